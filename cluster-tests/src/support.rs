//! Bounded polling, transient-failure retries, the random seed of a test, and runs of the
//! logdex command line.

use std::future::Future;
use std::time::Duration;
use std::time::Instant;

use rand::SeedableRng;
use rand::rngs::StdRng;

use crate::client::Reply;
use crate::error::Error;
use crate::error::Result;

/// Runs the logdex binary with `args` and `input` on its stdin to its end, within `timeout`
/// (killed after it), without `LOGDEX_URL` from the test's environment; returns (success,
/// stdout, stderr).
pub async fn run_logdex(args: &[&str], input: &str, timeout: Duration) -> Result<(bool, String, String)> {
    use std::process::Stdio;
    use tokio::io::AsyncWriteExt;
    let mut command = tokio::process::Command::new(crate::cluster::binary_path()?);
    command.args(args).env_remove("LOGDEX_URL").kill_on_drop(true);
    command.stdin(Stdio::piped()).stdout(Stdio::piped()).stderr(Stdio::piped());
    let mut child = command.spawn().map_err(|e| Error::io(format!("running logdex {args:?}"), e))?;
    let mut stdin = child.stdin.take().ok_or_else(|| Error::Check("logdex's stdin is not piped".into()))?;
    stdin.write_all(input.as_bytes()).await.map_err(|e| Error::io("writing logdex's stdin", e))?;
    drop(stdin);
    let out = tokio::time::timeout(timeout, child.wait_with_output())
        .await
        .map_err(|_| Error::Check(format!("logdex {args:?} ran over {timeout:?}")))?
        .map_err(|e| Error::io(format!("running logdex {args:?}"), e))?;
    let text = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
    Ok((out.status.success(), text(&out.stdout), text(&out.stderr)))
}

/// The environment variable that replays a randomized test.
pub const SEED_ENV: &str = "LOGDEX_TEST_SEED";

/// The seed of a randomized test: `LOGDEX_TEST_SEED` if set, else a fresh one. Printed (the
/// test runner shows it when the test fails) so that any failure replays.
pub fn test_rng(test: &str) -> Result<(u64, StdRng)> {
    let seed = seed_from_env(SEED_ENV)?;
    eprintln!("[{test}] seed {seed} (replay with {SEED_ENV}={seed})");
    Ok((seed, StdRng::seed_from_u64(seed)))
}

/// What a probe of [`poll_until`] saw.
pub enum Probe<T> {
    Ready(T),
    /// Not yet; the text describes what was seen, for the timeout message.
    NotYet(String),
}

/// Calls `probe` every `interval` until it is `Ready`, fails (a fatal `Err`), or `timeout`
/// passes; bounded both by the deadline and by a count of attempts.
pub async fn poll_until<T, F, Fut>(what: &str, timeout: Duration, interval: Duration, mut probe: F) -> Result<T>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<Probe<T>>>,
{
    let started = Instant::now();
    let attempts_max = timeout.as_millis() / interval.as_millis().max(1) + 2;
    let mut last = String::from("no attempt made");
    for _ in 0..attempts_max {
        match probe().await? {
            Probe::Ready(value) => return Ok(value),
            Probe::NotYet(seen) => last = seen,
        }
        if started.elapsed() >= timeout {
            break;
        }
        tokio::time::sleep(interval).await;
    }
    Err(Error::Timeout { what: what.to_string(), waited_ms: started.elapsed().as_millis(), last })
}

/// Status codes the design allows while the cluster settles (no leader, not caught up, timeout).
pub fn is_transient_status(status: u16) -> bool {
    matches!(status, 502..=504)
}

/// Sends a request until it gets an answer that is not transient (a 502/503/504 or no HTTP
/// answer at all), within `timeout`; returns that answer.
pub async fn settled<F, Fut>(what: &str, timeout: Duration, mut send: F) -> Result<Reply>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<Reply>>,
{
    poll_until(what, timeout, Duration::from_millis(200), || {
        let attempt = send();
        async move {
            match attempt.await {
                Ok(reply) if is_transient_status(reply.status) => Ok(Probe::NotYet(reply.summary())),
                Ok(reply) => Ok(Probe::Ready(reply)),
                Err(e) if e.is_transport() => Ok(Probe::NotYet(e.to_string())),
                Err(e) => Err(e),
            }
        }
    })
    .await
}

/// Collects failures of many independent checks, so one report shows how widespread a fault is.
#[derive(Default)]
pub struct Failures {
    count: usize,
    first: Vec<String>,
}

impl Failures {
    const SHOWN_MAX: usize = 8;

    pub fn add(&mut self, failure: impl Into<String>) {
        self.count += 1;
        if self.first.len() < Self::SHOWN_MAX {
            self.first.push(failure.into());
        }
    }

    pub fn record<T>(&mut self, result: Result<T>) -> Option<T> {
        match result {
            Ok(value) => Some(value),
            Err(e) => {
                self.add(e.to_string());
                None
            }
        }
    }

    /// `Ok` when nothing failed, else one `Check` error listing the first failures.
    pub fn into_result(self, checked: usize, what: &str) -> Result<()> {
        if self.count == 0 {
            return Ok(());
        }
        Err(Error::Check(format!(
            "{} of {checked} {what} failed; the first {}:\n  - {}",
            self.count,
            self.first.len(),
            self.first.join("\n  - ")
        )))
    }
}

/// The seed in environment variable `var` if set (an error if it is not a
/// number), else a fresh random one.
pub fn seed_from_env(var: &str) -> Result<u64> {
    match std::env::var(var) {
        Ok(text) => {
            text.trim().parse::<u64>().map_err(|_| Error::Check(format!("{var}={text:?} is not an unsigned integer")))
        }
        Err(_) => Ok(rand::random::<u64>()),
    }
}
