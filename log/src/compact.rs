//! Compaction of sealed segments, one segment at a time.
//!
//! A batch whose records are all kept is copied byte for byte. A batch that
//! loses records is re-encoded with the same base offset, last offset delta,
//! attributes (codec), producer fields and partition leader epoch; kept
//! records keep their offset deltas, so offsets are preserved and gaps
//! appear. A batch that loses every record is dropped.
//!
//! Crash protocol for segment `B` (`log/FORMAT.md` section 7):
//! 1. write `B.log.cleaned` (the prefix before the first changed batch is
//!    copied), fsync it, scan it, and write its seek table as
//!    `B.seek.cleaned.tmp`, fsynced; all without holding the log;
//! 2. remove `B.seek` (derived data; rebuilt if step 3 does not happen);
//! 3. rename `B.log.cleaned` over `B.log` (atomic) and `B.seek.cleaned.tmp`
//!    to `B.seek`, fsync the directory.
//!
//! A crash before 3 leaves the old segment (open removes the staged files);
//! after 3 the new one; between its renames, a segment without a seek file
//! or with a stale one, rebuilt on open either way. A segment left with no
//! batch is deleted (seek file, then log), except the first segment, which
//! is kept as an empty file so the start offset does not move; the active
//! segment is never touched. Because step 3 replaces a single segment file,
//! no `.swap` stage is needed.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use tracing::{info, warn};

use crate::Offset;
use crate::batch::{self, BatchHeader, Record, encode_with};
use crate::error::{Error, Result};
use crate::files;
use crate::reader::BatchCursor;
use crate::segment::{ChunkReader, Segment};

/// What one call of [`crate::Log::compact`] did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CompactStats {
    pub segments_rewritten: usize,
    pub records_removed: u64,
    /// Total size of the sealed segments examined, before and after.
    pub bytes_before: u64,
    pub bytes_after: u64,
    /// The timestamp of the oldest tombstone the pass kept because it was newer than the
    /// horizon: a later pass with a horizon past it removes it even if nothing else changed.
    pub oldest_tombstone_kept_ms: Option<i64>,
}

impl std::ops::AddAssign for CompactStats {
    fn add_assign(&mut self, other: CompactStats) {
        self.segments_rewritten += other.segments_rewritten;
        self.records_removed += other.records_removed;
        self.bytes_before += other.bytes_before;
        self.bytes_after += other.bytes_after;
        self.oldest_tombstone_kept_ms = match (self.oldest_tombstone_kept_ms, other.oldest_tombstone_kept_ms) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        };
    }
}

/// Decides which records stay.
struct Policy<'l> {
    live: &'l mut dyn FnMut(&[u8], Offset) -> bool,
    tombstone_horizon_ms: i64,
    oldest_tombstone_kept_ms: Option<i64>,
}

enum Outcome {
    Unchanged,
    Rewritten { records_removed: u64 },
}

const COMPACT_CHUNK_BYTES: usize = 1 << 20;

/// The sealed segments of one log, to compact without holding the log: taken by
/// [`crate::Log::compaction_plan`], rewritten by [`CompactionPlan::rewrite`] (the long
/// part: every batch read, every key looked up), installed by
/// [`crate::Log::finish_compaction`]. Sealed segment files are never modified in place,
/// so the rewrite reads exactly the bytes the log held when the plan was taken.
pub struct CompactionPlan {
    /// The log's id and its count of truncations and resets when the plan was taken.
    pub(crate) log_id: (u64, u64),
    pub(crate) dir: PathBuf,
    pub(crate) interval: u32,
    /// Read handles of the sealed segments, oldest first, with the file each reads.
    pub(crate) segments: Vec<(Segment, FileId)>,
}

/// Rewritten segments waiting for [`crate::Log::finish_compaction`].
pub struct Compacted {
    pub(crate) log_id: (u64, u64),
    pub(crate) dir: PathBuf,
    pub(crate) rewrites: Vec<Rewrite>,
    /// What stopped the rewrite (a damaged batch, a failed write): reported once the
    /// segments rewritten before it are installed.
    pub(crate) error: Option<Error>,
    /// The oldest tombstone the rewrite kept (see [`CompactStats::oldest_tombstone_kept_ms`]).
    pub(crate) oldest_tombstone_kept_ms: Option<i64>,
}

/// (device, inode) of a segment file.
pub(crate) type FileId = (u64, u64);

pub(crate) struct Rewrite {
    base_offset: Offset,
    /// The file the rewrite read: installed only over that same file.
    file_id: FileId,
    size_before: u64,
    /// The new segment, opened from `B.log.cleaned`; `None` when every record stays.
    replacement: Option<(Segment, u64)>,
}

impl CompactionPlan {
    /// The offset after the plan's last segment: every record at or past it is in a segment
    /// the plan does not take (the active one, or one sealed after the plan was taken).
    /// 0 for a plan of no segment.
    pub fn end_offset(&self) -> Offset {
        self.segments.last().map_or(0, |(segment, _)| segment.content_end())
    }

    /// Calls `f` with the key and offset of every record with a key (tombstones included) in
    /// the plan's segments, in offset order: what a caller needs to know, before
    /// [`CompactionPlan::rewrite`], of the newest record of some keys within the plan.
    pub fn for_each_keyed_record(&self, f: &mut dyn FnMut(&[u8], Offset)) -> Result<()> {
        let mut scratch = Vec::new();
        for (segment, _) in &self.segments {
            let mut cursor = BatchCursor::whole_segment(segment, COMPACT_CHUNK_BYTES);
            while let Some(batch) = cursor.next_batch()? {
                if batch::is_control(&batch.header) {
                    continue;
                }
                batch::decode_into(&batch.header, batch.bytes, &mut scratch, &mut |offset, record| {
                    if let Some(key) = &record.key {
                        f(key, offset);
                    }
                    true
                })
                .map_err(|e| segment.corrupt(batch.position, e))?;
            }
        }
        Ok(())
    }

    /// Writes `B.log.cleaned` for every segment that loses records and opens it. Stops at
    /// the first error, keeping what was rewritten before it.
    pub fn rewrite(self, live: &mut dyn FnMut(&[u8], Offset) -> bool, tombstone_horizon_ms: i64) -> Compacted {
        let mut policy = Policy { live, tombstone_horizon_ms, oldest_tombstone_kept_ms: None };
        let mut rewrites = Vec::with_capacity(self.segments.len());
        let mut error = None;
        for (view, file_id) in &self.segments {
            let replaced = match rewrite(&self.dir, view, &mut policy) {
                Ok(Outcome::Unchanged) => Ok(None),
                Ok(Outcome::Rewritten { records_removed }) => {
                    Segment::open_cleaned(&self.dir, view.base_offset, self.interval)
                        .map(|s| Some((s, records_removed)))
                }
                Err(e) => Err(e),
            };
            match replaced {
                Ok(replacement) => rewrites.push(Rewrite {
                    base_offset: view.base_offset,
                    file_id: *file_id,
                    size_before: view.size_bytes(),
                    replacement,
                }),
                Err(e) => {
                    remove_cleaned(&self.dir, view.base_offset);
                    error = Some(e);
                    break;
                }
            }
        }
        let oldest_tombstone_kept_ms = policy.oldest_tombstone_kept_ms;
        Compacted { log_id: self.log_id, dir: self.dir, rewrites, error, oldest_tombstone_kept_ms }
    }
}

impl Compacted {
    /// One part per rewritten segment, in order (the error, if any, with the last part), so
    /// that a caller sharing the log can install them one at a time and let appends and
    /// reads in between.
    /// The first part carries the oldest tombstone kept.
    pub fn into_parts(self) -> Vec<Compacted> {
        let Compacted { log_id, dir, rewrites, error, oldest_tombstone_kept_ms } = self;
        let mut parts: Vec<Compacted> = rewrites
            .into_iter()
            .map(|r| Compacted {
                log_id,
                dir: dir.clone(),
                rewrites: vec![r],
                error: None,
                oldest_tombstone_kept_ms: None,
            })
            .collect();
        match parts.last_mut() {
            Some(last) => last.error = error,
            None => parts.push(Compacted { log_id, dir, rewrites: Vec::new(), error, oldest_tombstone_kept_ms: None }),
        }
        if let Some(first) = parts.first_mut() {
            first.oldest_tombstone_kept_ms = oldest_tombstone_kept_ms;
        }
        parts
    }

    /// Removes the output of rewrites that will not be installed.
    pub(crate) fn discard(self) {
        for r in self.rewrites {
            if r.replacement.is_some() {
                remove_cleaned(&self.dir, r.base_offset);
            }
        }
    }
}

/// Best effort: a file left behind is removed when the log is next opened.
fn remove_cleaned(dir: &Path, base_offset: Offset) {
    for path in [files::cleaned_path(dir, base_offset), files::staged_seek_path(dir, base_offset)] {
        if let Err(e) = files::remove_if_exists(&path) {
            warn!(base_offset, error = %e, "cannot remove a compaction output file");
        }
    }
}

/// Installs `rewrites` into `segments` (all but the last are sealed): each replaces its
/// segment if that is still sealed and still the file the rewrite read (retention may have
/// deleted it); others are dropped. The caller checked that the log was neither reopened nor
/// truncated since the plan (a truncation may cut a sealed segment's file in place).
pub(crate) fn install(dir: &Path, segments: &mut Vec<Segment>, rewrites: Vec<Rewrite>) -> Result<CompactStats> {
    let mut stats = CompactStats::default();
    for r in rewrites {
        let index = segments.iter().position(|s| s.base_offset == r.base_offset);
        let current = match index {
            Some(i) if i + 1 < segments.len() && segments[i].file_id()? == r.file_id => i,
            _ => {
                if r.replacement.is_some() {
                    remove_cleaned(dir, r.base_offset);
                }
                continue;
            }
        };
        stats.bytes_before += r.size_before;
        let Some((mut segment, records_removed)) = r.replacement else {
            stats.bytes_after += r.size_before;
            continue;
        };
        stats.records_removed += records_removed;
        stats.segments_rewritten += 1;
        let base_offset = r.base_offset;
        if segment.size_bytes() == 0 && current > 0 {
            drop(segment);
            files::remove_if_exists(&files::cleaned_path(dir, base_offset))?;
            files::remove_if_exists(&files::staged_seek_path(dir, base_offset))?;
            segments[current].delete(dir)?;
            segments.remove(current);
            files::sync_dir(dir)?;
            continue;
        }
        swap_in(dir, base_offset)?;
        segment.renamed_into_place(dir);
        stats.bytes_after += segment.size_bytes();
        info!(
            base_offset,
            records_removed,
            size_before = r.size_before,
            size_bytes = segment.size_bytes(),
            "segment compacted"
        );
        segments[current] = segment;
    }
    Ok(stats)
}

/// Writes `B.log.cleaned` if any record of the segment goes.
fn rewrite(dir: &Path, segment: &Segment, policy: &mut Policy<'_>) -> Result<Outcome> {
    let mut cursor = BatchCursor::whole_segment(segment, COMPACT_CHUNK_BYTES);
    let mut cleaner: Option<Cleaner> = None;
    let mut scratch = Vec::new();
    let mut records_removed = 0u64;
    while let Some(batch) = cursor.next_batch()? {
        let kept = if batch::is_control(&batch.header) {
            None
        } else {
            let records =
                decode(&batch.header, batch.bytes, &mut scratch).map_err(|e| segment.corrupt(batch.position, e))?;
            policy.filter(&batch.header, records)
        };
        let Some((kept, removed)) = kept else {
            if let Some(cleaner) = cleaner.as_mut() {
                cleaner.write(batch.bytes)?;
            }
            continue;
        };
        records_removed += removed;
        if cleaner.is_none() {
            cleaner = Some(Cleaner::start(dir, segment, batch.position)?);
        }
        if let (Some(cleaner), false) = (cleaner.as_mut(), kept.is_empty()) {
            let numbered: Vec<(i32, &Record)> = kept.iter().map(|(delta, r)| (*delta, r)).collect();
            cleaner.write(&encode_with(&batch.header.template(), &numbered)?)?;
        }
    }
    match cleaner {
        None => Ok(Outcome::Unchanged),
        Some(cleaner) => {
            cleaner.finish()?;
            Ok(Outcome::Rewritten { records_removed })
        }
    }
}

fn decode(header: &BatchHeader, bytes: &[u8], scratch: &mut Vec<u8>) -> Result<Vec<(Offset, Record)>> {
    let mut records = Vec::new();
    batch::decode_into(header, bytes, scratch, &mut |offset, record| {
        records.push((offset, record));
        true
    })?;
    Ok(records)
}

impl Policy<'_> {
    /// `None` when every record stays, else the kept records with their
    /// offset deltas and the number removed.
    fn filter(&mut self, header: &BatchHeader, records: Vec<(Offset, Record)>) -> Option<(Vec<(i32, Record)>, u64)> {
        let total = records.len();
        let keep: Vec<bool> = records.iter().map(|(offset, r)| self.keeps(r, *offset)).collect();
        if keep.iter().all(|k| *k) {
            return None;
        }
        let kept: Vec<(i32, Record)> = records
            .into_iter()
            .zip(keep)
            .filter(|(_, k)| *k)
            .map(|((offset, record), _)| ((offset - header.base_offset) as i32, record))
            .collect();
        let removed = (total - kept.len()) as u64;
        Some((kept, removed))
    }

    fn keeps(&mut self, record: &Record, offset: Offset) -> bool {
        match (&record.key, &record.value) {
            (None, _) => true,
            (Some(_), None) => {
                let kept = record.timestamp_ms >= self.tombstone_horizon_ms;
                if kept {
                    let oldest =
                        self.oldest_tombstone_kept_ms.map_or(record.timestamp_ms, |t| t.min(record.timestamp_ms));
                    self.oldest_tombstone_kept_ms = Some(oldest);
                }
                kept
            }
            (Some(key), Some(_)) => (self.live)(key, offset),
        }
    }
}

/// Removes the stale seek file, renames `B.log.cleaned` over `B.log` and the staged seek
/// file to `B.seek`, and fsyncs the directory. A crash between the renames leaves the new
/// segment without a seek file (rebuilt on open) or, if only the second rename reached the
/// disk, the old segment with a seek file whose recorded size and last batch do not match
/// it (found stale and rebuilt on open).
fn swap_in(dir: &Path, base_offset: Offset) -> Result<()> {
    let seek = files::seek_path(dir, base_offset);
    files::remove_if_exists(&seek)?;
    let cleaned = files::cleaned_path(dir, base_offset);
    std::fs::rename(&cleaned, files::segment_path(dir, base_offset)).map_err(Error::io("rename", &cleaned))?;
    let staged = files::staged_seek_path(dir, base_offset);
    std::fs::rename(&staged, &seek).map_err(Error::io("rename", &staged))?;
    files::sync_dir(dir)
}

/// The `.cleaned` file being written.
struct Cleaner {
    path: PathBuf,
    out: BufWriter<File>,
}

impl Cleaner {
    /// Creates `B.log.cleaned` holding the segment's bytes before `position`.
    fn start(dir: &Path, segment: &Segment, position: u64) -> Result<Cleaner> {
        let path = files::cleaned_path(dir, segment.base_offset);
        let file = File::create(&path).map_err(Error::io("create", &path))?;
        let mut cleaner = Cleaner { path, out: BufWriter::with_capacity(COMPACT_CHUNK_BYTES, file) };
        let mut reader = ChunkReader::with_chunk_bytes(COMPACT_CHUNK_BYTES);
        let mut copied = 0u64;
        while copied < position {
            let len = (position - copied).min(COMPACT_CHUNK_BYTES as u64) as usize;
            cleaner.write(reader.get(segment, copied, len, position)?)?;
            copied += len as u64;
        }
        Ok(cleaner)
    }

    fn write(&mut self, bytes: &[u8]) -> Result<()> {
        self.out.write_all(bytes).map_err(Error::io("write", &self.path))
    }

    /// Flushes and fsyncs.
    fn finish(self) -> Result<()> {
        let path = self.path;
        let file = self.out.into_inner().map_err(|e| Error::io("write", &path)(e.into_error()))?;
        file.sync_all().map_err(Error::io("fsync", &path))
    }
}
