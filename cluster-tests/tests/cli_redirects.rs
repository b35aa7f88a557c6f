//! The `logdex` CLI follows a 421's `X-Kv-Redirect`: against a cluster whose nodes answer 421
//! instead of forwarding (`--forward=false`), every CLI command works from any node.

use std::time::Duration;

use logdex_cluster_tests::Cluster;
use logdex_cluster_tests::ClusterOptions;
use logdex_cluster_tests::Error;
use logdex_cluster_tests::Result;
use logdex_cluster_tests::TopicSpec;
use logdex_cluster_tests::client::HEADER_REDIRECT;
use logdex_cluster_tests::ensure;
use logdex_cluster_tests::ensure_eq;
use logdex_cluster_tests::support::run_logdex;

const NODES: usize = 3;
/// Bound on one CLI run (its own request timeout is 30 s; a settling cluster answers sooner).
const CLI_TIMEOUT: Duration = Duration::from_secs(60);
/// How long a CLI command is retried while the cluster settles (no leader yet: 503).
const SETTLE_TIMEOUT: Duration = Duration::from_secs(20);

/// Runs `logdex <args> --url <url>` and returns (success, stdout, stderr).
async fn cli(url: &str, args: &[&str]) -> Result<(bool, String, String)> {
    cli_with_input(url, args, "").await
}

/// Runs `logdex <args> --url <url>` with `input` on its stdin; returns (success, stdout, stderr).
async fn cli_with_input(url: &str, args: &[&str], input: &str) -> Result<(bool, String, String)> {
    run_logdex(&[args, &["--url", url]].concat(), input, CLI_TIMEOUT).await
}

/// [`cli`] until it succeeds; only a 503 (the cluster still electing) is retried.
async fn cli_ok(url: &str, args: &[&str]) -> Result<String> {
    let deadline = tokio::time::Instant::now() + SETTLE_TIMEOUT;
    loop {
        let (ok, stdout, stderr) = cli(url, args).await?;
        if ok {
            return Ok(stdout);
        }
        if !stderr.contains("503") || tokio::time::Instant::now() >= deadline {
            return Err(Error::Check(format!("logdex {args:?} against {url} failed: {stderr}")));
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cli_commands_follow_redirects_of_nodes_that_do_not_forward() -> Result<()> {
    let options = ClusterOptions {
        node_env: vec![("LOGDEX_FORWARD".to_string(), "false".to_string())],
        ..ClusterOptions::plain(NODES)
    };
    let cluster = Cluster::start_with(options).await?;
    let outcome = async {
        let urls: Vec<String> = cluster.node_ids().into_iter().map(|id| cluster.url(id)).collect();
        cli_ok(&urls[NODES - 1], &["topic", "create", "users", "--partitions", "1"]).await?;
        let topic = cluster.wait_for_leaders("users", SETTLE_TIMEOUT).await?;
        let leader = topic.partitions[0].leader.ok_or_else(|| Error::Check("partition 0 has no leader".into()))?;

        // The nodes really do answer 421 rather than forward: a write to a follower does.
        let follower = cluster.node_ids().into_iter().find(|id| *id != leader).unwrap_or(leader);
        let raw = reqwest::Client::new()
            .put(format!("{}/kv/users/probe", cluster.url(follower)))
            .body("v")
            .send()
            .await
            .map_err(|e| Error::Check(format!("PUT to node {follower}: {e}")))?;
        ensure_eq!(raw.status().as_u16(), 421, "a follower's answer to a write with forwarding off");
        ensure!(raw.headers().contains_key(HEADER_REDIRECT), "the 421 names where to go");

        // Every node takes the CLI's writes, deletes and reads: the CLI goes where the 421 says.
        for (i, url) in urls.iter().enumerate() {
            let key = format!("k{i}");
            let value = format!("from node {}", i + 1);
            cli_ok(url, &["put", "users", &key, &value]).await?;
            let got = cli_ok(url, &["get", "users", &key]).await?;
            ensure_eq!(got.trim_end(), value, "get {key} (linearizable) from {url}");
            // A follower read is served by the node asked, once its replica has applied the write.
            let deadline = tokio::time::Instant::now() + SETTLE_TIMEOUT;
            loop {
                let (ok, got, stderr) = cli(url, &["get", "users", &key, "--read", "follower"]).await?;
                if ok && got.trim_end() == value {
                    break;
                }
                ensure!(tokio::time::Instant::now() < deadline, "get {key} --read follower from {url}: {got}{stderr}");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
        cli_ok(&urls[0], &["del", "users", "k0"]).await?;
        let (ok, _, stderr) = cli(&urls[1], &["get", "users", "k0"]).await?;
        ensure!(!ok && stderr.contains("404"), "a deleted key is 404 through any node, got: {stderr}");
        Ok(())
    }
    .await;
    cluster.finish(outcome)
}

/// `logdex produce` against a node that does not forward: a batch spanning partitions led by
/// different nodes is refused whole (421, nothing written), and the CLI sends each
/// partition's records to its leader instead; every record lands once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cli_produce_splits_a_batch_whose_partitions_have_different_leaders() -> Result<()> {
    const RECORDS: usize = 90;
    let options = ClusterOptions {
        node_env: vec![("LOGDEX_FORWARD".to_string(), "false".to_string())],
        ..ClusterOptions::plain(NODES)
    };
    let cluster = Cluster::start_with(options).await?;
    let outcome = async {
        let url = cluster.url(1);
        cli_ok(&url, &["topic", "create", "spread", "--partitions", "6", "--replication-factor", "1"]).await?;
        let topic = cluster.wait_for_leaders("spread", SETTLE_TIMEOUT).await?;
        let leaders: std::collections::BTreeSet<u64> = topic.partitions.iter().filter_map(|p| p.leader).collect();
        ensure!(leaders.len() > 1, "the partitions' leaders are on one node only: {leaders:?}");
        // Every third record has no key (a line without a tab).
        let input: String = (0..RECORDS)
            .map(|i| if i % 3 == 2 { format!("keyless {i}\n") } else { format!("key-{i}\tvalue {i}\n") })
            .collect();
        let (ok, stdout, stderr) = cli_with_input(&url, &["produce", "spread", "--batch", "30"], &input).await?;
        ensure!(ok, "logdex produce failed: {stderr}");
        ensure!(stdout.contains(&format!("produced {RECORDS} records")), "produce said: {stdout}");
        let written: u64 = cluster.describe("spread").await?.partitions.iter().map(|p| p.high_watermark).sum();
        ensure_eq!(written, RECORDS as u64, "records in the topic after one produce of {RECORDS}");
        for i in [0, 1, 45, 88] {
            let got = cli_ok(&url, &["get", "spread", &format!("key-{i}")]).await?;
            ensure_eq!(got.trim_end(), format!("value {i}"), "get key-{i}");
        }
        // With --json: the server's answer to each request it sent, one JSON line each.
        let input = "j-0\tv\nj-1\tv\nkeyless\nj-3\tv\n";
        let (ok, stdout, stderr) = cli_with_input(&url, &["produce", "spread", "--json"], input).await?;
        ensure!(ok, "logdex produce --json failed: {stderr}");
        let mut placed = 0;
        for line in stdout.lines() {
            let answer: serde_json::Value =
                serde_json::from_str(line).map_err(|e| Error::Check(format!("not JSON: {line:?}: {e}")))?;
            placed += answer["offsets"].as_array().map_or(0, Vec::len);
        }
        ensure_eq!(placed, 4, "records placed in the JSON answers: {stdout}");
        Ok(())
    }
    .await;
    cluster.finish(outcome)
}

/// `logdex produce` names the input lines of a record it cannot send (a key before the tab
/// that is empty) or the server refuses (a value over the bound), and how many records it
/// wrote before them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cli_produce_errors_name_the_input_lines() -> Result<()> {
    let cluster = Cluster::start(1).await?;
    let outcome = async {
        let url = cluster.url(cluster.node_ids()[0]);
        cli_ok(&url, &["topic", "create", "lines"]).await?;
        let input = "a\t1\nb\t2\n\tno key\nd\t4\n";
        let (ok, _, stderr) = cli_with_input(&url, &["produce", "lines", "--batch", "2"], input).await?;
        ensure!(!ok, "a line with an empty key was produced");
        ensure!(stderr.contains("line 3: the key before the tab is empty"), "produce said: {stderr}");
        ensure!(stderr.contains("2 records written before it"), "produce said: {stderr}");
        let big = format!("e\t5\nf\t{}\n", "v".repeat(2 << 20));
        let (ok, _, stderr) = cli_with_input(&url, &["produce", "lines"], &big).await?;
        ensure!(!ok, "a value over the bound was produced");
        ensure!(stderr.contains("lines 1 to 2 (record 0 is line 1)"), "produce said: {stderr}");
        ensure!(stderr.contains("record 1"), "produce said: {stderr}");
        let written = cluster.describe("lines").await?.partitions[0].high_watermark;
        ensure_eq!(written, 2, "records written: the first batch only");
        Ok(())
    }
    .await;
    cluster.finish(outcome)
}

/// A reader that goes away before the CLI prints (`logdex ... | head -0`) gets a clear error
/// from it and exit status 1, not a panic.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cli_output_to_a_closed_pipe_is_an_error_not_a_panic() -> Result<()> {
    use std::process::Stdio;
    let cluster = Cluster::start(1).await?;
    let outcome = async {
        let url = cluster.url(cluster.node_ids()[0]);
        cli_ok(&url, &["topic", "create", "closed-pipe"]).await?;
        for args in [&["topic", "describe", "closed-pipe", "--json"][..], &["topic", "list"], &["cluster"]] {
            let mut command = tokio::process::Command::new(logdex_cluster_tests::cluster::binary_path()?);
            command.args(args).args(["--url", &url]).kill_on_drop(true);
            command.stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped());
            let mut child = command.spawn().map_err(|e| Error::io(format!("running logdex {args:?}"), e))?;
            // Closed before the CLI has its answer from the node to print.
            drop(child.stdout.take());
            let out = tokio::time::timeout(CLI_TIMEOUT, child.wait_with_output())
                .await
                .map_err(|_| Error::Check(format!("logdex {args:?} ran over {CLI_TIMEOUT:?}")))?
                .map_err(|e| Error::io(format!("running logdex {args:?}"), e))?;
            let stderr = String::from_utf8_lossy(&out.stderr);
            ensure!(!stderr.contains("panicked"), "logdex {args:?} panicked: {stderr}");
            ensure_eq!(out.status.code(), Some(1), "exit status of logdex {args:?} ({stderr})");
            ensure!(stderr.contains("writing to stdout"), "logdex {args:?} said: {stderr}");
        }
        Ok(())
    }
    .await;
    cluster.finish(outcome)
}

/// `logdex put`, `get` and `del` with `--partition` write, read and delete the key in the
/// partition named, not in the one murmur2 of its bytes picks.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cli_put_get_del_with_partition_use_the_partition_named() -> Result<()> {
    let cluster = Cluster::start(1).await?;
    let outcome = async {
        let url = cluster.url(cluster.node_ids()[0]);
        cli_ok(&url, &["topic", "create", "placed", "--partitions", "4"]).await?;
        let hashed = cli_ok(&url, &["put", "placed", "k", "hashed"]).await?;
        let default: u32 = hashed
            .split_whitespace()
            .nth(1)
            .and_then(|p| p.parse().ok())
            .ok_or_else(|| Error::Check(format!("put printed {hashed:?}")))?;
        let other = ((default + 1) % 4).to_string();

        let placed = cli_ok(&url, &["put", "placed", "k", "placed", "--partition", &other]).await?;
        ensure!(placed.starts_with(&format!("partition {other} ")), "put --partition {other} printed {placed:?}");
        ensure_eq!(
            cli_ok(&url, &["get", "placed", "k", "--partition", &other]).await?.trim_end(),
            "placed",
            "the key in partition {other}"
        );
        ensure_eq!(cli_ok(&url, &["get", "placed", "k"]).await?.trim_end(), "hashed", "the key's own partition");

        cli_ok(&url, &["del", "placed", "k", "--partition", &other]).await?;
        let (ok, _, stderr) = cli(&url, &["get", "placed", "k", "--partition", &other, "--read", "follower"]).await?;
        ensure!(!ok && stderr.contains("404"), "deleted in partition {other}, got: {stderr}");
        ensure_eq!(cli_ok(&url, &["get", "placed", "k"]).await?.trim_end(), "hashed", "untouched by the delete");
        Ok(())
    }
    .await;
    cluster.finish(outcome)
}

/// A node that does not forward sends a writer only to a leader that answers: right after the
/// leader dies (its followers still name it until the election ends), a write through a node
/// without a replica is answered 503 with Retry-After, never a 421 to the dead node, and once
/// the election is over its 421 names the new leader, which takes the write.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redirect_of_a_write_never_names_a_leader_that_died() -> Result<()> {
    let options = ClusterOptions {
        node_env: vec![("LOGDEX_FORWARD".to_string(), "false".to_string())],
        ..ClusterOptions::plain(4)
    };
    let mut cluster = Cluster::start_with(options).await?;
    let outcome = async {
        let created = cluster.api().create_topic(&cluster.url(1), &TopicSpec::compacted("orphans", 4, 3)).await?;
        ensure!(created.status == 201, "create: {}", created.summary());
        let topic = cluster.wait_for_leaders("orphans", SETTLE_TIMEOUT).await?;
        // A partition with a node outside its replicas, to write through.
        let (partition, outsider, leader) = topic
            .partitions
            .iter()
            .find_map(|p| {
                let outsider = cluster.node_ids().into_iter().find(|n| !p.replicas.contains(n))?;
                Some((p.partition, outsider, p.leader?))
            })
            .ok_or_else(|| Error::Check(format!("no partition leaves a node out: {topic:?}")))?;
        let url = format!("{}/kv/orphans/k?partition={partition}", cluster.url(outsider));
        let http = reqwest::Client::new();
        // The outsider knows the leader before it dies.
        let before = http.put(&url).body("v").send().await.map_err(|e| Error::Check(format!("PUT {url}: {e}")))?;
        ensure_eq!(before.status().as_u16(), 421, "a write through node {outsider}");

        cluster.kill(leader)?;
        let dead = cluster.url(leader);
        let deadline = tokio::time::Instant::now() + SETTLE_TIMEOUT;
        loop {
            let reply = http.put(&url).body("v").send().await.map_err(|e| Error::Check(format!("PUT {url}: {e}")))?;
            let status = reply.status().as_u16();
            let redirect = reply.headers().get(HEADER_REDIRECT).and_then(|v| v.to_str().ok()).map(str::to_string);
            match (status, redirect) {
                (421, Some(to)) => {
                    ensure!(!to.starts_with(&dead), "node {outsider} sent a writer to node {leader}, dead: {to}");
                    let taken =
                        http.put(&to).body("v").send().await.map_err(|e| Error::Check(format!("PUT {to}: {e}")))?;
                    ensure_eq!(taken.status().as_u16(), 200, "the write at {to}");
                    break;
                }
                (503, _) => ensure!(reply.headers().contains_key("retry-after"), "a 503 without Retry-After"),
                (other, _) => return Err(Error::Check(format!("a write through node {outsider}: {other}"))),
            }
            ensure!(tokio::time::Instant::now() < deadline, "no new leader named in {SETTLE_TIMEOUT:?}");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        Ok(())
    }
    .await;
    cluster.finish(outcome)
}
