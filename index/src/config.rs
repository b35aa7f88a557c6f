//! `IndexConfig`: plain data with defaults and `validate()`.

use crate::encoding::DATA_PREFIX_BYTES_MAX;
use crate::error::{Error, Result};
use crate::layout::SHARDS_MAX;

const KIB: u64 = 1024;
const MIB: u64 = 1024 * KIB;

/// fjall refuses keys longer than this (u16 length prefix).
const FJALL_KEY_BYTES_MAX: usize = 65_536;

/// Default shard count at most: beyond it the open is no faster on most machines, and
/// every shard adds a journal, an fsync per `persist` and a maintenance thread.
const DEFAULT_SHARDS_MAX: usize = 4;

/// fjall asserts `max_journaling_size >= 64 MiB`.
const FJALL_JOURNAL_BYTES_MIN: u64 = 64 * MIB;

/// Configuration of one node's key index.
///
/// Memtable sizes are fixed when the keyspaces are first created (fjall stores
/// them); changing `memtable_bytes_max` later has no effect on an existing index.
#[derive(Clone, Debug)]
pub struct IndexConfig {
    /// Longest user key accepted by `apply`, `rebuild` and `get` (default 16 KiB).
    pub key_bytes_max: usize,
    /// Block cache shared by both keyspaces (default 64 MiB).
    pub cache_bytes: u64,
    /// Memtable size of the data keyspace before it is flushed (default 32 MiB).
    pub memtable_bytes_max: u64,
    /// Upper bound of sealed journal bytes before fjall forces flushes
    /// (default 256 MiB, fjall's minimum is 64 MiB per shard). Each shard's active
    /// journal adds up to 64 MiB on top (fjall rotates it at that size).
    pub journal_bytes_max: u64,
    /// Flush memtables after this long without writes, so that idle data does
    /// not sit in memory and in the journal (default 5000 ms; 0 disables).
    pub idle_flush_ms: u64,
    /// Memory bound of one sorted run while rebuilding (default 64 MiB of keys).
    pub rebuild_chunk_bytes_max: u64,
    /// Longest time a dropped generation or a raised watermark waits for an
    /// fsync before the compaction filter may remove its entries; the
    /// background thread issues that fsync if `persist` was not called
    /// (default 1000 ms; 0 disables, then only `persist` releases them).
    pub gc_sync_interval_ms: u64,
    /// fjall flush and compaction threads (default 2).
    pub worker_threads: usize,
    /// Databases the index is split into by group, opened side by side (default: the
    /// machine's cores, at most 4). Fixed when the index is created: an existing index
    /// keeps its count. The cache, the memtable size, the journal bound and the worker
    /// threads above are for the whole index and divided among the shards.
    pub shards: usize,
}

impl Default for IndexConfig {
    fn default() -> Self {
        Self {
            key_bytes_max: 16 * 1024,
            cache_bytes: 64 * MIB,
            memtable_bytes_max: 32 * MIB,
            journal_bytes_max: 256 * MIB,
            idle_flush_ms: 5_000,
            rebuild_chunk_bytes_max: 64 * MIB,
            gc_sync_interval_ms: 1_000,
            worker_threads: 2,
            shards: std::thread::available_parallelism().map_or(1, |n| n.get()).min(DEFAULT_SHARDS_MAX),
        }
    }
}

impl IndexConfig {
    /// Checks every field; `Index::open` calls this first.
    pub fn validate(&self) -> Result<()> {
        let key_max = FJALL_KEY_BYTES_MAX - DATA_PREFIX_BYTES_MAX;
        check(
            "key_bytes_max",
            self.key_bytes_max as u64,
            self.key_bytes_max >= 1 && self.key_bytes_max <= key_max,
            "must be 1..=65522 (fjall's 64 KiB key limit minus the 14-byte prefix)",
        )?;
        check("cache_bytes", self.cache_bytes, self.cache_bytes >= MIB, "must be at least 1 MiB")?;
        check(
            "memtable_bytes_max",
            self.memtable_bytes_max,
            (MIB..=1024 * MIB).contains(&self.memtable_bytes_max),
            "must be 1 MiB..=1 GiB",
        )?;
        check(
            "journal_bytes_max",
            self.journal_bytes_max,
            self.journal_bytes_max >= FJALL_JOURNAL_BYTES_MIN,
            "must be at least 64 MiB (fjall minimum)",
        )?;
        check(
            "rebuild_chunk_bytes_max",
            self.rebuild_chunk_bytes_max,
            self.rebuild_chunk_bytes_max >= MIB,
            "must be at least 1 MiB",
        )?;
        check("worker_threads", self.worker_threads as u64, (1..=64).contains(&self.worker_threads), "must be 1..=64")?;
        check("shards", self.shards as u64, (1..=SHARDS_MAX).contains(&self.shards), "must be 1..=16")
    }

    /// The config of one of `shards` databases: the cache, the memtable, the sealed
    /// journals' bound and the worker threads divided among them (at least 1 MiB, 1 MiB,
    /// fjall's 64 MiB and one thread each).
    pub(crate) fn for_shard(&self, shards: usize) -> IndexConfig {
        let n = shards.max(1);
        IndexConfig {
            cache_bytes: (self.cache_bytes / n as u64).max(MIB),
            memtable_bytes_max: (self.memtable_bytes_max / n as u64).max(MIB),
            journal_bytes_max: (self.journal_bytes_max / n as u64).max(FJALL_JOURNAL_BYTES_MIN),
            worker_threads: (self.worker_threads / n).max(1),
            shards: 1,
            ..self.clone()
        }
    }
}

fn check(field: &'static str, value: u64, ok: bool, reason: &'static str) -> Result<()> {
    if ok { Ok(()) } else { Err(Error::InvalidConfig { field, value, reason }) }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_config_is_valid() -> Result<()> {
        IndexConfig::default().validate()
    }

    #[test]
    fn a_shard_gets_its_part_of_the_budgets_and_a_valid_config() -> Result<()> {
        let config = IndexConfig { shards: 2, ..IndexConfig::default() };
        let shard = config.for_shard(2);
        assert_eq!(shard.cache_bytes, config.cache_bytes / 2);
        assert_eq!(shard.memtable_bytes_max, config.memtable_bytes_max / 2);
        assert_eq!(shard.journal_bytes_max, config.journal_bytes_max / 2);
        assert_eq!(shard.worker_threads, 1);
        let tiny = IndexConfig {
            cache_bytes: MIB,
            memtable_bytes_max: MIB,
            journal_bytes_max: FJALL_JOURNAL_BYTES_MIN,
            worker_threads: 1,
            ..config
        };
        tiny.for_shard(SHARDS_MAX).validate()
    }

    #[test]
    fn zero_shards_are_rejected() {
        let config = IndexConfig { shards: 0, ..IndexConfig::default() };
        assert!(matches!(config.validate(), Err(Error::InvalidConfig { field: "shards", .. })));
    }

    #[test]
    fn journal_below_fjall_minimum_is_rejected() {
        let config = IndexConfig { journal_bytes_max: MIB, ..IndexConfig::default() };
        assert!(matches!(config.validate(), Err(Error::InvalidConfig { field: "journal_bytes_max", .. })));
    }
}
