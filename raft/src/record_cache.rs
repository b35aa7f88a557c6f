//! Records that key lookups read and that apply wrote, kept in memory by
//! (replica, offset).
//!
//! A lookup asks the index for the key's offset, then reads the record at that
//! offset from the segment log: a `pread` of the window around its batch, the
//! walk to the batch and its checksum. The cache keeps the decoded record
//! instead, so a key read again costs the index get alone.
//!
//! To ensure correctness:
//! - The record at an offset of a replica never changes while the replica
//!   holds it: offsets are given to committed entries only, in log order, so
//!   every replica (and every re-application after a crash or a snapshot
//!   install) writes the same record there; compaction removes records but
//!   never rewrites one it keeps. An entry can therefore go stale only by no
//!   longer being asked for, never by being wrong.
//! - The cache is consulted after everything that decides whether the record
//!   is still served: the index's answer for the key (its latest offset, or
//!   none after a tombstone) and the log's start offset (retention). A record
//!   retention removed is never answered from here.
//! - Bounded by the bytes of the records it holds (`--record-cache-mb`); 0
//!   turns it off.

use std::sync::Arc;
use std::sync::atomic::AtomicU64;
use std::sync::atomic::Ordering::Relaxed;

use logdex_log::Offset;
use logdex_log::Record;
use quick_cache::Weighter;

use crate::types::ReplicaId;

/// Bookkeeping bytes counted for each cached record beyond its key, value and headers.
const ENTRY_OVERHEAD_BYTES: u64 = 96;
/// The average weight assumed when sizing the cache's table.
const EXPECTED_ENTRY_BYTES: u64 = 256;

#[derive(Clone, Copy)]
struct RecordWeight;

impl Weighter<(ReplicaId, Offset), Arc<Record>> for RecordWeight {
    fn weight(&self, _key: &(ReplicaId, Offset), record: &Arc<Record>) -> u64 {
        record_bytes(record)
    }
}

fn record_bytes(record: &Record) -> u64 {
    let headers: usize = record.headers.iter().map(|h| h.key.len() + h.value.as_ref().map_or(0, Vec::len) + 48).sum();
    let bytes = record.key.as_ref().map_or(0, Vec::len) + record.value.as_ref().map_or(0, Vec::len) + headers;
    bytes as u64 + ENTRY_OVERHEAD_BYTES
}

/// The node's cache of looked-up records, shared by its replicas. Cheap to clone.
#[derive(Clone)]
pub struct RecordCache {
    records: Arc<Records>,
}

struct Records {
    /// None: the cache is off, and every lookup misses.
    cache: Option<quick_cache::sync::Cache<(ReplicaId, Offset), Arc<Record>, RecordWeight>>,
    hits: AtomicU64,
    misses: AtomicU64,
}

impl RecordCache {
    /// A cache holding records of up to `capacity_bytes` in all; 0: a cache that holds nothing.
    pub fn new(capacity_bytes: u64) -> RecordCache {
        if capacity_bytes == 0 {
            return RecordCache::disabled();
        }
        let items = (capacity_bytes / EXPECTED_ENTRY_BYTES).clamp(16, 1 << 24) as usize;
        let cache = quick_cache::sync::Cache::with_weighter(items, capacity_bytes, RecordWeight);
        RecordCache::of(Some(cache))
    }

    /// A cache that holds nothing (every `get` misses, and counts so).
    pub fn disabled() -> RecordCache {
        RecordCache::of(None)
    }

    fn of(cache: Option<quick_cache::sync::Cache<(ReplicaId, Offset), Arc<Record>, RecordWeight>>) -> RecordCache {
        RecordCache { records: Arc::new(Records { cache, hits: AtomicU64::new(0), misses: AtomicU64::new(0) }) }
    }

    /// The record at `offset` of `replica`, if cached.
    pub fn get(&self, replica: ReplicaId, offset: Offset) -> Option<Arc<Record>> {
        let records = &self.records;
        let found = records.cache.as_ref().and_then(|cache| cache.get(&(replica, offset)));
        let counter = if found.is_some() { &records.hits } else { &records.misses };
        counter.fetch_add(1, Relaxed);
        found
    }

    /// Keeps `record`, read or written at `offset` of `replica`, for later lookups. A record larger
    /// than an eighth of the cache is not kept.
    pub fn insert(&self, replica: ReplicaId, offset: Offset, record: Arc<Record>) {
        let Some(cache) = &self.records.cache else { return };
        if record_bytes(&record) > cache.capacity() / 8 {
            return;
        }
        cache.insert((replica, offset), record);
    }

    /// Lookups answered from the cache and lookups that read the log, since the start.
    pub fn hits_and_misses(&self) -> (u64, u64) {
        (self.records.hits.load(Relaxed), self.records.misses.load(Relaxed))
    }

    /// Bytes of the records held (as weighed), and the bound.
    pub fn bytes_and_capacity(&self) -> (u64, u64) {
        self.records.cache.as_ref().map_or((0, 0), |c| (c.weight(), c.capacity()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(key: &str, value_bytes: usize) -> Arc<Record> {
        Arc::new(Record {
            timestamp_ms: 1,
            key: Some(key.as_bytes().to_vec()),
            value: Some(vec![7; value_bytes]),
            headers: Vec::new(),
        })
    }

    #[test]
    fn cached_record_is_found_by_replica_and_offset_only() {
        let cache = RecordCache::new(1 << 20);
        cache.insert(5, 10, record("k", 100));
        assert_eq!(cache.get(5, 10).and_then(|r| r.key.clone()), Some(b"k".to_vec()));
        assert!(cache.get(5, 11).is_none(), "another offset of the replica");
        assert!(cache.get(6, 10).is_none(), "the same offset of another replica");
    }

    #[test]
    fn cache_stays_within_its_byte_bound() {
        let cache = RecordCache::new(64 * 1024);
        for offset in 0..10_000 {
            cache.insert(1, offset, record("key", 100));
        }
        let (bytes, capacity) = cache.bytes_and_capacity();
        assert_eq!(capacity, 64 * 1024);
        assert!(bytes <= capacity, "{bytes} bytes held, bound {capacity}");
        assert!(bytes > 0);
    }

    #[test]
    fn disabled_cache_keeps_nothing_and_counts_each_lookup_a_miss() {
        let cache = RecordCache::new(0);
        cache.insert(1, 1, record("k", 10));
        assert!(cache.get(1, 1).is_none());
        assert!(cache.get(1, 2).is_none());
        assert_eq!(cache.hits_and_misses(), (0, 2));
    }

    #[test]
    fn record_larger_than_an_eighth_of_the_cache_is_not_kept() {
        let cache = RecordCache::new(64 * 1024);
        cache.insert(1, 1, record("big", 9 * 1024));
        assert!(cache.get(1, 1).is_none());
        cache.insert(1, 2, record("small", 1024));
        assert!(cache.get(1, 2).is_some());
    }
}
