//! Concurrent writes are batched into one Raft entry, but batching never changes what a
//! request alone would get: under a small `max.message.bytes`, concurrent writes that each
//! fit all succeed (though together they would not), and a write too big by itself is
//! refused with a JSON error while the others go through.

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
