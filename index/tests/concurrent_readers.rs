//! Readers running during rebuilds, drops and compactions of their group only
//! ever see one whole generation.

mod common;

use common::{TestResult, marker, put};
use logdex_index::{Lookup, Update};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

const KEYS: u64 = 2_000;
const NEW: u64 = 10_000;

/// While a rebuild (offsets shifted by `NEW`) and then a drop run, with
/// compactions (filter included) in a loop, every lookup answers the old
/// offset, the new one, or - once the drop has started - `NotFound`.
#[test]
fn readers_see_old_or_new_generation_during_rebuild_drop_and_compaction() -> TestResult {
    let dir = tempfile::tempdir()?;
    let index = common::open(dir.path())?;
    let keys: Vec<Vec<u8>> = (0..KEYS).map(|i| format!("key-{i:05}").into_bytes()).collect();
    let updates: Vec<Update<'_>> = keys.iter().zip(0u64..).map(|(k, o)| put(k, o)).collect();
    index.apply(1, &updates, &marker(KEYS))?;

    let dropping = Arc::new(AtomicBool::new(false));
    let done = Arc::new(AtomicBool::new(false));
    let readers: Vec<_> = (0..2u64)
        .map(|seed| {
            let (index, keys, dropping, done) = (index.clone(), keys.clone(), dropping.clone(), done.clone());
            std::thread::spawn(move || -> Result<u64, String> {
                let mut reads = 0u64;
                let mut i = seed;
                while !done.load(Ordering::Acquire) {
                    i = (i * 31 + 7) % KEYS;
                    let key = keys.get(i as usize).ok_or("key index")?;
                    let answer = index.get(1, key).map_err(|e| e.to_string())?;
                    let ok = match answer {
                        Lookup::Found(offset) => offset == i || offset == i + NEW,
                        Lookup::NotFound => dropping.load(Ordering::Acquire),
                        Lookup::Evicted(_) => false,
                    };
                    if !ok {
                        return Err(format!("key {i}: {answer:?}"));
                    }
                    reads += 1;
                }
                Ok(reads)
            })
        })
        .collect();
    let compactor = {
        let (index, done) = (index.clone(), done.clone());
        std::thread::spawn(move || -> Result<(), String> {
            while !done.load(Ordering::Acquire) {
                index.compact().map_err(|e| e.to_string())?;
            }
            Ok(())
        })
    };

    for round in 0..3u64 {
        let shift = if round % 2 == 0 { NEW } else { 0 };
        let log = keys.iter().zip(0u64..).map(|(key, i)| Ok::<_, String>((key.clone(), i + shift, false)));
        assert_eq!(index.rebuild(1, log, &marker(KEYS + shift))?, Ok(KEYS));
        index.persist()?;
    }
    dropping.store(true, Ordering::Release);
    index.drop_group(1)?;
    index.persist()?;
    std::thread::sleep(std::time::Duration::from_millis(50));
    done.store(true, Ordering::Release);

    for reader in readers {
        let reads = reader.join().map_err(|_| "reader panicked")??;
        assert!(reads > 0);
    }
    compactor.join().map_err(|_| "compactor panicked")??;
    assert_eq!(index.get(1, b"key-00001")?, Lookup::NotFound);
    Ok(())
}
