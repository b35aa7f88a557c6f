//! C4 convergence: after healing and quiescence every replica of every partition holds the
//! same records at the same offsets and answers every key the same, including replicas that
//! arrived by a move or a snapshot. Also collects the final logs the history checkers use.

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
use crate::error::Error;
use crate::error::Result;
use crate::support::Probe;
use crate::support::poll_until;

const SETTLE_TIMEOUT: Duration = Duration::from_secs(45);
const PAGE_RECORDS: u32 = 1000;
const PAGES_MAX: usize = 2000;
/// Produced keys looked up on every replica (all register keys are).
const PRODUCED_KEYS_SAMPLED: usize = 100;

/// The final logs (from each partition's leader) and C4's findings.
pub struct Converged {
    pub logs: FinalLogs,
    pub replicas: BTreeMap<u32, Vec<u64>>,
    pub findings: Findings,
}

/// Every record of `partition` below its high watermark, fetched from `node`'s replica
/// (`read=follower&forward=false`) or through the leader (`linearizable`).
async fn fetch_all(
    cluster: &Cluster,
    node: u64,
    topic: &str,
    partition: u32,
    follower: bool,
) -> Result<(Vec<LogRecord>, u64)> {
    let base = cluster.url(node);
    let mode = if follower { "read=follower&forward=false" } else { "read=linearizable&forward=false" };
    let mut records = Vec::new();
    let mut offset = 0;
    for _ in 0..PAGES_MAX {
        let url = format!(
            "{base}/topics/{topic}/partitions/{partition}/records?offset={offset}&max_records={PAGE_RECORDS}&{mode}"
        );
        let reply = cluster.api().get_url(&url).await?;
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
            return Ok((records, page.high_watermark));
        }
        offset = page.next_offset;
    }
    Err(Error::Check(format!("partition {partition} needs more than {PAGES_MAX} fetch pages")))
}

/// Waits for a leader everywhere, reads each partition's log from its leader, waits until every
/// replica reached that high watermark, and compares every replica's records and key answers.
pub async fn converge(cluster: &Cluster, topic: &str, partitions: u32, rng: &mut StdRng) -> Result<Converged> {
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
    let mut logs = FinalLogs::new();
    let mut replicas = BTreeMap::new();
    for p in 0..partitions {
        let part = description.partition(p)?;
        let leader = part.leader.ok_or_else(|| Error::Check(format!("partition {p} has no leader")))?;
        let (log, hw) = fetch_all(cluster, leader, topic, p, false).await?;
        replicas.insert(p, part.replicas.clone());
        for &node in &part.replicas {
            let what = format!("node {node}'s replica of partition {p} to reach high watermark {hw}");
            let caught_up = poll_until(&what, SETTLE_TIMEOUT, Duration::from_millis(250), || async {
                let (records, replica_hw) = match fetch_all(cluster, node, topic, p, true).await {
                    Ok(found) => found,
                    Err(e) => return Ok(Probe::NotYet(e.to_string())),
                };
                Ok(if replica_hw >= hw {
                    Probe::Ready(records)
                } else {
                    Probe::NotYet(format!("high watermark {replica_hw}"))
                })
            })
            .await;
            match caught_up {
                Ok(records) => compare_logs(p, leader, &log, node, &records, &mut findings),
                Err(e) => findings.add(format!("partition {p}: replica on node {node} never caught up: {e}")),
            }
        }
        logs.insert(p, log);
    }
    compare_key_answers(cluster, topic, &logs, &replicas, rng, &mut findings).await;
    Ok(Converged { logs, replicas, findings })
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
            let same = match (&outcome, want) {
                (Outcome::Found { offset, value, .. }, Some((o, v))) => offset == o && value == v,
                (Outcome::NotFound { .. }, None) => true,
                _ => false,
            };
            if !same {
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
}
