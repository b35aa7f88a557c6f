//! Random sequences of apply / tombstone / rebuild / drop / watermark /
//! persist / compact / reopen over three groups give, after every step,
//! exactly the answers of a naive in-memory model.

mod common;

use common::{TestResult, marker};
use logdex_index::{AppliedMarker, Index, Lookup, Update};
use proptest::prelude::*;
use proptest::test_runner::{Config, TestCaseError, TestRunner};
use std::collections::{BTreeMap, HashMap};
use std::path::Path;

const GROUPS: [u64; 3] = [1, 2, 3];
const KEYS: u8 = 8;

/// Key 7 is long enough to take the heap path of key encoding.
fn key(id: u8) -> Vec<u8> {
    if id == KEYS - 1 { vec![b'L'; 300] } else { format!("key-{id}").into_bytes() }
}

#[derive(Clone, Debug)]
enum Op {
    Apply { group: u64, updates: Vec<(u8, bool)> },
    Rebuild { group: u64, records: Vec<(u8, bool)> },
    Drop { group: u64 },
    Watermark { group: u64, below_next: u64 },
    Persist,
    Compact,
    Reopen,
}

fn op() -> impl Strategy<Value = Op> {
    let group = prop::sample::select(GROUPS.to_vec());
    let update = (0..KEYS, prop::bool::weighted(0.25));
    prop_oneof![
        6 => (group.clone(), prop::collection::vec(update.clone(), 0..6))
            .prop_map(|(group, updates)| Op::Apply { group, updates }),
        1 => (group.clone(), prop::collection::vec(update, 0..12))
            .prop_map(|(group, records)| Op::Rebuild { group, records }),
        1 => group.clone().prop_map(|group| Op::Drop { group }),
        2 => (group, 0u64..6).prop_map(|(group, below_next)| Op::Watermark { group, below_next }),
        1 => Just(Op::Persist),
        1 => Just(Op::Compact),
        1 => Just(Op::Reopen),
    ]
}

#[derive(Clone, Debug, Default)]
struct GroupModel {
    entries: BTreeMap<u8, u64>,
    marker: Option<AppliedMarker>,
    watermark: u64,
    /// Watermark known fsynced: entries below it may vanish at any compaction.
    durable_watermark: u64,
    next_offset: u64,
}

impl GroupModel {
    fn write(&mut self, key: u8, offset: u64, delete: bool) {
        if delete {
            self.entries.remove(&key);
        } else {
            self.entries.insert(key, offset);
        }
    }

    /// Whether `actual` is a correct answer for `key`. Right after a
    /// compaction, entries below the durable watermark must be gone; at other
    /// times they may be gone, or back (fjall replays journal records that a
    /// compaction filter removed from tables).
    fn accepts(&self, key: u8, actual: Lookup, just_compacted: bool) -> bool {
        match self.entries.get(&key) {
            None => actual == Lookup::NotFound,
            Some(_) if just_compacted && self.is_purgeable(key) => actual == Lookup::NotFound,
            Some(&offset) if offset < self.durable_watermark => {
                actual == Lookup::Evicted(offset) || actual == Lookup::NotFound
            }
            Some(&offset) if offset < self.watermark => actual == Lookup::Evicted(offset),
            Some(&offset) => actual == Lookup::Found(offset),
        }
    }

    fn is_purgeable(&self, key: u8) -> bool {
        self.entries.get(&key).is_some_and(|offset| *offset < self.durable_watermark)
    }

    fn persisted(&mut self) {
        self.durable_watermark = self.watermark;
    }
}

#[derive(Default)]
struct Model {
    groups: HashMap<u64, GroupModel>,
}

fn run_case(ops: &[Op]) -> Result<(), Box<dyn std::error::Error>> {
    let dir = tempfile::tempdir()?;
    let mut index = common::open(dir.path())?;
    let mut model = Model::default();
    for (step, op) in ops.iter().enumerate() {
        index = apply_op(index, dir.path(), &mut model, op)?;
        let just_compacted = matches!(op, Op::Compact);
        check(&index, &model, just_compacted).map_err(|error| format!("after step {step} {op:?}: {error}"))?;
    }
    Ok(())
}

fn apply_op(index: Index, path: &Path, model: &mut Model, op: &Op) -> Result<Index, Box<dyn std::error::Error>> {
    match op {
        Op::Apply { group, updates } => {
            let state = model.groups.entry(*group).or_default();
            let keys: Vec<Vec<u8>> = updates.iter().map(|(id, _)| key(*id)).collect();
            let mut batch = Vec::new();
            for ((id, delete), key) in updates.iter().zip(&keys) {
                let offset = state.next_offset;
                state.next_offset += 1;
                state.write(*id, offset, *delete);
                batch.push(if *delete { Update::Delete { key } } else { Update::Put { key, offset } });
            }
            state.marker = Some(marker(state.next_offset));
            index.apply(*group, &batch, &marker(state.next_offset))?;
        }
        Op::Rebuild { group, records } => {
            let state = model.groups.entry(*group).or_default();
            // Offsets straddle the watermark so some entries come back evicted.
            let base = state.watermark.saturating_sub(1);
            state.entries.clear();
            let log: Vec<(Vec<u8>, u64, bool)> = records
                .iter()
                .zip(base..)
                .map(|((id, delete), offset)| {
                    state.write(*id, offset, *delete);
                    (key(*id), offset, *delete)
                })
                .collect();
            state.next_offset = base + records.len() as u64;
            state.marker = Some(marker(state.next_offset));
            let keys = index.rebuild(*group, log.into_iter().map(Ok::<_, String>), &marker(state.next_offset))?;
            if keys != Ok(state.entries.len() as u64) {
                return Err(format!("rebuild counted {keys:?}, model {}", state.entries.len()).into());
            }
        }
        Op::Drop { group } => {
            model.groups.remove(group);
            index.drop_group(*group)?;
        }
        Op::Watermark { group, below_next } => {
            let state = model.groups.entry(*group).or_default();
            let watermark = state.next_offset.saturating_sub(*below_next);
            state.watermark = state.watermark.max(watermark);
            index.set_watermark(*group, watermark)?;
        }
        Op::Persist => {
            index.persist()?;
            model.groups.values_mut().for_each(GroupModel::persisted);
        }
        Op::Compact => {
            index.compact()?;
            model.groups.values_mut().for_each(GroupModel::persisted);
        }
        Op::Reopen => {
            drop(index);
            model.groups.values_mut().for_each(GroupModel::persisted);
            return Ok(common::open(path)?);
        }
    }
    Ok(index)
}

fn check(index: &Index, model: &Model, just_compacted: bool) -> Result<(), Box<dyn std::error::Error>> {
    let empty = GroupModel::default();
    let keys: Vec<Vec<u8>> = (0..KEYS).map(key).collect();
    let key_refs: Vec<&[u8]> = keys.iter().map(Vec::as_slice).collect();
    for group in GROUPS {
        let state = model.groups.get(&group).unwrap_or(&empty);
        let many = index.get_many(group, &key_refs)?;
        for (id, key) in (0..KEYS).zip(&keys) {
            let actual = index.get(group, key)?;
            if !state.accepts(id, actual, just_compacted) {
                return Err(format!(
                    "group {group} key {id}: got {actual:?}, model {:?} (watermark {}, durable {})",
                    state.entries.get(&id),
                    state.watermark,
                    state.durable_watermark
                )
                .into());
            }
            let batched = many.get(usize::from(id)).copied();
            if !batched.is_some_and(|lookup| state.accepts(id, lookup, just_compacted)) {
                return Err(format!("group {group} key {id}: get_many gave {batched:?}").into());
            }
        }
        if index.applied(group)? != state.marker {
            return Err(format!("group {group}: applied {:?}", index.applied(group)?).into());
        }
        if index.watermark(group)? != state.watermark {
            return Err(format!("group {group}: watermark {}", index.watermark(group)?).into());
        }
    }
    Ok(())
}

/// The index agrees with the model after every step of random operation sequences.
#[test]
fn model_random_operations_match_a_hashmap_model() -> TestResult {
    let mut runner = TestRunner::new(Config { cases: 48, failure_persistence: None, ..Config::default() });
    let ops = prop::collection::vec(op(), 1..40);
    runner
        .run(&ops, |ops| run_case(&ops).map_err(|error| TestCaseError::fail(error.to_string())))
        .map_err(|error| error.to_string())?;
    Ok(())
}
