//! The openraft type configuration of every logdex group.

use std::fmt;

use crate::pb;

/// Id of one Raft group on the cluster. Group 0 is the controller.
pub type GroupId = u64;
/// Raft node id of one replica of one group: fresh for every placement.
pub type ReplicaId = u64;
/// Id of one `logdex serve` process.
pub type NodeId = u64;

/// The controller group.
pub const CONTROLLER_GROUP: GroupId = 0;

openraft::declare_raft_types!(
    /// Type configuration shared by the controller and every partition group.
    pub TypeConfig:
        D = pb::Command,
        R = pb::CommandResponse,
        NodeId = ReplicaId,
        Node = pb::Node,
        LeaderId = openraft::impls::leader_id_std::LeaderId<u64, ReplicaId>,
);

pub type LogId = openraft::alias::LogIdOf<TypeConfig>;
pub type Vote = openraft::alias::VoteOf<TypeConfig>;
pub type Entry = openraft::alias::EntryOf<TypeConfig>;
pub type EntryPayload = openraft::alias::EntryPayloadOf<TypeConfig>;
pub type Membership = openraft::Membership<ReplicaId, pb::Node>;
pub type StoredMembership = openraft::alias::StoredMembershipOf<TypeConfig>;
pub type SnapshotMeta = openraft::alias::SnapshotMetaOf<TypeConfig>;
pub type RaftMetrics = openraft::RaftMetrics<TypeConfig>;
pub type IoFlushed = openraft::storage::IOFlushed<TypeConfig>;
pub type LogState = openraft::storage::LogState<TypeConfig>;
pub type RpcError = openraft::errors::RPCError<TypeConfig>;
pub type StreamingError = openraft::errors::StreamingError<TypeConfig>;
pub type RaftError<E = openraft::errors::Infallible> = openraft::errors::RaftError<TypeConfig, E>;
pub type ClientWriteError = openraft::errors::ClientWriteError<TypeConfig>;
pub type Raft = openraft::Raft<TypeConfig, crate::state_machine::GroupStateMachine>;

pub use openraft::type_config::async_runtime::WatchReceiver;

/// A copy of a group's current metrics.
pub fn metrics_of(raft: &Raft) -> RaftMetrics {
    raft.metrics().borrow_watched().clone()
}

impl fmt::Display for pb::Command {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.kind {
            Some(pb::command::Kind::Produce(p)) => write!(f, "produce({} bytes)", p.batch.len()),
            Some(pb::command::Kind::Controller(c)) => write!(f, "controller({:?})", c.kind),
            Some(pb::command::Kind::Tier(t)) => write!(f, "tier({:?})", t.kind),
            None => write!(f, "empty"),
        }
    }
}

impl fmt::Display for pb::Node {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "node {} at {}", self.node_id, self.rpc_addr)
    }
}
