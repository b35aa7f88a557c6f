//! The background thread flushes idle memtables and releases dead data.

mod common;

use common::{TestResult, marker, put};
use logdex_index::{Index, IndexConfig, Update};
use std::time::{Duration, Instant};

fn wait_until(
    deadline: Duration,
    mut condition: impl FnMut() -> Result<bool, logdex_index::Error>,
) -> Result<bool, logdex_index::Error> {
    let start = Instant::now();
    while start.elapsed() < deadline {
        if condition()? {
            return Ok(true);
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    Ok(false)
}

/// After `idle_flush_ms` without writes the memtable is flushed to a table.
#[test]
fn idle_memtables_are_flushed_in_the_background() -> TestResult {
    let dir = tempfile::tempdir()?;
    let config = IndexConfig { idle_flush_ms: 50, ..common::config() };
    let index = Index::open(dir.path(), config)?;
    let keys: Vec<Vec<u8>> = (0..1000u64).map(|i| format!("k{i}").into_bytes()).collect();
    let updates: Vec<Update<'_>> = keys.iter().zip(0u64..).map(|(k, o)| put(k, o)).collect();
    index.apply(1, &updates, &marker(1000))?;
    let flushed = wait_until(Duration::from_secs(10), || {
        let stats = index.stats()?;
        Ok(stats.data_tables > 0 && stats.write_buffer_bytes == 0)
    })?;
    assert!(flushed, "{:?}", index.stats()?);
    Ok(())
}

/// Without any `persist` call, a drop reaches the compaction filter after
/// `gc_sync_interval_ms` (the background thread fsyncs).
#[test]
fn background_fsync_releases_dropped_groups() -> TestResult {
    let dir = tempfile::tempdir()?;
    let config = IndexConfig { gc_sync_interval_ms: 20, ..common::config() };
    let index = Index::open(dir.path(), config)?;
    index.apply(1, &[put(b"a", 0)], &marker(1))?;
    index.drop_group(1)?;
    let released = wait_until(Duration::from_secs(10), || Ok(!index.stats()?.cleanup_pending))?;
    assert!(released);
    Ok(())
}

/// Dropping the last handle stops the background thread and closes the
/// database: the directory can be opened again right away.
#[test]
fn dropping_the_index_stops_the_thread_and_releases_the_directory() -> TestResult {
    let dir = tempfile::tempdir()?;
    for round in 0..3u64 {
        let config = IndexConfig { idle_flush_ms: 10, gc_sync_interval_ms: 10, ..common::config() };
        let index = Index::open(dir.path(), config)?;
        let clone = index.clone();
        clone.apply(1, &[put(b"k", round)], &marker(round + 1))?;
        drop(clone);
        assert_eq!(index.applied(1)?, Some(marker(round + 1)));
    }
    Ok(())
}
