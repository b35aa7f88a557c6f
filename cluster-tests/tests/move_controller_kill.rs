//! A partition move survives the crash of the controller leader (issue: cluster
//! moves): the move completes after re-election, the joined node serves every
//! key, and the removed node deletes the partition's data when it comes back.

use std::time::Duration;
use std::time::Instant;

use logdex_cluster_tests::Cluster;
use logdex_cluster_tests::ClusterOptions;
use logdex_cluster_tests::Error;
use logdex_cluster_tests::Read;
use logdex_cluster_tests::Result;
use logdex_cluster_tests::TopicSpec;
use logdex_cluster_tests::client::Body;
use logdex_cluster_tests::ensure;
use logdex_cluster_tests::ensure_eq;
use serde_json::Value;
use serde_json::json;

const TOPIC: &str = "mv";
const KEYS: usize = 200;
const MOVE_DEADLINE: Duration = Duration::from_secs(90);

/// Starts 3 nodes plus a 4th that joins later; moves the partition off the
/// controller leader's node onto node 4 and SIGKILLs the controller leader at
/// once; writes continue through a surviving node; the move must complete,
/// node 4 must answer every acknowledged key, and the killed node, restarted,
/// must remove its copy of the partition.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn move_completes_after_the_controller_leader_is_killed() -> Result<()> {
    let options = ClusterOptions { spare_nodes: 1, ..ClusterOptions::plain(3) };
    let cluster = Cluster::start_with(options).await?;
    let mut cluster = cluster;
    let outcome = scenario(&mut cluster).await;
    cluster.finish(outcome)
}

async fn scenario(cluster: &mut Cluster) -> Result<()> {
    let api = cluster.api().clone();
    api.create_topic(&cluster.url(1), &TopicSpec::compacted(TOPIC, 1, 3)).await?.expect_status(201)?;
    cluster.wait_for_leaders(TOPIC, Duration::from_secs(20)).await?;
    for k in 0..KEYS / 2 {
        api.put(&cluster.url(1), TOPIC, format!("k-{k}").as_bytes(), format!("v-{k}").as_bytes())
            .await?
            .expect_status(200)?;
    }
    cluster.start_spare(4).await?;
    let view: Value = api.cluster(&cluster.url(1)).await?.json()?;
    let controller =
        view["controller_leader"].as_u64().ok_or_else(|| Error::Check(format!("no controller leader: {view}")))?;
    let mut target: Vec<u64> = [1, 2, 3].into_iter().filter(|n| *n != controller).collect();
    target.push(4);
    let survivor = target[0];
    let moved = api
        .request(
            reqwest::Method::PUT,
            &format!("{}/topics/{TOPIC}/partitions/0/replicas", cluster.url(survivor)),
            Some(logdex_cluster_tests::client::Body::Json(json!({ "replicas": target }))),
        )
        .await?;
    ensure!(moved.status == 202 || moved.status == 200, "move answered {}", moved.summary());
    cluster.kill(controller)?;
    let mut acknowledged = Vec::new();
    for k in KEYS / 2..KEYS {
        let (key, value) = (format!("k-{k}"), format!("v-{k}"));
        for attempt in 0..40 {
            let reply = api.put(&cluster.url(survivor), TOPIC, key.as_bytes(), value.as_bytes()).await?;
            if reply.status == 200 {
                acknowledged.push(k);
                break;
            }
            ensure!(reply.status == 503 || reply.status == 504, "write {key} answered {}", reply.summary());
            ensure!(attempt < 39, "write {key} never succeeded");
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    }
    let deadline = Instant::now() + MOVE_DEADLINE;
    loop {
        let d: Value = api.describe(&cluster.url(survivor), TOPIC).await?.json()?;
        let p = &d["partitions"][0];
        let replicas: Vec<u64> = p["replicas"].as_array().into_iter().flatten().filter_map(Value::as_u64).collect();
        if p.get("move").is_none() && replicas == target {
            break;
        }
        ensure!(Instant::now() < deadline, "move not complete: {p}");
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    // A removed leader steps down once the membership without it commits: an election may
    // still be under way.
    cluster.wait_for_leaders(TOPIC, Duration::from_secs(20)).await?;
    for k in (0..KEYS / 2).chain(acknowledged.iter().copied()) {
        let key = format!("k-{k}");
        let read = Read::linearizable();
        let reply = api.get(&cluster.url(4), TOPIC, key.as_bytes(), &read).await?;
        reply.expect_status(200)?;
        ensure_eq!(reply.text(), format!("v-{k}"), "node 4, key {key}");
    }
    cluster.restart(controller).await?;
    let partitions = cluster.data_dir(controller).join("partitions");
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let left = std::fs::read_dir(&partitions).map(|d| d.count()).unwrap_or(0);
        if left == 0 {
            break;
        }
        ensure!(Instant::now() < deadline, "node {controller} still holds {left} partition directories");
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    Ok(())
}

/// A move whose target shares no node with the current replicas (one replica
/// onto another node, then onto two other nodes) completes: the leaving leader
/// first makes the target replicas voters beside itself, then hands them
/// leadership. Every acknowledged key stays readable from every node and
/// writes go on after each move.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn move_onto_replicas_disjoint_from_the_current_ones_completes() -> Result<()> {
    let mut cluster = Cluster::start_with(ClusterOptions::plain(3)).await?;
    let outcome = disjoint_moves(&mut cluster).await;
    cluster.finish(outcome)
}

async fn disjoint_moves(cluster: &mut Cluster) -> Result<()> {
    let api = cluster.api().clone();
    let topic = "disjoint";
    api.create_topic(&cluster.url(1), &TopicSpec::compacted(topic, 1, 1)).await?.expect_status(201)?;
    cluster.wait_for_leaders(topic, Duration::from_secs(20)).await?;
    let d: Value = api.describe(&cluster.url(1), topic).await?.json()?;
    let first = d["partitions"][0]["replicas"][0].as_u64().ok_or_else(|| Error::Check(format!("no replica in {d}")))?;
    let others: Vec<u64> = [1, 2, 3].into_iter().filter(|n| *n != first).collect();
    let mut written = 0;
    for (round, target) in [vec![others[0]], vec![first, others[1]]].into_iter().enumerate() {
        for k in written..written + 50 {
            api.put(&cluster.url(1), topic, format!("k-{k}").as_bytes(), format!("v-{k}").as_bytes())
                .await?
                .expect_status(200)?;
        }
        written += 50;
        let moved = api
            .request(
                reqwest::Method::PUT,
                &format!("{}/topics/{topic}/partitions/0/replicas", cluster.url(1)),
                Some(logdex_cluster_tests::client::Body::Json(json!({ "replicas": target }))),
            )
            .await?;
        ensure!(moved.status == 202 || moved.status == 200, "move {round} answered {}", moved.summary());
        let deadline = Instant::now() + MOVE_DEADLINE;
        loop {
            let d: Value = api.describe(&cluster.url(1), topic).await?.json()?;
            let p = &d["partitions"][0];
            let replicas: Vec<u64> = p["replicas"].as_array().into_iter().flatten().filter_map(Value::as_u64).collect();
            if p.get("move").is_none() && replicas == target {
                break;
            }
            ensure!(Instant::now() < deadline, "move {round} to {target:?} not complete: {p}");
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
        cluster.wait_for_leaders(topic, Duration::from_secs(20)).await?;
        for node in 1..=3 {
            for k in 0..written {
                let key = format!("k-{k}");
                let reply = api.get(&cluster.url(node), topic, key.as_bytes(), &Read::linearizable()).await?;
                reply.expect_status(200)?;
                ensure_eq!(reply.text(), format!("v-{k}"), "move {round}, node {node}, key {key}");
            }
        }
    }
    api.put(&cluster.url(2), topic, b"after", b"moves").await?.expect_status(200)?;
    Ok(())
}

/// A move onto a node that is down waits for that node's replica to catch up before it
/// changes the voters: the partition (two replicas, one of them to be replaced by the
/// down node) keeps taking writes and linearizable reads while the move waits; a move back
/// to the current replicas replaces it and completes at once; made again, the move
/// completes once the node returns, with every acknowledged key on it. (Making a voter of
/// the down node at once would leave a quorum that needs it: every write 503 until it came back.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn move_onto_a_down_node_waits_and_the_partition_stays_writable() -> Result<()> {
    let options = ClusterOptions { spare_nodes: 1, ..ClusterOptions::plain(3) };
    let mut cluster = Cluster::start_with(options).await?;
    let outcome = move_onto_down_node(&mut cluster).await;
    cluster.finish(outcome)
}

/// Waits until partition 0 of `topic` has `replicas` and no move runs, for at most `within`.
async fn wait_for_replicas(
    api: &logdex_cluster_tests::client::Api,
    base: &str,
    topic: &str,
    replicas: &[u64],
    within: Duration,
) -> Result<()> {
    let deadline = Instant::now() + within;
    loop {
        let d: Value = api.describe(base, topic).await?.json()?;
        let p = &d["partitions"][0];
        let now: Vec<u64> = p["replicas"].as_array().into_iter().flatten().filter_map(Value::as_u64).collect();
        if p.get("move").is_none() && now == replicas {
            return Ok(());
        }
        ensure!(Instant::now() < deadline, "partition 0 of {topic} did not reach replicas {replicas:?}: {p}");
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

async fn move_onto_down_node(cluster: &mut Cluster) -> Result<()> {
    let api = cluster.api().clone();
    let topic = "ontodown";
    api.create_topic(&cluster.url(1), &TopicSpec::compacted(topic, 1, 2)).await?.expect_status(201)?;
    let d = cluster.wait_for_leaders(topic, Duration::from_secs(20)).await?;
    let replicas = d.partitions[0].replicas.clone();
    ensure_eq!(replicas.len(), 2, "replicas of {topic}");
    // Node 4 joins (so it is registered) and dies before the move names it.
    cluster.start_spare(4).await?;
    cluster.kill(4)?;
    let target = vec![replicas[1], 4];
    let moved = api
        .request(
            reqwest::Method::PUT,
            &format!("{}/topics/{topic}/partitions/0/replicas", cluster.url(1)),
            Some(logdex_cluster_tests::client::Body::Json(json!({ "replicas": target }))),
        )
        .await?;
    ensure_eq!(moved.status, 202, "move answered {}", moved.summary());
    let mut written = 0;
    let waiting_until = Instant::now() + Duration::from_secs(8);
    while Instant::now() < waiting_until {
        let (key, value) = (format!("k-{written}"), format!("v-{written}"));
        let put = api.put(&cluster.url(1), topic, key.as_bytes(), value.as_bytes()).await?;
        ensure_eq!(put.status, 200, "write {key} while the move waits: {}", put.summary());
        let got = api.get(&cluster.url(1), topic, key.as_bytes(), &Read::linearizable()).await?;
        ensure_eq!(got.status, 200, "read {key} while the move waits: {}", got.summary());
        ensure_eq!(got.text(), value, "read {key} while the move waits");
        written += 1;
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let d: Value = api.describe(&cluster.url(1), topic).await?.json()?;
    ensure!(d["partitions"][0].get("move").is_some(), "the move onto the down node finished: {d}");
    // The waiting move is taken back (a move to the current replicas replaces it) ...
    let url = format!("{}/topics/{topic}/partitions/0/replicas", cluster.url(2));
    let back = api.request(reqwest::Method::PUT, &url, Some(Body::Json(json!({ "replicas": replicas })))).await?;
    ensure_eq!(back.status, 202, "taking the move back answered {}", back.summary());
    wait_for_replicas(&api, &cluster.url(1), topic, &replicas, MOVE_DEADLINE).await?;
    let put = api.put(&cluster.url(1), topic, b"after-take-back", b"v").await?;
    ensure_eq!(put.status, 200, "write after the move was taken back: {}", put.summary());
    // ... and made again, to complete once node 4 is back.
    let again = api.request(reqwest::Method::PUT, &url, Some(Body::Json(json!({ "replicas": target })))).await?;
    ensure_eq!(again.status, 202, "the move made again answered {}", again.summary());
    cluster.restart(4).await?;
    // While the move completes, linearizable reads through the node it removes keep
    // answering: leadership leaves that node and then its replica does, and a read caught
    // in either goes to the new leader or to a replica still assigned.
    let leaving = replicas[0];
    let deadline = Instant::now() + MOVE_DEADLINE;
    let mut reads = 0;
    loop {
        let key = format!("k-{}", reads % written);
        let got = api.get(&cluster.url(leaving), topic, key.as_bytes(), &Read::linearizable()).await?;
        ensure_eq!(got.status, 200, "read {key} through node {leaving} as the move completes: {}", got.summary());
        reads += 1;
        let d: Value = api.describe(&cluster.url(1), topic).await?.json()?;
        let p = &d["partitions"][0];
        let now: Vec<u64> = p["replicas"].as_array().into_iter().flatten().filter_map(Value::as_u64).collect();
        if p.get("move").is_none() && now == target {
            break;
        }
        ensure!(Instant::now() < deadline, "move to {target:?} not complete after node 4 returned: {p}");
    }
    for k in 0..written {
        let key = format!("k-{k}");
        let got = api.get(&cluster.url(leaving), topic, key.as_bytes(), &Read::linearizable()).await?;
        ensure_eq!(got.status, 200, "read {key} through node {leaving} after the move: {}", got.summary());
    }
    cluster.wait_for_leaders(topic, Duration::from_secs(20)).await?;
    for k in 0..written {
        let key = format!("k-{k}");
        let reply = api.get(&cluster.url(4), topic, key.as_bytes(), &Read::linearizable()).await?;
        reply.expect_status(200)?;
        ensure_eq!(reply.text(), format!("v-{k}"), "node 4, key {key}");
    }
    Ok(())
}

/// A move onto a down node, made when the partition's Raft log is longer than openraft's
/// catch-up threshold for a learner (5,000 entries), is still taken back at once: the move
/// driver does not sit in a blocking learner add that no replacement can end.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn move_onto_a_down_node_after_a_long_log_is_taken_back_at_once() -> Result<()> {
    let options = ClusterOptions { spare_nodes: 1, ..ClusterOptions::plain(3) };
    let mut cluster = Cluster::start_with(options).await?;
    let outcome = take_back_after_long_log(&mut cluster).await;
    cluster.finish(outcome)
}

async fn take_back_after_long_log(cluster: &mut Cluster) -> Result<()> {
    /// Past openraft's `replication_lag_threshold` (5,000): one Raft entry per sequential put.
    const ENTRIES: usize = 5_200;
    let api = cluster.api().clone();
    let topic = "longlog";
    api.create_topic(&cluster.url(1), &TopicSpec::compacted(topic, 1, 2)).await?.expect_status(201)?;
    let d = cluster.wait_for_leaders(topic, Duration::from_secs(20)).await?;
    let replicas = d.partitions[0].replicas.clone();
    let leader = d.partitions[0].leader.ok_or_else(|| Error::Check(format!("{topic} has no leader")))?;
    for i in 0..ENTRIES {
        let put = api.put(&cluster.url(leader), topic, format!("k-{}", i % 100).as_bytes(), b"v").await?;
        ensure_eq!(put.status, 200, "put {i}: {}", put.summary());
    }
    cluster.start_spare(4).await?;
    cluster.kill(4)?;
    let url = format!("{}/topics/{topic}/partitions/0/replicas", cluster.url(1));
    let target = vec![replicas[1], 4];
    let moved = api.request(reqwest::Method::PUT, &url, Some(Body::Json(json!({ "replicas": target })))).await?;
    ensure_eq!(moved.status, 202, "move answered {}", moved.summary());
    tokio::time::sleep(Duration::from_secs(2)).await;
    let back = api.request(reqwest::Method::PUT, &url, Some(Body::Json(json!({ "replicas": replicas })))).await?;
    ensure_eq!(back.status, 202, "taking the move back answered {}", back.summary());
    // Well under the 120 s a blocked learner add held the move for.
    wait_for_replicas(&api, &cluster.url(1), topic, &replicas, Duration::from_secs(20)).await?;
    let put = api.put(&cluster.url(1), topic, b"after-take-back", b"v").await?;
    ensure_eq!(put.status, 200, "write after the move was taken back: {}", put.summary());
    Ok(())
}

/// A topic created while a registered node is down is placed on the nodes that answer (as
/// Kafka places on live brokers): every partition has a leader in the create's answer and
/// takes a write at once. (Before, the down node got its share of replicas, and a
/// partition placed only there had no leader until it returned.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn topic_created_while_a_node_is_down_is_placed_on_the_live_nodes() -> Result<()> {
    let options = ClusterOptions { spare_nodes: 1, ..ClusterOptions::plain(3) };
    let mut cluster = Cluster::start_with(options).await?;
    let outcome = create_with_a_node_down(&mut cluster).await;
    cluster.finish(outcome)
}

async fn create_with_a_node_down(cluster: &mut Cluster) -> Result<()> {
    let api = cluster.api().clone();
    cluster.start_spare(4).await?;
    cluster.kill(4)?;
    let topic = "placed";
    let created = api.create_topic(&cluster.url(1), &TopicSpec::compacted(topic, 4, 1)).await?;
    created.expect_status(201)?;
    let d: Value = created.json()?;
    for p in d["partitions"].as_array().into_iter().flatten() {
        let replicas: Vec<u64> = p["replicas"].as_array().into_iter().flatten().filter_map(Value::as_u64).collect();
        ensure!(!replicas.contains(&4), "a replica was placed on the down node 4: {p}");
        ensure!(p["leader"].as_u64().is_some(), "a partition has no leader after the create: {p}");
    }
    for k in 0..20 {
        api.put(&cluster.url(2), topic, format!("k-{k}").as_bytes(), b"v").await?.expect_status(200)?;
    }
    // With nodes 3 and 4 down, a topic of 4 replicas has only 2 live ones per partition, too
    // few to elect a leader: the create answers at once (it waited 15 s for leaders before),
    // and the partitions get their leaders when the nodes return.
    cluster.kill(3)?;
    let wide = "wide";
    let asked = Instant::now();
    let created = api.create_topic(&cluster.url(1), &TopicSpec::compacted(wide, 2, 4)).await?;
    created.expect_status(201)?;
    let took = asked.elapsed();
    ensure!(took < Duration::from_secs(10), "the create waited {took:?} for leaders that cannot be elected");
    let d: Value = created.json()?;
    for p in d["partitions"].as_array().into_iter().flatten() {
        ensure!(p["leader"].is_null(), "a partition with 2 of 4 replicas live has a leader: {p}");
    }
    cluster.restart(3).await?;
    cluster.restart(4).await?;
    cluster.wait_for_leaders(wide, Duration::from_secs(30)).await?;
    api.put(&cluster.url(1), wide, b"k", b"v").await?.expect_status(200)?;
    Ok(())
}

/// A move whose target keeps a replica that is down, while it drops one that is up
/// ([L, D, K] to [L, D] with D down), waits before it changes the voters, and the
/// partition keeps taking writes: the voter set {L, D} would need D for every commit.
/// (Before, only replicas the move adds were waited for: the voters changed, and every
/// write and linearizable read answered 503 until D returned.) The waiting move can be
/// taken back, and once D is back the same move completes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn move_that_keeps_a_down_replica_waits_and_the_partition_stays_writable() -> Result<()> {
    let mut cluster = Cluster::start_with(ClusterOptions::plain(3)).await?;
    let outcome = keep_a_down_replica(&mut cluster).await;
    cluster.finish(outcome)
}

async fn keep_a_down_replica(cluster: &mut Cluster) -> Result<()> {
    let api = cluster.api().clone();
    let topic = "keepdown";
    api.create_topic(&cluster.url(1), &TopicSpec::compacted(topic, 1, 3)).await?.expect_status(201)?;
    let d = cluster.wait_for_leaders(topic, Duration::from_secs(20)).await?;
    let replicas = d.partitions[0].replicas.clone();
    let leader = d.partitions[0].leader.ok_or_else(|| Error::Check(format!("{topic} has no leader")))?;
    let followers: Vec<u64> = replicas.iter().copied().filter(|&n| n != leader).collect();
    let (down, kept_up) = (followers[0], followers[1]);
    cluster.kill(down)?;
    // Past the leader's view of a live replica (an answer within the election timeout).
    tokio::time::sleep(Duration::from_secs(3)).await;
    let url = format!("{}/topics/{topic}/partitions/0/replicas", cluster.url(leader));
    let target = vec![leader, down];
    let moved = api.request(reqwest::Method::PUT, &url, Some(Body::Json(json!({ "replicas": target })))).await?;
    ensure_eq!(moved.status, 202, "move answered {}", moved.summary());
    let waiting_until = Instant::now() + Duration::from_secs(6);
    let mut written = 0;
    while Instant::now() < waiting_until {
        let (key, value) = (format!("k-{written}"), format!("v-{written}"));
        let put = api.put(&cluster.url(kept_up), topic, key.as_bytes(), value.as_bytes()).await?;
        ensure_eq!(put.status, 200, "write {key} while the move waits: {}", put.summary());
        let got = api.get(&cluster.url(kept_up), topic, key.as_bytes(), &Read::linearizable()).await?;
        ensure_eq!(got.status, 200, "read {key} while the move waits: {}", got.summary());
        ensure_eq!(got.text(), value, "read {key} while the move waits");
        written += 1;
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let d: Value = api.describe(&cluster.url(leader), topic).await?.json()?;
    ensure!(d["partitions"][0].get("move").is_some(), "the move that keeps node {down} (down) finished: {d}");
    let back = api.request(reqwest::Method::PUT, &url, Some(Body::Json(json!({ "replicas": replicas })))).await?;
    ensure_eq!(back.status, 202, "taking the move back answered {}", back.summary());
    wait_for_replicas(&api, &cluster.url(leader), topic, &replicas, MOVE_DEADLINE).await?;
    let again = api.request(reqwest::Method::PUT, &url, Some(Body::Json(json!({ "replicas": target })))).await?;
    ensure_eq!(again.status, 202, "the move made again answered {}", again.summary());
    cluster.restart(down).await?;
    wait_for_replicas(&api, &cluster.url(leader), topic, &target, MOVE_DEADLINE).await?;
    for k in 0..written {
        let (key, value) = (format!("k-{k}"), format!("v-{k}"));
        let got = api.get(&cluster.url(down), topic, key.as_bytes(), &Read::linearizable()).await?;
        ensure_eq!(got.status, 200, "read {key} from node {down} after the move: {}", got.summary());
        ensure_eq!(got.text(), value, "read {key} from node {down} after the move");
    }
    Ok(())
}

/// A move's new replica is a learner, empty until the leader's snapshot reaches it: it sends
/// `follower` reads to a voter (421 naming one with `forward=false`) rather than answer from
/// its empty state (404 for a key the partition has had all along, seen by a black-box probe
/// for a few milliseconds of each move). The link between the partition's leader and the new
/// replica's node is cut so the replica stays empty; once healed, the move completes and the
/// new replica, a voter now, answers itself.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_moves_new_replica_sends_follower_reads_to_a_voter_until_it_is_one() -> Result<()> {
    let cluster = Cluster::start_with(ClusterOptions { proxy: true, ..ClusterOptions::plain(3) }).await?;
    let outcome = new_replica_follower_reads(&cluster).await;
    if let Some(proxy) = cluster.proxy() {
        proxy.heal();
    }
    cluster.finish(outcome)
}

async fn new_replica_follower_reads(cluster: &Cluster) -> Result<()> {
    let api = cluster.api().clone();
    let topic = "fr";
    api.create_topic(&cluster.url(1), &TopicSpec::compacted(topic, 3, 1)).await?.expect_status(201)?;
    let described = cluster.wait_for_leaders(topic, Duration::from_secs(20)).await?;
    let view: Value = api.cluster(&cluster.url(1)).await?.json()?;
    let controller =
        view["controller_leader"].as_u64().ok_or_else(|| Error::Check(format!("no controller leader: {view}")))?;
    // A partition on a node that does not lead the controller, moved to add the third node:
    // the controller still reaches both while the link between them is cut.
    let p = described
        .partitions
        .iter()
        .find(|p| p.replicas.first().is_some_and(|r| *r != controller))
        .ok_or_else(|| Error::Check("every partition on the controller leader".into()))?;
    let (partition, first) = (p.partition, p.replicas[0]);
    let target = (1..=3).find(|n| *n != first && *n != controller).ok_or(Error::Check("three nodes".into()))?;
    let produced = api
        .request(
            reqwest::Method::POST,
            &format!("{}/topics/{topic}/records", cluster.url(first)),
            Some(Body::Json(json!({"records": [{"key": "k", "value": "v", "partition": partition}]}))),
        )
        .await?;
    produced.expect_status(200)?;
    let proxy = cluster.proxy().ok_or_else(|| Error::Check("no proxy".into()))?;
    proxy.set_pair(first, target, logdex_cluster_tests::proxy::Fault::Cut);
    let moved = api
        .request(
            reqwest::Method::PUT,
            &format!("{}/topics/{topic}/partitions/{partition}/replicas", cluster.url(controller)),
            Some(Body::Json(json!({ "replicas": [first, target] }))),
        )
        .await?;
    ensure!(moved.status == 202 || moved.status == 200, "move answered {}", moved.summary());
    // The new replica has started on its node once that node's metrics name it.
    let series = format!("topic=\"{topic}\",partition=\"{partition}\"");
    let deadline = Instant::now() + Duration::from_secs(30);
    while !api.get_url(&format!("{}/metrics", cluster.url(target))).await?.text().contains(&series) {
        ensure!(Instant::now() < deadline, "no replica of partition {partition} started on node {target}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let url = cluster.url(target);
    let read = Read::follower().partition(partition);
    // With `forward=false`: 421 naming the voter, or 503 as here, where the proxy keeps this
    // node's status call from reaching it; never the empty replica's own 404.
    let here = api.get(&url, topic, b"k", &read.clone().forward(false)).await?;
    ensure!(here.status == 503 || here.status == 421, "follower read on the new, empty replica: {}", here.summary());
    // Forwarded (over HTTP, which the proxy does not carry), the voter answers.
    let forwarded = api.get(&url, topic, b"k", &read).await?;
    forwarded.expect_status(200)?;
    ensure_eq!(forwarded.text(), "v", "{}", forwarded.summary());
    ensure_eq!(forwarded.header("x-kv-node"), Some(first.to_string().as_str()), "{}", forwarded.summary());
    let fetch_url = format!("{url}/topics/{topic}/partitions/{partition}/records?offset=0&read=follower&forward=false");
    let fetched = api.get_url(&fetch_url).await?;
    ensure!(
        fetched.status == 503 || fetched.status == 421,
        "follower fetch on the new, empty replica: {}",
        fetched.summary()
    );

    proxy.heal();
    let deadline = Instant::now() + MOVE_DEADLINE;
    loop {
        let d: Value = api.describe(&cluster.url(controller), topic).await?.json()?;
        let p = &d["partitions"][partition as usize];
        let replicas: Vec<u64> = p["replicas"].as_array().into_iter().flatten().filter_map(Value::as_u64).collect();
        if p.get("move").is_none() && replicas.len() == 2 {
            break;
        }
        ensure!(Instant::now() < deadline, "move of partition {partition} not complete: {p}");
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    let served = api.get(&url, topic, b"k", &Read::follower().partition(partition).forward(false)).await?;
    served.expect_status(200)?;
    ensure_eq!(served.text(), "v", "{}", served.summary());
    ensure_eq!(served.header("x-kv-node"), Some(target.to_string().as_str()), "{}", served.summary());
    Ok(())
}
