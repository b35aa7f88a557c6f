//! An admin change made through a node that does not lead the controller is visible in that
//! node's answer and in its next describe: the node waits until its own controller replica has
//! applied the change before it answers (it used to answer from its older view, now and then).

mod common;

use common::TestResult;
use common::start_node;
use serde_json::Value;
use serde_json::json;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admin_changes_through_a_non_leader_show_in_its_answer_and_next_describe() -> TestResult {
    let dir = tempfile::tempdir()?;
    let (node_1, _) = start_node(&dir.path().join("n1"), &["--node-id", "1"]).await?;
    let join = node_1.rpc_addr.to_string();
    let (node_2, url_2) = start_node(&dir.path().join("n2"), &["--node-id", "2", "--join", &join]).await?;
    let (node_3, url_3) = start_node(&dir.path().join("n3"), &["--node-id", "3", "--join", &join]).await?;
    let http = reqwest::Client::new();
    // Node 1 initialized the controller and leads it; nodes 2 and 3 joined as controller
    // learners and forward admin writes to it. The leader's answer can reach the forwarding
    // node before the commit does: a replica learns of a commit only from a later message
    // of the leader.
    let created = http
        .post(format!("{url_2}/topics"))
        .json(&json!({"name": "t", "partitions": 1, "replication_factor": 1, "config": {"retention.ms": "1000000"}}))
        .send()
        .await?;
    assert_eq!(created.status(), 201);

    for round in 0..40u64 {
        let value = (100_000 + round).to_string();
        let url = if round % 2 == 0 { &url_2 } else { &url_3 };
        let altered = http
            .post(format!("{url}/topics/t/config"))
            .json(&json!({"config": {"delete.retention.ms": value}}))
            .send()
            .await?;
        assert_eq!(altered.status(), 200, "round {round}");
        let answer: Value = altered.json().await?;
        assert_eq!(answer["config"]["delete.retention.ms"], value, "round {round}: the alter's answer: {answer}");
        let described: Value = http.get(format!("{url}/topics/t")).send().await?.json().await?;
        assert_eq!(described["config"]["delete.retention.ms"], value, "round {round}: the next describe: {described}");
    }

    let before: Value = http.get(format!("{url_2}/topics/t")).send().await?.json().await?;
    let owner = before["partitions"][0]["replicas"][0].as_u64().ok_or("no replica")?;
    let target = if owner == 1 { 2 } else { 1 };
    let moved =
        http.put(format!("{url_2}/topics/t/partitions/0/replicas")).json(&json!({"replicas": [target]})).send().await?;
    assert_eq!(moved.status(), 202);
    let answer: Value = moved.json().await?;
    let p0 = &answer["partitions"][0];
    assert!(
        p0["move"]["target_replicas"] == json!([target]) || p0["replicas"] == json!([target]),
        "the move's answer shows the move: {answer}"
    );

    let deleted = http.delete(format!("{url_2}/topics/t")).send().await?;
    assert_eq!(deleted.status(), 200);
    let gone = http.get(format!("{url_2}/topics/t")).send().await?;
    assert_eq!(gone.status(), 404, "describe right after the delete");
    node_3.shutdown().await;
    node_2.shutdown().await;
    node_1.shutdown().await;
    Ok(())
}
