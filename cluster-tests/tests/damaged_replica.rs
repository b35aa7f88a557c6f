//! A replica whose copy of a record is damaged does not answer it wrong, and a lookup that
//! reaches it still gets the right answer: it is forwarded once to a healthy replica. With
//! `forward=false` (or when it was itself forwarded) the damaged replica answers 500
//! `corrupt_data`.

use std::time::Duration;

use logdex_cluster_tests::Cluster;
use logdex_cluster_tests::Error;
use logdex_cluster_tests::Read;
use logdex_cluster_tests::Result;
use logdex_cluster_tests::TopicSpec;
use logdex_cluster_tests::damage;
use logdex_cluster_tests::ensure;
use logdex_cluster_tests::ensure_eq;
use serde_json::Value;

const TOPIC: &str = "dmg";
const KEYS: usize = 60;

fn value(k: usize) -> String {
    format!("value-{k}-{}", "y".repeat(40))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lookup_of_a_damaged_record_is_answered_by_a_healthy_replica() -> Result<()> {
    let mut cluster = Cluster::start(3).await?;
    let outcome = scenario(&mut cluster).await;
    cluster.finish(outcome)
}

async fn scenario(cluster: &mut Cluster) -> Result<()> {
    let api = cluster.api().clone();
    let mut spec = TopicSpec::compacted(TOPIC, 1, 3);
    spec.config.insert("cleanup.policy".into(), Value::String("delete".into()));
    spec.config.insert("segment.bytes".into(), Value::String("1024".into()));
    api.create_topic(&cluster.url(1), &spec).await?.expect_status(201)?;
    let d = cluster.wait_for_leaders(TOPIC, Duration::from_secs(20)).await?;
    let leader = d.partition(0)?.leader.ok_or_else(|| Error::Check("no leader".into()))?;
    for k in 0..KEYS {
        api.put(&cluster.url(1), TOPIC, format!("k-{k}").as_bytes(), value(k).as_bytes()).await?.expect_status(200)?;
    }
    let follower = [1, 2, 3].into_iter().find(|n| *n != leader).ok_or_else(|| Error::Check("no follower".into()))?;
    // Every replica has applied every write before the follower stops.
    for k in 0..KEYS {
        let read = Read::follower().min_offset(KEYS as u64 - 1);
        api.get(&cluster.url(follower), TOPIC, format!("k-{k}").as_bytes(), &read).await?.expect_status(200)?;
    }

    // Flip a bit inside the first record of the follower's oldest sealed segment.
    cluster.kill(follower)?;
    let log_dir = std::fs::read_dir(cluster.data_dir(follower).join("partitions"))
        .map_err(|e| Error::io("listing partitions", e))?
        .filter_map(|e| e.ok().map(|e| e.path().join("log")))
        .next()
        .ok_or_else(|| Error::Check("the follower holds no replica".into()))?;
    let mut segments: Vec<_> = std::fs::read_dir(&log_dir)
        .map_err(|e| Error::io("listing segments", e))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "log"))
        .collect();
    segments.sort();
    ensure!(segments.len() > 1, "the follower has a sealed segment: {segments:?}");
    let file = &segments[0];
    let mut bytes = std::fs::read(file).map_err(|e| Error::io("reading the segment", e))?;
    let batch = damage::batches(&bytes).into_iter().next().ok_or_else(|| Error::Check("no batch".into()))?;
    let start = batch.position as usize;
    let keys = damage::records(&bytes[start..start + batch.size as usize]);
    let key = keys.first().and_then(|(k, _)| k.clone()).ok_or_else(|| Error::Check("no keyed record".into()))?;
    // The last byte of the batch: inside its last record's value.
    bytes[start + batch.size as usize - 1] ^= 0x20;
    std::fs::write(file, &bytes).map_err(|e| Error::io("writing the segment", e))?;
    cluster.restart(follower).await?;
    let k: usize = key.trim_start_matches("k-").parse().map_err(|_| Error::Check(format!("key {key}")))?;

    let refused = api.get(&cluster.url(follower), TOPIC, key.as_bytes(), &Read::follower().forward(false)).await?;
    refused.expect_error(500, "corrupt_data")?;
    let reply = api.get(&cluster.url(follower), TOPIC, key.as_bytes(), &Read::follower()).await?;
    reply.expect_status(200)?;
    ensure_eq!(reply.text(), value(k), "the damaged key's value, from a healthy replica");
    let answered_by = reply.header_u64("x-kv-node")?;
    ensure!(answered_by != follower, "node {answered_by} answered: not the damaged replica");
    Ok(())
}
