//! `Index`: the public handle, open/load, writes, reads and persistence.

use crate::config::IndexConfig;
use crate::encoding::{
    DataKey, DataPrefix, FIRST_GENERATION, FORMAT_VERSION, Generation, GroupRecord, META_FORMAT_VERSION_KEY,
    META_GROUP_PREFIX, META_NEXT_GENERATION_KEY, NO_GENERATION, decode_applied, decode_group_meta_key, decode_offset,
    decode_u32, decode_u64, encode_applied, encode_offset, encode_u32, encode_u64, group_meta_key,
};
use crate::error::{Error, Result, fjall_err};
use crate::filter::GenerationFilterFactory;
use crate::groups::{GroupState, Registry};
use crate::layout;
use crate::maintenance::{Activity, Maintenance};
use crate::{AppliedMarker, GroupId, Lookup, Offset, Update};
use fjall::compaction::filter::Factory;
use fjall::{Database, Keyspace, KeyspaceCreateOptions, OwnedWriteBatch, PersistMode, Readable, Slice};
use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

pub(crate) const DATA_KEYSPACE: &str = "data";
pub(crate) const META_KEYSPACE: &str = "meta";
/// Meta records are small: a small memtable keeps them from pinning journals.
const META_MEMTABLE_BYTES: u64 = 8 * 1024 * 1024;

/// The key index of one node. Cheap to clone; `Send + Sync`: many threads may
/// call `get` while others write. Writes of one group are serialized
/// internally; the background maintenance threads stop when the last clone
/// is dropped.
///
/// Split by group into shards, one fjall database each (`layout.rs`): every
/// call about one group goes to its shard alone, so a group's entries and its
/// applied marker still commit in one batch.
#[derive(Clone)]
pub struct Index {
    inner: Arc<Inner>,
}

struct Inner {
    shards: Vec<Shard>,
}

/// One database of the index.
struct Shard {
    // Declared first so it drops first: the thread stops before the database closes.
    _maintenance: Maintenance,
    shared: Arc<Shared>,
}

/// State shared by the handles and the maintenance thread.
pub(crate) struct Shared {
    pub(crate) db: Database,
    pub(crate) data: Keyspace,
    pub(crate) meta: Keyspace,
    pub(crate) registry: Arc<Registry>,
    pub(crate) config: IndexConfig,
    pub(crate) activity: Activity,
    path: PathBuf,
    /// Next generation to hand out; held until the batch recording it commits,
    /// so the counter's writes commit in allocation order.
    next_generation: Mutex<Generation>,
    /// Serializes `persist` (one promotion at a time).
    persist_lock: Mutex<()>,
}

/// A generation handed out but not yet in a committed batch.
pub(crate) struct NewGeneration<'a> {
    _allocation: MutexGuard<'a, Generation>,
    pub(crate) generation: Generation,
}

impl Index {
    /// Opens (or creates) the index in directory `path`: its shards side by side,
    /// each on a thread of its own (each replays its journal).
    pub fn open(path: &Path, config: IndexConfig) -> Result<Index> {
        config.validate()?;
        let dirs = layout::open_or_create(path, config.shards)?;
        let shard_config = config.for_shard(dirs.len());
        let opened: Vec<Result<Shard>> = std::thread::scope(|scope| {
            let opening: Vec<_> =
                dirs.iter().map(|dir| (dir, scope.spawn(|| Shard::open(dir, shard_config.clone())))).collect();
            opening
                .into_iter()
                .map(|(dir, thread)| thread.join().unwrap_or_else(|_| Err(Error::OpenPanicked { path: dir.clone() })))
                .collect()
        });
        let shards = opened.into_iter().collect::<Result<Vec<_>>>()?;
        tracing::info!(
            path = %path.display(),
            shards = shards.len(),
            groups = shards.iter().map(|s| s.shared.registry.group_count()).sum::<usize>(),
            "index opened"
        );
        Ok(Index { inner: Arc::new(Inner { shards }) })
    }

    /// Writes `updates` and `marker` of `group` in one atomic batch.
    ///
    /// Later updates of the same key in `updates` win. Keys longer than
    /// `key_bytes_max` fail with `Error::KeyTooLong` before anything is written.
    /// Re-applying the same updates is idempotent. Buffered: survives a process
    /// kill; `persist` makes it survive power loss.
    pub fn apply(&self, group: GroupId, updates: &[Update<'_>], marker: &AppliedMarker) -> Result<()> {
        let shared = self.shard(group);
        shared.check_key_lengths(group, updates.iter().map(Update::key))?;
        shared.with_group_write(group, |state| {
            let mut batch = shared.db.batch();
            let new_generation = shared.prepare_group(group, state, &mut batch)?;
            let generation =
                new_generation.as_ref().map_or_else(|| state.live.load(Ordering::Acquire), |new| new.generation);
            let mut key_estimate = state.key_estimate.load(Ordering::Relaxed);
            let superseded = superseded_updates(updates);
            for (position, update) in updates.iter().enumerate() {
                if superseded.as_ref().and_then(|marks| marks.get(position)).copied().unwrap_or(false) {
                    continue;
                }
                let key = Slice::from(DataKey::new(group, generation, update.key()).as_ref());
                match update {
                    Update::Put { offset, .. } => {
                        batch.insert(&shared.data, key, encode_offset(*offset).as_ref());
                        key_estimate = key_estimate.saturating_add(1);
                    }
                    Update::Delete { .. } => {
                        batch.remove(&shared.data, key);
                        key_estimate = key_estimate.saturating_sub(1);
                    }
                }
            }
            batch.insert(
                &shared.meta,
                group_meta_key(group, GroupRecord::Applied),
                encode_applied(marker, key_estimate),
            );
            shared.commit("apply", group, state, batch, new_generation)?;
            state.key_estimate.store(key_estimate, Ordering::Relaxed);
            Ok(())
        })
    }

    /// Looks `key` up in `group`: one fjall point read.
    ///
    /// Reads the key's latest committed version. Point reads are not isolated
    /// from a batch being committed concurrently: the key's version from an
    /// `apply` that has not returned yet may already be visible (it is
    /// committed in fjall's journal). Read the group's high watermark after
    /// the lookup, not before, when the two must agree.
    pub fn get(&self, group: GroupId, key: &[u8]) -> Result<Lookup> {
        let shared = self.shard(group);
        shared.check_key_lengths(group, std::iter::once(key))?;
        shared.registry.with_group(group, |state| match state {
            None => Ok(Lookup::NotFound),
            Some(state) => shared.lookup(group, state, key, |data_key| shared.data.get(data_key)),
        })
    }

    /// A view of `group`'s entries as they are now: its lookups answer alike however long it
    /// is kept, whatever is applied meanwhile (a fjall snapshot, whole batches only). For a
    /// reader that must judge many keys against one state of the index.
    pub fn view(&self, group: GroupId) -> IndexView<'_> {
        let shared = self.shard(group);
        let state = shared.registry.get(group);
        // The generation first: a switch after it is seen at each lookup.
        let generation = state.as_ref().map_or(NO_GENERATION, |s| s.live.load(Ordering::Acquire));
        IndexView { shared, group, state, generation, snapshot: shared.db.snapshot() }
    }

    /// Looks several keys of `group` up in one consistent view (a fjall
    /// snapshot: whole batches only); answers in the order of `keys`.
    pub fn get_many(&self, group: GroupId, keys: &[&[u8]]) -> Result<Vec<Lookup>> {
        let shared = self.shard(group);
        shared.check_key_lengths(group, keys.iter().copied())?;
        let Some(state) = shared.registry.get(group) else {
            return Ok(vec![Lookup::NotFound; keys.len()]);
        };
        loop {
            let generation = state.live.load(Ordering::Acquire);
            let snapshot = shared.db.snapshot();
            let read = |data_key: &[u8]| snapshot.get(&shared.data, data_key);
            let lookups = keys.iter().map(|key| shared.lookup(group, &state, key, read)).collect::<Result<Vec<_>>>()?;
            // A generation switch in between: the snapshot may predate the new
            // generation, so read everything again.
            if state.live.load(Ordering::Acquire) == generation {
                return Ok(lookups);
            }
        }
    }

    /// Calls `f` with the key and offset of each entry of `group` whose offset is in `offsets`,
    /// in key order, over one consistent view (a fjall snapshot); returns how many. Entries
    /// below the group's cleanup watermark are left out, as lookups answer them `Evicted`.
    pub fn scan_entries<E: From<Error>>(
        &self,
        group: GroupId,
        offsets: std::ops::Range<Offset>,
        mut f: impl FnMut(&[u8], Offset) -> std::result::Result<(), E>,
    ) -> std::result::Result<u64, E> {
        let shared = self.shard(group);
        let Some(state) = shared.registry.get(group) else {
            return Ok(0);
        };
        let generation = state.live.load(Ordering::Acquire);
        if generation == NO_GENERATION {
            return Ok(0);
        }
        let snapshot = shared.db.snapshot();
        let from = offsets.start.max(state.watermark.load(Ordering::Acquire));
        let prefix = DataPrefix::new(group, generation);
        let prefix_len = prefix.as_ref().len();
        let mut count = 0;
        for guard in snapshot.prefix(&shared.data, prefix.as_ref()) {
            let (key, value) = guard.into_inner().map_err(fjall_err("scan", Some(group)))?;
            let offset = decode_offset(&value).ok_or(Error::CorruptEntry { group, len: value.len() })?;
            if (from..offsets.end).contains(&offset) {
                f(&key[prefix_len..], offset)?;
                count += 1;
            }
        }
        Ok(count)
    }

    /// The group's applied marker; `None` for a group never written or dropped.
    pub fn applied(&self, group: GroupId) -> Result<Option<AppliedMarker>> {
        let shared = self.shard(group);
        if shared.registry.get(group).is_none() {
            return Ok(None);
        }
        let key = group_meta_key(group, GroupRecord::Applied);
        let Some(value) = shared.meta.get(key).map_err(fjall_err("applied", Some(group)))? else {
            return Ok(None);
        };
        let (marker, _) = decode_applied(&value).ok_or(Error::CorruptMeta {
            record: "applied",
            group: Some(group),
            len: value.len(),
        })?;
        Ok(Some(marker))
    }

    /// Writes the marker alone (after entries without records).
    pub fn set_applied(&self, group: GroupId, marker: &AppliedMarker) -> Result<()> {
        self.apply(group, &[], marker)
    }

    /// Raises the group's cleanup watermark (lower values are ignored). Lookups
    /// of entries below it answer `Evicted`; compactions remove those entries
    /// once the raise is fsynced. Stored in the meta keyspace (buffered, like
    /// `apply`).
    pub fn set_watermark(&self, group: GroupId, offset: Offset) -> Result<()> {
        let shared = self.shard(group);
        shared.with_group_write(group, |state| {
            if offset <= state.watermark.load(Ordering::Acquire) {
                return Ok(());
            }
            let mut batch = shared.db.batch();
            let new_generation = shared.prepare_group(group, state, &mut batch)?;
            batch.insert(&shared.meta, group_meta_key(group, GroupRecord::Watermark), encode_u64(offset));
            shared.commit("set_watermark", group, state, batch, new_generation)?;
            shared.registry.watermark_raised(state, offset);
            Ok(())
        })
    }

    /// The group's cleanup watermark (0 if never set).
    pub fn watermark(&self, group: GroupId) -> Result<Offset> {
        Ok(self.shard(group).registry.get(group).map_or(0, |state| state.watermark.load(Ordering::Acquire)))
    }

    /// Drops the group: O(1) (one small batch removing its meta records).
    /// Afterwards `applied` is `None` and `get` answers `NotFound`; a later
    /// group with the same id starts empty. Compactions remove the entries once
    /// the drop is fsynced.
    pub fn drop_group(&self, group: GroupId) -> Result<()> {
        let shared = self.shard(group);
        let Some(state) = shared.registry.get(group) else {
            return Ok(());
        };
        let _writes = state.lock_writes();
        if state.is_detached() {
            return Ok(());
        }
        let mut batch = shared.db.batch();
        for record in GroupRecord::ALL {
            batch.remove(&shared.meta, group_meta_key(group, record));
        }
        batch.commit().map_err(fjall_err("drop_group", Some(group)))?;
        shared.registry.retire(group, &state);
        shared.activity.touch();
        tracing::info!(group, "index group dropped");
        Ok(())
    }

    /// Makes every earlier write survive power loss (fdatasync of every shard's
    /// journal), then lets the compaction filter reclaim what those writes made dead.
    pub fn persist(&self) -> Result<()> {
        self.inner.shards.iter().try_for_each(|shard| shard.shared.persist())
    }

    /// [`Index::persist`] for the shard holding `group`: makes every earlier write of
    /// `group` survive power loss (and those of the other groups in its shard).
    pub fn persist_group(&self, group: GroupId) -> Result<()> {
        self.shard(group).persist()
    }

    /// The directory of the database holding `group` (its journals are what
    /// [`Index::persist_group`] fsyncs).
    pub fn shard_dir(&self, group: GroupId) -> &Path {
        &self.shard(group).path
    }

    /// A cheap estimate of the group's live keys, for metrics: exact after a
    /// rebuild, then plus one per put and minus one per delete. Overwrites of
    /// an existing key and deletes of a missing key make it drift (upwards for
    /// update-heavy groups) until the next rebuild.
    pub fn key_count_estimate(&self, group: GroupId) -> Result<u64> {
        Ok(self.shard(group).registry.get(group).map_or(0, |state| state.key_estimate.load(Ordering::Relaxed)))
    }

    /// Blocking maintenance (the node runs it after removing replicas): persist, flush
    /// both memtables, then compact the data keyspace into its last level,
    /// running the compaction filter over everything.
    pub fn compact(&self) -> Result<()> {
        for shard in &self.inner.shards {
            let shared = &shard.shared;
            shared.persist()?;
            for keyspace in [&shared.data, &shared.meta] {
                let flushed = crate::maintenance::seal_and_wait_flushed(keyspace, crate::maintenance::FLUSH_WAIT_MAX)
                    .map_err(fjall_err("compact", None))?;
                if !flushed {
                    tracing::warn!(path = %shared.path.display(), "index memtable not flushed in time; compacting the tables without it");
                }
            }
            shared.data.major_compact().map_err(fjall_err("compact", None))?;
        }
        Ok(())
    }

    /// Sizes and counts for metrics and benchmarks, summed over the shards (reads
    /// file metadata: not for the hot path).
    pub fn stats(&self) -> Result<IndexStats> {
        let mut total = IndexStats::default();
        for shard in &self.inner.shards {
            let shared = &shard.shared;
            let (journal_files, journal_bytes) = journal_usage(&shared.path)?;
            total.groups += shared.registry.group_count();
            total.disk_bytes += shared.db.disk_space().map_err(fjall_err("stats", None))?;
            total.journal_files += journal_files;
            total.journal_bytes += journal_bytes;
            total.data_tables += shared.data.table_count();
            total.data_table_bytes += shared.data.disk_space();
            total.write_buffer_bytes += shared.db.write_buffer_size();
            total.cleanup_pending |= shared.registry.has_pending();
        }
        Ok(total)
    }

    /// The shard holding `group`.
    pub(crate) fn shard(&self, group: GroupId) -> &Shared {
        let shards = &self.inner.shards;
        // `open` fails rather than return an index without shards.
        &shards[layout::shard_of(group, shards.len())].shared
    }
}

impl Shard {
    /// Opens (or creates) one database of the index in directory `path`.
    fn open(path: &Path, config: IndexConfig) -> Result<Shard> {
        let registry = Arc::new(Registry::default());
        let factory: Arc<dyn Factory> = Arc::new(GenerationFilterFactory::new(registry.clone()));
        let open_err = |source| Error::Open { path: path.to_path_buf(), source };
        let db = Database::builder(path)
            .cache_size(config.cache_bytes)
            .max_journaling_size(config.journal_bytes_max)
            .worker_threads(config.worker_threads)
            .with_compaction_filter_factories(Arc::new(move |keyspace: &str| {
                (keyspace == DATA_KEYSPACE).then(|| factory.clone())
            }))
            .open()
            .map_err(open_err)?;
        let memtable_bytes = config.memtable_bytes_max;
        let data = db
            .keyspace(DATA_KEYSPACE, || KeyspaceCreateOptions::default().max_memtable_size(memtable_bytes))
            .map_err(open_err)?;
        let meta = db
            .keyspace(META_KEYSPACE, || {
                KeyspaceCreateOptions::default().max_memtable_size(META_MEMTABLE_BYTES).expect_point_read_hits(true)
            })
            .map_err(open_err)?;
        let shared = Arc::new(Shared {
            db,
            data,
            meta,
            registry,
            config,
            activity: Activity::new(),
            path: path.to_path_buf(),
            next_generation: Mutex::new(FIRST_GENERATION),
            persist_lock: Mutex::new(()),
        });
        shared.load(path)?;
        shared.registry.set_ready();
        let maintenance = Maintenance::start(shared.clone())?;
        tracing::debug!(path = %path.display(), groups = shared.registry.group_count(), "index shard opened");
        Ok(Shard { _maintenance: maintenance, shared })
    }
}

impl Shared {
    /// Loads the meta keyspace into the registry.
    fn load(&self, path: &Path) -> Result<()> {
        self.check_format_version(path)?;
        let mut next = match self.meta.get(META_NEXT_GENERATION_KEY).map_err(fjall_err("open", None))? {
            Some(value) => decode_u32(&value).ok_or(Error::CorruptMeta {
                record: "next_generation",
                group: None,
                len: value.len(),
            })?,
            None => FIRST_GENERATION,
        };
        let mut orphans = Vec::new();
        for (group, loaded) in self.read_group_records()? {
            let Some(generation) = loaded.generation else {
                orphans.push(group);
                continue;
            };
            next = next.max(generation.saturating_add(1));
            self.registry.insert_loaded(group, GroupState::loaded(generation, loaded.watermark, loaded.key_estimate));
        }
        *self.lock_next_generation() = next;
        self.remove_orphans(&orphans)
    }

    fn check_format_version(&self, path: &Path) -> Result<()> {
        let stored = self.meta.get(META_FORMAT_VERSION_KEY).map_err(fjall_err("open", None))?;
        match stored {
            Some(version) if version.as_ref() == [FORMAT_VERSION] => Ok(()),
            Some(version) => Err(Error::UnsupportedFormat {
                path: path.to_path_buf(),
                found: version.first().copied().unwrap_or_default(),
                expected: FORMAT_VERSION,
            }),
            None => {
                self.meta.insert(META_FORMAT_VERSION_KEY, [FORMAT_VERSION]).map_err(fjall_err("open", None))?;
                // A write like any other: the idle flush takes it out of the memtable and
                // the journal (a shard no group writes to would otherwise keep it there).
                self.activity.touch();
                Ok(())
            }
        }
    }

    fn read_group_records(&self) -> Result<HashMap<GroupId, LoadedGroup>> {
        let mut groups: HashMap<GroupId, LoadedGroup> = HashMap::new();
        for guard in self.meta.prefix(META_GROUP_PREFIX) {
            let (key, value) = guard.into_inner().map_err(fjall_err("open", None))?;
            let Some(decoded) = decode_group_meta_key(&key) else {
                continue;
            };
            let (group, record) =
                decoded.map_err(|len| Error::CorruptMeta { record: "group key", group: None, len })?;
            let corrupt = |record| Error::CorruptMeta { record, group: Some(group), len: value.len() };
            let loaded = groups.entry(group).or_default();
            match record {
                GroupRecord::Generation => {
                    loaded.generation = Some(decode_u32(&value).ok_or(corrupt("generation"))?);
                }
                GroupRecord::Applied => {
                    loaded.key_estimate = decode_applied(&value).ok_or(corrupt("applied"))?.1;
                }
                GroupRecord::Watermark => {
                    loaded.watermark = decode_u64(&value).ok_or(corrupt("watermark"))?;
                }
            }
        }
        Ok(groups)
    }

    /// Records without a generation record cannot be written by this code
    /// (drops remove all of a group's records in one batch); remove them so a
    /// later group with the same id cannot see them.
    fn remove_orphans(&self, orphans: &[GroupId]) -> Result<()> {
        if orphans.is_empty() {
            return Ok(());
        }
        tracing::warn!(count = orphans.len(), "removing orphan meta records");
        let mut batch = self.db.batch();
        for group in orphans {
            for record in GroupRecord::ALL {
                batch.remove(&self.meta, group_meta_key(*group, record));
            }
        }
        batch.commit().map_err(fjall_err("open", None))
    }

    pub(crate) fn check_key_lengths<'k>(&self, group: GroupId, keys: impl Iterator<Item = &'k [u8]>) -> Result<()> {
        let max = self.config.key_bytes_max;
        for key in keys {
            if key.len() > max {
                return Err(Error::KeyTooLong { group, len: key.len(), max });
            }
        }
        Ok(())
    }

    /// Runs `f` holding the group's write lock, creating the group in memory
    /// if needed (it exists on disk once `f` commits a batch from `prepare_group`).
    pub(crate) fn with_group_write<T>(
        &self,
        group: GroupId,
        f: impl FnOnce(&Arc<GroupState>) -> Result<T>,
    ) -> Result<T> {
        loop {
            let state = self.registry.get_or_insert(group);
            let _writes = state.lock_writes();
            if state.is_detached() {
                // Dropped between the look-up and the lock: use the new state.
                continue;
            }
            return f(&state);
        }
    }

    /// If the group has no generation yet, allocates one and adds its records
    /// to `batch`. Call holding the group's write lock.
    pub(crate) fn prepare_group<'a>(
        &'a self,
        group: GroupId,
        state: &GroupState,
        batch: &mut OwnedWriteBatch,
    ) -> Result<Option<NewGeneration<'a>>> {
        if state.live.load(Ordering::Acquire) != NO_GENERATION {
            return Ok(None);
        }
        let new = self.allocate_generation(group, batch)?;
        state.building.store(new.generation, Ordering::Release);
        batch.insert(&self.meta, group_meta_key(group, GroupRecord::Generation), encode_u32(new.generation));
        Ok(Some(new))
    }

    /// Hands out a fresh generation and adds the counter update to `batch`.
    pub(crate) fn allocate_generation(&self, group: GroupId, batch: &mut OwnedWriteBatch) -> Result<NewGeneration<'_>> {
        let mut next = self.lock_next_generation();
        let generation = *next;
        let after = generation.checked_add(1).ok_or(Error::GenerationsExhausted { group })?;
        // Advanced in memory even if the batch fails: a number is never reused.
        *next = after;
        batch.insert(&self.meta, META_NEXT_GENERATION_KEY, encode_u32(after));
        Ok(NewGeneration { _allocation: next, generation })
    }

    /// Commits a group's batch and publishes a generation it created.
    pub(crate) fn commit(
        &self,
        op: &'static str,
        group: GroupId,
        state: &GroupState,
        batch: OwnedWriteBatch,
        new_generation: Option<NewGeneration<'_>>,
    ) -> Result<()> {
        if let Err(source) = batch.commit() {
            if new_generation.is_some() {
                state.building.store(NO_GENERATION, Ordering::Release);
            }
            return Err(Error::storage(op, Some(group), source));
        }
        if let Some(new) = new_generation {
            self.registry.switch_generation(group, state, new.generation);
        }
        self.activity.touch();
        Ok(())
    }

    /// The read path: one point read, retried if the generation changed under it.
    /// (`IndexView::get` is the same read on a snapshot, without the retry.)
    fn lookup(
        &self,
        group: GroupId,
        state: &GroupState,
        key: &[u8],
        read: impl Fn(&[u8]) -> fjall::Result<Option<Slice>>,
    ) -> Result<Lookup> {
        loop {
            let generation = state.live.load(Ordering::Acquire);
            if generation == NO_GENERATION {
                return Ok(Lookup::NotFound);
            }
            let value = read(DataKey::new(group, generation, key).as_ref()).map_err(fjall_err("get", Some(group)))?;
            if state.live.load(Ordering::Acquire) != generation {
                // A rebuild or drop switched generations during the read; the
                // old generation's entries may already be compacted away.
                continue;
            }
            let Some(value) = value else {
                return Ok(Lookup::NotFound);
            };
            let offset = decode_offset(&value).ok_or(Error::CorruptEntry { group, len: value.len() })?;
            return Ok(if offset < state.watermark.load(Ordering::Acquire) {
                Lookup::Evicted(offset)
            } else {
                Lookup::Found(offset)
            });
        }
    }

    /// fsync, then promote what it covered to the compaction filter.
    pub(crate) fn persist(&self) -> Result<()> {
        let _serial = self.persist_lock.lock().unwrap_or_else(PoisonError::into_inner);
        let promotion = self.registry.begin_promotion();
        self.db.persist(PersistMode::SyncData).map_err(fjall_err("persist", None))?;
        if let Some(promotion) = promotion {
            self.registry.finish_promotion(promotion);
        }
        Ok(())
    }

    /// Seals both memtables; fjall flushes them in the background.
    pub(crate) fn seal_memtables(&self) -> Result<()> {
        for keyspace in [&self.data, &self.meta] {
            keyspace.rotate_memtable().map_err(fjall_err("flush", None))?;
        }
        Ok(())
    }

    /// Seals the meta memtable so sealed journals it pins can be deleted.
    pub(crate) fn seal_meta_memtable(&self) -> Result<()> {
        self.meta.rotate_memtable().map(drop).map_err(fjall_err("flush", None))
    }

    fn lock_next_generation(&self) -> MutexGuard<'_, Generation> {
        // Poisoning can only interrupt a plain integer store: the value is whole.
        self.next_generation.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// Sizes and counts of the index (see `Index::stats`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct IndexStats {
    /// Groups with state in the index.
    pub groups: usize,
    /// fjall's disk usage: tables plus the journals' logical length (the
    /// active journal is preallocated to 64 MiB).
    pub disk_bytes: u64,
    /// Journal files (the active one included).
    pub journal_files: usize,
    /// Bytes the journal files occupy on disk (allocated blocks).
    pub journal_bytes: u64,
    /// Tables (SST files) of the data keyspace.
    pub data_tables: usize,
    /// Bytes of those tables.
    pub data_table_bytes: u64,
    /// Bytes in memtables (active and sealed) as fjall accounts them.
    pub write_buffer_bytes: u64,
    /// Drops, rebuilds or watermark raises wait for an fsync before the
    /// compaction filter may reclaim their entries.
    pub cleanup_pending: bool,
}

/// `(files, allocated bytes)` of the journal files (`*.jnl`) in `path`.
fn journal_usage(path: &Path) -> Result<(usize, u64)> {
    let io_err = |source| Error::storage("stats", None, fjall::Error::Io(source));
    let mut files = 0;
    let mut bytes = 0;
    for entry in std::fs::read_dir(path).map_err(io_err)? {
        let entry = entry.map_err(io_err)?;
        if entry.path().extension().is_some_and(|ext| ext == "jnl") {
            files += 1;
            bytes += allocated_bytes(&entry.metadata().map_err(io_err)?);
        }
    }
    Ok((files, bytes))
}

#[cfg(unix)]
fn allocated_bytes(metadata: &std::fs::Metadata) -> u64 {
    use std::os::unix::fs::MetadataExt;
    metadata.blocks() * 512
}

#[cfg(not(unix))]
fn allocated_bytes(metadata: &std::fs::Metadata) -> u64 {
    metadata.len()
}

#[derive(Debug, Default)]
struct LoadedGroup {
    generation: Option<Generation>,
    watermark: Offset,
    key_estimate: u64,
}

/// Marks updates that a later update of the same key overrides; `None` if
/// no key repeats (the common case).
///
/// One batch must not hold two versions of a key: they would share one seqno.
fn superseded_updates(updates: &[Update<'_>]) -> Option<Vec<bool>> {
    if updates.len() < 2 {
        return None;
    }
    let mut seen = HashSet::with_capacity(updates.len());
    let mut superseded: Option<Vec<bool>> = None;
    for (position, update) in updates.iter().enumerate().rev() {
        if !seen.insert(update.key()) {
            let marks = superseded.get_or_insert_with(|| vec![false; updates.len()]);
            if let Some(mark) = marks.get_mut(position) {
                *mark = true;
            }
        }
    }
    superseded
}

/// A view of one group's index entries at one moment ([`Index::view`]).
pub struct IndexView<'a> {
    shared: &'a Shared,
    group: GroupId,
    state: Option<Arc<GroupState>>,
    generation: Generation,
    snapshot: fjall::Snapshot,
}

impl IndexView<'_> {
    /// Looks `key` up as the index was when the view was taken. [`Error::ViewStale`] once the
    /// group's entries were rebuilt, replaced or dropped since: the snapshot holds the old
    /// generation's entries only, so every key would seem gone.
    pub fn get(&self, key: &[u8]) -> Result<Lookup> {
        self.shared.check_key_lengths(self.group, std::iter::once(key))?;
        let Some(state) = &self.state else { return Ok(Lookup::NotFound) };
        if self.generation == NO_GENERATION {
            return Ok(Lookup::NotFound);
        }
        let data_key = DataKey::new(self.group, self.generation, key);
        let value =
            self.snapshot.get(&self.shared.data, data_key.as_ref()).map_err(fjall_err("get", Some(self.group)))?;
        if state.live.load(Ordering::Acquire) != self.generation {
            return Err(Error::ViewStale { group: self.group });
        }
        let Some(value) = value else { return Ok(Lookup::NotFound) };
        let offset = decode_offset(&value).ok_or(Error::CorruptEntry { group: self.group, len: value.len() })?;
        Ok(if offset < state.watermark.load(Ordering::Acquire) {
            Lookup::Evicted(offset)
        } else {
            Lookup::Found(offset)
        })
    }
}
