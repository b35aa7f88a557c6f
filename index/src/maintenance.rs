//! The background maintenance thread (one per `Index`, stopped on drop).
//!
//! - Idle flush: after `idle_flush_ms` without writes, seal the memtables of
//!   both keyspaces so fjall flushes them to tables and can delete the
//!   journals they pinned (fjall only rotates memtables when they fill up, so
//!   an idle node would otherwise keep its data in memory and in the journal).
//! - Journal release: once fjall has sealed a journal (it rotates the active
//!   one at 64 MiB), seal the small meta memtable too, at most once a second:
//!   the meta keyspace gets a marker per apply but fills its memtable slowly,
//!   so it would otherwise pin sealed journals until `journal_bytes_max`.
//! - Promotion: if dropped generations or raised watermarks wait for an fsync
//!   and `persist` was not called for `gc_sync_interval_ms`, call it, so the
//!   compaction filter can reclaim their space.

use crate::error::{Error, Result};
use crate::index::Shared;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, PoisonError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

const TICK_MS_MIN: u64 = 10;
const TICK_MS_MAX: u64 = 1_000;

/// When the index was last written, for idle detection.
#[derive(Debug)]
pub(crate) struct Activity {
    started: Instant,
    last_write_ms: AtomicU64,
    dirty: AtomicBool,
}

impl Activity {
    pub(crate) fn new() -> Self {
        Self { started: Instant::now(), last_write_ms: AtomicU64::new(0), dirty: AtomicBool::new(false) }
    }

    /// Called after every committed write.
    pub(crate) fn touch(&self) {
        self.last_write_ms.store(self.now_ms(), Ordering::Relaxed);
        self.dirty.store(true, Ordering::Release);
    }

    fn now_ms(&self) -> u64 {
        u64::try_from(self.started.elapsed().as_millis()).unwrap_or(u64::MAX)
    }

    /// True (once) if written since the last call and idle for `idle_ms`.
    fn take_idle_dirty(&self, idle_ms: u64) -> bool {
        let idle = self.now_ms().saturating_sub(self.last_write_ms.load(Ordering::Relaxed));
        idle >= idle_ms && self.dirty.swap(false, Ordering::AcqRel)
    }
}

#[derive(Default)]
struct Stop {
    stopped: Mutex<bool>,
    wake: Condvar,
}

/// Handle of the maintenance thread; dropping it stops and joins the thread.
pub(crate) struct Maintenance {
    stop: Arc<Stop>,
    handle: Option<JoinHandle<()>>,
}

impl Maintenance {
    pub(crate) fn start(shared: Arc<Shared>) -> Result<Self> {
        let stop = Arc::new(Stop::default());
        let tick = tick(shared.config.idle_flush_ms, shared.config.gc_sync_interval_ms);
        let handle = std::thread::Builder::new()
            .name("logdex-index-maint".to_owned())
            .spawn({
                let stop = stop.clone();
                move || run(&shared, &stop, tick)
            })
            .map_err(|source| Error::Spawn { source })?;
        Ok(Self { stop, handle: Some(handle) })
    }
}

impl Drop for Maintenance {
    fn drop(&mut self) {
        *self.stop.stopped.lock().unwrap_or_else(PoisonError::into_inner) = true;
        self.stop.wake.notify_all();
        if let Some(handle) = self.handle.take()
            && handle.join().is_err()
        {
            tracing::error!("index maintenance thread panicked");
        }
    }
}

fn tick(idle_flush_ms: u64, gc_sync_interval_ms: u64) -> Duration {
    let shortest = [idle_flush_ms, gc_sync_interval_ms].into_iter().filter(|ms| *ms > 0).min().unwrap_or(TICK_MS_MAX);
    Duration::from_millis((shortest / 4).clamp(TICK_MS_MIN, TICK_MS_MAX))
}

const META_SEAL_INTERVAL: Duration = Duration::from_secs(1);

/// How long a compaction waits for a sealed memtable's flush before it goes on.
pub const FLUSH_WAIT_MAX: Duration = Duration::from_secs(10);

/// Seals `keyspace`'s active memtable and waits, at most `bound`, until fjall's workers have
/// flushed every sealed memtable of it; false if they had not by then.
///
/// fjall's `rotate_memtable_and_wait` waits without a bound (for its flush queue to empty,
/// then for the sealed memtables to go), and was seen waiting for ever with its workers idle,
/// holding up the compaction after a topic delete. A caller that stops waiting loses
/// nothing: the memtable is sealed and journaled, and the next flush of the keyspace (any
/// later rotation, as the idle flush makes) takes every sealed memtable along.
pub fn seal_and_wait_flushed(keyspace: &fjall::Keyspace, bound: Duration) -> fjall::Result<bool> {
    keyspace.rotate_memtable()?;
    let deadline = Instant::now() + bound;
    while keyspace.sealed_memtable_count() > 0 {
        if Instant::now() >= deadline {
            return Ok(false);
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    Ok(true)
}

fn run(shared: &Shared, stop: &Stop, tick: Duration) {
    let mut last_promotion = Instant::now();
    let mut last_meta_seal = Instant::now();
    loop {
        let stopped = stop.stopped.lock().unwrap_or_else(PoisonError::into_inner);
        let (stopped, _) =
            stop.wake.wait_timeout_while(stopped, tick, |stopped| !*stopped).unwrap_or_else(PoisonError::into_inner);
        if *stopped {
            return;
        }
        drop(stopped);

        let config = &shared.config;
        if config.idle_flush_ms > 0
            && shared.activity.take_idle_dirty(config.idle_flush_ms)
            && let Err(error) = shared.seal_memtables()
        {
            tracing::warn!(%error, "idle memtable flush failed");
        }
        if last_meta_seal.elapsed() >= META_SEAL_INTERVAL && shared.db.journal_count() > 1 {
            last_meta_seal = Instant::now();
            if let Err(error) = shared.seal_meta_memtable() {
                tracing::warn!(%error, "meta memtable flush failed");
            }
        }
        let gc_interval = Duration::from_millis(config.gc_sync_interval_ms);
        if config.gc_sync_interval_ms > 0 && last_promotion.elapsed() >= gc_interval && shared.registry.has_pending() {
            last_promotion = Instant::now();
            if let Err(error) = shared.persist() {
                tracing::warn!(%error, "background fsync for cleanup failed");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The bounded seal waits for the flush it starts: the keyspace's entry is in a table
    /// after it, and no sealed memtable is left.
    #[test]
    fn sealing_waits_until_the_sealed_memtable_is_flushed() -> Result<(), Box<dyn std::error::Error>> {
        let dir = tempfile::tempdir()?;
        let db = fjall::Database::builder(dir.path()).open()?;
        let keyspace = db.keyspace("t", fjall::KeyspaceCreateOptions::default)?;
        keyspace.insert("k", "v")?;
        assert_eq!(keyspace.table_count(), 0);
        assert!(seal_and_wait_flushed(&keyspace, Duration::from_secs(60))?);
        assert_eq!(keyspace.sealed_memtable_count(), 0);
        assert_eq!(keyspace.table_count(), 1);
        assert_eq!(keyspace.get("k")?.as_deref(), Some(&b"v"[..]));
        Ok(())
    }

    #[test]
    fn tick_follows_the_shortest_interval_within_bounds() {
        assert_eq!(tick(0, 0), Duration::from_millis(250));
        assert_eq!(tick(5_000, 1_000), Duration::from_millis(250));
        assert_eq!(tick(20, 0), Duration::from_millis(TICK_MS_MIN));
        assert_eq!(tick(60_000, 0), Duration::from_millis(TICK_MS_MAX));
    }
}
