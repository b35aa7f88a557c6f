//! A chaos run: start a proxied cluster, create a topic, run the workload while the nemesis
//! applies one scenario's faults, heal, let the cluster converge, and check the history.
//!
//! A run prints its seed (`LOGDEX_CHAOS_SEED` replays it) and, when it fails, keeps the
//! cluster's temp dir (node logs and data dirs) with `chaos/` inside it: the history
//! (`history.jsonl`), the fault events (`events.jsonl`), the final logs and the checkers'
//! explanation (`report.txt`). The path is printed.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::io::Write as _;
use std::time::Duration;
use std::time::Instant;

use rand::Rng as _;
use rand::SeedableRng as _;
use rand::rngs::StdRng;
use serde_json::json;

use crate::chaos::checker;
use crate::chaos::checker::FinalLogs;
use crate::chaos::checker::Findings;
use crate::chaos::converge;
use crate::chaos::nemesis::Event;
use crate::chaos::nemesis::EventKind;
use crate::chaos::nemesis::Nemesis;
use crate::chaos::nemesis::Victim;
use crate::chaos::op::OP_TIMEOUT;
use crate::chaos::op::Op;
use crate::chaos::op::Outcome;
use crate::chaos::op::Request;
use crate::chaos::wgl;
use crate::chaos::workload::RunState;
use crate::chaos::workload::Workload;
use crate::chaos::workload::WorkloadConfig;
use crate::client::Api;
use crate::client::TopicSpec;
use crate::cluster::Cluster;
use crate::cluster::ClusterOptions;
use crate::error::Error;
use crate::error::Result;
use crate::proxy::Fault;
use crate::support::settled;

/// The environment variable that replays a chaos run.
pub const SEED_ENV: &str = "LOGDEX_CHAOS_SEED";
const TOPIC: &str = "chaos";
const SETTLE_TIMEOUT: Duration = Duration::from_secs(30);
/// How often the nodes of a tiered run copy and delete segments.
const TIERED_CLEANER_INTERVAL_MS: u64 = 300;

/// Which faults a run applies.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Faults {
    None,
    /// kill -9 one node every few seconds (the leader of a partition half the time).
    KillOne,
    /// kill -9 every node at once, three times.
    KillAll,
    /// Power loss of every node three times: cut to the last fsync, then with torn pages,
    /// then also deleting one node's index so it rebuilds from the log.
    PowerLoss,
    /// SIGSTOP the busiest leader for three election timeouts, twice.
    PauseLeader,
    /// Cut the busiest leader off from its peers (reset, then blackhole) while clients
    /// still reach it, twice.
    IsolateLeader,
    /// Random per-link delay, 50% loss, one-way blackholes and cuts.
    Flaky,
    /// Cut a follower until the leader purged its log, heal, catch up by snapshot, kill the leader.
    SnapshotCatchup,
    /// A fourth node joins; two partition moves onto it, one killing the leader mid-move and
    /// one killing the new node mid-move.
    PartitionMove,
    /// kill -9 one node, flip a bit inside a record of one of its sealed segments and cut its
    /// active segment short, restart it; twice, on two different nodes (the first cut above the
    /// replica's last checkpoint, the second anywhere).
    Corruption,
    /// Everything above mixed at random for the whole fault window, on 5 nodes.
    Mixed,
}

/// Minimum activity a run must show (C5: a run that did nothing fails).
#[derive(Clone, Debug)]
pub struct Coverage {
    pub faults_min: usize,
    pub writes_before: u64,
    pub writes_during: u64,
    pub writes_after: u64,
    pub linearizable_reads: u64,
    pub follower_reads: u64,
    pub fetches: u64,
}

/// One chaos run's configuration.
#[derive(Clone, Debug)]
pub struct Scenario {
    pub name: String,
    pub faults: Faults,
    pub nodes: usize,
    pub spare_nodes: usize,
    pub partitions: u32,
    pub replication_factor: u32,
    pub heartbeat_ms: u64,
    pub election_timeout_ms: u64,
    pub snapshot_every: Option<u64>,
    /// The chaos topic's `segment.bytes` (small segments give sealed ones to damage).
    pub segment_bytes: Option<u64>,
    /// Tiered storage: the nodes share an object store and the chaos topic copies its sealed
    /// segments there with `local.retention.ms=0`, so most reads come from remote segments.
    pub tiered: bool,
    /// Workload before the first fault, time the faults run (for looping scenarios), and
    /// workload after the last heal.
    pub warmup: Duration,
    pub fault_window: Duration,
    pub cooldown: Duration,
    pub workload: WorkloadConfig,
    pub coverage: Coverage,
}

impl Scenario {
    /// The CI configuration of a scenario: 3 nodes (plus a spare for moves), 4 partitions of
    /// 3 replicas, 8 clients, each run bounded to about a minute.
    pub fn ci(name: &str, faults: Faults) -> Scenario {
        let (fault_window, snapshot_every, spare_nodes) = match faults {
            Faults::None => (Duration::from_secs(20), None, 0),
            Faults::KillOne => (Duration::from_secs(36), None, 0),
            Faults::Flaky => (Duration::from_secs(32), None, 0),
            Faults::SnapshotCatchup => (Duration::ZERO, Some(50), 0),
            Faults::PartitionMove => (Duration::ZERO, None, 1),
            Faults::Mixed => (Duration::from_secs(60), Some(200), 0),
            _ => (Duration::ZERO, None, 0),
        };
        Scenario {
            name: name.to_string(),
            faults,
            nodes: if faults == Faults::Mixed { 5 } else { 3 },
            spare_nodes,
            partitions: 4,
            replication_factor: 3,
            heartbeat_ms: 200,
            election_timeout_ms: 1000,
            snapshot_every,
            segment_bytes: (faults == Faults::Corruption).then_some(4096),
            tiered: false,
            warmup: Duration::from_secs(5),
            fault_window,
            // Flaky links: a connection that lost bytes to a blackhole is replaced after 10 s
            // of silence (ARCHITECTURE.md, "Call streams"), so writes and reads on it may
            // stall for that long after the heal.
            cooldown: Duration::from_secs(if faults == Faults::Flaky { 12 } else { 6 }),
            workload: WorkloadConfig::default(),
            coverage: Coverage {
                faults_min: usize::from(faults != Faults::None),
                writes_before: 30,
                writes_during: if faults == Faults::None { 0 } else { 20 },
                writes_after: 30,
                linearizable_reads: 50,
                follower_reads: 30,
                fetches: 20,
            },
        }
    }

    /// [`Scenario::ci`] with tiered storage on: 2 KiB segments copied to the shared store and
    /// deleted locally as soon as they are copied.
    pub fn ci_tiered(name: &str, faults: Faults) -> Scenario {
        let mut s = Scenario::ci(name, faults);
        s.tiered = true;
        s.segment_bytes = Some(2048);
        s
    }

    /// The soak configuration: every fault mixed on 5 nodes for `minutes`.
    pub fn soak(minutes: u64) -> Scenario {
        let mut s = Scenario::ci("soak", Faults::Mixed);
        s.fault_window = Duration::from_secs(minutes * 60);
        s.cooldown = Duration::from_secs(10);
        s
    }

    fn cluster_options(&self, seed: u64) -> ClusterOptions {
        ClusterOptions {
            nodes: self.nodes,
            spare_nodes: self.spare_nodes,
            proxy: true,
            heartbeat_ms: Some(self.heartbeat_ms),
            election_timeout_ms: Some(self.election_timeout_ms),
            snapshot_every: self.snapshot_every,
            fsync_trace: matches!(self.faults, Faults::PowerLoss | Faults::Mixed),
            seed,
            tiered_store: self.tiered,
            cleaner_interval_ms: self.tiered.then_some(TIERED_CLEANER_INTERVAL_MS),
            ..ClusterOptions::default()
        }
    }
}

/// The seed of a chaos run: `LOGDEX_CHAOS_SEED` if set, else a fresh one; printed.
pub fn chaos_seed(name: &str) -> Result<u64> {
    let seed = crate::support::seed_from_env(SEED_ENV)?;
    eprintln!("[chaos {name}] seed {seed} (replay with {SEED_ENV}={seed})");
    Ok(seed)
}

/// Runs `scenario` with the seed from the environment (or a fresh one).
pub async fn run(scenario: Scenario) -> Result<()> {
    let seed = chaos_seed(&scenario.name)?;
    run_seeded(scenario, seed).await
}

/// Runs `scenario` with `seed`: `Ok` only when every checker passed.
pub async fn run_seeded(scenario: Scenario, seed: u64) -> Result<()> {
    let started = Instant::now();
    let mut rng = StdRng::seed_from_u64(seed);
    let mut cluster = Cluster::start_with(scenario.cluster_options(rng.random())).await?;
    let outcome = run_on(&mut cluster, &scenario, seed, &mut rng).await;
    let elapsed = started.elapsed();
    match &outcome {
        Ok(()) => eprintln!("[chaos {}] PASSED in {:.1}s (seed {seed})", scenario.name, elapsed.as_secs_f64()),
        Err(e) => eprintln!(
            "[chaos {}] FAILED in {:.1}s (seed {seed}, replay with {SEED_ENV}={seed}): {e}\n[chaos {}] history, events, final logs, report, node logs and data dirs kept in {}",
            scenario.name,
            elapsed.as_secs_f64(),
            scenario.name,
            cluster.dir().display()
        ),
    }
    cluster.finish(outcome)
}

async fn run_on(cluster: &mut Cluster, s: &Scenario, seed: u64, rng: &mut StdRng) -> Result<()> {
    let spec = {
        let mut spec = TopicSpec::compacted(TOPIC, s.partitions, s.replication_factor);
        // `delete` with the default retention keeps every record, so C1 sees each one.
        spec.config.insert("cleanup.policy".into(), json!("delete"));
        if let Some(bytes) = s.segment_bytes {
            spec.config.insert("segment.bytes".into(), json!(bytes.to_string()));
        }
        if s.tiered {
            spec.config.insert("remote.storage.enable".into(), json!("true"));
            spec.config.insert("local.retention.ms".into(), json!("0"));
        }
        spec
    };
    let base = cluster.url(1);
    settled("create the chaos topic", SETTLE_TIMEOUT, || cluster.api().create_topic(&base, &spec))
        .await?
        .expect_status(201)?;
    cluster.wait_for_leaders(TOPIC, SETTLE_TIMEOUT).await?;
    let nodes: Vec<(u64, String)> = cluster.node_ids().into_iter().map(|id| (id, cluster.url(id))).collect();
    let state = RunState::new(nodes, cluster.all_node_ids().len());
    let mut workload_rng = StdRng::seed_from_u64(rng.random());
    let workload = Workload::start(
        Api::with_timeout(OP_TIMEOUT)?,
        TOPIC,
        s.partitions,
        &s.workload,
        state.clone(),
        &mut workload_rng,
    );
    let mut nemesis = Nemesis {
        cluster,
        state: state.clone(),
        rng: StdRng::seed_from_u64(rng.random()),
        topic: TOPIC.to_string(),
        partitions: s.partitions,
        election_timeout_max: Duration::from_millis(2 * s.election_timeout_ms),
        snapshot_every: s.snapshot_every,
        events: Vec::new(),
        damages: Vec::new(),
    };
    let faulted = apply_faults(&mut nemesis, s, &workload).await;
    let healed = heal_everything(&mut nemesis).await;
    if faulted.is_ok() && healed.is_ok() {
        let _ = nemesis.hold(s.cooldown).await;
    }
    let events = std::mem::take(&mut nemesis.events);
    let damages = std::mem::take(&mut nemesis.damages);
    drop(nemesis);
    let ops = workload.stop().await;
    let artifacts = Artifacts { dir: cluster.dir().join("chaos"), seed, scenario: s.name.clone() };
    if let Err(e) = faulted.and(healed) {
        artifacts.save(&ops, &events, None, &format!("the run stopped early: {e}\n"));
        return Err(e);
    }
    let mut check_rng = StdRng::seed_from_u64(rng.random());
    let converged = match converge::converge(cluster, TOPIC, s.partitions, &damages, &mut check_rng).await {
        Ok(c) => c,
        Err(e) => {
            artifacts.save(&ops, &events, None, &format!("the cluster did not converge: {e}\n"));
            return Err(e);
        }
    };
    let wgl = wgl::cross_check(&ops, &wgl::Limits::CI);
    let findings = vec![
        checker::check_log(&ops, &converged.logs),
        checker::check_key_reads(&ops, &converged.logs),
        wgl.findings,
        checker::check_sessions(&ops, &converged.logs),
        converged.findings,
        check_coverage(&ops, &events, &s.coverage),
        check_tiered(cluster, s).await,
    ];
    let report = report(s, seed, &ops, &events, &converged.logs, &findings) + &wgl.summary + "\n";
    let report = report + &converged.notes.iter().map(|n| format!("damage: {n}\n")).collect::<String>();
    eprintln!("{report}");
    if findings.iter().all(Findings::is_ok) {
        if std::env::var_os(crate::cluster::KEEP_ENV).is_some() {
            artifacts.save(&ops, &events, Some(&converged.logs), &report);
        }
        return Ok(());
    }
    artifacts.save(&ops, &events, Some(&converged.logs), &report);
    let failed: Vec<String> =
        findings.iter().filter(|f| !f.is_ok()).map(|f| format!("{} ({} violations)", f.checker, f.count)).collect();
    Err(Error::Check(format!("CHECKER FAILED: {}; see the report above", failed.join(", "))))
}

/// C5 for a tiered run: the run read through remote segments only if the nodes hold some, so
/// every node must report remote segments in `/metrics`.
async fn check_tiered(cluster: &Cluster, s: &Scenario) -> Findings {
    let mut f = Findings::new("C5 tiered coverage");
    if !s.tiered {
        return f;
    }
    for id in cluster.running_ids() {
        let metrics = match cluster.api().get_url(&format!("{}/metrics", cluster.url(id))).await {
            Ok(reply) => reply.text(),
            Err(e) => {
                f.add(format!("node {id}: /metrics failed: {e}"));
                continue;
            }
        };
        let remote: u64 = metrics
            .lines()
            .filter(|l| l.starts_with("logdex_partition_remote_segments{"))
            .filter_map(|l| l.rsplit(' ').next().and_then(|v| v.parse::<u64>().ok()))
            .sum();
        if remote == 0 {
            f.add(format!("node {id} holds no remote segments: tiered storage was not exercised"));
        }
    }
    f
}

/// Heals every fault the run may have left: links, paused and stopped nodes.
async fn heal_everything(nemesis: &mut Nemesis<'_>) -> Result<()> {
    if let Some(proxy) = nemesis.cluster.proxy() {
        proxy.heal();
    }
    nemesis.cluster.resume_all()?;
    let stopped: Vec<u64> =
        nemesis.cluster.node_ids().into_iter().filter(|id| !nemesis.cluster.running_ids().contains(id)).collect();
    for id in stopped {
        nemesis.restart(id).await?;
    }
    Ok(())
}

async fn apply_faults(n: &mut Nemesis<'_>, s: &Scenario, workload: &Workload) -> Result<()> {
    n.hold(s.warmup).await?;
    if workload.acked_writes() == 0 {
        return Err(Error::Check(format!("no write was acknowledged in the {:?} warmup", s.warmup)));
    }
    let window_end = Instant::now() + s.fault_window;
    let election = n.election_timeout_max;
    match s.faults {
        Faults::None => n.hold(s.fault_window).await?,
        Faults::KillOne => {
            while Instant::now() < window_end {
                let down = Duration::from_millis(n.rng.random_range(2000..=4000));
                n.kill_one(down).await?;
                let calm = Duration::from_millis(n.rng.random_range(2000..=4000));
                n.hold(calm).await?;
            }
        }
        Faults::Corruption => {
            // First a cut above the replica's last checkpoint (it rolls back to it, re-applies
            // the cut tail and keeps the flipped batch: it must refuse it), then one anywhere
            // (deeper, it may re-apply everything and so heal the flip too).
            let mut victims = Vec::new();
            for above_checkpoint in [true, false] {
                let down = Duration::from_millis(n.rng.random_range(2000..=4000));
                n.flip_and_cut_one(down, &victims, above_checkpoint).await?;
                victims.extend(n.damages.last().map(|d| d.node));
                let calm = Duration::from_millis(n.rng.random_range(3000..=5000));
                n.hold(calm).await?;
            }
        }
        Faults::KillAll => {
            for _ in 0..3 {
                n.kill_all().await?;
                let calm = Duration::from_millis(n.rng.random_range(5000..=8000));
                n.hold(calm).await?;
            }
        }
        Faults::PowerLoss => {
            let wipe = n.rng.random_range(1..=s.nodes as u64);
            for round in 0..3 {
                n.power_loss(&[], round > 0, (round == 2).then_some(wipe), true).await?;
                let calm = Duration::from_millis(n.rng.random_range(6000..=9000));
                n.hold(calm).await?;
            }
        }
        Faults::PauseLeader => {
            for _ in 0..2 {
                let leader = n.busiest_leader().await;
                n.pause(leader, election * 3).await?;
                n.hold(Duration::from_secs(5)).await?;
            }
        }
        Faults::IsolateLeader => {
            for fault in [Fault::Cut, Fault::Blackhole] {
                let leader = n.busiest_leader().await;
                n.isolate(leader, fault, Duration::from_secs(8)).await?;
                n.hold(Duration::from_secs(5)).await?;
            }
        }
        Faults::Flaky => n.flaky(s.fault_window).await?,
        Faults::SnapshotCatchup => n.snapshot_catchup().await?,
        Faults::PartitionMove => partition_moves(n, workload).await?,
        Faults::Mixed => mixed(n, s, window_end).await?,
    }
    Ok(())
}

/// A spare node joins, then two partitions move onto it: the first kills the partition's
/// leader mid-move, the second kills the joining node mid-move.
async fn partition_moves(n: &mut Nemesis<'_>, _workload: &Workload) -> Result<()> {
    let spare = *n.cluster.all_node_ids().last().ok_or_else(|| Error::Check("no spare node".into()))?;
    n.cluster.start_spare(spare).await?;
    n.state.bump_epoch(spare);
    n.state.add_node(spare, n.cluster.url(spare));
    n.events.push(Event {
        at: n.state.now(),
        kind: EventKind::Info,
        what: format!("node {spare} joined"),
        evidence: None,
    });
    eprintln!("[chaos] node {spare} joined");
    n.hold(Duration::from_secs(2)).await?;
    let mut partitions: Vec<u32> = (0..n.partitions).collect();
    for victim in [Victim::Leader, Victim::Node(spare)] {
        let p = partitions.remove(n.rng.random_range(0..partitions.len()));
        let layout = n.layout(&[]).await;
        let (leader, replicas, _) =
            layout.get(&p).cloned().ok_or_else(|| Error::Check(format!("partition {p} not described")))?;
        // Replace the leader half the time, else another replica.
        let replaced = if n.rng.random_bool(0.5) {
            leader.unwrap_or(replicas[0])
        } else {
            replicas[n.rng.random_range(0..replicas.len())]
        };
        let target: Vec<u64> = replicas.iter().map(|r| if *r == replaced { spare } else { *r }).collect();
        // The kill usually lands mid-move (within 20 ms of the request), but a
        // move can finish first on an idle machine; the kill and the move's
        // completion are still required evidence, and the log says which.
        n.move_with_kill(p, target, victim, false).await?;
        n.hold(Duration::from_secs(3)).await?;
    }
    Ok(())
}

/// Random faults for the whole window: kills (one, a minority, all), power loss (all, or one
/// node while a minority is paused: the pattern that lost data in NATS), pauses, isolation,
/// flaky links, and partition moves between nodes.
async fn mixed(n: &mut Nemesis<'_>, s: &Scenario, window_end: Instant) -> Result<()> {
    let election = n.election_timeout_max;
    let nodes: Vec<u64> = n.cluster.node_ids();
    for _ in 0..10_000 {
        if Instant::now() >= window_end {
            break;
        }
        match n.rng.random_range(0..100) {
            0..15 => {
                let down = Duration::from_millis(n.rng.random_range(2000..=5000));
                n.kill_one(down).await?;
            }
            15..22 => {
                let victims: Vec<u64> = pick(&mut n.rng, &nodes, (s.nodes - 1) / 2);
                for v in &victims {
                    n.kill(*v, "part of a minority")?;
                }
                let down = Duration::from_millis(n.rng.random_range(2000..=5000));
                n.hold(down).await?;
                for v in victims {
                    n.restart(v).await?;
                }
            }
            22..28 => n.kill_all().await?,
            28..36 => {
                let tear = n.rng.random_bool(0.7);
                let wipe = n.rng.random_bool(0.2).then(|| nodes[n.rng.random_range(0..nodes.len())]);
                n.power_loss(&[], tear, wipe, false).await?;
            }
            36..44 => {
                // Pause a minority minus one, power-fail another node, continue the paused.
                let group = pick(&mut n.rng, &nodes, (s.nodes - 1) / 2);
                let (paused, failed) = group.split_at(group.len() - 1);
                for p in paused {
                    n.cluster.pause(*p)?;
                }
                n.events.push(Event {
                    at: n.state.now(),
                    kind: EventKind::Fault,
                    what: format!("SIGSTOP nodes {paused:?}"),
                    evidence: None,
                });
                n.hold(Duration::from_secs(2)).await?;
                n.power_loss(failed, true, None, false).await?;
                n.hold(Duration::from_secs(2)).await?;
                n.cluster.resume_all()?;
                n.events.push(Event {
                    at: n.state.now(),
                    kind: EventKind::Heal,
                    what: format!("SIGCONT nodes {paused:?}"),
                    evidence: None,
                });
            }
            44..56 => {
                let leader = n.busiest_leader().await;
                n.pause(leader, election * 3).await?;
            }
            56..68 => {
                let leader = n.busiest_leader().await;
                let fault = if n.rng.random_bool(0.5) { Fault::Cut } else { Fault::Blackhole };
                // At least two maximal election timeouts: under a loaded machine the new leader
                // (C5's evidence) took more than 4 s once (soak seed 3031).
                let duration = Duration::from_millis(n.rng.random_range(6000..=10000));
                n.isolate(leader, fault, duration).await?;
            }
            68..82 => {
                let duration = Duration::from_millis(n.rng.random_range(8000..=16000));
                n.flaky(duration).await?;
            }
            _ => {
                let p = n.rng.random_range(0..n.partitions);
                let layout = n.layout(&[]).await;
                if let Some((_, replicas, false)) = layout.get(&p).cloned() {
                    let outside: Vec<u64> = nodes.iter().copied().filter(|x| !replicas.contains(x)).collect();
                    if let Some(&incoming) = outside.get(n.rng.random_range(0..outside.len().max(1))) {
                        let replaced = replicas[n.rng.random_range(0..replicas.len())];
                        let target: Vec<u64> =
                            replicas.iter().map(|r| if *r == replaced { incoming } else { *r }).collect();
                        let victim = if n.rng.random_bool(0.5) { Victim::Leader } else { Victim::Node(incoming) };
                        n.move_with_kill(p, target, victim, false).await?;
                    }
                }
            }
        }
        let calm = Duration::from_millis(n.rng.random_range(3000..=7000));
        n.hold(calm).await?;
    }
    Ok(())
}

fn pick(rng: &mut StdRng, nodes: &[u64], count: usize) -> Vec<u64> {
    use rand::seq::IndexedRandom as _;
    nodes.choose_multiple(rng, count.max(1)).copied().collect()
}

/// C5: the faults happened (each with evidence) and enough operations succeeded before,
/// during and after them.
pub fn check_coverage(ops: &[Op], events: &[Event], want: &Coverage) -> Findings {
    let mut f = Findings::new("C5 coverage");
    let faults: Vec<&Event> = events.iter().filter(|e| e.kind == EventKind::Fault).collect();
    if faults.len() < want.faults_min {
        f.add(format!("{} faults happened, at least {} expected", faults.len(), want.faults_min));
    }
    for e in &faults {
        if let Some(evidence) = &e.evidence
            && !evidence.ok
        {
            f.add(format!("no evidence that the fault happened: {} ({})", e.what, evidence.detail));
        }
    }
    let start = faults.first().map_or(u64::MAX, |e| e.at);
    let end = events.iter().filter(|e| e.kind == EventKind::Heal).map(|e| e.at).max().unwrap_or(start).max(start);
    let mut writes = [0u64; 3];
    let (mut linearizable, mut follower, mut fetches) = (0, 0, 0);
    for op in ops.iter().filter(|o| o.outcome.is_ok()) {
        if matches!(op.outcome, Outcome::Written { .. }) {
            let phase = if op.invoke < start {
                0
            } else if op.invoke < end {
                1
            } else {
                2
            };
            writes[phase] += 1;
        }
        match &op.request {
            Request::Get { mode, .. } if mode.is_linearizable() => linearizable += 1,
            Request::Get { .. } => follower += 1,
            Request::Fetch { .. } => fetches += 1,
            _ => {}
        }
    }
    let mut need = |what: &str, have: u64, min: u64| {
        if have < min {
            f.add(format!("only {have} {what}, at least {min} expected"));
        }
    };
    if want.faults_min == 0 {
        need("acknowledged writes", writes.iter().sum(), want.writes_before + want.writes_after);
    } else {
        need("acknowledged writes before the first fault", writes[0], want.writes_before);
        need("acknowledged writes while faults were on", writes[1], want.writes_during);
        need("acknowledged writes after the last heal", writes[2], want.writes_after);
    }
    need("successful linearizable/strict lookups", linearizable, want.linearizable_reads);
    need("successful follower lookups", follower, want.follower_reads);
    need("successful fetches", fetches, want.fetches);
    f
}

/// The run's summary: operations by kind and outcome, faults, checker verdicts.
fn report(s: &Scenario, seed: u64, ops: &[Op], events: &[Event], logs: &FinalLogs, findings: &[Findings]) -> String {
    let mut counts: BTreeMap<(&str, &str), u64> = BTreeMap::new();
    for op in ops {
        let kind = match &op.request {
            Request::Put { forward: false, .. } => "put(forward=false)",
            Request::Put { .. } => "put",
            Request::Delete { .. } => "delete",
            Request::Produce { .. } => "produce",
            Request::Get { mode, min_offset: Some(_), .. } if !mode.is_linearizable() => "get(follower,min_offset)",
            Request::Get { mode, .. } if mode.is_linearizable() => "get(linearizable|strict)",
            Request::Get { .. } => "get(follower)",
            Request::Fetch { .. } => "fetch(follower)",
        };
        let outcome = match &op.outcome {
            Outcome::Definite { .. } => "definite failure",
            Outcome::Indeterminate { .. } => "indeterminate",
            _ => "ok",
        };
        *counts.entry((kind, outcome)).or_default() += 1;
    }
    let mut out = String::new();
    let records: usize = logs.values().map(Vec::len).sum();
    let _ = writeln!(out, "===== chaos report: scenario {} ({:?}), seed {seed}, {} nodes", s.name, s.faults, s.nodes);
    let _ = writeln!(out, "operations: {} in total; final logs hold {records} records", ops.len());
    for ((kind, outcome), n) in &counts {
        let _ = writeln!(out, "  {kind:26} {outcome:17} {n}");
    }
    let start = events.iter().find(|e| e.kind == EventKind::Fault).map_or(u64::MAX, |e| e.at);
    let end = events.iter().filter(|e| e.kind == EventKind::Heal).map(|e| e.at).max().unwrap_or(start).max(start);
    let last = ops.iter().map(|o| o.complete).max().unwrap_or(0);
    let mut phases = [(0u64, 0u64); 3];
    for op in ops.iter().filter(|o| matches!(o.outcome, Outcome::Written { .. })) {
        let phase = if op.invoke < start {
            0
        } else if op.invoke < end {
            1
        } else {
            2
        };
        phases[phase].0 += 1;
    }
    let spans = [start.min(last), end.min(last).saturating_sub(start.min(last)), last.saturating_sub(end.min(last))];
    for (i, name) in ["before the faults", "during the faults", "after the last heal"].iter().enumerate() {
        phases[i].1 = spans[i];
        let seconds = spans[i] as f64 / 1e9;
        let rate = if seconds > 0.0 { phases[i].0 as f64 / seconds } else { 0.0 };
        let _ = writeln!(out, "acknowledged writes {name}: {} in {seconds:.1}s ({rate:.1}/s)", phases[i].0);
    }
    let _ = writeln!(out, "faults: {} events", events.len());
    for e in events.iter().filter(|e| e.kind == EventKind::Fault) {
        let _ = writeln!(out, "  {:7.2}s {}", e.at as f64 / 1e9, e.what);
    }
    for f in findings {
        let _ = writeln!(out, "{f}");
    }
    out
}

struct Artifacts {
    dir: std::path::PathBuf,
    seed: u64,
    scenario: String,
}

impl Artifacts {
    /// Writes the history, events, final logs and report; failures to write are printed only.
    fn save(&self, ops: &[Op], events: &[Event], logs: Option<&FinalLogs>, report: &str) {
        let result = (|| -> std::io::Result<()> {
            std::fs::create_dir_all(&self.dir)?;
            let mut history = std::io::BufWriter::new(std::fs::File::create(self.dir.join("history.jsonl"))?);
            for op in ops {
                serde_json::to_writer(&mut history, op)?;
                history.write_all(b"\n")?;
            }
            history.flush()?;
            let mut file = std::io::BufWriter::new(std::fs::File::create(self.dir.join("events.jsonl"))?);
            for e in events {
                serde_json::to_writer(&mut file, e)?;
                file.write_all(b"\n")?;
            }
            file.flush()?;
            if let Some(logs) = logs {
                std::fs::write(self.dir.join("final-logs.json"), serde_json::to_vec_pretty(logs)?)?;
            }
            let header = format!("scenario {}, seed {} (replay: {SEED_ENV}={})\n", self.scenario, self.seed, self.seed);
            std::fs::write(self.dir.join("report.txt"), header + report)?;
            Ok(())
        })();
        match result {
            Ok(()) => eprintln!("[chaos {}] history and checker report saved in {}", self.scenario, self.dir.display()),
            Err(e) => eprintln!("[chaos {}] could not save the history in {}: {e}", self.scenario, self.dir.display()),
        }
    }
}

#[cfg(test)]
mod tests {
    //! C5's self-test: a run without its fault, a fault without evidence, or too little work
    //! fails.

    use super::*;
    use crate::chaos::nemesis::Evidence;
    use crate::chaos::op::ReadKind;

    fn ops(writes_per_phase: [u64; 3], at: [u64; 3]) -> Vec<Op> {
        let mut ops = Vec::new();
        for (phase, count) in writes_per_phase.iter().enumerate() {
            for i in 0..*count {
                let request = Request::Put { key: "k".into(), value: format!("v{phase}.{i}"), forward: true };
                let outcome = Outcome::Written { partition: 0, offsets: vec![ops.len() as u64] };
                ops.push(Op {
                    id: ops.len(),
                    client: 0,
                    node: 1,
                    node_epoch: (1, 1),
                    invoke: at[phase] + i,
                    complete: at[phase] + i + 1,
                    request,
                    outcome,
                });
            }
        }
        for (kind, count) in [(Some(ReadKind::Linearizable), 50), (Some(ReadKind::Follower), 30), (None, 20)] {
            for _ in 0..count {
                let (request, outcome) = match kind {
                    Some(mode) => (
                        Request::Get { key: "k".into(), mode, min_offset: None, partition: None },
                        Outcome::NotFound { partition: 0, high_watermark: 0, node: 1 },
                    ),
                    None => (
                        Request::Fetch { partition: 0, offset: 0, max_records: 1 },
                        Outcome::Fetched { records: Vec::new(), next_offset: 0, high_watermark: 0, node: 1 },
                    ),
                };
                ops.push(Op {
                    id: ops.len(),
                    client: 1,
                    node: 1,
                    node_epoch: (1, 1),
                    invoke: 1,
                    complete: 2,
                    request,
                    outcome,
                });
            }
        }
        ops
    }

    fn event(at: u64, kind: EventKind, ok: Option<bool>) -> Event {
        Event { at, kind, what: "fault".into(), evidence: ok.map(|ok| Evidence { ok, detail: String::new() }) }
    }

    #[test]
    fn coverage_checker_fails_runs_that_did_not_exercise_the_fault() {
        let want = Scenario::ci("test", Faults::KillOne).coverage;
        let good_ops = ops([40, 40, 40], [0, 1_000, 2_000]);
        let good_events = vec![event(1_000, EventKind::Fault, Some(true)), event(1_900, EventKind::Heal, None)];
        let f = check_coverage(&good_ops, &good_events, &want);
        assert!(f.is_ok(), "{f}");

        assert!(!check_coverage(&good_ops, &[], &want).is_ok(), "no fault happened");
        let unproven = vec![event(1_000, EventKind::Fault, Some(false)), event(1_900, EventKind::Heal, None)];
        assert!(!check_coverage(&good_ops, &unproven, &want).is_ok(), "a fault without evidence");
        let idle = ops([40, 0, 40], [0, 1_000, 2_000]);
        assert!(!check_coverage(&idle, &good_events, &want).is_ok(), "no write while the fault was on");
    }
}
