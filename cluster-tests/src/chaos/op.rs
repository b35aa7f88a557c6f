//! One client operation of the chaos workload: what was asked, of which node, when, and what
//! came back, with every failure classified as definite or indeterminate.
//!
//! # Error classification
//!
//! A failed **write** is *definite* (it did not happen, and its value must never be seen) only
//! when the server certainly did not propose it:
//! - the TCP connect failed (connection refused, connect timeout): the request never left;
//! - HTTP 400, 404, 409, 413, 421, 429: validation, routing (`?forward=false` at a non-leader)
//!   and rate limiting answer before anything is proposed, on the receiving node or, when
//!   forwarded, on the leader (a forwarded answer is relayed with its status).
//!
//! Everything else is *indeterminate* (it may have happened, now or later): a client timeout,
//! a connection reset or a body cut after the request was sent, 500, 502, 504, and every 503
//! (the client cannot tell a 503 of "no leader yet" before forwarding from a 503 after the
//! leader proposed the entry and lost leadership: openraft's `LogEntryDiscarded` maps to 503).
//!
//! A failed **read** carries no constraint and is only counted.

use std::time::Duration;

use serde::Serialize;

use crate::client::Api;
use crate::client::HEADER_HIGH_WATERMARK;
use crate::client::HEADER_NODE;
use crate::client::HEADER_OFFSET;
use crate::client::HEADER_PARTITION;
use crate::client::Reply;
use crate::client::kv_url;
use crate::error::Error;

/// Nanoseconds since the run started: one clock, the test process's monotonic clock.
pub type Nanos = u64;

/// What a client asked.
#[derive(Clone, Debug, Serialize, PartialEq, Eq)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Request {
    Put {
        key: String,
        value: String,
        /// `?forward=false`: a non-leader answers 421 instead of forwarding.
        forward: bool,
    },
    Delete {
        key: String,
    },
    /// One batch to one partition (so it is one Raft entry: atomic and contiguous).
    Produce {
        partition: u32,
        records: Vec<(String, String)>,
    },
    Get {
        key: String,
        mode: ReadKind,
        /// Follower reads only: read-your-writes bound.
        min_offset: Option<u64>,
        /// `?partition=`, for keys produced to a chosen partition (the convergence check).
        #[serde(skip_serializing_if = "Option::is_none")]
        partition: Option<u32>,
    },
    /// A follower fetch from the asked node's own replica (`read=follower&forward=false`).
    Fetch {
        partition: u32,
        offset: u64,
        max_records: u32,
    },
}

#[derive(Clone, Copy, Debug, Serialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum ReadKind {
    Linearizable,
    Strict,
    /// `read=follower&forward=false`: the asked node's replica answers.
    Follower,
}

impl ReadKind {
    pub fn query(self) -> &'static str {
        match self {
            ReadKind::Linearizable => "read=linearizable",
            ReadKind::Strict => "read=strict",
            ReadKind::Follower => "read=follower&forward=false",
        }
    }

    /// Linearizable and strict lookups promise the same thing (DESIGN.md I6).
    pub fn is_linearizable(self) -> bool {
        matches!(self, ReadKind::Linearizable | ReadKind::Strict)
    }
}

/// One record as fetched or as held by a final log.
#[derive(Clone, Debug, Serialize, PartialEq, Eq)]
pub struct LogRecord {
    pub offset: u64,
    pub key: Option<String>,
    /// `None` is a tombstone.
    pub value: Option<String>,
}

/// What came back.
#[derive(Clone, Debug, Serialize, PartialEq, Eq)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Outcome {
    /// A write acknowledged: its offsets, in request order.
    Written {
        partition: u32,
        offsets: Vec<u64>,
    },
    /// A lookup hit.
    Found {
        partition: u32,
        offset: u64,
        high_watermark: u64,
        node: u64,
        value: String,
    },
    /// A lookup miss (`key_not_found`): never written or tombstoned as of `high_watermark`.
    NotFound {
        partition: u32,
        high_watermark: u64,
        node: u64,
    },
    Fetched {
        records: Vec<LogRecord>,
        next_offset: u64,
        high_watermark: u64,
        node: u64,
    },
    /// Certainly did not happen.
    Definite {
        reason: String,
    },
    /// May have happened.
    Indeterminate {
        reason: String,
    },
}

impl Outcome {
    pub fn is_ok(&self) -> bool {
        !matches!(self, Outcome::Definite { .. } | Outcome::Indeterminate { .. })
    }
}

/// One operation, invoked and completed by one client.
#[derive(Clone, Debug, Serialize)]
pub struct Op {
    /// Position in the merged history (set when the history is assembled).
    pub id: usize,
    pub client: usize,
    /// The node asked.
    pub node: u64,
    /// That node's process generation when the op was invoked and when it completed (the
    /// harness bumps it before a kill and after a restart): a session spans one generation.
    pub node_epoch: (u64, u64),
    pub invoke: Nanos,
    pub complete: Nanos,
    pub request: Request,
    pub outcome: Outcome,
}

impl Op {
    /// A one-line description for checker explanations.
    pub fn brief(&self) -> String {
        format!(
            "op#{} client {} node {} [{:.3}s..{:.3}s] {} -> {}",
            self.id,
            self.client,
            self.node,
            self.invoke as f64 / 1e9,
            self.complete as f64 / 1e9,
            serde_json::to_string(&self.request).unwrap_or_default(),
            serde_json::to_string(&self.outcome).unwrap_or_default()
        )
    }

    pub fn is_write(&self) -> bool {
        matches!(self.request, Request::Put { .. } | Request::Delete { .. } | Request::Produce { .. })
    }

    /// Same node process from invocation to completion.
    pub fn one_epoch(&self) -> bool {
        self.node_epoch.0 == self.node_epoch.1
    }
}

/// Classifies a failed write attempt (see the module documentation).
pub fn classify_write_failure(result: &Result<Reply, Error>) -> Outcome {
    match result {
        Ok(reply) => {
            let reason = format!("{} {}", reply.status, reply.error_code().unwrap_or_default());
            if matches!(reply.status, 400 | 404 | 409 | 413 | 421 | 429) {
                Outcome::Definite { reason }
            } else {
                Outcome::Indeterminate { reason }
            }
        }
        Err(e) if e.is_connect_failure() => Outcome::Definite { reason: "connect failed".into() },
        Err(e) => Outcome::Indeterminate { reason: short(&e.to_string()) },
    }
}

fn short(text: &str) -> String {
    text.chars().take(160).collect()
}

fn read_failure(result: &Result<Reply, Error>) -> Outcome {
    match result {
        Ok(reply) => {
            Outcome::Indeterminate { reason: format!("{} {}", reply.status, reply.error_code().unwrap_or_default()) }
        }
        Err(e) if e.is_connect_failure() => Outcome::Definite { reason: "connect failed".into() },
        Err(e) => Outcome::Indeterminate { reason: short(&e.to_string()) },
    }
}

/// Sends `request` to `base` (the node's HTTP URL) and turns the answer into an outcome.
/// Protocol violations (a 200 without its headers) are outcomes too: `Indeterminate` with the
/// reason, so a checker, not the workload, decides.
pub async fn execute(api: &Api, base: &str, topic: &str, request: &Request) -> Outcome {
    match request {
        Request::Put { key, value, forward } => {
            let mut url = kv_url(base, topic, key.as_bytes());
            if !forward {
                url.push_str("?forward=false");
            }
            let result = api
                .request(reqwest::Method::PUT, &url, Some(crate::client::Body::Raw(value.clone().into_bytes())))
                .await;
            written_single(&result)
        }
        Request::Delete { key } => {
            let result = api.delete(base, topic, key.as_bytes()).await;
            written_single(&result)
        }
        Request::Produce { partition, records } => {
            let body = serde_json::json!({
                "records": records.iter().map(|(k, v)| serde_json::json!({"key": k, "value": v, "partition": partition})).collect::<Vec<_>>(),
            });
            let result = api.produce(base, topic, &body).await;
            match &result {
                Ok(reply) if reply.status == 200 => produced(reply, *partition, records.len()),
                _ => classify_write_failure(&result),
            }
        }
        Request::Get { key, mode, min_offset, partition } => {
            let mut url = format!("{}?{}", kv_url(base, topic, key.as_bytes()), mode.query());
            if let Some(m) = min_offset {
                url.push_str(&format!("&min_offset={m}"));
            }
            if let Some(p) = partition {
                url.push_str(&format!("&partition={p}"));
            }
            let result = api.get_url(&url).await;
            match &result {
                Ok(reply) if reply.status == 200 => found(reply),
                Ok(reply) if reply.status == 404 && reply.error_code().as_deref() == Some("key_not_found") => {
                    not_found(reply)
                }
                _ => read_failure(&result),
            }
        }
        Request::Fetch { partition, offset, max_records } => {
            let url = format!(
                "{base}/topics/{topic}/partitions/{partition}/records?offset={offset}&max_records={max_records}&read=follower&forward=false"
            );
            let result = api.get_url(&url).await;
            match &result {
                Ok(reply) if reply.status == 200 => fetched(reply),
                _ => read_failure(&result),
            }
        }
    }
}

fn protocol(reply: &Reply, what: &str) -> Outcome {
    Outcome::Indeterminate { reason: format!("protocol violation: {what}: {}", reply.summary()) }
}

fn written_single(result: &Result<Reply, Error>) -> Outcome {
    match result {
        Ok(reply) if reply.status == 200 => match crate::client::written(reply) {
            Ok(w) => Outcome::Written { partition: w.partition, offsets: vec![w.offset] },
            Err(e) => protocol(reply, &e.to_string()),
        },
        _ => classify_write_failure(result),
    }
}

fn produced(reply: &Reply, partition: u32, count: usize) -> Outcome {
    #[derive(serde::Deserialize)]
    struct Offsets {
        offsets: Vec<crate::client::Written>,
    }
    let Ok(body) = reply.decode::<Offsets>() else {
        return protocol(reply, "produce answer does not decode");
    };
    if body.offsets.len() != count || body.offsets.iter().any(|w| w.partition != partition) {
        return protocol(reply, "produce answer does not match the request");
    }
    Outcome::Written { partition, offsets: body.offsets.iter().map(|w| w.offset).collect() }
}

fn found(reply: &Reply) -> Outcome {
    let headers = (
        reply.header_u64(HEADER_PARTITION),
        reply.header_u64(HEADER_OFFSET),
        reply.header_u64(HEADER_HIGH_WATERMARK),
        reply.header_u64(HEADER_NODE),
    );
    match headers {
        (Ok(p), Ok(offset), Ok(hw), Ok(node)) => Outcome::Found {
            partition: p as u32,
            offset,
            high_watermark: hw,
            node,
            value: String::from_utf8_lossy(&reply.body).into_owned(),
        },
        _ => protocol(reply, "a 200 lookup lacks an X-Kv header"),
    }
}

fn not_found(reply: &Reply) -> Outcome {
    match (reply.header_u64(HEADER_PARTITION), reply.header_u64(HEADER_HIGH_WATERMARK)) {
        (Ok(p), Ok(hw)) => Outcome::NotFound {
            partition: p as u32,
            high_watermark: hw,
            node: reply.header_u64(HEADER_NODE).unwrap_or(0),
        },
        _ => protocol(reply, "a 404 lookup lacks X-Kv-Partition or X-Kv-High-Watermark"),
    }
}

fn fetched(reply: &Reply) -> Outcome {
    let Ok(page) = reply.decode::<crate::client::FetchResponse>() else {
        return protocol(reply, "fetch answer does not decode");
    };
    let mut records = Vec::with_capacity(page.records.len());
    for r in &page.records {
        let (Ok(key), Ok(value)) = (page.bytes_of(&r.key), page.bytes_of(&r.value)) else {
            return protocol(reply, "fetch answer holds undecodable fields");
        };
        records.push(LogRecord {
            offset: r.offset,
            key: key.map(|k| String::from_utf8_lossy(&k).into_owned()),
            value: value.map(|v| String::from_utf8_lossy(&v).into_owned()),
        });
    }
    Outcome::Fetched {
        records,
        next_offset: page.next_offset,
        high_watermark: page.high_watermark,
        node: reply.header_u64(HEADER_NODE).unwrap_or(0),
    }
}

/// Workload requests are bounded tighter than the harness's own (a client must move on while
/// a partition heals).
pub const OP_TIMEOUT: Duration = Duration::from_secs(5);
