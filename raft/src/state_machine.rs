//! The state machine of every group: a partition replica or the controller.
//!
//! To ensure correctness:
//! - every entry is recorded as applied, blank and membership entries too, and
//!   every responder gets an answer (or `client_write` would never return);
//! - `applied_state` reports only what recovery will find again: for a
//!   partition, the marker stored in the index with the records it covers; for
//!   the controller, the state file written after each applied chunk.

use std::io;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::RwLock;
use std::time::SystemTime;
use std::time::UNIX_EPOCH;

use futures::Stream;
use futures::TryStreamExt;
use openraft::EntryPayload;
use openraft::RaftSnapshotBuilder;
use openraft::storage::EntryResponder;
use openraft::storage::RaftStateMachine;

use crate::controller::ClusterState;
use crate::error::to_io;
use crate::partition::AppliedState;
use crate::partition::Partition;
use crate::pb;
use crate::types::LogId;
use crate::types::SnapshotMeta;
use crate::types::StoredMembership;
use crate::types::TypeConfig;

/// Snapshot payload. Snapshots are not built yet (the Raft log is kept whole,
/// see ARCHITECTURE.md), so this type is never constructed.
pub type SnapshotData = std::io::Cursor<Vec<u8>>;

/// The controller's replicated state and where it is persisted.
pub struct Controller {
    dir: PathBuf,
    state: RwLock<ClusterState>,
    changed: tokio::sync::watch::Sender<u64>,
}

impl Controller {
    pub fn open(dir: PathBuf) -> crate::Result<Arc<Controller>> {
        std::fs::create_dir_all(&dir)?;
        let state = ClusterState::load(&dir)?;
        let (changed, _) = tokio::sync::watch::channel(0);
        Ok(Arc::new(Controller { dir, state: RwLock::new(state), changed }))
    }

    /// A copy of the current state.
    pub fn state(&self) -> ClusterState {
        self.state.read().map(|s| s.clone()).unwrap_or_default()
    }

    /// Reads the state without copying it.
    pub fn with_state<T>(&self, f: impl FnOnce(&ClusterState) -> T) -> Option<T> {
        self.state.read().ok().map(|s| f(&s))
    }

    /// Notified after every applied chunk of entries.
    pub fn subscribe(&self) -> tokio::sync::watch::Receiver<u64> {
        self.changed.subscribe()
    }
}

/// What a group's state machine applies to.
#[derive(Clone)]
pub enum GroupData {
    Controller(Arc<Controller>),
    Partition(Arc<Partition>),
}

pub struct GroupStateMachine {
    data: GroupData,
    state: AppliedState,
}

impl GroupStateMachine {
    pub fn new(data: GroupData, state: AppliedState) -> GroupStateMachine {
        GroupStateMachine { data, state }
    }

    pub fn for_controller(controller: Arc<Controller>) -> GroupStateMachine {
        let state = controller
            .with_state(|s| AppliedState { applied: s.applied.clone(), membership: s.membership.clone() })
            .unwrap_or_default();
        GroupStateMachine { data: GroupData::Controller(controller), state }
    }

    fn apply_partition(&mut self, partition: &Partition, entries: Vec<EntryResponder<TypeConfig>>) -> io::Result<()> {
        let mut batches = Vec::new();
        let mut batch_owner = Vec::with_capacity(entries.len());
        for (entry, _) in &entries {
            self.state.applied = Some(entry.log_id.clone());
            match &entry.payload {
                EntryPayload::Normal(pb::Command { kind: Some(pb::command::Kind::Produce(p)) }) => {
                    batch_owner.push(Some(batches.len()));
                    batches.push(p.batch.clone());
                }
                EntryPayload::Membership(m) => {
                    self.state.membership = StoredMembership::new(Some(entry.log_id.clone()), m.clone());
                    batch_owner.push(None);
                }
                _ => batch_owner.push(None),
            }
        }
        let appended = if batches.is_empty() {
            partition.apply_marker(&self.state).map_err(to_io)?;
            Vec::new()
        } else {
            partition.apply_batches(&mut batches, &self.state, now_ms()).map_err(to_io)?
        };
        for ((_, responder), owner) in entries.into_iter().zip(batch_owner) {
            let Some(responder) = responder else { continue };
            let kind = match owner.and_then(|i| appended.get(i)) {
                Some(a) => pb::command_response::Kind::Produce(pb::ProduceResult {
                    base_offset: a.base_offset,
                    last_offset: a.last_offset,
                    timestamp_ms: u64::try_from(a.timestamp_ms).unwrap_or(0),
                }),
                None => pb::command_response::Kind::None(pb::Blank {}),
            };
            responder.send(pb::CommandResponse { kind: Some(kind) });
        }
        Ok(())
    }

    fn apply_controller(
        &mut self,
        controller: &Controller,
        entries: Vec<EntryResponder<TypeConfig>>,
    ) -> io::Result<()> {
        let mut answers = Vec::with_capacity(entries.len());
        {
            let mut state = controller.state.write().map_err(|_| to_io("controller state lock poisoned"))?;
            for (entry, _) in &entries {
                state.applied = Some(entry.log_id.clone());
                let answer = match &entry.payload {
                    EntryPayload::Normal(pb::Command { kind: Some(pb::command::Kind::Controller(cmd)) }) => {
                        pb::command_response::Kind::Controller(state.apply(cmd))
                    }
                    EntryPayload::Membership(m) => {
                        state.membership = StoredMembership::new(Some(entry.log_id.clone()), m.clone());
                        pb::command_response::Kind::None(pb::Blank {})
                    }
                    _ => pb::command_response::Kind::None(pb::Blank {}),
                };
                answers.push(answer);
            }
            state.save(&controller.dir).map_err(to_io)?;
            self.state = AppliedState { applied: state.applied.clone(), membership: state.membership.clone() };
        }
        controller.changed.send_modify(|v| *v += 1);
        for ((_, responder), kind) in entries.into_iter().zip(answers) {
            if let Some(responder) = responder {
                responder.send(pb::CommandResponse { kind: Some(kind) });
            }
        }
        Ok(())
    }
}

pub fn now_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_millis() as u64).unwrap_or(0)
}

impl RaftStateMachine<TypeConfig> for GroupStateMachine {
    type SnapshotData = SnapshotData;
    type SnapshotBuilder = NoSnapshots;

    async fn applied_state(&mut self) -> Result<(Option<LogId>, StoredMembership), io::Error> {
        Ok((self.state.applied.clone(), self.state.membership.clone()))
    }

    async fn apply<Strm>(&mut self, mut entries: Strm) -> Result<(), io::Error>
    where
        Strm: Stream<Item = Result<EntryResponder<TypeConfig>, io::Error>> + Unpin + Send,
    {
        let mut chunk = Vec::new();
        while let Some(item) = entries.try_next().await? {
            chunk.push(item);
        }
        if chunk.is_empty() {
            return Ok(());
        }
        match self.data.clone() {
            GroupData::Partition(p) => self.apply_partition(&p, chunk),
            GroupData::Controller(c) => self.apply_controller(&c, chunk),
        }
    }

    async fn try_create_snapshot_builder(&mut self, _force: bool) -> Option<Self::SnapshotBuilder> {
        None
    }

    async fn get_snapshot_builder(&mut self) -> Self::SnapshotBuilder {
        NoSnapshots
    }

    async fn install_snapshot(&mut self, _meta: &SnapshotMeta, _snapshot: SnapshotData) -> Result<(), io::Error> {
        Err(io::Error::new(io::ErrorKind::Unsupported, "snapshot install is not supported yet"))
    }

    async fn get_current_snapshot(
        &mut self,
    ) -> Result<Option<openraft::alias::SnapshotOf<TypeConfig, SnapshotData>>, io::Error> {
        Ok(None)
    }
}

/// Snapshot builder of a configuration that never builds snapshots
/// (`SnapshotPolicy::Never`); building one is an error.
pub struct NoSnapshots;

impl RaftSnapshotBuilder<TypeConfig> for NoSnapshots {
    type SnapshotData = SnapshotData;

    async fn build_snapshot(&mut self) -> Result<openraft::alias::SnapshotOf<TypeConfig, SnapshotData>, io::Error> {
        Err(io::Error::new(io::ErrorKind::Unsupported, "snapshots are not built: the Raft log is kept whole"))
    }
}
