//! Deleting a topic gives its disk back: its partitions' segment logs go at once, and the
//! Raft log entries and index keys its replicas left (LSM tombstones, which only a compaction
//! drops) go with the compaction the node runs a few seconds after the removal, without any
//! later writes.

mod common;

use std::path::Path;
use std::time::Duration;
use std::time::Instant;

use common::TestResult;

/// Bytes the files under `dir` occupy on disk (allocated blocks: the Raft log's journal is
/// a sparse file of a fixed length).
fn disk_bytes(dir: &Path) -> std::io::Result<u64> {
    use std::os::unix::fs::MetadataExt as _;
    let mut total = 0;
    for entry in std::fs::read_dir(dir)? {
        let entry = entry?;
        let meta = entry.metadata()?;
        total += if meta.is_dir() { disk_bytes(&entry.path())? } else { meta.blocks() * 512 };
    }
    Ok(total)
}

fn raft_log_and_index_bytes(data: &Path) -> std::io::Result<u64> {
    Ok(disk_bytes(&data.join("raft"))? + disk_bytes(&data.join("index"))?)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deleted_topics_raft_log_and_index_leave_the_disk_without_further_writes() -> TestResult {
    let dir = tempfile::tempdir()?;
    let (node, url) = common::start_node(dir.path(), &[]).await?;
    let http = reqwest::Client::new();
    common::create_topic(&http, &url, "gone", 3).await?;
    common::create_topic(&http, &url, "kept", 1).await?;
    assert_eq!(http.put(format!("{url}/kv/kept/k")).body("stays").send().await?.status(), 200);
    let empty = raft_log_and_index_bytes(dir.path())?;

    // 24 MiB of 1 KiB values in 48 requests.
    let value = "v".repeat(1024);
    for request in 0..48 {
        let records: Vec<_> =
            (0..512).map(|i| serde_json::json!({"key": format!("key-{request}-{i}"), "value": value})).collect();
        let answer = http.post(format!("{url}/topics/gone/records")).json(&serde_json::json!({"records": records}));
        assert_eq!(answer.send().await?.status(), 200);
    }
    let written = raft_log_and_index_bytes(dir.path())?;
    assert!(written > empty + (12 << 20), "the writes take disk: {empty} bytes before, {written} after");

    assert_eq!(http.delete(format!("{url}/topics/gone")).send().await?.status(), 200);
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut now = raft_log_and_index_bytes(dir.path())?;
    while now > empty + (4 << 20) && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(250)).await;
        now = raft_log_and_index_bytes(dir.path())?;
    }
    assert!(
        now <= empty + (4 << 20),
        "the deleted topic's Raft log and index left the disk: {empty} bytes before the writes, {written} after, {now} 60 s after the delete"
    );
    let kept = http.get(format!("{url}/kv/kept/k")).send().await?;
    assert_eq!(kept.status(), 200);
    assert_eq!(kept.text().await?, "stays");
    node.shutdown().await;
    Ok(())
}
