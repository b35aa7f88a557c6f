//! Chaos suite, process crashes, power loss and disk damage (DESIGN.md I2, I5): nothing
//! acknowledged is lost, replicas converge, every read stays linearizable or session-consistent,
//! and a damaged replica refuses its damaged data rather than answering it wrong.

use logdex_cluster_tests::Result;
use logdex_cluster_tests::chaos::scenario::Faults;
use logdex_cluster_tests::chaos::scenario::Scenario;
use logdex_cluster_tests::chaos::scenario::run;

/// kill -9 one node every few seconds (the leader of a random partition half the time), down
/// 2-4 s each, for 36 s; C1-C5 hold.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chaos_kill_one_node_repeatedly() -> Result<()> {
    run(Scenario::ci("kill_one", Faults::KillOne)).await
}

/// kill -9 of all three nodes at once, three times, restarting them together; C1-C5 hold.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chaos_kill_all_nodes_three_times() -> Result<()> {
    run(Scenario::ci("kill_all", Faults::KillAll)).await
}

/// Power loss of all three nodes, three times: every file cut back to its last fsync (then
/// with the next page torn, then also one node's index deleted so it rebuilds from the log);
/// C1-C5 hold.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chaos_power_loss_of_all_nodes() -> Result<()> {
    run(Scenario::ci("power_loss", Faults::PowerLoss)).await
}

/// Twice, on two different nodes: kill -9, flip a bit inside a record of a sealed segment and
/// cut the active segment of the same replica inside one of its last batches, restart. C1-C5
/// hold; the damaged replica answers the damaged batch's offsets and keys with 500
/// `corrupt_data` or, if it re-applied them from the Raft log, right, and everything else
/// exactly as the others do (C4); its own log shows it cut the damaged tail (C5).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chaos_bit_flip_and_truncation_on_one_node() -> Result<()> {
    run(Scenario::ci("corruption", Faults::Corruption)).await
}
