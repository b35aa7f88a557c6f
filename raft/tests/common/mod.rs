//! Helpers shared by the partition tests.

use logdex_log::Record;
use logdex_raft::partition::AppliedState;
use logdex_raft::pb;

/// Record `i` (written at offset `i`): key `k{i % keys}`, value `v{i}-` and 40 bytes more.
pub fn record(i: u64, keys: u64) -> Record {
    Record {
        timestamp_ms: 1_700_000_000_000 + i as i64,
        key: Some(format!("k{}", i % keys).into_bytes()),
        value: Some(format!("v{i}-{}", "x".repeat(40)).into_bytes()),
        headers: Vec::new(),
    }
}

/// The applied state after Raft entry `entry` (term 1).
pub fn applied(entry: u64) -> AppliedState {
    let log_id = logdex_raft::wire::log_id_from_pb(&pb::LogId { term: 1, index: entry });
    AppliedState { applied: Some(log_id), ..AppliedState::default() }
}
