//! Linearizable reads from followers see writes acknowledged just before them
//! (DESIGN.md I6), in both linearizable (lease) and strict (read index) modes, also
//! between nodes that cannot use call streams and fall back to unary RPCs.

use logdex_cluster_tests::Cluster;
use logdex_cluster_tests::Read;
use logdex_cluster_tests::ReadMode;
use logdex_cluster_tests::Result;
use logdex_cluster_tests::TopicSpec;
use logdex_cluster_tests::cluster::FAILPOINTS_ENV;
use logdex_cluster_tests::ensure;
use logdex_cluster_tests::ensure_eq;
use std::time::Duration;

const TOPIC: &str = "ryw";
const ROUNDS: usize = 60;

/// For each round: write a new value for one key through the partition leader,
/// and as soon as it is acknowledged read it back from both followers, one in
/// `linearizable` and one in `strict` mode: each must return the new value and
/// an offset no older than the write's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn follower_linearizable_read_right_after_an_acknowledged_write_sees_it() -> Result<()> {
    let cluster = Cluster::start(3).await?;
    let outcome = rounds(&cluster).await;
    cluster.finish(outcome)
}

/// The leader of the topic's partition 0 and its two followers, once it has a leader.
async fn leader_and_followers(cluster: &Cluster) -> Result<(u64, [u64; 2])> {
    let described = cluster.wait_for_leaders(TOPIC, Duration::from_secs(20)).await?;
    let partition = described.partition(0)?;
    let leader =
        partition.leader.ok_or_else(|| logdex_cluster_tests::Error::Check("partition 0 has no leader".into()))?;
    let followers: Vec<u64> = partition.replicas.iter().copied().filter(|n| *n != leader).collect();
    match followers[..] {
        [a, b] => Ok((leader, [a, b])),
        _ => Err(logdex_cluster_tests::Error::Check(format!(
            "replicas {:?} led by {leader}: expected two followers",
            partition.replicas
        ))),
    }
}

async fn rounds(cluster: &Cluster) -> Result<()> {
    let api = cluster.api();
    let base = cluster.url(1);
    api.create_topic(&base, &TopicSpec::compacted(TOPIC, 1, 3)).await?;
    let (leader, followers) = leader_and_followers(cluster).await?;
    for round in 0..ROUNDS {
        let value = format!("value-{round}");
        let put = api.put(&cluster.url(leader), TOPIC, b"key", value.as_bytes()).await?;
        put.expect_status(200)?;
        let offset = put.header_u64("x-kv-offset")?;
        for (follower, mode) in [(followers[0], ReadMode::Linearizable), (followers[1], ReadMode::Strict)] {
            let read = api.get(&cluster.url(follower), TOPIC, b"key", &Read::mode(mode)).await?;
            read.expect_status(200)?;
            ensure_eq!(read.text(), value, "round {round}: node {follower} in {mode:?} mode");
            ensure!(read.header_u64("x-kv-offset")? >= offset, "round {round}: stale offset from node {follower}");
            ensure_eq!(read.header_u64("x-kv-node")?, follower, "round {round}: read was not served by the follower");
        }
    }
    Ok(())
}

/// The same rounds with every node answering the `Calls` stream with UNIMPLEMENTED, as a
/// node from before call streams does (fail point `rpc::calls_unsupported`, a failpoints
/// build): read-index requests and, in a second pass, writes sent to a follower and
/// forwarded to the leader travel over the unary RPCs instead, with the same answers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nodes_without_call_streams_serve_follower_reads_and_forwarded_writes_over_unary_rpcs() -> Result<()> {
    let mut cluster = Cluster::start(3).await?;
    let outcome = without_call_streams(&mut cluster).await;
    cluster.finish(outcome)
}

async fn without_call_streams(cluster: &mut Cluster) -> Result<()> {
    cluster.stop_all()?;
    for id in cluster.node_ids() {
        cluster.set_node_env(id, FAILPOINTS_ENV, "rpc::calls_unsupported=return");
    }
    cluster.restart_all().await?;
    for id in cluster.node_ids() {
        let log = cluster.launch_log(id)?;
        ensure!(
            log.contains("crash points armed") && log.contains("rpc::calls_unsupported"),
            "node {id} did not arm rpc::calls_unsupported: is the binary a failpoints build \
             (`cargo build -p logdex-api --bin logdex --features failpoints`)?"
        );
    }
    rounds(cluster).await?;
    forwarded_rounds(cluster).await
}

/// Writes through one follower (forwarded to the leader), reads back through the other.
async fn forwarded_rounds(cluster: &Cluster) -> Result<()> {
    let api = cluster.api();
    let (_, followers) = leader_and_followers(cluster).await?;
    for round in 0..ROUNDS {
        let value = format!("forwarded-{round}");
        let put = api.put(&cluster.url(followers[0]), TOPIC, b"key", value.as_bytes()).await?;
        put.expect_status(200)?;
        let offset = put.header_u64("x-kv-offset")?;
        let read = api.get(&cluster.url(followers[1]), TOPIC, b"key", &Read::mode(ReadMode::Linearizable)).await?;
        read.expect_status(200)?;
        ensure_eq!(
            read.text(),
            value,
            "round {round}: node {} after a write through node {}",
            followers[1],
            followers[0]
        );
        ensure!(read.header_u64("x-kv-offset")? >= offset, "round {round}: stale offset from node {}", followers[1]);
    }
    Ok(())
}
