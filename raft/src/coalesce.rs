//! Coalesces concurrent read-index requests of one group into one RPC.
//!
//! To ensure correctness (linearizable reads): a caller is answered only by a
//! fetch that *started after it arrived*. A caller that finds no round running
//! runs one itself, inline (no task hand-off on the single-client path).
//! Callers arriving meanwhile queue; when that round ends, a background task
//! takes everyone queued so far, performs one fetch, answers them all, and
//! repeats until nobody waits.

use std::sync::Arc;
use std::sync::Mutex;

use futures::future::BoxFuture;
use tokio::sync::oneshot;

use crate::error::Error;
use crate::error::Result;

/// One fetch of a read index.
pub type Fetch = Arc<dyn Fn() -> BoxFuture<'static, Result<u64>> + Send + Sync>;

type Waiter = oneshot::Sender<std::result::Result<u64, String>>;

#[derive(Default)]
pub struct Coalescer {
    state: Arc<Mutex<State>>,
}

#[derive(Default)]
struct State {
    running: bool,
    waiting: Vec<Waiter>,
}

impl Coalescer {
    /// A read index obtained by a fetch that started after this call.
    pub async fn get(&self, fetch: Fetch) -> Result<u64> {
        let (tx, rx) = oneshot::channel();
        let lead = {
            let mut st = self.state.lock().unwrap_or_else(|e| e.into_inner());
            if st.running {
                st.waiting.push(tx);
                false
            } else {
                st.running = true;
                true
            }
        };
        if lead {
            // The round is this caller's own: its fetch starts now. The guard hands the
            // callers that queued meanwhile to a background round, also if this future is
            // dropped mid-fetch.
            let _handover = Handover { state: self.state.clone(), fetch: fetch.clone() };
            return fetch().await;
        }
        match rx.await {
            Ok(Ok(index)) => Ok(index),
            Ok(Err(message)) => Err(Error::Unavailable(message)),
            Err(_) => Err(Error::unavailable("read index round ended without an answer")),
        }
    }
}

/// Ends an inline round: starts background rounds for the callers that queued
/// during it, or marks the coalescer idle.
struct Handover {
    state: Arc<Mutex<State>>,
    fetch: Fetch,
}

impl Drop for Handover {
    fn drop(&mut self) {
        let mut st = self.state.lock().unwrap_or_else(|e| e.into_inner());
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

async fn run_rounds(state: Arc<Mutex<State>>, fetch: Fetch) {
    loop {
        let round = {
            let mut st = state.lock().unwrap_or_else(|e| e.into_inner());
            if st.waiting.is_empty() {
                st.running = false;
                return;
            }
            std::mem::take(&mut st.waiting)
        };
        let result = fetch().await.map_err(|e| e.to_string());
        for waiter in round {
            let _ = waiter.send(result.clone());
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::AtomicU64;
    use std::sync::atomic::Ordering;

    use super::*;

    /// A fetch that answers how many fetches have started, after `delay_ms`; and that count.
    fn counting_fetch(delay_ms: u64) -> (Arc<AtomicU64>, Fetch) {
        let fetches = Arc::new(AtomicU64::new(0));
        let counter = fetches.clone();
        let fetch: Fetch = Arc::new(move || {
            let counter = counter.clone();
            Box::pin(async move {
                let n = counter.fetch_add(1, Ordering::SeqCst) + 1;
                tokio::time::sleep(std::time::Duration::from_millis(delay_ms)).await;
                Ok(n)
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
                let got = c.get(f).await?;
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
        let leader = tokio::spawn(async move { c.get(f).await });
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
        let (c, f) = (coalescer.clone(), fetch.clone());
        let queued = tokio::spawn(async move { c.get(f).await });
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
        leader.abort();
        let bound = std::time::Duration::from_secs(10);
        let got =
            tokio::time::timeout(bound, queued).await.map_err(Error::unavailable)?.map_err(Error::unavailable)??;
        assert_eq!(got, 2, "the queued caller is answered by a fetch that started after the dropped one");
        let again = tokio::time::timeout(bound, coalescer.get(fetch)).await.map_err(Error::unavailable)??;
        assert_eq!(again, 3, "a later caller runs its own round");
        Ok(())
    }
}
