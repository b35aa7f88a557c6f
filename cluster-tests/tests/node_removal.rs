//! Removing a node for good (`DELETE /cluster/nodes/{id}`): a node whose disk is lost leaves
//! the cluster once its replicas moved off. When it was a controller voter, a live learner
//! takes its place, so the controller again tolerates the loss of another voter; the removed
//! node, started again on its old data directory, is refused and stops with the reason. A
//! cluster started with fewer nodes than `--controller-voters` makes joined nodes voters once
//! they are enough for an odd count.

use std::time::Duration;
use std::time::Instant;

use logdex_cluster_tests::Cluster;
use logdex_cluster_tests::ClusterOptions;
use logdex_cluster_tests::Error;
use logdex_cluster_tests::Read;
use logdex_cluster_tests::Result;
use logdex_cluster_tests::TopicSpec;
use logdex_cluster_tests::client::Body;
use logdex_cluster_tests::client::Reply;
use logdex_cluster_tests::ensure;
use logdex_cluster_tests::ensure_eq;
use reqwest::Method;
use serde_json::Value;
use serde_json::json;

const TOPIC: &str = "rm";
const KEYS: usize = 40;
const MOVE_DEADLINE: Duration = Duration::from_secs(90);
const EXIT_TIMEOUT: Duration = Duration::from_secs(60);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_removed_controller_voter_is_replaced_and_the_controller_survives_the_loss_of_another() -> Result<()> {
    let mut cluster = Cluster::start_with(ClusterOptions { spare_nodes: 1, ..ClusterOptions::plain(3) }).await?;
    let outcome = async {
        cluster.start_spare(4).await?;
        remove_voter(&mut cluster).await
    }
    .await;
    cluster.finish(outcome)
}

async fn remove_voter(cluster: &mut Cluster) -> Result<()> {
    let api = cluster.api().clone();
    let url_1 = cluster.url(1);
    // Two partitions of three replicas over four nodes: node 3 holds at least one.
    api.create_topic(&url_1, &TopicSpec::compacted(TOPIC, 2, 3)).await?.expect_status(201)?;
    cluster.wait_for_leaders(TOPIC, Duration::from_secs(30)).await?;
    for k in 0..KEYS {
        api.put(&url_1, TOPIC, format!("k-{k}").as_bytes(), format!("v-{k}").as_bytes()).await?.expect_status(200)?;
    }
    let before: Value = api.cluster(&url_1).await?.json()?;
    ensure_eq!(before["controller_voters"], json!([1, 2, 3]), "the voters of --peers: {before}");

    let running = remove(cluster, 1, "3").await?;
    expect_error(&running, 409, "node_running")?;
    cluster.kill(3)?;
    expect_error(&remove(cluster, 1, "9").await?, 404, "node_not_found")?;
    for bad in ["three", "+3", "-3", "99999999999999999999999"] {
        expect_error(&remove(cluster, 1, bad).await?, 400, "invalid_node")?;
    }
    let holding = remove(cluster, 1, "3").await?;
    expect_error(&holding, 409, "node_has_replicas")?;
    ensure!(holding.text().contains(&format!("{TOPIC}/")), "names a partition it holds: {}", holding.summary());

    // Its replicas move to the one node of 1, 2 and 4 that holds none of the partition:
    // every partition then has its three replicas on those nodes.
    let d = api.describe_ok(&url_1, TOPIC).await?;
    for p in d.partitions.iter().filter(|p| p.replicas.contains(&3)) {
        let spare = [1, 2, 4].into_iter().find(|n| !p.replicas.contains(n));
        let spare = spare.ok_or_else(|| Error::Check(format!("partition {} has four replicas", p.partition)))?;
        let target: Vec<u64> = p.replicas.iter().map(|n| if *n == 3 { spare } else { *n }).collect();
        move_partition(cluster, p.partition, &target).await?;
    }

    let removed = remove(cluster, 2, "3").await?;
    removed.expect_status(200)?;
    let body: Value = removed.json()?;
    ensure_eq!(body["controller_voters"], json!([1, 2, 4]), "node 4, the live learner, took node 3's place: {body}");
    ensure_eq!(body["controller_group"], json!("left"), "{body}");
    let again = remove(cluster, 1, "3").await?;
    ensure_eq!(again.status, 200, "a removal again is a no-op: {}", again.summary());
    let view: Value = api.cluster(&url_1).await?.json()?;
    let ids: Vec<u64> = view["nodes"].as_array().into_iter().flatten().filter_map(|n| n["node_id"].as_u64()).collect();
    ensure_eq!(ids, vec![1, 2, 4], "node 3 is no longer listed: {view}");
    ensure_eq!(view["removed_nodes"], json!([3]), "{view}");

    // With voters 1, 2 and 4, losing node 2 leaves a quorum: before, the voters 1, 2 and 3
    // had none with 2 and 3 gone, and no admin write could commit.
    cluster.kill(2)?;
    api.create_topic(&url_1, &TopicSpec::compacted("after", 1, 2)).await?.expect_status(201)?;
    cluster.wait_for_leaders(TOPIC, Duration::from_secs(30)).await?;
    api.put(&cluster.url(4), "after", b"k", b"v").await?.expect_status(200)?;
    for k in 0..KEYS {
        let key = format!("k-{k}");
        let read = api.get(&cluster.url(4), TOPIC, key.as_bytes(), &Read::linearizable()).await?;
        read.expect_status(200)?;
        ensure_eq!(read.text(), format!("v-{k}"), "{key} on node 4");
    }
    cluster.restart(2).await?;

    // Started again on its old data directory, node 3 is refused and stops with the reason.
    cluster.launch_stopped(3)?;
    let status = cluster.wait_exited(3, EXIT_TIMEOUT).await?;
    ensure_eq!(status.code(), Some(1), "exit status of the removed node");
    let log = cluster.launch_log(3)?;
    ensure!(log.contains("was removed from the cluster"), "node 3 says why it stopped:\n{log}");
    // So is a node started under its id on an empty directory, which the controller never
    // adds to its group (its entries would reach that process, which would start the
    // replicas the id once held, empty).
    empty_data_dir(cluster, 3)?;
    cluster.launch_stopped(3)?;
    let status = cluster.wait_exited(3, EXIT_TIMEOUT).await?;
    ensure_eq!(status.code(), Some(1), "exit status of a new process under the removed id");
    let log = cluster.launch_log(3)?;
    ensure!(log.contains("was removed from the cluster"), "the new process says why it stopped:\n{log}");
    ensure!(!log.contains("partition replica started"), "it started no replica:\n{log}");
    for id in [1, 2, 4] {
        let log = std::fs::read_to_string(cluster.log_path(id))
            .map_err(|e| Error::io(format!("reading the log of node {id}"), e))?;
        ensure!(
            !log.contains("added node to the controller group as learner node=3"),
            "node {id} added the refused node to the controller group"
        );
    }
    let view: Value = api.cluster(&url_1).await?.json()?;
    ensure_eq!(view["controller_voters"], json!([1, 2, 4]), "the removed node changed nothing: {view}");
    api.put(&cluster.url(2), TOPIC, b"last", b"write").await?.expect_status(200)?;
    Ok(())
}

/// A learner of the controller group (a node that joined) leaves it on removal, and the
/// voters stay as they were. Removed while paused, once resumed it finds out and stops.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_removed_learner_leaves_the_controller_group_and_the_voters_stay() -> Result<()> {
    let mut cluster = Cluster::start_with(ClusterOptions { spare_nodes: 1, ..ClusterOptions::plain(3) }).await?;
    let outcome = async {
        cluster.start_spare(4).await?;
        cluster.pause(4)?;
        let removed = remove(&cluster, 3, "4").await?;
        removed.expect_status(200)?;
        let body: Value = removed.json()?;
        ensure_eq!(body["controller_voters"], json!([1, 2, 3]), "{body}");
        ensure_eq!(body["controller_group"], json!("left"), "{body}");
        let view: Value = cluster.api().cluster(&cluster.url(1)).await?.json()?;
        ensure_eq!(view["removed_nodes"], json!([4]), "{view}");
        // A topic of three replicas is placed on the nodes that remain.
        let url_1 = cluster.url(1);
        cluster.api().create_topic(&url_1, &TopicSpec::compacted("left", 3, 3)).await?.expect_status(201)?;
        let d = cluster.api().describe_ok(&url_1, "left").await?;
        ensure!(d.partitions.iter().all(|p| !p.replicas.contains(&4)), "no replica on node 4: {d:?}");
        cluster.resume(4)?;
        let status = cluster.wait_exited(4, EXIT_TIMEOUT).await?;
        ensure_eq!(status.code(), Some(1), "exit status of the removed node, resumed");
        let log = cluster.launch_log(4)?;
        ensure!(log.contains("was removed from the cluster"), "node 4 says why it stopped:\n{log}");
        Ok(())
    }
    .await;
    cluster.finish(outcome)
}

/// A one-node cluster's controller is that node alone. A second node that joins stays a
/// learner (two voters would tolerate no more failures than one); with a third, both become
/// voters, and the controller survives the loss of the first node.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn joined_nodes_become_controller_voters_once_they_make_an_odd_count() -> Result<()> {
    let mut cluster = Cluster::start_with(ClusterOptions { spare_nodes: 2, ..ClusterOptions::plain(1) }).await?;
    let outcome = async {
        let url_1 = cluster.url(1);
        cluster.start_spare(2).await?;
        // A voter change would be made within a check of the controller's leader (2 s).
        tokio::time::sleep(Duration::from_secs(3)).await;
        let view: Value = cluster.api().cluster(&url_1).await?.json()?;
        ensure_eq!(view["controller_voters"], json!([1]), "two voters would be no better than one: {view}");
        cluster.start_spare(3).await?;
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let view: Value = cluster.api().cluster(&url_1).await?.json()?;
            if view["controller_voters"] == json!([1, 2, 3]) {
                break;
            }
            ensure!(Instant::now() < deadline, "the joined nodes did not become voters: {view}");
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
        cluster.kill(1)?;
        let created = cluster.api().create_topic(&cluster.url(2), &TopicSpec::compacted("after", 1, 2)).await?;
        created.expect_status(201)?;
        cluster.api().put(&cluster.url(3), "after", b"k", b"v").await?.expect_status(200)?;
        Ok(())
    }
    .await;
    cluster.finish(outcome)
}

/// Removes everything of node `id`'s data directory but its log, as a lost disk would.
fn empty_data_dir(cluster: &Cluster, id: u64) -> Result<()> {
    let dir = cluster.data_dir(id);
    let entries = std::fs::read_dir(dir).map_err(|e| Error::io(format!("listing {}", dir.display()), e))?;
    for entry in entries {
        let path = entry.map_err(|e| Error::io(format!("listing {}", dir.display()), e))?.path();
        if path == cluster.log_path(id) {
            continue;
        }
        let removed = if path.is_dir() { std::fs::remove_dir_all(&path) } else { std::fs::remove_file(&path) };
        removed.map_err(|e| Error::io(format!("removing {}", path.display()), e))?;
    }
    Ok(())
}

/// `DELETE /cluster/nodes/{node}` through node `via`.
async fn remove(cluster: &Cluster, via: u64, node: &str) -> Result<Reply> {
    cluster.api().request(Method::DELETE, &format!("{}/cluster/nodes/{node}", cluster.url(via)), None).await
}

fn expect_error(reply: &Reply, status: u16, code: &str) -> Result<()> {
    ensure_eq!(reply.status, status, "{}", reply.summary());
    let body: Value = reply.json()?;
    ensure_eq!(body["error"]["code"], json!(code), "{}", reply.summary());
    Ok(())
}

/// Moves partition `partition` of [`TOPIC`] to `target` and waits until the move is complete.
async fn move_partition(cluster: &Cluster, partition: u32, target: &[u64]) -> Result<()> {
    let api = cluster.api();
    let url = format!("{}/topics/{TOPIC}/partitions/{partition}/replicas", cluster.url(1));
    let moved = api.request(Method::PUT, &url, Some(Body::Json(json!({ "replicas": target })))).await?;
    ensure!(moved.status == 202 || moved.status == 200, "move of {partition} answered {}", moved.summary());
    let deadline = Instant::now() + MOVE_DEADLINE;
    loop {
        let d = api.describe_ok(&cluster.url(1), TOPIC).await?;
        let p =
            d.partitions.get(partition as usize).ok_or_else(|| Error::Check(format!("no partition {partition}")))?;
        if p.move_state.is_none() && p.replicas == target {
            return Ok(());
        }
        ensure!(Instant::now() < deadline, "move of {partition} to {target:?} not complete: {p:?}");
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}
