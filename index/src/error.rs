//! The one error type of `logdex-index`.
//!
//! Variants carry the context needed to act on them (group, sizes, what was
//! being done). `Poisoned` and `Storage` both mean "restart and recover";
//! `KeyTooLong` is bad input; `Corrupt*` and `UnsupportedFormat` mean the index
//! must be rebuilt from the log.

use crate::GroupId;
use std::path::PathBuf;

/// Result alias of this crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything that can go wrong in the key index.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A config field is out of range; nothing was opened.
    #[error("invalid index config: {field} = {value}: {reason}")]
    InvalidConfig {
        /// Name of the `IndexConfig` field.
        field: &'static str,
        /// The rejected value.
        value: u64,
        /// What the field must satisfy.
        reason: &'static str,
    },

    /// A key is longer than `IndexConfig::key_bytes_max`; nothing of the
    /// request was written.
    #[error("group {group}: key of {len} bytes exceeds key_bytes_max {max}")]
    KeyTooLong {
        /// The group the key was for.
        group: GroupId,
        /// Length of the rejected key.
        len: usize,
        /// The configured limit.
        max: usize,
    },

    /// The index directory's `layout` file (its shard count) cannot be read or written.
    #[error("index layout at {path}: {reason}")]
    Layout {
        /// Index directory.
        path: PathBuf,
        /// What is wrong with it.
        reason: String,
    },

    /// A shard's database could not be opened: the thread opening it panicked.
    #[error("opening the index shard at {path} panicked")]
    OpenPanicked {
        /// The shard's directory.
        path: PathBuf,
    },

    /// The fjall database at `path` could not be opened or created.
    #[error("cannot open the index at {path}: {source}")]
    Open {
        /// Index directory.
        path: PathBuf,
        /// The underlying fjall error.
        #[source]
        source: fjall::Error,
    },

    /// A write or fsync failed earlier and fjall refuses further writes.
    /// Recovery is a restart (reopen); never retry.
    #[error("index is poisoned by an earlier failed write or fsync (during {op})")]
    Poisoned {
        /// The operation that observed the poisoning.
        op: &'static str,
    },

    /// fjall or I/O failed.
    #[error("index storage failed during {op} (group {group:?}): {source}")]
    Storage {
        /// The operation that failed.
        op: &'static str,
        /// The group concerned, if any.
        group: Option<GroupId>,
        /// The underlying fjall error.
        #[source]
        source: fjall::Error,
    },

    /// The database at `path` was written with a format this build does not read.
    #[error("index at {path} has format version {found}, this build reads {expected}")]
    UnsupportedFormat {
        /// Index directory.
        path: PathBuf,
        /// Version byte found in the meta keyspace.
        found: u8,
        /// Version this build writes and reads.
        expected: u8,
    },

    /// The group's entries were rebuilt, replaced or dropped while an [`crate::IndexView`] of
    /// them was read: the view cannot answer for the new ones.
    #[error("group {group}: its index entries changed generation while a view of them was read")]
    ViewStale {
        /// The group viewed.
        group: GroupId,
    },

    /// A record in the meta keyspace does not decode.
    #[error("corrupt meta record {record} (group {group:?}): {len} bytes")]
    CorruptMeta {
        /// Which record (`"generation"`, `"applied"`, `"watermark"`, ...).
        record: &'static str,
        /// The group, if the record belongs to one.
        group: Option<GroupId>,
        /// Length of the stored value or key.
        len: usize,
    },

    /// An entry of the data keyspace does not decode (value not 1..=8 bytes).
    #[error("corrupt index entry in group {group}: value of {len} bytes")]
    CorruptEntry {
        /// The group the entry belongs to.
        group: GroupId,
        /// Length of the stored value.
        len: usize,
    },

    /// All 2^32 - 1 generation numbers of this node were used.
    #[error("generation numbers exhausted (group {group})")]
    GenerationsExhausted {
        /// The group that asked for one.
        group: GroupId,
    },

    /// The background maintenance thread could not be started.
    #[error("cannot spawn the index maintenance thread: {source}")]
    Spawn {
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
}

impl Error {
    /// Wraps a fjall error, keeping poisoning as its own variant.
    pub(crate) fn storage(op: &'static str, group: Option<GroupId>, source: fjall::Error) -> Self {
        match source {
            fjall::Error::Poisoned => Self::Poisoned { op },
            source => Self::Storage { op, group, source },
        }
    }
}

/// `map_err` helper: `.map_err(fjall_err("apply", Some(group)))`.
pub(crate) fn fjall_err(op: &'static str, group: Option<GroupId>) -> impl FnOnce(fjall::Error) -> Error {
    move |source| Error::storage(op, group, source)
}
