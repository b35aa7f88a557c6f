//! Compaction contract on an in-process node: overwrites, tombstones and
//! forced segment rolls over several rounds, with a restart between rounds;
//! every live key answers its last value byte for byte, every deleted key 404s,
//! and compaction really removed records.

use std::collections::BTreeMap;
use std::time::Duration;

mod common;

use common::TestResult;

/// Compaction runs every 200 ms in these tests.
const CLEANER: &[&str] = &["--cleaner-interval-ms", "200"];

/// The value of `k` in round `r`: binary, with a length that varies per round.
fn value(k: usize, r: usize) -> Vec<u8> {
    (0..(r * 7 + k) % 50 + 1).map(|i| (i * 31 + k * 7 + r) as u8).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn compaction_keeps_last_values_and_tombstones_across_restarts() -> TestResult {
    let dir = tempfile::tempdir()?;
    let http = reqwest::Client::new();
    let (mut node, mut url) = common::start_node(dir.path(), CLEANER).await?;
    let created = http
        .post(format!("{url}/topics"))
        .body(r#"{"name":"c","partitions":2,"replication_factor":1,"config":{"segment.bytes":"1024","delete.retention.ms":"0"}}"#)
        .send()
        .await?;
    assert_eq!(created.status(), 201);
    let mut expected: BTreeMap<usize, Option<Vec<u8>>> = BTreeMap::new();
    for round in 0..4 {
        for k in 0..40 {
            let url_k = format!("{url}/kv/c/key-{k}");
            if (k + round) % 5 == 0 {
                let r = http.delete(&url_k).send().await?;
                assert_eq!(r.status(), 200);
                expected.insert(k, None);
            } else {
                let r = http.put(&url_k).body(value(k, round)).send().await?;
                assert_eq!(r.status(), 200);
                expected.insert(k, Some(value(k, round)));
            }
        }
        // Let the cleaner run over the sealed segments, then restart.
        tokio::time::sleep(Duration::from_millis(800)).await;
        node.shutdown().await;
        (node, url) = common::start_node(dir.path(), CLEANER).await?;
        for (k, want) in &expected {
            let r = http.get(format!("{url}/kv/c/key-{k}")).send().await?;
            match want {
                Some(v) => {
                    assert_eq!(r.status(), 200, "round {round} key-{k}");
                    assert_eq!(r.bytes().await?.as_ref(), v.as_slice(), "round {round} key-{k}");
                }
                None => assert_eq!(r.status(), 404, "round {round} key-{k} was deleted"),
            }
        }
    }
    // 160 writes went to the two partitions; compaction must have removed most
    // superseded records from the sealed segments.
    let mut kept = 0;
    for p in 0..2 {
        let r: serde_json::Value = http
            .get(format!("{url}/topics/c/partitions/{p}/records?offset=0&max_records=1000"))
            .send()
            .await?
            .json()
            .await?;
        kept += r["records"].as_array().map_or(0, Vec::len);
    }
    assert!(kept < 120, "compaction kept {kept} of 160 records");
    node.shutdown().await;
    Ok(())
}
