//! Batches concurrent produce requests to one partition (DESIGN.md section 4).
//!
//! On the leader, one batch is one Raft entry: one log append, one replication
//! message and one apply for many client requests. On a node that forwards
//! writes to the leader, one batch is one `Produce` RPC.
//!
//! A task per batcher drains the queue whenever fewer than [`IN_FLIGHT_MAX`]
//! batches are outstanding, takes everything queued (up to the size bounds),
//! proposes it, and hands each request its own offsets. Records of one request
//! stay contiguous and requests keep their queue order.
//!
//! Before it proposes, the task yields to the other tasks that are ready to run
//! (at most [`GATHER_YIELDS_MAX`] times, and only while that brings more
//! requests). The first write of a poll of the sockets wakes the batcher; with
//! tokio's LIFO slot (a build without `--cfg tokio_unstable`, see
//! `serve::tune_runtime` in the api crate) the batcher would run next, ahead of
//! the connections whose requests are parsed in the same poll, and without the
//! yield every batch held the one request that woke it. A lone writer finds
//! nothing else ready and goes at once (one yield, no timer).
//!
//! To ensure correctness:
//! - A batch is atomic: it is appended whole or not at all, so every request of
//!   a failed batch gets the batch's error, with the same definite or
//!   indeterminate meaning.
//! - Batching never changes what a request alone would get: when a batch of
//!   several requests is refused as invalid (a topic's `max.message.bytes`
//!   below the combined size, say), nothing was appended, and each request is
//!   proposed again on its own, so only a request that is invalid by itself
//!   fails.

use std::sync::Arc;

use logdex_log::Record;
use tokio::sync::Semaphore;
use tokio::sync::mpsc;
use tokio::sync::oneshot;

use crate::error::Error;
use crate::error::Result;
use crate::log_store::WriteLoad;
use crate::types::GroupId;
use crate::types::NodeId;

/// Batches of one batcher being committed at once.
pub const IN_FLIGHT_MAX: usize = 4;
/// Requests waiting in one group's queue before producers wait.
pub const QUEUE_MAX: usize = 8192;
/// Bounds on one batch: records, and approximate bytes (below Kafka's default
/// `max.message.bytes` of 1 MiB; a single larger request is a batch of its own).
pub const ENTRY_RECORDS_MAX: usize = 10_000;
pub const ENTRY_BYTES_MAX: usize = 900 * 1024;

struct Request {
    records: Vec<Record>,
    reply: oneshot::Sender<Result<u64>>,
}

/// The sending side. Cheap to clone; the task ends when every clone is dropped.
#[derive(Clone)]
pub struct Batcher {
    tx: mpsc::Sender<Request>,
    load: WriteLoad,
}

/// Appends one batch of records atomically and returns the offset of the first.
pub type Propose = Arc<dyn for<'a> Fn(&'a [Record]) -> futures::future::BoxFuture<'a, Result<u64>> + Send + Sync>;

impl Batcher {
    /// Starts the batching task of `group`; its requests count in `load` until answered.
    pub fn start(group: GroupId, propose: Propose, load: WriteLoad) -> Batcher {
        let (tx, rx) = mpsc::channel(QUEUE_MAX);
        tokio::spawn(run(group, rx, propose));
        Batcher { tx, load }
    }

    /// Appends `records` as part of the next batch; returns the offset of the first.
    pub async fn produce(&self, records: Vec<Record>) -> Result<u64> {
        if records.is_empty() {
            return Err(Error::Invalid("no records".into()));
        }
        let _waiting = self.load.enter();
        let (reply, rx) = oneshot::channel();
        self.tx.send(Request { records, reply }).await.map_err(|_| Error::unavailable("partition is shutting down"))?;
        rx.await.map_err(|_| Error::unavailable("partition is shutting down"))?
    }
}

/// Most times a batcher yields to other ready tasks to gather more requests into one batch.
const GATHER_YIELDS_MAX: usize = 4;

/// Requests gathered for one batch, within [`ENTRY_RECORDS_MAX`] and [`ENTRY_BYTES_MAX`].
struct Batch {
    requests: Vec<Request>,
    records: usize,
    bytes: usize,
}

impl Batch {
    fn new(first: Request) -> Batch {
        let bytes = first.records.iter().map(approx_bytes).sum();
        Batch { records: first.records.len(), bytes, requests: vec![first] }
    }

    fn has_room(&self) -> bool {
        self.records < ENTRY_RECORDS_MAX && self.bytes < ENTRY_BYTES_MAX
    }

    /// Adds `next`, or gives it back when it would take the batch over a bound.
    fn push(&mut self, next: Request) -> std::result::Result<(), Request> {
        let bytes: usize = next.records.iter().map(approx_bytes).sum();
        if self.records + next.records.len() > ENTRY_RECORDS_MAX || self.bytes + bytes > ENTRY_BYTES_MAX {
            return Err(next);
        }
        self.bytes += bytes;
        self.records += next.records.len();
        self.requests.push(next);
        Ok(())
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
        let mut batch = Batch::new(first);
        let mut yields = 0;
        loop {
            let before = batch.requests.len();
            while batch.has_room() {
                let Ok(next) = rx.try_recv() else { break };
                if let Err(next) = batch.push(next) {
                    carry = Some(next);
                    break;
                }
            }
            // Let the tasks that are ready to run (requests being parsed, forwarded calls
            // being read) queue their writes first, while that keeps adding to the batch:
            // one Raft entry (or one forwarded call) then carries them all. A lone writer
            // finds nobody else ready and goes at once.
            let grew = batch.requests.len() > before || yields == 0;
            if carry.is_some() || !batch.has_room() || !grew || yields == GATHER_YIELDS_MAX {
                break;
            }
            tokio::task::yield_now().await;
            yields += 1;
        }
        let requests = batch.requests;
        let propose = propose.clone();
        tokio::spawn(async move {
            let _permit = permit;
            commit(group, requests, &propose).await;
        });
    }
}

async fn commit(group: GroupId, requests: Vec<Request>, propose: &Propose) {
    if requests.len() == 1 {
        for r in requests {
            let result = propose(&r.records).await;
            let _ = r.reply.send(result);
        }
        return;
    }
    let mut all = Vec::with_capacity(requests.iter().map(|r| r.records.len()).sum());
    let mut replies = Vec::with_capacity(requests.len());
    let mut sizes = Vec::with_capacity(requests.len());
    for r in requests {
        sizes.push(r.records.len());
        all.extend(r.records);
        replies.push(r.reply);
    }
    match propose(&all).await {
        Ok(base) => {
            let mut offset = base;
            for (n, reply) in sizes.into_iter().zip(replies) {
                let _ = reply.send(Ok(offset));
                offset += n as u64;
            }
        }
        Err(Error::Invalid(m) | Error::TooLarge(m)) => {
            // Nothing was appended. Each request alone may be valid: propose them one by one.
            tracing::debug!(group, error = %m, requests = replies.len(), "batch refused; proposing its requests one by one");
            let mut start = 0;
            for (n, reply) in sizes.into_iter().zip(replies) {
                let _ = reply.send(propose(&all[start..start + n]).await);
                start += n;
            }
        }
        Err(e) => {
            tracing::debug!(group, error = %e, "batched produce failed");
            for reply in replies {
                let _ = reply.send(Err(e.duplicate()));
            }
        }
    }
}

/// The batchers of writes this node forwards, one per (leader node, group): concurrent
/// forwarded writes to one partition share one `Produce` RPC.
#[derive(Default)]
pub struct Forwarders {
    batchers: std::sync::Mutex<std::collections::HashMap<(NodeId, GroupId), Batcher>>,
}

impl Forwarders {
    /// The batcher forwarding to `node` for `group`, started with `propose` if there is none.
    pub fn get(&self, node: NodeId, group: GroupId, load: &WriteLoad, propose: impl FnOnce() -> Propose) -> Batcher {
        // The map holds no invariant a panicking holder could break.
        let mut batchers = self.batchers.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        batchers.entry((node, group)).or_insert_with(|| Batcher::start(group, propose(), load.clone())).clone()
    }

    /// Drops the batcher for (`node`, `group`) (that node no longer leads it); its task ends
    /// once the requests it holds are answered.
    pub fn forget(&self, node: NodeId, group: GroupId) {
        self.batchers.lock().unwrap_or_else(std::sync::PoisonError::into_inner).remove(&(node, group));
    }

    /// Drops the batchers of groups for which `exists` is false (their topic was deleted).
    pub fn retain_groups(&self, exists: impl Fn(GroupId) -> bool) {
        self.batchers.lock().unwrap_or_else(std::sync::PoisonError::into_inner).retain(|(_, group), _| exists(*group));
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Mutex;

    use super::*;

    /// A log that appends whole batches up to `max_records`, like a topic's `max.message.bytes`.
    fn bounded_log(max_records: usize, delay: std::time::Duration) -> (Propose, Arc<Mutex<Vec<Vec<Record>>>>) {
        let batches: Arc<Mutex<Vec<Vec<Record>>>> = Arc::default();
        let seen = batches.clone();
        let propose: Propose = Arc::new(move |records: &[Record]| {
            let seen = seen.clone();
            let records = records.to_vec();
            Box::pin(async move {
                tokio::time::sleep(delay).await;
                if records.len() > max_records {
                    return Err(Error::Invalid(format!("{} records over the limit", records.len())));
                }
                let mut log = seen.lock().map_err(|_| Error::unavailable("poisoned"))?;
                let base: usize = log.iter().map(Vec::len).sum();
                log.push(records);
                Ok(base as u64)
            })
        });
        (propose, batches)
    }

    fn record(n: u32) -> Record {
        Record {
            timestamp_ms: 1,
            key: Some(format!("k{n}").into_bytes()),
            value: Some(vec![7; 10]),
            headers: Vec::new(),
        }
    }

    #[tokio::test]
    async fn concurrent_requests_share_batches_and_get_their_own_offsets() {
        let (propose, log) = bounded_log(usize::MAX, std::time::Duration::from_millis(5));
        let batcher = Batcher::start(1, propose, WriteLoad::default());
        let tasks: Vec<_> = (0..40u32)
            .map(|i| {
                let b = batcher.clone();
                tokio::spawn(async move { (i, b.produce(vec![record(i), record(i + 1000)]).await) })
            })
            .collect();
        let log_records: Vec<Record> = {
            let mut results = Vec::new();
            for t in tasks {
                results.push(t.await.expect("task"));
            }
            let log = log.lock().expect("lock").clone();
            assert!(log.len() < 40, "40 concurrent requests took {} batches: no batching", log.len());
            let flat: Vec<Record> = log.into_iter().flatten().collect();
            for (i, result) in results {
                let offset = result.expect("produce") as usize;
                assert_eq!(flat[offset], record(i), "request {i} got another request's offset");
                assert_eq!(flat[offset + 1], record(i + 1000), "request {i} is not contiguous");
            }
            flat
        };
        assert_eq!(log_records.len(), 80);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 1)]
    async fn writes_woken_together_share_the_first_batch() {
        let (propose, log) = bounded_log(usize::MAX, std::time::Duration::from_millis(5));
        let batcher = Batcher::start(1, propose, WriteLoad::default());
        let (start, started) = tokio::sync::watch::channel(false);
        let producers: Vec<_> = (0..8u32)
            .map(|i| {
                let (b, mut started) = (batcher.clone(), started.clone());
                tokio::spawn(async move {
                    started.changed().await.expect("start");
                    b.produce(vec![record(i)]).await
                })
            })
            .collect();
        // Wake them all from a worker task, as a poll of the sockets wakes the requests of
        // many connections: the batcher, woken by the first write, runs before the others.
        tokio::spawn(async move {
            tokio::task::yield_now().await;
            start.send(true).expect("send");
        })
        .await
        .expect("starter");
        for p in producers {
            p.await.expect("producer").expect("produce");
        }
        let sizes: Vec<usize> = log.lock().expect("lock").iter().map(Vec::len).collect();
        assert_eq!(sizes.first(), Some(&8), "8 writes ready at once were split into batches {sizes:?}");
    }

    #[tokio::test]
    async fn refused_batch_is_retried_request_by_request_so_only_the_invalid_request_fails() {
        // At most 3 records per batch: 2-record requests fail only when batched together.
        let (propose, log) = bounded_log(3, std::time::Duration::from_millis(5));
        let batcher = Batcher::start(1, propose, WriteLoad::default());
        let mut tasks = Vec::new();
        for i in 0..12u32 {
            let b = batcher.clone();
            let records = if i == 5 { (0..4).map(|j| record(100 + j)).collect() } else { vec![record(i), record(i)] };
            tasks.push(tokio::spawn(async move { (i, b.produce(records).await) }));
        }
        for t in tasks {
            let (i, result) = t.await.expect("task");
            if i == 5 {
                assert!(matches!(result, Err(Error::Invalid(_))), "the 4-record request must fail alone: {result:?}");
            } else {
                assert!(result.is_ok(), "request {i} failed only because it was batched: {result:?}");
            }
        }
        let appended: usize = log.lock().expect("lock").iter().map(Vec::len).sum();
        assert_eq!(appended, 22, "11 valid requests of 2 records each");
    }

    #[tokio::test]
    async fn failed_batch_gives_every_request_the_same_definite_error() {
        let propose: Propose = Arc::new(|_records: &[Record]| {
            Box::pin(async move {
                tokio::time::sleep(std::time::Duration::from_millis(2)).await;
                Err(Error::NotLeader { group: 1, leader_node: Some(3) })
            })
        });
        let batcher = Batcher::start(1, propose, WriteLoad::default());
        let tasks: Vec<_> = (0..10u32)
            .map(|i| {
                let b = batcher.clone();
                tokio::spawn(async move { b.produce(vec![record(i)]).await })
            })
            .collect();
        for t in tasks {
            let result = t.await.expect("task");
            assert!(matches!(result, Err(Error::NotLeader { group: 1, leader_node: Some(3) })), "{result:?}");
        }
    }

    #[tokio::test]
    async fn forwarders_of_deleted_groups_are_dropped() {
        let forwarders = Forwarders::default();
        for (node, group) in [(1, 10), (2, 10), (1, 11)] {
            forwarders.get(node, group, &WriteLoad::default(), || bounded_log(10, std::time::Duration::ZERO).0);
        }
        forwarders.retain_groups(|g| g == 11);
        let left: Vec<(NodeId, GroupId)> = forwarders.batchers.lock().expect("lock").keys().copied().collect();
        assert_eq!(left, vec![(1, 11)]);
    }

    #[tokio::test]
    async fn write_load_counts_requests_until_they_are_answered() {
        let (propose, _log) = bounded_log(usize::MAX, std::time::Duration::from_millis(50));
        let load = WriteLoad::default();
        let batcher = Batcher::start(1, propose, load.clone());
        let producers: Vec<_> = (0..5u32)
            .map(|i| {
                let b = batcher.clone();
                tokio::spawn(async move { b.produce(vec![record(i)]).await })
            })
            .collect();
        let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(5);
        while load.current() < 5 {
            assert!(tokio::time::Instant::now() < deadline, "5 waiting writes counted {}", load.current());
            tokio::task::yield_now().await;
        }
        for p in producers {
            p.await.expect("producer").expect("produce");
        }
        assert_eq!(load.current(), 0, "answered writes still counted");
        // A write whose caller gave up is no longer counted either.
        let abandoned =
            tokio::time::timeout(std::time::Duration::from_millis(5), batcher.produce(vec![record(9)])).await;
        assert!(abandoned.is_err(), "the slow log answered within 5 ms");
        assert_eq!(load.current(), 0, "an abandoned write is still counted");
    }

    #[tokio::test]
    async fn empty_request_is_invalid() {
        let (propose, _log) = bounded_log(10, std::time::Duration::ZERO);
        let batcher = Batcher::start(1, propose, WriteLoad::default());
        assert!(matches!(batcher.produce(Vec::new()).await, Err(Error::Invalid(_))));
    }
}
