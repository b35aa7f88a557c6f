//! Coalesces concurrent read-index requests of one group into one RPC.
//!
//! To ensure correctness (linearizable reads): a caller is answered only by a
//! fetch that *started after it arrived*. Callers queue; a background round
//! takes everyone queued so far, performs one fetch, and answers them all;
//! callers arriving meanwhile wait for the next round.

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
        let start = {
            let mut st = self.state.lock().unwrap_or_else(|e| e.into_inner());
            st.waiting.push(tx);
            !std::mem::replace(&mut st.running, true)
        };
        if start {
            tokio::spawn(run_rounds(self.state.clone(), fetch));
        }
        match rx.await {
            Ok(Ok(index)) => Ok(index),
            Ok(Err(message)) => Err(Error::Unavailable(message)),
            Err(_) => Err(Error::unavailable("read index round ended without an answer")),
        }
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

    /// Many concurrent callers share few fetches, and every answer comes from
    /// a fetch that started after the caller arrived (fetch n answers n).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn concurrent_callers_share_fetches_that_started_after_them() -> Result<()> {
        let fetches = Arc::new(AtomicU64::new(0));
        let counter = fetches.clone();
        let fetch: Fetch = Arc::new(move || {
            let counter = counter.clone();
            Box::pin(async move {
                let n = counter.fetch_add(1, Ordering::SeqCst) + 1;
                tokio::time::sleep(std::time::Duration::from_millis(5)).await;
                Ok(n)
            })
        });
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
}
