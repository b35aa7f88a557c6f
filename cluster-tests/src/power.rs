//! Power loss without lazyfs or device-mapper: every node records, after each fsync, the
//! length of each file that fsync made durable (`LOGDEX_FSYNC_TRACE`, see
//! `raft/src/fsync_trace.rs`); after SIGKILL of every node the harness cuts each file back to
//! its last recorded length, optionally tearing the page after it, then restarts.
//!
//! Which files, and how (per directory, for the newest traced file of each kind):
//! - `*.jnl` fjall journals (`<data>/raft/`, `<data>/index/shard-N/`): fjall preallocates a journal
//!   with zeros and fsyncs it only through the traced persist calls or when it seals it on
//!   rotation. So the newest traced journal is zeroed from its recorded length to its end
//!   (what a power loss leaves of a preallocated file), and a journal created after the last
//!   trace (a rotation since) is zeroed whole while the one it sealed is kept whole.
//! - `*.log` segment files of a partition replica: the newest traced segment is truncated to
//!   its recorded length, unless a newer segment exists (it was sealed, so fsynced, since).
//!   Segments created after the last trace are left as they are (a snapshot install fsyncs
//!   its segments without a trace): milder than a real power loss, never harsher.
//! - Nothing else is touched: fjall's tables, manifests and version files, seek files,
//!   `checkpoint.json` and `controller.json` are fsynced (or rebuilt) by their writers.
//!
//! Tearing keeps the lost bytes of the first page after the durable length up to a random
//! 512-byte sector boundary (the disk wrote some sectors of the page before the power went),
//! and for segment files overwrites the end of that prefix with random bytes (a sector written
//! with garbage). Bytes below the durable length are never changed.
//!
//! Limitation: fsyncs of the index journal outside checkpoints (an index rebuild, a snapshot
//! install, cleanup after a replica was dropped) are not traced; a power loss within a second
//! of one can cut more of the index than a real one would. The scenarios do not cut power then.

use std::collections::BTreeMap;
use std::fmt;
use std::fs::OpenOptions;
use std::io::Read as _;
use std::io::Seek as _;
use std::io::SeekFrom;
use std::io::Write as _;
use std::path::Path;
use std::path::PathBuf;

use rand::Rng as _;
use rand::rngs::StdRng;

use crate::error::Error;
use crate::error::Result;

const PAGE_BYTES: u64 = 4096;
/// A torn page keeps whole sectors.
const SECTOR_BYTES: u64 = 512;
/// Bytes of a torn segment page overwritten with garbage, at most.
const GARBAGE_BYTES_MAX: u64 = 512;

/// What a power loss did to the files of one or more nodes.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PowerLossReport {
    /// Files cut below their length on disk.
    pub files_cut: usize,
    /// Bytes lost (zeroed or truncated) in total.
    pub bytes_lost: u64,
    /// Pages torn (part kept, part lost or garbage).
    pub pages_torn: usize,
    /// Journals zeroed whole (created after the last trace).
    pub journals_zeroed: usize,
    /// Every file cut: path, length on disk, length kept.
    pub cuts: Vec<(PathBuf, u64, u64)>,
}

impl PowerLossReport {
    pub fn add(&mut self, other: PowerLossReport) {
        self.files_cut += other.files_cut;
        self.bytes_lost += other.bytes_lost;
        self.pages_torn += other.pages_torn;
        self.journals_zeroed += other.journals_zeroed;
        self.cuts.extend(other.cuts);
    }
}

impl fmt::Display for PowerLossReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} files cut, {} bytes lost, {} pages torn, {} journals zeroed",
            self.files_cut, self.bytes_lost, self.pages_torn, self.journals_zeroed
        )
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Kind {
    Journal,
    Segment,
}

/// `(kind, sequence number)` of a traced file name: `N.jnl` or `{base_offset:020}.log`.
fn classify(path: &Path) -> Option<(Kind, u64)> {
    let name = path.file_name()?.to_str()?;
    if let Some(stem) = name.strip_suffix(".jnl") {
        return stem.parse().ok().map(|n| (Kind::Journal, n));
    }
    if let Some(stem) = name.strip_suffix(".log") {
        return stem.parse().ok().map(|n| (Kind::Segment, n));
    }
    None
}

/// The last recorded length of every file in a trace (a torn last line is ignored).
pub fn read_trace(trace: &Path) -> Result<BTreeMap<PathBuf, u64>> {
    let text = std::fs::read_to_string(trace).map_err(|e| Error::io(format!("reading {}", trace.display()), e))?;
    let mut lengths = BTreeMap::new();
    for line in text.lines() {
        let Some((path, length)) = line.split_once('\t') else { continue };
        let Ok(length) = length.trim().parse::<u64>() else { continue };
        lengths.insert(PathBuf::from(path), length);
    }
    Ok(lengths)
}

/// Applies a power loss to the files under `data_dir` that `trace` names (the node must be
/// dead). See the module documentation for the rules.
pub fn cut_to_last_fsync(data_dir: &Path, trace: &Path, rng: &mut StdRng, tear: bool) -> Result<PowerLossReport> {
    let data_dir = std::path::absolute(data_dir).map_err(|e| Error::io("resolving the data dir", e))?;
    let lengths = read_trace(trace)?;
    // (directory, kind) -> traced files by sequence number.
    let mut groups: BTreeMap<(PathBuf, Kind), BTreeMap<u64, (PathBuf, u64)>> = BTreeMap::new();
    for (path, length) in lengths {
        let (Some(parent), Some((kind, seq))) = (path.parent(), classify(&path)) else { continue };
        if !path.starts_with(&data_dir) {
            return Err(Error::Check(format!("the trace names {} outside {}", path.display(), data_dir.display())));
        }
        groups.entry((parent.to_path_buf(), kind)).or_default().insert(seq, (path, length));
    }
    let mut report = PowerLossReport::default();
    for ((dir, kind), traced) in groups {
        let Some((&newest_seq, (newest, length))) = traced.iter().next_back() else { continue };
        let on_disk = files_of_kind(&dir, kind)?;
        let newer: Vec<&PathBuf> = on_disk.range(newest_seq + 1..).map(|(_, p)| p).collect();
        if !on_disk.contains_key(&newest_seq) {
            continue; // removed since (a flushed journal, a retention-deleted segment)
        }
        if newer.is_empty() {
            cut_file(newest, *length, kind, rng, tear, &mut report)?;
        } else if kind == Kind::Journal {
            // `newest` was sealed (fsynced whole); journals after it were never fsynced.
            for path in newer {
                let len = file_len(path)?;
                if len > 0 {
                    cut_file(path, 0, kind, rng, false, &mut report)?;
                    report.journals_zeroed += 1;
                }
            }
        }
    }
    Ok(report)
}

fn files_of_kind(dir: &Path, kind: Kind) -> Result<BTreeMap<u64, PathBuf>> {
    let mut files = BTreeMap::new();
    let entries = match std::fs::read_dir(dir) {
        Ok(entries) => entries,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(files),
        Err(e) => return Err(Error::io(format!("listing {}", dir.display()), e)),
    };
    for entry in entries {
        let path = entry.map_err(|e| Error::io(format!("listing {}", dir.display()), e))?.path();
        if let Some((k, seq)) = classify(&path)
            && k == kind
        {
            files.insert(seq, path);
        }
    }
    Ok(files)
}

fn file_len(path: &Path) -> Result<u64> {
    std::fs::metadata(path).map(|m| m.len()).map_err(|e| Error::io(format!("stat {}", path.display()), e))
}

/// Cuts `path` to `keep` bytes: a journal keeps its length (zeros after `keep`), a segment is
/// truncated. With `tear`, part of the first lost page survives (see the module doc).
fn cut_file(
    path: &Path,
    keep: u64,
    kind: Kind,
    rng: &mut StdRng,
    tear: bool,
    report: &mut PowerLossReport,
) -> Result<()> {
    let io = |what: &str| {
        let what = format!("{what} {}", path.display());
        move |e| Error::io(what, e)
    };
    let mut file = OpenOptions::new().read(true).write(true).open(path).map_err(io("opening"))?;
    let len = file.metadata().map_err(io("stat"))?.len();
    if len <= keep {
        return Ok(());
    }
    // The bytes of the first page after `keep` that a torn write may have left on disk.
    let page_end = (keep / PAGE_BYTES + 1) * PAGE_BYTES;
    let mut survivor = vec![0u8; (page_end.min(len) - keep) as usize];
    if tear {
        file.seek(SeekFrom::Start(keep)).map_err(io("seeking"))?;
        file.read_exact(&mut survivor).map_err(io("reading"))?;
        // The disk wrote whole sectors of the page before the power went: keep a prefix
        // ending on a sector boundary (or the written data's end).
        let sectors = (page_end - keep).div_ceil(SECTOR_BYTES);
        let kept_end = (keep / SECTOR_BYTES + rng.random_range(0..=sectors)) * SECTOR_BYTES;
        survivor.truncate(kept_end.saturating_sub(keep).min(survivor.len() as u64) as usize);
        if kind == Kind::Segment && !survivor.is_empty() {
            let garbage = rng.random_range(1..=GARBAGE_BYTES_MAX.min(survivor.len() as u64)) as usize;
            let from = survivor.len() - garbage;
            rng.fill(&mut survivor[from..]);
        }
    } else {
        survivor.clear();
    }
    // A journal is preallocated with zeros: only its written bytes count as lost.
    let written_end =
        if kind == Kind::Journal { written_end(&mut file, keep, len).map_err(io("scanning"))? } else { len };
    file.set_len(keep).map_err(io("truncating"))?;
    if !survivor.is_empty() {
        file.seek(SeekFrom::Start(keep)).map_err(io("seeking"))?;
        file.write_all(&survivor).map_err(io("tearing"))?;
        report.pages_torn += 1;
    }
    if kind == Kind::Journal {
        // A preallocated journal keeps its size; what was lost reads as zeros.
        file.set_len(len).map_err(io("extending"))?;
    }
    file.sync_all().map_err(io("syncing"))?;
    report.files_cut += 1;
    report.bytes_lost += written_end.saturating_sub(keep + survivor.len() as u64);
    report.cuts.push((path.to_path_buf(), len, keep));
    Ok(())
}

/// The end of the last non-zero byte at or after `from` (a journal is written sequentially
/// into zeros; the scan stops at the first 64 KiB of zeros).
fn written_end(file: &mut std::fs::File, from: u64, len: u64) -> std::io::Result<u64> {
    const CHUNK: usize = 64 * 1024;
    let mut buffer = vec![0u8; CHUNK];
    let mut position = from;
    let mut end = from;
    file.seek(SeekFrom::Start(from))?;
    while position < len {
        let read = file.read(&mut buffer)?;
        if read == 0 {
            break;
        }
        match buffer[..read].iter().rposition(|b| *b != 0) {
            Some(last) => end = position + last as u64 + 1,
            None => break,
        }
        position += read as u64;
    }
    Ok(end)
}

#[cfg(test)]
mod tests {
    use rand::SeedableRng as _;

    use super::*;

    fn write(path: &Path, bytes: &[u8]) {
        std::fs::write(path, bytes).expect("test file written");
    }

    /// The newest traced segment is truncated to its traced length; older ones, and the
    /// newest journal's bytes below its traced length, are kept; a journal created after the
    /// last trace is zeroed whole, keeping its length.
    #[test]
    fn cut_follows_the_trace_and_never_touches_durable_bytes() -> Result<()> {
        let dir = tempfile::tempdir().map_err(|e| Error::io("tempdir", e))?;
        let data = dir.path();
        let log = data.join("partitions/1-2/log");
        let raft = data.join("raft");
        std::fs::create_dir_all(&log).map_err(|e| Error::io("mkdir", e))?;
        std::fs::create_dir_all(&raft).map_err(|e| Error::io("mkdir", e))?;
        let sealed = log.join(format!("{:020}.log", 0));
        let active = log.join(format!("{:020}.log", 100));
        write(&sealed, &[1u8; 300]);
        write(&active, &[2u8; 9000]);
        let j0 = raft.join("0.jnl");
        let mut journal = vec![7u8; 5000];
        journal.resize(20_000, 0);
        write(&j0, &journal);
        let trace = data.join("fsync.trace");
        let lines = format!(
            "{}\t300\n{}\t100\n{}\t4000\n{}\t5000\n{}\t2000\npartial-line-without-len",
            sealed.display(),
            active.display(),
            j0.display(),
            active.display(),
            j0.display()
        );
        write(&trace, lines.as_bytes());
        let mut rng = StdRng::seed_from_u64(7);
        let report = cut_to_last_fsync(data, &trace, &mut rng, false)?;
        assert_eq!(file_len(&sealed)?, 300, "an older segment is kept");
        assert_eq!(std::fs::read(&active).map_err(|e| Error::io("read", e))?, vec![2u8; 5000]);
        let after = std::fs::read(&j0).map_err(|e| Error::io("read", e))?;
        assert_eq!(after.len(), 20_000, "a journal keeps its preallocated length");
        assert!(after[..2000].iter().all(|b| *b == 7) && after[2000..].iter().all(|b| *b == 0));
        assert_eq!(report.files_cut, 2);

        // A rotation after the last trace: 0.jnl was sealed (kept), 1.jnl never fsynced.
        let j1 = raft.join("1.jnl");
        write(&j0, &vec![7u8; 6000]);
        write(&j1, &[9u8; 3000]);
        let report = cut_to_last_fsync(data, &trace, &mut rng, true)?;
        assert_eq!(file_len(&j0)?, 6000);
        assert!(std::fs::read(&j0).map_err(|e| Error::io("read", e))?.iter().all(|b| *b == 7));
        let zeroed = std::fs::read(&j1).map_err(|e| Error::io("read", e))?;
        assert!(zeroed.len() == 3000 && zeroed.iter().all(|b| *b == 0));
        assert_eq!(report.journals_zeroed, 1);
        Ok(())
    }

    /// Tearing keeps at most the rest of the first lost page and never changes a durable byte.
    #[test]
    fn tearing_stays_within_the_first_lost_page() -> Result<()> {
        let dir = tempfile::tempdir().map_err(|e| Error::io("tempdir", e))?;
        let data = dir.path().join("partitions/1-2/log");
        std::fs::create_dir_all(&data).map_err(|e| Error::io("mkdir", e))?;
        for seed in 0..20 {
            let path = data.join(format!("{:020}.log", 0));
            write(&path, &vec![5u8; 12_000]);
            let mut report = PowerLossReport::default();
            let mut rng = StdRng::seed_from_u64(seed);
            cut_file(&path, 5000, Kind::Segment, &mut rng, true, &mut report)?;
            let after = std::fs::read(&path).map_err(|e| Error::io("read", e))?;
            assert!(after.len() >= 5000 && after.len() <= 8192, "seed {seed}: length {}", after.len());
            assert!(after[..5000].iter().all(|b| *b == 5), "seed {seed}: a durable byte changed");
        }
        Ok(())
    }
}
