//! The receiving side of the node-to-node transport.
//!
//! Dispatch is per request, concurrently across groups (no head-of-line
//! blocking between groups). A request for a group or replica this node does
//! not host is rejected, never applied to another replica.

use std::path::Path;
use std::path::PathBuf;
use std::sync::Arc;

use tonic::Request;
use tonic::Response;
use tonic::Status;
use tonic::Streaming;

use crate::network::ClusterIdentity;
use crate::node::HostedGroup;
use crate::node::Node;
use crate::node::leader_read_log_id;
use crate::pb;
use crate::pb::raft_service_server::RaftService;
use crate::pb::raft_service_server::RaftServiceServer;
use crate::snapshot::SnapshotFiles;
use crate::snapshot::SnapshotStore;
use crate::types::CONTROLLER_GROUP;
use crate::types::GroupId;
use crate::types::Raft;
use crate::types::SnapshotMeta;
use crate::types::StoredMembership;
use crate::types::TypeConfig;
use crate::wire;

/// Largest node-to-node message accepted (an append of many batches).
pub const MESSAGE_BYTES_MAX: usize = 64 * 1024 * 1024;

#[derive(Clone)]
pub struct Service {
    node: Node,
}

/// Calls answered concurrently on one `Calls` stream; the stream is not read further
/// until one ends. A sender has at most a few calls per group in flight (forwarded
/// produces are batched, read-index requests coalesced per group).
const CALLS_IN_FLIGHT: usize = 4096;
/// Longest a call of a `Calls` stream is worked on: the sender has given up by then
/// (it waits at most [`crate::node::OPERATION_TIMEOUT`]), and a call that hangs must not
/// hold its place among [`CALLS_IN_FLIGHT`].
const CALL_DEADLINE: std::time::Duration =
    crate::node::OPERATION_TIMEOUT.saturating_add(std::time::Duration::from_secs(1));

/// Checks every node-to-node call: its bearer token, when one is configured, and that it
/// comes from a node of this node's cluster, when both sides know their cluster's id
/// ([`ClusterIdentity`]).
#[derive(Clone)]
pub struct CheckPeer {
    expected: Option<String>,
    cluster: ClusterIdentity,
    /// This node's data-directory incarnation.
    incarnation: u64,
    /// When a refusal was last logged: a refused peer calls many times a second.
    warned_at: Arc<std::sync::Mutex<Option<std::time::Instant>>>,
}

/// Least time between two warnings of refused node-to-node calls.
const REFUSED_PEER_WARN_EVERY: std::time::Duration = std::time::Duration::from_secs(10);

/// The text of the refusal of a call meant for another data directory than this node's.
const STRANGER_REFUSAL: &str = "this node's data directory is not the one registered under its id";

/// The text of the refusal of a call from another cluster; `Node::register_loop` stops on it.
pub const FOREIGN_CLUSTER_REFUSAL: &str = "the caller belongs to another cluster";

/// The text of the refusal of a call from a node removed from the cluster; its
/// `Node::register_loop` stops on it.
pub const REMOVED_NODE_REFUSAL: &str = "the caller's node was removed from the cluster";

impl CheckPeer {
    /// Logs `why` (with the caller's address), at most every [`REFUSED_PEER_WARN_EVERY`].
    fn warn(&self, request: &tonic::Request<()>, why: &str) {
        let mut warned_at = self.warned_at.lock().unwrap_or_else(|p| p.into_inner());
        if warned_at.is_none_or(|at| at.elapsed() >= REFUSED_PEER_WARN_EVERY) {
            *warned_at = Some(std::time::Instant::now());
            let from = request.remote_addr().map_or_else(|| "a peer".to_string(), |a| a.to_string());
            tracing::warn!(from, "{why}");
        }
    }
}

impl tonic::service::Interceptor for CheckPeer {
    fn call(&mut self, request: tonic::Request<()>) -> Result<tonic::Request<()>, Status> {
        if let Some(expected) = &self.expected {
            let given = request
                .metadata()
                .get("authorization")
                .and_then(|v| v.to_str().ok())
                .and_then(|v| v.strip_prefix("Bearer "));
            let ok = given.is_some_and(|g| {
                g.len() == expected.len() && g.bytes().zip(expected.bytes()).fold(0u8, |a, (x, y)| a | (x ^ y)) == 0
            });
            if !ok {
                self.warn(
                    &request,
                    "refused a node-to-node call with a missing or wrong token: every node needs the same --rpc-token-file",
                );
                return Err(Status::unauthenticated("missing or wrong node-to-node token"));
            }
        }
        if let (Some(own), Some(theirs)) =
            (self.cluster.get(), ClusterIdentity::of_call(request.metadata(), crate::network::CLUSTER_ID_HEADER))
            && own != theirs
        {
            let why = format!(
                "refused a node-to-node call from a node of cluster {theirs:016x}: this node belongs to cluster \
                 {own:016x}. A node started on an empty data directory without --peers or --join forms a cluster \
                 of its own; one that replaces a member's address needs that member's data directory, or joins \
                 (--join) under a new id"
            );
            self.warn(&request, &why);
            return Err(Status::permission_denied(format!(
                "{FOREIGN_CLUSTER_REFUSAL} ({theirs:016x}); this node belongs to cluster {own:016x}"
            )));
        }
        let source = ClusterIdentity::of_call(request.metadata(), crate::network::SOURCE_INCARNATION_HEADER);
        if let Some(source) = source
            && self.cluster.is_removed(source)
        {
            self.warn(
                &request,
                "refused a node-to-node call from a node removed from the cluster (DELETE /cluster/nodes/{id}) that \
                 still runs on its old data directory (started again, or resumed): stop it for good",
            );
            return Err(Status::permission_denied(format!("{REMOVED_NODE_REFUSAL} (data directory {source:016x})")));
        }
        let target = ClusterIdentity::of_call(request.metadata(), crate::network::TARGET_INCARNATION_HEADER);
        if let Some(expected) = target
            && expected != self.incarnation
        {
            self.warn(
                &request,
                "refused a node-to-node call meant for the data directory this node's id was registered with: this \
                 node's data directory is another one (lost, or replaced by an empty one). Its peers hold what it \
                 acknowledged; a node whose data was lost joins under a new --node-id (--join), and the \
                 partitions move off the old id",
            );
            return Err(Status::permission_denied(format!(
                "{STRANGER_REFUSAL}: the caller expects data directory {expected:016x}, this node has {:016x}",
                self.incarnation
            )));
        }
        Ok(request)
    }
}

/// Whether a call that named `caller` as its cluster comes from another cluster than this
/// node's (both known). Long-lived streams ask it again for each message: a stream opened
/// before this node learnt its cluster's id ends at the first message after, and the caller's
/// next stream is refused when it opens.
fn from_another_cluster(own: &ClusterIdentity, caller: Option<u64>) -> bool {
    matches!((own.get(), caller), (Some(own), Some(caller)) if own != caller)
}

/// The tonic service for this node.
pub fn server(node: Node) -> tonic::service::interceptor::InterceptedService<RaftServiceServer<Service>, CheckPeer> {
    let expected = node.config().rpc_token.clone();
    let cluster = node.cluster_identity();
    let incarnation = node.incarnation();
    let server = RaftServiceServer::new(Service { node })
        .max_decoding_message_size(MESSAGE_BYTES_MAX)
        .max_encoding_message_size(MESSAGE_BYTES_MAX);
    tonic::service::interceptor::InterceptedService::new(
        server,
        CheckPeer { expected, cluster, incarnation, warned_at: Arc::default() },
    )
}

impl Service {
    /// Notes an append or a heartbeat from the controller's leader (`Node::controller_leader`).
    fn note_append(&self, header: Option<pb::GroupHeader>) {
        if header.is_some_and(|h| h.group_id == CONTROLLER_GROUP) {
            self.node.note_controller_contact();
        }
    }

    fn raft_for(&self, header: Option<pb::GroupHeader>) -> Result<Raft, Status> {
        let header = header.ok_or_else(|| Status::invalid_argument("missing group header"))?;
        if header.group_id == CONTROLLER_GROUP {
            if header.target_replica != self.node.node_id() {
                return Err(Status::failed_precondition(format!(
                    "controller replica {} is not on node {}",
                    header.target_replica,
                    self.node.node_id()
                )));
            }
            return Ok(self.node.controller_raft().clone());
        }
        Ok(self.hosted_for(header)?.raft.clone())
    }

    /// The partition replica `header` names, if this node hosts it.
    fn hosted_for(&self, header: pb::GroupHeader) -> Result<Arc<HostedGroup>, Status> {
        let hosted = self
            .node
            .group(header.group_id)
            .ok_or_else(|| Status::not_found(format!("group {} is not hosted here", header.group_id)))?;
        if hosted.replica_id != header.target_replica {
            return Err(Status::failed_precondition(format!(
                "group {} is hosted here as replica {}, not {}",
                header.group_id, hosted.replica_id, header.target_replica
            )));
        }
        Ok(hosted)
    }

    /// Reads a received partition snapshot whole before openraft is handed it: a damaged one
    /// (its leader's files rotted) is refused with DATA_LOSS, so the leader learns of it and
    /// this replica's group goes on. Installing it would fail inside openraft, which stops
    /// the group until the node restarts.
    fn check_received_snapshot(&self, group: GroupId, dir: &Path) -> Result<(), Status> {
        let Some(hosted) = self.node.group(group) else { return Ok(()) };
        match crate::tier::blocking(|| hosted.partition.verify_snapshot(dir)) {
            Ok(()) => Ok(()),
            Err(e) if e.is_corrupt_data() => {
                self.node.count_damaged_snapshot_refused();
                tracing::error!(group, error = %e, "refused a damaged snapshot from the leader");
                Err(Status::data_loss(format!("damaged snapshot refused: {e}")))
            }
            Err(e) => Err(Status::unavailable(format!("cannot check the received snapshot: {e}"))),
        }
    }

    async fn read_index_call(&self, req: pb::ReadIndexRequest) -> Result<pb::ReadIndexResponse, Status> {
        let read = match req.header {
            // A partition group's reads share linearizers (the controller's go one by one).
            Some(header) if header.group_id != CONTROLLER_GROUP => {
                let hosted = self.hosted_for(header)?;
                let read = hosted.leader_read_log_id(req.strict).await.map_err(fatal)?;
                // The follower that asked waits until it applied `read`: the commit notices held
                // back for its stream go now (a notice not yet held when this runs waits its hold out).
                hosted.commit_release.release(read.index);
                read
            }
            header => {
                let raft = self.raft_for(header)?;
                leader_read_log_id(&raft, CONTROLLER_GROUP, req.strict).await.map_err(fatal)?
            }
        };
        Ok(pb::ReadIndexResponse { read_log_id: Some(wire::log_id_to_pb(&read)) })
    }

    /// The read index of each group in `req`, concurrently, one outcome per header.
    async fn read_index_batch_call(&self, req: pb::ReadIndexBatchRequest) -> pb::ReadIndexBatchResponse {
        use pb::read_index_outcome::Result as Outcome;
        let strict = req.strict;
        let answers = futures::future::join_all(
            req.headers.into_iter().map(|h| self.read_index_call(pb::ReadIndexRequest { header: Some(h), strict })),
        )
        .await;
        let outcomes = answers
            .into_iter()
            .map(|answer| pb::ReadIndexOutcome {
                result: Some(match answer {
                    Ok(r) => Outcome::ReadIndex(r),
                    Err(s) => Outcome::Error(pb::CallError { code: s.code() as i32, message: s.message().to_string() }),
                }),
            })
            .collect();
        pb::ReadIndexBatchResponse { outcomes }
    }

    /// A heartbeat from the call stream, answered as the only item of an append stream.
    async fn heartbeat_call(&self, req: pb::AppendEntriesRequest) -> Result<pb::StreamAppendResponse, Status> {
        use futures::StreamExt;
        if !req.entries.is_empty() {
            return Err(Status::invalid_argument("a heartbeat carries no entries"));
        }
        self.note_append(req.header);
        let raft = self.raft_for(req.header)?;
        let rpc = append_request_from_pb(req)?;
        let answers = raft.stream_append(futures::stream::once(futures::future::ready(rpc)));
        let mut answers = std::pin::pin!(answers);
        match answers.next().await {
            Some(item) => stream_append_answer(item),
            None => Err(Status::unavailable("the replica answered nothing to the heartbeat")),
        }
    }

    async fn produce_call(&self, req: pb::ProduceRequest) -> Result<pb::ProduceResponse, Status> {
        let header = req.header.ok_or_else(|| Status::invalid_argument("missing group header"))?;
        let records: Vec<logdex_log::Record> = req.records.into_iter().map(wire::record_from_pb).collect();
        use pb::produce_response::Result as R;
        let result = match self.node.produce_records(header.group_id, records).await {
            Ok(base) => R::BaseOffset(base),
            Err(crate::Error::NotLeader { leader_node, .. }) => R::NotLeader(leader_node.unwrap_or(0)),
            Err(crate::Error::NotHosted { group }) => {
                return Err(Status::not_found(format!("group {group} is not hosted here")));
            }
            Err(crate::Error::Invalid(m)) => return Err(Status::invalid_argument(m)),
            Err(crate::Error::TooLarge(m)) => return Err(Status::out_of_range(m)),
            Err(crate::Error::Timeout(m)) => return Err(Status::deadline_exceeded(m)),
            Err(e) => return Err(Status::internal(e.to_string())),
        };
        Ok(pb::ProduceResponse { result: Some(result) })
    }

    /// A preferred replica asks for the leadership of its group (`crate::balance`).
    async fn leadership_call(&self, req: pb::LeadershipRequest) -> Result<pb::LeadershipResponse, Status> {
        let header = req.header.ok_or_else(|| Status::invalid_argument("missing group header"))?;
        match self.node.hand_leadership(header.group_id, req.replica_id).await {
            Ok(transferring) => Ok(pb::LeadershipResponse { transferring }),
            Err(crate::Error::NotHosted { group }) => {
                Err(Status::not_found(format!("group {group} is not hosted here")))
            }
            Err(e) => Err(Status::unavailable(e.to_string())),
        }
    }

    /// Answers one call of a `Calls` stream; a failure carries the status the unary RPC
    /// of the same call would have returned.
    async fn answer_call(&self, request: pb::CallRequest) -> pb::CallResponse {
        use pb::call_request::Call;
        use pb::call_response::Result as A;
        let id = request.id;
        let call = request.call;
        let work = async {
            match call {
                Some(Call::ReadIndex(r)) => self.read_index_call(r).await.map(A::ReadIndex),
                Some(Call::Produce(r)) => self.produce_call(r).await.map(A::Produce),
                Some(Call::ReadIndexBatch(r)) => {
                    // Test builds: `rpc::read_index_batch_unsupported=return` answers as a node
                    // from before `ReadIndexBatch` does (it decodes the call as empty).
                    fail::fail_point!("rpc::read_index_batch_unsupported", |_| Err(Status::unimplemented(
                        "unknown or empty call"
                    )));
                    Ok(A::ReadIndexBatch(self.read_index_batch_call(r).await))
                }
                Some(Call::Heartbeat(r)) => {
                    // Test builds: `rpc::heartbeat_call_unsupported=return` answers as a node from
                    // before heartbeat calls does (it decodes the call as empty).
                    fail::fail_point!("rpc::heartbeat_call_unsupported", |_| Err(Status::unimplemented(
                        "unknown or empty call"
                    )));
                    self.heartbeat_call(r).await.map(A::Heartbeat)
                }
                Some(Call::Leadership(r)) => self.leadership_call(r).await.map(A::Leadership),
                None => Err(Status::unimplemented("unknown or empty call")),
            }
        };
        let result = tokio::time::timeout(CALL_DEADLINE, work)
            .await
            .unwrap_or_else(|_| Err(Status::deadline_exceeded(format!("call not done in {CALL_DEADLINE:?}"))));
        let result = result
            .unwrap_or_else(|s| A::Error(pb::CallError { code: s.code() as i32, message: s.message().to_string() }));
        pb::CallResponse { id, result: Some(result) }
    }
}

async fn install_received(
    raft: &Raft,
    vote: Option<pb::Vote>,
    last_log_id: Option<pb::LogId>,
    last_membership_log_id: Option<pb::LogId>,
    last_membership: Option<pb::Membership>,
    dir: &Path,
) -> Result<Response<pb::SnapshotResponse>, Status> {
    let vote = wire::vote_from_pb(&wire::required(vote, "SnapshotHeader", "vote").map_err(bad)?);
    let membership =
        wire::membership_from_pb(&wire::required(last_membership, "SnapshotHeader", "last_membership").map_err(bad)?)
            .map_err(bad)?;
    let meta = SnapshotMeta {
        last_log_id: wire::opt_log_id_from_pb(last_log_id.as_ref()),
        last_membership: StoredMembership::new(wire::opt_log_id_from_pb(last_membership_log_id.as_ref()), membership),
    };
    let snapshot = openraft::alias::SnapshotOf::<TypeConfig, SnapshotFiles> {
        meta,
        snapshot: SnapshotFiles { dir: dir.to_path_buf() },
    };
    let resp = raft.install_full_snapshot(vote, snapshot).await.map_err(fatal)?;
    Ok(Response::new(pb::SnapshotResponse { vote: Some(wire::vote_to_pb(&resp.vote)) }))
}

/// One answer of an append stream on the wire.
fn stream_append_answer<E: std::fmt::Display>(
    item: Result<openraft::raft::StreamAppendResult<crate::types::TypeConfig>, E>,
) -> Result<pb::StreamAppendResponse, Status> {
    use openraft::raft::StreamAppendError;
    use pb::stream_append_response::Result as R;
    let result = match item.map_err(fatal)? {
        Ok(Some(l)) => R::Flushed(wire::log_id_to_pb(&l)),
        Ok(None) => R::Accepted(pb::Blank {}),
        Err(StreamAppendError::Conflict(l)) => R::Conflict(wire::log_id_to_pb(&l)),
        Err(StreamAppendError::HigherVote(v)) => R::HigherVote(wire::vote_to_pb(&v)),
    };
    Ok(pb::StreamAppendResponse { result: Some(result) })
}

fn bad(e: impl std::fmt::Display) -> Status {
    Status::invalid_argument(e.to_string())
}

fn fatal(e: impl std::fmt::Display) -> Status {
    Status::unavailable(e.to_string())
}

fn vote_request(req: pb::VoteRequest) -> Result<openraft::raft::VoteRequest<crate::types::TypeConfig>, Status> {
    let vote = wire::required(req.vote, "VoteRequest", "vote").map_err(bad)?;
    Ok(openraft::raft::VoteRequest {
        vote: wire::vote_from_pb(&vote),
        last_log_id: wire::opt_log_id_from_pb(req.last_log_id.as_ref()),
        leadership_transfer: req.leadership_transfer,
    })
}

fn vote_response(resp: openraft::raft::VoteResponse<crate::types::TypeConfig>) -> pb::VoteResponse {
    pb::VoteResponse {
        vote: Some(wire::vote_to_pb(&resp.vote)),
        vote_granted: resp.vote_granted,
        last_log_id: wire::opt_log_id_to_pb(resp.last_log_id.as_ref()),
    }
}

/// Upper bound on files in one received snapshot.
const SNAPSHOT_FILES_MAX: usize = 100_000;

/// A relative path inside a snapshot: no root, no `..`, not empty.
fn safe_relative(name: &str) -> Result<PathBuf, Status> {
    let path = Path::new(name);
    let ok = !name.is_empty()
        && name.len() < 1024
        && path.components().all(|c| matches!(c, std::path::Component::Normal(_)));
    if ok { Ok(path.to_path_buf()) } else { Err(Status::invalid_argument(format!("bad snapshot file name {name:?}"))) }
}

/// Writes the files of a snapshot stream into `dir`, checking each file's size and CRC-32C.
async fn receive_snapshot_files(dir: &Path, stream: &mut Streaming<pb::SnapshotChunk>) -> Result<(), Status> {
    use pb::snapshot_chunk::Kind;
    use tokio::io::AsyncWriteExt;
    let io = |e: std::io::Error| Status::internal(format!("writing snapshot: {e}"));
    let mut current: Option<(String, tokio::fs::File, u32, u64)> = None;
    let mut files = 0usize;
    let mut files_ended = 0usize;
    let mut ended = false;
    while let Some(chunk) = stream.message().await? {
        if ended {
            return Err(Status::invalid_argument("snapshot data after its end marker"));
        }
        match chunk.kind {
            Some(Kind::Data(d)) => {
                if current.as_ref().map(|c| &c.0) != Some(&d.name) {
                    if current.is_some() {
                        return Err(Status::invalid_argument("snapshot file data before the previous file ended"));
                    }
                    files += 1;
                    if files > SNAPSHOT_FILES_MAX {
                        return Err(Status::invalid_argument("too many files in snapshot"));
                    }
                    let path = dir.join(safe_relative(&d.name)?);
                    if let Some(parent) = path.parent() {
                        tokio::fs::create_dir_all(parent).await.map_err(io)?;
                    }
                    let file = tokio::fs::File::create(&path).await.map_err(io)?;
                    current = Some((d.name.clone(), file, 0, 0));
                }
                if let Some((_, file, crc, size)) = current.as_mut() {
                    file.write_all(&d.data).await.map_err(io)?;
                    *crc = crc32c::crc32c_append(*crc, &d.data);
                    *size += d.data.len() as u64;
                }
            }
            Some(Kind::FileEnd(end)) => {
                let (name, file, crc, size) = match current.take() {
                    Some(c) if c.0 == end.name => c,
                    None if end.size == 0 => {
                        let path = dir.join(safe_relative(&end.name)?);
                        if let Some(parent) = path.parent() {
                            tokio::fs::create_dir_all(parent).await.map_err(io)?;
                        }
                        (end.name.clone(), tokio::fs::File::create(&path).await.map_err(io)?, 0, 0)
                    }
                    _ => {
                        return Err(Status::invalid_argument(format!(
                            "unexpected end of snapshot file {:?}",
                            end.name
                        )));
                    }
                };
                if crc != end.crc32c || size != end.size {
                    return Err(Status::data_loss(format!(
                        "snapshot file {name}: got {size} bytes with crc32c {crc:#010x}, sender says {} bytes with {:#010x}",
                        end.size, end.crc32c
                    )));
                }
                file.sync_all().await.map_err(io)?;
                files_ended += 1;
            }
            Some(Kind::End(end)) => {
                if current.is_some() || end.files != files_ended as u64 {
                    return Err(Status::invalid_argument(format!(
                        "snapshot end marker says {} files, {files_ended} were received whole",
                        end.files
                    )));
                }
                ended = true;
            }
            Some(Kind::Header(_)) => return Err(Status::invalid_argument("second snapshot header")),
            None => return Err(Status::invalid_argument("empty snapshot chunk")),
        }
    }
    if current.is_some() {
        return Err(Status::invalid_argument("snapshot stream ended inside a file"));
    }
    if !ended {
        // The sender stopped early (a file of its snapshot vanished, say): what arrived is not
        // the whole snapshot, and installing it would fail the state machine.
        return Err(Status::aborted("snapshot stream ended before its end marker; the sender failed"));
    }
    sync_dirs(dir).map_err(io)
}

fn sync_dirs(dir: &Path) -> std::io::Result<()> {
    for entry in std::fs::read_dir(dir)? {
        let entry = entry?;
        if entry.file_type()?.is_dir() {
            sync_dirs(&entry.path())?;
        }
    }
    std::fs::File::open(dir)?.sync_all()
}

fn append_request_from_pb(
    req: pb::AppendEntriesRequest,
) -> Result<openraft::raft::AppendEntriesRequest<crate::types::TypeConfig>, Status> {
    let vote = wire::required(req.vote, "AppendEntriesRequest", "vote").map_err(bad)?;
    Ok(openraft::raft::AppendEntriesRequest {
        vote: wire::vote_from_pb(&vote),
        prev_log_id: wire::opt_log_id_from_pb(req.prev_log_id.as_ref()),
        entries: wire::entries_from_pb(req.entries).map_err(bad)?,
        leader_commit: wire::opt_log_id_from_pb(req.leader_commit.as_ref()),
    })
}

/// Answers of a pipelined append stream.
pub type StreamAppendAnswers =
    std::pin::Pin<Box<dyn futures::Stream<Item = Result<pb::StreamAppendResponse, Status>> + Send + 'static>>;

/// Answers of a `Calls` stream.
pub type CallAnswers =
    std::pin::Pin<Box<dyn futures::Stream<Item = Result<pb::CallResponse, Status>> + Send + 'static>>;

#[tonic::async_trait]
impl RaftService for Service {
    async fn stream_append(
        &self,
        request: Request<Streaming<pb::AppendEntriesRequest>>,
    ) -> Result<Response<StreamAppendAnswers>, Status> {
        use futures::StreamExt;
        let caller = ClusterIdentity::of_call(request.metadata(), crate::network::CLUSTER_ID_HEADER);
        let own = self.node.cluster_identity();
        let mut input = request.into_inner();
        let first = input.message().await?.ok_or_else(|| Status::invalid_argument("empty append stream"))?;
        let header = first.header;
        self.note_append(header);
        let raft = self.raft_for(header)?;
        let first = append_request_from_pb(first)?;
        // The stream ends at the first request for another group, that fails to
        // decode, from another cluster, or at a transport error; openraft then reopens it.
        // The controller's stream notes each append from its leader.
        let controller = header.is_some_and(|h| h.group_id == CONTROLLER_GROUP).then(|| self.node.clone());
        let rest = futures::stream::unfold((input, own, controller), move |(mut input, own, controller)| async move {
            let next = input.message().await.ok()??;
            if next.header != header || from_another_cluster(&own, caller) {
                return None;
            }
            if let Some(node) = &controller {
                node.note_controller_contact();
            }
            let rpc = append_request_from_pb(next).ok()?;
            Some((rpc, (input, own, controller)))
        });
        let requests = futures::stream::once(futures::future::ready(first)).chain(rest);
        let answers = raft.stream_append(requests).map(stream_append_answer);
        Ok(Response::new(Box::pin(answers)))
    }

    async fn calls(&self, request: Request<Streaming<pb::CallRequest>>) -> Result<Response<CallAnswers>, Status> {
        // Test builds with the `failpoints` feature: `rpc::calls_unsupported=return` answers as a
        // node from before call streams does, so its peers use the unary RPCs.
        fail::fail_point!("rpc::calls_unsupported", |_| Err(Status::unimplemented("call streams are switched off")));
        let caller = ClusterIdentity::of_call(request.metadata(), crate::network::CLUSTER_ID_HEADER);
        let own = self.node.cluster_identity();
        let mut input = request.into_inner();
        let (answers, outgoing) = tokio::sync::mpsc::channel::<pb::CallResponse>(CALLS_IN_FLIGHT);
        let permits = std::sync::Arc::new(tokio::sync::Semaphore::new(CALLS_IN_FLIGHT));
        let service = self.clone();
        // Reads calls until the caller closes the stream (or it breaks), answering each in
        // its own task; answers leave in the order they are ready.
        tokio::spawn(async move {
            loop {
                let Ok(permit) = permits.clone().acquire_owned().await else { break };
                let request = match input.message().await {
                    Ok(Some(_)) if from_another_cluster(&own, caller) => break,
                    Ok(Some(request)) => request,
                    Ok(None) => break,
                    Err(e) => {
                        tracing::debug!(error = %e, "call stream from a peer broke");
                        break;
                    }
                };
                let service = service.clone();
                let answers = answers.clone();
                tokio::spawn(async move {
                    let answer = service.answer_call(request).await;
                    let _ = answers.send(answer).await;
                    drop(permit);
                });
            }
        });
        let stream = futures::stream::unfold(outgoing, |mut outgoing| async move {
            outgoing.recv().await.map(|answer| (Ok(answer), outgoing))
        });
        Ok(Response::new(Box::pin(stream)))
    }

    async fn install_snapshot(
        &self,
        request: Request<Streaming<pb::SnapshotChunk>>,
    ) -> Result<Response<pb::SnapshotResponse>, Status> {
        let mut stream = request.into_inner();
        let first = stream.message().await?.ok_or_else(|| Status::invalid_argument("empty snapshot stream"))?;
        let Some(pb::snapshot_chunk::Kind::Header(header)) = first.kind else {
            return Err(Status::invalid_argument("a snapshot stream starts with its header"));
        };
        let group_header = header.header.ok_or_else(|| Status::invalid_argument("missing group header"))?;
        let raft = self.raft_for(Some(group_header))?;
        let root = self
            .node
            .snapshot_root(group_header.group_id)
            .ok_or_else(|| Status::not_found(format!("group {} is not hosted here", group_header.group_id)))?;
        let store = SnapshotStore::open_existing(root);
        let staging = store.incoming(&format!("{}", group_header.target_replica)).map_err(fatal)?;
        let mut result = receive_snapshot_files(&staging, &mut stream).await;
        if result.is_ok() {
            result = self.check_received_snapshot(group_header.group_id, &staging);
        }
        let installed = match result {
            Ok(()) => {
                install_received(
                    &raft,
                    header.vote,
                    header.last_log_id,
                    header.last_membership_log_id,
                    header.last_membership,
                    &staging,
                )
                .await
            }
            Err(e) => Err(e),
        };
        let _ = std::fs::remove_dir_all(&staging);
        installed
    }

    async fn append_entries(
        &self,
        request: Request<pb::AppendEntriesRequest>,
    ) -> Result<Response<pb::AppendEntriesResponse>, Status> {
        let req = request.into_inner();
        self.note_append(req.header);
        let raft = self.raft_for(req.header)?;
        let rpc = append_request_from_pb(req)?;
        let resp = raft.append_entries(rpc).await.map_err(fatal)?;
        use openraft::raft::AppendEntriesResponse as A;
        use pb::append_entries_response::Result as R;
        let result = match resp {
            A::Success => R::Success(pb::Blank {}),
            A::PartialSuccess(l) => {
                R::PartialSuccess(pb::PartialSuccess { last_log_id: wire::opt_log_id_to_pb(l.as_ref()) })
            }
            A::Conflict => R::Conflict(pb::Blank {}),
            A::HigherVote(v) => R::HigherVote(wire::vote_to_pb(&v)),
        };
        Ok(Response::new(pb::AppendEntriesResponse { result: Some(result) }))
    }

    async fn vote(&self, request: Request<pb::VoteRequest>) -> Result<Response<pb::VoteResponse>, Status> {
        let req = request.into_inner();
        let raft = self.raft_for(req.header)?;
        let resp = raft.vote(vote_request(req)?).await.map_err(fatal)?;
        Ok(Response::new(vote_response(resp)))
    }

    async fn pre_vote(&self, request: Request<pb::VoteRequest>) -> Result<Response<pb::VoteResponse>, Status> {
        let req = request.into_inner();
        let raft = self.raft_for(req.header)?;
        let resp = raft.pre_vote(vote_request(req)?).await.map_err(fatal)?;
        Ok(Response::new(vote_response(resp)))
    }

    async fn read_index(
        &self,
        request: Request<pb::ReadIndexRequest>,
    ) -> Result<Response<pb::ReadIndexResponse>, Status> {
        self.read_index_call(request.into_inner()).await.map(Response::new)
    }

    async fn transfer_leader(
        &self,
        request: Request<pb::TransferLeaderRequest>,
    ) -> Result<Response<pb::TransferLeaderResponse>, Status> {
        use openraft::raft::TransferLeaderError;
        use pb::transfer_leader_response::Result as R;
        let req = request.into_inner();
        let raft = self.raft_for(req.header)?;
        let from =
            wire::vote_from_pb(&wire::required(req.from_leader, "TransferLeaderRequest", "from_leader").map_err(bad)?);
        let rpc = openraft::raft::TransferLeaderRequest::new(
            from,
            req.to_replica,
            wire::opt_log_id_from_pb(req.last_log_id.as_ref()),
        );
        let result = match raft.handle_transfer_leader(rpc).await.map_err(fatal)? {
            Ok(()) => R::Ok(pb::Blank {}),
            Err(TransferLeaderError::VoteChanged { expected, actual }) => R::VoteChanged(pb::VoteAndLogIds {
                expected_vote: Some(wire::vote_to_pb(&expected)),
                actual_vote: Some(wire::vote_to_pb(&actual)),
                ..Default::default()
            }),
            Err(TransferLeaderError::LogNotFlushed { expected, actual }) => R::LogNotFlushed(pb::VoteAndLogIds {
                expected_log_id: wire::opt_log_id_to_pb(expected.as_ref()),
                actual_log_id: wire::opt_log_id_to_pb(actual.as_ref()),
                ..Default::default()
            }),
        };
        Ok(Response::new(pb::TransferLeaderResponse { result: Some(result) }))
    }

    async fn produce(&self, request: Request<pb::ProduceRequest>) -> Result<Response<pb::ProduceResponse>, Status> {
        self.produce_call(request.into_inner()).await.map(Response::new)
    }

    async fn status(&self, _request: Request<pb::StatusRequest>) -> Result<Response<pb::StatusResponse>, Status> {
        Ok(Response::new(self.node.status()))
    }

    async fn controller_write(
        &self,
        request: Request<pb::ControllerWriteRequest>,
    ) -> Result<Response<pb::ControllerWriteResponse>, Status> {
        let req = request.into_inner();
        let cmd = req.command.ok_or_else(|| Status::invalid_argument("missing command"))?;
        match self.node.controller_write_at(cmd, req.forwarded).await {
            Ok((result, log_index)) => {
                Ok(Response::new(pb::ControllerWriteResponse { result: Some(result), log_index, ..Default::default() }))
            }
            Err(e) => Err(Status::unavailable(e.to_string())),
        }
    }
}
