//! Crash recovery: a child process (this test binary re-executed) applies
//! batches with markers and sometimes rebuilds; the parent kills it with
//! SIGKILL at random moments. After every kill the reopened index holds every
//! entry up to its marker and nothing else, the marker is at least the last
//! one the child saw acknowledged, and replay from the marker converges.

mod common;

use common::{TestResult, marker};
use logdex_index::{Index, Lookup, Update};
use std::collections::HashMap;
use std::io::{BufRead, BufReader, Write};
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

const CHILD_DIR_ENV: &str = "LOGDEX_INDEX_CRASH_CHILD_DIR";
const SEED_ENV: &str = "LOGDEX_INDEX_CRASH_SEED";
const GROUP: u64 = 1;
const BATCH_RECORDS: u64 = 100;
const KEYS: u64 = 500;
const ROUNDS: u32 = 20;
const TIME_BUDGET: Duration = Duration::from_secs(90);

/// The deterministic log: key and tombstone flag of the record at `offset`.
fn record(offset: u64) -> (Vec<u8>, bool) {
    let key = format!("k{:04}", (offset * 7919) % KEYS).into_bytes();
    (key, offset.is_multiple_of(11))
}

/// The answers the index must give after applying the log up to `next`.
#[derive(Default)]
struct Model {
    next: u64,
    entries: HashMap<Vec<u8>, u64>,
}

impl Model {
    fn advance_to(&mut self, next: u64) {
        for offset in self.next..next {
            let (key, tombstone) = record(offset);
            if tombstone {
                self.entries.remove(&key);
            } else {
                self.entries.insert(key, offset);
            }
        }
        self.next = self.next.max(next);
    }

    fn check(&self, index: &Index) -> TestResult {
        for id in 0..KEYS {
            let key = format!("k{id:04}").into_bytes();
            let expected = self.entries.get(&key).map_or(Lookup::NotFound, |offset| Lookup::Found(*offset));
            let actual = index.get(GROUP, &key)?;
            if actual != expected {
                return Err(format!("key k{id:04} at marker {}: index {actual:?}, log {expected:?}", self.next).into());
            }
        }
        Ok(())
    }
}

fn apply_batch(index: &Index, next: u64) -> Result<u64, logdex_index::Error> {
    let records: Vec<(Vec<u8>, bool)> = (next..next + BATCH_RECORDS).map(record).collect();
    let updates: Vec<Update<'_>> = records
        .iter()
        .zip(next..)
        .map(|((key, tombstone), offset)| if *tombstone { Update::Delete { key } } else { Update::Put { key, offset } })
        .collect();
    let after = next + BATCH_RECORDS;
    index.apply(GROUP, &updates, &marker(after))?;
    Ok(after)
}

/// Child half of the crash test: runs only when re-executed by the parent,
/// and then never returns (the parent kills it).
#[test]
fn crash_child_process() -> TestResult {
    let Some(dir) = std::env::var_os(CHILD_DIR_ENV) else {
        return Ok(());
    };
    let index = common::open(Path::new(&dir))?;
    let mut next = index.applied(GROUP)?.map_or(0, |m| m.next_offset);
    let mut stdout = std::io::stdout().lock();
    for batch in 1u64.. {
        if batch.is_multiple_of(25) {
            let log = (0..next).map(|offset| {
                let (key, tombstone) = record(offset);
                Ok::<_, std::convert::Infallible>((key, offset, tombstone))
            });
            let keys = index.rebuild(GROUP, log, &marker(next))?;
            writeln!(stdout, "rebuilt {keys:?}")?;
        } else {
            next = apply_batch(&index, next)?;
        }
        if batch.is_multiple_of(10) {
            index.persist()?;
        }
        writeln!(stdout, "M {next}")?;
        stdout.flush()?;
    }
    Ok(())
}

/// SIGKILL at random moments never leaves a marker that claims missing
/// entries, never loses an acknowledged batch, and replay from the marker
/// converges to the log.
#[test]
fn crash_recovery_marker_never_claims_missing_entries() -> TestResult {
    if std::env::var_os(CHILD_DIR_ENV).is_some() {
        return Ok(());
    }
    let seed = match std::env::var(SEED_ENV) {
        Ok(seed) => seed.parse()?,
        Err(_) => SystemTime::now().duration_since(UNIX_EPOCH)?.as_nanos() as u64,
    };
    eprintln!("crash test seed {seed} (replay with {SEED_ENV}={seed})");
    let mut rng = seed | 1;
    let dir = tempfile::tempdir()?;
    let mut model = Model::default();
    let started = Instant::now();
    let mut rounds = 0;
    while rounds < ROUNDS && started.elapsed() < TIME_BUDGET {
        rounds += 1;
        let acknowledged = run_child_and_kill(dir.path(), 50 + next_random(&mut rng) % 450)?;
        let index = common::open(dir.path())?;
        let applied = index.applied(GROUP)?;
        let next = applied.as_ref().map_or(0, |m| m.next_offset);
        if let Some(applied) = &applied {
            assert_eq!(applied, &marker(next), "marker state travels with next_offset");
        }
        assert!(next >= acknowledged, "round {rounds}: marker {next} is behind the acknowledged {acknowledged}");
        model.advance_to(next);
        model.check(&index).map_err(|error| format!("round {rounds} (seed {seed}): {error}"))?;
    }
    // Replay from the marker, as the state machine does after a restart.
    let index = common::open(dir.path())?;
    let mut next = index.applied(GROUP)?.map_or(0, |m| m.next_offset);
    let target = next + 20 * BATCH_RECORDS;
    while next < target {
        next = apply_batch(&index, next)?;
    }
    model.advance_to(next);
    model.check(&index)?;
    eprintln!("crash test: {rounds} rounds, log at {next}");
    Ok(())
}

/// Runs the child for `run_ms`, kills it, and returns the last acknowledged marker.
fn run_child_and_kill(dir: &Path, run_ms: u64) -> Result<u64, Box<dyn std::error::Error>> {
    let mut child = Command::new(std::env::current_exe()?)
        .args(["--exact", "crash_child_process", "--nocapture", "--test-threads=1"])
        .env(CHILD_DIR_ENV, dir)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()?;
    let stdout = child.stdout.take().ok_or("child has no stdout")?;
    let reader = std::thread::spawn(move || {
        let mut last = 0u64;
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            if let Some(next) = line.strip_prefix("M ").and_then(|n| n.parse().ok()) {
                last = next;
            }
        }
        last
    });
    std::thread::sleep(Duration::from_millis(run_ms));
    child.kill()?;
    child.wait()?;
    reader.join().map_err(|_| "stdout reader panicked".into())
}

/// xorshift64: enough randomness for kill timing, reproducible from the seed.
fn next_random(state: &mut u64) -> u64 {
    *state ^= *state << 13;
    *state ^= *state >> 7;
    *state ^= *state << 17;
    *state
}
