//! Replicas agree (DESIGN.md I3, I4): after 10,000 records, every replica holds
//! the same records at the same offsets and answers every key the same.

use std::collections::BTreeMap;
use std::time::Duration;
use std::time::Instant;

use logdex_cluster_tests::Cluster;
use logdex_cluster_tests::Result;
use logdex_cluster_tests::TopicSpec;
use logdex_cluster_tests::client::FetchResponse;
use logdex_cluster_tests::ensure;
use logdex_cluster_tests::ensure_eq;
use serde_json::json;

const TOPIC: &str = "ten-k";
const PARTITIONS: u32 = 4;
const RECORDS: usize = 10_000;
const PER_REQUEST: usize = 500;
/// Distinct keys: each is written four times.
const KEYS: usize = 2_500;
const CATCH_UP: Duration = Duration::from_secs(30);

/// One partition's records as a replica holds them: `(offset, key, value)`.
type PartitionRecords = Vec<(u64, Option<String>, Option<String>)>;

/// Writes 10,000 records (2,500 keys, each four times) through one node, waits
/// until every replica applied them, then checks that all three replicas hold
/// identical records at identical dense offsets and give identical lookup
/// answers (value and offset) for every key, reading each replica's own state.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replicas_hold_identical_logs_and_lookups_after_ten_thousand_records() -> Result<()> {
    let cluster = Cluster::start(3).await?;
    let outcome = agreement(&cluster).await;
    cluster.finish(outcome)
}

async fn agreement(cluster: &Cluster) -> Result<()> {
    let api = cluster.api();
    let base = cluster.url(1);
    api.create_topic(&base, &TopicSpec::compacted(TOPIC, PARTITIONS, 3)).await?.expect_status(201)?;
    cluster.wait_for_leaders(TOPIC, Duration::from_secs(20)).await?;
    for chunk in 0..RECORDS / PER_REQUEST {
        let records: Vec<_> = (chunk * PER_REQUEST..(chunk + 1) * PER_REQUEST)
            .map(|i| json!({ "key": format!("k-{}", i % KEYS), "value": format!("v-{i}") }))
            .collect();
        api.produce(&base, TOPIC, &json!({ "records": records })).await?.expect_status(200)?;
    }
    let nodes = cluster.node_ids();
    let mut logs: BTreeMap<u64, Vec<PartitionRecords>> = BTreeMap::new();
    for &node in &nodes {
        let mut partitions = Vec::new();
        for p in 0..PARTITIONS {
            partitions.push(replica_log(cluster, node, p).await?);
        }
        logs.insert(node, partitions);
    }
    let first = &logs[&nodes[0]];
    let total: usize = first.iter().map(Vec::len).sum();
    ensure_eq!(total, RECORDS, "records held by node {}", nodes[0]);
    for (p, records) in first.iter().enumerate() {
        ensure!(records.iter().enumerate().all(|(i, r)| r.0 == i as u64), "partition {p} offsets are not dense");
    }
    for (&node, partitions) in &logs {
        ensure!(partitions == first, "node {node} holds different records than node {}", nodes[0]);
    }
    for k in 0..KEYS {
        let key = format!("k-{k}");
        let mut answers = Vec::new();
        for &node in &nodes {
            let url = format!("{}/kv/{TOPIC}/{key}?read=follower", cluster.url(node));
            let reply = api.get_url(&url).await?;
            reply.expect_status(200)?;
            answers.push((reply.text(), reply.header_u64("x-kv-offset")?));
        }
        ensure!(answers.windows(2).all(|w| w[0] == w[1]), "key {key}: replicas answer {answers:?}");
        let last_write = (KEYS * 3 + k).to_string();
        ensure_eq!(answers[0].0, format!("v-{last_write}"), "key {key} must hold its last write");
    }
    Ok(())
}

/// All records of one partition as one replica holds them, once it applied
/// every record (its high watermark reached `RECORDS`' share of the partition).
async fn replica_log(cluster: &Cluster, node: u64, p: u32) -> Result<PartitionRecords> {
    let api = cluster.api();
    let deadline = Instant::now() + CATCH_UP;
    let leader_hw = {
        let url =
            format!("{}/topics/{TOPIC}/partitions/{p}/records?offset=0&max_records=1&read=strict", cluster.url(node));
        let page: FetchResponse = api.get_url(&url).await?.decode()?;
        page.high_watermark
    };
    let mut out = Vec::new();
    let mut offset = 0;
    while offset < leader_hw {
        let url = format!(
            "{}/topics/{TOPIC}/partitions/{p}/records?offset={offset}&max_records=1000&read=follower",
            cluster.url(node)
        );
        let page: FetchResponse = api.get_url(&url).await?.decode()?;
        if page.records.is_empty() {
            ensure!(Instant::now() < deadline, "node {node} partition {p} stuck at {offset} below {leader_hw}");
            tokio::time::sleep(Duration::from_millis(100)).await;
            continue;
        }
        for r in &page.records {
            out.push((r.offset, r.key.clone(), r.value.clone()));
        }
        offset = page.next_offset;
    }
    Ok(out)
}
