//! Recovery on open: torn tails, corrupt sealed segments, seek tables,
//! leftovers of interrupted compactions and installs.

mod common;

use std::fs::OpenOptions;
use std::io::Write;
use std::path::{Path, PathBuf};

use common::{TestResult, file_names, fill, record, small_config};
use logdex_log::{Compression, Error, Log, encode_batch};

fn segment_files(dir: &Path) -> std::io::Result<Vec<PathBuf>> {
    Ok(file_names(dir)?.into_iter().filter(|n| n.ends_with(".log")).map(|n| dir.join(n)).collect())
}

/// Positions of the batches of a segment file, read from their length fields.
fn batch_positions(bytes: &[u8]) -> Vec<usize> {
    let mut positions = Vec::new();
    let mut position = 0;
    while position + 12 <= bytes.len() {
        positions.push(position);
        let mut length = [0u8; 4];
        length.copy_from_slice(&bytes[position + 8..position + 12]);
        position += i32::from_be_bytes(length) as usize + 12;
    }
    positions
}

/// A partial batch at the end of the active segment is cut off on open; appends continue there.
#[test]
fn recovery_truncates_torn_tail() -> TestResult {
    let dir = tempfile::tempdir()?;
    let mut log = Log::open(dir.path(), small_config())?;
    fill(&mut log, 100, 10)?;
    log.sync()?;
    let (next, size) = (log.next_offset(), log.size_bytes());
    drop(log);
    let active = segment_files(dir.path())?.pop().ok_or("no segment")?;
    let batch = encode_batch(&[record(1), record(2)], Compression::None)?;
    OpenOptions::new().append(true).open(&active)?.write_all(&batch[..batch.len() / 2])?;
    let mut log = Log::open(dir.path(), small_config())?;
    assert_eq!(log.next_offset(), next);
    assert_eq!(log.size_bytes(), size);
    assert_eq!(
        std::fs::metadata(&active)?.len() as usize,
        log.segments().last().ok_or("no segment")?.size_bytes as usize
    );
    common::append_records(&mut log, 500, 2, Compression::None)?;
    assert_eq!(log.read_record(next)?, Some((next, record(500))));
    Ok(())
}

/// Zeroes after the last batch (a file extended without its data, as after power loss) are cut off.
#[test]
fn recovery_truncates_zero_filled_tail() -> TestResult {
    let dir = tempfile::tempdir()?;
    let mut log = Log::open(dir.path(), small_config())?;
    fill(&mut log, 20, 10)?;
    drop(log);
    let active = segment_files(dir.path())?.pop().ok_or("no segment")?;
    OpenOptions::new().append(true).open(&active)?.write_all(&[0u8; 4096])?;
    let log = Log::open(dir.path(), small_config())?;
    assert_eq!(log.next_offset(), 20);
    assert_eq!(log.scan(0).count(), 20);
    Ok(())
}

/// A flipped byte in a sealed segment whose seek table is gone fails open with the file and the batch position.
#[test]
fn sealed_segment_corruption_is_reported_with_file_and_position() -> TestResult {
    let dir = tempfile::tempdir()?;
    let mut log = Log::open(dir.path(), small_config())?;
    fill(&mut log, 400, 10)?;
    drop(log);
    let sealed = segment_files(dir.path())?[1].clone();
    let mut bytes = std::fs::read(&sealed)?;
    let target = batch_positions(&bytes)[2];
    bytes[target + 70] ^= 0x40;
    std::fs::write(&sealed, &bytes)?;
    std::fs::remove_file(sealed.with_extension("seek"))?;
    match Log::open(dir.path(), small_config()) {
        Err(Error::Corrupt { path, position, source, .. }) => {
            assert_eq!(path, sealed);
            assert_eq!(position, target as u64);
            assert!(matches!(*source, Error::CrcMismatch { .. }), "{source:?}");
        }
        other => return Err(format!("expected Corrupt, got {:?}", other.map(|_| ())).into()),
    }
    Ok(())
}

/// With an intact seek table the damage surfaces on read, with file and position; it is never skipped.
#[test]
fn sealed_segment_corruption_is_reported_on_read() -> TestResult {
    let dir = tempfile::tempdir()?;
    let mut log = Log::open(dir.path(), small_config())?;
    fill(&mut log, 400, 10)?;
    drop(log);
    let sealed = segment_files(dir.path())?[0].clone();
    let mut bytes = std::fs::read(&sealed)?;
    let target = batch_positions(&bytes)[1];
    bytes[target + 70] ^= 0x40;
    std::fs::write(&sealed, &bytes)?;
    let log = Log::open(dir.path(), small_config())?;
    let expect_corrupt = |result: Result<(), Error>| match result {
        Err(Error::Corrupt { path, position, .. }) if path == sealed && position == target as u64 => Ok(()),
        other => Err(format!("expected Corrupt at {target}, got {other:?}")),
    };
    expect_corrupt(log.read_record(15).map(|_| ()))?;
    expect_corrupt(log.read_records(10, 100, usize::MAX).map(|_| ()))?;
    // A read that starts before the damage answers the records before it, and stops there.
    assert_eq!(log.read_records(0, 100, usize::MAX)?, (0..10).map(|o| (o, record(o))).collect::<Vec<_>>());
    expect_corrupt(log.read_batches(0, usize::MAX).map(|_| ()))?;
    expect_corrupt(log.scan(0).find_map(Result::err).map_or(Ok(()), Err))?;
    assert_eq!(log.read_record(5)?, Some((5, record(5))));
    Ok(())
}

/// A corrupt batch in the middle of the active segment is treated as a torn tail (Kafka's rule).
#[test]
fn active_segment_corruption_truncates_from_the_bad_batch() -> TestResult {
    let dir = tempfile::tempdir()?;
    let mut log = Log::open(dir.path(), logdex_log::LogConfig::default())?;
    fill(&mut log, 50, 10)?;
    drop(log);
    let active = segment_files(dir.path())?.pop().ok_or("no segment")?;
    let mut bytes = std::fs::read(&active)?;
    let target = batch_positions(&bytes)[3];
    bytes[target + 65] ^= 1;
    std::fs::write(&active, &bytes)?;
    let log = Log::open(dir.path(), logdex_log::LogConfig::default())?;
    assert_eq!(log.next_offset(), 30);
    Ok(())
}

/// Missing or damaged seek tables are rebuilt, byte for byte as before.
#[test]
fn missing_or_damaged_seek_tables_are_rebuilt() -> TestResult {
    let dir = tempfile::tempdir()?;
    let mut log = Log::open(dir.path(), small_config())?;
    fill(&mut log, 400, 10)?;
    drop(log);
    let seeks: Vec<PathBuf> =
        file_names(dir.path())?.into_iter().filter(|n| n.ends_with(".seek")).map(|n| dir.path().join(n)).collect();
    assert!(seeks.len() >= 2);
    let originals: Vec<Vec<u8>> = seeks.iter().map(std::fs::read).collect::<Result<_, _>>()?;
    std::fs::remove_file(&seeks[0])?;
    std::fs::write(&seeks[1], b"LXSK garbage")?;
    let log = Log::open(dir.path(), small_config())?;
    for (path, original) in seeks.iter().zip(&originals) {
        assert_eq!(&std::fs::read(path)?, original);
    }
    for offset in 0..400 {
        assert_eq!(log.read_record(offset)?, Some((offset, record(offset))));
    }
    Ok(())
}

/// Leftovers of an interrupted compaction or write, and orphan seek tables, are removed on open.
#[test]
fn leftovers_of_interrupted_writes_are_removed_on_open() -> TestResult {
    let dir = tempfile::tempdir()?;
    let mut log = Log::open(dir.path(), small_config())?;
    fill(&mut log, 100, 10)?;
    drop(log);
    let before = file_names(dir.path())?;
    std::fs::write(dir.path().join("00000000000000000000.log.cleaned"), b"partial")?;
    std::fs::write(dir.path().join("00000000000000000000.seek.tmp"), b"partial")?;
    std::fs::write(dir.path().join("00000000000000099999.seek"), b"orphan")?;
    let log = Log::open(dir.path(), small_config())?;
    assert_eq!(file_names(dir.path())?, before);
    assert_eq!(log.scan(0).count(), 100);
    Ok(())
}

/// An install interrupted between its two renames is finished by the next open.
#[test]
fn interrupted_install_is_finished_on_open() -> TestResult {
    let root = tempfile::tempdir()?;
    let dir = root.path().join("log");
    let mut log = Log::open(&dir, small_config())?;
    fill(&mut log, 30, 10)?;
    drop(log);
    let staging = root.path().join("log.install-staging");
    let mut new = Log::open(&staging, small_config())?;
    fill(&mut new, 70, 7)?;
    drop(new);
    std::fs::write(staging.join("INSTALL_COMPLETE"), b"")?;
    std::fs::rename(&dir, root.path().join("log.install-old"))?;
    let log = Log::open(&dir, small_config())?;
    assert_eq!(log.next_offset(), 70);
    assert_eq!(file_names(root.path())?, vec!["log".to_string()]);
    Ok(())
}

/// An install interrupted before its marker leaves the old log in place.
#[test]
fn install_interrupted_before_its_marker_keeps_the_old_log() -> TestResult {
    let root = tempfile::tempdir()?;
    let dir = root.path().join("log");
    let mut log = Log::open(&dir, small_config())?;
    fill(&mut log, 30, 10)?;
    drop(log);
    let staging = root.path().join("log.install-staging");
    std::fs::create_dir(&staging)?;
    std::fs::write(staging.join("00000000000000000000.log"), b"half copied")?;
    let log = Log::open(&dir, small_config())?;
    assert_eq!(log.next_offset(), 30);
    assert!(!staging.exists());
    Ok(())
}

/// A crash between sealing a segment and creating the next leaves the sealed one last: it becomes active again.
#[test]
fn crash_during_roll_reactivates_the_sealed_segment() -> TestResult {
    let dir = tempfile::tempdir()?;
    let mut log = Log::open(dir.path(), small_config())?;
    fill(&mut log, 30, 10)?;
    log.roll()?;
    drop(log);
    let files = segment_files(dir.path())?;
    assert_eq!(files.len(), 2);
    std::fs::remove_file(&files[1])?;
    let mut log = Log::open(dir.path(), small_config())?;
    assert_eq!(log.next_offset(), 30);
    assert!(!log.segments()[0].sealed);
    assert!(!files[0].with_extension("seek").exists());
    common::append_records(&mut log, 30, 5, Compression::Zstd)?;
    assert_eq!(log.read_record(34)?, Some((34, record(34))));
    Ok(())
}
