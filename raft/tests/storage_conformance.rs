//! openraft's storage conformance suite against logdex's Raft log storage
//! (fjall, group-committed) and the partition state machine (segment log +
//! key index + directory snapshots).

use std::sync::Arc;

use logdex_index::Index;
use logdex_index::IndexConfig;
use logdex_log::LogConfig;
use logdex_raft::log_store::GroupLogStore;
use logdex_raft::log_store::RaftLogDb;
use logdex_raft::partition::Partition;
use logdex_raft::snapshot::SnapshotStore;
use logdex_raft::state_machine::GroupData;
use logdex_raft::state_machine::GroupStateMachine;
use logdex_raft::types::TypeConfig;
use openraft::StorageError;
use openraft::testing::log::StoreBuilder;
use openraft::testing::log::Suite;

struct Builder;

fn storage_error(e: impl std::fmt::Display) -> StorageError<TypeConfig> {
    StorageError::from_io_error(
        openraft::ErrorSubject::Store,
        openraft::ErrorVerb::Read,
        std::io::Error::other(e.to_string()),
    )
}

impl StoreBuilder<TypeConfig, GroupLogStore, GroupStateMachine, tempfile::TempDir> for Builder {
    async fn build(&self) -> Result<(tempfile::TempDir, GroupLogStore, GroupStateMachine), StorageError<TypeConfig>> {
        let dir = tempfile::tempdir().map_err(storage_error)?;
        let db = RaftLogDb::open(&dir.path().join("raft"), logdex_raft::log_store::GROUP_COMMIT_WAIT_LOADED_DEFAULT)
            .map_err(storage_error)?;
        let index = Index::open(&dir.path().join("index"), IndexConfig::default()).map_err(storage_error)?;
        let partition_dir = dir.path().join("partition");
        let (partition, state) =
            Partition::open(7, 1, &partition_dir, LogConfig::default(), index).map_err(storage_error)?;
        let snapshots = SnapshotStore::open(partition_dir.join("snapshots")).map_err(storage_error)?;
        let sm = GroupStateMachine::new(GroupData::Partition(Arc::new(partition)), state, snapshots);
        Ok((dir, db.group(1), sm))
    }
}

/// Runs every test of `openraft::testing::log::Suite` (log state, votes,
/// purge, truncate, append, membership recovery, snapshot build and transfer).
#[test]
fn raft_storage_passes_openraft_conformance_suite() -> Result<(), Box<dyn std::error::Error>> {
    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    runtime.block_on(Suite::test_all(Builder))?;
    Ok(())
}
