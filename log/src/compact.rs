//! Compaction of sealed segments, one segment at a time.
//!
//! A batch whose records are all kept is copied byte for byte. A batch that
//! loses records is re-encoded with the same base offset, last offset delta,
//! attributes (codec), producer fields and partition leader epoch; kept
//! records keep their offset deltas, so offsets are preserved and gaps
//! appear. A batch that loses every record is dropped.
//!
//! Crash protocol for segment `B`:
//! 1. write `B.log.cleaned` (the prefix before the first changed batch is
//!    copied), fsync it;
//! 2. remove `B.seek` (derived data; rebuilt if step 3 does not happen);
//! 3. rename `B.log.cleaned` over `B.log` (atomic), fsync the directory;
//! 4. rebuild the segment state from the new file and write `B.seek`.
//!
//! A crash before 3 leaves the old segment (open removes `*.log.cleaned`);
//! after 3 the new one. A segment left with no batch is deleted (seek file,
//! then log), except the first segment, which is kept as an empty file so
//! the start offset does not move; the active segment is never touched.
//! Because step 3 replaces a single file, no `.swap` stage is needed.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use tracing::info;

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
}

/// Decides which records stay.
struct Policy<'l> {
    live: &'l mut dyn FnMut(&[u8], Offset) -> bool,
    tombstone_horizon_ms: i64,
}

enum Outcome {
    Unchanged,
    Rewritten { records_removed: u64, size_bytes: u64 },
}

const COMPACT_CHUNK_BYTES: usize = 1 << 20;

/// Compacts every sealed segment of `segments` (all but the last).
pub(crate) fn compact_sealed(
    dir: &Path,
    segments: &mut Vec<Segment>,
    interval: u32,
    live: &mut dyn FnMut(&[u8], Offset) -> bool,
    tombstone_horizon_ms: i64,
) -> Result<CompactStats> {
    let mut policy = Policy { live, tombstone_horizon_ms };
    let mut stats = CompactStats::default();
    let mut index = 0;
    while index + 1 < segments.len() {
        let size_before = segments[index].size_bytes();
        stats.bytes_before += size_before;
        let Outcome::Rewritten { records_removed, size_bytes } = rewrite(dir, &segments[index], &mut policy)? else {
            stats.bytes_after += size_before;
            index += 1;
            continue;
        };
        stats.records_removed += records_removed;
        stats.segments_rewritten += 1;
        let base_offset = segments[index].base_offset;
        if size_bytes == 0 && index > 0 {
            files::remove_if_exists(&files::cleaned_path(dir, base_offset))?;
            segments[index].delete(dir)?;
            segments.remove(index);
            files::sync_dir(dir)?;
            continue;
        }
        swap_in(dir, base_offset)?;
        segments[index] = Segment::reopen(dir, base_offset, interval)?;
        stats.bytes_after += segments[index].size_bytes();
        info!(base_offset, records_removed, size_before, size_bytes, "segment compacted");
        index += 1;
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
        Some(cleaner) => Ok(Outcome::Rewritten { records_removed, size_bytes: cleaner.finish()? }),
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
            (Some(_), None) => record.timestamp_ms >= self.tombstone_horizon_ms,
            (Some(key), Some(_)) => (self.live)(key, offset),
        }
    }
}

/// Removes the stale seek file and renames `B.log.cleaned` over `B.log`.
fn swap_in(dir: &Path, base_offset: Offset) -> Result<()> {
    files::remove_if_exists(&files::seek_path(dir, base_offset))?;
    let cleaned = files::cleaned_path(dir, base_offset);
    std::fs::rename(&cleaned, files::segment_path(dir, base_offset)).map_err(Error::io("rename", &cleaned))?;
    files::sync_dir(dir)
}

/// The `.cleaned` file being written.
struct Cleaner {
    path: PathBuf,
    out: BufWriter<File>,
    size_bytes: u64,
}

impl Cleaner {
    /// Creates `B.log.cleaned` holding the segment's bytes before `position`.
    fn start(dir: &Path, segment: &Segment, position: u64) -> Result<Cleaner> {
        let path = files::cleaned_path(dir, segment.base_offset);
        let file = File::create(&path).map_err(Error::io("create", &path))?;
        let mut cleaner = Cleaner { path, out: BufWriter::with_capacity(COMPACT_CHUNK_BYTES, file), size_bytes: 0 };
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
        self.out.write_all(bytes).map_err(Error::io("write", &self.path))?;
        self.size_bytes += bytes.len() as u64;
        Ok(())
    }

    /// Flushes and fsyncs; returns the file size.
    fn finish(self) -> Result<u64> {
        let path = self.path;
        let file = self.out.into_inner().map_err(|e| Error::io("write", &path)(e.into_error()))?;
        file.sync_all().map_err(Error::io("fsync", &path))?;
        Ok(self.size_bytes)
    }
}
