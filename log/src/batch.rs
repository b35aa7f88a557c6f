//! Kafka RecordBatch v2 (magic 2), byte for byte as Kafka's
//! `DefaultRecordBatch`: a 61-byte big-endian header followed by the records
//! section (varint records, optionally compressed as a whole).
//!
//! The CRC-32C covers the bytes from `attributes` to the end of the batch, so
//! the base offset (bytes 0..8) and the partition leader epoch (bytes 12..16)
//! can be rewritten without recomputing it. See `log/FORMAT.md`.

use crate::Offset;
use crate::compression::{self, DECOMPRESSED_BYTES_MAX};
use crate::error::{Error, Result};
use crate::record::{self, RecordIter};

/// Codec of a batch's records section (attribute bits 0..3).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Compression {
    None,
    Lz4,
    Zstd,
}

/// A record header: a UTF-8 key and an optional value.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Header {
    pub key: String,
    pub value: Option<Vec<u8>>,
}

/// One record. `value: None` is a tombstone.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Record {
    pub timestamp_ms: i64,
    pub key: Option<Vec<u8>>,
    pub value: Option<Vec<u8>>,
    pub headers: Vec<Header>,
}

/// What a validated batch header says.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BatchInfo {
    pub base_offset: Offset,
    /// `base_offset + last_offset_delta`; records may be missing below it
    /// after compaction.
    pub last_offset: Offset,
    pub record_count: u32,
    pub first_timestamp_ms: i64,
    pub max_timestamp_ms: i64,
    pub compression: Compression,
    /// Whole batch, header included.
    pub size_bytes: usize,
}

/// Encodes `records` as one batch with base offset 0, offset deltas
/// `0..n`, timestamp deltas relative to the first record, producer id,
/// epoch and base sequence -1, partition leader epoch -1, create-time
/// timestamps.
pub fn encode_batch(records: &[Record], compression: Compression) -> Result<Vec<u8>> {
    if records.is_empty() {
        return Err(Error::EmptyBatch);
    }
    let last_offset_delta = i32::try_from(records.len() - 1)
        .map_err(|_| Error::BatchTooLarge { size: records.len(), limit: i32::MAX as usize })?;
    let template = BatchTemplate {
        base_offset: 0,
        partition_leader_epoch: -1,
        attributes: i16::from(compression.id()),
        last_offset_delta,
        producer_id: -1,
        producer_epoch: -1,
        base_sequence: -1,
    };
    let numbered: Vec<(i32, &Record)> = (0..).zip(records.iter()).collect();
    encode_with(&template, &numbered)
}

/// Writes `base_offset` into bytes 0..8 of `batch`. The CRC does not cover
/// these bytes, so the batch stays valid.
///
/// # Panics
/// If `batch` is shorter than a batch header (callers validate first).
pub fn set_base_offset(batch: &mut [u8], base_offset: Offset) {
    assert!(batch.len() >= BATCH_HEADER_BYTES, "set_base_offset on a batch shorter than its header");
    batch[BASE_OFFSET_POS..BASE_OFFSET_POS + 8].copy_from_slice(&base_offset.to_be_bytes());
}

/// Writes the partition leader epoch (bytes 12..16), also outside the CRC.
///
/// # Panics
/// If `batch` is shorter than a batch header.
pub fn set_partition_leader_epoch(batch: &mut [u8], epoch: i32) {
    assert!(batch.len() >= BATCH_HEADER_BYTES, "set_partition_leader_epoch on a batch shorter than its header");
    batch[PARTITION_LEADER_EPOCH_POS..PARTITION_LEADER_EPOCH_POS + 4].copy_from_slice(&epoch.to_be_bytes());
}

/// Checks that `bytes` is exactly one whole batch: length field, magic,
/// CRC-32C, codec, counts and offset deltas consistent. For an uncompressed
/// batch every record is parsed (no allocation); a compressed records
/// section is only checked by [`decode_batch`] (and by `Log::append`).
pub fn validate_batch(bytes: &[u8]) -> Result<BatchInfo> {
    let header = BatchHeader::parse_whole(bytes)?;
    let compression = header.compression()?;
    if compression == Compression::None {
        walk_records(&header, &bytes[BATCH_HEADER_BYTES..], BATCH_HEADER_BYTES)?;
    } else if header.record_count as usize > DECOMPRESSED_BYTES_MAX / record::RECORD_BYTES_MIN {
        return Err(Error::malformed("record count exceeds the decompressed size bound", RECORD_COUNT_POS));
    }
    Ok(header.info(bytes.len()))
}

/// Validates and decodes a whole batch: absolute offsets and timestamps.
pub fn decode_batch(bytes: &[u8]) -> Result<Vec<(Offset, Record)>> {
    let header = BatchHeader::parse_whole(bytes)?;
    let mut scratch = Vec::new();
    let mut out = Vec::new();
    decode_into(&header, bytes, &mut scratch, &mut |offset, record| {
        out.push((offset, record));
        true
    })?;
    Ok(out)
}

// ---------------------------------------------------------------------------
// Layout. Each position is the previous position plus the previous size.

pub(crate) const BASE_OFFSET_POS: usize = 0;
pub(crate) const BATCH_LENGTH_POS: usize = BASE_OFFSET_POS + 8;
pub(crate) const PARTITION_LEADER_EPOCH_POS: usize = BATCH_LENGTH_POS + 4;
pub(crate) const MAGIC_POS: usize = PARTITION_LEADER_EPOCH_POS + 4;
pub(crate) const CRC_POS: usize = MAGIC_POS + 1;
pub(crate) const ATTRIBUTES_POS: usize = CRC_POS + 4;
pub(crate) const LAST_OFFSET_DELTA_POS: usize = ATTRIBUTES_POS + 2;
pub(crate) const FIRST_TIMESTAMP_POS: usize = LAST_OFFSET_DELTA_POS + 4;
pub(crate) const MAX_TIMESTAMP_POS: usize = FIRST_TIMESTAMP_POS + 8;
pub(crate) const PRODUCER_ID_POS: usize = MAX_TIMESTAMP_POS + 8;
pub(crate) const PRODUCER_EPOCH_POS: usize = PRODUCER_ID_POS + 8;
pub(crate) const BASE_SEQUENCE_POS: usize = PRODUCER_EPOCH_POS + 2;
pub(crate) const RECORD_COUNT_POS: usize = BASE_SEQUENCE_POS + 4;
/// Size of the fixed batch header (Kafka's `RECORD_BATCH_OVERHEAD`).
pub const BATCH_HEADER_BYTES: usize = RECORD_COUNT_POS + 4;
/// Bytes not counted by the batch length field: base offset + length.
pub(crate) const LOG_OVERHEAD_BYTES: usize = BATCH_LENGTH_POS + 4;
/// The CRC covers `[CRC_COVERED_FROM, end)`.
pub(crate) const CRC_COVERED_FROM: usize = ATTRIBUTES_POS;

const MAGIC_V2: i8 = 2;
const CODEC_MASK: i16 = 0x07;
const TIMESTAMP_TYPE_LOG_APPEND: i16 = 0x08;
const CONTROL_FLAG: i16 = 0x20;

const _: () = assert!(BATCH_HEADER_BYTES == 61);
const _: () = assert!(LOG_OVERHEAD_BYTES == 12);
const _: () = assert!(CRC_COVERED_FROM == 21);

// ---------------------------------------------------------------------------

impl Compression {
    /// The attribute codec id (0 none, 3 lz4, 4 zstd).
    pub fn id(self) -> u8 {
        match self {
            Compression::None => 0,
            Compression::Lz4 => 3,
            Compression::Zstd => 4,
        }
    }

    /// The codec of attribute id `id`, if logdex writes it.
    pub fn from_id(id: u8) -> Option<Compression> {
        match id {
            0 => Some(Compression::None),
            3 => Some(Compression::Lz4),
            4 => Some(Compression::Zstd),
            _ => None,
        }
    }

    fn from_attributes(attributes: i16) -> Result<Compression> {
        match (attributes & CODEC_MASK) as u8 {
            0 => Ok(Compression::None),
            3 => Ok(Compression::Lz4),
            4 => Ok(Compression::Zstd),
            codec => Err(Error::UnsupportedCompression { codec }),
        }
    }
}

/// The fixed header fields, parsed without interpretation.
#[derive(Clone, Copy, Debug)]
pub(crate) struct BatchHeader {
    pub base_offset: Offset,
    pub batch_length: i32,
    pub partition_leader_epoch: i32,
    pub magic: i8,
    pub crc: u32,
    pub attributes: i16,
    pub last_offset_delta: i32,
    pub first_timestamp: i64,
    pub max_timestamp: i64,
    pub producer_id: i64,
    pub producer_epoch: i16,
    pub base_sequence: i32,
    pub record_count: i32,
}

impl BatchHeader {
    /// Parses the first [`BATCH_HEADER_BYTES`] of `bytes` and checks the
    /// fields that do not need the rest of the batch. Does not check crc.
    pub(crate) fn parse(bytes: &[u8]) -> Result<BatchHeader> {
        if bytes.len() < BATCH_HEADER_BYTES {
            return Err(Error::malformed("shorter than a batch header", bytes.len()));
        }
        let header = BatchHeader {
            base_offset: u64::from_be_bytes(field(bytes, BASE_OFFSET_POS)),
            batch_length: i32::from_be_bytes(field(bytes, BATCH_LENGTH_POS)),
            partition_leader_epoch: i32::from_be_bytes(field(bytes, PARTITION_LEADER_EPOCH_POS)),
            magic: bytes[MAGIC_POS] as i8,
            crc: u32::from_be_bytes(field(bytes, CRC_POS)),
            attributes: i16::from_be_bytes(field(bytes, ATTRIBUTES_POS)),
            last_offset_delta: i32::from_be_bytes(field(bytes, LAST_OFFSET_DELTA_POS)),
            first_timestamp: i64::from_be_bytes(field(bytes, FIRST_TIMESTAMP_POS)),
            max_timestamp: i64::from_be_bytes(field(bytes, MAX_TIMESTAMP_POS)),
            producer_id: i64::from_be_bytes(field(bytes, PRODUCER_ID_POS)),
            producer_epoch: i16::from_be_bytes(field(bytes, PRODUCER_EPOCH_POS)),
            base_sequence: i32::from_be_bytes(field(bytes, BASE_SEQUENCE_POS)),
            record_count: i32::from_be_bytes(field(bytes, RECORD_COUNT_POS)),
        };
        header.check()?;
        Ok(header)
    }

    /// Parses a header and checks that `bytes` is exactly this batch with a
    /// matching crc.
    pub(crate) fn parse_whole(bytes: &[u8]) -> Result<BatchHeader> {
        let header = BatchHeader::parse(bytes)?;
        if header.total_bytes() != bytes.len() {
            return Err(Error::malformed("batch length field does not match the batch size", BATCH_LENGTH_POS));
        }
        header.check_crc(bytes)?;
        Ok(header)
    }

    fn check(&self) -> Result<()> {
        let min_length = (BATCH_HEADER_BYTES - LOG_OVERHEAD_BYTES) as i32;
        if self.batch_length < min_length {
            return Err(Error::malformed("batch length smaller than the header", BATCH_LENGTH_POS));
        }
        if self.magic != MAGIC_V2 {
            return Err(Error::UnsupportedMagic { magic: self.magic });
        }
        self.compression()?;
        if self.record_count < 0 {
            return Err(Error::malformed("negative record count", RECORD_COUNT_POS));
        }
        if self.last_offset_delta < 0 || self.last_offset_delta < self.record_count - 1 {
            return Err(Error::malformed("last offset delta below record count", LAST_OFFSET_DELTA_POS));
        }
        if self.base_offset.checked_add(self.last_offset_delta as u64).is_none_or(|last| last > i64::MAX as u64) {
            return Err(Error::malformed("last offset beyond i64::MAX", BASE_OFFSET_POS));
        }
        Ok(())
    }

    /// Checks the crc of a whole batch (`bytes.len() == total_bytes()`).
    pub(crate) fn check_crc(&self, bytes: &[u8]) -> Result<()> {
        let actual = crc32c::crc32c(&bytes[CRC_COVERED_FROM..]);
        if actual != self.crc {
            return Err(Error::CrcMismatch { expected: self.crc, actual });
        }
        Ok(())
    }

    /// Size of the whole batch. Valid after `check`.
    pub(crate) fn total_bytes(&self) -> usize {
        self.batch_length as usize + LOG_OVERHEAD_BYTES
    }

    pub(crate) fn compression(&self) -> Result<Compression> {
        Compression::from_attributes(self.attributes)
    }

    pub(crate) fn last_offset(&self) -> Offset {
        self.base_offset + self.last_offset_delta as u64
    }

    fn is_log_append_time(&self) -> bool {
        self.attributes & TIMESTAMP_TYPE_LOG_APPEND != 0
    }

    pub(crate) fn info(&self, size_bytes: usize) -> BatchInfo {
        BatchInfo {
            base_offset: self.base_offset,
            last_offset: self.last_offset(),
            record_count: self.record_count as u32,
            first_timestamp_ms: self.first_timestamp,
            max_timestamp_ms: self.max_timestamp,
            compression: Compression::from_attributes(self.attributes).unwrap_or(Compression::None),
            size_bytes,
        }
    }

    fn write(&self, out: &mut [u8]) {
        out[BASE_OFFSET_POS..][..8].copy_from_slice(&self.base_offset.to_be_bytes());
        out[BATCH_LENGTH_POS..][..4].copy_from_slice(&self.batch_length.to_be_bytes());
        out[PARTITION_LEADER_EPOCH_POS..][..4].copy_from_slice(&self.partition_leader_epoch.to_be_bytes());
        out[MAGIC_POS] = self.magic as u8;
        out[CRC_POS..][..4].copy_from_slice(&self.crc.to_be_bytes());
        out[ATTRIBUTES_POS..][..2].copy_from_slice(&self.attributes.to_be_bytes());
        out[LAST_OFFSET_DELTA_POS..][..4].copy_from_slice(&self.last_offset_delta.to_be_bytes());
        out[FIRST_TIMESTAMP_POS..][..8].copy_from_slice(&self.first_timestamp.to_be_bytes());
        out[MAX_TIMESTAMP_POS..][..8].copy_from_slice(&self.max_timestamp.to_be_bytes());
        out[PRODUCER_ID_POS..][..8].copy_from_slice(&self.producer_id.to_be_bytes());
        out[PRODUCER_EPOCH_POS..][..2].copy_from_slice(&self.producer_epoch.to_be_bytes());
        out[BASE_SEQUENCE_POS..][..4].copy_from_slice(&self.base_sequence.to_be_bytes());
        out[RECORD_COUNT_POS..][..4].copy_from_slice(&self.record_count.to_be_bytes());
    }

    /// The fields a re-encoded (compacted) batch keeps from this one.
    pub(crate) fn template(&self) -> BatchTemplate {
        BatchTemplate {
            base_offset: self.base_offset,
            partition_leader_epoch: self.partition_leader_epoch,
            attributes: self.attributes,
            last_offset_delta: self.last_offset_delta,
            producer_id: self.producer_id,
            producer_epoch: self.producer_epoch,
            base_sequence: self.base_sequence,
        }
    }
}

fn field<const N: usize>(bytes: &[u8], pos: usize) -> [u8; N] {
    let mut out = [0u8; N];
    out.copy_from_slice(&bytes[pos..pos + N]);
    out
}

/// Header fields chosen by the writer; the rest follow from the records.
pub(crate) struct BatchTemplate {
    pub base_offset: Offset,
    pub partition_leader_epoch: i32,
    pub attributes: i16,
    pub last_offset_delta: i32,
    pub producer_id: i64,
    pub producer_epoch: i16,
    pub base_sequence: i32,
}

/// Encodes records with explicit offset deltas (strictly increasing, at most
/// `template.last_offset_delta`). Used by `encode_batch` and compaction.
pub(crate) fn encode_with(template: &BatchTemplate, records: &[(i32, &Record)]) -> Result<Vec<u8>> {
    let first = records.first().ok_or(Error::EmptyBatch)?.1;
    let first_timestamp = first.timestamp_ms;
    let max_timestamp = records.iter().map(|(_, r)| r.timestamp_ms).max().unwrap_or(first_timestamp);
    let mut payload = Vec::new();
    for (offset_delta, record) in records {
        let timestamp_delta = record.timestamp_ms.wrapping_sub(first_timestamp);
        record::put_record(&mut payload, *offset_delta, timestamp_delta, record)?;
    }
    let codec = Compression::from_attributes(template.attributes)?;
    let body = compression::compress(codec, &payload)?;
    let too_large =
        || Error::BatchTooLarge { size: body.len().saturating_add(BATCH_HEADER_BYTES), limit: i32::MAX as usize };
    let batch_length = i32::try_from(body.len() + BATCH_HEADER_BYTES - LOG_OVERHEAD_BYTES).map_err(|_| too_large())?;
    let header = BatchHeader {
        base_offset: template.base_offset,
        batch_length,
        partition_leader_epoch: template.partition_leader_epoch,
        magic: MAGIC_V2,
        crc: 0,
        attributes: template.attributes,
        last_offset_delta: template.last_offset_delta,
        first_timestamp,
        max_timestamp,
        producer_id: template.producer_id,
        producer_epoch: template.producer_epoch,
        base_sequence: template.base_sequence,
        record_count: i32::try_from(records.len()).map_err(|_| too_large())?,
    };
    let mut out = vec![0u8; BATCH_HEADER_BYTES];
    header.write(&mut out);
    out.extend_from_slice(&body);
    let crc = crc32c::crc32c(&out[CRC_COVERED_FROM..]);
    out[CRC_POS..CRC_POS + 4].copy_from_slice(&crc.to_be_bytes());
    Ok(out)
}

/// Parses every record of a records section without allocating: counts,
/// framing, offset deltas, header keys' UTF-8. `at` locates errors.
pub(crate) fn walk_records(header: &BatchHeader, payload: &[u8], at: usize) -> Result<()> {
    if header.record_count as usize > payload.len() / record::RECORD_BYTES_MIN {
        return Err(Error::malformed("record count exceeds the records section", RECORD_COUNT_POS));
    }
    for view in RecordIter::new(header, payload, at) {
        view?;
    }
    Ok(())
}

/// Decompresses and walks the records of a compressed whole batch (a no-op
/// for an uncompressed one, which `validate_batch` already walked).
pub(crate) fn validate_compressed_records(bytes: &[u8]) -> Result<()> {
    let header = BatchHeader::parse(bytes)?;
    if header.compression()? == Compression::None {
        return Ok(());
    }
    let mut scratch = Vec::new();
    let payload = records_section(&header, bytes, &mut scratch)?;
    walk_records(&header, payload, 0)
}

/// Whether the batch is a control batch (transaction markers), attribute
/// bit 5; compaction keeps those unchanged.
pub(crate) fn is_control(header: &BatchHeader) -> bool {
    header.attributes & CONTROL_FLAG != 0
}

/// The records section of a whole, checked batch: borrowed when
/// uncompressed, else decompressed into `scratch`.
pub(crate) fn records_section<'a>(header: &BatchHeader, bytes: &'a [u8], scratch: &'a mut Vec<u8>) -> Result<&'a [u8]> {
    let body = &bytes[BATCH_HEADER_BYTES..];
    match header.compression()? {
        Compression::None => Ok(body),
        codec => {
            compression::decompress(codec, body, scratch)?;
            Ok(scratch.as_slice())
        }
    }
}

/// Decodes the records of a whole, checked batch, calling `sink` with each
/// absolute offset and record until it returns false.
pub(crate) fn decode_into(
    header: &BatchHeader,
    bytes: &[u8],
    scratch: &mut Vec<u8>,
    sink: &mut dyn FnMut(Offset, Record) -> bool,
) -> Result<()> {
    let payload = records_section(header, bytes, scratch)?;
    let at = if header.compression()? == Compression::None { BATCH_HEADER_BYTES } else { 0 };
    if header.record_count as usize > payload.len() / record::RECORD_BYTES_MIN {
        return Err(Error::malformed("record count exceeds the records section", RECORD_COUNT_POS));
    }
    for view in RecordIter::new(header, payload, at) {
        let view = view?;
        let record = view.to_record(record_timestamp(header, view.timestamp_delta))?;
        if !sink(header.base_offset + view.offset_delta as u64, record) {
            break;
        }
    }
    Ok(())
}

/// Finds the record at exactly `offset` in a whole, checked batch.
pub(crate) fn find_record(
    header: &BatchHeader,
    bytes: &[u8],
    scratch: &mut Vec<u8>,
    offset: Offset,
) -> Result<Option<Record>> {
    let Some(delta) = offset.checked_sub(header.base_offset) else {
        return Ok(None);
    };
    let payload = records_section(header, bytes, scratch)?;
    let at = if header.compression()? == Compression::None { BATCH_HEADER_BYTES } else { 0 };
    for view in RecordIter::new(header, payload, at) {
        let view = view?;
        let view_delta = view.offset_delta as u64;
        if view_delta == delta {
            return view.to_record(record_timestamp(header, view.timestamp_delta)).map(Some);
        }
        if view_delta > delta {
            break;
        }
    }
    Ok(None)
}

fn record_timestamp(header: &BatchHeader, timestamp_delta: i64) -> i64 {
    if header.is_log_append_time() {
        header.max_timestamp
    } else {
        header.first_timestamp.wrapping_add(timestamp_delta)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(i: i64) -> Record {
        Record {
            timestamp_ms: 1_000 + i,
            key: Some(format!("k{i}").into_bytes()),
            value: if i % 3 == 0 { None } else { Some(vec![i as u8; i as usize]) },
            headers: vec![Header { key: "h".into(), value: Some(b"v".to_vec()) }],
        }
    }

    #[test]
    fn round_trip_every_codec() -> Result<()> {
        let records: Vec<Record> = (0..20).map(record).collect();
        for codec in [Compression::None, Compression::Lz4, Compression::Zstd] {
            let mut batch = encode_batch(&records, codec)?;
            set_base_offset(&mut batch, 100);
            let info = validate_batch(&batch)?;
            assert_eq!((info.base_offset, info.last_offset, info.record_count), (100, 119, 20));
            assert_eq!(info.compression, codec);
            let decoded = decode_batch(&batch)?;
            let expected: Vec<(Offset, Record)> = (100..).zip(records.iter().cloned()).collect();
            assert_eq!(decoded, expected);
        }
        Ok(())
    }

    #[test]
    fn every_flipped_covered_byte_is_detected() -> Result<()> {
        let batch = encode_batch(&[record(1), record(2)], Compression::None)?;
        for i in MAGIC_POS..batch.len() {
            let mut bad = batch.clone();
            bad[i] ^= 0x10;
            assert!(validate_batch(&bad).is_err(), "flip at {i} not detected");
            assert!(decode_batch(&bad).is_err(), "flip at {i} not detected");
        }
        Ok(())
    }
}
