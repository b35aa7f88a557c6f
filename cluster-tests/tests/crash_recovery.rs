//! Nothing acknowledged is lost (DESIGN.md invariant I2) across SIGKILL of a partition leader
//! while a client keeps writing, and across SIGKILL of every node at once; replicas agree
//! afterwards (I3).

use std::collections::BTreeMap;
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
use logdex_cluster_tests::Error;
use logdex_cluster_tests::Read;
use logdex_cluster_tests::Result;
use logdex_cluster_tests::TopicSpec;
use logdex_cluster_tests::Written;
use logdex_cluster_tests::client::HEADER_NODE;
use logdex_cluster_tests::client::HEADER_OFFSET;
use logdex_cluster_tests::client::written;
use logdex_cluster_tests::ensure;
use logdex_cluster_tests::ensure_eq;
use logdex_cluster_tests::history::History;
use logdex_cluster_tests::history::collect_fetched;
use logdex_cluster_tests::history::show;
use logdex_cluster_tests::support::Failures;
use logdex_cluster_tests::support::Probe;
use logdex_cluster_tests::support::poll_until;
use logdex_cluster_tests::support::settled;
use logdex_cluster_tests::support::test_rng;
use rand::Rng as _;
use rand::SeedableRng as _;
use rand::rngs::StdRng;
use serde_json::json;
use tokio::task::JoinHandle;

const NODES: usize = 3;
const PARTITIONS: u32 = 3;
/// Concurrent writing clients, so several writes are in flight when a node dies.
const CLIENTS: usize = 4;
/// Distinct keys each client picks from, so keys are overwritten many times.
const KEYS_PER_CLIENT: usize = 10;
/// Upper bounds of a client: writes, attempts per write, and wall time.
const WRITES_PER_CLIENT_MAX: u64 = 2_000;
const ATTEMPTS_PER_WRITE_MAX: u32 = 40;
const WRITER_DEADLINE: Duration = Duration::from_secs(120);
const RETRY_BACKOFF: Duration = Duration::from_millis(150);
/// Deadlines of the phases of a test.
const PHASE_TIMEOUT: Duration = Duration::from_secs(45);
const SETTLE_TIMEOUT: Duration = Duration::from_secs(30);
/// Fetch pages read per partition and node when comparing logs.
const FETCH_PAGES_MAX: u32 = 200;
const FETCH_PAGE_RECORDS: u32 = 500;

/// SIGKILLs the leader of partition 0 while 4 clients keep writing through the other nodes;
/// checks that every partition gets a leader among the survivors, that writes are acknowledged
/// again, then restarts the killed node and checks that every node answers every key with its
/// last acknowledged value (or a later unacknowledged attempt) at an offset no lower than its
/// acknowledgement, linearizably and from its own replica, and that every node's log holds every
/// acknowledged record at its acknowledged offset.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn acknowledged_writes_survive_sigkill_of_a_partition_leader() -> Result<()> {
    let mut cluster = Cluster::start(NODES).await?;
    let outcome = leader_crash(&mut cluster).await;
    cluster.finish(outcome)
}

async fn leader_crash(cluster: &mut Cluster) -> Result<()> {
    const TOPIC: &str = "leader-crash";
    let (_, mut rng) = test_rng("leader_crash")?;
    let before = create_topic(cluster, TOPIC).await?;
    let victim = before.partition(0)?.leader.ok_or_else(|| Error::Check("partition 0 has no leader".into()))?;
    let survivors: Vec<String> =
        cluster.node_ids().into_iter().filter(|id| *id != victim).map(|id| cluster.url(id)).collect();
    eprintln!("victim: node {victim}, leader of partition 0 (leaders {:?})", leaders(&before));

    let writer = Writer::start(cluster.api().clone(), survivors, TOPIC, &mut rng);
    let outcome = async {
        writer.wait_for_acks(cluster, 40, "acknowledged writes before the crash").await?;
        cluster.kill(victim)?;
        let acked_at_kill = writer.acks();
        let after = cluster.wait_for_leaders(TOPIC, SETTLE_TIMEOUT).await?;
        eprintln!("leaders after the crash: {:?}", leaders(&after));
        writer.wait_for_acks(cluster, acked_at_kill + 30, "acknowledged writes after the crash").await?;
        cluster.restart(victim).await?;
        let acked_at_restart = writer.acks();
        writer.wait_for_acks(cluster, acked_at_restart + 20, "acknowledged writes after the restart").await
    }
    .await;
    let history = writer.stop().await?;
    outcome?;
    verify(cluster, TOPIC, &history).await
}

/// SIGKILLs all three nodes at once while 4 clients are writing through all of them, restarts
/// them all, and checks that every node answers every key with its last acknowledged value (or
/// a later unacknowledged attempt) and that every node's log holds every acknowledged record.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn acknowledged_writes_survive_sigkill_of_every_node_at_once() -> Result<()> {
    let mut cluster = Cluster::start(NODES).await?;
    let outcome = total_crash(&mut cluster).await;
    cluster.finish(outcome)
}

async fn total_crash(cluster: &mut Cluster) -> Result<()> {
    const TOPIC: &str = "total-crash";
    let (_, mut rng) = test_rng("total_crash")?;
    create_topic(cluster, TOPIC).await?;
    let urls: Vec<String> = cluster.node_ids().into_iter().map(|id| cluster.url(id)).collect();
    let writer = Writer::start(cluster.api().clone(), urls, TOPIC, &mut rng);
    let outcome = writer.wait_for_acks(cluster, 150, "acknowledged writes before the crash").await;
    // Stop asking for new writes, and kill while the last one may be in flight.
    writer.stop.store(true, Ordering::SeqCst);
    let killed = cluster.kill_all();
    let history = writer.stop().await?;
    outcome?;
    killed?;
    cluster.restart_all().await?;
    verify(cluster, TOPIC, &history).await
}

/// A topic of `PARTITIONS` partitions replicated on every node, each partition led.
/// `cleanup.policy=delete` keeps every record, so the log check can see each acknowledged one.
async fn create_topic(cluster: &Cluster, topic: &str) -> Result<logdex_cluster_tests::TopicDescription> {
    let mut spec = TopicSpec::compacted(topic, PARTITIONS, NODES as u32);
    spec.config.insert("cleanup.policy".into(), json!("delete"));
    cluster.api().create_topic(&cluster.url(1), &spec).await?.expect_status(201)?;
    cluster.wait_for_leaders(topic, SETTLE_TIMEOUT).await
}

fn leaders(d: &logdex_cluster_tests::TopicDescription) -> Vec<(u32, Option<u64>)> {
    d.partitions.iter().map(|p| (p.partition, p.leader)).collect()
}

/// Clients writing unique values to random keys, each client one write at a time to its own
/// keys (so writes to one key are sequential), through random nodes of its list; a failed write
/// is retried with the same value up to a bound, then abandoned (its outcome unknown).
struct Writer {
    history: Arc<Mutex<History>>,
    stop: Arc<AtomicBool>,
    acks: Arc<AtomicU64>,
    tasks: Vec<JoinHandle<Result<BTreeMap<String, u64>>>>,
}

impl Writer {
    fn start(api: Api, urls: Vec<String>, topic: &'static str, rng: &mut StdRng) -> Writer {
        let history = Arc::new(Mutex::new(History::default()));
        let stop = Arc::new(AtomicBool::new(false));
        let acks = Arc::new(AtomicU64::new(0));
        let tasks = (0..CLIENTS)
            .map(|client| {
                let client = Client {
                    id: client,
                    api: api.clone(),
                    urls: urls.clone(),
                    topic,
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

    /// Waits until `target` writes were acknowledged, failing early if a node died on its own.
    async fn wait_for_acks(&self, cluster: &Cluster, target: u64, what: &str) -> Result<()> {
        poll_until(&format!("{target} {what}"), PHASE_TIMEOUT, Duration::from_millis(100), || async {
            cluster.check_all_alive()?;
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
        let mut failed: BTreeMap<String, u64> = BTreeMap::new();
        for task in self.tasks {
            let stats = task.await.map_err(|e| Error::Check(format!("writer task failed: {e}")))??;
            for (kind, count) in stats {
                *failed.entry(kind).or_default() += count;
            }
        }
        let history = self.history.lock().unwrap_or_else(PoisonError::into_inner).clone();
        eprintln!(
            "writers: {} writes to {} keys, {} acknowledged; failed attempts by kind: {failed:?}",
            history.attempts(),
            history.keys().count(),
            history.acks().len()
        );
        Ok(history)
    }
}

/// One writing client of a `Writer`.
struct Client {
    id: usize,
    api: Api,
    urls: Vec<String>,
    topic: &'static str,
    rng: StdRng,
    history: Arc<Mutex<History>>,
    stop: Arc<AtomicBool>,
    acks: Arc<AtomicU64>,
}

impl Client {
    /// Writes until stopped or bounded out; returns the count of failed attempts by kind.
    async fn run(mut self) -> Result<BTreeMap<String, u64>> {
        let started = Instant::now();
        let mut failed: BTreeMap<String, u64> = BTreeMap::new();
        for seq in 0..WRITES_PER_CLIENT_MAX {
            if self.stop.load(Ordering::SeqCst) || started.elapsed() > WRITER_DEADLINE {
                break;
            }
            let key = format!("ck-{}-{:02}", self.id, self.rng.random_range(0..KEYS_PER_CLIENT)).into_bytes();
            let value = format!("{}@{seq}", show(&key)).into_bytes();
            self.history.lock().unwrap_or_else(PoisonError::into_inner).attempt(&key, &value);
            for _ in 0..ATTEMPTS_PER_WRITE_MAX {
                match self.put_once(&key, &value).await? {
                    Ok(w) => {
                        self.history.lock().unwrap_or_else(PoisonError::into_inner).ack(&key, &value, w);
                        self.acks.fetch_add(1, Ordering::SeqCst);
                        break;
                    }
                    Err(kind) => *failed.entry(kind).or_default() += 1,
                }
                if self.stop.load(Ordering::SeqCst) {
                    break;
                }
                tokio::time::sleep(RETRY_BACKOFF).await;
            }
        }
        Ok(failed)
    }

    /// One attempt through a random node: the acknowledgement, or the kind of failure.
    async fn put_once(&mut self, key: &[u8], value: &[u8]) -> Result<std::result::Result<Written, String>> {
        let url = &self.urls[self.rng.random_range(0..self.urls.len())];
        Ok(match self.api.put(url, self.topic, key, value).await {
            Ok(reply) if reply.status == 200 => Ok(written(&reply)?),
            Ok(reply) => Err(format!("status {}", reply.status)),
            Err(e) if e.is_connect_failure() => Err("connect failed".to_string()),
            Err(_) => Err("no answer".to_string()),
        })
    }
}

/// After the faults: every key from every node, linearizably then from its own replica, and
/// every node's log against the acknowledgements.
async fn verify(cluster: &Cluster, topic: &str, history: &History) -> Result<()> {
    ensure!(!history.acks().is_empty(), "the writer got no acknowledgement at all");
    cluster.wait_for_leaders(topic, SETTLE_TIMEOUT).await?;
    let mut failures = Failures::default();
    let mut checked = 0;
    for (key, _) in history.keys() {
        checked += 1;
        failures.record(verify_key(cluster, topic, history, key).await);
    }
    failures.into_result(checked, "keys")?;
    verify_logs(cluster, topic, history).await
}

/// One key: a linearizable read from each node passes the history check and all agree; then a
/// follower read from each node, once its replica reached that offset, answers the same.
async fn verify_key(cluster: &Cluster, topic: &str, history: &History, key: &[u8]) -> Result<()> {
    cluster.check_all_alive()?;
    let api = cluster.api();
    let mut first: Option<(u16, Option<u64>, Vec<u8>)> = None;
    for node in cluster.node_ids() {
        let base = cluster.url(node);
        let what = format!("linearizable GET {} from node {node}", show(key));
        let read = Read::linearizable();
        let reply = settled(&what, SETTLE_TIMEOUT, || api.get(&base, topic, key, &read)).await?;
        let offset = history.check_lookup(key, &reply)?;
        let seen = (reply.status, offset, reply.body.clone());
        match &first {
            None => first = Some(seen),
            Some(expected) => ensure!(
                *expected == seen,
                "key {}: node {node} answers (status, offset, value) {:?}, an earlier node {:?}",
                show(key),
                (seen.0, seen.1, show(&seen.2)),
                (expected.0, expected.1, show(&expected.2))
            ),
        }
    }
    let Some((status, Some(offset), value)) = first else {
        return Ok(()); // never acknowledged and absent: nothing to wait for in follower mode
    };
    for node in cluster.node_ids() {
        let base = cluster.url(node);
        let read = Read::follower().min_offset(offset);
        let what = format!("follower GET {} from node {node} with min_offset {offset}", show(key));
        let reply = settled(&what, SETTLE_TIMEOUT, || api.get(&base, topic, key, &read)).await?;
        reply.expect_status(status)?;
        ensure!(reply.body == value, "key {}: follower read on node {node}: {}", show(key), reply.summary());
        ensure_eq!(reply.header_u64(HEADER_OFFSET)?, offset, "follower read offset on node {node}");
        ensure_eq!(reply.header_u64(HEADER_NODE)?, node, "follower read served by the asked node");
    }
    Ok(())
}

type Log = BTreeMap<u64, (Option<Vec<u8>>, Option<Vec<u8>>)>;

/// Each node's log of each partition, once its high watermark covers every acknowledgement,
/// holds every acknowledged record at its offset; the nodes' logs agree on their common range.
async fn verify_logs(cluster: &Cluster, topic: &str, history: &History) -> Result<()> {
    for partition in 0..PARTITIONS {
        let needed = history
            .acks()
            .iter()
            .filter(|a| a.written.partition == partition)
            .map(|a| a.written.offset + 1)
            .max()
            .unwrap_or(0);
        let mut logs: Vec<(u64, Log)> = Vec::new();
        for node in cluster.node_ids() {
            let log = fetch_log(cluster, node, topic, partition, needed).await?;
            let failures = history.check_log(partition, &log);
            ensure!(
                failures.is_empty(),
                "node {node}'s log misses acknowledged records:\n  - {}",
                failures.join("\n  - ")
            );
            logs.push((node, log));
        }
        let common_end = logs.iter().map(|(_, log)| log.keys().next_back().map_or(0, |o| o + 1)).min().unwrap_or(0);
        let (first_node, first_log) = &logs[0];
        for (node, log) in &logs[1..] {
            let a: Vec<_> = first_log.range(..common_end).collect();
            let b: Vec<_> = log.range(..common_end).collect();
            ensure!(
                a == b,
                "partition {partition}: the logs of node {first_node} and node {node} differ below offset {common_end}"
            );
        }
    }
    Ok(())
}

/// Every record of `partition` fetched through `node` from offset 0, polled until that node's
/// high watermark reaches `needed`.
async fn fetch_log(cluster: &Cluster, node: u64, topic: &str, partition: u32, needed: u64) -> Result<Log> {
    let what = format!("node {node}'s high watermark of partition {partition} to reach {needed}");
    poll_until(&what, SETTLE_TIMEOUT, Duration::from_millis(200), || async {
        let mut log = Log::new();
        let mut offset = 0;
        for _ in 0..FETCH_PAGES_MAX {
            let base = cluster.url(node);
            let reply = settled("fetch", SETTLE_TIMEOUT, || {
                cluster.api().fetch(&base, topic, partition, offset, FETCH_PAGE_RECORDS)
            })
            .await?;
            reply.expect_status(200)?;
            let page: logdex_cluster_tests::client::FetchResponse = reply.decode()?;
            collect_fetched(&page, &mut log)?;
            if page.high_watermark < needed {
                return Ok(Probe::NotYet(format!("high watermark {}", page.high_watermark)));
            }
            if page.records.is_empty() || page.next_offset >= page.high_watermark {
                return Ok(Probe::Ready(log));
            }
            ensure!(page.next_offset > offset, "fetch at {offset} did not advance: {}", reply.summary());
            offset = page.next_offset;
        }
        Err(Error::Check(format!("partition {partition} needs more than {FETCH_PAGES_MAX} fetch pages")))
    })
    .await
}
