//! A replica whose storage fails (a failpoint of a `failpoints` build gives its segment log
//! the I/O error of a full disk) stops taking part in its group until its node restarts. The
//! node then says so: `/readyz` answers 503 naming the replica and the error, the
//! `logdex_partition_stopped` gauge is 1, and the write that met the error answers 503 saying
//! what happened. The replica names no leader any more (its metrics keep the one it last knew,
//! itself here), so writes through its node go to the leader the others elect, and reads
//! through its node go to the replicas that serve.

use std::time::Duration;

use logdex_cluster_tests::Cluster;
use logdex_cluster_tests::Read;
use logdex_cluster_tests::Result;
use logdex_cluster_tests::TopicSpec;
use logdex_cluster_tests::cluster::FAILPOINTS_ENV;
use logdex_cluster_tests::ensure;
use logdex_cluster_tests::ensure_eq;
use logdex_cluster_tests::support::Probe;
use logdex_cluster_tests::support::poll_until;

const TOPIC: &str = "disk";
/// The node whose storage fails: the preferred leader of the topic's one partition.
const VICTIM: u64 = 1;
/// Applies of produce entries the victim makes before its segment log write fails.
const APPLIES_BEFORE_FAILURE: u64 = 3;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leader_stopped_by_a_storage_error_makes_its_node_unready_and_writes_go_to_the_next_leader() -> Result<()> {
    let mut cluster = Cluster::start(3).await?;
    let outcome = leader_storage_failure(&mut cluster).await;
    cluster.finish(outcome)
}

async fn leader_storage_failure(cluster: &mut Cluster) -> Result<()> {
    let api = cluster.api().clone();
    cluster.kill(VICTIM)?;
    let armed = format!("partition::apply_io_error={APPLIES_BEFORE_FAILURE}*off->return");
    cluster.set_node_env(VICTIM, FAILPOINTS_ENV, &armed);
    cluster.restart(VICTIM).await?;
    let victim = cluster.url(VICTIM);
    api.create_topic(&victim, &TopicSpec::compacted(TOPIC, 1, 3)).await?.expect_status(201)?;
    poll_until("the victim leads the partition", Duration::from_secs(30), Duration::from_millis(250), || async {
        let leader = cluster.describe(TOPIC).await?.partitions[0].leader;
        Ok(if leader == Some(VICTIM) { Probe::Ready(()) } else { Probe::NotYet(format!("leader {leader:?}")) })
    })
    .await?;
    for i in 0..APPLIES_BEFORE_FAILURE {
        api.put(&victim, TOPIC, format!("k{i}").as_bytes(), b"v").await?.expect_status(200)?;
    }

    // The leader's apply of the next write fails: committed or not, the answer says why.
    let failed = api.put(&victim, TOPIC, b"k-failed", b"v").await?;
    ensure_eq!(failed.status, 503, "the write that met the error: {}", failed.summary());
    let text = failed.text();
    ensure!(text.contains("stopped on a storage error") && text.contains("No space left on device"), "{text}");

    poll_until(
        "the victim is not ready, naming the replica",
        Duration::from_secs(20),
        Duration::from_millis(250),
        || async {
            let ready = api.readyz(&victim).await?;
            let text = ready.text();
            Ok(
                if ready.status == 503
                    && text.contains(&format!("topic {TOPIC} partition 0"))
                    && text.contains("No space left")
                {
                    Probe::Ready(())
                } else {
                    Probe::NotYet(ready.summary())
                },
            )
        },
    )
    .await?;
    ensure_eq!(cluster.metric(VICTIM, "logdex_partition_stopped").await?, 1, "the victim's gauge");
    ensure_eq!(cluster.metric(2, "logdex_partition_stopped").await?, 0, "a healthy replica's gauge");

    // Writes through the victim's node reach the leader the other two elect.
    poll_until("a write through the victim's node", Duration::from_secs(20), Duration::from_millis(250), || async {
        let put = api.put(&victim, TOPIC, b"k-after", b"v").await?;
        Ok(if put.status == 200 { Probe::Ready(()) } else { Probe::NotYet(put.summary()) })
    })
    .await?;
    let leader = cluster.describe(TOPIC).await?.partitions[0].leader;
    ensure!(leader.is_some_and(|l| l != VICTIM), "the partition's leader after the failure: {leader:?}");
    for key in ["k0", "k1", "k2", "k-after"] {
        for node in [VICTIM, 2] {
            let got = api.get(&cluster.url(node), TOPIC, key.as_bytes(), &Read::linearizable()).await?;
            ensure_eq!(got.status, 200, "acknowledged key {key} through node {node}: {}", got.summary());
        }
    }
    // The stopped replica's state is frozen where it stopped: a follower read through its
    // node goes to a replica that serves (forwarded, so the reply names another node).
    poll_until(
        "a follower read through the victim's node",
        Duration::from_secs(10),
        Duration::from_millis(200),
        || async {
            let got = api.get(&victim, TOPIC, b"k-after", &Read::follower()).await?;
            Ok(if got.status == 200 { Probe::Ready(()) } else { Probe::NotYet(got.summary()) })
        },
    )
    .await?;
    Ok(())
}
