//! `bench-peer`: the peer of `logdex bench`. The same `load`, `get1` and
//! `getc` workloads against a NATS JetStream Key-Value bucket (3 replicas,
//! direct get) through async-nats, with the same bounds and the same output
//! (text or JSON lines with the fields of `logdex bench`), so that
//! `logdex bench report` can put both in one table.
//!
//! A put waits for the stream leader's publish acknowledgement (after the
//! quorum stored it); a get is a direct get (`$JS.API.DIRECT.GET`), which any
//! replica may answer.

use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::sync::atomic::AtomicU64;
use std::sync::atomic::Ordering;
use std::time::Duration;
use std::time::Instant;

use async_nats::jetstream;
use async_nats::jetstream::kv;
use clap::Parser;
use clap::ValueEnum;
use rand::Rng;

// The run report, statistics, histogram and printer of `logdex bench`, shared
// by path: this crate stays out of the workspace so CI never builds async-nats.
#[path = "../../api/src/bench_measure.rs"]
mod bench_measure;

use bench_measure::Outcome;
use bench_measure::Shared;
use bench_measure::Stats;
use bench_measure::print_report;
use bench_measure::progress_task;

#[derive(Parser, Debug, Clone)]
#[command(name = "bench-peer", about = "NATS JetStream KV: the same workloads as `logdex bench`")]
struct Args {
    /// load (write --keys keys), get1 (one client, closed loop), getc (--concurrency clients for --duration-secs).
    #[arg(value_enum)]
    workload: Workload,
    /// A NATS server URL; repeat for several (one connection each; requests rotate over them).
    #[arg(long = "url", default_value = "nats://127.0.0.1:4222")]
    urls: Vec<String>,
    /// KV bucket (load creates it).
    #[arg(long, default_value = "bench")]
    bucket: String,
    /// Replicas of the bucket load creates.
    #[arg(long, default_value_t = 3)]
    replicas: usize,
    /// Number of keys (`key-%08d`).
    #[arg(long, default_value_t = 100_000)]
    keys: u64,
    /// Value size of load, in random bytes; gets check it.
    #[arg(long, default_value_t = 100)]
    value_bytes: usize,
    /// Concurrent clients [default: 32 for load and getc, 1 for get1].
    #[arg(long)]
    concurrency: Option<usize>,
    /// Time bound in seconds [default: 300 for load, 120 for get1, 10 for getc].
    #[arg(long)]
    duration_secs: Option<u64>,
    /// Request-count bound [default: --keys for load, 20000 for get1, none for getc].
    #[arg(long)]
    requests: Option<u64>,
    /// Requests per client before measuring (not counted).
    #[arg(long, default_value_t = 200)]
    warmup_requests: u64,
    /// Per-request timeout in milliseconds.
    #[arg(long, default_value_t = 10_000)]
    request_timeout_ms: u64,
    /// Seconds to keep retrying the bucket creation while the JetStream cluster elects its leaders.
    #[arg(long, default_value_t = 60)]
    ready_timeout_secs: u64,
    /// Print one JSON object per run on stdout instead of a text line.
    #[arg(long)]
    json: bool,
    /// Name of the measured system in the output.
    #[arg(long, default_value = "nats")]
    label: String,
}

#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
enum Workload {
    Load,
    Get1,
    Getc,
}

fn main() -> std::process::ExitCode {
    let args = Args::parse();
    let runtime = match tokio::runtime::Builder::new_multi_thread().enable_all().build() {
        Ok(r) => r,
        Err(e) => {
            eprintln!("bench-peer: cannot start the runtime: {e}");
            return std::process::ExitCode::FAILURE;
        }
    };
    match runtime.block_on(run(args)) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("bench-peer: {e}");
            std::process::ExitCode::FAILURE
        }
    }
}

async fn run(args: Args) -> Result<(), String> {
    if args.urls.is_empty() {
        return Err("give at least one --url".into());
    }
    let concurrency = match args.workload {
        Workload::Get1 => 1,
        _ => args.concurrency.unwrap_or(32),
    };
    if concurrency == 0 || concurrency > 4096 {
        return Err("--concurrency must be 1 to 4096".into());
    }
    let timeout = Duration::from_millis(args.request_timeout_ms);
    let mut stores = Vec::new();
    for url in &args.urls {
        let client = async_nats::ConnectOptions::new()
            .request_timeout(Some(timeout))
            .connect(url.as_str())
            .await
            .map_err(|e| format!("cannot connect to {url}: {e}"))?;
        let js = jetstream::new(client);
        let store = if args.workload == Workload::Load && stores.is_empty() {
            create_bucket(&js, &args).await?
        } else {
            js.get_key_value(args.bucket.as_str()).await.map_err(|e| format!("bucket {}: {e}", args.bucket))?
        };
        stores.push(store);
    }
    let (requests, secs, warmup, read) = match args.workload {
        Workload::Load => (Some(args.requests.unwrap_or(args.keys).min(args.keys)), 300, 0, None),
        Workload::Get1 => (Some(args.requests.unwrap_or(20_000)), 120, args.warmup_requests, Some("direct")),
        Workload::Getc => (args.requests, 10, args.warmup_requests, Some("direct")),
    };
    let plan = Plan {
        concurrency,
        requests,
        duration: Duration::from_secs(args.duration_secs.unwrap_or(secs)),
        warmup_requests: warmup,
    };
    let workload = format!("{:?}", args.workload).to_lowercase();
    let ctx = Arc::new(Ctx {
        stores,
        put: args.workload == Workload::Load,
        keys: args.keys,
        value_bytes: args.value_bytes,
        timeout,
    });
    let (stats, elapsed) = drive(&ctx, &plan, &workload).await;
    let report = stats.report(&args.label, &workload, read.map(str::to_string), plan.concurrency, elapsed);
    print_report(&report, args.json)?;
    if report.ok == 0 {
        return Err(format!("no request succeeded: {}", report.first_error.unwrap_or_default()));
    }
    Ok(())
}

/// Creates the bucket's stream as `create_key_value` shapes it (history 1,
/// file storage, `--replicas` replicas, direct get, rollup, discard new),
/// retrying while the JetStream cluster is still electing leaders. The stream
/// is created directly because `create_key_value` first reads the account
/// info, whose 2.9 form (Debian's nats-server 2.9.10) this client cannot
/// decode.
async fn create_bucket(js: &jetstream::Context, args: &Args) -> Result<kv::Store, String> {
    let config = jetstream::stream::Config {
        name: format!("KV_{}", args.bucket),
        subjects: vec![format!("$KV.{}.>", args.bucket)],
        max_messages_per_subject: 1,
        storage: jetstream::stream::StorageType::File,
        num_replicas: args.replicas,
        allow_rollup: true,
        deny_delete: true,
        allow_direct: true,
        discard: jetstream::stream::DiscardPolicy::New,
        ..Default::default()
    };
    let deadline = Instant::now() + Duration::from_secs(args.ready_timeout_secs);
    loop {
        match js.get_or_create_stream(config.clone()).await {
            Ok(_stream) => break,
            Err(e) if Instant::now() < deadline => {
                eprintln!("bench-peer: bucket not created yet ({e}); retrying");
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
            Err(e) => return Err(format!("cannot create bucket {}: {e}", args.bucket)),
        }
    }
    js.get_key_value(args.bucket.as_str()).await.map_err(|e| format!("bucket {}: {e}", args.bucket))
}

// ---------------------------------------------------------------- the driver

struct Plan {
    concurrency: usize,
    requests: Option<u64>,
    duration: Duration,
    warmup_requests: u64,
}

struct Ctx {
    stores: Vec<kv::Store>,
    put: bool,
    keys: u64,
    value_bytes: usize,
    timeout: Duration,
}

async fn drive(ctx: &Arc<Ctx>, plan: &Plan, name: &str) -> (Stats, Duration) {
    let limit = plan.requests.unwrap_or(u64::MAX);
    let shared = Arc::new(Shared { next: AtomicU64::new(0), done: AtomicU64::new(0), stop: AtomicBool::new(false) });
    let barrier = Arc::new(tokio::sync::Barrier::new(plan.concurrency + 1));
    let mut workers = Vec::with_capacity(plan.concurrency);
    for worker in 0..plan.concurrency {
        let (ctx, shared, barrier) = (ctx.clone(), shared.clone(), barrier.clone());
        let (warmup, duration) = (plan.warmup_requests, plan.duration);
        workers.push(tokio::spawn(async move {
            for i in 0..warmup {
                let _ = one(&ctx, worker, u64::MAX - i).await;
            }
            barrier.wait().await;
            client_loop(&ctx, &shared, worker, limit, Instant::now() + duration).await
        }));
    }
    barrier.wait().await;
    let start = Instant::now();
    let progress = progress_task(shared.clone(), name.to_string(), plan.requests, plan.duration, start);
    let mut stats = Stats::default();
    for w in workers {
        match w.await {
            Ok(s) => stats.merge(s),
            Err(e) => stats.error(format!("client task failed: {e}")),
        }
    }
    let elapsed = start.elapsed();
    shared.stop.store(true, Ordering::Relaxed);
    if let Some(p) = progress {
        let _ = p.await;
    }
    (stats, elapsed)
}

async fn client_loop(ctx: &Ctx, shared: &Shared, worker: usize, limit: u64, deadline: Instant) -> Stats {
    let mut stats = Stats::default();
    while Instant::now() < deadline {
        let seq = shared.next.fetch_add(1, Ordering::Relaxed);
        if seq >= limit {
            break;
        }
        let t0 = Instant::now();
        let outcome = one(ctx, worker, seq).await;
        stats.record(outcome, t0.elapsed());
        shared.done.fetch_add(1, Ordering::Relaxed);
    }
    stats
}

/// One put of key `seq` or one direct get of a uniformly random key; `seq`
/// rotates the connection used.
async fn one(ctx: &Ctx, worker: usize, seq: u64) -> Outcome {
    let store = &ctx.stores[worker.wrapping_add(seq as usize) % ctx.stores.len()];
    if ctx.put {
        let mut value = vec![0u8; ctx.value_bytes];
        rand::rng().fill(&mut value[..]);
        let key = seq % ctx.keys.max(1);
        return match tokio::time::timeout(ctx.timeout, store.put(format!("key-{key:08}"), value.into())).await {
            Ok(Ok(_revision)) => Outcome::Ok,
            Ok(Err(e)) => Outcome::Error(format!("put: {e}")),
            Err(_) => Outcome::Error("put timed out".into()),
        };
    }
    let key = rand::rng().random_range(0..ctx.keys.max(1));
    match tokio::time::timeout(ctx.timeout, store.get(format!("key-{key:08}"))).await {
        Ok(Ok(Some(value))) if value.len() == ctx.value_bytes => Outcome::Ok,
        Ok(Ok(Some(value))) => Outcome::Error(format!("value of {} bytes, expected {}", value.len(), ctx.value_bytes)),
        Ok(Ok(None)) => Outcome::NotFound,
        Ok(Err(e)) => Outcome::Error(format!("get: {e}")),
        Err(_) => Outcome::Error("get timed out".into()),
    }
}
