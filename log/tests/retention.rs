//! Retention by time and by size.

mod common;

use common::{TestResult, small_config};
use logdex_log::{Compression, Log, LogConfig, Record, encode_batch};

fn at(timestamp_ms: i64) -> Record {
    Record { timestamp_ms, key: Some(b"k".to_vec()), value: Some(vec![7; 100]), headers: Vec::new() }
}

/// Builds segments whose records carry timestamps 1000, 2000, ... (one segment each) plus an active one.
fn timed_segments(config: LogConfig, count: i64) -> Result<(tempfile::TempDir, Log), Box<dyn std::error::Error>> {
    let dir = tempfile::tempdir()?;
    let mut log = Log::open(dir.path(), config)?;
    for i in 1..=count {
        let mut batch = encode_batch(&[at(i * 1000), at(i * 1000)], Compression::None)?;
        log.append(&mut batch, 0)?;
        log.roll()?;
    }
    let mut batch = encode_batch(&[at(0)], Compression::None)?;
    log.append(&mut batch, 0)?;
    Ok((dir, log))
}

/// Sealed segments whose max timestamp is older than `retention_ms` go, oldest first; the start offset moves.
#[test]
fn retention_by_time_deletes_old_sealed_segments() -> TestResult {
    let config = LogConfig { retention_ms: Some(2500), ..small_config() };
    let (_dir, mut log) = timed_segments(config, 5)?;
    assert_eq!(log.apply_retention(5000)?, 4);
    assert_eq!(log.segments().len(), 4);
    assert_eq!(log.read_record(3)?, None);
    assert_eq!(log.read_record(4)?.map(|(o, _)| o), Some(4));
    assert!(matches!(log.read_records(0, 1, 10), Err(logdex_log::Error::OffsetOutOfRange { .. })));
    assert_eq!(log.apply_retention(5000)?, 4);
    Ok(())
}

/// The oldest sealed segments go while the log without them stays at least `retention_bytes` (Kafka's rule).
#[test]
fn retention_by_size_keeps_the_log_above_the_limit() -> TestResult {
    let (_dir, log) = timed_segments(small_config(), 5)?;
    let sizes: Vec<u64> = log.segments().iter().map(|s| s.size_bytes).collect();
    let total: u64 = sizes.iter().sum();
    let limit = total - sizes[0] - sizes[1] - 1;
    let config = LogConfig { retention_bytes: Some(limit), ..small_config() };
    let dir = log.dir().to_path_buf();
    drop(log);
    let mut log = Log::open(&dir, config)?;
    assert_eq!(log.apply_retention(0)?, 4);
    assert!(log.size_bytes() >= limit);
    Ok(())
}

/// `retention_cut` names the start `apply_retention` would leave without deleting anything;
/// `delete_before` removes only segments that end at or before the offset it is given (a
/// segment straddling it stays), as a replica with other segment boundaries applies the
/// leader's cut.
#[test]
fn retention_cut_deletes_nothing_and_delete_before_keeps_a_straddling_segment() -> TestResult {
    let config = LogConfig { retention_ms: Some(2500), ..small_config() };
    let (_dir, mut log) = timed_segments(config, 5)?;
    assert_eq!(log.retention_cut(5000), 4);
    assert_eq!(log.start_offset(), 0, "computing the cut deletes nothing");
    assert_eq!(log.delete_before(3)?, 2, "segment 2..4 straddles offset 3 and stays");
    assert_eq!(log.read_record(2)?.map(|(o, _)| o), Some(2));
    assert_eq!(log.delete_before(4)?, 4);
    assert_eq!(log.delete_before(10)?, 10, "the active segment 10..11 straddles offset 10 and stays");
    assert_eq!(log.read_record(10)?.map(|(o, _)| o), Some(10));
    assert_eq!(log.delete_before(11)?, 11, "an active segment that ends at the offset goes");
    assert_eq!(log.next_offset(), 11);
    Ok(())
}

/// As in Kafka, an active segment whose records are all past retention goes too (rolled
/// first): the log is left empty at its next offset, and appends and a reopen continue there.
#[test]
fn retention_removes_an_active_segment_past_retention_and_leaves_an_empty_log() -> TestResult {
    let config = LogConfig { retention_ms: Some(1), ..small_config() };
    let (dir, mut log) = timed_segments(config.clone(), 3)?;
    assert_eq!(log.retention_cut(u64::MAX), 7);
    assert_eq!(log.apply_retention(u64::MAX)?, 7);
    assert_eq!(log.segments().len(), 1);
    assert_eq!((log.start_offset(), log.next_offset()), (7, 7));
    assert_eq!(log.read_record(6)?, None);
    assert_eq!(log.apply_retention(u64::MAX)?, 7, "an empty log has nothing past retention");
    let mut batch = encode_batch(&[at(9000)], Compression::None)?;
    assert_eq!(log.append(&mut batch, 0)?.base_offset, 7);
    drop(log);
    let log = Log::open(dir.path(), config)?;
    assert_eq!((log.start_offset(), log.next_offset()), (7, 8));
    assert_eq!(log.read_record(7)?.map(|(o, _)| o), Some(7));
    Ok(())
}

/// An active segment with a record newer than `retention_ms` stays, with every record.
#[test]
fn retention_keeps_an_active_segment_with_a_recent_record() -> TestResult {
    let config = LogConfig { retention_ms: Some(2500), ..small_config() };
    let (_dir, mut log) = timed_segments(config, 3)?;
    let mut batch = encode_batch(&[at(4000)], Compression::None)?;
    log.append(&mut batch, 0)?;
    assert_eq!(log.apply_retention(6000)?, 6, "the sealed segments go, the active one stays");
    assert_eq!(log.read_record(6)?.map(|(o, _)| o), Some(6));
    Ok(())
}

/// Local retention of copied segments: the oldest sealed segment goes and its file with it; the
/// active segment never does. Segment infos name each file and its newest timestamp.
#[test]
fn delete_oldest_sealed_removes_one_segment_file_and_never_the_active_one() -> TestResult {
    let (_dir, mut log) = timed_segments(small_config(), 2)?;
    let segments = log.segments();
    assert_eq!(segments[0].max_timestamp_ms, 1000);
    assert_eq!(segments[1].max_timestamp_ms, 2000);
    let first = segments[0].path.clone();
    assert!(first.exists());
    assert_eq!(log.delete_oldest_sealed()?, Some(2));
    assert!(!first.exists(), "the file of the deleted segment is gone");
    assert_eq!(log.start_offset(), 2);
    assert_eq!(log.delete_oldest_sealed()?, Some(4));
    assert_eq!(log.delete_oldest_sealed()?, None, "only the active segment is left");
    assert_eq!(log.read_record(4)?.map(|(o, _)| o), Some(4));
    Ok(())
}

/// A first segment that compaction emptied (kept, so the start offset does not move) has no
/// record to age: retention by time takes it only with the next segment past retention, so
/// compaction alone never moves the start of a `compact,delete` log.
#[test]
fn a_segment_compaction_emptied_goes_only_with_the_next_segment_past_retention() -> TestResult {
    let dir = tempfile::tempdir()?;
    let mut log = Log::open(dir.path(), LogConfig { retention_ms: Some(2500), ..small_config() })?;
    // Two sealed segments of `k` (times 1000 and 2000), then the latest `k` (time 5000).
    for time in [1000, 2000] {
        log.append(&mut encode_batch(&[at(time), at(time)], Compression::None)?, 0)?;
        log.roll()?;
    }
    log.append(&mut encode_batch(&[at(5000)], Compression::None)?, 0)?;
    let plan = log.compaction_plan(log.next_offset())?;
    log.finish_compaction(plan.rewrite(&mut |_, offset| offset == 4, 0))?;
    let segments = log.segments();
    assert_eq!((segments.len(), segments[0].size_bytes, log.start_offset()), (2, 0, 0), "{segments:?}");
    assert_eq!(log.retention_cut(4000), 0, "the emptied segment waits for the record after it");
    assert_eq!(log.retention_cut(8000), 5, "then both go");
    Ok(())
}
