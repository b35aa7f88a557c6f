//! `logdex bench recovery` and `logdex bench rebuild` run end to end as a user runs them:
//! they start their own node, load keys, restart it (clean, kill -9, index deleted), and
//! report one JSON line per restart; every sampled key answered its value afterwards.

use std::process::Command;

type Result<T = ()> = std::result::Result<T, Box<dyn std::error::Error>>;

use logdex_cluster_tests::cluster::binary_path;

fn bench(workload: &str, keys: u64) -> Result<Vec<serde_json::Value>> {
    let dir = tempfile::tempdir()?;
    let data = dir.path().join("node");
    let out = Command::new(binary_path()?)
        .args(["bench", workload, "--keys", &keys.to_string(), "--partitions", "2", "--json", "--data-dir"])
        .arg(&data)
        .output()?;
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "logdex bench {workload} failed: {stderr}");
    assert!(stderr.contains(&format!("loaded {keys} keys")), "progress is reported on stderr: {stderr}");
    let mut lines = Vec::new();
    for line in String::from_utf8(out.stdout)?.lines() {
        lines.push(serde_json::from_str(line)?);
    }
    Ok(lines)
}

#[test]
fn bench_recovery_reports_ready_times_after_clean_stop_and_kill_9() -> Result<()> {
    let lines = bench("recovery", 20_000)?;
    let kinds: Vec<&str> = lines.iter().filter_map(|l| l["kind"].as_str()).collect();
    assert_eq!(kinds, ["clean", "kill9"]);
    for l in &lines {
        assert_eq!(l["workload"], "recovery");
        assert_eq!(l["keys"], 20_000);
        let ready = l["ready_ms"].as_f64().unwrap_or(0.0);
        assert!(ready > 0.0 && ready < 300_000.0, "ready time {ready} ms");
    }
    Ok(())
}

#[test]
fn bench_rebuild_reports_the_index_rebuild_rate_from_the_log() -> Result<()> {
    let lines = bench("rebuild", 20_000)?;
    assert_eq!(lines.len(), 1, "{lines:?}");
    assert_eq!(lines[0]["workload"], "rebuild");
    assert_eq!(lines[0]["kind"], "index-deleted");
    assert!(lines[0]["keys_per_s"].as_f64().unwrap_or(0.0) > 0.0, "{:?}", lines[0]);
    Ok(())
}
