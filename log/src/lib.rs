//! logdex segment log: Kafka RecordBatch v2 codec, segment files, seek
//! tables, recovery, retention and compaction.
//!
//! Synchronous (std::fs only); knows nothing of Raft, HTTP or what keys
//! mean. The on-disk formats are specified in `log/FORMAT.md`.
//!
//! Architecture invariants:
//! - offsets in a log only increase, and an append lands at `next_offset`;
//! - a sealed segment file is never modified in place (compaction renames a
//!   new file over it, truncation copies it when it is linked elsewhere), so
//!   hard links taken by `checkpoint` stay unchanged;
//! - every batch read from disk has its crc checked before it is returned.

mod batch;
mod compact;
mod compression;
mod config;
mod error;
mod files;
mod log;
mod reader;
mod record;
mod seek;
mod segment;
mod snapshot;
mod varint;

pub use batch::{
    BATCH_HEADER_BYTES, BatchInfo, Compression, Header, Record, decode_batch, encode_batch, set_base_offset,
    set_partition_leader_epoch, validate_batch,
};
pub use compact::{CompactStats, Compacted, CompactionPlan};
pub use compression::DECOMPRESSED_BYTES_MAX;
pub use config::LogConfig;
pub use error::{Error, Result};
pub use files::segment_file_name;
pub use log::{Log, SegmentInfo};

/// A record's logical number in a partition.
pub type Offset = u64;

#[cfg(test)]
mod tests {
    fn assert_send_sync<T: Send + Sync>() {}

    #[test]
    fn log_is_send_and_sync() {
        assert_send_sync::<super::Log>();
    }
}
