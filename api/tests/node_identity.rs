//! A node id belongs to one data directory: a second process that joins under an id the
//! cluster knows from another directory (an impostor, or the same node after its data was
//! lost) is refused and stops, and the cluster keeps the node it knew.

mod common;

use std::time::Duration;

use common::TestResult;
use common::start_node;
use common::start_node_unready;
use serde_json::Value;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_join_under_an_id_registered_from_another_directory_is_refused() -> TestResult {
    let root = tempfile::tempdir()?;
    let (first, url) = start_node(&root.path().join("a"), &[]).await?;
    let join = first.rpc_addr.to_string();
    let (second, _) = start_node_unready(&root.path().join("b"), "127.0.0.1:0", &["--join", &join]).await?;
    let reason = tokio::time::timeout(Duration::from_secs(30), second.node.fatal()).await?;
    assert!(reason.contains("registered by another data directory"), "{reason}");
    second.shutdown().await;
    let cluster: Value = reqwest::get(format!("{url}/cluster")).await?.json().await?;
    let nodes = cluster["nodes"].as_array().ok_or("no nodes in /cluster")?;
    assert_eq!(nodes.len(), 1, "{cluster}");
    assert_eq!(nodes[0]["rpc_addr"], join.as_str(), "the registered node keeps its address: {cluster}");
    first.shutdown().await;
    Ok(())
}
