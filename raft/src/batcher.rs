//! Batches concurrent produce requests to one partition into one Raft entry
//! (DESIGN.md section 4): one log append, one replication message and one
//! apply for many client requests.
//!
//! A task per hosted partition drains the queue whenever fewer than
//! [`IN_FLIGHT_MAX`] entries are being committed, encodes everything queued
//! (up to the size bounds) as one Kafka record batch, proposes it, and hands
//! each request its own offsets. Records of one request stay contiguous and
//! requests keep their queue order.

use std::sync::Arc;

use logdex_log::Record;
use tokio::sync::Semaphore;
use tokio::sync::mpsc;
use tokio::sync::oneshot;

use crate::error::Error;
use crate::error::Result;
use crate::types::GroupId;

/// Entries of one group being committed at once.
pub const IN_FLIGHT_MAX: usize = 4;
/// Requests waiting in one group's queue before producers wait.
pub const QUEUE_MAX: usize = 8192;
/// Bounds on one entry: records, and approximate bytes (below Kafka's default
/// `max.message.bytes` of 1 MiB; a single larger request is an entry of its own).
pub const ENTRY_RECORDS_MAX: usize = 10_000;
pub const ENTRY_BYTES_MAX: usize = 900 * 1024;

struct Request {
    records: Vec<Record>,
    reply: oneshot::Sender<Result<u64>>,
}

/// The sending side, owned by the hosted partition.
#[derive(Clone)]
pub struct Batcher {
    tx: mpsc::Sender<Request>,
}

/// Proposes one encoded batch and returns its base offset.
pub type Propose = Arc<dyn Fn(Vec<u8>) -> futures::future::BoxFuture<'static, Result<u64>> + Send + Sync>;

impl Batcher {
    /// Starts the batching task of `group`; it ends when every `Batcher` clone is dropped.
    pub fn start(group: GroupId, propose: Propose) -> Batcher {
        let (tx, rx) = mpsc::channel(QUEUE_MAX);
        tokio::spawn(run(group, rx, propose));
        Batcher { tx }
    }

    /// Appends `records` through the group's leader; returns the offset of the first.
    pub async fn produce(&self, records: Vec<Record>) -> Result<u64> {
        if records.is_empty() {
            return Err(Error::Invalid("no records".into()));
        }
        let (reply, rx) = oneshot::channel();
        self.tx.send(Request { records, reply }).await.map_err(|_| Error::unavailable("partition is shutting down"))?;
        rx.await.map_err(|_| Error::unavailable("partition is shutting down"))?
    }
}

fn approx_bytes(r: &Record) -> usize {
    let headers: usize = r.headers.iter().map(|h| h.key.len() + h.value.as_ref().map_or(0, Vec::len)).sum();
    32 + r.key.as_ref().map_or(0, Vec::len) + r.value.as_ref().map_or(0, Vec::len) + headers
}

async fn run(group: GroupId, mut rx: mpsc::Receiver<Request>, propose: Propose) {
    let permits = Arc::new(Semaphore::new(IN_FLIGHT_MAX));
    let mut carry: Option<Request> = None;
    loop {
        let Ok(permit) = permits.clone().acquire_owned().await else { return };
        let first = match carry.take() {
            Some(r) => r,
            None => match rx.recv().await {
                Some(r) => r,
                None => return,
            },
        };
        let mut bytes: usize = first.records.iter().map(approx_bytes).sum();
        let mut count = first.records.len();
        let mut requests = vec![first];
        while count < ENTRY_RECORDS_MAX && bytes < ENTRY_BYTES_MAX {
            let Ok(next) = rx.try_recv() else { break };
            let next_bytes: usize = next.records.iter().map(approx_bytes).sum();
            if count + next.records.len() > ENTRY_RECORDS_MAX || bytes + next_bytes > ENTRY_BYTES_MAX {
                carry = Some(next);
                break;
            }
            bytes += next_bytes;
            count += next.records.len();
            requests.push(next);
        }
        let propose = propose.clone();
        tokio::spawn(async move {
            let _permit = permit;
            commit(group, requests, &propose).await;
        });
    }
}

async fn commit(group: GroupId, requests: Vec<Request>, propose: &Propose) {
    let mut all = Vec::with_capacity(requests.iter().map(|r| r.records.len()).sum());
    let mut replies = Vec::with_capacity(requests.len());
    for r in requests {
        replies.push((r.records.len() as u64, r.reply));
        all.extend(r.records);
    }
    let result = match logdex_log::encode_batch(&all, logdex_log::Compression::None) {
        Ok(batch) => propose(batch).await,
        Err(e) => Err(Error::Invalid(e.to_string())),
    };
    match result {
        Ok(base) => {
            let mut offset = base;
            for (n, reply) in replies {
                let _ = reply.send(Ok(offset));
                offset += n;
            }
        }
        Err(e) => {
            tracing::debug!(group, error = %e, "batched produce failed");
            let message = e.to_string();
            for (_, reply) in replies {
                let _ = reply.send(Err(clone_error(&e, &message)));
            }
        }
    }
}

/// Every request of a failed entry gets the same error kind.
fn clone_error(e: &Error, message: &str) -> Error {
    match e {
        Error::NotLeader { group, leader_node } => Error::NotLeader { group: *group, leader_node: *leader_node },
        Error::NotHosted { group } => Error::NotHosted { group: *group },
        Error::Invalid(m) => Error::Invalid(m.clone()),
        Error::Timeout(m) => Error::Timeout(m.clone()),
        _ => Error::Unavailable(message.to_string()),
    }
}
