//! Reads of a partition that has no leader.
//!
//! A read sent to a node that hosts no replica of its partition, while no replica can serve
//! it (every one paused, so none answers and none can elect a leader), answers as a replica
//! asked directly does: 503 `unavailable` with Retry-After, within about as long as a replica
//! waits for a leader, naming each replica it tried. (It used to answer 504 after trying every
//! replica for 5 s each.)
//!
//! A `follower` read through a node without a replica, while the replica it would try first
//! (the leader) is paused, is answered by another replica after at most 1.5 s on the paused
//! one: a follower read is served at once from a replica's state, so the target is given up
//! sooner than a `linearizable` read's 5 s.
//!
//! A read waiting for a leader when its topic is deleted answers 404 `topic_not_found` once
//! its node applied the deletion, not 503 once its wait for a leader ran out.

use std::time::Duration;
use std::time::Instant;

use logdex_cluster_tests::Cluster;
use logdex_cluster_tests::Error;
use logdex_cluster_tests::Read;
use logdex_cluster_tests::Reply;
use logdex_cluster_tests::Result;
use logdex_cluster_tests::TopicSpec;
use logdex_cluster_tests::ensure;
use logdex_cluster_tests::ensure_eq;

/// How long a read through a node without a replica may take: the forwarded read's budget
/// (9 s: a replica's wait for a leader and a second), and a little for this machine.
const ANSWER_WITHIN: Duration = Duration::from_secs(12);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_read_through_a_node_without_a_replica_answers_503_when_no_replica_can_serve() -> Result<()> {
    let cluster = Cluster::start(3).await?;
    let outcome = async {
        let api = cluster.api();
        api.create_topic(&cluster.url(1), &TopicSpec::compacted("two", 1, 2)).await?.expect_status(201)?;
        let described = cluster.wait_for_leaders("two", Duration::from_secs(20)).await?;
        let replicas = described.partitions[0].replicas.clone();
        let outsider = (1..=3).find(|id| !replicas.contains(id)).unwrap_or(3);
        api.put(&cluster.url(outsider), "two", b"k", b"v").await?.expect_status(200)?;
        for id in &replicas {
            cluster.pause(*id)?;
        }
        let url = cluster.url(outsider);
        let started = Instant::now();
        let lookup = api.get(&url, "two", b"k", &Read::linearizable()).await?;
        check_unavailable("lookup", &lookup, started.elapsed(), &replicas)?;
        let started = Instant::now();
        let fetch = api.fetch(&url, "two", 0, 0, 10).await?;
        check_unavailable("fetch", &fetch, started.elapsed(), &replicas)?;
        cluster.resume_all()?;
        Ok(())
    }
    .await;
    let _ = cluster.resume_all();
    cluster.finish(outcome)
}

/// Within the 5 s a `linearizable` read gives each target, with room for this machine.
const FOLLOWER_ANSWER_WITHIN: Duration = Duration::from_secs(4);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_follower_read_through_a_node_without_a_replica_passes_over_a_paused_leader_quickly() -> Result<()> {
    let cluster = Cluster::start(3).await?;
    let outcome = async {
        let api = cluster.api();
        api.create_topic(&cluster.url(1), &TopicSpec::compacted("two", 1, 2)).await?.expect_status(201)?;
        let described = cluster.wait_for_leaders("two", Duration::from_secs(20)).await?;
        let partition = &described.partitions[0];
        let leader = partition.leader.ok_or_else(|| Error::Check("no leader".into()))?;
        let other = partition.replicas.iter().copied().find(|id| *id != leader).ok_or(Error::Check("RF 2".into()))?;
        let outsider = (1..=3).find(|id| !partition.replicas.contains(id)).unwrap_or(3);
        let url = cluster.url(outsider);
        api.put(&url, "two", b"k", b"v").await?.expect_status(200)?;
        // The outsider has just seen the leader answer: it tries the leader first.
        api.get(&url, "two", b"k", &Read::follower()).await?.expect_status(200)?;
        cluster.pause(leader)?;
        let started = Instant::now();
        let lookup = api.get(&url, "two", b"k", &Read::follower()).await?;
        let took = started.elapsed();
        cluster.resume(leader)?;
        ensure_eq!(lookup.status, 200, "follower lookup with the leader paused: {}", lookup.summary());
        ensure_eq!(lookup.header("x-kv-node"), Some(other.to_string().as_str()), "{}", lookup.summary());
        ensure!(took <= FOLLOWER_ANSWER_WITHIN, "the follower lookup took {took:?}");
        Ok(())
    }
    .await;
    let _ = cluster.resume_all();
    cluster.finish(outcome)
}

/// `reply` is a 503 with Retry-After, taken within [`ANSWER_WITHIN`], naming a replica tried.
fn check_unavailable(what: &str, reply: &Reply, took: Duration, replicas: &[u64]) -> Result<()> {
    ensure_eq!(reply.status, 503, "{what} through the node without a replica: {}", reply.summary());
    ensure!(reply.header("retry-after").is_some(), "{what}: 503 with Retry-After: {}", reply.summary());
    ensure!(took <= ANSWER_WITHIN, "{what} took {took:?}");
    let text = reply.text();
    ensure!(replicas.iter().any(|id| text.contains(&format!("node {id}"))), "{what} names a replica it tried: {text}");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_read_waiting_for_a_leader_when_its_topic_is_deleted_answers_topic_not_found() -> Result<()> {
    let cluster = Cluster::start(3).await?;
    let outcome = async {
        let api = cluster.api().clone();
        api.create_topic(&cluster.url(1), &TopicSpec::compacted("gone", 1, 2)).await?.expect_status(201)?;
        let described = cluster.wait_for_leaders("gone", Duration::from_secs(20)).await?;
        let partition = &described.partitions[0];
        let leader = partition.leader.ok_or_else(|| Error::Check("no leader".into()))?;
        let follower = partition.replicas.iter().copied().find(|id| *id != leader).unwrap_or(leader);
        let outsider = (1..=3).find(|id| !partition.replicas.contains(id)).unwrap_or(3);
        api.put(&cluster.url(leader), "gone", b"k", b"v").await?.expect_status(200)?;
        // One replica of two left: no leader until the topic goes.
        cluster.pause(leader)?;
        let url = cluster.url(follower);
        let waiting = tokio::spawn({
            let api = api.clone();
            async move { api.get(&url, "gone", b"k", &Read::linearizable()).await }
        });
        tokio::time::sleep(Duration::from_millis(500)).await;
        let deleted =
            api.request(reqwest::Method::DELETE, &format!("{}/topics/gone", cluster.url(outsider)), None).await?;
        ensure!(deleted.status == 200 || deleted.status == 204, "delete: {}", deleted.summary());
        let reply = waiting.await.map_err(|e| Error::Check(format!("the read task failed: {e}")))??;
        ensure_eq!(reply.status, 404, "the waiting read: {}", reply.summary());
        ensure_eq!(reply.error_code().as_deref(), Some("topic_not_found"), "{}", reply.summary());
        cluster.resume_all()?;
        Ok(())
    }
    .await;
    let _ = cluster.resume_all();
    cluster.finish(outcome)
}
