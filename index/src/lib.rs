//! logdex key index: `key -> offset` for every partition replica (group) on a
//! node, in a few fjall databases (shards by group id, see `FORMAT.md`).
//!
//! Synchronous; knows nothing about Raft, the log's file format or HTTP. The
//! raft crate applies committed entries with [`Index::apply`] (entries and the
//! group's [`AppliedMarker`] in one atomic batch) and serves lookups with
//! [`Index::get`].
//!
//! Layout (byte for byte in `FORMAT.md`): in each shard, one shared `data` keyspace with keys
//! `group (u64 BE) | generation (u32 BE) | user key` and values holding the
//! offset in its shortest big-endian form; one `meta` keyspace with each
//! group's live generation, applied marker and cleanup watermark. Dropping a
//! group or rebuilding it switches generations in O(1); a compaction filter
//! removes dead generations and entries below the watermark in the background.
//!
//! To ensure correctness:
//! - writes of one group are serialized (a per-group lock), writes of
//!   different groups and all reads run concurrently;
//! - every write is one fjall batch: after a crash the index holds a prefix of
//!   the batches, and a group's marker never claims entries that are missing;
//! - writes are buffered (they survive a process kill); [`Index::persist`]
//!   makes everything before it survive power loss;
//! - the compaction filter only removes what is dead in the fsynced state.

mod config;
mod encoding;
mod error;
mod filter;
mod groups;
mod index;
mod layout;
mod maintenance;
mod rebuild;

pub use config::IndexConfig;
pub use error::{Error, Result};
pub use index::{Index, IndexStats, IndexView};
pub use layout::SHARDS_MAX;
pub use maintenance::{FLUSH_WAIT_MAX, seal_and_wait_flushed};

/// One partition replica on this node (its replica id). Never reused on a
/// node, but the index stays correct if it is: a dropped group's entries are
/// never visible to a later group with the same id.
pub type GroupId = u64;

/// A record's logical number within its partition.
pub type Offset = u64;

/// One change of the index for one record.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Update<'a> {
    /// The key's latest record is at `offset`.
    Put {
        /// User key.
        key: &'a [u8],
        /// Offset of the record.
        offset: Offset,
    },
    /// Tombstone record: the key has no live value.
    Delete {
        /// User key.
        key: &'a [u8],
    },
}

impl<'a> Update<'a> {
    /// The user key this update is about.
    pub fn key(&self) -> &'a [u8] {
        match self {
            Self::Put { key, .. } | Self::Delete { key } => key,
        }
    }
}

/// What a group has applied, written atomically with the entries.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AppliedMarker {
    /// Opaque bytes owned by the caller (its Raft applied log id and membership).
    pub state: Vec<u8>,
    /// The offset the next record of the group will get.
    pub next_offset: Offset,
}

/// Answer of a lookup.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Lookup {
    /// The key's latest record is at this offset.
    Found(Offset),
    /// The key has no entry (never written, deleted, or its group dropped).
    NotFound,
    /// The key's entry is at this offset, below the group's cleanup watermark.
    ///
    /// Only while the entry is still stored: once a compaction has removed it
    /// the answer becomes `NotFound` (and after a restart it can be `Evicted`
    /// again, when fjall replays journal records that the compaction filter had
    /// removed from tables). Replicas can differ in which of the two they
    /// return for such a key; treat both as "no readable record".
    Evicted(Offset),
}

#[cfg(test)]
mod tests {
    fn assert_send_sync<T: Send + Sync + 'static>() {}

    #[test]
    fn index_and_error_cross_threads() {
        assert_send_sync::<crate::Index>();
        assert_send_sync::<crate::Error>();
    }
}
