//! The batch codec against byte sequences produced by other Kafka
//! implementations and against a batch built field by field.
//!
//! The record-batch vectors are the ones of the Sarama Kafka client's
//! `record_test.go` (`recordBatchTestCases`), which Sarama checks against
//! Kafka brokers; the CRC-32C check value is the one of RFC 3720 / the
//! Castagnoli catalogue.

use logdex_log::{Compression, Error, Header, Record, decode_batch, encode_batch, set_base_offset, validate_batch};

type TestResult = Result<(), Box<dyn std::error::Error>>;

/// The common 61-byte header of the Sarama vectors with the given length, crc and attributes.
fn sarama_header(length: u8, crc: [u8; 4], attributes: u8, first_timestamp: [u8; 8], count: u8) -> Vec<u8> {
    let mut out = vec![0, 0, 0, 0, 0, 0, 0, 0]; // base offset
    out.extend([0, 0, 0, length]); // batch length
    out.extend([0, 0, 0, 0]); // partition leader epoch
    out.push(2); // magic
    out.extend(crc);
    out.extend([0, attributes]);
    out.extend([0, 0, 0, 0]); // last offset delta
    out.extend(first_timestamp);
    out.extend([0; 8]); // max timestamp
    out.extend([0; 8]); // producer id
    out.extend([0, 0]); // producer epoch
    out.extend([0, 0, 0, 0]); // base sequence
    out.extend([0, 0, 0, count]); // record count
    out
}

const SARAMA_TIMESTAMP: [u8; 8] = [0, 0, 1, 88, 141, 205, 89, 56];

/// The single record of the Sarama "uncompressed record" vector, uncompressed bytes.
const SARAMA_RECORD: [u8; 21] = [40, 0, 10, 0, 8, 1, 2, 3, 4, 6, 5, 6, 7, 2, 6, 8, 9, 10, 4, 11, 12];

fn sarama_record() -> Record {
    Record {
        timestamp_ms: 1_479_847_795_005,
        key: Some(vec![1, 2, 3, 4]),
        value: Some(vec![5, 6, 7]),
        headers: vec![Header { key: "\u{8}\u{9}\u{a}".into(), value: Some(vec![11, 12]) }],
    }
}

/// CRC-32C of "123456789" is the catalogue check value 0xE3069283.
#[test]
fn crc32c_check_value() {
    assert_eq!(crc32c::crc32c(b"123456789"), 0xE306_9283);
}

/// Empty and control batches written by Sarama pass the crc, length and magic checks.
#[test]
fn empty_and_control_batch_vectors_validate() -> TestResult {
    let empty = sarama_header(49, [89, 95, 183, 221], 0, [0; 8], 0);
    let info = validate_batch(&empty)?;
    assert_eq!((info.record_count, info.size_bytes, info.last_offset), (0, 61, 0));
    assert_eq!(decode_batch(&empty)?, Vec::new());
    let control = sarama_header(49, [81, 46, 67, 217], 32, [0; 8], 0);
    validate_batch(&control)?;
    let mut wrong = empty.clone();
    wrong[20] ^= 1;
    assert!(matches!(validate_batch(&wrong), Err(Error::CrcMismatch { expected: 0x595F_B7DC, actual: 0x595F_B7DD })));
    Ok(())
}

/// Sarama's uncompressed and lz4 batches decode to the same record (lz4 frame with content checksum).
#[test]
fn uncompressed_and_lz4_record_vectors_decode() -> TestResult {
    let mut uncompressed = sarama_header(70, [84, 121, 97, 253], 0, SARAMA_TIMESTAMP, 1);
    uncompressed.extend(SARAMA_RECORD);
    assert_eq!(decode_batch(&uncompressed)?, vec![(0, sarama_record())]);
    let mut lz4 = sarama_header(89, [169, 74, 119, 197], 3, SARAMA_TIMESTAMP, 1);
    lz4.extend([4, 34, 77, 24, 100, 112, 185, 21, 0, 0, 128]);
    lz4.extend(SARAMA_RECORD);
    lz4.extend([0, 0, 0, 0, 12, 59, 239, 146]);
    assert_eq!(validate_batch(&lz4)?.compression, Compression::Lz4);
    assert_eq!(decode_batch(&lz4)?, vec![(0, sarama_record())]);
    Ok(())
}

/// Sarama's gzip and snappy batches are refused as unsupported codecs 1 and 2.
#[test]
fn gzip_and_snappy_vectors_are_unsupported() -> TestResult {
    let mut gzip = sarama_header(95, [231, 74, 206, 165], 1, SARAMA_TIMESTAMP, 1);
    gzip.extend([
        31, 139, 8, 0, 0, 9, 110, 136, 0, 255, 0, 21, 0, 234, 255, 40, 0, 10, 0, 8, 1, 2, 3, 4, 6, 5, 6, 7, 2, 6, 8, 9,
        10, 4, 11, 12, 3, 0, 173, 201, 88, 103, 21, 0, 0, 0,
    ]);
    assert!(matches!(validate_batch(&gzip), Err(Error::UnsupportedCompression { codec: 1 })));
    assert!(matches!(decode_batch(&gzip), Err(Error::UnsupportedCompression { codec: 1 })));
    let mut snappy = sarama_header(72, [21, 0, 159, 97], 2, SARAMA_TIMESTAMP, 1);
    snappy.extend([21, 80]);
    snappy.extend(SARAMA_RECORD);
    assert!(matches!(validate_batch(&snappy), Err(Error::UnsupportedCompression { codec: 2 })));
    Ok(())
}

/// `encode_batch` output equals a batch assembled by hand, field by field, per Kafka's DefaultRecordBatch.
#[test]
fn encode_matches_a_batch_built_field_by_field() -> TestResult {
    let records = [
        Record {
            timestamp_ms: 1_000,
            key: Some(b"ab".to_vec()),
            value: Some(b"xyz".to_vec()),
            headers: vec![Header { key: "h".into(), value: None }],
        },
        Record { timestamp_ms: 1_064, key: None, value: None, headers: Vec::new() },
    ];
    let mut records_section = Vec::new();
    // Record 0: attributes 0, ts delta 0, offset delta 0, key "ab", value "xyz", 1 header "h" with null value.
    let body0 = [0u8, 0x00, 0x00, 0x04, b'a', b'b', 0x06, b'x', b'y', b'z', 0x02, 0x02, b'h', 0x01];
    records_section.push((body0.len() as u8) << 1);
    records_section.extend(body0);
    // Record 1: ts delta 64 (zigzag 128 = 0x80 0x01), offset delta 1, null key, null value, no headers.
    let body1 = [0u8, 0x80, 0x01, 0x02, 0x01, 0x01, 0x00];
    records_section.push((body1.len() as u8) << 1);
    records_section.extend(body1);

    let mut expected = Vec::new();
    expected.extend(7u64.to_be_bytes()); // base offset (set below)
    expected.extend(((61 - 12 + records_section.len()) as i32).to_be_bytes()); // batch length
    expected.extend((-1i32).to_be_bytes()); // partition leader epoch
    expected.push(2); // magic
    expected.extend([0; 4]); // crc, filled below
    expected.extend(0i16.to_be_bytes()); // attributes: no codec, create time
    expected.extend(1i32.to_be_bytes()); // last offset delta
    expected.extend(1_000i64.to_be_bytes()); // first timestamp
    expected.extend(1_064i64.to_be_bytes()); // max timestamp
    expected.extend((-1i64).to_be_bytes()); // producer id
    expected.extend((-1i16).to_be_bytes()); // producer epoch
    expected.extend((-1i32).to_be_bytes()); // base sequence
    expected.extend(2i32.to_be_bytes()); // record count
    expected.extend(&records_section);
    let crc = crc32c::crc32c(&expected[21..]);
    expected[17..21].copy_from_slice(&crc.to_be_bytes());

    let mut batch = encode_batch(&records, Compression::None)?;
    set_base_offset(&mut batch, 7);
    assert_eq!(batch, expected);
    let decoded = decode_batch(&batch)?;
    assert_eq!(decoded, vec![(7, records[0].clone()), (8, records[1].clone())]);
    Ok(())
}

/// Rewriting the base offset or the partition leader epoch keeps the crc valid.
#[test]
fn base_offset_and_leader_epoch_are_outside_the_crc() -> TestResult {
    let mut batch = encode_batch(&[sarama_record()], Compression::Zstd)?;
    set_base_offset(&mut batch, u32::MAX as u64);
    logdex_log::set_partition_leader_epoch(&mut batch, 42);
    let info = validate_batch(&batch)?;
    assert_eq!(info.base_offset, u32::MAX as u64);
    assert_eq!(decode_batch(&batch)?[0].1, sarama_record());
    Ok(())
}
