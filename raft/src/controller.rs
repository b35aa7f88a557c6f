//! The controller: cluster metadata replicated by group 0.
//!
//! Every node hosts a replica of the controller (voter or learner), so every
//! node can read topics, assignments and node addresses locally; the
//! reconciler makes the node's partition replicas match them.
//!
//! Commands are validated in `apply`, deterministically, so every replica
//! reaches the same state and the same answer.

use std::collections::BTreeMap;
use std::path::Path;
use std::path::PathBuf;

use serde::Deserialize;
use serde::Serialize;

use crate::error::Error;
use crate::error::Result;
use crate::partition::write_file_durably;
use crate::pb;
use crate::pb::controller_command::Kind;
use crate::types::GroupId;
use crate::types::LogId;
use crate::types::NodeId;
use crate::types::ReplicaId;
use crate::types::StoredMembership;

const STATE_FILE: &str = "controller.json";
/// Version of the controller state file.
pub const STATE_VERSION: u8 = 1;

/// Upper bound on partitions of one topic.
pub const PARTITIONS_MAX: u32 = 1024;
/// Upper bound on the replication factor.
pub const REPLICATION_FACTOR_MAX: u32 = 7;
/// Kafka's bound on topic name length.
pub const TOPIC_NAME_BYTES_MAX: usize = 249;
/// The topic config that turns tiered storage on (`"true"`).
const TIERED_KEY: &str = "remote.storage.enable";

/// Whether a topic config (or the keys of a create or alter) turns tiered storage on.
pub fn tiered(config: &BTreeMap<String, String>) -> bool {
    config.get(TIERED_KEY).map(String::as_str) == Some("true")
}

#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct NodeRecord {
    pub node_id: NodeId,
    pub rpc_addr: String,
    pub http_addr: String,
    /// The data directory the node registered with (`RegisterNode.incarnation`; 0: unknown).
    #[serde(default)]
    pub incarnation: u64,
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct ReplicaRecord {
    pub node_id: NodeId,
    pub replica_id: ReplicaId,
    /// Part of the group's first membership: it may initialize the group. A
    /// replica added by a move never initializes; the leader adds it.
    #[serde(default = "initial_default")]
    pub initial: bool,
}

fn initial_default() -> bool {
    true
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct PartitionRecord {
    pub partition: u32,
    pub group_id: GroupId,
    /// The first replica is the preferred leader.
    pub replicas: Vec<ReplicaRecord>,
    /// Set while a move is in progress: the replicas the group moves to.
    #[serde(default)]
    pub target: Option<Vec<ReplicaRecord>>,
    /// Completed moves; only a group never moved may be initialized.
    #[serde(default)]
    pub moves: u32,
    /// The move's driver has begun changing the voters to `target` (`FixMove`): the move
    /// can no longer be replaced. Until then a new move replaces it.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub target_fixed: bool,
}

impl PartitionRecord {
    /// Every replica that must run: current ones and, during a move, the target's.
    pub fn all_replicas(&self) -> impl Iterator<Item = &ReplicaRecord> {
        let extra =
            self.target.iter().flatten().filter(|t| !self.replicas.iter().any(|r| r.replica_id == t.replica_id));
        self.replicas.iter().chain(extra)
    }
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct TopicRecord {
    pub name: String,
    pub replication_factor: u32,
    pub config: BTreeMap<String, String>,
    pub partitions: Vec<PartitionRecord>,
}

/// Everything the controller group replicates.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct ClusterState {
    pub version: u8,
    pub nodes: BTreeMap<NodeId, NodeRecord>,
    pub topics: BTreeMap<String, std::sync::Arc<TopicRecord>>,
    pub next_group_id: GroupId,
    pub next_replica_id: ReplicaId,
    /// Count of topics ever created: spreads preferred leaders across topics.
    pub topics_created: u64,
    /// The last applied entry.
    pub applied: Option<LogId>,
    /// The last applied membership of the controller group.
    pub membership: StoredMembership,
    /// The cluster's id, random, set by the first node registration applied (0 until then,
    /// and in a state saved before the field). Node-to-node calls carry it, and a node
    /// refuses calls from another cluster (`network::ClusterIdentity`).
    #[serde(default)]
    pub cluster_id: u64,
    /// Nodes removed from the cluster (`RemoveNode`), with the data-directory incarnation each
    /// had registered: neither the id nor that directory registers again, and a call from that
    /// directory is refused (`network::ClusterIdentity`).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub removed_nodes: BTreeMap<NodeId, u64>,
}

/// Outcome of a controller command, as the client sees it.
pub fn result(status: &str, message: impl Into<String>) -> pb::ControllerResult {
    pb::ControllerResult { status: status.to_string(), message: message.into() }
}

impl ClusterState {
    /// Loads the state persisted in `dir`, or a fresh one.
    pub fn load(dir: &Path) -> Result<ClusterState> {
        match std::fs::read(dir.join(STATE_FILE)) {
            Ok(bytes) => {
                let state: ClusterState = serde_json::from_slice(&bytes)
                    .map_err(|e| Error::Corrupted(format!("{}: {e}", dir.join(STATE_FILE).display())))?;
                if state.version != STATE_VERSION {
                    return Err(Error::Corrupted(format!("controller state version {} unknown", state.version)));
                }
                Ok(state)
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(ClusterState::fresh()),
            Err(e) => Err(e.into()),
        }
    }

    fn fresh() -> ClusterState {
        ClusterState { version: STATE_VERSION, next_group_id: 1, next_replica_id: 1 << 20, ..Default::default() }
    }

    /// Persists the state in `dir` (crash-atomic).
    pub fn save(&self, dir: &Path) -> Result<()> {
        let bytes = serde_json::to_vec(self).map_err(|e| Error::Corrupted(e.to_string()))?;
        write_file_durably(dir, STATE_FILE, &bytes)
    }

    pub fn state_file(dir: &Path) -> PathBuf {
        dir.join(STATE_FILE)
    }

    /// Applies one command; the answer is part of the replicated outcome.
    pub fn apply(&mut self, command: &pb::ControllerCommand) -> pb::ControllerResult {
        match &command.kind {
            Some(Kind::RegisterNode(r)) => self.register_node(r),
            Some(Kind::CreateTopic(c)) => self.create_topic(c),
            Some(Kind::DeleteTopic(d)) => match self.topics.remove(&d.name) {
                Some(_) => result("ok", format!("topic {} deleted", d.name)),
                None => result("not_found", format!("topic {} does not exist", d.name)),
            },
            Some(Kind::AlterTopicConfig(a)) => self.alter_config(a),
            Some(Kind::MovePartition(m)) => self.move_partition(m),
            Some(Kind::CompleteMove(c)) => self.complete_move(c),
            Some(Kind::FixMove(f)) => self.fix_move(f),
            Some(Kind::RemoveNode(r)) => self.remove_node(r),
            None => result("invalid", "empty controller command"),
        }
    }

    /// Registers a node, or updates its HTTP address. An id already registered from another
    /// data directory is refused: it is another process taking the id (its peers would send it
    /// the replicas of the node it impersonates), or the same node after its data was lost,
    /// whose Raft logs no longer hold what it acknowledged; such a node joins under a new id.
    /// So is a registered node at another RPC address: the Raft groups it is a member of (the
    /// controller's among them) name it by the address it registered with, and would go on
    /// sending it their entries there.
    fn register_node(&mut self, r: &pb::RegisterNode) -> pb::ControllerResult {
        if self.removed_nodes.contains_key(&r.node_id) {
            return result(
                "conflict",
                format!(
                    "node id {} was removed from the cluster: a node joins under an id never used before \
                     (--join, with an empty data directory)",
                    r.node_id
                ),
            );
        }
        let mut record = NodeRecord {
            node_id: r.node_id,
            rpc_addr: r.rpc_addr.clone(),
            http_addr: r.http_addr.clone(),
            incarnation: r.incarnation,
        };
        if let Some(existing) = self.nodes.get(&r.node_id) {
            if existing.incarnation != 0 && r.incarnation != 0 && existing.incarnation != r.incarnation {
                return result(
                    "conflict",
                    format!(
                        "node id {} is registered by another data directory (at {}); a node whose data was lost, \
                         or a new node, joins under an id of its own, and the partitions move off the old id",
                        r.node_id, existing.rpc_addr
                    ),
                );
            }
            if existing.rpc_addr != r.rpc_addr {
                return result(
                    "conflict",
                    format!(
                        "node {} is registered at RPC address {}, and its groups' replicas know it there: \
                         start it with --rpc-addr {} (a node at another address joins under an id of its own, \
                         and the partitions move off the old id)",
                        r.node_id, existing.rpc_addr, existing.rpc_addr
                    ),
                );
            }
            if r.incarnation == 0 {
                record.incarnation = existing.incarnation;
            }
        }
        if self.cluster_id == 0 {
            self.cluster_id = r.proposed_cluster_id;
        }
        if self.nodes.get(&r.node_id) == Some(&record) {
            return result("exists", format!("node {} already registered", r.node_id));
        }
        self.nodes.insert(r.node_id, record);
        result("ok", format!("node {} registered", r.node_id))
    }

    fn create_topic(&mut self, c: &pb::CreateTopic) -> pb::ControllerResult {
        if let Err(e) = validate_topic_name(&c.name) {
            return result("invalid", e);
        }
        let config: BTreeMap<String, String> = c.config.iter().map(|(k, v)| (k.clone(), v.clone())).collect();
        if let Err(e) = validate_config(&config) {
            return result("invalid", e);
        }
        let config = numbers_spelt_plainly(config);
        if let Some(existing) = self.topics.get(&c.name) {
            let same = existing.partitions.len() as u32 == c.partitions
                && existing.replication_factor == c.replication_factor
                && comparable(&existing.config) == comparable(&config);
            return if same {
                result("exists", format!("topic {} exists with the same settings", c.name))
            } else {
                result("conflict", format!("topic {} exists with different settings", c.name))
            };
        }
        // As in Kafka, names that differ only in '.' against '_' collide (its metric names
        // spell both as '_'): the second is refused.
        let folded = |name: &str| name.replace('.', "_");
        if let Some(other) = self.topics.keys().find(|other| folded(other) == folded(&c.name)) {
            return result(
                "conflict",
                format!("topic name {} collides with the existing topic {other} ('.' and '_' collide)", c.name),
            );
        }
        if c.partitions == 0 || c.partitions > PARTITIONS_MAX {
            return result("invalid", format!("partitions must be 1..={PARTITIONS_MAX}"));
        }
        if c.replication_factor == 0 || c.replication_factor > REPLICATION_FACTOR_MAX {
            return result("invalid", format!("replication_factor must be 1..={REPLICATION_FACTOR_MAX}"));
        }
        let registered: Vec<NodeId> = self.nodes.keys().copied().collect();
        if c.replication_factor as usize > registered.len() {
            return result(
                "invalid",
                format!(
                    "replication_factor {} exceeds the {} registered nodes",
                    c.replication_factor,
                    registered.len()
                ),
            );
        }
        // As Kafka places on live brokers: replicas go round-robin over the nodes that
        // answered the proposer, and only when fewer answered than the replication factor
        // do down nodes fill the rest (after all the live ones, which lead), so a partition
        // has as many live replicas as it can (else one placed only on down nodes has no
        // leader until they return). The list is in the command: every replica places alike.
        let (up, down): (Vec<NodeId>, Vec<NodeId>) = registered.iter().partition(|n| !c.down_nodes.contains(n));
        let rf = c.replication_factor as usize;
        let rotated = |nodes: &[NodeId], k: usize| -> Vec<NodeId> {
            (0..nodes.len()).map(|i| nodes[(k + i) % nodes.len()]).collect()
        };
        let shift = self.topics_created as usize;
        let partitions = (0..c.partitions)
            .map(|p| {
                let k = p as usize + shift;
                let mut nodes = rotated(&up, k);
                nodes.extend(rotated(&down, k));
                let replicas = nodes
                    .into_iter()
                    .take(rf)
                    .map(|node_id| ReplicaRecord { node_id, replica_id: self.allocate_replica(), initial: true })
                    .collect();
                let group_id = self.next_group_id;
                self.next_group_id += 1;
                PartitionRecord { partition: p, group_id, replicas, target: None, moves: 0, target_fixed: false }
            })
            .collect();
        self.topics_created += 1;
        self.topics.insert(
            c.name.clone(),
            std::sync::Arc::new(TopicRecord {
                name: c.name.clone(),
                replication_factor: c.replication_factor,
                config,
                partitions,
            }),
        );
        result("created", format!("topic {} created", c.name))
    }

    fn alter_config(&mut self, a: &pb::AlterTopicConfig) -> pb::ControllerResult {
        let Some(topic) = self.topics.get_mut(&a.name).map(std::sync::Arc::make_mut) else {
            return result("not_found", format!("topic {} does not exist", a.name));
        };
        let mut config = topic.config.clone();
        for (k, v) in &a.config {
            config.insert(k.clone(), v.clone());
        }
        // As Kafka refuses it: records whose local copies were removed live only in the
        // object store, and a topic without tiered storage would trim its log to the local
        // start at once (and drop the objects if it were turned on again).
        if tiered(&topic.config) && !tiered(&config) {
            return result(
                "invalid",
                format!(
                    "{TIERED_KEY} cannot be turned off once on: records of topic {} may live only in the \
                     tiered store; create a new topic without it and copy the records there",
                    a.name
                ),
            );
        }
        if let Err(e) = validate_config(&config) {
            return result("invalid", e);
        }
        topic.config = numbers_spelt_plainly(config);
        result("ok", format!("topic {} altered", a.name))
    }

    fn move_partition(&mut self, m: &pb::MovePartition) -> pb::ControllerResult {
        let nodes = &self.nodes;
        let Some(topic) = self.topics.get(&m.topic) else {
            return result("not_found", format!("topic {} does not exist", m.topic));
        };
        let Some(current) = topic.partitions.get(m.partition as usize) else {
            return result("invalid", format!("topic {} has no partition {}", m.topic, m.partition));
        };
        if m.nodes.is_empty() || m.nodes.len() > REPLICATION_FACTOR_MAX as usize {
            return result("invalid", format!("a partition needs 1 to {REPLICATION_FACTOR_MAX} replicas"));
        }
        let mut seen = std::collections::BTreeSet::new();
        for n in &m.nodes {
            if !nodes.contains_key(n) {
                return result("invalid", format!("node {n} is not registered"));
            }
            if !seen.insert(*n) {
                return result("invalid", format!("node {n} is listed twice"));
            }
        }
        if let Some(target) = &current.target {
            if target.iter().map(|r| r.node_id).eq(m.nodes.iter().copied()) {
                return result("exists", "this move is already in progress");
            }
            if current.target_fixed {
                return result(
                    "conflict",
                    "another move of this partition is changing its voters; it cannot be replaced now",
                );
            }
            // As with Kafka's reassignments, a new move replaces one that has only added
            // learners so far (a move onto a node that is down can be taken back this way).
        } else if current.replicas.iter().map(|r| r.node_id).eq(m.nodes.iter().copied()) {
            return result("exists", "the partition already has these replicas");
        }
        // Nodes keep the replica ids they have, in the current replicas or in a replaced target.
        let existing: Vec<ReplicaRecord> = current.all_replicas().cloned().collect();
        let mut target = Vec::with_capacity(m.nodes.len());
        for n in &m.nodes {
            match existing.iter().find(|r| r.node_id == *n) {
                Some(r) => target.push(r.clone()),
                None => {
                    let replica_id = self.allocate_replica();
                    target.push(ReplicaRecord { node_id: *n, replica_id, initial: false });
                }
            }
        }
        let topic = self.topics.get_mut(&m.topic).map(std::sync::Arc::make_mut);
        if let Some(p) = topic.and_then(|t| t.partitions.get_mut(m.partition as usize)) {
            // A move back to the current replicas still runs: its driver removes the
            // learners the replaced move added, then completes it.
            p.target = Some(target);
            p.target_fixed = false;
        }
        result("ok", format!("moving {}/{} to nodes {:?}", m.topic, m.partition, m.nodes))
    }

    fn fix_move(&mut self, f: &pb::FixMove) -> pb::ControllerResult {
        let topic = self.topics.get_mut(&f.topic).map(std::sync::Arc::make_mut);
        let Some(p) = topic.and_then(|t| t.partitions.get_mut(f.partition as usize)) else {
            return result("not_found", format!("topic {} partition {} does not exist", f.topic, f.partition));
        };
        if p.group_id != f.group_id {
            return result("conflict", "stale move for another group");
        }
        let Some(target) = &p.target else {
            return result("conflict", "no move in progress");
        };
        if !same_replicas(&f.replica_ids, target) {
            return result("conflict", "the move was replaced by another one");
        }
        if p.target_fixed {
            return result("exists", "the move already changes the voters");
        }
        p.target_fixed = true;
        result("ok", format!("move of {}/{} changes the voters now", f.topic, f.partition))
    }

    fn complete_move(&mut self, c: &pb::CompleteMove) -> pb::ControllerResult {
        let topic = self.topics.get_mut(&c.topic).map(std::sync::Arc::make_mut);
        let Some(p) = topic.and_then(|t| t.partitions.get_mut(c.partition as usize)) else {
            return result("not_found", format!("topic {} partition {} does not exist", c.topic, c.partition));
        };
        if p.group_id != c.group_id {
            return result("conflict", "stale move completion for another group");
        }
        let Some(target) = p.target.take() else {
            return result("exists", "no move in progress");
        };
        if !same_replicas(&c.replica_ids, &target) {
            p.target = Some(target);
            return result("conflict", "the committed membership does not match the move target");
        }
        p.replicas = target;
        p.target_fixed = false;
        p.moves += 1;
        result("ok", format!("move of {}/{} complete", c.topic, c.partition))
    }

    /// Removes node `r.node_id` from the cluster, once no partition names it among its
    /// replicas or its move's target: the replicas move off first, so no group loses a member
    /// it counts on. A node never registered is removed only as a controller member (a node
    /// of `--peers` that never started). Removing a removed node again is a no-op.
    fn remove_node(&mut self, r: &pb::RemoveNode) -> pb::ControllerResult {
        let node = r.node_id;
        if self.removed_nodes.contains_key(&node) {
            return result("exists", format!("node {node} was already removed"));
        }
        let record = self.nodes.get(&node);
        if record.is_none() && !r.controller_member {
            return result("not_found", format!("node {node} is not registered"));
        }
        let hosted: Vec<String> = self
            .topics
            .values()
            .flat_map(|t| t.partitions.iter().map(move |p| (t, p)))
            .filter(|(_, p)| p.all_replicas().any(|r| r.node_id == node))
            .map(|(t, p)| format!("{}/{}", t.name, p.partition))
            .collect();
        if let Some(first) = hosted.first() {
            let more = match hosted.len() {
                1 => String::new(),
                n => format!(" and {} more", n - 1),
            };
            return result(
                "conflict",
                format!(
                    "node {node} still holds replicas of {first}{more}: move them to other nodes first \
                     (PUT /topics/{{topic}}/partitions/{{p}}/replicas, or `logdex move`)"
                ),
            );
        }
        let incarnation = record.map_or(0, |n| n.incarnation);
        self.nodes.remove(&node);
        self.removed_nodes.insert(node, incarnation);
        result("ok", format!("node {node} removed"))
    }

    fn allocate_replica(&mut self) -> ReplicaId {
        let id = self.next_replica_id;
        self.next_replica_id += 1;
        id
    }

    /// The topic and partition number of a group.
    pub fn find_group(&self, group: GroupId) -> Option<(&TopicRecord, &PartitionRecord)> {
        self.topics
            .values()
            .flat_map(|t| t.partitions.iter().map(move |p| (t.as_ref(), p)))
            .find(|(_, p)| p.group_id == group)
    }
}

/// Whether `ids` name the replicas of `target`, in any order.
fn same_replicas(ids: &[ReplicaId], target: &[ReplicaRecord]) -> bool {
    let mut asked = ids.to_vec();
    asked.sort_unstable();
    let mut wanted: Vec<ReplicaId> = target.iter().map(|r| r.replica_id).collect();
    wanted.sort_unstable();
    asked == wanted
}

/// Default `delete.retention.ms`: how long tombstones survive compaction (Kafka's default, one day).
pub const DELETE_RETENTION_MS_DEFAULT: u64 = 86_400_000;

/// Default `min.cleanable.dirty.ratio` (Kafka's): a compacted log is cleaned again once the
/// bytes sealed since its last cleaning are half of its sealed bytes.
pub const MIN_CLEANABLE_DIRTY_RATIO_DEFAULT: f64 = 0.5;

/// How a topic's log is cleaned, from its config.
#[derive(Clone, Debug, PartialEq)]
pub struct CleanupPolicy {
    pub compact: bool,
    pub delete: bool,
    pub delete_retention_ms: u64,
    pub min_cleanable_dirty_ratio: f64,
}

/// Tiered storage of a topic (`remote.storage.enable=true`); limits are `None` when unlimited.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TierPolicy {
    /// `retention.ms` and `retention.bytes`: the whole log, remote and local.
    pub retention_ms: Option<u64>,
    pub retention_bytes: Option<u64>,
    /// `local.retention.ms` and `local.retention.bytes`: how much of the copied log a
    /// replica keeps on its own disk (default: as `retention.*`).
    pub local_retention_ms: Option<u64>,
    pub local_retention_bytes: Option<u64>,
}

impl TopicRecord {
    /// The topic's config as given, plus the defaults of the keys that have one
    /// (`cleanup.policy`, `kv.index.enabled`): what describe shows.
    pub fn effective_config(&self) -> BTreeMap<&str, &str> {
        with_defaults(&self.config)
    }

    /// `cleanup.policy` (default `compact`), `delete.retention.ms` and
    /// `min.cleanable.dirty.ratio`.
    pub fn cleanup_policy(&self) -> CleanupPolicy {
        let policy = self.config.get("cleanup.policy").map_or("compact", String::as_str);
        CleanupPolicy {
            compact: policy.contains("compact"),
            delete: policy.contains("delete"),
            delete_retention_ms: self
                .config
                .get("delete.retention.ms")
                .and_then(|v| v.parse().ok())
                .unwrap_or(DELETE_RETENTION_MS_DEFAULT),
            min_cleanable_dirty_ratio: self
                .config
                .get("min.cleanable.dirty.ratio")
                .and_then(|v| v.parse().ok())
                .unwrap_or(MIN_CLEANABLE_DIRTY_RATIO_DEFAULT),
        }
    }

    /// Tiered storage settings, when `remote.storage.enable=true`.
    pub fn tier_policy(&self) -> Option<TierPolicy> {
        if !tiered(&self.config) {
            return None;
        }
        let num = |k: &str| self.config.get(k).and_then(|v| v.parse::<i64>().ok());
        let limit = |v: Option<i64>| v.filter(|v| *v >= 0).map(|v| v as u64);
        let (retention_ms, retention_bytes) = (limit(num("retention.ms")), limit(num("retention.bytes")));
        let local = |k: &str, total: Option<u64>| match num(k) {
            None | Some(-2) => total,
            v => limit(v),
        };
        Some(TierPolicy {
            retention_ms,
            retention_bytes,
            local_retention_ms: local("local.retention.ms", retention_ms),
            local_retention_bytes: local("local.retention.bytes", retention_bytes),
        })
    }

    /// The segment log settings of this topic's replicas, over `base` (node defaults).
    /// Retention limits apply only with the `delete` policy, as in Kafka.
    pub fn log_config(&self, base: &logdex_log::LogConfig) -> logdex_log::LogConfig {
        let num = |k: &str| self.config.get(k).and_then(|v| v.parse::<i64>().ok());
        let mut c = base.clone();
        if let Some(b) = num("segment.bytes") {
            // Kafka accepts tinier segments; logdex rolls at 1 KiB at the least.
            c.segment_bytes = (b.max(0) as u64).clamp(1024, i32::MAX as u64);
        }
        if let Some(ms) = num("segment.ms") {
            c.segment_ms = (ms > 0).then_some(ms as u64);
        }
        let delete = self.cleanup_policy().delete;
        c.retention_ms = num("retention.ms").filter(|v| delete && *v >= 0).map(|v| v as u64);
        c.retention_bytes = num("retention.bytes").filter(|v| delete && *v >= 0).map(|v| v as u64);
        if let Some(m) = num("max.message.bytes") {
            c.batch_bytes_max = (m.max(0) as u64).clamp(logdex_log::BATCH_HEADER_BYTES as u64, i32::MAX as u64) as u32;
        }
        c.compression = self.compression();
        c
    }

    /// The codec of the topic's batches, from `compression.type`: `lz4` and `zstd` name theirs;
    /// `producer` (the default) and `uncompressed` write batches without one, since the HTTP
    /// and gRPC produce requests carry records, not encoded batches.
    pub fn compression(&self) -> logdex_log::Compression {
        match self.config.get("compression.type").map(String::as_str) {
            Some("lz4") => logdex_log::Compression::Lz4,
            Some("zstd") => logdex_log::Compression::Zstd,
            _ => logdex_log::Compression::None,
        }
    }
}

/// A topic config with the defaults of the keys that have one filled in: a create that
/// spells out a default asks for the same topic as one that leaves it out.
fn with_defaults(config: &BTreeMap<String, String>) -> BTreeMap<&str, &str> {
    let mut c: BTreeMap<&str, &str> = config.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
    c.entry("cleanup.policy").or_insert("compact");
    c.entry("kv.index.enabled").or_insert("true");
    // `delete,compact` and `compact, delete` name the policy `compact,delete` does.
    if let Some(policy) = c.get_mut("cleanup.policy")
        && let Some(canonical) = canonical_cleanup_policy(policy)
    {
        *policy = canonical;
    }
    c
}

/// Defaults that describe does not show but a create may spell out and still name the same
/// topic, beside those of [`with_defaults`].
fn implied_defaults() -> [(&'static str, String); 9] {
    [
        ("compression.type", "producer".into()),
        ("segment.bytes", logdex_log::LogConfig::default().segment_bytes.to_string()),
        ("delete.retention.ms", DELETE_RETENTION_MS_DEFAULT.to_string()),
        ("min.cleanable.dirty.ratio", MIN_CLEANABLE_DIRTY_RATIO_DEFAULT.to_string()),
        ("retention.ms", "-1".into()),
        ("retention.bytes", "-1".into()),
        ("remote.storage.enable", "false".into()),
        ("local.retention.ms", "-2".into()),
        ("local.retention.bytes", "-2".into()),
    ]
}

/// `config` as a create compares it: every default filled in, numbers spelt plainly.
fn comparable(config: &BTreeMap<String, String>) -> BTreeMap<String, String> {
    let mut c: BTreeMap<String, String> =
        with_defaults(config).into_iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
    for (key, value) in implied_defaults() {
        c.entry(key.to_string()).or_insert(value);
    }
    numbers_spelt_plainly(c)
}

/// `config` with numbers in their plain spelling (`+1024` and `01024` are `1024`, a
/// `min.cleanable.dirty.ratio` of `0.50` is `0.5`), as Kafka keeps them once parsed. A create
/// compares configs so spelt: a topic created before numbers were kept so may hold another
/// spelling.
fn numbers_spelt_plainly(mut config: BTreeMap<String, String>) -> BTreeMap<String, String> {
    for (key, value) in config.iter_mut() {
        if let Ok(n) = value.parse::<i64>() {
            *value = n.to_string();
        } else if key == "min.cleanable.dirty.ratio"
            && let Ok(ratio) = value.parse::<f64>()
            && ratio.is_finite()
        {
            *value = ratio.to_string();
        }
    }
    config
}

/// `cleanup.policy` in one spelling (`compact`, `delete` or `compact,delete`) for a value that
/// names one or both, in either order, with spaces around the comma as Kafka allows; `None`
/// for any other value.
pub fn canonical_cleanup_policy(value: &str) -> Option<&'static str> {
    let (mut compact, mut delete) = (false, false);
    for part in value.split(',') {
        match part.trim() {
            "compact" => compact = true,
            "delete" => delete = true,
            _ => return None,
        }
    }
    match (compact, delete) {
        (true, true) => Some("compact,delete"),
        (true, false) => Some("compact"),
        (false, true) => Some("delete"),
        (false, false) => None,
    }
}

/// Kafka's topic name rules: 1 to 249 of `[a-zA-Z0-9._-]`, not `.` or `..`.
pub fn validate_topic_name(name: &str) -> std::result::Result<(), String> {
    if name.is_empty() || name.len() > TOPIC_NAME_BYTES_MAX {
        return Err(format!("topic name must be 1 to {TOPIC_NAME_BYTES_MAX} characters"));
    }
    if name == "." || name == ".." {
        return Err("topic name cannot be '.' or '..'".into());
    }
    if !name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'.' || b == b'_' || b == b'-') {
        return Err("topic name may contain only ASCII letters, digits, '.', '_' and '-'".into());
    }
    Ok(())
}

/// Topic config keys logdex understands, with a check of each value.
pub fn validate_config(config: &BTreeMap<String, String>) -> std::result::Result<(), String> {
    for (key, value) in config {
        let (ok, expected) = match key.as_str() {
            "cleanup.policy" => (canonical_cleanup_policy(value).is_some(), "compact, delete or both (compact,delete)"),
            "kv.index.enabled" | "remote.storage.enable" => {
                (matches!(value.as_str(), "true" | "false"), "true or false")
            }
            "segment.bytes" | "max.message.bytes" => {
                (value.parse::<u64>().is_ok_and(|v| v > 0), "a whole number of bytes, at least 1")
            }
            "segment.ms" | "delete.retention.ms" => (value.parse::<u64>().is_ok(), "a whole number of milliseconds"),
            "retention.ms" | "retention.bytes" => {
                (value.parse::<i64>().is_ok_and(|v| v >= -1), "a whole number, at least -1 (-1: no limit)")
            }
            "compression.type" => (
                matches!(value.as_str(), "producer" | "uncompressed" | "lz4" | "zstd"),
                "producer, uncompressed, lz4 or zstd (logdex does not write gzip or snappy)",
            ),
            "min.cleanable.dirty.ratio" => {
                (value.parse::<f64>().is_ok_and(|v| (0.0..=1.0).contains(&v)), "a number from 0 to 1")
            }
            // -2: as `retention.*` (Kafka's default); -1: no limit.
            "local.retention.ms" | "local.retention.bytes" => (
                value.parse::<i64>().is_ok_and(|v| v >= -2),
                "a whole number, at least -2 (-2: as retention.*, -1: no limit)",
            ),
            _ => return Err(format!("unknown topic config {key:?}")),
        };
        if !ok {
            return Err(format!("invalid value {value:?} for topic config {key:?}: it must be {expected}"));
        }
    }
    // As in Kafka: compaction rewrites sealed segments, which tiered storage copies once.
    if tiered(config) && config.get("cleanup.policy").and_then(|p| canonical_cleanup_policy(p)) != Some("delete") {
        return Err("remote.storage.enable=true needs cleanup.policy=delete (compacted topics are not tiered)".into());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn register(state: &mut ClusterState, id: u64) {
        register_from(state, id, 7000 + id, 0);
    }

    fn register_from(state: &mut ClusterState, id: u64, port: u64, incarnation: u64) -> pb::ControllerResult {
        let cmd = pb::ControllerCommand {
            kind: Some(Kind::RegisterNode(pb::RegisterNode {
                node_id: id,
                rpc_addr: format!("127.0.0.1:{port}"),
                http_addr: format!("127.0.0.1:{}", 8000 + id),
                incarnation,
                proposed_cluster_id: 100 + id,
            })),
        };
        state.apply(&cmd)
    }

    #[test]
    fn the_first_registration_applied_names_the_cluster_and_later_ones_do_not_rename_it() {
        let mut state = ClusterState::default();
        assert_eq!(register_from(&mut state, 4, 7004, 11).status, "ok");
        assert_eq!(state.cluster_id, 104, "the first proposal");
        assert_eq!(register_from(&mut state, 5, 7005, 22).status, "ok");
        assert_eq!(register_from(&mut state, 4, 7004, 11).status, "exists");
        assert_eq!(state.cluster_id, 104, "later registrations keep it");

        // A conflicting registration names no cluster; one from a node that predates the
        // field (no proposal) leaves it unnamed for the next.
        let mut state = ClusterState::default();
        let mut old = register_from(&mut state, 6, 7006, 0);
        assert_eq!(old.status, "ok");
        state.cluster_id = 0;
        old = register_from(&mut state, 6, 7016, 0);
        assert_eq!(old.status, "conflict", "{}", old.message);
        assert_eq!(state.cluster_id, 0, "a refused registration names no cluster");
        let unnamed = pb::ControllerCommand {
            kind: Some(Kind::RegisterNode(pb::RegisterNode {
                node_id: 7,
                rpc_addr: "127.0.0.1:7007".into(),
                http_addr: "127.0.0.1:8007".into(),
                ..Default::default()
            })),
        };
        assert_eq!(state.apply(&unnamed).status, "ok");
        assert_eq!(state.cluster_id, 0, "no proposal");
        assert_eq!(register_from(&mut state, 6, 7006, 0).status, "exists");
        assert_eq!(state.cluster_id, 106, "the next proposal names it");
    }

    #[test]
    fn an_id_registered_from_one_data_directory_is_refused_to_another() {
        let mut state = ClusterState::default();
        assert_eq!(register_from(&mut state, 4, 7004, 11).status, "ok");
        assert_eq!(register_from(&mut state, 4, 7004, 11).status, "exists", "a retry of the same registration");
        let refused = register_from(&mut state, 4, 7004, 22);
        assert_eq!(refused.status, "conflict", "{}", refused.message);
        assert_eq!(state.nodes[&4].incarnation, 11, "the refused registration changed nothing");
        assert_eq!(register_from(&mut state, 4, 7004, 0).status, "exists", "a node that predates incarnations");
        assert_eq!(state.nodes[&4].incarnation, 11);
        assert_eq!(register_from(&mut state, 5, 7005, 0).status, "ok");
        assert_eq!(
            register_from(&mut state, 5, 7005, 33).status,
            "ok",
            "an unknown directory takes the first one seen"
        );
        assert_eq!(register_from(&mut state, 5, 7005, 44).status, "conflict");
    }

    #[test]
    fn a_registered_node_at_another_rpc_address_is_refused_and_may_change_its_http_address() {
        let mut state = ClusterState::default();
        assert_eq!(register_from(&mut state, 4, 7004, 11).status, "ok");
        for incarnation in [11, 0] {
            let refused = register_from(&mut state, 4, 7014, incarnation);
            assert_eq!(refused.status, "conflict", "{}", refused.message);
            assert!(refused.message.contains("start it with --rpc-addr 127.0.0.1:7004"), "{}", refused.message);
            assert_eq!(state.nodes[&4].rpc_addr, "127.0.0.1:7004", "the refused registration changed nothing");
        }
        let moved_http = pb::ControllerCommand {
            kind: Some(Kind::RegisterNode(pb::RegisterNode {
                node_id: 4,
                rpc_addr: "127.0.0.1:7004".into(),
                http_addr: "127.0.0.1:9004".into(),
                incarnation: 11,
                ..Default::default()
            })),
        };
        assert_eq!(state.apply(&moved_http).status, "ok");
        assert_eq!(state.nodes[&4].http_addr, "127.0.0.1:9004");
    }

    fn remove(state: &mut ClusterState, node_id: u64) -> pb::ControllerResult {
        let r = pb::RemoveNode { node_id, controller_member: false };
        state.apply(&pb::ControllerCommand { kind: Some(Kind::RemoveNode(r)) })
    }

    #[test]
    fn a_node_is_removed_only_once_no_partition_names_it_and_never_registers_again() {
        let mut state = ClusterState::fresh();
        for id in 1..=4 {
            register_from(&mut state, id, 7000 + id, 10 + id);
        }
        assert_eq!(create(&mut state, "t", 1, 3).status, "created");
        let holder = state.topics["t"].partitions[0].replicas[0].node_id;
        let spare = (1..=4).find(|n| state.topics["t"].partitions[0].replicas.iter().all(|r| r.node_id != *n));
        let spare = spare.unwrap_or_default();
        assert_eq!(remove(&mut state, 9).status, "not_found");

        let refused = remove(&mut state, holder);
        assert_eq!(refused.status, "conflict", "{}", refused.message);
        assert!(refused.message.contains("t/0"), "names the partition: {}", refused.message);
        assert!(state.nodes.contains_key(&holder), "the refused removal changed nothing");

        // A move's target names the node too, until the move is done.
        let mut others: Vec<u64> =
            state.topics["t"].partitions[0].replicas.iter().map(|r| r.node_id).filter(|n| *n != holder).collect();
        others.push(spare);
        assert_eq!(move_to(&mut state, others.clone()).status, "ok");
        assert_eq!(remove(&mut state, spare).status, "conflict", "the target of a move in progress");

        let removed = remove(&mut state, holder);
        assert_eq!(removed.status, "conflict", "the move is not complete: {}", removed.message);
        let target = state.topics["t"].partitions[0].target.clone().unwrap_or_default();
        let group_id = state.topics["t"].partitions[0].group_id;
        let complete = pb::ControllerCommand {
            kind: Some(Kind::CompleteMove(pb::CompleteMove {
                topic: "t".into(),
                partition: 0,
                group_id,
                replica_ids: target.iter().map(|r| r.replica_id).collect(),
            })),
        };
        assert_eq!(state.apply(&complete).status, "ok");
        assert_eq!(remove(&mut state, holder).status, "ok");
        assert!(!state.nodes.contains_key(&holder));
        assert_eq!(state.removed_nodes.get(&holder), Some(&(10 + holder)), "its data directory is kept");
        assert_eq!(remove(&mut state, holder).status, "exists", "a retry");

        // Neither its directory nor a new one registers under the id again.
        for incarnation in [10 + holder, 99] {
            let refused = register_from(&mut state, holder, 7000 + holder, incarnation);
            assert_eq!(refused.status, "conflict", "{}", refused.message);
            assert!(refused.message.contains("was removed"), "{}", refused.message);
        }
        assert!(!state.nodes.contains_key(&holder));
        // A move onto it is refused like one onto any unregistered node.
        assert_eq!(move_to(&mut state, vec![holder]).status, "invalid");

        // A node never registered is removed only as a controller member, and then never
        // registers either.
        assert_eq!(remove(&mut state, 8).status, "not_found");
        let member = pb::RemoveNode { node_id: 8, controller_member: true };
        assert_eq!(state.apply(&pb::ControllerCommand { kind: Some(Kind::RemoveNode(member)) }).status, "ok");
        assert_eq!(state.removed_nodes.get(&8), Some(&0));
        assert_eq!(register_from(&mut state, 8, 7008, 18).status, "conflict");
    }

    fn create(state: &mut ClusterState, name: &str, partitions: u32, rf: u32) -> pb::ControllerResult {
        state.apply(&pb::ControllerCommand {
            kind: Some(Kind::CreateTopic(pb::CreateTopic {
                name: name.into(),
                partitions,
                replication_factor: rf,
                config: Default::default(),
                down_nodes: Vec::new(),
            })),
        })
    }

    /// A create of the one-partition, one-replica topic `t` with `config`.
    fn create_t_with(config: &[(&str, &str)]) -> pb::ControllerCommand {
        pb::ControllerCommand {
            kind: Some(Kind::CreateTopic(pb::CreateTopic {
                name: "t".into(),
                partitions: 1,
                replication_factor: 1,
                config: config.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect(),
                down_nodes: Vec::new(),
            })),
        }
    }

    fn register_all(state: &mut ClusterState, ids: std::ops::RangeInclusive<u64>) {
        for id in ids {
            register(state, id);
        }
    }

    fn move_to(state: &mut ClusterState, nodes: Vec<u64>) -> pb::ControllerResult {
        state.apply(&pb::ControllerCommand {
            kind: Some(Kind::MovePartition(pb::MovePartition { topic: "t".into(), partition: 0, nodes })),
        })
    }

    /// A move keeps the replica ids of nodes that stay, gives fresh ones to new
    /// nodes, and becomes current only when the committed membership matches.
    #[test]
    fn move_keeps_staying_replicas_and_completes_on_matching_membership() {
        let mut state = ClusterState::fresh();
        register_all(&mut state, 1..=4);
        assert_eq!(create(&mut state, "t", 1, 3).status, "created");
        let before = state.topics["t"].partitions[0].clone();
        let staying: Vec<u64> = before.replicas.iter().take(2).map(|r| r.node_id).collect();
        let nodes = vec![staying[0], staying[1], 4];
        assert_eq!(move_to(&mut state, nodes.clone()).status, "ok");
        assert_eq!(move_to(&mut state, nodes.clone()).status, "exists");
        let target = state.topics["t"].partitions[0].target.clone().unwrap_or_default();
        let ids: Vec<u64> = target.iter().map(|r| r.replica_id).collect();
        assert_eq!(state.apply(&fix("t", before.group_id, ids.clone())).status, "ok");
        assert_eq!(move_to(&mut state, vec![1]).status, "conflict", "a fixed move is not replaced");
        assert_eq!(target[0].replica_id, before.replicas[0].replica_id);
        assert!(!target[2].initial);
        assert!(before.replicas.iter().all(|r| r.replica_id != target[2].replica_id));
        let complete = |ids: Vec<u64>| pb::ControllerCommand {
            kind: Some(Kind::CompleteMove(pb::CompleteMove {
                topic: "t".into(),
                partition: 0,
                group_id: before.group_id,
                replica_ids: ids,
            })),
        };
        assert_eq!(state.apply(&complete(vec![1, 2])).status, "conflict");
        assert_eq!(state.apply(&complete(ids)).status, "ok");
        let after = &state.topics["t"].partitions[0];
        assert_eq!(after.replicas, target);
        assert!(after.target.is_none());
        assert!(!after.target_fixed);
    }

    fn fix(topic: &str, group_id: u64, replica_ids: Vec<u64>) -> pb::ControllerCommand {
        pb::ControllerCommand {
            kind: Some(Kind::FixMove(pb::FixMove { topic: topic.into(), partition: 0, group_id, replica_ids })),
        }
    }

    /// A move that has not begun changing the voters is replaced by a new one (node 4 keeps
    /// the replica id the first move gave it); a move back to the current replicas still
    /// runs (its driver removes the learners); the driver of a replaced move cannot fix it.
    #[test]
    fn a_move_not_yet_fixed_is_replaced_by_a_new_one() {
        let mut state = ClusterState::fresh();
        register_all(&mut state, 1..=5);
        create(&mut state, "t", 1, 2);
        let before = state.topics["t"].partitions[0].clone();
        let current: Vec<u64> = before.replicas.iter().map(|r| r.node_id).collect();
        let spare: Vec<u64> = (1..=5).filter(|n| !current.contains(n)).collect();
        assert_eq!(move_to(&mut state, vec![current[1], spare[0]]).status, "ok");
        let first = state.topics["t"].partitions[0].target.clone().unwrap_or_default();
        assert_eq!(move_to(&mut state, vec![spare[0], spare[1]]).status, "ok");
        let second = state.topics["t"].partitions[0].target.clone().unwrap_or_default();
        assert_eq!(second[0].replica_id, first[1].replica_id, "a node keeps its replica id");
        let stale: Vec<u64> = first.iter().map(|r| r.replica_id).collect();
        assert_eq!(state.apply(&fix("t", before.group_id, stale)).status, "conflict");
        assert_eq!(move_to(&mut state, current.clone()).status, "ok", "taking a move back");
        let back = state.topics["t"].partitions[0].target.clone().unwrap_or_default();
        assert_eq!(back, before.replicas);
        let ids: Vec<u64> = back.iter().map(|r| r.replica_id).collect();
        assert_eq!(state.apply(&fix("t", before.group_id, ids.clone())).status, "ok");
        assert_eq!(state.apply(&fix("t", before.group_id, ids)).status, "exists");
    }

    #[test]
    fn move_to_unregistered_or_repeated_node_is_invalid() {
        let mut state = ClusterState::fresh();
        register_all(&mut state, 1..=3);
        create(&mut state, "t", 1, 3);
        assert_eq!(move_to(&mut state, vec![1, 2, 9]).status, "invalid");
        assert_eq!(move_to(&mut state, vec![1, 1]).status, "invalid");
        assert!(state.topics["t"].partitions[0].target.is_none());
    }

    /// Six partitions at replication factor 3 over three nodes: every node is
    /// preferred leader of two partitions and holds all six.
    #[test]
    fn placement_spreads_preferred_leaders_evenly() {
        let mut state = ClusterState::fresh();
        for id in 1..=3 {
            register(&mut state, id);
        }
        assert_eq!(create(&mut state, "t", 6, 3).status, "created");
        let topic = &state.topics["t"];
        let mut leaders = BTreeMap::new();
        for p in &topic.partitions {
            *leaders.entry(p.replicas[0].node_id).or_insert(0) += 1;
            let mut nodes: Vec<_> = p.replicas.iter().map(|r| r.node_id).collect();
            nodes.sort();
            assert_eq!(nodes, vec![1, 2, 3]);
        }
        assert_eq!(leaders.values().copied().collect::<Vec<_>>(), vec![2, 2, 2]);
    }

    /// Nodes the proposer found down get no replica while enough others remain; when too
    /// few remain, every partition gets all the live ones (one of them first, to lead) and
    /// down nodes for the rest.
    #[test]
    fn placement_leaves_out_down_nodes_while_enough_remain() {
        let mut state = ClusterState::fresh();
        register_all(&mut state, 1..=4);
        let create_with_down = |state: &mut ClusterState, name: &str, rf: u32, down: Vec<u64>| {
            state.apply(&pb::ControllerCommand {
                kind: Some(Kind::CreateTopic(pb::CreateTopic {
                    name: name.into(),
                    partitions: 4,
                    replication_factor: rf,
                    config: Default::default(),
                    down_nodes: down,
                })),
            })
        };
        let nodes_of = |state: &ClusterState, name: &str| -> std::collections::BTreeSet<u64> {
            state.topics[name].partitions.iter().flat_map(|p| p.replicas.iter().map(|r| r.node_id)).collect()
        };
        assert_eq!(create_with_down(&mut state, "a", 2, vec![4]).status, "created");
        assert_eq!(nodes_of(&state, "a"), [1, 2, 3].into());
        assert_eq!(create_with_down(&mut state, "b", 3, vec![2, 4]).status, "created");
        for p in &state.topics["b"].partitions {
            let nodes: Vec<u64> = p.replicas.iter().map(|r| r.node_id).collect();
            assert_eq!(nodes.len(), 3);
            assert!([1, 3].contains(&nodes[0]) && [1, 3].contains(&nodes[1]), "live nodes first: {nodes:?}");
            assert!([2, 4].contains(&nodes[2]), "a down node fills the rest: {nodes:?}");
        }
        assert_eq!(nodes_of(&state, "b"), [1, 2, 3, 4].into(), "down nodes take turns filling");
    }

    #[test]
    fn replication_factor_above_node_count_is_invalid() {
        let mut state = ClusterState::fresh();
        register(&mut state, 1);
        assert_eq!(create(&mut state, "t", 1, 3).status, "invalid");
        assert!(state.topics.is_empty());
    }

    #[test]
    fn identical_create_is_exists_and_different_is_conflict() {
        let mut state = ClusterState::fresh();
        register(&mut state, 1);
        assert_eq!(create(&mut state, "t", 2, 1).status, "created");
        assert_eq!(create(&mut state, "t", 2, 1).status, "exists");
        assert_eq!(create(&mut state, "t", 3, 1).status, "conflict");
    }

    #[test]
    fn topic_names_differing_only_in_dot_and_underscore_collide() {
        let mut state = ClusterState::fresh();
        register(&mut state, 1);
        assert_eq!(create(&mut state, "a.b_c", 1, 1).status, "created");
        assert_eq!(create(&mut state, "a_b.c", 1, 1).status, "conflict");
        assert_eq!(create(&mut state, "a_b_c", 1, 1).status, "conflict");
        assert_eq!(create(&mut state, "a-b-c", 1, 1).status, "created");
        assert_eq!(state.topics.len(), 2);
    }

    #[test]
    fn create_spelling_out_a_default_config_is_the_same_topic() {
        let mut state = ClusterState::fresh();
        register(&mut state, 1);
        assert_eq!(create(&mut state, "t", 1, 1).status, "created");
        let defaults = [
            ("cleanup.policy", "compact"),
            ("kv.index.enabled", "true"),
            ("delete.retention.ms", "86400000"),
            ("segment.bytes", "134217728"),
            ("min.cleanable.dirty.ratio", "0.50"),
            ("retention.ms", "-1"),
            ("retention.bytes", "-1"),
            ("remote.storage.enable", "false"),
            ("local.retention.ms", "-2"),
            ("local.retention.bytes", "-2"),
            ("compression.type", "producer"),
        ];
        for default in defaults {
            assert_eq!(state.apply(&create_t_with(&[default])).status, "exists", "{default:?}");
        }
        assert_eq!(state.apply(&create_t_with(&defaults)).status, "exists");
        assert_eq!(state.apply(&create_t_with(&[("cleanup.policy", "delete")])).status, "conflict");
        assert_eq!(state.apply(&create_t_with(&[("min.cleanable.dirty.ratio", "0.51")])).status, "conflict");
        assert_eq!(state.apply(&create_t_with(&[("compression.type", "zstd")])).status, "conflict");
        // And the other way round: a topic created spelling out a default.
        let mut state = ClusterState::fresh();
        register(&mut state, 1);
        assert_eq!(state.apply(&create_t_with(&[("min.cleanable.dirty.ratio", "0.5")])).status, "created");
        assert_eq!(create(&mut state, "t", 1, 1).status, "exists");
        assert_eq!(state.apply(&create_t_with(&[("min.cleanable.dirty.ratio", ".5")])).status, "exists");
    }

    #[test]
    fn create_with_a_number_spelled_otherwise_is_the_same_topic() {
        let mut state = ClusterState::fresh();
        register(&mut state, 1);
        let create_with = |retention: &str| create_t_with(&[("retention.ms", retention)]);
        assert_eq!(state.apply(&create_with("01000")).status, "created");
        assert_eq!(state.apply(&create_with("1000")).status, "exists");
        assert_eq!(state.apply(&create_with("+1000")).status, "exists");
        assert_eq!(state.apply(&create_with("1001")).status, "conflict");
        assert_eq!(state.topics["t"].config["retention.ms"], "1000", "kept as Kafka keeps it");
    }

    #[test]
    fn create_naming_both_cleanup_policies_in_either_order_is_the_same_topic() {
        let mut state = ClusterState::fresh();
        register(&mut state, 1);
        let create_with = |policy: &str| create_t_with(&[("cleanup.policy", policy)]);
        assert_eq!(state.apply(&create_with("delete,compact")).status, "created");
        assert_eq!(state.apply(&create_with("compact,delete")).status, "exists");
        assert_eq!(state.apply(&create_with("delete,compact")).status, "exists");
        assert_eq!(state.apply(&create_with("compact, delete")).status, "exists");
        assert_eq!(state.apply(&create_with("compact")).status, "conflict");
        let policy = |v: &str| validate_config(&[("cleanup.policy".to_string(), v.to_string())].into());
        for taken in ["compact", "delete", "compact,delete", "delete,compact", "compact, delete", " delete "] {
            assert!(policy(taken).is_ok(), "{taken:?} refused");
        }
        for refused in ["", "compact,", "compact;delete", "Compact", "compact,bogus"] {
            assert!(policy(refused).is_err(), "{refused:?} taken");
        }
    }

    #[test]
    fn replica_ids_are_never_reused_across_topics() {
        let mut state = ClusterState::fresh();
        register(&mut state, 1);
        create(&mut state, "a", 2, 1);
        state.apply(&pb::ControllerCommand { kind: Some(Kind::DeleteTopic(pb::DeleteTopic { name: "a".into() })) });
        create(&mut state, "a", 2, 1);
        let ids: Vec<_> = state.topics["a"].partitions.iter().map(|p| p.replicas[0].replica_id).collect();
        assert!(ids.iter().all(|id| *id >= (1 << 20) + 2), "{ids:?}");
    }

    #[test]
    fn topic_names_follow_kafka_rules() {
        assert!(validate_topic_name("orders.v1_x-2").is_ok());
        for bad in ["", ".", "..", "a/b", "a b", &"x".repeat(250)] {
            assert!(validate_topic_name(bad).is_err(), "{bad:?}");
        }
    }

    fn config(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
    }

    #[test]
    fn remote_storage_needs_the_delete_policy() {
        let tiered = [("remote.storage.enable", "true")];
        assert!(validate_config(&config(&tiered)).is_err(), "the default policy is compact");
        assert!(validate_config(&config(&[tiered[0], ("cleanup.policy", "compact,delete")])).is_err());
        assert!(validate_config(&config(&[tiered[0], ("cleanup.policy", "delete")])).is_ok());
        assert!(validate_config(&config(&[("remote.storage.enable", "yes")])).is_err());
        assert!(validate_config(&config(&[("local.retention.ms", "-3")])).is_err());
    }

    #[test]
    fn tiered_storage_cannot_be_turned_off_once_on() {
        let mut state = ClusterState::fresh();
        register(&mut state, 1);
        create(&mut state, "t", 1, 1);
        let alter = |pairs: &[(&str, &str)]| pb::ControllerCommand {
            kind: Some(Kind::AlterTopicConfig(pb::AlterTopicConfig {
                name: "t".into(),
                config: pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect(),
            })),
        };
        // Off to off is no change; off to on is taken.
        assert_eq!(state.apply(&alter(&[("remote.storage.enable", "false")])).status, "ok");
        let on = [("cleanup.policy", "delete"), ("remote.storage.enable", "true")];
        assert_eq!(state.apply(&alter(&on)).status, "ok");
        assert_eq!(state.apply(&alter(&[("remote.storage.enable", "true")])).status, "ok");
        for off in ["false", "FALSE", ""] {
            let refused = state.apply(&alter(&[("remote.storage.enable", off)]));
            assert_eq!(refused.status, "invalid", "{off:?}");
            assert!(refused.message.contains("cannot be turned off"), "{}", refused.message);
        }
        assert_eq!(state.topics["t"].config["remote.storage.enable"], "true");
        assert!(state.topics["t"].tier_policy().is_some());
        assert_eq!(state.apply(&alter(&[("segment.bytes", "+02048")])).status, "ok");
        assert_eq!(state.topics["t"].config["segment.bytes"], "2048", "a number kept as Kafka keeps it");
    }

    #[test]
    fn local_retention_defaults_to_the_topic_retention() {
        let topic = |pairs: &[(&str, &str)]| TopicRecord {
            name: "t".into(),
            partitions: Vec::new(),
            replication_factor: 1,
            config: config(pairs),
        };
        assert_eq!(topic(&[("cleanup.policy", "delete")]).tier_policy(), None);
        let base = [("cleanup.policy", "delete"), ("remote.storage.enable", "true"), ("retention.ms", "5000")];
        let p = topic(&base).tier_policy().expect("tiered");
        assert_eq!((p.retention_ms, p.local_retention_ms, p.local_retention_bytes), (Some(5000), Some(5000), None));
        let p = topic(&[base[0], base[1], base[2], ("local.retention.ms", "0"), ("local.retention.bytes", "-1")])
            .tier_policy()
            .expect("tiered");
        assert_eq!((p.local_retention_ms, p.local_retention_bytes), (Some(0), None));
    }
}
