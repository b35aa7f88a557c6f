//! Where a request for a partition is served: here, forwarded once to a node
//! that can serve it, or answered 421 with `X-Kv-Redirect`.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::Mutex;
use std::time::Duration;
use std::time::Instant;

use axum::body::Body;
use axum::http::HeaderMap;
use axum::http::Method;
use axum::response::Response;
use logdex_raft::controller::PartitionRecord;
use logdex_raft::node::HostedGroup;
use logdex_raft::node::Node;
use logdex_raft::node::ReadMode;
use logdex_raft::pb;
use logdex_raft::types::GroupId;
use logdex_raft::types::NodeId;

use crate::error::ApiError;
use crate::tls::NodeTls;
use crate::tls::TlsError;

/// Header marking a request another node forwarded: it is never forwarded again.
pub const FORWARDED_HEADER: &str = "x-kv-forwarded";
/// How long a learned leader is trusted for routing.
const LEADER_CACHE_TTL: Duration = Duration::from_secs(2);
/// How long a write waits for an election to finish before answering 503.
pub const LEADER_WAIT: Duration = Duration::from_secs(8);

#[derive(Clone)]
pub struct Router {
    pub node: Node,
    http: reqwest::Client,
    /// `https` when the cluster runs TLS, else `http`: of forwarded requests and of the
    /// `X-Kv-Redirect` URLs.
    scheme: &'static str,
    /// What the replica nodes of groups this node does not host said, and when.
    routes: Arc<Mutex<HashMap<GroupId, (Route, Instant)>>>,
}

/// What the replica nodes of a group this node does not host said about it.
#[derive(Clone, Debug)]
struct Route {
    /// The leader of the highest term any of them named.
    leader: Option<NodeId>,
    /// The replica nodes that answered (within a second).
    answering: Vec<NodeId>,
}

/// Whether and how a request that cannot be served here moves on.
#[derive(Clone, Copy, Debug)]
pub struct Hop {
    /// This request was forwarded to us.
    pub forwarded: bool,
    /// The caller allows forwarding (`--forward` and `?forward=`).
    pub forward: bool,
}

/// How long a forwarded `linearizable` or `strict` read waits for its target's answer before
/// it goes to the next replica. A read that a node can serve takes milliseconds; those that
/// wait by design wait less: a `min_offset` read about a second, a follower's read index at
/// most 2 s.
pub const FORWARDED_READ_TIMEOUT: Duration = Duration::from_secs(5);
/// The same for a `follower` read, which its target serves from its own state at once (after
/// a `min_offset` wait of at most [`MIN_OFFSET_WAIT`]): a target silent for longer is
/// paused or cut off, and the next replica answers sooner.
pub const FORWARDED_FOLLOWER_READ_TIMEOUT: Duration = Duration::from_millis(1500);
/// The longest a read with `min_offset` waits for its replica's high watermark to pass it.
pub const MIN_OFFSET_WAIT: Duration = Duration::from_secs(1);

/// How long a forwarded read in `mode` waits for one target (see [`FORWARDED_READ_TIMEOUT`]).
pub fn forwarded_read_timeout(mode: ReadMode, min_offset: bool) -> Duration {
    match mode {
        ReadMode::Follower if min_offset => FORWARDED_FOLLOWER_READ_TIMEOUT + MIN_OFFSET_WAIT,
        ReadMode::Follower => FORWARDED_FOLLOWER_READ_TIMEOUT,
        ReadMode::Linearizable | ReadMode::Strict => FORWARDED_READ_TIMEOUT,
    }
}
/// How long a read forwarded to the replicas of a group takes at most in all, however many
/// it tries: as long as a replica asked directly waits for a leader (8 s with the default
/// timeouts, as a write does: [`LEADER_WAIT`]), and a second for the hops.
pub const FORWARDED_READ_BUDGET: Duration = LEADER_WAIT.saturating_add(Duration::from_secs(1));

impl Router {
    /// Forwarded requests go over HTTPS trusting only the cluster's CA when `tls` is given.
    pub fn new(node: Node, tls: Option<&NodeTls>) -> Result<Router, TlsError> {
        let mut http = reqwest::Client::builder()
            // Forwarded requests leave from the node's own address, as its RPC does.
            .local_address(node.config().rpc_source_ip)
            // Well within the idle limit of the nodes' HTTP listeners (`idle::HTTP_IDLE_TIMEOUT`),
            // so a pooled connection is not taken just as its node closes it.
            .pool_idle_timeout(crate::idle::HTTP_IDLE_TIMEOUT / 2)
            .tcp_nodelay(true)
            .timeout(Duration::from_secs(30));
        if let Some(tls) = tls {
            http = http.tls_built_in_root_certs(false);
            for root in tls.http_roots()? {
                http = http.add_root_certificate(root);
            }
        }
        let http = http.build().map_err(|e| TlsError::Config(format!("cannot build the forwarding client: {e}")))?;
        let scheme = if tls.is_some() { "https" } else { "http" };
        Ok(Router { node, http, scheme, routes: Arc::new(Mutex::new(HashMap::new())) })
    }

    /// The HTTP base URL of a node, from the controller's metadata.
    pub fn node_url(&self, node: NodeId) -> Option<String> {
        self.node.cluster().nodes.get(&node).map(|n| format!("{}://{}", self.scheme, n.http_addr))
    }

    /// The local replica if this node leads the group.
    pub fn local_leader(&self, group: GroupId) -> Option<Arc<HostedGroup>> {
        self.node.group(group).filter(|g| g.raft.is_leader())
    }

    /// The leader's node id as best known, asking replica nodes when this node hosts none (or
    /// its replica stopped).
    pub async fn find_leader(&self, record: &PartitionRecord) -> Option<NodeId> {
        // A replica stopped by an error knows no leader any more: the replica nodes say.
        if let Some(hosted) = self.node.group(record.group_id)
            && !self.node.replica_stopped(&hosted)
        {
            return self.node.leader_node(&hosted);
        }
        self.route(record).await.leader
    }

    /// Where a read of `record` goes from this node, which hosts none of its replicas, best
    /// first: the leader when its node answers, then the other replica nodes that answer, then
    /// the rest. Any replica serves a `follower` read, and a `linearizable` or `strict` one
    /// too (a follower asks the leader for a read index, and waits out an election), so a
    /// replica that answers beats a leader that is down. Never empty for a partition with
    /// replicas.
    pub async fn read_targets(&self, record: &PartitionRecord) -> Vec<NodeId> {
        let route = self.route(record).await;
        let mut targets: Vec<NodeId> = route.leader.filter(|l| route.answering.contains(l)).into_iter().collect();
        for answering in [true, false] {
            for node in record.replicas.iter().map(|r| r.node_id) {
                if route.answering.contains(&node) == answering && !targets.contains(&node) {
                    targets.push(node);
                }
            }
        }
        targets
    }

    pub fn forget_leader(&self, group: GroupId) {
        if let Ok(mut cache) = self.routes.lock() {
            cache.remove(&group);
        }
    }

    /// What the replica nodes of `record` say, as cached for [`LEADER_CACHE_TTL`].
    async fn route(&self, record: &PartitionRecord) -> Route {
        if let Some((route, at)) = self.routes.lock().ok().and_then(|c| c.get(&record.group_id).cloned())
            && at.elapsed() < LEADER_CACHE_TTL
        {
            return route;
        }
        let statuses = self.statuses(record.replicas.iter().map(|r| r.node_id)).await;
        let leader = statuses
            .iter()
            .flat_map(|s| s.groups.iter())
            .filter(|g| g.group_id == record.group_id && g.leader_node != 0)
            .max_by_key(|g| g.term)
            .map(|g| g.leader_node);
        let answering: Vec<NodeId> = statuses.iter().map(|s| s.node_id).collect();
        // A leader that does not answer is gone (its followers name it until the election
        // ends): no leader, rather than a route to a node that cannot take anything.
        let leader = leader.filter(|l| answering.contains(l));
        let route = Route { leader, answering };
        if leader.is_some()
            && let Ok(mut cache) = self.routes.lock()
        {
            cache.insert(record.group_id, (route.clone(), Instant::now()));
        }
        route
    }

    /// Status of the given nodes (those that answer within a second).
    pub async fn statuses(&self, nodes: impl IntoIterator<Item = NodeId>) -> Vec<pb::StatusResponse> {
        let cluster = self.node.cluster();
        let mut calls = Vec::new();
        for node in nodes {
            if node == self.node.node_id() {
                calls.push(tokio::spawn({
                    let status = self.node.status();
                    async move { Some(status) }
                }));
                continue;
            }
            let Some(addr) = cluster.nodes.get(&node).map(|n| n.rpc_addr.clone()) else { continue };
            let pool = self.node.pool().clone();
            calls.push(tokio::spawn(async move {
                let mut client = pool.client(&addr).ok()?;
                let mut request = tonic::Request::new(pb::StatusRequest {});
                request.set_timeout(Duration::from_secs(1));
                client.status(request).await.ok().map(|r| r.into_inner())
            }));
        }
        let mut out = Vec::new();
        for call in calls {
            if let Ok(Some(s)) = call.await {
                out.push(s);
            }
        }
        out
    }

    /// Sends a read on to the first of `targets` that takes it, or answers 421 naming the
    /// first (503 when a forwarded read reached this node, or when there is no target). A target whose node refuses the
    /// connection was not asked, and a read has no effect, so the next one is tried.
    ///
    /// A target that has not answered within `per_target` ([`forwarded_read_timeout`]) is given up too (a
    /// paused or hung node takes the connection and never answers), and the read goes to the
    /// next one, within [`FORWARDED_READ_BUDGET`] in all; when none answered, 503 with
    /// Retry-After, as a replica that waited as long for a leader answers.
    pub async fn redirect_read(
        &self,
        group: GroupId,
        targets: &[NodeId],
        hop: Hop,
        per_target: Duration,
        path_and_query: &str,
        headers: &HeaderMap,
    ) -> Result<Response, ApiError> {
        let mut outcome = Err(ApiError::Unavailable("the partition has no replicas".into()));
        // What each target given up said, for the answer when none answers.
        let mut given_up: Vec<String> = Vec::new();
        let deadline = tokio::time::Instant::now() + FORWARDED_READ_BUDGET;
        for &target in targets {
            let limit = per_target.min(deadline.saturating_duration_since(tokio::time::Instant::now()));
            if limit.is_zero() {
                break;
            }
            let read = self.redirect(target, hop, Method::GET, path_and_query, headers, bytes::Bytes::new());
            outcome = match tokio::time::timeout(limit, read).await {
                Ok(outcome) => outcome,
                Err(_) => {
                    Err(ApiError::Timeout(format!("node {target} did not answer a forwarded read within {limit:?}")))
                }
            };
            match &outcome {
                Err(ApiError::NodeUnreachable(m) | ApiError::Timeout(m)) => {
                    tracing::debug!(target, error = %m, "read goes to the next replica");
                    self.forget_leader(group);
                    given_up.push(m.clone());
                }
                _ => return outcome,
            }
        }
        // Every target was given up: the answer names them all, not only the last. Targets that
        // took the read and never answered are replicas waiting for a leader, or paused: as a
        // replica answers once it waited as long for a leader, 503 (not a gateway's 504).
        match outcome {
            Err(ApiError::Timeout(_)) => Err(ApiError::Unavailable(format!(
                "no replica answered the read in time (the partition may have no leader): {}",
                given_up.join("; ")
            ))),
            Err(ApiError::NodeUnreachable(_)) if given_up.len() > 1 => {
                Err(ApiError::NodeUnreachable(given_up.join("; ")))
            }
            other => other,
        }
    }

    /// Sends the request on to `target`, or answers 421 / 503 when it may not move.
    pub async fn redirect(
        &self,
        target: NodeId,
        hop: Hop,
        method: Method,
        path_and_query: &str,
        headers: &HeaderMap,
        body: bytes::Bytes,
    ) -> Result<Response, ApiError> {
        let base = self
            .node_url(target)
            .ok_or_else(|| ApiError::Unavailable(format!("node {target} has no known address")))?;
        let url = format!("{base}{path_and_query}");
        if hop.forwarded {
            return Err(ApiError::Unavailable(format!(
                "a forwarded request reached node {} which cannot serve it; node {target} may",
                self.node.node_id()
            )));
        }
        if !hop.forward {
            // A 421 sends the client to the node named: only to one that answers now (a
            // leader that just died is still named by its followers until the election ends).
            if target != self.node.node_id() && self.statuses([target]).await.is_empty() {
                return Err(ApiError::NodeUnreachable(format!(
                    "node {target}, which could serve this request, does not answer"
                )));
            }
            return Err(ApiError::Misdirected {
                message: format!("node {} cannot serve this request; node {target} can", self.node.node_id()),
                redirect: Some(url),
            });
        }
        let mut request = self.http.request(method, &url).header(FORWARDED_HEADER, "1").body(body);
        for name in ["content-type", "authorization"] {
            if let Some(v) = headers.get(name) {
                request = request.header(name, v);
            }
        }
        let resp = request.send().await.map_err(|e| {
            if e.is_connect() {
                ApiError::NodeUnreachable(format!("cannot connect to node {target}: {e}"))
            } else {
                ApiError::Unavailable(format!("forwarding to node {target}: {e}"))
            }
        })?;
        let mut builder = Response::builder().status(resp.status().as_u16());
        for (name, value) in resp.headers() {
            let n = name.as_str();
            if n.starts_with("x-kv-") || n == "content-type" || n == "retry-after" {
                builder = builder.header(name.as_str(), value.as_bytes());
            }
        }
        let body = resp.bytes().await.map_err(|e| ApiError::Unavailable(format!("forwarded answer: {e}")))?;
        builder.body(Body::from(body)).map_err(|e| ApiError::Internal(e.to_string()))
    }
}
