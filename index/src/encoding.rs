//! Byte layouts of the data and meta keyspaces (specified in `FORMAT.md`).
//!
//! Sizes are built from per-field constants and checked at compile time.

use crate::{AppliedMarker, GroupId, Offset};

/// Version byte stored under [`META_FORMAT_VERSION_KEY`]; bump on any layout change.
pub(crate) const FORMAT_VERSION: u8 = 1;

/// A generation number: a node-wide counter, never reused on a node.
pub(crate) type Generation = u32;
/// "No generation": the group holds no entries.
pub(crate) const NO_GENERATION: Generation = 0;
/// First generation handed out on a fresh index.
pub(crate) const FIRST_GENERATION: Generation = 1;

pub(crate) const GROUP_BYTES: usize = 8;
pub(crate) const GENERATION_BYTES: usize = 4;
/// Longest data key prefix: `len | group` and `len | generation`, each a
/// length byte followed by the number's shortest big-endian bytes.
pub(crate) const DATA_PREFIX_BYTES_MAX: usize = 1 + GROUP_BYTES + 1 + GENERATION_BYTES;
pub(crate) const OFFSET_BYTES_MAX: usize = 8;

const _: () = assert!(GROUP_BYTES == size_of::<GroupId>());
const _: () = assert!(GENERATION_BYTES == size_of::<Generation>());
const _: () = assert!(OFFSET_BYTES_MAX == size_of::<Offset>());
const _: () = assert!(DATA_PREFIX_BYTES_MAX == 14);

/// Data keys up to this many bytes (prefix included) are built on the stack.
const INLINE_KEY_BYTES: usize = 128;

/// A data key `prefix(group, generation) | user key`, on the stack when short.
pub(crate) enum DataKey {
    Inline { bytes: [u8; INLINE_KEY_BYTES], len: usize },
    Heap(Vec<u8>),
}

impl DataKey {
    pub(crate) fn new(group: GroupId, generation: Generation, key: &[u8]) -> Self {
        let prefix = DataPrefix::new(group, generation);
        let prefix = prefix.as_ref();
        let len = prefix.len() + key.len();
        if len <= INLINE_KEY_BYTES {
            let mut bytes = [0u8; INLINE_KEY_BYTES];
            bytes[..prefix.len()].copy_from_slice(prefix);
            bytes[prefix.len()..len].copy_from_slice(key);
            Self::Inline { bytes, len }
        } else {
            let mut vec = Vec::with_capacity(len);
            vec.extend_from_slice(prefix);
            vec.extend_from_slice(key);
            Self::Heap(vec)
        }
    }
}

impl AsRef<[u8]> for DataKey {
    fn as_ref(&self) -> &[u8] {
        match self {
            Self::Inline { bytes, len } => &bytes[..*len],
            Self::Heap(vec) => vec,
        }
    }
}

/// The prefix shared by all entries of one generation of one group:
/// `len (u8) | group (len bytes, BE) | len (u8) | generation (len bytes, BE)`
/// with each number in its shortest form (at least one byte).
///
/// Shorter numbers have a smaller length byte, so prefixes sort by
/// `(group, generation)`, and the prefix delimits itself. Small numbers keep
/// short user keys within fjall's 20-byte inline key size.
#[derive(Clone, Copy)]
pub(crate) struct DataPrefix {
    bytes: [u8; DATA_PREFIX_BYTES_MAX],
    len: usize,
}

impl DataPrefix {
    pub(crate) fn new(group: GroupId, generation: Generation) -> Self {
        let mut bytes = [0u8; DATA_PREFIX_BYTES_MAX];
        let mut len = push_shortest(&mut bytes, 0, &group.to_be_bytes());
        len = push_shortest(&mut bytes, len, &generation.to_be_bytes());
        Self { bytes, len }
    }
}

impl AsRef<[u8]> for DataPrefix {
    fn as_ref(&self) -> &[u8] {
        &self.bytes[..self.len]
    }
}

/// Writes `len | shortest bytes of big_endian` at `at`; returns the new end.
fn push_shortest(out: &mut [u8; DATA_PREFIX_BYTES_MAX], at: usize, big_endian: &[u8]) -> usize {
    let leading_zeros = big_endian.iter().take_while(|byte| **byte == 0).count();
    let digits = &big_endian[leading_zeros.min(big_endian.len() - 1)..];
    out[at] = digits.len() as u8;
    out[at + 1..at + 1 + digits.len()].copy_from_slice(digits);
    at + 1 + digits.len()
}

/// Reads `len | bytes` (1..=`max` bytes) from the front of `input`.
fn read_shortest(input: &[u8], max: usize) -> Option<(u64, &[u8])> {
    let (&len, rest) = input.split_first()?;
    let len = usize::from(len);
    if len == 0 || len > max {
        return None;
    }
    let digits = rest.get(..len)?;
    let value = digits.iter().fold(0u64, |acc, byte| (acc << 8) | u64::from(*byte));
    Some((value, rest.get(len..)?))
}

/// `(group, generation)` of a data key, `None` if its prefix does not decode.
pub(crate) fn decode_data_prefix(key: &[u8]) -> Option<(GroupId, Generation)> {
    let (group, rest) = read_shortest(key, GROUP_BYTES)?;
    let (generation, _) = read_shortest(rest, GENERATION_BYTES)?;
    Some((group, Generation::try_from(generation).ok()?))
}

/// An offset as the shortest big-endian byte string (1 to 8 bytes).
pub(crate) struct OffsetBytes {
    bytes: [u8; OFFSET_BYTES_MAX],
    start: usize,
}

impl AsRef<[u8]> for OffsetBytes {
    fn as_ref(&self) -> &[u8] {
        &self.bytes[self.start..]
    }
}

pub(crate) fn encode_offset(offset: Offset) -> OffsetBytes {
    let bytes = offset.to_be_bytes();
    let leading_zero_bytes = (offset.leading_zeros() / 8) as usize;
    // Offset 0 still takes one byte: an entry's value is never empty.
    let start = leading_zero_bytes.min(OFFSET_BYTES_MAX - 1);
    OffsetBytes { bytes, start }
}

/// Decodes a data value; `None` unless it is 1 to 8 bytes long.
pub(crate) fn decode_offset(value: &[u8]) -> Option<Offset> {
    if value.is_empty() || value.len() > OFFSET_BYTES_MAX {
        return None;
    }
    Some(value.iter().fold(0u64, |acc, byte| (acc << 8) | u64::from(*byte)))
}

/// Meta key tag of node-wide records.
const META_TAG_GLOBAL: u8 = 0x00;
/// Meta key tag of per-group records.
const META_TAG_GROUP: u8 = 0x01;

/// Prefix of all per-group meta records.
pub(crate) const META_GROUP_PREFIX: [u8; 1] = [META_TAG_GROUP];
/// `[0x00, 'V']` -> `[FORMAT_VERSION]`.
pub(crate) const META_FORMAT_VERSION_KEY: [u8; 2] = [META_TAG_GLOBAL, b'V'];
/// `[0x00, 'G']` -> next generation to hand out (u32 BE).
pub(crate) const META_NEXT_GENERATION_KEY: [u8; 2] = [META_TAG_GLOBAL, b'G'];

pub(crate) const GROUP_META_KEY_BYTES: usize = 1 + GROUP_BYTES + 1;

/// The per-group records of the meta keyspace.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub(crate) enum GroupRecord {
    /// Live generation (u32 BE). Present iff the group exists.
    Generation = 0x01,
    /// `next_offset (u64 BE) | key_estimate (u64 BE) | state bytes`.
    Applied = 0x02,
    /// Cleanup watermark (u64 BE).
    Watermark = 0x03,
}

impl GroupRecord {
    pub(crate) const ALL: [Self; 3] = [Self::Generation, Self::Applied, Self::Watermark];

    fn from_byte(byte: u8) -> Option<Self> {
        Self::ALL.into_iter().find(|record| *record as u8 == byte)
    }
}

pub(crate) fn group_meta_key(group: GroupId, record: GroupRecord) -> [u8; GROUP_META_KEY_BYTES] {
    let mut key = [0u8; GROUP_META_KEY_BYTES];
    key[0] = META_TAG_GROUP;
    key[1..=GROUP_BYTES].copy_from_slice(&group.to_be_bytes());
    key[GROUP_META_KEY_BYTES - 1] = record as u8;
    key
}

/// `(group, record)` of a per-group meta key; `None` for node-wide keys.
/// `Some(Err(len))` for a per-group key that does not decode.
pub(crate) fn decode_group_meta_key(key: &[u8]) -> Option<Result<(GroupId, GroupRecord), usize>> {
    if key.first() != Some(&META_TAG_GROUP) {
        return None;
    }
    let decoded = (|| {
        if key.len() != GROUP_META_KEY_BYTES {
            return None;
        }
        let group = GroupId::from_be_bytes(key.get(1..=GROUP_BYTES)?.try_into().ok()?);
        let record = GroupRecord::from_byte(*key.last()?)?;
        Some((group, record))
    })();
    Some(decoded.ok_or(key.len()))
}

pub(crate) fn encode_u32(value: u32) -> [u8; 4] {
    value.to_be_bytes()
}

pub(crate) fn decode_u32(value: &[u8]) -> Option<u32> {
    Some(u32::from_be_bytes(value.try_into().ok()?))
}

pub(crate) fn encode_u64(value: u64) -> [u8; 8] {
    value.to_be_bytes()
}

pub(crate) fn decode_u64(value: &[u8]) -> Option<u64> {
    Some(u64::from_be_bytes(value.try_into().ok()?))
}

const APPLIED_HEADER_BYTES: usize = 8 + 8;

/// `next_offset (u64 BE) | key_estimate (u64 BE) | state`.
pub(crate) fn encode_applied(marker: &AppliedMarker, key_estimate: u64) -> Vec<u8> {
    let mut value = Vec::with_capacity(APPLIED_HEADER_BYTES + marker.state.len());
    value.extend_from_slice(&marker.next_offset.to_be_bytes());
    value.extend_from_slice(&key_estimate.to_be_bytes());
    value.extend_from_slice(&marker.state);
    value
}

/// `(marker, key_estimate)`; `None` if shorter than the 16-byte header.
pub(crate) fn decode_applied(value: &[u8]) -> Option<(AppliedMarker, u64)> {
    let next_offset = decode_u64(value.get(..8)?)?;
    let key_estimate = decode_u64(value.get(8..APPLIED_HEADER_BYTES)?)?;
    let state = value.get(APPLIED_HEADER_BYTES..)?.to_vec();
    Some((AppliedMarker { state, next_offset }, key_estimate))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Golden bytes: these layouts are FORMAT.md version 1 and must not change
    /// without bumping `FORMAT_VERSION`.
    #[test]
    fn format_v1_golden_bytes() {
        assert_eq!(DataKey::new(1, 1, b"k").as_ref(), [1, 1, 1, 1, b'k']);
        assert_eq!(DataKey::new(0x0102, 0x03, b"ab").as_ref(), [2, 1, 2, 1, 3, b'a', b'b']);
        assert_eq!(DataKey::new(0, 0x0100_0000, b"").as_ref(), [1, 0, 4, 1, 0, 0, 0]);
        assert_eq!(encode_offset(0x0102).as_ref(), [1, 2]);
        assert_eq!(encode_offset(0).as_ref(), [0]);
        assert_eq!(META_FORMAT_VERSION_KEY, [0x00, b'V']);
        assert_eq!(META_NEXT_GENERATION_KEY, [0x00, b'G']);
        assert_eq!(group_meta_key(0x0102, GroupRecord::Generation), [1, 0, 0, 0, 0, 0, 0, 1, 2, 1]);
        assert_eq!(group_meta_key(0x0102, GroupRecord::Applied), [1, 0, 0, 0, 0, 0, 0, 1, 2, 2]);
        assert_eq!(group_meta_key(0x0102, GroupRecord::Watermark), [1, 0, 0, 0, 0, 0, 0, 1, 2, 3]);
        let marker = AppliedMarker { state: vec![0xAA], next_offset: 5 };
        assert_eq!(encode_applied(&marker, 3), [0, 0, 0, 0, 0, 0, 0, 5, 0, 0, 0, 0, 0, 0, 0, 3, 0xAA]);
        assert_eq!(FORMAT_VERSION, 1);
    }

    #[test]
    fn offsets_round_trip_in_shortest_form() {
        for (offset, len) in
            [(0u64, 1usize), (1, 1), (255, 1), (256, 2), (999_999, 3), (u64::from(u32::MAX), 4), (u64::MAX, 8)]
        {
            let encoded = encode_offset(offset);
            assert_eq!(encoded.as_ref().len(), len, "offset {offset}");
            assert_eq!(decode_offset(encoded.as_ref()), Some(offset));
        }
        assert_eq!(decode_offset(&[]), None);
        assert_eq!(decode_offset(&[0; 9]), None);
    }

    #[test]
    fn data_keys_sort_by_group_then_generation_then_key() {
        let ordered = [
            DataKey::new(0, 1, b"zz"),
            DataKey::new(1, 2, b"zz"),
            DataKey::new(1, 3, b"aa"),
            DataKey::new(1, 256, b""),
            DataKey::new(2, 1, b""),
            DataKey::new(255, u32::MAX, b"z"),
            DataKey::new(256, 1, b""),
            DataKey::new(u64::MAX, 1, b""),
        ];
        for pair in ordered.windows(2) {
            assert!(pair[0].as_ref() < pair[1].as_ref());
        }
        assert_eq!(DataKey::new(1, 1, b"k-0000001").as_ref().len(), 13);
        assert_eq!(decode_data_prefix(ordered[3].as_ref()), Some((1, 256)));
        assert_eq!(decode_data_prefix(ordered[7].as_ref()), Some((u64::MAX, 1)));
        let long = vec![7u8; 500];
        let heap = DataKey::new(300, 9, &long);
        assert_eq!(heap.as_ref().len(), 3 + 2 + 500);
        assert_eq!(decode_data_prefix(heap.as_ref()), Some((300, 9)));
        assert_eq!(decode_data_prefix(&[0]), None);
        assert_eq!(decode_data_prefix(&[9, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1]), None);
        assert_eq!(decode_data_prefix(&[1, 1, 5, 1, 1, 1, 1, 1]), None);
    }

    #[test]
    fn group_meta_keys_round_trip() {
        for record in GroupRecord::ALL {
            let key = group_meta_key(u64::MAX - 1, record);
            assert_eq!(decode_group_meta_key(&key), Some(Ok((u64::MAX - 1, record))));
        }
        assert_eq!(decode_group_meta_key(&META_NEXT_GENERATION_KEY), None);
        assert_eq!(decode_group_meta_key(&[META_TAG_GROUP, 1]), Some(Err(2)));
    }

    #[test]
    fn applied_marker_round_trips() {
        let marker = AppliedMarker { state: b"raft".to_vec(), next_offset: 42 };
        assert_eq!(decode_applied(&encode_applied(&marker, 7)), Some((marker, 7)));
        assert_eq!(decode_applied(&[0; 15]), None);
    }
}
