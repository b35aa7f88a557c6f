//! Concurrent writes are batched into one Raft entry, but batching never changes what a
//! request alone would get: under a small `max.message.bytes`, concurrent writes that each
//! fit all succeed (though together they would not), and a write too big by itself is
//! refused with a JSON error while the others go through. The records of one produce request
//! that name neither a key nor a partition go into one partition together, one batch.

mod common;

use common::TestResult;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_writes_that_each_fit_max_message_bytes_all_succeed() -> TestResult {
    let dir = tempfile::tempdir()?;
    let http = reqwest::Client::new();
    let (node, url) = common::start_node(dir.path(), &[]).await?;
    let created = http
        .post(format!("{url}/topics"))
        .body(r#"{"name":"small","partitions":1,"replication_factor":1,"config":{"max.message.bytes":"1024"}}"#)
        .send()
        .await?;
    assert_eq!(created.status(), 201);
    // 48 concurrent 300-byte writes: each fits in 1024 bytes, any 4 of them together do not.
    let mut writes = Vec::new();
    for k in 0..48 {
        let http = http.clone();
        let url = format!("{url}/kv/small/key-{k}");
        writes.push(tokio::spawn(async move { http.put(url).body(vec![b'v'; 300]).send().await }));
    }
    // And one that is too big by itself, among them.
    let too_big = http.put(format!("{url}/kv/small/big")).body(vec![b'x'; 2000]).send().await?;
    let status = too_big.status();
    let body: serde_json::Value = too_big.json().await?;
    assert!(status.is_client_error(), "a write over max.message.bytes must be refused: {status} {body}");
    assert!(body["error"]["message"].is_string(), "refusal carries a JSON error: {body}");
    let mut offsets = Vec::new();
    for w in writes {
        let r = w.await??;
        assert_eq!(r.status(), 200, "a write that fits by itself failed: {}", r.text().await?);
        offsets.push(r.headers()["x-kv-offset"].to_str()?.parse::<u64>()?);
    }
    offsets.sort_unstable();
    offsets.dedup();
    assert_eq!(offsets.len(), 48, "every write got its own offset");
    for k in 0..48 {
        let r = http.get(format!("{url}/kv/small/key-{k}")).send().await?;
        assert_eq!(r.status(), 200, "key-{k}");
        assert_eq!(r.bytes().await?.len(), 300);
    }
    let r = http.get(format!("{url}/kv/small/big")).send().await?;
    assert_eq!(r.status(), 404, "the refused write left nothing behind");
    node.shutdown().await;
    Ok(())
}

/// The (partition, offset) of each record of a produce answer.
fn placed(answer: &serde_json::Value) -> Vec<(u64, u64)> {
    answer["offsets"]
        .as_array()
        .map(|offsets| offsets.iter().filter_map(|o| Some((o["partition"].as_u64()?, o["offset"].as_u64()?))).collect())
        .unwrap_or_default()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keyless_records_of_one_request_share_one_partition_and_requests_take_turns() -> TestResult {
    let dir = tempfile::tempdir()?;
    let http = reqwest::Client::new();
    let (node, url) = common::start_node(dir.path(), &[]).await?;
    common::create_topic(&http, &url, "logs", 4).await?;
    let mut turns = std::collections::BTreeSet::new();
    for request in 0..4 {
        // Five records without a key, then one with a key, which goes by its key.
        let mut records: Vec<_> = (0..5).map(|i| serde_json::json!({"value": format!("r{request}-{i}")})).collect();
        records.push(serde_json::json!({"key": "k", "value": "keyed"}));
        let answer = http.post(format!("{url}/topics/logs/records")).json(&serde_json::json!({"records": records}));
        let answer = answer.send().await?;
        assert_eq!(answer.status(), 200);
        let mut offsets = placed(&answer.json().await?);
        assert_eq!(offsets.len(), 6);
        offsets.pop();
        let partition = offsets[0].0;
        assert!(offsets.iter().all(|(p, _)| *p == partition), "request {request}: {offsets:?}");
        let numbers: Vec<u64> = offsets.iter().map(|(_, o)| *o).collect();
        assert!(numbers.windows(2).all(|w| w[1] == w[0] + 1), "one batch, in request order: {numbers:?}");
        turns.insert(partition);
    }
    assert_eq!(turns.len(), 4, "four requests took the four partitions in turn: {turns:?}");
    node.shutdown().await;
    Ok(())
}

/// Two nodes (node 2 joined through node 1) and topic `logs` of 4 partitions with one replica
/// each; the directories live as long as the nodes.
struct TwoNodes {
    node_1: logdex_api::serve::RunningNode,
    url_1: String,
    node_2: logdex_api::serve::RunningNode,
    url_2: String,
    /// The topic as node 1 describes it after the create.
    described: serde_json::Value,
    _dirs: (tempfile::TempDir, tempfile::TempDir),
}

async fn two_nodes(http: &reqwest::Client) -> TestResult<TwoNodes> {
    let (dir_1, dir_2) = (tempfile::tempdir()?, tempfile::tempdir()?);
    let (node_1, url_1) = common::start_node(dir_1.path(), &["--node-id", "1"]).await?;
    let join = node_1.rpc_addr.to_string();
    let (node_2, url_2) = common::start_node(dir_2.path(), &["--node-id", "2", "--join", &join]).await?;
    common::create_topic(http, &url_1, "logs", 4).await?;
    let described = http.get(format!("{url_1}/topics/logs")).send().await?.json().await?;
    Ok(TwoNodes { node_1, url_1, node_2, url_2, described, _dirs: (dir_1, dir_2) })
}

/// The partitions whose `field` (a JSON pointer into a partition's description) is `node`.
fn partitions_where(described: &serde_json::Value, field: &str, node: u64) -> Vec<u64> {
    described["partitions"]
        .as_array()
        .map(|ps| {
            ps.iter()
                .filter(|p| p.pointer(field) == Some(&node.into()))
                .filter_map(|p| p["partition"].as_u64())
                .collect()
        })
        .unwrap_or_default()
}

/// Sends `count` records without a key in one request to `url`; every record must land in one
/// of `partitions`.
async fn keyless_lands_in(
    http: &reqwest::Client,
    url: &str,
    request: usize,
    count: usize,
    partitions: &[u64],
) -> TestResult {
    let records: Vec<_> = (0..count).map(|i| serde_json::json!({"value": format!("r{request}-{i}")})).collect();
    let answer = http.post(url).json(&serde_json::json!({"records": records})).send().await?;
    let status = answer.status();
    let body: serde_json::Value = answer.json().await?;
    assert_eq!(status, 200, "request {request}: {body}");
    let offsets = placed(&body);
    assert_eq!(offsets.len(), count);
    assert!(
        offsets.iter().all(|(p, _)| partitions.contains(p)),
        "request {request}: {offsets:?}, expected in {partitions:?}"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_that_does_not_forward_places_keyless_records_in_a_partition_it_leads() -> TestResult {
    let http = reqwest::Client::new();
    let nodes = two_nodes(&http).await?;
    let led_by_2 = partitions_where(&nodes.described, "/leader", 2);
    assert!(!led_by_2.is_empty() && led_by_2.len() < 4, "node 2 leads some partitions only: {}", nodes.described);
    let url = format!("{}/topics/logs/records?forward=false", nodes.url_2);
    for request in 0..6 {
        keyless_lands_in(&http, &url, request, 3, &led_by_2).await?;
    }
    nodes.node_2.shutdown().await;
    nodes.node_1.shutdown().await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keyless_records_pass_over_partitions_without_a_leader() -> TestResult {
    let http = reqwest::Client::builder().timeout(std::time::Duration::from_secs(5)).build()?;
    let nodes = two_nodes(&http).await?;
    let on_1 = partitions_where(&nodes.described, "/replicas/0", 1);
    assert!(!on_1.is_empty() && on_1.len() < 4, "node 1 holds some partitions only: {}", nodes.described);
    // Node 2's partitions (one replica each) have no leader while it is down.
    nodes.node_2.shutdown().await;
    let url = format!("{}/topics/logs/records", nodes.url_1);
    for request in 0..8 {
        keyless_lands_in(&http, &url, request, 2, &on_1).await?;
    }
    nodes.node_1.shutdown().await;
    Ok(())
}

/// The value of the series `name` of `/metrics` (one node, one series).
async fn metric(http: &reqwest::Client, url: &str, name: &str) -> TestResult<f64> {
    let text = http.get(format!("{url}/metrics")).send().await?.text().await?;
    let line = text
        .lines()
        .find(|l| l.starts_with(&format!("{name}{{")))
        .ok_or_else(|| format!("no series {name} in /metrics"))?;
    let value = line.rsplit(' ').next().ok_or("a series without a value")?;
    Ok(value.parse()?)
}

/// The Raft log's fsync time is exported in Prometheus's base unit, seconds: after writes,
/// more than nothing and less than a second per fsync (an fsync takes microseconds to
/// milliseconds; the same count in microseconds would be a million times larger).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_raft_log_fsync_time_is_exported_in_seconds() -> TestResult {
    let dir = tempfile::tempdir()?;
    let http = reqwest::Client::new();
    let (node, url) = common::start_node(dir.path(), &[]).await?;
    let created = http.post(format!("{url}/topics")).body(r#"{"name":"t","replication_factor":1}"#).send().await?;
    assert_eq!(created.status(), 201);
    for k in 0..20 {
        let put = http.put(format!("{url}/kv/t/key-{k}")).body("v").send().await?;
        assert_eq!(put.status(), 200);
    }
    let fsyncs = metric(&http, &url, "logdex_raft_log_fsyncs_total").await?;
    let seconds = metric(&http, &url, "logdex_raft_log_fsync_seconds_total").await?;
    assert!(fsyncs >= 1.0, "fsyncs {fsyncs}");
    assert!(seconds > 0.0 && seconds < fsyncs, "{seconds} s over {fsyncs} fsyncs");
    node.shutdown().await;
    Ok(())
}
