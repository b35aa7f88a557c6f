//! `logdex bench`: load, lookup and floor workloads against a running cluster,
//! over HTTP keep-alive connections (one pooled `reqwest` client, the way a
//! real client calls it; writes and linearizable lookups go to the key's
//! partition leader, as a Kafka client routes, unless `--route any`) or over the gRPC client API (`--protocol grpc`, one
//! channel per node, requests multiplexed over HTTP/2), with latency
//! percentiles from a log-linear (HDR-style) histogram; and the restart
//! workloads of `bench_restart` (recovery, rebuild) on a node of their own. `logdex bench report` turns the JSON lines of one
//! run (logdex, the no-work floor and the NATS peer of `bench-peer/`) into the
//! comparison table that `scripts/bench.sh` prints.
//!
//! Every run is bounded by a request count and by a duration, whichever comes
//! first. Timestamps come from `std::time::Instant`.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::sync::atomic::AtomicU64;
use std::sync::atomic::Ordering;
use std::time::Duration;
use std::time::Instant;

use clap::Args;
use clap::ValueEnum;
use rand::Rng;

use crate::bench_measure::Outcome;
pub use crate::bench_measure::RunReport;
use crate::bench_measure::Shared;
use crate::bench_measure::Stats;
use crate::bench_measure::print_report;
use crate::bench_measure::progress_task;
use crate::bench_restart::RestartReport;
use crate::client::encode_key;

/// `--value-bytes`: at most 16 MiB, well over what a node takes, so a bad value is refused here
/// rather than by the allocator.
fn parse_value_bytes(text: &str) -> Result<usize, String> {
    const MAX: usize = 16 << 20;
    match text.parse::<usize>() {
        Ok(n) if n <= MAX => Ok(n),
        Ok(_) => Err(format!("at most {MAX} bytes")),
        Err(e) => Err(e.to_string()),
    }
}

#[derive(Args, Debug, Clone)]
pub struct BenchArgs {
    /// What to run: load (write --keys keys), get1 (one client, closed loop, per read mode), getc
    /// (--concurrency clients for --duration-secs), noop (the floor: GET /bench/noop, or the gRPC
    /// Noop call with --protocol grpc, a fixed 100-byte body), recovery and rebuild (on a node of their own), or report (the comparison
    /// table from JSON-lines files given with --input).
    #[arg(value_enum)]
    pub workload: Workload,
    /// A node's URL; repeat for several (requests rotate over them, or go to a partition's
    /// leader: see --route). With `--protocol grpc`, the
    /// node's RPC address (`http://HOST:RPC_PORT`, where the gRPC client API is served).
    #[arg(long = "url", default_value = "http://127.0.0.1:8081")]
    pub urls: Vec<String>,
    /// How load, get1, getc and noop reach the nodes: HTTP/1.1 keep-alive, or the gRPC client API.
    #[arg(long, value_enum, default_value_t = Protocol::Http)]
    pub protocol: Protocol,
    /// Which node a write or a linearizable or strict lookup is sent to: `leader`, the node
    /// leading the key's partition, as a Kafka client routes (the partition from Kafka's
    /// murmur2 partitioner, leaders from `GET /topics/{topic}`, each --url's node id from
    /// `GET /cluster`; over gRPC both from --admin-url, which is needed for it, the --url
    /// nodes matched by their RPC address; a partition led by a node not given with --url
    /// rotates); or `any`, rotating over the --url nodes, which forward to the leader. Follower
    /// reads always rotate.
    #[arg(long, value_enum, default_value_t = Route::Leader)]
    pub route: Route,
    /// With `--protocol grpc`: a node's HTTP URL, used by load to create the topic (without it,
    /// the topic must exist) and to find the partition leaders (without it, requests rotate).
    #[arg(long)]
    pub admin_url: Option<String>,
    /// recovery and rebuild: the data directory of the node they start (new or empty; kept after
    /// the run) [default: a fresh directory under the system temp dir, removed after a successful run].
    #[arg(long)]
    pub data_dir: Option<PathBuf>,
    /// Topic to write and read (load creates it).
    #[arg(long, default_value = "bench")]
    pub topic: String,
    /// Partitions of the topic load creates.
    #[arg(long, default_value_t = 6)]
    pub partitions: u32,
    /// Replication factor of the topic load creates.
    #[arg(long, default_value_t = 3)]
    pub replication_factor: u32,
    /// Number of keys (`key-%08d`): load writes them, get1 and getc read them uniformly at random;
    /// recovery and rebuild load them into their own node [default: 100000; 1000000 for recovery and
    /// rebuild].
    #[arg(long)]
    pub keys: Option<u64>,
    /// Value size of load, in bytes of random data (0 to 16777216); get1 and getc check that
    /// every value read has it.
    #[arg(long, default_value_t = 100, value_parser = parse_value_bytes)]
    pub value_bytes: usize,
    /// Concurrent clients, each with one request in flight [default: 32 for load and getc, 1 for get1 and noop].
    #[arg(long)]
    pub concurrency: Option<usize>,
    /// Time bound of each run in seconds [default: 10 for getc and a concurrent noop, 120 for get1 and a
    /// single-client noop, 300 for load]; 1 to 86400.
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..=86_400))]
    pub duration_secs: Option<u64>,
    /// Request-count bound of each run [default: --keys for load, 20000 for get1 and a single-client noop,
    /// none for getc and a concurrent noop].
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..))]
    pub requests: Option<u64>,
    /// Read modes, comma-separated (linearizable, strict, follower); one run per mode
    /// [default: linearizable,follower for get1, linearizable for getc].
    #[arg(long, value_delimiter = ',')]
    pub read: Vec<String>,
    /// Requests per client before measuring (not counted): opens the connections and warms the caches.
    #[arg(long, default_value_t = 200)]
    pub warmup_requests: u64,
    /// Per-request timeout in milliseconds (a timed-out request counts as an error).
    #[arg(long, default_value_t = 10_000)]
    pub request_timeout_ms: u64,
    /// get1: pair each lookup with a no-work call to the same node (the noop of --protocol),
    /// sent just before or just after it, in turn, and timed apart; each read mode's no-work
    /// calls are reported as a floor run of their own (`floor` with that read mode). The
    /// machine's speed drifts over a run, so a floor measured at another moment can be off by
    /// more than the difference it is compared for; `report` compares each get1 row with its
    /// paired floor when there is one.
    #[arg(long)]
    pub paired_floor: bool,
    /// Print one JSON object per run on stdout instead of a text line.
    #[arg(long)]
    pub json: bool,
    /// Name of the measured system in the output [default: logdex, or floor for noop]. `report`
    /// lists runs labelled `logdex-...` or `floor-...` below its table; any other name is the peer.
    #[arg(long)]
    pub label: Option<String>,
    /// report: JSON-lines files written with --json (logdex, floor and peer lines); repeatable.
    #[arg(long = "input")]
    pub inputs: Vec<PathBuf>,
}

#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum Workload {
    Load,
    Get1,
    Getc,
    Noop,
    /// Start a node of its own, load --keys keys, then time how soon it answers again after a clean
    /// stop and after kill -9.
    Recovery,
    /// Start a node of its own, load --keys keys, stop it, delete its key index, and time the
    /// rebuild from the segment log until it answers again.
    Rebuild,
    Report,
}

#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum Protocol {
    Http,
    Grpc,
}

#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum Route {
    Leader,
    Any,
}

/// How long load, get1 and getc wait for every partition of the topic to have a leader before
/// they start (a partition still without one is rotated over the nodes).
const LEADERS_TIMEOUT: Duration = Duration::from_secs(30);

/// The error code of a 404 for a missing key (other 404s, a missing topic, are errors).
const KEY_NOT_FOUND: &[u8] = b"key_not_found";

/// Keys of load, get1 and getc when `--keys` is not given.
pub const DEFAULT_KEYS: u64 = 100_000;

pub async fn run(args: BenchArgs) -> Result<(), String> {
    if args.workload == Workload::Report {
        return report(&args.inputs);
    }
    if matches!(args.workload, Workload::Recovery | Workload::Rebuild) {
        return crate::bench_restart::run(&args).await;
    }
    let keys = args.keys.unwrap_or(DEFAULT_KEYS);
    if keys == 0 {
        return Err("--keys must be at least 1".into());
    }
    if args.urls.is_empty() {
        return Err("give at least one --url".into());
    }
    if args.paired_floor && args.workload != Workload::Get1 {
        return Err("--paired-floor is for get1".into());
    }
    let concurrency = args.concurrency.unwrap_or(match args.workload {
        Workload::Load | Workload::Getc => 32,
        _ => 1,
    });
    if concurrency == 0 || concurrency > 4096 {
        return Err("--concurrency must be 1 to 4096".into());
    }
    let http = reqwest::Client::builder()
        .no_proxy()
        .pool_max_idle_per_host(concurrency)
        .pool_idle_timeout(Duration::from_secs(90))
        .tcp_nodelay(true)
        .timeout(Duration::from_millis(args.request_timeout_ms))
        .build()
        .map_err(|e| format!("cannot build the HTTP client: {e}"))?;
    let urls: Vec<String> = args.urls.iter().map(|u| crate::client::base_url(u)).collect();
    let grpc = match args.protocol {
        Protocol::Http => None,
        Protocol::Grpc => Some(grpc_clients(&urls, Duration::from_millis(args.request_timeout_ms))?),
    };
    let bounded = |concurrency: usize, single_requests: Option<u64>, single_secs: u64, many_secs: u64| {
        let (requests, secs) = if concurrency == 1 { (single_requests, single_secs) } else { (None, many_secs) };
        Plan {
            concurrency,
            requests: args.requests.or(requests),
            duration: Duration::from_secs(args.duration_secs.unwrap_or(secs)),
            warmup_requests: args.warmup_requests,
        }
    };
    let mut runs = Vec::new();
    match args.workload {
        Workload::Load => {
            let admin = match args.protocol {
                Protocol::Http => Some(urls[0].clone()),
                Protocol::Grpc => args.admin_url.clone(),
            };
            if let Some(admin) = admin {
                create_topic(&http, admin.trim_end_matches('/'), &args.topic, args.partitions, args.replication_factor)
                    .await?;
            }
            let plan = Plan {
                concurrency,
                requests: Some(args.requests.unwrap_or(keys).min(keys)),
                duration: Duration::from_secs(args.duration_secs.unwrap_or(300)),
                warmup_requests: 0,
            };
            let targets = Targets::new(&http, &urls, &args, args.route).await?;
            runs.push((None, plan, Op::Put { targets }, false));
        }
        Workload::Get1 | Workload::Getc => {
            let mut modes = args.read.clone();
            if modes.is_empty() {
                modes = if args.workload == Workload::Get1 {
                    vec!["linearizable".into(), "follower".into()]
                } else {
                    vec!["linearizable".into()]
                };
            }
            for mode in modes {
                if !matches!(mode.as_str(), "linearizable" | "strict" | "follower") {
                    return Err(format!("--read must be linearizable, strict or follower, not {mode:?}"));
                }
                let plan = if args.workload == Workload::Get1 {
                    bounded(1, Some(20_000), 120, 10)
                } else {
                    bounded(concurrency, None, 10, 10)
                };
                let query = format!("?read={mode}");
                let route = if mode == "follower" { Route::Any } else { args.route };
                let targets = Targets::new(&http, &urls, &args, route).await?;
                runs.push((Some(mode.clone()), plan, Op::Get { targets, query, mode }, args.paired_floor));
            }
        }
        Workload::Noop => {
            runs.push((None, bounded(concurrency, Some(20_000), 120, 10), Op::Noop, false));
        }
        Workload::Report | Workload::Recovery | Workload::Rebuild => unreachable!("returned above"),
    }
    let label = args
        .label
        .clone()
        .unwrap_or_else(|| if args.workload == Workload::Noop { "floor".into() } else { "logdex".into() });
    let workload = format!("{:?}", args.workload).to_lowercase();
    let protocol = (args.protocol == Protocol::Grpc).then(|| "grpc".to_string());
    for (read, plan, op, paired) in runs {
        let ctx = Arc::new(Ctx {
            http: http.clone(),
            grpc: grpc.clone(),
            noops: urls.iter().map(|u| format!("{u}/bench/noop")).collect(),
            topic: args.topic.clone(),
            op,
            paired,
            keys,
            value_bytes: args.value_bytes,
        });
        let progress_name = format!("{workload} {}", read.as_deref().unwrap_or(""));
        let (stats, floor, elapsed) = drive(&ctx, &plan, progress_name.trim()).await;
        let routed = matches!(&ctx.op, Op::Put { targets } | Op::Get { targets, .. } if targets.leaders.is_some());
        let mut report = stats.report(&label, &workload, read.clone(), plan.concurrency, elapsed);
        report.protocol = protocol.clone();
        report.route = routed.then(|| "leader".to_string());
        print_report(&report, args.json)?;
        if report.ok == 0 {
            return Err(format!("no request succeeded: {}", report.first_error.unwrap_or_default()));
        }
        if paired {
            let mut report = floor.report("floor", "noop", read, plan.concurrency, elapsed);
            report.protocol = protocol.clone();
            print_report(&report, args.json)?;
        }
    }
    Ok(())
}

// ---------------------------------------------------------------- the driver

struct Plan {
    concurrency: usize,
    requests: Option<u64>,
    duration: Duration,
    warmup_requests: u64,
}

enum Op {
    /// `PUT {prefix}key-%08d` for key `seq`, value of `value_bytes` random bytes.
    Put { targets: Targets },
    /// `GET {prefix}key-%08d?read={mode}` for a uniformly random key.
    Get { targets: Targets, query: String, mode: String },
    /// The no-work call.
    Noop,
}

struct Ctx {
    http: reqwest::Client,
    /// With `--protocol grpc`: one client per node, in `--url` order.
    grpc: Option<Vec<GrpcClient>>,
    /// `{url}/bench/noop` of each --url node.
    noops: Vec<String>,
    topic: String,
    op: Op,
    /// Each request of `op` is paired with a no-work call to the same node (`--paired-floor`).
    paired: bool,
    keys: u64,
    value_bytes: usize,
}

/// One request: which node it goes to, and for a put or a lookup, its key.
enum Call {
    Noop { node: usize },
    Put { node: usize, key: String },
    Get { node: usize, key: String },
}

/// Which node each request of load, get1 and getc goes to.
struct Targets {
    /// `{url}/kv/{topic}/` of each --url node (over HTTP).
    prefixes: Vec<String>,
    /// With `--route leader`: per partition, the index in the --url list of the node leading
    /// it (`None`: a leader unknown or not among the --url nodes; such keys rotate).
    leaders: Option<Vec<Option<usize>>>,
}

impl Targets {
    async fn new(http: &reqwest::Client, urls: &[String], args: &BenchArgs, route: Route) -> Result<Targets, String> {
        let topic = encode_key(args.topic.as_bytes());
        let prefixes = urls.iter().map(|u| format!("{u}/kv/{topic}/")).collect();
        let leaders = match (route, args.protocol, &args.admin_url) {
            (Route::Any, _, _) => None,
            (Route::Leader, Protocol::Http, _) => {
                let mut nodes = HashMap::new();
                for (i, url) in urls.iter().enumerate() {
                    let cluster = get_json(http, &format!("{url}/cluster")).await?;
                    let id =
                        cluster["node_id"].as_u64().ok_or_else(|| format!("GET {url}/cluster names no node_id"))?;
                    nodes.entry(id).or_insert(i);
                }
                Some(partition_leaders(http, &urls[0], &args.topic, &nodes).await?)
            }
            (Route::Leader, Protocol::Grpc, Some(admin)) => {
                // The gRPC --url of a node is its RPC address, as `GET /cluster` lists it.
                let admin = admin.trim_end_matches('/');
                let cluster = get_json(http, &format!("{admin}/cluster")).await?;
                let authority =
                    |u: &str| u.split_once("://").map_or(u, |(_, rest)| rest).trim_end_matches('/').to_string();
                let mut nodes = HashMap::new();
                for node in cluster["nodes"].as_array().into_iter().flatten() {
                    let (Some(id), Some(rpc)) = (node["node_id"].as_u64(), node["rpc_addr"].as_str()) else { continue };
                    if let Some(i) = urls.iter().position(|u| authority(u) == rpc) {
                        nodes.insert(id, i);
                    }
                }
                Some(partition_leaders(http, admin, &args.topic, &nodes).await?)
            }
            (Route::Leader, Protocol::Grpc, None) => {
                eprintln!(
                    "bench: the gRPC requests rotate over the nodes; give --admin-url (a node's HTTP URL) to send them to the partition leaders"
                );
                None
            }
        };
        Ok(Targets { prefixes, leaders })
    }

    /// The index of the node `key`'s request goes to: its partition leader, else
    /// `rotate(number of nodes)`.
    fn node(&self, key: &[u8], rotate: impl Fn(usize) -> usize) -> usize {
        let leader = self.leaders.as_ref().and_then(|leaders| {
            let partition = crate::murmur2::partition_for_key(key, leaders.len() as u32) as usize;
            leaders.get(partition).copied().flatten()
        });
        leader.unwrap_or_else(|| rotate(self.prefixes.len()))
    }
}

/// `GET url` as JSON; a non-2xx answer is an error.
async fn get_json(http: &reqwest::Client, url: &str) -> Result<serde_json::Value, String> {
    let resp = http.get(url).send().await.map_err(|e| format!("GET {url}: {e}"))?;
    let status = resp.status();
    let body = resp.bytes().await.map_err(|e| format!("GET {url}: {e}"))?;
    if !status.is_success() {
        return Err(format!("GET {url}: {status} {}", String::from_utf8_lossy(&body)));
    }
    serde_json::from_slice(&body).map_err(|e| format!("GET {url}: not JSON: {e}"))
}

/// Per partition of `topic`, the index of the node leading it (`nodes`: node id to index),
/// from `GET {url}/topics/{topic}`, waiting up to [`LEADERS_TIMEOUT`] for every partition to
/// have a leader.
async fn partition_leaders(
    http: &reqwest::Client,
    url: &str,
    topic: &str,
    nodes: &HashMap<u64, usize>,
) -> Result<Vec<Option<usize>>, String> {
    let deadline = Instant::now() + LEADERS_TIMEOUT;
    let topic_url = format!("{url}/topics/{}", encode_key(topic.as_bytes()));
    loop {
        let description = get_json(http, &topic_url).await?;
        let partitions = description["partitions"].as_array().cloned().unwrap_or_default();
        if partitions.is_empty() {
            return Err(format!("topic {topic} has no partitions"));
        }
        let mut leaders = vec![None; partitions.len()];
        let mut leaderless = 0;
        for p in &partitions {
            let leader = p["leader"].as_u64();
            leaderless += usize::from(leader.is_none());
            let slot = p["partition"].as_u64().and_then(|n| leaders.get_mut(n as usize));
            if let Some(slot) = slot {
                *slot = leader.and_then(|id| nodes.get(&id).copied());
            }
        }
        if leaderless == 0 || Instant::now() >= deadline {
            if leaderless > 0 {
                eprintln!(
                    "bench: {leaderless} partitions of {topic} have no leader yet; their keys rotate over the nodes"
                );
            }
            return Ok(leaders);
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

type GrpcClient = crate::grpc::pb::logdex_client::LogdexClient<tonic::transport::Channel>;

/// One lazily connected gRPC channel per node.
fn grpc_clients(urls: &[String], timeout: Duration) -> Result<Vec<GrpcClient>, String> {
    urls.iter()
        .map(|u| {
            let endpoint = tonic::transport::Endpoint::from_shared(u.clone())
                .map_err(|e| format!("bad --url {u}: {e}"))?
                .tcp_nodelay(true)
                .timeout(timeout);
            Ok(GrpcClient::new(endpoint.connect_lazy()))
        })
        .collect()
}

/// Creates the topic (an existing topic with the same settings is fine).
pub(crate) async fn create_topic(
    http: &reqwest::Client,
    url: &str,
    topic: &str,
    partitions: u32,
    replication_factor: u32,
) -> Result<(), String> {
    let body = serde_json::json!({
        "name": topic, "partitions": partitions, "replication_factor": replication_factor,
    });
    let resp = http
        .post(format!("{url}/topics"))
        .timeout(Duration::from_secs(60))
        .json(&body)
        .send()
        .await
        .map_err(|e| format!("creating topic {topic}: {e}"))?;
    let status = resp.status();
    if !status.is_success() {
        let text = resp.text().await.unwrap_or_default();
        return Err(format!("creating topic {topic}: {status} {text}"));
    }
    Ok(())
}

/// Runs `plan.concurrency` closed-loop clients until the request count or the
/// duration is reached, after each client's warm-up; returns the merged
/// statistics and the measured wall time.
/// Runs `plan`: the statistics of its requests, those of the no-work calls paired with them
/// (empty unless `ctx.paired`), and the time it took.
async fn drive(ctx: &Arc<Ctx>, plan: &Plan, name: &str) -> (Stats, Stats, Duration) {
    let limit = plan.requests.unwrap_or(u64::MAX);
    let shared = Arc::new(Shared { next: AtomicU64::new(0), done: AtomicU64::new(0), stop: AtomicBool::new(false) });
    let barrier = Arc::new(tokio::sync::Barrier::new(plan.concurrency + 1));
    let mut workers = Vec::with_capacity(plan.concurrency);
    for worker in 0..plan.concurrency {
        let (ctx, shared, barrier) = (ctx.clone(), shared.clone(), barrier.clone());
        let (warmup, duration) = (plan.warmup_requests, plan.duration);
        workers.push(tokio::spawn(async move {
            let mut unused = (Stats::default(), Stats::default());
            for i in 0..warmup {
                exchange(&ctx, worker, u64::MAX - i, &mut unused.0, &mut unused.1).await;
            }
            barrier.wait().await;
            client_loop(&ctx, &shared, worker, limit, Instant::now() + duration).await
        }));
    }
    barrier.wait().await;
    let start = Instant::now();
    let progress = progress_task(shared.clone(), name.to_string(), plan.requests, plan.duration, start);
    let (mut stats, mut floor) = (Stats::default(), Stats::default());
    for w in workers {
        match w.await {
            Ok((s, f)) => {
                stats.merge(s);
                floor.merge(f);
            }
            Err(e) => stats.error(format!("client task failed: {e}")),
        }
    }
    let elapsed = start.elapsed();
    shared.stop.store(true, Ordering::Relaxed);
    if let Some(p) = progress {
        let _ = p.await;
    }
    (stats, floor, elapsed)
}

async fn client_loop(ctx: &Ctx, shared: &Shared, worker: usize, limit: u64, deadline: Instant) -> (Stats, Stats) {
    let (mut stats, mut floor) = (Stats::default(), Stats::default());
    while Instant::now() < deadline {
        let seq = shared.next.fetch_add(1, Ordering::Relaxed);
        if seq >= limit {
            break;
        }
        exchange(ctx, worker, seq, &mut stats, &mut floor).await;
        shared.done.fetch_add(1, Ordering::Relaxed);
    }
    (stats, floor)
}

/// Request `seq` of `worker`, timed into `stats`; when `ctx.paired`, with its no-work call to
/// the same node timed into `floor`, sent first for even `seq` and second for odd, so that
/// neither gains from going first (a connection just used, caches just warmed).
async fn exchange(ctx: &Ctx, worker: usize, seq: u64, stats: &mut Stats, floor: &mut Stats) {
    let call = plan_call(ctx, worker, seq);
    let noop = match &call {
        Call::Put { node, .. } | Call::Get { node, .. } if ctx.paired => Some(Call::Noop { node: *node }),
        _ => None,
    };
    let noop_first = seq.is_multiple_of(2);
    if let Some(noop) = noop.as_ref().filter(|_| noop_first) {
        timed(ctx, noop, floor).await;
    }
    timed(ctx, &call, stats).await;
    if let Some(noop) = noop.as_ref().filter(|_| !noop_first) {
        timed(ctx, noop, floor).await;
    }
}

async fn timed(ctx: &Ctx, call: &Call, stats: &mut Stats) {
    let t0 = Instant::now();
    let outcome = send(ctx, call).await;
    stats.record(outcome, t0.elapsed());
}

/// Request `seq` of `worker`: `seq` numbers the key of a write and rotates the node asked.
fn plan_call(ctx: &Ctx, worker: usize, seq: u64) -> Call {
    let pick = |n: usize| (worker.wrapping_add(seq as usize)) % n;
    match &ctx.op {
        Op::Noop => Call::Noop { node: pick(ctx.noops.len()) },
        Op::Put { targets } => {
            let key = format!("key-{:08}", if seq >= ctx.keys { seq % ctx.keys.max(1) } else { seq });
            Call::Put { node: targets.node(key.as_bytes(), pick), key }
        }
        Op::Get { targets, .. } => {
            let key = format!("key-{:08}", rand::rng().random_range(0..ctx.keys.max(1)));
            Call::Get { node: targets.node(key.as_bytes(), pick), key }
        }
    }
}

async fn send(ctx: &Ctx, call: &Call) -> Outcome {
    let request = match (call, &ctx.op) {
        (Call::Noop { node }, _) => {
            if let Some(clients) = &ctx.grpc {
                return noop_grpc(clients[*node].clone()).await;
            }
            ctx.http.get(&ctx.noops[*node])
        }
        (Call::Put { node, key }, Op::Put { targets }) => {
            let mut value = vec![0u8; ctx.value_bytes];
            rand::rng().fill(&mut value[..]);
            if let Some(clients) = &ctx.grpc {
                return put_grpc(ctx, clients[*node].clone(), key.clone(), value).await;
            }
            ctx.http.put(format!("{}{key}", targets.prefixes[*node])).body(value)
        }
        (Call::Get { node, key }, Op::Get { targets, query, mode }) => {
            if let Some(clients) = &ctx.grpc {
                return get_grpc(ctx, clients[*node].clone(), key.clone(), mode).await;
            }
            ctx.http.get(format!("{}{key}{query}", targets.prefixes[*node]))
        }
        (Call::Put { .. } | Call::Get { .. }, _) => {
            return Outcome::Error("a put or lookup planned for another workload".into());
        }
    };
    let resp = match request.send().await {
        Ok(r) => r,
        Err(e) => return Outcome::Error(format!("request failed: {e}")),
    };
    let status = resp.status();
    // Read the whole body so that the connection goes back to the pool.
    let body = match resp.bytes().await {
        Ok(b) => b,
        Err(e) => return Outcome::Error(format!("reading the answer: {e}")),
    };
    let lookup = matches!(call, Call::Get { .. });
    match status.as_u16() {
        200 if lookup && body.len() != ctx.value_bytes => {
            Outcome::Error(format!("value of {} bytes, expected {}", body.len(), ctx.value_bytes))
        }
        200 => Outcome::Ok,
        // A missing key; a missing topic (`topic_not_found`) or index is an error.
        404 if lookup && body.windows(KEY_NOT_FOUND.len()).any(|w| w == KEY_NOT_FOUND) => Outcome::NotFound,
        _ => Outcome::Error(format!("{status}: {}", String::from_utf8_lossy(&body[..body.len().min(200)]))),
    }
}

/// A put over the gRPC client API.
async fn put_grpc(ctx: &Ctx, mut client: GrpcClient, key: String, value: Vec<u8>) -> Outcome {
    let request =
        crate::grpc::pb::PutRequest { topic: ctx.topic.clone(), key: key.into_bytes(), value, ..Default::default() };
    match client.put(request).await {
        Ok(_) => Outcome::Ok,
        Err(s) => Outcome::Error(format!("{:?}: {}", s.code(), s.message())),
    }
}

/// The no-work call over the gRPC client API.
async fn noop_grpc(mut client: GrpcClient) -> Outcome {
    match client.noop(crate::grpc::pb::NoopRequest {}).await {
        Ok(r) if r.get_ref().body.len() == 100 => Outcome::Ok,
        Ok(r) => Outcome::Error(format!("body of {} bytes, expected 100", r.get_ref().body.len())),
        Err(s) => Outcome::Error(format!("{:?}: {}", s.code(), s.message())),
    }
}

/// A lookup over the gRPC client API.
async fn get_grpc(ctx: &Ctx, mut client: GrpcClient, key: String, mode: &str) -> Outcome {
    use crate::grpc::pb;
    let read = match mode {
        "strict" => pb::ReadMode::Strict,
        "follower" => pb::ReadMode::Follower,
        _ => pb::ReadMode::Linearizable,
    };
    let request =
        pb::GetRequest { topic: ctx.topic.clone(), key: key.into_bytes(), read: read as i32, ..Default::default() };
    match client.get(request).await {
        Ok(r) => {
            let r = r.into_inner();
            if !r.found {
                Outcome::NotFound
            } else if r.value.len() != ctx.value_bytes {
                Outcome::Error(format!("value of {} bytes, expected {}", r.value.len(), ctx.value_bytes))
            } else {
                Outcome::Ok
            }
        }
        Err(s) => Outcome::Error(format!("{:?}: {}", s.code(), s.message())),
    }
}

// ---------------------------------------------------------------- report

/// Prints the Markdown table of one run: each logdex figure next to the floor
/// (system `floor`: noop with the same number of clients) and the peer (any
/// system other than `logdex` and `floor*`), with the ratios and the issue's
/// targets. Other `floor-*` runs (the floor measured again later) are listed
/// under the table.
fn report(inputs: &[PathBuf]) -> Result<(), String> {
    print!("{}", render_report(inputs)?);
    Ok(())
}

fn render_report(inputs: &[PathBuf]) -> Result<String, String> {
    if inputs.is_empty() {
        return Err("report needs --input FILE: the JSON lines of runs written with --json".into());
    }
    let mut runs = Vec::new();
    let mut restarts = Vec::new();
    for path in inputs {
        let text = std::fs::read_to_string(path).map_err(|e| format!("cannot read {}: {e}", path.display()))?;
        for line in text.lines().filter(|l| l.trim_start().starts_with('{')) {
            let bad = |e: serde_json::Error| format!("{}: bad JSON line {line:?}: {e}", path.display());
            let value: serde_json::Value = serde_json::from_str(line).map_err(bad)?;
            if matches!(value["workload"].as_str(), Some("recovery" | "rebuild")) {
                restarts.push(serde_json::from_value::<RestartReport>(value).map_err(bad)?);
            } else {
                runs.push(serde_json::from_value::<RunReport>(value).map_err(bad)?);
            }
        }
    }
    if runs.is_empty() && restarts.is_empty() {
        return Err("no runs in the --input files: give the JSON lines that --json writes".into());
    }
    let find = |pred: &dyn Fn(&RunReport) -> bool| runs.iter().rev().find(|r| pred(r)).cloned();
    // The floor of a row: the no-work call over the row's protocol, with one client or many; a
    // gRPC row without a gRPC floor is compared with the HTTP one. A get1 row whose lookups were
    // paired with no-work calls (`--paired-floor`, a floor run with the row's read mode) is
    // compared with those.
    let floor = |grpc: bool, many: bool| {
        let of = |protocol: Option<&str>| {
            find(&|r| {
                r.system == "floor"
                    && r.read.is_none()
                    && (r.concurrency > 1) == many
                    && r.protocol.as_deref() == protocol
            })
        };
        if grpc { of(Some("grpc")).or_else(|| of(None)) } else { of(None) }
    };
    let paired_floor = |row: &RunReport| {
        find(&|r| r.system == "floor" && r.read.is_some() && r.read == row.read && r.protocol == row.protocol)
    };
    let is_peer = |system: &str| !system.starts_with("logdex") && !system.starts_with("floor");
    let peer_of = |w: &str| find(&|r| is_peer(&r.system) && r.workload == w);
    let peer_name = runs.iter().map(|r| r.system.clone()).find(|s| is_peer(s));
    let peer_name = peer_name.unwrap_or_else(|| "peer".into());
    let mut out = String::new();
    out.push_str(&format!(
        "| measure | logdex | floor (no-work call, same protocol) | {peer_name} | logdex/floor | logdex/{peer_name} | target | met |\n\
         |---|---:|---:|---:|---:|---:|---|---|\n"
    ));
    let mut row = |measure: String, l: f64, floor: Option<f64>, peer: Option<f64>, target: &str, met: Option<bool>| {
        let cell = |v: Option<f64>| v.map(fmt_num).unwrap_or_else(|| "".into());
        let ratio = |v: Option<f64>| v.filter(|v| *v > 0.0).map(|v| format!("{:.2}", l / v)).unwrap_or_default();
        let met = match met {
            Some(true) => "yes",
            Some(false) => "no",
            None => "",
        };
        out.push_str(&format!(
            "| {measure} | {} | {} | {} | {} | {} | {target} | {met} |\n",
            fmt_num(l),
            cell(floor),
            cell(peer),
            ratio(floor),
            ratio(peer)
        ));
    };
    for r in runs.iter().filter(|r| r.system == "logdex") {
        let read = match (r.read.as_deref(), r.protocol.as_deref()) {
            (Some(m), Some(p)) => format!("{m} [{p}]"),
            (Some(m), None) => m.to_string(),
            (None, Some(p)) => format!("[{p}]"),
            (None, None) => String::new(),
        };
        let read = read.as_str();
        let grpc = r.protocol.as_deref() == Some("grpc");
        let (floor1, floorc) = (floor(grpc, false), floor(grpc, true));
        match r.workload.as_str() {
            "load" => {
                let peer = peer_of("load");
                let pr = peer.as_ref().map(|p| p.rate_per_s);
                let met = pr.map(|p| r.rate_per_s >= 1.5 * p);
                let load = if read.is_empty() { "load".to_string() } else { format!("load {read}") };
                row(
                    format!("{load}: puts/s, {} in flight", r.concurrency),
                    r.rate_per_s,
                    None,
                    pr,
                    ">= 1.5x peer",
                    met,
                );
                row(format!("{load}: put p50 us"), r.p50_us, None, peer.as_ref().map(|p| p.p50_us), "", None);
                row(format!("{load}: put p99 us"), r.p99_us, None, peer.as_ref().map(|p| p.p99_us), "", None);
                row(format!("{load}: put p99.9 us"), r.p999_us, None, peer.as_ref().map(|p| p.p999_us), "", None);
            }
            "get1" => {
                let floor1 = paired_floor(r).or(floor1);
                let peer = peer_of("get1");
                let (f50, p50) = (floor1.as_ref().map(|f| f.p50_us), peer.as_ref().map(|p| p.p50_us));
                let (target, met) = match r.read.as_deref().unwrap_or("") {
                    "follower" => {
                        ("<= 1.3x floor and < peer", f50.zip(p50).map(|(f, p)| r.p50_us <= 1.3 * f && r.p50_us < p))
                    }
                    "linearizable" => ("< 300 us", Some(r.p50_us < 300.0)),
                    "strict" => ("< 500 us (ReadIndex)", Some(r.p50_us < 500.0)),
                    _ => ("", None),
                };
                row(format!("get1 {read}: p50 us"), r.p50_us, f50, p50, target, met);
                let (target, met) = if r.read.as_deref() == Some("follower") {
                    ("< 400 us", Some(r.p99_us < 400.0))
                } else {
                    ("", None)
                };
                let f99 = floor1.as_ref().map(|f| f.p99_us);
                row(format!("get1 {read}: p99 us"), r.p99_us, f99, peer.as_ref().map(|p| p.p99_us), target, met);
                let f999 = floor1.as_ref().map(|f| f.p999_us);
                row(format!("get1 {read}: p99.9 us"), r.p999_us, f999, peer.as_ref().map(|p| p.p999_us), "", None);
            }
            "getc" => {
                let peer = peer_of("getc");
                let (fr, pr) = (floorc.as_ref().map(|f| f.rate_per_s), peer.as_ref().map(|p| p.rate_per_s));
                let met = fr.zip(pr).map(|(f, p)| r.rate_per_s >= p && r.rate_per_s >= 0.6 * f);
                let measure = format!("getc {read}: gets/s, {} clients", r.concurrency);
                row(measure, r.rate_per_s, fr, pr, ">= peer and >= 0.6x floor", met);
                let (f50, p50) = (floorc.as_ref().map(|f| f.p50_us), peer.as_ref().map(|p| p.p50_us));
                row(format!("getc {read}: p50 us"), r.p50_us, f50, p50, "", None);
                let (f99, p99) = (floorc.as_ref().map(|f| f.p99_us), peer.as_ref().map(|p| p.p99_us));
                row(format!("getc {read}: p99 us"), r.p99_us, f99, p99, "", None);
            }
            _ => {}
        }
    }
    for r in restarts.iter().filter(|r| r.system == "logdex") {
        let measure = format!("{} {}: ready ms, {} keys", r.workload, r.kind, r.keys);
        let (target, met) = match r.workload.as_str() {
            "recovery" if r.keys >= 1_000_000 => ("< 2000 ms", Some(r.ready_ms < 2000.0)),
            "rebuild" if r.keys >= 1_000_000 => (">= 1,000,000 keys/s", Some(r.keys_per_s >= 1_000_000.0)),
            _ => ("", None),
        };
        if r.workload == "rebuild" {
            row(measure, r.ready_ms, None, None, "", None);
            row(format!("rebuild {}: keys/s", r.kind), r.keys_per_s, None, None, target, met);
        } else {
            row(measure, r.ready_ms, None, None, target, met);
        }
    }
    let floor_runs = runs.iter().filter(|r| r.system.starts_with("floor-") || r.system == "floor");
    for r in floor_runs.filter(|r| (r.system != "floor" || r.protocol.is_some()) && r.read.is_none()) {
        let protocol = r.protocol.as_ref().map(|p| format!(" [{p}]")).unwrap_or_default();
        out.push_str(&format!(
            "\n{}{protocol} (noop, {} clients): p50 {} us, p99 {} us, {}/s",
            r.system,
            r.concurrency,
            fmt_num(r.p50_us),
            fmt_num(r.p99_us),
            fmt_num(r.rate_per_s)
        ));
    }
    for r in runs.iter().filter(|r| r.system.starts_with("logdex-")) {
        let what = r.read.as_ref().map_or_else(|| r.workload.clone(), |m| format!("{} {m}", r.workload));
        out.push_str(&format!(
            "\n{} ({what}, {} in flight): {}/s, p50 {} us, p99 {} us",
            r.system,
            r.concurrency,
            fmt_num(r.rate_per_s),
            fmt_num(r.p50_us),
            fmt_num(r.p99_us)
        ));
    }
    if runs.iter().any(|r| r.system == "floor" && r.read.is_some()) {
        out.push_str(
            "\nget1 rows with a paired floor (--paired-floor) are compared with the no-work calls sent alongside their lookups",
        );
    }
    let errors: u64 = runs.iter().map(|r| r.errors).sum();
    let not_found: u64 = runs.iter().map(|r| r.not_found).sum();
    out.push_str(&format!("\nerrors in all runs: {errors}; not found: {not_found}\n"));
    Ok(out)
}

fn fmt_num(v: f64) -> String {
    if v >= 100.0 { format!("{v:.0}") } else { format!("{v:.1}") }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A run's report as its JSON line gives it, for the report's tests.
    fn run_report(
        system: &str,
        workload: &str,
        read: Option<&str>,
        protocol: Option<&str>,
        clients: usize,
    ) -> RunReport {
        let mut r = Stats::default().report(system, workload, read.map(String::from), clients, Duration::from_secs(1));
        r.protocol = protocol.map(String::from);
        r
    }

    #[test]
    fn report_without_runs_is_an_error_not_an_empty_table() -> Result<(), Box<dyn std::error::Error>> {
        let dir = tempfile::tempdir()?;
        let garbage = dir.path().join("garbage.jsonl");
        std::fs::write(&garbage, "garbage\n")?;
        let Err(none) = render_report(&[]) else { return Err("a report of no input".into()) };
        assert!(none.contains("--input"), "{none}");
        let Err(empty) = render_report(&[garbage]) else { return Err("a report of no runs".into()) };
        assert!(empty.contains("no runs"), "{empty}");
        Ok(())
    }

    #[test]
    fn report_puts_http_grpc_and_restart_runs_in_one_table() -> Result<(), Box<dyn std::error::Error>> {
        let dir = tempfile::tempdir()?;
        let path = dir.path().join("results.jsonl");
        let run = |system: &str, workload: &str, read: Option<&str>, protocol: Option<&str>, rate: f64| {
            let r = RunReport { rate_per_s: rate, p50_us: 100.0, ..run_report(system, workload, read, protocol, 32) };
            serde_json::to_string(&r)
        };
        let restart = |workload: &str, kind: &str, ready_ms: f64| {
            serde_json::to_string(&RestartReport {
                system: "logdex".into(),
                workload: workload.into(),
                kind: kind.into(),
                keys: 1_000_000,
                ready_ms,
                keys_per_s: 1e9 / ready_ms,
            })
        };
        let lines = [
            run("floor", "noop", None, None, 50_000.0)?,
            run("nats", "getc", None, None, 30_000.0)?,
            run("logdex", "getc", Some("follower"), None, 40_000.0)?,
            run("logdex", "getc", Some("follower"), Some("grpc"), 20_000.0)?,
            run("logdex-one-partition", "load", None, None, 9_000.0)?,
            restart("recovery", "kill9", 1500.0)?,
            restart("rebuild", "index-deleted", 2500.0)?,
        ];
        std::fs::write(&path, lines.join("\n"))?;
        let table = render_report(&[path])?;
        assert!(table.contains("| getc follower: gets/s, 32 clients | 40000 | 50000 | 30000 |"), "{table}");
        assert!(table.contains("| getc follower [grpc]: gets/s, 32 clients | 20000 |"), "{table}");
        assert!(table.contains("| recovery kill9: ready ms, 1000000 keys | 1500 |"), "{table}");
        assert!(table.contains("< 2000 ms | yes |"), "{table}");
        assert!(table.contains("| rebuild index-deleted: keys/s | 400000 |"), "{table}");
        assert!(table.contains(">= 1,000,000 keys/s | no |"), "{table}");
        assert!(table.contains("\nlogdex-one-partition (load, 32 in flight): 9000/s"), "labelled runs below: {table}");
        assert!(!table.contains("| load"), "a labelled run is not a row of the table: {table}");
        assert!(table.contains("| nats | logdex/floor | logdex/nats |"), "a labelled run is not the peer: {table}");
        Ok(())
    }

    #[test]
    fn grpc_rows_are_compared_with_the_grpc_floor_when_one_was_measured() -> Result<(), Box<dyn std::error::Error>> {
        let dir = tempfile::tempdir()?;
        let path = dir.path().join("results.jsonl");
        let run = |system: &str, workload: &str, read: Option<&str>, protocol: Option<&str>, p50: f64| {
            serde_json::to_string(&RunReport { p50_us: p50, ..run_report(system, workload, read, protocol, 1) })
        };
        let http_floor = run("floor", "noop", None, None, 100.0)?;
        let grpc_floor = run("floor", "noop", None, Some("grpc"), 125.0)?;
        let grpc_get = run("logdex", "get1", Some("follower"), Some("grpc"), 150.0)?;
        let http_get = run("logdex", "get1", Some("follower"), None, 120.0)?;

        std::fs::write(&path, [http_floor.clone(), grpc_floor, grpc_get.clone(), http_get].join("\n"))?;
        let table = render_report(std::slice::from_ref(&path))?;
        assert!(table.contains("| get1 follower [grpc]: p50 us | 150 | 125 |  | 1.20 |"), "{table}");
        assert!(table.contains("| get1 follower: p50 us | 120 | 100 |  | 1.20 |"), "{table}");
        assert!(table.contains("\nfloor [grpc] (noop, 1 clients): p50 125 us"), "the gRPC floor is listed: {table}");

        std::fs::write(&path, [http_floor, grpc_get].join("\n"))?;
        let table = render_report(&[path])?;
        assert!(
            table.contains("| get1 follower [grpc]: p50 us | 150 | 100 |  | 1.50 |"),
            "HTTP floor as before: {table}"
        );
        Ok(())
    }

    #[test]
    fn get1_rows_are_compared_with_their_paired_floor_when_one_was_measured() -> Result<(), Box<dyn std::error::Error>>
    {
        let dir = tempfile::tempdir()?;
        let path = dir.path().join("results.jsonl");
        let run = |system: &str, workload: &str, read: Option<&str>, protocol: Option<&str>, p50: f64| {
            serde_json::to_string(&RunReport { p50_us: p50, ..run_report(system, workload, read, protocol, 1) })
        };
        let lines = [
            run("floor", "noop", None, None, 100.0)?,
            run("logdex", "get1", Some("follower"), None, 130.0)?,
            run("floor", "noop", Some("follower"), None, 120.0)?,
            run("logdex", "get1", Some("linearizable"), None, 150.0)?,
            run("logdex", "get1", Some("follower"), Some("grpc"), 160.0)?,
            run("floor", "noop", Some("follower"), Some("grpc"), 128.0)?,
        ];
        std::fs::write(&path, lines.join("\n"))?;
        let table = render_report(&[path])?;
        assert!(table.contains("| get1 follower: p50 us | 130 | 120 |  | 1.08 |  | <= 1.3x floor"), "{table}");
        // A mode without a paired floor keeps the floor measured on its own.
        assert!(table.contains("| get1 linearizable: p50 us | 150 | 100 |  | 1.50 |"), "{table}");
        assert!(table.contains("| get1 follower [grpc]: p50 us | 160 | 128 |  | 1.25 |"), "{table}");
        assert!(
            !table.contains("(noop, 1 clients): p50 128 us"),
            "a paired floor is not listed as a floor run: {table}"
        );
        assert!(table.contains("compared with the no-work calls sent alongside their lookups"), "{table}");
        Ok(())
    }

    #[test]
    fn leader_route_sends_a_key_to_its_partition_leader_and_rotates_the_rest() {
        let prefixes = vec!["http://n1/kv/t/".to_string(), "http://n2/kv/t/".to_string()];
        // Partition 0 is led by the second node; partition 1's leader is not a --url node.
        let targets = Targets { prefixes: prefixes.clone(), leaders: Some(vec![Some(1), None]) };
        let keys: Vec<String> = (0..64).map(|i| format!("key-{i:08}")).collect();
        let in_partition =
            |p: u32| keys.iter().filter(move |k| crate::murmur2::partition_for_key(k.as_bytes(), 2) == p);
        for key in in_partition(0) {
            assert_eq!(targets.node(key.as_bytes(), |_| 0), 1, "{key} goes to its leader");
        }
        assert!(in_partition(0).count() > 0 && in_partition(1).count() > 0, "test keys fall in both partitions");
        for key in in_partition(1) {
            assert_eq!(targets.node(key.as_bytes(), |n| 2 % n), 0, "{key} rotates");
            assert_eq!(targets.node(key.as_bytes(), |n| 3 % n), 1, "{key} rotates");
        }
        let rotating = Targets { prefixes, leaders: None };
        assert_eq!(rotating.node(b"key-00000000", |n| 5 % n), 1);
    }
}
