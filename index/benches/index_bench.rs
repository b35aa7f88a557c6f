//! Index benchmarks against raw fjall on the same keys, in one run.
//!
//! Run: `cargo bench -p logdex-index --bench index_bench` (release).
//! Options: `--keys N` (default 1_000_000), `--idle-secs S` (default 10),
//! `--skip-idle`. Prints Markdown for BENCHMARKS.md.

use fjall::{Database, Keyspace, KeyspaceCreateOptions};
use logdex_index::{AppliedMarker, Index, IndexConfig, Lookup, Update};
use std::path::Path;
use std::time::{Duration, Instant};

type BenchResult<T = ()> = Result<T, Box<dyn std::error::Error>>;

const BATCH: usize = 1_000;
const GET_SAMPLES: usize = 200_000;
const APPLY_ROUNDS: usize = 2;
const GET_ROUNDS: usize = 3;

struct Options {
    keys: usize,
    idle_secs: u64,
    skip_idle: bool,
}

fn options() -> BenchResult<Options> {
    let mut options = Options { keys: 1_000_000, idle_secs: 10, skip_idle: false };
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--keys" => options.keys = args.next().ok_or("--keys N")?.parse()?,
            "--idle-secs" => options.idle_secs = args.next().ok_or("--idle-secs S")?.parse()?,
            "--skip-idle" => options.skip_idle = true,
            _ => {} // `cargo bench` passes --bench
        }
    }
    Ok(options)
}

fn main() -> BenchResult {
    let options = options()?;
    let keys: Vec<Vec<u8>> = (0..options.keys).map(|i| format!("k-{i:07}").into_bytes()).collect();
    let probes = random_probes(options.keys, GET_SAMPLES);
    println!(
        "## Run: {} keys `k-%07d`, batches of {BATCH}; best of {APPLY_ROUNDS} alternating apply rounds \
         and of {GET_ROUNDS} alternating rounds of {GET_SAMPLES} random gets\n",
        options.keys
    );
    if !options.skip_idle {
        idle_groups(options.idle_secs)?;
    }

    // Alternate the two sides and keep each side's best round, to damp the
    // noise of a shared 2-core VM. The last round's databases serve the gets.
    let mut index_apply = Duration::MAX;
    let mut raw_apply = Duration::MAX;
    let mut kept = None;
    for _round in 0..APPLY_ROUNDS {
        let dir = tempfile::tempdir()?;
        let index = Index::open(dir.path(), IndexConfig::default())?;
        index_apply = index_apply.min(time(|| apply_all(&index, 1, &keys))?);
        let raw_dir = tempfile::tempdir()?;
        let (raw_db, raw) = open_raw(raw_dir.path())?;
        raw_apply = raw_apply.min(time(|| raw_insert_all(&raw_db, &raw, &keys))?);
        kept = Some((dir, index, raw_dir, raw_db, raw));
    }
    let (_dir, index, _raw_dir, _raw_db, raw) = kept.ok_or("no apply round ran")?;
    index.compact()?;
    raw.rotate_memtable_and_wait()?;
    raw.major_compact()?;
    let index_bytes = index.stats()?.data_table_bytes;
    let raw_bytes = raw.disk_space();

    let mut index_gets: Option<Latencies> = None;
    let mut raw_gets: Option<Latencies> = None;
    let (mut index_gets_2t, mut raw_gets_2t) = (0f64, 0f64);
    for _round in 0..GET_ROUNDS {
        let round = get_latencies(&probes, |i| matches!(index.get(1, &keys[i]), Ok(Lookup::Found(_))));
        index_gets = best(index_gets, round);
        let round = get_latencies(&probes, |i| matches!(raw.get(&keys[i]), Ok(Some(_))));
        raw_gets = best(raw_gets, round);
        index_gets_2t = index_gets_2t.max(get_throughput_threads(&probes, 2, {
            let index = index.clone();
            let keys = keys.clone();
            move |i| matches!(index.get(1, &keys[i]), Ok(Lookup::Found(_)))
        }));
        raw_gets_2t = raw_gets_2t.max(get_throughput_threads(&probes, 2, {
            let raw = raw.clone();
            let keys = keys.clone();
            move |i| matches!(raw.get(&keys[i]), Ok(Some(_)))
        }));
    }
    let index_gets = index_gets.ok_or("no get round ran")?;
    let raw_gets = raw_gets.ok_or("no get round ran")?;

    let log: Vec<(Vec<u8>, u64)> = keys.iter().cloned().zip(0u64..).collect();
    let rebuild = time(|| {
        let records = log.iter().map(|(key, offset)| Ok::<_, String>((key.clone(), *offset, false)));
        index.rebuild(2, records, &marker(keys.len() as u64))?.map_err(|e| e.into()).map(|_| ())
    })?;
    drop(index);

    let n = keys.len() as f64;
    println!("| measure | logdex-index | raw fjall | ratio |");
    println!("|---|---|---|---|");
    let (index_rate, raw_rate) = (n / index_apply.as_secs_f64(), n / raw_apply.as_secs_f64());
    println!("| apply, keys/s (batches of {BATCH}) | {index_rate:.0} | {raw_rate:.0} | {:.2} |", index_rate / raw_rate);
    println!(
        "| random get, gets/s (1 thread) | {:.0} | {:.0} | {:.2} |",
        index_gets.per_second,
        raw_gets.per_second,
        index_gets.per_second / raw_gets.per_second
    );
    println!(
        "| random get, gets/s (2 threads) | {index_gets_2t:.0} | {raw_gets_2t:.0} | {:.2} |",
        index_gets_2t / raw_gets_2t
    );
    println!("| random get latency p50 / p99 / max, us | {} | {} | |", index_gets.summary(), raw_gets.summary());
    println!(
        "| bytes on disk per key (flush + major compaction) | {:.1} | {:.1} | {:.2} |",
        index_bytes as f64 / n,
        raw_bytes as f64 / n,
        index_bytes as f64 / raw_bytes as f64
    );
    println!("| rebuild, keys/s (fresh generation, ingestion) | {:.0} | | |", n / rebuild.as_secs_f64());
    if index_gets.misses + raw_gets.misses > 0 {
        println!("\nmisses: index {}, raw {}", index_gets.misses, raw_gets.misses);
    }
    Ok(())
}

fn marker(next_offset: u64) -> AppliedMarker {
    AppliedMarker {
        state: vec![0u8; 24], // about what raft stores: a log id and a membership hash
        next_offset,
    }
}

fn apply_all(index: &Index, group: u64, keys: &[Vec<u8>]) -> BenchResult {
    let mut offset = 0u64;
    for chunk in keys.chunks(BATCH) {
        let updates: Vec<Update<'_>> =
            chunk.iter().zip(offset..).map(|(key, offset)| Update::Put { key, offset }).collect();
        offset += chunk.len() as u64;
        index.apply(group, &updates, &marker(offset))?;
    }
    Ok(())
}

fn open_raw(path: &Path) -> BenchResult<(Database, Keyspace)> {
    let config = IndexConfig::default();
    let db = Database::builder(path)
        .cache_size(config.cache_bytes)
        .max_journaling_size(config.journal_bytes_max)
        .worker_threads(config.worker_threads)
        .open()?;
    let keyspace =
        db.keyspace("raw", || KeyspaceCreateOptions::default().max_memtable_size(config.memtable_bytes_max))?;
    Ok((db, keyspace))
}

fn raw_insert_all(db: &Database, keyspace: &Keyspace, keys: &[Vec<u8>]) -> BenchResult {
    let mut offset = 0u64;
    for chunk in keys.chunks(BATCH) {
        let mut batch = db.batch();
        for key in chunk {
            batch.insert(keyspace, key.as_slice(), offset.to_be_bytes());
            offset += 1;
        }
        batch.commit()?;
    }
    Ok(())
}

fn time(f: impl FnOnce() -> BenchResult) -> BenchResult<Duration> {
    let start = Instant::now();
    f()?;
    Ok(start.elapsed())
}

struct Latencies {
    per_second: f64,
    sorted_ns: Vec<u64>,
    misses: usize,
}

impl Latencies {
    fn percentile_us(&self, p: f64) -> f64 {
        let last = self.sorted_ns.len().saturating_sub(1);
        let at = ((last as f64) * p).round() as usize;
        self.sorted_ns.get(at).copied().unwrap_or_default() as f64 / 1_000.0
    }

    fn summary(&self) -> String {
        format!("{:.1} / {:.1} / {:.0}", self.percentile_us(0.5), self.percentile_us(0.99), self.percentile_us(1.0))
    }
}

fn best(kept: Option<Latencies>, round: Latencies) -> Option<Latencies> {
    match kept {
        Some(kept) if kept.per_second >= round.per_second => Some(kept),
        _ => Some(round),
    }
}

fn get_latencies(probes: &[usize], mut get: impl FnMut(usize) -> bool) -> Latencies {
    let mut sorted_ns = Vec::with_capacity(probes.len());
    let mut misses = 0;
    let start = Instant::now();
    for &i in probes {
        let op = Instant::now();
        if !get(i) {
            misses += 1;
        }
        sorted_ns.push(op.elapsed().as_nanos() as u64);
    }
    let per_second = probes.len() as f64 / start.elapsed().as_secs_f64();
    sorted_ns.sort_unstable();
    Latencies { per_second, sorted_ns, misses }
}

fn get_throughput_threads(
    probes: &[usize],
    threads: usize,
    get: impl Fn(usize) -> bool + Clone + Send + 'static,
) -> f64 {
    let start = Instant::now();
    let handles: Vec<_> = (0..threads)
        .map(|t| {
            let probes: Vec<usize> = probes.iter().copied().skip(t).step_by(threads).collect();
            let get = get.clone();
            std::thread::spawn(move || probes.into_iter().filter(|&i| get(i)).count())
        })
        .collect();
    let found: usize = handles.into_iter().map(|h| h.join().unwrap_or(0)).sum();
    found as f64 / start.elapsed().as_secs_f64()
}

fn random_probes(keys: usize, samples: usize) -> Vec<usize> {
    let mut state = 0x9E37_79B9_7F4A_7C15u64;
    (0..samples)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state % keys as u64) as usize
        })
        .collect()
}

/// 1000 groups x 1000 keys, then idle: RSS and journal bytes over time.
fn idle_groups(idle_secs: u64) -> BenchResult {
    const GROUPS: u64 = 1_000;
    const KEYS_PER_GROUP: usize = 1_000;
    let rss_start = rss_kib()?;
    let dir = tempfile::tempdir()?;
    let index = Index::open(dir.path(), IndexConfig::default())?;
    let keys: Vec<Vec<u8>> = (0..KEYS_PER_GROUP).map(|i| format!("k-{i:07}").into_bytes()).collect();
    let start = Instant::now();
    for group in 0..GROUPS {
        apply_all(&index, group, &keys)?;
    }
    let load = start.elapsed();
    let loaded = index.stats()?;
    let rss_loaded = rss_kib()?;
    println!("### Idle: {GROUPS} groups x {KEYS_PER_GROUP} keys (loaded in {:.1} s)\n", load.as_secs_f64());
    println!("| time | RSS MiB | journal files | journal MiB on disk | memtable MiB | data tables |");
    println!("|---|---|---|---|---|---|");
    println!("| before open | {:.1} | | | | |", rss_start as f64 / 1024.0);
    print_idle_row("after load", rss_loaded, &loaded);
    for second in 1..=idle_secs {
        std::thread::sleep(Duration::from_secs(1));
        if second % 5 == 0 || second == idle_secs {
            print_idle_row(&format!("idle {second} s"), rss_kib()?, &index.stats()?);
        }
    }
    drop(index);
    let reopen = Instant::now();
    let index = Index::open(dir.path(), IndexConfig::default())?;
    println!(
        "\nreopen after idle: {:.0} ms, {} groups\n",
        reopen.elapsed().as_secs_f64() * 1_000.0,
        index.stats()?.groups
    );
    Ok(())
}

fn print_idle_row(label: &str, rss: u64, stats: &logdex_index::IndexStats) {
    println!(
        "| {label} | {:.1} | {} | {:.1} | {:.1} | {} |",
        rss as f64 / 1024.0,
        stats.journal_files,
        stats.journal_bytes as f64 / 1_048_576.0,
        stats.write_buffer_bytes as f64 / 1_048_576.0,
        stats.data_tables
    );
}

fn rss_kib() -> BenchResult<u64> {
    let status = std::fs::read_to_string("/proc/self/status")?;
    let line = status.lines().find(|line| line.starts_with("VmRSS:")).ok_or("no VmRSS in /proc/self/status")?;
    Ok(line.split_whitespace().nth(1).ok_or("malformed VmRSS")?.parse()?)
}
