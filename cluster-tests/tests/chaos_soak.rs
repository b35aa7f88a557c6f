//! Chaos soak: every fault mixed at random on 5 nodes (kills of one, a minority or all nodes,
//! power loss of all or of one node while a minority is paused, pauses, isolation, flaky
//! links, partition moves with kills), snapshots every 200 entries.
//!
//! In CI it runs for one minute. `scripts/chaos.sh --minutes N` sets `LOGDEX_CHAOS_MINUTES`
//! (and optionally `LOGDEX_CHAOS_SCENARIO` to repeat one CI scenario instead) and runs it in
//! rounds of at most 5 minutes, each with its own seed, until the time is up.

use std::time::Duration;
use std::time::Instant;

use logdex_cluster_tests::Error;
use logdex_cluster_tests::Result;
use logdex_cluster_tests::chaos::scenario::Faults;
use logdex_cluster_tests::chaos::scenario::Scenario;
use logdex_cluster_tests::chaos::scenario::chaos_seed;
use logdex_cluster_tests::chaos::scenario::run_seeded;

const MINUTES_ENV: &str = "LOGDEX_CHAOS_MINUTES";
const SCENARIO_ENV: &str = "LOGDEX_CHAOS_SCENARIO";
/// `1`: run every round even after a failed one, and fail at the end listing them.
const KEEP_GOING_ENV: &str = "LOGDEX_CHAOS_KEEP_GOING";
const ROUND_MINUTES_MAX: u64 = 5;

fn named(name: &str) -> Result<Scenario> {
    let faults = match name {
        "baseline" => Faults::None,
        "kill_one" => Faults::KillOne,
        "kill_all" => Faults::KillAll,
        "power_loss" => Faults::PowerLoss,
        "pause_leader" => Faults::PauseLeader,
        "isolate_leader" => Faults::IsolateLeader,
        "flaky" => Faults::Flaky,
        "snapshot_catchup" => Faults::SnapshotCatchup,
        "partition_move" => Faults::PartitionMove,
        "mixed" | "soak" => return Ok(Scenario::soak(ROUND_MINUTES_MAX)),
        other => return Err(Error::Check(format!("{SCENARIO_ENV}={other:?} names no scenario"))),
    };
    Ok(Scenario::ci(name, faults))
}

/// Mixed faults on 5 nodes: one minute in CI, `LOGDEX_CHAOS_MINUTES` in rounds for a soak.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chaos_soak_mixed_faults_on_five_nodes() -> Result<()> {
    let minutes: Option<u64> = match std::env::var(MINUTES_ENV) {
        Ok(text) => {
            Some(text.trim().parse().map_err(|_| Error::Check(format!("{MINUTES_ENV}={text:?} is not a number")))?)
        }
        Err(_) => None,
    };
    let Some(minutes) = minutes else {
        let mut s = Scenario::soak(1);
        s.cooldown = Duration::from_secs(6);
        return logdex_cluster_tests::chaos::scenario::run(s).await;
    };
    let scenario = std::env::var(SCENARIO_ENV).ok().filter(|s| !s.trim().is_empty());
    let first_seed = chaos_seed("soak")?;
    let deadline = Instant::now() + Duration::from_secs(minutes * 60);
    let keep_going = std::env::var(KEEP_GOING_ENV).is_ok_and(|v| v.trim() == "1");
    let mut rounds = 0u64;
    let mut passed = 0u64;
    let mut failed = Vec::new();
    while Instant::now() < deadline && rounds < 10_000 {
        let left_minutes = (deadline - Instant::now()).as_secs().div_ceil(60).clamp(1, ROUND_MINUTES_MAX);
        let mut s = match &scenario {
            Some(name) => named(name)?,
            None => Scenario::soak(left_minutes),
        };
        s.name = format!("{}#{rounds}", s.name);
        let seed = first_seed.wrapping_add(rounds);
        eprintln!("[soak] round {rounds}: {} with seed {seed}, {:?} left", s.name, deadline - Instant::now());
        rounds += 1;
        match run_seeded(s, seed).await {
            Ok(()) => passed += 1,
            Err(e) if keep_going => failed.push(format!("round {} (seed {seed}): {e}", rounds - 1)),
            Err(e) => return Err(e),
        }
    }
    eprintln!("[soak] {passed} of {rounds} rounds passed in {minutes} minutes (first seed {first_seed})");
    if failed.is_empty() {
        Ok(())
    } else {
        Err(Error::Check(format!("{} rounds failed:\n  {}", failed.len(), failed.join("\n  "))))
    }
}
