//! Retention committed as a trim: the leader computes the start offset retention leaves in
//! its own log; every replica applies the same trim, whatever its own segment boundaries,
//! and then answers alike: keys below the trim are removed (410), fetches start at it, and
//! so after a restart. Removed keys answer 410 whatever the replica's index compactions did,
//! until a committed forget, and 404 from then on.

use std::path::Path;

use logdex_index::Index;
use logdex_index::IndexConfig;
use logdex_log::Compression;
use logdex_log::LogConfig;
use logdex_raft::partition::KeyRead;
use logdex_raft::partition::Partition;
use logdex_raft::pb;

mod common;

type TestResult = Result<(), Box<dyn std::error::Error>>;

const RECORDS: u64 = 60;

fn open(dir: &Path, config: LogConfig) -> Result<Partition, Box<dyn std::error::Error>> {
    let index = Index::open(&dir.join("index"), IndexConfig::default())?;
    let (p, _) = Partition::open(3, 1 << 20, &dir.join("partition"), config, index)?;
    Ok(p)
}

/// Base offsets of the segment files of `p`'s local log.
fn segment_bases(dir: &Path) -> Result<Vec<u64>, Box<dyn std::error::Error>> {
    let mut bases = Vec::new();
    for entry in std::fs::read_dir(dir.join("partition").join("log"))? {
        let name = entry?.file_name().to_string_lossy().into_owned();
        if let Some(base) = name.strip_suffix(".log") {
            bases.push(base.parse()?);
        }
    }
    bases.sort_unstable();
    Ok(bases)
}

fn check_trimmed(p: &Partition, cut: u64, who: &str) -> TestResult {
    assert_eq!(p.log_start_offset(), cut, "{who}: log start");
    for i in 0..RECORDS {
        let key = format!("k{i}").into_bytes();
        let (read, _) = p.read_key_at(&key)?;
        match read {
            KeyRead::Evicted { offset } if i < cut => assert_eq!(offset, i, "{who}: key k{i}"),
            KeyRead::Found { offset, .. } if i >= cut => assert_eq!(offset, i, "{who}: key k{i}"),
            other => panic!("{who}: key k{i} (offset {i}, trim at {cut}) read {other:?}"),
        }
    }
    let fetched = p.read_records(0, 1000, 1 << 20)?;
    assert_eq!(fetched.first().map(|(o, _)| *o), Some(cut), "{who}: a fetch from 0 starts at the trim");
    Ok(())
}

#[test]
fn a_committed_trim_leaves_replicas_with_other_segment_boundaries_answering_alike() -> TestResult {
    let (dir_a, dir_b) = (tempfile::tempdir()?, tempfile::tempdir()?);
    let leader_config = LogConfig { segment_bytes: 500, retention_ms: Some(1), ..LogConfig::default() };
    let follower_config = LogConfig { segment_bytes: 730, ..LogConfig::default() };
    let a = open(dir_a.path(), leader_config)?;
    let b = open(dir_b.path(), follower_config.clone())?;
    for i in 0..RECORDS {
        for p in [&a, &b] {
            let mut batch = [logdex_log::encode_batch(&[common::record(i, RECORDS)], Compression::None)?];
            p.apply_batches(&mut batch, &common::applied(i + 1), 0)?;
        }
    }
    // Every record but the newest (in the active segment) is past retention.
    let now = 1_700_000_000_000 + RECORDS;
    let cut = a.retention_cut(now)?.ok_or("every sealed segment of the leader is past retention")?;
    assert!(cut > 0 && cut < RECORDS, "cut {cut}");
    assert_eq!(a.log_start_offset(), 0, "computing the cut deletes nothing");
    let b_bases = segment_bases(dir_b.path())?;
    assert!(!b_bases.contains(&cut), "the follower's segments {b_bases:?} straddle the leader's cut {cut}");

    let trim = pb::TierCommand { kind: Some(pb::tier_command::Kind::TrimTo(cut)), at_ms: 0 };
    for p in [&a, &b] {
        p.apply_tier(&trim, RECORDS + 1)?;
    }
    check_trimmed(&a, cut, "leader")?;
    check_trimmed(&b, cut, "follower")?;
    assert!(segment_bases(dir_b.path())?.first().is_some_and(|base| *base < cut), "the straddling segment stays");
    assert_eq!(a.retention_cut(now)?, None, "nothing more past retention than the trim");

    drop(b);
    let b = open(dir_b.path(), follower_config)?;
    check_trimmed(&b, cut, "follower after a restart")?;
    Ok(())
}

/// A follower catching up applies many entries at once, in one call of its state machine: a
/// trim among them removes the records of the entries before it from its disk, as it does
/// when each entry comes alone (it used to be applied ahead of them, deleting none of them,
/// and the replica kept them until a later trim).
#[test]
fn a_trim_applied_in_one_chunk_with_the_records_before_it_deletes_their_segments() -> TestResult {
    use logdex_raft::state_machine::GroupData;
    use logdex_raft::state_machine::GroupStateMachine;
    use openraft::entry::RaftEntry;
    use openraft::storage::RaftStateMachine;

    let dir = tempfile::tempdir()?;
    let config = LogConfig { segment_bytes: 500, ..LogConfig::default() };
    let p = std::sync::Arc::new(open(dir.path(), config)?);
    let snapshots = logdex_raft::snapshot::SnapshotStore::open(dir.path().join("snapshots"))?;
    let mut sm = GroupStateMachine::new(GroupData::Partition(p.clone()), Default::default(), snapshots);
    let cut = 40;
    let entry = |index: u64, kind: pb::command::Kind| {
        let log_id = logdex_raft::wire::log_id_from_pb(&pb::LogId { term: 1, index });
        let payload = openraft::EntryPayload::Normal(pb::Command { kind: Some(kind) });
        Ok((logdex_raft::types::Entry::new(log_id, payload), None))
    };
    // Records 0..50, the trim to 40, records 50..60: entries 1 to 61.
    let mut entries = Vec::new();
    for i in 0..RECORDS {
        let batch = logdex_log::encode_batch(&[common::record(i, RECORDS)], Compression::None)?;
        let index = if i < 50 { i + 1 } else { i + 2 };
        entries.push(entry(index, pb::command::Kind::Produce(pb::Produce { batch })));
    }
    let trim = pb::TierCommand { kind: Some(pb::tier_command::Kind::TrimTo(cut)), at_ms: 0 };
    entries.insert(50, entry(51, pb::command::Kind::Tier(trim)));
    let runtime = tokio::runtime::Builder::new_current_thread().build()?;
    runtime.block_on(sm.apply(futures::stream::iter(entries)))?;

    check_trimmed(&p, cut, "after one chunk")?;
    let bases = segment_bases(dir.path())?;
    assert!(bases.len() > 2 && bases[0] <= cut && bases[1] > cut, "segments wholly below the trim stay: {bases:?}");
    assert_eq!(p.high_watermark(), RECORDS);
    Ok(())
}

fn copy_dir(from: &Path, to: &Path) -> std::io::Result<()> {
    std::fs::create_dir_all(to)?;
    for entry in std::fs::read_dir(from)? {
        let entry = entry?;
        let target = to.join(entry.file_name());
        if entry.file_type()?.is_dir() {
            copy_dir(&entry.path(), &target)?;
        } else {
            std::fs::copy(entry.path(), &target)?;
        }
    }
    Ok(())
}

/// A trim that emptied the log reached the disk and the index's applied point did not (a
/// power loss within a checkpoint interval): the replica opens at the index's point with an
/// empty log, and re-applying the entries after it (the records, then the trim) leaves it as
/// it was.
#[test]
fn a_replica_whose_index_is_behind_a_trim_that_emptied_its_log_opens_and_reapplies() -> TestResult {
    let dir = tempfile::tempdir()?;
    let config = LogConfig { segment_bytes: 500, retention_ms: Some(1), ..LogConfig::default() };
    let apply = |p: &Partition, i: u64| -> TestResult {
        let mut batch = [logdex_log::encode_batch(&[common::record(i, RECORDS)], Compression::None)?];
        p.apply_batches(&mut batch, &common::applied(i + 1), 0)?;
        Ok(())
    };
    let trim = pb::TierCommand { kind: Some(pb::tier_command::Kind::TrimTo(20)), at_ms: 0 };
    let p = open(dir.path(), config.clone())?;
    for i in 0..10 {
        apply(&p, i)?;
    }
    p.checkpoint()?;
    drop(p);
    copy_dir(&dir.path().join("index"), &dir.path().join("index-at-10"))?;
    let p = open(dir.path(), config.clone())?;
    for i in 10..20 {
        apply(&p, i)?;
    }
    p.apply_tier(&trim, 21)?;
    assert_eq!((p.log_start_offset(), p.high_watermark()), (20, 20), "the trim emptied the log");
    p.checkpoint()?;
    drop(p);
    // The power loss: the index is back at its point of offset 10, the log's deletions stayed.
    std::fs::remove_dir_all(dir.path().join("index"))?;
    std::fs::rename(dir.path().join("index-at-10"), dir.path().join("index"))?;

    let index = Index::open(&dir.path().join("index"), IndexConfig::default())?;
    let (p, state) = Partition::open(3, 1 << 20, &dir.path().join("partition"), config, index)?;
    assert_eq!(state.applied.map(|l| l.index), Some(10), "the replica resumes at the index's point");
    assert_eq!(p.high_watermark(), 10);
    for i in 10..20 {
        apply(&p, i)?;
    }
    p.apply_tier(&trim, 21)?;
    assert_eq!((p.log_start_offset(), p.high_watermark()), (20, 20), "re-applied to the same state");
    for i in 0..20 {
        let (read, _) = p.read_key_at(format!("k{i}").as_bytes())?;
        assert!(matches!(read, KeyRead::Evicted { .. } | KeyRead::NotFound), "k{i}: {read:?}");
    }
    apply(&p, 20)?;
    let (read, _) = p.read_key_at(b"k20")?;
    assert!(matches!(read, KeyRead::Found { offset: 20, .. }), "a write after the trim lands at offset 20: {read:?}");
    Ok(())
}

fn read_all(p: &Partition) -> Result<Vec<String>, Box<dyn std::error::Error>> {
    let mut answers = Vec::new();
    for i in 0..RECORDS {
        let (read, _) = p.read_key_at(format!("k{i}").as_bytes())?;
        answers.push(match read {
            KeyRead::Found { offset, .. } => format!("found {offset}"),
            KeyRead::Evicted { offset } => format!("removed {offset}"),
            KeyRead::NotFound => "not found".to_string(),
        });
    }
    Ok(answers)
}

/// The answers expected with the log trimmed to `cut` and forgotten to `forgotten`.
fn expected(cut: u64, forgotten: u64) -> Vec<String> {
    (0..RECORDS)
        .map(|i| match i {
            i if i < forgotten => "not found".to_string(),
            i if i < cut => format!("removed {i}"),
            i => format!("found {i}"),
        })
        .collect()
}

#[test]
fn removed_keys_answer_removed_on_every_replica_until_a_committed_forget_then_not_found() -> TestResult {
    let (dir_a, dir_b) = (tempfile::tempdir()?, tempfile::tempdir()?);
    let config = LogConfig { segment_bytes: 500, ..LogConfig::default() };
    let index_b = Index::open(&dir_b.path().join("index"), IndexConfig::default())?;
    let a = open(dir_a.path(), config.clone())?;
    let (b, _) = Partition::open(3, 1 << 20, &dir_b.path().join("partition"), config.clone(), index_b.clone())?;
    for i in 0..RECORDS {
        for p in [&a, &b] {
            let mut batch = [logdex_log::encode_batch(&[common::record(i, RECORDS)], Compression::None)?];
            p.apply_batches(&mut batch, &common::applied(i + 1), 0)?;
        }
    }
    let cut = 30;
    let trim = pb::TierCommand { kind: Some(pb::tier_command::Kind::TrimTo(cut)), at_ms: 0 };
    for p in [&a, &b] {
        p.apply_tier(&trim, RECORDS + 1)?;
    }
    // One replica's index compacts everything (its filter runs over every entry); the
    // other's does not: they answer alike.
    index_b.compact()?;
    assert_eq!(read_all(&a)?, expected(cut, 0), "replica a after the trim");
    assert_eq!(read_all(&b)?, expected(cut, 0), "replica b after the trim and a full index compaction");

    // A forget names at most the last trim: one past it forgets up to the trim only.
    let forget = |to| pb::TierCommand { kind: Some(pb::tier_command::Kind::ForgetTo(to)), at_ms: 0 };
    for p in [&a, &b] {
        p.apply_tier(&forget(20), RECORDS + 2)?;
    }
    assert_eq!(read_all(&a)?, expected(cut, 20), "replica a after a forget to 20");
    index_b.compact()?;
    assert_eq!(read_all(&b)?, expected(cut, 20), "replica b after a forget to 20 and a compaction");
    for p in [&a, &b] {
        p.apply_tier(&forget(RECORDS), RECORDS + 3)?;
        assert_eq!(p.tier_manifest().forgotten_to, cut, "forgotten to the trim, not past it");
    }
    assert_eq!(read_all(&a)?, expected(cut, cut), "replica a after a forget past the trim");
    assert_eq!(read_all(&b)?, expected(cut, cut), "replica b after a forget past the trim");

    drop((b, index_b));
    let b = open(dir_b.path(), config)?;
    assert_eq!(read_all(&b)?, expected(cut, cut), "replica b after a restart");
    Ok(())
}

/// A replica that installs a snapshot taken after a trim answers the removed keys as the
/// replica it came from does (the snapshot carries their index entries, which its segments
/// cannot give), before and after a forget; a damaged removed-keys file refuses the snapshot.
#[test]
fn a_replica_installing_a_snapshot_answers_removed_keys_as_its_source_does() -> TestResult {
    let (dir_a, dir_c) = (tempfile::tempdir()?, tempfile::tempdir()?);
    let config = LogConfig { segment_bytes: 500, ..LogConfig::default() };
    let a = open(dir_a.path(), config.clone())?;
    for i in 0..RECORDS {
        let mut batch = [logdex_log::encode_batch(&[common::record(i, RECORDS)], Compression::None)?];
        a.apply_batches(&mut batch, &common::applied(i + 1), 0)?;
    }
    let cut = 30;
    // The trim's time travels with the manifest, so the replica that installs it could lead
    // and forget the removed keys on time.
    a.apply_tier(&pb::TierCommand { kind: Some(pb::tier_command::Kind::TrimTo(cut)), at_ms: 12_345 }, RECORDS + 1)?;
    let timed = [logdex_raft::tier::TimedTrim { to: cut, at_ms: 12_345 }];
    let snapshot = |name: &str| -> Result<std::path::PathBuf, Box<dyn std::error::Error>> {
        let staged = dir_a.path().join(name);
        std::fs::create_dir_all(&staged)?;
        a.snapshot_to(&staged, &common::applied(RECORDS + 1))?;
        Ok(staged)
    };
    let c = open(dir_c.path(), config.clone())?;
    c.install_snapshot(&snapshot("after-trim")?)?;
    assert_eq!(read_all(&c)?, expected(cut, 0), "installed after the trim");
    assert_eq!(read_all(&c)?, read_all(&a)?);
    assert_eq!(c.tier_manifest().timed_trims, timed);

    a.apply_tier(&pb::TierCommand { kind: Some(pb::tier_command::Kind::ForgetTo(20)), at_ms: 0 }, RECORDS + 2)?;
    let after_forget = snapshot("after-forget")?;
    c.install_snapshot(&after_forget)?;
    assert_eq!(read_all(&c)?, expected(cut, 20), "installed after a forget to 20");
    assert_eq!(c.tier_manifest().forgotten_to, 20);
    drop(c);
    let c = open(dir_c.path(), config)?;
    assert_eq!(read_all(&c)?, expected(cut, 20), "after a restart");
    assert_eq!(c.tier_manifest().timed_trims, timed, "a forget below the trim keeps its time");

    let removed = after_forget.join("removed.keys");
    let mut bytes = std::fs::read(&removed)?;
    bytes[6] ^= 0x40;
    std::fs::write(&removed, bytes)?;
    let refused = c.install_snapshot(&after_forget).err().ok_or("a damaged removed-keys file was installed")?;
    assert!(refused.to_string().contains("removed.keys: checksum mismatch"), "{refused}");
    assert_eq!(read_all(&c)?, expected(cut, 20), "the replica is unchanged");
    Ok(())
}
