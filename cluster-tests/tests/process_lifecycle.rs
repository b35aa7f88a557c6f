//! Nodes never outlive the process that started them with `--exit-with-parent`, and
//! `logdex dev` stops its nodes also when it is interrupted while they start; a node whose
//! `--peers` misnames its address refuses to start.

use std::net::SocketAddr;
use std::net::TcpListener;
use std::path::Path;
use std::time::Duration;

use logdex_cluster_tests::Error;
use logdex_cluster_tests::Result;
use logdex_cluster_tests::cluster::binary_path;
use logdex_cluster_tests::ensure;

/// How long a node may take to notice its parent is gone and stop (it starts, then looks).
const STOP_TIMEOUT: Duration = Duration::from_secs(30);
/// Random port bases tried before giving up.
const PORT_PICKS: usize = 200;

/// A base port `p` with `p..p + count` free on 127.0.0.1 right now.
fn free_port_run(count: u16) -> Result<u16> {
    use rand::Rng as _;
    let mut rng = rand::rng();
    for _ in 0..PORT_PICKS {
        let base: u16 = rng.random_range(20_000..30_000);
        let bound: Vec<TcpListener> =
            (0..count).filter_map(|i| TcpListener::bind(SocketAddr::from(([127, 0, 0, 1], base + i))).ok()).collect();
        if bound.len() == usize::from(count) {
            return Ok(base);
        }
    }
    Err(Error::Check(format!("no {count} consecutive free ports found in {PORT_PICKS} tries")))
}

/// True while process `pid` runs (an exited, unreaped process counts as gone).
fn running(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        // `pid (comm) state ...`: the state follows the last `)`.
        Ok(stat) => stat.rsplit_once(')').is_some_and(|(_, rest)| !rest.trim_start().starts_with(['Z', 'X'])),
        Err(_) => false,
    }
}

/// PIDs of running processes whose command line mentions `needle`.
fn processes_mentioning(needle: &Path) -> Vec<u32> {
    let needle = needle.to_string_lossy().into_owned();
    let Ok(entries) = std::fs::read_dir("/proc") else { return Vec::new() };
    entries
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| {
            std::fs::read(format!("/proc/{pid}/cmdline"))
                .is_ok_and(|cmd| String::from_utf8_lossy(&cmd).contains(&needle) && running(*pid))
        })
        .collect()
}

/// Waits until none of `pids` runs; kills (SIGKILL) what still runs at the deadline and fails.
async fn wait_all_gone(pids: &[u32], what: &str) -> Result<()> {
    let deadline = tokio::time::Instant::now() + STOP_TIMEOUT;
    while pids.iter().any(|pid| running(*pid)) {
        if tokio::time::Instant::now() >= deadline {
            let alive: Vec<u32> = pids.iter().copied().filter(|pid| running(*pid)).collect();
            for pid in &alive {
                let _ = std::process::Command::new("kill").args(["-KILL", &pid.to_string()]).status();
            }
            return Err(Error::Check(format!("{what}: processes {alive:?} still ran after {STOP_TIMEOUT:?}")));
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn node_stops_when_its_parent_exited_before_the_node_began_to_run() -> Result<()> {
    let dir = tempfile::tempdir().map_err(|e| Error::io("creating a temp dir", e))?;
    let base = free_port_run(2)?;
    // The shell starts the node in the background and exits at once: the node is re-parented
    // before it runs, so only the parent PID it is given (`$$`, the shell) can tell.
    let script = format!(
        "'{bin}' serve --node-id 1 --data-dir '{data}' --http-addr 127.0.0.1:{base} --rpc-addr 127.0.0.1:{rpc} \
         --exit-with-parent --parent-pid $$ >'{log}' 2>&1 & echo $!",
        bin = binary_path()?.display(),
        data = dir.path().join("data").display(),
        rpc = base + 1,
        log = dir.path().join("node.log").display(),
    );
    let out = tokio::process::Command::new("sh")
        .args(["-c", &script])
        .output()
        .await
        .map_err(|e| Error::io("running sh", e))?;
    let pid: u32 = String::from_utf8_lossy(&out.stdout)
        .trim()
        .parse()
        .map_err(|e| Error::Check(format!("the shell printed no node PID ({e}): {out:?}")))?;
    wait_all_gone(&[pid], "a node whose parent exited").await?;
    let log = std::fs::read_to_string(dir.path().join("node.log")).unwrap_or_default();
    ensure!(log.contains("the process that started this node is gone"), "the node says why it stopped: {log}");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dev_interrupted_while_its_nodes_start_leaves_no_node_running() -> Result<()> {
    let dir = tempfile::tempdir().map_err(|e| Error::io("creating a temp dir", e))?;
    let data = dir.path().join("dev");
    let mut dev = dev_command(&data, free_port_run(3)?, free_port_run(3)?)?
        .stdout(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .map_err(|e| Error::io("starting logdex dev", e))?;
    let dev_pid = dev.id().ok_or_else(|| Error::Check("logdex dev exited at once".into()))?;
    // Wait until dev has started its nodes, then interrupt it before they are ready.
    let deadline = tokio::time::Instant::now() + STOP_TIMEOUT;
    let nodes = loop {
        let mut nodes = processes_mentioning(&data);
        nodes.retain(|pid| *pid != dev_pid);
        if nodes.len() == 3 || tokio::time::Instant::now() >= deadline {
            break nodes;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    };
    let _ = std::process::Command::new("kill").args(["-INT", &dev_pid.to_string()]).status();
    let status = tokio::time::timeout(STOP_TIMEOUT, dev.wait())
        .await
        .map_err(|_| Error::Check("logdex dev did not exit after SIGINT".into()))?
        .map_err(|e| Error::io("waiting for logdex dev", e))?;
    ensure!(nodes.len() == 3, "dev started 3 nodes, saw {nodes:?}");
    wait_all_gone(&nodes, "the nodes of an interrupted logdex dev").await?;
    ensure!(status.success(), "an interrupted dev exits cleanly, got {status}");
    Ok(())
}

/// `logdex dev` starts its nodes without the caller's `LOGDEX_*` settings, which `serve` would
/// read as flags. (Before, a `LOGDEX_JOIN` in the environment made every node exit, "--peers
/// cannot be used with --join", and `LOGDEX_FORWARD=false` turned forwarding off unseen.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dev_nodes_do_not_take_logdex_settings_from_the_environment() -> Result<()> {
    use tokio::io::AsyncBufReadExt as _;
    let dir = tempfile::tempdir().map_err(|e| Error::io("creating a temp dir", e))?;
    let data = dir.path().join("dev");
    let mut dev = dev_command(&data, free_port_run(3)?, free_port_run(3)?)?
        .env("LOGDEX_JOIN", "127.0.0.1:1")
        .env("LOGDEX_FORWARD", "false")
        .stdout(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .map_err(|e| Error::io("starting logdex dev", e))?;
    let dev_pid = dev.id().ok_or_else(|| Error::Check("logdex dev exited at once".into()))?;
    let stdout = dev.stdout.take().ok_or_else(|| Error::Check("no stdout of logdex dev".into()))?;
    let mut lines = tokio::io::BufReader::new(stdout).lines();
    let mut printed = Vec::new();
    let ready = tokio::time::timeout(Duration::from_secs(90), async {
        while let Ok(Some(line)) = lines.next_line().await {
            let ready = line.contains("nodes ready");
            printed.push(line);
            if ready {
                return true;
            }
        }
        false
    })
    .await
    .unwrap_or(false);
    let mut nodes = processes_mentioning(&data);
    nodes.retain(|pid| *pid != dev_pid);
    let environments: Vec<String> = nodes
        .iter()
        .map(|pid| {
            String::from_utf8_lossy(&std::fs::read(format!("/proc/{pid}/environ")).unwrap_or_default()).into_owned()
        })
        .collect();
    let _ = std::process::Command::new("kill").args(["-INT", &dev_pid.to_string()]).status();
    let _ = tokio::time::timeout(STOP_TIMEOUT, dev.wait()).await;
    wait_all_gone(&nodes, "the nodes of logdex dev").await?;
    ensure!(ready, "dev reports its nodes ready with LOGDEX_JOIN set, printed {printed:?}");
    ensure!(nodes.len() == 3, "dev runs 3 nodes, saw {nodes:?}");
    ensure!(
        environments.iter().all(|env| !env.contains("LOGDEX_JOIN") && !env.contains("LOGDEX_FORWARD")),
        "the nodes' environments hold no LOGDEX_ setting"
    );
    Ok(())
}

/// `logdex dev` whose ports another process holds says which port and exits with an error
/// before it starts any node. (Before, its nodes exited at once, and the process on those
/// ports answered the readiness checks: dev printed "3 nodes ready" with none running.)
/// HTTP and RPC port ranges that overlap are refused alike.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dev_with_a_port_in_use_says_so_and_starts_no_node() -> Result<()> {
    let dir = tempfile::tempdir().map_err(|e| Error::io("creating a temp dir", e))?;
    let data = dir.path().join("dev");
    let http = free_port_run(3)?;
    let rpc = free_port_run(3)?;
    let busy = http + 1;
    let holder = std::net::TcpListener::bind(("127.0.0.1", busy)).map_err(|e| Error::io("holding a port", e))?;
    refused_dev(&data, http, rpc, &format!("port {busy}")).await?;
    drop(holder);
    refused_dev(&data, http, http + 2, "overlap").await
}

/// `logdex dev` with its data under `data` and its nodes' HTTP and RPC ports from `http` and
/// `rpc`.
fn dev_command(data: &Path, http: u16, rpc: u16) -> Result<tokio::process::Command> {
    let mut dev = tokio::process::Command::new(binary_path()?);
    dev.arg("dev").arg("--data-dir").arg(data).args(["--http-port", &http.to_string(), "--rpc-port", &rpc.to_string()]);
    Ok(dev)
}

/// Runs `command` (`what` in errors) with its output captured until it exits, at most
/// [`STOP_TIMEOUT`].
async fn run_to_exit(mut command: tokio::process::Command, what: &str) -> Result<std::process::Output> {
    let run =
        command.stdout(std::process::Stdio::piped()).stderr(std::process::Stdio::piped()).kill_on_drop(true).output();
    tokio::time::timeout(STOP_TIMEOUT, run)
        .await
        .map_err(|_| Error::Check(format!("{what} did not exit")))?
        .map_err(|e| Error::io(format!("running {what}"), e))
}

/// Runs `logdex dev` on the given ports and checks that it exits with an error naming
/// `expected` and leaves no node running.
async fn refused_dev(data: &std::path::Path, http: u16, rpc: u16, expected: &str) -> Result<()> {
    let dev = dev_command(data, http, rpc)?;
    let out = run_to_exit(dev, &format!("logdex dev on ports {http}/{rpc}")).await?;
    let stderr = String::from_utf8_lossy(&out.stderr);
    ensure!(!out.status.success(), "dev on ports {http}/{rpc} exited with {}", out.status);
    ensure!(stderr.contains(expected), "dev says {expected:?}: {stderr}");
    ensure!(!String::from_utf8_lossy(&out.stdout).contains("ready"), "dev claimed ready: {out:?}");
    ensure!(processes_mentioning(data).is_empty(), "dev left nodes running");
    Ok(())
}

/// A node whose `--peers` entry names it at another address than its `--rpc-addr` refuses to
/// start and says which addresses differ. (Before, it started and served, while the other
/// nodes, dialing the address in `--peers`, could never register: no warning anywhere.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn node_named_in_peers_at_another_address_refuses_to_start() -> Result<()> {
    let dir = tempfile::tempdir().map_err(|e| Error::io("creating a temp dir", e))?;
    let base = free_port_run(4)?;
    let (http, rpc, listed, other) = (base, base + 1, base + 2, base + 3);
    let mut serve = tokio::process::Command::new(binary_path()?);
    serve
        .arg("serve")
        .args(["--node-id", "1", "--data-dir"])
        .arg(dir.path().join("n1"))
        .args(["--http-addr", &format!("127.0.0.1:{http}"), "--rpc-addr", &format!("127.0.0.1:{rpc}")])
        .args(["--peers", &format!("1@127.0.0.1:{listed},2@127.0.0.1:{other}")]);
    let out = run_to_exit(serve, "the misnamed node").await?;
    let stderr = String::from_utf8_lossy(&out.stderr);
    ensure!(!out.status.success(), "the node exited with {}", out.status);
    let says = format!("--peers names this node (1) at 127.0.0.1:{listed}, but its RPC address is 127.0.0.1:{rpc}");
    ensure!(stderr.contains(&says), "the node says {says:?}: {stderr}");
    Ok(())
}
