//! C2x: a Wing-Gong/Lowe linearizability search ([`porcupine_rs`]) over sampled register keys,
//! a cross-check of C2 that uses the client history alone, not the log's write order.
//!
//! Each key is a register: a put sets a value, a delete (tombstone) clears it, and a
//! linearizable or strict lookup returns the value or not-found. Follower lookups promise no
//! linearizability and are left out; so are failed lookups (they constrain nothing). Writes
//! follow the Jepsen/porcupine convention:
//! - acknowledged: happened once between invocation and completion;
//! - definitely failed: did not happen, dropped;
//! - indeterminate: may have happened once at any time after its invocation (its completion
//!   is the end of history), or never. An indeterminate put whose value no lookup returned is
//!   dropped: it can always be placed last, so the verdict is the same, but the search is
//!   smaller.
//!
//! The search is exponential in the worst case, so each key has a timeout and the whole
//! cross-check a budget; a key that runs out is reported as unknown, never as a violation.

use std::collections::HashMap;
use std::collections::HashSet;
use std::fmt::Write as _;
use std::time::Duration;
use std::time::Instant;

use porcupine_rs::CheckResult;
use porcupine_rs::Model;
use porcupine_rs::Operation;

use crate::chaos::checker::Findings;
use crate::chaos::op::Nanos;
use crate::chaos::op::Op;
use crate::chaos::op::Outcome;
use crate::chaos::op::Request;

/// How much the cross-check may search.
#[derive(Clone, Debug)]
pub struct Limits {
    /// Keys searched: the busiest ones (most operations), ties by name.
    pub keys_max: usize,
    pub key_timeout: Duration,
    /// For all keys together; keys left when it is spent are unknown.
    pub budget: Duration,
}

impl Limits {
    /// Every register key of the chaos workload (16), at most 5 s each and 20 s in all.
    pub const CI: Limits =
        Limits { keys_max: 16, key_timeout: Duration::from_secs(5), budget: Duration::from_secs(20) };
}

/// The verdict: violations as [`Findings`], and a one-line summary of what was searched,
/// including the keys whose search timed out (unknown).
#[derive(Clone, Debug)]
pub struct CrossCheck {
    pub findings: Findings,
    pub summary: String,
}

/// C2x: searches a linearization of each sampled key's writes and linearizable lookups;
/// a key with none is a violation, explained by the longest linearizable prefix found and
/// the operation it cannot place.
pub fn cross_check(ops: &[Op], limits: &Limits) -> CrossCheck {
    let started = Instant::now();
    let mut findings = Findings::new("C2x wgl cross-check");
    let sampled = sample(registers(ops), limits.keys_max);
    let searched_ops: usize = sampled.iter().map(|(_, r)| r.history.len()).sum();
    let mut linearizable = 0;
    let mut unknown: Vec<String> = Vec::new();
    for (key, register) in &sampled {
        let left = limits.budget.saturating_sub(started.elapsed());
        if left.is_zero() {
            unknown.push(format!("{key} (budget spent)"));
            continue;
        }
        let timeout = limits.key_timeout.min(left);
        match porcupine_rs::check_operations_timeout(&register.history, timeout) {
            CheckResult::Ok => linearizable += 1,
            CheckResult::Unknown => unknown.push(format!("{key} (timeout {:.1}s)", timeout.as_secs_f64())),
            CheckResult::Illegal => findings.add(explain(key, register, ops, timeout)),
        }
    }
    let mut summary = format!(
        "{}: {} keys ({searched_ops} operations) searched in {:.2}s: {linearizable} linearizable, {} not, {} unknown",
        findings.checker,
        sampled.len(),
        started.elapsed().as_secs_f64(),
        findings.count,
        unknown.len()
    );
    if !unknown.is_empty() {
        let _ = write!(summary, " ({})", unknown.join(", "));
    }
    CrossCheck { findings, summary }
}

/// The register model: the state is the value's number in [`Register::values`], `None` when
/// the key is absent (never written, or tombstoned).
#[derive(Clone, Debug)]
struct RegisterModel;

#[derive(Clone, Debug, PartialEq, Eq)]
enum Step {
    Put(u32),
    Delete,
    Get(Option<u32>),
}

impl Model for RegisterModel {
    type State = Option<u32>;
    type Op = Step;
    /// The operation's index in the history.
    type Metadata = usize;

    fn init() -> Option<u32> {
        None
    }

    fn step(state: &Option<u32>, op: &Step) -> (bool, Option<u32>) {
        match op {
            Step::Put(v) => (true, Some(*v)),
            Step::Delete => (true, None),
            Step::Get(read) => (read == state, *state),
        }
    }
}

/// One key's operations for the search, and the values they name.
#[derive(Default)]
struct Register<'a> {
    history: Vec<Operation<RegisterModel>>,
    values: Vec<&'a str>,
    numbers: HashMap<&'a str, u32>,
}

impl<'a> Register<'a> {
    fn number(&mut self, value: &'a str) -> u32 {
        let next = self.values.len() as u32;
        *self.numbers.entry(value).or_insert_with(|| {
            self.values.push(value);
            next
        })
    }

    fn push(&mut self, index: usize, op: &Op, returned: Nanos, step: Step) {
        self.history.push(Operation {
            client_id: Some(op.client as u32),
            call_time: time(op.invoke),
            return_time: time(returned),
            op: step,
            metadata: Some(index),
        });
    }

    fn describe(&self, state: Option<u32>) -> &str {
        state.map_or("absent", |v| self.values[v as usize])
    }
}

fn time(t: Nanos) -> i64 {
    i64::try_from(t).unwrap_or(i64::MAX)
}

/// The history of every key that has at least one successful linearizable lookup.
fn registers(ops: &[Op]) -> HashMap<&str, Register<'_>> {
    let mut out: HashMap<&str, Register<'_>> = HashMap::new();
    for (i, op) in ops.iter().enumerate() {
        let Request::Get { key, mode, .. } = &op.request else { continue };
        if !mode.is_linearizable() {
            continue;
        }
        let step = match &op.outcome {
            Outcome::Found { value, .. } => {
                let register = out.entry(key).or_default();
                Step::Get(Some(register.number(value)))
            }
            Outcome::NotFound { .. } => Step::Get(None),
            _ => continue,
        };
        out.entry(key).or_default().push(i, op, op.complete, step);
    }
    let read_values: HashMap<&str, HashSet<&str>> =
        out.iter().map(|(k, r)| (*k, r.numbers.keys().copied().collect())).collect();
    for (i, op) in ops.iter().enumerate() {
        let returned = match &op.outcome {
            Outcome::Written { .. } => op.complete,
            Outcome::Indeterminate { .. } => Nanos::MAX,
            _ => continue,
        };
        for (key, value) in writes(op) {
            let (Some(register), Some(read)) = (out.get_mut(key), read_values.get(key)) else { continue };
            match value {
                Some(v) if returned == Nanos::MAX && !read.contains(v) => {}
                Some(v) => {
                    let step = Step::Put(register.number(v));
                    register.push(i, op, returned, step);
                }
                None => register.push(i, op, returned, Step::Delete),
            }
        }
    }
    out
}

/// The writes one op sent, one per key: `(key, value)`, `None` for a delete. A batch that
/// writes a key twice leaves its last value (a batch is one entry, applied at once).
fn writes(op: &Op) -> Vec<(&str, Option<&str>)> {
    match &op.request {
        Request::Put { key, value, .. } => vec![(key.as_str(), Some(value.as_str()))],
        Request::Delete { key } => vec![(key.as_str(), None)],
        Request::Produce { records, .. } => {
            let last: HashMap<&str, &str> = records.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
            last.into_iter().map(|(k, v)| (k, Some(v))).collect()
        }
        _ => Vec::new(),
    }
}

/// The `keys_max` keys with the most operations, ties by name.
fn sample<'a>(registers: HashMap<&'a str, Register<'a>>, keys_max: usize) -> Vec<(&'a str, Register<'a>)> {
    let mut all: Vec<(&str, Register<'_>)> = registers.into_iter().collect();
    all.sort_by(|a, b| b.1.history.len().cmp(&a.1.history.len()).then(a.0.cmp(b.0)));
    all.truncate(keys_max);
    all
}

/// Why `key` is not linearizable: the longest linearizable prefix the search found, the state
/// it ends in and the write that set it, and the operation no order could place next (the
/// unplaced one that returned first), with the write of the value it read.
fn explain(key: &str, register: &Register<'_>, ops: &[Op], timeout: Duration) -> String {
    let history = &register.history;
    let head = format!("{key:?} is not linearizable ({} operations searched)", history.len());
    let (_, info) = porcupine_rs::check_operations_info_timeout(history, timeout);
    let Some(longest) = info.partial_linearizations.first().and_then(|p| p.iter().max_by_key(|l| l.len())) else {
        return format!("{head}; no partial linearization to show");
    };
    let brief = |i: usize| history[i].metadata.map_or_else(String::new, |at| ops[at].brief());
    let placed: HashSet<usize> = longest.iter().copied().collect();
    let mut state = RegisterModel::init();
    for &i in longest {
        state = RegisterModel::step(&state, &history[i].op).1;
    }
    let setter = longest.iter().rev().find(|&&i| !matches!(history[i].op, Step::Get(_)));
    let mut out = format!(
        "{head}: the longest linearizable prefix orders {} of them and ends with {key:?} {} (set by {})",
        longest.len(),
        register.describe(state),
        setter.map_or_else(|| "nothing: the initial state".into(), |&i| brief(i))
    );
    let stuck = (0..history.len()).filter(|i| !placed.contains(i)).min_by_key(|&i| (history[i].return_time, i));
    if let Some(stuck) = stuck {
        let _ = write!(out, "; it cannot place {}", brief(stuck));
        if let Step::Get(Some(v)) = history[stuck].op {
            let _ = write!(out, ", which read the value of {}", writer_of(register.values[v as usize], ops));
        }
    }
    out
}

/// The op that sent `value`, whatever its outcome.
fn writer_of(value: &str, ops: &[Op]) -> String {
    ops.iter()
        .find(|op| writes(op).iter().any(|(_, v)| *v == Some(value)))
        .map_or_else(|| format!("no write ({value:?} was never sent)"), Op::brief)
}

#[cfg(test)]
mod tests {
    //! Self-tests: the search accepts a linearizable history with concurrency and an
    //! indeterminate write, and rejects each class of bad read.

    use super::*;
    use crate::chaos::op::ReadKind;

    fn op(id: usize, client: usize, t: (u64, u64), request: Request, outcome: Outcome) -> Op {
        Op { id, client, node: 1, node_epoch: (1, 1), invoke: t.0, complete: t.1, request, outcome }
    }

    fn put(value: &str) -> Request {
        Request::Put { key: "k".into(), value: value.into(), forward: true }
    }

    fn get(mode: ReadKind) -> Request {
        Request::Get { key: "k".into(), mode, min_offset: None, partition: None }
    }

    fn written(offset: u64) -> Outcome {
        Outcome::Written { partition: 0, offsets: vec![offset] }
    }

    fn found(value: &str) -> Outcome {
        Outcome::Found { partition: 0, offset: 0, high_watermark: 9, node: 1, value: value.into() }
    }

    fn not_found() -> Outcome {
        Outcome::NotFound { partition: 0, high_watermark: 9, node: 1 }
    }

    fn indeterminate() -> Outcome {
        Outcome::Indeterminate { reason: "timeout".into() }
    }

    fn definite() -> Outcome {
        Outcome::Definite { reason: "421".into() }
    }

    fn check(ops: &[Op]) -> CrossCheck {
        cross_check(ops, &Limits::CI)
    }

    /// a and b overlap (a read between them may see either); c is never answered, yet a read
    /// sees it and a read before that does not; a delete is acknowledged, then not-found. An
    /// unanswered put nobody read, a definitely failed put and a stale follower read change
    /// nothing.
    #[test]
    fn wgl_accepts_a_linearizable_history_with_concurrency_and_an_indeterminate_write() {
        let ops = vec![
            op(0, 0, (0, 5), get(ReadKind::Linearizable), not_found()),
            op(1, 0, (10, 20), put("a"), written(0)),
            op(2, 1, (15, 40), put("b"), written(1)),
            op(3, 2, (18, 22), get(ReadKind::Linearizable), found("a")),
            op(4, 3, (19, 25), get(ReadKind::Strict), found("b")),
            op(5, 2, (26, 30), get(ReadKind::Linearizable), found("b")),
            op(6, 1, (50, 55), put("c"), indeterminate()),
            op(7, 3, (52, 58), get(ReadKind::Linearizable), found("b")),
            op(8, 4, (60, 70), get(ReadKind::Linearizable), found("c")),
            op(9, 5, (61, 63), put("d"), indeterminate()),
            op(10, 6, (64, 66), put("e"), definite()),
            op(11, 0, (80, 90), Request::Delete { key: "k".into() }, written(3)),
            op(12, 2, (95, 96), get(ReadKind::Linearizable), not_found()),
            op(13, 7, (97, 98), get(ReadKind::Follower), found("a")),
        ];
        let result = check(&ops);
        assert!(result.findings.is_ok(), "{}", result.findings);
        assert!(result.summary.contains("1 keys (11 operations)"), "{}", result.summary);
        assert!(result.summary.contains("1 linearizable, 0 not, 0 unknown"), "{}", result.summary);
    }

    /// b was acknowledged before the lookup began, yet it returned a (or not-found).
    #[test]
    fn wgl_rejects_a_stale_read() {
        let writes = vec![op(0, 0, (10, 20), put("a"), written(0)), op(1, 1, (30, 40), put("b"), written(1))];
        for stale in [found("a"), not_found()] {
            let mut ops = writes.clone();
            ops.push(op(2, 2, (50, 60), get(ReadKind::Linearizable), stale));
            expect_violation(&ops, "op#2");
        }
    }

    /// The lookup returned b, whose put was invoked after the lookup returned.
    #[test]
    fn wgl_rejects_a_read_of_a_value_written_after_the_read_returned() {
        for outcome in [written(1), indeterminate()] {
            let ops = vec![
                op(0, 0, (10, 20), put("a"), written(0)),
                op(1, 2, (30, 40), get(ReadKind::Linearizable), found("b")),
                op(2, 1, (50, 60), put("b"), outcome),
            ];
            expect_violation(&ops, "op#1");
        }
    }

    /// The lookup returned b, whose put definitely failed.
    #[test]
    fn wgl_rejects_a_read_of_a_definitely_failed_write() {
        let ops = vec![
            op(0, 0, (10, 20), put("a"), written(0)),
            op(1, 1, (30, 40), put("b"), definite()),
            op(2, 2, (50, 60), get(ReadKind::Linearizable), found("b")),
        ];
        let f = expect_violation(&ops, "op#2");
        assert!(f.shown[0].contains("which read the value of op#1"), "{f}");
    }

    /// With no budget every key is unknown, and unknown is not a violation.
    #[test]
    fn wgl_reports_keys_beyond_the_budget_as_unknown_not_as_violations() {
        let ops = vec![
            op(0, 0, (10, 20), put("a"), written(0)),
            op(1, 1, (30, 40), put("b"), written(1)),
            op(2, 2, (50, 60), get(ReadKind::Linearizable), found("a")),
        ];
        let limits = Limits { budget: Duration::ZERO, ..Limits::CI };
        let result = cross_check(&ops, &limits);
        assert!(result.findings.is_ok(), "{}", result.findings);
        assert!(result.summary.contains("1 unknown (k (budget spent))"), "{}", result.summary);
    }

    fn expect_violation(ops: &[Op], involved: &str) -> Findings {
        let result = check(ops);
        let f = result.findings;
        assert_eq!(f.count, 1, "{f}\n{}", result.summary);
        assert!(f.shown[0].starts_with("\"k\" is not linearizable"), "{f}");
        assert!(f.shown[0].contains(&format!("cannot place {involved} ")), "{f}");
        f
    }
}
