//! The content of the v1 format fixtures, shared by the generator
//! (`examples/gen_fixtures.rs`) and `tests/format_fixtures.rs`.

use logdex_log::{Compression, Header, Record};

fn record(timestamp_ms: i64, key: Option<&str>, value: Option<&str>, headers: &[(&str, Option<&str>)]) -> Record {
    Record {
        timestamp_ms,
        key: key.map(|k| k.as_bytes().to_vec()),
        value: value.map(|v| v.as_bytes().to_vec()),
        headers: headers
            .iter()
            .map(|(k, v)| Header { key: (*k).to_owned(), value: v.map(|v| v.as_bytes().to_vec()) })
            .collect(),
    }
}

/// Batches of the sealed segment `00000000000000000000.log` (offsets 0..=6).
pub fn sealed_batches() -> Vec<(Compression, Vec<Record>)> {
    vec![
        (
            Compression::None,
            vec![
                record(1_700_000_000_000, Some("user:1"), Some("alice"), &[("source", Some("signup"))]),
                record(1_700_000_000_005, Some("user:2"), Some("bob"), &[]),
                record(1_700_000_000_009, Some("user:3"), Some("carol"), &[("trace", None), ("v", Some("1"))]),
            ],
        ),
        (
            Compression::Lz4,
            vec![
                record(1_700_000_001_000, Some("user:1"), Some("alice smith"), &[]),
                record(1_700_000_001_001, Some("user:2"), None, &[]),
            ],
        ),
        (
            Compression::Zstd,
            vec![
                record(1_700_000_002_000, None, Some("no key"), &[]),
                record(1_699_999_999_999, Some("user:4"), Some("dave"), &[("h", Some("x"))]),
            ],
        ),
    ]
}

/// Batches of the active segment `00000000000000000007.log` (offsets 7..=8).
pub fn active_batches() -> Vec<(Compression, Vec<Record>)> {
    vec![(
        Compression::None,
        vec![
            record(1_700_000_003_000, Some("user:5"), Some("erin"), &[]),
            record(1_700_000_003_001, Some("user:1"), None, &[]),
        ],
    )]
}

/// Every fixture record with its offset.
pub fn all_records() -> Vec<(u64, Record)> {
    let records = sealed_batches().into_iter().chain(active_batches()).flat_map(|(_, records)| records);
    (0..).zip(records).collect()
}

/// Index of the batch (in the sealed segment) whose records section gets a
/// flipped byte in `corrupt_sealed/`, and the offset into that batch.
pub const CORRUPT_BATCH: usize = 1;
pub const CORRUPT_BYTE_IN_BATCH: usize = 64;

/// The seek interval the fixtures were written with (an entry per batch).
pub const FIXTURE_SEEK_INTERVAL_BYTES: u32 = 0;
