//! Reads of a log whose sealed segments were damaged on disk after they were written (a bit
//! flip under a trusted seek table): every read returns the right records or
//! [`Error::Corrupt`], never a wrong record and never a silent gap; a checkpoint's files are
//! verified whole before an install.

mod common;

use std::path::{Path, PathBuf};

use common::{TestResult, copy_dir, fill, record, small_config};
use logdex_log::{Error, Log, LogConfig, Offset};

const RECORDS: u64 = 100;
const PER_BATCH: u64 = 5;

/// Segment files of `dir` with the positions of their batches (from the length fields).
fn sealed_batches(dir: &Path) -> std::io::Result<Vec<(PathBuf, usize)>> {
    let mut segments: Vec<PathBuf> =
        common::file_names(dir)?.into_iter().filter(|n| n.ends_with(".log")).map(|n| dir.join(n)).collect();
    segments.pop(); // the active segment: damage there is a torn tail, cut on open
    let mut out = Vec::new();
    for path in segments {
        let bytes = std::fs::read(&path)?;
        let mut position = 0;
        while position + 12 <= bytes.len() {
            out.push((path.clone(), position));
            let length = i32::from_be_bytes([
                bytes[position + 8],
                bytes[position + 9],
                bytes[position + 10],
                bytes[position + 11],
            ]);
            position += length as usize + 12;
        }
    }
    Ok(out)
}

fn flip(path: &Path, at: usize, mask: u8) -> std::io::Result<()> {
    let mut bytes = std::fs::read(path)?;
    bytes[at] ^= mask;
    std::fs::write(path, &bytes)
}

/// Every read of every offset answers the right records or `Corrupt`: `read_record` the
/// record itself, `read_records` a run of right records from the offset asked (possibly
/// shorter than asked, when it stops before the damage, but never empty below the end).
fn assert_never_wrong(log: &Log, what: &str) -> TestResult {
    for offset in 0..RECORDS {
        match log.read_record(offset) {
            Ok(Some(found)) if found == (offset, record(offset)) => {}
            Err(Error::Corrupt { .. }) => {}
            other => return Err(format!("{what}: read_record({offset}) answered {other:?}").into()),
        }
        match log.read_records(offset, 1000, usize::MAX) {
            Ok(records) if !records.is_empty() => {
                let expected: Vec<(Offset, _)> =
                    (offset..offset + records.len() as u64).map(|o| (o, record(o))).collect();
                if records != expected {
                    return Err(format!("{what}: read_records({offset}) answered wrong records").into());
                }
            }
            Err(Error::Corrupt { .. }) => {}
            other => return Err(format!("{what}: read_records({offset}) answered {other:?}").into()),
        }
    }
    Ok(())
}

/// Damages one batch of a copy of `original` with `damage` and checks every read.
fn check_each_batch(
    original: &Path,
    config: &LogConfig,
    damage: impl Fn(&Path, usize) -> std::io::Result<String>,
) -> TestResult {
    let batches = sealed_batches(original)?;
    assert!(batches.len() >= 10, "the test needs several sealed batches");
    for (path, position) in batches {
        let copy = tempfile::tempdir()?;
        copy_dir(original, copy.path())?;
        let damaged = copy.path().join(path.file_name().ok_or("no file name")?);
        let what = damage(&damaged, position)?;
        let log = match Log::open(copy.path(), config.clone()) {
            Ok(log) => log,
            // The seek table no longer matched, the segment was scanned: refused at open.
            Err(Error::Corrupt { .. }) => continue,
            Err(e) => return Err(format!("{what}: open failed with {e}").into()),
        };
        assert_never_wrong(&log, &what)?;
    }
    Ok(())
}

fn dense_log(config: &LogConfig) -> Result<tempfile::TempDir, Box<dyn std::error::Error>> {
    let dir = tempfile::tempdir()?;
    let mut log = Log::open(dir.path(), config.clone())?;
    fill(&mut log, RECORDS, PER_BATCH)?;
    log.sync()?;
    Ok(dir)
}

fn configs() -> [LogConfig; 2] {
    // A seek entry for every batch, and one per segment only (headers walked).
    [
        LogConfig { segment_bytes: 1024, seek_interval_bytes: 0, ..LogConfig::default() },
        LogConfig { segment_bytes: 1024, seek_interval_bytes: 1 << 20, ..LogConfig::default() },
    ]
}

/// A flipped bit inside any record of any sealed batch (covered by the crc): reads of that
/// batch fail with `Corrupt`, every other read is right, and a read from before it stops at it.
#[test]
fn reads_never_return_a_wrong_record_after_a_record_byte_flip() -> TestResult {
    for config in configs() {
        let original = dense_log(&config)?;
        check_each_batch(original.path(), &config, |path, position| {
            flip(path, position + 61 + 7, 0x04)?;
            Ok(format!("record byte of the batch at {position} of {}", path.display()))
        })?;
    }
    Ok(())
}

/// A flipped bit in a batch's base offset (bytes 0..8, which Kafka's crc does not cover) is
/// caught by the offset checks of reads (seek entry, previous batch, next batch, segment end).
#[test]
fn reads_never_return_a_wrong_record_after_a_base_offset_flip() -> TestResult {
    for config in configs() {
        let original = dense_log(&config)?;
        for bit in [0u32, 1, 3, 9, 40, 62] {
            check_each_batch(original.path(), &config, |path, position| {
                flip(path, position + 7 - (bit / 8) as usize, 1 << (bit % 8))?;
                Ok(format!("base offset bit {bit} of the batch at {position} of {}", path.display()))
            })?;
        }
    }
    Ok(())
}

/// A fetch from before a damaged batch answers the records up to it; from inside it, `Corrupt`
/// naming the file and the batch position; after it, the right records again.
#[test]
fn fetch_stops_before_a_damaged_batch_and_fails_at_it() -> TestResult {
    let dir = tempfile::tempdir()?;
    let mut log = Log::open(dir.path(), small_config())?;
    fill(&mut log, 400, 10)?;
    drop(log);
    let (path, position) = sealed_batches(dir.path())?[3].clone();
    flip(&path, position + 80, 0x01)?;
    let log = Log::open(dir.path(), small_config())?;
    assert_eq!(log.read_records(0, 1000, usize::MAX)?, (0..30).map(|o| (o, record(o))).collect::<Vec<_>>());
    for offset in 30..40 {
        match log.read_records(offset, 1000, usize::MAX) {
            Err(Error::Corrupt { path: p, position: at, .. }) if p == path && at == position as u64 => {}
            other => return Err(format!("read_records({offset}): expected Corrupt, got {other:?}").into()),
        }
    }
    assert_eq!(log.read_records(40, 5, usize::MAX)?, (40..45).map(|o| (o, record(o))).collect::<Vec<_>>());
    Ok(())
}

/// `verify_files` reads a checkpoint whole, ignoring seek tables: it returns the next offset of
/// intact files and `Corrupt` with file and position for a damaged batch that a trusted seek
/// table would hide until read.
#[test]
fn verify_files_finds_damage_hidden_by_a_trusted_seek_table() -> TestResult {
    let dir = tempfile::tempdir()?;
    let mut log = Log::open(&dir.path().join("log"), small_config())?;
    fill(&mut log, 400, 10)?;
    let checkpoint = dir.path().join("checkpoint");
    log.checkpoint(&checkpoint)?;
    drop(log);
    assert_eq!(Log::verify_files(&checkpoint)?, 400);
    let copy = dir.path().join("copy");
    copy_dir(&checkpoint, &copy)?;
    let (path, position) = sealed_batches(&copy)?[5].clone();
    flip(&path, position + 70, 0x20)?;
    match Log::verify_files(&copy) {
        Err(Error::Corrupt { path: p, position: at, .. }) if p == path && at == position as u64 => {}
        other => return Err(format!("expected Corrupt at {position} of {}, got {other:?}", path.display()).into()),
    }
    // The seek table still trusts the segment: only a read of the batch would find it.
    let installed = Log::install(&dir.path().join("installed"), &copy, small_config())?;
    assert_eq!(installed.next_offset(), 400);
    Ok(())
}
