//! `logdex dev`: a local cluster of real `logdex serve` processes on loopback.

use std::path::PathBuf;
use std::process::Stdio;
use std::time::Duration;

use clap::Args;

#[derive(Args, Debug, Clone)]
pub struct DevArgs {
    /// Number of nodes, 1 to 9.
    #[arg(long, default_value_t = 3)]
    pub nodes: u32,
    /// Directory for the nodes' data (one subdirectory per node); kept after exit.
    #[arg(long, default_value = "./logdex-dev")]
    pub data_dir: PathBuf,
    /// HTTP port of node 1; node N listens on this + N - 1.
    #[arg(long, default_value_t = 8081)]
    pub http_port: u16,
    /// RPC port of node 1; node N listens on this + N - 1.
    #[arg(long, default_value_t = 9091)]
    pub rpc_port: u16,
}

pub async fn dev(args: DevArgs) -> Result<(), String> {
    if args.nodes == 0 || args.nodes > 9 {
        return Err("--nodes must be 1 to 9".into());
    }
    let exe = std::env::current_exe().map_err(|e| format!("cannot find the logdex binary: {e}"))?;
    let port = |base: u16, i: u32| base.checked_add(i as u16 - 1).ok_or("port out of range");
    let mut peers = Vec::new();
    for i in 1..=args.nodes {
        peers.push(format!("{i}@127.0.0.1:{}", port(args.rpc_port, i)?));
    }
    let peers = peers.join(",");
    let (http_last, rpc_last) = (port(args.http_port, args.nodes)?, port(args.rpc_port, args.nodes)?);
    if args.http_port <= rpc_last && args.rpc_port <= http_last {
        return Err(format!(
            "the HTTP ports {}-{http_last} and the RPC ports {}-{rpc_last} overlap: each node needs one of each",
            args.http_port, args.rpc_port
        ));
    }
    // A port another process holds would make a node exit at once, while that process might
    // answer the readiness checks in its place.
    for i in 1..=args.nodes {
        for (what, base) in [("HTTP", args.http_port), ("RPC", args.rpc_port)] {
            let p = port(base, i)?;
            std::net::TcpListener::bind(("127.0.0.1", p))
                .map_err(|e| format!("cannot use port {p} for node {i}'s {what} address: {e}"))?;
        }
    }
    // Listening before the first node starts: Ctrl-C or SIGTERM while they start stops them too.
    let stop = crate::serve::shutdown_signal();
    tokio::pin!(stop);
    let parent_pid = std::process::id().to_string();
    let mut children = Vec::new();
    for i in 1..=args.nodes {
        let dir = args.data_dir.join(format!("node-{i}"));
        std::fs::create_dir_all(&dir).map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
        let log = std::fs::File::create(dir.join("logdex.log")).map_err(|e| format!("cannot create node log: {e}"))?;
        let mut command = tokio::process::Command::new(&exe);
        // `serve` reads every flag from `LOGDEX_<FLAG>`: a `LOGDEX_JOIN` or `LOGDEX_FORWARD` meant
        // for another node would stop these nodes from starting or change them unseen.
        for (name, _) in std::env::vars_os() {
            if name.to_string_lossy().starts_with("LOGDEX_") {
                command.env_remove(&name);
            }
        }
        let child = command
            .arg("serve")
            .args(["--node-id", &i.to_string()])
            .arg("--data-dir")
            .arg(&dir)
            .args(["--http-addr", &format!("127.0.0.1:{}", port(args.http_port, i)?)])
            .args(["--rpc-addr", &format!("127.0.0.1:{}", port(args.rpc_port, i)?)])
            .args(["--peers", &peers])
            // Nodes stop with `dev`, also when it is killed and cannot stop them, even before
            // they have started to run.
            .arg("--exit-with-parent")
            .args(["--parent-pid", &parent_pid])
            // One object store for the cluster: topics may turn tiered storage on.
            .arg("--tiered-store")
            .arg(args.data_dir.join("tiered"))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .kill_on_drop(true)
            .spawn()
            .map_err(|e| format!("cannot start node {i}: {e}"))?;
        children.push(child);
    }
    println!("starting {} nodes, data under {} ...", args.nodes, args.data_dir.display());
    tokio::select! {
        ready = wait_ready(&mut children, &args) => {
            if let Err(e) = ready {
                stop_nodes(children).await;
                return Err(e);
            }
        }
        () = &mut stop => {
            println!("interrupted while the nodes started; stopping {} nodes", children.len());
            stop_nodes(children).await;
            return Ok(());
        }
    }
    println!("logdex dev cluster: {} nodes ready, data under {}", args.nodes, args.data_dir.display());
    for i in 1..=args.nodes {
        println!(
            "  node {i}: http://127.0.0.1:{}  (log: {}/node-{i}/logdex.log)",
            port(args.http_port, i)?,
            args.data_dir.display()
        );
    }
    println!("Ctrl-C stops every node.");
    stop.await;
    println!("stopping {} nodes", children.len());
    stop_nodes(children).await;
    Ok(())
}

/// Stops the nodes cleanly (SIGTERM), killing any that has not exited after 10 s.
async fn stop_nodes(children: Vec<tokio::process::Child>) {
    for child in &children {
        if let Some(pid) = child.id() {
            let _ = std::process::Command::new("kill").args(["-TERM", &pid.to_string()]).status();
        }
    }
    for mut child in children {
        if tokio::time::timeout(Duration::from_secs(10), child.wait()).await.is_err() {
            let _ = child.kill().await;
        }
    }
}

/// Waits (bounded) until every node answers `/readyz`; fails, naming the node
/// and its log, if one exits or never gets ready.
async fn wait_ready(children: &mut [tokio::process::Child], args: &DevArgs) -> Result<(), String> {
    let http = reqwest::Client::new();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    for (i, child) in children.iter_mut().enumerate() {
        let n = i as u32 + 1;
        let port = args.http_port.checked_add(i as u16).ok_or("port out of range")?;
        let log = args.data_dir.join(format!("node-{n}")).join("logdex.log");
        loop {
            if let Ok(Some(status)) = child.try_wait() {
                return Err(format!("node {n} exited ({status}); see {}", log.display()));
            }
            let ready = http
                .get(format!("http://127.0.0.1:{port}/readyz"))
                .timeout(Duration::from_secs(1))
                .send()
                .await
                .is_ok_and(|r| r.status().is_success());
            if ready {
                break;
            }
            if tokio::time::Instant::now() >= deadline {
                return Err(format!("node {n} is not ready after 60 s; see {}", log.display()));
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
    // Ready answers come from these nodes only if they are still running.
    for (i, child) in children.iter_mut().enumerate() {
        if let Ok(Some(status)) = child.try_wait() {
            let log = args.data_dir.join(format!("node-{}", i + 1)).join("logdex.log");
            return Err(format!("node {} exited ({status}); see {}", i + 1, log.display()));
        }
    }
    Ok(())
}
