//! Core behaviour of `Log`: append, reads, reopen, roll, truncate, reset,
//! checkpoint and install.

mod common;

use common::{TestResult, append_records, fill, record, small_config};
use logdex_log::{Compression, Error, Log, LogConfig, Record, encode_batch};

/// Appends get dense offsets from 0 and every read API returns what was written.
#[test]
fn append_assigns_dense_offsets_and_reads_return_them() -> TestResult {
    let dir = tempfile::tempdir()?;
    let mut log = Log::open(dir.path(), LogConfig::default())?;
    assert_eq!((log.start_offset(), log.next_offset()), (0, 0));
    for (i, codec) in [Compression::None, Compression::Lz4, Compression::Zstd].into_iter().enumerate() {
        let base = append_records(&mut log, i as u64 * 10, 10, codec)?;
        assert_eq!(base, i as u64 * 10);
    }
    assert_eq!(log.next_offset(), 30);
    for offset in 0..30 {
        assert_eq!(log.read_record(offset)?, Some((offset, record(offset))));
    }
    assert_eq!(log.read_record(30)?, None);
    let records = log.read_records(5, 100, usize::MAX)?;
    let expected: Vec<_> = (5..30).map(|o| (o, record(o))).collect();
    assert_eq!(records, expected);
    assert_eq!(log.read_records(5, 3, usize::MAX)?.len(), 3);
    let scanned: Vec<_> = log.scan(0).collect::<Result<_, _>>()?;
    assert_eq!(scanned.len(), 30);
    assert_eq!(log.read_records(30, 10, 1000)?, Vec::new());
    Ok(())
}

/// `read_batches` returns whole batches starting at the batch containing the offset, at least one.
#[test]
fn read_batches_returns_whole_batches_and_at_least_one() -> TestResult {
    let dir = tempfile::tempdir()?;
    let mut log = Log::open(dir.path(), small_config())?;
    fill(&mut log, 600, 10)?;
    assert!(log.segments().len() > 2, "small segments roll");
    let one = log.read_batches(15, 1)?;
    let info = logdex_log::validate_batch(&one)?;
    assert_eq!((info.base_offset, info.last_offset), (10, 19));
    let many = log.read_batches(15, usize::MAX)?;
    let mut position = 0;
    let mut next = 10;
    while position < many.len() {
        let info = logdex_log::validate_batch(&many[position..position + batch_len(&many[position..])])?;
        assert_eq!(info.base_offset, next);
        next = info.last_offset + 1;
        position += info.size_bytes;
    }
    assert_eq!(next, 600);
    assert!(log.read_batches(600, 100)?.is_empty());
    Ok(())
}

/// A page of records stops before a batch that would take it over `max_bytes`, as Kafka's
/// fetch does; only a page's first batch may exceed the budget, so a large batch comes alone.
#[test]
fn read_records_stops_before_a_batch_that_would_exceed_max_bytes() -> TestResult {
    let dir = tempfile::tempdir()?;
    let mut log = Log::open(dir.path(), LogConfig::default())?;
    append_records(&mut log, 0, 3, Compression::None)?;
    append_records(&mut log, 3, 3, Compression::None)?;
    let big: Vec<Record> = (6..14).map(|i| Record { value: Some(vec![b'v'; 10_000]), ..record(i) }).collect();
    log.append(&mut encode_batch(&big, Compression::None)?, 0)?;
    let small = log.read_batches(0, usize::MAX)?;
    let two_small = batch_len(&small) + batch_len(&small[batch_len(&small)..]);

    let offsets = |records: Vec<(u64, Record)>| records.into_iter().map(|(o, _)| o).collect::<Vec<_>>();
    assert_eq!(offsets(log.read_records(0, 100, two_small)?), (0..6).collect::<Vec<_>>());
    assert_eq!(offsets(log.read_records(0, 100, two_small + 1_000)?), (0..6).collect::<Vec<_>>());
    assert_eq!(offsets(log.read_records(0, 100, two_small - 1)?), (0..3).collect::<Vec<_>>());
    assert_eq!(offsets(log.read_records(6, 100, 1)?), (6..14).collect::<Vec<_>>(), "the first batch comes whole");
    assert_eq!(offsets(log.read_records(4, 100, 1)?), (4..6).collect::<Vec<_>>());
    assert_eq!(log.read_records(0, 100, usize::MAX)?.len(), 14);
    Ok(())
}

fn batch_len(bytes: &[u8]) -> usize {
    let mut length = [0u8; 4];
    length.copy_from_slice(&bytes[8..12]);
    i32::from_be_bytes(length) as usize + 12
}

/// Reopening a log (clean close) keeps every record, segment and offset.
#[test]
fn reopen_keeps_every_record() -> TestResult {
    let dir = tempfile::tempdir()?;
    let segments = {
        let mut log = Log::open(dir.path(), small_config())?;
        fill(&mut log, 300, 7)?;
        log.sync()?;
        log.segments()
    };
    let log = Log::open(dir.path(), small_config())?;
    assert_eq!(log.segments(), segments);
    assert_eq!(log.next_offset(), 300);
    for offset in (0..300).step_by(13) {
        assert_eq!(log.read_record(offset)?, Some((offset, record(offset))));
    }
    Ok(())
}

/// Appends roll the active segment before it would exceed `segment_bytes`.
#[test]
fn append_rolls_when_segment_bytes_would_be_exceeded() -> TestResult {
    let dir = tempfile::tempdir()?;
    let config = small_config();
    let mut log = Log::open(dir.path(), config.clone())?;
    fill(&mut log, 500, 5)?;
    let segments = log.segments();
    assert!(segments.len() > 3);
    for (i, segment) in segments.iter().enumerate() {
        assert!(segment.size_bytes <= config.segment_bytes);
        assert_eq!(segment.sealed, i + 1 < segments.len());
        if let Some(next) = segments.get(i + 1) {
            assert_eq!(segment.next_offset, next.base_offset);
        }
    }
    Ok(())
}

/// With `segment_ms`, an append after the segment's first append is older than it rolls.
#[test]
fn append_rolls_when_segment_ms_elapsed() -> TestResult {
    let dir = tempfile::tempdir()?;
    let config = LogConfig { segment_ms: Some(1000), ..LogConfig::default() };
    let mut log = Log::open(dir.path(), config)?;
    let mut batch = encode_batch(&[record(0)], Compression::None)?;
    log.append(&mut batch, 10_000)?;
    log.append(&mut batch, 10_500)?;
    assert_eq!(log.segments().len(), 1);
    log.append(&mut batch, 11_000)?;
    assert_eq!(log.segments().len(), 2);
    assert_eq!(log.segments()[1].base_offset, 2);
    Ok(())
}

/// `truncate` removes every record at and after the offset, across segments, and survives reopen.
#[test]
fn truncate_removes_records_at_and_after_offset() -> TestResult {
    let dir = tempfile::tempdir()?;
    let mut log = Log::open(dir.path(), small_config())?;
    fill(&mut log, 400, 10)?;
    log.truncate(120)?;
    assert_eq!(log.next_offset(), 120);
    assert_eq!(log.read_record(119)?, Some((119, record(119))));
    assert_eq!(log.read_record(120)?, None);
    append_records(&mut log, 1000, 5, Compression::Lz4)?;
    assert_eq!(log.read_record(120)?, Some((120, record(1000))));
    drop(log);
    let log = Log::open(dir.path(), small_config())?;
    assert_eq!(log.next_offset(), 125);
    assert_eq!(log.read_record(124)?, Some((124, record(1004))));
    Ok(())
}

/// Truncating inside a batch is refused with `NotBatchBoundary` and changes nothing.
#[test]
fn truncate_inside_a_batch_is_refused() -> TestResult {
    let dir = tempfile::tempdir()?;
    let mut log = Log::open(dir.path(), LogConfig::default())?;
    fill(&mut log, 30, 10)?;
    let err = log.truncate(15);
    assert!(
        matches!(err, Err(Error::NotBatchBoundary { batch_base_offset: 10, batch_last_offset: 19, .. })),
        "{err:?}"
    );
    assert_eq!(log.next_offset(), 30);
    assert!(matches!(log.truncate(31), Err(Error::OffsetOutOfRange { .. })));
    log.truncate(0)?;
    assert_eq!((log.start_offset(), log.next_offset()), (0, 0));
    append_records(&mut log, 0, 1, Compression::None)?;
    Ok(())
}

/// `reset` leaves an empty log whose next offset is the given start offset.
#[test]
fn reset_leaves_an_empty_log_at_the_start_offset() -> TestResult {
    let dir = tempfile::tempdir()?;
    let mut log = Log::open(dir.path(), small_config())?;
    fill(&mut log, 100, 10)?;
    log.reset(5000)?;
    assert_eq!((log.start_offset(), log.next_offset()), (5000, 5000));
    assert_eq!(log.read_record(50)?, None);
    assert_eq!(append_records(&mut log, 0, 3, Compression::None)?, 5000);
    drop(log);
    let log = Log::open(dir.path(), small_config())?;
    assert_eq!((log.start_offset(), log.next_offset()), (5000, 5003));
    Ok(())
}

/// `open_at` starts an empty log at the offset, and ignores it for a log with records.
#[test]
fn open_at_starts_an_empty_log_at_the_offset() -> TestResult {
    let dir = tempfile::tempdir()?;
    {
        let log = Log::open_at(dir.path(), LogConfig::default(), 777)?;
        assert_eq!((log.start_offset(), log.next_offset()), (777, 777));
    }
    let mut log = Log::open_at(dir.path(), LogConfig::default(), 900)?;
    assert_eq!(log.next_offset(), 900);
    append_records(&mut log, 0, 2, Compression::None)?;
    drop(log);
    let log = Log::open_at(dir.path(), LogConfig::default(), 5)?;
    assert_eq!((log.start_offset(), log.next_offset()), (900, 902));
    Ok(())
}

/// Reads below the start offset are `OffsetOutOfRange`; `read_record` answers `None`.
#[test]
fn reads_below_the_start_offset_are_out_of_range() -> TestResult {
    let dir = tempfile::tempdir()?;
    let mut log = Log::open_at(dir.path(), LogConfig::default(), 100)?;
    append_records(&mut log, 0, 3, Compression::None)?;
    assert!(matches!(log.read_batches(99, 100), Err(Error::OffsetOutOfRange { offset: 99, start_offset: 100, .. })));
    assert!(matches!(log.read_records(0, 1, 100), Err(Error::OffsetOutOfRange { .. })));
    assert_eq!(log.read_record(99)?, None);
    assert_eq!(log.scan(0).count(), 3);
    Ok(())
}

/// Invalid batches are refused before anything is written.
#[test]
fn append_refuses_invalid_batches() -> TestResult {
    let dir = tempfile::tempdir()?;
    let config = LogConfig { batch_bytes_max: 1024, ..LogConfig::default() };
    let mut log = Log::open(dir.path(), config)?;
    let mut batch = encode_batch(&[record(1), record(2)], Compression::None)?;
    let last = batch.len() - 1;
    batch[last] ^= 1;
    assert!(matches!(log.append(&mut batch, 0), Err(Error::CrcMismatch { .. })));
    let big: Vec<_> = (0..200).map(record).collect();
    let mut batch = encode_batch(&big, Compression::None)?;
    assert!(matches!(log.append(&mut batch, 0), Err(Error::BatchTooLarge { .. })));
    assert!(matches!(log.append(&mut [0u8; 10], 0), Err(Error::MalformedBatch { .. })));
    assert_eq!(log.next_offset(), 0);
    assert_eq!(log.size_bytes(), 0);
    Ok(())
}

/// A checkpoint's files keep their content whatever the log does afterwards.
#[test]
fn checkpoint_is_unchanged_by_later_appends() -> TestResult {
    let dir = tempfile::tempdir()?;
    let snapshot = tempfile::tempdir()?;
    let dst = snapshot.path().join("cp");
    let mut log = Log::open(dir.path(), small_config())?;
    fill(&mut log, 150, 10)?;
    let paths = log.checkpoint(&dst)?;
    let before: Vec<(std::path::PathBuf, Vec<u8>)> =
        paths.iter().map(|p| Ok((p.clone(), std::fs::read(p)?))).collect::<std::io::Result<_>>()?;
    fill(&mut log, 50, 10)?;
    log.truncate(60)?;
    fill(&mut log, 30, 3)?;
    log.compact(&mut |_, _| false, i64::MAX)?;
    log.apply_retention(u64::MAX)?;
    for (path, bytes) in &before {
        assert_eq!(&std::fs::read(path)?, bytes, "{} changed", path.display());
    }
    Ok(())
}

/// `install` replaces a log by checkpoint files; the result reads like the source.
#[test]
fn install_replaces_the_log_with_checkpoint_files() -> TestResult {
    let source = tempfile::tempdir()?;
    let target = tempfile::tempdir()?;
    let transfer = tempfile::tempdir()?;
    let mut log = Log::open(source.path(), small_config())?;
    fill(&mut log, 250, 10)?;
    log.checkpoint(transfer.path())?;
    let target_dir = target.path().join("log");
    let mut other = Log::open(&target_dir, small_config())?;
    fill(&mut other, 10, 1)?;
    drop(other);
    let installed = Log::install(&target_dir, transfer.path(), small_config())?;
    assert_eq!(installed.next_offset(), 250);
    assert_eq!(installed.start_offset(), 0);
    let all: Vec<_> = installed.scan(0).collect::<Result<_, _>>()?;
    assert_eq!(all, (0..250).map(|o| (o, record(o))).collect::<Vec<_>>());
    assert!(!target.path().join("log.install-staging").exists());
    assert!(!target.path().join("log.install-old").exists());
    Ok(())
}

/// Lookups reuse a read buffer per thread: reads alternating between a log of large
/// records (large windows) and one of small records (short windows, at segment ends)
/// each return exactly their own record, never bytes left from the previous read.
#[test]
fn read_record_alternating_large_and_small_windows_returns_each_own_record() -> TestResult {
    let (large_dir, small_dir) = (tempfile::tempdir()?, tempfile::tempdir()?);
    let mut large = Log::open(large_dir.path(), LogConfig::default())?;
    let mut small = Log::open(small_dir.path(), small_config())?;
    let big = |i: u64| Record {
        timestamp_ms: i as i64,
        key: Some(format!("big-{i}").into_bytes()),
        value: Some(vec![b'a' + (i % 26) as u8; 20_000 + i as usize]),
        headers: Vec::new(),
    };
    for i in 0..8 {
        large.append(&mut encode_batch(&[big(i)], Compression::None)?, 0)?;
    }
    fill(&mut small, 200, 3)?;
    for round in 0..3u64 {
        for i in 0..8 {
            assert_eq!(large.read_record(i)?, Some((i, big(i))));
            let offset = (i * 25 + round * 7) % 200;
            assert_eq!(small.read_record(offset)?, Some((offset, record(offset))));
            assert_eq!(small.read_record(199)?, Some((199, record(199))));
        }
    }
    Ok(())
}
