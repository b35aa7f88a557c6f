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
/// `group (u64 BE) | generation (u32 BE)` in front of every user key.
pub(crate) const DATA_PREFIX_BYTES: usize = GROUP_BYTES + GENERATION_BYTES;
pub(crate) const OFFSET_BYTES_MAX: usize = 8;

const _: () = assert!(GROUP_BYTES == size_of::<GroupId>());
const _: () = assert!(GENERATION_BYTES == size_of::<Generation>());
const _: () = assert!(OFFSET_BYTES_MAX == size_of::<Offset>());
const _: () = assert!(DATA_PREFIX_BYTES == 12);

/// Data keys up to this many bytes (prefix included) are built on the stack.
const INLINE_KEY_BYTES: usize = 128;

/// A data key `group | generation | user key`, on the stack when it is short.
pub(crate) enum DataKey {
    Inline { bytes: [u8; INLINE_KEY_BYTES], len: usize },
    Heap(Vec<u8>),
}

impl DataKey {
    pub(crate) fn new(group: GroupId, generation: Generation, key: &[u8]) -> Self {
        let len = DATA_PREFIX_BYTES + key.len();
        if len <= INLINE_KEY_BYTES {
            let mut bytes = [0u8; INLINE_KEY_BYTES];
            bytes[..DATA_PREFIX_BYTES].copy_from_slice(&data_prefix(group, generation));
            bytes[DATA_PREFIX_BYTES..len].copy_from_slice(key);
            Self::Inline { bytes, len }
        } else {
            Self::Heap(data_key_vec(group, generation, key))
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

/// The 12-byte prefix shared by all entries of one generation of one group.
pub(crate) fn data_prefix(group: GroupId, generation: Generation) -> [u8; DATA_PREFIX_BYTES] {
    let mut prefix = [0u8; DATA_PREFIX_BYTES];
    prefix[..GROUP_BYTES].copy_from_slice(&group.to_be_bytes());
    prefix[GROUP_BYTES..].copy_from_slice(&generation.to_be_bytes());
    prefix
}

/// A data key as an owned vector (for batches and ingestion).
pub(crate) fn data_key_vec(group: GroupId, generation: Generation, key: &[u8]) -> Vec<u8> {
    let mut vec = Vec::with_capacity(DATA_PREFIX_BYTES + key.len());
    vec.extend_from_slice(&data_prefix(group, generation));
    vec.extend_from_slice(key);
    vec
}

/// `(group, generation)` of a data key, `None` if it is shorter than the prefix.
pub(crate) fn decode_data_prefix(key: &[u8]) -> Option<(GroupId, Generation)> {
    let group = key.get(..GROUP_BYTES)?;
    let generation = key.get(GROUP_BYTES..DATA_PREFIX_BYTES)?;
    Some((GroupId::from_be_bytes(group.try_into().ok()?), Generation::from_be_bytes(generation.try_into().ok()?)))
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
        let a = DataKey::new(1, 2, b"zz");
        let b = DataKey::new(1, 3, b"aa");
        let c = DataKey::new(2, 1, b"");
        assert!(a.as_ref() < b.as_ref() && b.as_ref() < c.as_ref());
        assert_eq!(decode_data_prefix(a.as_ref()), Some((1, 2)));
        let long = vec![7u8; 500];
        let heap = DataKey::new(9, 9, &long);
        assert_eq!(heap.as_ref(), data_key_vec(9, 9, &long).as_slice());
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
