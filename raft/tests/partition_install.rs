//! Reads of a replica while a snapshot install holds its locks (the install rebuilds the
//! index: seconds for a large partition) wait on a thread of their own, so the runtime's
//! worker goes on with its other tasks; with one worker thread, a lookup waiting inline
//! stopped every task of the node until the install ended.

use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::sync::atomic::AtomicU64;
use std::sync::atomic::Ordering;

use logdex_index::Index;
use logdex_index::IndexConfig;
use logdex_log::Compression;
use logdex_log::LogConfig;
use logdex_raft::partition::KeyRead;
use logdex_raft::partition::Partition;
use logdex_raft::snapshot::SnapshotStore;
use logdex_raft::types::SnapshotMeta;

mod common;
use common::applied;

type TestResult = Result<(), Box<dyn std::error::Error>>;

const GROUP: u64 = 5;
const LEADER: u64 = 1 << 20;
const FOLLOWER: u64 = (1 << 20) + 1;
/// Enough records for the install to hold the replica's locks far longer than a lookup takes.
const RECORDS: u64 = 200_000;
const KEYS: u64 = 50_000;
const PER_ENTRY: u64 = 1_000;

#[test]
fn lookups_during_a_snapshot_install_leave_the_worker_to_other_tasks() -> TestResult {
    let root = tempfile::tempdir()?;
    let index = Index::open(&root.path().join("index"), IndexConfig::default())?;
    let config = LogConfig::default();
    let (leader, _) = Partition::open(GROUP, LEADER, &root.path().join("leader"), config.clone(), index.clone())?;
    for entry in 0..RECORDS / PER_ENTRY {
        let records: Vec<_> = (entry * PER_ENTRY..(entry + 1) * PER_ENTRY).map(|i| common::record(i, KEYS)).collect();
        let mut batch = [logdex_log::encode_batch(&records, Compression::None)?];
        let results = leader.apply_batches(&mut batch, &applied(entry + 1), 0)?;
        assert!(results.iter().all(Result::is_ok), "{results:?}");
    }
    let last = applied(RECORDS / PER_ENTRY);
    let store = SnapshotStore::open(root.path().join("snapshots"))?;
    let staged = store.staging("s1")?;
    leader.snapshot_to(&staged, &last)?;
    let meta = SnapshotMeta { last_log_id: last.applied, last_membership: Default::default() };
    let snapshot = store.commit(&staged, "s1", &meta)?;

    let (follower, _) = Partition::open(GROUP, FOLLOWER, &root.path().join("follower"), config, index)?;
    let follower = Arc::new(follower);
    let installed = Arc::new(AtomicBool::new(false));
    let installer = {
        let (follower, installed, dir) = (follower.clone(), installed.clone(), snapshot.dir.clone());
        std::thread::spawn(move || {
            let result = follower.install_snapshot(&dir).map(|_| ());
            installed.store(true, Ordering::Release);
            result
        })
    };

    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(1).build()?;
    let (lookups, freed) = runtime.block_on(async {
        // Another task of the node: it advances only while the worker runs it.
        let ticks = Arc::new(AtomicU64::new(0));
        let ticker = {
            let (ticks, installed) = (ticks.clone(), installed.clone());
            tokio::spawn(async move {
                while !installed.load(Ordering::Acquire) {
                    ticks.fetch_add(1, Ordering::Relaxed);
                    tokio::task::yield_now().await;
                }
            })
        };
        // Lookups until the install ends; counts those during which the ticker ran.
        let reader = {
            let (ticks, installed, follower) = (ticks.clone(), installed.clone(), follower.clone());
            tokio::spawn(async move {
                let (mut lookups, mut freed) = (0u64, 0u64);
                while !installed.load(Ordering::Acquire) {
                    let before = ticks.load(Ordering::Relaxed);
                    let _ = follower.read_key_at(b"k1");
                    if ticks.load(Ordering::Relaxed) > before {
                        freed += 1;
                    }
                    lookups += 1;
                    tokio::task::yield_now().await;
                }
                (lookups, freed)
            })
        };
        let counts = reader.await;
        let _ = ticker.await;
        counts
    })?;
    installer.join().map_err(|_| "the installing thread panicked")??;
    assert!(lookups > 0, "lookups ran during the install");
    assert!(freed > 0, "no lookup of {lookups} during the install let the worker run its other tasks");

    // The install is whole: the newest record of a key answers.
    match follower.read_key(b"k1")? {
        KeyRead::Found { offset, .. } => assert_eq!(offset, RECORDS - KEYS + 1),
        other => return Err(format!("k1 after the install: {other:?}").into()),
    }
    Ok(())
}
