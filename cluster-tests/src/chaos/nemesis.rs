//! The faults: kills, power loss, disk damage, pauses and network faults, applied to a running
//! cluster while the workload runs, each recorded as an event with evidence that it happened.
//!
//! Every random choice (which fault, which node, how long) comes from the nemesis's own RNG,
//! seeded from the run's seed, so a seed replays the same fault schedule; targets named by
//! role ("the leader of partition 2") are resolved against the live cluster.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;
use std::time::Instant;

use rand::Rng as _;
use rand::rngs::StdRng;
use rand::seq::IndexedRandom as _;
use serde::Serialize;

use crate::chaos::op::Nanos;
use crate::chaos::workload::RunState;
use crate::cluster::Cluster;
use crate::error::Error;
use crate::error::Result;
use crate::proxy::Fault;
use crate::proxy::LinkStats;

/// The log line a replica writes when it installed a snapshot (raft/src/partition.rs).
const SNAPSHOT_INSTALLED: &str = "snapshot installed";
/// The log line of a segment log that cut a damaged or torn tail off its active segment on
/// open (log/src/segment.rs).
const TORN_TAIL_CUT: &str = "truncating torn tail of the active segment";
const POLL: Duration = Duration::from_millis(250);
/// How long a pause or a cut lasts at most while waiting for its evidence (another node
/// elected): a loaded machine has taken more than 4 s for an election (soak seed 3031).
const EVIDENCE_WAIT: Duration = Duration::from_secs(20);
/// How long a node to damage may take to seal its first segment.
const SEALED_WAIT: Duration = Duration::from_secs(60);
const MOVE_TIMEOUT: Duration = Duration::from_secs(60);

#[derive(Clone, Copy, Debug, Serialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum EventKind {
    /// A fault begins (or continues in a new form).
    Fault,
    /// Every fault so far is over.
    Heal,
    Info,
}

/// Whether a fault demonstrably happened (C5).
#[derive(Clone, Debug, Serialize)]
pub struct Evidence {
    pub ok: bool,
    pub detail: String,
}

#[derive(Clone, Debug, Serialize)]
pub struct Event {
    pub at: Nanos,
    pub kind: EventKind,
    pub what: String,
    pub evidence: Option<Evidence>,
}

/// Applies faults to `cluster` and records them.
pub struct Nemesis<'a> {
    pub cluster: &'a mut Cluster,
    pub state: Arc<RunState>,
    pub rng: StdRng,
    pub topic: String,
    pub partitions: u32,
    /// The longest election timeout of the nodes (twice `--election-timeout-ms`).
    pub election_timeout_max: Duration,
    pub snapshot_every: Option<u64>,
    pub events: Vec<Event>,
    /// Bit flips the nemesis made in sealed segments (for C4: what a replica must refuse).
    pub damages: Vec<crate::damage::Damage>,
}

impl Nemesis<'_> {
    fn note(&mut self, kind: EventKind, what: String, evidence: Option<Evidence>) {
        let at = self.state.now();
        let shown = match &evidence {
            Some(e) if !e.ok => format!(" [NO EVIDENCE: {}]", e.detail),
            Some(e) => format!(" [{}]", e.detail),
            None => String::new(),
        };
        eprintln!("[chaos {:7.2}s] {:?}: {what}{shown}", at as f64 / 1e9, kind);
        self.events.push(Event { at, kind, what, evidence });
    }

    /// Records evidence on the latest event named `what` (a fault whose effect shows later).
    fn confirm(&mut self, index: usize, ok: bool, detail: String) {
        let event = &mut self.events[index];
        eprintln!(
            "[chaos {:7.2}s] evidence for {:?}: {}{detail}",
            self.state.now() as f64 / 1e9,
            event.what,
            if ok { "" } else { "NONE: " }
        );
        event.evidence = Some(Evidence { ok, detail });
    }

    /// Waits `duration` while the workload runs, failing early if a node died on its own.
    pub async fn hold(&self, duration: Duration) -> Result<()> {
        let until = Instant::now() + duration;
        while Instant::now() < until {
            self.cluster.check_all_alive()?;
            tokio::time::sleep(POLL.min(until - Instant::now())).await;
        }
        Ok(())
    }

    fn random_duration(&mut self, low: Duration, high: Duration) -> Duration {
        Duration::from_millis(self.rng.random_range(low.as_millis() as u64..=high.as_millis() as u64))
    }

    /// Running nodes that are not paused, in id order.
    fn responsive(&self) -> Vec<u64> {
        self.cluster.running_ids()
    }

    /// `partition -> (leader, replicas, move in progress)` as described by any node but `avoid`.
    pub async fn layout(&self, avoid: &[u64]) -> BTreeMap<u32, (Option<u64>, Vec<u64>, bool)> {
        for id in self.responsive().into_iter().filter(|id| !avoid.contains(id)) {
            let Ok(Ok(reply)) = tokio::time::timeout(
                Duration::from_secs(3),
                self.cluster.api().describe(&self.cluster.url(id), &self.topic),
            )
            .await
            else {
                continue;
            };
            let Ok(d) = reply.decode::<crate::client::TopicDescription>() else { continue };
            if reply.status != 200 {
                continue;
            }
            return d
                .partitions
                .iter()
                .map(|p| (p.partition, (p.leader, p.replicas.clone(), p.move_state.is_some())))
                .collect();
        }
        BTreeMap::new()
    }

    /// The leader of `partition`, waiting up to `timeout` for one that is running.
    pub async fn leader_of(&self, partition: u32, timeout: Duration) -> Option<u64> {
        let until = Instant::now() + timeout;
        loop {
            let running = self.responsive();
            if let Some((Some(leader), _, _)) = self.layout(&[]).await.get(&partition)
                && running.contains(leader)
            {
                return Some(*leader);
            }
            if Instant::now() >= until {
                return None;
            }
            tokio::time::sleep(POLL).await;
        }
    }

    /// Polls, describing through nodes other than `avoid`, until some partition in `led` has a
    /// leader other than `node`. Returns the evidence text.
    async fn wait_for_new_leader(
        &self,
        node: u64,
        led: &[u32],
        avoid: &[u64],
        timeout: Duration,
    ) -> std::result::Result<String, String> {
        if led.is_empty() {
            return Ok(format!("node {node} led no partition"));
        }
        let until = Instant::now() + timeout;
        loop {
            let layout = self.layout(avoid).await;
            for p in led {
                if let Some((Some(l), _, _)) = layout.get(p)
                    && *l != node
                {
                    return Ok(format!("partition {p} elected node {l}"));
                }
            }
            if Instant::now() >= until {
                return Err(format!(
                    "no partition of {led:?} elected a leader other than node {node} within {timeout:?}"
                ));
            }
            tokio::time::sleep(POLL).await;
        }
    }

    fn led_by(layout: &BTreeMap<u32, (Option<u64>, Vec<u64>, bool)>, node: u64) -> Vec<u32> {
        layout.iter().filter(|(_, (l, _, _))| *l == Some(node)).map(|(p, _)| *p).collect()
    }

    /// The node leading the most partitions (a random node if none is known).
    pub async fn busiest_leader(&mut self) -> u64 {
        let layout = self.layout(&[]).await;
        let mut counts: BTreeMap<u64, usize> = BTreeMap::new();
        for (leader, _, _) in layout.values() {
            if let Some(l) = leader {
                *counts.entry(*l).or_default() += 1;
            }
        }
        match counts.iter().max_by_key(|(id, c)| (**c, std::cmp::Reverse(**id))) {
            Some((id, _)) => *id,
            None => *self.cluster.running_ids().choose(&mut self.rng).unwrap_or(&1),
        }
    }

    // ------------------------------------------------------------------ process faults

    /// SIGKILL one node: the leader of a random partition half the time, else a random node;
    /// it stays down for `down`, then restarts.
    pub async fn kill_one(&mut self, down: Duration) -> Result<()> {
        let partition = self.rng.random_range(0..self.partitions);
        let by_leader = self.rng.random_bool(0.5);
        let pick = self.rng.random_range(0..64usize);
        let running = self.cluster.running_ids();
        let layout = self.layout(&[]).await;
        let (victim, why) = match layout.get(&partition) {
            Some((Some(l), _, _)) if by_leader && running.contains(l) => {
                (*l, format!("leader of partition {partition}"))
            }
            _ => (running[pick % running.len()], "a random node".to_string()),
        };
        let led = Self::led_by(&layout, victim);
        self.kill(victim, &why)?;
        let index = self.events.len() - 1;
        let started = Instant::now();
        let evidence = self.wait_for_new_leader(victim, &led, &[victim], down + self.election_timeout_max * 3).await;
        match evidence {
            Ok(text) => self.confirm(index, true, format!("process reaped; {text}")),
            Err(text) => self.confirm(index, false, text),
        }
        self.hold(down.saturating_sub(started.elapsed())).await?;
        self.restart(victim).await
    }

    /// kill -9 one node (the leader of a random partition half the time); while it is down,
    /// flip a bit inside a record of one of its sealed segments and cut the active segment of
    /// the same partition replica inside one of its last batches (with `above_checkpoint`, only
    /// batches at or above its last checkpoint when there are some); restart it after `down`.
    /// Nodes in `spare` are not chosen. Evidence: both changes read back from disk, and the
    /// restarted node logged that it cut the damaged tail.
    pub async fn flip_and_cut_one(&mut self, down: Duration, spare: &[u64], above_checkpoint: bool) -> Result<()> {
        let partition = self.rng.random_range(0..self.partitions);
        let by_leader = self.rng.random_bool(0.5);
        let pick = self.rng.random_range(0..64usize);
        let running: Vec<u64> = self.cluster.running_ids().into_iter().filter(|id| !spare.contains(id)).collect();
        if running.is_empty() {
            return Err(Error::Check("no running node left to damage".into()));
        }
        let (victim, why) = match self.layout(&[]).await.get(&partition) {
            Some((Some(l), _, _)) if by_leader && running.contains(l) => {
                (*l, format!("leader of partition {partition}"))
            }
            _ => (running[pick % running.len()], "a random node".to_string()),
        };
        // The workload seals segments at its own pace: on a slow machine the warm-up may not
        // have filled one yet.
        let until = Instant::now() + SEALED_WAIT;
        while !crate::damage::has_sealed_segment(self.cluster.data_dir(victim))? && Instant::now() < until {
            tokio::time::sleep(POLL).await;
        }
        self.kill(victim, &format!("{why}, to damage its files"))?;
        let cuts_before = count_in_log(self.cluster.log_path(victim), TORN_TAIL_CUT);
        let data_dir = self.cluster.data_dir(victim).to_path_buf();
        let damaged = crate::damage::flip_and_cut(victim, &data_dir, above_checkpoint, &mut self.rng)?;
        let evidence = match &damaged {
            Some((damage, cut)) => Evidence {
                ok: cut.bytes_after < cut.bytes_before,
                detail: format!(
                    "byte {} of {} flipped (batch at {}, offsets {}..={}); {} cut from {} to {} bytes ({} batches, {} the checkpoint at {:?})",
                    damage.at,
                    damage.file.display(),
                    damage.batch.position,
                    damage.batch.base_offset,
                    damage.batch.last_offset,
                    cut.file.display(),
                    cut.bytes_before,
                    cut.bytes_after,
                    cut.batches,
                    if cut.above_checkpoint { "above" } else { "reaching below" },
                    cut.checkpoint
                ),
            },
            None => Evidence { ok: false, detail: "no replica had a sealed segment and an active one".into() },
        };
        self.note(
            EventKind::Fault,
            format!("node {victim} down: a bit flipped in a sealed segment, its active segment cut"),
            Some(evidence),
        );
        let index = self.events.len() - 1;
        if let Some((damage, _)) = damaged {
            self.damages.push(damage);
        }
        self.hold(down).await?;
        self.restart(victim).await?;
        let cuts = count_in_log(self.cluster.log_path(victim), TORN_TAIL_CUT).saturating_sub(cuts_before);
        if cuts == 0 {
            let detail = self.events[index].evidence.as_ref().map(|e| e.detail.clone()).unwrap_or_default();
            let missing = format!("{detail}; but node {victim} did not log that it cut its damaged active segment");
            self.confirm(index, false, missing);
        }
        Ok(())
    }

    pub fn kill(&mut self, id: u64, why: &str) -> Result<()> {
        self.state.bump_epoch(id);
        self.cluster.kill(id)?;
        self.note(
            EventKind::Fault,
            format!("kill -9 node {id} ({why})"),
            Some(Evidence { ok: true, detail: "process reaped".into() }),
        );
        Ok(())
    }

    pub async fn restart(&mut self, id: u64) -> Result<()> {
        self.cluster.restart(id).await?;
        self.state.bump_epoch(id);
        self.note(EventKind::Heal, format!("node {id} restarted and ready"), None);
        Ok(())
    }

    /// SIGKILL every node at once, then restart them all.
    pub async fn kill_all(&mut self) -> Result<()> {
        for id in self.cluster.running_ids() {
            self.state.bump_epoch(id);
        }
        self.cluster.kill_all()?;
        self.note(
            EventKind::Fault,
            "kill -9 every node at once".into(),
            Some(Evidence { ok: true, detail: "every process reaped".into() }),
        );
        self.restart_all().await
    }

    async fn restart_all(&mut self) -> Result<()> {
        self.cluster.restart_all().await?;
        for id in self.cluster.node_ids() {
            self.state.bump_epoch(id);
        }
        self.note(EventKind::Heal, "every node restarted and ready".into(), None);
        Ok(())
    }

    /// Power loss of `nodes` (all running nodes when empty): SIGKILL, cut every traced file
    /// back to its last fsync (tearing a page when `tear`), optionally delete one node's index
    /// so it rebuilds from the log, and restart. With `loss_required`, the fault counts as
    /// having happened (C5) only if unsynced bytes were lost; without, a node that had nothing
    /// unsynced (its partitions idle for a checkpoint interval, say while their leader was
    /// paused) went through a kill -9, which is a fault too.
    pub async fn power_loss(
        &mut self,
        nodes: &[u64],
        tear: bool,
        wipe_index: Option<u64>,
        loss_required: bool,
    ) -> Result<()> {
        let victims: Vec<u64> = if nodes.is_empty() { self.cluster.running_ids() } else { nodes.to_vec() };
        for id in &victims {
            self.state.bump_epoch(*id);
        }
        let report = self.cluster.power_loss_nodes(&victims, &mut self.rng, tear)?;
        let mut what = format!("power loss of nodes {victims:?}{}: {report}", if tear { ", pages torn" } else { "" });
        if let Some(id) = wipe_index {
            let index = self.cluster.data_dir(id).join("index");
            std::fs::remove_dir_all(&index).map_err(|e| Error::io(format!("removing {}", index.display()), e))?;
            what.push_str(&format!("; node {id}'s index deleted"));
        }
        let lost = report.bytes_lost > 0 || report.pages_torn > 0;
        let detail = match (lost, loss_required) {
            (true, _) => "unsynced bytes lost",
            (false, true) => "nothing unsynced to lose",
            (false, false) => "nothing unsynced to lose: a kill -9, processes reaped",
        };
        self.note(EventKind::Fault, what, Some(Evidence { ok: lost || !loss_required, detail: detail.into() }));
        for id in &victims {
            self.cluster.launch_stopped(*id)?;
        }
        self.cluster.wait_nodes_ready(&victims).await?;
        for id in &victims {
            self.state.bump_epoch(*id);
        }
        self.note(EventKind::Heal, format!("nodes {victims:?} restarted and ready"), None);
        Ok(())
    }

    /// SIGSTOP `node` for `duration`, then SIGCONT; evidence: another node took over a
    /// partition it led. The node stays stopped until that is seen (up to [`EVIDENCE_WAIT`]),
    /// also past `duration`.
    pub async fn pause(&mut self, node: u64, duration: Duration) -> Result<()> {
        let layout = self.layout(&[]).await;
        let led = Self::led_by(&layout, node);
        self.cluster.pause(node)?;
        self.note(
            EventKind::Fault,
            format!("SIGSTOP node {node} for {duration:?}, longer until another node is elected (it leads partitions {led:?})"),
            None,
        );
        let index = self.events.len() - 1;
        let started = Instant::now();
        let evidence = self.wait_for_new_leader(node, &led, &[node], duration.max(EVIDENCE_WAIT)).await;
        match evidence {
            Ok(text) => self.confirm(index, true, text),
            Err(text) => self.confirm(index, false, text),
        }
        self.hold(duration.saturating_sub(started.elapsed())).await?;
        self.cluster.resume(node)?;
        self.note(EventKind::Heal, format!("SIGCONT node {node}"), None);
        Ok(())
    }

    // ------------------------------------------------------------------ network faults

    fn proxy(&self) -> Result<&crate::proxy::Proxy> {
        self.cluster.proxy().ok_or_else(|| Error::Check("network faults need a proxied cluster".into()))
    }

    fn link_stats(&self, node: u64) -> Result<LinkStats> {
        let proxy = self.proxy()?;
        let mut total = LinkStats::default();
        for other in self.cluster.all_node_ids().into_iter().filter(|o| *o != node) {
            for s in [proxy.stats(node, other), proxy.stats(other, node)] {
                total.bytes_blackholed += s.bytes_blackholed;
                total.connections_refused += s.connections_refused;
                total.connections_reset += s.connections_reset;
            }
        }
        Ok(total)
    }

    /// Cuts `node` off from every peer (`fault` both ways) for `duration` while clients still
    /// reach it over HTTP; evidence: the proxy refused, reset or discarded its traffic and
    /// another node took over a partition it led (the node stays cut off until that is seen,
    /// up to [`EVIDENCE_WAIT`], also past `duration`).
    pub async fn isolate(&mut self, node: u64, fault: Fault, duration: Duration) -> Result<()> {
        let layout = self.layout(&[]).await;
        let led = Self::led_by(&layout, node);
        let before = self.link_stats(node)?;
        self.proxy()?.isolate(node, fault);
        self.note(
            EventKind::Fault,
            format!("isolate node {node} from its peers ({fault:?}) for {duration:?}, longer until another node is elected; it leads {led:?}"),
            None,
        );
        let index = self.events.len() - 1;
        let started = Instant::now();
        let elected = self.wait_for_new_leader(node, &led, &[node], duration.max(EVIDENCE_WAIT)).await;
        self.hold(duration.saturating_sub(started.elapsed())).await?;
        let after = self.link_stats(node)?;
        let blocked = (after.bytes_blackholed - before.bytes_blackholed)
            + (after.connections_refused - before.connections_refused)
            + (after.connections_reset - before.connections_reset);
        match elected {
            Ok(text) if blocked > 0 => {
                self.confirm(index, true, format!("{text}; proxy blocked {blocked} (bytes + connections)"))
            }
            Ok(_) => self.confirm(index, false, "the proxy blocked nothing".into()),
            Err(text) => self.confirm(index, false, text),
        }
        self.heal()
    }

    pub fn heal(&mut self) -> Result<()> {
        self.proxy()?.heal();
        self.note(EventKind::Heal, "every link passes".into(), None);
        Ok(())
    }

    /// For `duration`, every 2 to 4 s, gives each directed link a random fault: pass, delay
    /// with jitter, 50% loss, a one-way blackhole or a cut; then heals. Evidence: the proxy
    /// delayed, lost and blocked traffic.
    pub async fn flaky(&mut self, duration: Duration) -> Result<()> {
        let before = self.proxy()?.total_stats();
        let started = Instant::now();
        let ids = self.cluster.all_node_ids();
        let mut first = None;
        for _ in 0..1000 {
            if started.elapsed() >= duration {
                break;
            }
            self.proxy()?.heal();
            let mut shown = Vec::new();
            for &a in &ids {
                for &b in ids.iter().filter(|b| **b != a) {
                    let fault = match self.rng.random_range(0..100) {
                        0..35 => Fault::Pass,
                        35..60 => Fault::Delay { base_ms: 40, jitter_ms: 40 },
                        60..85 => Fault::Drop { percent: 50 },
                        85..95 => Fault::Blackhole,
                        _ => Fault::Cut,
                    };
                    if fault != Fault::Pass {
                        self.proxy()?.set(a, b, fault);
                        shown.push(format!("{a}->{b} {fault:?}"));
                    }
                }
            }
            self.note(EventKind::Fault, format!("flaky links: {}", shown.join(", ")), None);
            first.get_or_insert(self.events.len() - 1);
            let step = self.random_duration(Duration::from_secs(2), Duration::from_secs(4));
            self.hold(step.min(duration.saturating_sub(started.elapsed()))).await?;
        }
        let after = self.proxy()?.total_stats();
        let lost = after.chunks_lost - before.chunks_lost;
        let delayed = after.chunks_delayed - before.chunks_delayed;
        let blocked = (after.bytes_blackholed - before.bytes_blackholed)
            + (after.connections_refused - before.connections_refused)
            + (after.connections_reset - before.connections_reset);
        if let Some(index) = first {
            self.confirm(
                index,
                lost > 0 && delayed > 0 && blocked > 0,
                format!("{lost} chunks lost, {delayed} delayed, {blocked} blocked"),
            );
        }
        self.heal()
    }

    // ------------------------------------------------------------------ composite faults

    /// Cuts a follower of a partition off until the leader has snapshotted and purged its
    /// Raft log well past it, heals, waits for it to catch up by snapshot, then kills the
    /// partition's leader. Evidence: the follower logged a snapshot install after the heal.
    pub async fn snapshot_catchup(&mut self) -> Result<()> {
        let every =
            self.snapshot_every.ok_or_else(|| Error::Check("snapshot catch-up needs --snapshot-every".into()))?;
        let partition = self.rng.random_range(0..self.partitions);
        let pick = self.rng.random_range(0..64usize);
        let leader = self
            .leader_of(partition, Duration::from_secs(20))
            .await
            .ok_or_else(|| Error::Check(format!("partition {partition} has no leader")))?;
        let layout = self.layout(&[]).await;
        let followers: Vec<u64> = layout
            .get(&partition)
            .map(|(_, r, _)| r.iter().copied().filter(|n| *n != leader).collect())
            .unwrap_or_default();
        let follower = *followers
            .get(pick % followers.len().max(1))
            .ok_or_else(|| Error::Check(format!("partition {partition} has no follower")))?;
        let installs_before = count_in_log(self.cluster.log_path(follower), SNAPSHOT_INSTALLED);
        let hw_before = self.high_watermark(partition, &[follower]).await.unwrap_or(0);
        let needed = hw_before + 4 * every;
        self.proxy()?.isolate(follower, Fault::Cut);
        self.note(
            EventKind::Fault,
            format!(
                "cut node {follower} (a follower of partition {partition}) off until its high watermark passes {needed}"
            ),
            None,
        );
        let index = self.events.len() - 1;
        let until = Instant::now() + Duration::from_secs(60);
        while Instant::now() < until && self.high_watermark(partition, &[follower]).await.unwrap_or(0) < needed {
            self.hold(Duration::from_millis(500)).await?;
        }
        self.heal()?;
        let caught_up_until = Instant::now() + Duration::from_secs(40);
        let mut installs = installs_before;
        while Instant::now() < caught_up_until {
            installs = count_in_log(self.cluster.log_path(follower), SNAPSHOT_INSTALLED);
            if installs > installs_before {
                break;
            }
            self.hold(Duration::from_millis(500)).await?;
        }
        let ok = installs > installs_before;
        self.confirm(
            index,
            ok,
            format!("node {follower} logged {} snapshot installs after the heal", installs - installs_before),
        );
        let leader = self.leader_of(partition, Duration::from_secs(20)).await.unwrap_or(leader);
        self.kill(leader, &format!("leader of partition {partition}, after the catch-up"))?;
        let down = self.random_duration(Duration::from_secs(2), Duration::from_secs(4));
        self.hold(down).await?;
        self.restart(leader).await
    }

    async fn high_watermark(&self, partition: u32, avoid: &[u64]) -> Option<u64> {
        for id in self.responsive().into_iter().filter(|id| !avoid.contains(id)) {
            if let Ok(Ok(reply)) = tokio::time::timeout(
                Duration::from_secs(3),
                self.cluster.api().describe(&self.cluster.url(id), &self.topic),
            )
            .await
                && reply.status == 200
                && let Ok(d) = reply.decode::<crate::client::TopicDescription>()
            {
                return d.partition(partition).ok().map(|p| p.high_watermark);
            }
        }
        None
    }

    /// Moves `partition` to `target` and kills `victim` 0 to 300 ms later (a kill mid-move),
    /// then restarts it and waits for the move to finish. Evidence: the move finished with the
    /// target replicas, and (when `mid_move_required`) it was still in progress at the kill.
    pub async fn move_with_kill(
        &mut self,
        partition: u32,
        target: Vec<u64>,
        victim: Victim,
        mid_move_required: bool,
    ) -> Result<()> {
        // A node that gains or loses the replica starts new client sessions: its next follower
        // reads come from another replica (a fresh one may be behind the one it replaces).
        let before: Vec<u64> = self.layout(&[]).await.get(&partition).map(|(_, r, _)| r.clone()).unwrap_or_default();
        let changed: Vec<u64> =
            before.iter().chain(&target).copied().filter(|n| before.contains(n) != target.contains(n)).collect();
        for node in &changed {
            self.state.bump_epoch(*node);
        }
        let body = serde_json::json!({ "replicas": target });
        let url =
            format!("{}/topics/{}/partitions/{partition}/replicas", self.cluster.url(self.responsive()[0]), self.topic);
        let reply =
            self.cluster.api().request(reqwest::Method::PUT, &url, Some(crate::client::Body::Json(body))).await?;
        if !matches!(reply.status, 200 | 202) {
            return Err(Error::Check(format!("the move was refused: {}", reply.summary())));
        }
        self.note(EventKind::Fault, format!("move partition {partition} to nodes {target:?}"), None);
        let index = self.events.len() - 1;
        // Moves finish in tens of milliseconds on an idle cluster: kill within
        // the first 20 ms so the kill lands mid-move (C5 requires it).
        let delay = self.random_duration(Duration::ZERO, Duration::from_millis(20));
        tokio::time::sleep(delay).await;
        let layout = self.layout(&[]).await;
        // Mid-move: not yet finished (in progress, or not even visible in this node's copy of
        // the controller state yet).
        let moving = layout.get(&partition).is_some_and(|(_, replicas, in_progress)| {
            let mut now = replicas.clone();
            now.sort_unstable();
            let mut wanted = target.clone();
            wanted.sort_unstable();
            *in_progress || now != wanted
        });
        let victim = match victim {
            Victim::Leader => layout.get(&partition).and_then(|(l, _, _)| *l).unwrap_or(target[0]),
            Victim::Node(id) => id,
        };
        self.kill(victim, &format!("mid-move of partition {partition}"))?;
        let down = self.random_duration(Duration::from_secs(2), Duration::from_secs(4));
        self.hold(down).await?;
        self.restart(victim).await?;
        let until = Instant::now() + MOVE_TIMEOUT;
        let mut wanted = target.clone();
        wanted.sort_unstable();
        let mut last = String::new();
        while Instant::now() < until {
            let layout = self.layout(&[]).await;
            if let Some((_, replicas, in_progress)) = layout.get(&partition) {
                let mut now = replicas.clone();
                now.sort_unstable();
                if now == wanted && !in_progress {
                    for node in &changed {
                        self.state.bump_epoch(*node);
                    }
                    self.confirm(
                        index,
                        moving || !mid_move_required,
                        format!("move in progress at the kill: {moving}; finished with replicas {now:?}"),
                    );
                    return Ok(());
                }
                last = format!("replicas {replicas:?}, in progress {in_progress}");
            }
            self.hold(Duration::from_millis(500)).await?;
        }
        self.confirm(index, false, format!("the move did not finish within {MOVE_TIMEOUT:?}: {last}"));
        Ok(())
    }
}

/// Whom a mid-move kill hits.
#[derive(Clone, Copy, Debug)]
pub enum Victim {
    /// The partition's leader at that moment (the node driving the move).
    Leader,
    Node(u64),
}

fn count_in_log(path: &std::path::Path, needle: &str) -> usize {
    std::fs::read(path).map(|bytes| String::from_utf8_lossy(&bytes).matches(needle).count()).unwrap_or(0)
}
