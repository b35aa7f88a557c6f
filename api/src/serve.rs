//! `logdex serve`: one node.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use clap::Args;
use logdex_index::IndexConfig;
use logdex_log::LogConfig;
use logdex_raft::node::Node;
use logdex_raft::node::NodeConfig;

use crate::http::AppState;
use crate::http::Limits;
use crate::idle::HTTP_IDLE_TIMEOUT;
use crate::idle::IdleListener;
use crate::routing::Router;
use crate::tls::ClientAddr;
use crate::tls::NodeTls;

/// The largest `--record-cache-mb`: a bound on a mistyped size, far above any machine's memory
/// the cache would fit in.
const RECORD_CACHE_MB_MAX: u64 = 1 << 20;

/// Flags of `logdex serve`; each also reads `LOGDEX_<FLAG>` from the environment.
#[derive(Args, Debug, Clone)]
pub struct ServeArgs {
    /// TOML file of serve settings, keys named like the flags (`node-id = 1`,
    /// `peers = "1@127.0.0.1:9091,..."`); flags and LOGDEX_* variables win over it.
    #[arg(long, env = "LOGDEX_CONFIG")]
    pub config: Option<PathBuf>,
    /// This node's id (1 or more), stable across restarts.
    #[arg(long, env = "LOGDEX_NODE_ID", default_value_t = 1)]
    pub node_id: u64,
    /// Directory holding this node's data.
    #[arg(long, env = "LOGDEX_DATA_DIR", default_value = "./logdex-data")]
    pub data_dir: PathBuf,
    /// HTTP listen address, IP:PORT or HOST:PORT (a name is resolved once, at start).
    #[arg(long, env = "LOGDEX_HTTP_ADDR", default_value = "127.0.0.1:8080", value_parser = parse_listen_address)]
    pub http_addr: SocketAddr,
    /// Node-to-node RPC listen address, IP:PORT or HOST:PORT (a name is resolved once, at start).
    #[arg(long, env = "LOGDEX_RPC_ADDR", default_value = "127.0.0.1:9090", value_parser = parse_listen_address)]
    pub rpc_addr: SocketAddr,
    /// HTTP address other nodes and clients use for this node, host:port (default: --http-addr).
    #[arg(long, env = "LOGDEX_ADVERTISE_HTTP_ADDR", value_parser = parse_address)]
    pub advertise_http_addr: Option<String>,
    /// RPC address other nodes use for this node, host:port (default: --rpc-addr).
    #[arg(long, env = "LOGDEX_ADVERTISE_RPC_ADDR", value_parser = parse_address)]
    pub advertise_rpc_addr: Option<String>,
    /// Initial cluster, the same on every initial node: `1@host:rpcport,2@host:rpcport,...`.
    /// Default: this node alone (a single-node cluster).
    #[arg(long, env = "LOGDEX_PEERS", conflicts_with = "join")]
    pub peers: Option<String>,
    /// Join a running cluster through any member's RPC address instead of --peers.
    #[arg(long, env = "LOGDEX_JOIN")]
    pub join: Option<String>,
    /// Forward requests this node cannot serve to a node that can (true), or answer 421 (false).
    #[arg(long, env = "LOGDEX_FORWARD", default_value_t = true, action = clap::ArgAction::Set)]
    pub forward: bool,
    /// Raft heartbeat interval of every group, in milliseconds (1 to 600000).
    #[arg(long, env = "LOGDEX_HEARTBEAT_MS", default_value_t = 250,
          value_parser = clap::value_parser!(u64).range(1..=600_000))]
    pub heartbeat_ms: u64,
    /// Minimum Raft election timeout, in milliseconds (1 to 3600000; the maximum is twice
    /// this). It must exceed twice the heartbeat.
    #[arg(long, env = "LOGDEX_ELECTION_TIMEOUT_MS", default_value_t = 1500,
          value_parser = clap::value_parser!(u64).range(1..=3_600_000))]
    pub election_timeout_ms: u64,
    /// File holding a bearer token required on every HTTP and client gRPC request
    /// (except /healthz, /readyz and /metrics). Forwarded requests carry it on.
    #[arg(long, env = "LOGDEX_AUTH_TOKEN_FILE")]
    pub auth_token_file: Option<PathBuf>,
    /// File holding a bearer token for node-to-node RPC: required from peers and sent to them.
    #[arg(long, env = "LOGDEX_RPC_TOKEN_FILE")]
    pub rpc_token_file: Option<PathBuf>,
    /// PEM certificate chain of this node (its own certificate first). With
    /// --tls-key-file and --tls-ca-file: the HTTP and RPC listeners serve only TLS, and
    /// calls to other nodes are HTTPS. Every node of a cluster runs TLS, or none.
    #[arg(long, env = "LOGDEX_TLS_CERT_FILE", requires_all = ["tls_key_file", "tls_ca_file"])]
    pub tls_cert_file: Option<PathBuf>,
    /// PEM private key of --tls-cert-file (PKCS#8, PKCS#1 or SEC1).
    #[arg(long, env = "LOGDEX_TLS_KEY_FILE", requires = "tls_cert_file")]
    pub tls_key_file: Option<PathBuf>,
    /// PEM certificates of the CA that signed every node's certificate: the only roots
    /// trusted when this node calls another (the name checked is the host of its address).
    #[arg(long, env = "LOGDEX_TLS_CA_FILE", requires = "tls_cert_file")]
    pub tls_ca_file: Option<PathBuf>,
    /// Upper bound on HTTP requests being served at once (1 to 1048576); more answer 503.
    #[arg(long, env = "LOGDEX_REQUESTS_IN_FLIGHT_MAX", default_value_t = 4096,
          value_parser = clap::value_parser!(u32).range(1..=1_048_576))]
    pub requests_in_flight_max: u32,
    /// Key lookups allowed per second from one client address (429 beyond), at least 1.
    /// Default: unlimited.
    #[arg(long, env = "LOGDEX_LOOKUP_RATE_LIMIT", value_parser = clap::value_parser!(u32).range(1..))]
    pub lookup_rate_limit: Option<u32>,
    /// Controller voters (1 to 7): at bootstrap the lowest ids of --peers, at most this many;
    /// the other nodes hold the cluster metadata as learners, and the controller's leader
    /// makes learners that answer voters while there are fewer (keeping their count odd), and
    /// in place of removed nodes.
    #[arg(long, env = "LOGDEX_CONTROLLER_VOTERS", default_value_t = logdex_raft::node::CONTROLLER_VOTERS_DEFAULT as u8,
          value_parser = clap::value_parser!(u8).range(1..=logdex_raft::node::CONTROLLER_VOTERS_MAX as i64))]
    pub controller_voters: u8,
    /// How often compaction (cleanup.policy=compact) and retention (delete) run on each log, in ms.
    #[arg(long, env = "LOGDEX_CLEANER_INTERVAL_MS", default_value_t = 30_000,
          value_parser = clap::value_parser!(u64).range(1..=86_400_000))]
    pub cleaner_interval_ms: u64,
    /// Object store of tiered storage, the same for every node of the cluster: an
    /// S3-compatible bucket `s3://bucket/prefix` (endpoint, region and credentials from the
    /// AWS_* environment variables: AWS_ENDPOINT, AWS_REGION, AWS_ACCESS_KEY_ID,
    /// AWS_SECRET_ACCESS_KEY, AWS_ALLOW_HTTP=true for plain HTTP), or a directory (or
    /// `file:///dir`) that every node shares. Topics with `remote.storage.enable=true` copy
    /// their sealed segments there and keep `local.retention.ms`/`local.retention.bytes` of
    /// them on local disk. Unset: nothing is copied, and data already copied cannot be read
    /// on this node.
    #[arg(long, env = "LOGDEX_TIERED_STORE")]
    pub tiered_store: Option<String>,
    /// Memory for records that key lookups read and that writes just applied, kept so the
    /// next lookups of their keys skip the segment log (one cache for every partition of the
    /// node), in MiB, at most 1048576 (1 TiB); 0 turns it off.
    #[arg(long, env = "LOGDEX_RECORD_CACHE_MB", default_value_t = 64, value_parser = clap::value_parser!(u64).range(0..=RECORD_CACHE_MB_MAX))]
    pub record_cache_mb: u64,
    /// How long the Raft log's fsync thread waits for more appends before an fsync while the
    /// node is loaded (at least 8 writes waiting, appends of several partitions), in
    /// microseconds, 0 to 100000. Longer: fewer fsyncs and less CPU per write, more latency.
    /// Raise it when writes are CPU-bound (slow disk, busy cores); lower it when they are not.
    #[arg(long, env = "LOGDEX_GROUP_COMMIT_WAIT_US",
          default_value_t = logdex_raft::log_store::GROUP_COMMIT_WAIT_LOADED_DEFAULT.as_micros() as u64,
          value_parser = clap::value_parser!(u64)
              .range(0..=logdex_raft::log_store::GROUP_COMMIT_WAIT_LOADED_MAX.as_micros() as u64))]
    pub group_commit_wait_us: u64,
    /// How often each node hands the leadership of the partitions it leads back to their
    /// preferred replica (the first of the assignment) when that replica is up and caught up,
    /// in seconds, 0 to 86400; 0 turns it off. Leaderships move off a node that restarts or is
    /// cut off, and come back this way (as Kafka's auto.leader.rebalance.enable). A node asks
    /// for at most 32 in a pass; while it has more to ask for, the next pass follows in 2 s.
    #[arg(long, env = "LOGDEX_LEADER_BALANCE_INTERVAL_SECS", default_value_t = 60,
          value_parser = clap::value_parser!(u64).range(0..=86_400))]
    pub leader_balance_interval_secs: u64,
    /// Snapshot a group after this many applied entries; its Raft log is purged behind the snapshot.
    #[arg(long, env = "LOGDEX_SNAPSHOT_EVERY", default_value_t = logdex_raft::node::SNAPSHOT_EVERY_ENTRIES)]
    pub snapshot_every: u64,
    /// Threads running the node's request handling, Raft and apply work, 0 to 256. 0: one
    /// less than the machine's cores, at least 1 (the fsync thread and the storage engine's
    /// flush and compaction threads run beside them).
    #[arg(long, env = "LOGDEX_WORKER_THREADS", default_value_t = 0,
          value_parser = clap::value_parser!(u16).range(0..=256))]
    pub worker_threads: u16,
    /// Log filter (tracing EnvFilter syntax), e.g. `info` or `logdex_raft=debug`. The default
    /// keeps openraft's errors but not those of its request path (`raft_inner`,
    /// `stream_append`) and heartbeat workers, which only repeat that a replica's Raft core has
    /// stopped, as it does when a topic is deleted, a replica moves away or the node shuts down
    /// (openraft logs a core that stops on an error itself, under `openraft::core`).
    #[arg(
        long,
        env = "LOGDEX_LOG",
        default_value = "info,openraft=error,openraft::raft::raft_inner=off,openraft::raft::stream_append=off,openraft::core::heartbeat::worker=off",
        value_parser = log_filter
    )]
    pub log: String,
    /// Stop (cleanly) when the process that started this node exits, even by `kill -9`
    /// (`logdex dev` sets it for its nodes).
    #[arg(long, env = "LOGDEX_EXIT_WITH_PARENT")]
    pub exit_with_parent: bool,
    /// With --exit-with-parent: the PID of the process that starts this node. The node stops
    /// as soon as its parent is another process, also when that one exited before the node
    /// began to run [default: the node's parent when it starts].
    #[arg(long, env = "LOGDEX_PARENT_PID", requires = "exit_with_parent")]
    pub parent_pid: Option<u32>,
}

/// Resolves once this process's parent is not `parent` (it exited and this process was
/// re-parented), looking at once and then twice a second.
async fn parent_gone(parent: u32) {
    #[cfg(unix)]
    while std::os::unix::process::parent_id() == parent {
        tokio::time::sleep(std::time::Duration::from_millis(500)).await;
    }
    #[cfg(not(unix))]
    {
        let _ = parent;
        std::future::pending::<()>().await
    }
}

/// The parent process `--exit-with-parent` follows: `--parent-pid`, else the parent now.
fn followed_parent(args: &ServeArgs) -> Option<u32> {
    #[cfg(unix)]
    let current = std::os::unix::process::parent_id();
    #[cfg(not(unix))]
    let current = 0;
    args.exit_with_parent.then(|| args.parent_pid.unwrap_or(current))
}

/// `--log`: a filter tracing accepts, or the reason it does not.
fn log_filter(filter: &str) -> Result<String, String> {
    tracing_subscriber::EnvFilter::try_new(filter).map(|_| filter.to_string()).map_err(|e| e.to_string())
}

/// The runtime's worker threads for `--worker-threads requested` on a machine of `cores`.
pub fn worker_threads(requested: usize, cores: usize) -> usize {
    if requested > 0 { requested } else { cores.saturating_sub(1).max(1) }
}

/// Whether the node's runtime runs its tasks in the order they were woken: built with
/// tokio's unstable options (`.cargo/config.toml`), it turns off the LIFO slot.
pub const LIFO_SLOT_OFF: bool = cfg!(tokio_unstable);

/// The node's runtime without tokio's LIFO slot, which runs a task woken by the running one
/// next, ahead of everything already waiting. Under load that hands each write to its
/// partition's batcher and Raft core as soon as its request is parsed, so the Raft log's
/// syncer finds one group's append at a time and fsyncs more often; in wake-up order the
/// requests parsed in one poll of the sockets are all queued first (ARCHITECTURE.md, "Worker
/// threads").
pub fn tune_runtime(builder: &mut tokio::runtime::Builder) {
    #[cfg(tokio_unstable)]
    builder.disable_lifo_slot();
    #[cfg(not(tokio_unstable))]
    let _ = builder;
}

fn parse_peers(spec: &str) -> Result<Vec<(u64, String)>, String> {
    let peers: Vec<(u64, String)> = spec
        .split(',')
        .filter(|s| !s.trim().is_empty())
        .map(|item| {
            let (id, addr) =
                item.trim().split_once('@').ok_or_else(|| format!("peer {item:?} is not of the form id@host:port"))?;
            let id: u64 = id.parse().map_err(|_| format!("peer id {id:?} is not a number"))?;
            check_address(addr).map_err(|e| format!("peer {id}: {e}"))?;
            Ok((id, addr.to_string()))
        })
        .collect::<Result<_, String>>()?;
    for (i, (id, _)) in peers.iter().enumerate() {
        if peers[..i].iter().any(|(other, _)| other == id) {
            return Err(format!("peer id {id} appears twice in --peers"));
        }
    }
    Ok(peers)
}

/// Refuses a `--peers` list that names this node at an address other than its own RPC
/// address: the other nodes would dial that one, so the cluster would never form (and a
/// restarted node would be named at an address nothing listens on). Addresses differ when
/// their ports do, or when both hosts are IP addresses and differ; a host name is taken as
/// it is (it may resolve to the node), and so is a wildcard listen address.
fn check_own_peer_entry(node_id: u64, peers: &[(u64, String)], rpc_addr: &str) -> Result<(), String> {
    let Some((_, listed)) = peers.iter().find(|(id, _)| *id == node_id) else { return Ok(()) };
    let same = match (listed.parse::<SocketAddr>(), rpc_addr.parse::<SocketAddr>()) {
        (Ok(listed), Ok(own)) => listed.port() == own.port() && (own.ip().is_unspecified() || listed.ip() == own.ip()),
        _ => listed.rsplit_once(':').map(|(_, port)| port) == rpc_addr.rsplit_once(':').map(|(_, port)| port),
    };
    if same {
        return Ok(());
    }
    Err(format!(
        "--peers names this node ({node_id}) at {listed}, but its RPC address is {rpc_addr}: the other nodes \
         dial the address in --peers, so give this node --rpc-addr {listed} (or --advertise-rpc-addr {listed} \
         when it listens on another address), or correct --peers"
    ))
}

/// `addr` if it is `host:port` (a name, an IPv4 address or a bracketed IPv6 one).
fn parse_address(addr: &str) -> Result<String, String> {
    check_address(addr).map(|()| addr.to_string())
}

/// A listen address: `IP:PORT`, or `HOST:PORT` resolved once, at start, to the name's first
/// IPv4 address if it has one (`localhost` then listens on 127.0.0.1, which clients that try
/// ::1 first fall back to), else its first address.
fn parse_listen_address(addr: &str) -> Result<SocketAddr, String> {
    if let Ok(ip) = addr.parse() {
        return Ok(ip);
    }
    check_address(addr)?;
    let resolved: Vec<SocketAddr> = std::net::ToSocketAddrs::to_socket_addrs(addr)
        .map_err(|e| format!("cannot resolve listen address {addr:?}: {e}"))?
        .collect();
    resolved
        .iter()
        .find(|a| a.is_ipv4())
        .or(resolved.first())
        .copied()
        .ok_or_else(|| format!("listen address {addr:?} resolves to no address"))
}

/// Checks that `addr` is `host:port` (a name, an IPv4 address or a bracketed IPv6 one).
fn check_address(addr: &str) -> Result<(), String> {
    let (host, port) = addr.rsplit_once(':').ok_or_else(|| format!("address {addr:?} lacks a port (host:port)"))?;
    if host.is_empty() || host.contains(['/', '@']) || host.contains(char::is_whitespace) {
        return Err(format!("address {addr:?} is not host:port"));
    }
    port.parse::<u16>().map_err(|_| format!("address {addr:?} has no valid port (host:port)"))?;
    Ok(())
}

impl ServeArgs {
    /// The node configuration, given the addresses the listeners actually bound.
    /// The node's TLS, when --tls-cert-file (and its companions) are given.
    fn tls(&self) -> Result<Option<NodeTls>, String> {
        match (&self.tls_cert_file, &self.tls_key_file, &self.tls_ca_file) {
            (None, None, None) => Ok(None),
            (Some(cert), Some(key), Some(ca)) => NodeTls::load(cert, key, ca).map(Some).map_err(|e| e.to_string()),
            _ => Err("--tls-cert-file, --tls-key-file and --tls-ca-file go together".to_string()),
        }
    }

    fn node_config(
        &self,
        http_bound: SocketAddr,
        rpc_bound: SocketAddr,
        tls: Option<&NodeTls>,
    ) -> Result<NodeConfig, String> {
        let rpc_addr = self.advertise_rpc_addr.clone().unwrap_or_else(|| rpc_bound.to_string());
        let http_addr = self.advertise_http_addr.clone().unwrap_or_else(|| http_bound.to_string());
        if let Some(tls) = tls {
            tls.check_valid_for(&[&rpc_addr, &http_addr]).map_err(|e| e.to_string())?;
        }
        if let Some(join) = &self.join {
            check_address(join).map_err(|e| format!("--join: {e}"))?;
            for (own, what) in [(&rpc_addr, "RPC"), (&http_addr, "HTTP")] {
                if join == own {
                    return Err(format!(
                        "--join {join} names this node's own {what} address: give the RPC address (--rpc-addr) of a \
                         member of the running cluster"
                    ));
                }
            }
        }
        let peers = match &self.peers {
            Some(spec) => parse_peers(spec)?,
            None if self.join.is_none() => vec![(self.node_id, rpc_addr.clone())],
            None => Vec::new(),
        };
        check_own_peer_entry(self.node_id, &peers, &rpc_addr)?;
        let config = NodeConfig {
            node_id: self.node_id,
            data_dir: self.data_dir.clone(),
            rpc_addr,
            http_addr,
            peers,
            join: self.join.clone(),
            heartbeat_ms: self.heartbeat_ms,
            election_timeout_min_ms: self.election_timeout_ms,
            election_timeout_max_ms: self.election_timeout_ms.saturating_mul(2),
            snapshot_every_entries: self.snapshot_every,
            log: LogConfig::default(),
            index: IndexConfig::default(),
            cleaner_interval_ms: self.cleaner_interval_ms,
            tiered_store: self.tiered_store.clone(),
            record_cache_bytes: self.record_cache_mb.saturating_mul(1024 * 1024),
            group_commit_wait: std::time::Duration::from_micros(self.group_commit_wait_us),
            leader_balance_interval: std::time::Duration::from_secs(self.leader_balance_interval_secs),
            controller_voters: usize::from(self.controller_voters),
            // Outgoing node-to-node connections leave from the RPC listen IP
            // when a node listens on its own loopback address (127.0.0.2, ...),
            // so per-link fault proxies can tell callers apart. Not for
            // 127.0.0.1 or a wildcard: binding before connecting reserves an
            // ephemeral port, which can collide with a port another node will
            // listen on.
            rpc_source_ip: Some(rpc_bound.ip())
                .filter(|ip| ip.is_loopback() && *ip != std::net::IpAddr::from([127, 0, 0, 1])),
            rpc_tls_ca_pem: tls.map(|t| t.ca_pem().to_vec()),
            rpc_token: match &self.rpc_token_file {
                Some(path) => Some(read_token(path)?),
                None => None,
            },
        };
        config.validate().map_err(|e| e.to_string())?;
        Ok(config)
    }
}

/// Reads a token file: the first line, trimmed, must be non-empty.
fn read_token(path: &std::path::Path) -> Result<String, String> {
    let t = std::fs::read_to_string(path).map_err(|e| format!("cannot read {}: {e}", path.display()))?;
    let t = t.trim().to_string();
    if t.is_empty() {
        return Err(format!("{} holds no token", path.display()));
    }
    Ok(t)
}

pub fn init_tracing(filter: &str) {
    use std::io::IsTerminal;
    let filter =
        tracing_subscriber::EnvFilter::try_new(filter).unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::stderr().is_terminal())
        .with_writer(std::io::stderr)
        .try_init();
}

/// A node serving HTTP and RPC until [`RunningNode::shutdown`].
pub struct RunningNode {
    pub node: Node,
    /// The HTTP address the node listens on.
    pub http_addr: SocketAddr,
    /// The RPC address the node listens on (node-to-node and client gRPC).
    pub rpc_addr: SocketAddr,
    stop: tokio::sync::watch::Sender<bool>,
    http_task: tokio::task::JoinHandle<std::io::Result<()>>,
    rpc_task: tokio::task::JoinHandle<Result<(), tonic::transport::Error>>,
}

impl RunningNode {
    /// Hands this node's leaderships over (bounded), stops serving, shuts every group down
    /// and makes applied state durable.
    pub async fn shutdown(self) {
        self.node.begin_stop().await;
        let _ = self.stop.send(true);
        let _ = tokio::time::timeout(Duration::from_secs(5), self.http_task).await;
        self.node.shutdown().await;
        let _ = tokio::time::timeout(Duration::from_secs(2), self.rpc_task).await;
    }
}

/// Binds the listeners, opens the node and starts serving.
pub async fn start(args: ServeArgs) -> Result<RunningNode, String> {
    let tls = args.tls()?;
    let rpc_listener = tokio::net::TcpListener::bind(args.rpc_addr)
        .await
        .map_err(|e| format!("cannot listen on rpc address {}: {e}", args.rpc_addr))?;
    let http_listener = tokio::net::TcpListener::bind(args.http_addr)
        .await
        .map_err(|e| format!("cannot listen on http address {}: {e}", args.http_addr))?;
    let rpc_addr = rpc_listener.local_addr().map_err(|e| e.to_string())?;
    let http_addr = http_listener.local_addr().map_err(|e| e.to_string())?;
    let config = args.node_config(http_addr, rpc_addr, tls.as_ref())?;
    let node = Node::open(config).await.map_err(|e| format!("cannot open node: {e}"))?;
    let (stop, stop_rx) = tokio::sync::watch::channel(false);

    let token = match &args.auth_token_file {
        Some(path) => Some(read_token(path)?),
        None => None,
    };
    let limits = Limits::default();
    let guard = crate::middleware::Guard::new(token, args.requests_in_flight_max as usize, args.lookup_rate_limit)
        .with_body_limit(limits.body_bytes_max);
    let router = Router::new(node.clone(), tls.as_ref()).map_err(|e| e.to_string())?;
    let state = AppState::new(router, args.forward, limits, guard);
    let app = crate::http::app(state.clone());
    let rpc = logdex_raft::service::server(node.clone());
    let client_api = crate::grpc::server(app.clone(), state);
    let mut rpc_stop = stop_rx.clone();
    let mut rpc_server = tonic::transport::Server::builder().tcp_nodelay(true);
    if let Some(tls) = &tls {
        rpc_server = rpc_server.tls_config(tls.rpc_server()).map_err(|e| format!("rpc listener's TLS: {e}"))?;
    }
    let tls_on = tls.is_some();
    let rpc_task = tokio::spawn(async move {
        rpc_server
            .add_service(rpc)
            .add_service(client_api)
            .serve_with_incoming_shutdown(rpc_incoming(rpc_listener, tls_on), async move {
                let _ = rpc_stop.changed().await;
            })
            .await
    });
    node.run().await.map_err(|e| format!("cannot start node: {e}"))?;

    let mut http_stop = stop_rx.clone();
    let stopped = async move {
        let _ = http_stop.changed().await;
    };
    let service = app.into_make_service_with_connect_info::<ClientAddr>();
    let http_task = match &tls {
        Some(tls) => {
            let listener = IdleListener::new(tls.listener(http_listener), HTTP_IDLE_TIMEOUT);
            tokio::spawn(async move { axum::serve(listener, service).with_graceful_shutdown(stopped).await })
        }
        None => {
            let listener = IdleListener::new(http_listener, HTTP_IDLE_TIMEOUT);
            tokio::spawn(async move { axum::serve(listener, service).with_graceful_shutdown(stopped).await })
        }
    };
    let workers = tokio::runtime::Handle::current().metrics().num_workers();
    let tls = tls.is_some();
    tracing::info!(node_id = args.node_id, http = %http_addr, rpc = %rpc_addr, workers, lifo_slot_off = LIFO_SLOT_OFF, tls, "logdex node serving");
    Ok(RunningNode { node, http_addr, rpc_addr, stop, http_task, rpc_task })
}

/// `logdex serve`: runs until Ctrl-C or SIGTERM, then shuts down cleanly.
pub async fn serve(args: ServeArgs) -> Result<(), String> {
    // Read first: a parent that exits while the node starts must still be noticed.
    let followed_parent = followed_parent(&args);
    init_tracing(&args.log);
    raise_open_files_limit();
    // Test builds only: arm the crash points named in FAILPOINTS (see crash_points.rs).
    #[cfg(feature = "failpoints")]
    crate::crash_points::arm();
    // Listening from here on: Ctrl-C or SIGTERM while the node starts stops it too.
    let stop = shutdown_signal();
    tokio::pin!(stop);
    let running = tokio::select! {
        running = start(args) => running?,
        () = &mut stop => {
            tracing::info!("stopped while starting");
            return Ok(());
        }
    };
    let node = running.node.clone();
    let parent = async {
        match followed_parent {
            Some(pid) => {
                parent_gone(pid).await;
                tracing::warn!(parent = pid, "the process that started this node is gone; stopping");
            }
            None => std::future::pending::<()>().await,
        }
    };
    let refused = tokio::select! {
        () = stop => None,
        () = parent => None,
        reason = node.fatal() => Some(reason),
    };
    tracing::info!("shutting down");
    running.shutdown().await;
    refused.map_or(Ok(()), Err)
}

/// Open files a node wants at least; fewer draws a warning.
const OPEN_FILES_WANTED: u64 = 65_536;

/// Raises the soft limit of open files to the hard one: every segment of every replica holds
/// its file open (as Kafka's do), and a node that runs out cannot roll a segment, write a
/// snapshot or accept a connection. The limit in force is logged; one below
/// [`OPEN_FILES_WANTED`] with a warning.
fn raise_open_files_limit() {
    // Linux refuses a soft limit above `fs.nr_open` (2^20 by default) even under an unlimited
    // hard one.
    const NR_OPEN_DEFAULT: u64 = 1 << 20;
    let raised = rlimit::Resource::NOFILE.get().and_then(|(soft, hard)| {
        let target = hard.min(NR_OPEN_DEFAULT).max(soft);
        if target > soft {
            rlimit::Resource::NOFILE.set(target, hard)?;
        }
        Ok(target)
    });
    match raised {
        Ok(limit) if limit < OPEN_FILES_WANTED => tracing::warn!(
            limit,
            "open files limit is low: every segment holds its file open; raise the hard limit (ulimit -Hn) \
             for many partitions or small segment.bytes"
        ),
        Ok(limit) => tracing::info!(limit, "open files limit"),
        Err(e) => tracing::warn!(error = %e, "cannot raise the open files limit"),
    }
}

/// How long an RPC connection's first byte is waited for before the connection goes to the
/// server unread (a client sends its opening at once).
const RPC_OPENING_WAIT: Duration = Duration::from_secs(5);
/// Least time between two warnings of RPC connections opened in the wrong protocol.
const RPC_OPENING_WARN_EVERY: Duration = Duration::from_secs(10);

/// The RPC listener's connections, each handed to the server once its first byte arrived (or
/// after [`RPC_OPENING_WAIT`]), so that a peer speaking TLS to a plain node, or plain HTTP/2
/// to a TLS node, is logged with what to change: otherwise only the peer sees a transport
/// error, and a node restarted without (or with) the cluster's TLS flags is silently cut off.
/// Connections are checked in tasks of their own: a silent client holds up no other. The
/// accept loop ends with the server.
fn rpc_incoming(
    listener: tokio::net::TcpListener,
    tls: bool,
) -> impl futures::Stream<Item = std::io::Result<tokio::net::TcpStream>> {
    let (ready, accepted) = tokio::sync::mpsc::channel(64);
    let warned_at: std::sync::Arc<std::sync::Mutex<Option<std::time::Instant>>> = Default::default();
    tokio::spawn(async move {
        loop {
            let (stream, peer) = tokio::select! {
                () = ready.closed() => return,
                accepted = listener.accept() => match accepted {
                    Ok(accepted) => accepted,
                    Err(e) => {
                        if ready.send(Err(e)).await.is_err() {
                            return;
                        }
                        continue;
                    }
                },
            };
            let _ = stream.set_nodelay(true);
            let (ready, warned_at) = (ready.clone(), warned_at.clone());
            tokio::spawn(async move {
                let mut first = [0u8; 1];
                if let Ok(Ok(1)) = tokio::time::timeout(RPC_OPENING_WAIT, stream.peek(&mut first)).await
                    && let Some(hint) = wrong_rpc_opening(first[0], tls)
                {
                    let mut warned_at = warned_at.lock().unwrap_or_else(|p| p.into_inner());
                    if warned_at.is_none_or(|at| at.elapsed() >= RPC_OPENING_WARN_EVERY) {
                        *warned_at = Some(std::time::Instant::now());
                        tracing::warn!(%peer, "{hint}");
                    }
                }
                let _ = ready.send(Ok(stream)).await;
            });
        }
    });
    futures::stream::unfold(accepted, |mut accepted| async move { accepted.recv().await.map(|item| (item, accepted)) })
}

/// What to tell of an RPC connection whose first byte is `first`, on a node that serves TLS
/// (`tls`) or not; None when it opens as expected (or unrecognizably).
fn wrong_rpc_opening(first: u8, tls: bool) -> Option<&'static str> {
    /// The first byte of a TLS connection (a handshake record), and of the HTTP/2 preface.
    const TLS_HANDSHAKE: u8 = 0x16;
    const HTTP2_PREFACE: u8 = b'P';
    match (tls, first) {
        (false, TLS_HANDSHAKE) => Some(
            "a peer opened a TLS connection to this node's plain RPC port: the cluster uses TLS; start this node \
             with --tls-cert-file, --tls-key-file and --tls-ca-file as its peers",
        ),
        (true, HTTP2_PREFACE) => Some(
            "a peer spoke plain HTTP/2 to this node's TLS RPC port: start that node with --tls-cert-file, \
             --tls-key-file and --tls-ca-file as this one",
        ),
        _ => None,
    }
}

/// Resolves on Ctrl-C (SIGINT) or SIGTERM. The handlers are installed when this is called,
/// so a signal that comes before the future is first awaited still counts.
pub fn shutdown_signal() -> impl std::future::Future<Output = ()> {
    #[cfg(unix)]
    {
        use tokio::signal::unix::SignalKind;
        use tokio::signal::unix::signal;
        let interrupt = signal(SignalKind::interrupt());
        let terminate = signal(SignalKind::terminate());
        async move {
            match (interrupt, terminate) {
                (Ok(mut interrupt), Ok(mut terminate)) => {
                    tokio::select! {
                        _ = interrupt.recv() => {}
                        _ = terminate.recv() => {}
                    }
                }
                // No signal handling (never on Linux): Ctrl-C as tokio offers it.
                _ => {
                    let _ = tokio::signal::ctrl_c().await;
                }
            }
        }
    }
    #[cfg(not(unix))]
    async {
        let _ = tokio::signal::ctrl_c().await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The node configuration of `logdex serve --node-id 6 --join <join>` bound at
    /// 127.0.0.1:8086 (HTTP) and 127.0.0.1:9096 (RPC).
    fn joining_config(join: &str) -> Result<NodeConfig, String> {
        use clap::Parser as _;
        let args = ["logdex", "serve", "--node-id", "6", "--data-dir", "/nonexistent", "--join", join];
        let cli = crate::cli::Cli::try_parse_from(args).map_err(|e| e.to_string())?;
        let Some(crate::cli::Command::Serve(serve)) = cli.command else { return Err("not serve".into()) };
        let (http, rpc) = (SocketAddr::from(([127, 0, 0, 1], 8086)), SocketAddr::from(([127, 0, 0, 1], 9096)));
        serve.node_config(http, rpc, None)
    }

    #[test]
    fn join_naming_this_nodes_own_address_is_refused() {
        let own_rpc = joining_config("127.0.0.1:9096").err().unwrap_or_default();
        assert!(own_rpc.contains("names this node's own RPC address"), "{own_rpc}");
        let own_http = joining_config("127.0.0.1:8086").err().unwrap_or_default();
        assert!(own_http.contains("names this node's own HTTP address"), "{own_http}");
        assert!(joining_config("127.0.0.1:9091").is_ok(), "a member's address");
    }

    #[test]
    fn peers_that_name_this_node_at_another_address_are_refused() {
        let peers = parse_peers("1@127.0.0.1:9091,2@127.0.0.1:9092").unwrap_or_default();
        assert!(check_own_peer_entry(1, &peers, "127.0.0.1:9091").is_ok());
        let refused = check_own_peer_entry(1, &peers, "127.0.0.1:9093").err().unwrap_or_default();
        assert!(refused.contains("at 127.0.0.1:9091, but its RPC address is 127.0.0.1:9093"), "{refused}");
        assert!(check_own_peer_entry(1, &peers, "127.0.0.2:9091").is_err(), "another IP");
        assert!(check_own_peer_entry(1, &peers, "0.0.0.0:9091").is_ok(), "a wildcard listen address");
        let named = parse_peers("1@node-1.example:9091").unwrap_or_default();
        assert!(check_own_peer_entry(1, &named, "10.0.0.1:9091").is_ok(), "a name may resolve to the node");
        assert!(check_own_peer_entry(1, &named, "10.0.0.1:9099").is_err(), "another port");
        assert!(check_own_peer_entry(3, &peers, "127.0.0.1:7000").is_ok(), "not listed: the node checks that");
        let v6 = parse_peers("1@[::1]:9091").unwrap_or_default();
        assert!(check_own_peer_entry(1, &v6, "[::1]:9091").is_ok());
    }

    #[test]
    fn peers_parse_id_at_address_lists() -> Result<(), String> {
        let peers = parse_peers("1@127.0.0.1:9091, 2@127.0.0.1:9092")?;
        assert_eq!(peers, vec![(1, "127.0.0.1:9091".to_string()), (2, "127.0.0.1:9092".to_string())]);
        assert!(parse_peers("1-127.0.0.1:9091").is_err());
        assert!(parse_peers("x@127.0.0.1:9091").is_err());
        assert!(parse_peers("1@localhost").is_err());
        assert!(parse_peers("1@127.0.0.1:9091,1@127.0.0.1:9092").is_err(), "an id twice");
        assert!(parse_peers("1@127.0.0.1:port").is_err());
        assert!(parse_peers("1@[::1]:9091").is_ok());
        assert!(check_address("garbage").is_err());
        assert!(check_address("http://127.0.0.1:9091").is_err());
        assert!(check_address("127.0.0.1:9091").is_ok());
        Ok(())
    }

    #[test]
    fn the_open_files_limit_is_raised_to_the_hard_limit() {
        raise_open_files_limit();
        let (soft, hard) = rlimit::Resource::NOFILE.get().unwrap_or_default();
        assert!(soft >= hard.min(1 << 20), "soft {soft}, hard {hard}");
    }

    #[test]
    fn a_record_cache_above_a_tebibyte_is_refused() {
        use clap::Parser;
        let parse =
            |mb: &str| crate::cli::Cli::try_parse_from(["logdex", "serve", "--record-cache-mb", mb]).map(|_| ());
        assert!(parse("0").is_ok());
        assert!(parse("1048576").is_ok());
        let refused = parse("999999999").err().map(|e| e.to_string()).unwrap_or_default();
        assert!(refused.contains("--record-cache-mb") && refused.contains("1048576"), "{refused}");
    }

    #[test]
    fn advertised_addresses_must_be_host_and_port() {
        use clap::Parser;
        let parse = |args: &[&str]| crate::cli::Cli::try_parse_from([&["logdex", "serve"], args].concat()).map(|_| ());
        assert!(parse(&["--advertise-http-addr", "node-1.example:8080"]).is_ok());
        assert!(parse(&["--advertise-rpc-addr", "[::1]:9090"]).is_ok());
        for bad in ["foo", "foo bar:1", "http://node-1:8080", "node-1:port"] {
            let refused = parse(&["--advertise-http-addr", bad]).err().map(|e| e.to_string()).unwrap_or_default();
            assert!(refused.contains("--advertise-http-addr"), "{bad}: {refused}");
        }
    }

    #[test]
    fn worker_threads_default_leaves_a_core_for_fsync_and_storage_threads() {
        assert_eq!(worker_threads(0, 1), 1);
        assert_eq!(worker_threads(0, 2), 1);
        assert_eq!(worker_threads(0, 16), 15);
        assert_eq!(worker_threads(3, 2), 3, "an explicit count is taken as given");
    }

    #[test]
    fn the_node_runtime_runs_woken_tasks_after_those_already_queued() {
        // .cargo/config.toml passes `--cfg tokio_unstable`; a RUSTFLAGS variable replaces it,
        // and the node's runtime then keeps tokio's LIFO slot (`tune_runtime`).
        let mut builder = tokio::runtime::Builder::new_multi_thread();
        builder.worker_threads(1).enable_all();
        tune_runtime(&mut builder);
        let runtime = builder.build().expect("runtime");
        // On the worker: W waits; Q is queued; then the running task wakes W. With the LIFO
        // slot W would run next, ahead of Q.
        let order = runtime.block_on(async {
            tokio::spawn(async {
                let order = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
                let (tx, rx) = tokio::sync::oneshot::channel::<()>();
                let w = {
                    let order = order.clone();
                    tokio::spawn(async move {
                        let _ = rx.await;
                        order.lock().expect("lock").push("woken");
                    })
                };
                tokio::task::yield_now().await;
                let q = {
                    let order = order.clone();
                    tokio::spawn(async move { order.lock().expect("lock").push("queued") })
                };
                let _ = tx.send(());
                let _ = (w.await, q.await);
                order.lock().expect("lock").clone()
            })
            .await
            .expect("task")
        });
        assert_eq!(order, ["queued", "woken"], "LIFO slot on (lifo_slot_off={LIFO_SLOT_OFF}): was RUSTFLAGS set?");
    }
}
