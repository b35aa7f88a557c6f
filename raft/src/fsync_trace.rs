//! Test-only record of what an fsync made durable, for power-loss simulation.
//!
//! Off unless the environment variable `LOGDEX_FSYNC_TRACE=<path>` is set when
//! the node starts. Then, after each successful fsync of the Raft log and after
//! each partition checkpoint, [`durable`] appends one line per file to `<path>`:
//!
//! ```text
//! <absolute path>\t<length>\n
//! ```
//!
//! meaning "the first `<length>` bytes of this file survive a power loss now".
//! The cluster tests (`cluster-tests/src/power.rs`) kill every node, cut each
//! traced file back to its last recorded length and restart.
//!
//! Files traced, at the top level of each directory passed in:
//! - `*.jnl`: fjall journals (`<data>/raft/`, `<data>/index/shard-N/`). fjall creates
//!   a journal preallocated with zeros (64 MiB) and writes it from the start, so
//!   its length says nothing: the written end is found after the last non-zero
//!   byte, plus 8 bytes for the trailing zero bytes an `End` entry's checksum
//!   may hold. fjall's tables, manifests and version files are fsynced by fjall
//!   itself and never traced.
//! - `*.log`: segment files of one partition replica (their length is exact).
//!
//! Lengths are read right after the fsync returned, before the caller
//! acknowledges anything, so a recorded length is never below what that fsync
//! made durable; writes racing with the measurement may count as durable, which
//! makes a simulated power loss milder than a real one, never harsher.

use std::collections::HashMap;
use std::fs::File;
use std::io::Read as _;
use std::io::Seek as _;
use std::io::SeekFrom;
use std::io::Write as _;
use std::path::Path;
use std::path::PathBuf;
use std::sync::Mutex;
use std::sync::OnceLock;

/// The environment variable naming the trace file.
pub const TRACE_ENV: &str = "LOGDEX_FSYNC_TRACE";
/// Bytes read per step while looking for a journal's written end.
const SCAN_CHUNK_BYTES: usize = 64 * 1024;
/// Trailing zero bytes a journal's last entry may end with (an `End` checksum).
const JOURNAL_TAIL_SLACK_BYTES: u64 = 8;

struct Tracer {
    file: File,
    /// Written end of each journal found so far: journals only grow.
    journal_ends: HashMap<PathBuf, u64>,
}

fn tracer() -> Option<&'static Mutex<Tracer>> {
    static TRACER: OnceLock<Option<Mutex<Tracer>>> = OnceLock::new();
    TRACER
        .get_or_init(|| {
            let path = std::env::var_os(TRACE_ENV)?;
            match std::fs::OpenOptions::new().create(true).append(true).open(&path) {
                Ok(file) => Some(Mutex::new(Tracer { file, journal_ends: HashMap::new() })),
                Err(error) => {
                    tracing::error!(%error, path = %Path::new(&path).display(), "cannot open the fsync trace");
                    None
                }
            }
        })
        .as_ref()
}

/// Records the durable length of every journal and segment file directly in
/// `dirs`. Does nothing unless `LOGDEX_FSYNC_TRACE` is set; never fails (a
/// trace problem is logged: it must not change the node's behaviour).
pub fn durable(dirs: &[&Path]) {
    let Some(tracer) = tracer() else {
        return;
    };
    let mut tracer = tracer.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    let mut lines = String::new();
    for dir in dirs {
        if let Err(error) = trace_dir(&mut tracer.journal_ends, dir, &mut lines) {
            tracing::warn!(%error, dir = %dir.display(), "fsync trace skipped a directory");
        }
    }
    // One write per call: O_APPEND keeps calls whole; a SIGKILL can cut only the last line.
    if let Err(error) = tracer.file.write_all(lines.as_bytes()) {
        tracing::warn!(%error, "cannot append to the fsync trace");
    }
}

fn trace_dir(journal_ends: &mut HashMap<PathBuf, u64>, dir: &Path, lines: &mut String) -> std::io::Result<()> {
    let dir = std::path::absolute(dir)?;
    for entry in std::fs::read_dir(&dir)? {
        let entry = entry?;
        let name = entry.file_name();
        let name = name.to_string_lossy();
        let is_journal = name.ends_with(".jnl");
        if !(is_journal || name.ends_with(".log")) || !entry.file_type()?.is_file() {
            continue;
        }
        let path = entry.path();
        let length = if is_journal {
            let from = journal_ends.get(&path).copied().unwrap_or(0);
            match journal_written_end(&path, from) {
                Ok((end, length)) => {
                    journal_ends.insert(path.clone(), end);
                    (end + JOURNAL_TAIL_SLACK_BYTES).min(length)
                }
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
                Err(e) => return Err(e),
            }
        } else {
            match entry.metadata() {
                Ok(metadata) => metadata.len(),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
                Err(e) => return Err(e),
            }
        };
        lines.push_str(&format!("{}\t{length}\n", path.display()));
    }
    Ok(())
}

/// `(end after the last non-zero byte, file length)` of a journal written
/// sequentially into zeros, scanning from `from` (an earlier end) until EOF or
/// a whole chunk of zeros.
fn journal_written_end(path: &Path, from: u64) -> std::io::Result<(u64, u64)> {
    let mut file = File::open(path)?;
    let length = file.metadata()?.len();
    let chunk_bytes = SCAN_CHUNK_BYTES as u64;
    let mut position = from.min(length) / chunk_bytes * chunk_bytes;
    let mut end = from.min(length);
    file.seek(SeekFrom::Start(position))?;
    let mut buffer = vec![0u8; SCAN_CHUNK_BYTES];
    while position < length {
        let read = file.read(&mut buffer)?;
        if read == 0 {
            break;
        }
        match buffer[..read].iter().rposition(|b| *b != 0) {
            Some(last) => end = end.max(position + last as u64 + 1),
            None if position >= end => break,
            None => {}
        }
        position += read as u64;
    }
    Ok((end, length))
}
