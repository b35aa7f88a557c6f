//! Retention committed as a trim: the leader computes the start offset retention leaves in
//! its own log; every replica applies the same trim, whatever its own segment boundaries,
//! and then answers alike: keys below the trim are removed (410), fetches start at it, and
//! so after a restart.

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

    let trim = pb::TierCommand { kind: Some(pb::tier_command::Kind::TrimTo(cut)) };
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
    let trim = pb::TierCommand { kind: Some(pb::tier_command::Kind::TrimTo(20)) };
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
