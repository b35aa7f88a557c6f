//! The client contract of lookups, writes, batch produce, fetch and topic creation
//! (DESIGN.md sections 7, 8, 11 and 12), checked on a 3-node cluster.

use std::collections::BTreeMap;
use std::time::Duration;

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD;
use base64::engine::general_purpose::URL_SAFE;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use logdex_cluster_tests::Api;
use logdex_cluster_tests::Cluster;
use logdex_cluster_tests::Error;
use logdex_cluster_tests::Read;
use logdex_cluster_tests::Reply;
use logdex_cluster_tests::Result;
use logdex_cluster_tests::TopicDescription;
use logdex_cluster_tests::TopicSpec;
use logdex_cluster_tests::Written;
use logdex_cluster_tests::client::Body;
use logdex_cluster_tests::client::FetchResponse;
use logdex_cluster_tests::client::HEADER_HIGH_WATERMARK;
use logdex_cluster_tests::client::HEADER_NODE;
use logdex_cluster_tests::client::HEADER_OFFSET;
use logdex_cluster_tests::client::HEADER_PARTITION;
use logdex_cluster_tests::client::HEADER_REDIRECT;
use logdex_cluster_tests::client::kv_url;
use logdex_cluster_tests::client::written;
use logdex_cluster_tests::ensure;
use logdex_cluster_tests::ensure_eq;
use logdex_cluster_tests::murmur2::kafka_partition;
use logdex_cluster_tests::support::Failures;
use logdex_cluster_tests::support::settled;
use reqwest::Method;
use serde_json::Value;
use serde_json::json;

const NODES: usize = 3;
const SETTLE_TIMEOUT: Duration = Duration::from_secs(20);

/// Creates a compacted topic through node 1 (201) and waits until every partition has a leader.
async fn create_topic(
    cluster: &Cluster,
    name: &str,
    partitions: u32,
    replication_factor: u32,
) -> Result<TopicDescription> {
    let reply = cluster
        .api()
        .create_topic(&cluster.url(1), &TopicSpec::compacted(name, partitions, replication_factor))
        .await?;
    reply.expect_status(201)?;
    cluster.wait_for_leaders(name, SETTLE_TIMEOUT).await
}

/// A lookup retried while it answers 502/503/504 or nothing (the cluster settling).
async fn get(cluster: &Cluster, node: u64, topic: &str, key: &[u8], read: &Read) -> Result<Reply> {
    let base = cluster.url(node);
    let what = format!("GET {topic}/{} from node {node}", String::from_utf8_lossy(key));
    settled(&what, SETTLE_TIMEOUT, || cluster.api().get(&base, topic, key, read)).await
}

/// A GET of a full URL, retried like `get`.
async fn get_url(cluster: &Cluster, url: &str) -> Result<Reply> {
    settled(&format!("GET {url}"), SETTLE_TIMEOUT, || cluster.api().get_url(url)).await
}

async fn put_ok(cluster: &Cluster, node: u64, topic: &str, key: &[u8], value: &[u8]) -> Result<Written> {
    written(&cluster.api().put(&cluster.url(node), topic, key, value).await?)
}

/// A 200 lookup with this value at this offset.
fn expect_hit(reply: &Reply, value: &[u8], offset: u64) -> Result<()> {
    reply.expect_status(200)?;
    ensure!(reply.body == value, "expected value {:?}: {}", String::from_utf8_lossy(value), reply.summary());
    ensure_eq!(reply.header_u64(HEADER_OFFSET)?, offset, "X-Kv-Offset of {}", reply.summary());
    Ok(())
}

/// A 404 `key_not_found` that still names the partition and the serving replica's high watermark.
fn expect_key_not_found(reply: &Reply, partition: Option<u32>) -> Result<u64> {
    reply.expect_error(404, "key_not_found")?;
    let actual = reply.header_u64(HEADER_PARTITION)?;
    if let Some(p) = partition {
        ensure_eq!(actual, u64::from(p), "X-Kv-Partition of a 404: {}", reply.summary());
    }
    reply.header_u64(HEADER_HIGH_WATERMARK)
}

/// A never-written key answers 404 `key_not_found` with X-Kv-Partition and X-Kv-High-Watermark
/// from every node in linearizable and follower mode; an unknown topic answers 404
/// `topic_not_found`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unknown_key_and_unknown_topic_answer_404_with_distinct_codes() -> Result<()> {
    let cluster = Cluster::start(NODES).await?;
    let outcome = unknown_key_and_unknown_topic(&cluster).await;
    cluster.finish(outcome)
}

async fn unknown_key_and_unknown_topic(cluster: &Cluster) -> Result<()> {
    create_topic(cluster, "lookups", 3, 3).await?;
    for node in cluster.node_ids() {
        for read in [Read::linearizable(), Read::follower()] {
            let reply = get(cluster, node, "lookups", b"never-written", &read).await?;
            expect_key_not_found(&reply, Some(kafka_partition(b"never-written", 3)))?;
        }
        let reply = get(cluster, node, "no-such-topic", b"k", &Read::default()).await?;
        reply.expect_error(404, "topic_not_found")?;
    }
    Ok(())
}

/// A DELETE writes a tombstone at a later offset of the same partition, after which every node
/// answers 404 `key_not_found` (linearizable, and follower once caught up) with a high watermark
/// past the tombstone; a rewrite answers 200 again; deleting a never-written key answers 200 and
/// reads as 404.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deleted_key_answers_404_until_rewritten() -> Result<()> {
    let cluster = Cluster::start(NODES).await?;
    let outcome = deleted_key_until_rewritten(&cluster).await;
    cluster.finish(outcome)
}

async fn deleted_key_until_rewritten(cluster: &Cluster) -> Result<()> {
    create_topic(cluster, "tombstones", 3, 3).await?;
    let first = put_ok(cluster, 1, "tombstones", b"doomed", b"v1").await?;
    expect_hit(&get(cluster, 2, "tombstones", b"doomed", &Read::linearizable()).await?, b"v1", first.offset)?;

    let tombstone = written(&cluster.api().delete(&cluster.url(2), "tombstones", b"doomed").await?)?;
    ensure_eq!(tombstone.partition, first.partition, "partition of the tombstone");
    ensure!(
        tombstone.offset > first.offset,
        "tombstone offset {} not after the write's {}",
        tombstone.offset,
        first.offset
    );
    for node in cluster.node_ids() {
        for read in [Read::linearizable(), Read::follower().min_offset(tombstone.offset)] {
            let reply = get(cluster, node, "tombstones", b"doomed", &read).await?;
            let hw = expect_key_not_found(&reply, Some(first.partition))?;
            ensure!(
                hw > tombstone.offset,
                "HW {hw} does not cover the tombstone at {}: {}",
                tombstone.offset,
                reply.summary()
            );
        }
    }

    let again = put_ok(cluster, 3, "tombstones", b"doomed", b"v2").await?;
    ensure!(
        again.offset > tombstone.offset,
        "rewrite offset {} not after the tombstone's {}",
        again.offset,
        tombstone.offset
    );
    for node in cluster.node_ids() {
        expect_hit(&get(cluster, node, "tombstones", b"doomed", &Read::linearizable()).await?, b"v2", again.offset)?;
    }

    let nothing = written(&cluster.api().delete(&cluster.url(1), "tombstones", b"never-written").await?)?;
    let reply = get(cluster, 1, "tombstones", b"never-written", &Read::linearizable()).await?;
    expect_key_not_found(&reply, Some(nothing.partition))?;
    Ok(())
}

/// An empty value is a value, not a tombstone: every node answers 200 with an empty body, and
/// fetch shows the record with an empty (not null) value.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn empty_value_reads_back_as_200_with_empty_body() -> Result<()> {
    let cluster = Cluster::start(NODES).await?;
    let outcome = empty_value(&cluster).await;
    cluster.finish(outcome)
}

async fn empty_value(cluster: &Cluster) -> Result<()> {
    create_topic(cluster, "empties", 3, 3).await?;
    let w = put_ok(cluster, 1, "empties", b"blank", b"").await?;
    for node in cluster.node_ids() {
        for read in [Read::linearizable(), Read::follower().min_offset(w.offset)] {
            expect_hit(&get(cluster, node, "empties", b"blank", &read).await?, b"", w.offset)?;
        }
    }
    let page = cluster.api().fetch_ok(&cluster.url(1), "empties", w.partition, w.offset, 1).await?;
    let record = page
        .records
        .first()
        .ok_or_else(|| Error::Check(format!("fetch at {} returned no record: {page:?}", w.offset)))?;
    ensure_eq!(record.offset, w.offset, "offset of the fetched record");
    ensure_eq!(page.bytes_of(&record.value)?, Some(Vec::new()), "fetched value of an empty write (not a tombstone)");
    Ok(())
}

/// A binary key written through its percent-encoded path reads back identically through the
/// percent-encoded path and through `?key_encoding=base64url`, padded and unpadded (same value,
/// partition and offset); a malformed base64url key answers 400 with a JSON error.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn binary_key_is_the_same_by_percent_encoding_and_base64url() -> Result<()> {
    let cluster = Cluster::start(NODES).await?;
    let outcome = binary_key(&cluster).await;
    cluster.finish(outcome)
}

async fn binary_key(cluster: &Cluster) -> Result<()> {
    create_topic(cluster, "binary", 3, 3).await?;
    // 8 bytes, so padded base64 ends in '='; includes bytes that are special in URLs.
    let key: &[u8] = &[0x00, 0xff, b'/', b'?', b'%', b' ', b'#', 0xc3];
    let w = put_ok(cluster, 1, "binary", key, b"binary-value").await?;
    let base = cluster.url(2);
    let padded = URL_SAFE.encode(key);
    let unpadded = URL_SAFE_NO_PAD.encode(key);
    ensure!(padded.ends_with('=') && padded != unpadded, "test key must need padding: {padded}");
    let urls = [
        kv_url(&base, "binary", key),
        format!("{base}/kv/binary/{padded}?key_encoding=base64url"),
        format!("{base}/kv/binary/{unpadded}?key_encoding=base64url"),
    ];
    for url in &urls {
        let reply = get_url(cluster, url).await?;
        expect_hit(&reply, b"binary-value", w.offset)?;
        ensure_eq!(
            reply.header_u64(HEADER_PARTITION)?,
            u64::from(w.partition),
            "X-Kv-Partition of {}",
            reply.summary()
        );
    }
    for bad in ["@@@@", "a", "a-b_c*"] {
        let reply = get_url(cluster, &format!("{base}/kv/binary/{bad}?key_encoding=base64url")).await?;
        reply.expect_status(400)?;
        reply.expect_error_shape()?;
    }
    Ok(())
}

/// A write sent to a node that does not lead the key's partition succeeds (200) and is read back
/// from the leader and from that node; so does a delete sent there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn write_through_a_node_that_does_not_lead_the_partition_succeeds() -> Result<()> {
    let cluster = Cluster::start(NODES).await?;
    let outcome = write_through_non_leader(&cluster).await;
    cluster.finish(outcome)
}

async fn write_through_non_leader(cluster: &Cluster) -> Result<()> {
    let before = create_topic(cluster, "via-follower", 3, 3).await?;
    // The node leading the fewest partitions (at most one of three).
    let via = cluster
        .node_ids()
        .into_iter()
        .min_by_key(|id| before.partitions.iter().filter(|p| p.leader == Some(*id)).count())
        .ok_or_else(|| Error::Check("no nodes".into()))?;
    let mut writes = Vec::new();
    for i in 0..30 {
        let key = format!("fk-{i}").into_bytes();
        let value = format!("fv-{i}").into_bytes();
        let w = put_ok(cluster, via, "via-follower", &key, &value).await?;
        writes.push((key, value, w));
    }
    let after = cluster.describe("via-follower").await?;
    let led_elsewhere = |p: u32| -> Result<Option<u64>> {
        let (b, a) = (before.partition(p)?.leader, after.partition(p)?.leader);
        Ok(if b == a && b.is_some() && b != Some(via) { b } else { None })
    };
    let mut checked = 0;
    for (key, value, w) in &writes {
        let Some(leader) = led_elsewhere(w.partition)? else { continue };
        checked += 1;
        expect_hit(&get(cluster, leader, "via-follower", key, &Read::linearizable()).await?, value, w.offset)?;
        expect_hit(&get(cluster, via, "via-follower", key, &Read::linearizable()).await?, value, w.offset)?;
        if checked == 1 {
            written(&cluster.api().delete(&cluster.url(via), "via-follower", key).await?)?;
            expect_key_not_found(
                &get(cluster, leader, "via-follower", key, &Read::linearizable()).await?,
                Some(w.partition),
            )?;
        }
    }
    ensure!(
        checked > 0,
        "no write through node {via} landed in a partition led by another node (before {before:?}, after {after:?})"
    );
    Ok(())
}

/// Lookups answered 200 on `node` that came from `origin` (`http`: a client, `forwarded`: another
/// node), from its `/metrics`.
async fn lookups_counted(cluster: &Cluster, node: u64, origin: &str) -> Result<u64> {
    let text = cluster.api().get_url(&format!("{}/metrics", cluster.url(node))).await?.text();
    let series = format!(
        "logdex_http_request_duration_seconds_count{{origin=\"{origin}\",method=\"GET\",route=\"/kv/{{topic}}/{{*key}}\",status=\"200\"}} "
    );
    match text.lines().find_map(|l| l.strip_prefix(&series)) {
        None => Ok(0),
        Some(count) => count.parse().map_err(|_| Error::Check(format!("a count that is no number: {count}"))),
    }
}

/// With `?forward=false`, a node that hosts no replica of the key's partition (rf 1 topic)
/// answers 421 with a JSON error and an X-Kv-Redirect URL that answers 200 from the hosting
/// node; without it (default: forward), the answer equals the hosting node's direct answer,
/// and the request metrics count it once as a client's and once as forwarded.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forward_false_on_a_node_without_the_partition_answers_421_with_a_working_redirect() -> Result<()> {
    let cluster = Cluster::start(NODES).await?;
    let outcome = misdirected(&cluster).await;
    cluster.finish(outcome)
}

async fn misdirected(cluster: &Cluster) -> Result<()> {
    let description = create_topic(cluster, "single-replica", 3, 1).await?;
    let mut first_key_of: BTreeMap<u32, (Vec<u8>, Vec<u8>, Written)> = BTreeMap::new();
    for i in 0..30 {
        let (key, value) = (format!("sk-{i}").into_bytes(), format!("sv-{i}").into_bytes());
        let w = put_ok(cluster, 1, "single-replica", &key, &value).await?;
        first_key_of.entry(w.partition).or_insert((key, value, w));
    }
    ensure!(first_key_of.len() > 1, "30 keys landed in only {:?} of 3 partitions", first_key_of.keys());
    for (partition, (key, value, w)) in &first_key_of {
        let replicas = &description.partition(*partition)?.replicas;
        ensure!(replicas.len() == 1, "an rf-1 partition {partition} has replicas {replicas:?}");
        let host = replicas[0];
        let Some(other) = cluster.node_ids().into_iter().find(|id| *id != host) else {
            return Err(Error::Check("no node other than the host".into()));
        };
        for read in [Read::linearizable(), Read::follower().min_offset(w.offset)] {
            let direct = get(cluster, host, "single-replica", key, &read.clone().forward(false)).await?;
            expect_hit(&direct, value, w.offset)?;
            ensure_eq!(direct.header_u64(HEADER_NODE)?, host, "X-Kv-Node of a direct read: {}", direct.summary());

            let refused = get(cluster, other, "single-replica", key, &read.clone().forward(false)).await?;
            refused.expect_status(421)?;
            refused.expect_error_shape()?;
            let redirect = refused
                .header(HEADER_REDIRECT)
                .ok_or_else(|| Error::Check(format!("421 without X-Kv-Redirect: {}", refused.summary())))?;
            ensure!(redirect.starts_with("http://"), "X-Kv-Redirect is not a full URL: {}", refused.summary());
            let followed = get_url(cluster, redirect).await?;
            expect_hit(&followed, value, w.offset)?;
            ensure_eq!(
                followed.header_u64(HEADER_NODE)?,
                host,
                "X-Kv-Node behind the redirect: {}",
                followed.summary()
            );

            let counted_before =
                (lookups_counted(cluster, other, "http").await?, lookups_counted(cluster, host, "forwarded").await?);
            let forwarded = get(cluster, other, "single-replica", key, &read).await?;
            expect_hit(&forwarded, value, w.offset)?;
            let counted_after =
                (lookups_counted(cluster, other, "http").await?, lookups_counted(cluster, host, "forwarded").await?);
            ensure_eq!(
                counted_after,
                (counted_before.0 + 1, counted_before.1 + 1),
                "a forwarded lookup counts once as the client's (node {other}) and once as forwarded (node {host})"
            );
            for header in [HEADER_PARTITION, HEADER_OFFSET, HEADER_NODE] {
                ensure_eq!(
                    forwarded.header(header),
                    direct.header(header),
                    "{header} of the forwarded answer ({}) vs the direct one ({})",
                    forwarded.summary(),
                    direct.summary()
                );
            }
        }
    }
    Ok(())
}

/// Keys whose path holds `.` or `..` segments (`..`, `a/./b`, `x/y/..`, sent as written) read
/// through a node without their partition the same as on their host: forwarded, and behind a
/// 421's X-Kv-Redirect followed by a client that resolves dot segments. Keys that such a
/// resolution would reach instead (`a/b`, `x`) hold other values.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keys_with_dot_segments_read_alike_forwarded_and_redirected() -> Result<()> {
    let cluster = Cluster::start(NODES).await?;
    let outcome = dot_segment_keys(&cluster).await;
    cluster.finish(outcome)
}

async fn dot_segment_keys(cluster: &Cluster) -> Result<()> {
    let topic = "dots";
    let description = create_topic(cluster, topic, 3, 1).await?;
    let keys: [&[u8]; 6] = [b"..", b".", b"a/./b", b"x/y/..", b"a/b", b"x"];
    let mut written_at = BTreeMap::new();
    for key in keys {
        let url = format!("{}/kv/{topic}/{}?key_encoding=base64url", cluster.url(1), URL_SAFE_NO_PAD.encode(key));
        let value = [b"value of ", key].concat();
        let reply = cluster.api().request(Method::PUT, &url, Some(Body::Raw(value.clone()))).await?;
        written_at.insert(key, (value, written(&reply)?));
    }
    let paths: [(&[u8], &str); 5] =
        [(b"..", ".."), (b"..", "%2E%2e"), (b".", "."), (b"a/./b", "a/./b"), (b"x/y/..", "x/y/..")];
    for (key, raw) in paths {
        let (value, w) = &written_at[key];
        let host = description.partition(w.partition)?.replicas[0];
        let Some(other) = cluster.node_ids().into_iter().find(|id| *id != host) else {
            return Err(Error::Check("no node other than the host".into()));
        };
        for node in [host, other] {
            let path = format!("/kv/{topic}/{raw}");
            let what = format!("GET {path} from node {node}");
            let base = cluster.url(node);
            let reply = settled(&what, SETTLE_TIMEOUT, || cluster.api().get_path_as_is(&base, &path)).await?;
            expect_hit(&reply, value, w.offset)?;
            ensure_eq!(reply.header_u64(HEADER_NODE)?, host, "X-Kv-Node of {}", reply.summary());
        }
        let path = format!("/kv/{topic}/{raw}?forward=false&read=follower");
        let refused = cluster.api().get_path_as_is(&cluster.url(other), &path).await?;
        refused.expect_status(421)?;
        let redirect = refused
            .header(HEADER_REDIRECT)
            .ok_or_else(|| Error::Check(format!("421 without X-Kv-Redirect: {}", refused.summary())))?;
        expect_hit(&get_url(cluster, redirect).await?, value, w.offset)?;
    }
    Ok(())
}

/// A node that hosts no replica of a partition sends a read of it to a replica that answers:
/// with the partition's leader killed (rf 2, so its other replica can never be elected alone),
/// a `follower` lookup and a `follower` fetch through the outside node are answered by the
/// surviving replica, and with `forward=false` its 421 names that replica.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn follower_read_through_a_node_without_the_partition_is_answered_by_a_live_replica_when_the_leader_is_down()
-> Result<()> {
    let mut cluster = Cluster::start(NODES).await?;
    let outcome = read_past_a_lost_leader(&mut cluster, LeaderLoss::Killed).await;
    cluster.finish(outcome)
}

/// As above with the leader paused (SIGSTOP) right after a read through the outside node went
/// to it: its node still takes connections and never answers, so the outside node gives up on
/// it (`FORWARDED_READ_TIMEOUT`, 5 s) and asks the surviving replica, instead of waiting until
/// the leader comes back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn follower_read_through_a_node_without_the_partition_is_answered_by_a_live_replica_when_the_leader_hangs()
-> Result<()> {
    let mut cluster = Cluster::start(NODES).await?;
    let outcome = read_past_a_lost_leader(&mut cluster, LeaderLoss::Paused).await;
    cluster.finish(outcome)
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum LeaderLoss {
    Killed,
    Paused,
}

async fn read_past_a_lost_leader(cluster: &mut Cluster, loss: LeaderLoss) -> Result<()> {
    let topic = "two-replicas";
    let description = create_topic(cluster, topic, 3, 2).await?;
    // A partition led by its first replica: the replica a read went to when no leader was known.
    let p = description
        .partitions
        .iter()
        .find(|p| p.leader.is_some() && p.leader == p.replicas.first().copied())
        .or_else(|| description.partitions.first())
        .ok_or_else(|| Error::Check(format!("no partitions: {description:?}")))?;
    let leader = p.leader.ok_or_else(|| Error::Check(format!("no leader: {description:?}")))?;
    let survivor = p.replicas.iter().copied().find(|r| *r != leader).ok_or_else(|| Error::Check(format!("{p:?}")))?;
    let outsider = cluster
        .node_ids()
        .into_iter()
        .find(|id| !p.replicas.contains(id))
        .ok_or_else(|| Error::Check(format!("every node hosts {p:?}")))?;
    let key = (0..1000)
        .map(|i| format!("dl-{i}").into_bytes())
        .find(|k| kafka_partition(k, 3) == p.partition)
        .ok_or_else(|| Error::Check("no key of the partition".into()))?;
    let w = put_ok(cluster, outsider, topic, &key, b"kept").await?;
    ensure_eq!(w.partition, p.partition, "partition of the written key");
    // Both replicas applied it before the leader goes.
    let hit = get(cluster, survivor, topic, &key, &Read::follower().min_offset(w.offset)).await?;
    expect_hit(&hit, b"kept", w.offset)?;

    let read = if loss == LeaderLoss::Paused {
        // The outside node's last read of the partition went to the leader.
        let warm = get(cluster, outsider, topic, &key, &Read::follower()).await?;
        ensure_eq!(warm.header_u64(HEADER_NODE)?, leader, "a read through node {outsider}: {}", warm.summary());
        cluster.pause(leader)?;
        // Asked once, not retried: the answer must not wait for the paused leader (a client
        // timeout of three times the forwarding node's limit).
        let api = Api::with_timeout(3 * Duration::from_secs(5))?;
        api.get(&cluster.url(outsider), topic, &key, &Read::follower()).await?
    } else {
        cluster.kill(leader)?;
        get(cluster, outsider, topic, &key, &Read::follower()).await?
    };
    expect_hit(&read, b"kept", w.offset)?;
    ensure_eq!(read.header_u64(HEADER_NODE)?, survivor, "X-Kv-Node of the read: {}", read.summary());

    let fetch_path = format!("/topics/{topic}/partitions/{}/records?offset={}&read=follower", p.partition, w.offset);
    let fetched = get_url(cluster, &format!("{}{fetch_path}", cluster.url(outsider))).await?;
    fetched.expect_status(200)?;
    let page: FetchResponse = fetched.decode()?;
    ensure!(
        page.records.first().is_some_and(|r| r.offset == w.offset),
        "fetch through node {outsider}: {}",
        fetched.summary()
    );

    let refused = get(cluster, outsider, topic, &key, &Read::follower().forward(false)).await?;
    refused.expect_status(421)?;
    let redirect = refused
        .header(HEADER_REDIRECT)
        .ok_or_else(|| Error::Check(format!("421 without X-Kv-Redirect: {}", refused.summary())))?;
    let followed = get_url(cluster, redirect).await?;
    expect_hit(&followed, b"kept", w.offset)?;
    ensure_eq!(followed.header_u64(HEADER_NODE)?, survivor, "X-Kv-Node behind the redirect: {}", followed.summary());
    Ok(())
}

/// A batch produce answers one (partition, offset) per record in request order, dense and
/// increasing per partition, honouring explicit partitions and Kafka's partitioner otherwise;
/// fetch returns those records with keys, values, headers and tombstones, `next_offset` and
/// `high_watermark`; lookups see the latest value per key; base64 batches round-trip bytes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batch_produce_returns_offsets_in_request_order_and_fetch_returns_the_records() -> Result<()> {
    let cluster = Cluster::start(NODES).await?;
    let outcome = batch_produce(&cluster).await;
    cluster.finish(outcome)
}

/// One record of a test batch, as sent.
struct Sent {
    key: Vec<u8>,
    value: Option<Vec<u8>>,
    headers: BTreeMap<String, String>,
    partition: u32,
}

async fn batch_produce(cluster: &Cluster) -> Result<()> {
    const TOPIC: &str = "batches";
    create_topic(cluster, TOPIC, 2, 3).await?;
    let mut sent = Vec::new();
    let mut records = Vec::new();
    for i in 0..8u32 {
        let key = format!("bk-{}", i % 6);
        let partition = kafka_partition(key.as_bytes(), 2);
        // Key bk-1 is written twice then deleted; bk-0 and bk-1 are overwritten in the batch.
        let value = if i == 7 { None } else { Some(format!("bv-{i}")) };
        let headers: BTreeMap<String, String> = if i % 3 == 0 {
            BTreeMap::from([("h".to_string(), format!("x{i}")), ("trace".to_string(), "t".into())])
        } else {
            BTreeMap::new()
        };
        let mut record = json!({ "key": key, "value": value });
        if !headers.is_empty() {
            record["headers"] = json!(headers);
        }
        if i % 2 == 0 {
            record["partition"] = json!(partition);
        }
        records.push(record);
        sent.push(Sent { key: key.into_bytes(), value: value.map(String::into_bytes), headers, partition });
    }
    let reply =
        cluster.api().produce(&cluster.url(2), TOPIC, &json!({ "records": records, "encoding": "utf8" })).await?;
    reply.expect_status(200)?;
    let offsets: Vec<Written> = serde_json::from_value(reply.json()?.get("offsets").cloned().unwrap_or(Value::Null))
        .map_err(|e| Error::Check(format!("produce answer has no offsets list ({e}): {}", reply.summary())))?;
    ensure_eq!(offsets.len(), sent.len(), "offsets in the produce answer {}", reply.summary());
    let mut per_partition: BTreeMap<u32, Vec<(u64, &Sent)>> = BTreeMap::new();
    for (w, s) in offsets.iter().zip(&sent) {
        ensure_eq!(
            w.partition,
            s.partition,
            "partition of record {:?} in {}",
            String::from_utf8_lossy(&s.key),
            reply.summary()
        );
        per_partition.entry(w.partition).or_default().push((w.offset, s));
    }
    ensure!(per_partition.len() == 2, "the test batch must span both partitions: {}", reply.summary());
    for (partition, written) in &per_partition {
        let first = written[0].0;
        let got: Vec<u64> = written.iter().map(|(o, _)| *o).collect();
        let dense: Vec<u64> = (first..first + written.len() as u64).collect();
        ensure_eq!(got, dense, "offsets of partition {partition} in request order");
        check_fetch(cluster, TOPIC, *partition, first, written).await?;
    }
    check_latest_values(cluster, TOPIC, &sent).await?;
    base64_batch_round_trips(cluster, TOPIC).await
}

/// A batch produce that one of its partitions cannot take is refused whole, before anything
/// is written: records making a batch over the topic's `max.message.bytes` for one partition
/// (413), and, with `forward=false`, records for a partition another node leads (421; the
/// redirect works when one node leads every partition of the batch).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batch_produce_that_one_partition_cannot_take_writes_no_partition() -> Result<()> {
    let cluster = Cluster::start(NODES).await?;
    let outcome = batch_refused_whole(&cluster).await;
    cluster.finish(outcome)
}

async fn batch_refused_whole(cluster: &Cluster) -> Result<()> {
    const SMALL: &str = "small-batches";
    let mut spec = TopicSpec::compacted(SMALL, 3, 3);
    spec.config.insert("max.message.bytes".into(), json!("1000"));
    cluster.api().create_topic(&cluster.url(1), &spec).await?.expect_status(201)?;
    cluster.wait_for_leaders(SMALL, SETTLE_TIMEOUT).await?;
    // Partition 0's record fits; partition 1's three 400-byte values together do not.
    let big = "y".repeat(400);
    let mut records = vec![json!({ "key": "a", "value": "x", "partition": 0 })];
    for key in ["b", "c", "d"] {
        records.push(json!({ "key": key, "value": big, "partition": 1 }));
    }
    for node in cluster.node_ids() {
        let reply = cluster.api().produce(&cluster.url(node), SMALL, &json!({ "records": records })).await?;
        reply.expect_error(413, "too_large")?;
    }
    expect_nothing_written_before(cluster, 1, SMALL, 3).await?;

    const APART: &str = "led-apart";
    let description = create_topic(cluster, APART, 3, 1).await?;
    let leaders: Vec<u64> = (0..3)
        .map(|p| description.partition(p)?.replicas.first().copied().ok_or_else(|| Error::Check("no replica".into())))
        .collect::<Result<_>>()?;
    let one_per_partition = json!({ "records": (0..3).map(|p| json!({ "key": format!("k{p}"), "value": "v", "partition": p })).collect::<Vec<_>>() });
    for node in cluster.node_ids() {
        let url = format!("{}/topics/{APART}/records?forward=false", cluster.url(node));
        ensure!(!leaders.iter().all(|l| *l == node), "node {node} leads every partition of {APART}: {leaders:?}");
        let reply = cluster.api().request(Method::POST, &url, Some(Body::Json(one_per_partition.clone()))).await?;
        reply.expect_status(421)?;
        reply.expect_error_shape()?;
        ensure!(reply.header(HEADER_REDIRECT).is_some(), "421 without X-Kv-Redirect: {}", reply.summary());
    }
    expect_nothing_written_before(cluster, 1, APART, 3).await?;
    // Records only for partitions one other node leads: its redirect takes them.
    let (partition, leader) = (0u32, leaders[0]);
    let Some(other) = cluster.node_ids().into_iter().find(|n| *n != leader) else {
        return Err(Error::Check("no node other than the leader".into()));
    };
    let body = json!({ "records": [{ "key": "r", "value": "v", "partition": partition }] });
    let url = format!("{}/topics/{APART}/records?forward=false", cluster.url(other));
    let refused = cluster.api().request(Method::POST, &url, Some(Body::Json(body.clone()))).await?;
    refused.expect_status(421)?;
    let redirect = refused
        .header(HEADER_REDIRECT)
        .ok_or_else(|| Error::Check(format!("421 without X-Kv-Redirect: {}", refused.summary())))?;
    let followed = cluster.api().request(Method::POST, redirect, Some(Body::Json(body))).await?;
    followed.expect_status(200)?;
    ensure_eq!(
        followed.json()?["offsets"],
        json!([{ "partition": partition, "offset": 1 }]),
        "the redirected batch follows the one record per partition: {}",
        followed.summary()
    );
    Ok(())
}

/// Writes one record to each of `partitions` through `node` and checks each lands at offset
/// 0: nothing was written to any of them before.
async fn expect_nothing_written_before(cluster: &Cluster, node: u64, topic: &str, partitions: u32) -> Result<()> {
    let records: Vec<Value> =
        (0..partitions).map(|p| json!({ "key": format!("probe-{p}"), "value": "p", "partition": p })).collect();
    let reply = cluster.api().produce(&cluster.url(node), topic, &json!({ "records": records })).await?;
    reply.expect_status(200)?;
    let expected: Vec<Value> = (0..partitions).map(|p| json!({ "partition": p, "offset": 0 })).collect();
    ensure_eq!(
        reply.json()?["offsets"],
        json!(expected),
        "a refused batch left records in {topic}: {}",
        reply.summary()
    );
    Ok(())
}

/// Fetch of `partition` from `first` returns exactly `written`, then a one-record page.
async fn check_fetch(
    cluster: &Cluster,
    topic: &str,
    partition: u32,
    first: u64,
    written: &[(u64, &Sent)],
) -> Result<()> {
    let page = cluster.api().fetch_ok(&cluster.url(3), topic, partition, first, 100).await?;
    ensure_eq!(page.records.len(), written.len(), "records fetched from partition {partition}: {page:?}");
    for (record, (offset, s)) in page.records.iter().zip(written) {
        ensure_eq!(record.offset, *offset, "offset of fetched record {record:?}");
        ensure_eq!(page.bytes_of(&record.key)?, Some(s.key.clone()), "key of fetched record {record:?}");
        ensure_eq!(page.bytes_of(&record.value)?, s.value.clone(), "value of fetched record {record:?}");
        ensure_eq!(fetched_headers(&page, record.headers.as_ref())?, s.headers, "headers of fetched record {record:?}");
    }
    let last = written[written.len() - 1].0;
    ensure_eq!(page.next_offset, last + 1, "next_offset of partition {partition}");
    ensure_eq!(page.high_watermark, last + 1, "high_watermark of partition {partition}");
    if written.len() > 1 {
        let one = cluster.api().fetch_ok(&cluster.url(1), topic, partition, first + 1, 1).await?;
        let offsets: Vec<u64> = one.records.iter().map(|r| r.offset).collect();
        ensure_eq!(offsets, vec![first + 1], "offsets of a max_records=1 fetch at {}", first + 1);
        ensure_eq!(one.next_offset, first + 2, "next_offset of a max_records=1 fetch");
    }
    Ok(())
}

/// Fetched headers as a name -> value map: an object, or a list of `{"key","value"}`; values
/// decoded like the record's value.
fn fetched_headers(page: &FetchResponse, headers: Option<&Value>) -> Result<BTreeMap<String, String>> {
    let decode = |v: &Value| -> Result<String> {
        let text = v.as_str().map(str::to_string);
        let bytes = page.bytes_of(&text)?.unwrap_or_default();
        Ok(String::from_utf8_lossy(&bytes).into_owned())
    };
    let mut out = BTreeMap::new();
    match headers {
        None | Some(Value::Null) => {}
        Some(Value::Object(map)) => {
            for (name, value) in map {
                out.insert(name.clone(), decode(value)?);
            }
        }
        Some(Value::Array(list)) => {
            for item in list {
                let name = item.get("key").and_then(Value::as_str).unwrap_or_default().to_string();
                out.insert(name, decode(item.get("value").unwrap_or(&Value::Null))?);
            }
        }
        Some(other) => return Err(Error::Check(format!("fetched headers are neither an object nor a list: {other}"))),
    }
    Ok(out)
}

/// Each key of the batch reads as its last value in the batch (404 when that is a tombstone).
async fn check_latest_values(cluster: &Cluster, topic: &str, sent: &[Sent]) -> Result<()> {
    let mut latest: BTreeMap<&[u8], &Option<Vec<u8>>> = BTreeMap::new();
    for s in sent {
        latest.insert(&s.key, &s.value);
    }
    for (key, value) in latest {
        let reply = get(cluster, 1, topic, key, &Read::linearizable()).await?;
        match value {
            Some(v) => {
                reply.expect_status(200)?;
                ensure!(reply.body == *v, "latest value of {:?}: {}", String::from_utf8_lossy(key), reply.summary());
            }
            None => {
                expect_key_not_found(&reply, None)?;
            }
        }
    }
    Ok(())
}

/// A base64 batch with a binary key and value: fetch and a base64url lookup return the bytes.
async fn base64_batch_round_trips(cluster: &Cluster, topic: &str) -> Result<()> {
    let key: &[u8] = &[0x00, 0x01, 0xfe, 0xff, b'\n'];
    let value: &[u8] = &[0xff, 0x00, 0x80, b'"', b'\\'];
    let body =
        json!({ "records": [{ "key": STANDARD.encode(key), "value": STANDARD.encode(value) }], "encoding": "base64" });
    let reply = cluster.api().produce(&cluster.url(1), topic, &body).await?;
    reply.expect_status(200)?;
    let offsets: Vec<Written> = serde_json::from_value(reply.json()?.get("offsets").cloned().unwrap_or(Value::Null))
        .map_err(|e| Error::Check(format!("produce answer has no offsets list ({e}): {}", reply.summary())))?;
    let [w] = offsets.as_slice() else {
        return Err(Error::Check(format!("one record produced, offsets {offsets:?}")));
    };
    ensure_eq!(w.partition, kafka_partition(key, 2), "partition of a keyed record without a partition");
    let page = cluster.api().fetch_ok(&cluster.url(2), topic, w.partition, w.offset, 1).await?;
    let record =
        page.records.first().ok_or_else(|| Error::Check(format!("fetch at {} is empty: {page:?}", w.offset)))?;
    ensure_eq!(page.bytes_of(&record.key)?, Some(key.to_vec()), "fetched binary key");
    ensure_eq!(page.bytes_of(&record.value)?, Some(value.to_vec()), "fetched binary value");
    let url = format!("{}/kv/{topic}/{}?key_encoding=base64url", cluster.url(3), URL_SAFE_NO_PAD.encode(key));
    expect_hit(&get_url(cluster, &url).await?, value, w.offset)
}

/// Creating a topic that exists identically answers 200 with its description (from any node);
/// a different spec under the same name answers 409; a replication factor above the node count
/// answers 400; neither changes anything. A create naming only the topic gets one partition and
/// three replicas. A name that differs from an existing one only in '.' against '_' is 409, and
/// a move to a node list that is empty, repeats a node or names an unknown one is 400.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn creating_a_topic_is_idempotent_defaults_to_three_replicas_and_rejects_conflicting_or_impossible_specs()
-> Result<()> {
    let cluster = Cluster::start(NODES).await?;
    let outcome = topic_creation(&cluster).await;
    cluster.finish(outcome)
}

async fn topic_creation(cluster: &Cluster) -> Result<()> {
    let api = cluster.api();
    let spec = TopicSpec::compacted("admin", 3, 3);
    let created = api.create_topic(&cluster.url(1), &spec).await?;
    created.expect_status(201)?;
    let again = api.create_topic(&cluster.url(2), &spec).await?;
    again.expect_status(200)?;
    let described: TopicDescription = again.decode()?;
    ensure_eq!(described.name.as_str(), "admin", "name in the 200 answer");
    ensure_eq!(described.partitions.len(), 3, "partitions in the 200 answer");

    let more_partitions = TopicSpec { partitions: 4, ..spec.clone() };
    let mut other_policy = spec.clone();
    other_policy.config.insert("cleanup.policy".into(), json!("delete"));
    let fewer_replicas = TopicSpec { replication_factor: 1, ..spec.clone() };
    for conflicting in [&more_partitions, &other_policy, &fewer_replicas] {
        let reply = api.create_topic(&cluster.url(3), conflicting).await?;
        reply.expect_status(409)?;
        reply.expect_error_shape()?;
    }
    let too_wide = api.create_topic(&cluster.url(1), &TopicSpec::compacted("too-wide", 3, 4)).await?;
    too_wide.expect_status(400)?;
    too_wide.expect_error_shape()?;

    let now = cluster.describe("admin").await?;
    ensure_eq!((now.partitions.len(), now.replication_factor), (3, 3), "admin after rejected creates");
    ensure_eq!(now.config.get("cleanup.policy").and_then(Value::as_str), Some("compact"), "admin cleanup.policy");
    api.describe(&cluster.url(1), "too-wide").await?.expect_error(404, "topic_not_found")?;

    // Only a name: one partition, one replica on each of the three nodes, and the same create
    // spelling the defaults out is identical.
    let url = format!("{}/topics", cluster.url(2));
    let bare = api.request(Method::POST, &url, Some(Body::Json(json!({"name": "bare"})))).await?;
    bare.expect_status(201)?;
    let described: TopicDescription = bare.decode()?;
    ensure_eq!((described.partitions.len(), described.replication_factor), (1, 3), "defaults of a bare create");
    let mut replicas = described.partitions[0].replicas.clone();
    replicas.sort_unstable();
    ensure_eq!(replicas, cluster.node_ids(), "replicas of a bare create");
    api.create_topic(&cluster.url(3), &TopicSpec::compacted("bare", 1, 3)).await?.expect_status(200)?;

    // As in Kafka, a name differing from an existing one only in '.' against '_' collides.
    api.create_topic(&cluster.url(1), &TopicSpec::compacted("a.b", 1, 3)).await?.expect_status(201)?;
    let colliding = api.create_topic(&cluster.url(2), &TopicSpec::compacted("a_b", 1, 3)).await?;
    colliding.expect_error(409, "conflict")?;
    api.describe(&cluster.url(1), "a_b").await?.expect_error(404, "topic_not_found")?;

    // A move naming a node that is not registered, a node twice, or no node is 400.
    let url = format!("{}/topics/admin/partitions/0/replicas", cluster.url(1));
    for replicas in [json!([1, 2, 9]), json!([1, 1, 2]), json!([])] {
        let reply = api.request(Method::PUT, &url, Some(Body::Json(json!({ "replicas": replicas })))).await?;
        reply.expect_error(400, "invalid_replicas")?;
    }
    Ok(())
}

/// Malformed JSON, invalid topic specs, bad encodings, a bad read mode, bad numbers and
/// out-of-range partitions each get a 4xx JSON error with a code; the node keeps answering
/// /healthz after each, and no record of a rejected batch is written.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_requests_get_a_4xx_json_error_and_the_node_keeps_serving() -> Result<()> {
    let cluster = Cluster::start(NODES).await?;
    let outcome = malformed_requests(&cluster).await;
    cluster.finish(outcome)
}

async fn malformed_requests(cluster: &Cluster) -> Result<()> {
    const TOPIC: &str = "strict";
    create_topic(cluster, TOPIC, 3, 3).await?;
    let json_text = |text: &str| Some(Body::Text { content_type: "application/json", text: text.to_string() });
    let cases: Vec<(Method, String, Option<Body>)> = vec![
        (Method::POST, "/topics".into(), json_text("{not json")),
        (
            Method::POST,
            "/topics".into(),
            Some(Body::Json(json!({"name": "zero", "partitions": 0, "replication_factor": 1}))),
        ),
        (
            Method::POST,
            "/topics".into(),
            Some(Body::Json(json!({"name": "bad name!", "partitions": 1, "replication_factor": 1}))),
        ),
        (Method::POST, "/topics".into(), Some(Body::Json(json!({"name": 7, "partitions": "six"})))),
        (Method::POST, format!("/topics/{TOPIC}/records"), json_text("{\"records\": [")),
        (
            Method::POST,
            format!("/topics/{TOPIC}/records"),
            Some(Body::Json(json!({"records": [{"key": "k", "value": "!!!"}], "encoding": "base64"}))),
        ),
        (
            Method::POST,
            format!("/topics/{TOPIC}/records"),
            Some(Body::Json(json!({"records": [{"key": "k", "value": "v"}], "encoding": "rot13"}))),
        ),
        (
            Method::POST,
            format!("/topics/{TOPIC}/records"),
            Some(Body::Json(
                json!({"records": [{"key": "partial-ok", "value": "1", "partition": 0}, {"key": "partial-bad", "value": "2", "partition": 3}]}),
            )),
        ),
        (Method::GET, format!("/kv/{TOPIC}/k?read=eventual"), None),
        (Method::GET, format!("/kv/{TOPIC}/k?partition=3"), None),
        (Method::GET, format!("/kv/{TOPIC}/k?min_offset=abc&read=follower"), None),
        (Method::GET, format!("/topics/{TOPIC}/partitions/3/records?offset=0&max_records=10"), None),
        (Method::GET, format!("/topics/{TOPIC}/partitions/0/records?offset=abc"), None),
    ];
    let count = cases.len();
    let mut failures = Failures::default();
    for (i, (method, path, body)) in cases.into_iter().enumerate() {
        let node = cluster.node_ids()[i % NODES];
        let base = cluster.url(node);
        let reply = cluster.api().request(method, &format!("{base}{path}"), body).await?;
        if (400..500).contains(&reply.status) {
            failures.record(reply.expect_error_shape().map(|_| ()));
        } else {
            failures.add(format!("expected a 4xx: {}", reply.summary()));
        }
        let health = cluster.api().healthz(&base).await;
        failures.record(health.and_then(|h| h.expect_status(200).map(|_| ())));
    }
    failures.into_result(count, "bad requests")?;
    // A partition that is not a number is `invalid_partition`, in a path as in a query.
    let not_numbers: Vec<(Method, String, Option<Body>)> = vec![
        (Method::GET, format!("/topics/{TOPIC}/partitions/abc/records?offset=0"), None),
        (Method::GET, format!("/topics/{TOPIC}/partitions/99999999999/records"), None),
        (Method::GET, format!("/kv/{TOPIC}/k?partition=-1"), None),
        (Method::PUT, format!("/kv/{TOPIC}/k?partition=one"), Some(Body::Raw(b"v".to_vec()))),
        (Method::PUT, format!("/topics/{TOPIC}/partitions/-1/replicas"), Some(Body::Json(json!({"replicas": [1]})))),
        (Method::GET, format!("/topics/{TOPIC}/partitions/+1/records?offset=0"), None),
        (Method::GET, format!("/kv/{TOPIC}/k?partition=%2B0"), None),
        (
            Method::POST,
            format!("/topics/{TOPIC}/records"),
            Some(Body::Json(json!({"records": [{"key": "k", "value": "v", "partition": -1}]}))),
        ),
        (
            Method::POST,
            format!("/topics/{TOPIC}/records"),
            Some(Body::Json(json!({"records": [{"key": "k", "value": "v", "partition": "0"}]}))),
        ),
    ];
    for (method, path, body) in not_numbers {
        let reply = cluster.api().request(method, &format!("{}{path}", cluster.url(1)), body).await?;
        reply.expect_error(400, "invalid_partition")?;
    }
    // Nothing was written by the rejected requests, in particular no part of the mixed batch.
    let reply = get(cluster, 1, TOPIC, b"partial-ok", &Read::linearizable().partition(0)).await?;
    expect_key_not_found(&reply, Some(0))?;
    let description = cluster.describe(TOPIC).await?;
    for p in &description.partitions {
        ensure_eq!(p.high_watermark, p.log_start_offset, "partition {} written by rejected requests", p.partition);
    }
    for node in cluster.node_ids() {
        cluster.api().healthz(&cluster.url(node)).await?.expect_status(200)?;
        cluster.api().readyz(&cluster.url(node)).await?.expect_status(200)?;
    }
    Ok(())
}

/// A key's partition is Kafka's default partitioner over its bytes, for text keys and for
/// percent-encoded binary keys, in writes and in lookups.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keys_are_partitioned_by_kafka_murmur2_of_their_bytes() -> Result<()> {
    let cluster = Cluster::start(NODES).await?;
    let outcome = murmur2_partitioning(&cluster).await;
    cluster.finish(outcome)
}

async fn murmur2_partitioning(cluster: &Cluster) -> Result<()> {
    create_topic(cluster, "partitioned", 6, 3).await?;
    let mut keys: Vec<Vec<u8>> =
        ["21", "foobar", "abc", "a-little-bit-long-string"].iter().map(|k| k.as_bytes().to_vec()).collect();
    keys.extend((0..24).map(|i| format!("user-{i}").into_bytes()));
    keys.extend((0..8u8).map(|i| vec![i, 0xff, 0x00, b'/', i.wrapping_mul(37)]));
    for key in &keys {
        let expected = kafka_partition(key, 6);
        let w = put_ok(cluster, 1, "partitioned", key, b"p").await?;
        ensure_eq!(w.partition, expected, "partition of key {key:?}");
        let reply = get(cluster, 2, "partitioned", key, &Read::linearizable()).await?;
        expect_hit(&reply, b"p", w.offset)?;
        ensure_eq!(reply.header_u64(HEADER_PARTITION)?, u64::from(expected), "X-Kv-Partition of a lookup of {key:?}");
    }
    Ok(())
}
