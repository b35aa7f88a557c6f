//! Log benchmarks (plain `main`, std::time::Instant). Run in release:
//! `cargo bench -p logdex-log`. Results are recorded in `log/BENCHMARKS.md`.
//!
//! 1. append MB/s: 1 KiB records in 64 KiB batches, fsync every 16 batches
//!    (1 MiB), against raw `write` of the same bytes to a plain file with
//!    the same fsync cadence;
//! 2. read_record latency (p50/p99/p999) at random offsets, on the log of
//!    (1) and on a log of single-record batches of 100-byte values (the
//!    key-value PUT shape);
//! 3. scan records/s over 100-byte records in batches of 100;
//! 4. appends beside a compaction pass: the latency of single-record appends
//!    through a lock shared with a compaction of about 150 MiB of sealed
//!    segments, when the pass holds the log throughout (as before) and when it
//!    holds it only to plan and to install; appends alone are the baseline.
//!
//! `LOGDEX_BENCH_MB` sets the size of one append run (default 256).

use std::fs::File;
use std::hint::black_box;
use std::io::Write;
use std::path::Path;
use std::time::{Duration, Instant};

use logdex_log::{Compression, Log, LogConfig, Record, encode_batch};

type BenchResult = Result<(), Box<dyn std::error::Error>>;

const BATCHES_PER_SYNC: usize = 16;
const LOOKUPS: usize = 200_000;
const APPEND_ROUNDS: usize = 3;

fn main() -> BenchResult {
    let total_mb: usize = std::env::var("LOGDEX_BENCH_MB").ok().and_then(|v| v.parse().ok()).unwrap_or(256);
    let dir = tempfile::tempdir()?;
    println!("logdex-log bench, data in {} (page cache warm after writing)", dir.path().display());
    let append_dir = dir.path().join("append");
    bench_append(&append_dir, total_mb)?;
    bench_read_record(&append_dir.join("log"), "64 KiB batches of 1 KiB records")?;
    let small_dir = dir.path().join("small");
    let small_mb = build_log(&small_dir, 1_000_000, 1, 100, Compression::None)?;
    println!("built {small_mb:.0} MiB log of 1,000,000 single-record batches (100-byte values)");
    bench_read_record(&small_dir, "single-record batches, 100-byte values")?;
    let zstd_dir = dir.path().join("zstd");
    let zstd_mb = build_log(&zstd_dir, 300_000, 10, 100, Compression::Zstd)?;
    println!("built {zstd_mb:.0} MiB log of 300,000 100-byte records in zstd batches of 10");
    bench_read_record(&zstd_dir, "zstd batches of 10, 100-byte values")?;
    let scan_dir = dir.path().join("scan");
    let scan_mb = build_log(&scan_dir, 3_000_000, 100, 100, Compression::None)?;
    println!("built {scan_mb:.0} MiB log of 3,000,000 100-byte records in batches of 100");
    bench_scan(&scan_dir)?;
    bench_compaction_beside_appends(&dir.path().join("compaction"))?;
    Ok(())
}

fn record(i: u64, value_bytes: usize) -> Record {
    Record {
        timestamp_ms: 1_700_000_000_000 + i as i64,
        key: Some(format!("key-{:08}", i % 1_000_000).into_bytes()),
        value: Some(vec![(i % 251) as u8; value_bytes]),
        headers: Vec::new(),
    }
}

fn bench_append(dir: &Path, total_mb: usize) -> BenchResult {
    let records: Vec<Record> = (0..63).map(|i| record(i, 1024)).collect();
    let batch = encode_batch(&records, Compression::None)?;
    let batches = total_mb * (1 << 20) / batch.len();
    let mb = (batches * batch.len()) as f64 / (1 << 20) as f64;
    println!(
        "append: {batches} batches of {} bytes ({} records of 1 KiB, {mb:.0} MiB), fsync every {BATCHES_PER_SYNC} batches, {APPEND_ROUNDS} alternating rounds",
        batch.len(),
        records.len()
    );
    std::fs::create_dir_all(dir)?;
    let (mut raw_rates, mut log_rates) = (Vec::new(), Vec::new());
    for round in 0..APPEND_ROUNDS {
        let raw = raw_write(&dir.join("raw.bin"), &batch, batches)?;
        std::fs::remove_file(dir.join("raw.bin"))?;
        if round > 0 {
            std::fs::remove_dir_all(dir.join("log"))?;
        }
        let log = log_append(&dir.join("log"), &batch, batches)?;
        raw_rates.push(mb / raw.as_secs_f64());
        log_rates.push(mb / log.as_secs_f64());
        println!("  round {round}: raw {:7.1} MB/s, log {:7.1} MB/s", raw_rates[round], log_rates[round]);
    }
    let (raw_mb, log_mb) = (median(&mut raw_rates), median(&mut log_rates));
    println!("  median raw write + fdatasync: {raw_mb:7.1} MB/s");
    println!("  median Log::append + sync:    {log_mb:7.1} MB/s");
    println!("  ratio log/raw: {:.2}", log_mb / raw_mb);
    Ok(())
}

fn median(values: &mut [f64]) -> f64 {
    values.sort_by(f64::total_cmp);
    values[values.len() / 2]
}

fn raw_write(path: &Path, batch: &[u8], batches: usize) -> Result<Duration, Box<dyn std::error::Error>> {
    let mut file = File::create(path)?;
    let started = Instant::now();
    for i in 0..batches {
        file.write_all(batch)?;
        if (i + 1) % BATCHES_PER_SYNC == 0 {
            file.sync_data()?;
        }
    }
    file.sync_data()?;
    Ok(started.elapsed())
}

fn log_append(dir: &Path, batch: &[u8], batches: usize) -> Result<Duration, Box<dyn std::error::Error>> {
    let mut log = Log::open(dir, LogConfig::default())?;
    let mut batch = batch.to_vec();
    let started = Instant::now();
    for i in 0..batches {
        log.append(&mut batch, 0)?;
        if (i + 1) % BATCHES_PER_SYNC == 0 {
            log.sync()?;
        }
    }
    log.sync()?;
    Ok(started.elapsed())
}

/// Builds a log of `count` records in batches of `per_batch`; returns its size in MiB.
fn build_log(
    dir: &Path,
    count: u64,
    per_batch: u64,
    value_bytes: usize,
    codec: Compression,
) -> Result<f64, Box<dyn std::error::Error>> {
    let mut log = Log::open(dir, LogConfig::default())?;
    let mut i = 0;
    while i < count {
        let records: Vec<Record> = (i..(i + per_batch).min(count)).map(|j| record(j, value_bytes)).collect();
        let mut batch = encode_batch(&records, codec)?;
        log.append(&mut batch, 0)?;
        i += per_batch;
    }
    log.sync()?;
    Ok(log.size_bytes() as f64 / (1 << 20) as f64)
}

fn bench_read_record(dir: &Path, shape: &str) -> BenchResult {
    let log = Log::open(dir, LogConfig::default())?;
    let next = log.next_offset();
    let mut state = 0x9E37_79B9_7F4A_7C15u64;
    let mut latencies = Vec::with_capacity(LOOKUPS);
    let started = Instant::now();
    for _ in 0..LOOKUPS {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        let offset = state % next;
        let t = Instant::now();
        let found = log.read_record(offset)?;
        latencies.push(t.elapsed());
        black_box(found);
    }
    let total = started.elapsed();
    latencies.sort_unstable();
    let at = |q: f64| latencies[((latencies.len() as f64 * q) as usize).min(latencies.len() - 1)];
    println!(
        "read_record ({shape}; {next} records, {:.0} MiB): p50 {:.1} us, p99 {:.1} us, p999 {:.1} us, {:.0} lookups/s",
        log.size_bytes() as f64 / (1 << 20) as f64,
        at(0.5).as_secs_f64() * 1e6,
        at(0.99).as_secs_f64() * 1e6,
        at(0.999).as_secs_f64() * 1e6,
        LOOKUPS as f64 / total.as_secs_f64()
    );
    Ok(())
}

fn bench_scan(dir: &Path) -> BenchResult {
    let log = Log::open(dir, LogConfig::default())?;
    for round in 0..2 {
        let started = Instant::now();
        let mut count = 0u64;
        for item in log.scan(0) {
            black_box(item?);
            count += 1;
        }
        let elapsed = started.elapsed().as_secs_f64();
        println!(
            "scan round {round}: {count} records in {elapsed:.2} s = {:.2} M records/s",
            count as f64 / elapsed / 1e6
        );
    }
    Ok(())
}

/// Records of the compaction benchmark: 100,000 keys written 10 times each.
const COMPACT_RECORDS: u64 = 1_000_000;
const COMPACT_KEYS: u64 = 100_000;

/// How a compaction pass shares the log with the appends.
#[derive(Clone, Copy, Debug)]
enum Locking {
    /// No compaction: the appends alone.
    None,
    /// The pass holds the write lock from start to end.
    WholePass,
    /// The pass holds a read lock to plan and the write lock to install each segment.
    PlanRewriteInstall,
}

fn bench_compaction_beside_appends(dir: &Path) -> BenchResult {
    use std::collections::HashMap;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::{Arc, RwLock};

    let source = dir.join("source");
    let config = LogConfig { segment_bytes: 16 << 20, ..LogConfig::default() };
    let mut live: HashMap<Vec<u8>, u64> = HashMap::new();
    {
        let mut log = Log::open(&source, config.clone())?;
        for first in (0..COMPACT_RECORDS).step_by(10) {
            let records: Vec<Record> = (first..first + 10)
                .map(|i| Record {
                    timestamp_ms: 1_700_000_000_000 + i as i64,
                    key: Some(format!("key-{:08}", i % COMPACT_KEYS).into_bytes()),
                    value: Some(vec![(i % 251) as u8; 100]),
                    headers: Vec::new(),
                })
                .collect();
            for (n, r) in records.iter().enumerate() {
                live.insert(r.key.clone().unwrap_or_default(), first + n as u64);
            }
            log.append(&mut encode_batch(&records, Compression::None)?, 0)?;
        }
        log.roll()?;
        log.sync()?;
        println!(
            "compaction: built {:.0} MiB of sealed segments ({COMPACT_RECORDS} records over {COMPACT_KEYS} keys)",
            log.size_bytes() as f64 / (1 << 20) as f64
        );
    }
    for (round, locking) in [Locking::None, Locking::WholePass, Locking::PlanRewriteInstall].into_iter().enumerate() {
        let copy = dir.join(format!("round-{round}"));
        std::fs::create_dir_all(&copy)?;
        for entry in std::fs::read_dir(&source)? {
            let entry = entry?;
            std::fs::copy(entry.path(), copy.join(entry.file_name()))?;
        }
        let log = Arc::new(RwLock::new(Log::open(&copy, config.clone())?));
        let stop = Arc::new(AtomicBool::new(false));
        let writer = {
            let (log, stop) = (log.clone(), stop.clone());
            std::thread::spawn(move || -> Result<Vec<Duration>, String> {
                let mut latencies = Vec::new();
                let mut i = 0u64;
                // Bounded: the pass ends within seconds; at most 200,000 appends either way.
                while !stop.load(Ordering::Acquire) && latencies.len() < 200_000 {
                    let r = Record {
                        timestamp_ms: 1,
                        key: Some(format!("new-{i}").into_bytes()),
                        value: Some(vec![7; 100]),
                        headers: Vec::new(),
                    };
                    let mut batch = encode_batch(&[r], Compression::None).map_err(|e| e.to_string())?;
                    let t = Instant::now();
                    log.write().map_err(|_| "poisoned")?.append(&mut batch, 0).map_err(|e| e.to_string())?;
                    latencies.push(t.elapsed());
                    i += 1;
                    std::thread::sleep(Duration::from_micros(200));
                }
                Ok(latencies)
            })
        };
        let mut is_live = |key: &[u8], offset: u64| live.get(key) == Some(&offset);
        let started = Instant::now();
        let stats = match locking {
            Locking::None => {
                std::thread::sleep(Duration::from_secs(2));
                logdex_log::CompactStats::default()
            }
            Locking::WholePass => log.write().map_err(|_| "poisoned")?.compact(&mut is_live, 0)?,
            Locking::PlanRewriteInstall => {
                let plan = log.read().map_err(|_| "poisoned")?.compaction_plan(u64::MAX)?;
                let compacted = plan.rewrite(&mut is_live, 0);
                let mut stats = logdex_log::CompactStats::default();
                let mut slowest = Duration::ZERO;
                for part in compacted.into_parts() {
                    let t = Instant::now();
                    stats += log.write().map_err(|_| "poisoned")?.finish_compaction(part)?;
                    slowest = slowest.max(t.elapsed());
                }
                println!("compaction: slowest install of one segment {:.1} ms", slowest.as_secs_f64() * 1e3);
                stats
            }
        };
        let elapsed = started.elapsed();
        stop.store(true, Ordering::Release);
        let mut latencies = writer.join().map_err(|_| "writer panicked")??;
        latencies.sort_unstable();
        let at = |q: f64| latencies[((latencies.len() as f64 * q) as usize).min(latencies.len() - 1)];
        println!(
            "compaction {locking:?}: pass {:.2} s, {} records removed, {:.0} -> {:.0} MiB; {} appends beside it: \
             p50 {:.1} us, p99 {:.1} us, p999 {:.1} us, max {:.1} ms",
            elapsed.as_secs_f64(),
            stats.records_removed,
            stats.bytes_before as f64 / (1 << 20) as f64,
            stats.bytes_after as f64 / (1 << 20) as f64,
            latencies.len(),
            at(0.5).as_secs_f64() * 1e6,
            at(0.99).as_secs_f64() * 1e6,
            at(0.999).as_secs_f64() * 1e6,
            at(1.0).as_secs_f64() * 1e3,
        );
    }
    Ok(())
}
