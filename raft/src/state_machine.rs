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
use crate::network::ClusterIdentity;
use crate::partition::AppliedState;
use crate::partition::Partition;
use crate::pb;
use crate::snapshot::SnapshotFiles;
use crate::snapshot::SnapshotStore;
use crate::snapshot::new_snapshot_id;
use crate::types::LogId;
use crate::types::SnapshotMeta;
use crate::types::StoredMembership;
use crate::types::TypeConfig;

/// Snapshot payload: a directory of files (see [`crate::snapshot`]).
pub type SnapshotData = SnapshotFiles;

/// The controller's replicated state and where it is persisted.
pub struct Controller {
    dir: PathBuf,
    /// Copy-on-write: readers take the `Arc`, apply swaps in a new state.
    state: RwLock<Arc<ClusterState>>,
    changed: tokio::sync::watch::Sender<u64>,
    /// The cluster's id as the applied state names it, for node-to-node calls.
    identity: ClusterIdentity,
}

impl Controller {
    pub fn open(dir: PathBuf) -> crate::Result<Arc<Controller>> {
        std::fs::create_dir_all(&dir)?;
        let state = ClusterState::load(&dir)?;
        let (changed, _) = tokio::sync::watch::channel(0);
        let identity = ClusterIdentity::default();
        identity.learn(&state);
        Ok(Arc::new(Controller { dir, state: RwLock::new(Arc::new(state)), changed, identity }))
    }

    /// The cluster's id, learnt as the state that names it is applied.
    pub fn identity(&self) -> ClusterIdentity {
        self.identity.clone()
    }

    /// A copy of the current state.
    /// The current state (cheap: a shared reference).
    pub fn state(&self) -> Arc<ClusterState> {
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
    snapshots: Arc<SnapshotStore>,
}

impl GroupStateMachine {
    pub fn new(data: GroupData, state: AppliedState, snapshots: SnapshotStore) -> GroupStateMachine {
        GroupStateMachine { data, state, snapshots: Arc::new(snapshots) }
    }

    pub fn for_controller(controller: Arc<Controller>) -> crate::Result<GroupStateMachine> {
        let state = controller
            .with_state(|s| AppliedState { applied: s.applied, membership: s.membership.clone() })
            .unwrap_or_default();
        let snapshots = SnapshotStore::open(controller.dir.join("snapshots"))?;
        Ok(GroupStateMachine::new(GroupData::Controller(controller), state, snapshots))
    }

    /// Stages a snapshot of the applied state; runs in the state machine task,
    /// so nothing is applied meanwhile.
    fn stage_snapshot(&self) -> crate::Result<SnapshotBuilder> {
        let started = std::time::Instant::now();
        let id = new_snapshot_id(self.state.applied.as_ref());
        let staged = self.snapshots.staging(&id)?;
        match &self.data {
            GroupData::Partition(p) => p.snapshot_to(&staged, &self.state)?,
            GroupData::Controller(c) => c.state().save(&staged)?,
        }
        let meta = SnapshotMeta { last_log_id: self.state.applied, last_membership: self.state.membership.clone() };
        tracing::debug!(snapshot = %id, elapsed_us = started.elapsed().as_micros() as u64, "snapshot staged");
        Ok(SnapshotBuilder { snapshots: self.snapshots.clone(), staged, id, meta })
    }

    fn apply_partition(
        &mut self,
        partition: &Partition,
        mut entries: Vec<EntryResponder<TypeConfig>>,
    ) -> io::Result<()> {
        // Produce batches go to the log together, as one append; what each batch became, by
        // its place among the chunk's batches.
        let mut batches = Vec::new();
        let mut appended = Vec::new();
        let mut batch_owner = Vec::with_capacity(entries.len());
        for (entry, _) in entries.iter_mut() {
            match &mut entry.payload {
                EntryPayload::Normal(pb::Command { kind: Some(pb::command::Kind::Produce(p)) }) => {
                    batch_owner.push(Some(appended.len() + batches.len()));
                    batches.push(std::mem::take(&mut p.batch));
                }
                EntryPayload::Normal(pb::Command { kind: Some(pb::command::Kind::Tier(t)) }) => {
                    // A trim or an upload refers to the records of the entries before it: those
                    // of this chunk go to the log first (a follower catching up applies many
                    // entries at once, and a trim applied ahead of them deleted nothing of them).
                    if !batches.is_empty() {
                        appended.extend(partition.apply_batches(&mut batches, &self.state, now_ms()).map_err(to_io)?);
                        batches.clear();
                    }
                    // Idempotent when re-applied.
                    partition.apply_tier(t, entry.log_id.index).map_err(to_io)?;
                    batch_owner.push(None);
                }
                EntryPayload::Membership(m) => {
                    crash_point_apply_membership();
                    self.state.membership = StoredMembership::new(Some(entry.log_id), m.clone());
                    batch_owner.push(None);
                }
                _ => batch_owner.push(None),
            }
            // After the entry: the batches applied before a tier command record the entry
            // before it as applied.
            self.state.applied = Some(entry.log_id);
        }
        if batches.is_empty() {
            partition.apply_marker(&self.state).map_err(to_io)?;
        } else {
            appended.extend(partition.apply_batches(&mut batches, &self.state, now_ms()).map_err(to_io)?);
        }
        for ((_, responder), owner) in entries.into_iter().zip(batch_owner) {
            let Some(responder) = responder else { continue };
            let kind = match owner.and_then(|i| appended.get(i)) {
                Some(Ok(a)) => pb::command_response::Kind::Produce(pb::ProduceResult {
                    base_offset: a.base_offset,
                    last_offset: a.last_offset,
                    timestamp_ms: u64::try_from(a.timestamp_ms).unwrap_or(0),
                    error: String::new(),
                }),
                Some(Err(reason)) => pb::command_response::Kind::Produce(pb::ProduceResult {
                    error: reason.clone(),
                    ..Default::default()
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
            let mut guard = controller.state.write().map_err(|_| to_io("controller state lock poisoned"))?;
            let state = Arc::make_mut(&mut guard);
            for (entry, _) in &entries {
                state.applied = Some(entry.log_id);
                let answer = match &entry.payload {
                    EntryPayload::Normal(pb::Command { kind: Some(pb::command::Kind::Controller(cmd)) }) => {
                        pb::command_response::Kind::Controller(state.apply(cmd))
                    }
                    EntryPayload::Membership(m) => {
                        crash_point_apply_membership();
                        state.membership = StoredMembership::new(Some(entry.log_id), m.clone());
                        pb::command_response::Kind::None(pb::Blank {})
                    }
                    _ => pb::command_response::Kind::None(pb::Blank {}),
                };
                answers.push(answer);
            }
            state.save(&controller.dir).map_err(to_io)?;
            controller.identity.learn(state);
            self.state = AppliedState { applied: state.applied, membership: state.membership.clone() };
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

/// Crash point (test builds with the `failpoints` feature; nothing otherwise): a group's
/// state machine is applying a membership entry, and neither it nor the entries of its chunk
/// are recorded as applied yet (the partition's index marker, the controller's state file).
fn crash_point_apply_membership() {
    fail::fail_point!("state_machine::apply_membership");
}

pub fn now_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_millis() as u64).unwrap_or(0)
}

impl RaftStateMachine<TypeConfig> for GroupStateMachine {
    type SnapshotData = SnapshotData;
    type SnapshotBuilder = SnapshotBuilder;

    async fn applied_state(&mut self) -> Result<(Option<LogId>, StoredMembership), io::Error> {
        Ok((self.state.applied, self.state.membership.clone()))
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
        // Staging fsyncs the segment log, the index and the new snapshot's files: the worker
        // thread hands its other tasks (every other group of the node, the requests) to
        // another thread meanwhile instead of stalling them.
        match crate::tier::blocking(|| self.stage_snapshot()) {
            Ok(b) => Some(b),
            Err(e) => {
                tracing::error!(error = %e, "cannot stage a snapshot");
                None
            }
        }
    }

    async fn get_snapshot_builder(&mut self) -> Self::SnapshotBuilder {
        // Deprecated entry point; openraft calls try_create_snapshot_builder.
        let id = new_snapshot_id(self.state.applied.as_ref());
        SnapshotBuilder {
            snapshots: self.snapshots.clone(),
            staged: PathBuf::new(),
            id,
            meta: SnapshotMeta { last_log_id: None, last_membership: StoredMembership::default() },
        }
    }

    async fn install_snapshot(&mut self, meta: &SnapshotMeta, snapshot: SnapshotData) -> Result<(), io::Error> {
        match &self.data {
            GroupData::Partition(p) => {
                // Reads every file of the snapshot, installs it and rebuilds the index from
                // its log: seconds for a large partition, during which the worker thread hands
                // the node's other tasks to another thread (as when staging a snapshot).
                let snapshots = &self.snapshots;
                let state = crate::tier::blocking(|| -> Result<AppliedState, io::Error> {
                    // Before it becomes this replica's current snapshot (which replaces the
                    // previous one): a damaged snapshot must leave the replica as it was.
                    p.verify_snapshot(&snapshot.dir).map_err(to_io)?;
                    let adopted = snapshots.adopt(&snapshot, meta).map_err(to_io)?;
                    // Verified above, before it was adopted.
                    p.install_verified_snapshot(&adopted.dir).map_err(to_io)
                })?;
                self.state = state;
            }
            GroupData::Controller(c) => {
                let adopted = self.snapshots.adopt(&snapshot, meta).map_err(to_io)?;
                let mut installed = ClusterState::load(&adopted.dir).map_err(to_io)?;
                installed.applied = meta.last_log_id;
                installed.membership = meta.last_membership.clone();
                installed.save(&c.dir).map_err(to_io)?;
                c.identity.learn(&installed);
                *c.state.write().map_err(|_| to_io("controller state lock poisoned"))? = Arc::new(installed);
                c.changed.send_modify(|v| *v += 1);
                self.state = AppliedState { applied: meta.last_log_id, membership: meta.last_membership.clone() };
            }
        }
        tracing::info!(last_log_id = ?meta.last_log_id, "snapshot installed");
        Ok(())
    }

    async fn get_current_snapshot(
        &mut self,
    ) -> Result<Option<openraft::alias::SnapshotOf<TypeConfig, SnapshotData>>, io::Error> {
        Ok(self.snapshots.current().map_err(to_io)?.map(|(meta, snapshot)| openraft::alias::SnapshotOf::<
            TypeConfig,
            SnapshotData,
        > {
            meta,
            snapshot,
        }))
    }
}

/// Finishes a snapshot staged by the state machine: commits it as current.
pub struct SnapshotBuilder {
    snapshots: Arc<SnapshotStore>,
    staged: PathBuf,
    id: String,
    meta: SnapshotMeta,
}

impl RaftSnapshotBuilder<TypeConfig> for SnapshotBuilder {
    type SnapshotData = SnapshotData;

    async fn build_snapshot(&mut self) -> Result<openraft::alias::SnapshotOf<TypeConfig, SnapshotData>, io::Error> {
        if self.staged.as_os_str().is_empty() {
            return Err(io::Error::other("snapshot builder was not staged"));
        }
        let files = self.snapshots.commit(&self.staged, &self.id, &self.meta).map_err(to_io)?;
        tracing::info!(snapshot = %self.id, last_log_id = ?self.meta.last_log_id, "snapshot built");
        Ok(openraft::alias::SnapshotOf::<TypeConfig, SnapshotData> { meta: self.meta.clone(), snapshot: files })
    }
}
