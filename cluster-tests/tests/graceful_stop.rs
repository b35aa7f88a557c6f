//! A node stopped with SIGTERM hands the leaderships it holds over before it exits, as Kafka's
//! controlled shutdown does: its partitions and the controller have a leader on another node
//! when it is gone, long before an election timeout could have elected one.

use std::time::Duration;

use logdex_cluster_tests::Cluster;
use logdex_cluster_tests::Error;
use logdex_cluster_tests::Read;
use logdex_cluster_tests::Result;
use logdex_cluster_tests::TopicSpec;
use logdex_cluster_tests::cluster::ClusterOptions;
use logdex_cluster_tests::ensure;
use logdex_cluster_tests::ensure_eq;
use logdex_cluster_tests::support::Probe;
use logdex_cluster_tests::support::poll_until;
use serde_json::Value;

const TOPIC: &str = "stopping";
/// Elections wait this long (and up to twice as long) after a leader falls silent, so a leader
/// seen within [`HANDED_OVER_WITHIN`] of the stop was handed the leadership, not elected.
const ELECTION_TIMEOUT_MS: u64 = 12_000;
const HANDED_OVER_WITHIN: Duration = Duration::from_secs(3);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_stopped_with_sigterm_hands_its_leaderships_over_first() -> Result<()> {
    let options = ClusterOptions { election_timeout_ms: Some(ELECTION_TIMEOUT_MS), ..ClusterOptions::plain(3) };
    let mut cluster = Cluster::start_with(options).await?;
    let outcome = stop_the_controller_leader(&mut cluster).await;
    cluster.finish(outcome)
}

async fn stop_the_controller_leader(cluster: &mut Cluster) -> Result<()> {
    let api = cluster.api().clone();
    // A create answers once the partitions have leaders; should a first election fail on a
    // loaded machine, the next waits an election timeout, longer than the client's own.
    let patient = logdex_cluster_tests::Api::with_timeout(Duration::from_secs(4 * ELECTION_TIMEOUT_MS / 1000))?;
    patient.create_topic(&cluster.url(1), &TopicSpec::compacted(TOPIC, 3, 3)).await?.expect_status(201)?;
    let view: Value = api.cluster(&cluster.url(1)).await?.json()?;
    let stopping =
        view["controller_leader"].as_u64().ok_or_else(|| Error::Check(format!("no controller leader: {view}")))?;
    let other = cluster.node_ids().into_iter().find(|id| *id != stopping).unwrap_or(stopping);
    // Each node is the preferred replica of one partition; the balancer gives it that one.
    let led = poll_until(
        "the stopping node leads a partition",
        Duration::from_secs(60),
        Duration::from_millis(200),
        || async {
            let described = api.describe_ok(&cluster.url(other), TOPIC).await?;
            let led: Vec<u32> =
                described.partitions.iter().filter(|p| p.leader == Some(stopping)).map(|p| p.partition).collect();
            let all_led = described.partitions.iter().all(|p| p.leader.is_some());
            Ok(if all_led && !led.is_empty() { Probe::Ready(led) } else { Probe::NotYet(format!("{described:?}")) })
        },
    )
    .await?;
    let mut written = Vec::new();
    for i in 0..12 {
        let key = format!("k{i}");
        let reply = api.put(&cluster.url(other), TOPIC, key.as_bytes(), b"before the stop").await?;
        reply.expect_status(200)?;
        written.push(key);
    }

    let status = cluster.terminate(stopping, Duration::from_secs(30)).await?;
    ensure!(status.success(), "node {stopping} exited with {status} after SIGTERM");
    let log = cluster.launch_log(stopping)?;
    ensure!(
        log.contains("handed the leaderships of this node's groups over"),
        "node {stopping} logged no handoff: {log}"
    );
    let url = cluster.url(other);
    poll_until(
        &format!("other nodes lead everything node {stopping} led"),
        HANDED_OVER_WITHIN,
        Duration::from_millis(100),
        || async {
            let view: Value = api.cluster(&url).await?.json()?;
            let described = api.describe_ok(&url, TOPIC).await?;
            let leaders: Vec<Option<u64>> = described.partitions.iter().map(|p| p.leader).collect();
            let controller = view["controller_leader"].as_u64();
            let handed =
                controller.is_some_and(|l| l != stopping) && leaders.iter().all(|l| l.is_some_and(|l| l != stopping));
            Ok(if handed {
                Probe::Ready(())
            } else {
                Probe::NotYet(format!("controller {controller:?}, leaders {leaders:?} (node {stopping} led {led:?})"))
            })
        },
    )
    .await?;

    for key in &written {
        let reply = api.get(&url, TOPIC, key.as_bytes(), &Read::linearizable()).await?;
        ensure_eq!(reply.status, 200, "{key} after the stop: {}", reply.summary());
    }
    api.put(&url, TOPIC, b"after", b"the stop").await?.expect_status(200)?;
    cluster.restart(stopping).await
}
