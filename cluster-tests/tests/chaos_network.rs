//! Chaos suite, pauses and network faults through the proxy (DESIGN.md I1, I6): a deposed or
//! cut-off leader never serves a stale linearizable read, nothing acknowledged is lost.

use logdex_cluster_tests::Result;
use logdex_cluster_tests::chaos::scenario::Faults;
use logdex_cluster_tests::chaos::scenario::Scenario;
use logdex_cluster_tests::chaos::scenario::run;

/// SIGSTOP the node leading the most partitions for three election timeouts, then SIGCONT,
/// twice; C1-C5 hold.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chaos_pause_the_leader() -> Result<()> {
    run(Scenario::ci("pause_leader", Faults::PauseLeader)).await
}

/// Cut the busiest leader off from its peers (connections reset, then blackholed) for 8 s
/// while clients keep sending it reads and writes, twice; C1-C5 hold.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chaos_isolate_the_leader() -> Result<()> {
    run(Scenario::ci("isolate_leader", Faults::IsolateLeader)).await
}

/// Every 2-4 s each directed link gets a random fault (delay 0-80 ms, 50% loss, one-way
/// blackhole, cut) for 32 s; C1-C5 hold.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chaos_flaky_links() -> Result<()> {
    run(Scenario::ci("flaky", Faults::Flaky)).await
}
