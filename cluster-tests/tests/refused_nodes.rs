//! Nodes the cluster cannot take stop with the reason instead of waiting for ever, and leave
//! the cluster as it was: a node restarted at another RPC address (its groups' replicas know
//! it at the old one; one of `--peers` refuses at start, as its entry there names the old
//! one), and a node joining with another node-to-node token.

use std::time::Duration;

use logdex_cluster_tests::Cluster;
use logdex_cluster_tests::ClusterOptions;
use logdex_cluster_tests::Error;
use logdex_cluster_tests::Result;
use logdex_cluster_tests::client::Read;
use logdex_cluster_tests::client::TopicSpec;
use logdex_cluster_tests::ensure;
use logdex_cluster_tests::ensure_eq;

/// How long a refused node may take to stop (registration retries every 500 ms).
const EXIT_TIMEOUT: Duration = Duration::from_secs(30);
const SETTLE_TIMEOUT: Duration = Duration::from_secs(20);

/// A free loopback port nothing listens on.
fn unused_address() -> Result<String> {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").map_err(|e| Error::io("binding a free port", e))?;
    let address = listener.local_addr().map_err(|e| Error::io("reading a free port", e))?;
    Ok(address.to_string())
}

/// Writes `token` to `name` in `dir` and returns the file's path as text.
fn token_file(dir: &std::path::Path, name: &str, token: &str) -> Result<String> {
    let path = dir.join(name);
    std::fs::write(&path, token).map_err(|e| Error::io(format!("writing {}", path.display()), e))?;
    Ok(path.display().to_string())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn node_restarted_at_another_rpc_address_stops_with_the_reason_and_starts_at_its_own() -> Result<()> {
    let mut cluster = Cluster::start_with(ClusterOptions { spare_nodes: 1, ..ClusterOptions::plain(3) }).await?;
    let outcome = async {
        cluster.start_spare(4).await?;
        cluster.api().create_topic(&cluster.url(1), &TopicSpec::compacted("moved", 4, 3)).await?.expect_status(201)?;
        cluster.wait_for_leaders("moved", SETTLE_TIMEOUT).await?;

        // A node that joined (no --peers): the controller refuses its registration.
        let elsewhere = restart_elsewhere(&mut cluster, 4).await?;
        let log = cluster.launch_log(4)?;
        let own = cluster.rpc_addr(4).to_string();
        ensure!(
            log.contains("registration refused") && log.contains(&format!("--rpc-addr {own}")),
            "node 4 says why it stopped and where it belongs:\n{log}"
        );
        let nodes = cluster.api().get_url(&format!("{}/cluster", cluster.url(1))).await?.text();
        ensure!(!nodes.contains(&elsewhere), "the refused address is not registered: {nodes}");

        // A node of --peers: its own entry there names the old address, so it refuses to start.
        restart_elsewhere(&mut cluster, 3).await?;
        let log = cluster.launch_log(3)?;
        let own = cluster.rpc_addr(3).to_string();
        ensure!(
            log.contains(&format!("--peers names this node (3) at {own}"))
                && log.contains(&format!("--rpc-addr {own}")),
            "node 3 says why it stopped and where it belongs:\n{log}"
        );

        // At their own addresses they take part as before.
        for id in [3, 4] {
            cluster.clear_node_env(id);
            cluster.restart(id).await?;
            let url = cluster.url(id);
            for i in 0..6 {
                let key = format!("k{id}-{i}");
                cluster.api().put(&url, "moved", key.as_bytes(), key.as_bytes()).await?.expect_status(200)?;
                let read = cluster.api().get(&url, "moved", key.as_bytes(), &Read::linearizable()).await?;
                ensure_eq!(read.status, 200, "{key} read back on node {id}: {}", read.summary());
            }
        }
        Ok(())
    }
    .await;
    cluster.finish(outcome)
}

/// Kills node `id` and starts it again advertising an RPC address nothing listens on; it must
/// exit with status 1. Returns that address.
async fn restart_elsewhere(cluster: &mut Cluster, id: u64) -> Result<String> {
    cluster.kill(id)?;
    let elsewhere = unused_address()?;
    cluster.set_node_env(id, "LOGDEX_ADVERTISE_RPC_ADDR", &elsewhere);
    cluster.launch_stopped(id)?;
    let status = cluster.wait_exited(id, EXIT_TIMEOUT).await?;
    ensure_eq!(status.code(), Some(1), "exit status of node {id} at {elsewhere}");
    Ok(elsewhere)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn node_joining_with_another_rpc_token_stops_with_the_reason() -> Result<()> {
    let tokens = tempfile::tempdir().map_err(|e| Error::io("creating a token directory", e))?;
    let right = token_file(tokens.path(), "rpc.token", "the-cluster-token")?;
    let wrong = token_file(tokens.path(), "other.token", "another-token")?;
    let options = ClusterOptions {
        spare_nodes: 1,
        node_env: vec![("LOGDEX_RPC_TOKEN_FILE".to_string(), right)],
        ..ClusterOptions::plain(3)
    };
    let mut cluster = Cluster::start_with(options).await?;
    let outcome = async {
        cluster.set_node_env(4, "LOGDEX_RPC_TOKEN_FILE", &wrong);
        cluster.launch_stopped(4)?;
        let status = cluster.wait_exited(4, EXIT_TIMEOUT).await?;
        ensure_eq!(status.code(), Some(1), "exit status of node 4");
        let log = cluster.launch_log(4)?;
        ensure!(
            log.contains("registration refused") && log.contains("missing or wrong node-to-node token"),
            "node 4 says why it stopped:\n{log}"
        );
        ensure!(!log.contains("the controller has no leader"), "node 4 blames the controller:\n{log}");
        let peer_log = cluster.launch_log(1)?;
        ensure!(
            peer_log.contains("refused a node-to-node call with a missing or wrong token"),
            "node 1 logs the refused calls:\n{}",
            cluster.log_tail(1, 20)
        );
        let nodes = cluster.api().get_url(&format!("{}/cluster", cluster.url(1))).await?.text();
        ensure!(!nodes.contains("\"node_id\":4"), "node 4 is not registered: {nodes}");
        Ok(())
    }
    .await;
    cluster.finish(outcome)
}
