//! Chaos suite, no faults: the workload and every checker on a healthy 3-node cluster behind
//! the fault proxy (all links passing). A failure here is a checker or server bug that needs
//! no fault at all.

use logdex_cluster_tests::Result;
use logdex_cluster_tests::chaos::scenario::Faults;
use logdex_cluster_tests::chaos::scenario::Scenario;
use logdex_cluster_tests::chaos::scenario::run;

/// 8 clients for 30 s over 4 partitions of 3 replicas; C1-C5 hold.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chaos_baseline_history_is_consistent_without_faults() -> Result<()> {
    run(Scenario::ci("baseline", Faults::None)).await
}
