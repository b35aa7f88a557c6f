//! The one error type of the crate.
//!
//! Variants carry the context an operator needs (path, segment base offset,
//! position, stored and computed crc). Conditions a caller must react to have
//! their own variant; free-form reasons are `&'static str` for humans only.

use std::io;
use std::path::PathBuf;

use crate::Offset;
use crate::batch::Compression;

/// Result with [`Error`] as the default error type.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything that can go wrong in the segment log.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// An operating-system call failed.
    #[error("{op} {path}: {source}")]
    Io {
        /// What was being done (`"open"`, `"write"`, `"fsync"`, ...).
        op: &'static str,
        path: PathBuf,
        #[source]
        source: io::Error,
    },

    /// The bytes are not a well-formed RecordBatch v2.
    ///
    /// `at` is a byte position inside the batch for header faults, or inside
    /// the (decompressed) records section for record faults.
    #[error("malformed batch: {reason} (at byte {at})")]
    MalformedBatch { reason: &'static str, at: usize },

    /// The stored CRC-32C does not match the bytes it covers.
    #[error("batch crc mismatch: stored {expected:#010x}, computed {actual:#010x}")]
    CrcMismatch { expected: u32, actual: u32 },

    /// The batch magic byte is not 2.
    #[error("unsupported batch magic {magic} (only magic 2 is supported)")]
    UnsupportedMagic { magic: i8 },

    /// The attributes name a codec this crate does not support (gzip = 1,
    /// snappy = 2, or an unknown value).
    #[error("unsupported compression codec {codec} (none, lz4 and zstd are supported)")]
    UnsupportedCompression { codec: u8 },

    /// The compressed records section does not decompress.
    #[error("{codec:?} records section does not decompress: {source}")]
    Decompress {
        codec: Compression,
        #[source]
        source: io::Error,
    },

    /// The records section decompresses to more than `limit` bytes.
    #[error("decompressed records section exceeds {limit} bytes")]
    DecompressedTooLarge { limit: usize },

    /// A batch (or record) is larger than the configured or encodable limit.
    #[error("batch of {size} bytes exceeds the limit of {limit} bytes")]
    BatchTooLarge { size: usize, limit: usize },

    /// A batch without records was offered for encoding or appending.
    #[error("batch has no records")]
    EmptyBatch,

    /// An appended batch must have dense offset deltas `0..record_count`.
    #[error("batch offsets are not dense: {record_count} records, last offset delta {last_offset_delta}")]
    NotDense { record_count: u32, last_offset_delta: i32 },

    /// A batch stored in a segment file is damaged. `source` is the batch
    /// fault (for example [`Error::CrcMismatch`] with both crcs).
    #[error("corrupt segment {path} (base offset {base_offset}) at position {position}: {source}")]
    Corrupt {
        path: PathBuf,
        base_offset: Offset,
        position: u64,
        #[source]
        source: Box<Error>,
    },

    /// The offset is outside `[start_offset, next_offset]` for this operation.
    #[error("offset {offset} is outside the log [{start_offset}, {next_offset})")]
    OffsetOutOfRange { offset: Offset, start_offset: Offset, next_offset: Offset },

    /// `truncate` was asked to cut inside a batch.
    #[error("offset {offset} is inside batch [{batch_base_offset}, {batch_last_offset}], not at a batch boundary")]
    NotBatchBoundary { offset: Offset, batch_base_offset: Offset, batch_last_offset: Offset },

    /// An earlier write or fsync failed; the log refuses writes until it is
    /// reopened (recovery is a restart, fsync is never retried).
    #[error("the log is poisoned by an earlier failed write or fsync; reopen it")]
    Poisoned,

    /// A [`crate::LogConfig`] field is out of range.
    #[error("invalid log config: {field} {reason}")]
    InvalidConfig { field: &'static str, reason: &'static str },

    /// A file offered to [`crate::Log::install`] is not a segment file.
    #[error("cannot install {path}: {reason}")]
    InvalidInstallSource { path: PathBuf, reason: &'static str },
}

impl Error {
    /// True for damaged stored data (as opposed to bad input or I/O).
    pub fn is_corruption(&self) -> bool {
        matches!(self, Error::Corrupt { .. })
    }

    /// True when a file was not there (deleted under the caller, say).
    pub fn is_not_found(&self) -> bool {
        matches!(self, Error::Io { source, .. } if source.kind() == io::ErrorKind::NotFound)
    }

    pub(crate) fn io(op: &'static str, path: impl Into<PathBuf>) -> impl FnOnce(io::Error) -> Error {
        let path = path.into();
        move |source| Error::Io { op, path, source }
    }

    pub(crate) fn malformed(reason: &'static str, at: usize) -> Error {
        Error::MalformedBatch { reason, at }
    }
}
