//! A replica whose copy of a record is damaged does not answer it wrong, and a lookup that
//! reaches it still gets the right answer: it is forwarded once to a healthy replica. With
//! `forward=false` (or when it was itself forwarded) the damaged replica answers 500
//! `corrupt_data`. A leader whose segment files are damaged does not stop a follower that
//! needs its snapshot: the follower refuses the snapshot, the leader hands leadership to a
//! healthy replica, and the follower catches up from that one. The background scrub finds
//! damage that no read has met yet.

use std::time::Duration;

use logdex_cluster_tests::Cluster;
use logdex_cluster_tests::ClusterOptions;
use logdex_cluster_tests::Error;
use logdex_cluster_tests::Read;
use logdex_cluster_tests::Result;
use logdex_cluster_tests::TopicSpec;
use logdex_cluster_tests::damage;
use logdex_cluster_tests::ensure;
use logdex_cluster_tests::ensure_eq;
use logdex_cluster_tests::support::settled;
use serde_json::Value;

const TOPIC: &str = "dmg";
const KEYS: usize = 60;

fn value(k: usize) -> String {
    format!("value-{k}-{}", "y".repeat(40))
}

/// Creates the 1-partition, replication-factor-3 topic with 1 KiB segments (`delete` policy,
/// so every record stays); returns the node leading it.
async fn create_topic(cluster: &Cluster) -> Result<u64> {
    let mut spec = TopicSpec::compacted(TOPIC, 1, 3);
    spec.config.insert("cleanup.policy".into(), Value::String("delete".into()));
    spec.config.insert("segment.bytes".into(), Value::String("1024".into()));
    cluster.api().create_topic(&cluster.url(1), &spec).await?.expect_status(201)?;
    let d = cluster.wait_for_leaders(TOPIC, Duration::from_secs(20)).await?;
    d.partition(0)?.leader.ok_or_else(|| Error::Check("no leader".into()))
}

/// Flips a bit in the last byte of the first batch of segment file `path` (inside its last
/// record's value): bit rot that only the batch CRC catches. Returns the batch's first key.
fn flip_in_first_batch(path: &std::path::Path) -> Result<String> {
    let mut bytes = std::fs::read(path).map_err(|e| Error::io("reading the segment", e))?;
    let batch = damage::batches(&bytes).into_iter().next().ok_or_else(|| Error::Check("no batch".into()))?;
    let (start, end) = (batch.position as usize, (batch.position + batch.size) as usize);
    let keys = damage::records(&bytes[start..end]);
    let key = keys.first().and_then(|(k, _)| k.clone()).ok_or_else(|| Error::Check("no keyed record".into()))?;
    bytes[end - 1] ^= 0x20;
    std::fs::write(path, &bytes).map_err(|e| Error::io("writing the segment", e))?;
    Ok(key)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lookup_of_a_damaged_record_is_answered_by_a_healthy_replica() -> Result<()> {
    let mut cluster = Cluster::start(3).await?;
    let outcome = scenario(&mut cluster).await;
    cluster.finish(outcome)
}

async fn scenario(cluster: &mut Cluster) -> Result<()> {
    let api = cluster.api().clone();
    let leader = create_topic(cluster).await?;
    for k in 0..KEYS {
        api.put(&cluster.url(1), TOPIC, format!("k-{k}").as_bytes(), value(k).as_bytes()).await?.expect_status(200)?;
    }
    let follower = [1, 2, 3].into_iter().find(|n| *n != leader).ok_or_else(|| Error::Check("no follower".into()))?;
    // Every replica has applied every write before the follower stops.
    // (A follower more than the server's wait behind answers 503 at first.)
    for k in 0..KEYS {
        let read = Read::follower().min_offset(KEYS as u64 - 1);
        let (key, url) = (format!("k-{k}"), cluster.url(follower));
        settled("the follower applied every write", Duration::from_secs(20), || {
            api.get(&url, TOPIC, key.as_bytes(), &read)
        })
        .await?
        .expect_status(200)?;
    }

    // Flip a bit inside the first record of the follower's oldest sealed segment.
    cluster.kill(follower)?;
    let segments = segment_files(cluster, follower)?;
    ensure!(segments.len() > 1, "the follower has a sealed segment: {segments:?}");
    let key = flip_in_first_batch(&segments[0])?;
    cluster.restart(follower).await?;
    let k: usize = key.trim_start_matches("k-").parse().map_err(|_| Error::Check(format!("key {key}")))?;

    let refused = api.get(&cluster.url(follower), TOPIC, key.as_bytes(), &Read::follower().forward(false)).await?;
    refused.expect_error(500, "corrupt_data")?;
    let reply = api.get(&cluster.url(follower), TOPIC, key.as_bytes(), &Read::follower()).await?;
    reply.expect_status(200)?;
    ensure_eq!(reply.text(), value(k), "the damaged key's value, from a healthy replica");
    let answered_by = reply.header_u64("x-kv-node")?;
    ensure!(answered_by != follower, "node {answered_by} answered: not the damaged replica");
    Ok(())
}

/// `--snapshot-every` of the snapshot test: small, so the leader purges its Raft log quickly.
const SNAPSHOT_EVERY: u64 = 20;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leader_with_a_damaged_segment_hands_off_leadership_and_its_lagging_follower_catches_up() -> Result<()> {
    let options = ClusterOptions { snapshot_every: Some(SNAPSHOT_EVERY), ..ClusterOptions::plain(3) };
    let mut cluster = Cluster::start_with(options).await?;
    let outcome = damaged_leader(&mut cluster).await;
    cluster.finish(outcome)
}

/// The `*.log` segment files of node `id`'s only partition replica, oldest first.
fn segment_files(cluster: &Cluster, id: u64) -> Result<Vec<std::path::PathBuf>> {
    let log_dir = std::fs::read_dir(cluster.data_dir(id).join("partitions"))
        .map_err(|e| Error::io("listing partitions", e))?
        .filter_map(|e| e.ok().map(|e| e.path().join("log")))
        .next()
        .ok_or_else(|| Error::Check(format!("node {id} holds no replica")))?;
    let mut segments: Vec<_> = std::fs::read_dir(&log_dir)
        .map_err(|e| Error::io("listing segments", e))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "log"))
        .collect();
    segments.sort();
    Ok(segments)
}

async fn damaged_leader(cluster: &mut Cluster) -> Result<()> {
    let api = cluster.api().clone();
    let leader = create_topic(cluster).await?;
    let lagging = [1, 2, 3].into_iter().find(|n| *n != leader).ok_or_else(|| Error::Check("no follower".into()))?;
    for k in 0..KEYS {
        api.put(&cluster.url(leader), TOPIC, format!("k-{k}").as_bytes(), value(k).as_bytes())
            .await?
            .expect_status(200)?;
    }
    // Writes the lagging follower misses, far past what the leader keeps of its Raft log
    // after a snapshot: it will need the leader's snapshot.
    cluster.kill(lagging)?;
    for k in KEYS..3 * KEYS {
        api.put(&cluster.url(leader), TOPIC, format!("k-{k}").as_bytes(), value(k).as_bytes())
            .await?
            .expect_status(200)?;
    }
    let final_hw = cluster.describe(TOPIC).await?.partition(0)?.high_watermark;

    // Bit rot in the leader's oldest sealed segment: its snapshots hold that file (hard links).
    let segments = segment_files(cluster, leader)?;
    ensure!(segments.len() > 1, "the leader has a sealed segment: {segments:?}");
    flip_in_first_batch(&segments[0])?;

    cluster.restart(lagging).await?;
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    loop {
        let d = cluster.describe(TOPIC).await?;
        let now_leader = d.partition(0)?.leader;
        let caught_up =
            api.get(&cluster.url(lagging), TOPIC, format!("k-{}", 3 * KEYS - 1).as_bytes(), &Read::follower()).await?;
        if now_leader.is_some_and(|l| l != leader) && caught_up.status == 200 {
            ensure_eq!(caught_up.text(), value(3 * KEYS - 1), "the lagging follower's newest key");
            ensure!(caught_up.header_u64("x-kv-high-watermark")? >= final_hw, "the lagging follower caught up");
            break;
        }
        ensure!(
            std::time::Instant::now() < deadline,
            "within 60 s: leader {now_leader:?} (was {leader}), the lagging node {lagging} answered {}",
            caught_up.summary()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    ensure!(
        cluster.metric(lagging, "logdex_damaged_snapshots_refused_total").await? >= 1,
        "node {lagging} refused the damaged snapshot"
    );
    let leader_log = cluster.launch_log(leader)?;
    ensure!(leader_log.contains("handing leadership to replica"), "node {leader} logged its hand-off");
    // Every key answers its value on the lagging node, from its own state.
    for k in 0..3 * KEYS {
        let read = api.get(&cluster.url(lagging), TOPIC, format!("k-{k}").as_bytes(), &Read::follower()).await?;
        read.expect_status(200)?;
        ensure_eq!(read.text(), value(k), "key k-{k} on node {lagging}");
    }
    Ok(())
}

/// Bit rot in a replica's sealed segment that no read touches: the scrub (every cleaner pass)
/// finds it, logs it and marks the replica (`logdex_partition_damaged`), and the replica does
/// not lead the partition.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_scrub_finds_damage_no_read_met_and_marks_the_replica() -> Result<()> {
    let options = ClusterOptions { cleaner_interval_ms: Some(200), ..ClusterOptions::plain(3) };
    let mut cluster = Cluster::start_with(options).await?;
    let outcome = scrubbed(&mut cluster).await;
    cluster.finish(outcome)
}

async fn scrubbed(cluster: &mut Cluster) -> Result<()> {
    let api = cluster.api().clone();
    let leader = create_topic(cluster).await?;
    for k in 0..KEYS {
        api.put(&cluster.url(leader), TOPIC, format!("k-{k}").as_bytes(), value(k).as_bytes())
            .await?
            .expect_status(200)?;
    }
    let damaged = leader;
    ensure_eq!(cluster.metric(damaged, "logdex_partition_damaged").await?, 0, "node {damaged} before the damage");
    cluster.kill(damaged)?;
    let segments = segment_files(cluster, damaged)?;
    ensure!(segments.len() > 1, "node {damaged} has a sealed segment: {segments:?}");
    flip_in_first_batch(&segments[0])?;
    cluster.restart(damaged).await?;

    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        let marked = cluster.metric(damaged, "logdex_partition_damaged").await?;
        let leads = cluster.describe(TOPIC).await?.partition(0)?.leader == Some(damaged);
        if marked == 1 && !leads {
            break;
        }
        ensure!(std::time::Instant::now() < deadline, "within 30 s: damaged mark {marked}, leads {leads}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let log = cluster.launch_log(damaged)?;
    ensure!(log.contains("the scrub found damaged data in this replica"), "node {damaged} logged the damage");
    Ok(())
}
