//! An in-process single-node server for the api crate's tests.

use std::time::Duration;

use clap::Parser;
use logdex_api::cli::Cli;
use logdex_api::cli::Command;
use logdex_api::serve::RunningNode;

pub type TestResult<T = ()> = Result<T, Box<dyn std::error::Error>>;

/// Starts a single node on ephemeral loopback ports with data in `dir`,
/// waits (bounded) until it is ready, and returns it with its HTTP base URL.
#[allow(dead_code)] // Not every test binary that includes this module uses it.
pub async fn start_node(dir: &std::path::Path, extra: &[&str]) -> TestResult<(RunningNode, String)> {
    start_node_at(dir, "127.0.0.1:0", extra).await
}

/// As [`start_node`], with the RPC address given (for a node named in `--peers`).
pub async fn start_node_at(dir: &std::path::Path, rpc_addr: &str, extra: &[&str]) -> TestResult<(RunningNode, String)> {
    let (node, url) = start_node_unready(dir, rpc_addr, extra).await?;
    let http = reqwest::Client::new();
    for _ in 0..300 {
        if http.get(format!("{url}/readyz")).send().await.map(|r| r.status().is_success()).unwrap_or(false) {
            return Ok((node, url));
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    Err("node never became ready".into())
}

/// As [`start_node_at`], without waiting for `/readyz` (a node that cannot be ready alone).
#[allow(dead_code)] // Not every test binary that includes this module uses it.
pub async fn start_node_unready(
    dir: &std::path::Path,
    rpc_addr: &str,
    extra: &[&str],
) -> TestResult<(RunningNode, String)> {
    let data_dir = dir.display().to_string();
    let mut args =
        vec!["logdex", "serve", "--data-dir", &data_dir, "--http-addr", "127.0.0.1:0", "--rpc-addr", rpc_addr];
    args.extend_from_slice(extra);
    let Some(Command::Serve(serve)) = Cli::parse_from(args).command else { return Err("not a serve command".into()) };
    let node = logdex_api::serve::start(*serve).await?;
    let url = format!("http://{}", node.http_addr);
    Ok((node, url))
}

/// Writes `token` as a token file (`--auth-token-file`, `--rpc-token-file`) named `name` in
/// `dir`, and returns its path as a flag value.
#[allow(dead_code)] // Not every test binary that includes this module uses it.
pub fn token_file(dir: &std::path::Path, name: &str, token: &str) -> TestResult<String> {
    let path = dir.join(name);
    std::fs::write(&path, format!("{token}\n"))?;
    Ok(path.display().to_string())
}

/// Creates topic `name` on the node at `url`: `partitions` partitions of one replica each;
/// fails unless the node answers 201.
#[allow(dead_code)] // Not every test binary that includes this module uses it.
pub async fn create_topic(http: &reqwest::Client, url: &str, name: &str, partitions: u32) -> TestResult {
    let body = serde_json::json!({"name": name, "partitions": partitions, "replication_factor": 1});
    let created = http.post(format!("{url}/topics")).json(&body).send().await?;
    let status = created.status();
    if status != 201 {
        return Err(format!("creating topic {name}: {status} {}", created.text().await?).into());
    }
    Ok(())
}
