//! Compaction of a replica runs beside its writes and lookups: it holds the segment log only
//! to take its plan and to install the rewritten segments, and it keeps every key's newest
//! record, including records of a segment sealed by the apply that is still indexing them.

use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::sync::atomic::Ordering;

use logdex_index::Index;
use logdex_index::IndexConfig;
use logdex_log::Compression;
use logdex_log::LogConfig;
use logdex_raft::partition::KeyRead;
use logdex_raft::partition::Partition;

mod common;

type TestResult = Result<(), Box<dyn std::error::Error>>;

const KEYS: u64 = 20;
/// Applies of two one-record batches each (an apply may seal a segment between its batches).
const APPLIES: u64 = 1500;

#[test]
fn compaction_beside_writes_keeps_every_key_at_its_newest_record() -> TestResult {
    let root = tempfile::tempdir()?;
    let index = Index::open(&root.path().join("index"), IndexConfig::default())?;
    let config = LogConfig { segment_bytes: 2048, ..LogConfig::default() };
    let (p, _) = Partition::open(3, 1 << 20, &root.path().join("partition"), config, index)?;
    let p = Arc::new(p);
    let done = Arc::new(AtomicBool::new(false));
    let (started_tx, started) = std::sync::mpsc::channel();
    let compactor = {
        let (p, done) = (p.clone(), done.clone());
        std::thread::spawn(move || -> Result<u64, String> {
            let _ = started_tx.send(());
            let mut passes = 0;
            // Bounded: the writer finishes in well under this many passes.
            while !done.load(Ordering::Acquire) && passes < 1_000_000 {
                p.compact(0).map_err(|e| e.to_string())?;
                passes += 1;
            }
            Ok(passes)
        })
    };
    started.recv_timeout(std::time::Duration::from_secs(30))?;
    for n in 0..APPLIES {
        let (a, b) = (2 * n, 2 * n + 1);
        let mut batches = [
            logdex_log::encode_batch(&[common::record(a, KEYS)], Compression::None)?,
            logdex_log::encode_batch(&[common::record(b, KEYS)], Compression::None)?,
        ];
        p.apply_batches(&mut batches, &common::applied(n + 1), 0)?;
    }
    done.store(true, Ordering::Release);
    let passes = compactor.join().map_err(|_| "compactor panicked")??;
    // One more pass over everything sealed by now.
    p.compact(0)?;
    let removed = p.counters.records_compacted.load(Ordering::Relaxed);
    assert!(passes > 0 && removed > 0, "compaction removed nothing ({passes} passes)");
    for k in 0..KEYS {
        let newest = (0..2 * APPLIES).filter(|i| i % KEYS == k).max().ok_or("no write of the key")?;
        match p.read_key(format!("k{k}").as_bytes())? {
            KeyRead::Found { offset, record } => {
                assert_eq!(offset, newest, "key k{k} answers offset {offset}, its newest write is {newest}");
                assert_eq!(record, common::record(newest, KEYS), "key k{k}");
            }
            other => return Err(format!("key k{k} (newest write at {newest}) answers {other:?}").into()),
        }
    }
    Ok(())
}

/// Two replicas of the same entries, one compacting before a write that supersedes a record
/// of its sealed segments (from the active segment) and one after it, keep the same records:
/// a record goes only when a newer record of its key is among the segments compacted, as
/// Kafka's cleaner decides. Before, the later replica removed the superseded record (its
/// index already pointed past it) and the earlier one kept it until its next pass, which a
/// partition that is not written to never runs: their fetches differed for good. Once the
/// superseding records are sealed too, both passes remove the old records alike.
#[test]
fn replicas_compacting_before_and_after_a_write_keep_the_same_records() -> TestResult {
    const KEYS: u64 = 14;
    let root = tempfile::tempdir()?;
    let index = Index::open(&root.path().join("index"), IndexConfig::default())?;
    let config = LogConfig { segment_bytes: 1024, ..LogConfig::default() };
    let (early, _) = Partition::open(1, 1, &root.path().join("early"), config.clone(), index.clone())?;
    let (late, _) = Partition::open(2, 2, &root.path().join("late"), config, index)?;
    let mut entry = 0;
    let mut apply = |records: &[logdex_log::Record]| -> TestResult {
        entry += 1;
        for p in [&early, &late] {
            let mut batches = [logdex_log::encode_batch(records, Compression::None)?];
            p.apply_batches(&mut batches, &common::applied(entry), 0)?;
        }
        Ok(())
    };
    for i in 0..KEYS {
        apply(&[common::record(i, KEYS)])?;
    }
    assert!(early.sealed_bytes() > 0, "1 KiB segments roll under {KEYS} records");
    early.compact(0)?;
    // k0 again, and a tombstone of k1: both in the active segment.
    apply(&[common::record(KEYS, KEYS)])?;
    let tombstone = logdex_log::Record { value: None, ..common::record(KEYS + 1, KEYS) };
    apply(&[tombstone])?;
    late.compact(0)?;
    let records =
        |p: &Partition| p.read_records(0, 1000, usize::MAX).map(|r| r.into_iter().map(|(o, _)| o).collect::<Vec<_>>());
    let (early_offsets, late_offsets) = (records(&early)?, records(&late)?);
    assert_eq!(early_offsets, late_offsets, "replicas that compacted before and after the write");
    assert!(
        early_offsets.contains(&0) && early_offsets.contains(&1),
        "superseded only from the active segment: {early_offsets:?}"
    );

    // Seal the segment holding the newer records; then both passes remove offsets 0 and 1.
    for i in KEYS + 2..3 * KEYS {
        apply(&[common::record(i, 100 + i)])?;
    }
    early.compact(0)?;
    late.compact(0)?;
    let (early_offsets, late_offsets) = (records(&early)?, records(&late)?);
    assert_eq!(early_offsets, late_offsets, "after the next passes");
    assert!(
        !early_offsets.contains(&0) && !early_offsets.contains(&1),
        "superseded within the sealed segments: {early_offsets:?}"
    );
    Ok(())
}
