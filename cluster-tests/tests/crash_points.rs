//! Crash points (issue 7): a node of a `failpoints` build (`cargo build -p logdex-api
//! --features failpoints`) is armed through `FAILPOINTS` and aborts at one precise point of its
//! durable path while clients keep writing: before and after the Raft log fsync (as the leader
//! and as a follower of the written partition), between the segment append and the index
//! write, in the middle of a snapshot install, and while applying a membership change. Each
//! test checks that the node really died there (SIGABRT, the point named in its log), restarts
//! it without the crash point, and checks that nothing acknowledged was lost (DESIGN.md I2) and
//! that the replicas agree (I3): equal records below the final high watermark, and every key
//! answered alike by every replica's own state. The crash points are listed in
//! `cluster-tests/README.md`.

use std::os::unix::process::ExitStatusExt as _;
use std::sync::Arc;
use std::sync::Mutex;
use std::sync::PoisonError;
use std::sync::atomic::AtomicBool;
use std::sync::atomic::AtomicU64;
use std::sync::atomic::Ordering;
use std::time::Duration;
use std::time::Instant;

use logdex_cluster_tests::Api;
use logdex_cluster_tests::Cluster;
use logdex_cluster_tests::ClusterOptions;
use logdex_cluster_tests::Error;
use logdex_cluster_tests::Read;
use logdex_cluster_tests::Result;
use logdex_cluster_tests::TopicDescription;
use logdex_cluster_tests::TopicSpec;
use logdex_cluster_tests::client::FetchResponse;
use logdex_cluster_tests::client::HEADER_NODE;
use logdex_cluster_tests::client::HEADER_OFFSET;
use logdex_cluster_tests::client::written;
use logdex_cluster_tests::cluster::FAILPOINTS_ENV;
use logdex_cluster_tests::cluster::SIGABRT;
use logdex_cluster_tests::ensure;
use logdex_cluster_tests::ensure_eq;
use logdex_cluster_tests::history::History;
use logdex_cluster_tests::history::PartitionLog;
use logdex_cluster_tests::history::collect_fetched;
use logdex_cluster_tests::history::show;
use logdex_cluster_tests::murmur2::kafka_partition;
use logdex_cluster_tests::support::Failures;
use logdex_cluster_tests::support::Probe;
use logdex_cluster_tests::support::poll_until;
use logdex_cluster_tests::support::settled;
use logdex_cluster_tests::support::test_rng;
use rand::Rng as _;
use rand::SeedableRng as _;
use rand::rngs::StdRng;
use serde_json::Value;
use serde_json::json;
use tokio::task::JoinHandle;

const NODES: usize = 3;
/// Partitions of the written topic: on 3 nodes, each node is the preferred leader of one.
const PARTITIONS: u32 = 3;
/// The node armed with a crash point (any node; the scenario picks the partition to write).
const VICTIM: u64 = 2;
/// Fsyncs (any group's) an armed node does before its crash: enough for it to start, take part
/// in creating the topic and acknowledge writes first.
const FSYNCS_BEFORE_CRASH: u32 = 60;
/// Applied produce chunks (any partition's) before the crash.
const APPLIES_BEFORE_CRASH: u32 = 25;
/// `--snapshot-every` of the snapshot test: small, so the leader purges its Raft log quickly.
const SNAPSHOT_EVERY: u64 = 20;
/// Concurrent writing clients and the keys each owns (writes to one key are sequential).
const CLIENTS: usize = 3;
const KEYS_PER_CLIENT: usize = 8;
/// Acknowledged writes wanted in each phase: before the crash, while the node is down, after
/// its restart.
const ACKS_BEFORE: u64 = 15;
const ACKS_DURING: u64 = 20;
const ACKS_AFTER: u64 = 15;
/// Upper bounds of a client: writes, attempts per write, wall time.
const WRITES_PER_CLIENT_MAX: u64 = 5_000;
const ATTEMPTS_PER_WRITE_MAX: u32 = 40;
const WRITER_DEADLINE: Duration = Duration::from_secs(120);
const RETRY_BACKOFF: Duration = Duration::from_millis(150);
/// Pause of a client between writes, so a phase's writes stay in the hundreds.
const WRITE_PAUSE: Duration = Duration::from_millis(10);
/// How long an armed node may take to reach its crash point.
const CRASH_TIMEOUT: Duration = Duration::from_secs(30);
const PHASE_TIMEOUT: Duration = Duration::from_secs(40);
const SETTLE_TIMEOUT: Duration = Duration::from_secs(30);
const MOVE_TIMEOUT: Duration = Duration::from_secs(60);
const FETCH_PAGE_RECORDS: u32 = 500;
const FETCH_PAGES_MAX: u32 = 100;

/// The leader of the written partition dies after its Raft log appends were written into
/// fjall but before their fsync (nothing acknowledged to openraft for them); a new leader
/// takes over, the old one restarts and catches up.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn acknowledged_writes_survive_a_leader_crash_before_its_raft_log_fsync() -> Result<()> {
    crash_while_writing("raft_log::before_fsync", &countdown(FSYNCS_BEFORE_CRASH), Role::Leader).await
}

/// The same crash point on a follower of the written partition.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn acknowledged_writes_survive_a_follower_crash_before_its_raft_log_fsync() -> Result<()> {
    crash_while_writing("raft_log::before_fsync", &countdown(FSYNCS_BEFORE_CRASH), Role::Follower).await
}

/// The leader of the written partition dies after a Raft log fsync succeeded but before it
/// told openraft (so before it counted its own append or acknowledged a client).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn acknowledged_writes_survive_a_leader_crash_between_raft_log_fsync_and_ack() -> Result<()> {
    crash_while_writing("raft_log::after_fsync", &countdown(FSYNCS_BEFORE_CRASH), Role::Leader).await
}

/// The same crash point on a follower: its entries are durable but the leader never heard so.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn acknowledged_writes_survive_a_follower_crash_between_raft_log_fsync_and_ack() -> Result<()> {
    crash_while_writing("raft_log::after_fsync", &countdown(FSYNCS_BEFORE_CRASH), Role::Follower).await
}

/// The leader of the written partition dies applying committed batches: in its segment log
/// but not in its key index (nor under its high watermark). On restart the log is cut back to the
/// index's applied marker and the entries are re-applied, once, at the same offsets.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leader_crashed_between_segment_append_and_index_write_reapplies_to_the_same_offsets() -> Result<()> {
    crash_while_writing("partition::after_segment_append", &countdown(APPLIES_BEFORE_CRASH), Role::Leader).await
}

/// A follower that was down while the leader snapshotted and purged its Raft log restarts,
/// receives the snapshot and dies in the middle of installing it (segments swapped in, index
/// not rebuilt); restarted again, it finishes the install from `installing.json`, catches up
/// and agrees with the others.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_follower_crashed_mid_snapshot_install_finishes_the_install_on_restart() -> Result<()> {
    let options = ClusterOptions { snapshot_every: Some(SNAPSHOT_EVERY), ..ClusterOptions::plain(NODES) };
    let mut cluster = Cluster::start_with(options).await?;
    let outcome = snapshot_install(&mut cluster).await;
    cluster.finish(outcome)
}

/// A partition moves from 3 nodes to 2 of them plus a 4th; a replica that stays dies applying
/// the move's first membership entry (before it is recorded as applied). Restarted, it
/// re-applies it; the move completes, and the new replica set holds every acknowledged write.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_partition_move_completes_after_a_replica_crashed_applying_its_membership_change() -> Result<()> {
    let options = ClusterOptions { spare_nodes: 1, ..ClusterOptions::plain(NODES) };
    let mut cluster = Cluster::start_with(options).await?;
    let outcome = membership_apply(&mut cluster).await;
    cluster.finish(outcome)
}

/// Which replica of the written partition the armed node is.
#[derive(Clone, Copy, Debug)]
enum Role {
    Leader,
    Follower,
}

/// A `fail` action: pass `hits` times, then panic (which a failpoints build turns into abort).
fn countdown(hits: u32) -> String {
    format!("{hits}*off->panic")
}

/// Arms `point` on the victim and restarts it, creates the topic (so the victim is the
/// preferred leader of one partition), writes to a partition it leads or follows until it
/// crashes there, keeps writing while it is down and after its restart without the crash
/// point, then verifies.
async fn crash_while_writing(point: &str, action: &str, role: Role) -> Result<()> {
    let mut cluster = Cluster::start(NODES).await?;
    let outcome = async {
        let (_, mut rng) = test_rng(point)?;
        let topic = "crash";
        arm(&mut cluster, VICTIM, point, action);
        cluster.kill(VICTIM)?;
        cluster.restart(VICTIM).await?;
        let description = create_topic(&cluster, topic, PARTITIONS).await?;
        let partition = pick_partition(&description, role)?;
        eprintln!("victim: node {VICTIM}, {role:?} of partition {partition}; leaders {:?}", leaders(&description));
        let others = others(&cluster, VICTIM);
        let writer = Writer::start(&cluster, &others, topic, (partition, PARTITIONS), &mut rng);
        let phases = async {
            let status = cluster.wait_exited(VICTIM, CRASH_TIMEOUT).await;
            let acked_at_crash = writer.acks();
            expect_crash(&cluster, VICTIM, point, status)?;
            eprintln!("{acked_at_crash} writes acknowledged before the crash");
            ensure!(acked_at_crash > 0, "no write was acknowledged before the crash at {point}");
            writer.wait_for_acks(&cluster, &others, acked_at_crash + ACKS_DURING, "while the victim is down").await?;
            cluster.clear_node_env(VICTIM);
            cluster.restart(VICTIM).await?;
            let acked = writer.acks();
            writer.wait_for_acks(&cluster, &cluster.node_ids(), acked + ACKS_AFTER, "after the restart").await
        }
        .await;
        let history = writer.stop().await?;
        phases?;
        verify(&cluster, topic, partition, &cluster.node_ids(), &history).await
    }
    .await;
    cluster.finish(outcome)
}

async fn snapshot_install(cluster: &mut Cluster) -> Result<()> {
    const POINT: &str = "partition::install_snapshot";
    let (_, mut rng) = test_rng("snapshot_install")?;
    let topic = "snap";
    let description = create_topic(cluster, topic, PARTITIONS).await?;
    let partition = pick_partition(&description, Role::Follower)?;
    let others = others(cluster, VICTIM);
    let writer = Writer::start(cluster, &others, topic, (partition, PARTITIONS), &mut rng);
    let phases = async {
        writer.wait_for_acks(cluster, &cluster.node_ids(), ACKS_BEFORE, "before the victim goes down").await?;
        cluster.kill(VICTIM)?;
        // Far enough past the victim for the leader to snapshot and purge what the victim lacks.
        let needed = high_watermark(cluster, &others, topic, partition).await? + 8 * SNAPSHOT_EVERY;
        wait_for_high_watermark(cluster, &others, topic, partition, needed).await?;
        arm(cluster, VICTIM, POINT, "panic");
        cluster.launch_stopped(VICTIM)?;
        let status = cluster.wait_exited(VICTIM, CRASH_TIMEOUT).await;
        expect_crash(cluster, VICTIM, POINT, status)?;
        cluster.clear_node_env(VICTIM);
        cluster.restart(VICTIM).await?;
        let finished = "finishing an interrupted snapshot install";
        ensure!(cluster.launch_log(VICTIM)?.contains(finished), "node {VICTIM} did not log {finished:?} on restart");
        let acked = writer.acks();
        writer.wait_for_acks(cluster, &cluster.node_ids(), acked + ACKS_AFTER, "after the restart").await
    }
    .await;
    let history = writer.stop().await?;
    phases?;
    verify(cluster, topic, partition, &cluster.node_ids(), &history).await
}

async fn membership_apply(cluster: &mut Cluster) -> Result<()> {
    const POINT: &str = "state_machine::apply_membership";
    const SPARE: u64 = 4;
    let (_, mut rng) = test_rng("membership_apply")?;
    let topic = "mv";
    // One partition on nodes 1-3 (created before node 4 joins, so it is not placed there).
    let description = create_topic(cluster, topic, 1).await?;
    let leader = description.partition(0)?.leader.ok_or_else(|| Error::Check("partition 0 has no leader".into()))?;
    let victim = if leader == VICTIM { 3 } else { VICTIM };
    let removed = (1..=NODES as u64).find(|n| *n != leader && *n != victim).unwrap_or(1);
    let target = vec![leader, victim, SPARE];
    eprintln!("partition 0: leader {leader}, victim {victim}, moving to {target:?} (off node {removed})");
    // Node 4 joins (a controller membership change) before the victim is armed, and the
    // victim applied that change (its registration, which comes after it in the controller's
    // log): else the victim, restarted armed, crashes applying the controller's change.
    cluster.start_spare(SPARE).await?;
    let view = format!("{}/cluster", cluster.url(victim));
    let deadline = Instant::now() + Duration::from_secs(20);
    while !cluster.api().get_url(&view).await?.text().contains(&format!("\"node_id\":{SPARE}")) {
        ensure!(Instant::now() < deadline, "node {victim} never saw node {SPARE} join");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    arm(cluster, victim, POINT, "panic");
    cluster.kill(victim)?;
    cluster.restart(victim).await?;
    let writers: Vec<u64> = vec![leader, removed];
    let writer = Writer::start(cluster, &writers, topic, (0, 1), &mut rng);
    let phases = async {
        writer.wait_for_acks(cluster, &cluster.node_ids(), ACKS_BEFORE, "before the move").await?;
        let url = format!("{}/topics/{topic}/partitions/0/replicas", cluster.url(leader));
        let body = logdex_cluster_tests::client::Body::Json(json!({ "replicas": target }));
        let moved = cluster.api().request(reqwest::Method::PUT, &url, Some(body)).await?;
        ensure!(moved.status == 202 || moved.status == 200, "move answered {}", moved.summary());
        let status = cluster.wait_exited(victim, CRASH_TIMEOUT).await;
        expect_crash(cluster, victim, POINT, status)?;
        let acked = writer.acks();
        writer
            .wait_for_acks(cluster, &[leader, removed, SPARE], acked + ACKS_DURING, "while the victim is down")
            .await?;
        cluster.clear_node_env(victim);
        cluster.restart(victim).await?;
        wait_for_move(cluster, topic, &target).await?;
        let acked = writer.acks();
        writer.wait_for_acks(cluster, &cluster.node_ids(), acked + ACKS_AFTER, "after the move").await
    }
    .await;
    let history = writer.stop().await?;
    phases?;
    verify(cluster, topic, 0, &target, &history).await
}

/// Arms `point` with `action` for node `id`'s next launches.
fn arm(cluster: &mut Cluster, id: u64, point: &str, action: &str) {
    cluster.set_node_env(id, FAILPOINTS_ENV, &format!("{point}={action}"));
    eprintln!("node {id}: {FAILPOINTS_ENV}={point}={action} from its next launch");
}

/// The victim exited by itself at `point`: killed by SIGABRT, its log naming the point.
fn expect_crash(cluster: &Cluster, id: u64, point: &str, status: Result<std::process::ExitStatus>) -> Result<()> {
    let log = cluster.launch_log(id)?;
    let status = match status {
        Ok(status) => status,
        Err(e) if !log.contains("crash points armed") => {
            return Err(Error::Check(format!(
                "node {id} did not crash at {point} ({e}); its log shows no armed crash points: \
                 is the binary a failpoints build (`cargo build -p logdex-api --bin logdex --features failpoints`)?"
            )));
        }
        Err(e) => return Err(e),
    };
    ensure!(status.signal() == Some(SIGABRT), "node {id} exited with {status}, not by SIGABRT (a crash point's abort)");
    let evidence = format!("crash point hit: failpoint {point} panic");
    ensure!(log.contains(&evidence), "node {id} died of SIGABRT but its log lacks {evidence:?}");
    eprintln!("node {id} crashed at {point} (SIGABRT)");
    Ok(())
}

/// A topic replicated on every node, each partition led. `cleanup.policy=delete` keeps every
/// record, so each replica's log can be compared whole.
async fn create_topic(cluster: &Cluster, topic: &str, partitions: u32) -> Result<TopicDescription> {
    let mut spec = TopicSpec::compacted(topic, partitions, NODES as u32);
    spec.config.insert("cleanup.policy".into(), json!("delete"));
    cluster.api().create_topic(&cluster.url(1), &spec).await?.expect_status(201)?;
    cluster.wait_for_leaders(topic, SETTLE_TIMEOUT).await
}

/// The partition the victim leads (or one it follows).
fn pick_partition(description: &TopicDescription, role: Role) -> Result<u32> {
    let found = description.partitions.iter().find(|p| match role {
        Role::Leader => p.leader == Some(VICTIM),
        Role::Follower => p.leader.is_some_and(|l| l != VICTIM) && p.replicas.contains(&VICTIM),
    });
    found.map(|p| p.partition).ok_or_else(|| {
        Error::Check(format!("node {VICTIM} is the {role:?} of no partition; leaders {:?}", leaders(description)))
    })
}

fn leaders(d: &TopicDescription) -> Vec<(u32, Option<u64>)> {
    d.partitions.iter().map(|p| (p.partition, p.leader)).collect()
}

fn others(cluster: &Cluster, id: u64) -> Vec<u64> {
    cluster.node_ids().into_iter().filter(|n| *n != id).collect()
}

/// The partition's high watermark as the first of `nodes` that answers describes it.
async fn high_watermark(cluster: &Cluster, nodes: &[u64], topic: &str, partition: u32) -> Result<u64> {
    let mut last = String::new();
    for &node in nodes {
        match cluster.api().describe(&cluster.url(node), topic).await {
            Ok(reply) if reply.status == 200 => {
                return Ok(reply.decode::<TopicDescription>()?.partition(partition)?.high_watermark);
            }
            Ok(reply) => last = reply.summary(),
            Err(e) => last = e.to_string(),
        }
    }
    Err(Error::Check(format!("no node of {nodes:?} described {topic}: {last}")))
}

async fn wait_for_high_watermark(
    cluster: &Cluster,
    nodes: &[u64],
    topic: &str,
    partition: u32,
    needed: u64,
) -> Result<()> {
    let what = format!("partition {partition}'s high watermark to reach {needed}");
    poll_until(&what, PHASE_TIMEOUT, Duration::from_millis(200), || async {
        nodes.iter().try_for_each(|id| cluster.check_alive(*id))?;
        let hw = high_watermark(cluster, nodes, topic, partition).await?;
        Ok(if hw >= needed { Probe::Ready(()) } else { Probe::NotYet(format!("high watermark {hw}")) })
    })
    .await
}

/// Polls describe until partition 0 has exactly `target` as replicas and no move in progress.
async fn wait_for_move(cluster: &Cluster, topic: &str, target: &[u64]) -> Result<()> {
    let what = format!("the move of {topic}/0 to {target:?} to complete");
    poll_until(&what, MOVE_TIMEOUT, Duration::from_millis(250), || async {
        let reply = cluster.api().describe(&cluster.url(target[0]), topic).await?;
        if reply.status != 200 {
            return Ok(Probe::NotYet(reply.summary()));
        }
        let d: Value = reply.json()?;
        let p = &d["partitions"][0];
        let replicas: Vec<u64> = p["replicas"].as_array().into_iter().flatten().filter_map(Value::as_u64).collect();
        let done = p.get("move").is_none_or(Value::is_null) && replicas == target;
        Ok(if done { Probe::Ready(()) } else { Probe::NotYet(p.to_string()) })
    })
    .await
}

/// Clients writing unique values to keys of one partition through `nodes`: each client owns
/// its keys and writes one at a time; a failed write is retried with the same value up to a
/// bound, then abandoned (its outcome unknown).
struct Writer {
    history: Arc<Mutex<History>>,
    stop: Arc<AtomicBool>,
    acks: Arc<AtomicU64>,
    tasks: Vec<JoinHandle<Result<()>>>,
}

impl Writer {
    /// Writes to keys of `partition` (of `partitions`) through `nodes`.
    fn start(
        cluster: &Cluster,
        nodes: &[u64],
        topic: &str,
        (partition, partitions): (u32, u32),
        rng: &mut StdRng,
    ) -> Writer {
        let history = Arc::new(Mutex::new(History::default()));
        let stop = Arc::new(AtomicBool::new(false));
        let acks = Arc::new(AtomicU64::new(0));
        let urls: Vec<String> = nodes.iter().map(|id| cluster.url(*id)).collect();
        let tasks = (0..CLIENTS)
            .map(|id| {
                let keys = (0..)
                    .map(|i| format!("{topic}-{id}-{i}").into_bytes())
                    .filter(|k| kafka_partition(k, partitions) == partition)
                    .take(KEYS_PER_CLIENT)
                    .collect();
                let client = Client {
                    api: cluster.api().clone(),
                    urls: urls.clone(),
                    topic: topic.to_string(),
                    keys,
                    rng: StdRng::seed_from_u64(rng.random()),
                    history: history.clone(),
                    stop: stop.clone(),
                    acks: acks.clone(),
                };
                tokio::spawn(client.run())
            })
            .collect();
        Writer { history, stop, acks, tasks }
    }

    fn acks(&self) -> u64 {
        self.acks.load(Ordering::SeqCst)
    }

    /// Waits until `target` writes were acknowledged, failing early if one of `alive` died.
    async fn wait_for_acks(&self, cluster: &Cluster, alive: &[u64], target: u64, what: &str) -> Result<()> {
        let what = format!("{target} acknowledged writes ({what})");
        poll_until(&what, PHASE_TIMEOUT, Duration::from_millis(100), || async {
            alive.iter().try_for_each(|id| cluster.check_alive(*id))?;
            let acks = self.acks();
            if self.tasks.iter().all(JoinHandle::is_finished) && acks < target {
                return Err(Error::Check(format!("the writers ended after {acks} acknowledgements")));
            }
            Ok(if acks >= target { Probe::Ready(()) } else { Probe::NotYet(format!("{acks} acknowledged")) })
        })
        .await
    }

    /// Stops the clients after their current write and returns what they know.
    async fn stop(self) -> Result<History> {
        self.stop.store(true, Ordering::SeqCst);
        for task in self.tasks {
            task.await.map_err(|e| Error::Check(format!("writer task failed: {e}")))??;
        }
        let history = self.history.lock().unwrap_or_else(PoisonError::into_inner).clone();
        eprintln!("writers: {} writes, {} acknowledged", history.attempts(), history.acks().len());
        Ok(history)
    }
}

/// One writing client of a [`Writer`].
struct Client {
    api: Api,
    urls: Vec<String>,
    topic: String,
    keys: Vec<Vec<u8>>,
    rng: StdRng,
    history: Arc<Mutex<History>>,
    stop: Arc<AtomicBool>,
    acks: Arc<AtomicU64>,
}

impl Client {
    async fn run(mut self) -> Result<()> {
        let started = Instant::now();
        for seq in 0..WRITES_PER_CLIENT_MAX {
            if self.stop.load(Ordering::SeqCst) || started.elapsed() > WRITER_DEADLINE {
                break;
            }
            tokio::time::sleep(WRITE_PAUSE).await;
            let key = self.keys[self.rng.random_range(0..self.keys.len())].clone();
            let value = format!("{}@{seq}", show(&key)).into_bytes();
            self.history.lock().unwrap_or_else(PoisonError::into_inner).attempt(&key, &value);
            for _ in 0..ATTEMPTS_PER_WRITE_MAX {
                let url = &self.urls[self.rng.random_range(0..self.urls.len())];
                match self.api.put(url, &self.topic, &key, &value).await {
                    Ok(reply) if reply.status == 200 => {
                        let w = written(&reply)?;
                        self.history.lock().unwrap_or_else(PoisonError::into_inner).ack(&key, &value, w);
                        self.acks.fetch_add(1, Ordering::SeqCst);
                        break;
                    }
                    Ok(_) | Err(_) => {}
                }
                if self.stop.load(Ordering::SeqCst) {
                    break;
                }
                tokio::time::sleep(RETRY_BACKOFF).await;
            }
        }
        Ok(())
    }
}

/// After the restart: every replica in `nodes` reaches the partition's final high watermark
/// and holds identical, dense records below it, with every acknowledged write at its offset;
/// every key written is answered alike by every replica's own state (`read=follower`,
/// `forward=false`, `min_offset` = its last acknowledged offset), as the history allows.
async fn verify(cluster: &Cluster, topic: &str, partition: u32, nodes: &[u64], history: &History) -> Result<()> {
    ensure!(!history.acks().is_empty(), "the writers got no acknowledgement at all");
    let acked_end = history.acks().iter().map(|a| a.written.offset + 1).max().unwrap_or(0);
    let end = final_high_watermark(cluster, topic, partition, nodes).await?;
    ensure!(end >= acked_end, "partition {partition}'s high watermark {end} is below an acknowledged offset");
    let mut logs: Vec<(u64, PartitionLog)> = Vec::new();
    for &node in nodes {
        let log = replica_log(cluster, node, topic, partition, end).await?;
        ensure_eq!(log.keys().copied().collect::<Vec<_>>(), (0..end).collect::<Vec<_>>(), "offsets on node {node}");
        let failures = history.check_log(partition, &log);
        ensure!(failures.is_empty(), "node {node}'s log misses acknowledged records:\n  - {}", failures.join("\n  - "));
        logs.push((node, log));
    }
    let (first, first_log) = &logs[0];
    for (node, log) in &logs[1..] {
        ensure!(log == first_log, "partition {partition}: the records of node {node} and node {first} differ");
    }
    let mut failures = Failures::default();
    let mut checked = 0;
    for (key, known) in history.keys() {
        checked += 1;
        let min_offset = known.last_ack.as_ref().map(|(_, offset)| *offset);
        failures.record(verify_key(cluster, topic, nodes, history, key, min_offset).await);
    }
    failures.into_result(checked, "keys")?;
    eprintln!(
        "verified: {} acknowledged writes, {checked} keys, {end} records identical on nodes {nodes:?}",
        history.acks().len()
    );
    Ok(())
}

/// One key from each replica's own state: passes the history check, and all answer alike.
async fn verify_key(
    cluster: &Cluster,
    topic: &str,
    nodes: &[u64],
    history: &History,
    key: &[u8],
    min_offset: Option<u64>,
) -> Result<()> {
    let mut first: Option<(u64, u16, Option<u64>, Vec<u8>)> = None;
    for &node in nodes {
        let mut read = Read::follower().forward(false);
        if let Some(offset) = min_offset {
            read = read.min_offset(offset);
        }
        let base = cluster.url(node);
        let what = format!("follower GET {} from node {node}", show(key));
        let reply = settled(&what, SETTLE_TIMEOUT, || cluster.api().get(&base, topic, key, &read)).await?;
        let offset = history.check_lookup(key, &reply)?;
        if reply.status == 200 {
            ensure_eq!(reply.header_u64(HEADER_NODE)?, node, "node serving a follower read of {}", show(key));
            ensure_eq!(Some(reply.header_u64(HEADER_OFFSET)?), offset, "offset header of {}", show(key));
        }
        let seen = (node, reply.status, offset, reply.body.clone());
        match &first {
            None => first = Some(seen),
            Some(f) => ensure!(
                (f.1, f.2, &f.3) == (seen.1, seen.2, &seen.3),
                "key {}: node {node} answers (status, offset, value) {:?}, node {} {:?}",
                show(key),
                (seen.1, seen.2, show(&seen.3)),
                f.0,
                (f.1, f.2, show(&f.3))
            ),
        }
    }
    Ok(())
}

/// The partition's high watermark at its leader (a strict fetch through any of `nodes`),
/// once the writers stopped.
async fn final_high_watermark(cluster: &Cluster, topic: &str, partition: u32, nodes: &[u64]) -> Result<u64> {
    let url = format!(
        "{}/topics/{topic}/partitions/{partition}/records?offset=0&max_records=1&read=strict",
        cluster.url(nodes[0])
    );
    let reply = settled("a strict fetch", SETTLE_TIMEOUT, || cluster.api().get_url(&url)).await?;
    reply.expect_status(200)?;
    Ok(reply.decode::<FetchResponse>()?.high_watermark)
}

/// Every record of `partition` below `end` as node `node`'s own replica holds it, polled until
/// that replica's high watermark reaches `end`.
async fn replica_log(cluster: &Cluster, node: u64, topic: &str, partition: u32, end: u64) -> Result<PartitionLog> {
    let what = format!("node {node}'s replica of partition {partition} to reach offset {end}");
    poll_until(&what, SETTLE_TIMEOUT, Duration::from_millis(200), || async {
        let mut log = PartitionLog::new();
        let mut offset = 0;
        for _ in 0..FETCH_PAGES_MAX {
            let url = format!(
                "{}/topics/{topic}/partitions/{partition}/records?offset={offset}&max_records={FETCH_PAGE_RECORDS}\
                 &read=follower&forward=false",
                cluster.url(node)
            );
            let reply = settled("a follower fetch", SETTLE_TIMEOUT, || cluster.api().get_url(&url)).await?;
            reply.expect_status(200)?;
            let page: FetchResponse = reply.decode()?;
            if page.high_watermark < end {
                return Ok(Probe::NotYet(format!("high watermark {}", page.high_watermark)));
            }
            collect_fetched(&page, &mut log)?;
            if page.records.is_empty() || page.next_offset >= end {
                log.retain(|o, _| *o < end);
                return Ok(Probe::Ready(log));
            }
            ensure!(page.next_offset > offset, "fetch at {offset} did not advance: {}", reply.summary());
            offset = page.next_offset;
        }
        Err(Error::Check(format!("partition {partition} needs more than {FETCH_PAGES_MAX} fetch pages")))
    })
    .await
}
