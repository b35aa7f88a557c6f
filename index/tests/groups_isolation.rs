//! Groups never see each other's entries, also across drop and id reuse.

mod common;

use common::{TestResult, marker, open, put};
use logdex_index::{Lookup, Update};

/// The same key in two groups has independent values.
#[test]
fn groups_never_see_each_others_keys() -> TestResult {
    let dir = tempfile::tempdir()?;
    let index = open(dir.path())?;
    index.apply(1, &[put(b"k", 10), put(b"only-1", 11)], &marker(12))?;
    index.apply(2, &[put(b"k", 20)], &marker(21))?;
    assert_eq!(index.get(1, b"k")?, Lookup::Found(10));
    assert_eq!(index.get(2, b"k")?, Lookup::Found(20));
    assert_eq!(index.get(2, b"only-1")?, Lookup::NotFound);
    assert_eq!(index.get(3, b"k")?, Lookup::NotFound);
    Ok(())
}

/// After a drop the group is empty and has no marker; a group created later
/// with the same id starts empty, before and after reopen and compaction,
/// while the other group is untouched.
#[test]
fn dropped_group_id_reused_starts_empty() -> TestResult {
    let dir = tempfile::tempdir()?;
    {
        let index = open(dir.path())?;
        index.apply(1, &[put(b"a", 1), put(b"b", 2)], &marker(3))?;
        index.apply(2, &[put(b"a", 5)], &marker(6))?;
        index.set_watermark(1, 2)?;
        index.drop_group(1)?;
        assert_eq!(index.applied(1)?, None);
        assert_eq!(index.get(1, b"a")?, Lookup::NotFound);
        assert_eq!(index.watermark(1)?, 0);
        assert_eq!(index.key_count_estimate(1)?, 0);
        index.drop_group(1)?; // dropping twice is fine

        index.apply(1, &[put(b"c", 0)], &marker(1))?;
        assert_eq!(index.get(1, b"a")?, Lookup::NotFound);
        assert_eq!(index.get(1, b"b")?, Lookup::NotFound);
        assert_eq!(index.get(1, b"c")?, Lookup::Found(0));
        assert_eq!(index.applied(1)?, Some(marker(1)));
        assert_eq!(index.watermark(1)?, 0);
        assert_eq!(index.get(2, b"a")?, Lookup::Found(5));
    }
    let index = open(dir.path())?;
    assert_eq!(index.get(1, b"a")?, Lookup::NotFound);
    assert_eq!(index.get(1, b"c")?, Lookup::Found(0));
    index.compact()?;
    assert_eq!(index.get(1, b"a")?, Lookup::NotFound);
    assert_eq!(index.get(1, b"c")?, Lookup::Found(0));
    assert_eq!(index.get(2, b"a")?, Lookup::Found(5));
    index.drop_group(1)?;
    index.drop_group(2)?;
    drop(index);
    let index = open(dir.path())?;
    assert_eq!(index.applied(1)?, None);
    assert_eq!(index.applied(2)?, None);
    assert_eq!(index.get(2, b"a")?, Lookup::NotFound);
    Ok(())
}

/// Once a drop is fsynced, compaction physically removes the group's entries
/// (the data tables shrink to the other group's size) and leaves the other
/// group's entries alone.
#[test]
fn dropped_group_entries_are_removed_by_compaction() -> TestResult {
    let dir = tempfile::tempdir()?;
    let index = open(dir.path())?;
    let keys: Vec<Vec<u8>> = (0..20_000u64).map(|i| format!("k-{i:07}").into_bytes()).collect();
    let updates: Vec<Update<'_>> = keys.iter().zip(0u64..).map(|(k, o)| put(k, o)).collect();
    index.apply(1, &updates, &marker(20_000))?;
    index.apply(2, &updates[..100], &marker(100))?;
    index.compact()?;
    let before = index.stats()?.data_table_bytes;
    index.drop_group(1)?;
    index.compact()?;
    let after = index.stats()?.data_table_bytes;
    assert!(after * 20 < before, "before {before} after {after}");
    assert_eq!(index.get(2, b"k-0000099")?, Lookup::Found(99));
    assert_eq!(index.get(1, b"k-0000099")?, Lookup::NotFound);
    Ok(())
}
