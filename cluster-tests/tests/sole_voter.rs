//! A replica that is its group's only voter (a one-node cluster's controller, a
//! replication-factor-1 partition) leads at once: when its group is created and every time its
//! node starts again after `kill -9`, without waiting for an election timer that no other
//! replica could beat (openraft elects a sole voter on its first tick; the restart time of
//! `logdex bench recovery` depends on it).
//!
//! The node runs with a 60 s minimum election timeout. Every wait of the test is bounded by
//! the harness's 30 s readiness deadline, so a node that waited for its election timer would
//! fail the test rather than pass it slowly.

use std::time::Duration;

use logdex_cluster_tests::Cluster;
use logdex_cluster_tests::Read;
use logdex_cluster_tests::Result;
use logdex_cluster_tests::TopicSpec;
use logdex_cluster_tests::client::HEADER_PARTITION;
use logdex_cluster_tests::cluster::ClusterOptions;
use logdex_cluster_tests::ensure_eq;

const TOPIC: &str = "sole-voter";
const PARTITIONS: u32 = 3;
/// Keys written, spread over the partitions by the key hash.
const KEYS: usize = 12;
/// Far beyond every deadline of the test.
const ELECTION_TIMEOUT_MS: u64 = 60_000;
/// Leaders of a new topic, well under the election timeout.
const LEADERS_TIMEOUT: Duration = Duration::from_secs(20);

/// Creates a 3-partition topic of replication factor 1 on a one-node cluster, writes keys to
/// every partition, then kills the node with `kill -9` and starts it again, twice: each time it
/// must be ready (controller and every partition led) within the harness's 30 s, and answer
/// every key linearizably with the value written.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sole_voter_leads_at_creation_and_after_every_restart_without_its_election_timeout() -> Result<()> {
    let options = ClusterOptions { election_timeout_ms: Some(ELECTION_TIMEOUT_MS), ..ClusterOptions::plain(1) };
    let mut cluster = Cluster::start_with(options).await?;
    let outcome = restarts(&mut cluster).await;
    cluster.finish(outcome)
}

async fn restarts(cluster: &mut Cluster) -> Result<()> {
    let api = cluster.api().clone();
    api.create_topic(&cluster.url(1), &TopicSpec::compacted(TOPIC, PARTITIONS, 1)).await?.expect_status(201)?;
    cluster.wait_for_leaders(TOPIC, LEADERS_TIMEOUT).await?;
    let mut keys = Vec::new();
    let mut partitions = std::collections::BTreeSet::new();
    for i in 0..KEYS {
        let (key, value) = (format!("key-{i}"), format!("value-{i}"));
        let written = api.put(&cluster.url(1), TOPIC, key.as_bytes(), value.as_bytes()).await?;
        partitions.insert(written.expect_status(200)?.header_u64(HEADER_PARTITION)?);
        keys.push((key, value));
    }
    ensure_eq!(partitions.len(), PARTITIONS as usize, "the keys cover every partition");
    for restart in 1..=2 {
        cluster.kill(1)?;
        // Ready within the harness's 30 s, or an error.
        cluster.restart(1).await?;
        for (key, value) in &keys {
            let reply = api.get(&cluster.url(1), TOPIC, key.as_bytes(), &Read::linearizable()).await?;
            reply.expect_status(200)?;
            ensure_eq!(reply.text(), value.clone(), "{key} after restart {restart}");
        }
    }
    Ok(())
}
