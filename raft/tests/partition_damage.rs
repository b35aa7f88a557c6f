//! A partition replica whose files were damaged while its node was down (issue 7: a bit flip in
//! a sealed segment, the active segment cut short): it reopens, refuses to answer from the
//! damaged batch (never a wrong value, never a 404 for a key that exists), re-applies the lost
//! tail from the Raft log with lookups held back until then, and refuses a snapshot whose files
//! fail their checks without touching its own data.

use std::path::Path;
use std::path::PathBuf;

use logdex_index::Index;
use logdex_index::IndexConfig;
use logdex_log::Compression;
use logdex_log::LogConfig;
use logdex_log::Offset;
use logdex_log::Record;
use logdex_raft::partition::AppliedState;
use logdex_raft::partition::KeyRead;
use logdex_raft::partition::Partition;
use logdex_raft::snapshot::SnapshotFiles;
use logdex_raft::snapshot::SnapshotStore;
use logdex_raft::state_machine::GroupData;
use logdex_raft::state_machine::GroupStateMachine;
use logdex_raft::types::SnapshotMeta;
use openraft::storage::RaftStateMachine;

mod common;

use common::applied;

type TestResult = Result<(), Box<dyn std::error::Error>>;
/// A batch in a sealed segment: `(segment file, position, base offset)`.
type SealedBatch = (PathBuf, usize, Offset);

const GROUP: u64 = 3;
const REPLICA: u64 = 1 << 20;
const KEYS: u64 = 20;

/// Record `i` (written at offset `i`, by Raft entry `i + 1`): key `k{i % KEYS}`, value `v{i}`.
fn record(i: u64) -> Record {
    common::record(i, KEYS)
}

fn applied_entry(state: &AppliedState) -> Option<u64> {
    state.applied.map(|l| l.index)
}

/// Applies records `from..to`, one Raft entry (one batch) each, as the state machine does.
fn apply(p: &Partition, from: u64, to: u64) -> TestResult {
    for i in from..to {
        let mut batch = [logdex_log::encode_batch(&[record(i)], Compression::None)?];
        let results = p.apply_batches(&mut batch, &applied(i + 1), 0)?;
        assert!(matches!(results[..], [Ok(a)] if a.base_offset == i), "{results:?}");
    }
    Ok(())
}

struct Replica {
    root: tempfile::TempDir,
    index: Index,
    config: LogConfig,
}

impl Replica {
    fn new(segment_bytes: u64) -> Result<Replica, Box<dyn std::error::Error>> {
        let root = tempfile::tempdir()?;
        let index = Index::open(&root.path().join("index"), IndexConfig::default())?;
        let config = LogConfig { segment_bytes, ..LogConfig::default() };
        Ok(Replica { root, index, config })
    }

    fn dir(&self) -> PathBuf {
        self.root.path().join("partition")
    }

    /// Opens the replica (after a kill -9: the index keeps what it was given, as the page
    /// cache would).
    fn open(&self) -> Result<(Partition, AppliedState), Box<dyn std::error::Error>> {
        Ok(Partition::open(GROUP, REPLICA, &self.dir(), self.config.clone(), self.index.clone())?)
    }

    fn segments(&self) -> std::io::Result<Vec<PathBuf>> {
        let dir = self.dir().join("log");
        let mut names: Vec<PathBuf> = std::fs::read_dir(&dir)?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|x| x == "log"))
            .collect();
        names.sort();
        Ok(names)
    }

    /// Cuts the active segment inside the batch holding `offset` (so it and all later ones go).
    fn cut_active_at(&self, offset: Offset) -> TestResult {
        let active = self.segments()?.pop().ok_or("no segment")?;
        let (position, _) = batches(&active)?.into_iter().find(|(_, base)| *base == offset).ok_or("no such batch")?;
        let file = std::fs::OpenOptions::new().write(true).open(&active)?;
        file.set_len(position as u64 + 10)?;
        Ok(())
    }

    /// `(segment file, position, base offset)` of every batch in a sealed segment.
    fn sealed_batches(&self) -> Result<Vec<SealedBatch>, Box<dyn std::error::Error>> {
        let mut sealed = self.segments()?;
        sealed.pop();
        let mut out = Vec::new();
        for path in sealed {
            out.extend(batches(&path)?.into_iter().map(|(position, base)| (path.clone(), position, base)));
        }
        Ok(out)
    }

    /// Flips a bit inside the record of the batch holding `offset`, in a sealed segment.
    fn flip_sealed(&self, offset: Offset) -> TestResult {
        let batches = self.sealed_batches()?;
        let (path, position, _) =
            batches.iter().find(|(_, _, base)| *base == offset).ok_or(format!("offset {offset} is not sealed"))?;
        flip(path, position + 61 + 12)
    }
}

/// `(position, base offset)` of every batch of a segment file.
fn batches(path: &Path) -> std::io::Result<Vec<(usize, Offset)>> {
    let bytes = std::fs::read(path)?;
    let mut out = Vec::new();
    let mut position = 0;
    while position + 61 <= bytes.len() {
        let field = |at: usize, n: usize| bytes[position + at..position + at + n].to_vec();
        let base = u64::from_be_bytes(field(0, 8).try_into().map_err(|_| std::io::ErrorKind::InvalidData)?);
        let length = i32::from_be_bytes(field(8, 4).try_into().map_err(|_| std::io::ErrorKind::InvalidData)?);
        out.push((position, base));
        position += length as usize + 12;
    }
    Ok(out)
}

fn flip(path: &Path, at: usize) -> TestResult {
    let mut bytes = std::fs::read(path)?;
    bytes[at] ^= 0x08;
    std::fs::write(path, &bytes)?;
    Ok(())
}

/// The offset of the latest write of key `k{key}` among records `0..end`.
fn latest(key: u64, end: u64) -> Option<u64> {
    (0..end).rev().find(|i| i % KEYS == key)
}

/// Every key answers its latest record below `end`, except keys whose latest record is in
/// `damaged`, which must be refused as corrupt data.
fn check_lookups(p: &Partition, end: u64, damaged: Option<Offset>) -> TestResult {
    for key in 0..KEYS {
        let name = format!("k{key}");
        let result = p.read_key(name.as_bytes());
        match (latest(key, end), result) {
            (None, Ok(KeyRead::NotFound)) => {}
            (Some(o), Err(e)) if Some(o) == damaged && e.is_corrupt_data() => {}
            (Some(o), Ok(KeyRead::Found { offset, record: r })) if offset == o && r == record(o) => {}
            (want, got) => return Err(format!("{name}: expected offset {want:?}, got {got:?}").into()),
        }
    }
    Ok(())
}

/// The active segment cut short while the node was down: the index (ahead of the log) is kept,
/// the log goes back to the last checkpoint, lookups answer unavailable (not an older value,
/// not a 404) until Raft re-applied past the index's old point, then every key is right; the
/// hold is cleared durably by the next checkpoint.
#[test]
fn cut_active_segment_is_reapplied_with_lookups_held_back_until_then() -> TestResult {
    let replica = Replica::new(1 << 20)?;
    let (p, _) = replica.open()?;
    apply(&p, 0, 40)?;
    p.checkpoint()?;
    apply(&p, 40, 50)?;
    drop(p);
    replica.cut_active_at(45)?;

    let (p, state) = replica.open()?;
    assert_eq!(applied_entry(&state), Some(40), "rolled back to the checkpoint");
    assert_eq!(p.high_watermark(), 40);
    for key in [b"k3".as_slice(), b"k0"] {
        match p.read_key(key) {
            Err(logdex_raft::Error::Unavailable(_)) => {}
            other => return Err(format!("a lookup while re-applying answered {other:?}").into()),
        }
    }
    assert_eq!(p.read_records(30, 100, usize::MAX)?.len(), 10, "fetches below the high watermark are served");
    apply(&p, 40, 50)?;
    check_lookups(&p, 50, None)?;
    assert!(replica.dir().join("reapply.json").exists());
    p.checkpoint()?;
    assert!(!replica.dir().join("reapply.json").exists());
    drop(p);
    let (p, state) = replica.open()?;
    assert_eq!(applied_entry(&state), Some(50));
    check_lookups(&p, 50, None)
}

/// A kill in the middle of re-applying (the index's marker is then below its old point): the
/// hold survives the restart.
#[test]
fn lookups_stay_held_back_across_a_restart_while_reapplying() -> TestResult {
    let replica = Replica::new(1 << 20)?;
    let (p, _) = replica.open()?;
    apply(&p, 0, 20)?;
    p.checkpoint()?;
    apply(&p, 20, 30)?;
    drop(p);
    replica.cut_active_at(25)?;
    let (p, _) = replica.open()?;
    apply(&p, 20, 24)?;
    drop(p);
    let (p, state) = replica.open()?;
    assert_eq!(applied_entry(&state), Some(24));
    assert!(matches!(p.read_key(b"k1"), Err(logdex_raft::Error::Unavailable(_))));
    apply(&p, 24, 30)?;
    check_lookups(&p, 30, None)
}

/// The cut goes below the last checkpoint: the replica rolls back to its last snapshot (the
/// active segment starts there, and the Raft log is never purged past it) or, with no snapshot
/// at all, to the empty log, and re-applies from there.
#[test]
fn cut_below_the_checkpoint_rolls_back_to_the_snapshot_or_the_start() -> TestResult {
    for with_snapshot in [true, false] {
        let replica = Replica::new(1 << 20)?;
        let (p, _) = replica.open()?;
        apply(&p, 0, 30)?;
        if with_snapshot {
            let store = SnapshotStore::open(replica.dir().join("snapshots"))?;
            let staged = store.staging("s1")?;
            p.snapshot_to(&staged, &applied(30))?;
            let meta = SnapshotMeta { last_log_id: applied(30).applied, last_membership: Default::default() };
            store.commit(&staged, "s1", &meta)?;
        }
        apply(&p, 30, 50)?;
        p.checkpoint()?;
        apply(&p, 50, 55)?;
        drop(p);
        replica.cut_active_at(35)?;
        let (p, state) = replica.open()?;
        let (point, entry) = if with_snapshot { (30, Some(30)) } else { (0, None) };
        assert_eq!((p.high_watermark(), applied_entry(&state)), (point, entry), "snapshot: {with_snapshot}");
        assert!(matches!(p.read_key(b"k2"), Err(logdex_raft::Error::Unavailable(_))));
        apply(&p, point, 55)?;
        check_lookups(&p, 55, None)?;
    }
    Ok(())
}

/// The fault: a bit flipped inside a record of a sealed segment and the active segment
/// cut, on a node that was down. The replica opens without reading the sealed segments whole,
/// re-applies the cut tail, and then refuses the damaged record (lookups and fetches: corrupt
/// data) while answering everything else right; a fetch from before the damage stops at it.
#[test]
fn bit_flip_in_a_sealed_segment_is_refused_and_the_cut_tail_reapplied() -> TestResult {
    let replica = Replica::new(1024)?;
    let (p, _) = replica.open()?;
    apply(&p, 0, 60)?;
    p.checkpoint()?;
    apply(&p, 60, 64)?;
    drop(p);
    // The latest record of some key, in a sealed segment, below the checkpoint (so it is not
    // re-applied).
    let damaged = replica
        .sealed_batches()?
        .iter()
        .map(|(_, _, base)| *base)
        .filter(|o| *o < 60 && latest(o % KEYS, 64) == Some(*o))
        .max()
        .ok_or("no sealed record is the latest of its key")?;
    replica.flip_sealed(damaged)?;
    replica.cut_active_at(63)?;

    let (p, state) = replica.open()?;
    assert_eq!(applied_entry(&state), Some(60));
    apply(&p, 60, 64)?;
    check_lookups(&p, 64, Some(damaged))?;
    match p.read_records(damaged, 100, usize::MAX) {
        Err(e) if e.is_corrupt_data() => {}
        other => return Err(format!("a fetch at the damaged batch answered {other:?}").into()),
    }
    let before = p.read_records(40, 100, usize::MAX)?;
    assert_eq!(before.iter().map(|(o, _)| *o).collect::<Vec<_>>(), (40..damaged).collect::<Vec<_>>());
    let after = p.read_records(damaged + 1, 100, usize::MAX)?;
    assert_eq!(after, (damaged + 1..64).map(|o| (o, record(o))).collect::<Vec<_>>());
    Ok(())
}

/// A snapshot whose segment files fail their checks (a damaged leader's) is refused before it
/// replaces anything: the install fails loudly and the receiver keeps its own data, with no
/// install left to finish at the next open.
#[test]
fn snapshot_with_a_damaged_segment_is_refused_before_install() -> TestResult {
    let leader = Replica::new(1024)?;
    let (lp, _) = leader.open()?;
    apply(&lp, 0, 40)?;
    let store = SnapshotStore::open(leader.dir().join("snapshots"))?;
    let staged = store.staging("s1")?;
    lp.snapshot_to(&staged, &applied(40))?;
    let meta = SnapshotMeta { last_log_id: applied(40).applied, last_membership: Default::default() };
    let files = store.commit(&staged, "s1", &meta)?;
    leader.flip_sealed(12)?; // the snapshot's segment files are hard links of the log's

    let follower = Replica::new(1024)?;
    let (fp, _) = follower.open()?;
    apply(&fp, 0, 10)?;
    match fp.install_snapshot(&files.dir) {
        Err(e) if e.is_corrupt_data() => {}
        other => return Err(format!("installing a damaged snapshot answered {other:?}").into()),
    }
    // Through the state machine, as openraft installs it: refused before it becomes the
    // replica's current snapshot (which would replace its previous one).
    let fp = std::sync::Arc::new(fp);
    let store = SnapshotStore::open(follower.dir().join("snapshots"))?;
    let mut sm = GroupStateMachine::new(GroupData::Partition(fp.clone()), applied(10), store);
    let runtime = tokio::runtime::Builder::new_current_thread().build()?;
    let received = SnapshotFiles { dir: files.dir.clone() };
    assert!(runtime.block_on(sm.install_snapshot(&meta, received)).is_err());
    assert!(runtime.block_on(sm.get_current_snapshot())?.is_none());
    drop(sm);
    let fp = std::sync::Arc::into_inner(fp).ok_or("the partition is still shared")?;
    assert_eq!(fp.high_watermark(), 10);
    check_lookups(&fp, 10, None)?;
    assert!(!follower.dir().join("installing.json").exists());
    drop(fp);
    let (fp, state) = follower.open()?;
    assert_eq!(applied_entry(&state), Some(10));
    check_lookups(&fp, 10, None)?;

    // An intact snapshot installs, and the index it rebuilds answers every key.
    let healthy = Replica::new(1024)?;
    let (hp, _) = healthy.open()?;
    apply(&hp, 0, 40)?;
    let hstore = SnapshotStore::open(healthy.dir().join("snapshots"))?;
    let staged = hstore.staging("s2")?;
    hp.snapshot_to(&staged, &applied(40))?;
    let files = hstore.commit(&staged, "s2", &meta)?;
    let state = fp.install_snapshot(&files.dir)?;
    assert_eq!(applied_entry(&state), Some(40));
    check_lookups(&fp, 40, None)
}

/// The scrub reads every sealed segment once, finds a flipped bit in one (an error naming
/// the file, once), and the replica stays marked damaged while the log holds that segment.
#[test]
fn the_scrub_reads_sealed_segments_once_and_marks_a_damaged_replica() -> TestResult {
    let replica = Replica::new(1024)?;
    let (p, _) = replica.open()?;
    apply(&p, 0, 40)?;
    let sealed_bytes = p.sealed_bytes();
    assert!(sealed_bytes > 0, "small segments: some are sealed");
    assert_eq!(p.scrub(u64::MAX)?, sealed_bytes, "every sealed byte read once");
    assert_eq!(p.scrub(u64::MAX)?, 0, "nothing read twice");
    assert!(!p.is_damaged());
    drop(p);

    // Bit rot while the node was down; the scrub of the reopened replica finds it.
    replica.flip_sealed(12)?;
    let (p, _) = replica.open()?;
    match p.scrub(u64::MAX) {
        Err(e) if e.is_corrupt_data() => {
            assert!(e.to_string().contains(".log"), "the error names the segment file: {e}");
        }
        other => return Err(format!("the scrub of a damaged segment answered {other:?}").into()),
    }
    assert!(p.is_damaged());
    assert!(p.scrub(u64::MAX).is_ok(), "a damaged segment is reported once");
    assert!(p.is_damaged(), "and stays marked");
    // A budget bounds one pass: the first segment is read even when it alone is past it.
    let other = Replica::new(1024)?;
    let (fresh, _) = other.open()?;
    apply(&fresh, 0, 40)?;
    let first = fresh.scrub(1)?;
    assert!(first > 0 && first < fresh.sealed_bytes(), "one segment per pass at budget 1: {first}");
    Ok(())
}

/// Replicas of one node share a pass's budget: a small one is spent on the first replica's
/// first segment and the others read nothing; passes with a large budget then read every
/// sealed byte of every replica exactly once.
#[test]
fn a_scrub_pass_shares_one_budget_over_the_replicas() -> TestResult {
    let dirs = [Replica::new(1024)?, Replica::new(1024)?, Replica::new(1024)?];
    let mut replicas = Vec::new();
    for dir in &dirs {
        let (p, _) = dir.open()?;
        apply(&p, 0, 40)?;
        replicas.push(std::sync::Arc::new(p));
    }
    let sealed: u64 = replicas.iter().map(|p| p.sealed_bytes()).sum();

    let first: Vec<u64> = Partition::scrub_each(&replicas, 1).into_iter().collect::<Result<_, _>>()?;
    assert!(first[0] > 0 && first[0] < replicas[0].sealed_bytes(), "one segment of the first replica: {first:?}");
    assert_eq!(&first[1..], &[0, 0], "the budget is spent: the others wait for the next pass");

    let budget = replicas[0].sealed_bytes();
    let mut read = first.iter().sum::<u64>();
    for _ in 0..10 {
        let pass: Vec<u64> = Partition::scrub_each(&replicas, budget).into_iter().collect::<Result<_, _>>()?;
        assert!(pass.iter().sum::<u64>() <= 2 * budget, "a pass stays near its budget: {pass:?}");
        read += pass.iter().sum::<u64>();
    }
    assert_eq!(read, sealed, "every sealed byte of every replica read once");
    Ok(())
}
