//! One logdex node's replication layer: the controller replica, the registry
//! of partition replicas, the reconciler that makes them match the controller's
//! assignments, and the operations the API calls.

use std::collections::BTreeMap;
use std::collections::HashMap;
use std::collections::HashSet;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::RwLock;
use std::time::Duration;

use futures::StreamExt as _;
use logdex_index::Index;
use logdex_index::IndexConfig;
use logdex_log::LogConfig;
use openraft::ReadPolicy;
use openraft::errors::ClientWriteError as OrClientWriteError;
use openraft::errors::RaftError as OrRaftError;

use crate::batcher::Batcher;
use crate::controller::ClusterState;
use crate::controller::PartitionRecord;
use crate::controller::ReplicaRecord;
use crate::controller::TierPolicy;
use crate::error::Error;
use crate::error::Result;
use crate::log_store::RaftLogDb;
use crate::network::ChannelPool;
use crate::network::CommitNoticeRelease;
use crate::network::NetworkFactory;
use crate::network::RPC_TIMEOUT;
use crate::partition::KeyRead;
use crate::partition::Partition;
use crate::pb;
use crate::snapshot::SnapshotStore;
use crate::state_machine::Controller;
use crate::state_machine::GroupData;
use crate::state_machine::GroupStateMachine;
use crate::tier::TierStore;
use crate::types::CONTROLLER_GROUP;
use crate::types::GroupId;
use crate::types::NodeId;
use crate::types::Raft;
use crate::types::ReplicaId;
use crate::wire;

/// Upper bound on controller voters (larger quorums only slow metadata writes).
pub const CONTROLLER_VOTERS_MAX: usize = 7;
/// Default number of controller voters.
pub const CONTROLLER_VOTERS_DEFAULT: usize = 3;
/// Default: a group snapshots after this many applied entries; its Raft log is
/// then purged up to the snapshot, keeping a fifth of that behind it.
pub const SNAPSHOT_EVERY_ENTRIES: u64 = 5000;
/// Replication factor of a topic created without one, when the cluster has that many nodes.
pub const DEFAULT_REPLICATION_FACTOR_MAX: u32 = 3;
/// Bound on one step of a partition move (a learner catching up, a membership change).
pub const MOVE_STEP_TIMEOUT: Duration = Duration::from_secs(120);
/// How long a write or a read waits for its group before answering unavailable.
pub const OPERATION_TIMEOUT: Duration = Duration::from_secs(10);

/// How long a node that had a controller write done elsewhere waits for its own controller
/// replica to apply it before it answers (normally milliseconds; longer only when this
/// replica lags, and then the answer shows its older view).
const CONTROLLER_CATCH_UP: Duration = Duration::from_secs(2);
/// Tries of a read whose remote segments must be fetched first (tiered storage).
const TIER_READ_ATTEMPTS: usize = 3;
/// Longest a read waits for one segment from the tiered store before it answers 503 (with
/// Retry-After; the fetch goes on): below a forwarding node's 5 s for a read.
const TIER_FETCH_WAIT: Duration = Duration::from_secs(4);
/// See [`fetch_segment`].
const TIER_FETCHES_PENDING_MAX: usize = 16;
/// How long a controller write (a topic create, an alter, a move) waits for the controller
/// group to elect a leader, as a partition write waits for its group's (8 s), before it
/// answers 503.
const CONTROLLER_LEADER_WAIT: Duration = Duration::from_secs(8);
/// How often the controller's leader looks again at its voters between applied changes
/// ([`Node::controller_voters_loop`]).
const CONTROLLER_MEMBERSHIP_CHECK: Duration = Duration::from_secs(2);
/// How often a controller write whose leader cannot be reached asks again (an election).
const CONTROLLER_RETRY: Duration = Duration::from_millis(100);
/// How long a `linearizable` or `strict` read waits for a leader that answers, beyond
/// the longest election timeout and one read-index call's deadline: a follower starts an
/// election only once the leader lease it granted (the longest election timeout) and then
/// its own election timeout have passed since the last heartbeat, and the new leader's
/// first heartbeat takes a little more. (8 s with the default timeouts, as
/// long as a write waits for a leader. Measured with the defaults, a follower served such
/// reads 4.6 to 6.0 s after its leader was killed or paused; a 6 s bound answered 503 in
/// 2 of 34 pauses, a 4 s bound in every test run.)
const READ_LEADER_WAIT_MARGIN: Duration = Duration::from_secs(3);
/// How often that wait looks again.
const LEADER_POLL: Duration = Duration::from_millis(20);
/// Bytes of sealed segments the scrub reads per cleaner pass, over all of a node's replicas
/// (`--cleaner-interval-ms`, 30 s by default: about 8 MiB/s at most, and nothing once every
/// segment is checked).
const SCRUB_BYTES_PER_PASS: u64 = 256 << 20;
/// Least time between two leadership hand-offs of one damaged group (a refused snapshot is
/// sent again, with backoff, until a healthy replica leads).
const DAMAGE_HANDOFF_INTERVAL: Duration = Duration::from_secs(5);

/// How often follower reads asked a leader for a read index, and how many requests to
/// leaders that took (concurrent reads of a group share one).
#[derive(Default)]
pub struct ReadIndexStats {
    /// `linearizable` and `strict` reads served by a follower replica of this node.
    pub reads: std::sync::atomic::AtomicU64,
    /// Read-index requests this node sent to leaders for them.
    pub fetches: std::sync::atomic::AtomicU64,
}

/// Plain configuration of the replication layer; `api/` fills it.
#[derive(Clone, Debug)]
pub struct NodeConfig {
    pub node_id: NodeId,
    pub data_dir: PathBuf,
    /// Advertised node-to-node address.
    pub rpc_addr: String,
    /// Advertised HTTP address (other nodes forward and redirect to it).
    pub http_addr: String,
    /// Initial cluster: `(node id, rpc address)`, including this node.
    pub peers: Vec<(NodeId, String)>,
    /// A member's rpc address to join through, instead of `peers`.
    pub join: Option<String>,
    pub heartbeat_ms: u64,
    pub election_timeout_min_ms: u64,
    pub election_timeout_max_ms: u64,
    /// A group snapshots after this many applied entries and purges its Raft log behind it.
    pub snapshot_every_entries: u64,
    pub log: LogConfig,
    pub index: IndexConfig,
    /// Bearer token required on node-to-node RPC and sent with it, when set.
    pub rpc_token: Option<String>,
    /// How often compaction and retention look at every hosted log.
    pub cleaner_interval_ms: u64,
    /// Voters of the controller group at bootstrap: the lowest ids of the peer
    /// list, at most this many; the other nodes replicate it as learners.
    pub controller_voters: usize,
    /// Source IP of outgoing node-to-node connections, when set.
    pub rpc_source_ip: Option<std::net::IpAddr>,
    /// PEM certificates of the CA that signed the other nodes' certificates: set when the
    /// cluster runs TLS, and then every call to another node is HTTPS trusting only them.
    pub rpc_tls_ca_pem: Option<Vec<u8>>,
    /// The object store of tiered storage (a directory every node shares, or a `file://`
    /// URL); topics with `remote.storage.enable=true` copy their sealed segments there.
    pub tiered_store: Option<String>,
    /// Bytes of records (read by lookups or just applied) kept in memory for the next lookups
    /// of their keys (shared by every replica of the node; 0: none). See `crate::record_cache`.
    pub record_cache_bytes: u64,
    /// How long the Raft log's fsync thread waits for more appends before an fsync while
    /// the node is loaded (`crate::log_store`).
    pub group_commit_wait: Duration,
    /// How often this node's replicas that are their partition's preferred leader ask for
    /// the leadership when another node holds it (`crate::balance`); zero: never.
    pub leader_balance_interval: Duration,
}

impl NodeConfig {
    pub fn validate(&self) -> Result<()> {
        if self.node_id == 0 {
            return Err(Error::Invalid("node id must be at least 1".into()));
        }
        if self.snapshot_every_entries == 0 {
            return Err(Error::Invalid("snapshot interval must be at least 1 entry".into()));
        }
        if self.heartbeat_ms == 0 {
            return Err(Error::Invalid("heartbeat must be at least 1 ms".into()));
        }
        if self.election_timeout_min_ms <= self.heartbeat_ms.saturating_mul(2) {
            return Err(Error::Invalid("election timeout must exceed twice the heartbeat".into()));
        }
        if self.election_timeout_max_ms <= self.election_timeout_min_ms {
            return Err(Error::Invalid("election timeout max must exceed min".into()));
        }
        if self.group_commit_wait > crate::log_store::GROUP_COMMIT_WAIT_LOADED_MAX {
            return Err(Error::Invalid(format!(
                "group commit wait must be at most {} ms",
                crate::log_store::GROUP_COMMIT_WAIT_LOADED_MAX.as_millis()
            )));
        }
        if self.join.is_none() && !self.peers.iter().any(|(id, _)| *id == self.node_id) {
            return Err(Error::Invalid(format!("peer list must contain this node ({})", self.node_id)));
        }
        Ok(())
    }
}

/// Read consistency a caller asks for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReadMode {
    /// Leader lease or read index; a follower asks the leader for the read index.
    Linearizable,
    /// Always a quorum-confirmed read index.
    Strict,
    /// This replica's applied state, without contacting others.
    Follower,
}

/// A partition replica hosted on this node.
pub struct HostedGroup {
    pub group_id: GroupId,
    pub replica_id: ReplicaId,
    pub topic: String,
    pub partition_no: u32,
    pub raft: Raft,
    pub partition: Arc<Partition>,
    /// Batches concurrent produces into one entry while this replica leads.
    pub batcher: Batcher,
    /// Sends the commit notices this replica holds back as leader (a follower waits for one).
    pub commit_release: CommitNoticeRelease,
    /// Leader reads of this group waiting for a read linearizer.
    leader_reads: LeaderReads,
}

/// Read-index rounds to one leader node: each caller names its group.
type ReadIndexRounds = crate::coalesce::Coalescer<pb::GroupHeader>;

/// The reads of one group on its leader waiting for a read linearizer: lease reads, and
/// strict ones, each with the fetch that asks openraft for one (built once per group).
struct LeaderReads {
    rounds: [crate::coalesce::Coalescer<(), crate::types::LogId>; 2],
    fetch: [crate::coalesce::Fetch<(), crate::types::LogId>; 2],
}

impl LeaderReads {
    fn new(raft: &Raft, group: GroupId) -> LeaderReads {
        let fetch = |strict: bool| -> crate::coalesce::Fetch<(), crate::types::LogId> {
            let raft = raft.clone();
            Arc::new(move |reads: Vec<()>| {
                let raft = raft.clone();
                Box::pin(async move {
                    let read = leader_read_log_id(&raft, group, strict).await;
                    reads.iter().map(|_| read.as_ref().map(|l| *l).map_err(Error::duplicate)).collect()
                })
            })
        };
        LeaderReads { rounds: Default::default(), fetch: [fetch(false), fetch(true)] }
    }
}

impl HostedGroup {
    /// The log id a read on this replica, as leader, must wait for: a lease read unless
    /// `strict`. Concurrent reads of the group share one linearizer that openraft issued
    /// after all of them arrived, which is what each one alone would have waited for.
    pub async fn leader_read_log_id(&self, strict: bool) -> Result<crate::types::LogId> {
        let mode = usize::from(strict);
        self.leader_reads.rounds[mode].get((), self.leader_reads.fetch[mode].clone()).await
    }
}

/// The replication layer of one node. Cheap to clone.
#[derive(Clone)]
pub struct Node {
    inner: Arc<NodeInner>,
}

struct NodeInner {
    config: NodeConfig,
    raft_config: Arc<openraft::Config>,
    pool: Arc<ChannelPool>,
    /// Read-index and produce calls to peers, multiplexed on one stream per peer.
    calls: Arc<crate::calls::Calls>,
    raft_log: Arc<RaftLogDb>,
    index: Index,
    controller: Arc<Controller>,
    controller_raft: Raft,
    groups: RwLock<HashMap<GroupId, Arc<HostedGroup>>>,
    /// Groups whose move this node is driving now.
    moving: std::sync::Mutex<std::collections::HashSet<GroupId>>,
    /// Groups assigned here whose replica failed to start (retried by every reconcile).
    failed_starts: std::sync::Mutex<std::collections::HashSet<GroupId>>,
    forwarders: crate::batcher::Forwarders,
    read_index_stats: ReadIndexStats,
    /// Per leader node and `strict`: concurrent follower reads share one read-index call.
    read_index: std::sync::Mutex<HashMap<(NodeId, bool), Arc<ReadIndexRounds>>>,
    /// Groups whose follower refused this node's snapshot as damaged, for `damage_loop`.
    damage: crate::network::DamageReports,
    damage_reports: std::sync::Mutex<Option<tokio::sync::mpsc::Receiver<GroupId>>>,
    /// Snapshots received here and refused as damaged.
    damaged_snapshots_refused: std::sync::atomic::AtomicU64,
    /// Groups whose leadership this node handed away as damaged (`damage_loop`): its
    /// replicas of them never ask for the leadership back (`crate::balance`).
    damaged_handoffs: std::sync::Mutex<std::collections::HashSet<GroupId>>,
    /// Leaderships this node's leader replicas handed to a preferred replica that asked.
    leadership_handoffs: std::sync::atomic::AtomicU64,
    /// Tiered storage's object store, when configured.
    tier_store: Option<TierStore>,
    /// Records read by lookups or just applied, for every replica of the node.
    records: crate::record_cache::RecordCache,
    /// Per group, the trim point whose objects this node last collected.
    tier_collected: std::sync::Mutex<HashMap<GroupId, u64>>,
    stop: tokio::sync::watch::Sender<bool>,
    /// The data directory's incarnation (`node.json`), sent with the registration.
    incarnation: u64,
    /// A compaction of the Raft log and the index is due after replicas were removed
    /// ([`Node::reclaim_removed`]); held while one runs.
    reclaim_due: std::sync::atomic::AtomicBool,
    reclaiming: tokio::sync::Mutex<()>,
    /// Why the node cannot go on (its registration was refused), once it knows.
    fatal: tokio::sync::watch::Sender<Option<String>>,
    /// When a controller leader last reached this node's controller replica (an append or a
    /// heartbeat): a follower or learner names the leader it knows only while it hears from it.
    controller_contact: std::sync::Mutex<Option<std::time::Instant>>,
}

impl Node {
    /// Opens the node's storage and starts its controller replica. Call
    /// [`Node::run`] once the RPC server is accepting connections.
    pub async fn open(config: NodeConfig) -> Result<Node> {
        config.validate()?;
        let incarnation = claim_data_dir(&config.data_dir, config.node_id)?;
        let raft_config = Arc::new(
            openraft::Config {
                cluster_name: "logdex".into(),
                heartbeat_interval: config.heartbeat_ms,
                election_timeout_min: config.election_timeout_min_ms,
                election_timeout_max: config.election_timeout_max_ms,
                snapshot_policy: openraft::SnapshotPolicy::LogsSinceLast(config.snapshot_every_entries),
                max_in_snapshot_log_to_keep: config.snapshot_every_entries / 5,
                max_payload_entries: 256,
                // Replicate as soon as the leader appended (its fsync runs in
                // parallel with the followers'), instead of after it flushed.
                broadcast_submitted_on_append: Some(true),
                // A restarted leader must not resume leadership (and serve lease
                // reads) from its own vote: the state machine is durable only at
                // checkpoints and the committed log id is not fsynced, so it may
                // be behind what it acknowledged. Found by the chaos soak.
                enable_leader_restore: Some(false),
                ..Default::default()
            }
            .validate()
            .map_err(|e| Error::Invalid(e.to_string()))?,
        );
        let tier_store = config.tiered_store.as_deref().map(TierStore::open).transpose()?;
        // Both databases replay their journals when they open (the index's, about 2 s per
        // million keys after a crash: BENCHMARKS.md, "tenth round"), so they open side by side.
        let (raft_log, index) = std::thread::scope(|scope| {
            let raft_log = scope.spawn(|| RaftLogDb::open(&config.data_dir.join("raft"), config.group_commit_wait));
            let index = Index::open(&config.data_dir.join("index"), config.index.clone());
            (raft_log.join(), index)
        });
        let raft_log = raft_log.map_err(|_| Error::unavailable("opening the Raft log database panicked"))??;
        let index = index?;
        let controller = Controller::open(config.data_dir.join("controller"))?;
        let pool = Arc::new(
            ChannelPool::new(config.rpc_token.as_deref(), config.rpc_source_ip)
                .map_err(Error::Invalid)?
                .with_tls_ca(config.rpc_tls_ca_pem.as_deref())
                .with_cluster(controller.identity(), incarnation),
        );
        let (damage, damage_reports) = tokio::sync::mpsc::channel(crate::network::DAMAGE_REPORTS_MAX);
        let calls = Arc::new(crate::calls::Calls::new(pool.clone()));
        let controller_raft = Raft::new(
            config.node_id,
            raft_config.clone(),
            NetworkFactory::new(CONTROLLER_GROUP, pool.clone(), calls.clone(), damage.clone(), None),
            raft_log.group(config.node_id),
            GroupStateMachine::for_controller(controller.clone())?,
        )
        .await
        .map_err(Error::unavailable)?;
        let (stop, _) = tokio::sync::watch::channel(false);
        let records = crate::record_cache::RecordCache::new(config.record_cache_bytes);
        Ok(Node {
            inner: Arc::new(NodeInner {
                config,
                raft_config,
                calls,
                pool,
                raft_log,
                index,
                controller,
                controller_raft,
                groups: RwLock::new(HashMap::new()),
                moving: Default::default(),
                failed_starts: Default::default(),
                forwarders: Default::default(),
                read_index_stats: Default::default(),
                read_index: Default::default(),
                damage,
                damage_reports: std::sync::Mutex::new(Some(damage_reports)),
                damaged_snapshots_refused: Default::default(),
                damaged_handoffs: Default::default(),
                leadership_handoffs: Default::default(),
                tier_store,
                records,
                tier_collected: Default::default(),
                stop,
                incarnation,
                reclaim_due: Default::default(),
                reclaiming: Default::default(),
                fatal: tokio::sync::watch::channel(None).0,
                controller_contact: std::sync::Mutex::new(None),
            }),
        })
    }

    pub fn node_id(&self) -> NodeId {
        self.inner.config.node_id
    }

    /// Resolves when the node cannot go on, with the reason (its registration was refused);
    /// never while it can.
    pub async fn fatal(&self) -> String {
        let mut fatal = self.inner.fatal.subscribe();
        loop {
            if let Some(reason) = fatal.borrow_and_update().clone() {
                return reason;
            }
            if fatal.changed().await.is_err() {
                return std::future::pending().await;
            }
        }
    }

    pub fn config(&self) -> &NodeConfig {
        &self.inner.config
    }

    pub fn pool(&self) -> &Arc<ChannelPool> {
        &self.inner.pool
    }

    pub fn controller_raft(&self) -> &Raft {
        &self.inner.controller_raft
    }

    /// The controller's leader as this node reports it: none while this node leads it but no
    /// quorum answered it for an election timeout (as in [`Node::status`]).
    pub fn controller_leader(&self) -> Option<NodeId> {
        let m = crate::types::metrics_of(&self.inner.controller_raft);
        if self.cut_off(&m) {
            return None;
        }
        // A replica that follows (a learner above all, which never campaigns) keeps naming
        // the last leader it knew however long ago it heard from it: only one heard from
        // within the longest election timeout counts.
        let heard = || {
            let contact = self.inner.controller_contact.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            contact.is_some_and(|at| at.elapsed() <= self.quorum_lost_after())
        };
        m.current_leader.filter(|leader| *leader == m.id || heard())
    }

    /// A controller leader reached this node's controller replica (an append or a heartbeat).
    pub fn note_controller_contact(&self) {
        *self.inner.controller_contact.lock().unwrap_or_else(std::sync::PoisonError::into_inner) =
            Some(std::time::Instant::now());
    }

    /// How long a leader goes without a quorum's answer before it reports no leader: the
    /// longest election timeout, after which its followers have called an election.
    fn quorum_lost_after(&self) -> Duration {
        Duration::from_millis(self.inner.config.election_timeout_max_ms)
    }

    /// A copy of the cluster metadata as this node's controller replica has applied it.
    pub fn cluster(&self) -> Arc<ClusterState> {
        self.inner.controller.state()
    }

    /// The incarnation of this node's data directory (`node.json`).
    pub fn incarnation(&self) -> u64 {
        self.inner.incarnation
    }

    /// The id of the cluster this node belongs to, once its controller replica knows it.
    pub fn cluster_identity(&self) -> crate::network::ClusterIdentity {
        self.inner.controller.identity()
    }

    pub fn subscribe_cluster(&self) -> tokio::sync::watch::Receiver<u64> {
        self.inner.controller.subscribe()
    }

    /// Bootstraps the controller if this node is the lowest initial peer, then
    /// starts registration, the reconciler and the checkpointer.
    pub async fn run(&self) -> Result<()> {
        self.bootstrap_controller().await?;
        let node = self.clone();
        tokio::spawn(async move { node.register_loop().await });
        let node = self.clone();
        tokio::spawn(async move { node.check_peers_cluster().await });
        let node = self.clone();
        tokio::spawn(async move { node.reconcile_loop().await });
        let node = self.clone();
        tokio::spawn(async move { node.checkpoint_loop().await });
        let node = self.clone();
        tokio::spawn(async move { node.cleaner_loop().await });
        let node = self.clone();
        tokio::spawn(async move { node.leader_balance_loop().await });
        let node = self.clone();
        tokio::spawn(async move { node.controller_voters_loop().await });
        if let Some(reports) = self.inner.damage_reports.lock().unwrap_or_else(|p| p.into_inner()).take() {
            let node = self.clone();
            tokio::spawn(async move { node.damage_loop(reports).await });
        }
        Ok(())
    }

    /// On the controller's leader: keeps the controller's voters as `--controller-voters` asks,
    /// with the nodes there are. It takes the nodes removed from the cluster out of the
    /// controller group, and makes learners that answer and are caught up voters while the
    /// voters are fewer than asked (a removed voter's place first; a cluster that started with
    /// fewer nodes than that once enough have joined), so a cluster that lost a voter's disk
    /// for good gets back the failures its controller tolerates. Woken by each applied
    /// controller change, and every few seconds while a change is left to make (a leader
    /// elected since, or no learner answering yet).
    async fn controller_voters_loop(&self) {
        let failed = "cannot change the controller's voters yet";
        self.after_each_controller_change(CONTROLLER_MEMBERSHIP_CHECK, failed, || self.tend_controller_voters()).await
    }

    /// One step of [`Node::controller_voters_loop`]: nothing unless this node leads the
    /// controller group and its membership needs a change.
    async fn tend_controller_voters(&self) -> Result<()> {
        let raft = &self.inner.controller_raft;
        let m = crate::types::metrics_of(raft);
        let me = self.node_id();
        if m.current_leader != Some(me) {
            return Ok(());
        }
        let removed: std::collections::BTreeSet<NodeId> = self.cluster().removed_nodes.keys().copied().collect();
        if removed.contains(&me) {
            tracing::error!("this node leads the controller group yet was removed from the cluster: it stays a voter");
            return Ok(());
        }
        let membership = m.membership_config.membership();
        // Only this loop changes the controller's voters: a joint configuration is one of its
        // changes whose leader went halfway, finished here towards its second half.
        let halfway = membership.get_joint_config().len() > 1;
        let voters: std::collections::BTreeSet<NodeId> =
            membership.get_joint_config().last().cloned().unwrap_or_default();
        let gone: std::collections::BTreeSet<NodeId> = voters.intersection(&removed).copied().collect();
        let kept: std::collections::BTreeSet<NodeId> = voters.difference(&gone).copied().collect();
        let wanted = self.inner.config.controller_voters.clamp(1, CONTROLLER_VOTERS_MAX);
        let promoted = promotions(&m, &removed, kept.len(), wanted, self.quorum_lost_after());
        if halfway || !gone.is_empty() || !promoted.is_empty() {
            let mut next = kept;
            next.extend(promoted.iter().copied());
            tracing::info!(removed = ?gone, promoted = ?promoted, voters = ?next, "changing the controller's voters");
            self.change_controller_membership(openraft::ChangeMembers::ReplaceAllVoters(next)).await?;
        }
        let m = crate::types::metrics_of(raft);
        let learners: std::collections::BTreeSet<NodeId> =
            m.membership_config.membership().learner_ids().filter(|id| removed.contains(id)).collect();
        if !learners.is_empty() {
            tracing::info!(removed = ?learners, "taking removed nodes out of the controller group");
            self.change_controller_membership(openraft::ChangeMembers::RemoveNodes(learners)).await?;
        }
        Ok(())
    }

    /// Makes `change` to the controller group's membership (removed voters do not stay as
    /// learners), bounded by [`OPERATION_TIMEOUT`].
    async fn change_controller_membership(&self, change: openraft::ChangeMembers<NodeId, pb::Node>) -> Result<()> {
        let raft = &self.inner.controller_raft;
        tokio::time::timeout(OPERATION_TIMEOUT, raft.change_membership(change, false))
            .await
            .map_err(|_| Error::Timeout("changing the controller group's membership".into()))?
            .map_err(Error::unavailable)?;
        Ok(())
    }

    /// Hands the leadership of a group off this node when a follower refused its snapshot as
    /// damaged, or the scrub found damage (its sealed segment files rotted here): the healthy
    /// voter furthest along takes
    /// over and sends its own snapshot. At most once per group every
    /// [`DAMAGE_HANDOFF_INTERVAL`]; nothing when this replica no longer leads.
    async fn damage_loop(&self, mut reports: tokio::sync::mpsc::Receiver<GroupId>) {
        let mut stop = self.inner.stop.subscribe();
        let mut handed_off: HashMap<GroupId, tokio::time::Instant> = HashMap::new();
        loop {
            let group = tokio::select! {
                group = reports.recv() => match group {
                    Some(group) => group,
                    None => return,
                },
                _ = stop.changed() => return,
            };
            if handed_off.get(&group).is_some_and(|at| at.elapsed() < DAMAGE_HANDOFF_INTERVAL) {
                continue;
            }
            let Some(hosted) = self.group(group) else { continue };
            match self.hand_off_damaged(&hosted).await {
                Ok(true) => {
                    handed_off.insert(group, tokio::time::Instant::now());
                }
                Ok(false) => {}
                Err(e) => tracing::warn!(group, error = %e, "cannot hand off the leadership of a damaged replica"),
            }
        }
    }

    /// Transfers `hosted`'s leadership to the other voter with the most matched log, if this
    /// replica leads; whether a transfer was asked.
    async fn hand_off_damaged(&self, hosted: &HostedGroup) -> Result<bool> {
        let metrics = crate::types::metrics_of(&hosted.raft);
        if metrics.current_leader != Some(hosted.replica_id) {
            return Ok(false);
        }
        let voters: std::collections::BTreeSet<ReplicaId> =
            metrics.membership_config.membership().voter_ids().collect();
        let to = metrics
            .replication
            .iter()
            .flatten()
            .filter(|(replica, _)| **replica != hosted.replica_id && voters.contains(*replica))
            .max_by_key(|(_, matched)| matched.map(|l| l.index))
            .map(|(replica, _)| *replica);
        let Some(to) = to else {
            tracing::error!(group = hosted.group_id, "this replica's data is damaged and no other voter can lead");
            return Ok(false);
        };
        tracing::error!(
            group = hosted.group_id,
            to,
            "this replica's data is damaged (a follower refused its snapshot, or the scrub found it): handing leadership to replica {to}"
        );
        hosted.raft.trigger().transfer_leader(to).await.map_err(Error::unavailable)?;
        self.inner.damaged_handoffs.lock().unwrap_or_else(|p| p.into_inner()).insert(hosted.group_id);
        Ok(true)
    }

    /// Whether this node was started with an object store for tiered storage (`--tiered-store`).
    pub fn has_tier_store(&self) -> bool {
        self.inner.tier_store.is_some()
    }

    /// Counts a received snapshot refused as damaged (`/metrics`).
    pub fn count_damaged_snapshot_refused(&self) {
        self.inner.damaged_snapshots_refused.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    }

    /// Snapshots received here and refused as damaged.
    pub fn damaged_snapshots_refused(&self) -> &std::sync::atomic::AtomicU64 {
        &self.inner.damaged_snapshots_refused
    }

    async fn bootstrap_controller(&self) -> Result<()> {
        let config = &self.inner.config;
        if config.join.is_some() {
            return Ok(());
        }
        let mut peers = config.peers.clone();
        peers.sort();
        let lowest = peers.first().map(|(id, _)| *id);
        if lowest != Some(config.node_id) {
            return Ok(());
        }
        let raft = &self.inner.controller_raft;
        if raft.is_initialized().await.map_err(Error::unavailable)? {
            return Ok(());
        }
        let voters: BTreeMap<u64, pb::Node> = peers
            .iter()
            .take(config.controller_voters.clamp(1, CONTROLLER_VOTERS_MAX))
            .map(|(id, addr)| (*id, pb::Node { node_id: *id, rpc_addr: addr.clone() }))
            .collect();
        tracing::info!(voters = ?voters.keys().collect::<Vec<_>>(), "initializing the controller group");
        match raft.initialize(voters).await {
            Ok(()) => Ok(()),
            Err(OrRaftError::APIError(e)) => {
                tracing::info!(error = %e, "controller already initialized");
                Ok(())
            }
            Err(e) => Err(Error::unavailable(e)),
        }
    }

    /// Registers this node with the controller until it succeeds.
    async fn register_loop(&self) {
        let config = &self.inner.config;
        let cmd = pb::ControllerCommand {
            kind: Some(pb::controller_command::Kind::RegisterNode(pb::RegisterNode {
                node_id: config.node_id,
                rpc_addr: config.rpc_addr.clone(),
                http_addr: config.http_addr.clone(),
                incarnation: self.inner.incarnation,
                // Used only when the cluster has no id yet (its first registration).
                proposed_cluster_id: random_incarnation(),
            })),
        };
        if let Some(addr) = &config.join
            && self.joins_another_cluster(addr).await
        {
            return;
        }
        let mut stop = self.inner.stop.subscribe();
        let mut refusals = 0;
        for attempt in 0u64.. {
            // A cluster that predates cluster ids gets one from this registration (a few
            // tries: a controller leader of an older version drops the proposal).
            let state = self.cluster();
            let registered = (state.cluster_id != 0 || attempt >= CLUSTER_NAMING_ATTEMPTS)
                && state
                    .nodes
                    .get(&config.node_id)
                    .is_some_and(|n| n.rpc_addr == config.rpc_addr && n.http_addr == config.http_addr);
            let in_membership = self.controller_membership_has(config.node_id);
            // A node registered before still asks once at each start (the answer is "exists"),
            // and goes on only if the cluster did not refuse it: it may have been removed
            // meanwhile, and its own controller replica, cut off since, cannot tell. It asks
            // again whenever it stops hearing from the controller.
            if registered && in_membership && attempt > 0 && refusals == 0 {
                tracing::info!(attempt, "registered with the controller");
                self.watch_registration(&cmd).await;
                return;
            }
            let result = self.register_once(&cmd, in_membership).await;
            // A peer that refuses this node's token or certificate refuses every retry: the
            // node stops with the reason rather than wait for ever.
            match &result {
                Err(e) if refused_as_a_peer(&e.to_string()) => refusals += 1,
                _ => refusals = 0,
            }
            if self.stop_if_refused_for_good(&result) {
                return;
            }
            if refusals >= REGISTRATION_REFUSALS_MAX {
                let e = result.as_ref().err().map(ToString::to_string).unwrap_or_default();
                tracing::error!(error = %e, "the cluster refused this node's token, certificate or cluster");
                let reason = format!(
                    "registration refused: {e} (every node needs the same --rpc-token-file, a certificate its peers' \
                     --tls-ca-file trusts, and a data directory of their cluster or an empty one)"
                );
                let _ = self.inner.fatal.send(Some(reason));
                return;
            }
            match result {
                Err(e) if attempt % 20 == 3 => {
                    tracing::warn!(error = %e, attempt, "cannot register with the controller yet")
                }
                Err(e) => tracing::debug!(error = %e, attempt, "registration not done yet"),
                // Taken, yet this node's controller replica does not show it: the controller's
                // entries do not reach this node at the address it registered.
                Ok(_) if attempt % 20 == 10 => tracing::warn!(
                    attempt,
                    rpc_addr = %config.rpc_addr,
                    "the controller took this node's registration, but its entries do not reach this node: \
                     can the peers connect to its RPC address, and do they trust its TLS certificate?"
                ),
                Ok(_) => {}
            }
            tokio::select! {
                _ = tokio::time::sleep(Duration::from_millis(500)) => {}
                _ = stop.changed() => return,
            }
        }
    }

    /// Whether `--join` names a node of another cluster than the one this node's data
    /// directory already belongs to (it ran before), and if so stops the node with the reason.
    /// Its own controller replica would take its registration otherwise, and it would serve a
    /// cluster of its own while the one named never heard of it. A node that cannot be reached
    /// (restarting, say) is not checked, with a warning.
    async fn joins_another_cluster(&self, addr: &str) -> bool {
        let Some(own) = self.cluster_identity().get() else { return false };
        match self.peer_cluster(addr).await {
            PeerCluster::Same => false,
            PeerCluster::Other => {
                self.refuse_to_start(format!(
                    "this data directory belongs to cluster {own:016x}, and --join {addr} names a node of another \
                     cluster: join that cluster with an empty --data-dir, or --join a node of this directory's cluster"
                ));
                true
            }
            PeerCluster::Unknown(e) => {
                tracing::warn!(
                    join = addr,
                    error = %e,
                    "cannot check that the --join node is of this data directory's cluster; going on"
                );
                false
            }
        }
    }

    /// For a node of `--peers` whose data directory already belongs to a cluster: stops it
    /// with the reason once the peers that answer all refuse it as another cluster's (a data
    /// directory left from an earlier cluster), instead of running on refused by every peer.
    /// One peer of its cluster answering ends the check; so do [`PEER_CLUSTER_CHECKS`] rounds
    /// in which no peer answered (they may all be restarting).
    async fn check_peers_cluster(&self) {
        let config = &self.inner.config;
        let Some(own) = self.cluster_identity().get() else { return };
        let peers: Vec<&(NodeId, String)> = config.peers.iter().filter(|(id, _)| *id != config.node_id).collect();
        if config.join.is_some() || peers.is_empty() {
            return;
        }
        let mut stop = self.inner.stop.subscribe();
        for _ in 0..PEER_CLUSTER_CHECKS {
            let answers = futures::future::join_all(peers.iter().map(|(_, addr)| self.peer_cluster(addr))).await;
            if answers.iter().any(|a| matches!(a, PeerCluster::Same)) {
                return;
            }
            let refused: Vec<NodeId> = peers
                .iter()
                .zip(&answers)
                .filter(|(_, a)| matches!(a, PeerCluster::Other))
                .map(|((id, _), _)| *id)
                .collect();
            if !refused.is_empty() {
                self.refuse_to_start(format!(
                    "this data directory belongs to cluster {own:016x}, and the peers that answered (nodes \
                     {refused:?}) belong to another cluster: start this node with an empty --data-dir to join \
                     theirs, or start it with the --peers of its own cluster"
                ));
                return;
            }
            tokio::select! {
                _ = tokio::time::sleep(Duration::from_millis(500)) => {}
                _ = stop.changed() => return,
            }
        }
    }

    /// Which cluster the node at `addr` is of, as one status call tells: it refuses calls from
    /// another cluster than its own.
    async fn peer_cluster(&self, addr: &str) -> PeerCluster {
        let answer = match self.pool().client(addr) {
            Ok(mut client) => {
                let mut request = tonic::Request::new(pb::StatusRequest {});
                request.set_timeout(Duration::from_secs(2));
                client.status(request).await.map(drop).map_err(|status| status.message().to_string())
            }
            Err(e) => Err(e.to_string()),
        };
        match answer {
            Ok(()) => PeerCluster::Same,
            Err(e) if e.contains(crate::service::FOREIGN_CLUSTER_REFUSAL) => PeerCluster::Other,
            Err(e) => PeerCluster::Unknown(e),
        }
    }

    /// Stops the node at start with `reason` (logged, and printed by `logdex serve`).
    fn refuse_to_start(&self, reason: String) {
        tracing::error!(%reason, "refusing to start");
        let _ = self.inner.fatal.send(Some(reason));
    }

    /// One registration of this node, through its own controller replica or its peers.
    async fn register_once(&self, cmd: &pb::ControllerCommand, in_membership: bool) -> Result<pb::ControllerResult> {
        // Not `controller_write`: this node's controller replica may not be a learner yet.
        match self.controller_write_at(cmd.clone(), false).await {
            Ok((r, _)) => Ok(r),
            // A joining node's own controller replica knows no leader: only what its peers
            // said tells why.
            Err(_) if !in_membership => self.register_via_peers(cmd).await,
            Err(e) => self
                .register_via_peers(cmd)
                .await
                .map_err(|peers| Error::unavailable(format!("{e}; through the peers: {peers}"))),
        }
    }

    /// Stops the node when `result` refuses its registration for good: its id or data
    /// directory was removed from the cluster, or the id is registered from another directory
    /// or address. Whether it did.
    fn stop_if_refused_for_good(&self, result: &Result<pb::ControllerResult>) -> bool {
        let id = self.inner.config.node_id;
        let reason = match result {
            Err(e) if e.to_string().contains(crate::service::REMOVED_NODE_REFUSAL) => {
                tracing::error!(error = %e, "this node was removed from the cluster");
                format!(
                    "this node (id {id}, this data directory) was removed from the cluster and may not take part again: {e}"
                )
            }
            Ok(refused) if refused.status == "conflict" => {
                tracing::error!(message = %refused.message, "the cluster refused this node's registration");
                format!("registration refused: {}", refused.message)
            }
            _ => return false,
        };
        let _ = self.inner.fatal.send(Some(reason));
        true
    }

    /// After registration: while this node hears nothing from the controller's leader (cut off,
    /// or removed from the cluster while it was paused or down), registers again every
    /// [`REGISTRATION_RECHECK`] (an "exists" answer once the controller is reached), and
    /// stops if the cluster refuses it for good, as at start.
    async fn watch_registration(&self, cmd: &pb::ControllerCommand) {
        let mut stop = self.inner.stop.subscribe();
        loop {
            tokio::select! {
                _ = tokio::time::sleep(REGISTRATION_RECHECK) => {}
                _ = stop.changed() => return,
            }
            if self.controller_leader().is_some() {
                continue;
            }
            let in_membership = self.controller_membership_has(self.node_id());
            let result = self.register_once(cmd, in_membership).await;
            if self.stop_if_refused_for_good(&result) {
                return;
            }
            if let Err(e) = result {
                tracing::debug!(error = %e, "the controller cannot be reached to confirm this node's registration");
            }
        }
    }

    /// How many nodes the controller group's membership names (voters and learners): every
    /// node of `--peers` from the start, and each node that joined. Some may not have
    /// registered yet (they start in any order).
    fn controller_member_count(&self) -> usize {
        let m = crate::types::metrics_of(&self.inner.controller_raft);
        m.membership_config.membership().nodes().count()
    }

    /// Whether the controller group's membership (voters and learners) names node `node`, as
    /// this node's controller replica knows it.
    pub fn controller_membership_has(&self, node: NodeId) -> bool {
        let m = crate::types::metrics_of(&self.inner.controller_raft);
        m.membership_config.membership().nodes().any(|(id, _)| *id == node)
    }

    /// The controller group's voters, as this node's controller replica knows them.
    pub fn controller_voters(&self) -> Vec<NodeId> {
        let m = crate::types::metrics_of(&self.inner.controller_raft);
        m.membership_config.membership().voter_ids().collect()
    }

    /// Waits (up to `bound`) until this node's controller replica sees node `node` out of the
    /// controller group (after its removal, [`Node::controller_voters_loop`]); whether it does.
    pub async fn wait_left_controller_group(&self, node: NodeId, bound: Duration) -> bool {
        let deadline = tokio::time::Instant::now() + bound;
        while self.controller_membership_has(node) {
            if tokio::time::Instant::now() >= deadline {
                return false;
            }
            tokio::time::sleep(LEADER_POLL).await;
        }
        true
    }

    async fn register_via_peers(&self, cmd: &pb::ControllerCommand) -> Result<pb::ControllerResult> {
        let config = &self.inner.config;
        let targets: Vec<String> = match &config.join {
            Some(addr) => vec![addr.clone()],
            None => config.peers.iter().filter(|(id, _)| *id != config.node_id).map(|(_, a)| a.clone()).collect(),
        };
        let mut last = Error::unavailable("no peer to register with");
        for addr in targets {
            match self.remote_controller_write(&addr, cmd.clone(), false).await {
                Ok((r, _)) => return Ok(r),
                Err(e) => {
                    // An HTTP listener answers gRPC with a 404 whose body tonic reads as a bad frame.
                    let text = e.to_string();
                    let http = mentions_any(&text, &["invalid compression flag", "404 not found", "content-type"]);
                    let hint = if http {
                        " (that address answers HTTP, not node-to-node RPC: name a member's --rpc-addr)"
                    } else {
                        ""
                    };
                    last = Error::unavailable(format!("{addr}: {text}{hint}"));
                }
            }
        }
        Err(last)
    }

    /// Proposes a controller command on the controller leader, wherever it is, and returns
    /// once this node's controller replica has applied it (bounded by [`CONTROLLER_CATCH_UP`]),
    /// so the node's next answer (a describe after an alter or a move) shows the change.
    pub async fn controller_write(&self, cmd: pb::ControllerCommand, forwarded: bool) -> Result<pb::ControllerResult> {
        let (result, index) = self.controller_write_at(cmd, forwarded).await?;
        self.wait_controller_applied(index).await;
        Ok(result)
    }

    /// Waits until the local controller replica has applied `index`; gives up after
    /// [`CONTROLLER_CATCH_UP`] with a warning: the write is committed, only this replica's
    /// view lags.
    async fn wait_controller_applied(&self, index: u64) {
        let applied = |s: &ClusterState| s.applied.map_or(0, |l| l.index) >= index;
        if !self.wait_cluster_state(CONTROLLER_CATCH_UP, applied).await {
            tracing::warn!(
                index,
                "controller write not applied by this node's controller replica in time; answering from its older view"
            );
        }
    }

    /// Waits until the local controller state satisfies `ready`, woken by each applied change;
    /// false if it still does not after `bound`.
    async fn wait_cluster_state(&self, bound: Duration, ready: impl Fn(&ClusterState) -> bool) -> bool {
        let controller = &self.inner.controller;
        let mut changed = controller.subscribe();
        let deadline = tokio::time::Instant::now() + bound;
        loop {
            if controller.with_state(&ready).unwrap_or(false) {
                return true;
            }
            match tokio::time::timeout_at(deadline, changed.changed()).await {
                Ok(Ok(())) => {}
                Ok(Err(_)) | Err(_) => return false,
            }
        }
    }

    /// The replication factor of a topic created without one: three replicas, or one per node
    /// when the cluster names fewer nodes (voters and learners of the controller group, so the
    /// nodes of `--peers` count before they registered).
    pub fn default_replication_factor(&self) -> u32 {
        self.controller_member_count().clamp(1, DEFAULT_REPLICATION_FACTOR_MAX as usize) as u32
    }

    /// Waits (up to `bound`) until `count` nodes have registered, if the controller group's
    /// membership names that many: nodes of `--peers` start in any order, and a topic created
    /// on the first ones up may ask for more replicas than have registered yet. Returns as soon
    /// as the membership, once a controller leader is known, names fewer nodes than `count`
    /// (the create is then refused as it was).
    pub async fn wait_registered_nodes(&self, count: usize, bound: Duration) {
        // A node of a brand-new cluster asked before its first election may not know the
        // membership yet: it knows it once the controller has a leader.
        let deadline = tokio::time::Instant::now() + bound;
        if self.controller_member_count() < count {
            self.wait_controller_leader(deadline).await;
        }
        if self.controller_member_count() >= count {
            let left = deadline.saturating_duration_since(tokio::time::Instant::now());
            self.wait_cluster_state(left, |s| s.nodes.len() >= count).await;
        }
    }

    /// Proposes a controller command on the controller leader and returns its result and its
    /// controller log index (0 when a forwarding peer did not say).
    pub async fn controller_write_at(
        &self,
        cmd: pb::ControllerCommand,
        forwarded: bool,
    ) -> Result<(pb::ControllerResult, u64)> {
        let raft = &self.inner.controller_raft;
        let register = match &cmd.kind {
            Some(pb::controller_command::Kind::RegisterNode(r)) => Some(r.clone()),
            _ => None,
        };
        let command = pb::Command { kind: Some(pb::command::Kind::Controller(cmd.clone())) };
        let election_deadline = tokio::time::Instant::now() + CONTROLLER_LEADER_WAIT;
        loop {
            match tokio::time::timeout(OPERATION_TIMEOUT, raft.client_write(command.clone())).await {
                Err(_) => return Err(Error::Timeout("controller write".into())),
                Ok(Ok(resp)) => {
                    let result = match resp.data.kind {
                        Some(pb::command_response::Kind::Controller(r)) => r,
                        _ => return Err(Error::Corrupted("controller answered a non-controller response".into())),
                    };
                    // A refused registration (a removed id, another data directory or address)
                    // never joins the controller group: its entries would reach that process.
                    if let Some(r) = register.filter(|_| matches!(result.status.as_str(), "ok" | "exists")) {
                        self.add_controller_learner(r).await?;
                    }
                    return Ok((result, resp.log_id.index));
                }
                Ok(Err(OrRaftError::APIError(OrClientWriteError::ForwardToLeader(f)))) => {
                    let Some(node) = f.leader_node else {
                        // An election is under way (every node restarted, or the leader
                        // went): nothing was proposed, so wait for its winner, bounded. Not
                        // on a node outside the controller group (a joining node, which
                        // registers through its peers then) nor for a forwarding node (its
                        // call has its own deadline).
                        let waits = !forwarded && self.controller_membership_has(self.node_id());
                        if !waits || tokio::time::Instant::now() >= election_deadline {
                            return Err(Error::unavailable("the controller has no leader"));
                        }
                        tokio::time::sleep(LEADER_POLL).await;
                        self.wait_controller_leader(election_deadline).await;
                        continue;
                    };
                    if forwarded {
                        return Err(Error::NotLeader { group: CONTROLLER_GROUP, leader_node: Some(node.node_id) });
                    }
                    // A leader that stops answering without closing its connections (paused,
                    // or cut off) holds the call until its deadline; once this node sees
                    // another leader, or an election, the command goes there instead. Should
                    // the first call still commit, a create finds the identical topic (200).
                    let wait = raft.wait(Some(OPERATION_TIMEOUT));
                    let deposed = wait.metrics(|m| m.current_leader != Some(node.node_id), "controller leader changes");
                    // Why the command goes to the next leader, and how long to wait first.
                    let (why, pause) = tokio::select! {
                        call = self.remote_controller_write(&node.rpc_addr, cmd.clone(), true) => match call {
                            // The leader this node knows is gone (nothing was sent): its
                            // successor takes the command once an election ends, bounded.
                            Err(Error::NodeUnreachable(m)) => (m, CONTROLLER_RETRY),
                            other => return other,
                        },
                        Ok(_) = deposed => {
                            tracing::info!(leader = node.node_id, "controller leader changed during a write; sending it to the next one");
                            ("stopped answering".to_string(), LEADER_POLL)
                        }
                    };
                    if tokio::time::Instant::now() >= election_deadline {
                        return Err(Error::unavailable(format!(
                            "the controller leader, node {}, {why}; no other leader took the write in time",
                            node.node_id
                        )));
                    }
                    tokio::time::sleep(pause).await;
                }
                Ok(Err(e)) => return Err(write_failed(e)),
            }
        }
    }

    /// Waits until the controller group has a leader this node knows of, or `deadline` passes.
    async fn wait_controller_leader(&self, deadline: tokio::time::Instant) {
        let raft = &self.inner.controller_raft;
        while crate::types::metrics_of(raft).current_leader.is_none() && tokio::time::Instant::now() < deadline {
            tokio::time::sleep(LEADER_POLL).await;
        }
    }

    async fn add_controller_learner(&self, r: pb::RegisterNode) -> Result<()> {
        if self.controller_membership_has(r.node_id) {
            return Ok(());
        }
        let node = pb::Node { node_id: r.node_id, rpc_addr: r.rpc_addr };
        let raft = self.inner.controller_raft.clone();
        tokio::time::timeout(OPERATION_TIMEOUT, raft.add_learner(r.node_id, node, false))
            .await
            .map_err(|_| Error::unavailable("adding a controller learner timed out"))?
            .map_err(Error::unavailable)?;
        tracing::info!(node = r.node_id, "added node to the controller group as learner");
        Ok(())
    }

    async fn remote_controller_write(
        &self,
        addr: &str,
        cmd: pb::ControllerCommand,
        forwarded: bool,
    ) -> Result<(pb::ControllerResult, u64)> {
        let mut client = self.inner.pool.client(addr).map_err(Error::unavailable)?;
        let mut request = tonic::Request::new(pb::ControllerWriteRequest { command: Some(cmd), forwarded });
        request.set_timeout(OPERATION_TIMEOUT);
        let resp = match client.controller_write(request).await {
            Ok(resp) => resp.into_inner(),
            // A unary call whose connection failed sent nothing (as for a forwarded produce).
            Err(s) if s.code() == tonic::Code::Unavailable && s.message().contains("connect") => {
                return Err(Error::NodeUnreachable(format!("at {addr} cannot be reached ({})", s.message())));
            }
            Err(s) if s.code() == tonic::Code::DeadlineExceeded => {
                return Err(Error::Timeout(format!("controller write at {addr}: {}", s.message())));
            }
            Err(s) => return Err(Error::remote_unavailable(&format!("controller at {addr}: {}", s.message()))),
        };
        let result = resp.result.ok_or_else(|| Error::unavailable(format!("controller at {addr} has no leader")))?;
        Ok((result, resp.log_index))
    }

    async fn reconcile_loop(&self) {
        self.after_each_controller_change(Duration::from_secs(1), "reconcile failed; retrying", || self.reconcile())
            .await
    }

    /// Runs `step` now, after each change the controller replica applies, and at least every
    /// `every`, until the node stops; a failed step is logged with `failed` and runs again.
    async fn after_each_controller_change<F, Fut>(&self, every: Duration, failed: &str, mut step: F)
    where
        F: FnMut() -> Fut,
        Fut: std::future::Future<Output = Result<()>>,
    {
        let mut changed = self.inner.controller.subscribe();
        let mut stop = self.inner.stop.subscribe();
        loop {
            if let Err(e) = step().await {
                tracing::warn!(error = %e, "{failed}");
            }
            tokio::select! {
                _ = changed.changed() => {}
                _ = tokio::time::sleep(every) => {}
                _ = stop.changed() => return,
            }
        }
    }

    /// Makes the hosted partition replicas match the controller's assignments.
    pub async fn reconcile(&self) -> Result<()> {
        let state = self.cluster();
        let me = self.inner.config.node_id;
        let mut desired: HashMap<GroupId, (String, &PartitionRecord, ReplicaId)> = HashMap::new();
        for topic in state.topics.values() {
            for p in &topic.partitions {
                if let Some(r) = p.all_replicas().find(|r| r.node_id == me) {
                    desired.insert(p.group_id, (topic.name.clone(), p, r.replica_id));
                }
            }
        }
        let groups: std::collections::HashSet<GroupId> =
            state.topics.values().flat_map(|t| t.partitions.iter().map(|p| p.group_id)).collect();
        self.inner.forwarders.retain_groups(|g| groups.contains(&g));
        self.inner.failed_starts.lock().unwrap_or_else(|p| p.into_inner()).retain(|g| desired.contains_key(g));
        self.inner.tier_collected.lock().unwrap_or_else(|p| p.into_inner()).retain(|g, _| desired.contains_key(g));
        let hosted: Vec<(GroupId, ReplicaId)> =
            self.groups_read().values().map(|g| (g.group_id, g.replica_id)).collect();
        for (group, replica) in hosted {
            if desired.get(&group).map(|d| d.2) != Some(replica) {
                if !groups.contains(&group) {
                    // The topic was deleted: its copies in tiered storage go too.
                    self.delete_remote_segments(group).await;
                }
                self.remove_group(group).await?;
            }
        }
        let assigned: std::collections::HashSet<String> =
            desired.iter().map(|(group, d)| format!("{group}-{}", d.2)).collect();
        // Replicas open a few at a time: opening one reads its segment log (all of it when its
        // index must be rebuilt), on a blocking thread, so the cores share a node's start.
        let waiting: Vec<(GroupId, String, PartitionRecord, ReplicaId)> = desired
            .into_iter()
            .filter(|(group, _)| !self.groups_read().contains_key(group))
            .map(|(group, (topic, record, replica))| (group, topic, record.clone(), replica))
            .collect();
        let cluster = &state;
        let mut starts = futures::stream::iter(waiting)
            .map(|(group, topic, record, replica)| async move {
                (group, replica, self.start_group(cluster, &topic, &record, replica).await)
            })
            .buffer_unordered(starts_at_once());
        while let Some((group, replica, started)) = starts.next().await {
            let mut failed = self.inner.failed_starts.lock().unwrap_or_else(|p| p.into_inner());
            if let Err(e) = started {
                // One replica that cannot open (damaged data, say) must not keep the
                // others from starting; it stays stopped, keeps its files, and is retried.
                tracing::error!(group, replica, error = %e, "cannot start partition replica");
                failed.insert(group);
            } else {
                failed.remove(&group);
            }
        }
        self.apply_topic_configs(&state);
        self.drive_moves(&state);
        self.sweep_orphans(&assigned)
    }

    /// Pushes topic config changes (segment size and age, retention) to the hosted logs.
    fn apply_topic_configs(&self, state: &ClusterState) {
        for g in self.groups() {
            let Some(topic) = state.topics.get(&g.topic) else { continue };
            if let Err(e) = g.partition.set_log_config(topic.log_config(&self.inner.config.log)) {
                tracing::warn!(group = g.group_id, error = %e, "cannot apply the topic config to the log");
            }
        }
    }

    /// Preferred-leader balancing (`crate::balance`): every interval, each replica here that
    /// is its partition's preferred leader, healthy, and follows another node asks that node
    /// for the leadership.
    async fn leader_balance_loop(&self) {
        use crate::balance;
        let interval = self.inner.config.leader_balance_interval;
        if interval.is_zero() {
            return;
        }
        let retry_after = interval.saturating_mul(balance::RETRY_AFTER_INTERVALS);
        let mut stop = self.inner.stop.subscribe();
        let mut handed: HashMap<GroupId, tokio::time::Instant> = HashMap::new();
        let mut pause = interval;
        loop {
            tokio::select! {
                _ = tokio::time::sleep(pause) => {}
                _ = stop.changed() => return,
            }
            handed.retain(|_, at| at.elapsed() < retry_after);
            let state = self.cluster();
            let mut asked = 0;
            for g in self.groups() {
                if asked == balance::ASKS_PER_PASS_MAX {
                    break;
                }
                if handed.contains_key(&g.group_id) {
                    continue;
                }
                let Some(leader) = self.leader_to_ask(&state, &g) else { continue };
                asked += 1;
                match self.ask_leadership(leader, &g).await {
                    Ok(true) => {
                        tracing::info!(group = g.group_id, topic = %g.topic, partition = g.partition_no, from = leader, "the preferred replica is handed the leadership back");
                        handed.insert(g.group_id, tokio::time::Instant::now());
                    }
                    Ok(false) => {}
                    Err(e) => tracing::debug!(group = g.group_id, leader, error = %e, "cannot ask for the leadership"),
                }
            }
            // A pass that asked for its most leaves more to ask for (after a full-cluster
            // restart, say, hundreds): the next goes on shortly, not an interval later.
            pause = balance::next_pause(asked, interval);
        }
    }

    /// The node to ask for the leadership of `g`'s group, when `g` should lead it
    /// ([`crate::balance::asks_for_leadership`]).
    fn leader_to_ask(&self, state: &ClusterState, g: &HostedGroup) -> Option<NodeId> {
        let record = assignment_of(state, g)?;
        let leader = self.leader_node(g);
        let view = crate::balance::ReplicaView {
            preferred: record.replicas.first().map(|r| r.replica_id) == Some(g.replica_id),
            moving: record.target.is_some(),
            leads: g.raft.is_leader(),
            damaged: g.partition.is_damaged() || self.handed_off_as_damaged(g.group_id),
            leader_elsewhere: leader.is_some_and(|l| l != self.node_id()),
        };
        crate::balance::asks_for_leadership(view).then_some(leader).flatten()
    }

    /// Asks node `leader` to hand `g`'s replica the leadership of its group; whether it does.
    /// A node from before leader balancing answers UNIMPLEMENTED: no.
    async fn ask_leadership(&self, leader: NodeId, g: &HostedGroup) -> Result<bool> {
        let addr = self.rpc_addr_of(leader)?;
        let request = pb::LeadershipRequest {
            header: Some(pb::GroupHeader { group_id: g.group_id, target_replica: 0 }),
            replica_id: g.replica_id,
        };
        use pb::call_response::Result as Answer;
        match self.inner.calls.call(&addr, pb::call_request::Call::Leadership(request), RPC_TIMEOUT).await {
            Ok(Answer::Leadership(answer)) => Ok(answer.transferring),
            Ok(_) => Err(Error::unavailable("leadership call answered with another call's result")),
            Err(e) if e.unsupported() => Ok(false),
            Err(e) => Err(Error::unavailable(e.status().message())),
        }
    }

    /// Hands the leadership of `group` to `replica`, its partition's preferred replica, when
    /// this node's replica leads the group and `replica` can take it at once
    /// ([`crate::balance::hand_to_preferred`]); whether it asked openraft for the transfer.
    pub async fn hand_leadership(&self, group: GroupId, replica: ReplicaId) -> Result<bool> {
        let hosted = self.group(group).ok_or(Error::NotHosted { group })?;
        let Some(view) = leader_view(&self.cluster(), &hosted) else { return Ok(false) };
        let ack_fresh = crate::balance::ack_fresh(Duration::from_millis(self.inner.config.heartbeat_ms));
        if view.preferred != replica || !crate::balance::hand_to_preferred(&view, ack_fresh) {
            return Ok(false);
        }
        tracing::info!(group, to = replica, "handing the leadership to the preferred replica");
        hosted.raft.trigger().transfer_leader(replica).await.map_err(Error::unavailable)?;
        self.inner.leadership_handoffs.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        Ok(true)
    }

    /// Leaderships this node handed to a partition's preferred replica that asked for it.
    pub fn leadership_handoffs(&self) -> &std::sync::atomic::AtomicU64 {
        &self.inner.leadership_handoffs
    }

    /// The node-to-node address of `node`, as the controller has it registered.
    fn rpc_addr_of(&self, node: NodeId) -> Result<String> {
        let cluster = self.cluster();
        let record = cluster.nodes.get(&node);
        record
            .map(|n| n.rpc_addr.clone())
            .ok_or_else(|| Error::unavailable(format!("node {node} has no known address")))
    }

    /// Whether this node handed the leadership of `group` away because its replica's data is
    /// damaged (since the process started).
    fn handed_off_as_damaged(&self, group: GroupId) -> bool {
        self.inner.damaged_handoffs.lock().unwrap_or_else(|p| p.into_inner()).contains(&group)
    }

    /// Compaction and retention of every hosted replica, by its topic's cleanup policy.
    async fn cleaner_loop(&self) {
        let mut stop = self.inner.stop.subscribe();
        let interval = Duration::from_millis(self.inner.config.cleaner_interval_ms);
        let mut compacted_at: HashMap<GroupId, Cleaned> = HashMap::new();
        let mut trims: HashMap<GroupId, Trims> = HashMap::new();
        loop {
            tokio::select! {
                _ = tokio::time::sleep(interval) => {}
                _ = stop.changed() => return,
            }
            let state = self.cluster();
            let groups = self.groups();
            // What the passes kept of groups no longer hosted here (moved away, topic deleted).
            let hosted: HashSet<GroupId> = groups.iter().map(|g| g.group_id).collect();
            trims.retain(|id, _| hosted.contains(id));
            compacted_at.retain(|id, _| hosted.contains(id));
            for g in groups {
                let Some(topic) = state.topics.get(&g.topic) else { continue };
                if let Err(e) = snapshot_past_trim(&g).await {
                    tracing::warn!(group = g.group_id, error = %e, "snapshot after a trim failed; retrying next pass");
                }
                if let (Some(tier), Some(store)) = (topic.tier_policy(), &self.inner.tier_store)
                    && let Err(e) = self.tier_pass(&g, store, &tier).await
                {
                    tracing::warn!(group = g.group_id, error = %e, "tiered storage pass failed; retrying next pass");
                }
                let policy = topic.cleanup_policy();
                if policy.delete
                    && topic.tier_policy().is_none()
                    && g.raft.is_leader()
                    && let Err(e) = self.propose_retention(&g).await
                {
                    tracing::warn!(group = g.group_id, error = %e, "retention trim failed; retrying next pass");
                }
                if g.raft.is_leader() {
                    let grace = Duration::from_millis(policy.delete_retention_ms);
                    let manifest = g.partition.tier_manifest();
                    // Trims with their time in the manifest are forgotten a grace after it,
                    // whichever replica led then; others a grace after this leader saw them.
                    let timed = manifest.forget_due(crate::state_machine::now_ms(), policy.delete_retention_ms);
                    let seen = trims.entry(g.group_id).or_default().due(&manifest, std::time::Instant::now(), grace);
                    let due = timed.max(seen);
                    if let Some(to) = due
                        && let Err(e) = self.tier_write(&g, pb::tier_command::Kind::ForgetTo(to)).await
                    {
                        tracing::warn!(group = g.group_id, error = %e, "forgetting removed keys failed; retrying next pass");
                    }
                } else {
                    // A leader again later starts timing from then: removed keys are kept longer,
                    // never shorter.
                    trims.remove(&g.group_id);
                }
                let p = g.partition.clone();
                let last = compacted_at.get(&g.group_id).copied();
                let outcome = tokio::task::spawn_blocking(move || clean(&p, &policy, last)).await;
                match outcome {
                    Ok(Ok(Some(cleaned))) => {
                        compacted_at.insert(g.group_id, cleaned);
                    }
                    Ok(Ok(None)) => {}
                    Ok(Err(e)) => tracing::warn!(group = g.group_id, error = %e, "log cleaning failed"),
                    Err(e) => tracing::warn!(group = g.group_id, error = %e, "log cleaning task failed"),
                }
            }
            self.scrub().await;
        }
    }

    /// One scrub pass over the hosted replicas ([`Partition::scrub_each`],
    /// [`SCRUB_BYTES_PER_PASS`] in all). A damaged replica that leads hands its leadership to
    /// a healthy one (`damage_loop`), every pass while it stays damaged, so also after it
    /// wins an election again.
    async fn scrub(&self) {
        let mut groups = self.groups();
        groups.sort_by_key(|g| g.group_id);
        let replicas: Vec<Arc<Partition>> = groups.iter().map(|g| g.partition.clone()).collect();
        let outcomes =
            match tokio::task::spawn_blocking(move || Partition::scrub_each(&replicas, SCRUB_BYTES_PER_PASS)).await {
                Ok(outcomes) => outcomes,
                Err(e) => {
                    tracing::warn!(error = %e, "scrub task failed");
                    Vec::new()
                }
            };
        for (g, outcome) in groups.iter().zip(outcomes) {
            match outcome {
                Ok(_) => {}
                Err(e) if e.is_corrupt_data() => {
                    tracing::error!(group = g.group_id, error = %e, "the scrub found damaged data in this replica");
                }
                Err(e) => tracing::warn!(group = g.group_id, error = %e, "scrub failed"),
            }
        }
        for g in &groups {
            if g.partition.is_damaged() {
                let _ = self.inner.damage.try_send(g.group_id);
            }
        }
    }

    /// Deletes every object of a hosted replica's partition in tiered storage: its topic was
    /// deleted (every replica's node does it; deleting a missing object is fine). Failures
    /// are logged: the objects stay behind (ARCHITECTURE.md, "Tiered storage").
    async fn delete_remote_segments(&self, group: GroupId) {
        let (Some(store), Some(hosted)) = (&self.inner.tier_store, self.group(group)) else { return };
        let prefix = crate::tier::object_prefix(&hosted.topic, hosted.partition_no, group);
        match store.delete_prefix(&prefix).await {
            Ok(0) => {}
            Ok(n) => tracing::info!(group, objects = n, "deleted a deleted topic's objects in tiered storage"),
            Err(e) => tracing::warn!(group, %prefix, error = %e, "cannot delete a deleted topic's objects"),
        }
    }

    /// Whether `g`'s partition still exists (its topic was not deleted meanwhile).
    fn partition_exists(&self, g: &HostedGroup) -> bool {
        assignment_of(&self.cluster(), g).is_some()
    }

    /// Tiered storage of one replica: while it leads, copies sealed segments to the store
    /// and commits each copy through Raft, then trims remote segments past retention; on
    /// every replica, deletes local segments the store holds past local retention.
    async fn tier_pass(&self, g: &HostedGroup, store: &TierStore, policy: &TierPolicy) -> Result<()> {
        // The leader deletes trimmed objects only once its own current snapshot (the one it
        // sends) is past the trim (`snapshot_past_trim`).
        let snapshot_index = crate::types::metrics_of(&g.raft).snapshot.map_or(0, |l| l.index);
        let manifest = g.partition.tier_manifest();
        if self.leader_node(g) == Some(self.node_id()) {
            for segment in g.partition.tier_candidates() {
                self.tier_upload(g, store, &segment).await?;
            }
            self.tier_expire(g, policy).await?;
            if manifest.trimmed_to > 0 && manifest.trimmed_at <= snapshot_index {
                self.tier_collect(g, store, &manifest).await?;
            }
        }
        let p = g.partition.clone();
        let (local_ms, local_bytes) = (policy.local_retention_ms, policy.local_retention_bytes);
        let now = crate::state_machine::now_ms();
        let deleted = tokio::task::spawn_blocking(move || p.apply_local_retention(now, local_ms, local_bytes))
            .await
            .map_err(Error::unavailable)??;
        if deleted > 0 {
            tracing::info!(
                group = g.group_id,
                segments = deleted,
                "local retention deleted segments held in tiered storage"
            );
        }
        Ok(())
    }

    /// Copies one sealed segment to the store as a new object, then commits it to the
    /// manifest through Raft. The copy is checked first (opened as a log: every batch's crc,
    /// and it must end where the segment does), so a damaged local file is never copied.
    /// An upload whose commit fails leaves an object no manifest names (ARCHITECTURE.md),
    /// unless the partition was deleted meanwhile: then the object goes.
    async fn tier_upload(&self, g: &HostedGroup, store: &TierStore, segment: &logdex_log::SegmentInfo) -> Result<()> {
        let (remote, copy) = crate::tier::blocking(|| {
            g.partition.tier_cache().copy_local(segment, &g.topic, g.partition_no, g.group_id)
        })?;
        store.put_file(&remote.object, copy, remote.size_bytes).await?;
        let add = pb::tier_command::Kind::Add(remote.to_pb());
        let committed = self.tier_write(g, add).await;
        // The topic was deleted under the upload (whether the add committed or not): nothing
        // will name the object again. Each node deletes what it lists under the partition's
        // prefix once it applied the deletion, and this node may have listed before the
        // object landed; if it had not applied the deletion yet, its listing comes after.
        if !self.partition_exists(g) {
            store.delete(&remote.object).await?;
            tracing::info!(group = g.group_id, object = %remote.object, "deleted the copy of a deleted topic's segment");
            return committed;
        }
        committed?;
        tracing::info!(
            group = g.group_id,
            base_offset = remote.base_offset,
            next_offset = remote.next_offset,
            object = %remote.object,
            "segment copied to tiered storage"
        );
        Ok(())
    }

    /// Retention of a partition without tiered storage: its leader finds the start offset
    /// retention leaves in its own log and commits it as a trim, which every replica applies
    /// alike (deleting its segments that end at or before it; reads below it answer as
    /// removed), so replicas agree on the log start whatever their clocks or segment
    /// boundaries.
    async fn propose_retention(&self, g: &HostedGroup) -> Result<()> {
        let now = crate::state_machine::now_ms();
        let Some(cut) = g.partition.retention_cut(now)? else { return Ok(()) };
        self.tier_write(g, pb::tier_command::Kind::TrimTo(cut)).await?;
        tracing::info!(group = g.group_id, start_offset = cut, "retention moved the log start");
        Ok(())
    }

    /// Trims remote segments past the topic's retention (oldest first, whole segments, by
    /// newest record age and by the size of the whole log); their objects are deleted later
    /// (`tier_pass`).
    async fn tier_expire(&self, g: &HostedGroup, policy: &TierPolicy) -> Result<()> {
        let manifest = g.partition.tier_manifest();
        let local_past_remote: u64 = g.partition.tier_candidates().iter().map(|s| s.size_bytes).sum::<u64>();
        let mut remaining = manifest.size_bytes() + local_past_remote;
        let now = i64::try_from(crate::state_machine::now_ms()).unwrap_or(i64::MAX);
        let mut trim_to = None;
        for s in &manifest.segments {
            let too_old = policy.retention_ms.is_some_and(|ms| now.saturating_sub(s.max_timestamp_ms) > ms as i64);
            let too_big = policy.retention_bytes.is_some_and(|limit| remaining - s.size_bytes >= limit);
            if !(too_old || too_big) {
                break;
            }
            remaining -= s.size_bytes;
            trim_to = Some(s.next_offset);
        }
        let Some(to) = trim_to else { return Ok(()) };
        self.tier_write(g, pb::tier_command::Kind::TrimTo(to)).await?;
        tracing::info!(group = g.group_id, start_offset = to, "retention trimmed tiered storage");
        Ok(())
    }

    /// Deletes the partition's objects that retention trimmed (ending at or before
    /// `manifest.trimmed_to`) and that the manifest does not name, found by listing the
    /// partition's prefix, so trims forgotten by a restart or a change of leader and uploads
    /// that never committed below the trim are collected too. The store's trim marker is
    /// raised first: a replica installing an older snapshot then knows those objects may be
    /// gone. Once per trim point per node.
    async fn tier_collect(&self, g: &HostedGroup, store: &TierStore, manifest: &crate::tier::Manifest) -> Result<()> {
        {
            let collected = self.inner.tier_collected.lock().unwrap_or_else(|p| p.into_inner());
            if collected.get(&g.group_id) == Some(&manifest.trimmed_to) {
                return Ok(());
            }
        }
        let prefix = crate::tier::object_prefix(&g.topic, g.partition_no, g.group_id);
        store.raise_trimmed_to(&prefix, manifest.trimmed_to).await?;
        let named: std::collections::HashSet<&str> = manifest.segments.iter().map(|s| s.object.as_str()).collect();
        let mut deleted = 0;
        for key in store.list(&prefix).await? {
            let trimmed = crate::tier::range_of_key(&key).is_some_and(|(_, next)| next <= manifest.trimmed_to);
            if trimmed && !named.contains(key.as_str()) {
                store.delete(&key).await?;
                deleted += 1;
            }
        }
        if deleted > 0 {
            tracing::info!(
                group = g.group_id,
                objects = deleted,
                trimmed_to = manifest.trimmed_to,
                "deleted trimmed objects"
            );
        }
        self.inner.tier_collected.lock().unwrap_or_else(|p| p.into_inner()).insert(g.group_id, manifest.trimmed_to);
        Ok(())
    }

    async fn tier_write(&self, g: &HostedGroup, kind: pb::tier_command::Kind) -> Result<()> {
        // A trim carries the time it was proposed at, so that any later leader times its keys.
        let at_ms = if matches!(kind, pb::tier_command::Kind::TrimTo(_)) { crate::state_machine::now_ms() } else { 0 };
        let command = pb::Command { kind: Some(pb::command::Kind::Tier(pb::TierCommand { kind: Some(kind), at_ms })) };
        match tokio::time::timeout(OPERATION_TIMEOUT, g.raft.client_write(command)).await {
            Err(_) => Err(Error::Timeout("tiered storage command waiting for commit".into())),
            Ok(Ok(_)) => Ok(()),
            Ok(Err(e)) => Err(write_failed(e)),
        }
    }

    /// Starts a move driver for every moving partition this node leads.
    fn drive_moves(&self, state: &ClusterState) {
        for topic in state.topics.values() {
            for p in &topic.partitions {
                let Some(target) = p.target.clone() else { continue };
                let Some(hosted) = self.group(p.group_id) else { continue };
                if !hosted.raft.is_leader() {
                    continue;
                }
                let mut moving = self.inner.moving.lock().unwrap_or_else(|e| e.into_inner());
                if !moving.insert(p.group_id) {
                    continue;
                }
                let node = self.clone();
                let (topic, partition) = (topic.name.clone(), p.partition);
                tokio::spawn(async move {
                    let group = hosted.group_id;
                    if let Err(e) = node.drive_move(&hosted, &topic, partition, &target).await {
                        tracing::warn!(group, error = %e, "partition move step failed; retrying");
                    }
                    node.inner.moving.lock().unwrap_or_else(|e| e.into_inner()).remove(&group);
                });
            }
        }
    }

    /// One pass of a move, idempotent: add missing target replicas as learners
    /// (waiting for them to catch up), make the target the voter set, then
    /// tell the controller the move is complete.
    async fn drive_move(
        &self,
        hosted: &HostedGroup,
        topic: &str,
        partition: u32,
        target: &[ReplicaRecord],
    ) -> Result<()> {
        let state = self.cluster();
        let membership = crate::types::metrics_of(&hosted.raft).membership_config.membership().clone();
        for r in target {
            if membership.get_node(&r.replica_id).is_some() {
                continue;
            }
            let rpc_addr = state.nodes.get(&r.node_id).map(|n| n.rpc_addr.clone()).unwrap_or_default();
            tracing::info!(group = hosted.group_id, replica = r.replica_id, node = r.node_id, "move: adding learner");
            let node = pb::Node { node_id: r.node_id, rpc_addr };
            // Not blocking: openraft would wait here, deaf to a replaced move, for a learner
            // whose node is down; `await_catch_up` below waits for it and watches the target.
            tokio::time::timeout(OPERATION_TIMEOUT, hosted.raft.add_learner(r.replica_id, node, false))
                .await
                .map_err(|_| Error::Timeout("adding a learner".into()))?
                .map_err(Error::unavailable)?;
        }
        let wanted: std::collections::BTreeSet<u64> = target.iter().map(|r| r.replica_id).collect();
        self.await_catch_up(hosted, target).await?;
        // From here on the voters change: the controller stops taking a replacement first.
        let fix = pb::ControllerCommand {
            kind: Some(pb::controller_command::Kind::FixMove(pb::FixMove {
                topic: topic.to_string(),
                partition,
                group_id: hosted.group_id,
                replica_ids: wanted.iter().copied().collect(),
            })),
        };
        let fixed = self.controller_write(fix, false).await?;
        if fixed.status != "ok" && fixed.status != "exists" {
            return Err(Error::Conflict(format!("move not continued: {}", fixed.message)));
        }
        if !wanted.contains(&hosted.replica_id) {
            // This leader leaves the group. A learner cannot take leadership,
            // so first make the target replicas voters beside the current
            // ones, then hand leadership to one of them; the new leader
            // drives the rest of the move (dropping the old voters).
            let membership = crate::types::metrics_of(&hosted.raft).membership_config.membership().clone();
            let voters: std::collections::BTreeSet<u64> = membership.voter_ids().collect();
            if !wanted.is_subset(&voters) || membership.get_joint_config().len() > 1 {
                let both: std::collections::BTreeSet<u64> = voters.union(&wanted).copied().collect();
                tracing::info!(group = hosted.group_id, voters = ?both, "move: promoting the target replicas beside the current voters");
                tokio::time::timeout(MOVE_STEP_TIMEOUT, hosted.raft.change_membership(both, true))
                    .await
                    .map_err(|_| Error::Timeout("promoting the target replicas".into()))?
                    .map_err(Error::unavailable)?;
            }
            // The most caught-up target replica takes over (a down one never
            // matches, so it is not picked while another is up).
            let metrics = crate::types::metrics_of(&hosted.raft);
            let matched = |id: u64| {
                metrics.replication.as_ref().and_then(|r| r.get(&id).copied().flatten()).map_or(0, |l| l.index)
            };
            if let Some(to) = target.iter().rev().max_by_key(|r| matched(r.replica_id)) {
                tracing::info!(
                    group = hosted.group_id,
                    to = to.replica_id,
                    "move: transferring leadership off a removed leader"
                );
                hosted.raft.trigger().transfer_leader(to.replica_id).await.map_err(Error::unavailable)?;
            }
            return Ok(());
        }
        let membership = crate::types::metrics_of(&hosted.raft).membership_config.membership().clone();
        let voters: std::collections::BTreeSet<u64> = membership.voter_ids().collect();
        let learners_extra = membership.learner_ids().any(|l| !wanted.contains(&l));
        if voters != wanted || learners_extra || membership.get_joint_config().len() > 1 {
            tracing::info!(group = hosted.group_id, voters = ?wanted, "move: changing membership");
            tokio::time::timeout(MOVE_STEP_TIMEOUT, hosted.raft.change_membership(wanted.clone(), false))
                .await
                .map_err(|_| Error::Timeout("changing membership".into()))?
                .map_err(Error::unavailable)?;
        }
        let cmd = pb::ControllerCommand {
            kind: Some(pb::controller_command::Kind::CompleteMove(pb::CompleteMove {
                topic: topic.to_string(),
                partition,
                group_id: hosted.group_id,
                replica_ids: wanted.into_iter().collect(),
            })),
        };
        let result = self.controller_write(cmd, false).await?;
        tracing::info!(group = hosted.group_id, status = %result.status, message = %result.message, "move: completion recorded");
        Ok(())
    }

    /// Waits until every target replica that is not yet a voter has the leader's log up to
    /// where it ends now, and until a majority of the target replicas answer the leader.
    /// Until then a membership change could make a voter set whose quorum needs a replica
    /// that is down or far behind, and the group stops taking writes: a replica that is
    /// behind is a learner the move adds (openraft's own `add_learner(.., blocking)` counts
    /// a learner within `replication_lag_threshold` entries as caught up, so a short log
    /// passes at once); a replica that is down may also be a voter already (a move from
    /// [3, 2, 1] to [1, 3] while node 3 is down would leave a voter set of two with one of
    /// them gone). A move that waits leaves the partition as it was: the pass times out and
    /// the next reconcile tries again, and another move can replace it meanwhile.
    async fn await_catch_up(&self, hosted: &HostedGroup, target: &[ReplicaRecord]) -> Result<()> {
        let metrics = crate::types::metrics_of(&hosted.raft);
        let voters: std::collections::BTreeSet<u64> = metrics.membership_config.membership().voter_ids().collect();
        let pending: Vec<&ReplicaRecord> = target.iter().filter(|r| !voters.contains(&r.replica_id)).collect();
        let goal = metrics.last_log_index.unwrap_or(0);
        let matched = |m: &crate::types::RaftMetrics, id: u64| {
            m.replication.as_ref().and_then(|r| r.get(&id).copied().flatten()).map_or(0, |l| l.index)
        };
        // Answering: the leader itself, or a replica that acknowledged the leader within the
        // shortest election timeout (heartbeats go several times in it).
        let recent = Duration::from_millis(self.inner.config.election_timeout_min_ms);
        let answering = |m: &crate::types::RaftMetrics, id: u64| {
            id == hosted.replica_id
                || m.heartbeat
                    .as_ref()
                    .and_then(|h| h.get(&id).cloned().flatten())
                    .is_some_and(|acked| openraft::Instant::elapsed(&*acked) < recent)
        };
        let ready = |m: &crate::types::RaftMetrics| {
            // A leader that lost its term stops waiting: the next leader drives the move.
            m.replication.is_none()
                || (pending.iter().all(|r| matched(m, r.replica_id) >= goal)
                    && target.iter().filter(|r| answering(m, r.replica_id)).count() * 2 > target.len())
        };
        // A move replaced meanwhile (say, one onto a node that is down, taken back) ends the
        // wait at once: the next pass drives the new target.
        let replaced = async {
            let mut changed = self.subscribe_cluster();
            loop {
                let state = self.cluster();
                let current = state.find_group(hosted.group_id).and_then(|(_, p)| p.target.as_deref());
                if current != Some(target) || changed.changed().await.is_err() {
                    return;
                }
            }
        };
        let wait = hosted.raft.wait(Some(MOVE_STEP_TIMEOUT));
        let waited = tokio::select! {
            waited = wait.metrics(ready, "move: target replicas catch up and answer") => waited,
            () = replaced => return Err(Error::Conflict("the move was replaced by another one".into())),
        };
        match waited {
            Ok(m) if m.replication.is_some() => Ok(()),
            Ok(_) => Err(Error::NotLeader { group: hosted.group_id, leader_node: None }),
            Err(openraft::metrics::WaitError::Timeout(..)) => {
                let m = crate::types::metrics_of(&hosted.raft);
                let behind = pending.iter().filter(|r| matched(&m, r.replica_id) < goal).map(|r| {
                    format!("replica {} on node {} has not caught up to log index {goal}", r.replica_id, r.node_id)
                });
                let silent = target
                    .iter()
                    .filter(|r| !answering(&m, r.replica_id))
                    .map(|r| format!("replica {} on node {} does not answer", r.replica_id, r.node_id));
                Err(Error::Timeout(behind.chain(silent).collect::<Vec<_>>().join("; ")))
            }
            Err(e) => Err(Error::unavailable(e)),
        }
    }

    /// Removes replica directories this node no longer hosts (a removal that
    /// crashed half way, or a replica still referenced when it was removed).
    /// Replicas still `assigned` here are kept even when not running (they failed to start).
    fn sweep_orphans(&self, assigned: &std::collections::HashSet<String>) -> Result<()> {
        let root = self.inner.config.data_dir.join("partitions");
        let entries = match std::fs::read_dir(&root) {
            Ok(e) => e,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
            Err(e) => return Err(e.into()),
        };
        let hosted: std::collections::HashSet<String> =
            self.groups_read().values().map(|g| format!("{}-{}", g.group_id, g.replica_id)).collect();
        for entry in entries {
            let entry = entry?;
            let name = entry.file_name().to_string_lossy().into_owned();
            if hosted.contains(&name) || assigned.contains(&name) {
                continue;
            }
            let Some(replica) = name.split_once('-').and_then(|(_, r)| r.parse::<ReplicaId>().ok()) else {
                continue;
            };
            tracing::info!(dir = %name, "removing data of a replica this node no longer hosts");
            self.inner.index.drop_group(replica)?;
            self.inner.raft_log.delete_group(replica)?;
            std::fs::remove_dir_all(entry.path())?;
            self.reclaim_removed();
        }
        Ok(())
    }

    /// Gives the disk of removed replicas back: their Raft log entries and index keys are
    /// only marked removed (LSM tombstones, and a dropped group's keys), and the space would
    /// come back only when later writes happen to compact the tables holding them, which an
    /// idle node never does. A few seconds after the last removal (a topic's replicas go in
    /// one reconcile pass), the Raft log and the index are flushed and compacted whole, on
    /// the blocking pool, one compaction at a time.
    fn reclaim_removed(&self) {
        use std::sync::atomic::Ordering;
        if self.inner.reclaim_due.swap(true, Ordering::AcqRel) {
            return;
        }
        let node = self.clone();
        tokio::spawn(async move {
            tokio::time::sleep(RECLAIM_DELAY).await;
            let _one_at_a_time = node.inner.reclaiming.lock().await;
            node.inner.reclaim_due.store(false, Ordering::Release);
            let (raft_log, index) = (node.inner.raft_log.clone(), node.inner.index.clone());
            let started = std::time::Instant::now();
            let compacted = tokio::task::spawn_blocking(move || -> Result<()> {
                raft_log.compact()?;
                index.compact()?;
                Ok(())
            })
            .await;
            match compacted {
                Ok(Ok(())) => tracing::info!(
                    took_ms = started.elapsed().as_millis() as u64,
                    "compacted the Raft log and the index after removing replicas"
                ),
                Ok(Err(e)) => tracing::warn!(error = %e, "cannot compact after removing replicas; later writes will"),
                Err(e) => tracing::warn!(error = %e, "the compaction after removing replicas did not finish"),
            }
        });
    }

    fn groups_read(&self) -> std::sync::RwLockReadGuard<'_, HashMap<GroupId, Arc<HostedGroup>>> {
        self.inner.groups.read().unwrap_or_else(|p| p.into_inner())
    }

    async fn start_group(
        &self,
        state: &ClusterState,
        topic: &str,
        record: &PartitionRecord,
        replica: ReplicaId,
    ) -> Result<()> {
        let group = record.group_id;
        let dir = self.partition_dir(group, replica);
        let log_config = state
            .topics
            .get(topic)
            .map_or_else(|| self.inner.config.log.clone(), |t| t.log_config(&self.inner.config.log));
        let (index, store) = (self.inner.index.clone(), self.inner.tier_store.clone());
        let records = self.inner.records.clone();
        let (partition, applied, snapshots) = tokio::task::spawn_blocking(move || -> Result<_> {
            let (partition, applied) = Partition::open_with_tier(group, replica, &dir, log_config, index, store)?;
            let partition = partition.with_record_cache(records);
            let snapshots = SnapshotStore::open(dir.join("snapshots"))?;
            Ok((partition, applied, snapshots))
        })
        .await
        .map_err(|e| Error::unavailable(format!("opening the replica did not finish: {e}")))??;
        let partition = Arc::new(partition);
        let sm = GroupStateMachine::new(GroupData::Partition(partition.clone()), applied, snapshots);
        let commit_release = CommitNoticeRelease::default();
        let network = NetworkFactory::new(
            group,
            self.inner.pool.clone(),
            self.inner.calls.clone(),
            self.inner.damage.clone(),
            Some(commit_release.clone()),
        );
        let raft = Raft::new(replica, self.inner.raft_config.clone(), network, self.inner.raft_log.group(replica), sm)
            .await
            .map_err(Error::unavailable)?;
        let initializes = record.moves == 0 && record.target.is_none();
        let members: BTreeMap<u64, pb::Node> = record
            .replicas
            .iter()
            .filter(|r| r.initial)
            .map(|r| {
                let rpc_addr = state.nodes.get(&r.node_id).map(|n| n.rpc_addr.clone()).unwrap_or_default();
                (r.replica_id, pb::Node { node_id: r.node_id, rpc_addr })
            })
            .collect();
        let preferred = record.replicas.first().map(|r| r.replica_id) == Some(replica);
        let batcher = Batcher::start(
            group,
            propose_fn(raft.clone(), partition.clone()),
            self.inner.raft_log.write_load().clone(),
        );
        let hosted = Arc::new(HostedGroup {
            group_id: group,
            replica_id: replica,
            topic: topic.to_string(),
            partition_no: record.partition,
            raft: raft.clone(),
            partition,
            commit_release,
            batcher,
            leader_reads: LeaderReads::new(&raft, group),
        });
        self.inner.groups.write().unwrap_or_else(|p| p.into_inner()).insert(group, hosted);
        tracing::info!(group, replica, topic, partition = record.partition, "partition replica started");
        if initializes {
            tokio::spawn(initialize_group(raft, members, preferred));
        }
        Ok(())
    }

    async fn remove_group(&self, group: GroupId) -> Result<()> {
        let Some(hosted) = self.inner.groups.write().unwrap_or_else(|p| p.into_inner()).remove(&group) else {
            return Ok(());
        };
        hosted.raft.shutdown().await.map_err(Error::unavailable)?;
        self.inner.raft_log.delete_group(hosted.replica_id)?;
        self.reclaim_removed();
        tracing::info!(group, replica = hosted.replica_id, "partition replica removed");
        // Readers may still hold the partition; the data goes when they let go
        // (at once, usually), else the orphan sweep removes it.
        if let Ok(h) = Arc::try_unwrap(hosted)
            && let Ok(p) = Arc::try_unwrap(h.partition)
        {
            p.destroy()?;
        }
        Ok(())
    }

    /// True while replica `replica` of `group` runs on this node.
    fn hosts_replica(&self, group: GroupId, replica: ReplicaId) -> bool {
        self.group(group).is_some_and(|g| g.replica_id == replica)
    }

    fn partition_dir(&self, group: GroupId, replica: ReplicaId) -> PathBuf {
        self.inner.config.data_dir.join("partitions").join(format!("{group}-{replica}"))
    }

    async fn checkpoint_loop(&self) {
        let mut stop = self.inner.stop.subscribe();
        let mut last: HashMap<GroupId, u64> = HashMap::new();
        // When each failing group's error was last logged: once a minute while it fails.
        let mut failing: HashMap<GroupId, std::time::Instant> = HashMap::new();
        loop {
            tokio::select! {
                _ = tokio::time::sleep(Duration::from_secs(1)) => {}
                _ = stop.changed() => return,
            }
            let groups: Vec<Arc<HostedGroup>> = self.groups_read().values().cloned().collect();
            for g in groups {
                let hw = g.partition.high_watermark();
                if last.get(&g.group_id) == Some(&hw) {
                    continue;
                }
                let p = g.partition.clone();
                match tokio::task::spawn_blocking(move || p.checkpoint()).await {
                    Ok(Ok(())) => {
                        last.insert(g.group_id, hw);
                        failing.remove(&g.group_id);
                    }
                    // A replica removed meanwhile (a move took it away) may have lost its
                    // files under the checkpoint: nothing of it is left to keep.
                    Ok(Err(e)) if !self.hosts_replica(g.group_id, g.replica_id) => {
                        tracing::debug!(group = g.group_id, error = %e, "checkpoint of a removed replica skipped");
                    }
                    Ok(Err(e)) => {
                        let due = failing.get(&g.group_id).is_none_or(|at| at.elapsed() >= Duration::from_secs(60));
                        if due {
                            failing.insert(g.group_id, std::time::Instant::now());
                            tracing::error!(
                                group = g.group_id,
                                error = %e,
                                "checkpoint failed (logged once a minute while it fails)"
                            );
                        }
                    }
                    Err(e) => tracing::error!(group = g.group_id, error = %e, "checkpoint task failed"),
                }
            }
        }
    }

    /// Where a group's snapshots live on this node.
    pub fn snapshot_root(&self, group: GroupId) -> Option<PathBuf> {
        if group == CONTROLLER_GROUP {
            return Some(self.inner.config.data_dir.join("controller").join("snapshots"));
        }
        self.group(group).map(|g| g.partition.dir().join("snapshots"))
    }

    /// Follower read-index counters of this node.
    pub fn read_index_stats(&self) -> &ReadIndexStats {
        &self.inner.read_index_stats
    }

    /// How this node's leader replicas sent their heartbeats.
    pub fn heartbeat_stats(&self) -> &crate::calls::HeartbeatStats {
        &self.inner.calls.heartbeats
    }

    /// What this node's leader replicas sent on their replication streams.
    pub fn append_stats(&self) -> &crate::calls::AppendStats {
        &self.inner.calls.appends
    }

    /// The node's cache of looked-up records (for its metrics).
    pub fn record_cache(&self) -> &crate::record_cache::RecordCache {
        &self.inner.records
    }

    /// Group-commit counters of this node's Raft log.
    pub fn raft_log_sync_stats(&self) -> &crate::log_store::SyncStats {
        self.inner.raft_log.sync_stats()
    }

    /// The hosted replica of `group`.
    pub fn group(&self, group: GroupId) -> Option<Arc<HostedGroup>> {
        self.groups_read().get(&group).cloned()
    }

    pub fn groups(&self) -> Vec<Arc<HostedGroup>> {
        self.groups_read().values().cloned().collect()
    }

    /// The node id of the leader this replica knows, if any.
    pub fn leader_node(&self, group: &HostedGroup) -> Option<NodeId> {
        leader_node_of(&group.raft)
    }

    /// The group's leader as this node reports it to others (status, describe, readiness):
    /// none while this replica leads but lost its quorum, unlike [`Node::leader_node`], which
    /// routing uses (the replica still takes writes, which wait for the quorum or time out).
    pub fn reported_leader_node(&self, group: &HostedGroup) -> Option<NodeId> {
        let m = crate::types::metrics_of(&group.raft);
        if self.names_no_leader(&m) {
            return None;
        }
        leader_node_of(&group.raft)
    }

    /// Whether the replica of metrics `m` names no leader to anyone: it leads but lost its
    /// quorum ([`Node::cut_off`]), or it stopped (an error of its storage: its metrics keep
    /// the leader it last knew, itself maybe, while the others elect another; [`leader_of`]).
    fn names_no_leader(&self, m: &crate::types::RaftMetrics) -> bool {
        m.running_state.is_err() || self.cut_off(m)
    }

    /// The replicas of this node (`None` for the controller's) whose group stopped on an error
    /// (see [`stopped_by`]), with the reason: they take no part in their groups until the
    /// node restarts.
    pub fn stopped_replicas(&self) -> Vec<(Option<Arc<HostedGroup>>, String)> {
        let mut stopped: Vec<(Option<Arc<HostedGroup>>, String)> = self
            .groups()
            .into_iter()
            .filter_map(|g| stopped_by(&crate::types::metrics_of(&g.raft)).map(|why| (Some(g), why)))
            .collect();
        if let Some(why) = stopped_by(&crate::types::metrics_of(&self.inner.controller_raft)) {
            stopped.push((None, why));
        }
        stopped
    }

    /// Whether the replica of metrics `m` leads but lost its quorum (see [`lost_its_quorum`]).
    fn cut_off(&self, m: &crate::types::RaftMetrics) -> bool {
        m.current_leader == Some(m.id) && lost_its_quorum(m, self.quorum_lost_after())
    }

    /// Appends records through the group's leader replica on this node,
    /// batched with concurrent produces; returns the offset of the first.
    pub async fn produce_records(&self, group: GroupId, records: Vec<logdex_log::Record>) -> Result<u64> {
        let hosted = self.group(group).ok_or(Error::NotHosted { group })?;
        if !hosted.raft.is_leader() {
            return Err(Error::NotLeader { group, leader_node: self.leader_node(&hosted) });
        }
        hosted.batcher.produce(records).await
    }

    /// Sends records to the node leading the group (forwarding a write once), in one RPC
    /// with concurrent writes forwarded there. `NotLeader` and transport failures before
    /// sending are definite: nothing was written.
    pub async fn remote_produce(&self, node: NodeId, group: GroupId, records: &[logdex_log::Record]) -> Result<u64> {
        let weak = Arc::downgrade(&self.inner);
        let batcher =
            self.inner.forwarders.get(node, group, self.inner.raft_log.write_load(), || forward_fn(weak, node, group));
        let result = batcher.produce(records.to_vec()).await;
        if let Err(Error::NotLeader { .. } | Error::NotHosted { .. } | Error::NodeUnreachable(_)) = &result {
            self.inner.forwarders.forget(node, group);
        }
        result
    }

    async fn send_produce(&self, node: NodeId, group: GroupId, records: &[logdex_log::Record]) -> Result<u64> {
        let addr = self.rpc_addr_of(node)?;
        let request = || pb::ProduceRequest {
            header: Some(pb::GroupHeader { group_id: group, target_replica: 0 }),
            records: records.iter().map(wire::record_to_pb).collect(),
        };
        use crate::calls::CallError;
        use pb::call_response::Result as Answer;
        let answer =
            match self.inner.calls.call(&addr, pb::call_request::Call::Produce(request()), OPERATION_TIMEOUT).await {
                Ok(Answer::Produce(answer)) => answer,
                Ok(_) => return Err(Error::unavailable("produce call answered with another call's result")),
                Err(e) if e.unsupported() => {
                    let mut client = self.inner.pool.client(&addr).map_err(Error::unavailable)?;
                    let mut request = tonic::Request::new(request());
                    request.set_timeout(OPERATION_TIMEOUT);
                    client.produce(request).await.map_err(|s| produce_error(group, node, s, true))?.into_inner()
                }
                // Nothing left this node: definitely not written.
                Err(CallError::NotSent(s)) => return Err(Error::NodeUnreachable(s.message().to_string())),
                Err(CallError::Failed(s)) => return Err(produce_error(group, node, s, false)),
            };
        match answer.result {
            Some(pb::produce_response::Result::BaseOffset(o)) => Ok(o),
            Some(pb::produce_response::Result::NotLeader(n)) => {
                Err(Error::NotLeader { group, leader_node: (n != 0).then_some(n) })
            }
            None => Err(Error::unavailable("empty produce answer")),
        }
    }

    /// Whether `hosted` is still this node's replica of its group.
    fn still_hosts(&self, hosted: &HostedGroup) -> bool {
        self.group(hosted.group_id).is_some_and(|now| now.replica_id == hosted.replica_id)
    }

    /// Waits until this replica may serve a read in `mode`; returns its high watermark then.
    pub async fn read_barrier(&self, hosted: &HostedGroup, mode: ReadMode) -> Result<()> {
        if mode == ReadMode::Follower || cfg!(feature = "mutant-local-linearizable") {
            // (The mutant serves every mode from local state, without a read index.)
            return Ok(());
        }
        let strict = mode == ReadMode::Strict;
        // A replica that does not know its leader yet (an election, a restart, a replica
        // a move just added), or whose leader does not answer (killed, paused, cut off),
        // waits for one that answers, bounded by an election's length, before 503.
        let election_max = Duration::from_millis(self.inner.config.election_timeout_max_ms);
        let deadline = tokio::time::Instant::now() + election_max + RPC_TIMEOUT + READ_LEADER_WAIT_MARGIN;
        let read_index = loop {
            match self.read_index_once(hosted, strict, deadline).await {
                Ok(index) => break index,
                // Leadership moved under the read (a transfer, a leader a move removes, an
                // election): the leader there is now answers, within the same bound.
                // Unless the replica left this node meanwhile (a move, a topic deletion):
                // the caller finds where the read goes now.
                Err(Error::NotLeader { .. } | Error::Unavailable(_))
                    if tokio::time::Instant::now() < deadline && self.still_hosts(hosted) =>
                {
                    tokio::time::sleep(LEADER_POLL).await;
                }
                Err(e) => return Err(e),
            }
        };
        if applied_index(&hosted.raft) >= read_index {
            return Ok(());
        }
        self.wait_applied(hosted, read_index, OPERATION_TIMEOUT).await
    }

    /// One read index for `hosted`: this replica's own if it leads, else its leader's
    /// (waiting for a leader to be known until `deadline`).
    async fn read_index_once(&self, hosted: &HostedGroup, strict: bool, deadline: tokio::time::Instant) -> Result<u64> {
        let known_leader = loop {
            if hosted.raft.is_leader() {
                break None;
            }
            if let Some(leader) = leader_of(&hosted.raft) {
                break Some(leader);
            }
            if tokio::time::Instant::now() >= deadline {
                return Err(Error::unavailable("no leader known"));
            }
            tokio::time::sleep(LEADER_POLL).await;
        };
        if let Some((leader, leader_replica)) = known_leader {
            // Concurrent follower reads of the groups one node leads share one call.
            self.inner.read_index_stats.reads.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            let coalescer = self
                .inner
                .read_index
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .entry((leader, strict))
                .or_default()
                .clone();
            let node = self.clone();
            let fetch: crate::coalesce::Fetch<pb::GroupHeader> = Arc::new(move |headers| {
                let node = node.clone();
                Box::pin(async move { node.remote_read_indexes(leader, strict, headers).await })
            });
            let header = pb::GroupHeader { group_id: hosted.group_id, target_replica: leader_replica };
            // A leader that stops answering without closing its connections (paused, cut
            // off) holds the call until its deadline; once this replica sees another
            // leader, or an election, the read asks there instead. The wait arms no timer of
            // its own: the read's bound below ends it.
            let wait = hosted.raft.wait(None);
            let deposed = wait.metrics(|m| m.current_leader != Some(leader_replica), "partition leader changes");
            tokio::select! {
                answer = coalescer.get(header, fetch) => answer,
                Ok(_) = deposed => Err(Error::NotLeader { group: hosted.group_id, leader_node: None }),
                () = tokio::time::sleep_until(deadline) => {
                    Err(Error::unavailable(format!("leader node {leader} gave no read index in time")))
                }
            }
        } else {
            hosted.leader_read_log_id(strict).await.map(|l| l.index)
        }
    }

    /// Asks node `leader` for the read index of each group in `headers` (ReadIndex if
    /// `strict`, else a lease read), in one call; answers in the order of `headers`.
    async fn remote_read_indexes(
        &self,
        leader: NodeId,
        strict: bool,
        headers: Vec<pb::GroupHeader>,
    ) -> Vec<Result<u64>> {
        self.inner.read_index_stats.fetches.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let Some(addr) = self.cluster().nodes.get(&leader).map(|n| n.rpc_addr.clone()) else {
            let message = format!("leader node {leader} has no known address");
            return headers.iter().map(|_| Err(Error::unavailable(message.clone()))).collect();
        };
        // Each group once, however many reads of it wait.
        let mut unique: Vec<pb::GroupHeader> = Vec::new();
        let positions: Vec<usize> = headers
            .iter()
            .map(|h| match unique.iter().position(|u| u == h) {
                Some(i) => i,
                None => {
                    unique.push(*h);
                    unique.len() - 1
                }
            })
            .collect();
        let answers = if let [header] = unique[..] {
            vec![self.remote_read_index(&addr, header, strict).await]
        } else {
            self.remote_read_index_batch(&addr, &unique, strict).await
        };
        positions
            .into_iter()
            .map(|i| match answers.get(i) {
                Some(Ok(index)) => Ok(*index),
                Some(Err(Error::Unavailable(m))) => {
                    Err(Error::Unavailable(format!("leader node {leader} gave no read index: {m}")))
                }
                Some(Err(e)) => Err(Error::unavailable(e.to_string())),
                None => Err(Error::unavailable("read-index batch answered fewer groups than it was asked")),
            })
            .collect()
    }

    /// One `ReadIndexBatch` call; a peer that does not know it gets one call per group.
    async fn remote_read_index_batch(&self, addr: &str, headers: &[pb::GroupHeader], strict: bool) -> Vec<Result<u64>> {
        use pb::call_response::Result as Answer;
        use pb::read_index_outcome::Result as Outcome;
        let request = pb::ReadIndexBatchRequest { headers: headers.to_vec(), strict };
        match self.inner.calls.call(addr, pb::call_request::Call::ReadIndexBatch(request), RPC_TIMEOUT).await {
            Ok(Answer::ReadIndexBatch(answer)) => answer
                .outcomes
                .into_iter()
                .map(|outcome| match outcome.result {
                    Some(Outcome::ReadIndex(r)) => Ok(r.read_log_id.map_or(0, |l| l.index)),
                    Some(Outcome::Error(e)) => Err(Error::Unavailable(e.message)),
                    None => Err(Error::unavailable("empty read-index outcome")),
                })
                .collect(),
            Ok(_) => headers
                .iter()
                .map(|_| Err(Error::unavailable("read-index batch answered with another call's result")))
                .collect(),
            Err(e) if e.unsupported() => {
                futures::future::join_all(headers.iter().map(|h| self.remote_read_index(addr, *h, strict))).await
            }
            Err(e) => headers.iter().map(|_| Err(Error::remote_unavailable(e.status().message()))).collect(),
        }
    }

    /// Asks the node at `addr` for one group's read index.
    async fn remote_read_index(&self, addr: &str, header: pb::GroupHeader, strict: bool) -> Result<u64> {
        let request = pb::ReadIndexRequest { header: Some(header), strict };
        use pb::call_response::Result as Answer;
        let answer = match self.inner.calls.call(addr, pb::call_request::Call::ReadIndex(request), RPC_TIMEOUT).await {
            Ok(Answer::ReadIndex(answer)) => answer,
            Ok(_) => return Err(Error::unavailable("read-index call answered with another call's result")),
            Err(e) if e.unsupported() => {
                let mut client = self.inner.pool.client(addr).map_err(Error::unavailable)?;
                let mut request = tonic::Request::new(request);
                request.set_timeout(RPC_TIMEOUT);
                client.read_index(request).await.map_err(Error::unavailable)?.into_inner()
            }
            Err(e) => return Err(Error::remote_unavailable(e.status().message())),
        };
        Ok(answer.read_log_id.map_or(0, |l| l.index))
    }

    /// Waits until the replica applied the Raft log through `index`.
    pub async fn wait_applied(&self, hosted: &HostedGroup, index: u64, timeout: Duration) -> Result<()> {
        hosted
            .raft
            .wait(Some(timeout))
            .applied_index_at_least(Some(index), "read barrier")
            .await
            .map(|_| ())
            .map_err(|e| Error::unavailable(format!("replica did not catch up: {e}")))
    }

    /// Waits until the replica's high watermark exceeds `offset`.
    pub async fn wait_high_watermark(&self, hosted: &HostedGroup, offset: u64, timeout: Duration) -> Result<()> {
        let deadline = tokio::time::Instant::now() + timeout;
        use crate::types::WatchReceiver;
        let mut metrics = hosted.raft.metrics();
        while hosted.partition.high_watermark() <= offset {
            if tokio::time::timeout_at(deadline, metrics.changed()).await.is_err() {
                return Err(Error::unavailable(format!("replica has not applied offset {offset} yet")));
            }
        }
        Ok(())
    }

    /// Whether this replica answers `follower` reads: it is a voter of its group. A learner is
    /// a move's new replica still catching up, empty until its snapshot arrives, so its state
    /// may lack records its partition has had for long; its `follower` reads go to a voter
    /// (a `linearizable` or `strict` read waits on it for the leader's read index instead).
    pub fn serves_follower_reads(&self, hosted: &HostedGroup) -> bool {
        let m = crate::types::metrics_of(&hosted.raft);
        m.membership_config.membership().voter_ids().any(|v| v == m.id)
    }

    /// Whether this replica's group stopped ([`stopped_by`]): it serves nothing until the node
    /// restarts (its state is frozen where it stopped), and names no leader.
    pub fn replica_stopped(&self, hosted: &HostedGroup) -> bool {
        use crate::types::WatchReceiver;
        hosted.raft.metrics().borrow_watched().running_state.is_err()
    }

    /// Looks a key up on the hosted replica after the read barrier of `mode`.
    pub async fn read_key(&self, group: GroupId, key: &[u8], mode: ReadMode) -> Result<(KeyRead, u64)> {
        let hosted = self.group(group).ok_or(Error::NotHosted { group })?;
        self.read_barrier(&hosted, mode).await?;
        // The lookup and the high watermark it reports are one consistent snapshot.
        with_tier(&hosted.partition, || hosted.partition.read_key_at(key)).await
    }

    /// Records of the hosted replica from `offset` (no read barrier: the caller's), fetching
    /// remote segments of tiered storage into the cache when the read needs them.
    pub async fn read_records(
        &self,
        hosted: &HostedGroup,
        offset: u64,
        max_records: usize,
        max_bytes: usize,
    ) -> Result<Vec<(u64, logdex_log::Record)>> {
        with_tier(&hosted.partition, || hosted.partition.read_records(offset, max_records, max_bytes)).await
    }

    /// Partition replicas the cluster state assigns to this node that are not started yet
    /// (not counting those that failed to start: they are retried, and would keep the node
    /// from ever being ready). `/readyz` waits for none.
    pub fn replicas_starting(&self) -> usize {
        let me = self.node_id();
        let state = self.cluster();
        let hosted = self.groups_read();
        let failed = self.inner.failed_starts.lock().unwrap_or_else(|p| p.into_inner());
        state
            .topics
            .values()
            .flat_map(|t| t.partitions.iter())
            .filter(|p| p.all_replicas().any(|r| r.node_id == me))
            .filter(|p| !hosted.contains_key(&p.group_id) && !failed.contains(&p.group_id))
            .count()
    }

    /// This node's view of its groups, for routing and describe.
    pub fn status(&self) -> pb::StatusResponse {
        let mut groups: Vec<pb::GroupStatus> = self
            .groups()
            .iter()
            .map(|g| {
                let m = crate::types::metrics_of(&g.raft);
                // A leader a quorum stopped answering, or a replica stopped by an error, is
                // reported as knowing no leader: the others have elected another one by now (or
                // will), and its writes cannot commit.
                let no_leader = self.names_no_leader(&m);
                pb::GroupStatus {
                    group_id: g.group_id,
                    replica_id: g.replica_id,
                    leader_replica: if no_leader { 0 } else { m.current_leader.unwrap_or(0) },
                    leader_node: if no_leader { 0 } else { leader_node_of(&g.raft).unwrap_or(0) },
                    term: m.current_term,
                    high_watermark: g.partition.high_watermark(),
                    log_start_offset: g.partition.log_start_offset(),
                    applied_index: m.last_applied.map_or(0, |l| l.index),
                    size_bytes: g.partition.total_size_bytes(),
                }
            })
            .collect();
        groups.sort_by_key(|g| g.group_id);
        pb::StatusResponse { node_id: self.node_id(), groups }
    }

    /// Begins a clean stop, while the node still serves: its background work stops, and the
    /// leadership of each group it leads (the controller's too) goes to the voter with the
    /// most matched log among those that answered lately, as Kafka's controlled shutdown moves
    /// a broker's leaderships first. Waits up to [`STOP_HANDOFF_WAIT`] for those groups to name
    /// their new leader: writes and linearizable reads then move on within a round trip or
    /// two, instead of after an election timeout. Before the servers stop: the new leaders'
    /// elections ask this node for its vote too.
    pub async fn begin_stop(&self) {
        let _ = self.inner.stop.send(true);
        let ack_fresh = crate::balance::ack_fresh(Duration::from_millis(self.inner.config.heartbeat_ms));
        let mut rafts: Vec<(GroupId, Raft)> = self.groups().iter().map(|g| (g.group_id, g.raft.clone())).collect();
        rafts.push((CONTROLLER_GROUP, self.inner.controller_raft.clone()));
        let handoffs = rafts.into_iter().map(|(group, raft)| async move {
            let m = crate::types::metrics_of(&raft);
            if m.current_leader != Some(m.id) || self.cut_off(&m) {
                return None;
            }
            let to = successor(&m, ack_fresh)?;
            raft.trigger().transfer_leader(to).await.ok()?;
            let handed = raft
                .wait(Some(STOP_HANDOFF_WAIT))
                .metrics(|m| m.current_leader.is_some_and(|l| l != m.id), "another replica leads")
                .await
                .is_ok();
            if !handed {
                tracing::warn!(group, to, "the leadership was not taken before the stop; the group elects a leader");
            }
            Some(handed)
        });
        let handed = futures::future::join_all(handoffs).await;
        let asked = handed.iter().flatten().count();
        if asked > 0 {
            let taken = handed.iter().flatten().filter(|h| **h).count();
            tracing::info!(taken, asked, "handed the leaderships of this node's groups over before stopping");
        }
    }

    /// Stops every group and makes applied state durable.
    pub async fn shutdown(&self) {
        let _ = self.inner.stop.send(true);
        for g in self.groups() {
            if let Err(e) = g.raft.shutdown().await {
                tracing::warn!(group = g.group_id, error = %e, "group shutdown failed");
            }
            if let Err(e) = g.partition.checkpoint() {
                tracing::warn!(group = g.group_id, error = %e, "final checkpoint failed");
            }
        }
        if let Err(e) = self.inner.controller_raft.shutdown().await {
            tracing::warn!(error = %e, "controller shutdown failed");
        }
    }
}

/// The error of a forwarded produce that failed with `status`. Only a failure known to have
/// sent nothing is `NodeUnreachable` (definite: the caller may retry on another leader):
/// `connect_failed` marks a unary call, whose transport error names the connection attempt
/// then. A call stream reports "not sent" itself; any other failure on it may have been
/// written.
fn produce_error(group: GroupId, node: NodeId, status: tonic::Status, connect_failed: bool) -> Error {
    match status.code() {
        tonic::Code::Unavailable if connect_failed && status.message().contains("connect") => {
            Error::NodeUnreachable(status.message().to_string())
        }
        tonic::Code::InvalidArgument => Error::Invalid(status.message().to_string()),
        tonic::Code::OutOfRange => Error::TooLarge(status.message().to_string()),
        tonic::Code::NotFound => Error::NotLeader { group, leader_node: None },
        tonic::Code::DeadlineExceeded => Error::Timeout(format!(
            "the partition leader on node {node} did not answer in time; the write may or may not have been applied ({})",
            status.message()
        )),
        // The transport broke (the leader's process died, say) after the write may have left:
        // say so in words, with the transport's own text after them.
        tonic::Code::Unavailable | tonic::Code::Unknown | tonic::Code::Internal | tonic::Code::Cancelled
            if transport_broke(status.message()) =>
        {
            Error::Unavailable(format!(
                "the connection to the partition leader on node {node} broke before it answered; \
                 the write may or may not have been applied ({})",
                status.message()
            ))
        }
        _ => Error::remote_unavailable(status.message()),
    }
}

/// Rounds of [`Node::check_peers_cluster`] (every 500 ms) in which no peer answered before it
/// gives up.
const PEER_CLUSTER_CHECKS: u32 = 20;

/// What a peer's answer to a status call says of its cluster.
enum PeerCluster {
    /// It answered: this node's cluster (or one without an id yet).
    Same,
    /// It refused the call as another cluster's.
    Other,
    /// No answer (the error).
    Unknown(String),
}

/// Registrations a node sends, though registered, while its cluster has no id yet.
const CLUSTER_NAMING_ATTEMPTS: u64 = 4;
/// How often a registered node that hears nothing from the controller's leader registers
/// again ([`Node::watch_registration`]).
const REGISTRATION_RECHECK: Duration = Duration::from_secs(5);

/// Registration attempts in a row that a peer refuses (its token, its TLS certificate, or its
/// cluster) before the node stops with the reason; every 500 ms.
const REGISTRATION_REFUSALS_MAX: u32 = 6;

/// True for the texts of a peer's refusal that no retry can change: this node's node-to-node
/// token ([`crate::service::CheckPeer`]), a certificate that one side does not trust, or a
/// data directory of another cluster.
fn refused_as_a_peer(message: &str) -> bool {
    mentions_any(
        message,
        &[
            "missing or wrong node-to-node token",
            "invalid peer certificate",
            "unknownca",
            "badcertificate",
            crate::service::FOREIGN_CLUSTER_REFUSAL,
            crate::service::REMOVED_NODE_REFUSAL,
        ],
    )
}

/// True when `message`, in lower case, contains one of `markers` (lower case).
fn mentions_any(message: &str, markers: &[&str]) -> bool {
    let message = message.to_ascii_lowercase();
    markers.iter().any(|marker| message.contains(marker))
}

/// True for the texts tonic and h2 give a connection that failed under a call, and for the
/// one of a call stream closed because it answered nothing for too long (`Calls::call`); a
/// peer's own errors travel as their `Error` text, which names none of these.
fn transport_broke(message: &str) -> bool {
    mentions_any(
        message,
        &[
            "h2 protocol error",
            "transport error",
            "connection reset",
            "broken pipe",
            "operation was canceled",
            "answered nothing",
        ],
    )
}

/// The file naming the node a data directory belongs to (`raft/FORMAT.md`).
const NODE_FILE: &str = "node.json";

#[derive(serde::Serialize, serde::Deserialize)]
struct NodeFile {
    version: u8,
    node_id: NodeId,
    /// Random, drawn when the directory is claimed: tells this directory from another one of
    /// the same node id when the node registers (`RegisterNode.incarnation`).
    #[serde(default)]
    incarnation: u64,
}

/// A random nonzero number (std's per-process hasher keys, and the clock).
fn random_incarnation() -> u64 {
    use std::hash::BuildHasher;
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos());
    std::collections::hash_map::RandomState::new().hash_one((now, std::process::id())).max(1)
}

/// Creates the data directory, or checks that it belongs to `node_id`: a node started with
/// another node's directory would take that node's replicas for its own (and remove those it
/// does not host), so it refuses to start. A directory written before the file existed is
/// claimed by the first node that opens it. Returns the directory's incarnation.
fn claim_data_dir(dir: &std::path::Path, node_id: NodeId) -> Result<u64> {
    let shown = dir.display();
    std::fs::create_dir_all(dir)
        .map_err(|e| Error::Invalid(format!("cannot create the data directory {shown}: {e}")))?;
    let path = dir.join(NODE_FILE);
    match std::fs::read(&path) {
        Ok(bytes) => {
            let file: NodeFile =
                serde_json::from_slice(&bytes).map_err(|e| Error::Corrupted(format!("{}: {e}", path.display())))?;
            if file.version != 1 {
                return Err(Error::Corrupted(format!("{}: unknown version {}", path.display(), file.version)));
            }
            if file.node_id != node_id {
                return Err(Error::Invalid(format!(
                    "the data directory {shown} belongs to node {}, not node {node_id}: start node {} with it, or give node {node_id} a directory of its own",
                    file.node_id, file.node_id
                )));
            }
            Ok(file.incarnation)
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            let incarnation = random_incarnation();
            let bytes = serde_json::to_vec(&NodeFile { version: 1, node_id, incarnation })
                .map_err(|e| Error::Invalid(e.to_string()))?;
            crate::partition::write_file_durably(dir, NODE_FILE, &bytes)
                .map_err(|e| Error::Invalid(format!("cannot write to the data directory {shown}: {e}")))?;
            Ok(incarnation)
        }
        Err(e) => Err(Error::Invalid(format!("cannot read {}: {e}", path.display()))),
    }
}

/// The log id a read on the leader must wait for: a lease read unless `strict`.
pub async fn leader_read_log_id(raft: &Raft, group: GroupId, strict: bool) -> Result<crate::types::LogId> {
    let policy = if strict { ReadPolicy::ReadIndex } else { ReadPolicy::LeaseRead };
    let linearizer = tokio::time::timeout(OPERATION_TIMEOUT, raft.get_read_linearizer(policy))
        .await
        .map_err(|_| Error::unavailable("read index timed out"))?
        .map_err(|e| match e {
            OrRaftError::APIError(openraft::errors::LinearizableReadError::ForwardToLeader(f)) => {
                Error::NotLeader { group, leader_node: f.leader_node.map(|n| n.node_id) }
            }
            // openraft's text lists the whole membership: say it in a line.
            OrRaftError::APIError(openraft::errors::LinearizableReadError::QuorumNotEnough(q)) => Error::unavailable(
                format!("only {} of the partition's replicas answered its leader: no quorum", q.got.len()),
            ),
            other => Error::unavailable(other),
        })?;
    Ok(*linearizer.read_log_id().log_id())
}

/// The index of the last entry the replica applied.
fn applied_index(raft: &Raft) -> u64 {
    use crate::types::WatchReceiver;
    raft.metrics().borrow_watched().last_applied.map_or(0, |l| l.index)
}

/// How long after a replica's removal its disk is reclaimed ([`Node::reclaim_removed`]), so
/// the removals of one topic share one compaction.
const RECLAIM_DELAY: Duration = Duration::from_secs(3);

/// Longest a stopping node waits for the groups it led to name another leader.
const STOP_HANDOFF_WAIT: Duration = Duration::from_secs(3);

/// The voter a stopping leader of metrics `m` hands its group to: of the other voters that
/// answered within `ack_fresh`, the one with the most matched log.
fn successor(m: &crate::types::RaftMetrics, ack_fresh: Duration) -> Option<ReplicaId> {
    let membership = m.membership_config.membership();
    membership.voter_ids().filter(|v| *v != m.id && answered_within(m, *v, ack_fresh)).max_by_key(|v| matched(m, *v))
}

/// Whether `replica` acknowledged the leader of metrics `m` within `fresh`.
fn answered_within(m: &crate::types::RaftMetrics, replica: ReplicaId, fresh: Duration) -> bool {
    m.heartbeat
        .as_ref()
        .and_then(|h| h.get(&replica).cloned().flatten())
        .is_some_and(|acked| openraft::Instant::elapsed(&*acked) <= fresh)
}

/// The log index the leader of metrics `m` knows `replica` has, when it knows one.
fn matched(m: &crate::types::RaftMetrics, replica: ReplicaId) -> Option<u64> {
    m.replication.as_ref().and_then(|r| r.get(&replica).cloned().flatten()).map(|log_id| log_id.index)
}

/// How far behind the leader's log a learner may be and still become a controller voter: a
/// voter further behind would hold every controller write of the joint configuration until it
/// caught up.
const PROMOTION_LAG_MAX: u64 = 64;

/// The learners of the controller group, leader metrics `m`, to become voters beside `kept`
/// voters so that there are `wanted`: of the learners not removed that answered within
/// `ack_fresh` and are caught up, the ones with the most matched log (then the lowest ids).
/// Fewer when fewer qualify, and then never so many that the voters become an even count
/// short of `wanted` (two voters tolerate no more failures than one).
fn promotions(
    m: &crate::types::RaftMetrics,
    removed: &std::collections::BTreeSet<NodeId>,
    kept: usize,
    wanted: usize,
    ack_fresh: Duration,
) -> Vec<NodeId> {
    let matched = |id: NodeId| matched(m, id).unwrap_or(0);
    let caught_up = |id: NodeId| matched(id) + PROMOTION_LAG_MAX >= m.last_log_index.unwrap_or(0);
    let mut learners: Vec<NodeId> = m
        .membership_config
        .membership()
        .learner_ids()
        .filter(|id| !removed.contains(id) && answered_within(m, *id, ack_fresh) && caught_up(*id))
        .collect();
    learners.sort_by_key(|id| (std::cmp::Reverse(matched(*id)), *id));
    learners.truncate(wanted.saturating_sub(kept));
    if (kept + learners.len()).is_multiple_of(2) && kept + learners.len() < wanted {
        learners.pop();
    }
    learners
}

/// Whether this replica leads (by its metrics) yet no quorum of its voters acknowledged it for
/// more than `after`. A sole voter is its own quorum; a leader not acknowledged yet (just
/// elected) has not lost it.
fn lost_its_quorum(m: &crate::types::RaftMetrics, after: Duration) -> bool {
    m.state == openraft::ServerState::Leader
        && m.membership_config.membership().voter_ids().nth(1).is_some()
        && m.last_quorum_acked.as_ref().is_some_and(|acked| openraft::Instant::elapsed(&**acked) > after)
}

fn leader_node_of(raft: &Raft) -> Option<NodeId> {
    leader_of(raft).map(|(node, _)| node)
}

/// The group's leader as this replica knows it: its node and its replica id (one reading).
fn leader_of(raft: &Raft) -> Option<(NodeId, ReplicaId)> {
    use crate::types::WatchReceiver;
    let metrics = raft.metrics();
    let m = metrics.borrow_watched();
    if m.running_state.is_err() {
        // Stopped (an error of its storage, or a shutdown): its metrics keep the leader it
        // last knew, itself maybe, while the others elect another.
        return None;
    }
    let leader = m.current_leader?;
    m.membership_config.membership().get_node(&leader).map(|n| (n.node_id, leader))
}

/// Trims of a group its leader saw, and when it first saw each: a removed key answers
/// "removed by retention" (410) for `delete.retention.ms` after its trim, and then the
/// leader commits a forget up to that trim (`TierCommand` `forget_to`) and it answers "not
/// found", on every replica alike. Trims carry their leader's wall-clock time, which the
/// manifest keeps (`Manifest::forget_due`); this in-memory timing is for trims without one
/// (from a node that predates the field): a new leader (or one restarted) times those from
/// when it first sees them, so such a removed key answers 410 longer, never shorter.
#[derive(Debug, Default)]
struct Trims {
    /// (trim offset, first seen), oldest first, offsets increasing.
    seen: std::collections::VecDeque<(logdex_log::Offset, std::time::Instant)>,
}

/// Trims a leader keeps timing per group: a trim seen within `grace / MAX_TRIMS_TIMED` of the
/// last one timed waits to be timed until that one is forgotten (forgotten up to that much
/// later).
const MAX_TRIMS_TIMED: u32 = 64;

impl Trims {
    /// Notes `manifest`'s trim, and returns the offset to forget up to when a trim is at
    /// least `grace` old (the newest such).
    fn due(
        &mut self,
        manifest: &crate::tier::Manifest,
        now: std::time::Instant,
        grace: Duration,
    ) -> Option<logdex_log::Offset> {
        let (trimmed_to, forgotten_to) = (manifest.trimmed_to, manifest.forgotten_to);
        while self.seen.front().is_some_and(|(to, _)| *to <= forgotten_to) {
            self.seen.pop_front();
        }
        let newer = trimmed_to > forgotten_to && self.seen.back().is_none_or(|(to, _)| trimmed_to > *to);
        let spaced = self.seen.back().is_none_or(|(_, at)| now.duration_since(*at) >= grace / MAX_TRIMS_TIMED);
        if newer && spaced {
            self.seen.push_back((trimmed_to, now));
        }
        self.seen.iter().take_while(|(_, at)| now.duration_since(*at) >= grace).last().map(|(to, _)| *to)
    }
}

/// What the last compaction pass of a replica found: the sealed bytes after it, the
/// timestamp of the oldest tombstone it kept (too new to remove then), when it ended and how
/// long it took.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Cleaned {
    sealed_bytes: u64,
    oldest_tombstone_kept_ms: Option<i64>,
    at: std::time::Instant,
    took: Duration,
}

/// A replica with bytes sealed since its last pass, too few for `min.cleanable.dirty.ratio`,
/// passes again once this long has gone since that pass (or [`SETTLE_PASS_COST_SHARE`] times
/// the pass's own time, when longer). Replicas run their passes at moments of their own, and
/// a pass removes what the segments it covers supersede: without it, one that passed after a
/// segment was sealed and one that passed before kept different records for as long as no
/// more bytes were sealed (a quiet partition: for good). With it, every replica's last pass
/// covers every sealed segment within about this long after the last one was sealed, and
/// replicas with the same segments hold the same records.
const SETTLE_PASS_AFTER: Duration = Duration::from_secs(30);
/// How many times its own duration a settling pass waits at least, so that passes over a
/// large log take at most about 1/20 of the time.
const SETTLE_PASS_COST_SHARE: u32 = 20;

/// One compaction pass of a replica under the `compact` policy, when the bytes sealed since
/// the last pass (`last`; every sealed byte before a node's first pass) are at least
/// `min.cleanable.dirty.ratio` of all its sealed bytes, as Kafka's cleaner chooses a log, or
/// when a tombstone that pass kept is now past `delete.retention.ms` (as Kafka's cleaner does,
/// KIP-534: an idle log still loses its expired tombstones), or when bytes were sealed since
/// and [`SETTLE_PASS_AFTER`] has gone by (so replicas settle alike). Returns what the pass
/// found, or `None` when it did not run or examined nothing (a replica re-applying, or with
/// nothing indexed yet), so the next pass tries again. (Retention is committed through Raft:
/// `propose_retention`.)
fn clean(p: &Partition, policy: &crate::controller::CleanupPolicy, last: Option<Cleaned>) -> Result<Option<Cleaned>> {
    clean_with(p, policy, last, Partition::compact)
}

/// [`clean`], the pass itself done by `compact` (a test seals a segment while it runs).
fn clean_with(
    p: &Partition,
    policy: &crate::controller::CleanupPolicy,
    last: Option<Cleaned>,
    compact: impl FnOnce(&Partition, i64) -> Result<logdex_log::CompactStats>,
) -> Result<Option<Cleaned>> {
    let now = crate::state_machine::now_ms();
    if !policy.compact {
        return Ok(None);
    }
    let sealed = p.sealed_bytes();
    let horizon = now.saturating_sub(policy.delete_retention_ms) as i64;
    let tombstones_due = |c: &Cleaned| c.oldest_tombstone_kept_ms.is_some_and(|t| t < horizon);
    let dirty_enough = |c: &Cleaned| {
        let dirty = sealed.saturating_sub(c.sealed_bytes);
        dirty > 0 && dirty as f64 >= policy.min_cleanable_dirty_ratio * sealed as f64
    };
    let settle_due = |c: &Cleaned| {
        sealed > c.sealed_bytes && c.at.elapsed() >= SETTLE_PASS_AFTER.max(c.took * SETTLE_PASS_COST_SHARE)
    };
    if sealed == 0 || last.is_some_and(|c| !dirty_enough(&c) && !tombstones_due(&c) && !settle_due(&c)) {
        return Ok(None);
    }
    let started = std::time::Instant::now();
    let stats = compact(p, horizon)?;
    if stats.records_removed > 0 {
        tracing::info!(
            group = p.group,
            removed = stats.records_removed,
            bytes_before = stats.bytes_before,
            bytes_after = stats.bytes_after,
            "compacted"
        );
    }
    if stats.bytes_before == 0 {
        return Ok(None);
    }
    // The bytes of the segments this pass examined, as it left them: a segment sealed while
    // it ran (an apply goes on meanwhile) or past the high watermark when it began is not
    // among them, and counts as dirty for the next pass. (The log's sealed bytes read now
    // would count it as clean, and it would wait for the next segment to be sealed.)
    Ok(Some(Cleaned {
        sealed_bytes: stats.bytes_after,
        oldest_tombstone_kept_ms: stats.oldest_tombstone_kept_ms,
        at: std::time::Instant::now(),
        took: started.elapsed(),
    }))
}

/// Reads that may find their data in tiered storage: run `read`; when it needs remote
/// segments that are not cached, fetch them and run it again (a few times, since other reads
/// may push them out of the bounded cache meanwhile).
async fn with_tier<T>(partition: &Arc<Partition>, mut read: impl FnMut() -> Result<T>) -> Result<T> {
    for _ in 0..TIER_READ_ATTEMPTS {
        match read() {
            Err(Error::TierMiss { segments, .. }) => {
                for segment in &segments {
                    match fetch_segment(partition, segment).await {
                        // Trimmed by retention and deleted before this replica applied the
                        // trim (it will answer 410 once it has), or lost by the store.
                        Err(Error::NotFound(what)) => {
                            return Err(Error::Unavailable(format!(
                                "{what} is gone: trimmed by retention (410 once this replica applies the trim) or lost by the store"
                            )));
                        }
                        other => other?,
                    }
                }
            }
            other => return other,
        }
    }
    read()
}

/// Segment fetches from the tiered store that may run on after the read that started them
/// gave up waiting (a slow or hanging store), in this process.
static TIER_FETCHES_PENDING: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// Fetches `segment` into the replica's cache for a read, which waits at most
/// [`TIER_FETCH_WAIT`]: the fetch runs on as a task of its own, so a segment slower to come
/// than that (a large one, a slow store) is cached for the read's retry, and a store that
/// hangs (its client retries for about a minute) gets a 503 with Retry-After, not a read held
/// past the client's patience and the HTTP idle limit. At most [`TIER_FETCHES_PENDING_MAX`]
/// such fetches at once; a read beyond them answers 503 at once.
async fn fetch_segment(partition: &Arc<Partition>, segment: &crate::tier::RemoteSegment) -> Result<()> {
    use std::sync::atomic::Ordering::Relaxed;
    struct Pending;
    impl Drop for Pending {
        fn drop(&mut self) {
            TIER_FETCHES_PENDING.fetch_sub(1, Relaxed);
        }
    }
    if TIER_FETCHES_PENDING.fetch_add(1, Relaxed) >= TIER_FETCHES_PENDING_MAX {
        TIER_FETCHES_PENDING.fetch_sub(1, Relaxed);
        return Err(Error::Unavailable(format!(
            "{TIER_FETCHES_PENDING_MAX} fetches from the tiered store are still running; retry"
        )));
    }
    let pending = Pending;
    let (p, s) = (partition.clone(), segment.clone());
    let task = tokio::spawn(async move {
        let _pending = pending;
        p.tier_cache().fetch(&s).await
    });
    match tokio::time::timeout(TIER_FETCH_WAIT, task).await {
        Ok(Ok(fetched)) => fetched,
        Ok(Err(e)) => Err(Error::Unavailable(format!("the fetch of object {} stopped: {e}", segment.object))),
        Err(_) => Err(Error::Unavailable(format!(
            "object {} is still coming from the tiered store after {TIER_FETCH_WAIT:?}; retry",
            segment.object
        ))),
    }
}

/// The assignment of `g`'s partition in `state`, while it is still `g`'s group (its topic was
/// not deleted, or deleted and created again, meanwhile).
fn assignment_of<'a>(state: &'a ClusterState, g: &HostedGroup) -> Option<&'a PartitionRecord> {
    let record = state.topics.get(&g.topic)?.partitions.get(g.partition_no as usize)?;
    (record.group_id == g.group_id).then_some(record)
}

/// What the leader replica `g` knows for preferred-leader balancing; `None` when it does not
/// lead, or its partition is not (or no longer) assigned as hosted.
fn leader_view(state: &ClusterState, g: &HostedGroup) -> Option<crate::balance::LeaderView> {
    let record = assignment_of(state, g)?;
    let preferred = record.replicas.first()?.replica_id;
    let metrics = crate::types::metrics_of(&g.raft);
    if metrics.current_leader != Some(g.replica_id) {
        return None;
    }
    let membership = metrics.membership_config.membership();
    let matched = metrics.replication.as_ref().and_then(|r| r.get(&preferred).cloned().flatten());
    let acked = metrics.heartbeat.as_ref().and_then(|h| h.get(&preferred).cloned().flatten());
    Some(crate::balance::LeaderView {
        me: g.replica_id,
        preferred,
        moving: record.target.is_some(),
        voters: membership.voter_ids().collect(),
        joint: membership.get_joint_config().len() > 1,
        last_log_index: metrics.last_log_index.unwrap_or(0),
        preferred_matched: matched.map(|l| l.index),
        preferred_acked_ago: acked.map(|at| openraft::Instant::elapsed(&*at)),
    })
}

/// Proposes `records` as one entry on `raft` and returns the offset of the first.
fn propose_fn(raft: Raft, partition: Arc<Partition>) -> crate::batcher::Propose {
    let group = partition.group;
    Arc::new(move |records: &[logdex_log::Record]| {
        let raft = raft.clone();
        let batch = logdex_log::encode_batch(records, partition.compression())
            .map_err(|e| Error::Invalid(e.to_string()))
            .and_then(|batch| partition.admit_batch(batch.len()).map(|()| batch));
        Box::pin(async move {
            let mut batch = batch?;
            logdex_log::set_base_offset(&mut batch, 0);
            let command = pb::Command { kind: Some(pb::command::Kind::Produce(pb::Produce { batch })) };
            match tokio::time::timeout(OPERATION_TIMEOUT, raft.client_write(command)).await {
                Err(_) => Err(Error::Timeout("write waiting for commit".into())),
                Ok(Ok(resp)) => match resp.data.kind {
                    Some(pb::command_response::Kind::Produce(r)) if r.error.is_empty() => Ok(r.base_offset),
                    Some(pb::command_response::Kind::Produce(r)) => Err(Error::Invalid(r.error)),
                    _ => Err(Error::Corrupted("produce answered a non-produce response".into())),
                },
                Ok(Err(OrRaftError::APIError(OrClientWriteError::ForwardToLeader(f)))) => {
                    Err(Error::NotLeader { group, leader_node: f.leader_node.map(|n| n.node_id) })
                }
                Ok(Err(e)) => Err(write_failed(e)),
            }
        })
    })
}

/// A write a group did not take, other than for another leader: one whose replica here
/// stopped on an error of its storage (a full disk, say) says so and what to do, instead of
/// openraft's text of the failed call.
fn write_failed(e: OrRaftError<crate::types::TypeConfig, crate::types::ClientWriteError>) -> Error {
    match e {
        OrRaftError::Fatal(openraft::errors::Fatal::StorageError(se)) => Error::Unavailable(format!(
            "the replica on this node stopped on a storage error ({}); the write may or may not \
             have been committed by the group's other replicas, which elect a leader meanwhile; \
             this replica takes part again once its node restarts (restart it once the cause, a \
             full disk say, is fixed)",
            storage_cause(&se)
        )),
        other => Error::unavailable(other),
    }
}

/// What failed under a storage error (the I/O error, without openraft's frame of it).
fn storage_cause(se: &openraft::StorageError<crate::types::TypeConfig>) -> String {
    let cause = std::error::Error::source(se).map_or_else(|| se.to_string(), |cause| cause.to_string());
    // openraft keeps the cause as text led by its type's name.
    cause.strip_prefix("std::io::error::Error: ").map(str::to_string).unwrap_or(cause)
}

/// Why the replica of metrics `m` stopped other than by a shutdown (an error of its storage),
/// if it did.
pub fn stopped_by(m: &crate::types::RaftMetrics) -> Option<String> {
    match &m.running_state {
        Ok(()) | Err(openraft::errors::Fatal::Stopped) => None,
        Err(openraft::errors::Fatal::StorageError(se)) => Some(format!("storage error: {}", storage_cause(se))),
        Err(other) => Some(other.to_string()),
    }
}

/// Sends each batch of forwarded writes to `node` in one `Produce` RPC.
fn forward_fn(node: std::sync::Weak<NodeInner>, leader: NodeId, group: GroupId) -> crate::batcher::Propose {
    Arc::new(move |records: &[logdex_log::Record]| {
        let inner = node.upgrade();
        Box::pin(async move {
            let inner = inner.ok_or_else(|| Error::unavailable("node is shutting down"))?;
            Node { inner }.send_produce(leader, group, records).await
        })
    })
}

/// A snapshot taken before a trim (retention, local or tiered) still links the segments the
/// trim deleted and names its remote objects: their disk space comes back, and a replica that
/// catches up through the snapshot skips them, only once a newer snapshot replaces it. Every
/// replica takes one after it applied a trim (the manifest keeps the trim's log index across
/// restarts), instead of waiting for the snapshot policy's next one, which a topic no longer
/// written never reaches.
async fn snapshot_past_trim(g: &HostedGroup) -> Result<()> {
    let snapshot_index = crate::types::metrics_of(&g.raft).snapshot.map_or(0, |l| l.index);
    if g.partition.tier_manifest().trimmed_at > snapshot_index {
        g.raft.trigger().snapshot().await.map_err(Error::unavailable)?;
    }
    Ok(())
}

/// Replicas a node opens at once when it starts them: one per core, at most 4.
fn starts_at_once() -> usize {
    std::thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get).clamp(1, 4)
}

async fn initialize_group(raft: Raft, members: BTreeMap<u64, pb::Node>, preferred: bool) {
    if !preferred {
        // The preferred replica initializes first so leaders spread as placed;
        // the others initialize later with the identical membership (safe per
        // openraft) only if it never reached them.
        tokio::time::sleep(Duration::from_secs(3)).await;
    }
    match raft.is_initialized().await {
        Ok(true) | Err(_) => return,
        Ok(false) => {}
    }
    if let Err(e) = raft.initialize(members).await {
        tracing::debug!(error = %e, "group initialize skipped");
        return;
    }
    // The first election fails when its vote requests reach peers that have not created their
    // replica yet (they answer "not hosted"), and the next would wait an election timeout:
    // campaign again shortly while no leader is known (a pre-vote first, which disturbs no
    // leader elected meanwhile).
    for _ in 0..INITIAL_ELECTION_RETRIES {
        tokio::time::sleep(INITIAL_ELECTION_RETRY_PAUSE).await;
        if crate::types::metrics_of(&raft).current_leader.is_some() || raft.trigger().elect(true).await.is_err() {
            return;
        }
    }
}

/// How often, and how far apart, a group's initializing replica campaigns again while its
/// first election found no leader.
const INITIAL_ELECTION_RETRIES: usize = 10;
const INITIAL_ELECTION_RETRY_PAUSE: Duration = Duration::from_millis(300);

/// For `wire` users outside this crate.
pub use wire::log_id_to_pb;

#[cfg(test)]
mod tests {
    use super::*;

    /// The grace of the trim timing tests: 64 s, so that grace / MAX_TRIMS_TIMED is 1 s.
    const TRIM_GRACE: Duration = Duration::from_secs(64);

    /// A manifest trimmed to `trimmed_to` and forgotten to `forgotten_to`.
    fn manifest(trimmed_to: u64, forgotten_to: u64) -> crate::tier::Manifest {
        crate::tier::Manifest { trimmed_to, forgotten_to, ..crate::tier::Manifest::default() }
    }

    #[test]
    fn a_trim_is_forgotten_once_it_is_older_than_the_grace_and_never_before() {
        let (grace, t0) = (TRIM_GRACE, std::time::Instant::now());
        let at = |secs: u64| t0 + Duration::from_secs(secs);
        let mut trims = Trims::default();
        assert_eq!(trims.due(&manifest(0, 0), at(0), grace), None, "nothing trimmed");
        assert_eq!(trims.due(&manifest(10, 0), at(0), grace), None, "trim to 10 seen at 0 s");
        assert_eq!(trims.due(&manifest(20, 0), at(5), grace), None, "trim to 20 seen at 5 s");
        assert_eq!(trims.due(&manifest(20, 0), at(63), grace), None, "10 is 63 s old");
        assert_eq!(trims.due(&manifest(20, 0), at(64), grace), Some(10), "10 is due, 20 is not");
        // Until the forget to 10 applies, 10 stays due; then 20 is the next.
        assert_eq!(trims.due(&manifest(20, 0), at(65), grace), Some(10));
        assert_eq!(trims.due(&manifest(20, 10), at(66), grace), None, "20 is 61 s old");
        assert_eq!(trims.due(&manifest(20, 10), at(69), grace), Some(20));
        assert_eq!(trims.due(&manifest(20, 20), at(70), grace), None, "all forgotten");
    }

    #[test]
    fn trims_in_quick_succession_are_timed_from_the_first_and_forgotten_later_never_sooner() {
        let (grace, t0) = (TRIM_GRACE, std::time::Instant::now());
        let at = |secs: u64| t0 + Duration::from_secs(secs);
        let mut trims = Trims::default();
        // One trim per 100 ms for 10 s: the timed trims stay at most one per grace/64 = 1 s.
        for tenth in 0..100u64 {
            let now = t0 + Duration::from_millis(tenth * 100);
            assert_eq!(trims.due(&manifest(tenth + 1, 0), now, grace), None);
        }
        assert!(trims.seen.len() <= 11, "{} trims timed", trims.seen.len());
        // The first timed trim is due at 64 s; a trim timed later is not due before its time.
        assert_eq!(trims.due(&manifest(100, 0), at(64), grace), Some(1));
        let due = trims.due(&manifest(100, 1), at(70), grace);
        assert!(due.is_some_and(|to| to < 100), "trims seen after 6 s are not 64 s old at 70 s: {due:?}");
        // A new leader starts timing afresh: nothing is due before its own grace has passed.
        let mut fresh = Trims::default();
        assert_eq!(fresh.due(&manifest(100, 1), at(70), grace), None);
        assert_eq!(fresh.due(&manifest(100, 1), at(133), grace), None);
        assert_eq!(fresh.due(&manifest(100, 1), at(134), grace), Some(100));
    }

    #[test]
    fn a_data_directory_refuses_a_node_other_than_its_own() -> std::result::Result<(), Box<dyn std::error::Error>> {
        let root = tempfile::tempdir()?;
        let dir = root.path().join("data");
        let incarnation = claim_data_dir(&dir, 1)?;
        assert_ne!(incarnation, 0);
        assert_eq!(claim_data_dir(&dir, 1)?, incarnation, "a directory keeps its incarnation");
        let other = root.path().join("other");
        assert_ne!(claim_data_dir(&other, 1)?, incarnation, "another directory of the same id differs");
        let refused = claim_data_dir(&dir, 2).err().ok_or("node 2 opened node 1's directory")?;
        assert!(matches!(refused, Error::Invalid(_)), "{refused:?}");
        assert!(refused.to_string().contains("belongs to node 1"), "{refused}");
        let file = root.path().join("file");
        std::fs::write(&file, b"x")?;
        let not_a_dir = claim_data_dir(&file, 1).err().ok_or("a regular file became a data directory")?;
        assert!(not_a_dir.to_string().contains(&file.display().to_string()), "{not_a_dir}");
        Ok(())
    }

    /// A read that needs a segment from a tiered store that hangs answers 503 after
    /// `TIER_FETCH_WAIT` (its fetch goes on), and beyond `TIER_FETCHES_PENDING_MAX` such
    /// fetches a read answers 503 at once.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_read_waiting_on_a_hanging_tiered_store_answers_503_and_the_fetches_are_bounded()
    -> std::result::Result<(), Box<dyn std::error::Error>> {
        use object_store::throttle::ThrottleConfig;
        use object_store::throttle::ThrottledStore;
        let root = tempfile::tempdir()?;
        let hanging = ThrottleConfig { wait_get_per_call: Duration::from_secs(3600), ..ThrottleConfig::default() };
        let store = ThrottledStore::new(object_store::memory::InMemory::new(), hanging);
        let store = crate::tier::TierStore::over(Arc::new(store));
        let index = logdex_index::Index::open(&root.path().join("index"), logdex_index::IndexConfig::default())?;
        let config = logdex_log::LogConfig::default();
        let dir = root.path().join("partition");
        let (p, _) = Partition::open_with_tier(3, 1 << 20, &dir, config, index, Some(store))?;
        let p = Arc::new(p);
        let segment = |base: u64| crate::tier::RemoteSegment {
            base_offset: base,
            next_offset: base + 10,
            size_bytes: 100,
            crc32c: 0,
            max_timestamp_ms: 0,
            object: format!("segment-{base}"),
        };
        let bound = Duration::from_secs(60);
        let segments: Vec<_> = (0..TIER_FETCHES_PENDING_MAX as u64).map(|i| segment(i * 10)).collect();
        let waits = segments.iter().map(|s| fetch_segment(&p, s));
        let answers = tokio::time::timeout(bound, futures::future::join_all(waits)).await?;
        for answer in answers {
            let Err(Error::Unavailable(why)) = answer else { return Err(format!("{answer:?}").into()) };
            assert!(why.contains("still coming from the tiered store"), "{why}");
        }
        // All of them still wait on the store: one more read is not given a fetch of its own.
        let beyond = tokio::time::timeout(bound, fetch_segment(&p, &segment(1000))).await?;
        let Err(Error::Unavailable(why)) = beyond else { return Err(format!("{beyond:?}").into()) };
        assert!(why.contains("still running"), "{why}");
        Ok(())
    }

    type TestResult<T = ()> = std::result::Result<T, Box<dyn std::error::Error>>;

    /// A replica of a compacted log with 1 KiB segments, its index beside it.
    fn compacted_replica(root: &std::path::Path) -> TestResult<Partition> {
        let index = logdex_index::Index::open(&root.join("index"), logdex_index::IndexConfig::default())?;
        let config = logdex_log::LogConfig { segment_bytes: 1024, ..logdex_log::LogConfig::default() };
        Ok(Partition::open(3, 1 << 20, &root.join("partition"), config, index)?.0)
    }

    /// Applies `records` to `p`, one entry each, from offset `first`; `now - 10 s` is the
    /// first record's time, one millisecond more for each next.
    fn apply_each(p: &Partition, first: u64, records: &[(String, Option<Vec<u8>>)], now: i64) -> TestResult {
        for (n, (key, value)) in records.iter().enumerate() {
            let i = first + n as u64;
            let record = logdex_log::Record {
                timestamp_ms: now - 10_000 + i as i64,
                key: Some(key.as_bytes().to_vec()),
                value: value.clone(),
                headers: Vec::new(),
            };
            let mut batches = [logdex_log::encode_batch(&[record], logdex_log::Compression::None)?];
            let log_id = crate::wire::log_id_from_pb(&pb::LogId { term: 1, index: i + 1 });
            let applied = crate::partition::AppliedState { applied: Some(log_id), ..Default::default() };
            p.apply_batches(&mut batches, &applied, 0)?;
        }
        Ok(())
    }

    fn filler(range: std::ops::Range<u64>) -> Vec<(String, Option<Vec<u8>>)> {
        range.map(|i| (format!("fill{i}"), Some(vec![7; 100]))).collect()
    }

    fn compact_policy(delete_retention_ms: u64, min_cleanable_dirty_ratio: f64) -> crate::controller::CleanupPolicy {
        crate::controller::CleanupPolicy {
            compact: true,
            delete: false,
            delete_retention_ms,
            min_cleanable_dirty_ratio,
        }
    }

    /// An idle compacted log loses a tombstone once it is past `delete.retention.ms`: a pass
    /// that kept it as too new runs again when it expires, though no sealed byte changed.
    #[test]
    fn an_expired_tombstone_is_cleaned_from_an_idle_log() -> TestResult {
        let root = tempfile::tempdir()?;
        let p = compacted_replica(root.path())?;
        let now = crate::state_machine::now_ms() as i64;
        // Offset 0 writes `gone`, offset 1 tombstones it, then filler seals both.
        let mut records = vec![("gone".to_string(), Some(b"v".to_vec())), ("gone".to_string(), None)];
        records.extend(filler(2..40));
        apply_each(&p, 0, &records, now)?;
        let tombstone_at = |p: &Partition| -> TestResult<bool> {
            Ok(p.read_records(0, 100, 1 << 20)?.iter().any(|(o, r)| *o == 1 && r.value.is_none()))
        };
        let keep_a_minute = compact_policy(60_000, 0.5);
        let first = clean(&p, &keep_a_minute, None)?.ok_or("the first pass examines the sealed segments")?;
        assert_eq!(first.oldest_tombstone_kept_ms, Some(now - 10_000 + 1), "the pass reports the tombstone it kept");
        assert!(tombstone_at(&p)?, "a tombstone newer than delete.retention.ms stays");
        assert_eq!(clean(&p, &keep_a_minute, Some(first))?, None, "nothing changed and nothing expired: no pass");
        let keep_a_second = compact_policy(1_000, 0.5);
        let second = clean(&p, &keep_a_second, Some(first))?.ok_or("the expired tombstone brings a pass")?;
        assert_eq!(second.oldest_tombstone_kept_ms, None);
        assert!(!tombstone_at(&p)?, "the expired tombstone is gone");
        Ok(())
    }

    /// `k` at offset 0 and filler, a first pass over every sealed segment, then a new value of
    /// `k` and a little filler that seal a segment: a small dirty share. Returns the pass.
    fn first_pass_then_a_small_dirty_share(p: &Partition) -> TestResult<Cleaned> {
        let now = crate::state_machine::now_ms() as i64;
        let mut records = vec![("k".to_string(), Some(b"v0".to_vec()))];
        records.extend(filler(1..80));
        apply_each(p, 0, &records, now)?;
        let first = clean(p, &compact_policy(60_000, 0.9), None)?.ok_or("the first pass examines every segment")?;
        let mut records = vec![("k".to_string(), Some(b"v1".to_vec()))];
        records.extend(filler(81..92));
        apply_each(p, 80, &records, now)?;
        Ok(first)
    }

    /// After its first pass, a compacted log is cleaned again only once the bytes sealed since
    /// are `min.cleanable.dirty.ratio` of its sealed bytes, as in Kafka.
    #[test]
    fn a_log_is_cleaned_again_once_its_dirty_share_reaches_min_cleanable_dirty_ratio() -> TestResult {
        let root = tempfile::tempdir()?;
        let p = compacted_replica(root.path())?;
        let first = first_pass_then_a_small_dirty_share(&p)?;
        let sealed = p.sealed_bytes();
        let dirty = sealed - first.sealed_bytes;
        assert!(dirty > 0 && (dirty as f64) < 0.5 * sealed as f64, "dirty {dirty} of {sealed}");
        let k_at_0 =
            |p: &Partition| -> TestResult<bool> { Ok(p.read_records(0, 1, 1 << 20)?.iter().any(|(o, _)| *o == 0)) };
        for ratio in [0.9, 0.5] {
            assert_eq!(clean(&p, &compact_policy(60_000, ratio), Some(first))?, None, "ratio {ratio}: no pass");
            assert!(k_at_0(&p)?, "ratio {ratio}: the superseded record stays");
        }
        let ratio = dirty as f64 / sealed as f64;
        clean(&p, &compact_policy(60_000, ratio), Some(first))?.ok_or("a dirty share at the ratio brings a pass")?;
        assert!(!k_at_0(&p)?, "the superseded record is gone");
        Ok(())
    }

    /// Bytes sealed since the last pass, too few for the dirty ratio, bring a pass once
    /// `SETTLE_PASS_AFTER` has gone by since that pass: a replica whose pass ran before the
    /// seal settles to what one that passed after it holds, though nothing more is written.
    #[test]
    fn a_replica_with_a_few_dirty_bytes_passes_again_once_the_settle_time_is_past() -> TestResult {
        let root = tempfile::tempdir()?;
        let p = compacted_replica(root.path())?;
        let policy = compact_policy(60_000, 0.9);
        let first = first_pass_then_a_small_dirty_share(&p)?;
        let k_at_0 =
            |p: &Partition| -> TestResult<bool> { Ok(p.read_records(0, 1, 1 << 20)?.iter().any(|(o, _)| *o == 0)) };
        assert_eq!(clean(&p, &policy, Some(first))?, None, "a small dirty share right after a pass: no pass");
        assert!(k_at_0(&p)?);
        let at = std::time::Instant::now().checked_sub(SETTLE_PASS_AFTER).ok_or("a clock too young")?;
        let settled = clean(&p, &policy, Some(Cleaned { at, ..first }))?.ok_or("the settle time brings a pass")?;
        assert!(!k_at_0(&p)?, "the record superseded in the newly sealed segment is gone");
        let later = std::time::Instant::now().checked_sub(2 * SETTLE_PASS_AFTER).ok_or("a clock too young")?;
        assert_eq!(clean(&p, &policy, Some(Cleaned { at: later, ..settled }))?, None, "nothing sealed since: no pass");
        Ok(())
    }

    /// A segment sealed while a pass runs is not one the pass examined: it is dirty for the
    /// next pass, which removes its superseded records, though nothing is sealed after it.
    #[test]
    fn a_segment_sealed_while_a_pass_runs_is_cleaned_by_the_next_pass() -> TestResult {
        let root = tempfile::tempdir()?;
        let p = compacted_replica(root.path())?;
        let now = crate::state_machine::now_ms() as i64;
        apply_each(&p, 0, &filler(0..40), now)?;
        let policy = compact_policy(60_000, 0.01);
        // During the pass: `k` twice, then filler that seals the segment holding both.
        let mut during = vec![("k".to_string(), Some(b"v1".to_vec())), ("k".to_string(), Some(b"v2".to_vec()))];
        during.extend(filler(42..60));
        let first = clean_with(&p, &policy, None, |p, horizon| {
            let stats = p.compact(horizon)?;
            apply_each(p, 40, &during, now).map_err(|e| Error::Invalid(e.to_string()))?;
            Ok(stats)
        })?
        .ok_or("the first pass examines the sealed segments")?;
        let superseded_at_40 =
            |p: &Partition| -> TestResult<bool> { Ok(p.read_records(40, 1, 1 << 20)?.iter().any(|(o, _)| *o == 40)) };
        assert!(p.sealed_bytes() > first.sealed_bytes, "a segment was sealed while the pass ran");
        assert!(superseded_at_40(&p)?, "the pass did not examine the segment sealed under it");
        clean(&p, &policy, Some(first))?.ok_or("the segment sealed under the last pass brings a pass")?;
        assert!(!superseded_at_40(&p)?, "the superseded record at offset 40 is gone");
        Ok(())
    }

    /// Metrics of replica 1 leading voters `voters`, last acknowledged by a quorum `ago`.
    fn leading(voters: &[u64], ago: Option<Duration>) -> crate::types::RaftMetrics {
        let nodes: std::collections::BTreeMap<u64, pb::Node> =
            voters.iter().map(|v| (*v, pb::Node::default())).collect();
        let membership =
            crate::types::Membership::new(vec![voters.iter().copied().collect()], nodes).expect("a membership");
        let mut m = crate::types::RaftMetrics::new_initial(1);
        m.state = openraft::ServerState::Leader;
        m.current_leader = Some(1);
        m.membership_config = Arc::new(crate::types::StoredMembership::new(None, membership));
        let now = <openraft::alias::InstantOf<crate::types::TypeConfig> as openraft::Instant>::now();
        m.last_quorum_acked = ago.map(|ago| openraft::metrics::SerdeInstant::new(now - ago));
        m
    }

    #[test]
    fn controller_voters_are_made_of_answering_caught_up_learners_furthest_along_up_to_an_odd_count() {
        let fresh = Duration::from_millis(1500);
        let nodes: std::collections::BTreeMap<u64, pb::Node> = (1..=8).map(|v| (v, pb::Node::default())).collect();
        let membership =
            crate::types::Membership::new(vec![[1, 2, 3].into_iter().collect()], nodes).expect("a membership");
        let mut m = leading(&[1, 2, 3], Some(Duration::from_millis(10)));
        m.membership_config = Arc::new(crate::types::StoredMembership::new(None, membership));
        m.last_log_index = Some(200);
        let now = <openraft::alias::InstantOf<crate::types::TypeConfig> as openraft::Instant>::now();
        let acked = |ago: u64| Some(openraft::metrics::SerdeInstant::new(now - Duration::from_millis(ago)));
        // Learner 4 answers and is a little behind, 5 answers and is furthest along, 6 is
        // further along but silent, 7 is removed itself, 8 answers but is far behind.
        m.heartbeat =
            Some([(4, acked(100)), (5, acked(200)), (6, acked(60_000)), (7, acked(10)), (8, acked(10))].into());
        let matched = |index: u64| Some(crate::wire::log_id_from_pb(&pb::LogId { term: 1, index }));
        m.replication = Some(
            [(4, matched(150)), (5, matched(200)), (6, matched(200)), (7, matched(200)), (8, matched(100))].into(),
        );
        let removed: std::collections::BTreeSet<u64> = [3, 7].into_iter().collect();
        // Voter 3 removed: one replaces it.
        assert_eq!(promotions(&m, &removed, 2, 3, fresh), vec![5]);
        // Five wanted of two kept: two qualify, but four voters tolerate no more failures
        // than three.
        assert_eq!(promotions(&m, &removed, 2, 5, fresh), vec![5]);
        assert_eq!(promotions(&m, &removed, 1, 5, fresh), vec![5, 4]);
        // Three wanted of one: two, or none rather than an even count of two voters.
        assert_eq!(promotions(&m, &removed, 1, 3, fresh), vec![5, 4]);
        m.heartbeat = Some([(5, acked(10))].into());
        assert!(promotions(&m, &removed, 1, 3, fresh).is_empty(), "one learner alone would make two voters");
        assert_eq!(promotions(&m, &removed, 1, 2, fresh), vec![5], "unless two are wanted");
        assert!(promotions(&m, &removed, 3, 3, fresh).is_empty(), "enough voters");
        m.heartbeat = None;
        assert!(promotions(&m, &removed, 2, 3, fresh).is_empty(), "none answered: the voters shrink");
    }

    #[test]
    fn a_leader_no_quorum_acknowledged_for_an_election_timeout_has_lost_it() {
        let timeout = Duration::from_millis(1500);
        assert!(lost_its_quorum(&leading(&[1, 2, 3], Some(Duration::from_secs(3))), timeout));
        assert!(!lost_its_quorum(&leading(&[1, 2, 3], Some(Duration::from_millis(100))), timeout));
        // Just elected, not acknowledged yet.
        assert!(!lost_its_quorum(&leading(&[1, 2, 3], None), timeout));
        // A sole voter is its own quorum, however long ago another answered.
        assert!(!lost_its_quorum(&leading(&[1], Some(Duration::from_secs(3))), timeout));
        let mut follower = leading(&[1, 2, 3], Some(Duration::from_secs(3)));
        follower.state = openraft::ServerState::Follower;
        assert!(!lost_its_quorum(&follower, timeout));
    }

    #[test]
    fn a_produce_that_failed_after_its_call_stream_opened_is_never_definite() {
        // A broken stream's status often names the connection ("connection reset"): the
        // write may have happened, so it must not look like a refused connection.
        let reset = tonic::Status::unavailable("error reading a body from connection: connection reset");
        assert!(matches!(produce_error(7, 2, reset.clone(), false), Error::Unavailable(_)));
        assert!(matches!(produce_error(7, 2, reset, true), Error::NodeUnreachable(_)));
        let timeout = tonic::Status::deadline_exceeded("no answer");
        let timed_out = produce_error(7, 2, timeout, false);
        assert!(matches!(timed_out, Error::Timeout(_)));
        assert!(timed_out.to_string().contains("may or may not have been applied"), "{timed_out}");
        let silent = tonic::Status::unavailable("the call stream to 127.0.0.1:9 answered nothing in 2s");
        let said = produce_error(7, 2, silent, false).to_string();
        assert!(said.contains("may or may not have been applied"), "{said}");
        let died = tonic::Status::internal("h2 protocol error: error reading a body from connection");
        let said = produce_error(7, 2, died, false).to_string();
        assert!(said.contains("on node 2 broke") && said.contains("h2 protocol error"), "{said}");
        let refused = tonic::Status::internal("unavailable: raft is shutting down");
        assert_eq!(produce_error(7, 2, refused, false).to_string(), "unavailable: raft is shutting down");
        let moved = tonic::Status::not_found("group 7 is not hosted here");
        assert!(matches!(produce_error(7, 2, moved, false), Error::NotLeader { group: 7, leader_node: None }));
    }
}
