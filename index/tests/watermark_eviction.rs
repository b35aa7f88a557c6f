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
