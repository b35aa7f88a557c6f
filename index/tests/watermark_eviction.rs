//! Cleanup watermark: monotonic, durable, `Evicted` lookups, removal by compaction.

mod common;

use common::{TestResult, marker, open, put};
use logdex_index::{Lookup, Update};

/// Lower values never lower the watermark, and it survives reopen.
#[test]
fn watermark_is_monotonic_and_survives_reopen() -> TestResult {
    let dir = tempfile::tempdir()?;
    {
        let index = open(dir.path())?;
        assert_eq!(index.watermark(1)?, 0);
        index.set_watermark(1, 10)?;
        index.set_watermark(1, 5)?;
        assert_eq!(index.watermark(1)?, 10);
        index.set_watermark(1, 12)?;
        assert_eq!(index.watermark(1)?, 12);
        assert_eq!(index.watermark(2)?, 0);
    }
    let index = open(dir.path())?;
    assert_eq!(index.watermark(1)?, 12);
    index.set_watermark(1, 3)?;
    assert_eq!(index.watermark(1)?, 12);
    Ok(())
}

/// Entries below the watermark answer `Evicted(offset)`, others `Found`; a
/// key rewritten above the watermark is `Found` again.
#[test]
fn lookups_below_the_watermark_are_evicted() -> TestResult {
    let dir = tempfile::tempdir()?;
    let index = open(dir.path())?;
    index.apply(1, &[put(b"a", 0), put(b"b", 5), put(b"c", 9)], &marker(10))?;
    index.set_watermark(1, 6)?;
    assert_eq!(index.get(1, b"a")?, Lookup::Evicted(0));
    assert_eq!(index.get(1, b"b")?, Lookup::Evicted(5));
    assert_eq!(index.get(1, b"c")?, Lookup::Found(9));
    index.apply(1, &[put(b"a", 10)], &marker(11))?;
    assert_eq!(index.get(1, b"a")?, Lookup::Found(10));
    Ok(())
}

/// Once the raise is fsynced, compaction removes entries below the watermark
/// (they answer `NotFound`) and keeps the others, in this group only.
#[test]
fn compaction_removes_entries_below_the_watermark() -> TestResult {
    let dir = tempfile::tempdir()?;
    let index = open(dir.path())?;
    let keys: Vec<Vec<u8>> = (0..100u64).map(|i| format!("k{i:03}").into_bytes()).collect();
    let updates: Vec<Update<'_>> = keys.iter().zip(0u64..).map(|(key, offset)| put(key, offset)).collect();
    index.apply(1, &updates, &marker(100))?;
    index.apply(2, &updates, &marker(100))?;
    index.set_watermark(1, 50)?;
    assert_eq!(index.get(1, b"k010")?, Lookup::Evicted(10));
    index.compact()?;
    assert_eq!(index.get(1, b"k010")?, Lookup::NotFound);
    assert_eq!(index.get(1, b"k049")?, Lookup::NotFound);
    assert_eq!(index.get(1, b"k050")?, Lookup::Found(50));
    assert_eq!(index.get(2, b"k010")?, Lookup::Found(10));
    assert_eq!(index.applied(1)?, Some(marker(100)));
    Ok(())
}

/// `scan_entries` yields the group's entries in an offset range, in key order, without those
/// below the watermark, deleted keys or other groups' entries, and after a rebuild the new
/// generation's.
#[test]
fn scan_entries_yields_the_live_entries_of_an_offset_range_at_or_above_the_watermark() -> TestResult {
    let dir = tempfile::tempdir()?;
    let index = open(dir.path())?;
    index.apply(1, &[put(b"d", 0), put(b"b", 1), put(b"a", 2), put(b"c", 3), put(b"e", 4)], &marker(5))?;
    index.apply(2, &[put(b"x", 1)], &marker(2))?;
    index.apply(1, &[common::delete(b"c")], &marker(6))?;
    index.set_watermark(1, 1)?;
    let scan = |from, to| -> Result<Vec<(Vec<u8>, u64)>, logdex_index::Error> {
        let mut seen = Vec::new();
        let count = index.scan_entries(1, from..to, |key, offset| {
            seen.push((key.to_vec(), offset));
            Ok::<(), logdex_index::Error>(())
        })?;
        assert_eq!(count as usize, seen.len());
        Ok(seen)
    };
    assert_eq!(scan(0, 4)?, [(b"a".to_vec(), 2), (b"b".to_vec(), 1)], "d is below the watermark, c deleted");
    assert_eq!(scan(2, 100)?, [(b"a".to_vec(), 2), (b"e".to_vec(), 4)]);
    assert_eq!(scan(5, 100)?, []);
    index.rebuild(1, [Ok::<_, std::io::Error>((b"z".to_vec(), 7, false))].into_iter(), &marker(8))??;
    assert_eq!(scan(0, 100)?, [(b"z".to_vec(), 7)], "the rebuilt generation only");
    Ok(())
}
