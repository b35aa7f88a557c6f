//! `Index::rebuild`: builds a fresh generation of a group from its log and
//! switches to it atomically with the marker.
//!
//! Records arrive in offset order. They are collected into runs of at most
//! `rebuild_chunk_bytes_max`, each sorted by key (the last record of a key
//! wins) and bulk-loaded with fjall's ingestion, which writes tables directly
//! (no journal, no memtable). The first run needs no tombstones (the
//! generation is empty); later runs look each key up in the generation built
//! so far, to count keys exactly and to write tombstones only where needed.
//!
//! Crash safety: the new generation number is fsynced before any of its
//! entries can reach disk, so it is never handed out again. Until the final
//! batch (generation record + marker) commits, the old generation and its
//! marker stay live; after a crash the half-built generation is dead and the
//! compaction filter removes it.

use crate::encoding::{
    DataPrefix, Generation, GroupRecord, NO_GENERATION, encode_applied, encode_offset, encode_u32, group_meta_key,
};
use crate::error::{Error, Result, fjall_err};
use crate::groups::GroupState;
use crate::index::Shared;
use crate::{AppliedMarker, GroupId, Index, Offset};
use fjall::{PersistMode, Slice};
use std::sync::atomic::Ordering;

/// One record of a run: key, offset, tombstone.
type Record = (Vec<u8>, Offset, bool);

/// Memory charged per record on top of its key bytes (the tuple and the
/// key's allocation).
const RECORD_OVERHEAD_BYTES: u64 = size_of::<Record>() as u64 + 16;

impl Index {
    /// Rebuilds `group` from `records` (its log, in offset order; the bool is
    /// "tombstone") into a fresh generation, then switches to it and to
    /// `marker` in one atomic batch. Returns the number of live keys.
    ///
    /// A crash or an error (from `records` or from storage) before the switch
    /// leaves the old generation and its marker in place. `Ok(Err(e))` passes
    /// the iterator's error through. Writers of the group wait until it ends.
    pub fn rebuild<E>(
        &self,
        group: GroupId,
        records: impl Iterator<Item = std::result::Result<Record, E>>,
        marker: &AppliedMarker,
    ) -> Result<std::result::Result<u64, E>> {
        let shared = self.shard(group);
        shared.with_group_write(group, |state| {
            let outcome = begin(shared, group, state).and_then(|generation| {
                match Builder::new(shared, group, generation).run(records)? {
                    Ok(keys) => switch(shared, group, state, generation, keys, marker).map(Ok),
                    Err(error) => Ok(Err(error)),
                }
            });
            if !matches!(outcome, Ok(Ok(_))) {
                // Abandoned: the half-built generation is dead; the filter removes it.
                state.building.store(NO_GENERATION, Ordering::Release);
            }
            outcome
        })
    }
}

/// Allocates the new generation, marks it as building and fsyncs the counter.
fn begin(shared: &Shared, group: GroupId, state: &GroupState) -> Result<Generation> {
    let mut batch = shared.db.batch();
    let new = shared.allocate_generation(group, &mut batch)?;
    state.building.store(new.generation, Ordering::Release);
    batch.commit().map_err(fjall_err("rebuild", Some(group)))?;
    shared.db.persist(PersistMode::SyncData).map_err(fjall_err("rebuild", Some(group)))?;
    tracing::info!(group, generation = new.generation, "index rebuild started");
    Ok(new.generation)
}

/// Commits generation record and marker together, then makes the generation live.
fn switch(
    shared: &Shared,
    group: GroupId,
    state: &GroupState,
    generation: Generation,
    keys: u64,
    marker: &AppliedMarker,
) -> Result<u64> {
    let mut batch = shared.db.batch();
    batch.insert(&shared.meta, group_meta_key(group, GroupRecord::Generation), encode_u32(generation));
    batch.insert(&shared.meta, group_meta_key(group, GroupRecord::Applied), encode_applied(marker, keys));
    batch.commit().map_err(fjall_err("rebuild", Some(group)))?;
    shared.registry.switch_generation(group, state, generation);
    state.key_estimate.store(keys, Ordering::Relaxed);
    shared.activity.touch();
    tracing::info!(group, generation, keys, "index rebuild switched");
    Ok(keys)
}

struct Builder<'a> {
    shared: &'a Shared,
    group: GroupId,
    generation: Generation,
    keys: u64,
    runs: u32,
    prefix_len: usize,
    scratch: Vec<u8>,
}

impl<'a> Builder<'a> {
    fn new(shared: &'a Shared, group: GroupId, generation: Generation) -> Self {
        let prefix = DataPrefix::new(group, generation);
        let prefix_len = prefix.as_ref().len();
        let mut scratch = Vec::with_capacity(prefix_len + 64);
        scratch.extend_from_slice(prefix.as_ref());
        Self { shared, group, generation, keys: 0, runs: 0, prefix_len, scratch }
    }

    fn run<E>(
        mut self,
        records: impl Iterator<Item = std::result::Result<Record, E>>,
    ) -> Result<std::result::Result<u64, E>> {
        let bytes_max = self.shared.config.rebuild_chunk_bytes_max;
        let mut run: Vec<Record> = Vec::new();
        let mut run_bytes = 0u64;
        for record in records {
            let record = match record {
                Ok(record) => record,
                Err(error) => return Ok(Err(error)),
            };
            self.shared.check_key_lengths(self.group, std::iter::once(record.0.as_slice()))?;
            run_bytes += record.0.len() as u64 + RECORD_OVERHEAD_BYTES;
            run.push(record);
            if run_bytes >= bytes_max {
                self.ingest(&mut run)?;
                run_bytes = 0;
            }
        }
        if !run.is_empty() {
            self.ingest(&mut run)?;
        }
        Ok(Ok(self.keys))
    }

    /// Sorts one run and bulk-loads it; empties `run`.
    fn ingest(&mut self, run: &mut Vec<Record>) -> Result<()> {
        // By key, then offset: the last record of each key is its latest.
        run.sort_unstable_by(|a, b| a.0.cmp(&b.0).then(a.1.cmp(&b.1)));
        let first_run = self.runs == 0;
        let err = fjall_err("rebuild", Some(self.group));
        let mut ingestion = self.shared.data.start_ingestion().map_err(err)?;
        let mut records = run.drain(..).peekable();
        while let Some((key, offset, tombstone)) = records.next() {
            if records.peek().is_some_and(|next| next.0 == key) {
                continue;
            }
            self.scratch.truncate(self.prefix_len);
            self.scratch.extend_from_slice(&key);
            let data_key = Slice::from(self.scratch.as_slice());
            let existed = !first_run && self.exists(&data_key)?;
            let err = fjall_err("rebuild", Some(self.group));
            match (tombstone, existed) {
                (true, true) => {
                    ingestion.write_tombstone(data_key).map_err(err)?;
                    self.keys = self.keys.saturating_sub(1);
                }
                (true, false) => {}
                (false, existed) => {
                    ingestion.write(data_key, encode_offset(offset).as_ref()).map_err(err)?;
                    if !existed {
                        self.keys += 1;
                    }
                }
            }
        }
        drop(records);
        ingestion.finish().map_err(fjall_err("rebuild", Some(self.group)))?;
        self.runs += 1;
        tracing::debug!(
            group = self.group,
            generation = self.generation,
            run = self.runs,
            keys = self.keys,
            "index rebuild run ingested"
        );
        Ok(())
    }

    fn exists(&self, data_key: &[u8]) -> Result<bool> {
        self.shared.data.contains_key(data_key).map_err(|source| Error::storage("rebuild", Some(self.group), source))
    }
}
