//! Sequential reading across segments: [`BatchCursor`] yields whole,
//! crc-checked batches; [`ScanIter`] decodes them into records.

use crate::Offset;
use crate::batch::{self, BATCH_HEADER_BYTES, BatchHeader, Record};
use crate::error::{Error, Result};
use crate::segment::{ChunkReader, Segment};

/// Walks the batches of a run of segments from a starting offset.
pub(crate) struct BatchCursor<'a> {
    segments: &'a [Segment],
    index: usize,
    position: u64,
    /// The lowest base offset the next batch may have (offsets increase).
    next_min: Offset,
    reader: ChunkReader,
}

/// One batch handed out by a cursor.
pub(crate) struct CursorBatch<'a, 'c> {
    pub segment: &'a Segment,
    pub position: u64,
    pub header: BatchHeader,
    pub bytes: &'c [u8],
}

impl<'a> BatchCursor<'a> {
    /// Positions the cursor at the batch containing `offset` (or the next
    /// one); `offset` must be at least the first segment's base offset.
    pub(crate) fn at(segments: &'a [Segment], offset: Offset, interval: u32, chunk_bytes: usize) -> Result<Self> {
        let index = segments.partition_point(|s| s.base_offset <= offset).saturating_sub(1);
        let (position, next_min) = match segments.get(index) {
            Some(segment) => match segment.locate(offset, interval)? {
                Some(located) => (located.position, located.header.base_offset),
                None => (segment.size_bytes(), segment.base_offset),
            },
            None => (0, 0),
        };
        Ok(BatchCursor { segments, index, position, next_min, reader: ChunkReader::with_chunk_bytes(chunk_bytes) })
    }

    /// Every batch of one segment, from its start.
    pub(crate) fn whole_segment(segment: &'a Segment, chunk_bytes: usize) -> Self {
        BatchCursor {
            segments: std::slice::from_ref(segment),
            index: 0,
            position: 0,
            next_min: segment.base_offset,
            reader: ChunkReader::with_chunk_bytes(chunk_bytes),
        }
    }

    /// The next whole batch, crc checked, its offsets above the previous
    /// batch's and inside its segment; `None` at the end.
    pub(crate) fn next_batch(&mut self) -> Result<Option<CursorBatch<'a, '_>>> {
        loop {
            let Some(segment) = self.segments.get(self.index) else {
                return Ok(None);
            };
            let size = segment.size_bytes();
            let position = self.position;
            if position >= size {
                self.index += 1;
                self.position = 0;
                self.reader.clear();
                continue;
            }
            if size - position < BATCH_HEADER_BYTES as u64 {
                return Err(segment.corrupt(position, Error::malformed("truncated batch header", 0)));
            }
            let head = self.reader.get(segment, position, BATCH_HEADER_BYTES, size)?;
            let header = BatchHeader::parse(head).map_err(|e| segment.corrupt(position, e))?;
            let total = header.total_bytes();
            if total as u64 > size - position {
                let error = Error::malformed("batch extends past the end of the segment", 0);
                return Err(segment.corrupt(position, error));
            }
            segment.check_batch_offsets(position, &header, None, self.next_min)?;
            self.next_min = header.last_offset() + 1;
            self.position = position + total as u64;
            // The next batch's header comes along, to check that it starts after this one.
            let with_next = (total + BATCH_HEADER_BYTES).min((size - position) as usize);
            let (bytes, next_head) = self.reader.get(segment, position, with_next, size)?.split_at(total);
            header.check_crc(bytes).map_err(|e| segment.corrupt(position, e))?;
            segment.check_next_start(position, header.last_offset(), next_head)?;
            return Ok(Some(CursorBatch { segment, position, header, bytes }));
        }
    }
}

/// Appends whole batches of `segment` from `position` to `out` until `out`
/// holds `max_bytes` (always at least one batch in all). Returns true when
/// the budget is used up, false when the segment ended first.
pub(crate) fn copy_batches(segment: &Segment, position: u64, max_bytes: usize, out: &mut Vec<u8>) -> Result<bool> {
    let size = segment.size_bytes();
    let start = out.len();
    let want = (max_bytes.saturating_sub(start) as u64).min(size - position) as usize;
    out.resize(start + want, 0);
    segment.read_exact_at(position, &mut out[start..])?;
    let mut end = start;
    while out.len() - end >= BATCH_HEADER_BYTES {
        let at = position + (end - start) as u64;
        let header = BatchHeader::parse(&out[end..end + BATCH_HEADER_BYTES]).map_err(|e| segment.corrupt(at, e))?;
        let total = header.total_bytes();
        if total > out.len() - end {
            break;
        }
        header.check_crc(&out[end..end + total]).map_err(|e| segment.corrupt(at, e))?;
        end += total;
    }
    out.truncate(end);
    if end == start && start == 0 && position < size {
        copy_one_batch(segment, position, out)?;
        return Ok(true);
    }
    let consumed = position + (end - start) as u64;
    Ok(consumed < size || out.len() >= max_bytes)
}

/// Appends the single batch at `position`, whatever its size.
fn copy_one_batch(segment: &Segment, position: u64, out: &mut Vec<u8>) -> Result<()> {
    let size = segment.size_bytes();
    if size - position < BATCH_HEADER_BYTES as u64 {
        return Err(segment.corrupt(position, Error::malformed("truncated batch header", 0)));
    }
    let mut head = [0u8; BATCH_HEADER_BYTES];
    segment.read_exact_at(position, &mut head)?;
    let header = BatchHeader::parse(&head).map_err(|e| segment.corrupt(position, e))?;
    let total = header.total_bytes();
    if total as u64 > size - position {
        let error = Error::malformed("batch extends past the end of the segment", 0);
        return Err(segment.corrupt(position, error));
    }
    let start = out.len();
    out.resize(start + total, 0);
    segment.read_exact_at(position, &mut out[start..])?;
    header.check_crc(&out[start..]).map_err(|e| segment.corrupt(position, e))
}

/// Iterator over decoded records from an offset to the end of the log.
pub(crate) struct ScanIter<'a> {
    cursor: Option<BatchCursor<'a>>,
    error: Option<Error>,
    from: Offset,
    pending: std::vec::IntoIter<(Offset, Record)>,
    scratch: Vec<u8>,
}

impl<'a> ScanIter<'a> {
    pub(crate) fn new(cursor: Result<Option<BatchCursor<'a>>>, from: Offset) -> ScanIter<'a> {
        let (cursor, error) = match cursor {
            Ok(cursor) => (cursor, None),
            Err(error) => (None, Some(error)),
        };
        ScanIter { cursor, error, from, pending: Vec::new().into_iter(), scratch: Vec::new() }
    }

    /// Decodes the next batch into `pending`; false at the end.
    fn refill(&mut self) -> Result<bool> {
        let Some(cursor) = self.cursor.as_mut() else {
            return Ok(false);
        };
        let Some(batch) = cursor.next_batch()? else {
            return Ok(false);
        };
        let from = self.from;
        let mut records = Vec::with_capacity(batch.header.record_count.clamp(0, 4096) as usize);
        let mut sink = |offset: Offset, record: Record| {
            if offset >= from {
                records.push((offset, record));
            }
            true
        };
        batch::decode_into(&batch.header, batch.bytes, &mut self.scratch, &mut sink)
            .map_err(|e| batch.segment.corrupt(batch.position, e))?;
        self.pending = records.into_iter();
        Ok(true)
    }
}

impl Iterator for ScanIter<'_> {
    type Item = Result<(Offset, Record)>;

    fn next(&mut self) -> Option<Self::Item> {
        loop {
            if let Some(item) = self.pending.next() {
                return Some(Ok(item));
            }
            if let Some(error) = self.error.take() {
                return Some(Err(error));
            }
            match self.refill() {
                Ok(true) => {}
                Ok(false) => {
                    self.cursor = None;
                    return None;
                }
                Err(error) => {
                    self.cursor = None;
                    return Some(Err(error));
                }
            }
        }
    }
}
