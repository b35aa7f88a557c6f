//! The Raft log of every group on a node, in one fjall database.
//!
//! Key layout (big-endian, see `raft/FORMAT.md`): `group u64 | tag u8 | index u64`
//! with tag `E` for entries (value: version byte + protobuf `Entry`), `V` vote,
//! `C` committed log id and `P` last purged log id (value: version byte +
//! protobuf `Vote`/`LogId`).
//!
//! To ensure correctness:
//! - `append` writes the entries into fjall (readable immediately; kept in the
//!   journal's buffer rather than written to the OS per append) and hands the
//!   `IOFlushed` callback to the node's syncer thread, which completes it only
//!   after `persist(SyncData)` returned: one fsync serves every group that
//!   appended meanwhile (group commit). Before an fsync the syncer waits for
//!   more appends: the loaded wait (`--group-commit-wait-us`, 1 ms by default) while
//!   many writes wait on the node ([`WriteLoad`]) and the last fsync served several
//!   groups, else
//!   [`GROUP_COMMIT_LINGER`] while the last fsync served several requests, else
//!   not at all.
//! - `save_vote` returns only after such a fsync.
//! - fjall's journal is one ordered stream, so a vote or entry written after
//!   another is never durable without it: vote and log writes of one group are
//!   never reordered.
//! - A failed fsync poisons the store: every later flush and vote fails, and the
//!   node must restart (fjall refuses writes after a failed fsync too).

use std::fmt::Debug;
use std::ops::Bound;
use std::ops::RangeBounds;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::sync::atomic::Ordering;
use std::sync::mpsc;

use fjall::Database;
use fjall::Keyspace;
use fjall::KeyspaceCreateOptions;
use fjall::PersistMode;
use openraft::RaftLogReader;
use openraft::storage::RaftLogStorage;
use prost::Message;

use crate::error::to_io;
use crate::pb;
use crate::types::Entry;
use crate::types::GroupId;
use crate::types::IoFlushed;
use crate::types::LogId;
use crate::types::LogState;
use crate::types::TypeConfig;
use crate::types::Vote;
use crate::wire;

/// Version byte in front of every value this module writes.
pub const FORMAT_VERSION: u8 = 1;

const TAG_ENTRY: u8 = b'E';
/// A key no replica has (replica id 2^64 - 1, tag `R`), whose tombstone makes the flush that
/// ends [`RaftLogDb::compact`]. Never read.
const RECLAIM_KEY: [u8; 9] = [0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, b'R'];
/// Pause between the two compactions of [`RaftLogDb::compact`].
const COMPACT_RETRY_PAUSE: std::time::Duration = std::time::Duration::from_millis(500);
const TAG_VOTE: u8 = b'V';
const TAG_COMMITTED: u8 = b'C';
const TAG_PURGED: u8 = b'P';

/// Memtable size of the raft log keyspace (fixed when the keyspace is created). A restart
/// replays the journal behind unflushed memtables, so this bounds the replay: with fjall's
/// default of 64 MiB, a node with 1M freshly written keys spent 1.3 s replaying 113 MB.
const RAFT_LOG_MEMTABLE_BYTES: u64 = 16 * 1024 * 1024;

/// How long the syncer waits for more appends before an fsync while it is busy.
const GROUP_COMMIT_LINGER: std::time::Duration = std::time::Duration::from_micros(500);

/// The default of how long it waits while at least [`LOADED_WRITES`] writes wait on the
/// node (`--group-commit-wait-us`). Each of them then spends milliseconds queued behind the
/// others, so the wait adds little to their time and saves fsyncs and wake-ups. Longer
/// saves more CPU per write and adds more latency: the best wait follows the machine
/// (BENCHMARKS.md, rounds 14, 18 and 19).
pub const GROUP_COMMIT_WAIT_LOADED_DEFAULT: std::time::Duration = std::time::Duration::from_millis(1);
/// The longest loaded wait a node accepts.
pub const GROUP_COMMIT_WAIT_LOADED_MAX: std::time::Duration = std::time::Duration::from_millis(100);

/// Writes waiting on a node from which the syncer takes the loaded wait...
const LOADED_WRITES: usize = 8;
/// ...when the last fsync served the appends of at least this many groups.
const LOADED_GROUPS: usize = 3;

/// Bound on flush requests queued for the syncer before appenders wait.
const SYNC_QUEUE_MAX: usize = 4096;

/// The node-wide Raft log database.
pub struct RaftLogDb {
    db: Database,
    ks: Keyspace,
    syncer: mpsc::SyncSender<SyncJob>,
    poisoned: Arc<AtomicBool>,
    stats: Arc<SyncStats>,
    load: WriteLoad,
}

/// Produce requests waiting on a node: taken by its batchers (as leader, and as the node
/// that forwards them) until answered. The syncer reads it to size its group-commit wait.
#[derive(Clone, Debug, Default)]
pub struct WriteLoad(Arc<std::sync::atomic::AtomicUsize>);

impl WriteLoad {
    /// Counts one write until the guard is dropped.
    pub fn enter(&self) -> WriteLoadGuard {
        self.0.fetch_add(1, Ordering::Relaxed);
        WriteLoadGuard(self.0.clone())
    }

    /// Writes waiting now.
    pub fn current(&self) -> usize {
        self.0.load(Ordering::Relaxed)
    }
}

/// One write counted by a [`WriteLoad`].
pub struct WriteLoadGuard(Arc<std::sync::atomic::AtomicUsize>);

impl Drop for WriteLoadGuard {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Counters of the group-commit syncer, for metrics.
#[derive(Debug, Default)]
pub struct SyncStats {
    /// fsyncs done.
    pub fsyncs: std::sync::atomic::AtomicU64,
    /// Flush requests (appends and votes) those fsyncs served.
    pub requests: std::sync::atomic::AtomicU64,
    /// Total time spent in fsync, in microseconds.
    pub fsync_micros: std::sync::atomic::AtomicU64,
    /// fsyncs that took the loaded wait for more appends.
    pub loaded_lingers: std::sync::atomic::AtomicU64,
}

enum SyncJob {
    /// Appends of a group, made durable by the next fsync.
    Flushed(GroupId, IoFlushed),
    Wait(tokio::sync::oneshot::Sender<Result<(), String>>),
}

impl RaftLogDb {
    /// Opens the node's Raft log at `path`; its syncer waits `loaded_wait` for more appends
    /// before an fsync while the node is loaded (see the module's notes).
    pub fn open(path: &Path, loaded_wait: std::time::Duration) -> crate::Result<Arc<RaftLogDb>> {
        let db = Database::builder(path).open().map_err(|e| match e {
            fjall::Error::Locked => crate::error::Error::Invalid(format!(
                "the Raft log at {} is in use by another process: another logdex node on the same --data-dir, or one still stopping",
                path.display()
            )),
            e => e.into(),
        })?;
        let ks =
            db.keyspace("raft_log", || KeyspaceCreateOptions::default().max_memtable_size(RAFT_LOG_MEMTABLE_BYTES))?;
        let (syncer, rx) = mpsc::sync_channel(SYNC_QUEUE_MAX);
        let poisoned = Arc::new(AtomicBool::new(false));
        let stats = Arc::new(SyncStats::default());
        let load = WriteLoad::default();
        let thread = Syncer {
            db: db.clone(),
            dir: path.to_path_buf(),
            poisoned: poisoned.clone(),
            load: load.clone(),
            stats: stats.clone(),
            loaded_wait,
        };
        std::thread::Builder::new().name("raft-log-sync".into()).spawn(move || run_syncer(&thread, rx))?;
        Ok(Arc::new(RaftLogDb { db, ks, syncer, poisoned, stats, load }))
    }

    /// The count of writes waiting on this node, which its batchers keep.
    pub fn write_load(&self) -> &WriteLoad {
        &self.load
    }

    /// Group-commit counters.
    pub fn sync_stats(&self) -> &SyncStats {
        &self.stats
    }

    /// The log storage of one group.
    pub fn group(self: &Arc<Self>, group: GroupId) -> GroupLogStore {
        GroupLogStore { group, db: self.clone() }
    }

    /// Removes every key of a group (its replica was removed from this node).
    pub fn delete_group(&self, group: GroupId) -> crate::Result<()> {
        let mut batch = self.db.batch();
        for item in self.ks.prefix(group.to_be_bytes()) {
            batch.remove(&self.ks, item.key()?);
        }
        batch.commit()?;
        Ok(())
    }

    /// Blocking: flushes the memtable and compacts the keyspace into its last level, so the
    /// entries of removed groups (and of purged logs) leave the disk with their tombstones.
    /// A compaction finds nothing to do while fjall compacts in the background, so it runs
    /// twice, apart; the tables it replaced are deleted at the next flush (fjall drops
    /// replaced table versions then), which a tombstone of [`RECLAIM_KEY`] provides.
    pub fn compact(&self) -> crate::Result<()> {
        self.flush_memtable()?;
        self.ks.major_compact()?;
        std::thread::sleep(COMPACT_RETRY_PAUSE);
        self.ks.major_compact()?;
        self.ks.remove(RECLAIM_KEY)?;
        self.flush_memtable()?;
        Ok(())
    }

    /// Seals the memtable and waits (bounded) for its flush; see
    /// [`logdex_index::seal_and_wait_flushed`] for why not fjall's unbounded wait.
    fn flush_memtable(&self) -> crate::Result<()> {
        if !logdex_index::seal_and_wait_flushed(&self.ks, logdex_index::FLUSH_WAIT_MAX)? {
            tracing::warn!("raft log memtable not flushed in time; compacting the tables without it");
        }
        Ok(())
    }

    async fn sync(&self) -> Result<(), std::io::Error> {
        let (tx, rx) = tokio::sync::oneshot::channel();
        self.send(SyncJob::Wait(tx))?;
        rx.await.map_err(to_io)?.map_err(to_io)
    }

    fn send(&self, job: SyncJob) -> Result<(), std::io::Error> {
        if self.poisoned.load(Ordering::Acquire) {
            return Err(to_io("raft log is poisoned by a failed fsync; restart the node"));
        }
        self.syncer.send(job).map_err(|_| to_io("raft log syncer stopped"))
    }
}

/// What the syncer thread works with.
struct Syncer {
    db: Database,
    dir: std::path::PathBuf,
    poisoned: Arc<AtomicBool>,
    load: WriteLoad,
    stats: Arc<SyncStats>,
    loaded_wait: std::time::Duration,
}

/// What the last fsync served.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
struct Served {
    /// Flush requests (appends and votes).
    requests: usize,
    /// Groups whose appends it made durable.
    groups: usize,
}

impl Served {
    fn of(jobs: &[SyncJob]) -> Served {
        let mut groups: Vec<GroupId> = jobs
            .iter()
            .filter_map(|job| match job {
                SyncJob::Flushed(group, _) => Some(*group),
                SyncJob::Wait(_) => None,
            })
            .collect();
        groups.sort_unstable();
        groups.dedup();
        Served { requests: jobs.len(), groups: groups.len() }
    }
}

/// How long the syncer waits for more appends before its next fsync.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Linger {
    /// Not at all.
    None,
    /// [`GROUP_COMMIT_LINGER`].
    Busy,
    /// The loaded wait.
    Loaded,
}

/// The wait before the next fsync, given the writes waiting on the node and what the last
/// fsync served. A lone writer never waits, and neither does a lone group: a group's entries
/// in flight wait for this very fsync, so a group alone adds little to it while it waits,
/// and its writes only wait longer (a one-partition `load` lost 5% with the long wait by
/// load alone, and 10 to 21% with the short one: BENCHMARKS.md, round 23). A wait needs the
/// appends of several groups, and the loaded wait many writes.
fn linger(writes_waiting: usize, last: Served) -> Linger {
    if writes_waiting >= LOADED_WRITES && last.groups >= LOADED_GROUPS {
        Linger::Loaded
    } else if last.requests > 1 && last.groups > 1 {
        Linger::Busy
    } else {
        Linger::None
    }
}

fn run_syncer(syncer: &Syncer, rx: mpsc::Receiver<SyncJob>) {
    let Syncer { db, dir, poisoned, load, stats, loaded_wait } = syncer;
    let dir = dir.as_path();
    // Under load, a wait lets more appends share the next fsync (fewer fsyncs and wake-ups,
    // less CPU per write).
    let mut last = Served::default();
    while let Ok(first) = rx.recv() {
        let mut jobs = vec![first];
        let wait = match linger(load.current(), last) {
            Linger::None => std::time::Duration::ZERO,
            Linger::Busy => GROUP_COMMIT_LINGER,
            Linger::Loaded => {
                stats.loaded_lingers.fetch_add(1, Ordering::Relaxed);
                *loaded_wait
            }
        };
        if !wait.is_zero() {
            std::thread::sleep(wait);
        }
        while let Ok(job) = rx.try_recv() {
            jobs.push(job);
        }
        // Crash point (test builds with the `failpoints` feature; nothing otherwise): the
        // appends are written into fjall but not yet fsynced, and nobody was acknowledged.
        fail::fail_point!("raft_log::before_fsync");
        let started = std::time::Instant::now();
        let result = if poisoned.load(Ordering::Acquire) {
            Err("raft log is poisoned by a failed fsync".to_string())
        } else {
            db.persist(PersistMode::SyncData).map_err(|e| e.to_string())
        };
        last = Served::of(&jobs);
        stats.fsyncs.fetch_add(1, Ordering::Relaxed);
        stats.requests.fetch_add(jobs.len() as u64, Ordering::Relaxed);
        stats.fsync_micros.fetch_add(started.elapsed().as_micros() as u64, Ordering::Relaxed);
        match &result {
            // Test builds with LOGDEX_FSYNC_TRACE: record what is durable before acknowledging it.
            Ok(()) => {
                crate::fsync_trace::durable(&[dir]);
                // Crash point: durable, but no append or vote acknowledged to openraft yet.
                fail::fail_point!("raft_log::after_fsync");
            }
            Err(e) => {
                tracing::error!(error = %e, "raft log fsync failed; poisoning the raft log");
                poisoned.store(true, Ordering::Release);
            }
        }
        for job in jobs {
            match job {
                SyncJob::Flushed(_, cb) => cb.io_completed(result.clone().map_err(to_io)),
                SyncJob::Wait(tx) => {
                    let _ = tx.send(result.clone());
                }
            }
        }
    }
}

/// The Raft log storage of one group: a view of the node's [`RaftLogDb`].
#[derive(Clone)]
pub struct GroupLogStore {
    group: GroupId,
    db: Arc<RaftLogDb>,
}

impl GroupLogStore {
    fn key(&self, tag: u8, index: u64) -> [u8; 17] {
        let mut k = [0u8; 17];
        k[..8].copy_from_slice(&self.group.to_be_bytes());
        k[8] = tag;
        k[9..].copy_from_slice(&index.to_be_bytes());
        k
    }

    fn get_msg<M: Message + Default>(&self, tag: u8) -> Result<Option<M>, std::io::Error> {
        let Some(value) = self.db.ks.get(self.key(tag, 0)).map_err(to_io)? else {
            return Ok(None);
        };
        decode_value::<M>(&value).map(Some)
    }

    fn put_msg<M: Message>(&self, tag: u8, msg: &M) -> Result<(), std::io::Error> {
        self.db.ks.insert(self.key(tag, 0), encode_value(msg)).map_err(to_io)
    }

    fn last_entry_log_id(&self) -> Result<Option<LogId>, std::io::Error> {
        let lo = self.key(TAG_ENTRY, 0);
        let hi = self.key(TAG_ENTRY, u64::MAX);
        let Some(item) = self.db.ks.range(lo..=hi).next_back() else {
            return Ok(None);
        };
        let (_, value) = item.into_inner().map_err(to_io)?;
        let entry = decode_value::<pb::Entry>(&value)?;
        let log_id = wire::required(entry.log_id, "Entry", "log_id").map_err(to_io)?;
        Ok(Some(wire::log_id_from_pb(&log_id)))
    }

    fn remove_entries(&self, from: u64, to_inclusive: u64) -> Result<(), std::io::Error> {
        if from > to_inclusive {
            return Ok(());
        }
        let mut batch = self.db.db.batch();
        for item in self.db.ks.range(self.key(TAG_ENTRY, from)..=self.key(TAG_ENTRY, to_inclusive)) {
            batch.remove(&self.db.ks, item.key().map_err(to_io)?);
        }
        batch.commit().map_err(to_io)
    }
}

fn encode_value<M: Message>(msg: &M) -> Vec<u8> {
    let mut buf = Vec::with_capacity(1 + msg.encoded_len());
    buf.push(FORMAT_VERSION);
    // Encoding into a Vec cannot run out of capacity.
    let _ = msg.encode(&mut buf);
    buf
}

fn decode_value<M: Message + Default>(value: &[u8]) -> Result<M, std::io::Error> {
    match value.split_first() {
        Some((&FORMAT_VERSION, body)) => M::decode(body).map_err(to_io),
        Some((v, _)) => Err(to_io(format!("raft log value has unknown format version {v}"))),
        None => Err(to_io("raft log value is empty")),
    }
}

fn range_to_indexes<RB: RangeBounds<u64>>(range: &RB) -> Option<(u64, u64)> {
    let start = match range.start_bound() {
        Bound::Included(s) => *s,
        Bound::Excluded(s) => s.checked_add(1)?,
        Bound::Unbounded => 0,
    };
    let end = match range.end_bound() {
        Bound::Included(e) => *e,
        Bound::Excluded(e) => e.checked_sub(1)?,
        Bound::Unbounded => u64::MAX,
    };
    (start <= end).then_some((start, end))
}

impl RaftLogReader<TypeConfig> for GroupLogStore {
    async fn try_get_log_entries<RB: RangeBounds<u64> + Clone + Debug + Send>(
        &mut self,
        range: RB,
    ) -> Result<Vec<Entry>, std::io::Error> {
        let Some((start, end)) = range_to_indexes(&range) else {
            return Ok(Vec::new());
        };
        let mut entries = Vec::new();
        for item in self.db.ks.range(self.key(TAG_ENTRY, start)..=self.key(TAG_ENTRY, end)) {
            let (_, value) = item.into_inner().map_err(to_io)?;
            let entry = decode_value::<pb::Entry>(&value)?;
            entries.push(wire::entry_from_pb(entry).map_err(to_io)?);
        }
        Ok(entries)
    }

    async fn read_vote(&mut self) -> Result<Option<Vote>, std::io::Error> {
        Ok(self.get_msg::<pb::Vote>(TAG_VOTE)?.map(|v| wire::vote_from_pb(&v)))
    }
}

impl RaftLogStorage<TypeConfig> for GroupLogStore {
    type LogReader = Self;

    async fn get_log_state(&mut self) -> Result<LogState, std::io::Error> {
        let last_purged = self.get_msg::<pb::LogId>(TAG_PURGED)?.map(|l| wire::log_id_from_pb(&l));
        let last = self.last_entry_log_id()?.or(last_purged);
        Ok(LogState { last_purged_log_id: last_purged, last_log_id: last })
    }

    async fn get_log_reader(&mut self) -> Self::LogReader {
        self.clone()
    }

    async fn save_vote(&mut self, vote: &Vote) -> Result<(), std::io::Error> {
        self.put_msg(TAG_VOTE, &wire::vote_to_pb(vote))?;
        self.db.sync().await
    }

    async fn save_committed(&mut self, committed: Option<LogId>) -> Result<(), std::io::Error> {
        match committed {
            Some(c) => self.put_msg(TAG_COMMITTED, &wire::log_id_to_pb(&c)),
            None => Ok(()),
        }
    }

    async fn read_committed(&mut self) -> Result<Option<LogId>, std::io::Error> {
        Ok(self.get_msg::<pb::LogId>(TAG_COMMITTED)?.map(|l| wire::log_id_from_pb(&l)))
    }

    async fn append<I>(&mut self, entries: I, callback: IoFlushed) -> Result<(), std::io::Error>
    where
        I: IntoIterator<Item = Entry> + Send,
        I::IntoIter: Send,
    {
        // Kept in the journal's buffer, not written to the OS per append: the syncer's
        // `persist(SyncData)` writes and fsyncs everything appended before it, and nothing
        // is acknowledged before that.
        let mut batch = self.db.db.batch().durability(None);
        for entry in entries {
            let key = self.key(TAG_ENTRY, entry.log_id.index);
            batch.insert(&self.db.ks, key, encode_value(&wire::entry_to_pb(&entry)));
        }
        batch.commit().map_err(to_io)?;
        if cfg!(feature = "mutant-ack-before-fsync") {
            // Mutant: tells openraft the entries are durable before the fsync.
            callback.io_completed(Ok(()));
            return Ok(());
        }
        self.db.send(SyncJob::Flushed(self.group, callback))
    }

    async fn truncate_after(&mut self, last_log_id: Option<LogId>) -> Result<(), std::io::Error> {
        let from = last_log_id.map_or(0, |l| l.index + 1);
        self.remove_entries(from, u64::MAX)
    }

    async fn purge(&mut self, log_id: LogId) -> Result<(), std::io::Error> {
        self.put_msg(TAG_PURGED, &wire::log_id_to_pb(&log_id))?;
        self.remove_entries(0, log_id.index)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_raft_log_in_use_is_refused_naming_the_directory() -> std::result::Result<(), Box<dyn std::error::Error>> {
        let dir = tempfile::tempdir()?;
        let _open = RaftLogDb::open(dir.path(), GROUP_COMMIT_WAIT_LOADED_DEFAULT)?;
        let refused = RaftLogDb::open(dir.path(), GROUP_COMMIT_WAIT_LOADED_DEFAULT)
            .err()
            .ok_or("the Raft log opened twice")?
            .to_string();
        assert!(refused.contains("is in use by another process"), "{refused}");
        assert!(refused.contains(&dir.path().display().to_string()), "{refused}");
        Ok(())
    }

    #[test]
    fn syncer_waits_long_only_while_many_writes_of_several_groups_wait() {
        let served = |requests, groups| Served { requests, groups };
        assert_eq!(linger(0, served(0, 0)), Linger::None, "a lone writer waited");
        assert_eq!(linger(1, served(1, 1)), Linger::None, "a lone writer waited");
        assert_eq!(linger(1, served(2, 2)), Linger::Busy);
        assert_eq!(linger(LOADED_WRITES - 1, served(9, 9)), Linger::Busy, "a light load waited long");
        assert_eq!(linger(LOADED_WRITES, served(6, LOADED_GROUPS)), Linger::Loaded);
        assert_eq!(linger(10 * LOADED_WRITES, served(6, LOADED_GROUPS + 3)), Linger::Loaded);
        // Two groups, not enough for the loaded wait.
        assert_eq!(linger(10 * LOADED_WRITES, served(5, LOADED_GROUPS - 1)), Linger::Busy);
    }

    #[test]
    fn syncer_never_waits_for_a_lone_group() {
        let served = |requests, groups| Served { requests, groups };
        // One busy group: its entries in flight wait for this fsync; waiting only delays them.
        assert_eq!(linger(10 * LOADED_WRITES, served(5, 1)), Linger::None);
        assert_eq!(linger(1, served(2, 1)), Linger::None);
        // A vote and one group's appends.
        assert_eq!(linger(LOADED_WRITES, served(3, 1)), Linger::None);
        assert_eq!(linger(LOADED_WRITES, served(3, 2)), Linger::Busy);
    }

    #[test]
    fn served_counts_each_group_once_and_votes_in_no_group() {
        let (tx, _rx) = tokio::sync::oneshot::channel();
        let jobs = [
            SyncJob::Flushed(7, IoFlushed::noop()),
            SyncJob::Wait(tx),
            SyncJob::Flushed(3, IoFlushed::noop()),
            SyncJob::Flushed(7, IoFlushed::noop()),
        ];
        assert_eq!(Served::of(&jobs), Served { requests: 4, groups: 2 });
    }

    #[test]
    fn write_load_guard_counts_until_dropped() {
        let load = WriteLoad::default();
        let (a, b) = (load.enter(), load.enter());
        assert_eq!(load.current(), 2);
        drop(a);
        assert_eq!(load.current(), 1);
        drop(b);
        assert_eq!(load.current(), 0);
    }
}
