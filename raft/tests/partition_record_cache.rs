//! Lookups through the record cache answer exactly what the segment log answers: the
//! latest record of a key after overwrites, nothing after a tombstone, and "removed by
//! retention" for a key whose record a trim dropped, though the cache still holds it.

use std::path::Path;

use logdex_index::Index;
use logdex_index::IndexConfig;
use logdex_log::Compression;
use logdex_log::LogConfig;
use logdex_log::Record;
use logdex_raft::partition::KeyRead;
use logdex_raft::partition::Partition;
use logdex_raft::pb;
use logdex_raft::record_cache::RecordCache;

mod common;

type TestResult = Result<(), Box<dyn std::error::Error>>;

/// Distinct keys; records cycle through them, so every key is overwritten.
const KEYS: u64 = 10;

fn open(dir: &Path, records: Option<RecordCache>) -> Result<Partition, Box<dyn std::error::Error>> {
    let index = Index::open(&dir.join("index"), IndexConfig::default())?;
    let config = LogConfig { segment_bytes: 500, retention_ms: Some(1), ..LogConfig::default() };
    let (p, _) = Partition::open(3, 1 << 20, &dir.join("partition"), config, index)?;
    Ok(match records {
        Some(records) => p.with_record_cache(records),
        None => p,
    })
}

fn apply(p: &Partition, record: Record, entry: u64) -> TestResult {
    let mut batch = [logdex_log::encode_batch(&[record], Compression::None)?];
    p.apply_batches(&mut batch, &common::applied(entry), 0)?;
    Ok(())
}

/// Every key read from `cached` answers as from `plain`; returns the answers.
fn same_answers(cached: &Partition, plain: &Partition, phase: &str) -> Result<Vec<String>, Box<dyn std::error::Error>> {
    let mut answers = Vec::new();
    for k in 0..KEYS + 2 {
        let key = format!("k{k}").into_bytes();
        let (from_cache, _) = cached.read_key_at(&key)?;
        let (from_log, _) = plain.read_key_at(&key)?;
        let (from_cache, from_log) = (format!("{from_cache:?}"), format!("{from_log:?}"));
        assert_eq!(from_cache, from_log, "{phase}: key k{k}");
        answers.push(from_cache);
    }
    Ok(answers)
}

#[test]
fn lookups_through_the_record_cache_follow_overwrites_tombstones_and_retention() -> TestResult {
    let (dir_a, dir_b) = (tempfile::tempdir()?, tempfile::tempdir()?);
    let cache = RecordCache::new(1 << 20);
    let cached = open(dir_a.path(), Some(cache.clone()))?;
    let plain = open(dir_b.path(), None)?;
    let mut entry = 0;
    for i in 0..60 {
        entry += 1;
        for p in [&cached, &plain] {
            apply(p, common::record(i, KEYS), entry)?;
        }
    }
    let first = same_answers(&cached, &plain, "after 60 writes over 10 keys")?;
    assert!(first[..KEYS as usize].iter().all(|a| a.starts_with("Found")), "{first:?}");
    let (hits, _) = cache.hits_and_misses();
    assert!(hits >= KEYS, "the records just applied were served from the cache ({hits} hits)");

    // Six more writes (k0 to k5), so that the trim below leaves some keys' latest records.
    for i in 60..66 {
        entry += 1;
        for p in [&cached, &plain] {
            apply(p, common::record(i, KEYS), entry)?;
        }
    }

    // A tombstone: the cache still holds the key's last record, the index no longer points at it.
    entry += 1;
    for p in [&cached, &plain] {
        let tombstone = Record { timestamp_ms: 1, key: Some(b"k3".to_vec()), value: None, headers: Vec::new() };
        apply(p, tombstone, entry)?;
    }
    let answers = same_answers(&cached, &plain, "after deleting k3")?;
    assert!(matches!(cached.read_key_at(b"k3")?.0, KeyRead::NotFound), "{answers:?}");

    // A trim past some keys' latest records: they are removed by retention, not found in the cache.
    // Every record but the newest (record 65, in the active segment) is past retention.
    let cut = cached.retention_cut(1_700_000_000_066)?.ok_or("sealed segments past retention")?;
    let trim = pb::TierCommand { kind: Some(pb::tier_command::Kind::TrimTo(cut)), at_ms: 0 };
    entry += 1;
    for p in [&cached, &plain] {
        p.apply_tier(&trim, entry)?;
    }
    let (hits_before, _) = cache.hits_and_misses();
    let answers = same_answers(&cached, &plain, "after a trim")?;
    let evicted = answers.iter().filter(|a| a.starts_with("Evicted")).count();
    let found = answers.iter().filter(|a| a.starts_with("Found")).count();
    assert!(evicted > 0, "keys whose latest record is below the trim read as removed (cut {cut}): {answers:?}");
    assert!(found > 0, "keys whose latest record is above the trim are found (cut {cut}): {answers:?}");
    assert!(
        cache.hits_and_misses().0 > hits_before,
        "the keys above the trim are still served from the cache (cut {cut}): {answers:?}"
    );
    Ok(())
}
