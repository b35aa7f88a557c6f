//! Conversions between openraft's types and the protobuf messages of
//! `raft/proto/raft.proto`, for the transport and the Raft log's disk format.
//!
//! Decoding is strict: a message missing a required field is a typed
//! [`WireError`], never a panic.

use std::collections::BTreeMap;
use std::collections::BTreeSet;

use openraft::EntryPayload;
use openraft::entry::RaftEntry;
use openraft::vote::RaftLeaderId;

use crate::pb;
use crate::types::Entry;
use crate::types::LogId;
use crate::types::Membership;
use crate::types::Vote;

/// A protobuf message that cannot be turned into the openraft value it encodes.
#[derive(Debug, thiserror::Error)]
pub enum WireError {
    #[error("message {message} lacks required field {field}")]
    Missing { message: &'static str, field: &'static str },
    #[error("invalid membership: {0}")]
    Membership(String),
    #[error("undecodable protobuf: {0}")]
    Decode(#[from] prost::DecodeError),
}

pub fn log_id_to_pb(log_id: &LogId) -> pb::LogId {
    pb::LogId { term: log_id.leader_id.term, index: log_id.index }
}

pub fn log_id_from_pb(log_id: &pb::LogId) -> LogId {
    LogId::new(openraft::vote::leader_id_std::CommittedLeaderId::new(log_id.term), log_id.index)
}

pub fn opt_log_id_to_pb(log_id: Option<&LogId>) -> Option<pb::LogId> {
    log_id.map(log_id_to_pb)
}

pub fn opt_log_id_from_pb(log_id: Option<&pb::LogId>) -> Option<LogId> {
    log_id.map(log_id_from_pb)
}

pub fn vote_to_pb(vote: &Vote) -> pb::Vote {
    pb::Vote { term: vote.leader_id.term, voted_for: *vote.leader_id.node_id(), committed: vote.committed }
}

pub fn vote_from_pb(vote: &pb::Vote) -> Vote {
    let mut v = Vote::new(vote.term, vote.voted_for);
    v.committed = vote.committed;
    v
}

pub fn required<T>(value: Option<T>, message: &'static str, field: &'static str) -> Result<T, WireError> {
    value.ok_or(WireError::Missing { message, field })
}

pub fn membership_to_pb(membership: &Membership) -> pb::Membership {
    let configs =
        membership.get_joint_config().iter().map(|set| pb::NodeIdSet { ids: set.iter().copied().collect() }).collect();
    let nodes = membership.nodes().map(|(id, node)| (*id, node.clone())).collect();
    pb::Membership { configs, nodes }
}

pub fn membership_from_pb(membership: &pb::Membership) -> Result<Membership, WireError> {
    let configs: Vec<BTreeSet<u64>> = membership.configs.iter().map(|set| set.ids.iter().copied().collect()).collect();
    let nodes: BTreeMap<u64, pb::Node> = membership.nodes.iter().map(|(k, v)| (*k, v.clone())).collect();
    Membership::new(configs, nodes).map_err(|e| WireError::Membership(e.to_string()))
}

pub fn entry_to_pb(entry: &Entry) -> pb::Entry {
    let payload = match &entry.payload {
        EntryPayload::Blank => pb::entry::Payload::Blank(pb::Blank {}),
        EntryPayload::Normal(cmd) => pb::entry::Payload::Normal(cmd.clone()),
        EntryPayload::Membership(m) => pb::entry::Payload::Membership(membership_to_pb(m)),
    };
    pb::Entry { log_id: Some(log_id_to_pb(&entry.log_id)), payload: Some(payload) }
}

pub fn entry_from_pb(entry: pb::Entry) -> Result<Entry, WireError> {
    let log_id = log_id_from_pb(&required(entry.log_id, "Entry", "log_id")?);
    let payload = match required(entry.payload, "Entry", "payload")? {
        pb::entry::Payload::Blank(_) => EntryPayload::Blank,
        pb::entry::Payload::Normal(cmd) => EntryPayload::Normal(cmd),
        pb::entry::Payload::Membership(m) => EntryPayload::Membership(membership_from_pb(&m)?),
    };
    Ok(Entry::new(log_id, payload))
}

pub fn entries_from_pb(entries: Vec<pb::Entry>) -> Result<Vec<Entry>, WireError> {
    entries.into_iter().map(entry_from_pb).collect()
}

pub fn record_to_pb(r: &logdex_log::Record) -> pb::ProduceRecord {
    pb::ProduceRecord {
        key: r.key.clone(),
        value: r.value.clone(),
        headers: r.headers.iter().map(|h| pb::RecordHeader { key: h.key.clone(), value: h.value.clone() }).collect(),
        timestamp_ms: r.timestamp_ms,
    }
}

pub fn record_from_pb(r: pb::ProduceRecord) -> logdex_log::Record {
    logdex_log::Record {
        timestamp_ms: r.timestamp_ms,
        key: r.key,
        value: r.value,
        headers: r.headers.into_iter().map(|h| logdex_log::Header { key: h.key, value: h.value }).collect(),
    }
}
