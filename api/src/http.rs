//! The HTTP API (DESIGN.md sections 7, 8 and 12).

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::AtomicU32;
use std::sync::atomic::Ordering;
use std::time::Duration;

use axum::Json;
use axum::Router as AxumRouter;
use axum::body::Bytes;
use axum::extract::DefaultBodyLimit;
use axum::extract::FromRequestParts;
use axum::extract::Path;
use axum::extract::Query;
use axum::extract::State;
use axum::http::HeaderMap;
use axum::http::HeaderName;
use axum::http::HeaderValue;
use axum::http::Method;
use axum::http::StatusCode;
use axum::http::Uri;
use axum::http::header;
use axum::response::IntoResponse;
use axum::response::Response;
use axum::routing::get;
use axum::routing::post;
use base64::Engine;
use logdex_log::Record;
use logdex_raft::controller::PartitionRecord;
use logdex_raft::controller::TopicRecord;
use logdex_raft::node::ReadMode;
use logdex_raft::partition::KeyRead;
use logdex_raft::pb;
use serde::Deserialize;
use serde_json::Value;
use serde_json::json;

use crate::error::ApiError;
use crate::murmur2::partition_for_key;
use crate::routing::FORWARDED_HEADER;
use crate::routing::Hop;
use crate::routing::Router;

/// Request and record limits (DESIGN.md section 11).
#[derive(Clone, Debug)]
pub struct Limits {
    pub body_bytes_max: usize,
    pub key_bytes_max: usize,
    pub value_bytes_max: usize,
    pub records_per_batch_max: usize,
    pub fetch_records_max: usize,
    pub fetch_bytes_max: usize,
    pub min_offset_wait_max: Duration,
}

impl Default for Limits {
    fn default() -> Limits {
        Limits {
            body_bytes_max: 8 * 1024 * 1024,
            key_bytes_max: 16 * 1024,
            value_bytes_max: 1024 * 1024,
            records_per_batch_max: 10_000,
            fetch_records_max: 10_000,
            fetch_bytes_max: 8 * 1024 * 1024,
            min_offset_wait_max: Duration::from_secs(10),
        }
    }
}

// Response headers of produce and lookup answers (parsed once, not per request).
const X_KV_PARTITION: HeaderName = HeaderName::from_static("x-kv-partition");
const X_KV_OFFSET: HeaderName = HeaderName::from_static("x-kv-offset");
const X_KV_HIGH_WATERMARK: HeaderName = HeaderName::from_static("x-kv-high-watermark");
const X_KV_NODE: HeaderName = HeaderName::from_static("x-kv-node");
const X_KV_TIMESTAMP: HeaderName = HeaderName::from_static("x-kv-timestamp");

/// Body of `GET /bench/noop` and of the gRPC `Noop`: the benchmark's floor, a round trip with
/// no work.
pub(crate) const NOOP_BODY: &[u8; 100] = &[b'x'; 100];

/// The route of the no-work handler.
pub(crate) const NOOP_ROUTE: &str = "/bench/noop";

#[derive(Clone)]
pub struct AppState {
    pub router: Router,
    pub forward_default: bool,
    pub limits: Arc<Limits>,
    pub guard: Arc<crate::middleware::Guard>,
    round_robin: Arc<AtomicU32>,
}

impl AppState {
    pub fn new(router: Router, forward_default: bool, limits: Limits, guard: crate::middleware::Guard) -> AppState {
        AppState {
            router,
            forward_default,
            limits: Arc::new(limits),
            guard: Arc::new(guard),
            round_robin: Arc::new(AtomicU32::new(0)),
        }
    }
}

pub fn app(state: AppState) -> AxumRouter {
    let body_limit = state.limits.body_bytes_max;
    AxumRouter::new()
        .route("/topics", post(create_topic).get(list_topics))
        .route("/topics/{topic}", get(describe_topic).delete(delete_topic))
        .route("/topics/{topic}/config", post(alter_topic_config))
        .route("/topics/{topic}/records", post(produce_records))
        .route("/topics/{topic}/partitions/{partition}/records", get(fetch_records))
        .route("/topics/{topic}/partitions/{partition}/replicas", axum::routing::put(move_partition))
        .route(crate::middleware::LOOKUP_ROUTE, get(get_key).put(put_key).delete(delete_key))
        .route("/kv/{topic}/", axum::routing::any(|| async { empty_key() }))
        .route("/cluster", get(cluster))
        .route("/cluster/nodes/{node}", axum::routing::delete(remove_node))
        .route("/healthz", get(|| async { "ok" }))
        .route(NOOP_ROUTE, get(|| async { NOOP_BODY }))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics))
        .route_layer(axum::middleware::from_fn_with_state(state.guard.clone(), crate::middleware::guard))
        .fallback(|State(s): State<AppState>, request: axum::extract::Request| async move {
            crate::middleware::route_not_found(&s.guard, request).await
        })
        .layer(DefaultBodyLimit::max(body_limit))
        .with_state(state)
}

// ---------------------------------------------------------------- topics

// Request bodies refuse fields they do not know (400 `invalid_json` naming the field and the
// known ones): a misspelt `partitons` would otherwise create a topic of one partition.

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct CreateTopicBody {
    name: String,
    #[serde(default = "default_partitions")]
    partitions: u32,
    /// `None`: [`logdex_raft::node::Node::default_replication_factor`].
    #[serde(default)]
    replication_factor: Option<u32>,
    #[serde(default)]
    config: BTreeMap<String, Value>,
}

fn default_partitions() -> u32 {
    1
}

/// A request body, which is a JSON object (serde would also take an array of the fields in
/// order).
fn parse_json<T: serde::de::DeserializeOwned>(body: &Bytes) -> Result<T, ApiError> {
    if body.iter().find(|b| !b.is_ascii_whitespace()) != Some(&b'{') {
        return Err(ApiError::bad("invalid_json", "the body must be a JSON object"));
    }
    serde_json::from_slice(body).map_err(|e| ApiError::bad("invalid_json", e.to_string()))
}

fn config_strings(config: BTreeMap<String, Value>) -> Result<BTreeMap<String, String>, ApiError> {
    config
        .into_iter()
        .map(|(k, v)| match v {
            Value::String(s) => Ok((k, s)),
            Value::Number(n) => Ok((k, n.to_string())),
            Value::Bool(b) => Ok((k, b.to_string())),
            other => Err(ApiError::bad("invalid_config", format!("config {k} has a non-scalar value {other}"))),
        })
        .collect()
}

/// Checks of a create's or an alter's config that the controller's own validation leaves
/// out (it must apply old log entries as it did when they were written): Kafka's ranges, and
/// tiered storage only on nodes started with an object store.
fn check_config_limits(s: &AppState, config: &BTreeMap<String, String>) -> Result<(), ApiError> {
    const I32_MAX: u64 = i32::MAX as u64;
    const I64_MAX: u64 = i64::MAX as u64;
    for (key, value) in config {
        let (low, high) = match key.as_str() {
            "segment.bytes" => (14, I32_MAX),
            "max.message.bytes" => (1, I32_MAX),
            "segment.ms" => (1, I64_MAX),
            "delete.retention.ms" => (0, I64_MAX),
            _ => continue,
        };
        if !value.parse::<u64>().is_ok_and(|v| (low..=high).contains(&v)) {
            return Err(ApiError::bad(
                "invalid_config",
                format!("invalid value {value:?} for topic config {key:?}: it must be from {low} to {high}"),
            ));
        }
    }
    if logdex_raft::controller::tiered(config) && !s.router.node.has_tier_store() {
        return Err(ApiError::bad(
            "invalid_config",
            "remote.storage.enable=true needs an object store: start every node with --tiered-store",
        ));
    }
    Ok(())
}

fn controller_error(result: &pb::ControllerResult) -> Option<ApiError> {
    match result.status.as_str() {
        "invalid" => Some(ApiError::bad("invalid_topic", result.message.clone())),
        "conflict" => Some(ApiError::Conflict(result.message.clone())),
        "not_found" => Some(ApiError::TopicNotFound(result.message.clone())),
        _ => None,
    }
}

async fn create_topic(State(s): State<AppState>, body: Bytes) -> Result<Response, ApiError> {
    let req: CreateTopicBody = parse_json(&body)?;
    logdex_raft::controller::validate_topic_name(&req.name).map_err(|m| ApiError::bad("invalid_topic", m))?;
    let config = config_strings(req.config)?;
    // The limits first: their message gives the range, as an alter's does.
    check_config_limits(&s, &config)?;
    logdex_raft::controller::validate_config(&config).map_err(|m| ApiError::bad("invalid_config", m))?;
    let replication_factor = req.replication_factor.unwrap_or_else(|| s.router.node.default_replication_factor());
    // Nodes of an initial cluster start in any order: wait (bounded) for the nodes the
    // cluster names to register, rather than refuse a replication factor it will have.
    s.router.node.wait_registered_nodes(replication_factor as usize, Duration::from_secs(10)).await;
    // Registered nodes that do not answer now get no replica while enough others remain.
    let registered: Vec<u64> = s.router.node.cluster().nodes.keys().copied().collect();
    let answering: std::collections::HashSet<u64> =
        s.router.statuses(registered.iter().copied()).await.iter().map(|st| st.node_id).collect();
    let down_nodes: Vec<u64> = registered.into_iter().filter(|n| !answering.contains(n)).collect();
    // Which nodes the placement went around, and what this node knew: a replica placed on a
    // node that had stopped answering is explained by this line.
    tracing::info!(
        topic = %req.name,
        registered = answering.len() + down_nodes.len(),
        ?down_nodes,
        "placing a new topic's replicas on the registered nodes that answered"
    );
    let cmd = pb::ControllerCommand {
        kind: Some(pb::controller_command::Kind::CreateTopic(pb::CreateTopic {
            name: req.name.clone(),
            partitions: req.partitions,
            replication_factor,
            config: config.into_iter().collect(),
            down_nodes: down_nodes.clone(),
        })),
    };
    let result = s.router.node.controller_write(cmd, false).await?;
    if let Some(e) = controller_error(&result) {
        return Err(e);
    }
    let status = if result.status == "created" { StatusCode::CREATED } else { StatusCode::OK };
    let topic = wait_topic_ready(&s, &req.name, &down_nodes).await?;
    Ok((status, Json(describe(&s, &topic).await)).into_response())
}

/// Waits (bounded) until the local controller replica knows the topic and every partition
/// has a leader, so a write right after creation succeeds. A partition with too few of its
/// replicas on live nodes (not in `down`) to elect one is not waited for: it has no leader
/// until those nodes return, and describe says so.
async fn wait_topic_ready(s: &AppState, name: &str, down: &[u64]) -> Result<Arc<TopicRecord>, ApiError> {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(15);
    let can_elect = |p: &PartitionRecord| {
        let live = p.replicas.iter().filter(|r| !down.contains(&r.node_id)).count();
        live * 2 > p.replicas.len()
    };
    loop {
        if let Some(topic) = s.router.node.cluster().topics.get(name).cloned() {
            let mut all = true;
            for p in topic.partitions.iter().filter(|p| can_elect(p)) {
                if s.router.find_leader(p).await.is_none() {
                    all = false;
                    break;
                }
            }
            if all || tokio::time::Instant::now() >= deadline {
                return Ok(topic);
            }
        } else if tokio::time::Instant::now() >= deadline {
            return Err(ApiError::Unavailable(format!("topic {name} created but not yet visible on this node")));
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The topics; 503 on a node that has not joined the cluster yet, as for one topic.
async fn list_topics(State(s): State<AppState>) -> Result<Json<Value>, ApiError> {
    let cluster = s.router.node.cluster();
    if !cluster.nodes.contains_key(&s.router.node.node_id()) {
        return Err(not_joined(&s));
    }
    let names: Vec<&String> = cluster.topics.keys().collect();
    Ok(Json(json!({ "topics": names })))
}

/// The topic `name`; 404 when the cluster has none, but 503 on a node that has not joined the
/// cluster yet (its view of the topics is not the cluster's).
pub(crate) fn topic(s: &AppState, name: &str) -> Result<Arc<TopicRecord>, ApiError> {
    let cluster = s.router.node.cluster();
    if let Some(t) = cluster.topics.get(name) {
        return Ok(t.clone());
    }
    // A name no topic can have is bad input, as `POST /topics` says of it.
    check_topic_name(name)?;
    if !cluster.nodes.contains_key(&s.router.node.node_id()) {
        return Err(not_joined(s));
    }
    Err(ApiError::TopicNotFound(name.to_string()))
}

/// 400 `invalid_topic` for a name that breaks Kafka's rules.
fn check_topic_name(name: &str) -> Result<(), ApiError> {
    logdex_raft::controller::validate_topic_name(name).map_err(|m| ApiError::bad("invalid_topic", m))
}

/// The `{topic}` (and `{partition}`) segments of a path, percent-decoded. A segment that does
/// not decode to UTF-8 is `invalid_topic` or `invalid_partition` by its name, as the same topic
/// in a `/kv/` path is, where axum's own answer would be an `invalid_request` of its wording.
struct Segments<T>(T);

impl<T, S> FromRequestParts<S> for Segments<T>
where
    T: serde::de::DeserializeOwned + Send,
    S: Send + Sync,
{
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut axum::http::request::Parts, state: &S) -> Result<Self, ApiError> {
        use axum::extract::path::ErrorKind;
        use axum::extract::rejection::PathRejection;
        match Path::<T>::from_request_parts(parts, state).await {
            Ok(Path(segments)) => Ok(Segments(segments)),
            Err(PathRejection::FailedToDeserializePathParams(e)) => match e.kind() {
                ErrorKind::InvalidUtf8InPathParam { key } if key == "topic" => {
                    Err(ApiError::bad("invalid_topic", "topic name is not UTF-8"))
                }
                ErrorKind::InvalidUtf8InPathParam { key } if key == "partition" => Err(ApiError::bad(
                    "invalid_partition",
                    "a partition is a number from 0 up, and this one is not even UTF-8",
                )),
                _ => Err(ApiError::bad("invalid_request", e.body_text())),
            },
            Err(other) => Err(ApiError::Internal(other.body_text())),
        }
    }
}

fn not_joined(s: &AppState) -> ApiError {
    ApiError::Unavailable(format!(
        "node {} has not joined the cluster yet and does not know its topics; retry, or ask another node",
        s.router.node.node_id()
    ))
}

async fn describe_topic(State(s): State<AppState>, Segments(name): Segments<String>) -> Result<Json<Value>, ApiError> {
    let t = topic(&s, &name)?;
    Ok(Json(describe(&s, &t).await))
}

async fn describe(s: &AppState, t: &TopicRecord) -> Value {
    let nodes: std::collections::BTreeSet<u64> =
        t.partitions.iter().flat_map(|p| p.replicas.iter().map(|r| r.node_id)).collect();
    let statuses = s.router.statuses(nodes).await;
    let partitions: Vec<Value> = t
        .partitions
        .iter()
        .map(|p| {
            let views: Vec<&pb::GroupStatus> =
                statuses.iter().flat_map(|st| st.groups.iter()).filter(|g| g.group_id == p.group_id).collect();
            let leader = views.iter().filter(|g| g.leader_node != 0).max_by_key(|g| g.term).map(|g| g.leader_node);
            let leader_view = leader.and_then(|l| {
                let leader_replica = p.replicas.iter().find(|r| r.node_id == l).map(|r| r.replica_id);
                views.iter().find(|g| Some(g.replica_id) == leader_replica)
            });
            let hw = leader_view.map(|g| g.high_watermark).or_else(|| views.iter().map(|g| g.high_watermark).max());
            let start =
                leader_view.map(|g| g.log_start_offset).or_else(|| views.iter().map(|g| g.log_start_offset).min());
            let size = leader_view.map(|g| g.size_bytes).or_else(|| views.iter().map(|g| g.size_bytes).max());
            let mut v = json!({
                "partition": p.partition,
                "replicas": p.replicas.iter().map(|r| r.node_id).collect::<Vec<_>>(),
                "leader": leader,
                "high_watermark": hw.unwrap_or(0),
                "log_start_offset": start.unwrap_or(0),
                "size_bytes": size.unwrap_or(0),
            });
            if let Some(target) = &p.target {
                v["move"] = json!({
                    "target_replicas": target.iter().map(|r| r.node_id).collect::<Vec<_>>(),
                    "state": "in_progress",
                    // Replicas added as learners catch up until the voters change; from
                    // then on the move can no longer be replaced.
                    "phase": if p.target_fixed { "changing_voters" } else { "catching_up" },
                });
            }
            v
        })
        .collect();
    json!({
        "name": t.name,
        "partitions": partitions,
        "replication_factor": t.replication_factor,
        "config": t.effective_config(),
    })
}

async fn delete_topic(State(s): State<AppState>, Segments(name): Segments<String>) -> Result<Json<Value>, ApiError> {
    check_topic_name(&name)?;
    let cmd = pb::ControllerCommand {
        kind: Some(pb::controller_command::Kind::DeleteTopic(pb::DeleteTopic { name: name.clone() })),
    };
    let result = s.router.node.controller_write(cmd, false).await?;
    if result.status == "not_found" {
        return Err(ApiError::TopicNotFound(name));
    }
    Ok(Json(json!({ "deleted": name })))
}

async fn alter_topic_config(
    State(s): State<AppState>,
    Segments(name): Segments<String>,
    body: Bytes,
) -> Result<Json<Value>, ApiError> {
    check_topic_name(&name)?;
    #[derive(Deserialize)]
    #[serde(deny_unknown_fields)]
    struct Alter {
        config: BTreeMap<String, Value>,
    }
    let req: Alter = parse_json(&body)?;
    let config = config_strings(req.config)?;
    check_config_limits(&s, &config)?;
    let cmd = pb::ControllerCommand {
        kind: Some(pb::controller_command::Kind::AlterTopicConfig(pb::AlterTopicConfig {
            name: name.clone(),
            config: config.into_iter().collect(),
        })),
    };
    let result = s.router.node.controller_write(cmd, false).await?;
    if result.status == "not_found" {
        return Err(ApiError::TopicNotFound(name));
    }
    if result.status == "invalid" {
        // The only thing an alter can get wrong is its config.
        return Err(ApiError::bad("invalid_config", result.message));
    }
    if let Some(e) = controller_error(&result) {
        return Err(e);
    }
    let t = topic(&s, &name)?;
    Ok(Json(describe(&s, &t).await))
}

async fn move_partition(
    State(s): State<AppState>,
    Segments((name, partition)): Segments<(String, String)>,
    body: Bytes,
) -> Result<Response, ApiError> {
    let partition = partition_number(&partition)?;
    #[derive(Deserialize)]
    #[serde(deny_unknown_fields)]
    struct Move {
        replicas: Vec<u64>,
    }
    let req: Move = parse_json(&body)?;
    let t = topic(&s, &name)?;
    if partition as usize >= t.partitions.len() {
        return Err(ApiError::bad("invalid_partition", format!("topic {name} has no partition {partition}")));
    }
    let cmd = pb::ControllerCommand {
        kind: Some(pb::controller_command::Kind::MovePartition(pb::MovePartition {
            topic: name.clone(),
            partition,
            nodes: req.replicas,
        })),
    };
    let result = s.router.node.controller_write(cmd, false).await?;
    if result.status == "invalid" {
        // What a move can get wrong is its list of nodes.
        return Err(ApiError::bad("invalid_replicas", result.message));
    }
    if let Some(e) = controller_error(&result) {
        return Err(e);
    }
    let status = if result.status == "ok" { StatusCode::ACCEPTED } else { StatusCode::OK };
    let t = topic(&s, &name)?;
    Ok((status, Json(describe(&s, &t).await)).into_response())
}

// ---------------------------------------------------------------- common

#[derive(Deserialize, Default)]
struct CommonQuery {
    /// Parsed by [`partition_number`], so a bad one is `invalid_partition`.
    partition: Option<String>,
    key_encoding: Option<String>,
    read: Option<String>,
    min_offset: Option<u64>,
    forward: Option<bool>,
    offset: Option<u64>,
    max_records: Option<usize>,
    max_bytes: Option<usize>,
    encoding: Option<String>,
}

fn hop(s: &AppState, headers: &HeaderMap, q: &CommonQuery) -> Hop {
    Hop { forwarded: headers.contains_key(FORWARDED_HEADER), forward: q.forward.unwrap_or(s.forward_default) }
}

fn read_mode(q: &CommonQuery) -> Result<ReadMode, ApiError> {
    match q.read.as_deref() {
        None | Some("linearizable") => Ok(ReadMode::Linearizable),
        Some("strict") => Ok(ReadMode::Strict),
        Some("follower") => Ok(ReadMode::Follower),
        Some(other) => Err(ApiError::bad(
            "invalid_read_mode",
            format!("read must be linearizable, strict or follower, not {other:?}"),
        )),
    }
}

/// The path and query of a request to send on to another node, forwarded or in a 421's
/// `X-Kv-Redirect`. A `/kv/{topic}/{key}` key with a `.` or `..` path segment (`..`,
/// `a/./b`, `%2E%2E`) goes base64url-encoded: URL clients, ours included, resolve such segments
/// before they send, so the key as written would reach another key or another route.
fn path_and_query(uri: &Uri) -> String {
    let raw = || uri.path_and_query().map(|pq| pq.as_str().to_string()).unwrap_or_else(|| uri.path().to_string());
    let Some((topic, key)) = uri.path().strip_prefix("/kv/").and_then(|rest| rest.split_once('/')) else {
        return raw();
    };
    let dot_segment =
        |segment: &str| [".", "..", "%2e", "%2e%2e", ".%2e", "%2e."].iter().any(|d| segment.eq_ignore_ascii_case(d));
    if !key.split('/').any(dot_segment) {
        return raw();
    }
    // Only a key read as UTF-8 bytes can hold a dot segment (base64url has no `.`).
    let Ok(bytes) = percent_decode(key) else { return raw() };
    let mut query: Vec<&str> = uri
        .query()
        .unwrap_or("")
        .split('&')
        .filter(|pair| !pair.is_empty() && pair.split('=').next() != Some("key_encoding"))
        .collect();
    query.push("key_encoding=base64url");
    let key = base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(bytes);
    format!("/kv/{topic}/{key}?{}", query.join("&"))
}

/// The topic of a `/kv/{topic}/{key}` request, from the raw path.
fn topic_from_uri(uri: &Uri) -> Result<String, ApiError> {
    let rest = uri.path().strip_prefix("/kv/").unwrap_or("");
    let raw = rest.split('/').next().unwrap_or("");
    String::from_utf8(percent_decode(raw)?).map_err(|_| ApiError::bad("invalid_topic", "topic name is not UTF-8"))
}

fn key_from_uri(uri: &Uri, encoding: Option<&str>) -> Result<Vec<u8>, ApiError> {
    let rest = uri.path().strip_prefix("/kv/").unwrap_or("");
    let encoded = rest.split_once('/').map_or("", |(_, key)| key);
    let key = percent_decode(encoded)?;
    match encoding {
        None | Some("utf8") | Some("raw") => Ok(key),
        Some("base64url") => {
            let text =
                String::from_utf8(key).map_err(|_| ApiError::bad("invalid_key", "base64url key is not ASCII"))?;
            let trimmed = text.trim_end_matches('=');
            base64::engine::general_purpose::URL_SAFE_NO_PAD
                .decode(trimmed)
                .map_err(|e| ApiError::bad("invalid_key", format!("key is not valid base64url: {e}")))
        }
        Some(other) => {
            Err(ApiError::bad("invalid_key_encoding", format!("key_encoding must be base64url, not {other:?}")))
        }
    }
}

fn percent_decode(s: &str) -> Result<Vec<u8>, ApiError> {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' {
            let hex =
                bytes.get(i + 1..i + 3).ok_or_else(|| ApiError::bad("invalid_key", "truncated percent-encoding"))?;
            let text = std::str::from_utf8(hex).map_err(|_| ApiError::bad("invalid_key", "bad percent-encoding"))?;
            let b = u8::from_str_radix(text, 16).map_err(|_| ApiError::bad("invalid_key", "bad percent-encoding"))?;
            out.push(b);
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    Ok(out)
}

/// A partition number from a path or a query (`invalid_partition` when it is not one).
fn partition_number(text: &str) -> Result<u32, ApiError> {
    // Digits only: `u32::from_str` also takes a leading `+`.
    if text.is_empty() || !text.bytes().all(|b| b.is_ascii_digit()) {
        return Err(ApiError::bad("invalid_partition", format!("a partition is a number from 0 up, not {text:?}")));
    }
    text.parse().map_err(|_| {
        ApiError::bad(
            "invalid_partition",
            format!("no topic has partition {text}: partitions are numbered below {}", u32::MAX),
        )
    })
}

fn partition_of<'a>(t: &'a TopicRecord, partition: Option<u32>, key: &[u8]) -> Result<&'a PartitionRecord, ApiError> {
    let n = t.partitions.len() as u32;
    let p = match partition {
        Some(p) if p < n => p,
        Some(p) => {
            return Err(ApiError::bad(
                "invalid_partition",
                format!("topic {} has no partition {p} (its partitions are 0 to {})", t.name, n.saturating_sub(1)),
            ));
        }
        None => partition_for_key(key, n),
    };
    t.partitions.get(p as usize).ok_or_else(|| ApiError::Internal("partition out of range".into()))
}

fn now_ms() -> i64 {
    logdex_raft::state_machine::now_ms() as i64
}

// ---------------------------------------------------------------- writes

/// Produces records to a partition through its leader: here (batched with
/// concurrent writes), or forwarded once to the leader's node over RPC, or
/// answered 421 when forwarding is off. Returns the offset of the first record.
async fn produce_to(
    s: &AppState,
    topic: &str,
    record: &PartitionRecord,
    records: Vec<Record>,
    hop: Hop,
    uri: &Uri,
) -> Result<u64, ApiError> {
    let node = &s.router.node;
    let deadline = tokio::time::Instant::now() + crate::routing::LEADER_WAIT;
    loop {
        let leader = if s.router.local_leader(record.group_id).is_some() {
            Some(node.node_id())
        } else {
            s.router.find_leader(record).await
        };
        let outcome = match leader {
            Some(l) if l == node.node_id() => node.produce_records(record.group_id, records.clone()).await,
            Some(l) => {
                if hop.forwarded || !hop.forward {
                    // Not ours to forward: the HTTP answer names where to go.
                    let pq = path_and_query(uri);
                    let empty = HeaderMap::new();
                    match s.router.redirect(l, hop, Method::POST, &pq, &empty, Bytes::new()).await {
                        // The leader named does not answer: wait for the next one, bounded.
                        Err(ApiError::NodeUnreachable(m)) => Err(logdex_raft::Error::NodeUnreachable(m)),
                        Err(e) => return Err(e),
                        Ok(_) => return Err(ApiError::Internal("a write may not be forwarded here".into())),
                    }
                } else {
                    node.remote_produce(l, record.group_id, &records).await
                }
            }
            None => Err(logdex_raft::Error::unavailable("no leader known")),
        };
        match outcome {
            Ok(base) => return Ok(base),
            // Definite failures: nothing was written; wait for the next leader.
            Err(
                logdex_raft::Error::NotLeader { .. }
                | logdex_raft::Error::NodeUnreachable(_)
                | logdex_raft::Error::NotHosted { .. },
            ) => {
                s.router.forget_leader(record.group_id);
            }
            Err(logdex_raft::Error::Unavailable(m)) if m == "no leader known" => {}
            Err(e) => return Err(e.into()),
        }
        // Nothing was written. The topic may have been deleted (or made again, with other
        // groups) while the write waited: then no leader will come.
        let exists = node
            .cluster()
            .topics
            .get(topic)
            .is_some_and(|t| t.partitions.iter().any(|p| p.group_id == record.group_id));
        if !exists {
            return Err(ApiError::TopicNotFound(topic.to_string()));
        }
        if tokio::time::Instant::now() >= deadline {
            return Err(ApiError::Unavailable(format!("partition {} has no reachable leader", record.partition)));
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn written(partition: u32, offset: u64) -> Response {
    let mut resp = Json(json!({ "partition": partition, "offset": offset })).into_response();
    let h = resp.headers_mut();
    h.insert(X_KV_PARTITION, HeaderValue::from(partition));
    h.insert(X_KV_OFFSET, HeaderValue::from(offset));
    resp
}

async fn write_key(
    s: AppState,
    q: CommonQuery,
    uri: Uri,
    headers: HeaderMap,
    value: Option<Vec<u8>>,
) -> Result<Response, ApiError> {
    let topic_name = topic_from_uri(&uri)?;
    let write = KeyWrite {
        topic: topic(&s, &topic_name)?,
        key: key_from_uri(&uri, q.key_encoding.as_deref())?,
        value,
        partition: q.partition.as_deref().map(partition_number).transpose()?,
        hop: hop(&s, &headers, &q),
    };
    let (partition, offset) = write_one(&s, write, move || Ok(uri)).await?;
    Ok(written(partition, offset))
}

/// A write of one key (a value, or a tombstone when `value` is `None`), as the HTTP and the
/// gRPC API ask it.
pub(crate) struct KeyWrite {
    pub topic: Arc<TopicRecord>,
    pub key: Vec<u8>,
    pub value: Option<Vec<u8>>,
    pub partition: Option<u32>,
    pub hop: Hop,
}

/// Writes one key on its partition's leader (here, forwarded to it, or redirected there when
/// the request may not be forwarded: `uri` gives the request as this API's HTTP form, for the
/// redirect, once the key and value passed their bounds). Answers the partition and the
/// record's offset once it is committed and applied.
pub(crate) async fn write_one(
    s: &AppState,
    w: KeyWrite,
    uri: impl FnOnce() -> Result<Uri, ApiError>,
) -> Result<(u32, u64), ApiError> {
    if w.key.len() > s.limits.key_bytes_max {
        return Err(too_large("", "key", w.key.len(), s.limits.key_bytes_max));
    }
    if let Some(v) = w.value.as_ref().filter(|v| v.len() > s.limits.value_bytes_max) {
        return Err(too_large("", "value", v.len(), s.limits.value_bytes_max));
    }
    let p = partition_of(&w.topic, w.partition, &w.key)?;
    let record = Record { timestamp_ms: now_ms(), key: Some(w.key), value: w.value, headers: Vec::new() };
    let offset = produce_to(s, &w.topic.name, p, vec![record], w.hop, &uri()?).await?;
    Ok((p.partition, offset))
}

async fn put_key(
    State(s): State<AppState>,
    Query(q): Query<CommonQuery>,
    uri: Uri,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Response, ApiError> {
    write_key(s, q, uri, headers, Some(body.to_vec())).await
}

async fn delete_key(
    State(s): State<AppState>,
    Query(q): Query<CommonQuery>,
    uri: Uri,
    headers: HeaderMap,
) -> Result<Response, ApiError> {
    write_key(s, q, uri, headers, None).await
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ProduceBody {
    records: Vec<ProduceRecord>,
    #[serde(default)]
    encoding: Option<String>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ProduceRecord {
    #[serde(default)]
    key: Option<String>,
    #[serde(default)]
    value: Option<String>,
    #[serde(default, deserialize_with = "header_object")]
    headers: BTreeMap<String, Option<String>>,
    /// Any JSON value, so that a partition that is not one (`-1`, `"0"`) is refused as
    /// `invalid_partition`, naming the record, rather than failing the whole body's parse.
    #[serde(default)]
    partition: Option<Value>,
}

/// A record's `headers`: an object of names to values (null for a header without a value), or
/// null for none, as `key` and `partition` may be null. A name given twice is refused: a JSON
/// object keeps one of its values, and the other would be dropped unseen.
fn header_object<'de, D: serde::Deserializer<'de>>(d: D) -> Result<BTreeMap<String, Option<String>>, D::Error> {
    struct Headers;
    impl<'de> serde::de::Visitor<'de> for Headers {
        type Value = BTreeMap<String, Option<String>>;

        fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("an object of header names to string values or null")
        }

        fn visit_none<E>(self) -> Result<Self::Value, E> {
            Ok(BTreeMap::new())
        }

        fn visit_unit<E>(self) -> Result<Self::Value, E> {
            Ok(BTreeMap::new())
        }

        fn visit_some<D2: serde::Deserializer<'de>>(self, d: D2) -> Result<Self::Value, D2::Error> {
            d.deserialize_map(self)
        }

        fn visit_map<A: serde::de::MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
            let mut headers = BTreeMap::new();
            while let Some((name, value)) = map.next_entry::<String, Option<String>>()? {
                if headers.contains_key(&name) {
                    return Err(serde::de::Error::custom(format_args!("header `{name}` is named twice in one record")));
                }
                headers.insert(name, value);
            }
            Ok(headers)
        }
    }
    d.deserialize_option(Headers)
}

/// 413 for a key or value (`what`) of `len` bytes over the node's limit of `max`, in the same
/// words wherever it was sent; `record` names the record of a batch ("record 3: ").
fn too_large(record: &str, what: &str, len: usize, max: usize) -> ApiError {
    ApiError::TooLarge(format!("{record}{what} of {len} bytes exceeds the limit of {max} bytes"))
}

/// The partition a record names, if it names one.
fn record_partition(partition: Option<Value>, i: usize) -> Result<Option<u32>, ApiError> {
    match partition {
        None | Some(Value::Null) => Ok(None),
        Some(v) => match v.as_u64() {
            Some(p) => u32::try_from(p).map(Some).map_err(|_| {
                ApiError::bad(
                    "invalid_partition",
                    format!("record {i}: no topic has partition {p}: partitions are numbered below {}", u32::MAX),
                )
            }),
            None => Err(ApiError::bad(
                "invalid_partition",
                format!("record {i}: a partition is a number from 0 up, not {v}"),
            )),
        },
    }
}

/// The bytes of a field of record `i` (`what`: "key", "value", "header value").
fn decode_field(text: String, base64: bool, i: usize, what: &str) -> Result<Vec<u8>, ApiError> {
    if base64 {
        base64::engine::general_purpose::STANDARD
            .decode(text.as_bytes())
            .map_err(|e| ApiError::bad("invalid_record", format!("record {i}: {what} is not valid base64: {e}")))
    } else {
        Ok(text.into_bytes())
    }
}

async fn produce_records(
    State(s): State<AppState>,
    Segments(topic_name): Segments<String>,
    Query(q): Query<CommonQuery>,
    uri: Uri,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Response, ApiError> {
    let t = topic(&s, &topic_name)?;
    let req: ProduceBody = parse_json(&body)?;
    // The encoding is a field of the body; `?encoding=` (fetch's spelling) is taken too when
    // the body does not name one, and must agree with it when it does.
    if let (Some(body), Some(query)) = (&req.encoding, &q.encoding)
        && body != query
    {
        return Err(ApiError::bad(
            "invalid_encoding",
            format!("the body says encoding {body:?} and the query {query:?}"),
        ));
    }
    let base64 = match req.encoding.as_deref().or(q.encoding.as_deref()) {
        None | Some("utf8") => false,
        Some("base64") => true,
        Some(other) => {
            return Err(ApiError::bad("invalid_encoding", format!("encoding must be utf8 or base64, not {other:?}")));
        }
    };
    if req.records.is_empty() {
        return Err(ApiError::bad("invalid_record", "records must not be empty"));
    }
    if req.records.len() > s.limits.records_per_batch_max {
        return Err(ApiError::TooLarge(format!("at most {} records per request", s.limits.records_per_batch_max)));
    }
    let n = t.partitions.len() as u32;
    let now = now_ms();
    let hop = hop(&s, &headers, &q);
    // The partition of the records that name neither a partition nor a key (chosen once).
    let has_keyless = req.records.iter().any(|r| r.key.is_none() && matches!(r.partition, None | Some(Value::Null)));
    let keyless = if has_keyless { Some(keyless_partition(&s, &t, hop).await) } else { None };
    // Partition -> (request positions, records), validated before anything is written.
    let mut per_partition = PartitionBatches::new();
    for (i, r) in req.records.into_iter().enumerate() {
        let key = r.key.map(|k| decode_field(k, base64, i, "key")).transpose()?;
        let value = r.value.map(|v| decode_field(v, base64, i, "value")).transpose()?;
        if let Some(k) = key.as_ref().filter(|k| k.len() > s.limits.key_bytes_max) {
            return Err(too_large(&format!("record {i}: "), "key", k.len(), s.limits.key_bytes_max));
        }
        // No lookup can name an empty key (as `PUT /kv/{t}/` cannot write one).
        if key.as_ref().is_some_and(Vec::is_empty) {
            return Err(ApiError::bad(
                "invalid_key",
                format!("record {i}: the key is empty; leave it out (or null) for a record without a key"),
            ));
        }
        if let Some(v) = value.as_ref().filter(|v| v.len() > s.limits.value_bytes_max) {
            return Err(too_large(&format!("record {i}: "), "value", v.len(), s.limits.value_bytes_max));
        }
        let partition = match (record_partition(r.partition, i)?, &key) {
            (Some(p), _) if p < n => p,
            (Some(p), _) => {
                return Err(ApiError::bad("invalid_partition", format!("record {i}: partition {p} of {n}")));
            }
            (None, Some(k)) => partition_for_key(k, n),
            (None, None) => keyless
                .ok_or_else(|| ApiError::Internal(format!("record {i} has no key, yet no partition was chosen")))?,
        };
        let mut record_headers = Vec::with_capacity(r.headers.len());
        let mut header_bytes = 0usize;
        for (name, v) in r.headers {
            let value = v.map(|v| decode_field(v, base64, i, "header value")).transpose()?;
            header_bytes += name.len() + value.as_ref().map_or(0, Vec::len);
            record_headers.push(logdex_log::Header { key: name, value });
        }
        // Headers are bounded like the value: together at most as large as one value may be.
        if header_bytes > s.limits.value_bytes_max {
            return Err(ApiError::TooLarge(format!(
                "record {i}: headers exceed {} bytes together",
                s.limits.value_bytes_max
            )));
        }
        let entry = per_partition.entry(partition).or_default();
        entry.0.push(i);
        entry.1.push(Record { timestamp_ms: now, key, value, headers: record_headers });
    }
    // Each partition's records are one batch, appended whole or not at all; what would refuse
    // one partition's batch after others were written is checked first, for all of them.
    check_partition_batches(&s, &t, &per_partition)?;
    if hop.forwarded || !hop.forward {
        check_partitions_led_here(&s, &t, &per_partition, hop, &uri).await?;
    }
    let total: usize = per_partition.values().map(|(pos, _)| pos.len()).sum();
    let mut offsets = vec![Value::Null; total];
    // The partitions' batches are independent Raft entries: they commit side by side.
    let writes = per_partition.into_iter().map(|(partition, (positions, records))| {
        let (s, name, record, uri) = (&s, &t.name, &t.partitions[partition as usize], &uri);
        async move { produce_to(s, name, record, records, hop, uri).await.map(|base| (partition, positions, base)) }
    });
    for written in futures::future::join_all(writes).await {
        let (partition, positions, base) = written?;
        for (j, pos) in positions.into_iter().enumerate() {
            offsets[pos] = json!({ "partition": partition, "offset": base + j as u64 });
        }
    }
    Ok(Json(json!({ "offsets": offsets })).into_response())
}

/// The partition of a produce request's records that name neither a partition nor a key: one
/// for all of them, as Kafka's sticky partitioner keeps a batch's keyless records together, so
/// they are one batch, appended whole or not at all, and one Raft entry rather than one per
/// partition. The partitions take turns from one request to the next, passing over those
/// without a known leader (as Kafka's partitioner picks only partitions that have one), unless
/// none has one. A node that must write the records itself (`forward=false`, or a request
/// forwarded to it) takes its turn among the partitions it leads, so it does not refuse
/// records it could have placed; when it leads none, the turn's partition stands (and a node
/// that does not forward answers 421 naming its leader).
async fn keyless_partition(s: &AppState, t: &TopicRecord, hop: Hop) -> u32 {
    let n = t.partitions.len() as u32;
    let turn = s.round_robin.fetch_add(1, Ordering::Relaxed);
    let group = |p: u32| t.partitions.get(p as usize);
    if hop.forwarded || !hop.forward {
        let led: Vec<u32> =
            (0..n).filter(|p| group(*p).is_some_and(|r| s.router.local_leader(r.group_id).is_some())).collect();
        return match led.len() {
            0 => turn % n.max(1),
            count => led[turn as usize % count],
        };
    }
    for i in 0..n {
        let p = turn.wrapping_add(i) % n;
        if let Some(record) = group(p)
            && s.router.find_leader(record).await.is_some()
        {
            return p;
        }
    }
    turn % n.max(1)
}

/// Records of a produce request, grouped by partition: (request positions, records).
type PartitionBatches = BTreeMap<u32, (Vec<usize>, Vec<Record>)>;

/// Refuses a request whose records for one partition make a batch over the topic's
/// `max.message.bytes`, before anything is written. The leader checks each batch too, but a
/// request spanning partitions would have the others written by then. A request for one
/// partition is refused whole by its leader and is not encoded twice.
fn check_partition_batches(s: &AppState, t: &TopicRecord, batches: &PartitionBatches) -> Result<(), ApiError> {
    if batches.len() < 2 {
        return Ok(());
    }
    let limit = t.log_config(&s.router.node.config().log).batch_bytes_max as usize;
    for (partition, (_, records)) in batches {
        if batch_bytes_bound(records) <= limit {
            continue;
        }
        let bytes = logdex_log::encode_batch(records, t.compression())
            .map_err(|e| ApiError::bad("invalid_record", format!("partition {partition}: {e}")))?
            .len();
        if bytes > limit {
            return Err(ApiError::TooLarge(format!(
                "the records for partition {partition} make a batch of {bytes} bytes, over the limit of \
                 {limit} bytes (the topic's max.message.bytes, or a batch's {}-byte header when that is \
                 smaller); nothing was written",
                logdex_log::BATCH_HEADER_BYTES
            )));
        }
    }
    Ok(())
}

/// At least the encoded size of `records` as one batch: every varint at its widest (a
/// record's length, timestamp and offset deltas, key and value lengths and header count: 36
/// bytes, and 10 per header).
fn batch_bytes_bound(records: &[Record]) -> usize {
    let record = |r: &Record| {
        let headers: usize = r.headers.iter().map(|h| 10 + h.key.len() + h.value.as_ref().map_or(0, Vec::len)).sum();
        36 + r.key.as_ref().map_or(0, Vec::len) + r.value.as_ref().map_or(0, Vec::len) + headers
    };
    logdex_log::BATCH_HEADER_BYTES + records.iter().map(record).sum::<usize>()
}

/// When this node may not pass writes on (`forward=false`, or a forwarded request), answers
/// 421 (or 503 for a forwarded request) before anything is written unless it leads every
/// partition the records go to. The redirect names the leader when one node leads them all;
/// otherwise no node can take the request whole: every 421 still carries a redirect (to the
/// leader of the lowest partition not led here, where a client splitting the request sends
/// that partition's records), and the message says which node leads which partition.
async fn check_partitions_led_here(
    s: &AppState,
    t: &TopicRecord,
    batches: &PartitionBatches,
    hop: Hop,
    uri: &Uri,
) -> Result<(), ApiError> {
    let me = s.router.node.node_id();
    let mut elsewhere: BTreeMap<u64, Vec<u32>> = BTreeMap::new();
    // The leader of the lowest partition not led here (batches are in partition order).
    let mut first = None;
    for partition in batches.keys() {
        let record = &t.partitions[*partition as usize];
        if s.router.local_leader(record.group_id).is_some() {
            continue;
        }
        // A partition without a known leader is left to the write's own wait for one.
        if let Some(leader) = s.router.find_leader(record).await.filter(|l| *l != me) {
            elsewhere.entry(leader).or_default().push(*partition);
            first.get_or_insert(leader);
        }
    }
    let Some(first) = first else { return Ok(()) };
    let one_node_leads_all = elsewhere.len() == 1 && elsewhere.get(&first).map_or(0, Vec::len) == batches.len();
    let pq = path_and_query(uri);
    let redirect = s.router.redirect(first, hop, Method::POST, &pq, &HeaderMap::new(), Bytes::new()).await;
    match redirect {
        Err(ApiError::Misdirected { redirect, .. }) if !one_node_leads_all => {
            let leaders: Vec<String> = elsewhere
                .iter()
                .map(|(node, partitions)| format!("node {node} leads partitions {partitions:?}"))
                .collect();
            Err(ApiError::Misdirected {
                message: format!(
                    "node {me} cannot take these records whole and nothing was written: {}; send each \
                     partition's records to its leader, or let the node forward them (forward=true)",
                    leaders.join(", ")
                ),
                redirect,
            })
        }
        Err(e) => Err(e),
        Ok(_) => Err(ApiError::Internal("a write may not be forwarded here".into())),
    }
}

// ---------------------------------------------------------------- reads

/// Another replica of `record` to ask when this one's data is damaged: the leader when it is
/// another node, else the first other replica.
fn healthy_replica(s: &AppState, record: &PartitionRecord, hosted: &logdex_raft::node::HostedGroup) -> Option<u64> {
    let me = s.router.node.node_id();
    s.router
        .node
        .leader_node(hosted)
        .filter(|l| *l != me)
        .or_else(|| record.replicas.iter().map(|r| r.node_id).find(|n| *n != me))
}

pub(crate) fn empty_key() -> ApiError {
    ApiError::bad("invalid_key", "the key is empty")
}

/// A key lookup, as the HTTP and the gRPC API ask it.
pub(crate) struct LookupRequest<'a> {
    pub topic: Arc<TopicRecord>,
    pub key: &'a [u8],
    pub mode: ReadMode,
    pub partition: Option<u32>,
    pub min_offset: Option<u64>,
    pub hop: Hop,
}

/// Where a lookup was answered.
pub(crate) enum Lookup {
    /// By this node's replica of the partition, as of its high watermark.
    Here { partition: u32, high_watermark: u64, read: KeyRead },
    /// By the first of `targets` that takes it (best first): this node holds
    /// no replica of the partition, or its copy of the record is damaged. The caller
    /// forwards the request there or answers 421.
    Elsewhere { group: u64, targets: Vec<u64> },
}

/// Looks a key up on this node's replica of its partition (the read barrier of `mode`
/// first), or says which node to ask.
pub(crate) async fn lookup(s: &AppState, r: LookupRequest<'_>) -> Result<Lookup, ApiError> {
    if r.key.is_empty() {
        return Err(empty_key());
    }
    if r.key.len() > s.limits.key_bytes_max {
        return Err(too_large("", "key", r.key.len(), s.limits.key_bytes_max));
    }
    let p = partition_of(&r.topic, r.partition, r.key)?;
    if r.topic.config.get("kv.index.enabled").map(String::as_str) == Some("false") {
        return Err(ApiError::TopicNotIndexed(r.topic.name.clone()));
    }
    let Some(hosted) = s.router.node.group(p.group_id) else {
        return Ok(Lookup::Elsewhere { group: p.group_id, targets: s.router.read_targets(p).await });
    };
    // A replica stopped by an error, or a learner for `follower` reads: the others answer.
    if s.router.node.replica_stopped(&hosted)
        || (r.mode == ReadMode::Follower && !s.router.node.serves_follower_reads(&hosted))
    {
        return Ok(Lookup::Elsewhere { group: p.group_id, targets: voter_targets(s, p).await? });
    }
    if let Some(min) = r.min_offset {
        let wait = s.limits.min_offset_wait_max.min(crate::routing::MIN_OFFSET_WAIT);
        s.router.node.wait_high_watermark(&hosted, min, wait).await.map_err(ApiError::from)?;
    }
    match s.router.node.read_key(p.group_id, r.key, r.mode).await {
        Ok((read, high_watermark)) => Ok(Lookup::Here { partition: p.partition, high_watermark, read }),
        // This replica's copy of the record is damaged: another replica answers, once
        // (a forwarded request, or `forward=false`, gets the 500 `corrupt_data`).
        Err(e) if e.is_corrupt_data() && r.hop.forward && !r.hop.forwarded => {
            let Some(target) = healthy_replica(s, p, &hosted) else { return Err(e.into()) };
            tracing::warn!(group = p.group_id, error = %e, target, "lookup of a damaged record forwarded to another replica");
            Ok(Lookup::Elsewhere { group: p.group_id, targets: vec![target] })
        }
        // Leadership moved while the read barrier ran (a transfer, or a leader a move
        // removes): the new leader answers, as if the read had come in after the change.
        Err(logdex_raft::Error::NotLeader { leader_node: Some(leader), .. }) if leader != s.router.node.node_id() => {
            Ok(Lookup::Elsewhere { group: p.group_id, targets: vec![leader] })
        }
        // A move took this replica off the node while the read waited on it: a replica in
        // the current assignment answers.
        Err(e) if s.router.node.group(p.group_id).is_none_or(|now| !Arc::ptr_eq(&now, &hosted)) => {
            let Some(current) = s.router.node.cluster().topics.get(&r.topic.name).cloned() else {
                // The topic was deleted while the read waited.
                return Err(ApiError::TopicNotFound(r.topic.name.clone()));
            };
            let Some(record) = current.partitions.get(p.partition as usize) else { return Err(e.into()) };
            let me = s.router.node.node_id();
            let targets: Vec<u64> = s.router.read_targets(record).await.into_iter().filter(|t| *t != me).collect();
            if targets.is_empty() {
                return Err(e.into());
            }
            tracing::debug!(group = p.group_id, error = %e, ?targets, "the replica left this node during a lookup");
            Ok(Lookup::Elsewhere { group: p.group_id, targets })
        }
        Err(e) => Err(e.into()),
    }
}

/// Where a read goes from a replica that does not serve it (a move's new replica, still a
/// learner, for `follower` reads; one stopped by an error, for any): the partition's other
/// replicas, best first.
async fn voter_targets(s: &AppState, p: &PartitionRecord) -> Result<Vec<u64>, ApiError> {
    let me = s.router.node.node_id();
    let targets: Vec<u64> = s.router.read_targets(p).await.into_iter().filter(|t| *t != me).collect();
    if targets.is_empty() {
        return Err(ApiError::Unavailable("this replica is still catching up and no other replica is known".into()));
    }
    Ok(targets)
}

/// `GET /kv/{topic}/{key}`. Takes the whole request so its URI and headers are borrowed,
/// not copied (this is the hot read path).
async fn get_key(
    State(s): State<AppState>,
    Query(q): Query<CommonQuery>,
    request: axum::extract::Request,
) -> Result<Response, ApiError> {
    let (parts, _) = request.into_parts();
    let (uri, headers) = (&parts.uri, &parts.headers);
    let topic_name = topic_from_uri(uri)?;
    let t = topic(&s, &topic_name)?;
    let mode = read_mode(&q)?;
    let key = key_from_uri(uri, q.key_encoding.as_deref())?;
    let hop = hop(&s, headers, &q);
    let partition = q.partition.as_deref().map(partition_number).transpose()?;
    let request = LookupRequest { topic: t, key: &key, mode, partition, min_offset: q.min_offset, hop };
    let (partition, hw, read) = match lookup(&s, request).await? {
        Lookup::Here { partition, high_watermark, read } => (partition, high_watermark, read),
        Lookup::Elsewhere { group, targets } => {
            let per_target = crate::routing::forwarded_read_timeout(mode, q.min_offset.is_some());
            return s.router.redirect_read(group, &targets, hop, per_target, &path_and_query(uri), headers).await;
        }
    };
    let node_id = s.router.node.node_id();
    let meta = |resp: &mut Response| {
        let h = resp.headers_mut();
        h.insert(X_KV_PARTITION, HeaderValue::from(partition));
        h.insert(X_KV_HIGH_WATERMARK, HeaderValue::from(hw));
        h.insert(X_KV_NODE, HeaderValue::from(node_id));
    };
    match read {
        KeyRead::Found { offset, record } => {
            let mut resp = (StatusCode::OK, record.value.unwrap_or_default()).into_response();
            resp.headers_mut().reserve(6);
            meta(&mut resp);
            let h = resp.headers_mut();
            h.insert(X_KV_OFFSET, HeaderValue::from(offset));
            h.insert(X_KV_TIMESTAMP, HeaderValue::from(record.timestamp_ms));
            h.insert(header::CONTENT_TYPE, HeaderValue::from_static("application/octet-stream"));
            Ok(resp)
        }
        KeyRead::NotFound => {
            let mut resp = ApiError::KeyNotFound.into_response();
            meta(&mut resp);
            Ok(resp)
        }
        KeyRead::Evicted { offset } => {
            let mut resp = ApiError::Gone(offset).into_response();
            meta(&mut resp);
            Ok(resp)
        }
    }
}

/// How a fetch page spells keys, values and header values (`?encoding=`).
#[derive(Clone, Copy, PartialEq, Eq)]
enum FetchEncoding {
    /// UTF-8 text when every field of the page is, else base64 (the default).
    Auto,
    /// UTF-8 text; a page holding other bytes is refused.
    Utf8,
    /// base64 (standard alphabet, padded), whatever the bytes.
    Base64,
}

fn fetch_encoding(q: &CommonQuery) -> Result<FetchEncoding, ApiError> {
    match q.encoding.as_deref() {
        None | Some("auto") => Ok(FetchEncoding::Auto),
        Some("utf8") => Ok(FetchEncoding::Utf8),
        Some("base64") => Ok(FetchEncoding::Base64),
        Some(other) => {
            Err(ApiError::bad("invalid_encoding", format!("encoding must be auto, utf8 or base64, not {other:?}")))
        }
    }
}

fn encode_records(records: &[(u64, Record)], wanted: FetchEncoding) -> Result<(Vec<Value>, &'static str), ApiError> {
    let is_text = |b: &Option<Vec<u8>>| b.as_deref().is_none_or(|b| std::str::from_utf8(b).is_ok());
    let first_binary = if wanted == FetchEncoding::Base64 {
        None
    } else {
        records
            .iter()
            .find(|(_, r)| !(is_text(&r.key) && is_text(&r.value) && r.headers.iter().all(|h| is_text(&h.value))))
            .map(|(offset, _)| *offset)
    };
    let all_utf8 = wanted != FetchEncoding::Base64 && first_binary.is_none();
    if let (FetchEncoding::Utf8, Some(offset)) = (wanted, first_binary) {
        return Err(ApiError::bad(
            "invalid_encoding",
            format!(
                "the record at offset {offset} has a key, value or header value that is not UTF-8; ask for encoding=base64"
            ),
        ));
    }
    let text = |b: &Vec<u8>| -> Value {
        if all_utf8 {
            Value::String(String::from_utf8_lossy(b).into_owned())
        } else {
            Value::String(base64::engine::general_purpose::STANDARD.encode(b))
        }
    };
    let out = records
        .iter()
        .map(|(offset, r)| {
            let headers: serde_json::Map<String, Value> =
                r.headers.iter().map(|h| (h.key.clone(), h.value.as_ref().map_or(Value::Null, text))).collect();
            json!({
                "offset": offset,
                "timestamp": r.timestamp_ms,
                "key": r.key.as_ref().map_or(Value::Null, text),
                "value": r.value.as_ref().map_or(Value::Null, text),
                "headers": headers,
            })
        })
        .collect();
    Ok((out, if all_utf8 { "utf8" } else { "base64" }))
}

async fn fetch_records(
    State(s): State<AppState>,
    Segments((topic_name, partition)): Segments<(String, String)>,
    Query(q): Query<CommonQuery>,
    uri: Uri,
    headers: HeaderMap,
) -> Result<Response, ApiError> {
    let partition = partition_number(&partition)?;
    let t = topic(&s, &topic_name)?;
    let p = t.partitions.get(partition as usize).ok_or_else(|| {
        ApiError::bad("invalid_partition", format!("topic {topic_name} has no partition {partition}"))
    })?;
    let mode = read_mode(&q)?;
    let wanted = fetch_encoding(&q)?;
    let offset = q.offset.unwrap_or(0);
    if q.max_records == Some(0) || q.max_bytes == Some(0) {
        return Err(ApiError::bad("invalid_limit", "max_records and max_bytes must be at least 1"));
    }
    let max_records = q.max_records.unwrap_or(500).clamp(1, s.limits.fetch_records_max);
    let max_bytes = q.max_bytes.unwrap_or(1024 * 1024).clamp(1, s.limits.fetch_bytes_max);
    let hop = hop(&s, &headers, &q);
    let per_target = crate::routing::forwarded_read_timeout(mode, false);
    let Some(hosted) = s.router.node.group(p.group_id) else {
        let targets = s.router.read_targets(p).await;
        return s.router.redirect_read(p.group_id, &targets, hop, per_target, &path_and_query(&uri), &headers).await;
    };
    if s.router.node.replica_stopped(&hosted)
        || (mode == ReadMode::Follower && !s.router.node.serves_follower_reads(&hosted))
    {
        let targets = voter_targets(&s, p).await?;
        return s.router.redirect_read(p.group_id, &targets, hop, per_target, &path_and_query(&uri), &headers).await;
    }
    s.router.node.read_barrier(&hosted, mode).await?;
    let hw = hosted.partition.high_watermark();
    let records = s.router.node.read_records(&hosted, offset, max_records, max_bytes).await?;
    let start = hosted.partition.log_start_offset();
    let next_offset = records.last().map_or_else(|| empty_page_next_offset(offset, start, hw, mode), |(o, _)| o + 1);
    let (encoded, encoding) = encode_records(&records, wanted)?;
    let mut resp = Json(json!({
        "records": encoded,
        "next_offset": next_offset,
        "high_watermark": hw,
        "encoding": encoding,
    }))
    .into_response();
    let h = resp.headers_mut();
    h.insert(X_KV_PARTITION, HeaderValue::from(partition));
    h.insert(X_KV_HIGH_WATERMARK, HeaderValue::from(hw));
    h.insert(X_KV_NODE, HeaderValue::from(s.router.node.node_id()));
    Ok(resp)
}

/// Where the next fetch starts after a page without records asked at `offset` of a replica
/// whose log runs from `start` to `hw`: the log start for an offset retention removed; the high
/// watermark for one past it, which a leader or a caught-up replica has not reached (a
/// `follower` read keeps the offset asked: the replica may only be behind, and pointing the
/// consumer back would have it read again what it has).
fn empty_page_next_offset(offset: u64, start: u64, hw: u64, mode: ReadMode) -> u64 {
    match mode {
        ReadMode::Follower if offset > hw => offset,
        _ => offset.max(start).min(hw),
    }
}

// ---------------------------------------------------------------- cluster

async fn cluster(State(s): State<AppState>) -> Json<Value> {
    let state = s.router.node.cluster();
    let controller_leader = s.router.node.controller_leader();
    let statuses = s.router.statuses(state.nodes.keys().copied()).await;
    let voters = s.router.node.controller_voters();
    let nodes: Vec<Value> = state
        .nodes
        .values()
        .map(|n| {
            let status = statuses.iter().find(|st| st.node_id == n.node_id);
            let hosts: Vec<u64> = status.map(|st| st.groups.iter().map(|g| g.group_id).collect()).unwrap_or_default();
            let leads: Vec<u64> = status
                .map(|st| st.groups.iter().filter(|g| g.leader_node == n.node_id).map(|g| g.group_id).collect())
                .unwrap_or_default();
            json!({
                "node_id": n.node_id,
                "rpc_addr": n.rpc_addr,
                "http_addr": n.http_addr,
                "alive": status.is_some(),
                "controller_role": if voters.contains(&n.node_id) { "voter" } else { "learner" },
                "groups_hosted": hosts,
                "groups_led": leads,
            })
        })
        .collect();
    let cluster_id = s.router.node.cluster_identity().get().map(|id| format!("{id:016x}"));
    Json(json!({
        "cluster_id": cluster_id,
        "node_id": s.router.node.node_id(),
        "controller_leader": controller_leader,
        "controller_voters": voters,
        "nodes": nodes,
        "removed_nodes": state.removed_nodes.keys().collect::<Vec<_>>(),
    }))
}

/// How long a removal waits for the controller's leader to take the node out of the
/// controller group before it answers 202.
const REMOVAL_WAIT: Duration = Duration::from_secs(10);

/// `DELETE /cluster/nodes/{node}`: removes a node that is down for good and holds no replica
/// from the cluster. Its id and data directory never take part again, and when it was a
/// controller voter a live learner takes its place.
async fn remove_node(State(s): State<AppState>, Path(node): Path<String>) -> Result<Response, ApiError> {
    // Digits only, as for a partition: `u64::from_str` also takes a leading `+`.
    let digits = !node.is_empty() && node.bytes().all(|b| b.is_ascii_digit());
    let node: u64 = node
        .parse()
        .ok()
        .filter(|_| digits)
        .ok_or_else(|| ApiError::bad("invalid_node", format!("node id must be a number, got {node:?}")))?;
    let state = s.router.node.cluster();
    let me = s.router.node.node_id();
    if !state.nodes.contains_key(&me) {
        return Err(ApiError::Unavailable(format!(
            "node {me} has not joined the cluster yet and does not know its nodes; retry, or ask another node"
        )));
    }
    if !state.removed_nodes.contains_key(&node) {
        // A node of --peers that never started is a controller member, never registered.
        let controller_member = s.router.node.controller_membership_has(node);
        if !state.nodes.contains_key(&node) && !controller_member {
            return Err(ApiError::NodeNotFound(node));
        }
        if !s.router.statuses([node]).await.is_empty() {
            return Err(ApiError::ConflictWith {
                code: "node_running",
                message: format!(
                    "node {node} answers: a node is removed only once it is stopped for good (move its replicas \
                     off, stop it, then remove it)"
                ),
            });
        }
        let cmd = pb::ControllerCommand {
            kind: Some(pb::controller_command::Kind::RemoveNode(pb::RemoveNode { node_id: node, controller_member })),
        };
        let result = s.router.node.controller_write(cmd, false).await?;
        match result.status.as_str() {
            "ok" | "exists" => {}
            "not_found" => return Err(ApiError::NodeNotFound(node)),
            "conflict" => return Err(ApiError::ConflictWith { code: "node_has_replicas", message: result.message }),
            _ => return Err(ApiError::Internal(result.message)),
        }
    }
    let left = s.router.node.wait_left_controller_group(node, REMOVAL_WAIT).await;
    let status = if left { StatusCode::OK } else { StatusCode::ACCEPTED };
    let body = json!({
        "node_id": node,
        "removed": true,
        "controller_group": if left { "left" } else { "leaving" },
        "controller_voters": s.router.node.controller_voters(),
    });
    Ok((status, Json(body)).into_response())
}

async fn readyz(State(s): State<AppState>) -> Response {
    let controller_has_leader = s.router.node.controller_leader().is_some();
    let registered = s.router.node.cluster().nodes.contains_key(&s.router.node.node_id());
    let groups_led = s.router.node.groups().iter().all(|g| s.router.node.reported_leader_node(g).is_some());
    let starting = s.router.node.replicas_starting();
    // A replica stopped by an error (of its storage: a full disk, say) takes no part in its
    // group until the node restarts: the node is not ready, and says which and why.
    let stopped = s.router.node.stopped_replicas();
    if !stopped.is_empty() {
        let named: Vec<String> = stopped
            .iter()
            .map(|(g, why)| match g {
                Some(g) => format!("topic {} partition {}: {why}", g.topic, g.partition_no),
                None => format!("the controller: {why}"),
            })
            .collect();
        return ApiError::Unavailable(format!(
            "not ready: {} replica(s) of this node stopped on an error and take no part in their groups until \
             the node restarts (restart it once the cause is fixed): {}",
            stopped.len(),
            named.join("; ")
        ))
        .into_response();
    }
    if controller_has_leader && registered && groups_led && starting == 0 {
        (StatusCode::OK, "ready").into_response()
    } else {
        ApiError::Unavailable(format!(
            "not ready: controller leader known: {controller_has_leader}, registered: {registered}, every group has a leader: {groups_led}, replicas still starting: {starting}"
        ))
        .into_response()
    }
}

async fn metrics(State(s): State<AppState>) -> Response {
    use std::fmt::Write;
    use std::sync::atomic::Ordering::Relaxed;
    let mut out = String::new();
    let node = s.router.node.node_id();
    let groups = s.router.node.groups();
    type Gauge = fn(&logdex_raft::node::HostedGroup) -> u64;
    let series: [(&str, &str, &str, Gauge); 16] = [
        ("logdex_partition_high_watermark", "gauge", "Offset after the last applied record.", |g| {
            g.partition.high_watermark()
        }),
        ("logdex_partition_log_start_offset", "gauge", "First readable offset.", |g| g.partition.log_start_offset()),
        ("logdex_partition_leader", "gauge", "1 when this node leads the partition.", |g| {
            u64::from(g.raft.is_leader())
        }),
        ("logdex_partition_applied_lag_entries", "gauge", "Raft entries appended but not yet applied.", |g| {
            let m = logdex_raft::types::metrics_of(&g.raft);
            m.last_log_index.unwrap_or(0).saturating_sub(m.last_applied.map_or(0, |l| l.index))
        }),
        ("logdex_partition_log_bytes", "gauge", "Bytes of segment files.", |g| g.partition.size_bytes()),
        ("logdex_partition_segments", "gauge", "Segment files.", |g| g.partition.segment_count() as u64),
        ("logdex_partition_remote_segments", "gauge", "Segments in tiered storage (the manifest).", |g| {
            g.partition.tier_manifest().segments.len() as u64
        }),
        ("logdex_partition_remote_bytes", "gauge", "Bytes of segments in tiered storage.", |g| {
            g.partition.tier_manifest().size_bytes()
        }),
        (
            "logdex_partition_index_keys",
            "gauge",
            "Keys written to the replica's index minus keys deleted: an upper bound of its live keys (an overwrite, or a re-apply after a crash, counts again).",
            |g| g.partition.index_keys(),
        ),
        ("logdex_partition_compactions_total", "counter", "Compaction passes.", |g| {
            g.partition.counters.compactions.load(Relaxed)
        }),
        ("logdex_partition_compacted_records_total", "counter", "Records removed by compaction.", |g| {
            g.partition.counters.records_compacted.load(Relaxed)
        }),
        ("logdex_partition_snapshots_built_total", "counter", "Snapshots built.", |g| {
            g.partition.counters.snapshots_built.load(Relaxed)
        }),
        ("logdex_partition_snapshots_installed_total", "counter", "Snapshots installed from a leader.", |g| {
            g.partition.counters.snapshots_installed.load(Relaxed)
        }),
        (
            "logdex_partition_scrubbed_bytes_total",
            "counter",
            "Sealed segment bytes the scrub read and found whole.",
            |g| g.partition.counters.bytes_scrubbed.load(Relaxed),
        ),
        (
            "logdex_partition_damaged",
            "gauge",
            "1 while the scrub finds a damaged sealed segment in this replica.",
            |g| u64::from(g.partition.is_damaged()),
        ),
        (
            "logdex_partition_stopped",
            "gauge",
            "1 when the replica's group stopped on an error (of its storage: a full disk, say) until the node restarts.",
            |g| u64::from(logdex_raft::node::stopped_by(&logdex_raft::types::metrics_of(&g.raft)).is_some()),
        ),
    ];
    for (name, kind, help, value) in series {
        let _ = writeln!(out, "# HELP {name} {help}");
        let _ = writeln!(out, "# TYPE {name} {kind}");
        for g in &groups {
            let labels = format!("node=\"{node}\",topic=\"{}\",partition=\"{}\"", g.topic, g.partition_no);
            let _ = writeln!(out, "{name}{{{labels}}} {}", value(g));
        }
    }
    let sync = s.router.node.raft_log_sync_stats();
    let reads = s.router.node.read_index_stats();
    let heartbeats = s.router.node.heartbeat_stats();
    let appends = s.router.node.append_stats();
    for (name, help, v) in [
        (
            "logdex_follower_linearizable_reads_total",
            "linearizable and strict reads served by a follower replica of this node.",
            &reads.reads,
        ),
        (
            "logdex_read_index_requests_total",
            "Read-index calls sent to leaders for them (concurrent reads of the groups one node leads share one).",
            &reads.fetches,
        ),
        (
            "logdex_heartbeat_calls_total",
            "Heartbeats (also the quorum rounds of strict reads) sent by this node's leader replicas as calls on call streams.",
            &heartbeats.calls,
        ),
        (
            "logdex_heartbeat_streams_total",
            "Heartbeats sent on append streams of their own, to peers that do not take them as calls.",
            &heartbeats.streams,
        ),
        (
            "logdex_append_requests_total",
            "Requests sent on the replication streams of this node's leader replicas.",
            &appends.requests,
        ),
        (
            "logdex_commit_notices_replaced_total",
            "Replication requests that carried only a commit index and were replaced by the next request of their stream.",
            &appends.commit_notices_replaced,
        ),
        (
            "logdex_damaged_snapshots_refused_total",
            "Snapshots received from a leader and refused as damaged (that leader then hands off leadership).",
            s.router.node.damaged_snapshots_refused(),
        ),
        (
            "logdex_leadership_handoffs_total",
            "Leaderships this node's leader replicas handed to their partition's preferred replica when it asked (leader balancing).",
            s.router.node.leadership_handoffs(),
        ),
        ("logdex_raft_log_fsyncs_total", "fsyncs of the Raft log (one serves every group).", &sync.fsyncs),
        ("logdex_raft_log_flush_requests_total", "Appends and votes made durable by those fsyncs.", &sync.requests),
        (
            "logdex_raft_log_loaded_lingers_total",
            "fsyncs that first waited --group-commit-wait-us for more appends, as many writes of several partitions were waiting on the node.",
            &sync.loaded_lingers,
        ),
    ] {
        let _ =
            writeln!(out, "# HELP {name} {help}\n# TYPE {name} counter\n{name}{{node=\"{node}\"}} {}", v.load(Relaxed));
    }
    // Prometheus's base unit: seconds, counted in microseconds.
    let name = "logdex_raft_log_fsync_seconds_total";
    let fsync_seconds = sync.fsync_micros.load(Relaxed) as f64 / 1e6;
    let _ = writeln!(
        out,
        "# HELP {name} Time spent in Raft log fsyncs.\n# TYPE {name} counter\n{name}{{node=\"{node}\"}} {fsync_seconds}"
    );
    let records = s.router.node.record_cache();
    let ((hits, misses), (bytes, capacity)) = (records.hits_and_misses(), records.bytes_and_capacity());
    for (name, kind, help, v) in [
        ("logdex_record_cache_hits_total", "counter", "Key lookups that found their record in the record cache.", hits),
        (
            "logdex_record_cache_misses_total",
            "counter",
            "Key lookups that read their record from the segment log.",
            misses,
        ),
        ("logdex_record_cache_bytes", "gauge", "Bytes of records held by the record cache.", bytes),
        ("logdex_record_cache_capacity_bytes", "gauge", "Bound of the record cache (--record-cache-mb).", capacity),
    ] {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}\n{name}{{node=\"{node}\"}} {v}");
    }
    s.guard.metrics.render(&mut out);
    ([("content-type", "text/plain; version=0.0.4")], out).into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn onward(uri: &str) -> Result<String, Box<dyn std::error::Error>> {
        Ok(path_and_query(&uri.parse::<Uri>()?))
    }

    #[test]
    fn keys_with_dot_segments_go_on_base64url_encoded_with_the_rest_of_the_query()
    -> Result<(), Box<dyn std::error::Error>> {
        let b64 = |key: &[u8]| base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(key);
        assert_eq!(onward("/kv/t/..")?, format!("/kv/t/{}?key_encoding=base64url", b64(b"..")));
        assert_eq!(onward("/kv/t/.%2E")?, format!("/kv/t/{}?key_encoding=base64url", b64(b"..")));
        assert_eq!(onward("/kv/t/%2E")?, format!("/kv/t/{}?key_encoding=base64url", b64(b".")));
        assert_eq!(
            onward("/kv/t/a/./b?read=follower&key_encoding=utf8")?,
            format!("/kv/t/{}?read=follower&key_encoding=base64url", b64(b"a/./b"))
        );
        assert_eq!(
            onward("/kv/t/x/y/%2e%2E?forward=false")?,
            format!("/kv/t/{}?forward=false&key_encoding=base64url", b64(b"x/y/.."))
        );
        // Dots that are not a whole segment, and other paths, go on as they came.
        assert_eq!(onward("/kv/t/a.b/..c?read=strict")?, "/kv/t/a.b/..c?read=strict");
        assert_eq!(onward("/kv/t/Li4?key_encoding=base64url")?, "/kv/t/Li4?key_encoding=base64url");
        assert_eq!(onward("/topics/t/partitions/0/records?offset=1")?, "/topics/t/partitions/0/records?offset=1");
        Ok(())
    }

    fn refusal(result: Result<u32, ApiError>) -> String {
        match result {
            Err(ApiError::BadRequest { code, message }) => format!("{code}: {message}"),
            other => panic!("expected a 400, got {other:?}"),
        }
    }

    #[test]
    fn an_empty_follower_page_past_the_replicas_high_watermark_keeps_the_offset_asked() {
        // Below the log start: the log start; within the log: the offset asked.
        for mode in [ReadMode::Linearizable, ReadMode::Strict, ReadMode::Follower] {
            assert_eq!(empty_page_next_offset(3, 10, 50, mode), 10);
            assert_eq!(empty_page_next_offset(50, 10, 50, mode), 50);
        }
        // Past the high watermark: a leader's answer is its end; a follower may be behind.
        assert_eq!(empty_page_next_offset(70, 10, 50, ReadMode::Linearizable), 50);
        assert_eq!(empty_page_next_offset(70, 10, 50, ReadMode::Strict), 50);
        assert_eq!(empty_page_next_offset(70, 10, 50, ReadMode::Follower), 70);
    }

    #[test]
    fn partition_numbers_are_plain_digits_and_one_too_large_is_named_as_such() {
        assert_eq!(partition_number("0").ok(), Some(0));
        assert_eq!(partition_number("4294967295").ok(), Some(u32::MAX));
        for text in ["", "-1", "+1", "1.0", " 1", "x"] {
            assert!(refusal(partition_number(text)).contains("a number from 0 up"), "{text:?}");
        }
        let too_large = refusal(partition_number("4294967296"));
        assert!(too_large.starts_with("invalid_partition: no topic has partition 4294967296"), "{too_large}");
        let in_a_record = match record_partition(Some(json!(4294967296u64)), 3) {
            Err(ApiError::BadRequest { message, .. }) => message,
            other => panic!("expected a 400, got {other:?}"),
        };
        assert!(in_a_record.starts_with("record 3: no topic has partition 4294967296"), "{in_a_record}");
        assert_eq!(record_partition(Some(json!(5)), 0).ok(), Some(Some(5)));
        assert_eq!(record_partition(Some(Value::Null), 0).ok(), Some(None));
    }
}
