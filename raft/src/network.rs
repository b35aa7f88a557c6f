//! The sending side of the node-to-node transport.
//!
//! One lazily connected tonic channel per peer node address carries every
//! group (HTTP/2 multiplexes the streams); each request names its group and
//! target replica. Every call has a deadline (openraft's hard TTL), and a
//! transport failure is reported as `Unreachable` so openraft backs off.

use std::collections::HashMap;
use std::future::Future;
use std::sync::Arc;
use std::sync::Mutex;
use std::sync::atomic::Ordering;
use std::time::Duration;

use futures::FutureExt;
use futures::Stream;
use futures::StreamExt;
use openraft::base::BoxFuture;
use openraft::base::BoxStream;
use openraft::errors::ReplicationClosed;
use openraft::errors::Unreachable;
use openraft::network::Backoff;
use openraft::network::RPCOption;
use openraft::network::RaftNetworkFactory;
use openraft::network::v2::RaftNetworkV2;
use openraft::raft::AppendEntriesRequest;
use openraft::raft::AppendEntriesResponse;
use openraft::raft::SnapshotResponse;
use openraft::raft::StreamAppendError;
use openraft::raft::StreamAppendResult;
use openraft::raft::VoteRequest;
use openraft::raft::VoteResponse;
use tonic::transport::Channel;
use tonic::transport::Endpoint;

use crate::calls::AppendStats;
use crate::calls::Calls;
use crate::calls::RETRY_UNSUPPORTED;
use crate::pb;
use crate::pb::call_request::Call;
use crate::pb::raft_service_client::RaftServiceClient;
use crate::state_machine::SnapshotData;
use crate::types::GroupId;
use crate::types::LogId;
use crate::types::ReplicaId;
use crate::types::RpcError;
use crate::types::StreamingError;
use crate::types::TypeConfig;
use crate::types::Vote;
use crate::wire;

/// Default deadline for node-to-node calls that openraft does not time itself.
pub const RPC_TIMEOUT: Duration = Duration::from_secs(2);
/// Longest a replication stream may stay silent while it owes answers (the unary
/// append's deadline is at most five RPC timeouts too); then it fails and the
/// connection to that peer is replaced.
pub const STREAM_ANSWER_TIMEOUT: Duration = Duration::from_secs(10);

/// Deadline of a whole snapshot transfer.
pub const SNAPSHOT_TIMEOUT: Duration = Duration::from_secs(600);
/// Longest a snapshot transfer may wait for the transport to take its next chunk.
pub const SNAPSHOT_STALL_TIMEOUT: Duration = Duration::from_secs(30);
/// Bytes of one snapshot file chunk on the wire.
pub const SNAPSHOT_CHUNK_BYTES: usize = 1024 * 1024;

/// Streams the header, then every file of the snapshot in chunks with its CRC-32C, then the
/// end marker. The files are opened first, all at once ([`crate::snapshot::SnapshotFiles::open_all`]), so a
/// newer snapshot replacing this one meanwhile cannot cut the transfer short; on any error it
/// stops before the end marker, so the receiver refuses what it got. Each chunk is owed
/// (`owed`) from when it is handed over until the transport takes it.
async fn send_snapshot_files(
    header: pb::SnapshotHeader,
    files: SnapshotData,
    tx: tokio::sync::mpsc::Sender<pb::SnapshotChunk>,
    owed: &Owed,
) -> Result<(), std::io::Error> {
    use pb::snapshot_chunk::Kind;
    use tokio::io::AsyncReadExt;
    let send = |kind: Kind| {
        owed.handed_over();
        let sent = tx.send(pb::SnapshotChunk { kind: Some(kind) });
        async move { sent.await.map_err(|_| std::io::Error::other("snapshot receiver closed the stream")) }
    };
    send(Kind::Header(header)).await?;
    let opened = files.open_all().map_err(std::io::Error::other)?;
    let count = opened.len() as u64;
    for (rel, file) in opened {
        let name = rel.to_string_lossy().replace(std::path::MAIN_SEPARATOR, "/");
        let mut file = tokio::fs::File::from_std(file);
        let mut crc = 0u32;
        let mut size = 0u64;
        loop {
            let mut buf = vec![0u8; SNAPSHOT_CHUNK_BYTES];
            let n = file.read(&mut buf).await?;
            if n == 0 {
                break;
            }
            buf.truncate(n);
            crc = crc32c::crc32c_append(crc, &buf);
            size += n as u64;
            let chunk = pb::SnapshotFileChunk { name: name.clone(), data: buf };
            send(Kind::Data(chunk)).await?;
        }
        let end = pb::SnapshotFileEnd { name, size, crc32c: crc };
        send(Kind::FileEnd(end)).await?;
    }
    let end = pb::SnapshotEnd { files: count };
    send(Kind::End(end)).await
}

/// The id of the cluster this node belongs to (`ClusterState::cluster_id`), once its
/// controller replica applied it; unknown before (a node that joins, or a new cluster before
/// its first registration). Every node-to-node call carries it ([`CLUSTER_ID_HEADER`]), and
/// a node refuses calls from another cluster (`service::CheckPeer`): a node started on an
/// empty directory at a member's address forms a cluster of its own, and its groups (whose
/// ids restart at 1) would otherwise take the other cluster's votes, entries and status
/// calls for their own.
///
/// It also holds the data-directory incarnation the cluster registered for each node's RPC
/// address (`NodeRecord::incarnation`): a call names the one it expects of the node it calls
/// ([`TARGET_INCARNATION_HEADER`]), and a node whose own differs refuses it. A node restarted
/// on an empty directory under a member's id (its disk was lost) then hears nothing from the
/// cluster under that id: its empty logs never reach the leaders, which openraft does not let
/// a follower's log go back on (a leader that saw it panicked), and it never learns the
/// assignments that would have it start the lost replicas empty; its registration is refused
/// and it stops.
///
/// And it holds the incarnations of the nodes removed from the cluster: every call names its
/// caller's own ([`SOURCE_INCARNATION_HEADER`]), and a call from a removed node's data
/// directory (the node started again by mistake) is refused, so its stale replicas never
/// take part in the groups it left.
#[derive(Clone, Default)]
pub struct ClusterIdentity {
    id: Arc<std::sync::atomic::AtomicU64>,
    incarnations: Arc<std::sync::RwLock<HashMap<String, u64>>>,
    removed: Arc<std::sync::RwLock<std::collections::HashSet<u64>>>,
}

/// The metadata key of a call's cluster id: 16 lowercase hex digits.
pub const CLUSTER_ID_HEADER: &str = "x-logdex-cluster";
/// The metadata key of the incarnation a call expects of the node it calls: 16 hex digits.
pub const TARGET_INCARNATION_HEADER: &str = "x-logdex-target-incarnation";
/// The metadata key of the calling node's own incarnation: 16 hex digits.
pub const SOURCE_INCARNATION_HEADER: &str = "x-logdex-source-incarnation";

impl ClusterIdentity {
    /// The id, once known.
    pub fn get(&self) -> Option<u64> {
        Some(self.id.load(Ordering::Relaxed)).filter(|id| *id != 0)
    }

    /// Records the cluster id `state` names (0: none yet, ignored; a cluster's id never
    /// changes once set, so the first one learnt stays) and its nodes' incarnations.
    pub fn learn(&self, state: &crate::controller::ClusterState) {
        if state.cluster_id != 0 {
            let _ = self.id.compare_exchange(0, state.cluster_id, Ordering::Relaxed, Ordering::Relaxed);
        }
        let known: HashMap<String, u64> =
            state.nodes.values().filter(|n| n.incarnation != 0).map(|n| (n.rpc_addr.clone(), n.incarnation)).collect();
        let mut incarnations = self.incarnations.write().unwrap_or_else(|p| p.into_inner());
        if *incarnations != known {
            *incarnations = known;
        }
        drop(incarnations);
        let removed: std::collections::HashSet<u64> =
            state.removed_nodes.values().copied().filter(|i| *i != 0).collect();
        let mut known_removed = self.removed.write().unwrap_or_else(|p| p.into_inner());
        if *known_removed != removed {
            *known_removed = removed;
        }
    }

    /// Whether `incarnation` is the data directory of a node removed from the cluster.
    pub fn is_removed(&self, incarnation: u64) -> bool {
        self.removed.read().unwrap_or_else(|p| p.into_inner()).contains(&incarnation)
    }

    /// The incarnation registered for the node at `addr`, when known.
    fn incarnation_at(&self, addr: &str) -> Option<u64> {
        self.incarnations.read().unwrap_or_else(|p| p.into_inner()).get(addr).copied()
    }

    /// A call's metadata value of `id` (hex digits are always a valid value).
    fn header(id: u64) -> Option<tonic::metadata::MetadataValue<tonic::metadata::Ascii>> {
        format!("{id:016x}").parse().ok()
    }

    /// The id a call's metadata names under `key`: `None` when it names none (a node that has
    /// not learnt it yet, or predates it); unreadable text reads as an id of its own.
    pub fn of_call(metadata: &tonic::metadata::MetadataMap, key: &str) -> Option<u64> {
        let value = metadata.get(key)?;
        Some(value.to_str().ok().and_then(|v| u64::from_str_radix(v, 16).ok()).unwrap_or(u64::MAX))
    }
}

/// Adds to every request the node-to-node bearer token, when configured, the cluster's id,
/// once known, and the incarnations of the caller and, when known, of the node called.
#[derive(Clone)]
pub struct PeerHeaders {
    token: Option<tonic::metadata::MetadataValue<tonic::metadata::Ascii>>,
    cluster: ClusterIdentity,
    /// This node's own incarnation (0: not given, in tests).
    source: u64,
    /// The incarnation expected of the node called, when known.
    target: Option<u64>,
}

impl tonic::service::Interceptor for PeerHeaders {
    fn call(&mut self, mut request: tonic::Request<()>) -> Result<tonic::Request<()>, tonic::Status> {
        if let Some(h) = &self.token {
            request.metadata_mut().insert("authorization", h.clone());
        }
        if let Some(value) = self.cluster.get().and_then(ClusterIdentity::header) {
            request.metadata_mut().insert(CLUSTER_ID_HEADER, value);
        }
        if let Some(value) = self.target.and_then(ClusterIdentity::header) {
            request.metadata_mut().insert(TARGET_INCARNATION_HEADER, value);
        }
        if let Some(value) = Some(self.source).filter(|s| *s != 0).and_then(ClusterIdentity::header) {
            request.metadata_mut().insert(SOURCE_INCARNATION_HEADER, value);
        }
        Ok(request)
    }
}

/// A node-to-node client.
pub type RaftClient = RaftServiceClient<tonic::service::interceptor::InterceptedService<Channel, PeerHeaders>>;

/// One channel per peer address, shared by all groups and by client-side calls.
pub struct ChannelPool {
    pub(crate) channels: Mutex<HashMap<String, Channel>>,
    headers: PeerHeaders,
    /// Source address of outgoing connections (the node's own RPC IP), so a
    /// fault-injecting proxy can tell the links between nodes apart.
    local_ip: Option<std::net::IpAddr>,
    /// TLS of every connection, trusting only the cluster's CA, when the cluster runs TLS.
    tls: Option<tonic::transport::ClientTlsConfig>,
}

impl ChannelPool {
    /// A pool whose requests carry `Authorization: Bearer <token>` when a token is given.
    pub fn new(token: Option<&str>, local_ip: Option<std::net::IpAddr>) -> Result<ChannelPool, String> {
        let header = match token {
            Some(t) => Some(format!("Bearer {t}").parse().map_err(|_| "the rpc token is not valid ASCII".to_string())?),
            None => None,
        };
        Ok(ChannelPool {
            channels: Mutex::new(HashMap::new()),
            headers: PeerHeaders { token: header, cluster: ClusterIdentity::default(), source: 0, target: None },
            local_ip,
            tls: None,
        })
    }

    /// Requests that carry `cluster`'s id once it is known, and `incarnation` as the caller's.
    pub fn with_cluster(self, cluster: ClusterIdentity, incarnation: u64) -> ChannelPool {
        ChannelPool { headers: PeerHeaders { cluster, source: incarnation, ..self.headers }, ..self }
    }

    /// Connections over TLS (`https`), verifying peers against the PEM certificates of
    /// `ca_pem` alone (the server name checked is the host of the peer's address), when
    /// given.
    pub fn with_tls_ca(self, ca_pem: Option<&[u8]>) -> ChannelPool {
        let tls = ca_pem.map(|pem| {
            tonic::transport::ClientTlsConfig::new().ca_certificate(tonic::transport::Certificate::from_pem(pem))
        });
        ChannelPool { tls, ..self }
    }

    /// Drops the pooled connection to `addr`: the next client gets a new one. Calls in flight
    /// on the old connection go on until they end. For a connection that answers HTTP/2 pings
    /// but carries no data any more (flow-control credit lost), which keep-alive cannot detect.
    pub fn forget(&self, addr: &str) {
        let mut channels = self.channels.lock().unwrap_or_else(|p| p.into_inner());
        if channels.remove(addr).is_some() {
            tracing::info!(peer = addr, "dropped the connection to a peer that stopped answering; reconnecting");
        }
    }

    pub fn client(&self, addr: &str) -> Result<RaftClient, tonic::transport::Error> {
        let headers = PeerHeaders { target: self.headers.cluster.incarnation_at(addr), ..self.headers.clone() };
        let mut channels = self.channels.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(channel) = channels.get(addr) {
            return Ok(RaftServiceClient::with_interceptor(channel.clone(), headers));
        }
        let scheme = if self.tls.is_some() { "https" } else { "http" };
        let mut endpoint = Endpoint::from_shared(format!("{scheme}://{addr}"))?;
        if let Some(tls) = &self.tls {
            endpoint = endpoint.tls_config(tls.clone())?;
        }
        let channel = endpoint
            .connect_timeout(Duration::from_secs(1))
            .tcp_nodelay(true)
            .http2_keep_alive_interval(Duration::from_secs(5))
            .keep_alive_timeout(Duration::from_secs(5))
            .local_address(self.local_ip)
            .connect_lazy();
        channels.insert(addr.to_string(), channel.clone());
        Ok(RaftServiceClient::with_interceptor(channel, headers))
    }
}

/// The requests of a replication stream that await an answer, and since when the oldest of
/// them has waited without the stream answering anything; `limit` is how long that may last.
/// A snapshot transfer uses it for its chunks: one is owed from when the producer hands it
/// over until the transport takes it.
struct Owed {
    limit: Duration,
    count: std::sync::atomic::AtomicI64,
    /// Nanoseconds after `start` when the stream last made progress while owing: the first
    /// request after none was owed, or an answer that left others owed.
    since: std::sync::atomic::AtomicU64,
    start: std::time::Instant,
}

impl Owed {
    fn new(limit: Duration) -> Owed {
        Owed {
            limit,
            count: std::sync::atomic::AtomicI64::new(0),
            since: std::sync::atomic::AtomicU64::new(0),
            start: std::time::Instant::now(),
        }
    }

    fn now(&self) -> u64 {
        self.start.elapsed().as_nanos() as u64
    }

    /// Called by the pump only (one task), so nothing else raises the count between the
    /// check and the increment; the clock starts before the count says a request is owed.
    fn handed_over(&self) {
        use std::sync::atomic::Ordering;
        if self.count.load(Ordering::Acquire) <= 0 {
            self.since.store(self.now(), Ordering::Release);
        }
        self.count.fetch_add(1, Ordering::AcqRel);
    }

    /// An answer is progress: the clock restarts for the requests still owed.
    fn answered(&self) {
        use std::sync::atomic::Ordering;
        self.since.store(self.now(), Ordering::Release);
        self.count.fetch_sub(1, Ordering::AcqRel);
    }

    /// How long the stream has owed an answer without answering; `None` when it owes none.
    fn waiting(&self) -> Option<Duration> {
        use std::sync::atomic::Ordering;
        (self.count.load(Ordering::Acquire) > 0)
            .then(|| Duration::from_nanos(self.now().saturating_sub(self.since.load(Ordering::Acquire))))
    }

    fn overdue(&self) -> bool {
        self.waiting().is_some_and(|w| w >= self.limit)
    }

    /// Until the oldest owed request is overdue (a full period when nothing is owed).
    fn time_left(&self) -> Duration {
        let left = self.limit.saturating_sub(self.waiting().unwrap_or_default());
        left.max(Duration::from_millis(1))
    }

    /// Resolves once the oldest owed request is overdue; never while nothing is owed.
    async fn overdue_at_last(&self) {
        loop {
            tokio::time::sleep(self.time_left()).await;
            if self.overdue() {
                return;
            }
        }
    }
}

/// Aborts a task when dropped: the request pump of a replication stream ends with the
/// stream's answers.
struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// The answers of a replication stream, read until the peer closes the stream, or until the
/// pump ended (its input ended or the stream broke) and every request it handed over is
/// answered; an error from `given_up` when the stream owes answers and gets none for
/// [`STREAM_ANSWER_TIMEOUT`].
///
/// The second end does not wait for the peer's close: the frame that ends the request
/// stream, or the one that ends the answers, may be lost on a flaky link while the
/// connection lives on (its pings answered again once the link came back). The stream then
/// owes nothing, so no deadline runs, and openraft would wait on it forever, sending this
/// follower nothing more. The answers are all there, so the session ends, the stream is
/// reset, and openraft's next session starts.
/// What a replication stream handed to its peer, so that openraft is given an answer only
/// when it cannot credit it to a request taken long after.
///
/// openraft stamps each append request with the time it takes it from the request stream, and
/// credits the leader's lease (and a read index's quorum) with the stamp of the latest request
/// whose last log id an answer covers (`InflightAppendQueue::drain_acked`). A commit notice
/// carries no entries, so its last log id is that of the request before it: an answer to that
/// earlier request, read after the notice was taken, was credited with the notice's later
/// stamp. Normally the two are a round trip apart, well within the lease's margin; but after a
/// pause of the leader's process (SIGSTOP, a stalled VM), answers its peers sent before the
/// pause and that it read after it were credited with a stamp taken after it: the lease looked
/// fresh, and a `linearizable` read served a value older than a write the new leader had
/// acknowledged meanwhile (found by a black-box linearizability check). Such an answer, when
/// the notice was taken more than a slack (half a heartbeat: the lease's margin is at least an
/// election timeout) after its request was sent, is not passed on: the answer to a later
/// request covers as much, and goes instead. No request is taken from openraft while it
/// credits an answer, so none can slip in between the look and the credit.
#[derive(Default)]
struct Handed {
    /// Requests sent and not answered, oldest first.
    unanswered: std::collections::VecDeque<SentAppend>,
    /// openraft has an answer it has not credited yet.
    crediting: bool,
    /// The pump, waiting for that.
    pump: Option<std::task::Waker>,
}

/// One request [`Handed`] over.
struct SentAppend {
    /// When it was handed to the connection.
    at: std::time::Instant,
    /// The last log id it covers.
    last: Option<LogId>,
    /// When openraft last produced a request covering no more than it (a commit notice).
    covered_at: Option<std::time::Instant>,
}

impl Handed {
    fn lock(handed: &Mutex<Handed>) -> std::sync::MutexGuard<'_, Handed> {
        handed.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// `rpc` goes to the peer.
    fn sent(handed: &Mutex<Handed>, rpc: &AppendEntriesRequest<TypeConfig>) {
        let sent = SentAppend { at: std::time::Instant::now(), last: last_log_id(rpc), covered_at: None };
        Handed::lock(handed).unanswered.push_back(sent);
    }

    /// openraft produced a request covering up to `last`.
    fn taken(&mut self, last: Option<LogId>) {
        let now = std::time::Instant::now();
        for sent in self.unanswered.iter_mut().rev().take_while(|sent| sent.last >= last) {
            sent.covered_at = Some(now);
        }
    }

    /// The oldest request sent was answered, a success when `flushed`: true when openraft may
    /// have the answer, false when a request it produced more than `slack` after that one was
    /// sent covers no more (that request's answer, or a later one's, goes instead).
    fn to_credit(handed: &Mutex<Handed>, flushed: bool, slack: Duration) -> bool {
        let mut handed = Handed::lock(handed);
        let answered = handed.unanswered.pop_front();
        let covered_late = flushed
            && answered.is_some_and(|sent| sent.covered_at.is_some_and(|at| at.duration_since(sent.at) >= slack));
        handed.crediting = !covered_late;
        !covered_late
    }

    /// openraft has credited the last answer: requests may be taken again.
    fn credited(handed: &Mutex<Handed>) {
        let mut handed = Handed::lock(handed);
        handed.crediting = false;
        if let Some(pump) = handed.pump.take() {
            pump.wake();
        }
    }
}

/// The last log id an append request covers: its last entry's, or with none the one before it.
fn last_log_id(rpc: &AppendEntriesRequest<TypeConfig>) -> Option<LogId> {
    use openraft::entry::RaftEntry;
    rpc.entries.last().map(|e| e.log_id()).or(rpc.prev_log_id)
}

/// openraft's request stream, taken from only while it credits no answer, noting what each
/// request covers against those sent before it ([`Handed`]).
struct Stamped<S> {
    input: S,
    handed: Arc<Mutex<Handed>>,
}

impl<S> Stream for Stamped<S>
where
    S: Stream<Item = AppendEntriesRequest<TypeConfig>> + Unpin,
{
    type Item = AppendEntriesRequest<TypeConfig>;

    fn poll_next(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Self::Item>> {
        let this = &mut *self;
        let mut handed = Handed::lock(&this.handed);
        if handed.crediting {
            handed.pump = Some(cx.waker().clone());
            return std::task::Poll::Pending;
        }
        // openraft stamps the request in this poll, under the lock.
        let next = this.input.poll_next_unpin(cx);
        if let std::task::Poll::Ready(Some(rpc)) = &next {
            handed.taken(last_log_id(rpc));
        }
        next
    }
}

fn answers<R>(
    responses: R,
    owed: Arc<Owed>,
    handed: Arc<Mutex<Handed>>,
    slack: Duration,
    pump: AbortOnDrop,
    given_up: impl Fn() -> RpcError + Clone + Send + 'static,
) -> impl Stream<Item = Result<StreamAppendResult<TypeConfig>, RpcError>> + Send + 'static
where
    R: Stream<Item = Result<pb::StreamAppendResponse, tonic::Status>> + Send + Unpin + 'static,
{
    struct Reading<R> {
        responses: R,
        /// The pump lives as long as the answers are read.
        pump: AbortOnDrop,
        pump_ended: bool,
    }
    let reading = Reading { responses, pump, pump_ended: false };
    futures::stream::unfold(Some(reading), move |reading| {
        let owed = owed.clone();
        let handed = handed.clone();
        let given_up = given_up.clone();
        async move {
            let mut reading = reading?;
            // openraft asks for the next answer once it has credited the last one.
            Handed::credited(&handed);
            loop {
                if reading.pump_ended && owed.waiting().is_none() {
                    return None;
                }
                tokio::select! {
                    biased;
                    next = reading.responses.next() => match next {
                        None => return None,
                        Some(item) => {
                            owed.answered();
                            let result = item.map_err(unreachable).and_then(stream_append_result);
                            if Handed::to_credit(&handed, matches!(result, Ok(Ok(_))), slack) {
                                return Some((result, Some(reading)));
                            }
                        }
                    },
                    _ = &mut reading.pump.0, if !reading.pump_ended => reading.pump_ended = true,
                    _ = owed.overdue_at_last() => return Some((Err(given_up()), None)),
                }
            }
        }
    })
}

/// Replaces the pooled connection to a peer when a vote sent over it got no answer: openraft
/// gives up on a vote after the minimum election timeout and drops the call, and this guard,
/// dropped with it, makes the next call to the peer open a new connection.
///
/// Votes are unary calls on the connection every group shares with the peer. A connection
/// that stopped carrying requests (frames lost on a link that came back, a peer that was
/// paused) would otherwise keep failing every election round of a group whose only other
/// traffic to that peer is votes: nothing else would notice and replace it. Replacing costs
/// little: calls already running keep their connection until they end.
struct VoteInFlight<'a> {
    pool: &'a ChannelPool,
    addr: &'a str,
    answered: bool,
}

impl<'a> VoteInFlight<'a> {
    fn new(pool: &'a ChannelPool, addr: &'a str) -> VoteInFlight<'a> {
        VoteInFlight { pool, addr, answered: false }
    }

    /// The call ended with the peer's answer, or with an error that is not a lost request.
    fn ended(&mut self, result: &Result<tonic::Response<pb::VoteResponse>, tonic::Status>) {
        self.answered = !matches!(result, Err(status) if status.code() == tonic::Code::DeadlineExceeded);
    }
}

impl Drop for VoteInFlight<'_> {
    fn drop(&mut self) {
        if !self.answered {
            self.pool.forget(self.addr);
        }
    }
}

/// Where a group reports that a follower refused its snapshot as damaged (DATA_LOSS): the
/// node then hands the group's leadership to a healthy replica (`Node::run`). Bounded
/// ([`DAMAGE_REPORTS_MAX`]); a report that finds it full is dropped, since the damage is
/// reported again by the next refused snapshot or scrub pass.
pub type DamageReports = tokio::sync::mpsc::Sender<GroupId>;

/// Damage reports a node holds before the hand-off task takes them.
pub const DAMAGE_REPORTS_MAX: usize = 1024;

/// Creates connections for one group.
pub struct NetworkFactory {
    group: GroupId,
    pool: Arc<ChannelPool>,
    calls: Arc<Calls>,
    damage: DamageReports,
    /// `Some`: the group's commit notices may be held back ([`COMMIT_NOTICE_HOLD`]).
    commit_release: Option<CommitNoticeRelease>,
}

impl NetworkFactory {
    pub fn new(
        group: GroupId,
        pool: Arc<ChannelPool>,
        calls: Arc<Calls>,
        damage: DamageReports,
        commit_release: Option<CommitNoticeRelease>,
    ) -> NetworkFactory {
        NetworkFactory { group, pool, calls, damage, commit_release }
    }
}

impl RaftNetworkFactory<TypeConfig> for NetworkFactory {
    type Network = GroupConnection;

    async fn new_client(&mut self, target: ReplicaId, node: &pb::Node) -> GroupConnection {
        GroupConnection {
            header: pb::GroupHeader { group_id: self.group, target_replica: target },
            addr: node.rpc_addr.clone(),
            pool: self.pool.clone(),
            calls: self.calls.clone(),
            heartbeat_refused_at: None,
            damage: self.damage.clone(),
            commit_release: self.commit_release.clone(),
        }
    }
}

/// A group's view of one peer replica.
pub struct GroupConnection {
    header: pb::GroupHeader,
    addr: String,
    pool: Arc<ChannelPool>,
    calls: Arc<Calls>,
    /// When the peer last refused a heartbeat call (an older node): heartbeats go on append
    /// streams for [`RETRY_UNSUPPORTED`] after it.
    heartbeat_refused_at: Option<std::time::Instant>,
    damage: DamageReports,
    commit_release: Option<CommitNoticeRelease>,
}

fn unreachable(e: impl std::fmt::Display) -> RpcError {
    RpcError::Unreachable(Unreachable::from_string(e.to_string()))
}

fn with_deadline<T>(msg: T, option: &RPCOption) -> tonic::Request<T> {
    let mut request = tonic::Request::new(msg);
    request.set_timeout(option.hard_ttl().min(RPC_TIMEOUT * 5));
    request
}

impl GroupConnection {
    fn client(&self) -> Result<RaftClient, RpcError> {
        self.pool.client(&self.addr).map_err(unreachable)
    }

    fn vote_request(&self, rpc: VoteRequest<TypeConfig>) -> pb::VoteRequest {
        pb::VoteRequest {
            header: Some(self.header),
            vote: Some(wire::vote_to_pb(&rpc.vote)),
            last_log_id: wire::opt_log_id_to_pb(rpc.last_log_id.as_ref()),
            leadership_transfer: rpc.leadership_transfer,
        }
    }
}

fn append_request_to_pb(header: pb::GroupHeader, rpc: &AppendEntriesRequest<TypeConfig>) -> pb::AppendEntriesRequest {
    pb::AppendEntriesRequest {
        header: Some(header),
        vote: Some(wire::vote_to_pb(&rpc.vote)),
        prev_log_id: wire::opt_log_id_to_pb(rpc.prev_log_id.as_ref()),
        entries: rpc.entries.iter().map(wire::entry_to_pb).collect(),
        leader_commit: wire::opt_log_id_to_pb(rpc.leader_commit.as_ref()),
    }
}

fn stream_append_result(resp: pb::StreamAppendResponse) -> Result<StreamAppendResult<TypeConfig>, RpcError> {
    use pb::stream_append_response::Result as R;
    match wire::required(resp.result, "StreamAppendResponse", "result").map_err(unreachable)? {
        R::Flushed(l) => Ok(Ok(Some(wire::log_id_from_pb(&l)))),
        R::Accepted(_) => Ok(Ok(None)),
        R::Conflict(l) => Ok(Err(StreamAppendError::Conflict(wire::log_id_from_pb(&l)))),
        R::HigherVote(v) => Ok(Err(StreamAppendError::HigherVote(wire::vote_from_pb(&v)))),
    }
}

/// The requests openraft handed to `stream_append`, after a look at how they start.
enum AppendInput<S> {
    /// The input ended before its first request.
    Empty,
    /// One request, and the input ended right after it (a heartbeat, when it has no entries).
    Lone(AppendEntriesRequest<TypeConfig>, futures::stream::Fuse<S>),
    /// The start of a stream: the requests already taken, then the rest of the input.
    Stream(Vec<AppendEntriesRequest<TypeConfig>>, futures::stream::Fuse<S>),
}

/// Takes the first request, then polls the input once more without waiting: a lone request
/// is told from the start of a replication stream, and a request already there is kept. The
/// input is fused: openraft's streams must not be polled again once they ended, and the rest
/// handed back may be chained after the requests taken whatever way the input went.
async fn peek_input<S>(input: S) -> AppendInput<S>
where
    S: Stream<Item = AppendEntriesRequest<TypeConfig>> + Unpin,
{
    let mut input = input.fuse();
    let Some(first) = input.next().await else {
        return AppendInput::Empty;
    };
    match input.next().now_or_never() {
        Some(None) => AppendInput::Lone(first, input),
        Some(Some(second)) => AppendInput::Stream(vec![first, second], input),
        None => AppendInput::Stream(vec![first], input),
    }
}

/// Longest a request of a replication stream that carries only a new commit index is held
/// back for the stream's next request, which carries the same commit or a later one and
/// replaces it. Tokio's timer rounds it up to its 1 ms tick.
pub const COMMIT_NOTICE_HOLD: Duration = Duration::from_micros(500);

/// The read indexes a group's leader replica answered, which let its held commit notices go.
#[derive(Debug, Default)]
pub struct CommitRelease {
    /// The highest read index answered.
    wanted: std::sync::atomic::AtomicU64,
    /// Wakes the notices held when a read index is answered.
    notify: tokio::sync::Notify,
}

impl CommitRelease {
    /// A follower was answered the read index `index` and waits until it applied it: the
    /// notices held now go, and so does every later one until its stream has sent a commit
    /// at or beyond `index`.
    pub fn release(&self, index: u64) {
        self.wanted.fetch_max(index, Ordering::AcqRel);
        self.notify.notify_waiters();
    }
}

/// Shared by a group's replica and the connections of its Raft instance.
pub type CommitNoticeRelease = Arc<CommitRelease>;

/// `rpc`, or the request of the stream that replaces it, and whether the input ended.
///
/// A request without entries that follows others of the stream only tells the follower a
/// new commit index (the leader sends one each time its commit advances while it has no
/// new entries for the follower). The next request of the stream starts where it starts and
/// carries the same or a later commit, so it may take its place: the follower applies a
/// little later, and handles one message, one apply and one answer instead of two. The
/// hold ends with the next request, after `hold` ([`COMMIT_NOTICE_HOLD`]), or when a read
/// index is answered ([`CommitRelease`]); there is none while a read index answered is
/// beyond `sent_commit`, the commit index the stream sent last. Raft is unaffected: a replaced request is one the network could have lost,
/// and openraft matches answers by log id, not one to one.
async fn commit_notice_or_successor<S>(
    mut rpc: AppendEntriesRequest<TypeConfig>,
    input: &mut S,
    hold: Duration,
    release: &CommitRelease,
    sent_commit: u64,
    stats: &AppendStats,
) -> (AppendEntriesRequest<TypeConfig>, bool)
where
    S: Stream<Item = AppendEntriesRequest<TypeConfig>> + Unpin,
{
    if !rpc.entries.is_empty() {
        return (rpc, false);
    }
    // Waits for wake-ups from here on, so a read index answered after the look below is not missed.
    let released = release.notify.notified();
    tokio::pin!(released);
    if release.wanted.load(Ordering::Acquire) > sent_commit {
        return (rpc, false);
    }
    let hold = tokio::time::sleep(hold);
    tokio::pin!(hold);
    loop {
        tokio::select! {
            next = input.next() => match next {
                Some(next) => {
                    stats.commit_notices_replaced.fetch_add(1, Ordering::Relaxed);
                    rpc = next;
                    if !rpc.entries.is_empty() {
                        return (rpc, false);
                    }
                }
                None => return (rpc, true),
            },
            _ = &mut hold => return (rpc, false),
            _ = &mut released => return (rpc, false),
        }
    }
}

/// Sends a heartbeat as a call on the peer's call stream: `None` when the peer does not know
/// the call (an older node), so the caller sends it on an append stream instead.
///
/// The call runs in a task of its own with the deadline of the other calls ([`RPC_TIMEOUT`]):
/// openraft gives up on a heartbeat after one heartbeat interval and drops this future, but
/// the call lives on, so a call stream that stopped answering is found and replaced
/// ([`Calls::call`]) even when heartbeats are all that travel on it.
async fn heartbeat_call(
    calls: &Arc<Calls>,
    addr: &str,
    header: pb::GroupHeader,
    rpc: &AppendEntriesRequest<TypeConfig>,
) -> Option<Result<StreamAppendResult<TypeConfig>, RpcError>> {
    use pb::call_response::Result as Answer;
    let call = Call::Heartbeat(append_request_to_pb(header, rpc));
    let (calls, addr) = (calls.clone(), addr.to_string());
    let answer = tokio::spawn(async move { calls.call(&addr, call, RPC_TIMEOUT).await });
    let answer = match answer.await {
        Ok(answer) => answer,
        Err(e) => return Some(Err(unreachable(format!("heartbeat call task failed: {e}")))),
    };
    match answer {
        Ok(Answer::Heartbeat(resp)) => Some(stream_append_result(resp)),
        Ok(other) => Some(Err(unreachable(format!("heartbeat answered with another call's answer: {other:?}")))),
        Err(e) if e.unsupported() => None,
        Err(e) => Some(Err(unreachable(e.status().message()))),
    }
}

fn vote_response(resp: pb::VoteResponse) -> Result<VoteResponse<TypeConfig>, RpcError> {
    let vote = wire::required(resp.vote, "VoteResponse", "vote").map_err(unreachable)?;
    Ok(VoteResponse::new(
        wire::vote_from_pb(&vote),
        wire::opt_log_id_from_pb(resp.last_log_id.as_ref()),
        resp.vote_granted,
    ))
}

fn snapshot_unreachable(e: &dyn std::fmt::Display) -> StreamingError {
    StreamingError::Unreachable(Unreachable::from_string(e.to_string()))
}

impl GroupConnection {
    /// Streams a snapshot's files to the target and returns its answer. The transfer fails
    /// when the transport takes no chunk for `stall_limit` while some wait (a connection whose
    /// flow-control window was lost on a flaky link takes none, while its pings still pass),
    /// and the connection to that peer is replaced, so openraft retries on a new one instead of
    /// waiting out [`SNAPSHOT_TIMEOUT`].
    async fn send_snapshot(
        &mut self,
        header: pb::SnapshotHeader,
        files: SnapshotData,
        cancel: impl Future<Output = ReplicationClosed> + Send + 'static,
        stall_limit: Duration,
    ) -> Result<pb::SnapshotResponse, StreamingError> {
        let mut client = self.pool.client(&self.addr).map_err(|e| snapshot_unreachable(&e))?;
        let owed = Arc::new(Owed::new(stall_limit));
        let (tx, rx) = tokio::sync::mpsc::channel::<pb::SnapshotChunk>(4);
        let producer = {
            let owed = owed.clone();
            AbortOnDrop(tokio::spawn(async move {
                if let Err(e) = send_snapshot_files(header, files, tx, &owed).await {
                    tracing::debug!(error = %e, "snapshot transfer stopped");
                }
            }))
        };
        let taken = owed.clone();
        let stream = futures::stream::unfold(rx, move |mut rx| {
            let taken = taken.clone();
            async move {
                let chunk = rx.recv().await?;
                taken.answered();
                Some((chunk, rx))
            }
        });
        let mut request = tonic::Request::new(stream);
        request.set_timeout(SNAPSHOT_TIMEOUT);
        let resp = tokio::select! {
            r = client.install_snapshot(request) => r,
            closed = cancel => return Err(StreamingError::Closed(closed)),
            _ = owed.overdue_at_last() => {
                self.pool.forget(&self.addr);
                let e = format!("the snapshot transfer took no chunk for {stall_limit:?}");
                return Err(snapshot_unreachable(&e));
            }
        };
        drop(producer);
        if let Err(status) = &resp
            && status.code() == tonic::Code::DataLoss
        {
            tracing::error!(
                group = self.header.group_id,
                follower = self.header.target_replica,
                reason = status.message(),
                "a follower refused this replica's snapshot as damaged"
            );
            let _ = self.damage.try_send(self.header.group_id);
        }
        resp.map(tonic::Response::into_inner).map_err(|e| snapshot_unreachable(&e))
    }
}

impl RaftNetworkV2<TypeConfig> for GroupConnection {
    type SnapshotData = SnapshotData;

    async fn append_entries(
        &mut self,
        rpc: AppendEntriesRequest<TypeConfig>,
        option: RPCOption,
    ) -> Result<AppendEntriesResponse<TypeConfig>, RpcError> {
        let request = append_request_to_pb(self.header, &rpc);
        let resp =
            self.client()?.append_entries(with_deadline(request, &option)).await.map_err(unreachable)?.into_inner();
        use pb::append_entries_response::Result as R;
        match wire::required(resp.result, "AppendEntriesResponse", "result").map_err(unreachable)? {
            R::Success(_) => Ok(AppendEntriesResponse::Success),
            R::PartialSuccess(p) => {
                Ok(AppendEntriesResponse::PartialSuccess(wire::opt_log_id_from_pb(p.last_log_id.as_ref())))
            }
            R::Conflict(_) => Ok(AppendEntriesResponse::Conflict),
            R::HigherVote(v) => Ok(AppendEntriesResponse::HigherVote(wire::vote_from_pb(&v))),
        }
    }

    fn stream_append<'s, S>(
        &'s mut self,
        input: S,
        option: RPCOption,
    ) -> BoxFuture<'s, Result<BoxStream<'s, Result<StreamAppendResult<TypeConfig>, RpcError>>, RpcError>>
    where
        S: Stream<Item = AppendEntriesRequest<TypeConfig>> + Send + Unpin + 'static,
    {
        let header = self.header;
        let client = self.client();
        let (pool, calls, addr) = (self.pool.clone(), self.calls.clone(), self.addr.clone());
        let refused_at = &mut self.heartbeat_refused_at;
        let release = self.commit_release.clone();
        Box::pin(async move {
            // openraft sends a heartbeat as a stream of one append without entries (one per
            // follower per heartbeat, and per round of `strict` reads). It goes as one call on
            // the call stream to the peer instead of opening an HTTP/2 stream of its own: the
            // opening, the server's task and the pump below cost more than the heartbeat.
            let (taken, rest) = match peek_input(input).await {
                AppendInput::Empty => return Ok(Box::pin(futures::stream::empty()) as BoxStream<'s, _>),
                AppendInput::Lone(first, rest) if first.entries.is_empty() => {
                    let refused = refused_at.is_some_and(|at| at.elapsed() < RETRY_UNSUPPORTED);
                    if !refused {
                        if let Some(result) = heartbeat_call(&calls, &addr, header, &first).await {
                            calls.heartbeats.calls.fetch_add(1, Ordering::Relaxed);
                            return Ok(Box::pin(futures::stream::once(async { result })) as BoxStream<'s, _>);
                        }
                        *refused_at = Some(std::time::Instant::now());
                    }
                    calls.heartbeats.streams.fetch_add(1, Ordering::Relaxed);
                    (vec![first], rest)
                }
                AppendInput::Lone(first, rest) => (vec![first], rest),
                AppendInput::Stream(taken, rest) => (taken, rest),
            };
            let handed = Arc::new(Mutex::new(Handed::default()));
            let input = Stamped { input: futures::stream::iter(taken).chain(rest), handed: handed.clone() };
            let mut client = client?;
            // Requests handed over and not yet answered: a stream that owes answers and gets
            // none for STREAM_ANSWER_TIMEOUT fails, so openraft replicates again on a new
            // stream, over a new connection, instead of waiting forever on one whose bytes
            // were lost. A request is owed from the moment openraft hands it over, not from
            // when HTTP/2 takes it: a stream whose send window was lost (its WINDOW_UPDATE
            // frames dropped on a flaky link) never takes the next request, and would
            // otherwise owe nothing while pings keep its connection alive.
            let owed = Arc::new(Owed::new(STREAM_ANSWER_TIMEOUT));
            let (queue, queued) = tokio::sync::mpsc::channel::<pb::AppendEntriesRequest>(1);
            let pump = {
                let (owed, handed) = (owed.clone(), handed.clone());
                let (release, calls) = (release.clone(), calls.clone());
                let mut input = input;
                tokio::spawn(async move {
                    // The first request may be a probe: it goes at once.
                    let mut first = true;
                    let mut sent_commit = 0;
                    while let Some(rpc) = input.next().await {
                        let (rpc, ended) = match &release {
                            Some(release) if !first => {
                                let (hold, stats) = (COMMIT_NOTICE_HOLD, &calls.appends);
                                commit_notice_or_successor(rpc, &mut input, hold, release, sent_commit, stats).await
                            }
                            _ => (rpc, false),
                        };
                        first = false;
                        sent_commit = rpc.leader_commit.map_or(0, |c| c.index);
                        calls.appends.requests.fetch_add(1, Ordering::Relaxed);
                        owed.handed_over();
                        // Noted before it leaves: its answer may come back at once.
                        Handed::sent(&handed, &rpc);
                        if queue.send(append_request_to_pb(header, &rpc)).await.is_err() || ended {
                            break;
                        }
                    }
                })
            };
            let pump = AbortOnDrop(pump);
            let requests = futures::stream::unfold(queued, |mut queued| async move {
                queued.recv().await.map(|request| (request, queued))
            });
            let given_up = |pool: &ChannelPool, addr: &str| {
                // The next stream goes over a new connection: this one may still answer pings
                // while its data no longer flows.
                pool.forget(addr);
                unreachable(format!("no append answer within {STREAM_ANSWER_TIMEOUT:?} on the replication stream"))
            };
            // The peer answers the stream's opening once it has the first request: a
            // connection that cannot carry it would keep the opening waiting too.
            let responses = tokio::select! {
                opened = client.stream_append(requests) => opened.map_err(unreachable)?.into_inner(),
                _ = owed.overdue_at_last() => return Err(given_up(&pool, &addr)),
            };
            let slack = option.hard_ttl() / 2;
            let results = answers(responses, owed, handed, slack, pump, move || given_up(&pool, &addr));
            Ok(Box::pin(results) as BoxStream<'s, _>)
        })
    }

    async fn vote(
        &mut self,
        rpc: VoteRequest<TypeConfig>,
        option: RPCOption,
    ) -> Result<VoteResponse<TypeConfig>, RpcError> {
        let request = self.vote_request(rpc);
        let mut client = self.client()?;
        let mut in_flight = VoteInFlight::new(&self.pool, &self.addr);
        let result = client.vote(with_deadline(request, &option)).await;
        in_flight.ended(&result);
        vote_response(result.map_err(unreachable)?.into_inner())
    }

    async fn pre_vote(
        &mut self,
        rpc: VoteRequest<TypeConfig>,
        option: RPCOption,
    ) -> Result<VoteResponse<TypeConfig>, RpcError> {
        let request = self.vote_request(rpc);
        let mut client = self.client()?;
        let mut in_flight = VoteInFlight::new(&self.pool, &self.addr);
        let result = client.pre_vote(with_deadline(request, &option)).await;
        in_flight.ended(&result);
        vote_response(result.map_err(unreachable)?.into_inner())
    }

    async fn full_snapshot(
        &mut self,
        vote: Vote,
        snapshot: openraft::alias::SnapshotOf<TypeConfig, SnapshotData>,
        cancel: impl Future<Output = ReplicationClosed> + Send + 'static,
        _option: RPCOption,
    ) -> Result<SnapshotResponse<TypeConfig>, StreamingError> {
        let meta = &snapshot.meta;
        let header = pb::SnapshotHeader {
            header: Some(self.header),
            vote: Some(wire::vote_to_pb(&vote)),
            last_log_id: wire::opt_log_id_to_pb(meta.last_log_id.as_ref()),
            last_membership_log_id: wire::opt_log_id_to_pb(meta.last_membership.log_id().as_ref()),
            last_membership: Some(wire::membership_to_pb(meta.last_membership.membership())),
        };
        let resp = self.send_snapshot(header, snapshot.snapshot.clone(), cancel, SNAPSHOT_STALL_TIMEOUT).await?;
        let vote = wire::required(resp.vote, "SnapshotResponse", "vote").map_err(|e| snapshot_unreachable(&e))?;
        Ok(SnapshotResponse { vote: wire::vote_from_pb(&vote) })
    }

    async fn transfer_leader(
        &mut self,
        req: openraft::raft::TransferLeaderRequest<TypeConfig>,
        option: RPCOption,
    ) -> Result<openraft::raft::TransferLeaderResponse<TypeConfig>, RpcError> {
        use openraft::raft::TransferLeaderError;
        let request = pb::TransferLeaderRequest {
            header: Some(self.header),
            from_leader: Some(wire::vote_to_pb(req.from_leader())),
            to_replica: *req.to_node_id(),
            last_log_id: wire::opt_log_id_to_pb(req.last_log_id()),
        };
        let resp =
            self.client()?.transfer_leader(with_deadline(request, &option)).await.map_err(unreachable)?.into_inner();
        use pb::transfer_leader_response::Result as R;
        let vote = |v: Option<pb::Vote>| v.map(|v| wire::vote_from_pb(&v));
        match wire::required(resp.result, "TransferLeaderResponse", "result").map_err(unreachable)? {
            R::Ok(_) => Ok(Ok(())),
            R::VoteChanged(v) => {
                let (Some(expected), Some(actual)) = (vote(v.expected_vote), vote(v.actual_vote)) else {
                    return Err(unreachable("vote_changed without votes"));
                };
                Ok(Err(TransferLeaderError::VoteChanged { expected, actual }))
            }
            R::LogNotFlushed(v) => Ok(Err(TransferLeaderError::LogNotFlushed {
                expected: wire::opt_log_id_from_pb(v.expected_log_id.as_ref()),
                actual: wire::opt_log_id_from_pb(v.actual_log_id.as_ref()),
            })),
        }
    }

    fn backoff(&self) -> Option<Backoff> {
        Some(Backoff::new(std::iter::successors(Some(Duration::from_millis(50)), |d| {
            Some((*d * 2).min(Duration::from_millis(1000)))
        })))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::types::Entry;
    use crate::types::EntryPayload;
    use openraft::entry::RaftEntry;

    fn append(index: u64) -> AppendEntriesRequest<TypeConfig> {
        AppendEntriesRequest {
            vote: Vote::new(1, 1),
            prev_log_id: None,
            leader_commit: Some(wire::log_id_from_pb(&pb::LogId { term: 1, index })),
            entries: vec![],
        }
    }

    fn commit_index(rpc: &AppendEntriesRequest<TypeConfig>) -> u64 {
        rpc.leader_commit.map_or(0, |l| l.index)
    }

    /// A stream that yields `requests`, ends, and panics if polled after it ended (as
    /// openraft's request streams may).
    fn strict_input(
        requests: Vec<AppendEntriesRequest<TypeConfig>>,
    ) -> impl Stream<Item = AppendEntriesRequest<TypeConfig>> + Unpin {
        let mut requests = requests.into_iter();
        let mut ended = false;
        futures::stream::poll_fn(move |_| {
            assert!(!ended, "polled after it ended");
            let next = requests.next();
            ended = next.is_none();
            std::task::Poll::Ready(next)
        })
    }

    fn log_id(index: u64) -> LogId {
        wire::log_id_from_pb(&pb::LogId { term: 1, index })
    }

    /// An append after `prev` with entries up to `last` (none when `last == prev`).
    fn covering(prev: u64, last: u64) -> AppendEntriesRequest<TypeConfig> {
        let entries = ((prev + 1)..=last).map(|i| Entry::new(log_id(i), EntryPayload::Blank)).collect();
        AppendEntriesRequest { prev_log_id: Some(log_id(prev)), entries, ..append(prev) }
    }

    #[tokio::test]
    async fn an_answer_is_withheld_when_a_commit_notice_taken_late_after_its_request_covers_as_much() {
        let handed = Arc::new(Mutex::new(Handed::default()));
        let (tx, rx) = futures::channel::mpsc::unbounded();
        let mut input = Stamped { input: rx, handed: handed.clone() };
        let mut send = |rpc| {
            tx.unbounded_send(rpc).expect("send");
            let rpc = input.next().now_or_never().flatten().expect("a request");
            Handed::sent(&handed, &rpc);
        };
        // No slack: any commit notice taken after a request counts as late.
        let late = Duration::ZERO;

        // Entries 1..=10, then a commit notice taken before the answer to them came.
        send(covering(0, 10));
        send(covering(10, 10));
        // The answer to the entries would be credited with the notice's stamp: withheld; the
        // notice's own answer goes.
        assert!(!Handed::to_credit(&handed, true, late));
        assert!(Handed::to_credit(&handed, true, late));
        Handed::credited(&handed);

        // A request taken after with entries of its own covers more: the answer goes.
        send(covering(10, 12));
        send(covering(12, 15));
        assert!(Handed::to_credit(&handed, true, late));
        Handed::credited(&handed);
        // So does an answer with nothing taken after it.
        assert!(Handed::to_credit(&handed, true, late));
        Handed::credited(&handed);

        // A notice taken within the slack (a round trip, not a pause) does not hold the answer
        // back, and an answer that is not a success (a conflict, a higher vote) always goes.
        send(covering(15, 15));
        send(covering(15, 15));
        send(covering(15, 15));
        assert!(Handed::to_credit(&handed, true, Duration::from_secs(3600)));
        Handed::credited(&handed);
        assert!(Handed::to_credit(&handed, false, late));
    }

    #[tokio::test]
    async fn no_request_is_taken_from_openraft_while_it_credits_an_answer() {
        let handed = Arc::new(Mutex::new(Handed::default()));
        let (tx, rx) = futures::channel::mpsc::unbounded();
        let mut input = Stamped { input: rx, handed: handed.clone() };
        tx.unbounded_send(covering(0, 3)).expect("send");
        let first = input.next().now_or_never().flatten().expect("a request");
        Handed::sent(&handed, &first);
        assert!(Handed::to_credit(&handed, true, Duration::ZERO));
        tx.unbounded_send(covering(3, 3)).expect("send");
        assert!(input.next().now_or_never().is_none(), "taken while openraft credits an answer");
        Handed::credited(&handed);
        assert_eq!(input.next().now_or_never().flatten().map(|r| last_log_id(&r)), Some(Some(log_id(3))));
    }

    #[tokio::test]
    async fn a_lone_request_is_told_apart_and_its_input_never_polled_after_it_ended() {
        let AppendInput::Lone(first, rest) = peek_input(strict_input(vec![append(7)])).await else {
            panic!("a lone request was not told apart");
        };
        assert_eq!(commit_index(&first), 7);
        // Sent on an append stream after all (a peer that refuses heartbeat calls).
        let sent: Vec<u64> = futures::stream::iter(vec![first]).chain(rest).map(|r| commit_index(&r)).collect().await;
        assert_eq!(sent, [7]);
    }

    #[tokio::test]
    async fn requests_already_there_start_the_stream_in_order() {
        let AppendInput::Stream(taken, rest) = peek_input(strict_input(vec![append(1), append(2), append(3)])).await
        else {
            panic!("three requests were not taken for a stream");
        };
        let sent: Vec<u64> = futures::stream::iter(taken).chain(rest).map(|r| commit_index(&r)).collect().await;
        assert_eq!(sent, [1, 2, 3]);
    }

    #[tokio::test]
    async fn a_stream_whose_next_request_is_not_there_yet_is_not_a_lone_request() {
        let (tx, rx) = futures::channel::mpsc::unbounded();
        tx.unbounded_send(append(1)).expect("send");
        let AppendInput::Stream(taken, mut rest) = peek_input(rx).await else {
            panic!("a stream still open was taken for a lone request");
        };
        assert_eq!(taken.iter().map(commit_index).collect::<Vec<_>>(), [1]);
        tx.unbounded_send(append(2)).expect("send");
        drop(tx);
        assert_eq!(rest.next().await.as_ref().map(commit_index), Some(2));
        assert!(rest.next().await.is_none());
    }

    fn with_entry(index: u64) -> AppendEntriesRequest<TypeConfig> {
        let log_id = wire::log_id_from_pb(&pb::LogId { term: 1, index });
        AppendEntriesRequest { entries: vec![Entry::new(log_id, EntryPayload::Blank)], ..append(index) }
    }

    /// Runs the hold of `first` over `input` (the stream sent commit 3 last) and returns the
    /// commit index of the request sent, whether the input ended, its entries, and how many
    /// requests it replaced.
    async fn hold<S>(
        first: AppendEntriesRequest<TypeConfig>,
        input: &mut S,
        hold: Duration,
        release: &CommitRelease,
    ) -> (u64, bool, usize, u64)
    where
        S: Stream<Item = AppendEntriesRequest<TypeConfig>> + Unpin,
    {
        let stats = AppendStats::default();
        let (sent, ended) = commit_notice_or_successor(first, input, hold, release, 3, &stats).await;
        (commit_index(&sent), ended, sent.entries.len(), stats.commit_notices_replaced.load(Ordering::Relaxed))
    }

    const AN_HOUR: Duration = Duration::from_secs(3600);

    #[tokio::test]
    async fn a_request_with_entries_is_never_held() {
        let (_tx, mut rx) = futures::channel::mpsc::unbounded::<AppendEntriesRequest<TypeConfig>>();
        assert_eq!(hold(with_entry(4), &mut rx, AN_HOUR, &CommitRelease::default()).await, (4, false, 1, 0));
    }

    #[tokio::test]
    async fn commit_notices_are_replaced_by_the_next_request_with_entries() {
        let release = CommitRelease::default();
        let mut input = strict_input(vec![append(5), append(6), with_entry(7), append(8)]);
        assert_eq!(hold(append(4), &mut input, AN_HOUR, &release).await, (7, false, 1, 3));
        // The notice after it waits again, then goes when the input ends.
        let next = input.next().await.expect("a request");
        assert_eq!(hold(next, &mut input, AN_HOUR, &release).await, (8, true, 0, 0));
    }

    #[tokio::test]
    async fn a_commit_notice_goes_after_its_hold_when_nothing_follows() {
        let (_tx, mut rx) = futures::channel::mpsc::unbounded::<AppendEntriesRequest<TypeConfig>>();
        let started = std::time::Instant::now();
        let release = CommitRelease::default();
        assert_eq!(hold(append(4), &mut rx, COMMIT_NOTICE_HOLD, &release).await, (4, false, 0, 0));
        assert!(started.elapsed() >= COMMIT_NOTICE_HOLD);
    }

    #[tokio::test]
    async fn a_held_commit_notice_goes_at_once_when_a_read_index_is_answered() {
        let (_tx, mut rx) = futures::channel::mpsc::unbounded::<AppendEntriesRequest<TypeConfig>>();
        let release = Arc::new(CommitRelease::default());
        let releaser = {
            let release = release.clone();
            tokio::spawn(async move {
                // Answered while the notice is held (this test runs on one thread).
                tokio::task::yield_now().await;
                release.release(4);
            })
        };
        let held = hold(append(4), &mut rx, AN_HOUR, &release);
        assert_eq!(tokio::time::timeout(Duration::from_secs(10), held).await.expect("released"), (4, false, 0, 0));
        releaser.await.expect("releaser");
    }

    #[tokio::test]
    async fn notices_are_not_held_while_a_read_index_answered_is_beyond_the_commit_sent() {
        let (_tx, mut rx) = futures::channel::mpsc::unbounded::<AppendEntriesRequest<TypeConfig>>();
        let release = CommitRelease::default();
        // Answered before the notice carrying it reached the stream.
        release.release(5);
        let held = hold(append(4), &mut rx, AN_HOUR, &release);
        assert_eq!(tokio::time::timeout(Duration::from_secs(10), held).await.expect("not held"), (4, false, 0, 0));
        // A read index the stream already sent a commit for (3, in `hold`) keeps nobody waiting.
        let release = CommitRelease::default();
        release.release(3);
        let (_tx, mut rx) = futures::channel::mpsc::unbounded::<AppendEntriesRequest<TypeConfig>>();
        let held = hold(append(6), &mut rx, Duration::from_millis(50), &release);
        let started = std::time::Instant::now();
        assert_eq!(held.await, (6, false, 0, 0));
        assert!(started.elapsed() >= Duration::from_millis(50));
    }

    #[tokio::test]
    async fn an_input_without_requests_is_empty() {
        assert!(matches!(peek_input(strict_input(vec![])).await, AppendInput::Empty));
    }

    /// A peer's answer that entries up to `index` are flushed.
    fn flushed(index: u64) -> Result<pb::StreamAppendResponse, tonic::Status> {
        let log_id = pb::LogId { term: 1, index };
        Ok(pb::StreamAppendResponse { result: Some(pb::stream_append_response::Result::Flushed(log_id)) })
    }

    type Peer = futures::channel::mpsc::UnboundedSender<Result<pb::StreamAppendResponse, tonic::Status>>;

    /// The answers of a stream whose pump handed `handed_over` requests over and ended (as when
    /// openraft's input ended), after the peer answered those up to each of `answered`; the
    /// peer can answer more, and never closes the stream while it is kept.
    async fn answers_after(
        handed_over: usize,
        answered: &[u64],
    ) -> (Peer, impl Stream<Item = Result<StreamAppendResult<TypeConfig>, RpcError>>) {
        let owed = Arc::new(Owed::new(STREAM_ANSWER_TIMEOUT));
        let handed = Arc::new(Mutex::new(Handed::default()));
        let pump = {
            let (owed, handed) = (owed.clone(), handed.clone());
            AbortOnDrop(tokio::spawn(async move {
                for i in 0..handed_over {
                    owed.handed_over();
                    Handed::sent(&handed, &append(i as u64));
                }
            }))
        };
        while owed.waiting().is_none() {
            tokio::task::yield_now().await;
        }
        let (peer, responses) = futures::channel::mpsc::unbounded();
        for &index in answered {
            peer.unbounded_send(flushed(index)).expect("send");
        }
        let never_given_up = || unreachable("given up");
        (peer, answers(responses, owed, handed, Duration::ZERO, pump, never_given_up))
    }

    #[tokio::test]
    async fn the_answers_end_once_the_input_ended_and_all_are_answered_though_the_close_never_comes() {
        // The peer answered both requests; the frame that would close its answers was lost.
        let (_peer, read) = answers_after(2, &[1, 2]).await;
        let read = tokio::time::timeout(Duration::from_secs(5), read.collect::<Vec<_>>());
        let read = read.await.expect("the answers end without the close");
        let flushed: Vec<_> = read.into_iter().map(|r| r.expect("answer").expect("success")).collect();
        assert_eq!(flushed.iter().map(|l| l.map(|l| l.index)).collect::<Vec<_>>(), vec![Some(1), Some(2)]);
    }

    #[tokio::test]
    async fn the_answers_wait_for_every_request_handed_over_after_the_input_ended() {
        let (peer, read) = answers_after(2, &[1]).await;
        let mut read = std::pin::pin!(read);
        assert!(read.next().await.is_some_and(|r| r.is_ok()), "the first answer");
        let early = tokio::time::timeout(Duration::from_millis(200), read.next()).await;
        assert!(early.is_err(), "the second request is still owed an answer: {early:?}");
        peer.unbounded_send(flushed(2)).expect("send");
        let second = read.next().await.expect("the second answer").expect("answer").expect("success");
        assert_eq!(second.map(|l| l.index), Some(2));
        let end = tokio::time::timeout(Duration::from_secs(5), read.next()).await;
        assert!(matches!(end, Ok(None)), "then the answers end: {end:?}");
    }

    #[test]
    fn a_stream_owing_nothing_is_never_overdue() {
        let owed = Owed::new(STREAM_ANSWER_TIMEOUT);
        assert!(!owed.overdue());
        assert_eq!(owed.time_left(), STREAM_ANSWER_TIMEOUT);
        owed.handed_over();
        owed.answered();
        assert!(!owed.overdue());
        assert_eq!(owed.time_left(), STREAM_ANSWER_TIMEOUT);
    }

    #[test]
    fn the_deadline_runs_from_the_oldest_unanswered_request_and_restarts_on_an_answer() {
        let owed = Owed::new(STREAM_ANSWER_TIMEOUT);
        // An idle stream for a long time, then a request: it has the whole period.
        owed.since.store(0, std::sync::atomic::Ordering::Release);
        std::thread::sleep(Duration::from_millis(30));
        owed.handed_over();
        assert!(owed.time_left() > STREAM_ANSWER_TIMEOUT - Duration::from_millis(20), "{:?}", owed.time_left());
        // A stream that started 20 s ago and has owed a request since its start: overdue,
        // and a second request does not restart the clock of the first.
        let start = std::time::Instant::now().checked_sub(Duration::from_secs(20)).expect("an instant 20 s ago");
        let old = Owed { start, ..Owed::new(STREAM_ANSWER_TIMEOUT) };
        old.handed_over();
        old.since.store(0, std::sync::atomic::Ordering::Release);
        old.handed_over();
        assert!(old.overdue());
        // One answer while another is owed: progress, the clock restarts.
        old.answered();
        assert!(!old.overdue());
        assert!(old.waiting().is_some(), "one request is still owed");
    }

    fn pooled(pool: &ChannelPool, addr: &str) -> bool {
        pool.channels.lock().unwrap_or_else(|p| p.into_inner()).contains_key(addr)
    }

    /// A peer whose kernel accepts connections while the process reads nothing (paused, or
    /// behind a link that drops its bytes), and a group's connection to it.
    struct SilentPeer {
        _listener: std::net::TcpListener,
        _damage_reports: tokio::sync::mpsc::Receiver<GroupId>,
        addr: String,
        pool: Arc<ChannelPool>,
        connection: GroupConnection,
    }

    fn silent_peer() -> SilentPeer {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let addr = listener.local_addr().expect("address").to_string();
        let pool = Arc::new(ChannelPool::new(None, None).expect("pool"));
        let (damage, damage_reports) = tokio::sync::mpsc::channel(1);
        let connection = GroupConnection {
            header: pb::GroupHeader { group_id: 7, target_replica: 2 },
            addr: addr.clone(),
            pool: pool.clone(),
            calls: Arc::new(Calls::new(pool.clone())),
            heartbeat_refused_at: None,
            damage,
            commit_release: None,
        };
        SilentPeer { _listener: listener, _damage_reports: damage_reports, addr, pool, connection }
    }

    #[tokio::test]
    async fn a_vote_the_peer_never_answers_replaces_the_pooled_connection() {
        let peer = silent_peer();
        let SilentPeer { addr, pool, mut connection, .. } = peer; // the listener lives until the end
        for pre_vote in [false, true] {
            pool.client(&addr).expect("client");
            let rpc = VoteRequest::new(Vote::new(3, 1), None);
            let option = RPCOption::new(Duration::from_secs(5));
            // openraft's election: at most the minimum election timeout, then the call is dropped.
            let vote = async {
                if pre_vote { connection.pre_vote(rpc, option).await } else { connection.vote(rpc, option).await }
            };
            assert!(tokio::time::timeout(Duration::from_millis(300), vote).await.is_err(), "the peer answers nothing");
            assert!(!pooled(&pool, &addr), "the next vote (pre_vote: {pre_vote}) goes over a new connection");
        }
    }

    #[tokio::test]
    async fn a_snapshot_transfer_the_transport_stops_taking_fails_and_replaces_the_connection() {
        // HTTP/2 takes what the initial send window allows, then nothing more, as when a
        // flaky link lost the window updates.
        let peer = silent_peer();
        let SilentPeer { addr, pool, mut connection, .. } = peer; // the listener lives until the end
        let dir = tempfile::tempdir().expect("snapshot dir");
        std::fs::write(dir.path().join("meta.json"), b"{}").expect("meta");
        std::fs::write(dir.path().join("segment"), vec![7u8; 8 * SNAPSHOT_CHUNK_BYTES]).expect("file");
        let files = SnapshotData { dir: dir.path().to_path_buf() };
        pool.client(&addr).expect("client");
        let never_cancelled = std::future::pending::<ReplicationClosed>();
        let stall = Duration::from_millis(300);
        let sent = connection.send_snapshot(pb::SnapshotHeader::default(), files, never_cancelled, stall);
        let sent = tokio::time::timeout(Duration::from_secs(20), sent).await.expect("the stall is found");
        assert!(matches!(sent, Err(StreamingError::Unreachable(_))), "{sent:?}");
        assert!(!pooled(&pool, &addr), "the next transfer goes over a new connection");
    }

    #[tokio::test]
    async fn a_vote_answered_or_refused_by_the_peer_keeps_the_connection() {
        let pool = ChannelPool::new(None, None).expect("pool");
        let addr = "127.0.0.1:9";
        pool.client(addr).expect("client");
        VoteInFlight::new(&pool, addr).ended(&Ok(tonic::Response::new(pb::VoteResponse::default())));
        assert!(pooled(&pool, addr), "an answer");
        VoteInFlight::new(&pool, addr).ended(&Err(tonic::Status::not_found("no replica of group 7 here")));
        assert!(pooled(&pool, addr), "a refusal is an answer");
        VoteInFlight::new(&pool, addr).ended(&Err(tonic::Status::deadline_exceeded("no answer in time")));
        assert!(!pooled(&pool, addr), "a deadline that passed is no answer");
    }
}
