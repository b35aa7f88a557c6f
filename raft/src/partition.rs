//! One partition replica's data: its segment log and its slice of the node's key index.
//!
//! To ensure correctness (DESIGN.md I1, I4, I5):
//! - Only [`Partition::apply_batches`] writes, and only with committed entries:
//!   it appends each batch to the segment log at the next offset (dense,
//!   identical on every replica), publishes the high watermark, then writes
//!   every key and the applied marker to the index in one atomic batch.
//! - Readers see an offset from the index only after the log holds it and the
//!   high watermark covers it, so no answer is ever ahead of commit.
//! - Recovery ([`Partition::open`]) makes the log and the index agree on one
//!   applied point; entries after it are re-applied from the Raft log.
//! - Damaged data is refused, never answered: the segment log checks every
//!   batch it reads (crc, framing, offsets), a lookup checks that the record
//!   the index points at is there under the key asked, and a snapshot's files
//!   are read whole before they replace this replica's log.
//! - When the log lost a tail the index had recorded (the active segment cut
//!   or damaged), the index is kept, the log is cut back to a durable point
//!   and Raft re-applies the rest; lookups answer unavailable until the
//!   replica is past the index's old applied point (`reapply.json`).

use std::collections::HashMap;
use std::path::Path;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::RwLock;
use std::sync::atomic::AtomicU64;
use std::sync::atomic::Ordering;

use logdex_index::AppliedMarker;
use logdex_index::Index;
use logdex_index::Lookup;
use logdex_index::Update;
use logdex_log::Log;
use logdex_log::LogConfig;
use logdex_log::Offset;
use logdex_log::Record;
use serde::Deserialize;
use serde::Serialize;

use crate::error::Error;
use crate::error::Result;
use crate::pb;
use crate::record_cache::RecordCache;
use crate::tier::Manifest;
use crate::tier::RemoteSegment;
use crate::tier::TierCache;
use crate::tier::TierStore;
use crate::types::GroupId;
use crate::types::LogId;
use crate::types::ReplicaId;
use crate::types::StoredMembership;

/// Rounds of a fetch that meets local retention moving the local log's start meanwhile.
const READ_ROUNDS_MAX: usize = 4;

/// Most keys a compaction pass tracks whose newest record the index cannot place in the
/// segments compacted (`Partition::compact`); the records of keys past it are kept. About
/// 1M keys: tens of MB for keys of a few dozen bytes.
const UNDECIDED_KEYS_MAX: usize = 1 << 20;
/// Name of the durable checkpoint file in a partition directory.
const CHECKPOINT_FILE: &str = "checkpoint.json";
/// Present while a snapshot is being installed: names the snapshot directory.
const INSTALL_FILE: &str = "installing.json";
/// Applied state and next offset of a snapshot, inside its directory.
const SNAPSHOT_STATE_FILE: &str = "state.json";
/// In a snapshot: the index entries of keys whose latest record a trim removed and no forget
/// reached yet (the snapshot's segments no longer hold those records), so that a replica
/// installing it answers those keys "removed" as every other replica does (raft/FORMAT.md,
/// "Removed keys").
const REMOVED_KEYS_FILE: &str = "removed.keys";
/// Version byte at the start of [`REMOVED_KEYS_FILE`].
const REMOVED_KEYS_VERSION: u8 = 1;
/// Present while the key index may be ahead of the segment log (the log lost a
/// tail the index had recorded): the index's next offset then. Lookups wait
/// until the replica re-applied that far.
const REAPPLY_FILE: &str = "reapply.json";

/// What a key lookup found on this replica.
#[derive(Debug)]
pub enum KeyRead {
    /// The live record for the key.
    Found { offset: Offset, record: Record },
    /// No live record: never written, tombstoned, or removed by retention and forgotten since
    /// (`TierCommand` `forget_to`).
    NotFound,
    /// The key's record was removed by retention (and not forgotten yet).
    Evicted { offset: Offset },
}

/// Result of applying one produce batch.
#[derive(Clone, Copy, Debug)]
pub struct Appended {
    pub base_offset: Offset,
    pub last_offset: Offset,
    pub timestamp_ms: i64,
}

/// One partition replica on this node.
pub struct Partition {
    pub group: GroupId,
    pub replica: ReplicaId,
    dir: PathBuf,
    log_config: LogConfig,
    /// The topic's `max.message.bytes`: the largest batch a write may propose. It is
    /// checked before proposing, never when applying: replicas learn a config change
    /// at different moments, and a committed entry must apply alike on each.
    batch_bytes_max: std::sync::atomic::AtomicU32,
    /// The topic's `compression.type`: the codec ([`logdex_log::Compression::id`]) of the
    /// batches writes propose. Like the batch bound, it is the proposer's choice: replicas
    /// store each committed batch as it came.
    compression: std::sync::atomic::AtomicU8,
    log: RwLock<Log>,
    index: Index,
    high_watermark: AtomicU64,
    /// Held for writing while the index takes new keys and the high watermark moves to
    /// cover them, and for reading while a lookup reads both: a lookup's index state and
    /// high watermark are one snapshot (never an offset at or above the high watermark it
    /// reports, never a write below it missing).
    visibility: RwLock<()>,
    /// While the high watermark is below this, the index may hold entries of
    /// records not yet re-applied to the log: lookups are refused (0: none).
    reapply_until: AtomicU64,
    /// A snapshot install holds the locks (seconds: it rebuilds the index); see
    /// [`Partition::unless_installing`].
    installing: std::sync::atomic::AtomicBool,
    /// Sealed segments the scrub checked and found whole, or damaged: (base offset, size)
    /// -> damaged. A segment compaction rewrote has another size (or is checked again).
    scrubbed: std::sync::Mutex<HashMap<(Offset, u64), bool>>,
    /// Segments copied to the object store (tiered storage) and the cache reads of them use.
    tier: Tier,
    /// Held by a compaction for its whole pass (one at a time per replica), and by a
    /// snapshot install (which replaces the files a compaction writes beside).
    compacting: std::sync::Mutex<()>,
    /// Held while `checkpoint.json` is computed and written, and by a snapshot install (which
    /// writes its own): checkpoints run from the checkpointer, local retention and snapshot
    /// staging, and one computed before another must not be written after it.
    checkpointing: std::sync::Mutex<()>,
    /// Records lookups read and apply wrote, shared by the node's replicas (see [`crate::record_cache`]).
    records: RecordCache,
    /// Counters for metrics.
    pub counters: Counters,
}

/// A replica's view of its tiered storage.
struct Tier {
    /// Changed only by applied `TierCommand`s and snapshot installs, saved before it changes.
    manifest: RwLock<Manifest>,
    cache: TierCache,
}

impl Tier {
    fn new(manifest: Manifest, cache: TierCache) -> Tier {
        Tier { manifest: RwLock::new(manifest), cache }
    }
}

/// Monotonic counters of one replica's background work, for metrics.
#[derive(Debug, Default)]
pub struct Counters {
    pub compactions: AtomicU64,
    pub records_compacted: AtomicU64,
    pub snapshots_built: AtomicU64,
    pub snapshots_installed: AtomicU64,
    /// Bytes of sealed segments the scrub read and found whole.
    pub bytes_scrubbed: AtomicU64,
    /// Sealed segments the scrub found damaged (each counted once).
    pub damaged_segments: AtomicU64,
}

/// Applied state recorded with every index write, opaque to the index.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct AppliedState {
    /// The last applied Raft entry.
    pub applied: Option<LogId>,
    /// The last applied membership.
    pub membership: StoredMembership,
}

impl AppliedState {
    pub fn encode(&self) -> Vec<u8> {
        // Serializing plain data into a Vec cannot fail.
        serde_json::to_vec(self).unwrap_or_default()
    }

    pub fn decode(bytes: &[u8]) -> Result<AppliedState> {
        serde_json::from_slice(bytes).map_err(|e| Error::Corrupted(format!("applied state: {e}")))
    }
}

#[derive(Clone, Debug, Serialize, Deserialize)]
struct Checkpoint {
    state: Vec<u8>,
    next_offset: Offset,
}

#[derive(Clone, Copy, Debug, Serialize, Deserialize)]
struct Reapply {
    index_next_offset: Offset,
}

impl Partition {
    /// Opens (or creates) the replica in `dir` and reconciles log and index.
    /// Returns the partition and the applied state both agree on.
    pub fn open(
        group: GroupId,
        replica: ReplicaId,
        dir: &Path,
        log_config: LogConfig,
        index: Index,
    ) -> Result<(Partition, AppliedState)> {
        Partition::open_with_tier(group, replica, dir, log_config, index, None)
    }

    /// [`Partition::open`] with the node's object store, for topics with tiered storage.
    pub fn open_with_tier(
        group: GroupId,
        replica: ReplicaId,
        dir: &Path,
        log_config: LogConfig,
        index: Index,
        store: Option<TierStore>,
    ) -> Result<(Partition, AppliedState)> {
        std::fs::create_dir_all(dir)?;
        let admitted = log_config.batch_bytes_max;
        let log_config = apply_config(log_config);
        let cache = TierCache::new(dir.join(crate::tier::CACHE_DIR), store);
        if let Some(snapshot) = read_install_intent(dir)? {
            tracing::info!(group, replica, snapshot = %snapshot.display(), "finishing an interrupted snapshot install");
            let (log, state, manifest) = install_files(replica, dir, &log_config, &index, &snapshot, &cache)?;
            let tier = Tier::new(manifest, cache);
            let partition = Partition::from_parts(group, replica, dir, log_config, log, index, tier);
            partition.batch_bytes_max.store(admitted, Ordering::Relaxed);
            return Ok((partition, state));
        }
        let manifest = Manifest::load(dir)?;
        let mut log = Log::open(&dir.join("log"), log_config.clone())?;
        // Segments a committed trim removed, if their deletion did not reach the disk.
        log.delete_before(manifest.trimmed_to)?;
        let marker = index.applied(replica)?;
        let mut reapply_until = read_json::<Reapply>(&dir.join(REAPPLY_FILE))?.map_or(0, |r| r.index_next_offset);
        let state = match marker {
            Some(m) if m.next_offset < log.start_offset() => {
                // A committed trim removed records the index's applied point does not reach
                // (a power loss after the trim's deletions reached the disk, before the
                // index's next checkpoint): the log starts empty at that point, and Raft
                // re-applies the records after it and then the trim.
                tracing::warn!(
                    group,
                    replica,
                    log_start = log.start_offset(),
                    index_end = m.next_offset,
                    "a trim removed records past the index's applied point; re-applying them from the Raft log"
                );
                log.reset(m.next_offset)?;
                AppliedState::decode(&m.state)?
            }
            Some(m) if log.next_offset() >= m.next_offset => {
                // The usual case after a crash: the log may hold batches the index
                // never recorded; drop them, Raft re-applies their entries.
                log.truncate(m.next_offset)?;
                AppliedState::decode(&m.state)?
            }
            Some(m) => {
                // The log lost a tail the index recorded: its active segment was cut or
                // damaged (the torn-tail scan dropped it), or power failed before a sync.
                tracing::warn!(
                    group,
                    replica,
                    log_end = log.next_offset(),
                    index_end = m.next_offset,
                    "the segment log ends before the index's applied point; keeping the index, cutting the log back to a durable point and re-applying the rest from the Raft log"
                );
                reapply_until = reapply_until.max(m.next_offset);
                let reapply = Reapply { index_next_offset: reapply_until };
                write_file_durably(dir, REAPPLY_FILE, &serde_json::to_vec(&reapply).unwrap_or_default())?;
                let point = recovery_point(group, replica, dir, &log)?;
                cut_log(&mut log, point.next_offset)?;
                AppliedState::decode(&point.state)?
            }
            // A log that ever held records, even one retention emptied (its start moved): a
            // fresh start from entry 1 would write offsets the other replicas do not have.
            None if log.next_offset() > 0 => {
                tracing::warn!(group, replica, "segment log without index state; rebuilding the index from the log");
                let point = recovery_point(group, replica, dir, &log)?;
                cut_log(&mut log, point.next_offset)?;
                rebuild_index(replica, &log, &index, &point, &manifest, &cache)?;
                reapply_until = 0;
                remove_file_durably(dir, REAPPLY_FILE)?;
                AppliedState::decode(&point.state)?
            }
            None => AppliedState::default(),
        };
        let tier = Tier::new(manifest, cache);
        let partition = Partition::from_parts(group, replica, dir, log_config, log, index, tier);
        partition.batch_bytes_max.store(admitted, Ordering::Relaxed);
        // A forget whose watermark raise the index lost in a crash (the manifest is durable first).
        let forgotten_to = partition.tier_manifest().forgotten_to;
        if forgotten_to > 0 {
            partition.index.set_watermark(replica, forgotten_to)?;
        }
        partition.reapply_until.store(reapply_until, Ordering::Release);
        Ok((partition, state))
    }

    fn from_parts(
        group: GroupId,
        replica: ReplicaId,
        dir: &Path,
        log_config: LogConfig,
        log: Log,
        index: Index,
        tier: Tier,
    ) -> Partition {
        let hw = log.next_offset();
        Partition {
            group,
            replica,
            dir: dir.to_path_buf(),
            batch_bytes_max: std::sync::atomic::AtomicU32::new(log_config.batch_bytes_max),
            compression: std::sync::atomic::AtomicU8::new(log_config.compression.id()),
            log_config,
            log: RwLock::new(log),
            index,
            high_watermark: AtomicU64::new(hw),
            visibility: RwLock::new(()),
            reapply_until: AtomicU64::new(0),
            installing: Default::default(),
            scrubbed: Default::default(),
            tier,
            compacting: std::sync::Mutex::new(()),
            checkpointing: std::sync::Mutex::new(()),
            records: RecordCache::disabled(),
            counters: Counters::default(),
        }
    }

    /// Apply and lookups of this replica keep the records they write or read in `records`, and
    /// lookups read them there (a replica opened without it reads the segment log every time).
    pub fn with_record_cache(mut self, records: RecordCache) -> Partition {
        self.records = records;
        self
    }

    /// The directory holding this replica's files.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Writes a snapshot of the applied state into `staged`: a durable
    /// checkpoint, hard links of the segment files, the tier manifest, the removed keys
    /// not forgotten yet, and `state.json`. The caller must not apply entries meanwhile.
    pub fn snapshot_to(&self, staged: &Path, state: &AppliedState) -> Result<()> {
        self.checkpoint()?;
        let next_offset = {
            let mut log = self.log.write().map_err(|_| Error::Corrupted("segment log lock poisoned".into()))?;
            log.checkpoint(&staged.join("log"))?;
            log.next_offset()
        };
        let manifest = self.tier_manifest();
        manifest.save(staged)?;
        write_removed_keys(&self.index, self.replica, &manifest, staged)?;
        let snapshot_state = Checkpoint { state: state.encode(), next_offset };
        self.counters.snapshots_built.fetch_add(1, Ordering::Relaxed);
        write_file_durably(staged, SNAPSHOT_STATE_FILE, &serde_json::to_vec(&snapshot_state).unwrap_or_default())
    }

    /// Reads a snapshot's segment files whole and checks them (crc, framing,
    /// offsets) against its state file; [`Error::Log`] `Corrupt` naming the
    /// file and position when a batch fails (a damaged leader's snapshot).
    /// With remote segments, checks that the store holds them (see
    /// `check_remote_segments`).
    pub fn verify_snapshot(&self, snapshot_dir: &Path) -> Result<()> {
        let snapshot: Checkpoint = read_json(&snapshot_dir.join(SNAPSHOT_STATE_FILE))?
            .ok_or_else(|| Error::Corrupted(format!("snapshot {} has no state file", snapshot_dir.display())))?;
        let verified = Log::verify_files(&snapshot_dir.join("log")).map_err(|e| {
            tracing::error!(group = self.group, replica = self.replica, error = %e, "refusing a snapshot whose segment files fail their checks; this replica's data is unchanged");
            e
        })?;
        read_removed_keys(snapshot_dir)?;
        if verified != snapshot.next_offset {
            return Err(Error::Corrupted(format!(
                "snapshot in {} holds offsets up to {verified} but its state says {}",
                snapshot_dir.display(),
                snapshot.next_offset
            )));
        }
        self.check_remote_segments(snapshot_dir)
    }

    /// Replaces this replica's log and index by a snapshot's; crash-safe: an
    /// interrupted install is finished by the next open. The snapshot is
    /// verified first ([`Partition::verify_snapshot`]): a damaged one fails the
    /// install before anything is replaced.
    pub fn install_snapshot(&self, snapshot_dir: &Path) -> Result<AppliedState> {
        self.verify_snapshot(snapshot_dir)?;
        self.install_verified_snapshot(snapshot_dir)
    }

    /// [`Partition::install_snapshot`] of a snapshot the caller already verified (the state
    /// machine checks it before adopting it, and its files do not change after that), so
    /// its files are not read a second time.
    pub fn install_verified_snapshot(&self, snapshot_dir: &Path) -> Result<AppliedState> {
        let _installing = Installing::start(&self.installing);
        let _no_compaction = self.compacting.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let _no_checkpoint = self.checkpointing.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        write_file_durably(&self.dir, INSTALL_FILE, &serde_json::to_vec(snapshot_dir).unwrap_or_default())?;
        let mut log = self.log.write().map_err(|_| Error::Corrupted("segment log lock poisoned".into()))?;
        let _visible = self.visibility.write().map_err(|_| Error::Corrupted("visibility lock poisoned".into()))?;
        let (new_log, state, manifest) =
            install_files(self.replica, &self.dir, &self.log_config, &self.index, snapshot_dir, &self.tier.cache)?;
        if manifest.forgotten_to > 0 {
            self.index.set_watermark(self.replica, manifest.forgotten_to)?;
        }
        *self.tier.manifest.write().map_err(|_| Error::Corrupted("tier manifest lock poisoned".into()))? = manifest;
        self.high_watermark.store(new_log.next_offset(), Ordering::Release);
        self.reapply_until.store(0, Ordering::Release);
        *log = new_log;
        self.counters.snapshots_installed.fetch_add(1, Ordering::Relaxed);
        Ok(state)
    }

    /// Before a snapshot replaces anything: when its manifest names remote segments (the
    /// index rebuild reads those below its local log), the store must hold each of them,
    /// except those retention trimmed after the snapshot was taken (at or below the store's
    /// trim marker, whose objects may be gone). Anything else missing means this node reads
    /// another store than its peers.
    fn check_remote_segments(&self, snapshot_dir: &Path) -> Result<()> {
        let manifest = Manifest::load(snapshot_dir)?;
        let Some(first) = manifest.segments.first() else { return Ok(()) };
        let store = self.tier.cache.store().ok_or_else(|| {
            Error::Unavailable(
                "the snapshot's data is partly in tiered storage and this node has no --tiered-store".into(),
            )
        })?;
        let trimmed_to = futures::executor::block_on(store.trimmed_to(crate::tier::prefix_of(&first.object)))?;
        for segment in manifest.segments.iter().filter(|s| s.next_offset > trimmed_to) {
            if !futures::executor::block_on(store.exists(&segment.object))? {
                return Err(Error::Unavailable(format!(
                    "the tiered store {} lacks {} (offsets {}..{}), which the snapshot names and retention did not trim (trimmed to {trimmed_to}); is --tiered-store the directory the other nodes use?",
                    store.location(),
                    segment.object,
                    segment.base_offset,
                    segment.next_offset
                )));
            }
        }
        Ok(())
    }

    /// The offset after the last applied record.
    pub fn high_watermark(&self) -> Offset {
        self.high_watermark.load(Ordering::Acquire)
    }

    /// Runs `read`, which takes this replica's locks and is called from async code
    /// (lookups, fetches, describe, metrics): inline, unless a snapshot install holds the
    /// locks, then on a thread of its own ([`crate::tier::blocking`]). Waiting inline would
    /// stop the worker thread, and with one worker every group of the node, heartbeats
    /// included, for as long as the install rebuilds the index.
    fn unless_installing<T>(&self, read: impl FnOnce() -> T) -> T {
        if self.installing.load(Ordering::Acquire) { crate::tier::blocking(read) } else { read() }
    }

    /// The first offset still readable: in the object store when tiered storage holds
    /// segments older than the local log's start, else the local log's start.
    pub fn log_start_offset(&self) -> Offset {
        let local = self.unless_installing(|| self.log.read().map(|l| l.start_offset()).unwrap_or(0));
        self.logical_start(local)
    }

    /// The first readable offset over a local log starting at `local_start`: older remote
    /// segments count, and nothing below the last committed trim does (a replica whose
    /// segment straddles the trim keeps the segment but not its offsets below the trim).
    fn logical_start(&self, local_start: Offset) -> Offset {
        let manifest = self.manifest();
        let start = manifest.start_offset().filter(|s| *s < local_start).unwrap_or(local_start);
        start.max(manifest.trimmed_to)
    }

    fn manifest(&self) -> std::sync::RwLockReadGuard<'_, Manifest> {
        self.tier.manifest.read().unwrap_or_else(|p| p.into_inner())
    }

    /// A copy of the tiered-storage manifest.
    pub fn tier_manifest(&self) -> Manifest {
        self.manifest().clone()
    }

    /// The cache of remote segments (fetches go through it).
    pub fn tier_cache(&self) -> &TierCache {
        &self.tier.cache
    }

    pub fn size_bytes(&self) -> u64 {
        self.unless_installing(|| self.log.read().map(|l| l.size_bytes()).unwrap_or(0))
    }

    /// [`Partition::size_bytes`] plus the tiered segments older than the local log.
    pub fn total_size_bytes(&self) -> u64 {
        let (local_start, local_bytes) =
            self.unless_installing(|| self.log.read().map(|l| (l.start_offset(), l.size_bytes())).unwrap_or((0, 0)));
        let remote: u64 =
            self.manifest().segments.iter().filter(|s| s.next_offset <= local_start).map(|s| s.size_bytes).sum();
        local_bytes + remote
    }

    /// Applies committed produce batches (in log order) and records `state` as
    /// applied. A batch the log refuses (over the size limit, say) is skipped
    /// the same way on every replica and answered with the reason; an I/O
    /// failure is an error (the log is poisoned, the node must restart).
    pub fn apply_batches(
        &self,
        batches: &mut [Vec<u8>],
        state: &AppliedState,
        now_ms: u64,
    ) -> Result<Vec<std::result::Result<Appended, String>>> {
        // Test builds with the `failpoints` feature (`return`): the error of a segment log
        // write on a full disk, before anything of these batches is written.
        fail::fail_point!("partition::apply_io_error", |_| Err(Error::Io(std::io::Error::new(
            std::io::ErrorKind::StorageFull,
            "No space left on device (failpoint partition::apply_io_error)"
        ))));
        let mut results = Vec::with_capacity(batches.len());
        let mut records_per_batch = Vec::with_capacity(batches.len());
        let next_offset = {
            let mut log = self.log.write().map_err(|_| Error::Corrupted("segment log lock poisoned".into()))?;
            for batch in batches.iter_mut() {
                let info = match log.append(batch, now_ms) {
                    Ok(info) => info,
                    Err(e @ (logdex_log::Error::Io { .. } | logdex_log::Error::Poisoned)) => return Err(e.into()),
                    Err(e) => {
                        results.push(Err(e.to_string()));
                        continue;
                    }
                };
                results.push(Ok(Appended {
                    base_offset: info.base_offset,
                    last_offset: info.last_offset,
                    timestamp_ms: info.max_timestamp_ms,
                }));
                records_per_batch.push(logdex_log::decode_batch(batch)?);
            }
            log.next_offset()
        };
        // One update per key, the last in offset order: a batch may write a key twice.
        let mut last: HashMap<&[u8], Update<'_>> = HashMap::new();
        for (offset, record) in records_per_batch.iter().flatten() {
            let Some(key) = record.key.as_deref() else { continue };
            let update = match record.value {
                Some(_) => Update::Put { key, offset: *offset },
                None => Update::Delete { key },
            };
            last.insert(key, update);
        }
        let updates: Vec<Update<'_>> = last.into_values().collect();
        let marker = AppliedMarker { state: state.encode(), next_offset };
        // Crash point (test builds with the `failpoints` feature; nothing otherwise): the
        // batches are in the segment log, but the index holds neither their keys nor the
        // applied marker, and the high watermark does not cover them yet.
        fail::fail_point!("partition::after_segment_append");
        // The keys and the high watermark that covers them become visible together: a reader
        // that sees the new high watermark (a `min_offset` read waits for it) finds every key
        // of these batches, and no lookup answers an offset the high watermark does not cover.
        let visible = self.visibility.write().map_err(|_| Error::Corrupted("visibility lock poisoned".into()))?;
        self.index.apply(self.replica, &updates, &marker)?;
        self.high_watermark.store(next_offset, Ordering::Release);
        drop(visible);
        drop(updates);
        // The keys just written are the likeliest to be looked up next.
        for (offset, record) in records_per_batch.into_iter().flatten() {
            if record.key.is_some() && record.value.is_some() {
                self.records.insert(self.replica, offset, Arc::new(record));
            }
        }
        Ok(results)
    }

    /// Records `state` as applied without new records (blank and membership entries).
    pub fn apply_marker(&self, state: &AppliedState) -> Result<()> {
        let marker = AppliedMarker { state: state.encode(), next_offset: self.high_watermark() };
        self.index.set_applied(self.replica, &marker)?;
        Ok(())
    }

    /// Makes everything applied so far survive power loss and records the point
    /// recovery may roll back to.
    pub fn checkpoint(&self) -> Result<()> {
        self.checkpoint_at().map(|_| ())
    }

    /// [`Partition::checkpoint`]; returns the offset the checkpoint now records, `None` when
    /// none was written (nothing applied yet, or more was applied while it synced).
    fn checkpoint_at(&self) -> Result<Option<Offset>> {
        let _one_at_a_time = self.checkpointing.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let next_offset = {
            let mut log = self.log.write().map_err(|_| Error::Corrupted("segment log lock poisoned".into()))?;
            log.sync()?;
            log.next_offset()
        };
        self.index.persist_group(self.replica)?;
        // Test builds with LOGDEX_FSYNC_TRACE: the journals of this replica's index shard and
        // its segments.
        crate::fsync_trace::durable(&[self.index.shard_dir(self.replica), &self.dir.join("log")]);
        let Some(marker) = self.index.applied(self.replica)? else {
            return Ok(None);
        };
        if marker.next_offset > next_offset {
            // Applied more while we synced; the next checkpoint covers it.
            return Ok(None);
        }
        let checkpoint = Checkpoint { state: marker.state, next_offset: marker.next_offset };
        write_file_durably(&self.dir, CHECKPOINT_FILE, &serde_json::to_vec(&checkpoint).unwrap_or_default())?;
        let until = self.reapply_until.load(Ordering::Acquire);
        if until > 0 && checkpoint.next_offset >= until {
            // Durably past the index's old applied point: the index and the log agree again.
            remove_file_durably(&self.dir, REAPPLY_FILE)?;
            self.reapply_until.store(0, Ordering::Release);
            tracing::info!(
                group = self.group,
                replica = self.replica,
                next_offset = until,
                "re-applied past the index's old applied point"
            );
        }
        Ok(Some(checkpoint.next_offset))
    }

    /// The live record for `key`, as of this replica's applied state.
    /// Unavailable while the index is ahead of the log (see `reapply.json`);
    /// [`Error::CorruptData`] or a segment log `Corrupt` error when the record
    /// the index points at is damaged, missing or under another key.
    pub fn read_key(&self, key: &[u8]) -> Result<KeyRead> {
        self.read_key_at(key).map(|(read, _)| read)
    }

    /// [`Partition::read_key`], with the high watermark the answer is consistent with: every
    /// write below it is reflected, and an answer's offset is below it.
    pub fn read_key_at(&self, key: &[u8]) -> Result<(KeyRead, Offset)> {
        self.unless_installing(|| self.read_key_locked(key))
    }

    fn read_key_locked(&self, key: &[u8]) -> Result<(KeyRead, Offset)> {
        let (lookup, hw) = {
            let _visible = self.visibility.read().map_err(|_| Error::Corrupted("visibility lock poisoned".into()))?;
            let hw = self.high_watermark();
            let until = self.reapply_until.load(Ordering::Acquire);
            if hw < until {
                return Err(Error::Unavailable(format!(
                    "group {}: re-applying entries after the segment log lost its tail (offset {hw} of {until}); lookups wait until then",
                    self.group
                )));
            }
            (self.index.get(self.replica, key)?, hw)
        };
        self.read_found(key, lookup).map(|read| (read, hw))
    }

    fn read_found(&self, key: &[u8], lookup: Lookup) -> Result<KeyRead> {
        match lookup {
            Lookup::NotFound => Ok(KeyRead::NotFound),
            // Below the index's cleanup watermark: forgotten (`TierCommand` `forget_to`), as
            // on a replica whose index compaction already dropped the entry.
            Lookup::Evicted(_) => Ok(KeyRead::NotFound),
            // Below the last trim, even where a segment straddling it still holds the record.
            Lookup::Found(offset) if offset < self.manifest().trimmed_to => Ok(KeyRead::Evicted { offset }),
            Lookup::Found(offset) => {
                let log = self.log.read().map_err(|_| Error::Corrupted("segment log lock poisoned".into()))?;
                // `fill`: the record came from the segment log, and the cache may keep it.
                let (found, fill) = if offset < log.start_offset() {
                    drop(log);
                    let Some(remote) = self.remote_log_for(offset)? else {
                        return Ok(KeyRead::Evicted { offset });
                    };
                    (remote.read_record(offset)?, false)
                } else if let Some(record) = self.records.get(self.replica, offset) {
                    // Still in the log (checked above under its lock): the same record as there.
                    drop(log);
                    (Some((offset, Record::clone(&record))), false)
                } else {
                    let found = log.read_record(offset)?;
                    drop(log);
                    (found, true)
                };
                match found {
                    Some((found, record)) if found == offset && record.key.as_deref() == Some(key) => {
                        if fill {
                            self.records.insert(self.replica, offset, Arc::new(record.clone()));
                        }
                        Ok(KeyRead::Found { offset, record })
                    }
                    Some(_) => Err(Error::CorruptData {
                        group: self.group,
                        detail: format!("the index points the key at offset {offset}, whose record has another key"),
                    }),
                    None => Err(Error::CorruptData {
                        group: self.group,
                        detail: format!(
                            "the index points the key at offset {offset}, which the segment log does not hold"
                        ),
                    }),
                }
            }
        }
    }

    /// The cached remote segment covering `offset`: `None` when no remote segment covers
    /// it, [`Error::TierMiss`] when one does but is not cached yet.
    fn remote_log_for(&self, offset: Offset) -> Result<Option<Arc<Log>>> {
        let Some(segment) = self.manifest().segment_from(offset).filter(|s| s.covers(offset)).cloned() else {
            return Ok(None);
        };
        match self.tier.cache.get(&segment) {
            Some(log) => Ok(Some(log)),
            None => Err(Error::TierMiss { group: self.group, segments: vec![segment] }),
        }
    }

    /// Records from `offset`, never beyond the high watermark.
    /// Below the local log's start they come from tiered storage ([`Error::TierMiss`] when
    /// the remote segment is not cached yet), one remote segment per answer.
    pub fn read_records(&self, offset: Offset, max_records: usize, max_bytes: usize) -> Result<Vec<(Offset, Record)>> {
        self.unless_installing(|| self.read_records_locked(offset, max_records, max_bytes))
    }

    fn read_records_locked(
        &self,
        offset: Offset,
        max_records: usize,
        max_bytes: usize,
    ) -> Result<Vec<(Offset, Record)>> {
        let hw = self.high_watermark();
        let mut offset = offset;
        // Local retention may move the local start while the remote segments are read: then
        // the offsets between are read from the remote segments on the next round.
        for _ in 0..READ_ROUNDS_MAX {
            let log = self.log.read().map_err(|_| Error::Corrupted("segment log lock poisoned".into()))?;
            let local_start = log.start_offset();
            // Below the log start (retention moved it) the fetch starts at the first
            // readable record, which the answer's offsets make visible.
            offset = offset.max(self.logical_start(local_start));
            if offset >= local_start || offset >= hw {
                return Self::read_local(&log, offset, hw, max_records, max_bytes);
            }
            drop(log);
            // Remote segments in order from `offset`; a gap retention left is skipped.
            while offset < local_start {
                let Some(segment) = self.manifest().segment_from(offset).cloned() else { break };
                if segment.base_offset >= local_start {
                    break;
                }
                offset = offset.max(segment.base_offset);
                let remote = self
                    .tier
                    .cache
                    .get(&segment)
                    .ok_or_else(|| Error::TierMiss { group: self.group, segments: vec![segment.clone()] })?;
                let mut records = remote.read_records(offset, max_records, max_bytes)?;
                records.retain(|(o, _)| *o < hw && *o < segment.next_offset);
                if !records.is_empty() {
                    return Ok(records);
                }
                offset = segment.next_offset;
            }
            offset = offset.max(local_start);
        }
        Err(Error::Unavailable(format!("group {}: the log kept moving while it was read; retry", self.group)))
    }

    fn read_local(
        log: &Log,
        offset: Offset,
        hw: Offset,
        max_records: usize,
        max_bytes: usize,
    ) -> Result<Vec<(Offset, Record)>> {
        if offset >= hw {
            return Ok(Vec::new());
        }
        let mut records = log.read_records(offset, max_records, max_bytes)?;
        records.retain(|(o, _)| *o < hw);
        Ok(records)
    }

    /// Applies a committed tiered-storage command: records a copied segment, trims
    /// segments past retention (local and remote; their cached copies go), or forgets the
    /// index entries below an earlier trim (the index's cleanup watermark follows). The
    /// manifest is saved before it changes here, so an applied command survives a crash.
    pub fn apply_tier(&self, command: &pb::TierCommand, log_index: u64) -> Result<()> {
        let mut manifest =
            self.tier.manifest.write().map_err(|_| Error::Corrupted("tier manifest lock poisoned".into()))?;
        match &command.kind {
            Some(pb::tier_command::Kind::Add(segment)) => {
                let mut next = manifest.clone();
                if next.add(RemoteSegment::from_pb(segment)) {
                    next.save(&self.dir)?;
                    *manifest = next;
                }
            }
            Some(pb::tier_command::Kind::TrimTo(to)) => {
                let mut next = manifest.clone();
                next.trim(*to, log_index, command.at_ms);
                if next != *manifest {
                    next.save(&self.dir)?;
                    *manifest = next;
                }
                drop(manifest);
                // Also when re-applied after a crash (nothing left to trim): the local
                // segments, the cache and the watermark follow.
                self.log
                    .write()
                    .map_err(|_| Error::Corrupted("segment log lock poisoned".into()))?
                    .delete_before(*to)?;
                self.tier.cache.forget_below(*to)?;
            }
            Some(pb::tier_command::Kind::ForgetTo(to)) => {
                let mut next = manifest.clone();
                next.forget(*to);
                if next != *manifest {
                    next.save(&self.dir)?;
                    *manifest = next;
                }
                let forgotten_to = manifest.forgotten_to;
                drop(manifest);
                // Also when re-applied after a crash: the watermark follows the manifest.
                if forgotten_to > 0 {
                    self.index.set_watermark(self.replica, forgotten_to)?;
                }
            }
            None => {}
        }
        Ok(())
    }

    /// Sealed local segments the manifest does not reach yet, oldest first: what the
    /// leader copies next. Only offsets below the high watermark (all applied, so all
    /// committed).
    /// Segments ending at or before the last trim are never copied: they are past retention,
    /// and the leader's collection of trimmed objects could delete such a copy before its
    /// `add` commits.
    pub fn tier_candidates(&self) -> Vec<logdex_log::SegmentInfo> {
        let (end, trimmed_to) = {
            let manifest = self.manifest();
            (manifest.end_offset(), manifest.trimmed_to)
        };
        let hw = self.high_watermark();
        self.unless_installing(|| {
            let Ok(log) = self.log.read() else { return Vec::new() };
            log.segments()
                .into_iter()
                .filter(|s| s.sealed && s.size_bytes > 0 && s.next_offset <= hw)
                .filter(|s| s.next_offset > trimmed_to && end.is_none_or(|e| s.next_offset > e))
                .collect()
        })
    }

    /// Local retention of a tiered topic: deletes local sealed segments, oldest first, that
    /// remote segments cover whole, while the oldest is older than `local_ms` (by its newest
    /// record) or the local log without it still holds `local_bytes`. Returns how many went.
    ///
    /// A checkpoint is taken first, so the recovery point stays inside the local log.
    pub fn apply_local_retention(&self, now_ms: u64, local_ms: Option<u64>, local_bytes: Option<u64>) -> Result<usize> {
        let manifest = self.manifest().clone();
        let now = i64::try_from(now_ms).unwrap_or(i64::MAX);
        // Whether the oldest local segment may go: sealed, covered whole by remote
        // segments, and past the local limits.
        let due = |log: &Log| {
            let segments = log.segments();
            segments.first().filter(|s| s.sealed && segments.len() > 1).is_some_and(|first| {
                let too_old = local_ms.is_some_and(|ms| now.saturating_sub(first.max_timestamp_ms) > ms as i64);
                let too_big = local_bytes.is_some_and(|limit| log.size_bytes() - first.size_bytes >= limit);
                manifest.covers_range(first.base_offset, first.next_offset) && (too_old || too_big)
            })
        };
        if !due(&*self.log.read().map_err(|_| Error::Corrupted("segment log lock poisoned".into()))?) {
            return Ok(0);
        }
        // The recovery point must stay inside the local log: only segments ending at or
        // before a durable checkpoint may go.
        // Under steady writes the new checkpoint may be skipped (more was applied while it
        // synced): the last one written is a recovery point too.
        let durable = match self.checkpoint_at()? {
            Some(offset) => offset,
            None => read_json::<Checkpoint>(&self.dir.join(CHECKPOINT_FILE))?.map_or(0, |c| c.next_offset),
        };
        let mut log = self.log.write().map_err(|_| Error::Corrupted("segment log lock poisoned".into()))?;
        let mut deleted = 0;
        while due(&log) && log.segments().first().is_some_and(|s| s.next_offset <= durable) {
            log.delete_oldest_sealed()?;
            deleted += 1;
        }
        Ok(deleted)
    }

    /// Applies a topic config change to the segment log (segment size and age, retention)
    /// and to the batch size writes may propose.
    pub fn set_log_config(&self, config: LogConfig) -> Result<()> {
        self.batch_bytes_max.store(config.batch_bytes_max, Ordering::Relaxed);
        self.compression.store(config.compression.id(), Ordering::Relaxed);
        let config = apply_config(config);
        let mut log = self.log.write().map_err(|_| Error::Corrupted("segment log lock poisoned".into()))?;
        if *log.config() != config {
            log.set_config(config)?;
        }
        Ok(())
    }

    /// The codec of the batches writes propose (the topic's `compression.type`).
    pub fn compression(&self) -> logdex_log::Compression {
        logdex_log::Compression::from_id(self.compression.load(Ordering::Relaxed))
            .unwrap_or(logdex_log::Compression::None)
    }

    /// Refuses a batch of `bytes` larger than the topic's `max.message.bytes`.
    pub fn admit_batch(&self, bytes: usize) -> Result<()> {
        let limit = self.batch_bytes_max.load(Ordering::Relaxed);
        if bytes > limit as usize {
            return Err(Error::TooLarge(format!(
                "record batch of {bytes} bytes exceeds the limit of {limit} bytes (the topic's \
                 max.message.bytes, or a batch's {}-byte header when that is smaller)",
                logdex_log::BATCH_HEADER_BYTES
            )));
        }
        Ok(())
    }

    /// Compacts sealed segments: a keyed record goes when a newer record of its key is in
    /// the segments compacted (as Kafka's cleaner decides: a record newer than those, in the
    /// active segment, does not count); tombstones stay until `tombstone_horizon_ms`.
    /// Offsets are preserved, and every lookup answer is unchanged.
    ///
    /// The answer depends on the segments only, not on what was applied when the pass ran,
    /// so replicas with the same segments compact them alike whenever each runs its pass.
    /// (Counting every newer record, as an earlier version did by asking the index alone,
    /// left a replica whose pass ran before a write with a record the others removed, until
    /// its next pass, which a partition that is not written to never runs.) The index
    /// answers for most keys: one whose newest record is in the segments compacted is
    /// decided by it. For the others, whose newest record lies beyond those segments or is a
    /// tombstone (the index holds no entry then), a first read of the segments finds the
    /// newest record within them. Both reads ask one view of the index, so a write applied
    /// meanwhile changes nothing.
    ///
    /// The log is held only to take the plan (read lock) and to install the
    /// rewritten segments (write lock, one segment per hold); applies, lookups and fetches go
    /// on while the segments are read and rewritten.
    pub fn compact(&self, tombstone_horizon_ms: i64) -> Result<logdex_log::CompactStats> {
        let _one_at_a_time = self.compacting.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        if self.high_watermark() < self.reapply_until.load(Ordering::Acquire) {
            // The index is ahead of the log: it cannot say yet which records are live.
            return Ok(logdex_log::CompactStats::default());
        }
        let plan = {
            let log = self.log.read().map_err(|_| Error::Corrupted("segment log lock poisoned".into()))?;
            // Only what the index covers: an apply appends (and may seal a segment) before it
            // indexes the keys and then moves the high watermark, and no append runs while the
            // log is held. A record whose key is not indexed yet would look dead.
            log.compaction_plan(self.high_watermark())?
        };
        let view = self.index.view(self.replica);
        let end = plan.end_offset();
        // Keys the index cannot decide (their newest record is past the plan's segments, or a
        // tombstone), with their newest offset within the plan.
        let mut newest_in_plan: HashMap<Vec<u8>, Offset> = HashMap::new();
        plan.for_each_keyed_record(&mut |key, offset| {
            let undecided = match view.get(key) {
                Ok(Lookup::Found(o) | Lookup::Evicted(o)) => o >= end,
                Ok(Lookup::NotFound) => true,
                Err(_) => false,
            };
            if !undecided {
                return;
            }
            if let Some(newest) = newest_in_plan.get_mut(key) {
                *newest = offset;
            } else if newest_in_plan.len() < UNDECIDED_KEYS_MAX {
                newest_in_plan.insert(key.to_vec(), offset);
            }
        })?;
        // An index error keeps the record, as does an undecided key past the map's bound:
        // compaction may only ever keep too much.
        let mut live = |key: &[u8], offset: Offset| match view.get(key) {
            Ok(Lookup::Found(o) | Lookup::Evicted(o)) if o < end => o == offset,
            Ok(_) => newest_in_plan.get(key).is_none_or(|newest| *newest == offset),
            Err(_) => true,
        };
        let compacted = plan.rewrite(&mut live, tombstone_horizon_ms);
        // One segment per hold of the log: an install is two renames and a directory fsync,
        // and appends wait for it.
        let mut stats = logdex_log::CompactStats::default();
        for part in compacted.into_parts() {
            let mut log = self.log.write().map_err(|_| Error::Corrupted("segment log lock poisoned".into()))?;
            stats += log.finish_compaction(part)?;
        }
        self.counters.compactions.fetch_add(1, Ordering::Relaxed);
        self.counters.records_compacted.fetch_add(stats.records_removed, Ordering::Relaxed);
        Ok(stats)
    }

    /// The log start offset retention (`retention.ms`, `retention.bytes`) would leave on
    /// this replica now, when it is past the last committed trim: what the leader proposes
    /// as a trim (`TierCommand` `trim_to`), which every replica applies alike
    /// ([`Partition::apply_tier`]).
    pub fn retention_cut(&self, now_ms: u64) -> Result<Option<Offset>> {
        let cut =
            self.log.read().map_err(|_| Error::Corrupted("segment log lock poisoned".into()))?.retention_cut(now_ms);
        Ok((cut > self.manifest().trimmed_to).then_some(cut))
    }

    /// Reads sealed segments not checked yet, oldest first, up to about `budget_bytes`, and
    /// checks every batch (bit rot found before a read or a snapshot meets it). The log is
    /// not held while reading: sealed files are never modified in place. Returns the bytes
    /// read; [`Error::CorruptData`] naming file and position when it finds a damaged segment
    /// (once: later passes skip it, and [`Partition::is_damaged`] stays true).
    pub fn scrub(&self, budget_bytes: u64) -> Result<u64> {
        let sealed: Vec<logdex_log::SegmentInfo> = {
            let log = self.log.read().map_err(|_| Error::Corrupted("segment log lock poisoned".into()))?;
            log.segments().into_iter().filter(|s| s.sealed && s.size_bytes > 0).collect()
        };
        let mut read = 0;
        for segment in sealed {
            let key = (segment.base_offset, segment.size_bytes);
            let known = self.scrubbed.lock().unwrap_or_else(std::sync::PoisonError::into_inner).get(&key).copied();
            if known.is_some() {
                continue;
            }
            if read >= budget_bytes {
                break;
            }
            match Log::verify_segment(&segment) {
                Ok(_) => {
                    read += segment.size_bytes;
                    self.counters.bytes_scrubbed.fetch_add(segment.size_bytes, Ordering::Relaxed);
                    self.scrubbed.lock().unwrap_or_else(std::sync::PoisonError::into_inner).insert(key, false);
                }
                // Deleted by retention or replaced by compaction since it was listed.
                Err(e) if e.is_not_found() => {}
                Err(e) if e.is_corruption() => {
                    self.counters.damaged_segments.fetch_add(1, Ordering::Relaxed);
                    self.scrubbed.lock().unwrap_or_else(std::sync::PoisonError::into_inner).insert(key, true);
                    return Err(damaged_segment(self.group, &segment, &e.to_string()));
                }
                Err(e) => return Err(e.into()),
            }
        }
        Ok(read)
    }

    /// Whether the scrub found a damaged sealed segment that the log still holds the same
    /// (compaction can replace it; retention can delete it).
    pub fn is_damaged(&self) -> bool {
        let damaged: Vec<(Offset, u64)> = self
            .scrubbed
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .iter()
            .filter(|(_, damaged)| **damaged)
            .map(|(key, _)| *key)
            .collect();
        if damaged.is_empty() {
            return false;
        }
        let Ok(log) = self.log.read() else { return true };
        log.segments().iter().any(|s| damaged.contains(&(s.base_offset, s.size_bytes)))
    }

    /// One scrub pass over a node's replicas that share `budget_bytes`: each in turn reads
    /// what it has not checked yet, until the budget is spent. The next pass goes on where
    /// this one stopped (checked segments are remembered), so a node hosting many replicas
    /// reads at most about the budget per pass, not the budget per replica. One outcome per
    /// replica, in order; a replica past the spent budget answers `Ok(0)` unread.
    pub fn scrub_each(replicas: &[Arc<Partition>], budget_bytes: u64) -> Vec<Result<u64>> {
        let mut left = budget_bytes;
        replicas
            .iter()
            .map(|p| {
                if left == 0 {
                    return Ok(0);
                }
                let outcome = p.scrub(left);
                if let Ok(read) = &outcome {
                    left = left.saturating_sub(*read);
                }
                outcome
            })
            .collect()
    }

    /// Number of segment files.
    pub fn segment_count(&self) -> usize {
        self.unless_installing(|| self.log.read().map(|l| l.segments().len()).unwrap_or(0))
    }

    /// Keys written to this replica's index minus keys deleted: an upper bound of its live
    /// keys, since an overwrite (or a re-apply after a crash) counts again.
    pub fn index_keys(&self) -> u64 {
        self.index.key_count_estimate(self.replica).unwrap_or(0)
    }

    /// Sealed segment count and bytes, to decide whether compaction has new work.
    pub fn sealed_bytes(&self) -> u64 {
        self.unless_installing(|| {
            self.log.read().map(|l| l.segments().iter().filter(|s| s.sealed).map(|s| s.size_bytes).sum()).unwrap_or(0)
        })
    }

    /// Removes this replica's files and index entries (the replica left this node).
    pub fn destroy(self) -> Result<()> {
        self.index.drop_group(self.replica)?;
        let dir = self.dir.clone();
        drop(self);
        std::fs::remove_dir_all(&dir)?;
        Ok(())
    }
}

fn read_install_intent(dir: &Path) -> Result<Option<PathBuf>> {
    match std::fs::read(dir.join(INSTALL_FILE)) {
        Ok(bytes) => serde_json::from_slice(&bytes)
            .map(Some)
            .map_err(|e| Error::Corrupted(format!("{}: {e}", dir.join(INSTALL_FILE).display()))),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(e.into()),
    }
}

/// Installs the segment files of `snapshot_dir`, rebuilds the index from them,
/// records a checkpoint and clears the install intent. Idempotent.
fn install_files(
    replica: ReplicaId,
    dir: &Path,
    log_config: &LogConfig,
    index: &Index,
    snapshot_dir: &Path,
    cache: &TierCache,
) -> Result<(Log, AppliedState, Manifest)> {
    let bytes = std::fs::read(snapshot_dir.join(SNAPSHOT_STATE_FILE))?;
    let snapshot: Checkpoint = serde_json::from_slice(&bytes)
        .map_err(|e| Error::Corrupted(format!("snapshot state in {}: {e}", snapshot_dir.display())))?;
    let log = Log::install(&dir.join("log"), &snapshot_dir.join("log"), log_config.clone())?;
    // Crash point (test builds with the `failpoints` feature; nothing otherwise): the
    // snapshot's segments replaced the log, the index still holds the old replica's keys and
    // marker, no checkpoint yet; `installing.json` makes the next open finish the install.
    fail::fail_point!("partition::install_snapshot");
    if log.next_offset() != snapshot.next_offset {
        return Err(Error::Corrupted(format!(
            "snapshot in {} ends at offset {} but its state says {}",
            snapshot_dir.display(),
            log.next_offset(),
            snapshot.next_offset
        )));
    }
    // The snapshot's manifest replaces this replica's (a snapshot without one: no remote
    // segments), before the index is rebuilt from the remote and the local segments.
    let manifest = Manifest::load(snapshot_dir)?;
    manifest.save(dir)?;
    let marker = AppliedMarker { state: snapshot.state.clone(), next_offset: snapshot.next_offset };
    // The removed keys first: their offsets are below every record the segments hold, and no
    // key is among both (its index entry would point at the newer record).
    let removed = read_removed_keys(snapshot_dir)?.into_iter().map(|(key, offset)| Ok((key, offset, false)));
    let keys = index.rebuild(replica, removed.chain(keyed_records(&log, &manifest, cache)), &marker)??;
    index.persist_group(replica)?;
    write_file_durably(dir, CHECKPOINT_FILE, &bytes)?;
    remove_file_durably(dir, REAPPLY_FILE)?;
    match std::fs::remove_file(dir.join(INSTALL_FILE)) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(e.into()),
    }
    tracing::info!(replica, keys, next_offset = snapshot.next_offset, "snapshot installed; index rebuilt from the log");
    Ok((log, AppliedState::decode(&snapshot.state)?, manifest))
}

/// Writes [`REMOVED_KEYS_FILE`] into `staged`: the replica's index entries at or above the
/// manifest's forget and below its trim, durably. Returns how many.
fn write_removed_keys(index: &Index, replica: ReplicaId, manifest: &Manifest, staged: &Path) -> Result<u64> {
    use std::io::Write;
    struct Out {
        file: std::io::BufWriter<std::fs::File>,
        crc: u32,
    }
    impl Out {
        fn put(&mut self, bytes: &[u8]) -> std::io::Result<()> {
            self.crc = crc32c::crc32c_append(self.crc, bytes);
            self.file.write_all(bytes)
        }
    }
    let mut out = Out { file: std::io::BufWriter::new(std::fs::File::create(staged.join(REMOVED_KEYS_FILE))?), crc: 0 };
    out.put(&[REMOVED_KEYS_VERSION])?;
    let range = manifest.forgotten_to..manifest.trimmed_to;
    // The scan reads every entry of the replica: only when a trim left something to carry.
    let count = if range.is_empty() {
        0
    } else {
        index.scan_entries(replica, range, |key, offset| -> Result<()> {
            let len =
                u32::try_from(key.len()).map_err(|_| Error::Corrupted(format!("index key of {} bytes", key.len())))?;
            out.put(&len.to_be_bytes())?;
            out.put(key)?;
            out.put(&offset.to_be_bytes())?;
            Ok(())
        })?
    };
    let crc = out.crc;
    out.file.write_all(&crc.to_be_bytes())?;
    out.file.into_inner().map_err(std::io::IntoInnerError::into_error)?.sync_all()?;
    Ok(count)
}

/// The entries of a snapshot's [`REMOVED_KEYS_FILE`] (none when it has no such file: a
/// snapshot of an older node); an error when the file is damaged.
fn read_removed_keys(snapshot_dir: &Path) -> Result<Vec<(Vec<u8>, Offset)>> {
    let path = snapshot_dir.join(REMOVED_KEYS_FILE);
    let bytes = match std::fs::read(&path) {
        Ok(bytes) => bytes,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(e.into()),
    };
    let corrupt = |what: &str| Error::Corrupted(format!("{}: {what}", path.display()));
    let Some((body, trailer)) = bytes.split_last_chunk::<4>() else {
        return Err(corrupt("shorter than its checksum"));
    };
    if crc32c::crc32c(body) != u32::from_be_bytes(*trailer) {
        return Err(corrupt("checksum mismatch"));
    }
    let Some((&version, mut rest)) = body.split_first() else {
        return Err(corrupt("no version byte"));
    };
    if version != REMOVED_KEYS_VERSION {
        return Err(corrupt(&format!("version {version} (this build reads {REMOVED_KEYS_VERSION})")));
    }
    let mut entries = Vec::new();
    while !rest.is_empty() {
        let (len, after) = rest.split_first_chunk::<4>().ok_or_else(|| corrupt("truncated key length"))?;
        let len = u32::from_be_bytes(*len) as usize;
        if after.len() < len + 8 {
            return Err(corrupt("truncated entry"));
        }
        let (key, after) = after.split_at(len);
        let (offset, after) = after.split_first_chunk::<8>().ok_or_else(|| corrupt("truncated offset"))?;
        entries.push((key.to_vec(), u64::from_be_bytes(*offset)));
        rest = after;
    }
    Ok(entries)
}

/// The latest point whose applied state is known that the log still holds:
/// the last checkpoint, else the current snapshot (the active segment always
/// starts at or after it, and the Raft log is never purged past it), else the
/// start (the Raft log is whole when no snapshot was ever taken; otherwise
/// openraft restores the snapshot first).
fn recovery_point(group: GroupId, replica: ReplicaId, dir: &Path, log: &Log) -> Result<Checkpoint> {
    let (start, end) = (log.start_offset(), log.next_offset());
    let usable = |c: &Checkpoint| (start..=end).contains(&c.next_offset);
    if let Some(c) = read_json::<Checkpoint>(&dir.join(CHECKPOINT_FILE))?.filter(usable) {
        tracing::info!(group, replica, next_offset = c.next_offset, "rolling back to the last checkpoint");
        return Ok(c);
    }
    let snapshot = crate::snapshot::SnapshotStore::open_existing(dir.join("snapshots")).current()?;
    if let Some((_, files)) = snapshot
        && let Some(c) = read_json::<Checkpoint>(&files.dir.join(SNAPSHOT_STATE_FILE))?.filter(usable)
    {
        tracing::warn!(
            group,
            replica,
            next_offset = c.next_offset,
            "the log ends before the last checkpoint; rolling back to the last snapshot"
        );
        return Ok(c);
    }
    tracing::warn!(group, replica, "the log holds no durable point; re-applying from the start of the Raft log");
    Ok(Checkpoint { state: AppliedState::default().encode(), next_offset: 0 })
}

/// Cuts the log back to `next_offset` (empty at 0).
fn cut_log(log: &mut Log, next_offset: Offset) -> Result<()> {
    if next_offset == 0 {
        log.reset(0)?;
    } else {
        log.truncate(next_offset)?;
    }
    Ok(())
}

/// Rebuilds the replica's index from the whole log, with `point` as its applied marker.
fn rebuild_index(
    replica: ReplicaId,
    log: &Log,
    index: &Index,
    point: &Checkpoint,
    manifest: &Manifest,
    cache: &TierCache,
) -> Result<()> {
    let marker = AppliedMarker { state: point.state.clone(), next_offset: point.next_offset };
    index.rebuild(replica, keyed_records(log, manifest, cache), &marker)??;
    Ok(())
}

/// Every keyed record of the replica in offset order, as the index rebuild takes them: first
/// those only remote segments hold (below the local log's start; fetched when not cached,
/// blocking the thread), then the local log's. Records without a key are not indexed.
fn keyed_records<'a>(
    log: &'a Log,
    manifest: &Manifest,
    cache: &'a TierCache,
) -> impl Iterator<Item = Result<(Vec<u8>, Offset, bool)>> + 'a {
    let local_start = log.start_offset();
    let remote: Vec<RemoteSegment> =
        manifest.segments.iter().filter(|s| s.base_offset < local_start).cloned().collect();
    let mut segments = remote.into_iter();
    // The segment being read, where to read next in it and where it stops being needed.
    let mut current: Option<(Arc<Log>, Offset, Offset)> = None;
    // Offsets below this were yielded (overlapping segments hold some offsets twice).
    let mut yielded_until: Offset = 0;
    let mut buffered = std::collections::VecDeque::new();
    let mut failed = false;
    // The store's trim marker for this partition, read at the first missing object.
    let mut marker: Option<Offset> = None;
    let mut trimmed_to = move |segment: &RemoteSegment| -> Offset {
        *marker.get_or_insert_with(|| {
            cache
                .store()
                .and_then(|store| {
                    futures::executor::block_on(store.trimmed_to(crate::tier::prefix_of(&segment.object))).ok()
                })
                .unwrap_or(0)
        })
    };
    let remote_records = std::iter::from_fn(move || {
        loop {
            if failed {
                return None;
            }
            if let Some(item) = buffered.pop_front() {
                return Some(Ok(item));
            }
            if let Some((remote, next, end)) = &mut current {
                if *next < *end {
                    match remote.read_records(*next, 4096, 1 << 20) {
                        Ok(records) if !records.is_empty() => {
                            *next = records.last().map_or(*end, |(o, _)| o + 1);
                            let (from, end) = (yielded_until, *end);
                            buffered.extend(records.into_iter().filter(|(o, _)| (from..end).contains(o)));
                            yielded_until = yielded_until.max((*next).min(end));
                            continue;
                        }
                        Ok(_) => {}
                        Err(e) => {
                            failed = true;
                            return Some(Err(Error::from(e)));
                        }
                    }
                }
                current = None;
            }
            let Some(segment) = segments.next() else {
                failed = true;
                return None;
            };
            match cache.get_or_fetch_blocking(&segment) {
                Ok(remote) => {
                    let from = segment.base_offset.max(yielded_until);
                    current = Some((remote, from, segment.next_offset.min(local_start)));
                }
                Err(Error::NotFound(what)) if segment.next_offset <= trimmed_to(&segment) => {
                    // Retention trimmed this segment after the snapshot (or manifest) naming
                    // it was taken, and its object is gone: the trim entry that follows
                    // trims it here too.
                    tracing::warn!(
                        base_offset = segment.base_offset,
                        next_offset = segment.next_offset,
                        %what,
                        "skipping a remote segment whose object is gone (trimmed by retention)"
                    );
                }
                Err(e) => {
                    failed = true;
                    return Some(Err(e));
                }
            }
        }
    });
    let local = log.scan(local_start).map(|r| r.map_err(Error::from));
    remote_records.chain(local).filter_map(|r| match r {
        Ok((offset, record)) => {
            let tombstone = record.value.is_none();
            record.key.map(|key| Ok((key, offset, tombstone)))
        }
        Err(e) => Some(Err(e)),
    })
}

/// A JSON file, `None` when it does not exist.
fn read_json<T: serde::de::DeserializeOwned>(path: &Path) -> Result<Option<T>> {
    match std::fs::read(path) {
        Ok(bytes) => {
            serde_json::from_slice(&bytes).map(Some).map_err(|e| Error::Corrupted(format!("{}: {e}", path.display())))
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(e.into()),
    }
}

/// Removes `name` from `dir` if present, durably.
/// The segment log's config for applying committed entries: any batch size up to
/// the format's limit (the topic's own limit is checked before proposing; see
/// [`Partition::admit_batch`]).
fn apply_config(config: LogConfig) -> LogConfig {
    LogConfig { batch_bytes_max: i32::MAX as u32, ..config }
}

fn remove_file_durably(dir: &Path, name: &str) -> Result<()> {
    match std::fs::remove_file(dir.join(name)) {
        Ok(()) => Ok(std::fs::File::open(dir)?.sync_all()?),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(e.into()),
    }
}

/// Writes `name` in `dir` so that after a crash it holds either the old or the new bytes.
fn damaged_segment(group: GroupId, segment: &logdex_log::SegmentInfo, detail: &str) -> Error {
    Error::CorruptData { group, detail: format!("sealed segment {}: {detail}", segment.path.display()) }
}

/// Marks a snapshot install under way for as long as it lives.
struct Installing<'a>(&'a std::sync::atomic::AtomicBool);

impl<'a> Installing<'a> {
    fn start(flag: &'a std::sync::atomic::AtomicBool) -> Installing<'a> {
        flag.store(true, Ordering::Release);
        Installing(flag)
    }
}

impl Drop for Installing<'_> {
    fn drop(&mut self) {
        self.0.store(false, Ordering::Release);
    }
}

pub fn write_file_durably(dir: &Path, name: &str, bytes: &[u8]) -> Result<()> {
    use std::io::Write;
    let tmp = dir.join(format!("{name}.tmp"));
    let mut file = std::fs::File::create(&tmp)?;
    file.write_all(bytes)?;
    file.sync_data()?;
    std::fs::rename(&tmp, dir.join(name))?;
    std::fs::File::open(dir)?.sync_all()?;
    Ok(())
}
