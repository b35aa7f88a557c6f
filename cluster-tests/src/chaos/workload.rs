//! The chaos workload: clients at a bounded rate over a topic's partitions, each running one
//! operation at a time against a random node and recording invocation and completion times.
//!
//! Per client, by weight: puts of unique values to a small shared key set (keys collide; at
//! most `clients` clients per key), some with `?forward=false`; deletes of those keys; batch
//! produces of 1 to 5 unique records to one partition; linearizable and strict lookups;
//! follower lookups; follower lookups with `min_offset` after the client's own write of the key
//! (read-your-writes); sequential follower fetches with a cursor per node and partition.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::RwLock;
use std::sync::atomic::AtomicBool;
use std::sync::atomic::AtomicU64;
use std::sync::atomic::Ordering;
use std::time::Duration;
use std::time::Instant;

use rand::Rng as _;
use rand::SeedableRng as _;
use rand::rngs::StdRng;
use tokio::task::JoinHandle;

use crate::chaos::op::Nanos;
use crate::chaos::op::Op;
use crate::chaos::op::Outcome;
use crate::chaos::op::ReadKind;
use crate::chaos::op::Request;
use crate::chaos::op::execute;
use crate::client::Api;

/// How hard and how long the clients work.
#[derive(Clone, Debug)]
pub struct WorkloadConfig {
    pub clients: usize,
    /// Keys shared by puts, deletes and lookups (`k00`, `k01`, ...).
    pub register_keys: usize,
    /// Mean pause between two operations of one client (uniform in 0.5x..1.5x).
    pub op_interval: Duration,
    /// Upper bounds of one client.
    pub ops_per_client_max: u64,
    pub deadline: Duration,
    /// Records per follower fetch.
    pub fetch_records: u32,
}

impl Default for WorkloadConfig {
    fn default() -> WorkloadConfig {
        WorkloadConfig {
            clients: 8,
            register_keys: 16,
            op_interval: Duration::from_millis(60),
            ops_per_client_max: 20_000,
            deadline: Duration::from_secs(40 * 60),
            fetch_records: 100,
        }
    }
}

/// What the harness and the clients share while a run is going.
pub struct RunState {
    /// Start of the run: every time in the history is measured from it.
    pub clock: Instant,
    /// `(node id, base URL)` of every node clients may ask.
    pub nodes: RwLock<Vec<(u64, String)>>,
    /// Process generation of each node (index = node id), bumped before a kill and after a
    /// restart, so a client session never spans two processes.
    pub epochs: Vec<AtomicU64>,
    pub stop: AtomicBool,
    pub acked_writes: AtomicU64,
    pub ok_reads: AtomicU64,
}

impl RunState {
    pub fn new(nodes: Vec<(u64, String)>, node_count_max: usize) -> Arc<RunState> {
        Arc::new(RunState {
            clock: Instant::now(),
            nodes: RwLock::new(nodes),
            epochs: (0..=node_count_max).map(|_| AtomicU64::new(1)).collect(),
            stop: AtomicBool::new(false),
            acked_writes: AtomicU64::new(0),
            ok_reads: AtomicU64::new(0),
        })
    }

    pub fn now(&self) -> Nanos {
        self.clock.elapsed().as_nanos() as Nanos
    }

    pub fn epoch(&self, node: u64) -> u64 {
        self.epochs.get(node as usize).map_or(0, |e| e.load(Ordering::SeqCst))
    }

    pub fn bump_epoch(&self, node: u64) {
        if let Some(e) = self.epochs.get(node as usize) {
            e.fetch_add(1, Ordering::SeqCst);
        }
    }

    pub fn add_node(&self, id: u64, url: String) {
        let mut nodes = self.nodes.write().unwrap_or_else(std::sync::PoisonError::into_inner);
        if !nodes.iter().any(|(n, _)| *n == id) {
            nodes.push((id, url));
        }
    }

    /// A random node; one in `suspects` (it left an operation unanswered lately) only one
    /// time in twenty, as a client with a circuit breaker would, so a cut-off node still sees
    /// some traffic.
    fn pick_node(&self, rng: &mut StdRng, suspects: &HashMap<u64, Instant>) -> (u64, String) {
        let nodes = self.nodes.read().unwrap_or_else(std::sync::PoisonError::into_inner);
        let mut pick = nodes[rng.random_range(0..nodes.len())].clone();
        for _ in 0..3 {
            let suspect = suspects.get(&pick.0).is_some_and(|until| Instant::now() < *until);
            if !suspect || rng.random_bool(0.05) {
                break;
            }
            pick = nodes[rng.random_range(0..nodes.len())].clone();
        }
        pick
    }
}

/// The running clients.
pub struct Workload {
    state: Arc<RunState>,
    tasks: Vec<JoinHandle<Vec<Op>>>,
}

impl Workload {
    pub fn start(
        api: Api,
        topic: &str,
        partitions: u32,
        config: &WorkloadConfig,
        state: Arc<RunState>,
        rng: &mut StdRng,
    ) -> Workload {
        let tasks = (0..config.clients)
            .map(|id| {
                let client = Client {
                    id,
                    api: api.clone(),
                    topic: topic.to_string(),
                    partitions,
                    config: config.clone(),
                    state: state.clone(),
                    rng: StdRng::seed_from_u64(rng.random()),
                    own_writes: HashMap::new(),
                    cursors: HashMap::new(),
                    suspects: HashMap::new(),
                    strikes: HashMap::new(),
                    ops: Vec::new(),
                };
                tokio::spawn(client.run())
            })
            .collect();
        Workload { state, tasks }
    }

    pub fn acked_writes(&self) -> u64 {
        self.state.acked_writes.load(Ordering::SeqCst)
    }

    pub fn ok_reads(&self) -> u64 {
        self.state.ok_reads.load(Ordering::SeqCst)
    }

    /// True when every client ended (bounded out) before being stopped.
    pub fn finished(&self) -> bool {
        self.tasks.iter().all(JoinHandle::is_finished)
    }

    /// Stops the clients after their current operation; returns the merged history, ordered by
    /// invocation, with ids assigned.
    pub async fn stop(self) -> Vec<Op> {
        self.state.stop.store(true, Ordering::SeqCst);
        let mut ops = Vec::new();
        for task in self.tasks {
            match task.await {
                Ok(list) => ops.extend(list),
                Err(e) => eprintln!("a workload client panicked: {e}"),
            }
        }
        ops.sort_by_key(|o| (o.invoke, o.client));
        for (i, op) in ops.iter_mut().enumerate() {
            op.id = i;
        }
        ops
    }
}

struct Client {
    id: usize,
    api: Api,
    topic: String,
    partitions: u32,
    config: WorkloadConfig,
    state: Arc<RunState>,
    rng: StdRng,
    /// The client's last acknowledged write of each key: its offset (for `min_offset`).
    own_writes: HashMap<String, u64>,
    /// Sequential fetch cursors: (node, partition) -> (node generation, next offset).
    cursors: HashMap<(u64, u32), (u64, u64)>,
    /// Nodes that lately left an operation without an answer, until when they are avoided.
    suspects: HashMap<u64, Instant>,
    /// Consecutive unanswered operations per node (at most 3).
    strikes: HashMap<u64, u32>,
    ops: Vec<Op>,
}

/// How long a node that timed out is mostly avoided.
const SUSPECT_FOR: Duration = Duration::from_secs(5);

impl Client {
    async fn run(mut self) -> Vec<Op> {
        let started = Instant::now();
        let mut due = Instant::now();
        for seq in 0..self.config.ops_per_client_max {
            if self.state.stop.load(Ordering::SeqCst) || started.elapsed() > self.config.deadline {
                break;
            }
            let mean = self.config.op_interval.as_millis() as u64;
            due += Duration::from_millis(self.rng.random_range(mean / 2..=mean + mean / 2));
            let now = Instant::now();
            if due > now {
                tokio::time::sleep(due - now).await;
            } else {
                due = now;
            }
            let (node, base) = self.state.pick_node(&mut self.rng, &self.suspects);
            let request = self.next_request(seq, node);
            let epoch_invoked = self.state.epoch(node);
            let invoke = self.state.now();
            let outcome = execute(&self.api, &base, &self.topic, &request).await;
            let complete = self.state.now();
            let epoch_completed = self.state.epoch(node);
            self.learn(node, epoch_invoked, &request, &outcome);
            self.ops.push(Op {
                id: 0,
                client: self.id,
                node,
                node_epoch: (epoch_invoked, epoch_completed),
                invoke,
                complete,
                request,
                outcome,
            });
        }
        self.ops
    }

    fn key(&mut self) -> String {
        format!("k{:02}", self.rng.random_range(0..self.config.register_keys))
    }

    fn next_request(&mut self, seq: u64, node: u64) -> Request {
        let roll = self.rng.random_range(0..100);
        match roll {
            0..28 => Request::Put { key: self.key(), value: format!("v{}.{seq}", self.id), forward: true },
            28..32 => Request::Put { key: self.key(), value: format!("v{}.{seq}", self.id), forward: false },
            32..36 => Request::Delete { key: self.key() },
            36..50 => {
                let count = self.rng.random_range(1..=5);
                let records = (0..count)
                    .map(|i| (format!("p{}.{seq}.{i}", self.id), format!("v{}.{seq}.{i}", self.id)))
                    .collect();
                Request::Produce { partition: self.rng.random_range(0..self.partitions), records }
            }
            50..66 => Request::Get { key: self.key(), mode: ReadKind::Linearizable, min_offset: None, partition: None },
            66..70 => Request::Get { key: self.key(), mode: ReadKind::Strict, min_offset: None, partition: None },
            70..80 => Request::Get { key: self.key(), mode: ReadKind::Follower, min_offset: None, partition: None },
            80..90 if !self.own_writes.is_empty() => {
                let keys: Vec<&String> = self.own_writes.keys().collect();
                let key = keys[self.rng.random_range(0..keys.len())].clone();
                let min_offset = self.own_writes.get(&key).copied();
                Request::Get { key, mode: ReadKind::Follower, min_offset, partition: None }
            }
            80..90 => Request::Get { key: self.key(), mode: ReadKind::Follower, min_offset: None, partition: None },
            _ => {
                let partition = self.rng.random_range(0..self.partitions);
                let epoch = self.state.epoch(node);
                let offset = match self.cursors.get(&(node, partition)) {
                    Some((e, offset)) if *e == epoch => *offset,
                    _ => 0,
                };
                Request::Fetch { partition, offset, max_records: self.config.fetch_records }
            }
        }
    }

    /// Updates the client's own view after an answer.
    fn learn(&mut self, node: u64, epoch: u64, request: &Request, outcome: &Outcome) {
        match outcome {
            // Back off a node that keeps leaving operations unanswered: 5, 10, 20 s.
            Outcome::Indeterminate { .. } => {
                let strikes = self.strikes.entry(node).or_default();
                *strikes = (*strikes + 1).min(3);
                self.suspects.insert(node, Instant::now() + SUSPECT_FOR * (1 << (*strikes - 1)));
            }
            Outcome::Definite { .. } => {}
            _ => {
                self.strikes.remove(&node);
            }
        }
        if outcome.is_ok() {
            let counter = if matches!(outcome, Outcome::Written { .. }) {
                &self.state.acked_writes
            } else {
                &self.state.ok_reads
            };
            counter.fetch_add(1, Ordering::Relaxed);
        }
        match (request, outcome) {
            (Request::Put { key, .. } | Request::Delete { key }, Outcome::Written { offsets, .. }) => {
                self.own_writes.insert(key.clone(), offsets[0]);
            }
            (Request::Fetch { partition, .. }, Outcome::Fetched { next_offset, .. }) => {
                self.cursors.insert((node, *partition), (epoch, *next_offset));
            }
            _ => {}
        }
    }
}
