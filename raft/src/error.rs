//! Errors of the replication layer.
//!
//! Internally each storage engine keeps its own error; at this crate's public
//! boundary they become a small set of kinds the API maps to status codes.

use crate::types::GroupId;
use crate::types::NodeId;

pub type Result<T, E = Error> = std::result::Result<T, E>;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// This replica is not the leader; the leader's node, when known.
    #[error("not the leader of group {group}; leader: {}", leader_text(.leader_node))]
    NotLeader { group: GroupId, leader_node: Option<NodeId> },
    /// This node hosts no replica of the group.
    #[error("group {group} is not hosted on this node")]
    NotHosted { group: GroupId },
    /// A forwarded request never reached the node it was sent to: safe to retry.
    #[error("node unreachable: {0}")]
    NodeUnreachable(String),
    /// The group cannot answer now (no leader, shutting down, timed out); retry later.
    #[error("unavailable: {0}")]
    Unavailable(String),
    /// The operation did not finish within its deadline; it may still take effect.
    #[error("timed out: {0}")]
    Timeout(String),
    /// The request is invalid.
    #[error("invalid: {0}")]
    Invalid(String),
    /// A write's record batch exceeds the topic's `max.message.bytes`.
    #[error("too large: {0}")]
    TooLarge(String),
    /// A named thing does not exist.
    #[error("not found: {0}")]
    NotFound(String),
    /// The request conflicts with existing state.
    #[error("conflict: {0}")]
    Conflict(String),
    /// Stored data failed a check.
    #[error("corrupted: {0}")]
    Corrupted(String),
    /// A partition replica's data failed a check on read (the key index points at a record
    /// the segment log does not hold, or holds under another key); the replica refuses to
    /// answer from it. Damage the segment log finds itself is [`Error::Log`] with
    /// [`logdex_log::Error::Corrupt`]: see [`Error::is_corrupt_data`].
    #[error("corrupt data in group {group}: {detail}")]
    CorruptData { group: GroupId, detail: String },
    /// A read or an index rebuild needs remote segments (tiered storage) that are not in
    /// this replica's cache yet: the async caller fetches them and tries again.
    #[error("group {group}: {} remote segment(s) not fetched yet", segments.len())]
    TierMiss { group: GroupId, segments: Vec<crate::tier::RemoteSegment> },
    #[error("segment log: {0}")]
    Log(#[from] logdex_log::Error),
    #[error("key index: {0}")]
    Index(#[from] logdex_index::Error),
    #[error("raft log storage: {0}")]
    RaftLog(#[from] fjall::Error),
    #[error("io: {0}")]
    Io(#[from] std::io::Error),
    #[error("wire: {0}")]
    Wire(#[from] crate::wire::WireError),
}

impl Error {
    pub fn unavailable(msg: impl std::fmt::Display) -> Self {
        Error::Unavailable(msg.to_string())
    }

    /// The error a peer reported as unavailable in `message` (its own
    /// `unavailable: ` prefix dropped, so it is not said twice).
    pub fn remote_unavailable(message: &str) -> Self {
        Error::Unavailable(message.strip_prefix("unavailable: ").unwrap_or(message).to_string())
    }

    /// The same error for another caller that shared the operation (a batch, a read round):
    /// the kinds a caller acts on keep their kind; the rest become `Unavailable` with this
    /// error's text.
    pub fn duplicate(&self) -> Error {
        match self {
            Error::NotLeader { group, leader_node } => Error::NotLeader { group: *group, leader_node: *leader_node },
            Error::NotHosted { group } => Error::NotHosted { group: *group },
            Error::NodeUnreachable(m) => Error::NodeUnreachable(m.clone()),
            Error::Unavailable(m) => Error::Unavailable(m.clone()),
            Error::Timeout(m) => Error::Timeout(m.clone()),
            Error::Invalid(m) => Error::Invalid(m.clone()),
            Error::TooLarge(m) => Error::TooLarge(m.clone()),
            other => Error::Unavailable(other.to_string()),
        }
    }

    /// True when a replica refused to answer from damaged stored data (a batch failing its
    /// crc or framing, or the index and the log disagreeing): never a wrong answer, and the
    /// API says so with its own error code.
    pub fn is_corrupt_data(&self) -> bool {
        match self {
            Error::CorruptData { .. } => true,
            Error::Log(e) => e.is_corruption(),
            _ => false,
        }
    }
}

fn leader_text(leader: &Option<NodeId>) -> String {
    leader.map_or_else(|| "unknown".to_string(), |n| format!("node {n}"))
}

/// openraft's storage traits speak `std::io::Error`.
pub fn to_io(e: impl std::fmt::Display) -> std::io::Error {
    std::io::Error::other(e.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A shared failure keeps the kinds callers act on, and the text of the rest once.
    #[test]
    fn duplicate_keeps_the_kind_and_says_the_message_once() {
        let not_leader = Error::NotLeader { group: 3, leader_node: Some(2) };
        assert!(matches!(not_leader.duplicate(), Error::NotLeader { group: 3, leader_node: Some(2) }));
        assert!(matches!(Error::Timeout("t".into()).duplicate(), Error::Timeout(m) if m == "t"));
        let unavailable = Error::unavailable("no leader").duplicate();
        assert_eq!(unavailable.to_string(), "unavailable: no leader");
        let corrupt = Error::Corrupted("bad crc".into()).duplicate();
        assert!(matches!(&corrupt, Error::Unavailable(m) if m == "corrupted: bad crc"), "{corrupt}");
    }
}
