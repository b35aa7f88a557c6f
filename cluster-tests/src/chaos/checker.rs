//! The history checkers C1 (log), C2 (linearizable key reads) and C3 (sessions).
//!
//! They take the client history and the final log of every partition (fetched after healing
//! and quiescence from the partition leader, and shown by C4 to be what every replica holds)
//! and return every violation with the operations that prove it. All are O(n log n).
//!
//! Every written value is unique, so a value read names the write that produced it; a
//! tombstone is named by its key and offset.

use std::collections::BTreeMap;
use std::collections::HashMap;
use std::fmt;

use crate::chaos::op::LogRecord;
use crate::chaos::op::Nanos;
use crate::chaos::op::Op;
use crate::chaos::op::Outcome;
use crate::chaos::op::ReadKind;
use crate::chaos::op::Request;

/// The final log of each partition, dense from offset 0.
pub type FinalLogs = BTreeMap<u32, Vec<LogRecord>>;

/// Where each value is in the final logs: `(partition, offset, key)` per occurrence.
type Located<'a> = HashMap<&'a str, Vec<(u32, u64, Option<&'a str>)>>;

/// An acknowledged write for the real-time order check:
/// `(invoke, complete, lowest offset, highest offset, index in the history)`.
type AckedSpan = (Nanos, Nanos, u64, u64, usize);

/// Violations found by one checker: how many, and the first ones in full.
#[derive(Clone, Debug)]
pub struct Findings {
    pub checker: &'static str,
    pub count: usize,
    pub shown: Vec<String>,
}

impl Findings {
    const SHOWN_MAX: usize = 12;

    pub fn new(checker: &'static str) -> Findings {
        Findings { checker, count: 0, shown: Vec::new() }
    }

    pub fn add(&mut self, violation: String) {
        self.count += 1;
        if self.shown.len() < Self::SHOWN_MAX {
            self.shown.push(violation);
        }
    }

    pub fn is_ok(&self) -> bool {
        self.count == 0
    }
}

impl fmt::Display for Findings {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.count == 0 {
            return write!(f, "{}: ok", self.checker);
        }
        writeln!(f, "{}: {} violations; the first {}:", self.checker, self.count, self.shown.len())?;
        for v in &self.shown {
            writeln!(f, "  - {v}")?;
        }
        Ok(())
    }
}

fn record_at(logs: &FinalLogs, partition: u32, offset: u64) -> Option<&LogRecord> {
    logs.get(&partition).and_then(|log| log.get(offset as usize)).filter(|r| r.offset == offset)
}

fn show_record(r: Option<&LogRecord>) -> String {
    match r {
        None => "nothing".into(),
        Some(r) => format!("({:?}, {:?})", r.key, r.value),
    }
}

/// The writes one op sent: `(key, value)`, `None` value for a delete.
fn sent(op: &Op) -> Vec<(&str, Option<&str>)> {
    match &op.request {
        Request::Put { key, value, .. } => vec![(key.as_str(), Some(value.as_str()))],
        Request::Delete { key } => vec![(key.as_str(), None)],
        Request::Produce { records, .. } => records.iter().map(|(k, v)| (k.as_str(), Some(v.as_str()))).collect(),
        _ => Vec::new(),
    }
}

/// C1: the log holds every acknowledged write at its offset and nothing else: no loss, no
/// duplicate, no record of a definitely failed write (aborted read), no phantom, no answer at
/// or above the serving replica's high watermark, no read of a record the log does not hold
/// (dirty read), batches atomic and contiguous, offsets dense, and acknowledged writes ordered
/// by offset as they were in real time.
pub fn check_log(ops: &[Op], logs: &FinalLogs) -> Findings {
    let mut f = Findings::new("C1 log");
    for (p, log) in logs {
        if let Some((i, r)) = log.iter().enumerate().find(|(i, r)| r.offset != *i as u64) {
            f.add(format!("partition {p}: offsets not dense from 0: position {i} holds offset {}", r.offset));
        }
    }
    // Where each value is in the logs; tombstones per key.
    let mut located: Located<'_> = HashMap::new();
    let mut tombstones: HashMap<&str, Vec<(u32, u64)>> = HashMap::new();
    for (p, log) in logs {
        for r in log {
            match (&r.key, &r.value) {
                (key, Some(v)) => located.entry(v.as_str()).or_default().push((*p, r.offset, key.as_deref())),
                (Some(k), None) => tombstones.entry(k.as_str()).or_default().push((*p, r.offset)),
                (None, None) => {
                    f.add(format!("partition {p} offset {}: a record with neither key nor value", r.offset))
                }
            }
        }
    }
    for (value, places) in &located {
        if places.len() > 1 {
            f.add(format!(
                "duplicate: value {value:?} is in the log {} times, at (partition, offset) {:?}",
                places.len(),
                places.iter().map(|(p, o, _)| (*p, *o)).collect::<Vec<_>>()
            ));
        }
    }
    // Which op sent each value, and how many deletes each key may have.
    let mut sender: HashMap<&str, (&Op, &str)> = HashMap::new();
    let mut deletes_possible: HashMap<&str, usize> = HashMap::new();
    for op in ops.iter().filter(|o| o.is_write()) {
        for (key, value) in sent(op) {
            match value {
                Some(v) => {
                    sender.insert(v, (op, key));
                }
                None if !matches!(op.outcome, Outcome::Definite { .. }) => {
                    *deletes_possible.entry(key).or_default() += 1
                }
                None => {}
            }
        }
    }
    for (value, places) in &located {
        match sender.get(value) {
            None => f.add(format!(
                "phantom: value {value:?} at {:?} was never written",
                places.iter().map(|(p, o, _)| (*p, *o)).collect::<Vec<_>>()
            )),
            Some((op, key)) => {
                for (p, o, k) in places {
                    if *k != Some(*key) {
                        f.add(format!("partition {p} offset {o}: value {value:?} under key {k:?}, but it was written to {key:?} by {}", op.brief()));
                    }
                    if let Request::Produce { partition, .. } = &op.request
                        && partition != p
                    {
                        f.add(format!(
                            "value {value:?} in partition {p}, but {} sent it to partition {partition}",
                            op.brief()
                        ));
                    }
                }
            }
        }
    }
    for (key, stones) in &tombstones {
        let possible = deletes_possible.get(key).copied().unwrap_or(0);
        if stones.len() > possible {
            f.add(format!(
                "duplicate: key {key:?} has {} tombstones at {stones:?} but only {possible} deletes may have happened",
                stones.len()
            ));
        }
    }
    for op in ops.iter().filter(|o| o.is_write()) {
        check_write(op, logs, &located, &mut f);
    }
    for op in ops {
        check_read_against_log(op, logs, &mut f);
    }
    check_real_time_order(ops, &located, &mut f);
    f
}

fn check_write(op: &Op, logs: &FinalLogs, located: &Located<'_>, f: &mut Findings) {
    let records = sent(op);
    match &op.outcome {
        Outcome::Written { partition, offsets } => {
            if offsets.len() != records.len() {
                f.add(format!(
                    "acknowledged with {} offsets for {} records: {}",
                    offsets.len(),
                    records.len(),
                    op.brief()
                ));
                return;
            }
            if offsets.windows(2).any(|w| w[1] != w[0] + 1) {
                f.add(format!("batch not contiguous: offsets {offsets:?}: {}", op.brief()));
            }
            for ((key, value), offset) in records.iter().zip(offsets) {
                let at = record_at(logs, *partition, *offset);
                let matches = at.is_some_and(|r| r.key.as_deref() == Some(*key) && r.value.as_deref() == *value);
                if !matches {
                    f.add(format!(
                        "lost: acknowledged ({key:?}, {value:?}) at partition {partition} offset {offset}, the log holds {}: {}",
                        show_record(at),
                        op.brief()
                    ));
                }
            }
        }
        Outcome::Definite { .. } => {
            for (_, value) in &records {
                if let Some(places) = value.and_then(|v| located.get(v)) {
                    f.add(format!(
                        "aborted write visible: a definitely failed write is in the log at {:?}: {}",
                        places.iter().map(|(p, o, _)| (*p, *o)).collect::<Vec<_>>(),
                        op.brief()
                    ));
                }
            }
        }
        Outcome::Indeterminate { .. } => {
            if let Request::Produce { .. } = op.request {
                let places: Vec<Option<(u32, u64)>> = records
                    .iter()
                    .map(|(_, v)| v.and_then(|v| located.get(v)).and_then(|p| p.first()).map(|(p, o, _)| (*p, *o)))
                    .collect();
                let present = places.iter().filter(|p| p.is_some()).count();
                if present != 0 && present != places.len() {
                    f.add(format!(
                        "batch not atomic: {present} of {} records in the log: {}",
                        places.len(),
                        op.brief()
                    ));
                } else if present == places.len()
                    && places.windows(2).any(|w| match (w[0], w[1]) {
                        (Some((p0, o0)), Some((p1, o1))) => p0 != p1 || o1 != o0 + 1,
                        _ => false,
                    })
                {
                    f.add(format!("batch not contiguous in the log: {places:?}: {}", op.brief()));
                }
            }
        }
        _ => f.add(format!("a write answered like a read: {}", op.brief())),
    }
}

fn check_read_against_log(op: &Op, logs: &FinalLogs, f: &mut Findings) {
    match (&op.request, &op.outcome) {
        (Request::Get { key, .. }, Outcome::Found { partition, offset, high_watermark, value, .. }) => {
            if offset >= high_watermark {
                f.add(format!("dirty read: answer at offset {offset}, at or above the replica's high watermark {high_watermark}: {}", op.brief()));
            }
            let at = record_at(logs, *partition, *offset);
            if !at.is_some_and(|r| r.key.as_deref() == Some(key.as_str()) && r.value.as_deref() == Some(value.as_str()))
            {
                f.add(format!("dirty read: read ({key:?}, {value:?}) at partition {partition} offset {offset}, the log holds {}: {}", show_record(at), op.brief()));
            }
        }
        (Request::Fetch { partition, .. }, Outcome::Fetched { records, high_watermark, .. }) => {
            for r in records {
                if r.offset >= *high_watermark {
                    f.add(format!(
                        "dirty read: fetched offset {} at or above the high watermark {high_watermark}: {}",
                        r.offset,
                        op.brief()
                    ));
                }
                let at = record_at(logs, *partition, r.offset);
                if at != Some(r) {
                    f.add(format!(
                        "dirty read: fetched {r:?} from partition {partition}, the log holds {}: {}",
                        show_record(at),
                        op.brief()
                    ));
                    break;
                }
            }
        }
        _ => {}
    }
}

/// If write A was acknowledged before write B was invoked (same partition), A's offsets are
/// below B's. Sort by completion, sweep by invocation with the running maximum.
fn check_real_time_order(ops: &[Op], located: &Located<'_>, f: &mut Findings) {
    let mut by_partition: HashMap<u32, Vec<AckedSpan>> = HashMap::new();
    for (i, op) in ops.iter().enumerate() {
        if let Outcome::Written { partition, offsets } = &op.outcome
            && let (Some(lo), Some(hi)) = (offsets.iter().min(), offsets.iter().max())
        {
            by_partition.entry(*partition).or_default().push((op.invoke, op.complete, *lo, *hi, i));
        }
        // An unanswered write that took effect must still follow every write acknowledged
        // before it began; it never completed, so it only ever plays the later part.
        if let Outcome::Indeterminate { .. } = &op.outcome {
            let places: Vec<(u32, u64)> = sent(op)
                .iter()
                .filter_map(|(_, v)| v.and_then(|v| located.get(v)).and_then(|p| p.first()).map(|(p, o, _)| (*p, *o)))
                .collect();
            if let (Some(&(partition, _)), Some(lo), Some(hi)) =
                (places.first(), places.iter().map(|p| p.1).min(), places.iter().map(|p| p.1).max())
            {
                by_partition.entry(partition).or_default().push((op.invoke, Nanos::MAX, lo, hi, i));
            }
        }
    }
    for (p, writes) in by_partition {
        let mut by_complete = writes.clone();
        by_complete.sort_by_key(|w| w.1);
        let mut by_invoke = writes;
        by_invoke.sort_by_key(|w| w.0);
        let mut next = 0;
        let mut max_before: Option<(u64, usize)> = None;
        for b in by_invoke {
            while next < by_complete.len() && by_complete[next].1 < b.0 {
                let a = by_complete[next];
                if max_before.is_none_or(|(hi, _)| a.3 > hi) {
                    max_before = Some((a.3, a.4));
                }
                next += 1;
            }
            if let Some((hi, a)) = max_before
                && hi >= b.2
            {
                f.add(format!(
                    "real-time order: partition {p}: {} was acknowledged before {} was invoked, yet its offset {hi} is not below {}",
                    ops[a].brief(),
                    ops[b.4].brief(),
                    b.2
                ));
            }
        }
    }
}

/// The writes of one key in log order, and when their ops were invoked and acknowledged.
struct KeyWrites {
    /// `(offset, value)` in log order; `None` value is a tombstone.
    writes: Vec<(u64, Option<String>)>,
    /// Invocation time of the op behind each write, when known.
    invoked: Vec<Option<Nanos>>,
    /// Acknowledged writes: `(completion time, offset)`, sorted by completion.
    acked: Vec<(Nanos, u64)>,
}

fn key_writes(ops: &[Op], logs: &FinalLogs) -> HashMap<String, KeyWrites> {
    let mut put_invoked: HashMap<&str, Nanos> = HashMap::new();
    let mut delete_invoked: HashMap<(&str, u64), Nanos> = HashMap::new();
    let mut acked: HashMap<&str, Vec<(Nanos, u64)>> = HashMap::new();
    for op in ops {
        match (&op.request, &op.outcome) {
            (Request::Put { key, value, .. }, outcome) => {
                put_invoked.insert(value, op.invoke);
                if let Outcome::Written { offsets, .. } = outcome {
                    acked.entry(key).or_default().push((op.complete, offsets[0]));
                }
            }
            (Request::Delete { key }, Outcome::Written { offsets, .. }) => {
                delete_invoked.insert((key, offsets[0]), op.invoke);
                acked.entry(key).or_default().push((op.complete, offsets[0]));
            }
            _ => {}
        }
    }
    // Registers are the keys of puts and deletes (produced keys are unique, written once).
    let registers: std::collections::HashSet<&str> = ops
        .iter()
        .filter_map(|op| match &op.request {
            Request::Put { key, .. } | Request::Delete { key } => Some(key.as_str()),
            _ => None,
        })
        .collect();
    let mut out: HashMap<String, KeyWrites> = HashMap::new();
    for log in logs.values() {
        for r in log {
            let Some(key) = &r.key else { continue };
            if !registers.contains(key.as_str()) {
                continue;
            }
            let entry = out.entry(key.clone()).or_insert_with(|| KeyWrites {
                writes: Vec::new(),
                invoked: Vec::new(),
                acked: Vec::new(),
            });
            let invoked = match &r.value {
                Some(v) => put_invoked.get(v.as_str()).copied(),
                None => delete_invoked.get(&(key.as_str(), r.offset)).copied(),
            };
            entry.writes.push((r.offset, r.value.clone()));
            entry.invoked.push(invoked);
        }
    }
    for (key, mut list) in acked {
        list.sort();
        out.entry(key.to_string())
            .or_insert_with(|| KeyWrites { writes: Vec::new(), invoked: Vec::new(), acked: Vec::new() })
            .acked = list;
    }
    out
}

/// The positions (log offsets of writes of the key; -1 is "before any write") a lookup may
/// have observed: `(lowest, highest)`, or `None` when none is possible. `after` is the latest
/// write acknowledged before the lookup began, `before` the first write invoked after it
/// returned (in log order).
fn feasible(kw: &KeyWrites, outcome: &Outcome, after: Option<u64>, before: Option<u64>) -> Option<(i64, i64)> {
    let ok = |q: i64| after.is_none_or(|a| q >= a as i64) && before.is_none_or(|b| q < b as i64);
    match outcome {
        Outcome::Found { offset, .. } => {
            let q = *offset as i64;
            ok(q).then_some((q, q))
        }
        Outcome::NotFound { high_watermark, .. } => {
            let candidates = std::iter::once(-1i64)
                .chain(kw.writes.iter().filter(|(o, v)| v.is_none() && o < high_watermark).map(|(o, _)| *o as i64));
            let fits: Vec<i64> = candidates.filter(|q| ok(*q)).collect();
            Some((*fits.iter().min()?, *fits.iter().max()?))
        }
        _ => None,
    }
}

/// C2: every linearizable (or strict) lookup returns a state at least as new as every write
/// acknowledged before it began, never one written by an op invoked after it returned, and
/// lookups ordered in real time observe states in the log's per-key write order.
pub fn check_key_reads(ops: &[Op], logs: &FinalLogs) -> Findings {
    let mut f = Findings::new("C2 linearizable key reads");
    let keys = key_writes(ops, logs);
    let mut reads: HashMap<&str, Vec<(&Op, i64, i64)>> = HashMap::new();
    for op in ops {
        let Request::Get { key, mode, .. } = &op.request else { continue };
        if !mode.is_linearizable() || !matches!(op.outcome, Outcome::Found { .. } | Outcome::NotFound { .. }) {
            continue;
        }
        let Some(kw) = keys.get(key.as_str()) else {
            if let Outcome::Found { .. } = op.outcome {
                f.add(format!("read a key no write of which is in the log: {}", op.brief()));
            }
            continue;
        };
        // Latest acknowledged write that completed before this read began.
        let after = kw.acked.iter().take_while(|(c, _)| *c < op.invoke).map(|(_, o)| *o).max();
        let acked_op = after.and_then(|a| {
            ops.iter().find(|w| {
                w.is_write()
                    && matches!(&w.outcome, Outcome::Written { offsets, .. } if offsets[0] == a)
                    && sent(w).first().map(|s| s.0) == Some(key.as_str())
            })
        });
        // First write (in log order) invoked after this read returned.
        let before = kw
            .writes
            .iter()
            .zip(&kw.invoked)
            .find(|(_, inv)| inv.is_some_and(|i| i > op.complete))
            .map(|((o, _), _)| *o);
        match feasible(kw, &op.outcome, after, before) {
            Some((lo, hi)) => reads.entry(key).or_default().push((op, lo, hi)),
            None => {
                let why = match (&op.outcome, after, before) {
                    (Outcome::Found { offset, .. }, Some(a), _) if *offset < a => format!(
                        "stale read: returned offset {offset}, but the write at offset {a} was acknowledged before the read began ({})",
                        acked_op.map(Op::brief).unwrap_or_default()
                    ),
                    (Outcome::Found { offset, .. }, _, Some(b)) => format!(
                        "read from the future: returned offset {offset}, but the write at offset {b} was invoked after the read returned"
                    ),
                    (_, a, b) => format!(
                        "stale read: no state of the key fits: acknowledged before the read began up to offset {a:?} ({}), first write invoked after it returned at {b:?}; writes of the key {:?}",
                        acked_op.map(Op::brief).unwrap_or_default(),
                        kw.writes
                    ),
                };
                f.add(format!("{why}: {}", op.brief()));
            }
        }
    }
    for (key, mut list) in reads {
        // R1 returned before R2 began => R2 observes a state no older than R1's.
        let mut by_complete = list.clone();
        by_complete.sort_by_key(|(op, _, _)| op.complete);
        list.sort_by_key(|(op, _, _)| op.invoke);
        let mut next = 0;
        let mut newest: Option<(i64, &Op)> = None;
        for (r2, _, hi2) in list {
            while next < by_complete.len() && by_complete[next].0.complete < r2.invoke {
                let (r1, lo1, _) = by_complete[next];
                if newest.is_none_or(|(lo, _)| lo1 > lo) {
                    newest = Some((lo1, r1));
                }
                next += 1;
            }
            if let Some((lo1, r1)) = newest
                && hi2 < lo1
            {
                f.add(format!("non-monotonic reads of {key:?}: {} returned state {lo1} before {} began, which returned the older state {hi2}", r1.brief(), r2.brief()));
            }
        }
    }
    f
}

/// C3: sessions. Follower lookups of one client on one node process never go backwards (in
/// the key's state or the partition's high watermark); a lookup with `min_offset` after the
/// client's own acknowledged write at that offset returns that write's state or newer; a
/// client's sequential follower fetches from one node never skip, reorder or go backwards.
pub fn check_sessions(ops: &[Op], logs: &FinalLogs) -> Findings {
    let mut f = Findings::new("C3 sessions");
    let keys = key_writes(ops, logs);
    let empty = KeyWrites { writes: Vec::new(), invoked: Vec::new(), acked: Vec::new() };
    // (client, node, epoch) -> ops in invocation order (a client runs one op at a time).
    let mut sessions: BTreeMap<(usize, u64, u64), Vec<&Op>> = BTreeMap::new();
    for op in ops.iter().filter(|o| o.outcome.is_ok() && o.one_epoch()) {
        let follower = matches!(&op.request, Request::Get { mode: ReadKind::Follower, .. } | Request::Fetch { .. });
        if follower {
            sessions.entry((op.client, op.node, op.node_epoch.0)).or_default().push(op);
        }
    }
    for ((client, node, epoch), mut list) in sessions {
        list.sort_by_key(|o| o.invoke);
        let mut hw: HashMap<u32, (u64, &Op)> = HashMap::new();
        let mut state: HashMap<&str, (i64, &Op)> = HashMap::new();
        let mut cursor: HashMap<u32, (u64, &Op)> = HashMap::new();
        for op in list {
            let (partition, high_watermark) = match &op.outcome {
                Outcome::Found { partition, high_watermark, .. }
                | Outcome::NotFound { partition, high_watermark, .. } => (*partition, *high_watermark),
                Outcome::Fetched { high_watermark, .. } => match &op.request {
                    Request::Fetch { partition, .. } => (*partition, *high_watermark),
                    _ => continue,
                },
                _ => continue,
            };
            if let Some((previous, earlier)) = hw.get(&partition)
                && high_watermark < *previous
            {
                f.add(format!("session (client {client}, node {node}, generation {epoch}): high watermark of partition {partition} went back from {previous} ({}) to {high_watermark}: {}", earlier.brief(), op.brief()));
            }
            hw.insert(partition, (high_watermark, op));
            match &op.request {
                Request::Get { key, min_offset, .. } => {
                    let kw = keys.get(key.as_str()).unwrap_or(&empty);
                    let Some((lo, hi)) = feasible(kw, &op.outcome, None, None) else { continue };
                    if let Some((previous, earlier)) = state.get(key.as_str())
                        && hi < *previous
                    {
                        f.add(format!("session (client {client}, node {node}, generation {epoch}): {key:?} went back from state {previous} ({}) to {hi}: {}", earlier.brief(), op.brief()));
                    }
                    if state.get(key.as_str()).is_none_or(|(p, _)| lo > *p) {
                        state.insert(key, (lo, op));
                    }
                    if let Some(m) = min_offset {
                        check_min_offset(op, kw, *m, &mut f);
                    }
                }
                Request::Fetch { partition, offset, .. } => {
                    let Outcome::Fetched { records, next_offset, .. } = &op.outcome else { continue };
                    if let Some((expected, earlier)) = cursor.get(partition)
                        && *offset == *expected
                        && records.first().is_some_and(|r| r.offset != *offset)
                    {
                        f.add(format!(
                            "fetch skipped: after {} a fetch at {offset} began at offset {}: {}",
                            earlier.brief(),
                            records[0].offset,
                            op.brief()
                        ));
                    }
                    if records.first().is_some_and(|r| r.offset < *offset) {
                        f.add(format!(
                            "fetch went back: asked from {offset}, got offset {}: {}",
                            records[0].offset,
                            op.brief()
                        ));
                    }
                    if records.windows(2).any(|w| w[1].offset != w[0].offset + 1) {
                        f.add(format!(
                            "fetch not contiguous: offsets {:?}: {}",
                            records.iter().map(|r| r.offset).collect::<Vec<_>>(),
                            op.brief()
                        ));
                    }
                    let expected_next = records.last().map_or(*offset, |r| r.offset + 1);
                    if *next_offset != expected_next {
                        f.add(format!("fetch next_offset {next_offset}, expected {expected_next}: {}", op.brief()));
                    }
                    cursor.insert(*partition, (*next_offset, op));
                }
                _ => {}
            }
        }
    }
    f
}

/// A follower lookup with `min_offset = m` (the client's own acknowledged write of the key at
/// offset m) answers once the replica's high watermark passed m, with that write or a later one.
fn check_min_offset(op: &Op, kw: &KeyWrites, m: u64, f: &mut Findings) {
    match &op.outcome {
        Outcome::Found { offset, high_watermark, .. } if *high_watermark <= m || *offset < m => {
            f.add(format!(
                "read-your-writes: min_offset {m} answered offset {offset} at high watermark {high_watermark}: {}",
                op.brief()
            ));
        }
        Outcome::NotFound { high_watermark, .. } => {
            let tombstone = kw.writes.iter().any(|(o, v)| v.is_none() && *o >= m && o < high_watermark);
            if *high_watermark <= m || !tombstone {
                f.add(format!(
                    "read-your-writes: min_offset {m} answered 404 at high watermark {high_watermark} with no \
                     tombstone in [{m}, {high_watermark}): {}",
                    op.brief()
                ));
            }
        }
        _ => {}
    }
}

#[cfg(test)]
mod tests {
    //! Self-tests: each checker passes a correct hand-made history and fails a bad one of its
    //! class.

    use super::*;

    fn rec(offset: u64, key: &str, value: Option<&str>) -> LogRecord {
        LogRecord { offset, key: Some(key.into()), value: value.map(str::to_string) }
    }

    fn op(id: usize, client: usize, t: (u64, u64), request: Request, outcome: Outcome) -> Op {
        Op { id, client, node: 1, node_epoch: (1, 1), invoke: t.0, complete: t.1, request, outcome }
    }

    fn put(key: &str, value: &str) -> Request {
        Request::Put { key: key.into(), value: value.into(), forward: true }
    }

    fn written(offset: u64) -> Outcome {
        Outcome::Written { partition: 0, offsets: vec![offset] }
    }

    fn get(key: &str, mode: ReadKind) -> Request {
        Request::Get { key: key.into(), mode, min_offset: None, partition: None }
    }

    fn found(offset: u64, value: &str, hw: u64) -> Outcome {
        Outcome::Found { partition: 0, offset, high_watermark: hw, node: 1, value: value.into() }
    }

    fn indeterminate() -> Outcome {
        Outcome::Indeterminate { reason: "timeout".into() }
    }

    /// k: a at 0 (acked 10..20), b at 1 (acked 30..40), c sent 50..60 with no answer, in the log at 2.
    fn good() -> (Vec<Op>, FinalLogs) {
        let ops = vec![
            op(0, 0, (10, 20), put("k", "a"), written(0)),
            op(1, 1, (30, 40), put("k", "b"), written(1)),
            op(2, 2, (50, 60), put("k", "c"), indeterminate()),
            op(3, 3, (45, 46), get("k", ReadKind::Linearizable), found(1, "b", 2)),
            op(4, 3, (70, 80), get("k", ReadKind::Strict), found(2, "c", 3)),
        ];
        let logs = FinalLogs::from([(0, vec![rec(0, "k", Some("a")), rec(1, "k", Some("b")), rec(2, "k", Some("c"))])]);
        (ops, logs)
    }

    #[test]
    fn checkers_pass_a_correct_history() {
        let (ops, logs) = good();
        for findings in [check_log(&ops, &logs), check_key_reads(&ops, &logs), check_sessions(&ops, &logs)] {
            assert!(findings.is_ok(), "{findings}");
        }
    }

    /// C1 fails on: a lost acknowledged write, a duplicate, an aborted write in the log, a
    /// dirty read, a phantom value, a non-atomic batch, and acknowledged writes out of
    /// real-time order.
    #[test]
    fn log_checker_fails_each_bad_history() {
        let (ops, logs) = good();
        let mut lost = logs.clone();
        lost.get_mut(&0).expect("partition 0").truncate(1);
        let expect_fail = |ops: &[Op], logs: &FinalLogs, what: &str| {
            let f = check_log(ops, logs);
            assert!(!f.is_ok(), "C1 missed: {what}");
            assert!(f.shown.iter().any(|v| v.contains(what)), "C1 said {f}, expected {what}");
        };
        expect_fail(&ops, &lost, "lost");

        let mut dup = logs.clone();
        dup.get_mut(&0).expect("partition 0").push(rec(3, "k", Some("a")));
        expect_fail(&ops, &dup, "duplicate");

        let mut aborted = ops.clone();
        aborted[2].outcome = Outcome::Definite { reason: "421".into() };
        expect_fail(&aborted, &logs, "aborted write visible");

        let mut dirty = ops.clone();
        dirty.push(op(5, 4, (1, 2), get("k", ReadKind::Follower), found(3, "z", 4)));
        expect_fail(&dirty, &logs, "dirty read");
        let mut above_hw = ops.clone();
        above_hw[3].outcome = found(1, "b", 1);
        expect_fail(&above_hw, &logs, "dirty read");

        let mut phantom = logs.clone();
        phantom.get_mut(&0).expect("partition 0").push(rec(3, "k", Some("never")));
        expect_fail(&ops, &phantom, "phantom");

        let mut batch = ops.clone();
        batch.push(op(
            6,
            5,
            (1, 2),
            Request::Produce { partition: 0, records: vec![("p1".into(), "x1".into()), ("p2".into(), "x2".into())] },
            indeterminate(),
        ));
        let mut half = logs.clone();
        half.get_mut(&0).expect("partition 0").push(rec(3, "p1", Some("x1")));
        expect_fail(&batch, &half, "batch not atomic");

        let mut order = ops.clone();
        order[1].outcome = written(0);
        order[0].outcome = written(1);
        let swapped =
            FinalLogs::from([(0, vec![rec(0, "k", Some("b")), rec(1, "k", Some("a")), rec(2, "k", Some("c"))])]);
        expect_fail(&order[..3], &swapped, "real-time order");

        // An unanswered write invoked after an acknowledged one took effect before it.
        let late =
            vec![op(0, 0, (10, 20), put("k", "a"), written(1)), op(1, 1, (30, 40), put("k", "x"), indeterminate())];
        let early = FinalLogs::from([(0, vec![rec(0, "k", Some("x")), rec(1, "k", Some("a"))])]);
        expect_fail(&late, &early, "real-time order");
    }

    /// C2 fails on a stale read, a read from the future and non-monotonic reads.
    #[test]
    fn key_read_checker_fails_each_bad_history() {
        let (ops, logs) = good();
        let expect_fail = |ops: &[Op], what: &str| {
            let f = check_key_reads(ops, &logs);
            assert!(!f.is_ok(), "C2 missed: {what}");
            assert!(f.shown.iter().any(|v| v.contains(what)), "C2 said {f}, expected {what}");
        };
        let mut stale = ops.clone();
        stale.push(op(5, 4, (41, 42), get("k", ReadKind::Linearizable), found(0, "a", 2)));
        expect_fail(&stale, "stale read");

        let mut future = ops.clone();
        future.push(op(5, 4, (41, 42), get("k", ReadKind::Linearizable), found(2, "c", 3)));
        expect_fail(&future, "future");

        let mut stale_miss = ops.clone();
        stale_miss.push(op(
            5,
            4,
            (41, 42),
            get("k", ReadKind::Linearizable),
            Outcome::NotFound { partition: 0, high_watermark: 2, node: 1 },
        ));
        expect_fail(&stale_miss, "stale read");

        // Both reads overlap every write's window, but the second began after the first returned.
        let mut inversion = ops[..3].to_vec();
        inversion.push(op(5, 4, (31, 32), get("k", ReadKind::Linearizable), found(1, "b", 2)));
        inversion.push(op(6, 5, (33, 34), get("k", ReadKind::Linearizable), found(0, "a", 2)));
        inversion[1].invoke = 30;
        inversion[1].complete = 40;
        inversion[0].complete = 31; // a acknowledged at 31: neither read is stale by itself
        expect_fail(&inversion, "non-monotonic");
    }

    /// C3 fails when a follower session goes back, when min_offset returns older state, and
    /// when a sequential fetch skips.
    #[test]
    fn session_checker_fails_each_bad_history() {
        let (ops, logs) = good();
        let expect_fail = |ops: &[Op], what: &str| {
            let f = check_sessions(ops, &logs);
            assert!(!f.is_ok(), "C3 missed: {what}");
            assert!(f.shown.iter().any(|v| v.contains(what)), "C3 said {f}, expected {what}");
        };
        let mut back = ops.clone();
        back.push(op(5, 4, (100, 101), get("k", ReadKind::Follower), found(1, "b", 2)));
        back.push(op(6, 4, (102, 103), get("k", ReadKind::Follower), found(0, "a", 1)));
        expect_fail(&back, "went back");

        let mut ryw = ops.clone();
        ryw.push(op(
            5,
            1,
            (41, 42),
            Request::Get { key: "k".into(), mode: ReadKind::Follower, min_offset: Some(1), partition: None },
            found(0, "a", 2),
        ));
        expect_fail(&ryw, "read-your-writes");

        let fetch = |id, offset, records: Vec<LogRecord>, next| {
            let request = Request::Fetch { partition: 0, offset, max_records: 10 };
            let outcome = Outcome::Fetched { records, next_offset: next, high_watermark: 3, node: 1 };
            op(id, 6, (200 + id as u64 * 2, 201 + id as u64 * 2), request, outcome)
        };
        let mut skip = ops.clone();
        skip.push(fetch(10, 0, vec![rec(0, "k", Some("a"))], 1));
        skip.push(fetch(11, 1, vec![rec(2, "k", Some("c"))], 3));
        expect_fail(&skip, "skipped");
    }
}
