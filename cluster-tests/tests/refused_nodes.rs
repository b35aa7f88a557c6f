//! Nodes the cluster cannot take stop with the reason instead of waiting for ever, and leave
//! the cluster as it was: a node restarted at another RPC address (its groups' replicas know
//! it at the old one; one of `--peers` refuses at start, as its entry there names the old
//! one), and a node joining with another node-to-node token. A node of another cluster at a
//! member's address is refused by the cluster, and refuses it; a node restarted on an empty
//! data directory under its old id hears nothing under that id and stops.

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

/// A node started on an empty data directory without `--peers`, at the addresses of a member
/// that stopped, forms a cluster of its own (its group ids restart at 1, as the real one's
/// did). The real cluster's calls to it are refused, with the reason in its log: the real
/// cluster counts the member as down and never reads the stranger's groups as its own
/// (before, its `/cluster` showed node 3 alive, leading the stranger's group 1).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_of_another_cluster_at_a_members_address_is_refused() -> Result<()> {
    let mut cluster = Cluster::start(3).await?;
    let outcome = async {
        let api = cluster.api().clone();
        api.create_topic(&cluster.url(1), &TopicSpec::compacted("kept", 1, 3)).await?.expect_status(201)?;
        cluster.wait_for_leaders("kept", SETTLE_TIMEOUT).await?;
        api.put(&cluster.url(1), "kept", b"k", b"v").await?.expect_status(200)?;
        let view = api.get_url(&format!("{}/cluster", cluster.url(1))).await?.json()?;
        let ours = view["cluster_id"].as_str().unwrap_or_default().to_string();
        ensure_eq!(ours.len(), 16, "the cluster's id in /cluster: {view}");

        cluster.kill(3)?;
        let http = cluster.url(3).trim_start_matches("http://").to_string();
        let log_path = cluster.dir().join("stranger.log");
        let log = std::fs::File::create(&log_path).map_err(|e| Error::io("creating the stranger's log", e))?;
        let err = log.try_clone().map_err(|e| Error::io("duplicating the stranger's log", e))?;
        let mut command = tokio::process::Command::new(logdex_cluster_tests::cluster::binary_path()?);
        command.args(["serve", "--node-id", "3", "--data-dir"]).arg(cluster.dir().join("stranger"));
        command.args(["--http-addr", &http, "--rpc-addr", &cluster.rpc_addr(3).to_string()]);
        for (name, _) in std::env::vars_os() {
            if name.to_string_lossy().starts_with("LOGDEX_") && name != "LOGDEX_LOG" {
                command.env_remove(&name);
            }
        }
        let mut stranger = command
            .stdout(log)
            .stderr(err)
            .kill_on_drop(true)
            .spawn()
            .map_err(|e| Error::io("starting the stranger", e))?;
        let stranger_url = cluster.url(3);
        let deadline = std::time::Instant::now() + SETTLE_TIMEOUT;
        while api.get_url(&format!("{stranger_url}/readyz")).await.map(|r| r.status).unwrap_or(0) != 200 {
            ensure!(std::time::Instant::now() < deadline, "the stranger never became ready");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        api.create_topic(&stranger_url, &TopicSpec::compacted("mine", 1, 1)).await?.expect_status(201)?;

        let refusal = format!("refused a node-to-node call from a node of cluster {ours}");
        let read_log = || std::fs::read_to_string(&log_path).unwrap_or_default();
        let deadline = std::time::Instant::now() + SETTLE_TIMEOUT;
        while !read_log().contains(&refusal) {
            ensure!(
                std::time::Instant::now() < deadline,
                "the stranger never refused the cluster's calls:\n{}",
                read_log()
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        // Past a few status rounds and heartbeats.
        tokio::time::sleep(Duration::from_secs(3)).await;
        let theirs = api.get_url(&format!("{stranger_url}/cluster")).await?.json()?;
        ensure!(theirs["cluster_id"].as_str().is_some_and(|id| id != ours), "the stranger's own cluster: {theirs}");
        ensure_eq!(theirs["nodes"].as_array().map(Vec::len), Some(1), "the stranger knows only itself: {theirs}");
        let view = api.get_url(&format!("{}/cluster", cluster.url(1))).await?.json()?;
        let node3 = view["nodes"].as_array().and_then(|nodes| nodes.iter().find(|n| n["node_id"] == 3)).cloned();
        ensure!(
            node3.as_ref().is_some_and(|n| n["alive"] == false && n["groups_led"].as_array().is_none_or(Vec::is_empty)),
            "the cluster counts node 3 as down, leading nothing: {view}"
        );
        let read = api.get(&cluster.url(2), "kept", b"k", &Read::linearizable()).await?;
        ensure_eq!(read.status, 200, "the cluster serves on: {}", read.summary());
        api.put(&cluster.url(2), "kept", b"k2", b"v").await?.expect_status(200)?;
        stranger.kill().await.map_err(|e| Error::io("stopping the stranger", e))?;
        Ok(())
    }
    .await;
    cluster.finish(outcome)
}

/// A node whose disk was lost, started again on an empty data directory under its old id and
/// address, hears nothing from the cluster under that id: its peers' calls name the data
/// directory its id was registered with, and it refuses them. So its empty logs never reach
/// the leaders (openraft does not let a follower's log go back: a leader that saw it panicked,
/// taking the controller down), it never learns the assignments that would have it start the
/// lost replicas empty, and its registration is refused: it stops with the reason, and the
/// others serve on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_restarted_on_an_empty_directory_under_its_old_id_touches_no_replica_and_stops() -> Result<()> {
    let mut cluster = Cluster::start(3).await?;
    let outcome = async {
        let api = cluster.api().clone();
        api.create_topic(&cluster.url(1), &TopicSpec::compacted("kept", 3, 3)).await?.expect_status(201)?;
        cluster.wait_for_leaders("kept", SETTLE_TIMEOUT).await?;
        for i in 0..30 {
            let key = format!("k{i}");
            api.put(&cluster.url(1), "kept", key.as_bytes(), b"v").await?.expect_status(200)?;
        }
        cluster.kill(3)?;
        // Everything in the data directory goes, but the harness's log of the node.
        let dir = cluster.data_dir(3).to_path_buf();
        for entry in std::fs::read_dir(&dir).map_err(|e| Error::io(format!("listing {}", dir.display()), e))? {
            let path = entry.map_err(|e| Error::io("listing the data directory", e))?.path();
            let removed = if path.is_dir() {
                std::fs::remove_dir_all(&path)
            } else if path != cluster.log_path(3) {
                std::fs::remove_file(&path)
            } else {
                Ok(())
            };
            removed.map_err(|e| Error::io(format!("removing {}", path.display()), e))?;
        }
        cluster.launch_stopped(3)?;
        let status = cluster.wait_exited(3, EXIT_TIMEOUT).await?;
        let log = cluster.launch_log(3)?;
        ensure_eq!(status.code(), Some(1), "exit status of the emptied node 3:\n{log}");
        ensure!(
            log.contains("registration refused") && log.contains("another data directory"),
            "node 3 says why it stopped:\n{log}"
        );
        ensure!(!log.contains("partition replica started"), "node 3 started the lost replicas empty:\n{log}");
        for id in [1, 2] {
            cluster.check_alive(id)?;
            let peer_log = cluster.launch_log(id)?;
            ensure!(!peer_log.contains("log reversion"), "node {id} saw node 3's log go back:\n{peer_log}");
        }
        for i in 0..30 {
            let key = format!("k{i}");
            let read = api.get(&cluster.url(2), "kept", key.as_bytes(), &Read::linearizable()).await?;
            ensure_eq!(read.status, 200, "{key} on node 2: {}", read.summary());
            api.put(&cluster.url(1), "kept", key.as_bytes(), b"w").await?.expect_status(200)?;
        }
        Ok(())
    }
    .await;
    cluster.finish(outcome)
}

/// A node whose data directory belongs to a cluster of its own (it first ran with `--peers`
/// naming itself alone), started again with `--join` naming a node of another cluster, stops
/// with the reason: its own controller replica would take its registration, and it would serve
/// a cluster that the one it named never heard of (before, it did, and `/readyz` said ready).
/// Started with `--peers` naming that cluster's nodes instead, it stops too once they refuse it
/// (before, it ran on, refused by every peer).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_joining_with_a_data_directory_of_another_cluster_stops_with_the_reason() -> Result<()> {
    let cluster = Cluster::start(3).await?;
    let outcome = async {
        let dir = tempfile::tempdir().map_err(|e| Error::io("creating a data directory", e))?;
        let data_dir = dir.path().display().to_string();
        let (http, rpc) = (unused_address()?, unused_address()?);
        let serve = ["serve", "--node-id", "7", "--data-dir", &data_dir, "--http-addr", &http, "--rpc-addr", &rpc];
        let own_peers = format!("7@{rpc}");
        let mut own = tokio::process::Command::new(logdex_cluster_tests::cluster::binary_path()?)
            .args(serve)
            .args(["--peers", &own_peers])
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .map_err(|e| Error::io("starting a node of its own cluster", e))?;
        logdex_cluster_tests::support::poll_until(
            "the lone node knows its cluster's id",
            SETTLE_TIMEOUT,
            Duration::from_millis(200),
            || async {
                let view = cluster.api().get_url(&format!("http://{http}/cluster")).await;
                Ok(match view {
                    Ok(reply) if reply.status == 200 && reply.text().contains("\"cluster_id\":\"") => {
                        logdex_cluster_tests::support::Probe::Ready(())
                    }
                    Ok(reply) => logdex_cluster_tests::support::Probe::NotYet(reply.summary()),
                    Err(e) => logdex_cluster_tests::support::Probe::NotYet(e.to_string()),
                })
            },
        )
        .await?;
        let pid = own.id().ok_or_else(|| Error::Check("the lone node has no pid".into()))?;
        std::process::Command::new("kill")
            .args(["-TERM", &pid.to_string()])
            .status()
            .map_err(|e| Error::io("stopping the lone node", e))?;
        tokio::time::timeout(EXIT_TIMEOUT, own.wait())
            .await
            .map_err(|_| Error::Check("the lone node did not stop".into()))?
            .map_err(|e| Error::io("waiting for the lone node", e))?;

        let join = cluster.rpc_addr(1).to_string();
        let args = [&serve[..], &["--join", &join]].concat();
        let (ok, stdout, stderr) = logdex_cluster_tests::support::run_logdex(&args, "", EXIT_TIMEOUT).await?;
        ensure!(!ok, "the node joined another cluster with its data directory:\n{stdout}\n{stderr}");
        let said = format!("{stdout}\n{stderr}");
        ensure!(
            said.contains("belongs to cluster")
                && said.contains(&format!("--join {join} names a node of another cluster")),
            "the node says why it stopped:\n{said}"
        );
        // The same with `--peers` naming the other cluster's nodes: they refuse it.
        let peers = format!("1@{join},7@{rpc}");
        let args = [&serve[..], &["--peers", &peers]].concat();
        let (ok, stdout, stderr) = logdex_cluster_tests::support::run_logdex(&args, "", EXIT_TIMEOUT).await?;
        ensure!(!ok, "the node ran with peers of another cluster:\n{stdout}\n{stderr}");
        let said = format!("{stdout}\n{stderr}");
        ensure!(said.contains("(nodes [1]) belong to another cluster"), "the node says why it stopped:\n{said}");
        let nodes = cluster.api().get_url(&format!("{}/cluster", cluster.url(1))).await?.text();
        ensure!(!nodes.contains("\"node_id\":7"), "node 7 is not registered: {nodes}");
        Ok(())
    }
    .await;
    cluster.finish(outcome)
}
