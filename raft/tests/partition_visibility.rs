//! A replica's lookup and the high watermark it reports are one snapshot: a reader that sees
//! the high watermark at or past an offset (a follower lookup with `min_offset` waits for
//! exactly that) finds that write or a newer one, and never an offset at or above it.
//! Found by the chaos soak (seed 3030): a `min_offset` lookup answered an older value while
//! the high watermark it reported covered the newer write.

use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::sync::atomic::Ordering;

use logdex_index::Index;
use logdex_index::IndexConfig;
use logdex_log::Compression;
use logdex_log::LogConfig;
use logdex_log::Record;
use logdex_raft::partition::AppliedState;
use logdex_raft::partition::KeyRead;
use logdex_raft::partition::Partition;
use logdex_raft::pb;

type TestResult = Result<(), Box<dyn std::error::Error>>;

const KEYS: u64 = 4;
const WRITES: u64 = 3000;

/// Record `i`, at offset `i`: key `k{i % KEYS}`.
fn record(i: u64) -> Record {
    Record {
        timestamp_ms: 1_700_000_000_000 + i as i64,
        key: Some(format!("k{}", i % KEYS).into_bytes()),
        value: Some(format!("v{i}").into_bytes()),
        headers: Vec::new(),
    }
}

#[test]
fn lookup_answers_exactly_the_newest_write_below_the_high_watermark_it_reports() -> TestResult {
    let root = tempfile::tempdir()?;
    let index = Index::open(&root.path().join("index"), IndexConfig::default())?;
    let (p, _) = Partition::open(3, 1 << 20, &root.path().join("partition"), LogConfig::default(), index)?;
    let p = Arc::new(p);
    let done = Arc::new(AtomicBool::new(false));
    let reader = {
        let (p, done) = (p.clone(), done.clone());
        std::thread::spawn(move || -> Result<u64, String> {
            let mut checks = 0;
            while !done.load(Ordering::Acquire) {
                for k in 0..KEYS {
                    let (read, hw) = p.read_key_at(format!("k{k}").as_bytes()).map_err(|e| e.to_string())?;
                    if hw <= k {
                        continue;
                    }
                    // The newest write of key k below the high watermark the answer came with.
                    let newest = (hw - 1) - ((hw - 1 + KEYS - k) % KEYS);
                    match read {
                        KeyRead::Found { offset, .. } if offset == newest => {}
                        other => {
                            return Err(format!(
                                "high watermark {hw}: key k{k} answered {other:?}, but its newest write below it is {newest}"
                            ));
                        }
                    }
                    checks += 1;
                }
            }
            Ok(checks)
        })
    };
    for i in 0..WRITES {
        let log_id = logdex_raft::wire::log_id_from_pb(&pb::LogId { term: 1, index: i + 1 });
        let state = AppliedState { applied: Some(log_id), ..AppliedState::default() };
        let mut batch = [logdex_log::encode_batch(&[record(i)], Compression::None)?];
        p.apply_batches(&mut batch, &state, 0)?;
    }
    done.store(true, Ordering::Release);
    let checks = reader.join().map_err(|_| "reader panicked")??;
    assert!(checks > 0, "the reader never ran");
    Ok(())
}
