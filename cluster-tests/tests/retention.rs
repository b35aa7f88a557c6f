//! Retention is committed through Raft: the partition's leader finds the start offset
//! retention leaves and commits it as a trim, so every replica moves its log start at the
//! same point of the log. Once one node answers 410 for a key past retention, a
//! linearizable read on every node does, and fetches from offset 0 start at the same offset
//! everywhere. After `delete.retention.ms`, the leader commits a forget of the removed keys,
//! and every node answers 404 `key_not_found` for them.

use std::collections::BTreeMap;
use std::time::Duration;
use std::time::Instant;

use logdex_cluster_tests::Cluster;
use logdex_cluster_tests::ClusterOptions;
use logdex_cluster_tests::Error;
use logdex_cluster_tests::Read;
use logdex_cluster_tests::Result;
use logdex_cluster_tests::TopicSpec;
use logdex_cluster_tests::client::Body;
use logdex_cluster_tests::ensure;
use logdex_cluster_tests::ensure_eq;
use serde_json::Value;
use serde_json::json;

const TOPIC: &str = "retained";
const RETENTION_MS: u64 = 6000;
const OLD_KEYS: usize = 40;
const NEW_KEYS: usize = 20;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn once_a_key_is_past_retention_on_one_node_it_is_on_every_node() -> Result<()> {
    let options = ClusterOptions { cleaner_interval_ms: Some(2000), ..ClusterOptions::plain(3) };
    let mut cluster = Cluster::start_with(options).await?;
    let outcome = scenario(&mut cluster).await;
    cluster.finish(outcome)
}

async fn scenario(cluster: &mut Cluster) -> Result<()> {
    let api = cluster.api().clone();
    let mut spec = TopicSpec::compacted(TOPIC, 1, 3);
    spec.config.insert("cleanup.policy".into(), Value::from("delete"));
    spec.config.insert("retention.ms".into(), Value::from(RETENTION_MS.to_string()));
    spec.config.insert("segment.bytes".into(), Value::from("1024"));
    api.create_topic(&cluster.url(1), &spec).await?.expect_status(201)?;
    cluster.wait_for_leaders(TOPIC, Duration::from_secs(20)).await?;
    // Node 3's cleaner runs out of step with the others' (each node's cleaner ticks from
    // its own start): a replica deciding retention on its own would flip at another moment.
    tokio::time::sleep(Duration::from_millis(900)).await;
    cluster.kill(3)?;
    cluster.restart(3).await?;
    cluster.wait_for_leaders(TOPIC, Duration::from_secs(20)).await?;
    let value = vec![b'v'; 100];
    for k in 0..OLD_KEYS {
        api.put(&cluster.url(1), TOPIC, format!("o-{k}").as_bytes(), &value).await?.expect_status(200)?;
    }
    tokio::time::sleep(Duration::from_millis(RETENTION_MS + 500)).await;
    for k in 0..NEW_KEYS {
        api.put(&cluster.url(2), TOPIC, format!("n-{k}").as_bytes(), &value).await?.expect_status(200)?;
    }

    let deadline = Instant::now() + Duration::from_secs(30);
    'first: loop {
        for node in [1, 3] {
            let reply = api.get(&cluster.url(node), TOPIC, b"o-0", &Read::linearizable()).await?;
            if reply.status == 410 {
                break 'first;
            }
            ensure_eq!(reply.status, 200, "o-0 before retention, node {node}: {}", reply.summary());
        }
        ensure!(Instant::now() < deadline, "o-0 never went past retention");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    // No later trims (the new keys' segments would pass retention while a slow machine
    // still reads): retention off. A trim the leader decided before it applied that may
    // still land; a round counts when the log start did not move while it ran.
    let url = format!("{}/topics/{TOPIC}/config", cluster.url(1));
    let body = Body::Json(json!({ "config": { "retention.ms": "-1" } }));
    api.request(reqwest::Method::POST, &url, Some(body)).await?.expect_status(200)?;
    for round in 0..3 {
        let start = log_start(cluster).await?;
        let mut statuses: BTreeMap<String, Vec<u16>> = BTreeMap::new();
        let mut fetch_starts = Vec::new();
        for node in 1..=3 {
            for key in (0..OLD_KEYS).map(|k| format!("o-{k}")).chain((0..NEW_KEYS).map(|k| format!("n-{k}"))) {
                let reply = api.get(&cluster.url(node), TOPIC, key.as_bytes(), &Read::linearizable()).await?;
                ensure!(reply.status == 200 || reply.status == 410, "node {node}, {key}: {}", reply.summary());
                statuses.entry(key).or_default().push(reply.status);
            }
            let fetched = api.fetch_ok(&cluster.url(node), TOPIC, 0, 0, 1).await?;
            fetch_starts.push(fetched.records.first().map(|r| r.offset));
        }
        if log_start(cluster).await? != start {
            ensure!(round < 2, "the log start kept moving");
            continue;
        }
        ensure!(start > 0, "retention moved the log start");
        for (key, seen) in &statuses {
            ensure!(seen.iter().all(|s| *s == seen[0]), "{key} answered {seen:?} on nodes 1, 2, 3 (log start {start})");
        }
        ensure_eq!(statuses["o-0"][0], 410, "o-0 past retention");
        ensure_eq!(statuses[&format!("n-{}", NEW_KEYS - 1)][0], 200, "the newest key");
        ensure!(
            fetch_starts.iter().all(|s| *s == Some(start)),
            "fetches from 0 start at {fetch_starts:?}, log start {start}"
        );
        break;
    }

    // The removed keys are forgotten `delete.retention.ms` after their trim: 404 everywhere.
    let body = Body::Json(json!({ "config": { "delete.retention.ms": "500" } }));
    api.request(reqwest::Method::POST, &url, Some(body)).await?.expect_status(200)?;
    // The old keys went in first, one per offset: the newest removed one is at the log start - 1.
    let start = log_start(cluster).await?;
    ensure!(start > 0 && start <= OLD_KEYS as u64, "log start {start}");
    let newest_removed = format!("o-{}", start - 1);
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let reply = api.get(&cluster.url(1), TOPIC, newest_removed.as_bytes(), &Read::linearizable()).await?;
        if reply.status == 404 {
            break;
        }
        ensure_eq!(reply.status, 410, "{newest_removed} until it is forgotten: {}", reply.summary());
        ensure!(Instant::now() < deadline, "{newest_removed} was never forgotten");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    ensure_eq!(log_start(cluster).await?, start, "no trim after retention was turned off");
    for node in 1..=3 {
        for key in (0..OLD_KEYS).map(|k| format!("o-{k}")).chain((0..NEW_KEYS).map(|k| format!("n-{k}"))) {
            let reply = api.get(&cluster.url(node), TOPIC, key.as_bytes(), &Read::linearizable()).await?;
            // A key forgotten answers as one never written; the others as before.
            match reply.status {
                404 => ensure_eq!(reply.error_code().as_deref(), Some("key_not_found"), "node {node}, {key}"),
                200 => ensure!(reply.header_u64("x-kv-offset")? >= start, "node {node}, {key}: {}", reply.summary()),
                _ => ensure!(false, "node {node}, {key} after the forget: {}", reply.summary()),
            }
        }
    }
    Ok(())
}

/// Segments that retention removed leave the disk on every replica, though no later write
/// comes to make the next snapshot: a snapshot taken before the trim hard-links them, and each
/// replica replaces it after the trim.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn segments_removed_by_retention_leave_the_disk_of_an_idle_topic() -> Result<()> {
    let options =
        ClusterOptions { cleaner_interval_ms: Some(1000), snapshot_every: Some(20), ..ClusterOptions::plain(3) };
    let cluster = Cluster::start_with(options).await?;
    let outcome = idle_topic_scenario(&cluster).await;
    cluster.finish(outcome)
}

async fn idle_topic_scenario(cluster: &Cluster) -> Result<()> {
    let api = cluster.api().clone();
    let mut spec = TopicSpec::compacted(TOPIC, 1, 3);
    spec.config.insert("cleanup.policy".into(), Value::from("delete"));
    spec.config.insert("retention.ms".into(), Value::from("3000"));
    spec.config.insert("segment.bytes".into(), Value::from("1024"));
    api.create_topic(&cluster.url(1), &spec).await?.expect_status(201)?;
    cluster.wait_for_leaders(TOPIC, Duration::from_secs(20)).await?;
    let value = vec![b'v'; 100];
    for k in 0..OLD_KEYS {
        api.put(&cluster.url(1), TOPIC, format!("o-{k}").as_bytes(), &value).await?.expect_status(200)?;
    }
    // Every record is past retention 3 s after the last write: the whole log goes.
    let deadline = Instant::now() + Duration::from_secs(30);
    while log_start(cluster).await? < OLD_KEYS as u64 {
        ensure!(Instant::now() < deadline, "retention never removed the log (start {})", log_start(cluster).await?);
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let mut left = Vec::new();
        for node in 1..=3 {
            for base in segment_bases(cluster.data_dir(node))? {
                if base < OLD_KEYS as u64 {
                    left.push((node, base));
                }
            }
        }
        if left.is_empty() {
            return Ok(());
        }
        ensure!(
            Instant::now() < deadline,
            "segments below the log start {OLD_KEYS} are still on disk, as (node, base offset): {left:?}"
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

/// A removed key answers 410 for `delete.retention.ms` after the trim that removed it, then
/// 404, by the time the trim carries: a partition leader elected meanwhile does not time it
/// again from its election (it used to, and a leader change stretched the 410s by as long as
/// the trim had already waited).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leader_change_does_not_stretch_how_long_a_removed_key_answers_410() -> Result<()> {
    let options = ClusterOptions { cleaner_interval_ms: Some(1000), ..ClusterOptions::plain(3) };
    let mut cluster = Cluster::start_with(options).await?;
    let outcome = leader_change_scenario(&mut cluster).await;
    cluster.finish(outcome)
}

/// `delete.retention.ms` of that test; the leader is killed this long after the trim, and the
/// 404 may come this late past the grace (cleaner passes, an election, a slow machine).
const GRACE: Duration = Duration::from_secs(20);
const KILLED_AFTER: Duration = Duration::from_secs(10);
const FORGET_SLACK: Duration = Duration::from_secs(6);

async fn leader_change_scenario(cluster: &mut Cluster) -> Result<()> {
    let api = cluster.api().clone();
    let mut spec = TopicSpec::compacted(TOPIC, 1, 3);
    spec.config.insert("cleanup.policy".into(), Value::from("delete"));
    spec.config.insert("retention.ms".into(), Value::from("2000"));
    spec.config.insert("segment.bytes".into(), Value::from("1024"));
    spec.config.insert("delete.retention.ms".into(), Value::from(GRACE.as_millis().to_string()));
    api.create_topic(&cluster.url(1), &spec).await?.expect_status(201)?;
    cluster.wait_for_leaders(TOPIC, Duration::from_secs(20)).await?;
    for k in 0..OLD_KEYS {
        api.put(&cluster.url(1), TOPIC, format!("o-{k}").as_bytes(), b"v").await?.expect_status(200)?;
    }
    // The trim happened before o-0 first answers 410.
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let reply = api.get(&cluster.url(1), TOPIC, b"o-0", &Read::linearizable()).await?;
        if reply.status == 410 {
            break;
        }
        ensure!(Instant::now() < deadline, "o-0 never went past retention: {}", reply.summary());
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let trimmed_by = Instant::now();
    tokio::time::sleep(KILLED_AFTER).await;
    let leader = cluster.describe(TOPIC).await?.partitions[0].leader.unwrap_or(1);
    cluster.kill(leader)?;
    cluster.restart(leader).await?;
    let other = (1..=3).find(|id| *id != leader).unwrap_or(1);
    loop {
        let reply = api.get(&cluster.url(other), TOPIC, b"o-0", &Read::linearizable()).await?;
        match reply.status {
            404 => break,
            410 | 503 => {}
            _ => ensure!(false, "o-0 during the grace: {}", reply.summary()),
        }
        ensure!(
            trimmed_by.elapsed() < GRACE + FORGET_SLACK,
            "o-0 still answers 410 {:?} after its trim (grace {GRACE:?}, leader {leader} killed {KILLED_AFTER:?} in)",
            trimmed_by.elapsed()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    Ok(())
}

/// The base offsets of every segment file (`{base_offset:020}.log`) under `dir`, snapshots
/// included.
fn segment_bases(dir: &std::path::Path) -> Result<Vec<u64>> {
    let mut bases = Vec::new();
    let mut pending = vec![dir.to_path_buf()];
    while let Some(dir) = pending.pop() {
        // A superseded snapshot's directory may go while it is listed.
        let entries = match std::fs::read_dir(&dir) {
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
            entries => entries.map_err(|e| Error::io(format!("listing {}", dir.display()), e))?,
        };
        for entry in entries.flatten() {
            let path = entry.path();
            if path.is_dir() {
                pending.push(path);
            } else if path.extension().is_some_and(|e| e == "log")
                && let Some(base) = path.file_stem().and_then(|s| s.to_str()).and_then(|s| s.parse().ok())
            {
                bases.push(base);
            }
        }
    }
    Ok(bases)
}

async fn log_start(cluster: &Cluster) -> Result<u64> {
    let d: Value = cluster.api().describe(&cluster.url(1), TOPIC).await?.json()?;
    Ok(d["partitions"][0]["log_start_offset"].as_u64().unwrap_or(0))
}
