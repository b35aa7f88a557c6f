//! C4 convergence: after healing and quiescence every replica of every partition holds the
//! same records at the same offsets and answers every key the same, including replicas that
//! arrived by a move or a snapshot. Also collects the final logs the history checkers use.
//!
//! A replica whose files the nemesis damaged (a bit flipped in a sealed batch, see
//! `crate::damage`) may refuse that batch: fetches and lookups of its records answer 500
//! `corrupt_data`, or the right records if the replica re-applied them from the Raft log. Any
//! other answer for the damaged offsets (a wrong or missing record, a 404 for a key written
//! there) is a violation, and so is a `corrupt_data` answer anywhere else. The final logs are
//! then read from a replica that was not damaged.

use std::collections::BTreeMap;
use std::time::Duration;

use rand::rngs::StdRng;
use rand::seq::IndexedRandom as _;

use crate::chaos::checker::FinalLogs;
use crate::chaos::checker::Findings;
use crate::chaos::op::LogRecord;
use crate::chaos::op::Outcome;
use crate::chaos::op::ReadKind;
use crate::chaos::op::Request;
use crate::chaos::op::execute;
use crate::client::FetchResponse;
use crate::cluster::Cluster;
use crate::damage::Damage;
use crate::error::Error;
use crate::error::Result;
use crate::support::Probe;
use crate::support::is_transient_status;
use crate::support::poll_until;

const SETTLE_TIMEOUT: Duration = Duration::from_secs(45);
const PAGE_RECORDS: u32 = 1000;
const PAGES_MAX: usize = 2000;
/// Produced keys looked up on every replica (all register keys are).
const PRODUCED_KEYS_SAMPLED: usize = 100;
/// The error code of a replica refusing damaged data (api/src/error.rs).
pub const CORRUPT_DATA: &str = "corrupt_data";

/// The final logs (from each partition's leader, or a replica that was not damaged) and C4's
/// findings.
pub struct Converged {
    pub logs: FinalLogs,
    pub replicas: BTreeMap<u32, Vec<u64>>,
    pub findings: Findings,
    /// What became of each damaged batch, for the report.
    pub notes: Vec<String>,
}

/// A damaged batch located: `node`'s replica of `partition`, offsets `first..=last`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DamagedRange {
    pub node: u64,
    pub partition: u32,
    pub first: u64,
    pub last: u64,
}

impl DamagedRange {
    fn holds(&self, node: u64, partition: u32, offset: u64) -> bool {
        self.node == node && self.partition == partition && (self.first..=self.last).contains(&offset)
    }
}

/// Every record of `partition` below its high watermark, fetched from `node`'s replica
/// (`read=follower&forward=false`) or through the leader (`linearizable`). A `corrupt_data`
/// answer at the start of a `damaged` range skips that range (listed in the third value); one
/// anywhere else is an error.
async fn fetch_all(
    cluster: &Cluster,
    node: u64,
    topic: &str,
    partition: u32,
    follower: bool,
    damaged: &[DamagedRange],
) -> Result<(Vec<LogRecord>, u64, Vec<DamagedRange>)> {
    let base = cluster.url(node);
    let mode = if follower { "read=follower&forward=false" } else { "read=linearizable&forward=false" };
    let mut records = Vec::new();
    let mut refused = Vec::new();
    let mut offset = 0;
    for _ in 0..PAGES_MAX {
        let url = format!(
            "{base}/topics/{topic}/partitions/{partition}/records?offset={offset}&max_records={PAGE_RECORDS}&{mode}"
        );
        let reply = cluster.api().get_url(&url).await?;
        if reply.error_code().as_deref() == Some(CORRUPT_DATA) {
            let Some(range) = damaged.iter().find(|d| d.holds(node, partition, offset)) else {
                return Err(Error::Check(format!(
                    "node {node} refused partition {partition} at offset {offset} as corrupt, outside any damaged batch: {}",
                    reply.summary()
                )));
            };
            refused.push(*range);
            offset = range.last + 1;
            continue;
        }
        if reply.status == 421 || is_transient_status(reply.status) {
            return Err(Error::Unsettled(reply.summary()));
        }
        reply.expect_status(200)?;
        let page: FetchResponse = reply.decode()?;
        for r in &page.records {
            records.push(LogRecord {
                offset: r.offset,
                key: page.bytes_of(&r.key)?.map(|k| String::from_utf8_lossy(&k).into_owned()),
                value: page.bytes_of(&r.value)?.map(|v| String::from_utf8_lossy(&v).into_owned()),
            });
        }
        if page.records.is_empty() || page.next_offset >= page.high_watermark {
            return Ok((records, page.high_watermark, refused));
        }
        offset = page.next_offset;
    }
    Err(Error::Check(format!("partition {partition} needs more than {PAGES_MAX} fetch pages")))
}

/// Waits for a leader everywhere, reads each partition's log from its leader (or, when the
/// nemesis damaged some nodes' files, from a replica on an undamaged node), waits until every
/// replica reached that high watermark, and compares every replica's records and key answers.
pub async fn converge(
    cluster: &Cluster,
    topic: &str,
    partitions: u32,
    damages: &[Damage],
    rng: &mut StdRng,
) -> Result<Converged> {
    let mut findings = Findings::new("C4 convergence");
    let description = cluster.wait_for_leaders(topic, SETTLE_TIMEOUT).await?;
    let description =
        poll_until("every partition move to finish", SETTLE_TIMEOUT, Duration::from_millis(500), || async {
            let d = cluster.describe(topic).await?;
            let moving = d.partitions.iter().filter(|p| p.move_state.is_some()).count();
            Ok(if moving == 0 { Probe::Ready(d) } else { Probe::NotYet(format!("{moving} moving")) })
        })
        .await
        .unwrap_or(description);
    let damaged_nodes: Vec<u64> = damages.iter().map(|d| d.node).collect();
    let mut logs = FinalLogs::new();
    let mut replicas = BTreeMap::new();
    let mut sources = BTreeMap::new();
    let mut high_watermarks = BTreeMap::new();
    for p in 0..partitions {
        // Through the leader of a fresh description, again if leadership moves under the read
        // (an election after heavy faults answers 421 or 503 for a while).
        let mut first = Some(description.clone());
        let what = format!("partition {p}'s log through its leader");
        let damaged_nodes = &damaged_nodes;
        let (part_replicas, source, (log, hw, _)) =
            poll_until(&what, SETTLE_TIMEOUT, Duration::from_millis(500), || {
                let known = first.take();
                async move {
                    let d = match known {
                        Some(d) => d,
                        None => cluster.describe(topic).await?,
                    };
                    let part = d.partition(p)?;
                    let Some(leader) = part.leader else { return Ok(Probe::NotYet("no leader".into())) };
                    let source = Some(leader)
                        .filter(|l| !damaged_nodes.contains(l))
                        .or_else(|| part.replicas.iter().copied().find(|n| !damaged_nodes.contains(n)))
                        .unwrap_or(leader);
                    match fetch_all(cluster, source, topic, p, false, &[]).await {
                        Ok(found) => Ok(Probe::Ready((part.replicas.clone(), source, found))),
                        Err(e) if e.is_transport() || matches!(e, Error::Unsettled(_)) => {
                            Ok(Probe::NotYet(format!("through node {source}: {e}")))
                        }
                        Err(e) => Err(e),
                    }
                }
            })
            .await?;
        replicas.insert(p, part_replicas);
        sources.insert(p, source);
        high_watermarks.insert(p, hw);
        logs.insert(p, log);
    }
    let (damaged, mut notes) = locate_damages(damages, &logs, &mut findings);
    for (&p, log) in &logs {
        let (source, hw) = (sources[&p], high_watermarks[&p]);
        for &node in &replicas[&p] {
            let what = format!("node {node}'s replica of partition {p} to reach high watermark {hw}");
            let caught_up = poll_until(&what, SETTLE_TIMEOUT, Duration::from_millis(250), || async {
                let (records, replica_hw, refused) = match fetch_all(cluster, node, topic, p, true, &damaged).await {
                    Ok(found) => found,
                    Err(e) => return Ok(Probe::NotYet(e.to_string())),
                };
                Ok(if replica_hw >= hw {
                    Probe::Ready((records, refused))
                } else {
                    Probe::NotYet(format!("high watermark {replica_hw}"))
                })
            })
            .await;
            match caught_up {
                Ok((records, refused)) => {
                    let expected: Vec<LogRecord> =
                        log.iter().filter(|r| !refused.iter().any(|d| d.holds(node, p, r.offset))).cloned().collect();
                    compare_logs(p, source, &expected, node, &records, &mut findings);
                }
                Err(e) => findings.add(format!("partition {p}: replica on node {node} never caught up: {e}")),
            }
        }
    }
    for range in &damaged {
        notes.push(probe_damaged_range(cluster, topic, range, &logs, &mut findings).await);
    }
    compare_key_answers(cluster, topic, &logs, &replicas, &damaged, rng, &mut findings).await;
    Ok(Converged { logs, replicas, findings, notes })
}

/// Which partition each damaged batch belongs to: the one whose final log holds, at the
/// batch's offsets, the keys and values the batch held before the flip (a key belongs to one
/// partition; every value is unique).
fn locate_damages(damages: &[Damage], logs: &FinalLogs, findings: &mut Findings) -> (Vec<DamagedRange>, Vec<String>) {
    let mut located = Vec::new();
    let mut notes = Vec::new();
    for d in damages {
        let (first, last) = (d.batch.base_offset, d.batch.last_offset);
        let matches = |log: &Vec<LogRecord>| {
            let held: Vec<(Option<String>, Option<String>)> = log
                .iter()
                .filter(|r| (first..=last).contains(&r.offset))
                .map(|r| (r.key.clone(), r.value.clone()))
                .collect();
            !d.records.is_empty() && held == d.records
        };
        match logs.iter().find(|(_, log)| matches(log)) {
            Some((&partition, _)) => {
                located.push(DamagedRange { node: d.node, partition, first, last });
                notes.push(format!(
                    "node {}: bit flipped in partition {partition}'s batch of offsets {first}..={last} ({})",
                    d.node,
                    d.file.display()
                ));
            }
            None => findings.add(format!(
                "the batch damaged on node {} (offsets {first}..={last}, records {:?}) is in no final log",
                d.node, d.records
            )),
        }
    }
    (located, notes)
}

/// The damaged replica, asked for exactly the damaged batch's offsets, must refuse them
/// (`corrupt_data`) or answer them right (re-applied from the Raft log); never wrong or
/// missing records. Returns what it did, for the report.
async fn probe_damaged_range(
    cluster: &Cluster,
    topic: &str,
    d: &DamagedRange,
    logs: &FinalLogs,
    findings: &mut Findings,
) -> String {
    let expected: Vec<LogRecord> = logs
        .get(&d.partition)
        .map(|log| log.iter().filter(|r| (d.first..=d.last).contains(&r.offset)).cloned().collect())
        .unwrap_or_default();
    let request =
        Request::Fetch { partition: d.partition, offset: d.first, max_records: (d.last - d.first + 1) as u32 };
    let what =
        format!("node {}'s answer for partition {}'s damaged offsets {}..={}", d.node, d.partition, d.first, d.last);
    for _ in 0..40 {
        match execute(cluster.api(), &cluster.url(d.node), topic, &request).await {
            Outcome::Fetched { records, .. } if records == expected => {
                return format!("{what}: the right records (the damaged batch was re-applied)");
            }
            Outcome::Indeterminate { reason } if reason.ends_with(CORRUPT_DATA) => {
                return format!("{what}: refused ({reason})");
            }
            Outcome::Fetched { records, .. } => {
                findings.add(format!("{what}: {records:?}, expected {expected:?} or {CORRUPT_DATA}"));
                return format!("{what}: WRONG");
            }
            _ => tokio::time::sleep(Duration::from_millis(250)).await,
        }
    }
    findings.add(format!("{what}: no answer"));
    format!("{what}: no answer")
}

/// Records of `node`'s replica against the leader's.
pub fn compare_logs(
    partition: u32,
    leader: u64,
    expected: &[LogRecord],
    node: u64,
    actual: &[LogRecord],
    findings: &mut Findings,
) {
    if let Some(i) = (0..expected.len().max(actual.len())).find(|i| expected.get(*i) != actual.get(*i)) {
        findings.add(format!(
            "partition {partition}: node {node}'s replica differs from leader node {leader}'s at position {i}: {:?} vs {:?} ({} vs {} records)",
            actual.get(i),
            expected.get(i),
            actual.len(),
            expected.len()
        ));
    }
}

/// A follower lookup's answer against the log's latest record for the key (`want`): the same
/// offset and value, a 404 for a tombstone, or, only when that record is in a batch damaged on
/// the replica asked (`refusable`), a `corrupt_data` refusal.
pub fn key_answer_ok(outcome: &Outcome, want: &Option<(u64, String)>, refusable: impl Fn(u64) -> bool) -> bool {
    match (outcome, want) {
        (Outcome::Found { offset, value, .. }, Some((o, v))) => offset == o && value == v,
        (Outcome::NotFound { .. }, None) => true,
        (Outcome::Indeterminate { reason }, Some((o, _))) => reason.ends_with(CORRUPT_DATA) && refusable(*o),
        _ => false,
    }
}

/// What a lookup of each key must answer, from the final logs: `Some((offset, value))` for a
/// live key, `None` for a tombstoned one.
pub fn expected_answers(logs: &FinalLogs) -> BTreeMap<String, (u32, Option<(u64, String)>)> {
    let mut latest = BTreeMap::new();
    for (p, log) in logs {
        for r in log {
            if let Some(key) = &r.key {
                latest.insert(key.clone(), (*p, r.value.clone().map(|v| (r.offset, v))));
            }
        }
    }
    latest
}

async fn compare_key_answers(
    cluster: &Cluster,
    topic: &str,
    logs: &FinalLogs,
    replicas: &BTreeMap<u32, Vec<u64>>,
    damaged: &[DamagedRange],
    rng: &mut StdRng,
    findings: &mut Findings,
) {
    let expected = expected_answers(logs);
    let registers: Vec<&String> = expected.keys().filter(|k| k.starts_with('k')).collect();
    let produced: Vec<&String> = expected.keys().filter(|k| k.starts_with('p')).collect();
    let sampled: Vec<&String> = produced.choose_multiple(rng, PRODUCED_KEYS_SAMPLED).copied().collect();
    for key in registers.into_iter().chain(sampled) {
        let (partition, want) = &expected[key];
        for &node in replicas.get(partition).map(Vec::as_slice).unwrap_or_default() {
            let request = Request::Get {
                key: key.clone(),
                mode: ReadKind::Follower,
                min_offset: None,
                partition: Some(*partition),
            };
            let outcome = execute(cluster.api(), &cluster.url(node), topic, &request).await;
            let refusable = |o: u64| damaged.iter().any(|d| d.holds(node, *partition, o));
            if !key_answer_ok(&outcome, want, refusable) {
                findings.add(format!("key {key:?} on node {node}'s replica of partition {partition}: expected {want:?} (the log's latest record), got {outcome:?}"));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    //! C4's self-test: a replica that differs from the leader, by a record or by length, fails.

    use super::*;

    fn rec(offset: u64, value: &str) -> LogRecord {
        LogRecord { offset, key: Some("k".into()), value: Some(value.into()) }
    }

    #[test]
    fn replica_comparison_fails_on_any_difference() {
        let leader = vec![rec(0, "a"), rec(1, "b")];
        let mut f = Findings::new("C4");
        compare_logs(0, 1, &leader, 2, &leader.clone(), &mut f);
        assert!(f.is_ok(), "{f}");
        compare_logs(0, 1, &leader, 2, &[rec(0, "a"), rec(1, "x")], &mut f);
        compare_logs(0, 1, &leader, 3, &[rec(0, "a")], &mut f);
        assert_eq!(f.count, 2, "{f}");
        let expected = expected_answers(&FinalLogs::from([(0, leader)]));
        assert_eq!(expected.get("k"), Some(&(0, Some((1, "b".to_string())))));
    }

    /// On a damaged replica only a refusal or the right answer passes for a key whose record
    /// is in the damaged batch; a refusal anywhere else, a 404 or an older value fails.
    #[test]
    fn key_answers_accept_a_refusal_only_for_damaged_records() {
        let damaged = DamagedRange { node: 2, partition: 0, first: 10, last: 12 };
        let on = |node: u64| move |o: u64| damaged.holds(node, 0, o);
        let want = Some((11, "v1.5".to_string()));
        let found = |offset: u64, value: &str| Outcome::Found {
            partition: 0,
            offset,
            high_watermark: 20,
            node: 2,
            value: value.into(),
        };
        let refused = Outcome::Indeterminate { reason: format!("500 {CORRUPT_DATA}") };
        let missing = Outcome::NotFound { partition: 0, high_watermark: 20, node: 2 };
        assert!(key_answer_ok(&found(11, "v1.5"), &want, on(2)));
        assert!(key_answer_ok(&refused, &want, on(2)));
        assert!(!key_answer_ok(&refused, &want, on(3)), "a refusal on an undamaged replica");
        assert!(!key_answer_ok(&refused, &Some((13, "v1.6".into())), on(2)), "a refusal outside the damage");
        assert!(!key_answer_ok(&missing, &want, on(2)), "a 404 for a key that exists");
        assert!(!key_answer_ok(&found(7, "v1.2"), &want, on(2)), "an older value");
        assert!(!key_answer_ok(&Outcome::Indeterminate { reason: "500 internal".into() }, &want, on(2)));
    }

    /// A damaged batch is placed in the partition whose final log holds its values at its offsets.
    #[test]
    fn damaged_batches_are_located_by_their_values() {
        let log =
            |values: &[&str]| -> Vec<LogRecord> { values.iter().enumerate().map(|(i, v)| rec(i as u64, v)).collect() };
        let logs = FinalLogs::from([(0, log(&["a", "b", "c"])), (1, log(&["x", "y", "z"]))]);
        let damage = |values: &[&str]| Damage {
            node: 3,
            file: "f".into(),
            at: 70,
            batch: crate::damage::Batch { position: 0, size: 90, base_offset: 1, last_offset: 2 },
            records: values.iter().map(|v| (Some("k".to_string()), Some(v.to_string()))).collect(),
        };
        let mut f = Findings::new("C4");
        let (located, _) = locate_damages(&[damage(&["y", "z"])], &logs, &mut f);
        assert!(f.is_ok(), "{f}");
        assert_eq!(located, vec![DamagedRange { node: 3, partition: 1, first: 1, last: 2 }]);
        let (located, _) = locate_damages(&[damage(&["b", "q"])], &logs, &mut f);
        assert!(located.is_empty());
        assert_eq!(f.count, 1, "a damaged batch found in no log is reported");
    }
}
