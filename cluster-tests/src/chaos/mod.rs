//! The chaos suite: a workload of clients, a nemesis of faults, and checkers, in the manner of
//! Jepsen and etcd's robustness tests, sized for CI on 2 cores.
//!
//! - [`op`]: one client operation and the classification of failures (definite or
//!   indeterminate).
//! - [`workload`]: 8 clients at a bounded rate: puts, deletes, batch produces, linearizable,
//!   strict and follower lookups, lookups with `min_offset`, sequential fetches.
//! - [`nemesis`]: kills, power loss, pauses, network faults through the proxy, snapshot
//!   catch-up, partition moves; each fault recorded with evidence.
//! - [`checker`]: C1 log, C2 linearizable key reads, C3 sessions (pure functions of the
//!   history and the final logs, with self-tests).
//! - [`wgl`]: C2x, a Wing-Gong/Lowe linearizability search over sampled keys (`porcupine-rs`),
//!   a cross-check of C2 from the history alone.
//! - [`converge`]: C4, every replica holds the same records and answers every key the same.
//! - [`scenario`]: a run from start to verdict, C5 coverage, the report and the artifacts.

pub mod checker;
pub mod converge;
pub mod nemesis;
pub mod op;
pub mod scenario;
pub mod wgl;
pub mod workload;
