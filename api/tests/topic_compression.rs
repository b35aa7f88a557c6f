//! A topic's `compression.type` picks the codec of the batches its writes propose: the
//! segment files hold lz4 or zstd batches (Kafka's attribute bits), and every read answers
//! the records as written.

mod common;

use common::TestResult;
use common::start_node;
use serde_json::Value;
use serde_json::json;

/// The codec ids (attribute bits 0..3) of every batch in the segment files under `dir`, in
/// file order per segment.
fn batch_codecs(dir: &std::path::Path) -> TestResult<Vec<u8>> {
    let mut codecs = Vec::new();
    let mut dirs = vec![dir.to_path_buf()];
    while let Some(d) = dirs.pop() {
        for entry in std::fs::read_dir(&d)? {
            let path = entry?.path();
            let name = path.file_name().and_then(|n| n.to_str()).unwrap_or_default().to_string();
            if path.is_dir() {
                dirs.push(path);
            } else if name.len() == 24 && name.ends_with(".log") && name[..20].bytes().all(|b| b.is_ascii_digit()) {
                let bytes = std::fs::read(&path)?;
                let mut at = 0;
                while at + 23 <= bytes.len() {
                    let length = i32::from_be_bytes(bytes[at + 8..at + 12].try_into()?) as usize;
                    codecs.push(bytes[at + 22] & 0x07);
                    at += 12 + length;
                }
            }
        }
    }
    Ok(codecs)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn compression_type_lz4_and_zstd_write_compressed_batches_that_read_back_unchanged() -> TestResult {
    let dir = tempfile::tempdir()?;
    let (node, url) = start_node(dir.path(), &[]).await?;
    let http = reqwest::Client::new();

    for refused in ["gzip", "snappy", "LZ4", ""] {
        let body =
            json!({"name": "z", "partitions": 1, "replication_factor": 1, "config": {"compression.type": refused}});
        let answer = http.post(format!("{url}/topics")).json(&body).send().await?;
        assert_eq!(answer.status(), 400, "compression.type={refused:?}");
        let error: Value = answer.json().await?;
        assert_eq!(error["error"]["code"], "invalid_config", "{error}");
        assert!(error["error"]["message"].as_str().unwrap_or_default().contains("lz4 or zstd"), "{error}");
    }

    let body = json!({"name": "z", "partitions": 1, "replication_factor": 1, "config": {"compression.type": "zstd"}});
    assert_eq!(http.post(format!("{url}/topics")).json(&body).send().await?.status(), 201);
    let value = "compressible ".repeat(200);
    assert_eq!(http.put(format!("{url}/kv/z/one")).body(value.clone()).send().await?.status(), 200);
    let records: Vec<Value> =
        (0..50).map(|i| json!({"key": format!("k{i}"), "value": format!("{value}{i}")})).collect();
    let produced = http.post(format!("{url}/topics/z/records")).json(&json!({"records": records})).send().await?;
    assert_eq!(produced.status(), 200);
    let codecs = batch_codecs(dir.path())?;
    assert!(!codecs.is_empty() && codecs.iter().all(|c| *c == 4), "every batch is zstd (4): {codecs:?}");
    let size: Value = http.get(format!("{url}/topics/z")).send().await?.json().await?;
    let size = size["partitions"][0]["size_bytes"].as_u64().ok_or("no size_bytes")?;
    assert!(size < 51 * 2600 / 4, "51 values of about 2,600 bytes take much less compressed: {size} bytes");

    let altered = http.post(format!("{url}/topics/z/config")).json(&json!({"config": {"compression.type": "lz4"}}));
    assert_eq!(altered.send().await?.status(), 200);
    assert_eq!(http.put(format!("{url}/kv/z/two")).body(value.clone()).send().await?.status(), 200);
    let codecs = batch_codecs(dir.path())?;
    assert_eq!(codecs.last(), Some(&3), "a write after the alter is lz4 (3): {codecs:?}");

    for key in ["one", "two"] {
        let got = http.get(format!("{url}/kv/z/{key}")).send().await?;
        assert_eq!(got.status(), 200);
        assert_eq!(got.text().await?, value, "{key} reads back");
    }
    let page: Value =
        http.get(format!("{url}/topics/z/partitions/0/records?offset=0&max_records=100")).send().await?.json().await?;
    let values: Vec<&str> =
        page["records"].as_array().ok_or("no records")?.iter().filter_map(|r| r["value"].as_str()).collect();
    assert_eq!(values.len(), 52, "{page}");
    assert_eq!(values[7], format!("{value}6"), "a produced record reads back");
    node.shutdown().await;
    Ok(())
}
