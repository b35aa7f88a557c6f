//! A cluster of real `logdex serve` processes on loopback.
//!
//! Nodes are numbered by their node id, 1..=n. Each node's data directory is
//! `<temp dir>/node-<id>/`, and its stdout and stderr go to `<data dir>/node.log` (appended to
//! across restarts, with a marker line per launch). On failure the temp dir is kept and the tail
//! of every log is printed.
//!
//! [`Cluster::start`] runs every node on 127.0.0.1 with direct links. [`Cluster::start_with`]
//! can put every node on its own loopback IP behind the fault [`Proxy`], add spare nodes that
//! join later (`--join`), set Raft timings and snapshot frequency, and turn on the fsync trace
//! that [`Cluster::power_loss`] uses. [`Cluster::set_node_env`] arms crash points (`FAILPOINTS`)
//! for one node's next launches, and [`Cluster::wait_exited`] waits for it to crash.

use std::fs::OpenOptions;
use std::io::Write as _;
use std::net::IpAddr;
use std::net::Ipv4Addr;
use std::net::SocketAddr;
use std::net::TcpListener;
use std::path::Path;
use std::path::PathBuf;
use std::process::Child;
use std::process::Command;
use std::process::Stdio;
use std::sync::Arc;
use std::sync::LazyLock;
use std::time::Duration;
use std::time::Instant;

use tempfile::TempDir;
use tokio::sync::Mutex;
use tokio::sync::OwnedMutexGuard;

use crate::client::Api;
use crate::client::TopicDescription;
use crate::error::Error;
use crate::error::Result;
use crate::power;
use crate::proxy::ProxiedNode;
use crate::proxy::Proxy;
use crate::support::Probe;
use crate::support::poll_until;
use crate::tls::TestPki;
use crate::tls::TlsFiles;

/// How long a node may take from launch to `/readyz` 200.
pub const READY_TIMEOUT: Duration = Duration::from_secs(30);
/// Launch attempts when a reserved port was taken by someone else in the meantime.
const START_ATTEMPTS: u32 = 3;
const READY_POLL_INTERVAL: Duration = Duration::from_millis(100);
/// Log lines printed per node when a test fails.
const FAILURE_LOG_LINES: usize = 60;
/// Characters printed per log line in a failure report; the full log stays on disk.
const LOG_LINE_CHARS_MAX: usize = 400;
/// Set to keep the temp dir (data and logs) even when the test passes.
pub const KEEP_ENV: &str = "LOGDEX_TEST_KEEP";
/// Name of the fsync trace file in a node's data dir (see `raft/src/fsync_trace.rs`).
pub const FSYNC_TRACE_FILE: &str = "fsync.trace";
/// The variable a `failpoints` build of the server reads its crash points from
/// (`name=actions;...`, see `api/src/crash_points.rs`).
pub const FAILPOINTS_ENV: &str = "FAILPOINTS";
/// The signal a `failpoints` build dies of when a crash point fires (`abort`).
pub const SIGABRT: i32 = 6;
/// How often [`Cluster::wait_exited`] looks at a node's process.
const EXIT_POLL_INTERVAL: Duration = Duration::from_millis(50);
/// Node `i` of a proxied cluster listens on `127.0.0.(PROXIED_IP_BASE + i)`.
const PROXIED_IP_BASE: u8 = 10;

/// How to run a cluster; `ClusterOptions::plain(n)` is what [`Cluster::start`] uses.
#[derive(Clone, Debug, Default)]
pub struct ClusterOptions {
    /// Nodes started with the same `--peers` list.
    pub nodes: usize,
    /// Further nodes laid out (ports, proxy, data dir) but started later with `--join`.
    pub spare_nodes: usize,
    /// Every node on its own loopback IP, every node-to-node link through the fault proxy.
    pub proxy: bool,
    pub heartbeat_ms: Option<u64>,
    pub election_timeout_ms: Option<u64>,
    pub snapshot_every: Option<u64>,
    /// Sets `LOGDEX_FSYNC_TRACE` for every node (needed by [`Cluster::power_loss`]).
    pub fsync_trace: bool,
    /// Seed of the proxy's random choices (delay jitter, losses).
    pub seed: u64,
    /// Every node gets `--tiered-store <cluster dir>/tiered` (one object store for all).
    pub tiered_store: bool,
    /// Every node gets `--tiered-store <this>` instead (an `s3://` URL, say).
    pub tiered_store_url: Option<String>,
    /// Environment variables of every node (an S3 store's endpoint and credentials).
    pub node_env: Vec<(String, String)>,
    /// `--cleaner-interval-ms` of every node (retention, compaction, tiered storage).
    pub cleaner_interval_ms: Option<u64>,
    /// Every node serves HTTPS and RPC over TLS with a certificate of a CA made for the
    /// cluster ([`Cluster::pki`]); [`Cluster::url`] is `https://`, and [`Cluster::api`]
    /// trusts that CA alone.
    pub tls: bool,
}

impl ClusterOptions {
    pub fn plain(nodes: usize) -> ClusterOptions {
        ClusterOptions { nodes, ..ClusterOptions::default() }
    }
}

/// One cluster at a time per test binary: tests in a binary run on parallel threads, and
/// several 3-node clusters at once would starve a 2-core machine into election storms.
static SERIAL: LazyLock<Arc<Mutex<()>>> = LazyLock::new(|| Arc::new(Mutex::new(())));

/// The `logdex` binary under test: `LOGDEX_BIN`, else `<workspace>/target/debug/logdex`.
/// A missing binary is an error, never a reason to skip.
pub fn binary_path() -> Result<PathBuf> {
    let path = match std::env::var_os("LOGDEX_BIN") {
        Some(path) => PathBuf::from(path),
        None => Path::new(env!("CARGO_MANIFEST_DIR")).join("..").join("target").join("debug").join("logdex"),
    };
    if path.is_file() { Ok(path) } else { Err(Error::BinaryMissing { path }) }
}

/// Real `logdex` processes; dropping it kills every process it started.
pub struct Cluster {
    binary: PathBuf,
    dir: TempDir,
    peers: String,
    nodes: Vec<NodeProcess>,
    api: Api,
    keep_dir: bool,
    options: ClusterOptions,
    proxy: Option<Proxy>,
    pki: Option<TestPki>,
    /// The PEM files of `pki`, written once before the first launch: every launch reads
    /// them, and rewriting them per launch raced with a node reading them.
    tls_files: Option<TlsFiles>,
    _serial: OwnedMutexGuard<()>,
}

impl NodeProcess {
    fn lock_child(&self) -> std::sync::MutexGuard<'_, Option<Child>> {
        self.child.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

struct NodeProcess {
    id: u64,
    http_addr: SocketAddr,
    rpc_addr: SocketAddr,
    /// What peers dial: the proxy in front of `rpc_addr`, or `rpc_addr` itself.
    advertised_rpc_addr: SocketAddr,
    /// A spare node: starts with `--join` instead of `--peers`.
    joins: bool,
    data_dir: PathBuf,
    log_path: PathBuf,
    /// The running process; behind a lock so liveness checks work through `&Cluster`.
    child: std::sync::Mutex<Option<Child>>,
    /// Stopped with SIGSTOP and not yet continued.
    paused: std::sync::atomic::AtomicBool,
    launches: u32,
    /// Environment variables of the node's next launches (e.g. `FAILPOINTS`).
    env: Vec<(String, String)>,
}

impl Cluster {
    /// Starts `n` nodes with the same `--peers` list and waits until every `/readyz` answers 200.
    pub async fn start(n: usize) -> Result<Cluster> {
        Cluster::start_with(ClusterOptions::plain(n)).await
    }

    /// Starts `options.nodes` nodes (spare nodes stay stopped until [`Cluster::start_spare`])
    /// and waits until every started node's `/readyz` answers 200.
    pub async fn start_with(options: ClusterOptions) -> Result<Cluster> {
        let n = options.nodes;
        assert!(n >= 1, "a cluster has at least one node");
        let serial = SERIAL.clone().lock_owned().await;
        let binary = binary_path()?;
        let (dir, nodes, peers, proxy) = layout(&options)?;
        let pki = if options.tls { Some(TestPki::generate("logdex cluster test CA")?) } else { None };
        let api = match &pki {
            Some(pki) => Api::with_ca(&pki.ca_pem)?,
            None => Api::new()?,
        };
        let tls_files = write_tls_files(pki.as_ref(), &dir)?;
        let mut cluster = Cluster {
            binary,
            dir,
            peers,
            nodes,
            api,
            keep_dir: false,
            options,
            proxy,
            pki,
            tls_files,
            _serial: serial,
        };
        let started = Instant::now();
        for attempt in 1..=START_ATTEMPTS {
            let initial: Vec<u64> = cluster.nodes.iter().filter(|n| !n.joins).map(|n| n.id).collect();
            let outcome = match cluster.launch_all() {
                Ok(()) => cluster.wait_ready(&initial, READY_TIMEOUT).await,
                Err(e) => Err(e),
            };
            match outcome {
                Ok(()) => {
                    eprintln!(
                        "cluster of {n} ready in {} ms, data and logs in {}",
                        started.elapsed().as_millis(),
                        cluster.dir.path().display()
                    );
                    return Ok(cluster);
                }
                Err(e) if attempt < START_ATTEMPTS && cluster.any_log_says_address_in_use() => {
                    eprintln!("attempt {attempt}: a port was taken ({e}); retrying with fresh ports");
                    cluster.kill_all_quietly();
                    let (dir, nodes, peers, proxy) = layout(&cluster.options)?;
                    // The certificate files lived in the old directory, which goes with it.
                    cluster.tls_files = write_tls_files(cluster.pki.as_ref(), &dir)?;
                    (cluster.dir, cluster.nodes, cluster.peers, cluster.proxy) = (dir, nodes, peers, proxy);
                }
                Err(e) => {
                    cluster.report_failure(&e.to_string());
                    return Err(e);
                }
            }
        }
        Err(Error::Check(format!("could not start a cluster of {n} in {START_ATTEMPTS} attempts")))
    }

    /// Node ids, 1..=n (spare nodes excluded until they were started once).
    pub fn node_ids(&self) -> Vec<u64> {
        self.nodes.iter().filter(|n| !n.joins || n.launches > 0).map(|n| n.id).collect()
    }

    /// Every node id laid out, spare nodes included.
    pub fn all_node_ids(&self) -> Vec<u64> {
        self.nodes.iter().map(|n| n.id).collect()
    }

    /// The fault proxy, when the cluster was started with `proxy: true`.
    pub fn proxy(&self) -> Option<&Proxy> {
        self.proxy.as_ref()
    }

    pub fn options(&self) -> &ClusterOptions {
        &self.options
    }

    /// The temp dir holding every node's data dir and log (kept when a test fails).
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// Keeps the temp dir when the cluster is dropped, as after a failure.
    pub fn keep(&mut self) {
        self.keep_dir = true;
    }

    /// How many times node `id` was launched (a restart starts a new session on it).
    pub fn launches(&self, id: u64) -> u32 {
        self.node(id).launches
    }

    /// The process id of node `id`, when running.
    pub fn pid(&self, id: u64) -> Option<u32> {
        self.node(id).lock_child().as_ref().map(Child::id)
    }

    /// Sets environment variable `key` for node `id`'s next launches (until cleared), e.g.
    /// [`FAILPOINTS_ENV`] to arm crash points. A running node is unaffected until restarted.
    pub fn set_node_env(&mut self, id: u64, key: &str, value: &str) {
        let env = &mut self.node_mut(id).env;
        env.retain(|(k, _)| k != key);
        env.push((key.to_string(), value.to_string()));
    }

    /// Removes every variable set by [`Cluster::set_node_env`] for node `id`'s next launches.
    pub fn clear_node_env(&mut self, id: u64) {
        self.node_mut(id).env.clear();
    }

    /// Waits until node `id`'s process exits by itself (a crash: nothing here signals it),
    /// reaps it and returns its exit status; a timeout while it still runs is an error. The
    /// node counts as stopped afterwards: [`Cluster::restart`] starts it again.
    pub async fn wait_exited(&mut self, id: u64, timeout: Duration) -> Result<std::process::ExitStatus> {
        let started = Instant::now();
        let attempts_max = timeout.as_millis() / EXIT_POLL_INTERVAL.as_millis() + 2;
        for _ in 0..attempts_max {
            let exited = {
                let node = self.node(id);
                let mut guard = node.lock_child();
                let Some(child) = guard.as_mut() else {
                    return Err(Error::Check(format!("node {id} is not running (killed by the test)")));
                };
                match child.try_wait() {
                    Ok(None) => None,
                    Ok(Some(status)) => {
                        *guard = None;
                        node.paused.store(false, std::sync::atomic::Ordering::SeqCst);
                        Some(status)
                    }
                    Err(e) => return Err(Error::io(format!("checking node {id}"), e)),
                }
            };
            if let Some(status) = exited {
                eprintln!("node {id} exited by itself after {} ms: {status}", started.elapsed().as_millis());
                return Ok(status);
            }
            if started.elapsed() >= timeout {
                break;
            }
            tokio::time::sleep(EXIT_POLL_INTERVAL).await;
        }
        Err(Error::Timeout {
            what: format!("node {id} to exit by itself"),
            waited_ms: started.elapsed().as_millis(),
            last: format!("still running; its log ends with:\n{}", self.log_tail(id, 10)),
        })
    }

    /// What node `id` logged since its last launch (the log is appended across launches).
    pub fn launch_log(&self, id: u64) -> Result<String> {
        let node = self.node(id);
        let bytes =
            std::fs::read(&node.log_path).map_err(|e| Error::io(format!("reading {}", node.log_path.display()), e))?;
        let text = String::from_utf8_lossy(&bytes);
        let marker = format!("===== harness: launch #{} of node {id} =====", node.launches);
        Ok(text.rfind(&marker).map_or(&text[..], |at| &text[at..]).to_string())
    }

    /// Stops node `id` cleanly with SIGTERM and waits (up to `timeout`) for it to exit;
    /// returns its exit status.
    pub async fn terminate(&mut self, id: u64, timeout: Duration) -> Result<std::process::ExitStatus> {
        self.check_alive(id)?;
        self.signal(id, "-TERM")?;
        eprintln!("node {id} asked to stop (SIGTERM)");
        self.wait_exited(id, timeout).await
    }

    /// Stops node `id` with SIGSTOP (a process pause: no crash, no lost state).
    pub fn pause(&self, id: u64) -> Result<()> {
        self.check_alive(id)?;
        self.signal(id, "-STOP")?;
        self.node(id).paused.store(true, std::sync::atomic::Ordering::SeqCst);
        eprintln!("node {id} paused (SIGSTOP)");
        Ok(())
    }

    /// Continues node `id` after [`Cluster::pause`] (SIGCONT).
    pub fn resume(&self, id: u64) -> Result<()> {
        self.signal(id, "-CONT")?;
        self.node(id).paused.store(false, std::sync::atomic::Ordering::SeqCst);
        eprintln!("node {id} resumed (SIGCONT)");
        Ok(())
    }

    /// Continues every paused node.
    pub fn resume_all(&self) -> Result<()> {
        for node in &self.nodes {
            if node.paused.load(std::sync::atomic::Ordering::SeqCst) && node.lock_child().is_some() {
                self.resume(node.id)?;
            }
        }
        Ok(())
    }

    /// Sends a signal by pid with `kill(1)` (the workspace forbids `unsafe`, so no libc).
    fn signal(&self, id: u64, signal: &str) -> Result<()> {
        let pid = self.pid(id).ok_or_else(|| Error::Check(format!("node {id} is not running")))?;
        let status = Command::new("kill")
            .args([signal, &pid.to_string()])
            .status()
            .map_err(|e| Error::io(format!("running kill {signal} {pid}"), e))?;
        if status.success() {
            Ok(())
        } else {
            Err(Error::Check(format!("kill {signal} {pid} (node {id}) failed: {status}")))
        }
    }

    /// The object store directory the nodes share with [`ClusterOptions::tiered_store`].
    pub fn tiered_dir(&self) -> PathBuf {
        self.dir().join("tiered")
    }

    /// Starts spare node `id` with `--join` through a running initial node, and waits for it.
    /// Its ports were reserved when the cluster was laid out and released until now, so
    /// another socket may have taken one meanwhile: a first start that fails on that retries
    /// with fresh ports (not behind the fault proxy, whose targets are fixed).
    pub async fn start_spare(&mut self, id: u64) -> Result<()> {
        if !self.node(id).joins {
            return Err(Error::Check(format!("node {id} is not a spare node")));
        }
        let first_start = self.node(id).launches == 0;
        for attempt in 1..=START_ATTEMPTS {
            match self.restart(id).await {
                Ok(()) => return Ok(()),
                Err(e)
                    if attempt < START_ATTEMPTS
                        && first_start
                        && !self.options.proxy
                        && log_says_address_in_use(&self.node(id).log_path) =>
                {
                    eprintln!("node {id}, attempt {attempt}: a port was taken ({e}); retrying with fresh ports");
                    if let Some(mut child) = self.node(id).lock_child().take() {
                        let _ = child.kill();
                        let _ = child.wait();
                    }
                    let given = ports_in_use(&self.nodes);
                    let node = self.node_mut(id);
                    let ip = node.rpc_addr.ip();
                    let ports = reserve_ports(ip, 2, &given)?;
                    node.http_addr = SocketAddr::new(ip, ports[0]);
                    node.rpc_addr = SocketAddr::new(ip, ports[1]);
                    node.advertised_rpc_addr = node.rpc_addr;
                }
                Err(e) => return Err(e),
            }
        }
        Err(Error::Check(format!("could not start spare node {id} in {START_ATTEMPTS} attempts")))
    }

    /// Power loss of every running node: see [`Cluster::power_loss_nodes`].
    pub fn power_loss(&mut self, rng: &mut rand::rngs::StdRng, tear: bool) -> Result<power::PowerLossReport> {
        let ids = self.running_ids();
        self.power_loss_nodes(&ids, rng, tear)
    }

    /// Kills nodes `ids` (SIGKILL, all signalled before any is reaped), then cuts every file
    /// each traced back to its last recorded durable length, tearing the first page after it
    /// when `tear` (see `power.rs`). Does not restart them.
    pub fn power_loss_nodes(
        &mut self,
        ids: &[u64],
        rng: &mut rand::rngs::StdRng,
        tear: bool,
    ) -> Result<power::PowerLossReport> {
        if !self.options.fsync_trace {
            return Err(Error::Check("power loss needs a cluster started with fsync_trace".into()));
        }
        for &id in ids {
            self.check_alive(id)?;
        }
        let mut killed = Vec::new();
        for &id in ids {
            let node = self.node(id);
            if let Some(mut child) = node.lock_child().take() {
                let _ = child.kill();
                killed.push((id, child));
            }
            node.paused.store(false, std::sync::atomic::Ordering::SeqCst);
        }
        for (id, mut child) in killed {
            child.wait().map_err(|e| Error::io(format!("reaping node {id}"), e))?;
        }
        let mut report = power::PowerLossReport::default();
        for &id in ids {
            let node = self.node(id);
            let trace = node.data_dir.join(FSYNC_TRACE_FILE);
            if trace.exists() {
                report.add(power::cut_to_last_fsync(&node.data_dir, &trace, rng, tear)?);
            }
        }
        eprintln!("power loss of nodes {ids:?}: {report}");
        Ok(report)
    }

    /// Starts a stopped node without waiting for it (see [`Cluster::wait_all_ready`]).
    pub fn launch_stopped(&mut self, id: u64) -> Result<()> {
        self.launch(id)
    }

    /// Waits until nodes `ids` answer `/readyz` 200.
    pub async fn wait_nodes_ready(&mut self, ids: &[u64]) -> Result<()> {
        self.wait_ready(ids, READY_TIMEOUT).await
    }

    /// Ids of the nodes whose process the harness has running (not killed).
    pub fn running_ids(&self) -> Vec<u64> {
        self.nodes.iter().filter(|n| n.lock_child().is_some()).map(|n| n.id).collect()
    }

    /// `http://127.0.0.1:PORT` of node `id` (`https://` with [`ClusterOptions::tls`]).
    pub fn url(&self, id: u64) -> String {
        let scheme = if self.pki.is_some() { "https" } else { "http" };
        format!("{scheme}://{}", self.node(id).http_addr)
    }

    /// The address node `id`'s RPC listener is bound to.
    pub fn rpc_addr(&self, id: u64) -> std::net::SocketAddr {
        self.node(id).rpc_addr
    }

    /// The CA and node certificate of a cluster started with [`ClusterOptions::tls`].
    pub fn pki(&self) -> Option<&TestPki> {
        self.pki.as_ref()
    }

    pub fn api(&self) -> &Api {
        &self.api
    }

    pub fn data_dir(&self, id: u64) -> &Path {
        &self.node(id).data_dir
    }

    pub fn log_path(&self, id: u64) -> &Path {
        &self.node(id).log_path
    }

    /// SIGKILLs node `id` (`Child::kill`) and reaps it. Fails if it had already died on its own.
    pub fn kill(&mut self, id: u64) -> Result<()> {
        self.check_alive(id)?;
        if let Some(mut child) = self.node(id).lock_child().take() {
            let _ = child.kill();
            child.wait().map_err(|e| Error::io(format!("reaping node {id}"), e))?;
        }
        self.node(id).paused.store(false, std::sync::atomic::Ordering::SeqCst);
        eprintln!("node {id} killed (SIGKILL)");
        Ok(())
    }

    /// SIGKILLs every running node at once (all signals before any reaping), then reaps them.
    pub fn kill_all(&mut self) -> Result<()> {
        for id in self.running_ids() {
            self.check_alive(id)?;
        }
        let mut killed = Vec::new();
        for node in &self.nodes {
            if let Some(mut child) = node.lock_child().take() {
                let _ = child.kill();
                killed.push((node.id, child));
            }
            node.paused.store(false, std::sync::atomic::Ordering::SeqCst);
        }
        for (id, mut child) in killed {
            child.wait().map_err(|e| Error::io(format!("reaping node {id}"), e))?;
        }
        eprintln!("all nodes killed (SIGKILL)");
        Ok(())
    }

    /// Stops every node (SIGKILL; the harness needs no graceful stop) and reaps them.
    pub fn stop_all(&mut self) -> Result<()> {
        self.kill_all()
    }

    /// Starts node `id` again with the same flags and data dir, and waits for its `/readyz`.
    pub async fn restart(&mut self, id: u64) -> Result<()> {
        self.launch(id)?;
        self.wait_ready(&[id], READY_TIMEOUT).await
    }

    /// Starts every stopped node again (all before waiting, so they can form a quorum) and
    /// waits until every node's `/readyz` answers 200.
    pub async fn restart_all(&mut self) -> Result<()> {
        let stopped: Vec<u64> = self
            .nodes
            .iter()
            .filter(|n| n.lock_child().is_none() && (!n.joins || n.launches > 0))
            .map(|n| n.id)
            .collect();
        for &id in &stopped {
            self.launch(id)?;
        }
        self.wait_ready(&self.node_ids(), READY_TIMEOUT).await
    }

    /// Describes `topic` through the first running node that answers 200.
    /// The sum of the samples of metric `name` on node `id` (`GET /metrics`).
    pub async fn metric(&self, id: u64, name: &str) -> Result<u64> {
        let text = self.api.get_url(&format!("{}/metrics", self.url(id))).await?.text();
        Ok(text
            .lines()
            .filter(|l| l.split([' ', '{']).next() == Some(name))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<u64>().ok())
            .sum())
    }

    pub async fn describe(&self, topic: &str) -> Result<TopicDescription> {
        let mut last = String::from("no running node");
        for id in self.running_ids() {
            match self.api.describe(&self.url(id), topic).await {
                Ok(reply) if reply.status == 200 => return reply.decode(),
                Ok(reply) => last = reply.summary(),
                Err(e) => last = e.to_string(),
            }
        }
        Err(Error::Check(format!("no running node described topic {topic}; last: {last}")))
    }

    /// Polls describe until every partition of `topic` has a leader that is a running node.
    pub async fn wait_for_leaders(&self, topic: &str, timeout: Duration) -> Result<TopicDescription> {
        let what = format!("a running leader for every partition of {topic}");
        poll_until(&what, timeout, Duration::from_millis(200), || async {
            self.check_all_alive()?;
            let running = self.running_ids();
            let mut seen = Vec::new();
            for id in &running {
                let reply = match self.api.describe(&self.url(*id), topic).await {
                    Ok(reply) if reply.status == 200 => reply,
                    Ok(reply) => {
                        seen.push(reply.summary());
                        continue;
                    }
                    Err(e) => {
                        seen.push(e.to_string());
                        continue;
                    }
                };
                let description: TopicDescription = reply.decode()?;
                let led = description.partitions.iter().all(|p| p.leader.is_some_and(|l| running.contains(&l)));
                if led && !description.partitions.is_empty() {
                    return Ok(Probe::Ready(description));
                }
                let leaders: Vec<_> = description.partitions.iter().map(|p| (p.partition, p.leader)).collect();
                seen.push(format!("node {id}: (partition, leader) {leaders:?}, running {running:?}"));
            }
            Ok(Probe::NotYet(seen.join("; ")))
        })
        .await
    }

    /// The last `lines` lines of node `id`'s log.
    pub fn log_tail(&self, id: u64, lines: usize) -> String {
        let path = &self.node(id).log_path;
        match std::fs::read(path) {
            Ok(bytes) => {
                let text = String::from_utf8_lossy(&bytes);
                let all: Vec<&str> = text.lines().collect();
                all[all.len().saturating_sub(lines)..].iter().copied().map(shorten).collect::<Vec<_>>().join("\n")
            }
            Err(e) => format!("<cannot read {}: {e}>", path.display()),
        }
    }

    /// Ends a test: on `Err`, prints every node's log tail and keeps the temp dir; then drops
    /// the cluster (killing its processes) and returns `outcome` unchanged.
    pub fn finish(mut self, outcome: Result<()>) -> Result<()> {
        if let Err(e) = &outcome {
            self.report_failure(&e.to_string());
        }
        outcome
    }

    fn node(&self, id: u64) -> &NodeProcess {
        self.nodes
            .iter()
            .find(|n| n.id == id)
            .unwrap_or_else(|| panic!("node {id} is not in this cluster of {}", self.nodes.len()))
    }

    fn node_mut(&mut self, id: u64) -> &mut NodeProcess {
        let size = self.nodes.len();
        self.nodes
            .iter_mut()
            .find(|n| n.id == id)
            .unwrap_or_else(|| panic!("node {id} is not in this cluster of {size}"))
    }

    fn launch_all(&mut self) -> Result<()> {
        let initial: Vec<u64> = self.nodes.iter().filter(|n| !n.joins).map(|n| n.id).collect();
        for id in initial {
            self.launch(id)?;
        }
        Ok(())
    }

    /// `--join` target of a spare node: the advertised RPC address of a running initial node.
    fn join_target(&self) -> Result<SocketAddr> {
        self.nodes
            .iter()
            .find(|n| !n.joins && n.lock_child().is_some())
            .map(|n| n.advertised_rpc_addr)
            .ok_or_else(|| Error::Check("no running node to join through".into()))
    }

    fn launch(&mut self, id: u64) -> Result<()> {
        let binary = self.binary.clone();
        let peers = self.peers.clone();
        let options = self.options.clone();
        let join = if self.node(id).joins { Some(self.join_target()?) } else { None };
        let tiered_dir = self.tiered_dir();
        let tls = self.tls_files.clone();
        let node = self.node_mut(id);
        if node.lock_child().is_some() {
            return Err(Error::Check(format!("node {id} is already running")));
        }
        node.launches += 1;
        let mut log = OpenOptions::new()
            .create(true)
            .append(true)
            .open(&node.log_path)
            .map_err(|e| Error::io(format!("opening {}", node.log_path.display()), e))?;
        let _ = writeln!(log, "===== harness: launch #{} of node {id} =====", node.launches);
        let stdout = log.try_clone().map_err(|e| Error::io("duplicating the log handle", e))?;
        let mut command = Command::new(&binary);
        command
            .arg("serve")
            .args(["--node-id", &id.to_string()])
            .arg("--data-dir")
            .arg(&node.data_dir)
            .args(["--http-addr", &node.http_addr.to_string()])
            .args(["--rpc-addr", &node.rpc_addr.to_string()]);
        match join {
            Some(target) => command.args(["--join", &target.to_string()]),
            None => command.args(["--peers", &peers]),
        };
        if node.advertised_rpc_addr != node.rpc_addr {
            command.args(["--advertise-rpc-addr", &node.advertised_rpc_addr.to_string()]);
        }
        for (flag, value) in [
            ("--heartbeat-ms", options.heartbeat_ms),
            ("--election-timeout-ms", options.election_timeout_ms),
            ("--snapshot-every", options.snapshot_every),
            ("--cleaner-interval-ms", options.cleaner_interval_ms),
        ] {
            if let Some(value) = value {
                command.args([flag, &value.to_string()]);
            }
        }
        if let Some(tls) = &tls {
            command.arg("--tls-cert-file").arg(&tls.cert).arg("--tls-key-file").arg(&tls.key);
            command.arg("--tls-ca-file").arg(&tls.ca);
        }
        if let Some(url) = &options.tiered_store_url {
            command.args(["--tiered-store", url]);
        } else if options.tiered_store {
            command.arg("--tiered-store").arg(&tiered_dir);
        }
        // Every flag also reads LOGDEX_<FLAG>: keep ambient settings out, except the log filter;
        // and an S3 store reads AWS_*: only the test's own.
        for (name, _) in std::env::vars_os() {
            let name_text = name.to_string_lossy();
            if (name_text.starts_with("LOGDEX_") && name_text != "LOGDEX_LOG") || name_text.starts_with("AWS_") {
                command.env_remove(&name);
            }
        }
        command.envs(options.node_env.iter().map(|(k, v)| (k, v)));
        // Crash points are armed per node and launch (`set_node_env`), never from the ambient environment.
        command.env_remove(FAILPOINTS_ENV);
        if options.fsync_trace {
            command.env("LOGDEX_FSYNC_TRACE", node.data_dir.join(FSYNC_TRACE_FILE));
        }
        for (key, value) in &node.env {
            command.env(key, value);
        }
        command.env("RUST_BACKTRACE", "1").stdin(Stdio::null()).stdout(stdout).stderr(log);
        let child =
            command.spawn().map_err(|e| Error::io(format!("spawning {} for node {id}", binary.display()), e))?;
        *node.lock_child() = Some(child);
        Ok(())
    }

    /// Polls `/readyz` of `ids` until each answers 200; a node process that exits is an error.
    async fn wait_ready(&mut self, ids: &[u64], timeout: Duration) -> Result<()> {
        let started = Instant::now();
        let attempts_max = timeout.as_millis() / READY_POLL_INTERVAL.as_millis() + 2;
        let mut pending: Vec<u64> = ids.to_vec();
        let mut last = Vec::new();
        for _ in 0..attempts_max {
            last.clear();
            for id in pending.clone() {
                self.check_alive(id)?;
                match self.api.readyz(&self.url(id)).await {
                    Ok(reply) if reply.status == 200 => pending.retain(|p| *p != id),
                    Ok(reply) => last.push(format!("node {id}: {}", reply.summary())),
                    Err(e) => last.push(format!("node {id}: {e}")),
                }
            }
            if pending.is_empty() {
                return Ok(());
            }
            if started.elapsed() >= timeout {
                break;
            }
            tokio::time::sleep(READY_POLL_INTERVAL).await;
        }
        Err(Error::Timeout {
            what: format!("/readyz 200 from nodes {pending:?}"),
            waited_ms: started.elapsed().as_millis(),
            last: last.join("; "),
        })
    }

    /// `Err(NodeExited)` if node `id` was started by the harness and has exited since.
    pub fn check_alive(&self, id: u64) -> Result<()> {
        let node = self.node(id);
        let mut guard = node.lock_child();
        let Some(child) = guard.as_mut() else {
            return Err(Error::Check(format!("node {id} is not running (killed by the test)")));
        };
        match child.try_wait() {
            Ok(None) => Ok(()),
            Ok(Some(status)) => {
                *guard = None;
                drop(guard);
                let mut status = status.to_string();
                if status.contains("SIGKILL") {
                    status.push_str(
                        ", a signal this harness did not send: another process (a pkill or killall of logdex?) \
                         or the OOM killer killed it",
                    );
                }
                Err(Error::NodeExited { node_id: id, status, log_tail: self.log_tail(id, 30) })
            }
            Err(e) => Err(Error::io(format!("checking node {id}"), e)),
        }
    }

    /// `check_alive` for every node the harness has running.
    pub fn check_all_alive(&self) -> Result<()> {
        self.running_ids().into_iter().try_for_each(|id| self.check_alive(id))
    }

    fn any_log_says_address_in_use(&self) -> bool {
        self.nodes.iter().any(|n| log_says_address_in_use(&n.log_path))
    }

    fn kill_all_quietly(&mut self) {
        for node in &self.nodes {
            if let Some(mut child) = node.lock_child().take() {
                let _ = child.kill();
                let _ = child.wait();
            }
        }
    }

    /// Prints the tail of every node's log and keeps the temp dir for diagnosis.
    fn report_failure(&mut self, reason: &str) {
        self.keep_dir = true;
        eprintln!("===== test failed: {reason}");
        for id in self.running_ids() {
            if let Err(e) = self.check_alive(id) {
                eprintln!("===== {e}");
            }
        }
        for id in self.node_ids() {
            eprintln!(
                "===== node {id}: last {FAILURE_LOG_LINES} lines of {}\n{}",
                self.node(id).log_path.display(),
                self.log_tail(id, FAILURE_LOG_LINES)
            );
        }
        eprintln!("===== data dirs and full logs kept in {}", self.dir.path().display());
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        if std::thread::panicking() && !self.keep_dir {
            self.report_failure("the test panicked");
        }
        self.kill_all_quietly();
        if self.keep_dir || std::env::var_os(KEEP_ENV).is_some() {
            self.dir.disable_cleanup(true);
            eprintln!("kept {}", self.dir.path().display());
        }
    }
}

/// A log line cut to `LOG_LINE_CHARS_MAX` characters (openraft logs whole states on one line).
fn shorten(line: &str) -> String {
    match line.char_indices().nth(LOG_LINE_CHARS_MAX) {
        Some((cut, _)) => format!("{} ...", &line[..cut]),
        None => line.to_string(),
    }
}

/// A fresh temp dir, node directories, free ports (and proxy listeners) for every node, and
/// the `--peers` list of the initial nodes.
fn layout(options: &ClusterOptions) -> Result<(TempDir, Vec<NodeProcess>, String, Option<Proxy>)> {
    let dir = tempfile::Builder::new()
        .prefix("logdex-cluster-")
        .tempdir()
        .map_err(|e| Error::io("creating the cluster temp dir", e))?;
    let total = options.nodes + options.spare_nodes;
    let mut nodes = Vec::with_capacity(total);
    let mut proxied = Vec::new();
    for i in 0..total {
        let id = i as u64 + 1;
        let ip = if options.proxy {
            IpAddr::V4(Ipv4Addr::new(127, 0, 0, PROXIED_IP_BASE + id as u8))
        } else {
            IpAddr::V4(Ipv4Addr::LOCALHOST)
        };
        let ports = reserve_ports(ip, 2, &ports_in_use(&nodes))?;
        let data_dir = dir.path().join(format!("node-{id}"));
        std::fs::create_dir_all(&data_dir).map_err(|e| Error::io(format!("creating {}", data_dir.display()), e))?;
        let rpc_addr = SocketAddr::new(ip, ports[1]);
        let advertised_rpc_addr = if options.proxy {
            let listener = TcpListener::bind(SocketAddr::new(ip, 0))
                .map_err(|e| Error::io(format!("binding a proxy listener on {ip}"), e))?;
            let address = listener.local_addr().map_err(|e| Error::io("reading a proxy address", e))?;
            proxied.push(ProxiedNode { id, listener, target: rpc_addr, ip });
            address
        } else {
            rpc_addr
        };
        nodes.push(NodeProcess {
            id,
            http_addr: SocketAddr::new(ip, ports[0]),
            rpc_addr,
            advertised_rpc_addr,
            joins: i >= options.nodes,
            log_path: data_dir.join("node.log"),
            data_dir,
            child: std::sync::Mutex::new(None),
            paused: std::sync::atomic::AtomicBool::new(false),
            launches: 0,
            env: Vec::new(),
        });
    }
    let peers = nodes
        .iter()
        .filter(|n| !n.joins)
        .map(|n| format!("{}@{}", n.id, n.advertised_rpc_addr))
        .collect::<Vec<_>>()
        .join(",");
    let proxy = if options.proxy { Some(Proxy::start(proxied, options.seed)?) } else { None };
    Ok((dir, nodes, peers, proxy))
}

/// The HTTP and RPC ports of `nodes`.
fn ports_in_use(nodes: &[NodeProcess]) -> Vec<u16> {
    nodes.iter().flat_map(|n| [n.http_addr.port(), n.rpc_addr.port()]).collect()
}

/// Writes the PEM files of `pki`, if any, into `dir`/tls.
fn write_tls_files(pki: Option<&TestPki>, dir: &TempDir) -> Result<Option<TlsFiles>> {
    pki.map(|pki| pki.write(&dir.path().join("tls"))).transpose()
}

/// Whether a node's log says it could not bind an address already in use.
fn log_says_address_in_use(log_path: &Path) -> bool {
    std::fs::read(log_path).is_ok_and(|bytes| {
        let text = String::from_utf8_lossy(&bytes).to_lowercase();
        text.contains("address already in use") || text.contains("addrinuse") || text.contains("os error 98")
    })
}

/// Lowest port the harness gives a node.
const NODE_PORT_LOW: u16 = 10_000;
/// Random ports tried per reservation before falling back to the kernel's choice.
const PORT_PICKS_MAX: usize = 500;

/// First port of the kernel's ephemeral range, where outgoing connections get their local
/// ports (Linux's default when it cannot be read).
fn ephemeral_port_start() -> u16 {
    std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|text| text.split_whitespace().next()?.parse().ok())
        .unwrap_or(32_768)
}

/// `count` distinct free ports on `ip`, none of them in `avoid`: bound together (so they are
/// distinct and free now), then released for the nodes to take.
///
/// They are picked at random below the kernel's ephemeral range: a node restarts on its
/// port after a kill, and a port in that range could meanwhile be the local port of some
/// outgoing connection (a client's, another node's), so the restart would fail with
/// "address in use". Another process can still bind one in between; `Cluster::start` and
/// `Cluster::start_spare` retry with fresh ports when a node reports that.
fn reserve_ports(ip: IpAddr, count: usize, avoid: &[u16]) -> Result<Vec<u16>> {
    use rand::Rng as _;
    let high = ephemeral_port_start();
    let mut rng = rand::rng();
    let mut listeners: Vec<TcpListener> = Vec::with_capacity(count);
    let mut picks = 0;
    while listeners.len() < count && picks < PORT_PICKS_MAX && high > NODE_PORT_LOW {
        picks += 1;
        let port = rng.random_range(NODE_PORT_LOW..high);
        let taken = avoid.contains(&port) || listeners.iter().any(|l| l.local_addr().is_ok_and(|a| a.port() == port));
        if !taken && let Ok(listener) = TcpListener::bind(SocketAddr::new(ip, port)) {
            listeners.push(listener);
        }
    }
    // A machine whose ephemeral range starts low: let the kernel choose the rest.
    while listeners.len() < count {
        let listener = TcpListener::bind(SocketAddr::new(ip, 0))
            .map_err(|e| Error::io(format!("binding {ip}:0 to find a free port"), e))?;
        listeners.push(listener);
    }
    listeners
        .iter()
        .map(|l| l.local_addr().map(|a| a.port()))
        .collect::<std::io::Result<Vec<_>>>()
        .map_err(|e| Error::io("reading a reserved port", e))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reserved_ports_are_distinct_free_below_the_ephemeral_range_and_avoid_given_ones() -> Result<()> {
        let ip = IpAddr::V4(Ipv4Addr::LOCALHOST);
        let first = reserve_ports(ip, 2, &[])?;
        let mut given = first.clone();
        for _ in 0..20 {
            let ports = reserve_ports(ip, 2, &given)?;
            assert_ne!(ports[0], ports[1], "{ports:?}");
            assert!(ports.iter().all(|p| !given.contains(p)), "{ports:?} reuses one of {given:?}");
            given.extend(ports);
        }
        let high = ephemeral_port_start();
        assert!(given.iter().all(|p| (NODE_PORT_LOW..high).contains(p)), "{given:?} outside {NODE_PORT_LOW}..{high}");
        for port in given {
            TcpListener::bind(SocketAddr::new(ip, port)).map_err(|e| Error::io(format!("binding port {port}"), e))?;
        }
        Ok(())
    }
}
