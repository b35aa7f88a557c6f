//! Compaction of sealed segments and reads across the gaps it leaves.

mod common;

use std::collections::HashMap;

use common::{TestResult, file_names, small_config};
use logdex_log::{Compression, Log, Offset, Record, decode_batch, encode_batch, validate_batch};

fn keyed(key: &str, value: Option<&str>, timestamp_ms: i64) -> Record {
    Record {
        timestamp_ms,
        key: Some(key.as_bytes().to_vec()),
        value: value.map(|v| v.as_bytes().to_vec()),
        headers: Vec::new(),
    }
}

fn unkeyed(value: &str) -> Record {
    Record { timestamp_ms: 0, key: None, value: Some(value.as_bytes().to_vec()), headers: Vec::new() }
}

fn append(log: &mut Log, records: &[Record], codec: Compression) -> logdex_log::Result<Offset> {
    let mut batch = encode_batch(records, codec)?;
    Ok(log.append(&mut batch, 0)?.base_offset)
}

/// Latest offset of every key, as a key index would hold it.
fn latest(log: &Log) -> logdex_log::Result<HashMap<Vec<u8>, Offset>> {
    let mut latest = HashMap::new();
    for item in log.scan(0) {
        let (offset, record) = item?;
        if let Some(key) = record.key {
            latest.insert(key, offset);
        }
    }
    Ok(latest)
}

/// Writes 40 batches of 5 updates over 10 keys, then rolls.
fn updates(log: &mut Log, codec: Compression) -> logdex_log::Result<()> {
    for batch in 0..40 {
        let records: Vec<Record> = (0..5)
            .map(|i| {
                let n = batch * 5 + i;
                keyed(&format!("k{}", n % 10), Some(&format!("v{n}")), n as i64)
            })
            .collect();
        append(log, &records, codec)?;
    }
    log.roll()
}

/// Only live keyed records stay; offsets are preserved; codecs are kept.
#[test]
fn compaction_keeps_only_live_records_and_preserves_offsets() -> TestResult {
    for codec in [Compression::None, Compression::Lz4, Compression::Zstd] {
        let dir = tempfile::tempdir()?;
        let mut log = Log::open(dir.path(), small_config())?;
        updates(&mut log, codec)?;
        let before: Vec<(Offset, Record)> = log.scan(0).collect::<Result<_, _>>()?;
        let index = latest(&log)?;
        let stats = log.compact(&mut |key, offset| index.get(key) == Some(&offset), 0)?;
        assert_eq!(stats.records_removed, 190);
        assert!(stats.bytes_after < stats.bytes_before);
        let after: Vec<(Offset, Record)> = log.scan(0).collect::<Result<_, _>>()?;
        let expected: Vec<(Offset, Record)> =
            before.into_iter().filter(|(o, r)| r.key.as_ref().and_then(|k| index.get(k)) == Some(o)).collect();
        assert_eq!(after, expected);
        assert_eq!(log.next_offset(), 200);
        let raw = log.read_batches(190, 1)?;
        assert_eq!(validate_batch(&raw)?.compression, codec);
        drop(log);
        let reopened = Log::open(dir.path(), small_config())?;
        let again: Vec<(Offset, Record)> = reopened.scan(0).collect::<Result<_, _>>()?;
        assert_eq!(again, expected);
    }
    Ok(())
}

/// A read at an offset removed by compaction starts at the next record; `read_record` answers `None`.
#[test]
fn read_in_compacted_gap_returns_next_record() -> TestResult {
    let dir = tempfile::tempdir()?;
    let mut log = Log::open(dir.path(), small_config())?;
    append(&mut log, &[keyed("a", Some("1"), 0), keyed("b", Some("1"), 0)], Compression::None)?;
    append(&mut log, &[keyed("a", Some("2"), 0), keyed("c", Some("1"), 0)], Compression::None)?;
    append(&mut log, &[keyed("a", Some("3"), 0), keyed("b", Some("2"), 0)], Compression::None)?;
    log.roll()?;
    let index = latest(&log)?;
    log.compact(&mut |key, offset| index.get(key) == Some(&offset), 0)?;
    // Left: 3 (c), 4 (a), 5 (b); batches [0..1] gone, [2..3] holds only 3.
    assert_eq!(log.read_record(0)?, None);
    assert_eq!(log.read_record(2)?, None);
    assert_eq!(log.read_record(3)?.map(|(o, _)| o), Some(3));
    let records = log.read_records(0, 10, usize::MAX)?;
    assert_eq!(records.iter().map(|(o, _)| *o).collect::<Vec<_>>(), vec![3, 4, 5]);
    let records = log.read_records(2, 1, usize::MAX)?;
    assert_eq!(records.iter().map(|(o, _)| *o).collect::<Vec<_>>(), vec![3]);
    let batches = log.read_batches(1, 1)?;
    let info = validate_batch(&batches)?;
    assert_eq!((info.base_offset, info.last_offset, info.record_count), (2, 3, 1));
    assert_eq!(decode_batch(&batches)?[0].0, 3);
    Ok(())
}

/// Tombstones stay while their timestamp is at or after the horizon; unkeyed records always stay.
#[test]
fn tombstones_are_kept_until_the_horizon_and_unkeyed_records_always() -> TestResult {
    let dir = tempfile::tempdir()?;
    let mut log = Log::open(dir.path(), small_config())?;
    append(
        &mut log,
        &[keyed("a", None, 100), keyed("b", None, 200), unkeyed("x"), keyed("c", Some("v"), 0)],
        Compression::Lz4,
    )?;
    log.roll()?;
    let mut never_live = |_: &[u8], _: Offset| false;
    log.compact(&mut never_live, 150)?;
    let left: Vec<Offset> = log.scan(0).map(|r| r.map(|(o, _)| o)).collect::<Result<_, _>>()?;
    assert_eq!(left, vec![1, 2]);
    log.compact(&mut never_live, 201)?;
    let left: Vec<Offset> = log.scan(0).map(|r| r.map(|(o, _)| o)).collect::<Result<_, _>>()?;
    assert_eq!(left, vec![2]);
    Ok(())
}

/// The active segment is never compacted, even when nothing in it is live.
#[test]
fn compaction_never_touches_the_active_segment() -> TestResult {
    let dir = tempfile::tempdir()?;
    let mut log = Log::open(dir.path(), small_config())?;
    append(&mut log, &[keyed("a", Some("1"), 0), keyed("a", Some("2"), 0)], Compression::None)?;
    let stats = log.compact(&mut |_, _| false, i64::MAX)?;
    assert_eq!(stats, logdex_log::CompactStats::default());
    assert_eq!(log.scan(0).count(), 2);
    Ok(())
}

/// A sealed segment left without records is deleted, except the first, kept empty so the start offset stays.
#[test]
fn emptied_segments_are_removed_but_the_first_is_kept() -> TestResult {
    let dir = tempfile::tempdir()?;
    let mut log = Log::open(dir.path(), small_config())?;
    for segment in 0..3 {
        append(&mut log, &[keyed(&format!("s{segment}"), Some("v"), 0)], Compression::None)?;
        log.roll()?;
    }
    append(&mut log, &[keyed("live", Some("v"), 0)], Compression::None)?;
    let stats = log.compact(&mut |_, _| false, 0)?;
    assert_eq!((stats.segments_rewritten, stats.records_removed), (3, 3));
    let segments = log.segments();
    assert_eq!(segments.len(), 2);
    assert_eq!((segments[0].base_offset, segments[0].size_bytes, segments[0].next_offset), (0, 0, 3));
    assert_eq!(log.start_offset(), 0);
    assert_eq!(log.read_records(0, 10, 100)?.len(), 1);
    assert_eq!(
        file_names(dir.path())?,
        vec!["00000000000000000000.log", "00000000000000000000.seek", "00000000000000000003.log"]
    );
    drop(log);
    let log = Log::open(dir.path(), small_config())?;
    assert_eq!((log.start_offset(), log.next_offset()), (0, 4));
    Ok(())
}

/// Truncating into a compacted gap keeps the requested next offset, also after reopen.
#[test]
fn truncate_into_a_compacted_gap_keeps_the_next_offset() -> TestResult {
    let dir = tempfile::tempdir()?;
    let mut log = Log::open(dir.path(), small_config())?;
    append(&mut log, &[keyed("a", Some("1"), 0)], Compression::None)?;
    append(&mut log, &[keyed("b", Some("1"), 0), keyed("b", Some("2"), 0)], Compression::None)?;
    append(&mut log, &[keyed("c", Some("1"), 0)], Compression::None)?;
    log.roll()?;
    append(&mut log, &[keyed("d", Some("1"), 0)], Compression::None)?;
    let mut live = |key: &[u8], _: Offset| key != b"b";
    log.compact(&mut live, 0)?;
    log.truncate(2)?;
    assert_eq!(log.next_offset(), 2);
    drop(log);
    let mut log = Log::open(dir.path(), small_config())?;
    assert_eq!(log.next_offset(), 2);
    assert_eq!(append(&mut log, &[keyed("e", Some("1"), 0)], Compression::None)?, 2);
    let left: Vec<Offset> = log.scan(0).map(|r| r.map(|(o, _)| o)).collect::<Result<_, _>>()?;
    assert_eq!(left, vec![0, 2]);
    Ok(())
}

/// Each key's newest offset, as [`latest`] finds it.
type KeyIndex = HashMap<Vec<u8>, Offset>;

/// A fresh directory holding a log of [`updates`] (sealed segments with dead records), and
/// the key index of that log.
fn updated_log() -> Result<(tempfile::TempDir, Log, KeyIndex), Box<dyn std::error::Error>> {
    let dir = tempfile::tempdir()?;
    let mut log = Log::open(dir.path(), small_config())?;
    updates(&mut log, Compression::None)?;
    let index = latest(&log)?;
    Ok((dir, log, index))
}

/// No compaction output (`.cleaned`, staged `.tmp` files) is left in `dir`.
fn assert_no_leftovers(dir: &std::path::Path) -> TestResult {
    let names = file_names(dir)?;
    assert!(!names.iter().any(|n| n.ends_with(".cleaned") || n.ends_with(".tmp")), "leftovers: {names:?}");
    Ok(())
}

/// Compaction split into plan, rewrite and install: writes between the plan and the install
/// (the log is not held while segments are rewritten) are kept, and the rewrite is installed.
#[test]
fn writes_between_plan_and_install_are_kept_and_the_rewrite_installed() -> TestResult {
    let (dir, mut log, index) = updated_log()?;
    let plan = log.compaction_plan(log.next_offset())?;
    // Newer values of every key and a roll, while the plan is out.
    for n in 0..10 {
        append(&mut log, &[keyed(&format!("k{n}"), Some(&format!("late{n}")), 1000)], Compression::None)?;
    }
    log.roll()?;
    let compacted = plan.rewrite(&mut |key, offset| index.get(key) == Some(&offset), 0);
    let stats = log.finish_compaction(compacted)?;
    assert_eq!(stats.records_removed, 190, "the planned segments were rewritten");
    let after: Vec<(Offset, Record)> = log.scan(0).collect::<Result<_, _>>()?;
    assert_eq!(after.len(), 20, "10 live records of the plan and the 10 written during it: {after:?}");
    assert_eq!(after.last().map(|(o, _)| *o), Some(209));
    assert_no_leftovers(dir.path())?;
    drop(log);
    let reopened = Log::open(dir.path(), small_config())?;
    assert_eq!(reopened.scan(0).collect::<Result<Vec<_>, _>>()?, after);
    Ok(())
}

/// A segment deleted by retention while its rewrite ran is not brought back by the install.
#[test]
fn a_segment_deleted_during_compaction_stays_deleted() -> TestResult {
    let (dir, mut log, index) = updated_log()?;
    let plan = log.compaction_plan(log.next_offset())?;
    let deleted = log.delete_oldest_sealed()?.ok_or("no sealed segment to delete")?;
    let start = log.start_offset();
    let compacted = plan.rewrite(&mut |key, offset| index.get(key) == Some(&offset), 0);
    log.finish_compaction(compacted)?;
    assert_eq!(log.start_offset(), start, "the deleted segment {deleted} came back");
    let first = log.scan(0).next().transpose()?.map(|(o, _)| o);
    assert!(first.is_none_or(|o| o >= start), "a record below the log start {start} is readable: {first:?}");
    assert_no_leftovers(dir.path())?;
    Ok(())
}

/// A plan taken from a log that was reopened since (a restart, a snapshot install) installs
/// nothing into the new one and leaves no output behind.
#[test]
fn a_plan_of_a_reopened_log_installs_nothing() -> TestResult {
    let (dir, log, index) = updated_log()?;
    let before: Vec<(Offset, Record)> = log.scan(0).collect::<Result<_, _>>()?;
    let plan = log.compaction_plan(log.next_offset())?;
    drop(log);
    let mut reopened = Log::open(dir.path(), small_config())?;
    let compacted = plan.rewrite(&mut |key, offset| index.get(key) == Some(&offset), 0);
    let stats = reopened.finish_compaction(compacted)?;
    assert_eq!(stats.segments_rewritten, 0);
    assert_eq!(reopened.scan(0).collect::<Result<Vec<_>, _>>()?, before);
    assert_no_leftovers(dir.path())?;
    Ok(())
}

/// A plan takes only the segments whose records are all below the offset it is given (the
/// offset a key index covers): the others are not read, so no record is judged by an index
/// that does not have its key yet.
#[test]
fn a_plan_leaves_segments_reaching_its_bound_alone() -> TestResult {
    let dir = tempfile::tempdir()?;
    let mut log = Log::open(dir.path(), small_config())?;
    updates(&mut log, Compression::None)?;
    let segments = log.segments();
    let sealed: Vec<_> = segments.iter().filter(|s| s.sealed).collect();
    assert!(sealed.len() >= 2, "the test needs two sealed segments: {segments:?}");
    let bound = sealed[0].next_offset;
    let plan = log.compaction_plan(bound)?;
    // Every record is dead by this predicate: only the segments below the bound may lose any.
    let compacted = plan.rewrite(&mut |_, _| false, i64::MAX);
    log.finish_compaction(compacted)?;
    let left: Vec<Offset> = log.scan(0).map(|r| r.map(|(o, _)| o)).collect::<Result<_, _>>()?;
    assert!(left.iter().all(|o| *o >= bound), "records below {bound} survived: {left:?}");
    let expected: Vec<Offset> = (bound..sealed[1].next_offset).collect();
    assert_eq!(left, expected, "records at or above {bound} were compacted");
    Ok(())
}

/// A compaction installed one segment at a time, with appends between the installs, ends
/// as one installed whole.
#[test]
fn a_compaction_installed_segment_by_segment_with_appends_between() -> TestResult {
    let (_dir, mut log, index) = updated_log()?;
    let plan = log.compaction_plan(log.next_offset())?;
    let parts = plan.rewrite(&mut |key, offset| index.get(key) == Some(&offset), 0).into_parts();
    let count = parts.len();
    assert!(count >= 2, "the test needs several sealed segments: {count}");
    let mut stats = logdex_log::CompactStats::default();
    for (n, part) in parts.into_iter().enumerate() {
        stats += log.finish_compaction(part)?;
        append(&mut log, &[unkeyed(&format!("between-{n}"))], Compression::None)?;
    }
    assert_eq!(stats.records_removed, 190);
    let after: Vec<(Offset, Record)> = log.scan(0).collect::<Result<_, _>>()?;
    let keyed_left = after.iter().filter(|(_, r)| r.key.is_some()).count();
    let between = after.iter().filter(|(_, r)| r.key.is_none()).count();
    assert_eq!((keyed_left, between), (10, count), "records after the installs: {after:?}");
    Ok(())
}

/// The two renames of an install, cut by a crash: with only the seek file renamed the old
/// segment comes back with its seek table rebuilt; with only the segment renamed the new one
/// does. Either way every record reads back, and the leftovers are removed on open.
#[test]
fn an_install_cut_between_its_renames_reopens_whole() -> TestResult {
    for seek_only in [true, false] {
        let (dir, log, index) = updated_log()?;
        let before: Vec<(Offset, Record)> = log.scan(0).collect::<Result<_, _>>()?;
        let plan = log.compaction_plan(log.next_offset())?;
        let compacted = plan.rewrite(&mut |key, offset| index.get(key) == Some(&offset), 0);
        drop(log);
        // The crash: the first segment's staged files, one of them renamed into place.
        let base = format!("{:020}", 0);
        let (from, to) = if seek_only {
            (format!("{base}.seek.cleaned.tmp"), format!("{base}.seek"))
        } else {
            (format!("{base}.log.cleaned"), format!("{base}.log"))
        };
        std::fs::rename(dir.path().join(from), dir.path().join(to))?;
        drop(compacted);
        let reopened = Log::open(dir.path(), small_config())?;
        let after: Vec<(Offset, Record)> = reopened.scan(0).collect::<Result<_, _>>()?;
        let live_ones: Vec<(Offset, Record)> =
            before.iter().filter(|(o, r)| r.key.as_ref().and_then(|k| index.get(k)) == Some(o)).cloned().collect();
        if seek_only {
            assert_eq!(after, before, "the old segment with a new seek file");
        } else {
            assert!(live_ones.iter().all(|x| after.contains(x)), "a live record is missing after the cut install");
            assert!(after.len() < before.len(), "the renamed compaction output is not in use");
        }
        for (offset, record) in &after {
            assert_eq!(
                reopened.read_record(*offset)?.map(|(_, r)| r).as_ref(),
                Some(record),
                "read_record at {offset}"
            );
        }
        assert_no_leftovers(dir.path())?;
    }
    Ok(())
}

/// A truncation between the plan and the install (it may cut a sealed segment's file in
/// place, keeping its inode) makes the install drop the whole plan: the truncated records
/// do not come back, and what was appended after the truncation stays.
#[test]
fn a_plan_taken_before_a_truncation_installs_nothing() -> TestResult {
    let (dir, mut log, index) = updated_log()?;
    let plan = log.compaction_plan(log.next_offset())?;
    // Cut into the first sealed segment at a batch boundary, then write and roll again.
    log.truncate(50)?;
    append(&mut log, &[unkeyed("after the cut")], Compression::None)?;
    log.roll()?;
    let expected: Vec<(Offset, Record)> = log.scan(0).collect::<Result<_, _>>()?;
    let compacted = plan.rewrite(&mut |key, offset| index.get(key) == Some(&offset), 0);
    let stats = log.finish_compaction(compacted)?;
    assert_eq!(stats.segments_rewritten, 0);
    assert_eq!(log.scan(0).collect::<Result<Vec<_>, _>>()?, expected);
    assert_eq!(log.next_offset(), 51);
    assert_no_leftovers(dir.path())?;
    drop(log);
    let reopened = Log::open(dir.path(), small_config())?;
    assert_eq!(reopened.scan(0).collect::<Result<Vec<_>, _>>()?, expected);
    Ok(())
}
