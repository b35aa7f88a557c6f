//! Linearizable reads from followers see writes acknowledged just before them
//! (DESIGN.md I6), in both linearizable (lease) and strict (read index) modes, also
//! between nodes that cannot use call streams and fall back to unary RPCs, and when
//! concurrent reads of several partitions share one read-index call per leader node.
//! The quorum round of a strict read (a heartbeat from the leader) travels as a call on
//! the call streams, or on append streams to nodes that do not take heartbeat calls.
//! A leader holds back requests that only carry a new commit index for a moment, and
//! neither reads nor the end of a burst of writes wait on them for long. A follower's
//! read sent right after its leader was killed or paused waits for the next leader. A
//! follower fetch past the high watermark of a replica that is behind leaves the consumer
//! where it was.

use logdex_cluster_tests::Cluster;
use logdex_cluster_tests::ClusterOptions;
use logdex_cluster_tests::Read;
use logdex_cluster_tests::ReadMode;
use logdex_cluster_tests::Result;
use logdex_cluster_tests::TopicSpec;
use logdex_cluster_tests::client::FetchResponse;
use logdex_cluster_tests::cluster::FAILPOINTS_ENV;
use logdex_cluster_tests::ensure;
use logdex_cluster_tests::ensure_eq;
use logdex_cluster_tests::proxy::Fault;
use logdex_cluster_tests::support::Probe;
use logdex_cluster_tests::support::poll_until;
use logdex_cluster_tests::support::settled;
use std::time::Duration;

const TOPIC: &str = "ryw";
const ROUNDS: usize = 60;
/// Six partitions: each node follows about four, led by the two other nodes.
const MANY: &str = "ryw-many";
const MANY_KEYS: usize = 12;
const MANY_ROUNDS: usize = 30;
/// The node every read of the concurrent rounds goes to.
const READER: u64 = 1;
/// Writers of a burst, and the writes each sends.
const BURST_WRITERS: usize = 8;
const BURST_WRITES: usize = 40;

/// A follower cut off from its leader falls behind; a `read=follower` fetch there at the
/// leader's high watermark answers no records and keeps `next_offset` at the offset asked
/// (it pointed the consumer back to the replica's own high watermark, so the consumer read
/// again what it had). Once the cut heals, the same fetch returns the records.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_follower_fetch_past_a_lagging_replicas_high_watermark_keeps_the_offset_asked() -> Result<()> {
    let cluster = Cluster::start_with(ClusterOptions { proxy: true, ..ClusterOptions::plain(3) }).await?;
    let outcome = lagging_fetch(&cluster).await;
    cluster.finish(outcome)
}

async fn lagging_fetch(cluster: &Cluster) -> Result<()> {
    let api = cluster.api();
    api.create_topic(&cluster.url(1), &TopicSpec::compacted(TOPIC, 1, 3)).await?.expect_status(201)?;
    let (leader, [behind, _]) = leader_and_followers(cluster).await?;
    let leader_url = cluster.url(leader);
    for k in 0..3 {
        api.put(&leader_url, TOPIC, format!("before-{k}").as_bytes(), b"v").await?.expect_status(200)?;
    }
    let proxy = cluster.proxy().ok_or_else(|| logdex_cluster_tests::Error::Check("no proxy".into()))?;
    let fetch = |offset: u64| {
        let url = format!("{}/topics/{TOPIC}/partitions/0/records?offset={offset}&read=follower", cluster.url(behind));
        async move {
            let reply = api.get_url(&url).await?;
            reply.expect_status(200)?;
            reply.decode::<FetchResponse>()
        }
    };
    caught_up(&fetch, 0, 3).await?;
    proxy.isolate(behind, Fault::Cut);
    for k in 0..5 {
        api.put(&leader_url, TOPIC, format!("during-{k}").as_bytes(), b"v").await?.expect_status(200)?;
    }
    let page = fetch(8).await?;
    ensure_eq!(page.high_watermark, 3, "the cut-off follower is behind");
    ensure!(page.records.is_empty(), "no records past its high watermark: {page:?}");
    ensure_eq!(page.next_offset, 8, "the consumer stays at the offset it asked");
    proxy.heal();
    let page = caught_up(&fetch, 3, 8).await?;
    ensure_eq!(page.records.len(), 5, "the records written during the cut: {page:?}");
    ensure_eq!(page.next_offset, 8, "after the records written during the cut");
    Ok(())
}

/// The page `fetch(offset)` returns once its high watermark is `hw`.
async fn caught_up<F, Fut>(fetch: &F, offset: u64, hw: u64) -> Result<FetchResponse>
where
    F: Fn(u64) -> Fut,
    Fut: std::future::Future<Output = Result<FetchResponse>>,
{
    poll_until(
        &format!("the follower's high watermark reaches {hw}"),
        Duration::from_secs(20),
        Duration::from_millis(100),
        || async {
            let page = fetch(offset).await?;
            Ok(if page.high_watermark == hw { Probe::Ready(page) } else { Probe::NotYet(format!("{page:?}")) })
        },
    )
    .await
}

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

/// The same rounds; the heartbeats that confirm the leader's leadership for the strict
/// reads (and keep its lease) went as calls on the call streams, none on append streams
/// of their own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn strict_reads_confirm_leadership_with_heartbeats_sent_as_calls() -> Result<()> {
    let cluster = Cluster::start(3).await?;
    let outcome = async {
        rounds(&cluster).await?;
        let (calls, streams) = heartbeats_by_transport(&cluster).await?;
        ensure!(calls > 0, "no heartbeat went as a call");
        ensure_eq!(streams, 0, "heartbeats sent on append streams between nodes that take heartbeat calls");
        Ok(())
    }
    .await;
    cluster.finish(outcome)
}

/// The same rounds with every node answering a heartbeat call with UNIMPLEMENTED, as a node
/// from before heartbeat calls does (fail point `rpc::heartbeat_call_unsupported`, a
/// failpoints build): the heartbeats go on append streams, and strict reads still see
/// every acknowledged write.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nodes_without_heartbeat_calls_confirm_strict_reads_with_heartbeats_on_append_streams() -> Result<()> {
    let mut cluster = Cluster::start(3).await?;
    let outcome = async {
        restart_with_fail_point(&mut cluster, "rpc::heartbeat_call_unsupported").await?;
        rounds(&cluster).await?;
        let (_, streams) = heartbeats_by_transport(&cluster).await?;
        ensure!(streams > 0, "no heartbeat went on an append stream");
        Ok(())
    }
    .await;
    cluster.finish(outcome)
}

/// Heartbeats sent by all nodes since they started: (as calls, on append streams).
async fn heartbeats_by_transport(cluster: &Cluster) -> Result<(u64, u64)> {
    let (mut calls, mut streams) = (0, 0);
    for id in cluster.node_ids() {
        calls += cluster.metric(id, "logdex_heartbeat_calls_total").await?;
        streams += cluster.metric(id, "logdex_heartbeat_streams_total").await?;
    }
    Ok((calls, streams))
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
    // Right after a restart of every node the controller may still be electing (503).
    let spec = TopicSpec::compacted(TOPIC, 1, 3);
    // (200 if an attempt that timed out created it after all.)
    let created = settled("the topic is created", Duration::from_secs(20), || api.create_topic(&base, &spec)).await?;
    ensure!(created.status == 201 || created.status == 200, "create answered {}", created.summary());
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

/// A follower's `linearizable` and `strict` reads sent right after its partition's leader
/// was killed (SIGKILL) wait for the next leader and answer the acknowledged value, not
/// 503: a follower learns that its leader is gone only when an election timer fires, up to
/// the longest election timeout (3 s by default) after the last heartbeat.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn follower_reads_right_after_the_leader_is_killed_wait_for_the_next_leader() -> Result<()> {
    let mut cluster = Cluster::start(3).await?;
    let outcome = async {
        let (leader, followers) = written_key_and_its_replicas(&cluster).await?;
        cluster.kill(leader)?;
        reads_during_the_election(&cluster, followers).await
    }
    .await;
    cluster.finish(outcome)
}

/// The same with the leader paused (SIGSTOP) rather than killed: the paused leader holds the
/// read-index call unanswered, and the follower gives it up for the next leader once it sees
/// an election.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn follower_reads_right_after_the_leader_is_paused_wait_for_the_next_leader() -> Result<()> {
    let cluster = Cluster::start(3).await?;
    let outcome = async {
        let (leader, followers) = written_key_and_its_replicas(&cluster).await?;
        cluster.pause(leader)?;
        let read = reads_during_the_election(&cluster, followers).await;
        cluster.resume(leader)?;
        read
    }
    .await;
    cluster.finish(outcome)
}

/// Creates the one-partition topic and writes `key` = `before-the-fault` through its leader;
/// returns the leader and its followers.
async fn written_key_and_its_replicas(cluster: &Cluster) -> Result<(u64, [u64; 2])> {
    let api = cluster.api();
    let created = api.create_topic(&cluster.url(1), &TopicSpec::compacted(TOPIC, 1, 3)).await?;
    created.expect_status(201)?;
    let (leader, followers) = leader_and_followers(cluster).await?;
    api.put(&cluster.url(leader), TOPIC, b"key", b"before-the-fault").await?.expect_status(200)?;
    Ok((leader, followers))
}

/// One `linearizable` read on one follower and one `strict` read on the other, at once.
async fn reads_during_the_election(cluster: &Cluster, followers: [u64; 2]) -> Result<()> {
    let api = cluster.api();
    let (lin_url, strict_url) = (cluster.url(followers[0]), cluster.url(followers[1]));
    let (lin_read, strict_read) = (Read::mode(ReadMode::Linearizable), Read::mode(ReadMode::Strict));
    let (lin, strict) =
        tokio::join!(api.get(&lin_url, TOPIC, b"key", &lin_read), api.get(&strict_url, TOPIC, b"key", &strict_read));
    for (node, mode, read) in [(followers[0], "linearizable", lin), (followers[1], "strict", strict)] {
        let read = read?;
        ensure_eq!(read.status, 200, "{mode} read on node {node} during the election: {}", read.summary());
        ensure_eq!(read.text(), "before-the-fault", "{mode} read on node {node}");
    }
    Ok(())
}

/// Concurrent writes to one partition: the leader replaced commit notices by the next
/// request of their stream (`logdex_commit_notices_replaced_total`), and once the burst is
/// acknowledged both followers reach the leader's high watermark without being asked (the
/// last notice goes after its hold), with the burst's last value for every key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn followers_apply_a_burst_of_writes_whose_commit_notices_were_held_back() -> Result<()> {
    let cluster = Cluster::start(3).await?;
    let outcome = burst(&cluster).await;
    cluster.finish(outcome)
}

async fn burst(cluster: &Cluster) -> Result<()> {
    let api = cluster.api();
    api.create_topic(&cluster.url(1), &TopicSpec::compacted(TOPIC, 1, 3)).await?.expect_status(201)?;
    let (leader, followers) = leader_and_followers(cluster).await?;
    let mut writers = tokio::task::JoinSet::new();
    for w in 0..BURST_WRITERS {
        let (api, url) = (api.clone(), cluster.url(leader));
        writers.spawn(async move {
            for i in 0..BURST_WRITES {
                let put = api.put(&url, TOPIC, format!("writer-{w}").as_bytes(), format!("{i}").as_bytes()).await?;
                put.expect_status(200)?;
            }
            Ok::<_, logdex_cluster_tests::Error>(())
        });
    }
    while let Some(joined) = writers.join_next().await {
        joined.map_err(|e| logdex_cluster_tests::Error::Check(e.to_string()))??;
    }
    let replaced = cluster.metric(leader, "logdex_commit_notices_replaced_total").await?;
    ensure!(replaced > 0, "the leader replaced no commit notice in a burst of {BURST_WRITERS} writers");
    let high_watermark = (BURST_WRITERS * BURST_WRITES) as u64;
    for follower in followers {
        // Bounded: the notice of the burst's last commit goes after a hold of about 1 ms.
        let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
        loop {
            let read = api.get(&cluster.url(follower), TOPIC, b"writer-0", &Read::follower()).await?;
            read.expect_status(200)?;
            let seen = read.header_u64("x-kv-high-watermark")?;
            if seen == high_watermark {
                break;
            }
            ensure!(
                tokio::time::Instant::now() < deadline,
                "node {follower} stayed at high watermark {seen} of {high_watermark} after the burst"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        for w in 0..BURST_WRITERS {
            let read =
                api.get(&cluster.url(follower), TOPIC, format!("writer-{w}").as_bytes(), &Read::follower()).await?;
            read.expect_status(200)?;
            ensure_eq!(read.text(), format!("{}", BURST_WRITES - 1), "writer-{w} on node {follower}");
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
    restart_with_fail_point(cluster, "rpc::calls_unsupported").await?;
    rounds(cluster).await?;
    forwarded_rounds(cluster).await
}

/// Restarts every node with fail point `name` set to `return` (a failpoints build).
async fn restart_with_fail_point(cluster: &mut Cluster, name: &str) -> Result<()> {
    cluster.stop_all()?;
    for id in cluster.node_ids() {
        cluster.set_node_env(id, FAILPOINTS_ENV, &format!("{name}=return"));
    }
    cluster.restart_all().await?;
    for id in cluster.node_ids() {
        let log = cluster.launch_log(id)?;
        ensure!(
            log.contains("crash points armed") && log.contains(name),
            "node {id} did not arm {name}: is the binary a failpoints build \
             (`cargo build -p logdex-api --bin logdex --features failpoints`)?"
        );
    }
    Ok(())
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

/// Reads of many partitions at once from one node, right after a write to each: every
/// read sees its write. Concurrent follower reads of the groups one node leads share
/// read-index calls (`ReadIndexBatch`), so the reader sent fewer read-index requests
/// than it served follower reads.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_follower_reads_of_many_partitions_share_read_index_calls_and_see_acknowledged_writes() -> Result<()>
{
    let cluster = Cluster::start(3).await?;
    let outcome = concurrent_rounds(&cluster).await;
    cluster.finish(outcome)
}

/// The same rounds with every node answering `ReadIndexBatch` with UNIMPLEMENTED, as a
/// node from before it does (fail point `rpc::read_index_batch_unsupported`, a failpoints
/// build): the reader asks for each group's read index alone, with the same answers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nodes_without_read_index_batch_serve_concurrent_follower_reads_one_group_per_call() -> Result<()> {
    let mut cluster = Cluster::start(3).await?;
    let outcome = async {
        restart_with_fail_point(&mut cluster, "rpc::read_index_batch_unsupported").await?;
        concurrent_rounds(&cluster).await
    }
    .await;
    cluster.finish(outcome)
}

async fn concurrent_rounds(cluster: &Cluster) -> Result<()> {
    let api = cluster.api();
    let reader = cluster.url(READER);
    api.create_topic(&reader, &TopicSpec::compacted(MANY, 6, 3)).await?.expect_status(201)?;
    let described = cluster.wait_for_leaders(MANY, Duration::from_secs(20)).await?;
    ensure!(
        described.partitions.iter().any(|p| p.leader != Some(READER)),
        "node {READER} leads every partition: no follower reads to test"
    );
    let reads_before = cluster.metric(READER, "logdex_follower_linearizable_reads_total").await?;
    let fetches_before = cluster.metric(READER, "logdex_read_index_requests_total").await?;
    for round in 0..MANY_ROUNDS {
        let mut offsets = Vec::with_capacity(MANY_KEYS);
        for k in 0..MANY_KEYS {
            let put = api.put(&reader, MANY, format!("key-{k}").as_bytes(), format!("{round}-{k}").as_bytes()).await?;
            put.expect_status(200)?;
            offsets.push(put.header_u64("x-kv-offset")?);
        }
        let mut reads = tokio::task::JoinSet::new();
        for k in 0..MANY_KEYS {
            let (api, reader) = (api.clone(), reader.clone());
            let mode = if k % 2 == 0 { ReadMode::Linearizable } else { ReadMode::Strict };
            reads.spawn(async move {
                let read = api.get(&reader, MANY, format!("key-{k}").as_bytes(), &Read::mode(mode)).await;
                (k, mode, read)
            });
        }
        while let Some(joined) = reads.join_next().await {
            let (k, mode, read) = joined.map_err(|e| logdex_cluster_tests::Error::Check(e.to_string()))?;
            let read = read?;
            read.expect_status(200)?;
            ensure_eq!(read.text(), format!("{round}-{k}"), "round {round}: key-{k} in {mode:?} mode");
            ensure!(read.header_u64("x-kv-offset")? >= offsets[k], "round {round}: stale offset for key-{k}");
        }
    }
    let reads = cluster.metric(READER, "logdex_follower_linearizable_reads_total").await? - reads_before;
    let fetches = cluster.metric(READER, "logdex_read_index_requests_total").await? - fetches_before;
    ensure!(reads > 0, "node {READER} served no follower reads");
    ensure!(fetches < reads, "{reads} follower reads needed {fetches} read-index requests: none were shared");
    Ok(())
}
