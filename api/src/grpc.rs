//! The client gRPC API (`api/proto/logdex.proto`).
//!
//! `Get` is served from the node directly when it holds a replica of the key's
//! partition: the same lookup, checks and metrics as `GET /kv/{topic}/{key}`
//! (`http::lookup`, `Guard::admit_lookup`), without an HTTP request in between.
//! `Put` and `Delete` call the write of `PUT` and `DELETE /kv/{topic}/{key}`
//! (`http::write_one`, which forwards or redirects as over HTTP) after
//! `Guard::admit_call`. Every other call, and a `Get` another node must answer, is
//! translated into the equivalent HTTP request and served by the same in-process
//! router, so routing, forwarding, limits and error codes are one implementation for
//! both protocols.

use std::time::Instant;

use axum::body::Body;
use axum::http::Method;
use axum::http::Request as HttpRequest;
use axum::http::StatusCode;
use base64::Engine;
use logdex_raft::node::ReadMode;
use logdex_raft::partition::KeyRead;
use serde_json::Value;
use serde_json::json;
use tonic::Request;
use tonic::Response;
use tonic::Status;
use tower::ServiceExt;

use crate::error::ApiError;
use crate::http::AppState;
use crate::http::Lookup;
use crate::http::LookupRequest;
use crate::middleware::LOOKUP_ROUTE;
use crate::middleware::Origin;
use crate::routing::Hop;

pub mod pb {
    //! Generated from `api/proto/logdex.proto`.
    #![allow(clippy::all, missing_docs)]
    tonic::include_proto!("logdex.api.v1");
}

use pb::logdex_server::Logdex;
use pb::logdex_server::LogdexServer;

/// Largest body of an answer the gRPC layer reads back from the router.
const ANSWER_BYTES_MAX: usize = 64 * 1024 * 1024;

pub struct Service {
    app: axum::Router,
    state: AppState,
}

/// The client gRPC API over `app`, the HTTP router built on `state`. A message may be up to
/// twice the HTTP body limit, so a value or batch over the limits gets the same
/// `too_large` answer as over HTTP; a longer one is refused by the transport (`OUT_OF_RANGE`).
pub fn server(app: axum::Router, state: AppState) -> LogdexServer<Service> {
    let message_bytes_max = state.limits.body_bytes_max.saturating_mul(2);
    LogdexServer::new(Service { app, state }).max_decoding_message_size(message_bytes_max)
}

/// Prost's codec, except that a message that does not decode (not protobuf, a string field
/// that is not UTF-8) is `INVALID_ARGUMENT` `invalid_request`, as HTTP answers a body it cannot
/// read with 400, where prost's says `INTERNAL`.
pub struct RequestCodec<T, U>(tonic_prost::ProstCodec<T, U>);

impl<T, U> Default for RequestCodec<T, U> {
    fn default() -> Self {
        RequestCodec(tonic_prost::ProstCodec::default())
    }
}

impl<T, U> tonic::codec::Codec for RequestCodec<T, U>
where
    T: prost::Message + Send + 'static,
    U: prost::Message + Default + Send + 'static,
{
    type Encode = T;
    type Decode = U;
    type Encoder = tonic_prost::ProstEncoder<T>;
    type Decoder = BadInputDecoder<tonic_prost::ProstDecoder<U>>;

    fn encoder(&mut self) -> Self::Encoder {
        self.0.encoder()
    }

    fn decoder(&mut self) -> Self::Decoder {
        BadInputDecoder(self.0.decoder())
    }
}

/// See [`RequestCodec`].
pub struct BadInputDecoder<D>(D);

impl<D: tonic::codec::Decoder<Error = Status>> tonic::codec::Decoder for BadInputDecoder<D> {
    type Item = D::Item;
    type Error = Status;

    fn decode(&mut self, src: &mut tonic::codec::DecodeBuf<'_>) -> Result<Option<Self::Item>, Status> {
        self.0.decode(src).map_err(|e| Status::invalid_argument(format!("invalid_request: {}", e.message())))
    }

    fn buffer_settings(&self) -> tonic::codec::BufferSettings {
        self.0.buffer_settings()
    }
}

fn b64url(bytes: &[u8]) -> String {
    base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(bytes)
}

fn b64(bytes: &[u8]) -> String {
    base64::engine::general_purpose::STANDARD.encode(bytes)
}

fn unb64(text: &str) -> Result<Vec<u8>, Status> {
    base64::engine::general_purpose::STANDARD
        .decode(text)
        .map_err(|e| status_of_error(&ApiError::Internal(format!("undecodable answer: {e}"))))
}

/// The read mode a request names; a value the proto does not define is refused, as HTTP
/// refuses an unknown `read=`.
fn read_mode(mode: i32) -> Result<ReadMode, Status> {
    read_mode_of(mode).map_err(|e| status_of_error(&e))
}

fn read_mode_of(mode: i32) -> Result<ReadMode, ApiError> {
    match pb::ReadMode::try_from(mode) {
        Ok(pb::ReadMode::Linearizable) => Ok(ReadMode::Linearizable),
        Ok(pb::ReadMode::Strict) => Ok(ReadMode::Strict),
        Ok(pb::ReadMode::Follower) => Ok(ReadMode::Follower),
        Err(_) => Err(ApiError::bad(
            "invalid_read_mode",
            format!("read mode {mode} is none of linearizable (0), strict (1), follower (2)"),
        )),
    }
}

fn read_mode_name(mode: ReadMode) -> &'static str {
    match mode {
        ReadMode::Strict => "strict",
        ReadMode::Follower => "follower",
        ReadMode::Linearizable => "linearizable",
    }
}

/// Maps an HTTP error answer to a gRPC status with the stable error code in the message.
fn status_of(code: StatusCode, body: &[u8], headers: &axum::http::HeaderMap) -> Status {
    let v: Value = serde_json::from_slice(body).unwrap_or(Value::Null);
    let error_code = v["error"]["code"].as_str().unwrap_or("error");
    let message = v["error"]["message"].as_str().unwrap_or("");
    let redirect = headers.get("x-kv-redirect").and_then(|v| v.to_str().ok());
    status_with(code, error_code, message, redirect)
}

/// Maps an error of this node's own answer to a gRPC status, as [`status_of`] maps the same
/// error answered over HTTP.
fn status_of_error(e: &ApiError) -> Status {
    let redirect = match e {
        ApiError::Misdirected { redirect, .. } => redirect.as_deref(),
        _ => None,
    };
    status_with(e.status(), e.code(), &e.to_string(), redirect)
}

/// A gRPC status for an HTTP status, with the stable error code in the message and the
/// redirect, if any, in the `x-kv-redirect` metadata.
fn status_with(code: StatusCode, error_code: &str, message: &str, redirect: Option<&str>) -> Status {
    let message = format!("{error_code}: {}", within(message, STATUS_MESSAGE_BYTES_MAX));
    let mut status = match code {
        StatusCode::BAD_REQUEST | StatusCode::PAYLOAD_TOO_LARGE => Status::invalid_argument(message),
        StatusCode::NOT_FOUND => Status::not_found(message),
        StatusCode::CONFLICT => Status::already_exists(message),
        StatusCode::GONE => Status::out_of_range(message),
        StatusCode::MISDIRECTED_REQUEST => Status::failed_precondition(message),
        StatusCode::TOO_MANY_REQUESTS => Status::resource_exhausted(message),
        StatusCode::SERVICE_UNAVAILABLE => Status::unavailable(message),
        StatusCode::GATEWAY_TIMEOUT => Status::deadline_exceeded(message),
        StatusCode::UNAUTHORIZED => Status::unauthenticated(message),
        _ if error_code == "corrupt_data" => Status::data_loss(message),
        _ => Status::internal(message),
    };
    if let Some(redirect) = redirect
        && let Ok(v) = redirect.parse()
    {
        status.metadata_mut().insert("x-kv-redirect", v);
    }
    status
}

/// Longest status message sent: it travels as an HTTP/2 header, which clients refuse over
/// 16 KiB (a message naming a 20,000-byte topic would fail the call instead of answering it).
const STATUS_MESSAGE_BYTES_MAX: usize = 1024;

/// `text` cut to at most `max` bytes at a character boundary, `...` marking a cut.
fn within(text: &str, max: usize) -> std::borrow::Cow<'_, str> {
    if text.len() <= max {
        return text.into();
    }
    let end = (0..=max - 3).rev().find(|i| text.is_char_boundary(*i)).unwrap_or(0);
    format!("{}...", &text[..end]).into()
}

/// `topic` when it can name a topic (Kafka's rules: letters, digits, '.', '_', '-'), else the
/// `invalid_topic` HTTP answers for such a name. Only a valid name goes into the path of an
/// in-process request, so no name can reach another route, key or query. Whether the topic
/// exists is the router's answer, after its authentication.
fn topic_segment(topic: &str) -> Result<&str, Status> {
    logdex_raft::controller::validate_topic_name(topic)
        .map(|()| topic)
        .map_err(|m| status_of_error(&ApiError::bad("invalid_topic", m)))
}

struct Answer {
    status: StatusCode,
    headers: axum::http::HeaderMap,
    body: bytes::Bytes,
}

impl Service {
    /// Adds `x-kv-redirect-rpc` beside an `x-kv-redirect`: the address where the node that
    /// URL names serves this API, for a gRPC client to call it directly.
    fn with_rpc_redirect(&self, mut status: Status) -> Status {
        let authority = status
            .metadata()
            .get("x-kv-redirect")
            .and_then(|v| v.to_str().ok())
            .and_then(|url| url.parse::<axum::http::Uri>().ok())
            .and_then(|uri| uri.authority().map(|a| a.as_str().to_string()));
        let rpc_addr = authority.and_then(|authority| {
            let cluster = self.state.router.node.cluster();
            cluster.nodes.values().find(|n| n.http_addr == authority).map(|n| n.rpc_addr.clone())
        });
        if let Some(Ok(v)) = rpc_addr.map(|a| a.parse()) {
            status.metadata_mut().insert("x-kv-redirect-rpc", v);
        }
        status
    }

    async fn call(&self, method: &str, uri: String, body: Vec<u8>, auth: Option<String>) -> Result<Answer, Status> {
        let mut builder = HttpRequest::builder()
            .method(method)
            .uri(uri)
            .header("content-type", "application/json")
            .extension(crate::middleware::GrpcCall);
        if let Some(a) = auth {
            builder = builder.header("authorization", a);
        }
        let request = builder
            .body(Body::from(body))
            .map_err(|e| status_of_error(&ApiError::bad("invalid_request", e.to_string())))?;
        let response =
            self.app.clone().oneshot(request).await.map_err(|e| status_of_error(&ApiError::Internal(e.to_string())))?;
        let status = response.status();
        let headers = response.headers().clone();
        let body = axum::body::to_bytes(response.into_body(), ANSWER_BYTES_MAX)
            .await
            .map_err(|e| status_of_error(&ApiError::Internal(e.to_string())))?;
        Ok(Answer { status, headers, body })
    }

    /// A `Put` (`value`) or `Delete` (`None`): served from the node directly, with the checks,
    /// routing and metrics of `PUT` and `DELETE /kv/{topic}/{key}` (`http::write_one`,
    /// `Guard::admit_call`), without an HTTP request in between.
    async fn write(&self, request: Request<impl KeyedWrite>) -> Result<Response<pb::WriteResponse>, Status> {
        let started = Instant::now();
        let auth = authorization(&request);
        let (method, at, value) = request.into_inner().into_parts();
        let s = &self.state;
        let written = async {
            // The token first: a call without it learns nothing of its input's faults.
            let _slot = s.guard.admit_call(auth.as_deref())?;
            // As `/kv/{topic}/` answers over HTTP, whatever the topic.
            if at.key.is_empty() {
                return Err(crate::http::empty_key());
            }
            // The request's HTTP form: a node that does not forward names it in its redirect.
            // It is parsed only once `write_one` has checked the key's bound, and the topic
            // exists by then (so its name is a valid path segment).
            let mut uri = format!("/kv/{}/{}?key_encoding=base64url", at.topic, b64url(&at.key));
            if let Some(p) = at.partition {
                uri.push_str(&format!("&partition={p}"));
            }
            let uri = move || {
                with_forward(uri, at.forward).parse().map_err(|e| ApiError::Internal(format!("the request's URI: {e}")))
            };
            let write = crate::http::KeyWrite {
                topic: crate::http::topic(s, &at.topic)?,
                key: at.key,
                value,
                partition: at.partition,
                hop: Hop { forwarded: false, forward: at.forward.unwrap_or(s.forward_default) },
            };
            crate::http::write_one(s, write, uri).await
        }
        .await;
        let status = written.as_ref().map_or_else(ApiError::status, |_| StatusCode::OK);
        // Counted as the HTTP route it stands for.
        s.guard.metrics.observe(Origin::Grpc, &method, LOOKUP_ROUTE, status, started.elapsed());
        written
            .map(|(partition, offset)| Response::new(pb::WriteResponse { partition, offset }))
            .map_err(|e| self.with_rpc_redirect(status_of_error(&e)))
    }

    /// A `Get` another node answers: through the router, which forwards it or answers 421.
    async fn get_through_router(
        &self,
        r: pb::GetRequest,
        auth: Option<String>,
    ) -> Result<Response<pb::GetResponse>, Status> {
        let mode = read_mode_name(read_mode(r.read)?);
        let topic = topic_segment(&r.topic)?;
        let mut uri = format!("/kv/{topic}/{}?key_encoding=base64url&read={mode}", b64url(&r.key));
        if let Some(p) = r.partition {
            uri.push_str(&format!("&partition={p}"));
        }
        if let Some(m) = r.min_offset {
            uri.push_str(&format!("&min_offset={m}"));
        }
        let a = self.call("GET", with_forward(uri, r.forward), Vec::new(), auth).await?;
        let found = a.status == StatusCode::OK;
        let key_not_found = a.status == StatusCode::NOT_FOUND && a.headers.contains_key("x-kv-partition");
        if !found && !key_not_found {
            return Err(self.with_rpc_redirect(status_of(a.status, &a.body, &a.headers)));
        }
        Ok(Response::new(pb::GetResponse {
            found,
            value: if found { a.body.to_vec() } else { Vec::new() },
            partition: header_u64(&a.headers, "x-kv-partition") as u32,
            offset: header_u64(&a.headers, "x-kv-offset"),
            high_watermark: header_u64(&a.headers, "x-kv-high-watermark"),
            node: header_u64(&a.headers, "x-kv-node"),
            timestamp_ms: header_u64(&a.headers, "x-kv-timestamp") as i64,
        }))
    }
}

/// Where a `Put` or `Delete` writes.
struct KeyAt {
    topic: String,
    key: Vec<u8>,
    partition: Option<u32>,
    /// The request's `forward`; `None` follows the node's `--forward`.
    forward: Option<bool>,
}

/// A `Put` or a `Delete`.
trait KeyedWrite {
    /// The HTTP method the call stands for, where it writes, and the value (`None`: a tombstone).
    fn into_parts(self) -> (Method, KeyAt, Option<Vec<u8>>);
}

impl KeyedWrite for pb::PutRequest {
    fn into_parts(self) -> (Method, KeyAt, Option<Vec<u8>>) {
        let at = KeyAt { topic: self.topic, key: self.key, partition: self.partition, forward: self.forward };
        (Method::PUT, at, Some(self.value))
    }
}

impl KeyedWrite for pb::DeleteRequest {
    fn into_parts(self) -> (Method, KeyAt, Option<Vec<u8>>) {
        let at = KeyAt { topic: self.topic, key: self.key, partition: self.partition, forward: self.forward };
        (Method::DELETE, at, None)
    }
}

/// `uri` with the request's `forward` as HTTP's `forward=` query parameter, when it has one.
fn with_forward(mut uri: String, forward: Option<bool>) -> String {
    if let Some(forward) = forward {
        uri.push(if uri.contains('?') { '&' } else { '?' });
        uri.push_str(if forward { "forward=true" } else { "forward=false" });
    }
    uri
}

impl Service {
    /// The request's `authorization` metadata, once it passed the bearer token check: a call
    /// without the token is refused before its input is looked at, as over HTTP.
    fn authorized<T>(&self, request: &Request<T>) -> Result<Option<String>, Status> {
        let auth = authorization(request);
        self.state.guard.check_token(auth.as_deref()).map_err(|e| status_of_error(&e))?;
        Ok(auth)
    }
}

fn authorization<T>(request: &Request<T>) -> Option<String> {
    request.metadata().get("authorization").and_then(|v| v.to_str().ok()).map(str::to_string)
}

fn header_u64(headers: &axum::http::HeaderMap, name: &str) -> u64 {
    headers.get(name).and_then(|v| v.to_str().ok()).and_then(|v| v.parse().ok()).unwrap_or(0)
}

#[tonic::async_trait]
impl Logdex for Service {
    async fn put(&self, request: Request<pb::PutRequest>) -> Result<Response<pb::WriteResponse>, Status> {
        self.write(request).await
    }

    async fn delete(&self, request: Request<pb::DeleteRequest>) -> Result<Response<pb::WriteResponse>, Status> {
        self.write(request).await
    }

    async fn get(&self, request: Request<pb::GetRequest>) -> Result<Response<pb::GetResponse>, Status> {
        let started = Instant::now();
        let auth = authorization(&request);
        let client = request.remote_addr().map(|a| a.ip());
        let r = request.into_inner();
        let s = &self.state;
        let looked_up = async {
            // The token first: a call without it learns nothing of its input's faults.
            let _slot = s.guard.admit_lookup(auth.as_deref(), client)?;
            let request = LookupRequest {
                mode: read_mode_of(r.read)?,
                topic: crate::http::topic(s, &r.topic)?,
                key: &r.key,
                partition: r.partition,
                min_offset: r.min_offset,
                hop: Hop { forwarded: false, forward: r.forward.unwrap_or(s.forward_default) },
            };
            crate::http::lookup(s, request).await
        }
        .await;
        let node = s.router.node.node_id();
        let answer = match looked_up {
            Ok(Lookup::Elsewhere { .. }) => return self.get_through_router(r, auth).await,
            Ok(Lookup::Here { partition, high_watermark, read }) => match read {
                KeyRead::Found { offset, record } => Ok(pb::GetResponse {
                    found: true,
                    value: record.value.unwrap_or_default(),
                    partition,
                    offset,
                    high_watermark,
                    node,
                    timestamp_ms: record.timestamp_ms,
                }),
                KeyRead::NotFound => Ok(pb::GetResponse { partition, high_watermark, node, ..Default::default() }),
                KeyRead::Evicted { offset } => Err(ApiError::Gone(offset)),
            },
            Err(e) => Err(e),
        };
        let status = match &answer {
            Ok(a) if a.found => StatusCode::OK,
            Ok(_) => StatusCode::NOT_FOUND,
            Err(e) => e.status(),
        };
        s.guard.metrics.observe(Origin::Grpc, &Method::GET, LOOKUP_ROUTE, status, started.elapsed());
        answer.map(Response::new).map_err(|e| self.with_rpc_redirect(status_of_error(&e)))
    }

    async fn produce(&self, request: Request<pb::ProduceRequest>) -> Result<Response<pb::ProduceResponse>, Status> {
        let auth = self.authorized(&request)?;
        let r = request.into_inner();
        let topic = topic_segment(&r.topic)?;
        let mut records = Vec::with_capacity(r.records.len());
        for (n, rec) in r.records.iter().enumerate() {
            let mut headers: serde_json::Map<String, Value> =
                rec.headers.iter().map(|(k, v)| (k.clone(), Value::String(b64(v)))).collect();
            for name in &rec.null_headers {
                if headers.insert(name.clone(), Value::Null).is_some() {
                    return Err(status_of_error(&ApiError::bad(
                        "invalid_record",
                        format!("record {n}: header {name:?} is in both headers and null_headers"),
                    )));
                }
            }
            records.push(json!({
                "key": rec.key.as_deref().map(b64),
                "value": rec.value.as_deref().map(b64),
                "headers": headers,
                "partition": rec.partition,
            }));
        }
        let body = serde_json::to_vec(&json!({ "records": records, "encoding": "base64" }))
            .map_err(|e| status_of_error(&ApiError::Internal(e.to_string())))?;
        let a = self.call("POST", with_forward(format!("/topics/{topic}/records"), r.forward), body, auth).await?;
        if !a.status.is_success() {
            return Err(self.with_rpc_redirect(status_of(a.status, &a.body, &a.headers)));
        }
        let v: Value =
            serde_json::from_slice(&a.body).map_err(|e| status_of_error(&ApiError::Internal(e.to_string())))?;
        let offsets = v["offsets"]
            .as_array()
            .map(|a| {
                a.iter()
                    .map(|o| pb::WriteResponse {
                        partition: o["partition"].as_u64().unwrap_or(0) as u32,
                        offset: o["offset"].as_u64().unwrap_or(0),
                    })
                    .collect()
            })
            .unwrap_or_default();
        Ok(Response::new(pb::ProduceResponse { offsets }))
    }

    async fn fetch(&self, request: Request<pb::FetchRequest>) -> Result<Response<pb::FetchResponse>, Status> {
        let auth = self.authorized(&request)?;
        let r = request.into_inner();
        let topic = topic_segment(&r.topic)?;
        let mode = read_mode_name(read_mode(r.read)?);
        // proto3 cannot tell 0 from unset: 0 asks for the defaults.
        let max_records = if r.max_records == 0 { 500 } else { r.max_records };
        let max_bytes = if r.max_bytes == 0 { 1024 * 1024 } else { r.max_bytes };
        let uri = format!(
            "/topics/{topic}/partitions/{}/records?offset={}&max_records={max_records}&max_bytes={max_bytes}&read={mode}",
            r.partition, r.offset,
        );
        let a = self.call("GET", with_forward(uri, r.forward), Vec::new(), auth).await?;
        if !a.status.is_success() {
            return Err(self.with_rpc_redirect(status_of(a.status, &a.body, &a.headers)));
        }
        let v: Value =
            serde_json::from_slice(&a.body).map_err(|e| status_of_error(&ApiError::Internal(e.to_string())))?;
        let base64 = v["encoding"].as_str() == Some("base64");
        let bytes_of = |field: &Value| -> Result<Option<Vec<u8>>, Status> {
            match field.as_str() {
                None => Ok(None),
                Some(s) if base64 => unb64(s).map(Some),
                Some(s) => Ok(Some(s.as_bytes().to_vec())),
            }
        };
        let mut records = Vec::new();
        for rec in v["records"].as_array().into_iter().flatten() {
            let mut headers = std::collections::HashMap::new();
            let mut null_headers = Vec::new();
            for (k, hv) in rec["headers"].as_object().into_iter().flatten() {
                match bytes_of(hv)? {
                    Some(value) => {
                        headers.insert(k.clone(), value);
                    }
                    None => null_headers.push(k.clone()),
                }
            }
            records.push(pb::FetchedRecord {
                offset: rec["offset"].as_u64().unwrap_or(0),
                timestamp_ms: rec["timestamp"].as_i64().unwrap_or(0),
                key: bytes_of(&rec["key"])?,
                value: bytes_of(&rec["value"])?,
                headers,
                null_headers,
            });
        }
        Ok(Response::new(pb::FetchResponse {
            records,
            next_offset: v["next_offset"].as_u64().unwrap_or(0),
            high_watermark: v["high_watermark"].as_u64().unwrap_or(0),
        }))
    }

    async fn noop(&self, request: Request<pb::NoopRequest>) -> Result<Response<pb::NoopResponse>, Status> {
        let started = Instant::now();
        let guard = &self.state.guard;
        let answer = guard
            .admit_call(authorization(&request).as_deref())
            .map(|_slot| pb::NoopResponse { body: crate::http::NOOP_BODY.to_vec() });
        let status = answer.as_ref().map_or_else(ApiError::status, |_| StatusCode::OK);
        // Counted as the HTTP route it stands for, as `Get` is.
        guard.metrics.observe(Origin::Grpc, &Method::GET, crate::http::NOOP_ROUTE, status, started.elapsed());
        answer.map(Response::new).map_err(|e| status_of_error(&e))
    }
}
