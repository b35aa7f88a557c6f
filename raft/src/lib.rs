//! logdex replication: every partition replica and the cluster controller are
//! openraft groups on one node.
//!
//! - [`types`]: the openraft type configuration and the only place that names
//!   openraft's generic types (the adapter: an alpha bump touches this module
//!   and the storage/network trait impls only).
//! - [`wire`]: protobuf <-> openraft conversions, used by storage and transport.
//! - [`log_store`]: the Raft log: one fjall database per node, group-committed fsync.
//! - [`state_machine`]: applies committed entries to the segment log and key index
//!   (partitions) or to cluster metadata (controller).
//! - [`network`] and [`service`]: the tonic transport, one pooled channel per peer.
//! - [`node`]: the multi-raft registry, reconciler and the operations the API calls.

pub mod balance;
pub mod batcher;
pub mod calls;
pub mod coalesce;
pub mod controller;
pub mod error;
pub mod fsync_trace;
pub mod log_store;
pub mod network;
pub mod node;
pub mod partition;
pub mod record_cache;
pub mod service;
pub mod snapshot;
pub mod state_machine;
pub mod tier;
pub mod types;
pub mod wire;

pub mod pb {
    //! Generated from `raft/proto/raft.proto`.
    #![allow(clippy::all, missing_docs)]
    tonic::include_proto!("logdex.raft.v1");
}

pub use error::{Error, Result};
