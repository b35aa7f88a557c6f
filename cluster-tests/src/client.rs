//! A small typed HTTP client for the logdex API (DESIGN.md section 12).
//!
//! Every call returns a [`Reply`]: status, headers and raw body, so tests can check the exact
//! contract. Helpers named `*_ok` also check the success status and decode the body.

use std::time::Duration;

use reqwest::Method;
use reqwest::header::HeaderMap;
use serde::Deserialize;
use serde_json::Value;
use serde_json::json;

use crate::error::Error;
use crate::error::Result;

/// Upper bound of one HTTP request, so no test step can hang.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(15);
const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);
/// How much of a body `Reply::summary` shows.
const SUMMARY_BODY_BYTES_MAX: usize = 600;

pub const HEADER_PARTITION: &str = "x-kv-partition";
pub const HEADER_OFFSET: &str = "x-kv-offset";
pub const HEADER_HIGH_WATERMARK: &str = "x-kv-high-watermark";
pub const HEADER_NODE: &str = "x-kv-node";
pub const HEADER_TIMESTAMP: &str = "x-kv-timestamp";
pub const HEADER_REDIRECT: &str = "x-kv-redirect";

/// One HTTP answer, kept whole.
#[derive(Clone)]
pub struct Reply {
    pub method: String,
    pub url: String,
    pub status: u16,
    pub headers: HeaderMap,
    pub body: Vec<u8>,
}

impl Reply {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).and_then(|v| v.to_str().ok())
    }

    /// A header that must be present and hold an unsigned integer.
    pub fn header_u64(&self, name: &str) -> Result<u64> {
        let text =
            self.header(name).ok_or_else(|| Error::Check(format!("header {name} missing in {}", self.summary())))?;
        text.trim().parse().map_err(|_| {
            Error::Check(format!("header {name}={text:?} is not an unsigned integer in {}", self.summary()))
        })
    }

    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }

    pub fn json(&self) -> Result<Value> {
        serde_json::from_slice(&self.body)
            .map_err(|e| Error::Check(format!("body is not JSON ({e}) in {}", self.summary())))
    }

    pub fn decode<T: serde::de::DeserializeOwned>(&self) -> Result<T> {
        serde_json::from_slice(&self.body).map_err(|e| {
            Error::Check(format!("body does not decode as {} ({e}) in {}", std::any::type_name::<T>(), self.summary()))
        })
    }

    /// `error.code` of a JSON error body `{"error":{"code":"...","message":"..."}}`.
    pub fn error_code(&self) -> Option<String> {
        let value: Value = serde_json::from_slice(&self.body).ok()?;
        value.get("error")?.get("code")?.as_str().map(str::to_string)
    }

    /// Checks the status, returning `self` for chaining.
    pub fn expect_status(&self, status: u16) -> Result<&Reply> {
        if self.status == status {
            Ok(self)
        } else {
            Err(Error::Check(format!("expected status {status}, got {}", self.summary())))
        }
    }

    /// Checks the status and that the body is a JSON error with this `code` and a message.
    pub fn expect_error(&self, status: u16, code: &str) -> Result<&Reply> {
        self.expect_status(status)?;
        let actual = self.error_code();
        if actual.as_deref() != Some(code) {
            return Err(Error::Check(format!("expected error code {code:?}, got {actual:?} in {}", self.summary())));
        }
        self.expect_error_shape()
    }

    /// Checks that the body is `{"error":{"code":"<non-empty>","message":"..."}}`.
    pub fn expect_error_shape(&self) -> Result<&Reply> {
        let value = self.json()?;
        let error = value.get("error");
        let code_ok = error.and_then(|e| e.get("code")).and_then(Value::as_str).is_some_and(|c| !c.is_empty());
        let message_ok = error.and_then(|e| e.get("message")).is_some_and(Value::is_string);
        if code_ok && message_ok {
            Ok(self)
        } else {
            Err(Error::Check(format!(
                "expected a JSON error body {{\"error\":{{\"code\",\"message\"}}}}, got {}",
                self.summary()
            )))
        }
    }

    /// `METHOD url -> status`, the lookup headers, and the start of the body: for failure messages.
    pub fn summary(&self) -> String {
        let mut headers = Vec::new();
        for (name, value) in &self.headers {
            let name = name.as_str();
            if name.starts_with("x-kv-") || name == "retry-after" || name == "content-type" {
                headers.push(format!("{name}: {}", value.to_str().unwrap_or("<binary>")));
            }
        }
        let mut body = self.text();
        if body.len() > SUMMARY_BODY_BYTES_MAX {
            let mut cut = SUMMARY_BODY_BYTES_MAX;
            while !body.is_char_boundary(cut) {
                cut -= 1;
            }
            body.truncate(cut);
            body.push_str("...");
        }
        format!("{} {} -> {} [{}] body {:?}", self.method, self.url, self.status, headers.join(", "), body)
    }
}

/// The answer of a write: `{"partition": p, "offset": o}`.
#[derive(Clone, Copy, Debug, Deserialize, PartialEq, Eq)]
pub struct Written {
    pub partition: u32,
    pub offset: u64,
}

/// `GET /topics/{t}`.
#[derive(Clone, Debug, Deserialize)]
pub struct TopicDescription {
    pub name: String,
    pub partitions: Vec<PartitionDescription>,
    pub replication_factor: u32,
    pub config: serde_json::Map<String, Value>,
}

#[derive(Clone, Debug, Deserialize)]
pub struct PartitionDescription {
    pub partition: u32,
    pub replicas: Vec<u64>,
    pub leader: Option<u64>,
    pub high_watermark: u64,
    pub log_start_offset: u64,
    /// `{"target_replicas": [...], "state": "in_progress", "phase": "catching_up" or "changing_voters"}` while a move is in progress.
    #[serde(default, rename = "move")]
    pub move_state: Option<Value>,
}

impl TopicDescription {
    pub fn partition(&self, partition: u32) -> Result<&PartitionDescription> {
        self.partitions
            .iter()
            .find(|p| p.partition == partition)
            .ok_or_else(|| Error::Check(format!("describe of {} lacks partition {partition}: {self:?}", self.name)))
    }
}

/// `GET /topics/{t}/partitions/{p}/records`.
#[derive(Clone, Debug, Deserialize)]
pub struct FetchResponse {
    pub records: Vec<FetchedRecord>,
    pub next_offset: u64,
    pub high_watermark: u64,
    pub encoding: String,
}

#[derive(Clone, Debug, Deserialize)]
pub struct FetchedRecord {
    pub offset: u64,
    pub timestamp: i64,
    pub key: Option<String>,
    pub value: Option<String>,
    #[serde(default)]
    pub headers: Option<Value>,
}

impl FetchResponse {
    /// Decodes a key or value field of this response according to its `encoding`.
    pub fn bytes_of(&self, field: &Option<String>) -> Result<Option<Vec<u8>>> {
        match field {
            None => Ok(None),
            Some(text) => match self.encoding.as_str() {
                "utf8" => Ok(Some(text.as_bytes().to_vec())),
                "base64" => {
                    use base64::Engine as _;
                    base64::engine::general_purpose::STANDARD
                        .decode(text)
                        .map(Some)
                        .map_err(|e| Error::Check(format!("fetched field {text:?} is not base64: {e}")))
                }
                other => Err(Error::Check(format!("fetch answered an unknown encoding {other:?}"))),
            },
        }
    }
}

/// The read mode of a lookup (`?read=`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReadMode {
    Linearizable,
    Strict,
    Follower,
}

impl ReadMode {
    pub fn as_str(self) -> &'static str {
        match self {
            ReadMode::Linearizable => "linearizable",
            ReadMode::Strict => "strict",
            ReadMode::Follower => "follower",
        }
    }
}

/// Query options of `GET /kv/{t}/{key}`; `None` leaves the server default.
#[derive(Clone, Debug, Default)]
pub struct Read {
    pub mode: Option<ReadMode>,
    pub partition: Option<u32>,
    pub min_offset: Option<u64>,
    pub forward: Option<bool>,
}

impl Read {
    pub fn linearizable() -> Read {
        Read { mode: Some(ReadMode::Linearizable), ..Read::default() }
    }

    pub fn follower() -> Read {
        Read { mode: Some(ReadMode::Follower), ..Read::default() }
    }

    pub fn mode(mode: ReadMode) -> Read {
        Read { mode: Some(mode), ..Read::default() }
    }

    pub fn min_offset(mut self, offset: u64) -> Read {
        self.min_offset = Some(offset);
        self
    }

    pub fn forward(mut self, forward: bool) -> Read {
        self.forward = Some(forward);
        self
    }

    pub fn partition(mut self, partition: u32) -> Read {
        self.partition = Some(partition);
        self
    }

    fn query(&self) -> String {
        let mut params = Vec::new();
        if let Some(mode) = self.mode {
            params.push(format!("read={}", mode.as_str()));
        }
        if let Some(p) = self.partition {
            params.push(format!("partition={p}"));
        }
        if let Some(o) = self.min_offset {
            params.push(format!("min_offset={o}"));
        }
        if let Some(f) = self.forward {
            params.push(format!("forward={f}"));
        }
        if params.is_empty() { String::new() } else { format!("?{}", params.join("&")) }
    }
}

/// Percent-encodes every byte outside RFC 3986's unreserved set, so any key fits in a path segment.
pub fn percent_encode(bytes: &[u8]) -> String {
    let mut out = String::with_capacity(bytes.len() * 3);
    for &b in bytes {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~') {
            out.push(char::from(b));
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// `http://host:port/kv/{topic}/{percent-encoded key}` with no query.
pub fn kv_url(base: &str, topic: &str, key: &[u8]) -> String {
    format!("{base}/kv/{topic}/{}", percent_encode(key))
}

/// A cheap-to-clone HTTP client for any node (`base` is `http://127.0.0.1:PORT`).
#[derive(Clone)]
pub struct Api {
    http: reqwest::Client,
}

impl Api {
    pub fn new() -> Result<Api> {
        Api::with_timeout(REQUEST_TIMEOUT)
    }

    /// A client whose every request is bounded by `timeout`.
    pub fn with_timeout(timeout: Duration) -> Result<Api> {
        Api::build(timeout, None)
    }

    /// A client for `https://` nodes trusting only the CA certificates of `ca_pem`.
    pub fn with_ca(ca_pem: &str) -> Result<Api> {
        Api::build(REQUEST_TIMEOUT, Some(ca_pem))
    }

    fn build(timeout: Duration, ca_pem: Option<&str>) -> Result<Api> {
        let build_error = |source| Error::Http { method: "BUILD".into(), url: String::new(), source };
        let mut http = reqwest::Client::builder();
        if let Some(pem) = ca_pem {
            http = http.tls_built_in_root_certs(false);
            for root in reqwest::Certificate::from_pem_bundle(pem.as_bytes()).map_err(build_error)? {
                http = http.add_root_certificate(root);
            }
        }
        let http = http
            .no_proxy()
            .timeout(timeout)
            .connect_timeout(CONNECT_TIMEOUT)
            // A fresh connection per request: nodes are killed and restarted on the same port,
            // and a pooled connection to a dead process would turn into a confusing error.
            .pool_max_idle_per_host(0)
            .build()
            .map_err(build_error)?;
        Ok(Api { http })
    }

    /// Sends one request; `Err` only when no HTTP answer came back (connect, reset, timeout).
    pub async fn request(&self, method: Method, url: &str, body: Option<Body>) -> Result<Reply> {
        let mut builder = self.http.request(method.clone(), url);
        match body {
            None => {}
            Some(Body::Json(value)) => builder = builder.json(&value),
            Some(Body::Raw(bytes)) => builder = builder.body(bytes),
            Some(Body::Text { content_type, text }) => {
                builder = builder.header(reqwest::header::CONTENT_TYPE, content_type).body(text)
            }
        }
        let http_error =
            |e: reqwest::Error| Error::Http { method: method.to_string(), url: url.to_string(), source: e };
        let response = builder.send().await.map_err(http_error)?;
        let status = response.status().as_u16();
        let headers = response.headers().clone();
        let body = response.bytes().await.map_err(http_error)?.to_vec();
        Ok(Reply { method: method.to_string(), url: url.to_string(), status, headers, body })
    }

    pub async fn get_url(&self, url: &str) -> Result<Reply> {
        self.request(Method::GET, url, None).await
    }

    /// A GET of `path` exactly as written, over HTTP/1.1 on a connection of its own: URL
    /// clients (reqwest's included) resolve `.` and `..` segments, `%2E` spelt ones too,
    /// before they send.
    pub async fn get_path_as_is(&self, base: &str, path: &str) -> Result<Reply> {
        use tokio::io::AsyncReadExt as _;
        use tokio::io::AsyncWriteExt as _;
        let url = format!("{base}{path}");
        let addr = base.strip_prefix("http://").unwrap_or(base);
        let io = |what: &str, e| Error::io(format!("{what} {url}"), e);
        let exchange = async {
            let mut stream = tokio::net::TcpStream::connect(addr).await.map_err(|e| io("connecting for", e))?;
            let request = format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n");
            stream.write_all(request.as_bytes()).await.map_err(|e| io("sending", e))?;
            let mut answer = Vec::new();
            stream.read_to_end(&mut answer).await.map_err(|e| io("reading the answer to", e))?;
            Ok::<_, Error>(answer)
        };
        let answer = tokio::time::timeout(REQUEST_TIMEOUT, exchange)
            .await
            .map_err(|_| Error::Check(format!("GET {url}: no answer in {REQUEST_TIMEOUT:?}")))??;
        parse_http1_answer(&url, &answer)
    }

    pub async fn healthz(&self, base: &str) -> Result<Reply> {
        self.get_url(&format!("{base}/healthz")).await
    }

    pub async fn readyz(&self, base: &str) -> Result<Reply> {
        self.get_url(&format!("{base}/readyz")).await
    }

    pub async fn cluster(&self, base: &str) -> Result<Reply> {
        self.get_url(&format!("{base}/cluster")).await
    }

    /// `POST /topics` with `{"name", "partitions", "replication_factor", "config"}`.
    pub async fn create_topic(&self, base: &str, spec: &TopicSpec) -> Result<Reply> {
        self.request(Method::POST, &format!("{base}/topics"), Some(Body::Json(spec.to_json()))).await
    }

    pub async fn describe(&self, base: &str, topic: &str) -> Result<Reply> {
        self.get_url(&format!("{base}/topics/{topic}")).await
    }

    /// `GET /topics/{t}`, which must answer 200 with a well-formed description.
    pub async fn describe_ok(&self, base: &str, topic: &str) -> Result<TopicDescription> {
        let reply = self.describe(base, topic).await?;
        reply.expect_status(200)?;
        reply.decode()
    }

    pub async fn put(&self, base: &str, topic: &str, key: &[u8], value: &[u8]) -> Result<Reply> {
        self.request(Method::PUT, &kv_url(base, topic, key), Some(Body::Raw(value.to_vec()))).await
    }

    pub async fn delete(&self, base: &str, topic: &str, key: &[u8]) -> Result<Reply> {
        self.request(Method::DELETE, &kv_url(base, topic, key), None).await
    }

    pub async fn get(&self, base: &str, topic: &str, key: &[u8], read: &Read) -> Result<Reply> {
        self.get_url(&format!("{}{}", kv_url(base, topic, key), read.query())).await
    }

    /// `POST /topics/{t}/records` with a request body built by the caller.
    pub async fn produce(&self, base: &str, topic: &str, body: &Value) -> Result<Reply> {
        self.request(Method::POST, &format!("{base}/topics/{topic}/records"), Some(Body::Json(body.clone()))).await
    }

    pub async fn fetch(&self, base: &str, topic: &str, partition: u32, offset: u64, max_records: u32) -> Result<Reply> {
        let url =
            format!("{base}/topics/{topic}/partitions/{partition}/records?offset={offset}&max_records={max_records}");
        self.get_url(&url).await
    }

    /// `fetch` that must answer 200 with a well-formed body.
    pub async fn fetch_ok(
        &self,
        base: &str,
        topic: &str,
        partition: u32,
        offset: u64,
        max_records: u32,
    ) -> Result<FetchResponse> {
        let reply = self.fetch(base, topic, partition, offset, max_records).await?;
        reply.expect_status(200)?;
        reply.decode()
    }
}

/// A request body.
pub enum Body {
    Json(Value),
    Raw(Vec<u8>),
    /// Arbitrary text with a content type, for malformed-input tests.
    Text {
        content_type: &'static str,
        text: String,
    },
}

/// The body of `POST /topics`.
#[derive(Clone, Debug)]
pub struct TopicSpec {
    pub name: String,
    pub partitions: u32,
    pub replication_factor: u32,
    pub config: serde_json::Map<String, Value>,
}

impl TopicSpec {
    /// A compacted topic, as in the design's example.
    pub fn compacted(name: &str, partitions: u32, replication_factor: u32) -> TopicSpec {
        let mut config = serde_json::Map::new();
        config.insert("cleanup.policy".into(), Value::String("compact".into()));
        TopicSpec { name: name.to_string(), partitions, replication_factor, config }
    }

    pub fn to_json(&self) -> Value {
        json!({
            "name": self.name,
            "partitions": self.partitions,
            "replication_factor": self.replication_factor,
            "config": self.config,
        })
    }
}

/// Checks a `PUT`/`DELETE` answer: 200, body `{"partition", "offset"}`, and the same numbers in
/// `X-Kv-Partition` and `X-Kv-Offset`.
pub fn written(reply: &Reply) -> Result<Written> {
    reply.expect_status(200)?;
    let body: Written = reply.decode()?;
    let partition = reply.header_u64(HEADER_PARTITION)?;
    let offset = reply.header_u64(HEADER_OFFSET)?;
    if partition != u64::from(body.partition) || offset != body.offset {
        return Err(Error::Check(format!(
            "write headers (partition {partition}, offset {offset}) disagree with the body {body:?}: {}",
            reply.summary()
        )));
    }
    Ok(body)
}

/// A whole HTTP/1.1 answer (read to the connection's end) as a [`Reply`]; chunked bodies are
/// joined.
fn parse_http1_answer(url: &str, answer: &[u8]) -> Result<Reply> {
    let bad = |what: &str| Error::Check(format!("GET {url}: {what} in {:?}", String::from_utf8_lossy(answer)));
    let split = answer.windows(4).position(|w| w == b"\r\n\r\n").ok_or_else(|| bad("no end of headers"))?;
    let head = std::str::from_utf8(&answer[..split]).map_err(|_| bad("headers not UTF-8"))?;
    let mut lines = head.split("\r\n");
    let status_line = lines.next().unwrap_or("");
    let status = status_line.split(' ').nth(1).and_then(|s| s.parse().ok()).ok_or_else(|| bad("no status"))?;
    let mut headers = HeaderMap::new();
    for line in lines {
        let (name, value) = line.split_once(':').ok_or_else(|| bad("a header without ':'"))?;
        let name = reqwest::header::HeaderName::from_bytes(name.trim().as_bytes()).map_err(|_| bad("a header name"))?;
        let value = reqwest::header::HeaderValue::from_str(value.trim()).map_err(|_| bad("a header value"))?;
        headers.append(name, value);
    }
    let mut rest = &answer[split + 4..];
    let chunked = headers.get("transfer-encoding").is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(b"chunked"));
    let body = if chunked {
        let mut body = Vec::new();
        loop {
            let end = rest.windows(2).position(|w| w == b"\r\n").ok_or_else(|| bad("a chunk without its size"))?;
            let size = std::str::from_utf8(&rest[..end]).ok().and_then(|t| usize::from_str_radix(t.trim(), 16).ok());
            let size = size.ok_or_else(|| bad("a chunk size"))?;
            let data = rest.get(end + 2..end + 2 + size).ok_or_else(|| bad("a short chunk"))?;
            if size == 0 {
                break body;
            }
            body.extend_from_slice(data);
            rest = rest.get(end + 4 + size..).ok_or_else(|| bad("a chunk without its end"))?;
        }
    } else {
        rest.to_vec()
    };
    Ok(Reply { method: "GET".into(), url: url.to_string(), status, headers, body })
}
