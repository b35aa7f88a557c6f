//! A cluster started with TLS (`--tls-cert-file`, `--tls-key-file`, `--tls-ca-file`): every
//! path between client and nodes and between nodes is HTTPS or RPC over TLS, and works; a
//! node called in the other protocol on its RPC port logs which flags differ.

use std::collections::BTreeMap;
use std::time::Duration;

use logdex_cluster_tests::Api;
use logdex_cluster_tests::Cluster;
use logdex_cluster_tests::ClusterOptions;
use logdex_cluster_tests::Error;
use logdex_cluster_tests::Read;
use logdex_cluster_tests::ReadMode;
use logdex_cluster_tests::Reply;
use logdex_cluster_tests::Result;
use logdex_cluster_tests::TopicSpec;
use logdex_cluster_tests::Written;
use logdex_cluster_tests::client::HEADER_NODE;
use logdex_cluster_tests::client::HEADER_REDIRECT;
use logdex_cluster_tests::client::written;
use logdex_cluster_tests::ensure;
use logdex_cluster_tests::ensure_eq;
use logdex_cluster_tests::support::Probe;
use logdex_cluster_tests::support::poll_until;
use logdex_cluster_tests::support::settled;
use logdex_cluster_tests::tls::TestPki;

const NODES: usize = 3;
const SETTLE_TIMEOUT: Duration = Duration::from_secs(20);

/// Over TLS: writes through every node (forwarded to leaders over RPC) land; every node
/// answers every key in every read mode (a follower's read index comes over RPC); a node
/// without a replica forwards a lookup over HTTPS, or answers 421 with an `https://`
/// redirect that works; plain HTTP is told to use https, and a client trusting another CA gets
/// no answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tls_cluster_serves_writes_and_lookups_over_https_between_every_node() -> Result<()> {
    let cluster =
        Cluster::start_with(ClusterOptions { nodes: NODES, tls: true, ..ClusterOptions::plain(NODES) }).await?;
    let outcome = over_tls(&cluster).await;
    cluster.finish(outcome)
}

async fn put(cluster: &Cluster, via: u64, topic: &str, key: &[u8], value: &[u8]) -> Result<Written> {
    let url = cluster.url(via);
    let reply = settled("a put over TLS", SETTLE_TIMEOUT, || cluster.api().put(&url, topic, key, value)).await?;
    reply.expect_status(200)?;
    written(&reply)
}

async fn get(cluster: &Cluster, via: u64, topic: &str, key: &[u8], read: &Read) -> Result<Reply> {
    let url = cluster.url(via);
    settled("a lookup over TLS", SETTLE_TIMEOUT, || cluster.api().get(&url, topic, key, read)).await
}

fn expect_value(reply: &Reply, value: &[u8]) -> Result<()> {
    reply.expect_status(200)?;
    ensure_eq!(reply.text().as_bytes(), value, "value of {}", reply.summary());
    Ok(())
}

async fn over_tls(cluster: &Cluster) -> Result<()> {
    let base = cluster.url(1);
    ensure!(base.starts_with("https://"), "a TLS cluster's URL is {base}");
    for (name, replication_factor) in [("secure", 3), ("secure-single", 1)] {
        let created = cluster.api().create_topic(&base, &TopicSpec::compacted(name, 3, replication_factor)).await?;
        created.expect_status(201)?;
        cluster.wait_for_leaders(name, SETTLE_TIMEOUT).await?;
    }

    // Replicated topic: writes rotate over the nodes; reads from every node in every mode.
    let ids = cluster.node_ids();
    let mut keys = Vec::new();
    for i in 0..24u64 {
        let (key, value) = (format!("tls-key-{i}").into_bytes(), format!("tls-value-{i}").into_bytes());
        let via = ids[i as usize % ids.len()];
        let w = put(cluster, via, "secure", &key, &value).await?;
        keys.push((key, value, w));
    }
    for id in &ids {
        for (key, value, w) in &keys {
            for read in [Read::linearizable(), Read::mode(ReadMode::Strict), Read::follower().min_offset(w.offset)] {
                expect_value(&get(cluster, *id, "secure", key, &read).await?, value)?;
            }
        }
    }

    // Single-replica topic: a node without the partition forwards over HTTPS, or redirects.
    let description = cluster.api().describe_ok(&base, "secure-single").await?;
    let mut first_of: BTreeMap<u32, (Vec<u8>, Vec<u8>)> = BTreeMap::new();
    for i in 0..12 {
        let (key, value) = (format!("single-{i}").into_bytes(), format!("single-value-{i}").into_bytes());
        let w = put(cluster, 1, "secure-single", &key, &value).await?;
        first_of.entry(w.partition).or_insert((key, value));
    }
    for (partition, (key, value)) in &first_of {
        let host = description.partition(*partition)?.replicas[0];
        let Some(other) = ids.iter().copied().find(|id| *id != host) else {
            return Err(Error::Check("no node other than the host".into()));
        };
        let forwarded = get(cluster, other, "secure-single", key, &Read::linearizable()).await?;
        expect_value(&forwarded, value)?;
        ensure_eq!(forwarded.header_u64(HEADER_NODE)?, host, "X-Kv-Node of a forwarded lookup");

        let refused = get(cluster, other, "secure-single", key, &Read::linearizable().forward(false)).await?;
        refused.expect_status(421)?;
        let redirect = refused
            .header(HEADER_REDIRECT)
            .ok_or_else(|| Error::Check(format!("421 without X-Kv-Redirect: {}", refused.summary())))?;
        ensure!(redirect.starts_with("https://"), "X-Kv-Redirect of a TLS cluster: {redirect}");
        expect_value(&cluster.api().get_url(redirect).await?, value)?;
    }

    // A plain HTTP client is told to use https (a 400 in plain HTTP, then the connection
    // closes), and answers nothing else; nothing answers a client that does not trust the
    // cluster's CA.
    let plain_url = base.replacen("https://", "http://", 1);
    let plain = Api::new()?.healthz(&plain_url).await?;
    ensure_eq!(plain.status, 400, "plain HTTP to a TLS node: {}", plain.summary());
    ensure!(plain.text().contains("tls_required") && plain.text().contains("https://"), "{}", plain.summary());
    let stranger = Api::with_ca(&TestPki::generate("another CA")?.ca_pem)?;
    match stranger.healthz(&base).await {
        Err(e) if e.is_transport() => {}
        Ok(reply) => return Err(Error::Check(format!("a client trusting another CA got {}", reply.summary()))),
        Err(e) => return Err(e),
    }
    cluster.api().healthz(&base).await?.expect_status(200)?;

    // The RPC listener speaks TLS only: a plain HTTP/2 opening gets no SETTINGS frame back,
    // only a TLS alert record (content type 21) or a closed connection.
    let first = plain_http2_opening(cluster.rpc_addr(1)).await?;
    ensure!(
        first.is_empty() || first[0] == 21,
        "the RPC listener answered a plain HTTP/2 opening with {first:?} (a SETTINGS frame has type 4 at byte 3)"
    );
    // ... and the node logs what the peer that spoke it must change.
    let told = "spoke plain HTTP/2 to this node's TLS RPC port: start that node with --tls-cert-file";
    wait_logged(cluster, told).await
}

/// Waits (at most 10 s) until node 1 has logged `text` since its launch.
async fn wait_logged(cluster: &Cluster, text: &str) -> Result<()> {
    poll_until(&format!("node 1 logs {text:?}"), Duration::from_secs(10), Duration::from_millis(100), || async {
        Ok(if cluster.launch_log(1)?.contains(text) { Probe::Ready(()) } else { Probe::NotYet(cluster.log_tail(1, 5)) })
    })
    .await
}

/// A TLS opening on a plain node's RPC port (a peer of a TLS cluster calling a node started
/// without the cluster's TLS flags) is logged by that node with the flags to add: the peer
/// alone would see only a transport error.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_plain_node_called_over_tls_logs_the_flags_it_lacks() -> Result<()> {
    let cluster = Cluster::start(1).await?;
    let outcome = called_over_tls(&cluster).await;
    cluster.finish(outcome)
}

async fn called_over_tls(cluster: &Cluster) -> Result<()> {
    use tokio::io::AsyncWriteExt as _;
    let addr = cluster.rpc_addr(1);
    let mut stream =
        tokio::net::TcpStream::connect(addr).await.map_err(|e| Error::io(format!("connecting to {addr}"), e))?;
    // The start of a TLS record: handshake (22), version 3.1, then a length.
    stream.write_all(&[22, 3, 1, 0, 64]).await.map_err(|e| Error::io(format!("writing to {addr}"), e))?;
    let told = "opened a TLS connection to this node's plain RPC port: the cluster uses TLS; start this node with --tls-cert-file";
    wait_logged(cluster, told).await?;
    cluster.api().healthz(&cluster.url(1)).await?.expect_status(200)?;
    Ok(())
}

/// Sends the HTTP/2 client preface in the clear and returns the first bytes answered (empty
/// when the peer closes without a word).
async fn plain_http2_opening(addr: std::net::SocketAddr) -> Result<Vec<u8>> {
    use tokio::io::AsyncReadExt as _;
    use tokio::io::AsyncWriteExt as _;
    let io = |what: &str, e| Error::io(format!("{what} the RPC listener at {addr}"), e);
    let mut stream = tokio::net::TcpStream::connect(addr).await.map_err(|e| io("connecting to", e))?;
    stream.write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n").await.map_err(|e| io("writing to", e))?;
    let mut first = vec![0u8; 16];
    let read = tokio::time::timeout(Duration::from_secs(5), stream.read(&mut first)).await;
    match read {
        Ok(Ok(n)) => first.truncate(n),
        // Reset after the alert: nothing readable.
        Ok(Err(_)) => first.clear(),
        Err(_) => return Err(Error::Check(format!("the RPC listener at {addr} neither answered nor closed in 5 s"))),
    }
    Ok(first)
}

/// A node whose certificate does not name the address it advertises, or that another CA
/// signed, would be refused by every peer: it does not start, and says why.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn node_whose_certificate_its_peers_would_refuse_does_not_start() -> Result<()> {
    let dir = tempfile::tempdir().map_err(|e| Error::io("creating a directory", e))?;
    let files = TestPki::generate("logdex test CA")?.write(dir.path())?;
    let other_ca = TestPki::generate("another CA")?.write(&dir.path().join("other"))?;
    let data = dir.path().join("data");
    let data = data.to_string_lossy();
    let text = |p: &std::path::Path| p.to_string_lossy().to_string();
    let (cert, key, ca, other) = (text(&files.cert), text(&files.key), text(&files.ca), text(&other_ca.ca));
    let serve = |advertised: &'static str, ca: String| {
        let data = data.to_string();
        let (cert, key) = (cert.clone(), key.clone());
        async move {
            let args = [
                "serve",
                "--node-id",
                "1",
                "--data-dir",
                &data,
                "--http-addr",
                "127.0.0.1:0",
                "--rpc-addr",
                "127.0.0.1:0",
                "--advertise-rpc-addr",
                advertised,
                "--tls-cert-file",
                &cert,
                "--tls-key-file",
                &key,
                "--tls-ca-file",
                &ca,
            ];
            logdex_cluster_tests::support::run_logdex(&args, "", Duration::from_secs(30)).await
        }
    };
    // 127.0.0.99 is not among the test certificate's names.
    let (ok, _, stderr) = serve("127.0.0.99:9091", ca).await?;
    ensure!(
        !ok && stderr.contains("would refuse this node's certificate") && stderr.contains("127.0.0.99:9091"),
        "{stderr}"
    );
    let (ok, _, stderr) = serve("127.0.0.1:9091", other).await?;
    ensure!(!ok && stderr.contains("invalid peer certificate"), "{stderr}");
    Ok(())
}
