//! `bench-peer`: the peer of `logdex bench`. The same `load`, `get1` and
//! `getc` workloads against a NATS JetStream Key-Value bucket (3 replicas,
//! direct get) through async-nats, with the same bounds and the same output
//! (text or JSON lines with the fields of `logdex bench`), so that
//! `logdex bench report` can put both in one table.
//!
//! A put waits for the stream leader's publish acknowledgement (after the
//! quorum stored it); a get is a direct get (`$JS.API.DIRECT.GET`), which any
//! replica may answer.

use std::io::IsTerminal;
use std::io::Write;
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
use serde::Serialize;

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

/// One run's result; the fields of `logdex bench`'s `RunReport`.
#[derive(Serialize, Debug, Clone)]
struct RunReport {
    system: String,
    workload: String,
    read: Option<String>,
    concurrency: usize,
    ok: u64,
    not_found: u64,
    errors: u64,
    elapsed_s: f64,
    rate_per_s: f64,
    p50_us: f64,
    p90_us: f64,
    p99_us: f64,
    p999_us: f64,
    max_us: f64,
    first_error: Option<String>,
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

enum Outcome {
    Ok,
    NotFound,
    Error(String),
}

struct Shared {
    next: AtomicU64,
    done: AtomicU64,
    stop: AtomicBool,
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
        let latency = t0.elapsed();
        match outcome {
            Outcome::Ok => {
                stats.ok += 1;
                stats.latency.record(latency);
            }
            Outcome::NotFound => {
                stats.not_found += 1;
                stats.latency.record(latency);
            }
            Outcome::Error(e) => stats.error(e),
        }
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

/// A progress line on stderr, only when stderr is a terminal.
fn progress_task(
    shared: Arc<Shared>,
    name: String,
    requests: Option<u64>,
    duration: Duration,
    start: Instant,
) -> Option<tokio::task::JoinHandle<()>> {
    if !std::io::stderr().is_terminal() {
        return None;
    }
    Some(tokio::spawn(async move {
        let mut tick = tokio::time::interval(Duration::from_millis(250));
        while !shared.stop.load(Ordering::Relaxed) {
            tick.tick().await;
            let done = shared.done.load(Ordering::Relaxed);
            let secs = start.elapsed().as_secs_f64();
            let of = requests.map(|r| format!("/{r}")).unwrap_or_default();
            let mut err = std::io::stderr().lock();
            let _ = write!(
                err,
                "\r\x1b[2K{name}: {done}{of} requests, {:.0}/s, {secs:.1}/{} s",
                done as f64 / secs.max(1e-9),
                duration.as_secs()
            );
            let _ = err.flush();
        }
        let _ = write!(std::io::stderr().lock(), "\r\x1b[2K");
    }))
}

// ---------------------------------------------------------------- statistics
// The same histogram and report as api/src/bench.rs (this crate is kept out
// of the workspace, so it cannot share the code).

#[derive(Default)]
struct Stats {
    ok: u64,
    not_found: u64,
    errors: u64,
    first_error: Option<String>,
    latency: Histogram,
}

impl Stats {
    fn error(&mut self, e: String) {
        self.errors += 1;
        self.first_error.get_or_insert(e);
    }

    fn merge(&mut self, other: Stats) {
        self.ok += other.ok;
        self.not_found += other.not_found;
        self.errors += other.errors;
        if self.first_error.is_none() {
            self.first_error = other.first_error;
        }
        self.latency.merge(&other.latency);
    }

    fn report(
        &self,
        system: &str,
        workload: &str,
        read: Option<String>,
        concurrency: usize,
        elapsed: Duration,
    ) -> RunReport {
        let us = |q: f64| self.latency.quantile_ns(q) as f64 / 1000.0;
        let secs = elapsed.as_secs_f64();
        RunReport {
            system: system.to_string(),
            workload: workload.to_string(),
            read,
            concurrency,
            ok: self.ok,
            not_found: self.not_found,
            errors: self.errors,
            elapsed_s: secs,
            rate_per_s: (self.ok + self.not_found) as f64 / secs.max(1e-9),
            p50_us: us(0.5),
            p90_us: us(0.9),
            p99_us: us(0.99),
            p999_us: us(0.999),
            max_us: self.latency.max_ns as f64 / 1000.0,
            first_error: self.first_error.clone(),
        }
    }
}

/// Log-linear histogram of nanoseconds (HDR-style): values below 2^SUB_BITS
/// are exact, larger ones keep SUB_BITS significant bits (a bucket is at most
/// 0.2% wide).
struct Histogram {
    counts: Vec<u64>,
    total: u64,
    max_ns: u64,
}

const SUB_BITS: u32 = 10;
const HALF: usize = 1 << (SUB_BITS - 1);
const SHIFT_MAX: u32 = 32;

impl Default for Histogram {
    fn default() -> Histogram {
        Histogram { counts: vec![0; (SHIFT_MAX as usize + 2) * HALF], total: 0, max_ns: 0 }
    }
}

impl Histogram {
    fn record(&mut self, d: Duration) {
        let ns = u64::try_from(d.as_nanos()).unwrap_or(u64::MAX);
        let i = Self::index(ns).min(self.counts.len() - 1);
        self.counts[i] += 1;
        self.total += 1;
        self.max_ns = self.max_ns.max(ns);
    }

    fn index(v: u64) -> usize {
        if v < (1 << SUB_BITS) {
            return v as usize;
        }
        let shift = 64 - v.leading_zeros() - SUB_BITS;
        (shift as usize) * HALF + (v >> shift) as usize
    }

    fn highest(i: usize) -> u64 {
        if i < (1 << SUB_BITS) {
            return i as u64;
        }
        let shift = (i / HALF - 1) as u32;
        let mantissa = (i - shift as usize * HALF) as u64;
        ((mantissa + 1) << shift) - 1
    }

    fn merge(&mut self, other: &Histogram) {
        for (a, b) in self.counts.iter_mut().zip(&other.counts) {
            *a += b;
        }
        self.total += other.total;
        self.max_ns = self.max_ns.max(other.max_ns);
    }

    fn quantile_ns(&self, q: f64) -> u64 {
        if self.total == 0 {
            return 0;
        }
        let rank = ((q * self.total as f64).ceil() as u64).clamp(1, self.total);
        let mut seen = 0;
        for (i, c) in self.counts.iter().enumerate() {
            seen += c;
            if seen >= rank {
                return Self::highest(i).min(self.max_ns);
            }
        }
        self.max_ns
    }
}

fn print_report(r: &RunReport, json: bool) -> Result<(), String> {
    let mut out = std::io::stdout().lock();
    let line = if json {
        serde_json::to_string(r).map_err(|e| format!("cannot encode the report: {e}"))?
    } else {
        let read = r.read.as_deref().map(|m| format!(" read={m}")).unwrap_or_default();
        let error = r.first_error.as_deref().map(|e| format!(" (first error: {e})")).unwrap_or_default();
        format!(
            "{} {}{read} c={}: {} ok, {} not found, {} errors in {:.2} s = {:.0}/s; latency us p50 {:.0} p90 {:.0} \
             p99 {:.0} p99.9 {:.0} max {:.0}{error}",
            r.system,
            r.workload,
            r.concurrency,
            r.ok,
            r.not_found,
            r.errors,
            r.elapsed_s,
            r.rate_per_s,
            r.p50_us,
            r.p90_us,
            r.p99_us,
            r.p999_us,
            r.max_us
        )
    };
    writeln!(out, "{line}").map_err(|e| format!("cannot write the report: {e}"))
}
