//! The committed v1 fixtures (`tests/fixtures/v1/`, written once by
//! `examples/gen_fixtures.rs`) must load forever. The byte-level checks
//! follow `log/FORMAT.md`, not the crate's code. Every test works on a copy:
//! opening a log may repair it.

mod common;

#[allow(dead_code)]
#[path = "common/fixture_content.rs"]
mod fixture_content;

use std::path::{Path, PathBuf};

use common::{TestResult, copy_dir};
use fixture_content::{CORRUPT_BATCH, CORRUPT_BYTE_IN_BATCH, FIXTURE_SEEK_INTERVAL_BYTES, all_records, sealed_batches};
use logdex_log::{Error, Log, LogConfig, decode_batch};

const SEALED: &str = "00000000000000000000.log";
const SEALED_SEEK: &str = "00000000000000000000.seek";
const ACTIVE: &str = "00000000000000000007.log";

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/v1").join(name)
}

fn config() -> LogConfig {
    LogConfig { seek_interval_bytes: FIXTURE_SEEK_INTERVAL_BYTES, ..LogConfig::default() }
}

/// A working copy of a fixture directory.
fn copy_of(name: &str) -> Result<(tempfile::TempDir, PathBuf), Box<dyn std::error::Error>> {
    let root = tempfile::tempdir()?;
    let dir = root.path().join(name);
    copy_dir(&fixture(name), &dir)?;
    Ok((root, dir))
}

fn be_u32(bytes: &[u8], at: usize) -> u32 {
    u32::from_be_bytes([bytes[at], bytes[at + 1], bytes[at + 2], bytes[at + 3]])
}

fn be_u64(bytes: &[u8], at: usize) -> u64 {
    let mut out = [0u8; 8];
    out.copy_from_slice(&bytes[at..at + 8]);
    u64::from_be_bytes(out)
}

/// Splits a segment file into batches using only the length field.
fn split_batches(bytes: &[u8]) -> Vec<(usize, &[u8])> {
    let mut batches = Vec::new();
    let mut position = 0;
    while position + 12 <= bytes.len() {
        let end = (position + be_u32(bytes, position + 8) as usize + 12).min(bytes.len());
        batches.push((position, &bytes[position..end]));
        position = end;
    }
    batches
}

/// The valid fixture opens and every read returns the fixture records.
#[test]
fn v1_valid_log_opens_and_reads_the_fixture_records() -> TestResult {
    let (_root, dir) = copy_of("valid")?;
    assert_eq!(common::file_names(&dir)?, vec![SEALED, SEALED_SEEK, ACTIVE]);
    let log = Log::open(&dir, config())?;
    assert_eq!((log.start_offset(), log.next_offset()), (0, 9));
    let segments = log.segments();
    assert_eq!(segments.len(), 2);
    assert_eq!((segments[0].base_offset, segments[0].next_offset, segments[0].sealed), (0, 7, true));
    let expected = all_records();
    let scanned: Vec<_> = log.scan(0).collect::<Result<_, _>>()?;
    assert_eq!(scanned, expected);
    for (offset, record) in &expected {
        assert_eq!(log.read_record(*offset)?, Some((*offset, record.clone())));
    }
    Ok(())
}

/// Segment bytes follow FORMAT.md: length field, magic 2, crc32c over attributes..end, codec bits.
#[test]
fn v1_segment_bytes_follow_the_format() -> TestResult {
    let bytes = std::fs::read(fixture("valid").join(SEALED))?;
    let batches = split_batches(&bytes);
    let expected = sealed_batches();
    assert_eq!(batches.len(), expected.len());
    let mut next_offset = 0u64;
    for ((_, batch), (codec, records)) in batches.iter().zip(&expected) {
        assert_eq!(be_u64(batch, 0), next_offset, "base offset");
        assert_eq!(batch[16], 2, "magic");
        assert_eq!(be_u32(batch, 17), crc32c::crc32c(&batch[21..]), "crc32c covers attributes..end");
        assert_eq!(u16::from_be_bytes([batch[21], batch[22]]) & 0x07, u16::from(codec.id()), "codec bits");
        assert_eq!(be_u32(batch, 57) as usize, records.len(), "record count");
        assert_eq!(be_u32(batch, 23) as usize, records.len() - 1, "last offset delta");
        let decoded: Vec<_> = decode_batch(batch)?.into_iter().map(|(_, r)| r).collect();
        assert_eq!(&decoded, records);
        next_offset += records.len() as u64;
    }
    Ok(())
}

/// The seek table follows FORMAT.md: magic, version 1, facts, entries at batch starts, trailing crc32c.
#[test]
fn v1_seek_table_follows_the_format() -> TestResult {
    let seek = std::fs::read(fixture("valid").join(SEALED_SEEK))?;
    let segment = std::fs::read(fixture("valid").join(SEALED))?;
    assert_eq!(&seek[0..4], b"LXSK");
    assert_eq!(seek[4], 1, "version");
    assert_eq!(&seek[5..8], &[0, 0, 0]);
    assert_eq!(be_u64(&seek, 8), 0, "base offset");
    assert_eq!(be_u64(&seek, 16), segment.len() as u64, "segment bytes");
    assert_eq!(be_u64(&seek, 24), 7, "next offset");
    let batches = split_batches(&segment);
    let (last_position, last_batch) = batches[batches.len() - 1];
    assert_eq!(be_u64(&seek, 40), last_position as u64, "last batch position");
    assert_eq!(be_u32(&seek, 48), be_u32(last_batch, 17), "last batch crc");
    let count = be_u32(&seek, 56) as usize;
    assert_eq!(seek.len(), 60 + 8 * count + 4);
    assert_eq!(be_u32(&seek, seek.len() - 4), crc32c::crc32c(&seek[..seek.len() - 4]));
    for i in 0..count {
        let relative = be_u32(&seek, 60 + 8 * i) as u64;
        let position = be_u32(&seek, 64 + 8 * i) as usize;
        let batch = batches.iter().find(|(p, _)| *p == position).ok_or("entry not at a batch start")?;
        assert_eq!(be_u64(batch.1, 0), relative, "entry offset is the batch base offset");
    }
    Ok(())
}

/// A seek table rebuilt by the current code equals the committed one byte for byte.
#[test]
fn v1_seek_table_is_rebuilt_byte_for_byte() -> TestResult {
    let (_root, dir) = copy_of("valid")?;
    std::fs::remove_file(dir.join(SEALED_SEEK))?;
    Log::open(&dir, config())?;
    assert_eq!(std::fs::read(dir.join(SEALED_SEEK))?, std::fs::read(fixture("valid").join(SEALED_SEEK))?);
    Ok(())
}

/// The torn-tail fixture opens with the half batch cut off; appends continue at offset 7.
#[test]
fn v1_torn_tail_is_truncated_on_open() -> TestResult {
    let (_root, dir) = copy_of("torn_tail")?;
    let mut log = Log::open(&dir, config())?;
    assert_eq!(log.next_offset(), 7);
    let sealed_len = std::fs::metadata(fixture("valid").join(SEALED))?.len();
    assert_eq!(std::fs::metadata(dir.join(SEALED))?.len(), sealed_len);
    let records: Vec<_> = all_records().into_iter().skip(7).map(|(_, r)| r).collect();
    let mut batch = logdex_log::encode_batch(&records, logdex_log::Compression::None)?;
    assert_eq!(log.append(&mut batch, 0)?.base_offset, 7);
    let scanned: Vec<_> = log.scan(0).collect::<Result<_, _>>()?;
    assert_eq!(scanned, all_records());
    Ok(())
}

/// The flipped byte in the sealed segment is reported with file and position, on read and on open.
#[test]
fn v1_corrupt_sealed_segment_is_reported_with_file_and_position() -> TestResult {
    let (_root, dir) = copy_of("corrupt_sealed")?;
    let segment = std::fs::read(dir.join(SEALED))?;
    let (position, _) = split_batches(&segment)[CORRUPT_BATCH];
    const { assert!(CORRUPT_BYTE_IN_BATCH >= 61) };
    let log = Log::open(&dir, config())?;
    match log.read_record(3) {
        Err(Error::Corrupt { path, position: at, source, .. }) => {
            assert_eq!(path, dir.join(SEALED));
            assert_eq!(at, position as u64);
            assert!(matches!(*source, Error::CrcMismatch { .. }));
        }
        other => return Err(format!("expected Corrupt, got {other:?}").into()),
    }
    assert_eq!(log.read_record(0)?.map(|(o, _)| o), Some(0));
    assert!(log.scan(0).any(|r| r.is_err()));
    drop(log);
    std::fs::remove_file(dir.join(SEALED_SEEK))?;
    match Log::open(&dir, config()) {
        Err(Error::Corrupt { path, position: at, .. }) if path == dir.join(SEALED) && at == position as u64 => Ok(()),
        other => Err(format!("expected Corrupt at {position}, got {:?}", other.map(|_| ())).into()),
    }
}
