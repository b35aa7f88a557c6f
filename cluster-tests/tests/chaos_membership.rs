//! Chaos suite, replicas that arrive later (DESIGN.md I3): by snapshot after the leader purged
//! its log, and by a partition move interrupted by kills. They hold every record and answer
//! every key like the others.

use logdex_cluster_tests::Result;
use logdex_cluster_tests::chaos::scenario::Faults;
use logdex_cluster_tests::chaos::scenario::Scenario;
use logdex_cluster_tests::chaos::scenario::run;

/// With a snapshot every 50 entries, cut a follower off until the leader purged its log far
/// past it, heal (it must install a snapshot), then kill the leader; C1-C5 hold.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chaos_snapshot_catch_up() -> Result<()> {
    run(Scenario::ci("snapshot_catchup", Faults::SnapshotCatchup)).await
}

/// A fourth node joins; one partition moves onto it while its leader is killed mid-move,
/// another while the joining node is killed mid-move; both moves finish; C1-C5 hold.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chaos_partition_move_with_kills() -> Result<()> {
    run(Scenario::ci("partition_move", Faults::PartitionMove)).await
}
