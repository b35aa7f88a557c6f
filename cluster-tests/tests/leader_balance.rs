//! Preferred-leader balancing: a partition's leadership goes back to its first replica (the
//! preferred leader, `replicas[0]` in describe) once the node holding it is back and caught up,
//! so a node that restarts leads its share of the partitions again.
//!
//! The nodes run with `--leader-balance-interval-secs 1` (the default is a minute) so the test
//! sees a pass within its bounded waits.

use std::collections::BTreeMap;
use std::time::Duration;

use logdex_cluster_tests::Cluster;
use logdex_cluster_tests::Error;
use logdex_cluster_tests::Read;
use logdex_cluster_tests::Result;
use logdex_cluster_tests::TopicSpec;
use logdex_cluster_tests::client::TopicDescription;
use logdex_cluster_tests::cluster::ClusterOptions;
use logdex_cluster_tests::ensure;
use logdex_cluster_tests::ensure_eq;
use logdex_cluster_tests::support::Probe;
use logdex_cluster_tests::support::poll_until;

const TOPIC: &str = "balanced";
const NODES: usize = 3;
const PARTITIONS: u32 = 3;
/// Keys written in each phase, spread over the partitions by the key hash.
const KEYS: usize = 24;
const BALANCE_INTERVAL_SECS: &str = "1";
/// Leaders of a new topic, a failover, and the handing back after a restart: a few balance
/// passes and elections each.
const LEADERS_TIMEOUT: Duration = Duration::from_secs(30);

/// Creates a 3-partition topic on 3 nodes and checks that every partition is led by its
/// preferred replica; kills the preferred leader of partition 0 with `kill -9`, checks that the
/// survivors lead every partition and take writes, restarts it, and checks that every
/// partition is led by its preferred replica again, on every node's view, that a node counted
/// the hand-back, and that every node answers every key linearizably with its last written value.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_node_gets_the_leadership_of_its_preferred_partitions_back() -> Result<()> {
    let options = ClusterOptions {
        node_env: vec![("LOGDEX_LEADER_BALANCE_INTERVAL_SECS".into(), BALANCE_INTERVAL_SECS.into())],
        ..ClusterOptions::plain(NODES)
    };
    let mut cluster = Cluster::start_with(options).await?;
    let outcome = restart_and_rebalance(&mut cluster).await;
    cluster.finish(outcome)
}

async fn restart_and_rebalance(cluster: &mut Cluster) -> Result<()> {
    let api = cluster.api().clone();
    api.create_topic(&cluster.url(1), &TopicSpec::compacted(TOPIC, PARTITIONS, 3)).await?.expect_status(201)?;
    let placed = preferred_leaders(cluster).await?;
    let preferred: BTreeMap<u32, u64> =
        placed.partitions.iter().filter_map(|p| Some((p.partition, *p.replicas.first()?))).collect();
    ensure_eq!(preferred.len(), PARTITIONS as usize, "every partition has a preferred replica");
    let victim = preferred[&0];
    eprintln!("preferred leaders {preferred:?}; killing node {victim}");

    let mut values = BTreeMap::new();
    write_keys(cluster, 1, &mut values, "before").await?;
    cluster.kill(victim)?;
    let failed_over = cluster.wait_for_leaders(TOPIC, LEADERS_TIMEOUT).await?;
    for p in &failed_over.partitions {
        ensure!(p.leader != Some(victim), "partition {} still led by the killed node {victim}", p.partition);
    }
    let survivor = cluster.running_ids().first().copied().ok_or_else(|| Error::Check("no node running".into()))?;
    write_keys(cluster, survivor, &mut values, "while-down").await?;

    cluster.restart(victim).await?;
    let rebalanced = preferred_leaders(cluster).await?;
    ensure_eq!(rebalanced.partition(0)?.leader, Some(victim), "partition 0 is led by its preferred replica again");
    let mut handoffs = 0;
    for id in cluster.node_ids() {
        handoffs += cluster.metric(id, "logdex_leadership_handoffs_total").await?;
    }
    ensure!(handoffs >= 1, "no node counted a leadership handed back (logdex_leadership_handoffs_total)");

    for id in cluster.node_ids() {
        for (key, value) in &values {
            let reply = api.get(&cluster.url(id), TOPIC, key.as_bytes(), &Read::linearizable()).await?;
            reply.expect_status(200)?;
            ensure_eq!(reply.text(), *value, "node {id}, key {key}");
        }
    }
    Ok(())
}

/// Waits until every node describes every partition of the topic as led by its first replica;
/// returns the last description.
async fn preferred_leaders(cluster: &Cluster) -> Result<TopicDescription> {
    let ids = cluster.node_ids();
    poll_until(
        "every partition led by its preferred replica on every node",
        LEADERS_TIMEOUT,
        Duration::from_millis(200),
        || async {
            let mut last = None;
            let mut seen = Vec::new();
            for &id in &ids {
                let description = match cluster.api().describe(&cluster.url(id), TOPIC).await {
                    Ok(reply) if reply.status == 200 => reply.decode::<TopicDescription>()?,
                    Ok(reply) => return Ok(Probe::NotYet(format!("node {id}: {}", reply.summary()))),
                    Err(e) => return Ok(Probe::NotYet(format!("node {id}: {e}"))),
                };
                let leaders: Vec<(u32, Option<u64>, Option<u64>)> = description
                    .partitions
                    .iter()
                    .map(|p| (p.partition, p.leader, p.replicas.first().copied()))
                    .collect();
                let preferred = leaders.iter().all(|(_, leader, first)| leader.is_some() && leader == first);
                if !preferred || description.partitions.len() != PARTITIONS as usize {
                    seen.push(format!("node {id}: (partition, leader, preferred) {leaders:?}"));
                }
                last = Some(description);
            }
            match last {
                Some(description) if seen.is_empty() => Ok(Probe::Ready(description)),
                _ => Ok(Probe::NotYet(seen.join("; "))),
            }
        },
    )
    .await
}

/// Writes `KEYS` keys through node `via`, recording each value written.
async fn write_keys(cluster: &Cluster, via: u64, values: &mut BTreeMap<String, String>, phase: &str) -> Result<()> {
    for i in 0..KEYS {
        let (key, value) = (format!("key-{i}"), format!("{phase}-{i}"));
        cluster.api().put(&cluster.url(via), TOPIC, key.as_bytes(), value.as_bytes()).await?.expect_status(200)?;
        values.insert(key, value);
    }
    Ok(())
}
