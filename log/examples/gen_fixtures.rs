//! Regenerates `log/tests/fixtures/v1/`. The fixtures are committed and read
//! by `tests/format_fixtures.rs` forever; regenerate only for a new format
//! version (into `v2/`), never to make a failing test pass.
//!
//! `cargo run -p logdex-log --example gen_fixtures`

#[allow(dead_code)]
#[path = "../tests/common/fixture_content.rs"]
mod fixture_content;

use std::error::Error;
use std::path::Path;

use fixture_content::{
    CORRUPT_BATCH, CORRUPT_BYTE_IN_BATCH, FIXTURE_SEEK_INTERVAL_BYTES, active_batches, sealed_batches,
};
use logdex_log::{Compression, Log, LogConfig, Record, encode_batch};

fn main() -> Result<(), Box<dyn Error>> {
    let out = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/v1");
    if out.exists() {
        std::fs::remove_dir_all(&out)?;
    }
    let work = tempfile::tempdir()?;
    let config = LogConfig { seek_interval_bytes: FIXTURE_SEEK_INTERVAL_BYTES, ..LogConfig::default() };

    // valid/: a sealed segment with its seek table and an active segment.
    let valid = work.path().join("valid");
    let mut log = Log::open(&valid, config.clone())?;
    append_all(&mut log, &sealed_batches())?;
    log.roll()?;
    append_all(&mut log, &active_batches())?;
    log.sync()?;
    drop(log);
    copy_dir(&valid, &out.join("valid"))?;

    // torn_tail/: one active segment, the sealed batches plus half a batch.
    let torn = out.join("torn_tail");
    std::fs::create_dir_all(&torn)?;
    let mut bytes = std::fs::read(valid.join("00000000000000000000.log"))?;
    let (codec, records) = &active_batches()[0];
    let batch = encode_batch(records, *codec)?;
    bytes.extend_from_slice(&batch[..batch.len() / 2]);
    std::fs::write(torn.join("00000000000000000000.log"), bytes)?;

    // corrupt_sealed/: valid/ with one flipped byte inside a sealed batch.
    let corrupt = out.join("corrupt_sealed");
    copy_dir(&valid, &corrupt)?;
    let path = corrupt.join("00000000000000000000.log");
    let mut bytes = std::fs::read(&path)?;
    let position = batch_positions(&bytes)[CORRUPT_BATCH];
    bytes[position + CORRUPT_BYTE_IN_BATCH] ^= 0x01;
    std::fs::write(&path, bytes)?;
    println!("fixtures written to {}", out.display());
    Ok(())
}

fn append_all(log: &mut Log, batches: &[(Compression, Vec<Record>)]) -> Result<(), Box<dyn Error>> {
    for (codec, records) in batches {
        let mut batch = encode_batch(records, *codec)?;
        log.append(&mut batch, 0)?;
    }
    Ok(())
}

fn batch_positions(bytes: &[u8]) -> Vec<usize> {
    let mut positions = Vec::new();
    let mut position = 0;
    while position + 12 <= bytes.len() {
        positions.push(position);
        let length =
            i32::from_be_bytes([bytes[position + 8], bytes[position + 9], bytes[position + 10], bytes[position + 11]]);
        position += length as usize + 12;
    }
    positions
}

fn copy_dir(from: &Path, to: &Path) -> std::io::Result<()> {
    std::fs::create_dir_all(to)?;
    for entry in std::fs::read_dir(from)? {
        let entry = entry?;
        std::fs::copy(entry.path(), to.join(entry.file_name()))?;
    }
    Ok(())
}
