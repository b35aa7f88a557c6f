//! Helpers shared by the behaviour tests.
#![allow(dead_code)]

use logdex_index::{AppliedMarker, Index, IndexConfig, Update};
use std::path::Path;

pub type TestResult = Result<(), Box<dyn std::error::Error>>;

/// A small config for tests: no idle flush, fast background fsync.
pub fn config() -> IndexConfig {
    IndexConfig {
        cache_bytes: 4 * 1024 * 1024,
        memtable_bytes_max: 4 * 1024 * 1024,
        idle_flush_ms: 0,
        gc_sync_interval_ms: 0,
        worker_threads: 1,
        ..IndexConfig::default()
    }
}

pub fn open(path: &Path) -> Result<Index, logdex_index::Error> {
    Index::open(path, config())
}

pub fn marker(next_offset: u64) -> AppliedMarker {
    AppliedMarker { state: format!("applied-{next_offset}").into_bytes(), next_offset }
}

pub fn put(key: &[u8], offset: u64) -> Update<'_> {
    Update::Put { key, offset }
}

pub fn delete(key: &[u8]) -> Update<'_> {
    Update::Delete { key }
}
