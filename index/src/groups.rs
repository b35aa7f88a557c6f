//! In-memory state of every group: what reads and the compaction filter see.
//!
//! Reads use the current state (`live` generation, `watermark`), which changes
//! as soon as a batch is committed (buffered, not yet fsynced). The compaction
//! filter must be more careful: after a power loss the index comes back with
//! its last *fsynced* meta records, so a generation that died, or a watermark
//! that rose, after the last fsync may come back. The registry therefore keeps
//! dying generations and raised watermarks *pending* until an fsync that
//! started after their commit has completed (`begin_promotion` /
//! `finish_promotion`, driven by `Index::persist`).
//!
//! Architecture Invariant: the compaction filter never removes an entry that
//! the fsynced meta state still references.

use crate::encoding::{Generation, NO_GENERATION};
use crate::{GroupId, Offset};
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError, RwLock, RwLockReadGuard, RwLockWriteGuard};

/// One group (partition replica) in memory.
#[derive(Debug, Default)]
pub(crate) struct GroupState {
    /// Serializes writers of this group (apply, rebuild, watermark, drop).
    write: Mutex<()>,
    /// Generation reads use; `NO_GENERATION` when the group holds no entries.
    pub(crate) live: AtomicU32,
    /// Generation being written but not yet live (first write, rebuild).
    pub(crate) building: AtomicU32,
    /// Cleanup watermark reads use.
    pub(crate) watermark: AtomicU64,
    /// The highest watermark known to be fsynced: the filter's watermark.
    durable_watermark: AtomicU64,
    /// Puts minus deletes since the last rebuild (see `Index::key_count_estimate`).
    pub(crate) key_estimate: AtomicU64,
    /// Set once the group is dropped; a writer holding a stale handle retries.
    detached: AtomicBool,
}

impl GroupState {
    /// A group as loaded from (fsynced) meta records at open.
    pub(crate) fn loaded(live: Generation, watermark: Offset, key_estimate: u64) -> Self {
        Self {
            live: AtomicU32::new(live),
            watermark: AtomicU64::new(watermark),
            durable_watermark: AtomicU64::new(watermark),
            key_estimate: AtomicU64::new(key_estimate),
            ..Self::default()
        }
    }

    /// Takes the group's write lock.
    pub(crate) fn lock_writes(&self) -> MutexGuard<'_, ()> {
        // The mutex guards no data, only ordering: poisoning leaves nothing torn.
        self.write.lock().unwrap_or_else(PoisonError::into_inner)
    }

    pub(crate) fn is_detached(&self) -> bool {
        self.detached.load(Ordering::Acquire)
    }
}

/// Generations of one group the compaction filter keeps, each with the
/// watermark below which its entries may be removed.
#[derive(Debug, Default)]
pub(crate) struct FilterView {
    keep: Vec<(Generation, Offset)>,
}

impl FilterView {
    /// `Some(watermark)` if entries of `generation` are kept, `None` if dead.
    pub(crate) fn watermark_of(&self, generation: Generation) -> Option<Offset> {
        self.keep.iter().find(|(kept, _)| *kept == generation).map(|(_, watermark)| *watermark)
    }

    fn keep(&mut self, generation: Generation, watermark: Offset) {
        if generation != NO_GENERATION && self.watermark_of(generation).is_none() {
            self.keep.push((generation, watermark));
        }
    }
}

/// A promotion in progress: its epoch, taken before the fsync.
#[derive(Debug)]
pub(crate) struct Promotion {
    epoch: u64,
}

/// Changes committed but maybe not fsynced, each with the epoch read after its commit.
#[derive(Debug, Default)]
struct Pending {
    dying: HashMap<GroupId, Vec<(Generation, u64)>>,
    watermarks: Vec<(Arc<GroupState>, Offset, u64)>,
}

impl Pending {
    fn is_empty(&self) -> bool {
        self.dying.is_empty() && self.watermarks.is_empty()
    }
}

/// Copies of the group map, one per reader shard: a reader only touches the
/// lock of its own thread's shard, so concurrent `get`s share no written
/// cache line. Writers (group creation and drop, both rare) update every copy.
const SHARDS: usize = 8;

type GroupMap = HashMap<GroupId, Arc<GroupState>>;

#[derive(Debug, Default)]
#[repr(align(128))]
struct Shard {
    groups: RwLock<GroupMap>,
}

/// The reader shard of the calling thread (threads are spread round-robin).
fn thread_shard() -> usize {
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    thread_local! {
        static SHARD: usize = NEXT.fetch_add(1, Ordering::Relaxed) % SHARDS;
    }
    SHARD.with(|shard| *shard)
}

/// All groups of the node.
#[derive(Debug, Default)]
pub(crate) struct Registry {
    shards: [Shard; SHARDS],
    /// Serializes writers of the shards.
    map_writes: Mutex<()>,
    pending: Mutex<Pending>,
    /// Incremented by every promotion before its fsync.
    epoch: AtomicU64,
    /// False until open has loaded the meta keyspace: the filter keeps everything.
    ready: AtomicBool,
}

impl Registry {
    pub(crate) fn get(&self, group: GroupId) -> Option<Arc<GroupState>> {
        self.read_shard().get(&group).cloned()
    }

    /// Runs `f` on the group's state without cloning its `Arc` (the read
    /// path): holds the calling thread's shard lock, which only group
    /// creation and drop contend for.
    pub(crate) fn with_group<T>(&self, group: GroupId, f: impl FnOnce(Option<&GroupState>) -> T) -> T {
        let shard = self.read_shard();
        f(shard.get(&group).map(|state| &**state))
    }

    pub(crate) fn get_or_insert(&self, group: GroupId) -> Arc<GroupState> {
        if let Some(state) = self.get(group) {
            return state;
        }
        let _writes = self.lock_map_writes();
        if let Some(state) = self.get(group) {
            return state;
        }
        let state = Arc::new(GroupState::default());
        self.insert_everywhere(group, &state);
        state
    }

    pub(crate) fn insert_loaded(&self, group: GroupId, state: GroupState) {
        let _writes = self.lock_map_writes();
        self.insert_everywhere(group, &Arc::new(state));
    }

    pub(crate) fn group_count(&self) -> usize {
        self.read_shard().len()
    }

    fn insert_everywhere(&self, group: GroupId, state: &Arc<GroupState>) {
        for shard in &self.shards {
            write_map(&shard.groups).insert(group, state.clone());
        }
    }

    fn remove_everywhere(&self, group: GroupId, state: &Arc<GroupState>) {
        let _writes = self.lock_map_writes();
        for shard in &self.shards {
            let mut groups = write_map(&shard.groups);
            if groups.get(&group).is_some_and(|current| Arc::ptr_eq(current, state)) {
                groups.remove(&group);
            }
        }
    }

    pub(crate) fn set_ready(&self) {
        self.ready.store(true, Ordering::Release);
    }

    pub(crate) fn is_ready(&self) -> bool {
        self.ready.load(Ordering::Acquire)
    }

    /// Makes `generation` live in place of the current one. Call after the
    /// batch recording it is committed, holding the group's write lock.
    pub(crate) fn switch_generation(&self, group: GroupId, state: &GroupState, generation: Generation) {
        let old = state.live.load(Ordering::Acquire);
        if old != NO_GENERATION && old != generation {
            // Pending before `live` moves on: the filter reads `live` and then
            // the pending list, so it sees the old generation in one of them.
            self.generation_died(group, old);
        }
        state.live.store(generation, Ordering::Release);
        // After `live`: the filter reads `building` before `live`.
        state.building.store(NO_GENERATION, Ordering::Release);
    }

    /// Detaches a dropped group. Call after the removal of its meta records
    /// is committed, holding the group's write lock.
    pub(crate) fn retire(&self, group: GroupId, state: &Arc<GroupState>) {
        let building = state.building.swap(NO_GENERATION, Ordering::AcqRel);
        let live = state.live.load(Ordering::Acquire);
        for generation in [building, live] {
            if generation != NO_GENERATION {
                self.generation_died(group, generation);
            }
        }
        state.live.store(NO_GENERATION, Ordering::Release);
        state.detached.store(true, Ordering::Release);
        self.remove_everywhere(group, state);
    }

    /// Records a committed watermark raise; the filter applies it once durable.
    pub(crate) fn watermark_raised(&self, state: &Arc<GroupState>, watermark: Offset) {
        state.watermark.fetch_max(watermark, Ordering::AcqRel);
        let epoch = self.epoch.load(Ordering::SeqCst);
        self.lock_pending().watermarks.push((state.clone(), watermark, epoch));
    }

    fn generation_died(&self, group: GroupId, generation: Generation) {
        let epoch = self.epoch.load(Ordering::SeqCst);
        self.lock_pending().dying.entry(group).or_default().push((generation, epoch));
    }

    /// What the compaction filter keeps of `group`.
    ///
    /// Reads `building`, then `live`, then the pending list, in the reverse
    /// order of the writers (see `switch_generation`), so no generation a
    /// writer is moving between them is missed.
    pub(crate) fn filter_view(&self, group: GroupId) -> FilterView {
        let mut view = FilterView::default();
        if let Some(state) = self.get(group) {
            let watermark = state.durable_watermark.load(Ordering::Acquire);
            view.keep(state.building.load(Ordering::Acquire), watermark);
            view.keep(state.live.load(Ordering::Acquire), watermark);
        }
        if let Some(dying) = self.lock_pending().dying.get(&group) {
            for (generation, _) in dying {
                // Whole: a dying generation may belong to an earlier group
                // with this id, whose durable watermark is not this one.
                view.keep(*generation, 0);
            }
        }
        view
    }

    /// True if some committed change waits for an fsync to reach the filter.
    pub(crate) fn has_pending(&self) -> bool {
        !self.lock_pending().is_empty()
    }

    /// Call before an fsync; `None` if nothing is pending.
    pub(crate) fn begin_promotion(&self) -> Option<Promotion> {
        if self.lock_pending().is_empty() {
            return None;
        }
        // Changes whose epoch is below the new value were committed before
        // this point, hence before the fsync that follows.
        let epoch = self.epoch.fetch_add(1, Ordering::SeqCst) + 1;
        Some(Promotion { epoch })
    }

    /// Call after that fsync succeeded: what it covered reaches the filter.
    pub(crate) fn finish_promotion(&self, promotion: Promotion) {
        let mut pending = self.lock_pending();
        pending.dying.retain(|_, dying| {
            dying.retain(|(_, epoch)| *epoch >= promotion.epoch);
            !dying.is_empty()
        });
        pending.watermarks.retain(|(state, watermark, epoch)| {
            if *epoch < promotion.epoch {
                state.durable_watermark.fetch_max(*watermark, Ordering::AcqRel);
                false
            } else {
                true
            }
        });
    }

    fn read_shard(&self) -> RwLockReadGuard<'_, GroupMap> {
        let shard = self.shards.get(thread_shard() % SHARDS).unwrap_or(&self.shards[0]);
        // Every critical section is a single map operation: poisoning leaves nothing torn.
        shard.groups.read().unwrap_or_else(PoisonError::into_inner)
    }

    fn lock_map_writes(&self) -> MutexGuard<'_, ()> {
        self.map_writes.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn lock_pending(&self) -> MutexGuard<'_, Pending> {
        self.pending.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

fn write_map(groups: &RwLock<GroupMap>) -> RwLockWriteGuard<'_, GroupMap> {
    groups.write().unwrap_or_else(PoisonError::into_inner)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn promote(registry: &Registry) {
        if let Some(promotion) = registry.begin_promotion() {
            registry.finish_promotion(promotion);
        }
    }

    #[test]
    fn dropped_generation_is_kept_until_an_fsync_covers_the_drop() {
        let registry = Registry::default();
        registry.insert_loaded(7, GroupState::loaded(3, 0, 0));
        let state = registry.get_or_insert(7);
        let promotion_before_drop = registry.begin_promotion();
        assert!(promotion_before_drop.is_none(), "nothing pending yet");

        registry.retire(7, &state);
        assert!(registry.get(7).is_none());
        assert_eq!(registry.filter_view(7).watermark_of(3), Some(0));

        promote(&registry);
        assert_eq!(registry.filter_view(7).watermark_of(3), None);
        assert!(!registry.has_pending());
    }

    #[test]
    fn a_change_committed_after_the_fsync_began_stays_pending() {
        let registry = Registry::default();
        registry.insert_loaded(1, GroupState::loaded(2, 0, 0));
        let state = registry.get_or_insert(1);
        registry.switch_generation(1, &state, 4);
        let promotion = registry.begin_promotion();
        // Committed after the promotion took its epoch: not covered.
        registry.switch_generation(1, &state, 5);
        if let Some(promotion) = promotion {
            registry.finish_promotion(promotion);
        }
        let view = registry.filter_view(1);
        assert_eq!(view.watermark_of(2), None);
        assert_eq!(view.watermark_of(4), Some(0));
        assert_eq!(view.watermark_of(5), Some(0));
    }

    #[test]
    fn raised_watermark_reaches_the_filter_only_after_promotion() {
        let registry = Registry::default();
        registry.insert_loaded(1, GroupState::loaded(2, 10, 0));
        let state = registry.get_or_insert(1);
        registry.watermark_raised(&state, 50);
        assert_eq!(state.watermark.load(Ordering::Acquire), 50);
        assert_eq!(registry.filter_view(1).watermark_of(2), Some(10));
        promote(&registry);
        assert_eq!(registry.filter_view(1).watermark_of(2), Some(50));
    }
}
