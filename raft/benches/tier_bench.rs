//! Tiered storage benchmarks (plain `main`, std::time::Instant). Run in release:
//! `cargo bench -p logdex-raft --bench tier_bench`. Results are recorded in
//! `raft/BENCHMARKS.md`, each next to a baseline measured in the same run:
//!
//! 1. lookup latency (p50/p99) of keys whose records are in remote segments (cached,
//!    opened), against the same lookups on a replica that holds the segments locally;
//! 2. a cold read of a remote segment (fetch from the store directory, size and CRC-32C
//!    check, batch scan on open), in MiB/s, against a raw `std::fs::read` of the same file;
//! 3. copying a sealed segment to the store (check, put with fsync), in MiB/s, against a
//!    raw file copy with fsync.
//!
//! `LOGDEX_BENCH_RECORDS` sets the records written (default 300,000, 100-byte values).

use std::hint::black_box;
use std::io::Write;
use std::path::Path;
use std::time::Duration;
use std::time::Instant;

use logdex_index::Index;
use logdex_index::IndexConfig;
use logdex_log::Compression;
use logdex_log::LogConfig;
use logdex_log::Record;
use logdex_raft::Error;
use logdex_raft::partition::AppliedState;
use logdex_raft::partition::Partition;
use logdex_raft::pb;
use logdex_raft::tier::TierStore;

type BenchResult<T = ()> = Result<T, Box<dyn std::error::Error>>;

const SEGMENT_BYTES: u64 = 16 << 20;
const LOOKUPS: usize = 100_000;
const BATCH: u64 = 100;
const COLD_ROUNDS: usize = 5;

fn record(i: u64, keys: u64) -> Record {
    Record {
        timestamp_ms: 1_700_000_000_000 + i as i64,
        key: Some(format!("key-{:08}", i % keys).into_bytes()),
        value: Some(vec![(i % 251) as u8; 100]),
        headers: Vec::new(),
    }
}

fn open(dir: &Path, store: &TierStore) -> BenchResult<Partition> {
    let index = Index::open(&dir.join("index"), IndexConfig::default())?;
    let config = LogConfig { segment_bytes: SEGMENT_BYTES, ..LogConfig::default() };
    let (p, _) = Partition::open_with_tier(3, 1 << 20, &dir.join("partition"), config, index, Some(store.clone()))?;
    Ok(p)
}

/// Writes `records` records over `records / 3` keys, then seals the last segment (a
/// snapshot rolls the log), so every record is in a sealed segment.
fn fill(p: &Partition, records: u64, snapshot: &Path) -> BenchResult {
    let mut state = AppliedState::default();
    for b in 0..records / BATCH {
        let batch: Vec<Record> = (b * BATCH..(b + 1) * BATCH).map(|i| record(i, records / 3)).collect();
        let log_id = logdex_raft::wire::log_id_from_pb(&pb::LogId { term: 1, index: b + 1 });
        state = AppliedState { applied: Some(log_id), ..AppliedState::default() };
        p.apply_batches(&mut [logdex_log::encode_batch(&batch, Compression::None)?], &state, 0)?;
    }
    std::fs::create_dir_all(snapshot)?;
    p.snapshot_to(snapshot, &state)?;
    Ok(())
}

fn percentile(sorted: &[Duration], q: f64) -> f64 {
    let i = ((sorted.len() as f64 - 1.0) * q).round() as usize;
    sorted.get(i).map_or(0.0, |d| d.as_secs_f64() * 1e6)
}

fn lookups(p: &Partition, keys: u64, label: &str) -> BenchResult<f64> {
    let mut samples = Vec::with_capacity(LOOKUPS);
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    for _ in 0..LOOKUPS {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let key = format!("key-{:08}", x % keys);
        let started = Instant::now();
        black_box(p.read_key(key.as_bytes())?);
        samples.push(started.elapsed());
    }
    samples.sort_unstable();
    let p50 = percentile(&samples, 0.5);
    println!("  {label}: lookup p50 {p50:.2} us, p99 {:.2} us", percentile(&samples, 0.99));
    Ok(p50)
}

#[tokio::main(flavor = "multi_thread", worker_threads = 1)]
async fn main() -> BenchResult {
    let records: u64 = std::env::var("LOGDEX_BENCH_RECORDS").ok().and_then(|v| v.parse().ok()).unwrap_or(300_000);
    let dir = tempfile::tempdir()?;
    println!(
        "logdex-raft tiered storage bench, {records} records of 100-byte values, data in {}",
        dir.path().display()
    );
    let store = TierStore::open(&dir.path().join("store").display().to_string())?;
    let local = open(&dir.path().join("local"), &store)?;
    let tiered = open(&dir.path().join("tiered"), &store)?;
    fill(&local, records, &dir.path().join("snap-local"))?;
    fill(&tiered, records, &dir.path().join("snap-tiered"))?;

    // Copy the sealed segments to the store, and the same bytes with a plain copy + fsync.
    let segments = tiered.tier_candidates();
    let bytes_total: u64 = segments.iter().map(|s| s.size_bytes).sum();
    let mib = bytes_total as f64 / (1 << 20) as f64;
    let started = Instant::now();
    for (i, s) in segments.iter().enumerate() {
        let dst = dir.path().join(format!("plain-{i}"));
        let mut file = std::fs::File::create(&dst)?;
        file.write_all(&std::fs::read(&s.path)?)?;
        file.sync_all()?;
    }
    let plain_copy = started.elapsed();
    let started = Instant::now();
    let mut remote = Vec::new();
    for s in &segments {
        let (r, copy) = tiered.tier_cache().copy_local(s, "bench", 0, 3)?;
        store.put_file(&r.object, copy, r.size_bytes).await?;
        tiered.apply_tier(&pb::TierCommand { kind: Some(pb::tier_command::Kind::Add(r.to_pb())), at_ms: 0 }, 1)?;
        remote.push(r);
    }
    let copy = started.elapsed();
    println!(
        "copy {} sealed segments ({mib:.0} MiB): {:.0} MiB/s; plain copy + fsync {:.0} MiB/s ({:.2}x)",
        segments.len(),
        mib / copy.as_secs_f64(),
        mib / plain_copy.as_secs_f64(),
        plain_copy.as_secs_f64() / copy.as_secs_f64()
    );
    let deleted = tiered.apply_local_retention(u64::MAX / 2, Some(0), None)?;
    println!("local retention deleted {deleted} local segments; the log starts at {}", tiered.log_start_offset());

    // Cold reads: every remote segment fetched, checked and opened, against reading the
    // objects' files raw (both from the page cache: the store is a local directory); the
    // median of COLD_ROUNDS rounds each. The cached copies are dropped before each round.
    let mut raw_reads = Vec::new();
    let mut fetches = Vec::new();
    for _ in 0..COLD_ROUNDS {
        let started = Instant::now();
        for r in &remote {
            black_box(std::fs::read(dir.path().join("store").join(&r.object))?);
        }
        raw_reads.push(started.elapsed());
        tiered.tier_cache().forget_below(u64::MAX)?;
        let started = Instant::now();
        for r in &remote {
            match tiered.read_records(r.base_offset, 1, 1 << 10) {
                Err(Error::TierMiss { segments, .. }) => {
                    for s in segments {
                        tiered.tier_cache().fetch(&s).await?;
                    }
                }
                other => {
                    other?;
                }
            }
        }
        fetches.push(started.elapsed());
    }
    raw_reads.sort_unstable();
    fetches.sort_unstable();
    let (raw_read, fetch) = (raw_reads[COLD_ROUNDS / 2], fetches[COLD_ROUNDS / 2]);
    println!(
        "cold read of {} remote segments, median of {COLD_ROUNDS}: {:.0} MiB/s (fetch, check, open); raw file read {:.0} MiB/s ({:.2}x)",
        remote.len(),
        mib / fetch.as_secs_f64(),
        mib / raw_read.as_secs_f64(),
        raw_read.as_secs_f64() / fetch.as_secs_f64()
    );

    let keys = records / 3;
    println!("lookups of {keys} keys at random, {LOOKUPS} each:");
    let base = lookups(&local, keys, "local segments (baseline)")?;
    // Warm: every remote segment open in the cache (at most 4 are kept).
    let warm = lookups(&tiered, keys, "remote segments, cached")?;
    println!("  remote / local p50: {:.2}x", warm / base);
    Ok(())
}
