//! Node-to-node calls multiplexed on one long-lived stream per peer node.
//!
//! A follower's linearizable read asks the leader's node for a read index, and a
//! forwarded produce goes to the partition leader's node: small calls, thousands
//! per second. As unary gRPC each one opens an HTTP/2 stream (HEADERS both ways,
//! a server task per stream), which costs more CPU than the read it serves. Here
//! the calls to one peer share one bidirectional `Calls` stream: a request is one
//! message on it, concurrent requests leave in one write, and each answer is
//! matched to its caller by the id it repeats.
//!
//! The request stream sends nothing until the peer accepted the stream, so a
//! call that fails because the stream could not be opened was never sent
//! ([`CallError::NotSent`]): for a forwarded produce, definitely not written.
//!
//! A peer without `Calls` (an older node) answers UNIMPLEMENTED; callers then
//! use the unary RPC, and the stream is not tried again for [`RETRY_UNSUPPORTED`].

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::Mutex;
use std::sync::atomic::AtomicU64;
use std::sync::atomic::Ordering;
use std::time::Duration;
use std::time::Instant;

use tokio::sync::mpsc;
use tokio::sync::oneshot;
use tokio::sync::watch;
use tonic::Status;

use crate::network::ChannelPool;
use crate::network::RaftClient;
use crate::pb;
use crate::pb::call_request::Call;
use crate::pb::call_response::Result as Answer;

/// How long a peer that answered UNIMPLEMENTED is called over unary RPCs before
/// the stream is tried again (it may have been upgraded meanwhile).
pub const RETRY_UNSUPPORTED: Duration = Duration::from_secs(30);
/// Requests queued for one peer before callers wait for room.
const QUEUE: usize = 4096;

/// Why a call got no answer from the peer.
#[derive(Debug)]
pub enum CallError {
    /// The stream to the peer could not be opened: the request never left this node.
    NotSent(Status),
    /// The peer answered with an error, the stream broke after the request may have been
    /// sent, or no answer came in time: the call's effect is unknown.
    Failed(Status),
}

impl CallError {
    pub fn status(&self) -> &Status {
        match self {
            CallError::NotSent(s) | CallError::Failed(s) => s,
        }
    }

    /// The peer does not know the call (or the stream): use the unary RPC.
    pub fn unsupported(&self) -> bool {
        self.status().code() == tonic::Code::Unimplemented
    }
}

/// The call streams of a node, one per peer address.
pub struct Calls {
    pool: Arc<ChannelPool>,
    peers: Mutex<HashMap<String, Arc<CallStream>>>,
    /// How this node's leader replicas sent their heartbeats.
    pub heartbeats: HeartbeatStats,
    /// What this node's leader replicas sent on their replication streams.
    pub appends: AppendStats,
}

/// Heartbeats sent by the leader replicas of a node, by how they travelled.
#[derive(Debug, Default)]
pub struct HeartbeatStats {
    /// As one call on the peer's call stream.
    pub calls: AtomicU64,
    /// On an append stream of their own, because the peer does not take them as calls.
    pub streams: AtomicU64,
}

/// Requests sent on the replication streams of a node's leader replicas.
#[derive(Debug, Default)]
pub struct AppendStats {
    /// Requests sent.
    pub requests: AtomicU64,
    /// Requests that carried only a commit index and were replaced by the next request of
    /// their stream (see `network::COMMIT_NOTICE_HOLD`).
    pub commit_notices_replaced: AtomicU64,
}

impl Calls {
    pub fn new(pool: Arc<ChannelPool>) -> Calls {
        Calls {
            pool,
            peers: Mutex::new(HashMap::new()),
            heartbeats: HeartbeatStats::default(),
            appends: AppendStats::default(),
        }
    }

    /// Sends `call` to the node at `addr` and waits at most `timeout` for its answer.
    ///
    /// A call that times out while its stream answered nothing for as long ends the stream
    /// (its other calls fail as "effect unknown") and replaces the pooled connection: the
    /// peer is gone or the connection stopped carrying data, and the next call starts afresh.
    pub async fn call(&self, addr: &str, call: Call, timeout: Duration) -> Result<Answer, CallError> {
        let stream = self.stream(addr)?;
        let result = stream.call(call, timeout).await;
        if let Err(CallError::Failed(status)) = &result
            && status.code() == tonic::Code::DeadlineExceeded
            && stream.silent_for(timeout)
        {
            stream.close(Status::unavailable(format!("the call stream to {addr} answered nothing in {timeout:?}")));
            self.pool.forget(addr);
        }
        result
    }

    /// The open stream to `addr`, or a new one when there is none or it ended.
    fn stream(&self, addr: &str) -> Result<Arc<CallStream>, CallError> {
        let mut peers = self.peers.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(stream) = peers.get(addr) {
            match stream.ended() {
                None => return Ok(stream.clone()),
                Some((status, at)) if status.code() == tonic::Code::Unimplemented => {
                    if at.elapsed() < RETRY_UNSUPPORTED {
                        return Err(CallError::NotSent(status));
                    }
                }
                Some(_) => {}
            }
        }
        let client = self.pool.client(addr).map_err(|e| CallError::NotSent(Status::unavailable(e.to_string())))?;
        let stream = CallStream::open(client);
        peers.insert(addr.to_string(), stream.clone());
        Ok(stream)
    }
}

type Reply = oneshot::Sender<Result<Answer, CallError>>;

/// One `Calls` stream to a peer.
struct CallStream {
    requests: mpsc::Sender<pb::CallRequest>,
    state: Mutex<StreamState>,
    next_id: AtomicU64,
    /// Stops the stream's task (and with it the HTTP/2 stream) when the stream is given up.
    closed: tokio::sync::Notify,
}

struct StreamState {
    pending: HashMap<u64, Reply>,
    /// Why and when the stream ended; no call waits on an ended stream.
    ended: Option<(Status, Instant)>,
    /// When the stream last delivered an answer (or was opened).
    last_answer: Instant,
}

impl CallStream {
    fn open(client: RaftClient) -> Arc<CallStream> {
        let (requests, queued) = mpsc::channel(QUEUE);
        let state = StreamState { pending: HashMap::new(), ended: None, last_answer: Instant::now() };
        let stream = Arc::new(CallStream {
            requests,
            state: Mutex::new(state),
            next_id: AtomicU64::new(1),
            closed: tokio::sync::Notify::new(),
        });
        tokio::spawn(stream.clone().drive(client, queued));
        stream
    }

    fn state(&self) -> std::sync::MutexGuard<'_, StreamState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn ended(&self) -> Option<(Status, Instant)> {
        self.state().ended.clone()
    }

    /// Whether the stream delivered no answer for at least `period`.
    fn silent_for(&self, period: Duration) -> bool {
        self.state().last_answer.elapsed() >= period
    }

    async fn call(&self, call: Call, timeout: Duration) -> Result<Answer, CallError> {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let (reply, answer) = oneshot::channel();
        {
            let mut state = self.state();
            if let Some((status, _)) = &state.ended {
                return Err(CallError::NotSent(status.clone()));
            }
            state.pending.insert(id, reply);
        }
        // Removes the pending entry when this call ends without its answer (timeout, or the
        // caller dropped), so an unanswered call does not stay behind.
        let _pending = PendingGuard { stream: self, id };
        let request = pb::CallRequest { id, call: Some(call) };
        let exchange = async {
            // A send fails only once the stream ended; its end answers this call then.
            let _ = self.requests.send(request).await;
            answer.await
        };
        match tokio::time::timeout(timeout, exchange).await {
            Ok(Ok(result)) => result,
            Ok(Err(_)) => Err(CallError::Failed(Status::unavailable("the call stream ended without an answer"))),
            Err(_) => {
                Err(CallError::Failed(Status::deadline_exceeded(format!("no answer from the peer in {timeout:?}"))))
            }
        }
    }

    /// Opens the stream, then hands every answer to its caller until the stream ends.
    async fn drive(self: Arc<CallStream>, mut client: RaftClient, queued: mpsc::Receiver<pb::CallRequest>) {
        // Requests wait until the peer accepted the stream: a failed open then sent nothing.
        let (accepted_tx, mut accepted) = watch::channel(false);
        let outgoing = async_stream_of(async move {
            if accepted.wait_for(|a| *a).await.is_err() {
                return None;
            }
            Some(queued)
        });
        let opened = client.calls(outgoing).await;
        let mut answers = match opened {
            Ok(response) => response.into_inner(),
            Err(status) => {
                self.end(status, false);
                return;
            }
        };
        let _ = accepted_tx.send(true);
        let status = loop {
            tokio::select! {
                message = answers.message() => match message {
                    Ok(Some(answer)) => self.answer(answer),
                    Ok(None) => break Status::unavailable("the peer closed the call stream"),
                    Err(status) => break status,
                },
                _ = self.closed.notified() => break Status::cancelled("the call stream was given up"),
            }
        };
        self.end(status, true);
    }

    fn answer(&self, answer: pb::CallResponse) {
        let reply = {
            let mut state = self.state();
            state.last_answer = Instant::now();
            state.pending.remove(&answer.id)
        };
        let Some(reply) = reply else { return };
        let result = match answer.result {
            Some(Answer::Error(e)) => Err(CallError::Failed(Status::new(tonic::Code::from(e.code), e.message))),
            Some(result) => Ok(result),
            None => Err(CallError::Failed(Status::internal("empty call answer"))),
        };
        let _ = reply.send(result);
    }

    /// Gives the stream up: fails its waiting calls as maybe sent and stops its task.
    fn close(&self, status: Status) {
        self.end(status, true);
        self.closed.notify_one();
    }

    /// Marks the stream ended and fails every waiting call; `sent` says whether their
    /// requests may have reached the peer.
    fn end(&self, status: Status, sent: bool) {
        let pending = {
            let mut state = self.state();
            if state.ended.is_some() {
                return;
            }
            state.ended = Some((status.clone(), Instant::now()));
            std::mem::take(&mut state.pending)
        };
        if sent {
            tracing::debug!(error = %status, waiting = pending.len(), "call stream to a peer ended");
        }
        for (_, reply) in pending {
            let error = if sent { CallError::Failed(status.clone()) } else { CallError::NotSent(status.clone()) };
            let _ = reply.send(Err(error));
        }
    }
}

struct PendingGuard<'a> {
    stream: &'a CallStream,
    id: u64,
}

impl Drop for PendingGuard<'_> {
    fn drop(&mut self) {
        self.stream.state().pending.remove(&self.id);
    }
}

/// The requests of a stream: nothing until `gate` yields the queue, then everything queued.
fn async_stream_of(
    gate: impl std::future::Future<Output = Option<mpsc::Receiver<pb::CallRequest>>> + Send + 'static,
) -> impl futures::Stream<Item = pb::CallRequest> + Send + 'static {
    enum Step<G> {
        Gate(std::pin::Pin<Box<G>>),
        Open(mpsc::Receiver<pb::CallRequest>),
    }
    futures::stream::unfold(Step::Gate(Box::pin(gate)), |step| async move {
        let mut queued = match step {
            Step::Gate(gate) => gate.await?,
            Step::Open(queued) => queued,
        };
        let request = queued.recv().await?;
        Some((request, Step::Open(queued)))
    })
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use tonic::Request;
    use tonic::Response;
    use tonic::Status;
    use tonic::Streaming;

    use super::*;
    use crate::pb::raft_service_server::RaftService;
    use crate::pb::raft_service_server::RaftServiceServer;

    /// A peer that answers each read-index call with its group id as the index, later calls
    /// first (group 0 only after 200 ms). Its first stream may instead behave as `first`.
    #[derive(Clone, Default)]
    struct EchoPeer {
        first: FirstStream,
        used: Arc<std::sync::atomic::AtomicBool>,
    }

    #[derive(Clone, Copy, Default, PartialEq)]
    enum FirstStream {
        #[default]
        Answers,
        /// Answers nothing and fails once this many calls arrived.
        BreaksAfter(usize),
        /// Answers nothing and stays open.
        Silent,
    }

    /// A peer of an older version: every method answers UNIMPLEMENTED.
    struct OldPeer;

    #[tonic::async_trait]
    impl RaftService for OldPeer {}

    #[tonic::async_trait]
    impl RaftService for EchoPeer {
        async fn calls(
            &self,
            request: Request<Streaming<pb::CallRequest>>,
        ) -> Result<Response<crate::service::CallAnswers>, Status> {
            let mut input = request.into_inner();
            let (tx, rx) = mpsc::channel(64);
            let first = if self.used.swap(true, Ordering::SeqCst) { FirstStream::Answers } else { self.first };
            tokio::spawn(async move {
                let mut seen = 0;
                while let Ok(Some(request)) = input.message().await {
                    seen += 1;
                    match first {
                        FirstStream::BreaksAfter(n) if n == seen => {
                            let _ = tx.send(Err(Status::internal("peer broke the stream"))).await;
                            return;
                        }
                        FirstStream::BreaksAfter(_) | FirstStream::Silent => continue,
                        FirstStream::Answers => {}
                    }
                    let Some(Call::ReadIndex(read)) = request.call else {
                        let _ = tx.send(Err(Status::invalid_argument("not a read-index call"))).await;
                        return;
                    };
                    let group = read.header.map_or(0, |h| h.group_id);
                    let tx = tx.clone();
                    tokio::spawn(async move {
                        let delay = if group == 0 {
                            Duration::from_millis(200)
                        } else {
                            Duration::from_micros(2000 - group * 10)
                        };
                        tokio::time::sleep(delay).await;
                        let answer = Answer::ReadIndex(pb::ReadIndexResponse {
                            read_log_id: Some(pb::LogId { term: 1, index: group }),
                        });
                        let _ = tx.send(Ok(pb::CallResponse { id: request.id, result: Some(answer) })).await;
                    });
                }
            });
            let answers = futures::stream::unfold(rx, |mut rx| async move { rx.recv().await.map(|a| (a, rx)) });
            Ok(Response::new(Box::pin(answers)))
        }
    }

    async fn serve<S: RaftService>(peer: S) -> String {
        let incoming =
            tonic::transport::server::TcpIncoming::bind("127.0.0.1:0".parse().expect("address")).expect("bind");
        let addr = incoming.local_addr().expect("local address").to_string();
        let server = tonic::transport::Server::builder().add_service(RaftServiceServer::new(peer));
        tokio::spawn(server.serve_with_incoming(incoming));
        addr
    }

    fn calls() -> Calls {
        Calls::new(Arc::new(ChannelPool::new(None, None).expect("pool")))
    }

    fn read_index(group: u64) -> Call {
        Call::ReadIndex(pb::ReadIndexRequest {
            header: Some(pb::GroupHeader { group_id: group, target_replica: 1 }),
            strict: false,
        })
    }

    fn index_of(answer: Answer) -> u64 {
        match answer {
            Answer::ReadIndex(r) => r.read_log_id.expect("read log id").index,
            other => panic!("unexpected answer {other:?}"),
        }
    }

    #[tokio::test]
    async fn concurrent_calls_each_get_their_own_answer_out_of_order() {
        let addr = serve(EchoPeer::default()).await;
        let calls = calls();
        let results =
            futures::future::join_all((1..=150u64).map(|g| calls.call(&addr, read_index(g), Duration::from_secs(5))))
                .await;
        for (g, result) in (1..=150u64).zip(results) {
            assert_eq!(index_of(result.expect("call answered")), g);
        }
        // All went over one stream, which stays open for the next call.
        assert!(calls.peers.lock().expect("peers")[&addr].ended().is_none());
        assert_eq!(index_of(calls.call(&addr, read_index(7), Duration::from_secs(5)).await.expect("call answered")), 7);
    }

    #[tokio::test]
    async fn a_peer_without_call_streams_is_reported_unsupported_and_not_sent() {
        let addr = serve(OldPeer).await;
        let calls = calls();
        let error = calls.call(&addr, read_index(1), Duration::from_secs(5)).await.expect_err("call fails");
        assert!(error.unsupported(), "{error:?}");
        assert!(matches!(error, CallError::NotSent(_)), "{error:?}");
        // Remembered: the next call fails the same way without opening a stream.
        let again = calls.call(&addr, read_index(1), Duration::from_secs(5)).await.expect_err("call fails");
        assert!(again.unsupported() && matches!(again, CallError::NotSent(_)), "{again:?}");
    }

    #[tokio::test]
    async fn a_call_to_a_closed_port_is_not_sent() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let addr = listener.local_addr().expect("local address").to_string();
        drop(listener);
        let error = calls().call(&addr, read_index(1), Duration::from_secs(5)).await.expect_err("call fails");
        assert!(matches!(error, CallError::NotSent(_)), "{error:?}");
        assert!(!error.unsupported());
    }

    #[tokio::test]
    async fn a_broken_stream_fails_waiting_calls_as_maybe_sent_and_the_next_call_reopens() {
        let addr = serve(EchoPeer { first: FirstStream::BreaksAfter(3), ..Default::default() }).await;
        let calls = calls();
        let results =
            futures::future::join_all((1..=3u64).map(|g| calls.call(&addr, read_index(g), Duration::from_secs(5))))
                .await;
        for result in results {
            let error = result.expect_err("call fails");
            assert!(matches!(error, CallError::Failed(_)), "{error:?}");
        }
        // A new stream, which answers.
        for g in [4, 5, 6, 7] {
            assert_eq!(
                index_of(calls.call(&addr, read_index(g), Duration::from_secs(5)).await.expect("call answered")),
                g
            );
        }
    }

    #[tokio::test]
    async fn a_late_answer_on_a_stream_that_keeps_answering_times_out_its_call_only() {
        let addr = serve(EchoPeer::default()).await;
        let calls = Arc::new(calls());
        assert_eq!(index_of(calls.call(&addr, read_index(5), Duration::from_secs(5)).await.expect("call answered")), 5);
        let stream = calls.peers.lock().expect("peers")[&addr].clone();
        // Group 0 is answered after 200 ms, past its 100 ms deadline, while other calls are
        // answered every 10 ms: the stream is not silent and stays.
        let busy = {
            let (calls, addr) = (calls.clone(), addr.clone());
            tokio::spawn(async move {
                for _ in 0..25 {
                    let _ = calls.call(&addr, read_index(5), Duration::from_secs(5)).await;
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
            })
        };
        let error = calls.call(&addr, read_index(0), Duration::from_millis(100)).await.expect_err("call fails");
        assert_eq!(error.status().code(), tonic::Code::DeadlineExceeded, "{error:?}");
        busy.await.expect("busy caller");
        assert!(stream.ended().is_none(), "the stream was given up: {:?}", stream.ended());
        assert!(Arc::ptr_eq(&stream, &calls.peers.lock().expect("peers")[&addr]));
        assert!(stream.state().pending.is_empty());
        assert_eq!(index_of(calls.call(&addr, read_index(9), Duration::from_secs(5)).await.expect("call answered")), 9);
    }

    #[tokio::test]
    async fn a_stream_silent_past_a_calls_deadline_is_given_up_and_the_next_call_reconnects() {
        let addr = serve(EchoPeer { first: FirstStream::Silent, ..Default::default() }).await;
        let calls = calls();
        let error = calls.call(&addr, read_index(1), Duration::from_millis(100)).await.expect_err("call fails");
        assert_eq!(error.status().code(), tonic::Code::DeadlineExceeded, "{error:?}");
        let silent = calls.peers.lock().expect("peers")[&addr].clone();
        assert!(silent.ended().is_some(), "the silent stream is given up");
        assert!(!calls.pool.channels.lock().expect("channels").contains_key(&addr), "the connection is dropped");
        assert_eq!(index_of(calls.call(&addr, read_index(4), Duration::from_secs(5)).await.expect("call answered")), 4);
        assert!(!Arc::ptr_eq(&silent, &calls.peers.lock().expect("peers")[&addr]), "a new stream answered");
    }
}
