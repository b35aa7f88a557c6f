//! `validate_batch` and `decode_batch` never panic on arbitrary bytes, and
//! any damage to the bytes the crc covers is an error.

use logdex_log::{Compression, Header, Record, decode_batch, encode_batch, validate_batch};
use proptest::prelude::*;

fn record() -> impl Strategy<Value = Record> {
    (
        any::<i64>(),
        proptest::option::of(proptest::collection::vec(any::<u8>(), 0..20)),
        proptest::option::of(proptest::collection::vec(any::<u8>(), 0..40)),
        proptest::collection::vec(
            ("[a-z]{0,4}", proptest::option::of(proptest::collection::vec(any::<u8>(), 0..4))),
            0..3,
        ),
    )
        .prop_map(|(timestamp_ms, key, value, headers)| Record {
            timestamp_ms,
            key,
            value,
            headers: headers.into_iter().map(|(key, value)| Header { key, value }).collect(),
        })
}

fn codec() -> impl Strategy<Value = Compression> {
    prop_oneof![Just(Compression::None), Just(Compression::Lz4), Just(Compression::Zstd)]
}

/// Gives random bytes a well-formed header and a correct crc, so the record
/// parser and the decompressors see them.
fn with_valid_header(mut bytes: Vec<u8>, attributes: u8, count: i32) -> Vec<u8> {
    bytes.resize(bytes.len().max(61), 0);
    let length = (bytes.len() - 12) as i32;
    bytes[8..12].copy_from_slice(&length.to_be_bytes());
    bytes[16] = 2;
    bytes[21..23].copy_from_slice(&i16::from(attributes & 0x3f).to_be_bytes());
    bytes[23..27].copy_from_slice(&count.max(1).saturating_sub(1).to_be_bytes());
    bytes[57..61].copy_from_slice(&count.to_be_bytes());
    bytes[0..8].copy_from_slice(&0u64.to_be_bytes());
    let crc = crc32c::crc32c(&bytes[21..]);
    bytes[17..21].copy_from_slice(&crc.to_be_bytes());
    bytes
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// Arbitrary bytes: an error or a valid batch, never a panic.
    #[test]
    fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..300)) {
        let _ = validate_batch(&bytes);
        let _ = decode_batch(&bytes);
    }

    /// Random records sections behind a correct header and crc: never a panic,
    /// and validate agrees with decode on uncompressed batches.
    #[test]
    fn random_records_sections_never_panic(
        body in proptest::collection::vec(any::<u8>(), 0..300),
        attributes in prop_oneof![Just(0u8), Just(3u8), Just(4u8), any::<u8>()],
        count in -2i32..40,
    ) {
        let mut bytes = vec![0u8; 61];
        bytes.extend(body);
        let batch = with_valid_header(bytes, attributes, count);
        let validated = validate_batch(&batch);
        let decoded = decode_batch(&batch);
        if attributes & 0x07 == 0 {
            prop_assert_eq!(validated.is_ok(), decoded.is_ok());
        }
    }

    /// Corrupted compressed sections behind a correct crc: never a panic.
    #[test]
    fn corrupted_compressed_sections_never_panic(
        records in proptest::collection::vec(record(), 1..5),
        codec in prop_oneof![Just(Compression::Lz4), Just(Compression::Zstd)],
        flips in proptest::collection::vec((any::<prop::sample::Index>(), 1u8..=255), 1..4),
    ) {
        let batch = encode_batch(&records, codec).map_err(|e| TestCaseError::fail(e.to_string()))?;
        let mut bytes = batch.clone();
        for (index, mask) in flips {
            let at = 61 + index.index(bytes.len() - 61);
            bytes[at] ^= mask;
        }
        let count = records.len() as i32;
        let bytes = with_valid_header(bytes, codec.id(), count);
        let _ = decode_batch(&bytes);
    }

    /// Encode then decode is the identity; any flip at or after the magic byte is an error.
    #[test]
    fn round_trip_and_flips_are_detected(
        records in proptest::collection::vec(record(), 1..6),
        codec in codec(),
        flip in any::<prop::sample::Index>(),
        mask in 1u8..=255,
    ) {
        let batch = encode_batch(&records, codec).map_err(|e| TestCaseError::fail(e.to_string()))?;
        let decoded = decode_batch(&batch).map_err(|e| TestCaseError::fail(e.to_string()))?;
        let expected: Vec<(u64, Record)> = (0..).zip(records).collect();
        prop_assert_eq!(decoded, expected);
        let at = flip.index(batch.len());
        let mut bad = batch.clone();
        bad[at] ^= mask;
        // Bytes 0..8 (base offset) and 12..16 (leader epoch) are outside the
        // crc (a base offset above i64::MAX is refused all the same); the
        // length field 8..12 must match the batch size.
        let covered = at >= 16 || (8..12).contains(&at) || (at == 0 && mask & 0x80 != 0);
        prop_assert_eq!(validate_batch(&bad).is_err(), covered, "flip at {}", at);
        prop_assert_eq!(decode_batch(&bad).is_err(), covered, "flip at {}", at);
        let truncated = &batch[..at];
        prop_assert!(validate_batch(truncated).is_err());
    }
}
