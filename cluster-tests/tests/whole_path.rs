//! The whole path, fast: create a replicated topic, write through one node, read from every
//! node in every read mode, and describe.

use std::collections::BTreeMap;
use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Duration;

use logdex_cluster_tests::Api;
use logdex_cluster_tests::Cluster;
use logdex_cluster_tests::Read;
use logdex_cluster_tests::ReadMode;
use logdex_cluster_tests::Reply;
use logdex_cluster_tests::Result;
use logdex_cluster_tests::TopicDescription;
use logdex_cluster_tests::TopicSpec;
use logdex_cluster_tests::Written;
use logdex_cluster_tests::client::HEADER_HIGH_WATERMARK;
use logdex_cluster_tests::client::HEADER_NODE;
use logdex_cluster_tests::client::HEADER_OFFSET;
use logdex_cluster_tests::client::HEADER_PARTITION;
use logdex_cluster_tests::client::HEADER_TIMESTAMP;
use logdex_cluster_tests::client::written;
use logdex_cluster_tests::ensure;
use logdex_cluster_tests::ensure_eq;
use logdex_cluster_tests::support::Failures;
use logdex_cluster_tests::support::Probe;
use logdex_cluster_tests::support::poll_until;
use logdex_cluster_tests::support::settled;
use logdex_cluster_tests::support::test_rng;
use rand::Rng as _;
use tokio::sync::Semaphore;
use tokio::task::JoinSet;

const TOPIC: &str = "whole-path";
const PARTITIONS: u32 = 6;
const REPLICATION_FACTOR: u32 = 3;
const NODES: usize = 3;
const KEYS: usize = 300;
/// Concurrent requests the test keeps in flight.
const IN_FLIGHT: usize = 16;
/// Attempts of a write that answers 503 (no leader yet) before the test fails.
const WRITE_ATTEMPTS_MAX: u32 = 5;
const SETTLE_TIMEOUT: Duration = Duration::from_secs(20);

/// Writes 300 keys through node 1 of a 3-node cluster into a 6-partition, rf-3 topic, and checks
/// that every node answers every key with its value, partition, offset, a high watermark above
/// the offset, its node id and a timestamp, both linearizably and from its own replica
/// (follower mode with `min_offset`); that offsets are dense per partition; and that describe
/// shows 6 partitions of 3 replicas, each with a leader, the leaders on more than one node.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keys_written_through_one_node_are_readable_from_every_node() -> Result<()> {
    let cluster = Cluster::start(NODES).await?;
    let outcome = whole_path(&cluster).await;
    cluster.finish(outcome)
}

async fn whole_path(cluster: &Cluster) -> Result<()> {
    let (_, mut rng) = test_rng("whole_path")?;
    let api = cluster.api();
    let created =
        api.create_topic(&cluster.url(1), &TopicSpec::compacted(TOPIC, PARTITIONS, REPLICATION_FACTOR)).await?;
    created.expect_status(201)?;
    let description: TopicDescription = created.decode()?;
    ensure_eq!(description.name.as_str(), TOPIC, "create answers the description of the topic");
    ensure_eq!(description.partitions.len(), PARTITIONS as usize, "partitions in the create answer");
    cluster.wait_for_leaders(TOPIC, SETTLE_TIMEOUT).await?;

    let entries: Vec<(Vec<u8>, Vec<u8>)> = (0..KEYS)
        .map(|i| (format!("key-{i:03}").into_bytes(), format!("value-{i}-{:016x}", rng.random::<u64>()).into_bytes()))
        .collect();
    let writes = write_all(api, &cluster.url(1), &entries).await?;
    check_dense_offsets(cluster, &writes).await?;
    read_all_from_every_node(cluster, &entries, &writes).await?;
    check_describe(cluster).await
}

/// PUTs every entry through `base`, `IN_FLIGHT` at a time; every write must answer 200.
async fn write_all(api: &Api, base: &str, entries: &[(Vec<u8>, Vec<u8>)]) -> Result<Vec<Written>> {
    let permits = Arc::new(Semaphore::new(IN_FLIGHT));
    let mut tasks = JoinSet::new();
    for (i, (key, value)) in entries.iter().cloned().enumerate() {
        let (api, base, permits) = (api.clone(), base.to_string(), permits.clone());
        tasks.spawn(async move {
            let _permit = permits.acquire_owned().await;
            let mut reply = api.put(&base, TOPIC, &key, &value).await?;
            for _ in 1..WRITE_ATTEMPTS_MAX {
                if reply.status != 503 {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(250)).await;
                reply = api.put(&base, TOPIC, &key, &value).await?;
            }
            Ok::<_, logdex_cluster_tests::Error>((i, written(&reply)?))
        });
    }
    let mut writes = vec![None; entries.len()];
    let mut failures = Failures::default();
    while let Some(joined) = tasks.join_next().await {
        let joined = joined.map_err(|e| logdex_cluster_tests::Error::Check(format!("write task panicked: {e}")))?;
        if let Some((i, w)) = failures.record(joined) {
            writes[i] = Some(w);
        }
    }
    failures.into_result(entries.len(), "PUTs through node 1")?;
    Ok(writes.into_iter().flatten().collect())
}

/// The offsets acknowledged for one fresh partition are exactly `log_start..high_watermark`
/// (dense, invariant I4), once describe's high watermark reaches the number of writes.
async fn check_dense_offsets(cluster: &Cluster, writes: &[Written]) -> Result<()> {
    let mut by_partition: BTreeMap<u32, Vec<u64>> = BTreeMap::new();
    for w in writes {
        ensure!(
            w.partition < PARTITIONS,
            "write acknowledged in partition {} of a {PARTITIONS}-partition topic",
            w.partition
        );
        by_partition.entry(w.partition).or_default().push(w.offset);
    }
    let description = poll_until(
        "describe's high watermarks to cover every write",
        SETTLE_TIMEOUT,
        Duration::from_millis(200),
        || {
            let by_partition = &by_partition;
            async move {
                let d = cluster.describe(TOPIC).await?;
                let behind: Vec<_> = d
                    .partitions
                    .iter()
                    .filter(|p| {
                        p.high_watermark
                            < p.log_start_offset + by_partition.get(&p.partition).map_or(0, |o| o.len() as u64)
                    })
                    .map(|p| (p.partition, p.log_start_offset, p.high_watermark))
                    .collect();
                Ok(if behind.is_empty() {
                    Probe::Ready(d)
                } else {
                    Probe::NotYet(format!("(partition, log start, HW) behind: {behind:?}"))
                })
            }
        },
    )
    .await?;
    for p in &description.partitions {
        let mut offsets = by_partition.get(&p.partition).cloned().unwrap_or_default();
        offsets.sort_unstable();
        let expected: Vec<u64> = (p.log_start_offset..p.high_watermark).collect();
        ensure!(
            offsets == expected,
            "partition {}: acknowledged offsets {offsets:?} are not exactly log start {} .. high watermark {}",
            p.partition,
            p.log_start_offset,
            p.high_watermark
        );
    }
    Ok(())
}

/// Every key from every node: linearizable, then follower with `min_offset` = its offset.
async fn read_all_from_every_node(cluster: &Cluster, entries: &[(Vec<u8>, Vec<u8>)], writes: &[Written]) -> Result<()> {
    let permits = Arc::new(Semaphore::new(IN_FLIGHT));
    let mut tasks = JoinSet::new();
    for node in cluster.node_ids() {
        for ((key, value), w) in entries.iter().cloned().zip(writes.iter().copied()) {
            let (api, base, permits) = (cluster.api().clone(), cluster.url(node), permits.clone());
            tasks.spawn(async move {
                let _permit = permits.acquire_owned().await;
                for read in [Read::linearizable(), Read::follower().min_offset(w.offset)] {
                    let mode = read.mode.unwrap_or(ReadMode::Linearizable);
                    let what = format!("GET {} from node {node} ({})", String::from_utf8_lossy(&key), mode.as_str());
                    let reply = settled(&what, SETTLE_TIMEOUT, || api.get(&base, TOPIC, &key, &read)).await?;
                    check_hit(&reply, &value, w, node, mode)?;
                }
                Ok::<_, logdex_cluster_tests::Error>(())
            });
        }
    }
    let mut failures = Failures::default();
    let mut checked = 0;
    while let Some(joined) = tasks.join_next().await {
        checked += 1;
        let joined = joined.map_err(|e| logdex_cluster_tests::Error::Check(format!("read task panicked: {e}")))?;
        failures.record(joined);
    }
    eprintln!("read {checked} (node, key) pairs, linearizable and follower");
    failures.into_result(checked, "(node, key) reads")
}

/// A 200 lookup carrying `value` written at `w`, served per the mode asked of `node`.
fn check_hit(reply: &Reply, value: &[u8], w: Written, node: u64, mode: ReadMode) -> Result<()> {
    reply.expect_status(200)?;
    ensure!(reply.body == value, "expected value {:?}: {}", String::from_utf8_lossy(value), reply.summary());
    ensure_eq!(reply.header_u64(HEADER_PARTITION)?, u64::from(w.partition), "X-Kv-Partition of {}", reply.summary());
    ensure_eq!(reply.header_u64(HEADER_OFFSET)?, w.offset, "X-Kv-Offset of {}", reply.summary());
    let hw = reply.header_u64(HEADER_HIGH_WATERMARK)?;
    ensure!(hw > w.offset, "X-Kv-High-Watermark {hw} is not above X-Kv-Offset {}: {}", w.offset, reply.summary());
    let serving = reply.header_u64(HEADER_NODE)?;
    ensure!(
        (1..=NODES as u64).contains(&serving),
        "X-Kv-Node {serving} is not a node of the cluster: {}",
        reply.summary()
    );
    if mode == ReadMode::Follower {
        ensure_eq!(serving, node, "follower mode is answered by the receiving hosting replica: {}", reply.summary());
    }
    let timestamp = reply.header(HEADER_TIMESTAMP).unwrap_or_default();
    ensure!(
        timestamp.trim().parse::<i64>().is_ok(),
        "X-Kv-Timestamp {timestamp:?} is not an integer: {}",
        reply.summary()
    );
    Ok(())
}

/// Describe from every node: 6 partitions, 3 distinct replicas each, a leader among them;
/// leaders on more than one node.
async fn check_describe(cluster: &Cluster) -> Result<()> {
    let nodes: BTreeSet<u64> = cluster.node_ids().into_iter().collect();
    let mut leaders_seen = BTreeSet::new();
    for node in cluster.node_ids() {
        let d = cluster.api().describe_ok(&cluster.url(node), TOPIC).await?;
        ensure_eq!(d.name.as_str(), TOPIC, "describe name from node {node}");
        ensure_eq!(d.replication_factor, REPLICATION_FACTOR, "describe replication_factor from node {node}");
        ensure_eq!(
            d.config.get("cleanup.policy").and_then(|v| v.as_str()),
            Some("compact"),
            "describe config cleanup.policy from node {node}"
        );
        let numbers: Vec<u32> = d.partitions.iter().map(|p| p.partition).collect();
        ensure_eq!(numbers, (0..PARTITIONS).collect::<Vec<_>>(), "partitions described by node {node}");
        for p in &d.partitions {
            let replicas: BTreeSet<u64> = p.replicas.iter().copied().collect();
            ensure!(
                p.replicas.len() == REPLICATION_FACTOR as usize
                    && replicas.len() == p.replicas.len()
                    && replicas.is_subset(&nodes),
                "node {node} describes partition {} with replicas {:?}, expected {REPLICATION_FACTOR} distinct nodes of {nodes:?}",
                p.partition,
                p.replicas
            );
            let Some(leader) = p.leader else {
                return Err(logdex_cluster_tests::Error::Check(format!(
                    "node {node} describes partition {} without a leader: {d:?}",
                    p.partition
                )));
            };
            ensure!(
                replicas.contains(&leader),
                "partition {} leader {leader} is not one of its replicas {:?}",
                p.partition,
                p.replicas
            );
            if node == 1 {
                leaders_seen.insert(leader);
            }
        }
    }
    ensure!(leaders_seen.len() > 1, "all {PARTITIONS} partition leaders are on one node: {leaders_seen:?}");
    Ok(())
}
