//! The harness itself: a spare node's ports are reserved when the cluster is laid out
//! and bound only when the test starts it, so another socket can take one meanwhile.

use std::net::TcpListener;

use logdex_cluster_tests::Cluster;
use logdex_cluster_tests::ClusterOptions;
use logdex_cluster_tests::Error;
use logdex_cluster_tests::Result;
use logdex_cluster_tests::ensure;

/// A spare node whose reserved HTTP port another socket took starts on fresh ports, joins,
/// and answers `/readyz` at its new address.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn spare_node_whose_reserved_port_was_taken_starts_on_fresh_ports() -> Result<()> {
    let options = ClusterOptions { spare_nodes: 1, ..ClusterOptions::plain(3) };
    let mut cluster = Cluster::start_with(options).await?;
    let reserved = cluster.url(4);
    let address = reserved.trim_start_matches("http://").to_string();
    let squatter = TcpListener::bind(&address).map_err(|e| Error::io(format!("binding {address}"), e))?;
    let outcome = async {
        cluster.start_spare(4).await?;
        let moved = cluster.url(4);
        ensure!(moved != reserved, "node 4 moved off the taken address {reserved}");
        let ready = cluster.api().readyz(&moved).await?;
        ensure!(ready.status == 200, "node 4 ready at {moved}: {}", ready.summary());
        Ok(())
    }
    .await;
    drop(squatter);
    cluster.finish(outcome)
}
