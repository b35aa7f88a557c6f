//! The seek table: a sparse, in-memory offset -> position table per segment,
//! persisted as `{base_offset:020}.seek` when the segment is sealed.
//!
//! The file is derived data: it is rebuilt from the segment when it is
//! missing, fails its crc, or does not describe the segment file beside it.
//! Layout (big-endian, see `log/FORMAT.md`):
//!
//! ```text
//!  0  magic "LXSK"          4
//!  4  version = 1           1
//!  5  reserved = 0          3
//!  8  base_offset           8
//! 16  segment_bytes         8   length of the .log file described
//! 24  next_offset           8   last offset of the last batch + 1 (base if empty)
//! 32  max_timestamp_ms      8   i64::MIN if empty
//! 40  last_batch_position   8   u64::MAX if empty
//! 48  last_batch_crc        4   0 if empty
//! 52  interval_bytes        4   the seek interval used (informational)
//! 56  entry_count           4
//! 60  entries               8 x entry_count: relative_offset u32, position u32
//!  .  crc32c                4   over every byte before it
//! ```

use crate::Offset;

/// Facts about a segment's content recorded in its seek file.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct SegmentFacts {
    pub base_offset: Offset,
    pub size_bytes: u64,
    /// Last offset of the last batch + 1, or `base_offset` if empty.
    pub next_offset: Offset,
    pub max_timestamp_ms: i64,
    /// Position and stored crc of the last batch, if any.
    pub last_batch: Option<(u64, u32)>,
}

/// One seek entry: a batch starting at `position` whose base offset is
/// `segment base + relative_offset`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct SeekEntry {
    pub relative_offset: u32,
    pub position: u32,
}

/// The entries of one segment, increasing in both fields.
#[derive(Clone, Debug, Default)]
pub(crate) struct SeekTable {
    entries: Vec<SeekEntry>,
}

pub(crate) const SEEK_MAGIC: [u8; 4] = *b"LXSK";
pub(crate) const SEEK_VERSION: u8 = 1;
const MAGIC_POS: usize = 0;
const VERSION_POS: usize = MAGIC_POS + 4;
const BASE_OFFSET_POS: usize = VERSION_POS + 4;
const SEGMENT_BYTES_POS: usize = BASE_OFFSET_POS + 8;
const NEXT_OFFSET_POS: usize = SEGMENT_BYTES_POS + 8;
const MAX_TIMESTAMP_POS: usize = NEXT_OFFSET_POS + 8;
const LAST_BATCH_POSITION_POS: usize = MAX_TIMESTAMP_POS + 8;
const LAST_BATCH_CRC_POS: usize = LAST_BATCH_POSITION_POS + 8;
const INTERVAL_POS: usize = LAST_BATCH_CRC_POS + 4;
const ENTRY_COUNT_POS: usize = INTERVAL_POS + 4;
/// Size of the fixed seek file header.
pub(crate) const SEEK_HEADER_BYTES: usize = ENTRY_COUNT_POS + 4;
const ENTRY_BYTES: usize = 8;
const CRC_BYTES: usize = 4;
const _: () = assert!(SEEK_HEADER_BYTES == 60);

impl SeekTable {
    /// Adds an entry; entries must increase.
    pub(crate) fn push(&mut self, entry: SeekEntry) {
        if let Some(last) = self.entries.last() {
            assert!(
                entry.relative_offset > last.relative_offset && entry.position > last.position,
                "seek entries must increase"
            );
        }
        self.entries.push(entry);
    }

    /// The last entry whose relative offset is at most `relative_offset`.
    pub(crate) fn floor(&self, relative_offset: u32) -> Option<SeekEntry> {
        let index = self.entries.partition_point(|e| e.relative_offset <= relative_offset);
        index.checked_sub(1).map(|i| self.entries[i])
    }

    /// The first entry whose relative offset is above `relative_offset`.
    pub(crate) fn after(&self, relative_offset: u32) -> Option<SeekEntry> {
        let index = self.entries.partition_point(|e| e.relative_offset <= relative_offset);
        self.entries.get(index).copied()
    }

    pub(crate) fn len(&self) -> usize {
        self.entries.len()
    }

    /// Encodes the seek file for `facts`.
    pub(crate) fn encode(&self, facts: &SegmentFacts, interval_bytes: u32) -> Vec<u8> {
        let mut out = Vec::with_capacity(SEEK_HEADER_BYTES + self.entries.len() * ENTRY_BYTES + CRC_BYTES);
        out.extend_from_slice(&SEEK_MAGIC);
        out.extend_from_slice(&[SEEK_VERSION, 0, 0, 0]);
        out.extend_from_slice(&facts.base_offset.to_be_bytes());
        out.extend_from_slice(&facts.size_bytes.to_be_bytes());
        out.extend_from_slice(&facts.next_offset.to_be_bytes());
        out.extend_from_slice(&facts.max_timestamp_ms.to_be_bytes());
        let (last_position, last_crc) = facts.last_batch.unwrap_or((u64::MAX, 0));
        out.extend_from_slice(&last_position.to_be_bytes());
        out.extend_from_slice(&last_crc.to_be_bytes());
        out.extend_from_slice(&interval_bytes.to_be_bytes());
        out.extend_from_slice(&(self.entries.len() as u32).to_be_bytes());
        for entry in &self.entries {
            out.extend_from_slice(&entry.relative_offset.to_be_bytes());
            out.extend_from_slice(&entry.position.to_be_bytes());
        }
        let crc = crc32c::crc32c(&out);
        out.extend_from_slice(&crc.to_be_bytes());
        out
    }

    /// Decodes a seek file; `None` if it is not a well-formed v1 seek file
    /// (the caller then rebuilds it).
    pub(crate) fn decode(bytes: &[u8]) -> Option<(SegmentFacts, SeekTable)> {
        if bytes.len() < SEEK_HEADER_BYTES + CRC_BYTES
            || bytes[MAGIC_POS..MAGIC_POS + 4] != SEEK_MAGIC
            || bytes[VERSION_POS] != SEEK_VERSION
        {
            return None;
        }
        let (body, crc) = bytes.split_at(bytes.len() - CRC_BYTES);
        if crc32c::crc32c(body).to_be_bytes() != crc {
            return None;
        }
        let count = be_u32(body, ENTRY_COUNT_POS) as usize;
        if body.len() != SEEK_HEADER_BYTES + count.checked_mul(ENTRY_BYTES)? {
            return None;
        }
        let last_position = be_u64(body, LAST_BATCH_POSITION_POS);
        let facts = SegmentFacts {
            base_offset: be_u64(body, BASE_OFFSET_POS),
            size_bytes: be_u64(body, SEGMENT_BYTES_POS),
            next_offset: be_u64(body, NEXT_OFFSET_POS),
            max_timestamp_ms: be_u64(body, MAX_TIMESTAMP_POS) as i64,
            last_batch: (last_position != u64::MAX).then(|| (last_position, be_u32(body, LAST_BATCH_CRC_POS))),
        };
        let mut table = SeekTable::default();
        for chunk in body[SEEK_HEADER_BYTES..].chunks_exact(ENTRY_BYTES) {
            let entry = SeekEntry { relative_offset: be_u32(chunk, 0), position: be_u32(chunk, 4) };
            let increasing = table
                .entries
                .last()
                .is_none_or(|last| entry.relative_offset > last.relative_offset && entry.position > last.position);
            if !increasing || u64::from(entry.position) >= facts.size_bytes {
                return None;
            }
            table.entries.push(entry);
        }
        Some((facts, table))
    }
}

fn be_u32(bytes: &[u8], pos: usize) -> u32 {
    let mut out = [0u8; 4];
    out.copy_from_slice(&bytes[pos..pos + 4]);
    u32::from_be_bytes(out)
}

fn be_u64(bytes: &[u8], pos: usize) -> u64 {
    let mut out = [0u8; 8];
    out.copy_from_slice(&bytes[pos..pos + 8]);
    u64::from_be_bytes(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn encode_decode_round_trip_and_crc_is_checked() {
        let mut table = SeekTable::default();
        table.push(SeekEntry { relative_offset: 0, position: 0 });
        table.push(SeekEntry { relative_offset: 10, position: 4200 });
        let facts = SegmentFacts {
            base_offset: 7,
            size_bytes: 9000,
            next_offset: 30,
            max_timestamp_ms: 5,
            last_batch: Some((8000, 0xdead_beef)),
        };
        let bytes = table.encode(&facts, 4096);
        let (decoded, decoded_table) = SeekTable::decode(&bytes).expect("round trip");
        assert_eq!(decoded, facts);
        assert_eq!(decoded_table.entries, table.entries);
        assert_eq!(decoded_table.floor(9).map(|e| e.position), Some(0));
        assert_eq!(decoded_table.floor(10).map(|e| e.position), Some(4200));
        assert_eq!(decoded_table.after(9).map(|e| e.position), Some(4200), "the entry after a floor");
        assert_eq!(decoded_table.after(10), None, "nothing after the last entry");
        for i in 0..bytes.len() {
            let mut bad = bytes.clone();
            bad[i] ^= 1;
            assert!(SeekTable::decode(&bad).is_none(), "flip at {i} accepted");
        }
    }
}
