//! [`Log`]: the segments of one partition replica in one directory.
//!
//! Reads take `&self` (positional reads, no seek state); writes take
//! `&mut self`. The last segment is active; every other one is sealed and
//! only ever replaced whole (compaction renames) or deleted (retention).

use std::path::{Path, PathBuf};

use tracing::{error, info};

use crate::Offset;
use crate::batch::{self, BatchInfo, Record, set_base_offset, validate_batch};
use crate::compact::{self, CompactStats, Compacted, CompactionPlan};
use crate::config::LogConfig;
use crate::error::{Error, Result};
use crate::files::{self, EntryKind};
use crate::reader::{BatchCursor, ScanIter};
use crate::segment::Segment;
use crate::snapshot;

/// A segment log. `Send + Sync`; wrap it in a lock to share it.
pub struct Log {
    /// Unique per opened log in this process (compaction plans name the log they came from).
    id: u64,
    /// Bumped by every truncation and reset: they may change a sealed segment's file in
    /// place, which a compaction planned before must not overwrite.
    cuts: u64,
    dir: PathBuf,
    config: LogConfig,
    /// Sorted by base offset, never empty; the last one is active.
    segments: Vec<Segment>,
    poisoned: bool,
    /// A segment was created, renamed or removed since the last dir fsync.
    dir_dirty: bool,
}

/// One segment as [`Log::segments`] reports it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SegmentInfo {
    pub base_offset: Offset,
    /// End (exclusive) of the offset range this segment covers: the next
    /// segment's base offset, or the log's next offset for the active one.
    pub next_offset: Offset,
    pub size_bytes: u64,
    pub sealed: bool,
    /// Largest record timestamp in the segment (`-1` when empty).
    pub max_timestamp_ms: i64,
    /// The segment file. A sealed one is never modified in place, only
    /// replaced whole (compaction) or deleted (retention).
    pub path: PathBuf,
}

impl std::fmt::Debug for Log {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Log")
            .field("dir", &self.dir)
            .field("start_offset", &self.start_offset())
            .field("next_offset", &self.next_offset())
            .field("segments", &self.segments.len())
            .field("poisoned", &self.poisoned)
            .finish()
    }
}

/// Source of [`Log`] ids.
static NEXT_LOG_ID: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);

/// Chunk size of sequential reads for `scan`.
const SCAN_CHUNK_BYTES: usize = 1 << 20;

impl Log {
    /// Opens (creating if missing) the log in `dir` and recovers it: the
    /// torn tail of the active segment is truncated after its last whole
    /// valid batch; damage in a sealed segment is [`Error::Corrupt`]; seek
    /// tables are rebuilt when missing or stale; leftovers of interrupted
    /// compactions and installs are cleaned up.
    pub fn open(dir: &Path, config: LogConfig) -> Result<Log> {
        Log::open_inner(dir, config, None)
    }

    /// Like [`Log::open`], but a log without records starts at
    /// `start_offset` (after a snapshot whose log is empty).
    pub fn open_at(dir: &Path, config: LogConfig, start_offset: Offset) -> Result<Log> {
        Log::open_inner(dir, config, Some(start_offset))
    }

    /// Validates `batch` (whole batch, crc, records, dense offset deltas),
    /// sets its base offset to [`Log::next_offset`] and writes it with one
    /// positional write (no fsync). Rolls the active segment first when the
    /// batch would make it exceed `segment_bytes` or it is older than
    /// `segment_ms`. Returns the batch with its assigned offsets.
    pub fn append(&mut self, batch: &mut [u8], now_ms: u64) -> Result<BatchInfo> {
        if self.poisoned {
            return Err(Error::Poisoned);
        }
        let info = self.check_append(batch)?;
        if self.should_roll(batch.len(), info.last_offset - info.base_offset, now_ms) {
            self.roll()?;
        }
        let interval = self.config.seek_interval_bytes;
        let active = self.active_mut();
        assert_eq!(info.base_offset, active.content_end(), "append must land at the next offset");
        if let Err(e) = active.append(batch, &info, interval, now_ms) {
            return Err(self.poison(e));
        }
        Ok(info)
    }

    /// The offset the next appended record gets (log end offset).
    pub fn next_offset(&self) -> Offset {
        self.active().content_end()
    }

    /// The first offset still in the log (moves with retention).
    pub fn start_offset(&self) -> Offset {
        self.segments[0].base_offset
    }

    /// Raw concatenated whole batches, starting at the batch containing
    /// `offset` (or the next batch when `offset` is in a compacted gap), up
    /// to `max_bytes` but always at least one batch. Empty at the end;
    /// [`Error::OffsetOutOfRange`] below the start offset. Every batch's crc
    /// is checked.
    pub fn read_batches(&self, offset: Offset, max_bytes: usize) -> Result<Vec<u8>> {
        if !self.readable(offset)? {
            return Ok(Vec::new());
        }
        let mut out = Vec::new();
        let mut index = self.segment_index(offset);
        let mut from = Some(offset);
        while let Some(segment) = self.segments.get(index) {
            let position = match from.take() {
                Some(offset) => segment.locate(offset, self.config.seek_interval_bytes)?.map(|l| l.position),
                None => Some(0),
            };
            if let Some(position) = position
                && crate::reader::copy_batches(segment, position, max_bytes, &mut out)?
            {
                break;
            }
            index += 1;
        }
        Ok(out)
    }

    /// Decoded records with offsets `>= offset`, at most `max_records`, from
    /// whole batches that together hold at most `max_bytes`, as Kafka's fetch
    /// takes them: a batch that would go over the budget ends the answer,
    /// unless no record was taken yet (then it is taken whole, whatever its
    /// size, so a reader always moves on).
    /// A damaged batch ends the answer before it; when it is the first batch
    /// to read, the answer is [`Error::Corrupt`] (so a reader that continues
    /// from the last offset it got stops at the damage, never skips it).
    pub fn read_records(&self, offset: Offset, max_records: usize, max_bytes: usize) -> Result<Vec<(Offset, Record)>> {
        let mut out = Vec::new();
        if !self.readable(offset)? || max_records == 0 {
            return Ok(out);
        }
        let chunk_bytes = max_bytes.clamp(64 << 10, SCAN_CHUNK_BYTES);
        let mut cursor = BatchCursor::at(&self.segments, offset, self.config.seek_interval_bytes, chunk_bytes)?;
        let mut scratch = Vec::new();
        let mut bytes_read = 0usize;
        while out.len() < max_records && (out.is_empty() || bytes_read < max_bytes) {
            let batch = match cursor.next_batch() {
                Ok(Some(batch)) => batch,
                Ok(None) => break,
                Err(error) if error.is_corruption() && !out.is_empty() => break,
                Err(error) => return Err(error),
            };
            if !out.is_empty() && bytes_read + batch.bytes.len() > max_bytes {
                break;
            }
            bytes_read += batch.bytes.len();
            let mut sink = |record_offset: Offset, record: Record| {
                if record_offset >= offset {
                    out.push((record_offset, record));
                }
                out.len() < max_records
            };
            batch::decode_into(&batch.header, batch.bytes, &mut scratch, &mut sink)
                .map_err(|e| batch.segment.corrupt(batch.position, e))?;
        }
        Ok(out)
    }

    /// The record at exactly `offset`; `None` when it was compacted away or
    /// is outside `[start_offset, next_offset)`. Seek table, then batch
    /// headers, then only the one batch is read (crc checked) and decoded.
    pub fn read_record(&self, offset: Offset) -> Result<Option<(Offset, Record)>> {
        if offset < self.start_offset() || offset >= self.next_offset() {
            return Ok(None);
        }
        let segment = &self.segments[self.segment_index(offset)];
        let Some(mut located) = segment.locate(offset, self.config.seek_interval_bytes)? else {
            return Ok(None);
        };
        let (header, position) = (located.header, located.position);
        // Read (and check) the batch even when `offset` lies in a gap before it: a damaged
        // base offset could otherwise pass for a compacted gap.
        let bytes = segment.batch_bytes(&mut located)?;
        if header.base_offset > offset {
            return Ok(None);
        }
        let mut scratch = Vec::new();
        let record =
            batch::find_record(&header, bytes, &mut scratch, offset).map_err(|e| segment.corrupt(position, e))?;
        Ok(record.map(|record| (offset, record)))
    }

    /// fsyncs the active segment, and the directory if segments were
    /// created, renamed or removed. A failure poisons the log.
    pub fn sync(&mut self) -> Result<()> {
        if self.poisoned {
            return Err(Error::Poisoned);
        }
        if let Err(e) = self.active().sync() {
            return Err(self.poison(e));
        }
        if self.dir_dirty {
            if let Err(e) = files::sync_dir(&self.dir) {
                return Err(self.poison(e));
            }
            self.dir_dirty = false;
        }
        Ok(())
    }

    /// Seals the active segment (fsync + seek file) and starts a new one at
    /// [`Log::next_offset`]. Does nothing when the active segment is empty.
    pub fn roll(&mut self) -> Result<()> {
        if self.poisoned {
            return Err(Error::Poisoned);
        }
        if self.active().is_empty() {
            return Ok(());
        }
        let base_offset = self.next_offset();
        self.guarded(|log| {
            let interval = log.config.seek_interval_bytes;
            log.active_mut().seal(interval)?;
            let segment = Segment::create(&log.dir, base_offset)?;
            log.segments.push(segment);
            log.dir_dirty = true;
            info!(base_offset, "segment rolled");
            Ok(())
        })
    }

    /// Removes every record at or after `next_offset`, which must be a
    /// batch boundary (or inside a compacted gap). Deleted segments go first,
    /// newest first; a segment file shared with a checkpoint is copied, not
    /// cut in place.
    pub fn truncate(&mut self, next_offset: Offset) -> Result<()> {
        if self.poisoned {
            return Err(Error::Poisoned);
        }
        let (start, end) = (self.start_offset(), self.next_offset());
        if next_offset == end {
            return Ok(());
        }
        if next_offset > end || next_offset < start {
            return Err(Error::OffsetOutOfRange { offset: next_offset, start_offset: start, next_offset: end });
        }
        let index = self.segment_index(next_offset);
        let segment = &self.segments[index];
        let cut = match segment.locate(next_offset, self.config.seek_interval_bytes)? {
            Some(located) if located.header.base_offset < next_offset => {
                return Err(Error::NotBatchBoundary {
                    offset: next_offset,
                    batch_base_offset: located.header.base_offset,
                    batch_last_offset: located.header.last_offset(),
                });
            }
            Some(located) => located.position,
            None => segment.size_bytes(),
        };
        self.cuts += 1;
        self.guarded(|log| log.truncate_at(index, cut, next_offset))
    }

    /// Deletes every segment; the log is then empty with next offset
    /// `start_offset`.
    pub fn reset(&mut self, start_offset: Offset) -> Result<()> {
        if self.poisoned {
            return Err(Error::Poisoned);
        }
        self.cuts += 1;
        self.guarded(|log| {
            // Newest first, so a crash leaves a prefix of the old log; the
            // oldest entry stays listed until its replacement exists, so the
            // list is never empty.
            while log.segments.len() > 1 {
                log.active().delete(&log.dir)?;
                log.segments.pop();
            }
            log.segments[0].delete(&log.dir)?;
            log.segments[0] = Segment::create(&log.dir, start_offset)?;
            files::sync_dir(&log.dir)?;
            log.dir_dirty = false;
            info!(start_offset, "log reset");
            Ok(())
        })
    }

    /// Syncs, rolls a non-empty active segment, then hard-links every sealed
    /// segment and its seek file into `dst` (created) and creates an empty
    /// file named like the active segment (it carries the next offset).
    /// Later appends, compactions, truncations and deletions never change
    /// the linked files. Returns the paths created in `dst`.
    pub fn checkpoint(&mut self, dst: &Path) -> Result<Vec<PathBuf>> {
        self.sync()?;
        self.roll()?;
        self.sync()?;
        snapshot::link_segments(&self.dir, &self.segments, dst)
    }

    /// Replaces the segments of `dir` by the segment files of `files_dir`
    /// (as made by [`Log::checkpoint`]): staged in a sibling directory,
    /// fsynced, then swapped in by renames; an interrupted install is
    /// finished or discarded by the next open. Then opens the log. No `Log`
    /// may be open on `dir` meanwhile (drop it first).
    pub fn install(dir: &Path, files_dir: &Path, config: LogConfig) -> Result<Log> {
        config.validate()?;
        snapshot::install(dir, files_dir)?;
        Log::open(dir, config)
    }

    /// Checks every batch of every segment file in `files_dir` (as made by
    /// [`Log::checkpoint`], before [`Log::install`]) the way recovery checks
    /// a segment without a seek table: length, magic, crc, codec, record
    /// framing, offsets increasing, segments not overlapping. Seek files are
    /// ignored and nothing is written. Returns the next offset the files
    /// hold; any invalid batch is [`Error::Corrupt`] naming file and position.
    pub fn verify_files(files_dir: &Path) -> Result<Offset> {
        snapshot::verify(files_dir)
    }

    /// Reads the sealed segment `info` (from [`Log::segments`]) whole and checks every batch
    /// as [`Log::verify_files`] does: the scrub of a live log, run without holding it. The
    /// file is opened anew, so a segment that compaction replaced meanwhile is read as it is
    /// now, and one that retention deleted is an [`Error::Io`] (not found). Returns the
    /// segment's end: its last offset + 1.
    pub fn verify_segment(info: &SegmentInfo) -> Result<Offset> {
        let dir = info.path.parent().unwrap_or(Path::new("."));
        Segment::verify_file(dir, info.base_offset)
    }

    /// Every record from `from` (clamped to the start offset) to the end,
    /// in order, reading the segments sequentially in large chunks.
    pub fn scan(&self, from: Offset) -> impl Iterator<Item = Result<(Offset, Record)>> + '_ {
        let from = from.max(self.start_offset());
        let cursor = if from >= self.next_offset() {
            Ok(None)
        } else {
            BatchCursor::at(&self.segments, from, self.config.seek_interval_bytes, SCAN_CHUNK_BYTES).map(Some)
        };
        ScanIter::new(cursor, from)
    }

    /// Deletes segments, oldest first, while the oldest is older than `retention_ms` (its
    /// max timestamp) or the log without it is still at least `retention_bytes`. As in
    /// Kafka, that includes the active segment once all of it is past retention: it is
    /// rolled first and the log is left empty, starting at its next offset. Returns the new
    /// start offset.
    pub fn apply_retention(&mut self, now_ms: u64) -> Result<Offset> {
        let cut = self.retention_cut(now_ms);
        self.delete_before(cut)
    }

    /// The start offset [`Log::apply_retention`] would leave, without deleting anything:
    /// the base offset of the oldest segment retention keeps, or the next offset when it
    /// keeps none.
    pub fn retention_cut(&self, now_ms: u64) -> Offset {
        let mut size = self.size_bytes();
        let mut cut = self.start_offset();
        for (i, segment) in self.segments.iter().enumerate() {
            let next = self.segments.get(i + 1);
            if next.is_none() && segment.is_empty() {
                break;
            }
            // A segment that compaction emptied (the first is kept, so the start offset does
            // not move) has no record to age: by time it goes with the next segment past
            // retention, so compaction alone never moves the start (as in Kafka, where an
            // empty segment ages from its file's last change, the compaction).
            if segment.is_empty() && !self.too_big(segment, size) {
                continue;
            }
            if !self.retention_due(segment, size, now_ms) {
                break;
            }
            size -= segment.size_bytes();
            cut = next.map_or_else(|| self.next_offset(), |n| n.base_offset);
        }
        cut
    }

    /// Deletes the oldest segments that end at or before `offset` (a segment ends where the
    /// next begins, the active one at the next offset). A non-empty active segment that
    /// ends at or before it is rolled first, so the log is never without a segment: it is
    /// then empty, starting at its next offset. Returns the new start offset.
    pub fn delete_before(&mut self, offset: Offset) -> Result<Offset> {
        if self.poisoned {
            return Err(Error::Poisoned);
        }
        if !self.active().is_empty() && self.next_offset() <= offset {
            self.roll()?;
        }
        self.guarded(|log| {
            while log.segments.len() > 1 && log.segments[1].base_offset <= offset {
                log.segments[0].delete(&log.dir)?;
                log.segments.remove(0);
                log.dir_dirty = true;
                info!(start_offset = log.start_offset(), "retention moved the start offset");
            }
            Ok(log.start_offset())
        })
    }

    /// Deletes the oldest segment if it is sealed (the active segment is
    /// never deleted) and returns the new start offset, or `None` when the
    /// oldest segment is the active one. For local retention of segments
    /// copied elsewhere (tiered storage).
    pub fn delete_oldest_sealed(&mut self) -> Result<Option<Offset>> {
        if self.poisoned {
            return Err(Error::Poisoned);
        }
        if self.segments.len() < 2 {
            return Ok(None);
        }
        self.guarded(|log| {
            log.segments[0].delete(&log.dir)?;
            log.segments.remove(0);
            log.dir_dirty = true;
            info!(start_offset = log.start_offset(), "local retention moved the start offset");
            Ok(Some(log.start_offset()))
        })
    }

    /// Compacts sealed segments: a keyed record is kept iff `live(key,
    /// offset)`; a tombstone iff its timestamp `>= tombstone_horizon_ms`;
    /// records without a key always. Offsets are preserved. See
    /// `compact.rs` for the crash protocol.
    pub fn compact(
        &mut self,
        live: &mut dyn FnMut(&[u8], Offset) -> bool,
        tombstone_horizon_ms: i64,
    ) -> Result<CompactStats> {
        let plan = self.compaction_plan(Offset::MAX)?;
        let compacted = plan.rewrite(live, tombstone_horizon_ms);
        self.finish_compaction(compacted)
    }

    /// The first step of [`Log::compact`] for a caller that shares the log: read handles
    /// of the sealed segments. Rewrite them with [`CompactionPlan::rewrite`] without
    /// holding the log (appends and reads go on meanwhile), then install the result with
    /// [`Log::finish_compaction`]. One compaction of a log at a time: a second one would
    /// write the same `.cleaned` files.
    ///
    /// Only segments whose records are all below `below` are taken: a caller whose `live`
    /// answers from an index written after the append passes the offset the index covers,
    /// so a segment sealed by an append whose keys are not indexed yet is left alone.
    pub fn compaction_plan(&self, below: Offset) -> Result<CompactionPlan> {
        if self.poisoned {
            return Err(Error::Poisoned);
        }
        let sealed = &self.segments[..self.segments.len().saturating_sub(1)];
        let segments = sealed
            .iter()
            .take_while(|s| s.content_end() <= below)
            .map(|s| Ok((s.read_view()?, s.file_id()?)))
            .collect::<Result<Vec<_>>>()?;
        Ok(CompactionPlan {
            log_id: (self.id, self.cuts),
            dir: self.dir.clone(),
            interval: self.config.seek_interval_bytes,
            segments,
        })
    }

    /// Installs rewritten segments (the crash protocol of `compact.rs`, step 2 on). A
    /// segment that is gone since the plan was taken (retention) keeps its state; a plan
    /// taken before a truncation or a reset of this log, or from another log (this one was
    /// reopened, a snapshot installed), installs nothing. A failed install poisons the log; an
    /// error that stopped the rewrite is returned after what came before it is installed.
    pub fn finish_compaction(&mut self, compacted: Compacted) -> Result<CompactStats> {
        if compacted.log_id != (self.id, self.cuts) {
            compacted.discard();
            return Ok(CompactStats::default());
        }
        if self.poisoned {
            compacted.discard();
            return Err(Error::Poisoned);
        }
        let Compacted { rewrites, error, oldest_tombstone_kept_ms, .. } = compacted;
        let stats = match compact::install(&self.dir, &mut self.segments, rewrites) {
            Ok(stats) => CompactStats { oldest_tombstone_kept_ms, ..stats },
            Err(error) => return Err(self.poison(error)),
        };
        match error {
            Some(error) => Err(error),
            None => Ok(stats),
        }
    }

    /// The segments, oldest first.
    pub fn segments(&self) -> Vec<SegmentInfo> {
        let next_offset = self.next_offset();
        self.segments
            .iter()
            .enumerate()
            .map(|(i, s)| SegmentInfo {
                base_offset: s.base_offset,
                next_offset: self.segments.get(i + 1).map_or(next_offset, |n| n.base_offset),
                size_bytes: s.size_bytes(),
                sealed: s.sealed,
                max_timestamp_ms: s.max_timestamp_ms(),
                path: s.path.clone(),
            })
            .collect()
    }

    /// Total bytes of all segment files.
    pub fn size_bytes(&self) -> u64 {
        self.segments.iter().map(Segment::size_bytes).sum()
    }

    /// The directory of this log.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The configuration in force.
    pub fn config(&self) -> &LogConfig {
        &self.config
    }

    /// Replaces the configuration (topic config changes). Applies to later
    /// appends, rolls and retention; existing segments are left as they are.
    /// A different `seek_interval_bytes` applies to batches appended later.
    pub fn set_config(&mut self, config: LogConfig) -> Result<()> {
        config.validate()?;
        self.config = config;
        Ok(())
    }

    // -- private ---------------------------------------------------------

    fn open_inner(dir: &Path, config: LogConfig, start_offset: Option<Offset>) -> Result<Log> {
        config.validate()?;
        snapshot::finish_interrupted_install(dir)?;
        std::fs::create_dir_all(dir).map_err(Error::io("create directory", dir))?;
        let bases = Log::clean_dir(dir)?;
        let mut log = Log {
            id: NEXT_LOG_ID.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
            cuts: 0,
            dir: dir.to_path_buf(),
            config,
            segments: Vec::with_capacity(bases.len().max(1)),
            poisoned: false,
            dir_dirty: false,
        };
        log.open_segments(&bases, start_offset.unwrap_or(0))?;
        log.check_order()?;
        if let Some(start) = start_offset
            && log.start_offset() == log.next_offset()
            && log.start_offset() != start
        {
            log.reset(start)?;
        }
        info!(
            dir = %dir.display(),
            start_offset = log.start_offset(),
            next_offset = log.next_offset(),
            segments = log.segments.len(),
            "log opened"
        );
        Ok(log)
    }

    /// Removes leftovers (interrupted compactions, temporary files, seek
    /// files without a segment) and returns the segment base offsets.
    fn clean_dir(dir: &Path) -> Result<Vec<Offset>> {
        let names = files::list(dir)?;
        let mut bases = Vec::new();
        let mut seeks = Vec::new();
        for name in &names {
            match files::classify(name) {
                EntryKind::Segment(base) => bases.push(base),
                EntryKind::Seek(base) => seeks.push(base),
                EntryKind::Leftover => {
                    info!(file = %name, "removing leftover of an interrupted write");
                    files::remove_if_exists(&dir.join(name))?;
                }
                EntryKind::Other => {}
            }
        }
        for base in seeks.into_iter().filter(|b| !bases.contains(b)) {
            files::remove_if_exists(&files::seek_path(dir, base))?;
        }
        bases.sort_unstable();
        Ok(bases)
    }

    fn open_segments(&mut self, bases: &[Offset], start_offset: Offset) -> Result<()> {
        let interval = self.config.seek_interval_bytes;
        let Some((&active, sealed)) = bases.split_last() else {
            self.segments.push(Segment::create(&self.dir, start_offset)?);
            return files::sync_dir(&self.dir);
        };
        for &base in sealed {
            self.segments.push(Segment::open_sealed(&self.dir, base, interval)?);
        }
        self.segments.push(Segment::recover_active(&self.dir, active, interval)?);
        Ok(())
    }

    /// Each segment's batches end before the next segment begins.
    fn check_order(&self) -> Result<()> {
        for pair in self.segments.windows(2) {
            if pair[0].content_end() > pair[1].base_offset {
                let error = Error::malformed("segment overlaps the next segment", 0);
                return Err(pair[0].corrupt(pair[0].size_bytes(), error));
            }
        }
        Ok(())
    }

    fn check_append(&self, batch: &mut [u8]) -> Result<BatchInfo> {
        let limit = self.config.batch_bytes_max as usize;
        if batch.len() > limit {
            return Err(Error::BatchTooLarge { size: batch.len(), limit });
        }
        if batch.len() >= batch::BATCH_HEADER_BYTES {
            set_base_offset(batch, self.next_offset());
        }
        let info = validate_batch(batch)?;
        if info.record_count == 0 {
            return Err(Error::EmptyBatch);
        }
        let last_offset_delta = info.last_offset - info.base_offset;
        if last_offset_delta != u64::from(info.record_count) - 1 {
            return Err(Error::NotDense {
                record_count: info.record_count,
                last_offset_delta: last_offset_delta as i32,
            });
        }
        batch::validate_compressed_records(batch)?;
        Ok(info)
    }

    fn should_roll(&self, batch_bytes: usize, last_offset_delta: u64, now_ms: u64) -> bool {
        let active = self.active();
        if active.is_empty() {
            return false;
        }
        let too_big = active.size_bytes() + batch_bytes as u64 > self.config.segment_bytes;
        let too_old = match (self.config.segment_ms, active.roll_anchor_ms) {
            (Some(segment_ms), Some(anchor)) => {
                i64::try_from(now_ms).unwrap_or(i64::MAX).saturating_sub(anchor) >= segment_ms as i64
            }
            _ => false,
        };
        let span = self.next_offset() + last_offset_delta - active.base_offset;
        too_big || too_old || span > u64::from(u32::MAX)
    }

    /// Whether retention deletes `segment`, the oldest, of a log of `log_bytes`.
    fn retention_due(&self, segment: &Segment, log_bytes: u64, now_ms: u64) -> bool {
        let now = i64::try_from(now_ms).unwrap_or(i64::MAX);
        let too_old =
            self.config.retention_ms.is_some_and(|ms| now.saturating_sub(segment.max_timestamp_ms()) > ms as i64);
        too_old || self.too_big(segment, log_bytes)
    }

    /// Whether the log of `log_bytes` is still at least `retention_bytes` without `segment`.
    fn too_big(&self, segment: &Segment, log_bytes: u64) -> bool {
        self.config.retention_bytes.is_some_and(|limit| log_bytes - segment.size_bytes() >= limit)
    }

    fn truncate_at(&mut self, index: usize, cut: u64, next_offset: Offset) -> Result<()> {
        while self.segments.len() > index + 1 {
            self.active().delete(&self.dir)?;
            self.segments.pop();
        }
        let interval = self.config.seek_interval_bytes;
        let dir = self.dir.clone();
        let segment = self.active_mut();
        segment.truncate_to(&dir, cut, interval)?;
        if segment.content_end() == next_offset {
            segment.unseal(&dir)?;
        } else {
            // The cut lies in a compacted gap: the segment stays sealed and
            // a new empty segment records the next offset in its name.
            segment.sync()?;
            segment.write_seek_file(interval)?;
            self.segments.push(Segment::create(&dir, next_offset)?);
        }
        files::sync_dir(&dir)?;
        self.dir_dirty = false;
        info!(next_offset, "log truncated");
        Ok(())
    }

    /// Index of the segment whose range contains `offset` (the last one
    /// whose base offset is at most `offset`); 0 below the start.
    fn segment_index(&self, offset: Offset) -> usize {
        self.segments.partition_point(|s| s.base_offset <= offset).saturating_sub(1)
    }

    /// Whether a read at `offset` has anything to return; below the start
    /// offset is an error.
    fn readable(&self, offset: Offset) -> Result<bool> {
        let (start, end) = (self.start_offset(), self.next_offset());
        if offset < start {
            return Err(Error::OffsetOutOfRange { offset, start_offset: start, next_offset: end });
        }
        Ok(offset < end)
    }

    fn active(&self) -> &Segment {
        self.segments.last().expect("a log always has an active segment")
    }

    fn active_mut(&mut self) -> &mut Segment {
        self.segments.last_mut().expect("a log always has an active segment")
    }

    /// Runs a mutation; any error poisons the log.
    fn guarded<T>(&mut self, f: impl FnOnce(&mut Log) -> Result<T>) -> Result<T> {
        f(self).map_err(|e| self.poison(e))
    }

    fn poison(&mut self, error: Error) -> Error {
        self.poisoned = true;
        error!(dir = %self.dir.display(), %error, "log poisoned");
        error
    }
}
