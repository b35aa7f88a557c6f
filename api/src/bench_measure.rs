//! Measurement shared by `logdex bench` and the NATS peer of `bench-peer/`
//! (which includes this file by path, being kept out of the workspace): the
//! run report, the shared progress counters, the per-client statistics with a
//! log-linear histogram, and the report printer.

use std::io::IsTerminal;
use std::io::Write;
use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::sync::atomic::AtomicU64;
use std::sync::atomic::Ordering;
use std::time::Duration;
use std::time::Instant;

use serde::Deserialize;
use serde::Serialize;

/// One run's result: one JSON line with `--json`. `bench-peer/` prints the same fields.
#[derive(Serialize, Deserialize, Debug, Clone)]
pub struct RunReport {
    pub system: String,
    pub workload: String,
    pub read: Option<String>,
    pub concurrency: usize,
    pub ok: u64,
    pub not_found: u64,
    pub errors: u64,
    pub elapsed_s: f64,
    pub rate_per_s: f64,
    pub p50_us: f64,
    pub p90_us: f64,
    pub p99_us: f64,
    pub p999_us: f64,
    pub max_us: f64,
    pub first_error: Option<String>,
    /// `grpc` for a run over the gRPC client API; absent for HTTP.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub protocol: Option<String>,
    /// `leader` when each request went to its key's partition leader (`--route leader`); absent
    /// when requests rotated over the nodes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub route: Option<String>,
}

pub struct Shared {
    pub next: AtomicU64,
    pub done: AtomicU64,
    pub stop: AtomicBool,
}

/// A progress line on stderr, only when stderr is a terminal.
pub fn progress_task(
    shared: Arc<Shared>,
    name: String,
    requests: Option<u64>,
    duration: Duration,
    start: Instant,
) -> Option<tokio::task::JoinHandle<()>> {
    if !std::io::stderr().is_terminal() {
        return None;
    }
    Some(tokio::spawn(async move {
        let mut tick = tokio::time::interval(Duration::from_millis(250));
        while !shared.stop.load(Ordering::Relaxed) {
            tick.tick().await;
            let done = shared.done.load(Ordering::Relaxed);
            let secs = start.elapsed().as_secs_f64();
            let of = requests.map(|r| format!("/{r}")).unwrap_or_default();
            let mut err = std::io::stderr().lock();
            let _ = write!(
                err,
                "\r\x1b[2K{name}: {done}{of} requests, {:.0}/s, {secs:.1}/{} s",
                done as f64 / secs.max(1e-9),
                duration.as_secs()
            );
            let _ = err.flush();
        }
        let _ = write!(std::io::stderr().lock(), "\r\x1b[2K");
    }))
}

// ---------------------------------------------------------------- statistics

#[derive(Default)]
pub struct Stats {
    pub ok: u64,
    pub not_found: u64,
    pub errors: u64,
    pub first_error: Option<String>,
    pub latency: Histogram,
}

/// How one request ended.
pub enum Outcome {
    Ok,
    /// A lookup of a key that is not there (timed, as a hit is).
    NotFound,
    Error(String),
}

impl Stats {
    /// Counts a request that ended with `outcome` after `latency` (an error is not timed).
    pub fn record(&mut self, outcome: Outcome, latency: Duration) {
        match outcome {
            Outcome::Ok => self.ok += 1,
            Outcome::NotFound => self.not_found += 1,
            Outcome::Error(e) => return self.error(e),
        }
        self.latency.record(latency);
    }

    pub fn error(&mut self, e: String) {
        self.errors += 1;
        self.first_error.get_or_insert(e);
    }

    pub fn merge(&mut self, other: Stats) {
        self.ok += other.ok;
        self.not_found += other.not_found;
        self.errors += other.errors;
        if self.first_error.is_none() {
            self.first_error = other.first_error;
        }
        self.latency.merge(&other.latency);
    }

    pub fn report(
        &self,
        system: &str,
        workload: &str,
        read: Option<String>,
        concurrency: usize,
        elapsed: Duration,
    ) -> RunReport {
        let us = |q: f64| self.latency.quantile_ns(q) as f64 / 1000.0;
        let secs = elapsed.as_secs_f64();
        RunReport {
            system: system.to_string(),
            workload: workload.to_string(),
            read,
            concurrency,
            ok: self.ok,
            not_found: self.not_found,
            errors: self.errors,
            elapsed_s: secs,
            rate_per_s: (self.ok + self.not_found) as f64 / secs.max(1e-9),
            p50_us: us(0.5),
            p90_us: us(0.9),
            p99_us: us(0.99),
            p999_us: us(0.999),
            max_us: self.latency.max_ns as f64 / 1000.0,
            first_error: self.first_error.clone(),
            protocol: None,
            route: None,
        }
    }
}

/// Log-linear histogram of nanoseconds, as HDR histograms do: values below
/// 2^SUB_BITS are exact, larger ones keep SUB_BITS significant bits (a
/// bucket is at most 0.2% wide). Fixed size; values above about 2^40 ns (18 minutes)
/// land in the last bucket.
pub struct Histogram {
    counts: Vec<u64>,
    total: u64,
    max_ns: u64,
}

const SUB_BITS: u32 = 10;
const HALF: usize = 1 << (SUB_BITS - 1);
const SHIFT_MAX: u32 = 32;

impl Default for Histogram {
    fn default() -> Histogram {
        Histogram { counts: vec![0; (SHIFT_MAX as usize + 2) * HALF], total: 0, max_ns: 0 }
    }
}

impl Histogram {
    pub fn record(&mut self, d: Duration) {
        let ns = u64::try_from(d.as_nanos()).unwrap_or(u64::MAX);
        let i = Self::index(ns).min(self.counts.len() - 1);
        self.counts[i] += 1;
        self.total += 1;
        self.max_ns = self.max_ns.max(ns);
    }

    pub fn index(v: u64) -> usize {
        if v < (1 << SUB_BITS) {
            return v as usize;
        }
        let shift = 64 - v.leading_zeros() - SUB_BITS;
        (shift as usize) * HALF + (v >> shift) as usize
    }

    /// The highest value that falls into bucket `i`.
    pub fn highest(i: usize) -> u64 {
        if i < (1 << SUB_BITS) {
            return i as u64;
        }
        let shift = (i / HALF - 1) as u32;
        let mantissa = (i - shift as usize * HALF) as u64;
        ((mantissa + 1) << shift) - 1
    }

    pub fn merge(&mut self, other: &Histogram) {
        for (a, b) in self.counts.iter_mut().zip(&other.counts) {
            *a += b;
        }
        self.total += other.total;
        self.max_ns = self.max_ns.max(other.max_ns);
    }

    pub fn quantile_ns(&self, q: f64) -> u64 {
        if self.total == 0 {
            return 0;
        }
        let rank = ((q * self.total as f64).ceil() as u64).clamp(1, self.total);
        let mut seen = 0;
        for (i, c) in self.counts.iter().enumerate() {
            seen += c;
            if seen >= rank {
                return Self::highest(i).min(self.max_ns);
            }
        }
        self.max_ns
    }
}

pub fn print_report(r: &RunReport, json: bool) -> Result<(), String> {
    let mut out = std::io::stdout().lock();
    let line = if json {
        serde_json::to_string(r).map_err(|e| format!("cannot encode the report: {e}"))?
    } else {
        let read = r.read.as_deref().map(|m| format!(" read={m}")).unwrap_or_default();
        let read = match &r.protocol {
            Some(p) => format!("{read} protocol={p}"),
            None => read,
        };
        let read = match &r.route {
            Some(route) => format!("{read} route={route}"),
            None => read,
        };
        let error = r.first_error.as_deref().map(|e| format!(" (first error: {e})")).unwrap_or_default();
        format!(
            "{} {}{read} c={}: {} ok, {} not found, {} errors in {:.2} s = {:.0}/s; latency us p50 {:.0} p90 {:.0} \
             p99 {:.0} p99.9 {:.0} max {:.0}{error}",
            r.system,
            r.workload,
            r.concurrency,
            r.ok,
            r.not_found,
            r.errors,
            r.elapsed_s,
            r.rate_per_s,
            r.p50_us,
            r.p90_us,
            r.p99_us,
            r.p999_us,
            r.max_us
        )
    };
    writeln!(out, "{line}").map_err(|e| format!("cannot write the report: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every value falls into a bucket whose highest value is at most 0.2% above it.
    #[test]
    fn histogram_buckets_are_contiguous_and_precise() {
        for v in [0u64, 1, 1023, 1024, 1025, 1535, 1536, 4096, 123_456, 10_000_000, 1 << 40] {
            let i = Histogram::index(v);
            let high = Histogram::highest(i);
            assert!(high >= v, "{v} -> bucket {i} highest {high}");
            assert!((high - v) as f64 <= v as f64 / 500.0 + 1.0, "{v} -> {high}");
            if i > 0 {
                assert!(Histogram::highest(i - 1) < v, "{v} also fits bucket {}", i - 1);
            }
        }
    }

    /// Quantiles of 1..=1000 microseconds come out within 0.2%.
    #[test]
    fn histogram_quantiles_match_sorted_values() {
        let mut h = Histogram::default();
        for us in 1..=1000u64 {
            h.record(Duration::from_micros(us));
        }
        let p50 = h.quantile_ns(0.5) as f64 / 1000.0;
        let p99 = h.quantile_ns(0.99) as f64 / 1000.0;
        assert!((p50 - 500.0).abs() <= 0.5, "p50 {p50}");
        assert!((p99 - 990.0).abs() <= 1.0, "p99 {p99}");
        assert_eq!(h.quantile_ns(1.0), 1_000_000);
    }
}
