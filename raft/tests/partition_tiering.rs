//! Tiered storage at the replica: once remote segments cover its sealed segments and local
//! retention deleted them, a replica answers every fetch and lookup from the remote copies
//! (fetched into its cache on a miss), and a replica built from its snapshot rebuilds a
//! complete index from them, also when two leaders copied overlapping segments.

use std::path::Path;

use logdex_index::Index;
use logdex_index::IndexConfig;
use logdex_log::Compression;
use logdex_log::LogConfig;
use logdex_log::Record;
use logdex_raft::Error;
use logdex_raft::partition::AppliedState;
use logdex_raft::partition::KeyRead;
use logdex_raft::partition::Partition;
use logdex_raft::pb;
use logdex_raft::tier::RemoteSegment;
use logdex_raft::tier::TierStore;

mod common;

type TestResult = Result<(), Box<dyn std::error::Error>>;

const RECORDS: u64 = 80;
const KEYS: u64 = 25;

fn record(i: u64) -> Record {
    common::record(i, KEYS)
}

fn open(dir: &Path, segment_bytes: u64, store: &TierStore) -> Result<Partition, Box<dyn std::error::Error>> {
    let index = Index::open(&dir.join("index"), IndexConfig::default())?;
    let config = LogConfig { segment_bytes, ..LogConfig::default() };
    let (p, _) = Partition::open_with_tier(3, 1 << 20, &dir.join("partition"), config, index, Some(store.clone()))?;
    Ok(p)
}

/// The applied state after the entry of record `i`.
fn state(i: u64) -> AppliedState {
    common::applied(i + 1)
}

fn apply_all(p: &Partition) -> TestResult {
    for i in 0..RECORDS {
        let mut batch = [logdex_log::encode_batch(&[record(i)], Compression::None)?];
        p.apply_batches(&mut batch, &state(i), 0)?;
    }
    Ok(())
}

/// Copies `p`'s sealed segments not yet in its manifest to the store and applies their
/// `add` commands to every partition of `apply_to` (as the leader and Raft do).
async fn upload(
    p: &Partition,
    store: &TierStore,
    apply_to: &[&Partition],
) -> Result<usize, Box<dyn std::error::Error>> {
    let candidates = p.tier_candidates();
    for s in &candidates {
        let (remote, copy) = p.tier_cache().copy_local(s, "t", 0, 3)?;
        store.put_file(&remote.object, copy, remote.size_bytes).await?;
        let add = pb::TierCommand { kind: Some(pb::tier_command::Kind::Add(remote.to_pb())), at_ms: 0 };
        for q in apply_to {
            q.apply_tier(&add, 1)?;
        }
    }
    Ok(candidates.len())
}

/// Runs `read`, fetching the remote segments it misses, as the node does.
async fn with_fetch<T>(p: &Partition, read: impl Fn() -> Result<T, Error>) -> Result<T, Box<dyn std::error::Error>> {
    for _ in 0..100 {
        match read() {
            Err(Error::TierMiss { segments, .. }) => {
                for s in &segments {
                    p.tier_cache().fetch(s).await?;
                }
            }
            other => return Ok(other?),
        }
    }
    Err("still missing remote segments after 100 fetches".into())
}

async fn check_reads(p: &Partition) -> TestResult {
    let mut offset = 0;
    while offset < RECORDS {
        let got = with_fetch(p, || p.read_records(offset, 7, 1 << 20)).await?;
        assert!(!got.is_empty(), "empty read at offset {offset}");
        for (o, r) in got {
            assert_eq!((o, r.value), (offset, record(offset).value), "records in order, dense");
            offset += 1;
        }
    }
    for k in 0..KEYS {
        let newest = RECORDS - 1 - ((RECORDS - 1 + KEYS - k) % KEYS);
        match with_fetch(p, || p.read_key(format!("k{k}").as_bytes())).await? {
            KeyRead::Found { offset, record: r } => {
                assert_eq!((offset, r.value), (newest, record(newest).value), "key k{k}");
            }
            other => panic!("key k{k}: {other:?}"),
        }
    }
    Ok(())
}

#[tokio::test]
async fn a_replica_reads_remote_segments_and_its_snapshot_rebuilds_a_complete_index() -> TestResult {
    let root = tempfile::tempdir()?;
    let store = TierStore::open(&root.path().join("store").display().to_string())?;
    // Two replicas whose segments roll at different offsets.
    let a = open(&root.path().join("a"), 1024, &store)?;
    let b = open(&root.path().join("b"), 1600, &store)?;
    apply_all(&a)?;
    apply_all(&b)?;
    // The first leader copied a's first segments, a second one b's after them: the
    // manifest holds overlapping segments.
    let first = a.tier_candidates();
    assert!(first.len() > 4, "small segments roll: {}", first.len());
    let half = first[first.len() / 2].next_offset;
    let leader = open(&root.path().join("half"), 1024, &store)?;
    for i in 0..half {
        let mut batch = [logdex_log::encode_batch(&[record(i)], Compression::None)?];
        leader.apply_batches(&mut batch, &state(i), 0)?;
    }
    let mut batch = [logdex_log::encode_batch(&[record(half)], Compression::None)?];
    leader.apply_batches(&mut batch, &state(half), 0)?;
    assert!(upload(&leader, &store, &[&a, &b]).await? > 0);
    assert!(upload(&b, &store, &[&a, &b]).await? > 0);
    let manifest = a.tier_manifest();
    assert!(
        manifest.segments.windows(2).any(|w| w[1].base_offset < w[0].next_offset),
        "overlapping remote segments: {manifest:?}"
    );

    let now = u64::try_from(1_800_000_000_000i64)?;
    let deleted = a.apply_local_retention(now, Some(0), None)?;
    assert!(deleted > 4, "local copies deleted: {deleted}");
    assert_eq!(a.log_start_offset(), 0, "the log still starts at 0");
    assert!(matches!(a.read_records(0, 10, 1 << 20), Err(Error::TierMiss { .. })), "nothing cached yet");
    check_reads(&a).await?;

    // A replica built from a's snapshot: its index comes from the remote and local segments.
    let staged = root.path().join("snapshot");
    std::fs::create_dir_all(&staged)?;
    a.snapshot_to(&staged, &state(RECORDS - 1))?;
    let c = open(&root.path().join("c"), 1024, &store)?;
    let _: AppliedState = c.install_snapshot(&staged)?;
    assert_eq!(c.tier_manifest(), manifest);
    check_reads(&c).await?;

    // Retention trims remote segments: the start moves to the first one left, and reads
    // from 0 begin there.
    let trim_to = manifest.segments[1].next_offset;
    c.apply_tier(&pb::TierCommand { kind: Some(pb::tier_command::Kind::TrimTo(trim_to)), at_ms: 0 }, 500)?;
    let start = c.tier_manifest().start_offset().ok_or("remote segments left")?;
    assert_eq!(c.log_start_offset(), start);
    let first = with_fetch(&c, || c.read_records(0, 1, 1 << 20)).await?;
    assert_eq!(first.first().map(|(o, _)| *o), Some(start));
    let manifest_c = c.tier_manifest();
    assert_eq!((manifest_c.trimmed_to, manifest_c.trimmed_at), (trim_to, 500), "the trim is recorded");
    let trimmed: Vec<RemoteSegment> = manifest.segments.iter().filter(|s| s.next_offset <= trim_to).cloned().collect();
    assert_eq!(trimmed.len(), 2);
    let prefix = logdex_raft::tier::prefix_of(&trimmed[0].object).to_string();

    // Objects gone without the trim marker: a replica installing a's older snapshot (which
    // still names them) refuses it before replacing anything.
    let stash = root.path().join("stash");
    std::fs::create_dir_all(&stash)?;
    for (i, s) in trimmed.iter().enumerate() {
        store.get_to_file(&s.object, &stash.join(i.to_string())).await?;
        store.delete(&s.object).await?;
    }
    let refusing = open(&root.path().join("refusing"), 1024, &store)?;
    assert!(matches!(refusing.install_snapshot(&staged), Err(Error::Unavailable(_))));
    for (i, s) in trimmed.iter().enumerate() {
        store.put_file(&s.object, std::fs::File::open(stash.join(i.to_string()))?, s.size_bytes).await?;
    }

    // With the marker raised before they are deleted (as the leader does), the same install
    // skips them: the trim entry after the snapshot trims them there too. Every key whose
    // newest record is past the trim is found.
    store.raise_trimmed_to(&prefix, trim_to).await?;
    assert_eq!(store.trimmed_to(&prefix).await?, trim_to);
    for s in &trimmed {
        store.delete(&s.object).await?;
    }
    let d = open(&root.path().join("d"), 1024, &store)?;
    d.install_snapshot(&staged)?;
    assert_eq!(d.tier_manifest(), manifest);
    let newest_of = |k: u64| RECORDS - 1 - ((RECORDS - 1 + KEYS - k) % KEYS);
    let mut checked = 0;
    for k in (0..KEYS).filter(|k| newest_of(*k) >= trim_to) {
        match with_fetch(&d, || d.read_key(format!("k{k}").as_bytes())).await? {
            KeyRead::Found { offset, .. } => assert_eq!(offset, newest_of(k), "key k{k}"),
            other => panic!("key k{k}: {other:?}"),
        }
        checked += 1;
    }
    assert_eq!(checked, KEYS, "every key's newest record is past the trim");
    let remote_end = manifest.end_offset().ok_or("remote segments")?;
    assert!(
        (0..KEYS).filter(|k| newest_of(*k) < remote_end).count() > KEYS as usize / 2,
        "most keys' newest records are in remote segments (a's local copies were deleted)"
    );

    // A replica whose manifest was trimmed past some of its local segments never copies them:
    // they are past retention.
    let f = open(&root.path().join("f"), 1024, &store)?;
    apply_all(&f)?;
    let all = f.tier_candidates();
    f.apply_tier(&pb::TierCommand { kind: Some(pb::tier_command::Kind::TrimTo(trim_to)), at_ms: 0 }, 9)?;
    let left = f.tier_candidates();
    assert!(left.len() < all.len() && !left.is_empty(), "{} of {} candidates left", left.len(), all.len());
    assert!(left.iter().all(|s| s.next_offset > trim_to));

    // A store holding none of the objects (another directory, say) fails the install before
    // it replaces anything.
    let elsewhere = TierStore::open(&root.path().join("elsewhere").display().to_string())?;
    let e = open(&root.path().join("e"), 1024, &elsewhere)?;
    apply_all(&e)?;
    assert!(matches!(e.install_snapshot(&staged), Err(Error::Unavailable(_))));
    assert!(!root.path().join("e/partition/installing.json").exists(), "no install was started");
    check_reads(&e).await?;
    Ok(())
}

/// A replica whose local copies were all deleted (its local log is empty, its start moved)
/// and whose index is lost rebuilds the index from the remote segments on open, from its last
/// checkpoint, instead of starting over at entry 1 on a log that starts later.
#[tokio::test]
async fn an_index_lost_under_an_emptied_local_log_is_rebuilt_from_remote_segments() -> TestResult {
    let root = tempfile::tempdir()?;
    let store = TierStore::open(&root.path().join("store").display().to_string())?;
    let dir = root.path().join("g");
    {
        let g = open(&dir, 1024, &store)?;
        apply_all(&g)?;
        // Seal the last segment (a snapshot rolls the log), copy everything, delete it locally.
        std::fs::create_dir_all(root.path().join("snapshot"))?;
        g.snapshot_to(&root.path().join("snapshot"), &state(RECORDS - 1))?;
        assert!(upload(&g, &store, &[&g]).await? > 4);
        let now = u64::try_from(1_800_000_000_000i64)?;
        assert!(g.apply_local_retention(now, Some(0), None)? > 4);
        assert_eq!(g.tier_candidates().len(), 0);
    }
    std::fs::remove_dir_all(dir.join("index"))?;
    let g = open(&dir, 1024, &store)?;
    assert_eq!(g.high_watermark(), RECORDS, "the applied point comes from the checkpoint");
    check_reads(&g).await?;
    Ok(())
}
