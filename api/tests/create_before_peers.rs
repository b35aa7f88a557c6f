//! Nodes of an initial cluster start in any order. A topic created as soon as a quorum is up
//! may ask for more replicas than have registered: the create waits (bounded) for the nodes
//! the cluster's `--peers` names, instead of refusing with 400. A create that arrives while
//! the controller group has no leader yet (too few nodes up, or an election after every node
//! restarted) waits (bounded) for one to be elected, instead of answering 503 at once (for
//! an alter after a restart of every node: `cluster-tests/tests/controller_election.rs`).

mod common;

use common::TestResult;
use common::start_node_at;
use common::start_node_unready;
use serde_json::json;

/// Free loopback ports for the nodes' RPC addresses, which `--peers` must name up front. They
/// are taken below the kernel's ephemeral range: node 3's port stays unbound for seconds, and
/// a port in that range could meanwhile become the local end of another connection. Each
/// call starts past the ports earlier calls of this process handed out (the tests run side by
/// side, and a port handed out stays unbound until its node starts).
fn free_ports(count: usize) -> TestResult<Vec<u16>> {
    static HANDED_OUT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    let skip = HANDED_OUT.fetch_add(100, std::sync::atomic::Ordering::Relaxed);
    let ephemeral_start = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|s| s.split_whitespace().next().and_then(|p| p.parse::<u16>().ok()))
        .unwrap_or(32768);
    let low = 10_000u16;
    let span = ephemeral_start.saturating_sub(low).max(1);
    let mut next = low + (std::process::id().wrapping_add(skip) % u32::from(span)) as u16;
    let mut ports = Vec::new();
    for _ in 0..span {
        next = if next + 1 >= ephemeral_start { low } else { next + 1 };
        if std::net::TcpListener::bind(("127.0.0.1", next)).is_ok() {
            ports.push(next);
            if ports.len() == count {
                return Ok(ports);
            }
        }
    }
    Err("no free loopback ports below the ephemeral range".into())
}

/// Sends a topic create to `url` in the background; its answer's status.
fn spawn_create(
    http: &reqwest::Client,
    url: &str,
    topic: serde_json::Value,
) -> tokio::task::JoinHandle<reqwest::Result<reqwest::StatusCode>> {
    let (http, url) = (http.clone(), url.to_string());
    tokio::spawn(async move { http.post(format!("{url}/topics")).json(&topic).send().await.map(|r| r.status()) })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_topic_created_before_the_last_peer_registers_waits_for_it() -> TestResult {
    let dir = tempfile::tempdir()?;
    let ports = free_ports(3)?;
    let rpc: Vec<String> = ports.iter().map(|p| format!("127.0.0.1:{p}")).collect();
    let peers = format!("1@{},2@{},3@{}", rpc[0], rpc[1], rpc[2]);
    // Two of three make a quorum: started together, they elect a controller leader.
    let (dir_1, dir_2) = (dir.path().join("n1"), dir.path().join("n2"));
    let (args_1, args_2) = (["--node-id", "1", "--peers", &peers], ["--node-id", "2", "--peers", &peers]);
    let (first, second) =
        tokio::join!(start_node_at(&dir_1, &rpc[0], &args_1), start_node_at(&dir_2, &rpc[1], &args_2));
    let ((node_1, url_1), (node_2, _)) = (first?, second?);
    let http = reqwest::Client::new();

    // More replicas than the cluster has nodes: refused at once, as before.
    let too_many = json!({"name": "t4", "partitions": 1, "replication_factor": 4});
    let refused = http.post(format!("{url_1}/topics")).json(&too_many).send().await?;
    assert_eq!(refused.status(), 400);

    let create = spawn_create(&http, &url_1, json!({"name": "t", "partitions": 2, "replication_factor": 3}));
    tokio::time::sleep(std::time::Duration::from_millis(500)).await;
    assert!(!create.is_finished(), "the create waits while node 3 is not up");
    let (node_3, url_3) =
        start_node_at(&dir.path().join("n3"), &rpc[2], &["--node-id", "3", "--peers", &peers]).await?;
    assert_eq!(create.await??, 201, "created once node 3 registered");
    let put = http.put(format!("{url_3}/kv/t/k")).body("v").send().await?;
    assert_eq!(put.status(), 200);
    let got = http.get(format!("{url_1}/kv/t/k")).send().await?;
    assert_eq!(got.text().await?, "v");

    node_3.shutdown().await;
    node_2.shutdown().await;
    node_1.shutdown().await;
    Ok(())
}

/// Election timers of the two-node clusters below: short, so a test waits little.
const FAST: [&str; 4] = ["--election-timeout-ms", "300", "--heartbeat-ms", "100"];

/// `--node-id N --peers P` and [`FAST`].
fn peer_args<'a>(id: &'a str, peers: &'a str) -> Vec<&'a str> {
    let mut args = vec!["--node-id", id, "--peers", peers];
    args.extend_from_slice(&FAST);
    args
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_topic_created_before_the_controller_elects_a_leader_waits_for_the_election() -> TestResult {
    let dir = tempfile::tempdir()?;
    let ports = free_ports(2)?;
    let rpc: Vec<String> = ports.iter().map(|p| format!("127.0.0.1:{p}")).collect();
    let peers = format!("1@{},2@{}", rpc[0], rpc[1]);
    // Node 1 alone is no quorum of two: it never becomes ready.
    let (node_1, url_1) = start_node_unready(&dir.path().join("n1"), &rpc[0], &peer_args("1", &peers)).await?;
    let http = reqwest::Client::new();

    let create = spawn_create(&http, &url_1, json!({"name": "t", "partitions": 1, "replication_factor": 1}));
    tokio::time::sleep(std::time::Duration::from_millis(500)).await;
    assert!(!create.is_finished(), "the create waits while the controller has no leader");
    let (node_2, _) = start_node_at(&dir.path().join("n2"), &rpc[1], &peer_args("2", &peers)).await?;
    assert_eq!(create.await??, 201, "created once the controller elected a leader");
    let put = http.put(format!("{url_1}/kv/t/k")).body("v").send().await?;
    assert_eq!(put.status(), 200);

    node_2.shutdown().await;
    node_1.shutdown().await;
    Ok(())
}
