//! Preferred-leader balancing: a partition's leadership goes back to its first
//! replica once that replica can take it.
//!
//! Placement spreads the first replicas of a topic's partitions over the nodes
//! (`controller.rs`), and each group's first replica initializes it, so a new
//! topic's leaders are spread. A node that restarts, or is cut off for an
//! election timeout, loses its leaderships to the other replicas, and nothing
//! gives them back: after a rolling restart the last node restarted leads
//! nothing and the others carry every write. As Kafka's
//! `auto.leader.rebalance.enable` does, every `--leader-balance-interval-secs`
//! each node looks at the replicas it hosts that are their partition's first
//! replica but follow another leader ([`asks_for_leadership`]), and asks the
//! leader's node for the leadership (a `Leadership` call); that node hands it
//! over with openraft's `transfer_leader` when the replica can take it at once
//! ([`hand_to_preferred`]).
//!
//! The preferred replica asks, rather than the leader deciding alone, because
//! only its own node knows whether its data is damaged (the scrub, a refused
//! snapshot): a damaged replica hands its leadership away (`Node::damage_loop`)
//! and never asks for it back, where a leader handing leadership to the first
//! replica regardless would make the two pass it back and forth.
//!
//! To ensure correctness (and availability):
//! - A transfer is only a Raft leadership transfer: the target waits until its
//!   log is flushed up to the leader's last entry, then campaigns; nothing
//!   committed is lost, and writes proposed meanwhile are refused before they
//!   are appended (`ForwardToLeader`, retried by the write path) or committed by
//!   the new leader.
//! - The leader stops taking writes once it has asked for the transfer, so a
//!   target that cannot campaign stalls the group until an election timeout.
//!   The target must therefore be a voter of a settled membership (no move in
//!   progress: the move's driver places leadership itself), must have
//!   acknowledged a heartbeat or an append recently, and must hold the log up
//!   to a few entries of the leader's end. The leader checks this on its own
//!   replication state when asked.
//! - A replica that was handed its leadership does not ask again for
//!   [`RETRY_AFTER_INTERVALS`] intervals, so a preferred replica that keeps
//!   losing the leadership (a flaky node) is not given it again and again.

use std::collections::BTreeSet;
use std::time::Duration;

use crate::types::ReplicaId;

/// How far behind the leader's last entry a preferred replica may be and still be handed
/// the leadership (it catches up before it campaigns).
pub const LAG_MAX_ENTRIES: u64 = 64;
/// A preferred replica must have answered within this many heartbeat intervals (and at
/// least [`ACK_FRESH_MIN`]).
pub const ACK_FRESH_HEARTBEATS: u32 = 3;
pub const ACK_FRESH_MIN: Duration = Duration::from_secs(1);
/// Leaderships a node asks for in one pass at most: a node that should lead many groups
/// takes them back over several passes rather than starting every election at once.
pub const ASKS_PER_PASS_MAX: usize = 32;
/// Pause before the next pass when a pass asked for [`ASKS_PER_PASS_MAX`] leaderships.
pub const BACKLOG_PAUSE: Duration = Duration::from_secs(2);
/// A replica handed its leadership does not ask again for this many intervals.
pub const RETRY_AFTER_INTERVALS: u32 = 5;

/// What a node knows of one replica it hosts, for deciding whether it asks for the
/// leadership of its group.
#[derive(Clone, Copy, Debug)]
pub struct ReplicaView {
    /// The replica is the first of its partition's assignment.
    pub preferred: bool,
    /// The partition is moving to other replicas.
    pub moving: bool,
    /// The replica leads its group.
    pub leads: bool,
    /// The replica's data is damaged (the scrub, or a follower refused its snapshot).
    pub damaged: bool,
    /// Another node leads the group, as this replica knows.
    pub leader_elsewhere: bool,
}

/// Whether the replica should ask the leader's node for the leadership now.
pub fn asks_for_leadership(view: ReplicaView) -> bool {
    view.preferred && !view.moving && !view.leads && !view.damaged && view.leader_elsewhere
}

/// What the leader replica of a group knows, for deciding whether to hand its leadership
/// to the preferred replica.
#[derive(Clone, Debug)]
pub struct LeaderView {
    /// This (the leading) replica.
    pub me: ReplicaId,
    /// The first replica of the partition's assignment.
    pub preferred: ReplicaId,
    /// The partition is moving to other replicas.
    pub moving: bool,
    /// Voters of the group's membership, and whether it is a joint one.
    pub voters: BTreeSet<ReplicaId>,
    pub joint: bool,
    /// This replica's last log index.
    pub last_log_index: u64,
    /// The preferred replica's matched log index, as replication knows it.
    pub preferred_matched: Option<u64>,
    /// Time since the preferred replica last acknowledged a heartbeat or an append.
    pub preferred_acked_ago: Option<Duration>,
}

/// Whether the leadership should go to the preferred replica now.
pub fn hand_to_preferred(view: &LeaderView, ack_fresh: Duration) -> bool {
    if view.me == view.preferred || view.moving || view.joint || !view.voters.contains(&view.preferred) {
        return false;
    }
    let fresh = view.preferred_acked_ago.is_some_and(|ago| ago <= ack_fresh);
    let caught_up =
        view.preferred_matched.is_some_and(|matched| matched.saturating_add(LAG_MAX_ENTRIES) >= view.last_log_index);
    fresh && caught_up
}

/// The pause before the next balancing pass, after one that asked for `asked` leaderships:
/// shortly after one that asked for its most (more may be left), else `interval`.
pub fn next_pause(asked: usize, interval: Duration) -> Duration {
    if asked >= ASKS_PER_PASS_MAX { interval.min(BACKLOG_PAUSE) } else { interval }
}

/// How recent a preferred replica's last answer must be, for a heartbeat interval.
pub fn ack_fresh(heartbeat: Duration) -> Duration {
    heartbeat.saturating_mul(ACK_FRESH_HEARTBEATS).max(ACK_FRESH_MIN)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_pass_that_asked_for_its_most_is_followed_shortly_else_after_the_interval() {
        let minute = Duration::from_secs(60);
        assert_eq!(next_pause(ASKS_PER_PASS_MAX, minute), BACKLOG_PAUSE);
        assert_eq!(next_pause(ASKS_PER_PASS_MAX - 1, minute), minute);
        assert_eq!(next_pause(0, minute), minute);
        // An interval shorter than the pause stays the interval.
        assert_eq!(next_pause(ASKS_PER_PASS_MAX, Duration::from_secs(1)), Duration::from_secs(1));
    }

    fn view() -> LeaderView {
        LeaderView {
            me: 2,
            preferred: 1,
            moving: false,
            voters: [1, 2, 3].into_iter().collect(),
            joint: false,
            last_log_index: 1000,
            preferred_matched: Some(1000),
            preferred_acked_ago: Some(Duration::from_millis(200)),
        }
    }

    const FRESH: Duration = Duration::from_secs(1);

    #[test]
    fn a_caught_up_preferred_replica_that_answers_gets_the_leadership() {
        assert!(hand_to_preferred(&view(), FRESH));
        let slightly_behind = LeaderView { preferred_matched: Some(1000 - LAG_MAX_ENTRIES), ..view() };
        assert!(hand_to_preferred(&slightly_behind, FRESH));
    }

    #[test]
    fn the_preferred_replica_itself_keeps_the_leadership() {
        assert!(!hand_to_preferred(&LeaderView { me: 1, ..view() }, FRESH));
    }

    #[test]
    fn a_preferred_replica_that_has_not_answered_lately_is_not_handed_the_leadership() {
        let stale = LeaderView { preferred_acked_ago: Some(Duration::from_millis(1001)), ..view() };
        assert!(!hand_to_preferred(&stale, FRESH));
        let never = LeaderView { preferred_acked_ago: None, ..view() };
        assert!(!hand_to_preferred(&never, FRESH));
    }

    #[test]
    fn a_preferred_replica_far_behind_the_log_is_not_handed_the_leadership() {
        let behind = LeaderView { preferred_matched: Some(1000 - LAG_MAX_ENTRIES - 1), ..view() };
        assert!(!hand_to_preferred(&behind, FRESH));
        let unknown = LeaderView { preferred_matched: None, ..view() };
        assert!(!hand_to_preferred(&unknown, FRESH));
    }

    #[test]
    fn nothing_is_handed_off_while_the_membership_changes_or_the_partition_moves() {
        assert!(!hand_to_preferred(&LeaderView { moving: true, ..view() }, FRESH));
        assert!(!hand_to_preferred(&LeaderView { joint: true, ..view() }, FRESH));
        let not_a_voter = LeaderView { voters: [2, 3, 4].into_iter().collect(), ..view() };
        assert!(!hand_to_preferred(&not_a_voter, FRESH));
    }

    fn replica() -> ReplicaView {
        ReplicaView { preferred: true, moving: false, leads: false, damaged: false, leader_elsewhere: true }
    }

    #[test]
    fn a_healthy_preferred_replica_following_another_node_asks_for_the_leadership() {
        assert!(asks_for_leadership(replica()));
    }

    #[test]
    fn only_a_healthy_preferred_follower_of_a_known_leader_asks() {
        assert!(!asks_for_leadership(ReplicaView { preferred: false, ..replica() }));
        assert!(!asks_for_leadership(ReplicaView { leads: true, ..replica() }));
        assert!(!asks_for_leadership(ReplicaView { damaged: true, ..replica() }), "a damaged replica never asks");
        assert!(!asks_for_leadership(ReplicaView { moving: true, ..replica() }));
        assert!(!asks_for_leadership(ReplicaView { leader_elsewhere: false, ..replica() }));
    }

    #[test]
    fn the_answer_must_be_fresher_than_three_heartbeats_and_never_stricter_than_a_second() {
        assert_eq!(ack_fresh(Duration::from_millis(500)), Duration::from_millis(1500));
        assert_eq!(ack_fresh(Duration::from_millis(100)), ACK_FRESH_MIN);
    }
}
