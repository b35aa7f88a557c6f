//! `logdex bench recovery` and `logdex bench rebuild`: how fast a node holding many keys
//! answers lookups again.
//!
//! Both start their own single node (this binary, `serve`, on free loopback ports, data in
//! `--data-dir` or a fresh directory under the system temp dir), load `--keys` keys into a
//! replication-factor-1 topic with batched produce requests, then restart the node and time
//! how long it takes until it is ready and every one of a sample of keys answers its value:
//! - `recovery`: after a clean stop (SIGTERM), then after `kill -9`;
//! - `rebuild`: after a clean stop and deleting the node's key index (`<data>/index`), so
//!   every partition rebuilds its index from the segment log; the rate is keys per second.
//!
//! A lookup that answers 404 for a loaded key while the node comes back is an error (the
//! index must never answer "absent" before it is complete), not a retry. The node is
//! stopped by PID when the run ends, on success or error.

use std::path::PathBuf;
use std::process::Child;
use std::process::Command;
use std::process::Stdio;
use std::time::Duration;
use std::time::Instant;

use rand::Rng as _;
use serde::Deserialize;
use serde::Serialize;

use crate::bench::BenchArgs;
use crate::bench::Workload;

/// Keys of a restart run when `--keys` is not given (issue 8: "a node with 1 million keys").
pub const DEFAULT_KEYS: u64 = 1_000_000;
/// Records per produce request while loading.
const LOAD_BATCH: u64 = 1000;
/// Produce requests in flight while loading.
const LOAD_IN_FLIGHT: usize = 4;
/// Keys looked up to decide that the node answers again.
const SAMPLE_KEYS: usize = 200;
/// Bound on one wait for the node (start, readiness, exit).
const NODE_WAIT: Duration = Duration::from_secs(300);

/// One restart measurement: a JSON line with `--json`.
#[derive(Serialize, Deserialize, Debug, Clone)]
pub struct RestartReport {
    pub system: String,
    /// `recovery` or `rebuild`.
    pub workload: String,
    /// How the node went down: `clean` (SIGTERM), `kill9`, or `index-deleted` (clean stop, index removed).
    pub kind: String,
    pub keys: u64,
    /// From the new process's start until it was ready and every sampled key answered its value.
    pub ready_ms: f64,
    pub keys_per_s: f64,
}

/// A node process this run started; killed by PID when dropped.
struct NodeProcess {
    child: Child,
    url: String,
}

impl Drop for NodeProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

struct Setup {
    exe: PathBuf,
    data_dir: PathBuf,
    http_addr: String,
    rpc_addr: String,
    log: PathBuf,
}

pub async fn run(args: &BenchArgs) -> Result<(), String> {
    let keys = args.keys.unwrap_or(DEFAULT_KEYS);
    if keys == 0 {
        return Err("--keys must be at least 1".into());
    }
    let exe = std::env::current_exe().map_err(|e| format!("cannot find this program's path: {e}"))?;
    let (data_dir, remove_after) = match &args.data_dir {
        Some(d) => (d.clone(), false),
        None => (std::env::temp_dir().join(format!("logdex-bench-{}", std::process::id())), true),
    };
    if data_dir.exists() && std::fs::read_dir(&data_dir).map(|mut d| d.next().is_some()).unwrap_or(true) {
        return Err(format!("--data-dir {} is not empty: give a new or empty directory", data_dir.display()));
    }
    std::fs::create_dir_all(&data_dir).map_err(|e| format!("cannot create {}: {e}", data_dir.display()))?;
    let setup = Setup {
        exe,
        log: data_dir.with_extension("log"),
        http_addr: free_loopback_addr()?,
        rpc_addr: free_loopback_addr()?,
        data_dir,
    };
    // Ctrl-C drops the measurement, and with it the node process (killed by PID).
    let result = tokio::select! {
        r = measure(args, &setup, keys) => r,
        _ = tokio::signal::ctrl_c() => Err("interrupted".into()),
    };
    if remove_after && result.is_ok() {
        let _ = std::fs::remove_dir_all(&setup.data_dir);
        let _ = std::fs::remove_file(&setup.log);
    } else {
        eprintln!("bench: node data kept in {} (log {})", setup.data_dir.display(), setup.log.display());
    }
    result
}

async fn measure(args: &BenchArgs, setup: &Setup, keys: u64) -> Result<(), String> {
    let http = reqwest::Client::builder()
        .no_proxy()
        .timeout(Duration::from_millis(args.request_timeout_ms))
        .build()
        .map_err(|e| format!("cannot build the HTTP client: {e}"))?;
    let mut node = start(setup)?;
    wait_ready(&http, &mut node, None, args).await?;
    crate::bench::create_topic(&http, &node.url, &args.topic, args.partitions, 1).await?;
    let loaded = Instant::now();
    load(&http, &node.url, args, keys).await?;
    let secs = loaded.elapsed().as_secs_f64();
    eprintln!("bench: loaded {keys} keys in {secs:.1} s ({:.0} keys/s)", keys as f64 / secs.max(1e-9));
    let sample: Vec<u64> = {
        let mut rng = rand::rng();
        (0..SAMPLE_KEYS).map(|_| rng.random_range(0..keys)).collect()
    };
    let kinds: &[&str] = if args.workload == Workload::Rebuild { &["index-deleted"] } else { &["clean", "kill9"] };
    for kind in kinds {
        // Let the checkpointer make the loaded data durable first, as a long-running node would have.
        tokio::time::sleep(Duration::from_millis(1500)).await;
        match *kind {
            "kill9" => {
                let _ = node.child.kill();
                let _ = node.child.wait();
            }
            _ => stop_cleanly(&mut node).await?,
        }
        if *kind == "index-deleted" {
            let index = setup.data_dir.join("index");
            std::fs::remove_dir_all(&index).map_err(|e| format!("cannot delete {}: {e}", index.display()))?;
        }
        drop(node);
        eprintln!("bench: restarting the node ({kind})");
        let started = Instant::now();
        node = start(setup)?;
        wait_ready(&http, &mut node, Some(&sample), args).await?;
        let ready = started.elapsed().as_secs_f64();
        let workload = if args.workload == Workload::Rebuild { "rebuild" } else { "recovery" };
        let report = RestartReport {
            system: args.label.clone().unwrap_or_else(|| "logdex".into()),
            workload: workload.into(),
            kind: (*kind).into(),
            keys,
            ready_ms: ready * 1000.0,
            keys_per_s: keys as f64 / ready.max(1e-9),
        };
        print_restart(&report, args.json)?;
    }
    stop_cleanly(&mut node).await
}

fn print_restart(r: &RestartReport, json: bool) -> Result<(), String> {
    let line = if json {
        serde_json::to_string(r).map_err(|e| format!("cannot encode the report: {e}"))?
    } else {
        format!(
            "{} {} {}: {} keys, ready and answering in {:.0} ms ({:.0} keys/s)",
            r.system, r.workload, r.kind, r.keys, r.ready_ms, r.keys_per_s
        )
    };
    println!("{line}");
    Ok(())
}

fn free_loopback_addr() -> Result<String, String> {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").map_err(|e| format!("no free loopback port: {e}"))?;
    listener.local_addr().map(|a| a.to_string()).map_err(|e| format!("no free loopback port: {e}"))
}

fn start(setup: &Setup) -> Result<NodeProcess, String> {
    let log = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&setup.log)
        .map_err(|e| format!("cannot open {}: {e}", setup.log.display()))?;
    let err = log.try_clone().map_err(|e| format!("cannot open {}: {e}", setup.log.display()))?;
    let child = Command::new(&setup.exe)
        .arg("serve")
        .args(["--node-id", "1", "--http-addr", &setup.http_addr, "--rpc-addr", &setup.rpc_addr])
        .arg("--data-dir")
        .arg(&setup.data_dir)
        .stdin(Stdio::null())
        .stdout(log)
        .stderr(err)
        .spawn()
        .map_err(|e| format!("cannot start {} serve: {e}", setup.exe.display()))?;
    Ok(NodeProcess { child, url: format!("http://{}", setup.http_addr) })
}

/// SIGTERM, then waits (bounded) for the process to exit.
async fn stop_cleanly(node: &mut NodeProcess) -> Result<(), String> {
    let status = Command::new("kill")
        .args(["-TERM", &node.child.id().to_string()])
        .status()
        .map_err(|e| format!("cannot run kill: {e}"))?;
    if !status.success() {
        return Err(format!("kill -TERM {} failed", node.child.id()));
    }
    let deadline = Instant::now() + NODE_WAIT;
    loop {
        match node.child.try_wait() {
            Ok(Some(_)) => return Ok(()),
            Ok(None) if Instant::now() < deadline => tokio::time::sleep(Duration::from_millis(5)).await,
            Ok(None) => return Err("the node did not stop within 300 s of SIGTERM".into()),
            Err(e) => return Err(format!("waiting for the node: {e}")),
        }
    }
}

/// Polls until `/readyz` answers 200 and every key of `sample` answers its value.
async fn wait_ready(
    http: &reqwest::Client,
    node: &mut NodeProcess,
    sample: Option<&[u64]>,
    args: &BenchArgs,
) -> Result<(), String> {
    let deadline = Instant::now() + NODE_WAIT;
    let mut next = 0;
    loop {
        if let Ok(Some(status)) = node.child.try_wait() {
            return Err(format!("the node exited while starting: {status}"));
        }
        if Instant::now() >= deadline {
            return Err("the node was not ready within 300 s".into());
        }
        let ready = match http.get(format!("{}/readyz", node.url)).send().await {
            Ok(r) => r.status().is_success(),
            Err(_) => false,
        };
        if ready {
            let Some(sample) = sample else { return Ok(()) };
            while next < sample.len() {
                let url = format!("{}/kv/{}/key-{:08}", node.url, args.topic, sample[next]);
                let Ok(resp) = http.get(url).send().await else { break };
                match resp.status().as_u16() {
                    200 => {
                        let body = resp.bytes().await.map_err(|e| format!("reading a lookup: {e}"))?;
                        if body.len() != args.value_bytes {
                            return Err(format!(
                                "key-{:08}: {} bytes, expected {}",
                                sample[next],
                                body.len(),
                                args.value_bytes
                            ));
                        }
                        next += 1;
                    }
                    404 => return Err(format!("key-{:08} answered 404 after the restart: a lost key", sample[next])),
                    _ => break,
                }
            }
            if next == sample.len() {
                return Ok(());
            }
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// Writes keys `key-%08d` for `0..keys` with `--value-bytes` byte values, in produce requests of
/// [`LOAD_BATCH`] records, [`LOAD_IN_FLIGHT`] at a time.
async fn load(http: &reqwest::Client, url: &str, args: &BenchArgs, keys: u64) -> Result<(), String> {
    let endpoint = format!("{url}/topics/{}/records", args.topic);
    let batches = keys.div_ceil(LOAD_BATCH);
    let next = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
    let mut tasks = Vec::new();
    for _ in 0..LOAD_IN_FLIGHT {
        let (http, endpoint, next) = (http.clone(), endpoint.clone(), next.clone());
        let value_bytes = args.value_bytes;
        tasks.push(tokio::spawn(async move {
            loop {
                let b = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                if b >= batches {
                    return Ok::<(), String>(());
                }
                let records: Vec<serde_json::Value> = (b * LOAD_BATCH..((b + 1) * LOAD_BATCH).min(keys))
                    .map(|k| serde_json::json!({ "key": format!("key-{k:08}"), "value": random_text(value_bytes) }))
                    .collect();
                let resp = http
                    .post(&endpoint)
                    .json(&serde_json::json!({ "records": records }))
                    .send()
                    .await
                    .map_err(|e| format!("loading keys: {e}"))?;
                if !resp.status().is_success() {
                    let status = resp.status();
                    return Err(format!("loading keys: {status} {}", resp.text().await.unwrap_or_default()));
                }
                if b % 100 == 99 {
                    eprintln!("bench: loaded {} of {keys} keys", ((b + 1) * LOAD_BATCH).min(keys));
                }
            }
        }));
    }
    for t in tasks {
        t.await.map_err(|e| format!("load task failed: {e}"))??;
    }
    Ok(())
}

/// `n` random printable ASCII characters (a JSON string is UTF-8, and the value length is checked).
fn random_text(n: usize) -> String {
    let mut rng = rand::rng();
    (0..n).map(|_| char::from(rng.random_range(b'a'..=b'z'))).collect()
}
