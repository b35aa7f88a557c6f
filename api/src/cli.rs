//! Command-line interface.

use clap::Parser;
use clap::Subcommand;

use crate::dev::DevArgs;
use crate::serve::ServeArgs;

#[derive(Parser, Debug)]
#[command(name = "logdex", version, about = "logdex: a Raft-replicated partition log with a key index on every replica", long_about = None)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Option<Command>,
}

#[derive(Subcommand, Debug)]
pub enum Command {
    /// Run one node. With no flags: a single-node cluster on 127.0.0.1:8080 with data in ./logdex-data.
    Serve(ServeArgs),
    /// Start a local cluster of N nodes on loopback and print each node's HTTP URL; Ctrl-C stops it.
    Dev(DevArgs),
    /// Benchmark a running cluster: load, get1, getc, noop (the no-work floor), or report (the table).
    Bench(crate::bench::BenchArgs),
    /// Topic administration.
    Topic {
        #[command(subcommand)]
        command: TopicCommand,
        #[command(flatten)]
        target: Target,
    },
    /// Write a value for a key.
    Put {
        topic: String,
        key: String,
        value: String,
        #[command(flatten)]
        target: Target,
    },
    /// Read the latest value of a key (value on stdout; metadata on stderr with -v).
    Get {
        topic: String,
        key: String,
        /// Read mode: linearizable, strict or follower.
        #[arg(long, default_value = "linearizable")]
        read: String,
        /// Print partition, offset, high watermark and serving node on stderr.
        #[arg(short, long)]
        verbose: bool,
        #[command(flatten)]
        target: Target,
    },
    /// Delete a key (writes a tombstone).
    Del {
        topic: String,
        key: String,
        #[command(flatten)]
        target: Target,
    },
    /// Show the cluster: nodes, controller leader, groups hosted and led.
    Cluster {
        #[command(flatten)]
        target: Target,
    },
}

#[derive(Subcommand, Debug)]
pub enum TopicCommand {
    /// Create a topic.
    Create {
        name: String,
        #[arg(long, default_value_t = 1)]
        partitions: u32,
        #[arg(long, default_value_t = 1)]
        replication_factor: u32,
        /// Topic config as key=value, repeatable (e.g. cleanup.policy=compact).
        #[arg(long = "config", value_parser = parse_kv)]
        config: Vec<(String, String)>,
    },
    /// List topics.
    List,
    /// Show partitions, replicas, leaders and offsets of a topic.
    Describe { name: String },
    /// Delete a topic and its data on every node.
    Delete { name: String },
}

#[derive(clap::Args, Debug, Clone)]
pub struct Target {
    /// Any node's HTTP URL.
    #[arg(long, env = "LOGDEX_URL", default_value = "http://127.0.0.1:8080", global = true)]
    pub url: String,
}

fn parse_kv(s: &str) -> Result<(String, String), String> {
    s.split_once('=').map(|(k, v)| (k.to_string(), v.to_string())).ok_or_else(|| format!("{s:?} is not key=value"))
}

pub fn run(cli: Cli) -> Result<(), String> {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .map_err(|e| format!("cannot start the runtime: {e}"))?;
    let command = match cli.command {
        Some(c) => c,
        None => Cli::parse_from(["logdex", "serve"]).command.ok_or("no command")?,
    };
    runtime.block_on(async move {
        match command {
            Command::Serve(args) => crate::serve::serve(args).await,
            Command::Dev(args) => crate::dev::dev(args).await,
            Command::Bench(args) => crate::bench::run(args).await,
            other => client(other).await,
        }
    })
}

fn encode_key(key: &str) -> String {
    let mut out = String::with_capacity(key.len());
    for b in key.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b'~') {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

async fn client(command: Command) -> Result<(), String> {
    let http = reqwest::Client::new();
    let send = |req: reqwest::RequestBuilder| async move {
        let resp = req.send().await.map_err(|e| format!("request failed: {e}"))?;
        let status = resp.status();
        let headers = resp.headers().clone();
        let body = resp.bytes().await.map_err(|e| format!("reading the answer: {e}"))?;
        Ok::<_, String>((status, headers, body))
    };
    let (status, headers, body, verbose) = match command {
        Command::Topic { command, target } => {
            let base = target.url.trim_end_matches('/').to_string();
            let req = match command {
                TopicCommand::Create { name, partitions, replication_factor, config } => {
                    let config: serde_json::Map<String, serde_json::Value> =
                        config.into_iter().map(|(k, v)| (k, serde_json::Value::String(v))).collect();
                    http.post(format!("{base}/topics")).json(&serde_json::json!({
                        "name": name, "partitions": partitions, "replication_factor": replication_factor, "config": config,
                    }))
                }
                TopicCommand::List => http.get(format!("{base}/topics")),
                TopicCommand::Describe { name } => http.get(format!("{base}/topics/{name}")),
                TopicCommand::Delete { name } => http.delete(format!("{base}/topics/{name}")),
            };
            let (s, h, b) = send(req).await?;
            (s, h, b, false)
        }
        Command::Put { topic, key, value, target } => {
            let url = format!("{}/kv/{topic}/{}", target.url.trim_end_matches('/'), encode_key(&key));
            let (s, h, b) = send(http.put(url).body(value)).await?;
            (s, h, b, false)
        }
        Command::Del { topic, key, target } => {
            let url = format!("{}/kv/{topic}/{}", target.url.trim_end_matches('/'), encode_key(&key));
            let (s, h, b) = send(http.delete(url)).await?;
            (s, h, b, false)
        }
        Command::Get { topic, key, read, verbose, target } => {
            let url = format!("{}/kv/{topic}/{}?read={read}", target.url.trim_end_matches('/'), encode_key(&key));
            let (s, h, b) = send(http.get(url)).await?;
            (s, h, b, verbose)
        }
        Command::Cluster { target } => {
            let (s, h, b) = send(http.get(format!("{}/cluster", target.url.trim_end_matches('/')))).await?;
            (s, h, b, false)
        }
        Command::Serve(_) | Command::Dev(_) | Command::Bench(_) => return Err("not a client command".into()),
    };
    if verbose {
        for name in ["x-kv-partition", "x-kv-offset", "x-kv-high-watermark", "x-kv-node", "x-kv-timestamp"] {
            if let Some(v) = headers.get(name).and_then(|v| v.to_str().ok()) {
                eprintln!("{name}: {v}");
            }
        }
    }
    use std::io::Write;
    let mut stdout = std::io::stdout();
    let _ = stdout.write_all(&body);
    if !body.ends_with(b"\n") {
        let _ = stdout.write_all(b"\n");
    }
    if status.is_success() { Ok(()) } else { Err(format!("server answered {status}")) }
}
