//! A TCP fault proxy in front of every node's RPC port, as etcd's robustness tests use
//! (`pkg/proxy`): no root, no netem.
//!
//! Each node listens on its own loopback IP (node `i` on `127.0.0.(10+i)`) and opens its
//! node-to-node connections from that IP, and is advertised to its peers as the proxy
//! listening in front of it. The proxy tells the calling node by the source IP of a
//! connection, so it can apply a fault per directed link: `(from, to)` covers the bytes
//! flowing from node `from` to node `to`, whichever of them opened the connection (requests
//! of `from`'s calls, and responses to `to`'s calls).
//!
//! The proxy runs on its own small tokio runtime, so a test that blocks a worker thread (a
//! process wait, a file truncation) never stalls node-to-node traffic.

use std::collections::BTreeMap;
use std::collections::HashMap;
use std::net::IpAddr;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::Mutex;
use std::sync::PoisonError;
use std::sync::atomic::AtomicU64;
use std::sync::atomic::Ordering;
use std::time::Duration;

use rand::Rng as _;
use rand::SeedableRng as _;
use rand::rngs::StdRng;
use tokio::io::AsyncReadExt as _;
use tokio::io::AsyncWriteExt as _;
use tokio::net::TcpListener;
use tokio::net::TcpStream;
use tokio::net::tcp::OwnedReadHalf;
use tokio::net::tcp::OwnedWriteHalf;
use tokio::sync::watch;
use tokio::time::Instant;

use crate::error::Error;
use crate::error::Result;

/// The retransmission timeout a lost chunk costs (Linux's minimum RTO is 200 ms).
const RETRANSMIT_TIMEOUT: Duration = Duration::from_millis(200);
/// Retransmissions of one chunk at most; then it goes through.
const RETRANSMITS_MAX: u32 = 5;
const CHUNK_BYTES: usize = 16 * 1024;
const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);

/// What happens to the bytes of one directed link.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fault {
    Pass,
    /// Every chunk is held `base_ms` plus or minus up to `jitter_ms` (order kept, as TCP does).
    Delay {
        base_ms: u64,
        jitter_ms: u64,
    },
    /// Every chunk is lost with this probability and "retransmitted" after 200 ms, again
    /// and again up to 5 times: TCP over a lossy link, as latency spikes, never as holes.
    Drop {
        percent: u8,
    },
    /// Bytes are silently discarded; connections stay open (a one-way cut when only one
    /// direction of a pair is blackholed: requests arrive, answers never do).
    Blackhole,
    /// Open connections are reset and new ones refused (a cut both ways for that pair).
    Cut,
}

/// Evidence that a fault happened, per directed link (for the coverage checker, C5).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LinkStats {
    pub bytes_passed: u64,
    pub bytes_blackholed: u64,
    pub chunks_delayed: u64,
    pub chunks_lost: u64,
    pub connections_reset: u64,
    pub connections_refused: u64,
}

#[derive(Default)]
struct Counters {
    bytes_passed: AtomicU64,
    bytes_blackholed: AtomicU64,
    chunks_delayed: AtomicU64,
    chunks_lost: AtomicU64,
    connections_reset: AtomicU64,
    connections_refused: AtomicU64,
}

impl Counters {
    fn snapshot(&self) -> LinkStats {
        LinkStats {
            bytes_passed: self.bytes_passed.load(Ordering::Relaxed),
            bytes_blackholed: self.bytes_blackholed.load(Ordering::Relaxed),
            chunks_delayed: self.chunks_delayed.load(Ordering::Relaxed),
            chunks_lost: self.chunks_lost.load(Ordering::Relaxed),
            connections_reset: self.connections_reset.load(Ordering::Relaxed),
            connections_refused: self.connections_refused.load(Ordering::Relaxed),
        }
    }
}

/// One node behind the proxy: where the proxy listens for it, where the node really
/// listens, and the IP its outgoing connections come from.
pub struct ProxiedNode {
    pub id: u64,
    pub listener: std::net::TcpListener,
    pub target: SocketAddr,
    pub ip: IpAddr,
}

struct Shared {
    faults: Mutex<HashMap<(u64, u64), Fault>>,
    /// Bumped on every fault change, so idle connections notice a cut at once.
    epoch: watch::Sender<u64>,
    counters: HashMap<(u64, u64), Counters>,
    callers: HashMap<IpAddr, u64>,
    rng: Mutex<StdRng>,
}

impl Shared {
    fn fault(&self, link: (u64, u64)) -> Fault {
        self.faults.lock().unwrap_or_else(PoisonError::into_inner).get(&link).copied().unwrap_or(Fault::Pass)
    }

    fn counters(&self, link: (u64, u64)) -> Option<&Counters> {
        self.counters.get(&link)
    }

    fn random_below(&self, bound: u64) -> u64 {
        if bound == 0 {
            return 0;
        }
        self.rng.lock().unwrap_or_else(PoisonError::into_inner).random_range(0..bound)
    }

    fn random_percent(&self) -> u8 {
        self.random_below(100) as u8
    }
}

/// The fault proxy of one cluster; dropping it stops every listener and connection.
pub struct Proxy {
    runtime: Option<tokio::runtime::Runtime>,
    shared: Arc<Shared>,
    listen: BTreeMap<u64, SocketAddr>,
}

impl Proxy {
    /// Starts one listener per node (already bound, so its port is known and kept).
    pub fn start(nodes: Vec<ProxiedNode>, seed: u64) -> Result<Proxy> {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("fault-proxy")
            .enable_all()
            .build()
            .map_err(|e| Error::io("starting the proxy runtime", e))?;
        let ids: Vec<u64> = nodes.iter().map(|n| n.id).collect();
        let mut counters = HashMap::new();
        for &a in &ids {
            for &b in &ids {
                if a != b {
                    counters.insert((a, b), Counters::default());
                }
            }
        }
        let shared = Arc::new(Shared {
            faults: Mutex::new(HashMap::new()),
            epoch: watch::channel(0).0,
            counters,
            callers: nodes.iter().map(|n| (n.ip, n.id)).collect(),
            rng: Mutex::new(StdRng::seed_from_u64(seed)),
        });
        let mut listen = BTreeMap::new();
        for node in nodes {
            let address = node.listener.local_addr().map_err(|e| Error::io("reading a proxy address", e))?;
            node.listener.set_nonblocking(true).map_err(|e| Error::io("configuring a proxy listener", e))?;
            let listener = {
                let _guard = runtime.enter();
                TcpListener::from_std(node.listener).map_err(|e| Error::io("registering a proxy listener", e))?
            };
            runtime.spawn(accept_loop(shared.clone(), node.id, listener, node.target));
            listen.insert(node.id, address);
        }
        Ok(Proxy { runtime: Some(runtime), shared, listen })
    }

    /// The address node `id` is advertised at (the proxy in front of its RPC port).
    pub fn address(&self, id: u64) -> SocketAddr {
        self.listen[&id]
    }

    /// Sets the fault of the bytes flowing from node `from` to node `to`.
    pub fn set(&self, from: u64, to: u64, fault: Fault) {
        self.shared.faults.lock().unwrap_or_else(PoisonError::into_inner).insert((from, to), fault);
        self.shared.epoch.send_modify(|e| *e += 1);
    }

    /// Sets the same fault both ways between `a` and `b`.
    pub fn set_pair(&self, a: u64, b: u64, fault: Fault) {
        self.set(a, b, fault);
        self.set(b, a, fault);
    }

    /// Cuts `node` off from every other node (both directions) with `fault`.
    pub fn isolate(&self, node: u64, fault: Fault) {
        for other in self.listen.keys().copied().filter(|o| *o != node) {
            self.set_pair(node, other, fault);
        }
    }

    /// Every link passes again.
    pub fn heal(&self) {
        self.shared.faults.lock().unwrap_or_else(PoisonError::into_inner).clear();
        self.shared.epoch.send_modify(|e| *e += 1);
    }

    /// The links that currently have a fault.
    pub fn faults(&self) -> BTreeMap<(u64, u64), Fault> {
        let faults = self.shared.faults.lock().unwrap_or_else(PoisonError::into_inner);
        faults.iter().filter(|(_, f)| **f != Fault::Pass).map(|(k, v)| (*k, *v)).collect()
    }

    pub fn stats(&self, from: u64, to: u64) -> LinkStats {
        self.shared.counters((from, to)).map(Counters::snapshot).unwrap_or_default()
    }

    /// Every link's counters added up.
    pub fn total_stats(&self) -> LinkStats {
        let mut total = LinkStats::default();
        for counters in self.shared.counters.values() {
            let s = counters.snapshot();
            total.bytes_passed += s.bytes_passed;
            total.bytes_blackholed += s.bytes_blackholed;
            total.chunks_delayed += s.chunks_delayed;
            total.chunks_lost += s.chunks_lost;
            total.connections_reset += s.connections_reset;
            total.connections_refused += s.connections_refused;
        }
        total
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        if let Some(runtime) = self.runtime.take() {
            runtime.shutdown_background();
        }
    }
}

async fn accept_loop(shared: Arc<Shared>, target_id: u64, listener: TcpListener, target: SocketAddr) {
    loop {
        let Ok((client, peer)) = listener.accept().await else {
            tokio::time::sleep(Duration::from_millis(10)).await;
            continue;
        };
        tokio::spawn(serve(shared.clone(), target_id, client, peer, target));
    }
}

/// How a pump ended.
#[derive(Clone, Copy, PartialEq, Eq)]
enum End {
    /// The sender closed its side: pass the close on.
    Eof,
    /// A cut, an I/O error or the other direction's abort: reset the connection.
    Abort,
}

async fn serve(shared: Arc<Shared>, target_id: u64, client: TcpStream, peer: SocketAddr, target: SocketAddr) {
    // A caller that is not a node (a test tool) passes unharmed on link (0, target).
    let caller = shared.callers.get(&peer.ip()).copied().unwrap_or(0);
    let up = (caller, target_id);
    let down = (target_id, caller);
    if shared.fault(up) == Fault::Cut || shared.fault(down) == Fault::Cut {
        if let Some(c) = shared.counters(up) {
            c.connections_refused.fetch_add(1, Ordering::Relaxed);
        }
        reset(client);
        return;
    }
    let server = match tokio::time::timeout(CONNECT_TIMEOUT, TcpStream::connect(target)).await {
        Ok(Ok(server)) => server,
        _ => {
            reset(client);
            return;
        }
    };
    let _ = client.set_nodelay(true);
    let _ = server.set_nodelay(true);
    let (client_read, client_write) = client.into_split();
    let (server_read, server_write) = server.into_split();
    let (abort, _) = watch::channel(false);
    let (upstream, downstream) = tokio::join!(
        pump(&shared, up, client_read, server_write, &abort),
        pump(&shared, down, server_read, client_write, &abort),
    );
    let (client_read, server_write, up_end) = upstream;
    let (server_read, client_write, down_end) = downstream;
    if up_end == End::Abort || down_end == End::Abort {
        if let Some(c) = shared.counters(up) {
            c.connections_reset.fetch_add(1, Ordering::Relaxed);
        }
        if let Ok(client) = client_read.reunite(client_write) {
            reset(client);
        }
        if let Ok(server) = server_read.reunite(server_write) {
            reset(server);
        }
    }
}

/// Closes with RST (zero linger) rather than FIN: the peer sees "connection reset".
fn reset(stream: TcpStream) {
    let _ = stream.set_zero_linger();
    drop(stream);
}

/// Copies `from` to `to` applying the fault of `link` to every chunk, until EOF, a cut,
/// an error or the other direction's abort. Returns the halves so the caller can reset.
async fn pump(
    shared: &Shared,
    link: (u64, u64),
    mut from: OwnedReadHalf,
    mut to: OwnedWriteHalf,
    abort: &watch::Sender<bool>,
) -> (OwnedReadHalf, OwnedWriteHalf, End) {
    let mut epoch = shared.epoch.subscribe();
    let mut aborted = abort.subscribe();
    let mut buffer = vec![0u8; CHUNK_BYTES];
    // Chunks leave in order: a delayed chunk holds back the ones after it.
    let mut release = Instant::now();
    let end = loop {
        if shared.fault(link) == Fault::Cut || *aborted.borrow() {
            break End::Abort;
        }
        let read = tokio::select! {
            read = from.read(&mut buffer) => read,
            _ = epoch.changed() => continue,
            _ = aborted.changed() => continue,
        };
        let n = match read {
            Ok(0) => break End::Eof,
            Ok(n) => n,
            Err(_) => break End::Abort,
        };
        let counters = shared.counters(link);
        match shared.fault(link) {
            Fault::Pass => {}
            Fault::Cut => break End::Abort,
            Fault::Blackhole => {
                if let Some(c) = counters {
                    c.bytes_blackholed.fetch_add(n as u64, Ordering::Relaxed);
                }
                continue;
            }
            Fault::Delay { base_ms, jitter_ms } => {
                let low = base_ms.saturating_sub(jitter_ms);
                let delay_ms = low + shared.random_below(base_ms + jitter_ms - low + 1);
                release = release.max(Instant::now() + Duration::from_millis(delay_ms));
                if let Some(c) = counters {
                    c.chunks_delayed.fetch_add(1, Ordering::Relaxed);
                }
            }
            Fault::Drop { percent } => {
                let mut losses = 0;
                while losses < RETRANSMITS_MAX && shared.random_percent() < percent {
                    losses += 1;
                }
                if losses > 0 {
                    release = release.max(Instant::now() + RETRANSMIT_TIMEOUT * losses);
                    if let Some(c) = counters {
                        c.chunks_lost.fetch_add(u64::from(losses), Ordering::Relaxed);
                    }
                }
            }
        }
        if release > Instant::now() {
            tokio::time::sleep_until(release).await;
        }
        if to.write_all(&buffer[..n]).await.is_err() {
            break End::Abort;
        }
        if let Some(c) = counters {
            c.bytes_passed.fetch_add(n as u64, Ordering::Relaxed);
        }
    };
    match end {
        End::Eof => {
            let _ = to.shutdown().await;
        }
        End::Abort => {
            abort.send_replace(true);
        }
    }
    (from, to, end)
}
