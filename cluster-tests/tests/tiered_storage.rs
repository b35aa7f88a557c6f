//! Tiered storage end to end, over real processes: a topic with `remote.storage.enable=true`
//! and `local.retention.ms=0` copies its sealed segments to the shared object store and every
//! replica deletes its local copies; lookups and fetches from every node still answer every
//! record (read back from the store), after a kill -9 too; a replica that joins through a
//! partition move builds its index from the remote segments; retention then trims the
//! remote segments and their objects, and their keys answer 410; deleting the topic deletes
//! its objects. Once with a directory the nodes share as the store, once with an
//! S3-compatible server (`moto_server`) reached over the S3 API.

use std::collections::BTreeSet;
use std::path::Path;
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
use logdex_cluster_tests::s3::S3Server;
use serde_json::Value;
use serde_json::json;

const TOPIC: &str = "tiered";
const KEYS: usize = 240;
/// Keys written a second time at the end (their lookups must answer the second value).
const REWRITTEN: usize = 10;
const DEADLINE: Duration = Duration::from_secs(60);
/// More records than one 1 KiB segment holds: the leader's active segment, not in the store.
const ACTIVE_RECORDS_MAX: u64 = 20;

fn value(k: usize, version: u32) -> String {
    format!("v{version}-{k}-{}", "x".repeat(60))
}

fn tiered_spec() -> TopicSpec {
    let mut spec = TopicSpec::compacted(TOPIC, 1, 3);
    for (k, v) in [
        ("cleanup.policy", "delete"),
        ("remote.storage.enable", "true"),
        ("local.retention.ms", "0"),
        ("segment.bytes", "1024"),
    ] {
        spec.config.insert(k.into(), Value::String(v.into()));
    }
    spec
}

/// Files named `*.log` under `dir`, at any depth.
fn log_file_paths(dir: &Path) -> Vec<String> {
    let Ok(entries) = std::fs::read_dir(dir) else { return Vec::new() };
    entries
        .flatten()
        .flat_map(|e| {
            let path = e.path();
            if path.is_dir() {
                log_file_paths(&path)
            } else if path.extension().is_some_and(|x| x == "log") {
                vec![path.display().to_string()]
            } else {
                Vec::new()
            }
        })
        .collect()
}

/// Base offsets of the segment files in node `id`'s own logs (its cache of remote segments
/// not counted), ascending; the last one is the active segment.
fn local_bases(cluster: &Cluster, id: u64) -> Vec<u64> {
    let partitions = cluster.data_dir(id).join("partitions");
    let Ok(entries) = std::fs::read_dir(&partitions) else { return Vec::new() };
    let mut bases: Vec<u64> = entries
        .flatten()
        .flat_map(|e| log_file_paths(&e.path().join("log")))
        .filter_map(|path| Path::new(&path).file_stem()?.to_str()?.parse().ok())
        .collect();
    bases.sort_unstable();
    bases
}

/// Where the store's copies end: the highest `next_offset` of the segment objects, named
/// `{base}-{next}-{hash}.log`.
fn remote_end(objects: &BTreeSet<String>) -> u64 {
    objects.iter().filter_map(|o| o.rsplit('/').next()?.split('-').nth(1)?.parse::<u64>().ok()).max().unwrap_or(0)
}

/// Whether node `id` keeps no sealed segment the store holds in whole: with
/// `local.retention.ms=0` only the segment reaching past the store's end and the ones after
/// it stay. (Replicas cut segments where they each roll, so how many stay differs.)
fn keeps_only_what_the_store_lacks(cluster: &Cluster, id: u64, remote_end: u64) -> bool {
    let bases = local_bases(cluster, id);
    // Sealed segment `i` ends where segment `i + 1` begins.
    bases.get(1).is_none_or(|next| *next > remote_end)
}

async fn wait_until(what: &str, mut done: impl AsyncFnMut() -> Result<bool>) -> Result<()> {
    let deadline = Instant::now() + DEADLINE;
    while !done().await? {
        ensure!(Instant::now() < deadline, "timed out waiting until {what}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    Ok(())
}

/// Alters the topic's `retention.ms`.
async fn set_retention_ms(cluster: &Cluster, value: &str) -> Result<()> {
    let url = format!("{}/topics/{TOPIC}/config", cluster.url(1));
    let body = Body::Json(json!({ "config": { "retention.ms": value } }));
    cluster.api().request(reqwest::Method::POST, &url, Some(body)).await?.expect_status(200)?;
    Ok(())
}

/// Every key answers its latest value from node `id`.
async fn check_lookups(cluster: &Cluster, id: u64, read: &Read) -> Result<()> {
    let api = cluster.api();
    for k in 0..KEYS {
        let reply = api.get(&cluster.url(id), TOPIC, format!("k-{k}").as_bytes(), read).await?;
        reply.expect_status(200)?;
        let version = if k < REWRITTEN { 2 } else { 1 };
        ensure_eq!(reply.text(), value(k, version), "node {id}, key k-{k}");
    }
    Ok(())
}

/// A fetch from offset 0 through node `id` returns every record, offsets dense, in order.
async fn check_fetch(cluster: &Cluster, id: u64, records: u64) -> Result<()> {
    let mut offset = 0;
    while offset < records {
        let reply = cluster.api().fetch(&cluster.url(id), TOPIC, 0, offset, 50).await?;
        reply.expect_status(200)?;
        let body: Value = reply.json()?;
        let got = body["records"].as_array().ok_or_else(|| Error::Check(format!("no records: {body}")))?;
        ensure!(!got.is_empty(), "node {id}: empty fetch at offset {offset} of {records}: {body}");
        for r in got {
            ensure_eq!(r["offset"].as_u64(), Some(offset), "node {id}: fetch offsets are dense");
            offset += 1;
        }
    }
    Ok(())
}

/// The nodes' object store, to count its segment objects from outside.
enum Store {
    /// `--tiered-store <cluster dir>/tiered`.
    Directory,
    /// `--tiered-store s3://<bucket>/<S3_PREFIX>`.
    S3(S3Server),
}

const S3_PREFIX: &str = "logdex";

/// Segment copies (`*.log` objects) in the store.
async fn segment_objects(cluster: &Cluster, store: &Store) -> Result<BTreeSet<String>> {
    Ok(match store {
        Store::Directory => log_file_paths(&cluster.tiered_dir()).into_iter().collect(),
        Store::S3(s3) => s3.keys(cluster.api(), S3_PREFIX, ".log").await?.into_iter().collect(),
    })
}

fn options() -> ClusterOptions {
    ClusterOptions {
        spare_nodes: 1,
        tiered_store: true,
        cleaner_interval_ms: Some(200),
        snapshot_every: Some(40),
        ..ClusterOptions::plain(3)
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tiered_segments_serve_every_lookup_and_fetch_after_local_copies_are_gone() -> Result<()> {
    let mut cluster = Cluster::start_with(options()).await?;
    let outcome = scenario(&mut cluster, &Store::Directory).await;
    cluster.finish(outcome)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tiered_segments_in_an_s3_bucket_serve_every_lookup_and_fetch_after_local_copies_are_gone() -> Result<()> {
    let s3 = S3Server::start(&logdex_cluster_tests::Api::new()?, "logdex-tiered").await?;
    let options =
        ClusterOptions { tiered_store_url: Some(s3.store_url(S3_PREFIX)), node_env: s3.node_env(), ..options() };
    let mut cluster = Cluster::start_with(options).await?;
    let store = Store::S3(s3);
    let outcome = scenario(&mut cluster, &store).await;
    cluster.finish(outcome)
}

async fn scenario(cluster: &mut Cluster, store: &Store) -> Result<()> {
    let api = cluster.api().clone();
    let mut compacted = tiered_spec();
    compacted.config.insert("cleanup.policy".into(), Value::String("compact".into()));
    api.create_topic(&cluster.url(1), &compacted).await?.expect_error(400, "invalid_config")?;
    api.create_topic(&cluster.url(1), &tiered_spec()).await?.expect_status(201)?;
    cluster.wait_for_leaders(TOPIC, Duration::from_secs(20)).await?;
    for k in 0..KEYS {
        api.put(&cluster.url(1), TOPIC, format!("k-{k}").as_bytes(), value(k, 1).as_bytes())
            .await?
            .expect_status(200)?;
    }
    for k in 0..REWRITTEN {
        api.put(&cluster.url(2), TOPIC, format!("k-{k}").as_bytes(), value(k, 2).as_bytes())
            .await?
            .expect_status(200)?;
    }
    let records = (KEYS + REWRITTEN) as u64;

    // Copied to the store, deleted locally and every record applied on every replica.
    let mut seen = String::new();
    wait_until("segments are in the store and gone from every replica's disk", async || {
        let objects = segment_objects(cluster, store).await?;
        let end = remote_end(&objects);
        let local: Vec<Vec<u64>> = [1, 2, 3].iter().map(|id| local_bases(cluster, *id)).collect();
        // Follower reads below need every record applied on every replica.
        let mut applied = Vec::new();
        for id in [1, 2, 3] {
            applied.push(cluster.metric(id, "logdex_partition_high_watermark").await?);
        }
        seen = format!(
            "{} objects ending at {end}; high watermarks {applied:?}; local segment bases of nodes 1-3: {local:?}",
            objects.len()
        );
        Ok(objects.len() >= 10
            && end + ACTIVE_RECORDS_MAX >= records
            && applied.iter().all(|hw| *hw >= records)
            && [1, 2, 3].iter().all(|id| keeps_only_what_the_store_lacks(cluster, *id, end)))
    })
    .await
    .map_err(|e| Error::Check(format!("{e}: {seen}")))?;
    let d = cluster.describe(TOPIC).await?;
    ensure_eq!(d.partition(0)?.log_start_offset, 0, "the log still starts at 0: {d:?}");

    for id in [1, 2, 3] {
        check_lookups(cluster, id, &Read::follower()).await?;
        check_fetch(cluster, id, records).await?;
    }

    // A replica killed with -9 serves the remote segments again after its restart.
    cluster.kill(3)?;
    cluster.restart(3).await?;
    cluster.wait_for_leaders(TOPIC, Duration::from_secs(20)).await?;
    check_lookups(cluster, 3, &Read::linearizable()).await?;

    // A replica that joins through a move gets the manifest with its snapshot and builds its
    // index from the remote segments.
    cluster.start_spare(4).await?;
    let target = vec![1u64, 2, 4];
    let moved = api
        .request(
            reqwest::Method::PUT,
            &format!("{}/topics/{TOPIC}/partitions/0/replicas", cluster.url(1)),
            Some(Body::Json(json!({ "replicas": target }))),
        )
        .await?;
    ensure!(moved.status == 202 || moved.status == 200, "move answered {}", moved.summary());
    wait_until("the move to node 4 completes", async || {
        let d: Value = api.describe(&cluster.url(1), TOPIC).await?.json()?;
        let p = &d["partitions"][0];
        let replicas: Vec<u64> = p["replicas"].as_array().into_iter().flatten().filter_map(Value::as_u64).collect();
        Ok(p.get("move").is_none() && replicas == target)
    })
    .await?;
    check_lookups(cluster, 4, &Read::linearizable()).await?;
    check_fetch(cluster, 4, records).await?;
    let metrics = api.get_url(&format!("{}/metrics", cluster.url(4))).await?.text();
    let gauge = |name: &str| -> u64 {
        metrics.lines().filter(|l| l.starts_with(name)).filter_map(|l| l.rsplit(' ').next()?.parse::<u64>().ok()).sum()
    };
    ensure!(gauge("logdex_partition_snapshots_installed_total{") >= 1, "node 4 joined through a snapshot");
    ensure!(gauge("logdex_partition_remote_segments{") >= 10, "node 4's manifest names the copies");
    wait_until("node 4 keeps locally only what the store lacks", async || {
        let end = remote_end(&segment_objects(cluster, store).await?);
        Ok(keeps_only_what_the_store_lacks(cluster, 4, end))
    })
    .await
    .map_err(|e| Error::Check(format!("{e}: local segment bases {:?}", local_bases(cluster, 4))))?;

    // Retention trims the remote segments, their objects go, their keys answer 410.
    let objects = segment_objects(cluster, store).await?.len();
    set_retention_ms(cluster, "1").await?;
    wait_until("retention trims the remote segments", async || {
        let d = cluster.describe(TOPIC).await?;
        Ok(d.partition(0)?.log_start_offset > 0 && segment_objects(cluster, store).await?.len() < objects)
    })
    .await?;
    let old = format!("k-{}", REWRITTEN + 1);
    for id in [1, 2, 4] {
        let reply = api.get(&cluster.url(id), TOPIC, old.as_bytes(), &Read::linearizable()).await?;
        ensure_eq!(reply.status, 410, "node {id}, key {old} past retention: {}", reply.summary());
    }

    // Deleting the topic deletes its objects.
    set_retention_ms(cluster, "-1").await?;
    let before = segment_objects(cluster, store).await?;
    for k in 0..KEYS / 4 {
        api.put(&cluster.url(1), TOPIC, format!("n-{k}").as_bytes(), value(k, 3).as_bytes())
            .await?
            .expect_status(200)?;
    }
    // (Objects below the trim may still be going meanwhile: look for new ones, not for more.)
    wait_until("new segments are copied", async || {
        Ok(segment_objects(cluster, store).await?.iter().any(|o| !before.contains(o)))
    })
    .await?;
    api.request(reqwest::Method::DELETE, &format!("{}/topics/{TOPIC}", cluster.url(1)), None)
        .await?
        .expect_status(200)?;
    wait_until("the deleted topic's objects are gone", async || Ok(segment_objects(cluster, store).await?.is_empty()))
        .await?;
    Ok(())
}
