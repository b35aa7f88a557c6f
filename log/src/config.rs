//! [`LogConfig`]: plain data with defaults and `validate`.

use crate::batch::BATCH_HEADER_BYTES;
use crate::batch::Compression;
use crate::error::{Error, Result};

/// Settings of one partition replica's log.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LogConfig {
    /// Roll the active segment before an append would make it larger than
    /// this (a single larger batch gets a segment of its own). Default
    /// 128 MiB, at most `i32::MAX` so positions fit the seek table.
    pub segment_bytes: u64,
    /// Roll the active segment when its first append (since it was created
    /// or the log was opened: then the first batch's max timestamp) is
    /// older than this. Default none.
    pub segment_ms: Option<u64>,
    /// Bytes of batches between two seek entries. Default 4096.
    pub seek_interval_bytes: u32,
    /// Largest batch `append` accepts. Default 16 MiB.
    pub batch_bytes_max: u32,
    /// Delete sealed segments whose max timestamp is older than this.
    pub retention_ms: Option<u64>,
    /// Delete the oldest sealed segments while the log stays at least this
    /// large without them (Kafka's rule).
    pub retention_bytes: Option<u64>,
    /// Codec of the batches written to this log (the topic's `compression.type`). The log
    /// stores each batch as it is given and reads every codec alike; the writer encodes
    /// with this one. Default none.
    pub compression: Compression,
}

const SEGMENT_BYTES_MIN: u64 = 2 * BATCH_HEADER_BYTES as u64;
const SEGMENT_BYTES_MAX: u64 = i32::MAX as u64;
const SEEK_INTERVAL_BYTES_MAX: u32 = 64 << 20;

impl Default for LogConfig {
    fn default() -> LogConfig {
        LogConfig {
            segment_bytes: 128 << 20,
            segment_ms: None,
            seek_interval_bytes: 4096,
            batch_bytes_max: 16 << 20,
            retention_ms: None,
            retention_bytes: None,
            compression: Compression::None,
        }
    }
}

impl LogConfig {
    /// Checks every field's range.
    pub fn validate(&self) -> Result<()> {
        let invalid = |field, reason| Err(Error::InvalidConfig { field, reason });
        if !(SEGMENT_BYTES_MIN..=SEGMENT_BYTES_MAX).contains(&self.segment_bytes) {
            return invalid("segment_bytes", "must be between 122 and 2^31 - 1");
        }
        if self.segment_ms == Some(0) {
            return invalid("segment_ms", "must be at least 1");
        }
        if self.seek_interval_bytes > SEEK_INTERVAL_BYTES_MAX {
            return invalid("seek_interval_bytes", "must be at most 64 MiB");
        }
        if (self.batch_bytes_max as usize) < BATCH_HEADER_BYTES || self.batch_bytes_max > i32::MAX as u32 {
            return invalid("batch_bytes_max", "must be between 61 and 2^31 - 1");
        }
        Ok(())
    }
}
