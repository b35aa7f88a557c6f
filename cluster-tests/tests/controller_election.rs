//! Admin writes wait for the controller's election: after every node stopped, the first one
//! back is no quorum, and an alter sent to it waits (bounded) until a second node is back and
//! the controller elected a leader, instead of answering 503 at once.

use std::time::Duration;

use logdex_cluster_tests::Cluster;
use logdex_cluster_tests::Result;
use logdex_cluster_tests::TopicSpec;
use logdex_cluster_tests::client::Body;
use logdex_cluster_tests::cluster::ClusterOptions;
use logdex_cluster_tests::ensure;
use logdex_cluster_tests::ensure_eq;
use logdex_cluster_tests::proxy::Fault;
use logdex_cluster_tests::support::Probe;
use logdex_cluster_tests::support::poll_until;
use serde_json::Value;
use serde_json::json;

const TOPIC: &str = "elect";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_alter_while_the_controller_has_no_leader_waits_for_the_election() -> Result<()> {
    let mut cluster = Cluster::start(3).await?;
    let outcome = scenario(&mut cluster).await;
    cluster.finish(outcome)
}

async fn scenario(cluster: &mut Cluster) -> Result<()> {
    let api = cluster.api().clone();
    api.create_topic(&cluster.url(1), &TopicSpec::compacted(TOPIC, 1, 3)).await?.expect_status(201)?;
    cluster.stop_all()?;
    cluster.launch_stopped(1)?;
    let url_1 = cluster.url(1);
    poll_until("node 1 serves HTTP", Duration::from_secs(30), Duration::from_millis(100), || async {
        Ok(match api.healthz(&url_1).await {
            Ok(reply) if reply.status == 200 => Probe::Ready(()),
            Ok(reply) => Probe::NotYet(reply.summary()),
            Err(e) => Probe::NotYet(e.to_string()),
        })
    })
    .await?;

    let alter = {
        let (api, url) = (api.clone(), format!("{url_1}/topics/{TOPIC}/config"));
        tokio::spawn(async move {
            let body = Body::Json(json!({ "config": { "retention.ms": "60000" } }));
            api.request(reqwest::Method::POST, &url, Some(body)).await
        })
    };
    tokio::time::sleep(Duration::from_millis(500)).await;
    ensure!(!alter.is_finished(), "the alter waits while node 1 alone has no controller leader");
    cluster.launch_stopped(2)?;
    let answer = alter.await.map_err(|e| logdex_cluster_tests::Error::Check(e.to_string()))??;
    answer.expect_status(200)?;
    let described: Value = api.describe(&url_1, TOPIC).await?.json()?;
    ensure_eq!(described["config"]["retention.ms"], json!("60000"), "the alter applied: {described}");
    cluster.launch_stopped(3)?;
    cluster.wait_nodes_ready(&[1, 2, 3]).await
}

/// A create sent right after the controller leader was killed, to a node that still names
/// that leader, waits for the election and succeeds (it answered 503 with the transport's
/// raw error text before): the node cannot reach the leader it knows, so nothing was
/// proposed, and it asks again until a new leader takes the command.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_create_right_after_the_controller_leader_died_waits_for_the_next_leader() -> Result<()> {
    let mut cluster = Cluster::start(3).await?;
    let outcome = create_after_controller_death(&mut cluster).await;
    cluster.finish(outcome)
}

async fn create_after_controller_death(cluster: &mut Cluster) -> Result<()> {
    let api = cluster.api().clone();
    let (leader, via) = controller_leader_and_another(cluster).await?;
    cluster.kill(leader)?;
    let created = api.create_topic(&cluster.url(via), &TopicSpec::compacted("after", 2, 2)).await?;
    created.expect_status(201)?;
    let d: Value = created.json()?;
    for p in d["partitions"].as_array().into_iter().flatten() {
        let replicas: Vec<u64> = p["replicas"].as_array().into_iter().flatten().filter_map(Value::as_u64).collect();
        ensure!(!replicas.contains(&leader), "a replica was placed on the killed node {leader}: {p}");
    }
    api.put(&cluster.url(via), "after", b"k", b"v").await?.expect_status(200)?;
    Ok(())
}

/// A controller leader that is paused (SIGSTOP: its connections stay open, nothing answers)
/// does not hold an admin write until the call's deadline: once the other nodes elect a new
/// controller leader, the write goes there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_create_while_the_controller_leader_is_paused_goes_to_the_next_leader() -> Result<()> {
    let mut cluster = Cluster::start(3).await?;
    let outcome = create_while_controller_paused(&mut cluster).await;
    cluster.finish(outcome)
}

async fn create_while_controller_paused(cluster: &mut Cluster) -> Result<()> {
    let api = cluster.api().clone();
    let (leader, via) = controller_leader_and_another(cluster).await?;
    // A first create leaves the node asked with an open connection to the leader.
    api.create_topic(&cluster.url(via), &TopicSpec::compacted("warm", 1, 2)).await?.expect_status(201)?;
    cluster.pause(leader)?;
    let created = api.create_topic(&cluster.url(via), &TopicSpec::compacted("paused", 2, 2)).await?;
    created.expect_status(201)?;
    api.put(&cluster.url(via), "paused", b"k", b"v").await?.expect_status(200)?;
    cluster.resume(leader)?;
    // The same create again, through the node that was paused, finds the identical topic.
    let again = api.create_topic(&cluster.url(leader), &TopicSpec::compacted("paused", 2, 2)).await?;
    again.expect_status(200)?;
    Ok(())
}

/// A leader cut off from its peers stops naming itself once no quorum answered it for an
/// election timeout: on the cut-off node, `/cluster` names no controller leader, describe
/// names no leader for the partitions it led, and `/readyz` answers 503, while the others
/// elect new leaders and name them. After the cut heals, the node is ready again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leader_cut_off_from_its_peers_reports_no_leader() -> Result<()> {
    let mut cluster = Cluster::start_with(ClusterOptions { proxy: true, ..ClusterOptions::plain(3) }).await?;
    let outcome = cut_off_leader(&mut cluster).await;
    cluster.finish(outcome)
}

async fn cut_off_leader(cluster: &mut Cluster) -> Result<()> {
    let api = cluster.api().clone();
    api.create_topic(&cluster.url(1), &TopicSpec::compacted(TOPIC, 3, 3)).await?.expect_status(201)?;
    cluster.wait_for_leaders(TOPIC, Duration::from_secs(30)).await?;
    let (cut, other) = controller_leader_and_another(cluster).await?;
    let (cut_url, other_url) = (cluster.url(cut), cluster.url(other));
    let led: Vec<u32> = api
        .describe_ok(&cut_url, TOPIC)
        .await?
        .partitions
        .iter()
        .filter(|p| p.leader == Some(cut))
        .map(|p| p.partition)
        .collect();
    cluster.proxy().ok_or_else(|| logdex_cluster_tests::Error::Check("no proxy".into()))?.isolate(cut, Fault::Cut);

    poll_until(
        "the cut-off node names no leader of its own",
        Duration::from_secs(20),
        Duration::from_millis(250),
        || async {
            let view: Value = api.cluster(&cut_url).await?.json()?;
            let described = api.describe_ok(&cut_url, TOPIC).await?;
            let still: Vec<u32> =
                described.partitions.iter().filter(|p| p.leader == Some(cut)).map(|p| p.partition).collect();
            let ready = api.readyz(&cut_url).await?;
            Ok(if view["controller_leader"].is_null() && still.is_empty() && ready.status == 503 {
                Probe::Ready(())
            } else {
                Probe::NotYet(format!(
                    "controller leader {}, still leading {still:?} (led {led:?}), readyz {}",
                    view["controller_leader"],
                    ready.summary()
                ))
            })
        },
    )
    .await?;
    poll_until("the others name leaders of their own", Duration::from_secs(20), Duration::from_millis(250), || async {
        let view: Value = api.cluster(&other_url).await?.json()?;
        let described = api.describe_ok(&other_url, TOPIC).await?;
        let leaders: Vec<Option<u64>> = described.partitions.iter().map(|p| p.leader).collect();
        let elected = view["controller_leader"].as_u64().is_some_and(|l| l != cut)
            && leaders.iter().all(|l| l.is_some_and(|l| l != cut));
        Ok(if elected {
            Probe::Ready(())
        } else {
            Probe::NotYet(format!("controller leader {}, leaders {leaders:?}", view["controller_leader"]))
        })
    })
    .await?;

    cluster.proxy().ok_or_else(|| logdex_cluster_tests::Error::Check("no proxy".into()))?.heal();
    cluster.wait_nodes_ready(&[cut]).await?;
    let described = api.describe_ok(&cut_url, TOPIC).await?;
    ensure!(
        described.partitions.iter().all(|p| p.leader.is_some()),
        "after the heal every partition has a leader: {described:?}"
    );
    Ok(())
}

/// The controller leader node 1 names, and another node to send requests through.
async fn controller_leader_and_another(cluster: &Cluster) -> Result<(u64, u64)> {
    let view: Value = cluster.api().cluster(&cluster.url(1)).await?.json()?;
    let leader = view["controller_leader"]
        .as_u64()
        .ok_or_else(|| logdex_cluster_tests::Error::Check(format!("no controller leader: {view}")))?;
    Ok((leader, if leader == 1 { 2 } else { 1 }))
}

/// A joined node is a controller learner, which never campaigns and kept naming the last
/// leader it knew: with every voter gone, its `/readyz` answered 200 and `/cluster` named a
/// leader that no longer existed. A replica names a leader only while it hears from it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_learner_that_no_longer_hears_from_the_controller_reports_no_leader() -> Result<()> {
    let mut cluster = Cluster::start_with(ClusterOptions { spare_nodes: 1, ..ClusterOptions::plain(3) }).await?;
    let outcome = async {
        cluster.start_spare(4).await?;
        let api = cluster.api().clone();
        let url_4 = cluster.url(4);
        ensure_eq!(api.get_url(&format!("{url_4}/readyz")).await?.status, 200, "node 4 ready with the voters up");
        for id in 1..=3 {
            cluster.kill(id)?;
        }
        // Past the longest election timeout (3 s by default).
        tokio::time::sleep(Duration::from_secs(4)).await;
        let ready = api.get_url(&format!("{url_4}/readyz")).await?;
        ensure_eq!(ready.status, 503, "node 4 with every voter gone: {}", ready.summary());
        let view: Value = api.get_url(&format!("{url_4}/cluster")).await?.json()?;
        ensure_eq!(view["controller_leader"], Value::Null, "node 4's view: {view}");
        Ok(())
    }
    .await;
    cluster.finish(outcome)
}
