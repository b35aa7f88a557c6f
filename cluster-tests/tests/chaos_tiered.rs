//! Chaos suite with tiered storage: the chaos topic copies its 2 KiB segments to the shared
//! object store and every replica deletes its local copies at once, so fetches, lookups and the
//! checkers' final logs read mostly remote segments. Nothing acknowledged is lost, replicas
//! converge, reads stay linearizable or session-consistent, under crashes of the nodes that
//! copy and trim.

use logdex_cluster_tests::Result;
use logdex_cluster_tests::chaos::scenario::Faults;
use logdex_cluster_tests::chaos::scenario::Scenario;
use logdex_cluster_tests::chaos::scenario::run;

/// kill -9 one node every few seconds (the leader of a random partition half the time, the
/// node that copies its segments), down 2-4 s each, for 36 s; C1-C5 hold, and every node
/// holds remote segments at the end.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chaos_kill_one_node_repeatedly_with_tiered_storage() -> Result<()> {
    run(Scenario::ci_tiered("kill_one_tiered", Faults::KillOne)).await
}

/// kill -9 of all three nodes at once, three times; C1-C5 hold with tiered storage.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chaos_kill_all_nodes_three_times_with_tiered_storage() -> Result<()> {
    run(Scenario::ci_tiered("kill_all_tiered", Faults::KillAll)).await
}

/// Power loss of all three nodes, three times (files cut back to their last fsync, then with
/// torn pages, then one node's index deleted so it rebuilds, reading the remote segments);
/// C1-C5 hold with tiered storage.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chaos_power_loss_of_all_nodes_with_tiered_storage() -> Result<()> {
    run(Scenario::ci_tiered("power_loss_tiered", Faults::PowerLoss)).await
}
