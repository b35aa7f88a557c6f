//! kill -9 during appends: this test binary re-executes itself as a child
//! (switched by `LOGDEX_CRASH_CHILD_DIR`) that appends and syncs batches in
//! a loop, printing every synced end offset; the parent SIGKILLs it at
//! random moments, reopens the log and checks that it is a dense prefix of
//! what the child wrote that holds every synced batch. The seed is printed;
//! `LOGDEX_CRASH_SEED=<n>` replays a run.

use std::io::{BufRead, BufReader, Write};
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use logdex_log::{Compression, Log, LogConfig, Record, encode_batch};

type TestResult = Result<(), Box<dyn std::error::Error>>;

const CHILD_ENV: &str = "LOGDEX_CRASH_CHILD_DIR";
const ROUNDS: usize = 20;
const CHILD_RUN_MS_MAX: u64 = 10_000;

fn config() -> LogConfig {
    LogConfig { segment_bytes: 64 << 10, seek_interval_bytes: 1024, ..LogConfig::default() }
}

/// The record the child writes at `offset`: its value names the offset.
fn record_at(offset: u64) -> Record {
    Record {
        timestamp_ms: offset as i64,
        key: Some(format!("k{}", offset % 100).into_bytes()),
        value: Some(format!("{offset:020}-{}", "p".repeat((offset % 50) as usize)).into_bytes()),
        headers: Vec::new(),
    }
}

struct XorShift(u64);

impl XorShift {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

/// Child entry point; does nothing unless started by the parent test.
#[test]
fn crash_child() -> TestResult {
    let Ok(dir) = std::env::var(CHILD_ENV) else {
        return Ok(());
    };
    let mut log = Log::open(Path::new(&dir), config())?;
    let mut rng = XorShift(log.next_offset() | 1);
    let started = Instant::now();
    let mut stdout = std::io::stdout().lock();
    while started.elapsed() < Duration::from_millis(CHILD_RUN_MS_MAX) {
        let first = log.next_offset();
        let count = 1 + rng.below(20);
        let codec = [Compression::None, Compression::Lz4, Compression::Zstd][rng.below(3) as usize];
        let records: Vec<Record> = (first..first + count).map(record_at).collect();
        let mut batch = encode_batch(&records, codec)?;
        log.append(&mut batch, 0)?;
        if rng.below(4) != 0 {
            log.sync()?;
            writeln!(stdout, "synced {}", log.next_offset())?;
            stdout.flush()?;
        }
    }
    Ok(())
}

/// Every synced batch survives kill -9 at random moments, and the log stays a dense, valid prefix.
#[test]
fn kill9_during_appends_loses_no_synced_batch() -> TestResult {
    if std::env::var(CHILD_ENV).is_ok() {
        return Ok(());
    }
    let seed = std::env::var("LOGDEX_CRASH_SEED").ok().and_then(|s| s.parse().ok()).unwrap_or_else(|| {
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(1, |d| d.as_nanos() as u64)
    });
    println!("crash test seed {seed} (replay with LOGDEX_CRASH_SEED={seed})");
    let mut rng = XorShift(seed | 1);
    let dir = tempfile::tempdir()?;
    let exe = std::env::current_exe()?;
    let mut synced_max = 0u64;
    for round in 0..ROUNDS {
        let mut child = Command::new(&exe)
            .args(["--exact", "crash_child", "--nocapture", "--test-threads=1"])
            .env(CHILD_ENV, dir.path())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()?;
        let stdout = child.stdout.take().ok_or("no child stdout")?;
        let reader = std::thread::spawn(move || {
            let mut last = None;
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if let Some(offset) = line.strip_prefix("synced ").and_then(|o| o.parse::<u64>().ok()) {
                    last = Some(offset);
                }
            }
            last
        });
        std::thread::sleep(Duration::from_millis(20 + rng.below(200)));
        child.kill()?;
        child.wait()?;
        let synced = reader.join().map_err(|_| "reader thread panicked")?;
        synced_max = synced_max.max(synced.unwrap_or(0));
        let next = verify(dir.path(), synced_max)?;
        println!("round {round}: synced up to {synced_max}, recovered next offset {next}");
    }
    assert!(synced_max > 0, "the child never synced a batch");
    Ok(())
}

/// Reopens the log and checks it is the dense prefix `0..next` with `next >= synced`.
fn verify(dir: &Path, synced: u64) -> Result<u64, Box<dyn std::error::Error>> {
    let log = Log::open(dir, config())?;
    let next = log.next_offset();
    assert!(next >= synced, "synced up to {synced} but recovered only up to {next}");
    let mut expected = 0u64;
    for item in log.scan(0) {
        let (offset, record) = item?;
        assert_eq!(offset, expected, "offsets must be dense");
        assert_eq!(record, record_at(offset));
        expected += 1;
    }
    assert_eq!(expected, next);
    if next > 0 {
        assert_eq!(log.read_record(next - 1)?, Some((next - 1, record_at(next - 1))));
    }
    Ok(next)
}
