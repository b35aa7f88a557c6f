//! `logdex bench load` and `logdex bench get1` run against a running cluster as a user runs
//! them, and `get1 --paired-floor` reports, after each read mode's run, a floor run of the
//! no-work calls sent alongside its lookups.

use std::time::Duration;

use logdex_cluster_tests::Cluster;
use logdex_cluster_tests::Error;
use logdex_cluster_tests::Result;
use logdex_cluster_tests::ensure;
use logdex_cluster_tests::ensure_eq;
use logdex_cluster_tests::support::run_logdex;

/// Bound on one bench run (a few hundred requests to a local node).
const BENCH_TIMEOUT: Duration = Duration::from_secs(120);
const KEYS: u64 = 300;
const LOOKUPS: u64 = 200;

/// Runs `logdex bench <args> --url <url> --json`; returns (success, stdout, stderr).
async fn bench(url: &str, args: &[&str]) -> Result<(bool, String, String)> {
    run_logdex(&[&["bench"], args, &["--url", url, "--json"]].concat(), "", BENCH_TIMEOUT).await
}

/// The JSON lines of a bench run that must succeed.
async fn bench_lines(url: &str, args: &[&str]) -> Result<Vec<serde_json::Value>> {
    let (ok, stdout, stderr) = bench(url, args).await?;
    ensure!(ok, "logdex bench {args:?} failed: {stderr}");
    let parse = |line: &str| serde_json::from_str(line).map_err(|e| Error::Check(format!("not JSON: {line:?}: {e}")));
    stdout.lines().map(parse).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bench_get1_with_a_paired_floor_reports_a_floor_run_per_read_mode() -> Result<()> {
    let cluster = Cluster::start(1).await?;
    let outcome = paired_floor_runs(&cluster.url(1)).await;
    cluster.finish(outcome)
}

async fn paired_floor_runs(url: &str) -> Result<()> {
    let keys = KEYS.to_string();
    let load = bench_lines(url, &["load", "--keys", &keys, "--partitions", "2", "--replication-factor", "1"]).await?;
    ensure_eq!(load.len(), 1, "one load run: {load:?}");
    ensure_eq!(load[0]["ok"].as_u64(), Some(KEYS), "every key written: {load:?}");

    let lookups = LOOKUPS.to_string();
    let get1 = ["get1", "--keys", &keys, "--requests", &lookups, "--warmup-requests", "5"];
    let lines = bench_lines(url, &[&get1[..], &["--read", "follower,linearizable", "--paired-floor"]].concat()).await?;
    let field = |l: &serde_json::Value, name: &str| l[name].as_str().unwrap_or("").to_string();
    let runs: Vec<String> =
        lines.iter().map(|l| format!("{} {} {}", field(l, "system"), field(l, "workload"), field(l, "read"))).collect();
    ensure_eq!(
        runs,
        ["logdex get1 follower", "floor noop follower", "logdex get1 linearizable", "floor noop linearizable"],
        "a floor run after each read mode's run: {lines:?}"
    );
    for l in &lines {
        // Every lookup found its key, and had its no-work call.
        ensure_eq!((l["ok"].as_u64(), l["errors"].as_u64()), (Some(LOOKUPS), Some(0)), "{l}");
        ensure!(l["p50_us"].as_f64().unwrap_or(0.0) > 0.0, "latencies measured: {l}");
    }

    let (ok, _, stderr) = bench(url, &["getc", "--paired-floor"]).await?;
    ensure!(!ok && stderr.contains("--paired-floor is for get1"), "refused outside get1: {stderr}");
    Ok(())
}
