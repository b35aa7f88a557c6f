//! The receiving side of the node-to-node transport.
//!
//! Dispatch is per request, concurrently across groups (no head-of-line
//! blocking between groups). A request for a group or replica this node does
//! not host is rejected, never applied to another replica.

use tonic::Request;
use tonic::Response;
use tonic::Status;

use crate::node::Node;
use crate::node::leader_read_index;
use crate::pb;
use crate::pb::raft_service_server::RaftService;
use crate::pb::raft_service_server::RaftServiceServer;
use crate::types::CONTROLLER_GROUP;
use crate::types::Raft;
use crate::wire;

/// Largest node-to-node message accepted (an append of many batches).
pub const MESSAGE_BYTES_MAX: usize = 64 * 1024 * 1024;

pub struct Service {
    node: Node,
}

/// The tonic service for this node.
pub fn server(node: Node) -> RaftServiceServer<Service> {
    RaftServiceServer::new(Service { node })
        .max_decoding_message_size(MESSAGE_BYTES_MAX)
        .max_encoding_message_size(MESSAGE_BYTES_MAX)
}

impl Service {
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
        Ok(hosted.raft.clone())
    }
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

#[tonic::async_trait]
impl RaftService for Service {
    async fn append_entries(
        &self,
        request: Request<pb::AppendEntriesRequest>,
    ) -> Result<Response<pb::AppendEntriesResponse>, Status> {
        let req = request.into_inner();
        let raft = self.raft_for(req.header)?;
        let vote = wire::required(req.vote, "AppendEntriesRequest", "vote").map_err(bad)?;
        let rpc = openraft::raft::AppendEntriesRequest {
            vote: wire::vote_from_pb(&vote),
            prev_log_id: wire::opt_log_id_from_pb(req.prev_log_id.as_ref()),
            entries: wire::entries_from_pb(req.entries).map_err(bad)?,
            leader_commit: wire::opt_log_id_from_pb(req.leader_commit.as_ref()),
        };
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
        let req = request.into_inner();
        let raft = self.raft_for(req.header)?;
        let index = leader_read_index(&raft, req.strict).await.map_err(fatal)?;
        let term = crate::types::metrics_of(&raft).current_term;
        Ok(Response::new(pb::ReadIndexResponse { read_log_id: Some(pb::LogId { term, index }) }))
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
        match self.node.controller_write(cmd, req.forwarded).await {
            Ok(result) => Ok(Response::new(pb::ControllerWriteResponse { result: Some(result), ..Default::default() })),
            Err(e) => Err(Status::unavailable(e.to_string())),
        }
    }
}
