//! `rebuild` builds a fresh generation and switches to it with the marker.

mod common;

use common::{TestResult, marker, open, put};
use logdex_index::{Error, Index, IndexConfig, Lookup};

type Record = (Vec<u8>, u64, bool);

fn records(list: &[(&str, u64, bool)]) -> Vec<Result<Record, String>> {
    list.iter().map(|(key, offset, tombstone)| Ok((key.as_bytes().to_vec(), *offset, *tombstone))).collect()
}

/// A rebuild replaces everything of the group: keys only in the old
/// generation disappear, the last record of each key wins, tombstones remove
/// keys, and the marker switches with it.
#[test]
fn rebuild_replaces_the_group_atomically_with_the_marker() -> TestResult {
    let dir = tempfile::tempdir()?;
    let index = open(dir.path())?;
    index.apply(1, &[put(b"old", 0), put(b"a", 1)], &marker(2))?;
    index.apply(2, &[put(b"a", 7)], &marker(8))?;
    let log = records(&[("a", 0, false), ("b", 1, false), ("a", 2, false), ("b", 3, true), ("c", 4, false)]);
    let keys = index.rebuild(1, log.into_iter(), &marker(5))?;
    assert_eq!(keys, Ok(2));
    assert_eq!(index.get(1, b"old")?, Lookup::NotFound);
    assert_eq!(index.get(1, b"a")?, Lookup::Found(2));
    assert_eq!(index.get(1, b"b")?, Lookup::NotFound);
    assert_eq!(index.get(1, b"c")?, Lookup::Found(4));
    assert_eq!(index.applied(1)?, Some(marker(5)));
    assert_eq!(index.key_count_estimate(1)?, 2);
    assert_eq!(index.get(2, b"a")?, Lookup::Found(7));
    // Applies continue on the new generation, and it all survives compaction and reopen.
    index.apply(1, &[put(b"d", 5)], &marker(6))?;
    index.compact()?;
    drop(index);
    let index = open(dir.path())?;
    assert_eq!(index.get(1, b"old")?, Lookup::NotFound);
    assert_eq!(index.get(1, b"a")?, Lookup::Found(2));
    assert_eq!(index.get(1, b"d")?, Lookup::Found(5));
    assert_eq!(index.applied(1)?, Some(marker(6)));
    Ok(())
}

/// An error from the record iterator is passed through and leaves the old
/// generation and marker in place; so does a key that is too long.
#[test]
fn rebuild_failure_keeps_the_old_generation() -> TestResult {
    let dir = tempfile::tempdir()?;
    let index = open(dir.path())?;
    index.apply(1, &[put(b"a", 0)], &marker(1))?;
    let mut log = records(&[("x", 0, false)]);
    log.push(Err("log read failed".to_owned()));
    let outcome = index.rebuild(1, log.into_iter(), &marker(9))?;
    assert_eq!(outcome, Err("log read failed".to_owned()));
    assert_eq!(index.get(1, b"a")?, Lookup::Found(0));
    assert_eq!(index.get(1, b"x")?, Lookup::NotFound);
    assert_eq!(index.applied(1)?, Some(marker(1)));

    let long = vec![b'k'; 20_000];
    let log: Vec<Result<Record, String>> = vec![Ok((long, 0, false))];
    let outcome = index.rebuild(1, log.into_iter(), &marker(9));
    assert!(matches!(outcome, Err(Error::KeyTooLong { .. })));
    assert_eq!(index.applied(1)?, Some(marker(1)));

    // The abandoned generations are removed by compaction without harm.
    index.compact()?;
    assert_eq!(index.get(1, b"a")?, Lookup::Found(0));
    assert_eq!(index.get(1, b"x")?, Lookup::NotFound);
    Ok(())
}

/// A rebuild larger than one run (several ingestions) counts keys exactly and
/// applies tombstones and overwrites across runs.
#[test]
fn rebuild_across_several_runs_matches_the_log() -> TestResult {
    let dir = tempfile::tempdir()?;
    let config = IndexConfig { rebuild_chunk_bytes_max: 1024 * 1024, ..common::config() };
    let index = Index::open(dir.path(), config)?;
    // ~60 bytes per record charged: 1 MiB is ~17k records per run.
    let n = 50_000u64;
    let log = (0..n).map(|offset| {
        let key = format!("key-{:05}", offset % 20_000).into_bytes();
        // Keys below 10_000 occur three times; those divisible by 7 are
        // deleted by their third record (in the last run).
        let tombstone = offset >= 40_000 && (offset % 20_000) % 7 == 0;
        Ok::<_, String>((key, offset, tombstone))
    });
    let keys = index.rebuild(5, log, &marker(n))?;
    let deleted = (0..10_000u64).filter(|k| k % 7 == 0).count() as u64;
    assert_eq!(keys, Ok(20_000 - deleted));
    assert_eq!(index.get(5, b"key-00007")?, Lookup::NotFound);
    assert_eq!(index.get(5, b"key-00001")?, Lookup::Found(40_001));
    assert_eq!(index.get(5, b"key-19999")?, Lookup::Found(39_999));
    assert_eq!(index.key_count_estimate(5)?, 20_000 - deleted);
    Ok(())
}

/// Rebuilding a group with no records empties it (and creates it if new).
#[test]
fn rebuild_with_no_records_empties_the_group() -> TestResult {
    let dir = tempfile::tempdir()?;
    let index = open(dir.path())?;
    index.apply(1, &[put(b"a", 0)], &marker(1))?;
    let keys = index.rebuild(1, std::iter::empty::<Result<Record, String>>(), &marker(1))?;
    assert_eq!(keys, Ok(0));
    assert_eq!(index.get(1, b"a")?, Lookup::NotFound);
    let keys = index.rebuild(9, std::iter::empty::<Result<Record, String>>(), &marker(0))?;
    assert_eq!(keys, Ok(0));
    assert_eq!(index.applied(9)?, Some(marker(0)));
    Ok(())
}
