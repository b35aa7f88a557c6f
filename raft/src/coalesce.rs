//! Coalesces concurrent read-index requests into one fetch.
//!
//! A follower's linearizable read needs a read index from its group's leader.
//! Concurrent reads of the groups that one node leads share one fetch: a
//! `ReadIndexBatch` call naming each group once. On the leader, concurrent reads
//! of one group (its own and those its followers asked for) share one read
//! linearizer from openraft, one message to the group's Raft core.
//!
//! To ensure correctness (linearizable reads): a caller is answered only by a
//! fetch that *started after it arrived*. A caller that finds no round running
//! leads one itself, inline (no task hand-off on the single-client path): it
//! first yields to the tasks that are ready to run, while that brings more
//! callers (at most [`GATHER_YIELDS_MAX`] times), then fetches once for itself
//! and everyone who queued meanwhile. Callers arriving during the fetch queue;
//! when the round ends, a background task takes everyone queued so far, performs
//! one fetch, answers them all, and repeats until nobody waits.
//!
//! The yield matters as it does for writes (`batcher.rs`): one poll of the
//! sockets makes several requests readable, and the first one parsed would
//! otherwise start its fetch before the others had arrived.

use std::sync::Arc;
use std::sync::Mutex;

use futures::future::BoxFuture;
use tokio::sync::oneshot;

use crate::error::Error;
use crate::error::Result;

/// One fetch: an answer (a read index) for each query, in their order.
pub type Fetch<Q, A = u64> = Arc<dyn Fn(Vec<Q>) -> BoxFuture<'static, Vec<Result<A>>> + Send + Sync>;

type Waiter<A> = oneshot::Sender<Result<A>>;

/// Most times a round's leader yields to other ready tasks before its fetch.
const GATHER_YIELDS_MAX: usize = 4;

pub struct Coalescer<Q, A = u64> {
    state: Arc<Mutex<State<Q, A>>>,
}

impl<Q, A> Default for Coalescer<Q, A> {
    fn default() -> Self {
        Coalescer { state: Arc::new(Mutex::new(State { running: false, waiting: Vec::new() })) }
    }
}

struct State<Q, A> {
    running: bool,
    waiting: Vec<(Q, Waiter<A>)>,
}

fn lock<Q, A>(state: &Mutex<State<Q, A>>) -> std::sync::MutexGuard<'_, State<Q, A>> {
    state.lock().unwrap_or_else(|e| e.into_inner())
}

/// Hands each waiter its result, in order; a fetch that answered fewer is an error.
fn answer<A>(waiters: impl Iterator<Item = Waiter<A>>, results: &mut impl Iterator<Item = Result<A>>) {
    for waiter in waiters {
        let result = results
            .next()
            .unwrap_or_else(|| Err(Error::unavailable("read index fetch answered fewer queries than it was asked")));
        let _ = waiter.send(result);
    }
}

impl<Q: Clone + Send + 'static, A: Send + 'static> Coalescer<Q, A> {
    /// The answer to `query`, obtained by a fetch that started after this call.
    pub async fn get(&self, query: Q, fetch: Fetch<Q, A>) -> Result<A> {
        let (tx, rx) = oneshot::channel();
        let lead = {
            let mut st = lock(&self.state);
            if st.running {
                st.waiting.push((query.clone(), tx));
                false
            } else {
                st.running = true;
                true
            }
        };
        if lead {
            // The round is this caller's own. The guard hands the callers that queued to a
            // background round when it ends, also if this future is dropped before it
            // answered them.
            let mut round = Handover { state: self.state.clone(), fetch: fetch.clone(), joined: Vec::new() };
            let mut queued = 0;
            for _ in 0..GATHER_YIELDS_MAX {
                tokio::task::yield_now().await;
                let now = lock(&self.state).waiting.len();
                if now == queued {
                    break;
                }
                queued = now;
            }
            // Everyone queued so far arrived before the fetch starts: it answers them too.
            round.joined = std::mem::take(&mut lock(&self.state).waiting);
            let queries = std::iter::once(query).chain(round.joined.iter().map(|(q, _)| q.clone())).collect();
            let mut results = fetch(queries).await.into_iter();
            let mine = results.next().unwrap_or_else(|| Err(Error::unavailable("read index fetch answered nothing")));
            answer(round.joined.drain(..).map(|(_, waiter)| waiter), &mut results);
            return mine;
        }
        match rx.await {
            Ok(answer) => answer,
            Err(_) => Err(Error::unavailable("read index round ended without an answer")),
        }
    }
}

/// Ends an inline round: starts background rounds for the callers that queued
/// during it (and for the ones it took but did not answer, when it was dropped),
/// or marks the coalescer idle.
struct Handover<Q: Clone + Send + 'static, A: Send + 'static> {
    state: Arc<Mutex<State<Q, A>>>,
    fetch: Fetch<Q, A>,
    joined: Vec<(Q, Waiter<A>)>,
}

impl<Q: Clone + Send + 'static, A: Send + 'static> Drop for Handover<Q, A> {
    fn drop(&mut self) {
        let mut st = lock(&self.state);
        // Callers taken by a round dropped mid-fetch are answered by a later fetch,
        // which starts after they arrived, as every answer must.
        st.waiting.append(&mut self.joined);
        if st.waiting.is_empty() {
            st.running = false;
            return;
        }
        // Dropped outside a runtime (its shutdown): no round can run; the queued callers'
        // answers are dropped, which they see as an error, never as a read index.
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            st.running = false;
            st.waiting.clear();
            return;
        };
        drop(st);
        runtime.spawn(run_rounds(self.state.clone(), self.fetch.clone()));
    }
}

async fn run_rounds<Q: Clone + Send + 'static, A: Send + 'static>(state: Arc<Mutex<State<Q, A>>>, fetch: Fetch<Q, A>) {
    loop {
        let round = {
            let mut st = lock(&state);
            if st.waiting.is_empty() {
                st.running = false;
                return;
            }
            std::mem::take(&mut st.waiting)
        };
        let (queries, waiters): (Vec<Q>, Vec<Waiter<A>>) = round.into_iter().unzip();
        let mut results = fetch(queries).await.into_iter();
        answer(waiters.into_iter(), &mut results);
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::AtomicU64;
    use std::sync::atomic::Ordering;

    use super::*;

    /// A fetch that answers how many fetches have started, after `delay_ms`; and that count.
    fn counting_fetch(delay_ms: u64) -> (Arc<AtomicU64>, Fetch<u64>) {
        let fetches = Arc::new(AtomicU64::new(0));
        let counter = fetches.clone();
        let fetch: Fetch<u64> = Arc::new(move |queries: Vec<u64>| {
            let counter = counter.clone();
            Box::pin(async move {
                let n = counter.fetch_add(1, Ordering::SeqCst) + 1;
                tokio::time::sleep(std::time::Duration::from_millis(delay_ms)).await;
                queries.iter().map(|_| Ok(n)).collect()
            })
        });
        (fetches, fetch)
    }

    /// Many concurrent callers share few fetches, and every answer comes from
    /// a fetch that started after the caller arrived (fetch n answers n).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn concurrent_callers_share_fetches_that_started_after_them() -> Result<()> {
        let (fetches, fetch) = counting_fetch(5);
        let coalescer = Arc::new(Coalescer::default());
        let mut tasks = Vec::new();
        for _ in 0..64 {
            let c = coalescer.clone();
            let f = fetch.clone();
            let started = fetches.clone();
            tasks.push(tokio::spawn(async move {
                let before = started.load(Ordering::SeqCst);
                let got = c.get(0, f).await?;
                // The answering fetch began after this caller queued.
                assert!(got > before, "answered by fetch {got}, but {before} had started before the call");
                Ok::<_, Error>(())
            }));
        }
        for t in tasks {
            t.await.map_err(Error::unavailable)??;
        }
        let n = fetches.load(Ordering::SeqCst);
        assert!(n < 64, "64 callers needed {n} fetches");
        Ok(())
    }

    /// A caller running a round inline that is dropped mid-fetch (its client went away)
    /// leaves neither the callers queued behind it nor later callers without an answer.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn dropped_round_leader_hands_queued_callers_to_a_new_round() -> Result<()> {
        let (_, fetch) = counting_fetch(30);
        let coalescer = Arc::new(Coalescer::default());
        let (c, f) = (coalescer.clone(), fetch.clone());
        let leader = tokio::spawn(async move { c.get(0, f).await });
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
        let (c, f) = (coalescer.clone(), fetch.clone());
        let queued = tokio::spawn(async move { c.get(0, f).await });
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
        leader.abort();
        let bound = std::time::Duration::from_secs(10);
        let got =
            tokio::time::timeout(bound, queued).await.map_err(Error::unavailable)?.map_err(Error::unavailable)??;
        assert_eq!(got, 2, "the queued caller is answered by a fetch that started after the dropped one");
        let again = tokio::time::timeout(bound, coalescer.get(0, fetch)).await.map_err(Error::unavailable)??;
        assert_eq!(again, 3, "a later caller runs its own round");
        Ok(())
    }

    /// Callers made ready together (one poll of the sockets) share the first fetch:
    /// its leader yields until they have queued, then answers them all.
    #[tokio::test(flavor = "current_thread")]
    async fn callers_ready_together_share_the_first_fetch() -> Result<()> {
        let (fetches, fetch) = counting_fetch(1);
        let coalescer = Arc::new(Coalescer::default());
        let callers: Vec<_> = (0..8)
            .map(|_| {
                let (c, f) = (coalescer.clone(), fetch.clone());
                tokio::spawn(async move { c.get(0, f).await })
            })
            .collect();
        for caller in callers {
            assert_eq!(caller.await.map_err(Error::unavailable)??, 1, "answered by the first fetch");
        }
        assert_eq!(fetches.load(Ordering::SeqCst), 1, "eight callers ready together needed one fetch");
        Ok(())
    }

    /// A round's leader dropped during the fetch that was to answer the callers it
    /// took hands them to a new round, whose fetch starts after them too.
    #[tokio::test(flavor = "current_thread")]
    async fn callers_taken_by_a_dropped_round_are_answered_by_a_new_fetch() -> Result<()> {
        let (fetches, fetch) = counting_fetch(30);
        let coalescer = Arc::new(Coalescer::default());
        let (c, f) = (coalescer.clone(), fetch.clone());
        let leader = tokio::spawn(async move { c.get(0, f).await });
        let taken: Vec<_> = (0..3)
            .map(|_| {
                let (c, f) = (coalescer.clone(), fetch.clone());
                tokio::spawn(async move { c.get(0, f).await })
            })
            .collect();
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
        assert_eq!(fetches.load(Ordering::SeqCst), 1, "the leader's fetch is running");
        leader.abort();
        let bound = std::time::Duration::from_secs(10);
        for caller in taken {
            let got = tokio::time::timeout(bound, caller)
                .await
                .map_err(Error::unavailable)?
                .map_err(Error::unavailable)??;
            assert_eq!(got, 2, "answered by the fetch after the dropped one");
        }
        Ok(())
    }

    /// Callers of different queries in one round each get the answer to their own
    /// query, and a fetch that answers too few leaves the rest with an error.
    #[tokio::test(flavor = "current_thread")]
    async fn each_caller_gets_the_answer_to_its_own_query() -> Result<()> {
        let asked = Arc::new(Mutex::new(Vec::new()));
        let seen = asked.clone();
        // Answers query q with q * 10, and leaves the last query unanswered.
        let fetch: Fetch<u64> = Arc::new(move |queries: Vec<u64>| {
            seen.lock().expect("lock").push(queries.clone());
            Box::pin(async move { queries.iter().take(queries.len() - 1).map(|q| Ok(q * 10)).collect() })
        });
        let coalescer = Arc::new(Coalescer::default());
        let callers: Vec<_> = (1..=4u64)
            .map(|q| {
                let (c, f) = (coalescer.clone(), fetch.clone());
                tokio::spawn(async move { c.get(q, f).await })
            })
            .collect();
        let mut answers = Vec::new();
        for caller in callers {
            answers.push(caller.await.map_err(Error::unavailable)?.ok());
        }
        assert_eq!(*asked.lock().expect("lock"), vec![vec![1, 2, 3, 4]], "one fetch for the four queries");
        assert_eq!(answers, vec![Some(10), Some(20), Some(30), None]);
        Ok(())
    }

    /// A fetch's error reaches every caller it answers as the same kind, so a read that
    /// shared a leader's "not the leader" answer is still forwarded to the leader it names.
    #[tokio::test(flavor = "current_thread")]
    async fn callers_sharing_a_failed_fetch_each_get_its_error_kind() -> Result<()> {
        let fetch: Fetch<(), u64> = Arc::new(|reads: Vec<()>| {
            Box::pin(
                async move { reads.iter().map(|_| Err(Error::NotLeader { group: 7, leader_node: Some(2) })).collect() },
            )
        });
        let coalescer = Arc::new(Coalescer::default());
        let callers: Vec<_> = (0..4)
            .map(|_| {
                let (c, f) = (coalescer.clone(), fetch.clone());
                tokio::spawn(async move { c.get((), f).await })
            })
            .collect();
        for caller in callers {
            match caller.await.map_err(Error::unavailable)? {
                Err(Error::NotLeader { group: 7, leader_node: Some(2) }) => {}
                other => panic!("expected the fetch's NotLeader, got {other:?}"),
            }
        }
        Ok(())
    }
}
