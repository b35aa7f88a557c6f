//! Helpers shared by the behaviour tests.
#![allow(dead_code)]

use std::path::Path;

use logdex_log::{Compression, Header, Log, LogConfig, Offset, Record, encode_batch};

pub type TestResult = Result<(), Box<dyn std::error::Error>>;

/// A small-segment config so tests roll often.
pub fn small_config() -> LogConfig {
    LogConfig { segment_bytes: 4096, seek_interval_bytes: 256, ..LogConfig::default() }
}

/// A deterministic record for offset-independent index `i`.
pub fn record(i: u64) -> Record {
    Record {
        timestamp_ms: 1_700_000_000_000 + i as i64,
        key: Some(format!("key-{}", i % 17).into_bytes()),
        value: Some(format!("value-{i}-{}", "x".repeat((i % 7) as usize)).into_bytes()),
        headers: if i.is_multiple_of(5) {
            vec![Header { key: "h".into(), value: Some(i.to_be_bytes().to_vec()) }]
        } else {
            Vec::new()
        },
    }
}

/// Appends `count` records numbered from `first` as one batch.
pub fn append_records(log: &mut Log, first: u64, count: u64, compression: Compression) -> logdex_log::Result<Offset> {
    let records: Vec<Record> = (first..first + count).map(record).collect();
    let mut batch = encode_batch(&records, compression)?;
    let info = log.append(&mut batch, 0)?;
    Ok(info.base_offset)
}

/// Appends batches of `per_batch` records until `total` records were
/// written; record `i` (numbered from 0) lands at offset `start + i`.
pub fn fill(log: &mut Log, total: u64, per_batch: u64) -> logdex_log::Result<()> {
    let mut i = 0;
    while i < total {
        let n = per_batch.min(total - i);
        append_records(log, i, n, Compression::None)?;
        i += n;
    }
    Ok(())
}

/// Copies every file of `from` into `to` (created).
pub fn copy_dir(from: &Path, to: &Path) -> std::io::Result<()> {
    std::fs::create_dir_all(to)?;
    for entry in std::fs::read_dir(from)? {
        let entry = entry?;
        std::fs::copy(entry.path(), to.join(entry.file_name()))?;
    }
    Ok(())
}

/// Names of the files in `dir`, sorted.
pub fn file_names(dir: &Path) -> std::io::Result<Vec<String>> {
    let mut names: Vec<String> = std::fs::read_dir(dir)?
        .filter_map(|e| e.ok())
        .filter_map(|e| e.file_name().to_str().map(str::to_owned))
        .collect();
    names.sort();
    Ok(names)
}
