//! One segment: a `{base_offset:020}.log` file of concatenated batches, its
//! in-memory seek table and content facts. The log owns an ordered list of
//! segments; the last one is active (appended to), the others are sealed.

use std::cell::Cell;
use std::fs::{self, File, OpenOptions};
use std::io::Write;
use std::os::unix::fs::{FileExt, MetadataExt};
use std::path::{Path, PathBuf};

use tracing::{info, warn};

use crate::Offset;
use crate::batch::{BATCH_HEADER_BYTES, BatchHeader, BatchInfo, validate_batch};
use crate::error::{Error, Result};
use crate::files;
use crate::seek::{SEEK_HEADER_BYTES, SeekEntry, SeekTable, SegmentFacts};

/// A segment file and what is known about its content.
pub(crate) struct Segment {
    pub base_offset: Offset,
    pub path: PathBuf,
    file: File,
    size_bytes: u64,
    /// Last offset of the last batch + 1, or `base_offset` if empty.
    content_end: Offset,
    max_timestamp_ms: i64,
    last_batch: Option<(u64, u32)>,
    seek: SeekTable,
    bytes_since_entry: u64,
    pub sealed: bool,
    /// When the first batch arrived, for `segment_ms`.
    pub roll_anchor_ms: Option<i64>,
}

/// Where a batch was found and the bytes read around it.
pub(crate) struct Located {
    pub position: u64,
    pub header: BatchHeader,
    window: Window,
}

/// Offsets, time and size of one batch, as the segment state needs them.
#[derive(Clone, Copy)]
struct BatchSpan {
    base: Offset,
    last: Offset,
    max_timestamp_ms: i64,
    size_bytes: u64,
}

/// How a scan of a segment file ended.
enum ScanEnd {
    Complete,
    Invalid { position: u64, error: Error },
}

const SCAN_CHUNK_BYTES: usize = 1 << 20;
const WINDOW_BYTES_MIN: u64 = 8 << 10;
/// Largest window buffer kept for reuse by the next lookup on the same thread.
const WINDOW_KEEP_BYTES_MAX: usize = 256 << 10;

impl Segment {
    /// Creates a new, empty segment file (it must not exist).
    pub(crate) fn create(dir: &Path, base_offset: Offset) -> Result<Segment> {
        let path = files::segment_path(dir, base_offset);
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .open(&path)
            .map_err(Error::io("create", &path))?;
        info!(base_offset, "segment created");
        Ok(Segment::empty(base_offset, path, file))
    }

    /// Opens a sealed segment: trusts its seek file when it describes the
    /// file exactly, else scans every batch (crc included) and rewrites the
    /// seek file. Any invalid batch is [`Error::Corrupt`].
    pub(crate) fn open_sealed(dir: &Path, base_offset: Offset, interval: u32) -> Result<Segment> {
        let mut segment = Segment::open_file(dir, base_offset)?;
        segment.sealed = true;
        if segment.load_seek_file()? {
            return Ok(segment);
        }
        warn!(base_offset, "seek table missing or stale, rebuilding");
        if let ScanEnd::Invalid { position, error } = segment.rebuild(interval)? {
            return Err(segment.corrupt(position, error));
        }
        segment.write_seek_file(interval)?;
        Ok(segment)
    }

    /// Reads every batch of the segment file `base_offset` in `dir` (read
    /// only; its seek file is ignored) and checks it as recovery does.
    /// Returns the segment's end: its last offset + 1, or `base_offset` if
    /// empty. Any invalid batch is [`Error::Corrupt`].
    pub(crate) fn verify_file(dir: &Path, base_offset: Offset) -> Result<Offset> {
        let path = files::segment_path(dir, base_offset);
        let file = File::open(&path).map_err(Error::io("open", &path))?;
        let mut segment = Segment::empty(base_offset, path, file);
        if let ScanEnd::Invalid { position, error } = segment.rebuild(u32::MAX)? {
            return Err(segment.corrupt(position, error));
        }
        Ok(segment.content_end)
    }

    /// Opens the active (last) segment: scans every batch and truncates the
    /// file after the last whole valid batch (a torn tail).
    pub(crate) fn recover_active(dir: &Path, base_offset: Offset, interval: u32) -> Result<Segment> {
        let mut segment = Segment::open_file(dir, base_offset)?;
        if let ScanEnd::Invalid { position, error } = segment.rebuild(interval)? {
            let dropped_bytes = segment.file_len()? - position;
            warn!(base_offset, position, dropped_bytes, %error, "truncating torn tail of the active segment");
            segment.cut_file(position)?;
        }
        files::remove_if_exists(&files::seek_path(dir, base_offset))?;
        segment.roll_anchor_ms = segment.first_batch_max_timestamp()?;
        Ok(segment)
    }

    pub(crate) fn size_bytes(&self) -> u64 {
        self.size_bytes
    }

    pub(crate) fn content_end(&self) -> Offset {
        self.content_end
    }

    pub(crate) fn max_timestamp_ms(&self) -> i64 {
        self.max_timestamp_ms
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.size_bytes == 0
    }

    /// Writes a validated batch at the end of the file with one positional
    /// write. On error the segment state is unchanged (the caller poisons).
    pub(crate) fn append(&mut self, batch: &[u8], info: &BatchInfo, interval: u32, now_ms: u64) -> Result<()> {
        assert!(!self.sealed, "append to a sealed segment");
        assert!(info.base_offset >= self.content_end, "append below the segment's end");
        self.file.write_all_at(batch, self.size_bytes).map_err(Error::io("write", &self.path))?;
        if self.roll_anchor_ms.is_none() {
            self.roll_anchor_ms = Some(i64::try_from(now_ms).unwrap_or(i64::MAX));
        }
        let span = BatchSpan {
            base: info.base_offset,
            last: info.last_offset,
            max_timestamp_ms: info.max_timestamp_ms,
            size_bytes: batch.len() as u64,
        };
        self.note_batch(self.size_bytes, &span, interval);
        self.last_batch = Some((self.size_bytes, batch_crc(batch)));
        self.size_bytes += batch.len() as u64;
        Ok(())
    }

    /// fsyncs the data of the file.
    pub(crate) fn sync(&self) -> Result<()> {
        self.file.sync_data().map_err(Error::io("fsync", &self.path))
    }

    /// Syncs the file, writes the seek file and marks the segment sealed.
    pub(crate) fn seal(&mut self, interval: u32) -> Result<()> {
        self.sync()?;
        self.write_seek_file(interval)?;
        self.sealed = true;
        Ok(())
    }

    /// Positional read of exactly `buf.len()` bytes.
    pub(crate) fn read_exact_at(&self, position: u64, buf: &mut [u8]) -> Result<()> {
        self.file.read_exact_at(buf, position).map_err(Error::io("read", &self.path))
    }

    /// Finds the batch containing `offset`, or the first batch after it
    /// (`offset` in a compacted gap). `None` if no batch ends at or after
    /// `offset` in this segment.
    ///
    /// The batch offsets walked must fit the segment (the crc does not cover
    /// a batch's base offset): the batch at a seek entry has exactly the
    /// entry's offset, every batch starts after the previous one and ends
    /// before the segment's end; otherwise [`Error::Corrupt`].
    pub(crate) fn locate(&self, offset: Offset, interval: u32) -> Result<Option<Located>> {
        let relative = u32::try_from(offset.saturating_sub(self.base_offset)).unwrap_or(u32::MAX);
        let entry = self.seek.floor(relative);
        let mut position = entry.map_or(0, |e| u64::from(e.position));
        let mut exact = entry.map(|e| self.base_offset + u64::from(e.relative_offset));
        let mut next_min = self.base_offset;
        // The batch holding `offset` ends by the next seek entry's batch: read up to that
        // batch's header (for the overlap check), or to the end, and at most one seek interval
        // and two headers (or 8 KiB).
        let region_end = self
            .seek
            .after(relative)
            .map_or(self.size_bytes, |e| (u64::from(e.position) + BATCH_HEADER_BYTES as u64).min(self.size_bytes));
        let window_bytes = region_end.saturating_sub(position).clamp(
            BATCH_HEADER_BYTES as u64,
            (u64::from(interval) + 2 * BATCH_HEADER_BYTES as u64).max(WINDOW_BYTES_MIN),
        );
        let mut window = Window::default();
        while position < self.size_bytes {
            let header = self.header_at(position, &mut window, window_bytes)?;
            self.check_batch_offsets(position, &header, exact.take(), next_min)?;
            if header.last_offset() >= offset {
                return Ok(Some(Located { position, header, window }));
            }
            next_min = header.last_offset() + 1;
            position += header.total_bytes() as u64;
        }
        Ok(None)
    }

    /// A batch read at `position` must start at `exact` (a seek entry's
    /// offset) or else at `next_min` or later, and end before the segment's
    /// end. The crc does not cover the base offset, so this is what catches
    /// a damaged one on read.
    pub(crate) fn check_batch_offsets(
        &self,
        position: u64,
        header: &BatchHeader,
        exact: Option<Offset>,
        next_min: Offset,
    ) -> Result<()> {
        let starts_right = exact.map_or(header.base_offset >= next_min, |e| header.base_offset == e);
        if starts_right && header.base_offset >= self.base_offset && header.last_offset() < self.content_end {
            return Ok(());
        }
        Err(self.corrupt(position, Error::malformed("batch offsets do not fit the segment", 0)))
    }

    /// The whole batch found by `locate`, crc checked, and not overlapping
    /// the next batch (whose header is read along with it).
    pub(crate) fn batch_bytes<'w>(&self, located: &'w mut Located) -> Result<&'w [u8]> {
        let (position, total) = (located.position, located.header.total_bytes());
        let with_next = (total + BATCH_HEADER_BYTES).min(self.size_bytes.saturating_sub(position) as usize);
        if located.window.slice(position, with_next).is_none() {
            located.window = self.read_window(position, with_next as u64)?;
        }
        let span = located
            .window
            .slice(position, with_next)
            .filter(|span| span.len() >= total)
            .ok_or_else(|| self.corrupt(position, Error::malformed("batch extends past the segment", 0)))?;
        let (bytes, next_head) = span.split_at(total);
        located.header.check_crc(bytes).map_err(|e| self.corrupt(position, e))?;
        self.check_next_start(position, located.header.last_offset(), next_head)?;
        Ok(bytes)
    }

    /// The batch after the one at `position` (whose last offset is `last`;
    /// `next_head` holds the bytes after it, if any) must start after it.
    pub(crate) fn check_next_start(&self, position: u64, last: Offset, next_head: &[u8]) -> Result<()> {
        if next_head.len() < BATCH_HEADER_BYTES {
            return Ok(());
        }
        match BatchHeader::parse(next_head) {
            Ok(next) if next.base_offset <= last => {
                Err(self.corrupt(position, Error::malformed("batch offsets overlap the next batch", 0)))
            }
            _ => Ok(()),
        }
    }

    /// Wraps a batch fault found at `position` with this file's context;
    /// I/O errors pass through.
    pub(crate) fn corrupt(&self, position: u64, error: Error) -> Error {
        match error {
            Error::Io { .. } | Error::Corrupt { .. } => error,
            error => Error::Corrupt {
                path: self.path.clone(),
                base_offset: self.base_offset,
                position,
                source: Box::new(error),
            },
        }
    }

    /// Cuts the file at `position` (a batch boundary) and rebuilds the state
    /// from the remaining batches. A file that is also linked elsewhere (a
    /// checkpoint) is copied first so the other link keeps its bytes.
    pub(crate) fn truncate_to(&mut self, dir: &Path, position: u64, interval: u32) -> Result<()> {
        if position < self.size_bytes {
            let links = self.file.metadata().map_err(Error::io("stat", &self.path))?.nlink();
            if links > 1 {
                self.copy_prefix(dir, position)?;
            } else {
                self.cut_file(position)?;
            }
        }
        if let ScanEnd::Invalid { position, error } = self.rebuild(interval)? {
            return Err(self.corrupt(position, error));
        }
        Ok(())
    }

    /// Makes the segment active again (after a truncate): its seek file is
    /// stale.
    pub(crate) fn unseal(&mut self, dir: &Path) -> Result<()> {
        files::remove_if_exists(&files::seek_path(dir, self.base_offset))?;
        self.sealed = false;
        self.roll_anchor_ms = self.first_batch_max_timestamp()?;
        Ok(())
    }

    /// Removes the segment's files (seek file first, then the log). The
    /// caller drops the segment from its list once this succeeded.
    pub(crate) fn delete(&self, dir: &Path) -> Result<()> {
        files::remove_if_exists(&files::seek_path(dir, self.base_offset))?;
        fs::remove_file(&self.path).map_err(Error::io("remove", &self.path))?;
        info!(base_offset = self.base_offset, "segment deleted");
        Ok(())
    }

    /// Writes the seek file via a temporary file and a rename, so a hard
    /// link of the old seek file (in a checkpoint) is never modified.
    pub(crate) fn write_seek_file(&self, interval: u32) -> Result<()> {
        let dir = self.path.parent().unwrap_or(Path::new("."));
        let bytes = self.seek.encode(&self.facts(), interval);
        files::write_atomic(&files::seek_path(dir, self.base_offset), &bytes)
    }

    /// A second handle to this sealed segment: the same file (a duplicated descriptor, so
    /// it keeps reading these bytes even after a rename replaces the path) and state.
    /// Compaction reads it without holding the log.
    pub(crate) fn read_view(&self) -> Result<Segment> {
        let file = self.file.try_clone().map_err(Error::io("duplicate handle of", &self.path))?;
        Ok(Segment {
            base_offset: self.base_offset,
            path: self.path.clone(),
            file,
            size_bytes: self.size_bytes,
            content_end: self.content_end,
            max_timestamp_ms: self.max_timestamp_ms,
            last_batch: self.last_batch,
            seek: self.seek.clone(),
            bytes_since_entry: self.bytes_since_entry,
            sealed: self.sealed,
            roll_anchor_ms: self.roll_anchor_ms,
        })
    }

    /// Which file this segment reads: (device, inode). A segment replaced by compaction or
    /// by a snapshot install reads another one.
    pub(crate) fn file_id(&self) -> Result<(u64, u64)> {
        let meta = self.file.metadata().map_err(Error::io("stat", &self.path))?;
        Ok((meta.dev(), meta.ino()))
    }

    /// Opens and scans `B.log.cleaned` (compaction output, fsynced) as a sealed segment and
    /// writes its seek file as `B.seek.cleaned.tmp` (fsynced); [`Segment::renamed_into_place`]
    /// once both have been renamed over `B.log` and `B.seek`.
    pub(crate) fn open_cleaned(dir: &Path, base_offset: Offset, interval: u32) -> Result<Segment> {
        let path = files::cleaned_path(dir, base_offset);
        let file = OpenOptions::new().read(true).write(true).open(&path).map_err(Error::io("open", &path))?;
        let mut segment = Segment::empty(base_offset, path, file);
        segment.sealed = true;
        if let ScanEnd::Invalid { position, error } = segment.rebuild(interval)? {
            return Err(segment.corrupt(position, error));
        }
        let staged = files::staged_seek_path(dir, base_offset);
        let mut out = File::create(&staged).map_err(Error::io("create", &staged))?;
        out.write_all(&segment.seek.encode(&segment.facts(), interval)).map_err(Error::io("write", &staged))?;
        out.sync_all().map_err(Error::io("fsync", &staged))?;
        Ok(segment)
    }

    /// After `B.log.cleaned` was renamed over `B.log`: the segment's own path.
    pub(crate) fn renamed_into_place(&mut self, dir: &Path) {
        self.path = files::segment_path(dir, self.base_offset);
    }

    fn empty(base_offset: Offset, path: PathBuf, file: File) -> Segment {
        Segment {
            base_offset,
            path,
            file,
            size_bytes: 0,
            content_end: base_offset,
            max_timestamp_ms: i64::MIN,
            last_batch: None,
            seek: SeekTable::default(),
            bytes_since_entry: 0,
            sealed: false,
            roll_anchor_ms: None,
        }
    }

    fn open_file(dir: &Path, base_offset: Offset) -> Result<Segment> {
        let path = files::segment_path(dir, base_offset);
        let file = OpenOptions::new().read(true).write(true).open(&path).map_err(Error::io("open", &path))?;
        Ok(Segment::empty(base_offset, path, file))
    }

    fn file_len(&self) -> Result<u64> {
        Ok(self.file.metadata().map_err(Error::io("stat", &self.path))?.len())
    }

    fn facts(&self) -> SegmentFacts {
        SegmentFacts {
            base_offset: self.base_offset,
            size_bytes: self.size_bytes,
            next_offset: self.content_end,
            max_timestamp_ms: self.max_timestamp_ms,
            last_batch: self.last_batch,
        }
    }

    fn reset_state(&mut self) {
        self.size_bytes = 0;
        self.content_end = self.base_offset;
        self.max_timestamp_ms = i64::MIN;
        self.last_batch = None;
        self.seek = SeekTable::default();
        self.bytes_since_entry = 0;
    }

    fn note_batch(&mut self, position: u64, header: &BatchSpan, interval: u32) {
        let BatchSpan { base, last, max_timestamp_ms, size_bytes } = *header;
        let relative = u32::try_from(base - self.base_offset);
        let position_u32 = u32::try_from(position);
        let due = self.seek.len() == 0 || self.bytes_since_entry >= u64::from(interval);
        if let (true, Ok(relative_offset), Ok(position)) = (due, relative, position_u32) {
            self.seek.push(SeekEntry { relative_offset, position });
            self.bytes_since_entry = 0;
        }
        self.bytes_since_entry += size_bytes;
        self.content_end = last + 1;
        self.max_timestamp_ms = self.max_timestamp_ms.max(max_timestamp_ms);
    }

    /// Rebuilds the in-memory state by scanning the whole file.
    fn rebuild(&mut self, interval: u32) -> Result<ScanEnd> {
        self.reset_state();
        let file_len = self.file_len()?;
        let mut reader = ChunkReader::default();
        let mut position = 0u64;
        let mut next_min = self.base_offset;
        while position < file_len {
            let (header, total) = match self.scan_one(&mut reader, position, file_len, next_min)? {
                Ok(found) => found,
                Err(error) => return Ok(ScanEnd::Invalid { position, error }),
            };
            let span = BatchSpan {
                base: header.base_offset,
                last: header.last_offset(),
                max_timestamp_ms: header.max_timestamp,
                size_bytes: total,
            };
            self.note_batch(position, &span, interval);
            self.last_batch = Some((position, header.crc));
            position += total;
            self.size_bytes = position;
            next_min = header.last_offset() + 1;
        }
        Ok(ScanEnd::Complete)
    }

    /// Reads and fully validates the batch at `position`. The outer error is
    /// I/O, the inner one a batch fault.
    fn scan_one(
        &self,
        reader: &mut ChunkReader,
        position: u64,
        file_len: u64,
        next_min: Offset,
    ) -> Result<Result<(BatchHeader, u64)>> {
        if file_len - position < BATCH_HEADER_BYTES as u64 {
            return Ok(Err(Error::malformed("truncated batch header", 0)));
        }
        let header = match BatchHeader::parse(reader.get(self, position, BATCH_HEADER_BYTES, file_len)?) {
            Ok(header) => header,
            Err(error) => return Ok(Err(error)),
        };
        let total = header.total_bytes();
        if file_len - position < total as u64 {
            return Ok(Err(Error::malformed("batch extends past the end of the segment", 0)));
        }
        if let Err(error) = validate_batch(reader.get(self, position, total, file_len)?) {
            return Ok(Err(error));
        }
        if header.base_offset < next_min {
            return Ok(Err(Error::malformed("batch offset below the previous batch or the segment base", 0)));
        }
        Ok(Ok((header, total as u64)))
    }

    fn header_at(&self, position: u64, window: &mut Window, window_bytes: u64) -> Result<BatchHeader> {
        if self.size_bytes - position < BATCH_HEADER_BYTES as u64 {
            return Err(self.corrupt(position, Error::malformed("truncated batch header", 0)));
        }
        if window.slice(position, BATCH_HEADER_BYTES).is_none() {
            *window = self.read_window(position, window_bytes)?;
        }
        let bytes = window.slice(position, BATCH_HEADER_BYTES).unwrap_or_default();
        let header = BatchHeader::parse(bytes).map_err(|e| self.corrupt(position, e))?;
        if (header.total_bytes() as u64) > self.size_bytes - position {
            return Err(self.corrupt(position, Error::malformed("batch extends past the end of the segment", 0)));
        }
        Ok(header)
    }

    fn read_window(&self, position: u64, len: u64) -> Result<Window> {
        let len = len.min(self.size_bytes - position) as usize;
        // A lookup reads one window: reuse this thread's last buffer rather than allocating
        // and zeroing a fresh one each time (`resize` zeroes only growth; the read overwrites).
        let mut bytes = SPARE_WINDOW.take();
        bytes.resize(len, 0);
        self.read_exact_at(position, &mut bytes)?;
        Ok(Window { start: position, bytes })
    }

    fn cut_file(&mut self, position: u64) -> Result<()> {
        self.file.set_len(position).map_err(Error::io("truncate", &self.path))?;
        self.file.sync_all().map_err(Error::io("fsync", &self.path))?;
        Ok(())
    }

    fn copy_prefix(&mut self, dir: &Path, position: u64) -> Result<()> {
        let tmp = files::tmp_path(&self.path);
        let mut out = File::create(&tmp).map_err(Error::io("create", &tmp))?;
        let mut reader = ChunkReader::default();
        let mut copied = 0u64;
        while copied < position {
            let len = (position - copied).min(SCAN_CHUNK_BYTES as u64) as usize;
            let bytes = reader.get(self, copied, len, position)?;
            out.write_all(bytes).map_err(Error::io("write", &tmp))?;
            copied += len as u64;
        }
        out.sync_all().map_err(Error::io("fsync", &tmp))?;
        fs::rename(&tmp, &self.path).map_err(Error::io("rename", &tmp))?;
        files::sync_dir(dir)?;
        let reopened = Segment::open_file(dir, self.base_offset)?;
        self.file = reopened.file;
        Ok(())
    }

    fn first_batch_max_timestamp(&self) -> Result<Option<i64>> {
        if self.is_empty() {
            return Ok(None);
        }
        let mut head = [0u8; BATCH_HEADER_BYTES];
        self.read_exact_at(0, &mut head)?;
        Ok(BatchHeader::parse(&head).ok().map(|h| h.max_timestamp))
    }

    /// Loads the seek file if it exactly describes the segment file.
    fn load_seek_file(&mut self) -> Result<bool> {
        let dir = self.path.parent().unwrap_or(Path::new("."));
        let seek_path = files::seek_path(dir, self.base_offset);
        let file_len = self.file_len()?;
        let bytes_max = SEEK_HEADER_BYTES as u64 + 8 * (file_len / BATCH_HEADER_BYTES as u64 + 1) + 4;
        let Some(bytes) = files::read_bounded(&seek_path, bytes_max)? else {
            return Ok(false);
        };
        let Some((facts, table)) = SeekTable::decode(&bytes) else {
            return Ok(false);
        };
        if facts.base_offset != self.base_offset || facts.size_bytes != file_len || !self.last_batch_matches(&facts)? {
            return Ok(false);
        }
        self.size_bytes = facts.size_bytes;
        self.content_end = facts.next_offset;
        self.max_timestamp_ms = facts.max_timestamp_ms;
        self.last_batch = facts.last_batch;
        self.seek = table;
        Ok(true)
    }

    fn last_batch_matches(&self, facts: &SegmentFacts) -> Result<bool> {
        let Some((position, crc)) = facts.last_batch else {
            return Ok(facts.size_bytes == 0 && facts.next_offset == self.base_offset);
        };
        if position.saturating_add(BATCH_HEADER_BYTES as u64) > facts.size_bytes {
            return Ok(false);
        }
        let mut head = [0u8; BATCH_HEADER_BYTES];
        self.read_exact_at(position, &mut head)?;
        let Ok(header) = BatchHeader::parse(&head) else {
            return Ok(false);
        };
        Ok(header.crc == crc
            && position + header.total_bytes() as u64 == facts.size_bytes
            && header.last_offset() + 1 == facts.next_offset)
    }
}

fn batch_crc(batch: &[u8]) -> u32 {
    BatchHeader::parse(batch).map_or(0, |h| h.crc)
}

/// Bytes read from a segment starting at `start`.
#[derive(Default)]
pub(crate) struct Window {
    start: u64,
    bytes: Vec<u8>,
}

thread_local! {
    /// The buffer of the last [`Window`] dropped on this thread.
    static SPARE_WINDOW: Cell<Vec<u8>> = const { Cell::new(Vec::new()) };
}

impl Drop for Window {
    fn drop(&mut self) {
        let capacity = self.bytes.capacity();
        if capacity > 0 && capacity <= WINDOW_KEEP_BYTES_MAX {
            SPARE_WINDOW.set(std::mem::take(&mut self.bytes));
        }
    }
}

impl Window {
    fn slice(&self, position: u64, len: usize) -> Option<&[u8]> {
        let from = usize::try_from(position.checked_sub(self.start)?).ok()?;
        self.bytes.get(from..from.checked_add(len)?)
    }
}

/// Sequential reads of a segment in large chunks.
pub(crate) struct ChunkReader {
    start: u64,
    bytes: Vec<u8>,
    chunk_bytes: usize,
}

impl Default for ChunkReader {
    fn default() -> ChunkReader {
        ChunkReader::with_chunk_bytes(SCAN_CHUNK_BYTES)
    }
}

impl ChunkReader {
    pub(crate) fn with_chunk_bytes(chunk_bytes: usize) -> ChunkReader {
        ChunkReader { start: 0, bytes: Vec::new(), chunk_bytes: chunk_bytes.max(BATCH_HEADER_BYTES) }
    }

    /// Bytes `[position, position + len)` of `segment`, which must lie below
    /// `end` (at most the file length).
    pub(crate) fn get(&mut self, segment: &Segment, position: u64, len: usize, end: u64) -> Result<&[u8]> {
        let cached = position >= self.start && position + len as u64 <= self.start + self.bytes.len() as u64;
        if !cached {
            let want = (len.max(self.chunk_bytes) as u64).min(end - position) as usize;
            self.bytes.resize(want, 0);
            self.start = position;
            segment.read_exact_at(position, &mut self.bytes)?;
        }
        let from = (position - self.start) as usize;
        Ok(&self.bytes[from..from + len])
    }

    pub(crate) fn clear(&mut self) {
        self.bytes.clear();
        self.start = 0;
    }
}
