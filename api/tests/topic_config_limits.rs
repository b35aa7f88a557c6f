//! Topic configs outside Kafka's ranges, or asking for tiered storage on nodes without an
//! object store, are refused with 400 `invalid_config` on create and on alter, instead of
//! being stored and then read as something else; tiered storage, once on, cannot be turned
//! off (its records may live only in the store); and a node that has not joined its cluster
//! answers 503 for a topic it does not know, not 404.

mod common;

use common::TestResult;
use common::start_node;
use common::start_node_unready;
use serde_json::Value;
use serde_json::json;

async fn error_code(response: reqwest::Response) -> TestResult<(u16, String)> {
    let status = response.status().as_u16();
    let body: Value = response.json().await?;
    Ok((status, body["error"]["code"].as_str().unwrap_or_default().to_string()))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn configs_outside_kafkas_ranges_are_refused_on_create_and_alter() -> TestResult {
    let dir = tempfile::tempdir()?;
    let (node, url) = start_node(dir.path(), &[]).await?;
    let http = reqwest::Client::new();
    let refused = [
        ("segment.ms", "0"),
        ("segment.ms", "18446744073709551615"),
        ("segment.bytes", "1"),
        ("segment.bytes", "5000000000"),
        ("max.message.bytes", "99999999999"),
        ("delete.retention.ms", "18446744073709551615"),
    ];
    for (key, value) in refused {
        let body = json!({"name": "t", "partitions": 1, "replication_factor": 1, "config": {key: value}});
        let answer = error_code(http.post(format!("{url}/topics")).json(&body).send().await?).await?;
        assert_eq!(answer, (400, "invalid_config".to_string()), "create with {key}={value}");
    }
    // The message says what the key takes, on create as on alter.
    for (key, value, says) in [
        ("max.message.bytes", "-5", "from 1 to 2147483647"),
        ("cleanup.policy", "bogus", "compact, delete or both (compact,delete)"),
        ("retention.ms", "-7", "at least -1"),
    ] {
        let body = json!({"name": "t", "partitions": 1, "replication_factor": 1, "config": {key: value}});
        let answer: Value = http.post(format!("{url}/topics")).json(&body).send().await?.json().await?;
        let message = answer["error"]["message"].as_str().unwrap_or_default();
        assert!(message.contains(says), "create with {key}={value}: {answer}");
    }
    let tiered = json!({"name": "t", "partitions": 1, "replication_factor": 1,
        "config": {"cleanup.policy": "delete", "remote.storage.enable": "true"}});
    let answer = error_code(http.post(format!("{url}/topics")).json(&tiered).send().await?).await?;
    assert_eq!(answer, (400, "invalid_config".to_string()), "tiered storage without --tiered-store");
    let missing = http.get(format!("{url}/topics/t")).send().await?;
    assert_eq!(missing.status(), 404, "no refused create made a topic");

    let body = json!({"name": "t", "partitions": 1, "replication_factor": 1,
        "config": {"segment.bytes": "1024", "segment.ms": "60000"}});
    assert_eq!(http.post(format!("{url}/topics")).json(&body).send().await?.status(), 201);
    for (key, value) in refused {
        let alter = json!({"config": {key: value}});
        let answer = error_code(http.post(format!("{url}/topics/t/config")).json(&alter).send().await?).await?;
        assert_eq!(answer, (400, "invalid_config".to_string()), "alter to {key}={value}");
    }
    let accepted = json!({"config": {"segment.ms": "1"}});
    assert_eq!(http.post(format!("{url}/topics/t/config")).json(&accepted).send().await?.status(), 200);
    let described: Value = http.get(format!("{url}/topics/t")).send().await?.json().await?;
    assert_eq!(described["config"]["segment.bytes"], "1024", "refused alters changed nothing: {described}");
    assert_eq!(described["config"]["segment.ms"], "1");
    node.shutdown().await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_that_has_not_joined_answers_503_for_its_topics_and_a_list_of_them() -> TestResult {
    let dir = tempfile::tempdir()?;
    // Nothing listens on port 9 of loopback: the node never registers.
    let (node, url) = start_node_unready(dir.path(), "127.0.0.1:0", &["--join", "127.0.0.1:9"]).await?;
    let http = reqwest::Client::new();
    for path in ["/topics", "/topics/t", "/kv/t/k"] {
        let answer = error_code(http.get(format!("{url}{path}")).send().await?).await?;
        assert_eq!(answer, (503, "unavailable".to_string()), "GET {path}");
    }
    node.shutdown().await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tiered_storage_once_on_cannot_be_turned_off() -> TestResult {
    let dir = tempfile::tempdir()?;
    let store = dir.path().join("store");
    std::fs::create_dir_all(&store)?;
    let store_url = format!("file://{}", store.display());
    let (node, url) = start_node(&dir.path().join("node"), &["--tiered-store", &store_url]).await?;
    let http = reqwest::Client::new();
    let body = json!({"name": "t", "partitions": 1, "replication_factor": 1,
        "config": {"cleanup.policy": "delete", "remote.storage.enable": "true"}});
    assert_eq!(http.post(format!("{url}/topics")).json(&body).send().await?.status(), 201);
    let off = json!({"config": {"remote.storage.enable": "false"}});
    let answer: Value = http.post(format!("{url}/topics/t/config")).json(&off).send().await?.json().await?;
    assert_eq!(answer["error"]["code"], "invalid_config", "{answer}");
    let message = answer["error"]["message"].as_str().unwrap_or_default();
    assert!(message.contains("cannot be turned off"), "{answer}");
    let described: Value = http.get(format!("{url}/topics/t")).send().await?.json().await?;
    assert_eq!(described["config"]["remote.storage.enable"], "true", "{described}");
    // Other keys of a tiered topic still change.
    let local = json!({"config": {"local.retention.ms": "60000"}});
    assert_eq!(http.post(format!("{url}/topics/t/config")).json(&local).send().await?.status(), 200);
    node.shutdown().await;
    Ok(())
}
