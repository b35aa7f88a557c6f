//! `GET /topics/{t}` reports each partition's replicas, leader, offsets and size.

mod common;

use common::TestResult;
use common::start_node;
use serde_json::Value;
use serde_json::json;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn describe_reports_partition_sizes_that_grow_with_writes() -> TestResult {
    let dir = tempfile::tempdir()?;
    let (node, url) = start_node(dir.path(), &[]).await?;
    let http = reqwest::Client::new();
    common::create_topic(&http, &url, "sized", 2).await?;
    let describe = || async {
        let d: Value = http.get(format!("{url}/topics/sized")).send().await?.json().await?;
        TestResult::Ok(d)
    };
    let before = describe().await?;
    assert_eq!(before["partitions"][0]["size_bytes"], 0, "{before}");

    let records: Vec<Value> =
        (0..20).map(|i| json!({"key": format!("k{i}"), "value": "v".repeat(1000), "partition": 0})).collect();
    let produced = http.post(format!("{url}/topics/sized/records")).json(&json!({"records": records})).send().await?;
    assert_eq!(produced.status(), 200);
    let after = describe().await?;
    let p0 = &after["partitions"][0];
    let size = p0["size_bytes"].as_u64().ok_or("no size_bytes")?;
    assert!(size > 20 * 1000, "20 records of 1000-byte values take more than 20,000 bytes: {p0}");
    assert_eq!(p0["high_watermark"], 20);
    assert_eq!(p0["log_start_offset"], 0);
    assert_eq!(after["partitions"][1]["size_bytes"], 0, "the other partition is untouched: {after}");
    node.shutdown().await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn describe_shows_the_defaults_next_to_the_config_given() -> TestResult {
    let dir = tempfile::tempdir()?;
    let (node, url) = start_node(dir.path(), &[]).await?;
    let http = reqwest::Client::new();
    let create = |name: &'static str, config: Value| {
        let http = http.clone();
        let url = url.clone();
        async move {
            let body = json!({"name": name, "partitions": 1, "replication_factor": 1, "config": config});
            let status = http.post(format!("{url}/topics")).json(&body).send().await?.status();
            let described: Value = http.get(format!("{url}/topics/{name}")).send().await?.json().await?;
            TestResult::Ok((status, described["config"].clone()))
        }
    };
    let (status, plain) = create("plain", json!({})).await?;
    assert_eq!(status, 201);
    assert_eq!(plain, json!({"cleanup.policy": "compact", "kv.index.enabled": "true"}));

    let (status, given) = create("given", json!({"cleanup.policy": "delete", "retention.ms": "60000"})).await?;
    assert_eq!(status, 201);
    assert_eq!(given, json!({"cleanup.policy": "delete", "kv.index.enabled": "true", "retention.ms": "60000"}));

    // Spelling out what describe showed asks for the same topic.
    let (status, again) = create("plain", plain.clone()).await?;
    assert_eq!(status, 200, "a create with the described config is the same topic");
    assert_eq!(again, plain);
    node.shutdown().await;
    Ok(())
}
