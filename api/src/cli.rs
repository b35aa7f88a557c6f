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
    Serve(Box<ServeArgs>),
    /// Start a local cluster of N nodes on loopback and print each node's HTTP URL; Ctrl-C stops it.
    ///
    /// The nodes run with `serve`'s defaults and the flags `dev` gives them: they do not take
    /// `LOGDEX_*` settings from the environment, and `dev`'s own flags do not read it either.
    Dev(DevArgs),
    /// Benchmark a running cluster (load, get1, getc, noop: the no-work floor), a node's restart (recovery,
    /// rebuild), or print the comparison table (report).
    Bench(crate::bench::BenchArgs),
    /// Topic administration.
    Topic {
        #[command(subcommand)]
        command: TopicCommand,
        #[command(flatten)]
        target: Target,
    },
    /// Write a value for a key (value `-` reads it from stdin).
    Put {
        /// Topic name.
        topic: String,
        /// Key (UTF-8 text; its partition is Kafka's murmur2 of its bytes).
        key: String,
        /// Value (UTF-8 text), or `-` to read it from stdin (any bytes).
        value: String,
        /// The key's partition, when it was written to one other than murmur2 of its bytes picks.
        #[arg(long)]
        partition: Option<u32>,
        #[command(flatten)]
        target: Target,
    },
    /// Read the latest value of a key (value on stdout; metadata on stderr with -v).
    Get {
        /// Topic name.
        topic: String,
        /// Key (UTF-8 text; its partition is Kafka's murmur2 of its bytes).
        key: String,
        /// Read mode: linearizable, strict or follower.
        #[arg(long, default_value = "linearizable")]
        read: String,
        /// Print partition, offset, high watermark and serving node on stderr.
        #[arg(short, long)]
        verbose: bool,
        /// The key's partition, when it was written to one other than murmur2 of its bytes picks.
        #[arg(long)]
        partition: Option<u32>,
        #[command(flatten)]
        target: Target,
    },
    /// Delete a key (writes a tombstone).
    Del {
        /// Topic name.
        topic: String,
        /// Key (UTF-8 text; its partition is Kafka's murmur2 of its bytes).
        key: String,
        /// The key's partition, when it was written to one other than murmur2 of its bytes picks.
        #[arg(long)]
        partition: Option<u32>,
        #[command(flatten)]
        target: Target,
    },
    /// Produce records from stdin, one per line: `key<TAB>value` (a line without a tab has no key;
    /// an empty key before a tab is refused, naming the line); `--json`: the server's answer to each request (its records' offsets), one JSON line each.
    Produce {
        /// Topic name.
        topic: String,
        /// Records per request.
        #[arg(long, default_value_t = 500)]
        batch: usize,
        #[command(flatten)]
        target: Target,
    },
    /// Print a partition's records from an offset: `offset<TAB>key<TAB>value` per line, keys and
    /// values as UTF-8 text with `\\`, `\t`, `\n`, `\r` escaped, `\xNN` for other bytes that
    /// are not printable text, `\N` for none (no key, a tombstone); `--json`: the fetch API's
    /// records, with the page's `encoding` on each.
    Consume {
        /// Topic name.
        topic: String,
        /// Partition to read.
        #[arg(long, default_value_t = 0)]
        partition: u32,
        /// First offset to read (one below the log start reads from the log start).
        #[arg(long, default_value_t = 0)]
        offset: u64,
        /// Stop after this many records.
        #[arg(long)]
        max: Option<u64>,
        /// Keep polling for new records until Ctrl-C.
        #[arg(long)]
        follow: bool,
        #[command(flatten)]
        target: Target,
    },
    /// Move a partition's replicas to the given nodes (comma-separated ids); the leader stays where it is while it remains a replica.
    Move {
        /// Topic name.
        topic: String,
        /// Partition to move.
        partition: u32,
        /// Node ids of the new replicas, comma- or space-separated.
        #[arg(value_delimiter = ',', required = true)]
        nodes: Vec<u64>,
        #[command(flatten)]
        target: Target,
    },
    /// Show the cluster: nodes, controller leader and voters, groups hosted and led.
    Cluster {
        #[command(flatten)]
        target: Target,
    },
    /// Node administration.
    Node {
        #[command(subcommand)]
        command: NodeCommand,
        #[command(flatten)]
        target: Target,
    },
}

#[derive(Subcommand, Debug)]
pub enum NodeCommand {
    /// Remove a node that is stopped for good (its disk lost, or retired) from the cluster.
    ///
    /// Move its replicas to other nodes first (`logdex move`); the removal is refused while
    /// the node answers or holds a replica. Its id and data directory never take part again
    /// (a replacement joins under a new id), and when it was a controller voter a live
    /// learner takes its place.
    Remove {
        /// Id of the node to remove.
        node_id: u64,
    },
}

#[derive(Subcommand, Debug)]
pub enum TopicCommand {
    /// Create a topic.
    Create {
        /// Topic name.
        name: String,
        /// Partitions of the topic.
        #[arg(long, default_value_t = 1)]
        partitions: u32,
        /// Replicas per partition [default: the server's, 3, or one per node when the cluster has fewer]
        #[arg(long)]
        replication_factor: Option<u32>,
        /// Topic config as key=value, repeatable (e.g. cleanup.policy=compact).
        #[arg(long = "config", value_parser = parse_kv, long_help = topic_config_help("cleanup.policy=compact"))]
        config: Vec<(String, String)>,
    },
    /// List topics.
    List,
    /// Show partitions, replicas, leaders and offsets of a topic.
    Describe {
        /// Topic name.
        name: String,
    },
    /// Delete a topic and its data on every node.
    Delete {
        /// Topic name.
        name: String,
    },
    /// Change topic config: `--config key=value`, repeatable; the keys given replace their
    /// values, the others stay.
    Alter {
        /// Topic name.
        name: String,
        /// Topic config as key=value, repeatable (e.g. retention.ms=3600000).
        #[arg(long = "config", value_parser = parse_kv, required = true, long_help = topic_config_help("retention.ms=3600000"))]
        config: Vec<(String, String)>,
    },
}

#[derive(clap::Args, Debug, Clone)]
pub struct Target {
    /// Any node's HTTP URL (`http://` is assumed when it names no scheme).
    #[arg(long, env = "LOGDEX_URL", default_value = "http://127.0.0.1:8080", global = true)]
    pub url: String,
    /// Print the server's JSON answer instead of a table (`get` prints the value either way;
    /// its metadata is on stderr with -v).
    #[arg(long, global = true)]
    pub json: bool,
    /// Bearer token for a node started with --auth-token-file.
    #[arg(long, env = "LOGDEX_TOKEN", global = true, hide_env_values = true)]
    pub token: Option<String>,
    /// PEM certificates of the CA of a cluster started with --tls-cert-file: the only roots
    /// trusted for an https:// --url.
    #[arg(long, env = "LOGDEX_CA_FILE", global = true)]
    pub ca_file: Option<std::path::PathBuf>,
}

/// The `--help` of `--config`: every topic config key the server takes, with its values.
fn topic_config_help(example: &str) -> String {
    format!(
        "Topic config as key=value, repeatable (e.g. {example}). Keys, as Kafka names them:\n\
         cleanup.policy: compact (the default), delete, or compact,delete\n\
         retention.ms, retention.bytes: -1 (no limit, the default) or more\n\
         segment.bytes: 14 to 2147483647 (default 134217728; segments roll at 1 KiB at the least)\n\
         segment.ms: at least 1\n\
         delete.retention.ms: how long tombstones and removed keys' 410s stay (default 86400000)\n\
         min.cleanable.dirty.ratio: 0 to 1 (default 0.5)\n\
         max.message.bytes: 1 to 2147483647 (unset: 16 MiB)\n\
         kv.index.enabled: true (the default) or false\n\
         remote.storage.enable: true or false (tiered storage; needs cleanup.policy=delete)\n\
         local.retention.ms, local.retention.bytes: -2 (as retention.*, the default), -1, or more"
    )
}

pub(crate) fn parse_kv(s: &str) -> Result<(String, String), String> {
    s.split_once('=').map(|(k, v)| (k.to_string(), v.to_string())).ok_or_else(|| format!("{s:?} is not key=value"))
}

/// Moves the client flags given before the command (`logdex --url URL cluster`) to just after
/// it (`logdex cluster --url URL`), where they are defined; clap takes flags only after the
/// command they belong to.
pub fn client_flags_after_command(mut args: Vec<std::ffi::OsString>) -> Vec<std::ffi::OsString> {
    const WITH_VALUE: [&str; 3] = ["--url", "--token", "--ca-file"];
    let mut end = 1;
    while let Some(arg) = args.get(end).and_then(|a| a.to_str()) {
        let name = arg.split_once('=').map_or(arg, |(name, _)| name);
        if arg == "--json" || (WITH_VALUE.contains(&name) && arg.contains('=')) {
            end += 1;
        } else if WITH_VALUE.contains(&arg) {
            end += 2;
        } else {
            break;
        }
    }
    if end > 1 && end < args.len() {
        let flags: Vec<_> = args.drain(1..end).collect();
        args.splice(2..2, flags);
    }
    args
}

/// Adds the settings of `serve --config FILE` (or `LOGDEX_CONFIG`) as flags,
/// except those already given as flags or `LOGDEX_*` environment variables:
/// flags win over the environment, which wins over the file. Also returns the file's path
/// when it added any, for errors about them.
pub fn with_config_file(args: Vec<std::ffi::OsString>) -> Result<(Vec<std::ffi::OsString>, Option<String>), String> {
    let text: Vec<String> = args.iter().map(|a| a.to_string_lossy().into_owned()).collect();
    if text.get(1).map(String::as_str) != Some("serve") {
        return Ok((args, None));
    }
    let from_flag = text.iter().enumerate().find_map(|(i, a)| {
        a.strip_prefix("--config=")
            .map(str::to_string)
            .or_else(|| (a == "--config").then(|| text.get(i + 1).cloned()).flatten())
    });
    let Some(path) = from_flag.or_else(|| std::env::var("LOGDEX_CONFIG").ok()) else {
        return Ok((args, None));
    };
    let body = std::fs::read_to_string(&path).map_err(|e| format!("cannot read config file {path}: {e}"))?;
    let table: toml::Table = body.parse().map_err(|e| format!("config file {path} is not valid TOML: {e}"))?;
    let mut out = args;
    for (key, value) in table {
        let flag = key.replace('_', "-");
        let env = format!("LOGDEX_{}", flag.replace('-', "_").to_uppercase());
        let given = text.iter().any(|a| *a == format!("--{flag}") || a.starts_with(&format!("--{flag}=")));
        if given || std::env::var_os(&env).is_some() {
            continue;
        }
        let value = match value {
            toml::Value::String(s) => s,
            toml::Value::Integer(i) => i.to_string(),
            toml::Value::Boolean(b) => b.to_string(),
            toml::Value::Float(f) => f.to_string(),
            toml::Value::Array(items) => items
                .iter()
                .map(|v| v.as_str().map_or_else(|| format!("{v:?}"), str::to_string))
                .collect::<Vec<_>>()
                .join(","),
            other => return Err(format!("config key {key} has an unsupported value {other:?}")),
        };
        out.push(format!("--{flag}={value}").into());
    }
    let added = out.len() > text.len();
    Ok((out, added.then_some(path)))
}

pub fn run(cli: Cli) -> Result<(), String> {
    let command = match cli.command {
        Some(c) => c,
        None => Cli::parse_from(["logdex", "serve"]).command.ok_or("no command")?,
    };
    // Set explicitly for every command: tokio would otherwise read TOKIO_WORKER_THREADS and
    // panic on a value that is not a number.
    let cores = std::thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get);
    let workers = match &command {
        Command::Serve(args) => crate::serve::worker_threads(usize::from(args.worker_threads), cores),
        _ => cores,
    };
    let mut builder = tokio::runtime::Builder::new_multi_thread();
    builder.worker_threads(workers);
    if matches!(command, Command::Serve(_)) {
        crate::serve::tune_runtime(&mut builder);
    }
    let runtime = builder.enable_all().build().map_err(|e| format!("cannot start the runtime: {e}"))?;
    runtime.block_on(async move {
        match command {
            Command::Serve(args) => crate::serve::serve(*args).await,
            Command::Dev(args) => crate::dev::dev(args).await,
            Command::Bench(args) => crate::bench::run(args).await,
            other => crate::client::run(other).await,
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Settings of the file become flags; a flag given on the command line wins.
    #[test]
    fn config_file_fills_flags_that_were_not_given() -> Result<(), Box<dyn std::error::Error>> {
        let dir = tempfile::tempdir()?;
        let path = dir.path().join("logdex.toml");
        std::fs::write(&path, "node-id = 7\nhttp_addr = \"127.0.0.1:1\"\nforward = false\n")?;
        let args: Vec<std::ffi::OsString> =
            ["logdex", "serve", "--config", &path.display().to_string(), "--http-addr", "127.0.0.1:2"]
                .iter()
                .map(Into::into)
                .collect();
        let (out, file) = with_config_file(args)?;
        assert_eq!(file, Some(path.display().to_string()));
        let out: Vec<String> = out.iter().map(|a| a.to_string_lossy().into_owned()).collect();
        assert!(out.contains(&"--node-id=7".to_string()), "{out:?}");
        assert!(out.contains(&"--forward=false".to_string()), "{out:?}");
        assert!(!out.iter().any(|a| a.contains("127.0.0.1:1")), "the flag must win: {out:?}");
        let cli = Cli::try_parse_from(out)?;
        let Some(Command::Serve(serve)) = cli.command else { return Err("not serve".into()) };
        assert_eq!(serve.node_id, 7);
        assert!(!serve.forward);
        assert_eq!(serve.http_addr.to_string(), "127.0.0.1:2");
        Ok(())
    }

    /// A listen address may name its host, as `--peers` and `--join` may: it is resolved at
    /// start; a malformed one is refused with the reason.
    #[test]
    fn listen_addresses_take_a_host_name() -> Result<(), Box<dyn std::error::Error>> {
        let cli = Cli::try_parse_from(["logdex", "serve", "--http-addr", "localhost:0", "--rpc-addr", "[::1]:7"])?;
        let Some(Command::Serve(serve)) = cli.command else { return Err("not serve".into()) };
        assert!(serve.http_addr.ip().is_loopback(), "{}", serve.http_addr);
        assert_eq!(serve.rpc_addr.to_string(), "[::1]:7");
        for bad in ["localhost", "localhost:http", ":1"] {
            let refused = Cli::try_parse_from(["logdex", "serve", "--http-addr", bad]).err().ok_or(bad)?;
            assert!(refused.to_string().contains(bad), "{refused}");
        }
        Ok(())
    }

    #[test]
    fn client_flags_before_the_command_are_taken() -> Result<(), Box<dyn std::error::Error>> {
        let parse = |args: &[&str]| {
            let args = client_flags_after_command(args.iter().map(Into::into).collect());
            Cli::try_parse_from(args)
        };
        let Some(Command::Cluster { target }) = parse(&["logdex", "--url", "http://h:1", "--json", "cluster"])?.command
        else {
            return Err("not the cluster command".into());
        };
        assert_eq!((target.url.as_str(), target.json), ("http://h:1", true));
        let Some(Command::Topic { target, .. }) = parse(&["logdex", "--url=http://h:2", "topic", "list"])?.command
        else {
            return Err("not the topic command".into());
        };
        assert_eq!(target.url, "http://h:2");
        assert!(parse(&["logdex", "--url", "http://h:1"]).is_err(), "flags without a command stay refused");
        assert!(parse(&["logdex", "--url", "http://h:1", "serve"]).is_err(), "serve takes no --url");
        Ok(())
    }

    /// TLS needs its certificate, key and CA together: any one alone is refused at parse.
    #[test]
    fn tls_flags_go_together() {
        let parse = |flags: &[&str]| Cli::try_parse_from([&["logdex", "serve"], flags].concat()).map(|_| ());
        assert!(parse(&["--tls-cert-file", "c.pem"]).is_err());
        assert!(parse(&["--tls-cert-file", "c.pem", "--tls-key-file", "k.pem"]).is_err());
        assert!(parse(&["--tls-key-file", "k.pem", "--tls-ca-file", "ca.pem"]).is_err());
        assert!(parse(&["--tls-ca-file", "ca.pem"]).is_err());
        assert!(parse(&["--tls-cert-file", "c.pem", "--tls-key-file", "k.pem", "--tls-ca-file", "ca.pem"]).is_ok());
    }

    /// The `serve` flags as parsed from `flags`.
    fn serve_flags(flags: &[&str]) -> Result<Box<ServeArgs>, Box<dyn std::error::Error>> {
        match Cli::try_parse_from([&["logdex", "serve"], flags].concat())?.command {
            Some(Command::Serve(serve)) => Ok(serve),
            _ => Err("not serve".into()),
        }
    }

    /// The loaded group-commit wait is taken from 0 to 100 ms, 1 ms when not given.
    #[test]
    fn group_commit_wait_is_checked_at_parse() -> Result<(), Box<dyn std::error::Error>> {
        let parse = |flags: &[&str]| Cli::try_parse_from([&["logdex", "serve"], flags].concat());
        let wait = |flags: &[&str]| serve_flags(flags).map(|serve| serve.group_commit_wait_us);
        assert_eq!(wait(&[])?, 1000);
        assert_eq!(wait(&["--group-commit-wait-us", "0"])?, 0);
        assert_eq!(wait(&["--group-commit-wait-us", "100000"])?, 100_000);
        let refused = parse(&["--group-commit-wait-us", "100001"]).err().ok_or("100001 was taken")?;
        assert!(refused.to_string().contains("100000"), "{refused}");
        assert!(parse(&["--group-commit-wait-us", "-1"]).is_err());
        Ok(())
    }

    /// Preferred-leader balancing runs every minute unless told otherwise; 0 turns it off.
    #[test]
    fn leader_balance_interval_defaults_to_a_minute_and_zero_turns_it_off() -> Result<(), Box<dyn std::error::Error>> {
        let interval = |flags: &[&str]| serve_flags(flags).map(|serve| serve.leader_balance_interval_secs);
        assert_eq!(interval(&[])?, 60);
        assert_eq!(interval(&["--leader-balance-interval-secs", "0"])?, 0);
        assert!(serve_flags(&["--leader-balance-interval-secs", "86401"]).is_err());
        assert!(serve_flags(&["--leader-balance-interval-secs", "-1"]).is_err());
        Ok(())
    }

    #[test]
    fn serve_flags_out_of_range_are_refused_at_parse() {
        let parse = |flags: &[&str]| Cli::try_parse_from([&["logdex", "serve"], flags].concat());
        for flags in [
            ["--worker-threads", "100000"],
            ["--worker-threads", "-1"],
            ["--controller-voters", "0"],
            ["--controller-voters", "8"],
            ["--requests-in-flight-max", "0"],
            ["--lookup-rate-limit", "0"],
            ["--log", "not[valid"],
            ["--heartbeat-ms", "0"],
            ["--election-timeout-ms", "18446744073709551615"],
            ["--cleaner-interval-ms", "0"],
        ] {
            assert!(parse(&flags).is_err(), "{flags:?} was taken");
        }
        for flags in [
            ["--worker-threads", "256"],
            ["--controller-voters", "7"],
            ["--requests-in-flight-max", "1"],
            ["--lookup-rate-limit", "1"],
            ["--log", "info,logdex_raft=debug"],
        ] {
            assert!(parse(&flags).is_ok(), "{flags:?} was refused");
        }
    }

    #[test]
    fn bench_value_size_and_duration_out_of_range_are_refused_at_parse() {
        let parse = |flags: &[&str]| Cli::try_parse_from([&["logdex", "bench", "load"], flags].concat());
        assert!(parse(&["--value-bytes", "100000000000"]).is_err());
        assert!(parse(&["--duration-secs", "0"]).is_err());
        assert!(parse(&["--duration-secs", "18446744073709551615"]).is_err());
        assert!(parse(&["--value-bytes", "1048576", "--duration-secs", "60"]).is_ok());
    }

    #[test]
    fn invalid_config_file_is_a_clear_error() -> Result<(), Box<dyn std::error::Error>> {
        let dir = tempfile::tempdir()?;
        let path = dir.path().join("bad.toml");
        std::fs::write(&path, "node-id = [\n")?;
        let args: Vec<std::ffi::OsString> =
            ["logdex", "serve", "--config", &path.display().to_string()].iter().map(Into::into).collect();
        let err = with_config_file(args).err().ok_or("accepted invalid TOML")?;
        assert!(err.contains("not valid TOML"), "{err}");
        Ok(())
    }
}
