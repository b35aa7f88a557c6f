//! The one error type of the harness and of the tests that use it.

use std::fmt;
use std::path::PathBuf;

/// Why a harness step or a test check failed.
///
/// `Debug` prints the same text as `Display` (plus the source chain), because a test that
/// returns `Err` is reported by the test runner through `Debug`.
#[derive(thiserror::Error)]
pub enum Error {
    #[error(
        "the logdex binary is missing at {}: build it first with `cargo build -p logdex-api`, \
         or point LOGDEX_BIN at it",
        path.display()
    )]
    BinaryMissing { path: PathBuf },
    #[error("{context}: {source}")]
    Io {
        context: String,
        #[source]
        source: std::io::Error,
    },
    #[error("HTTP {method} {url} failed: {source}")]
    Http {
        method: String,
        url: String,
        #[source]
        source: reqwest::Error,
    },
    #[error("timed out after {waited_ms} ms waiting for {what}; last observation: {last}")]
    Timeout { what: String, waited_ms: u128, last: String },
    #[error("node {node_id} exited unexpectedly ({status}); its log ends with:\n{log_tail}")]
    NodeExited { node_id: u64, status: String, log_tail: String },
    /// A test expectation that did not hold; the text says what was expected and what was seen.
    #[error("check failed: {0}")]
    Check(String),
    /// An answer the design gives while the cluster settles (421 after a leader change, 502 to
    /// 504): the caller may ask again.
    #[error("not settled yet: {0}")]
    Unsettled(String),
}

impl Error {
    pub fn io(context: impl Into<String>, source: std::io::Error) -> Error {
        Error::Io { context: context.into(), source }
    }

    /// True for transport failures where the request may never have reached a server
    /// (connection refused or reset, timeouts): the caller may retry.
    pub fn is_transport(&self) -> bool {
        matches!(self, Error::Http { .. })
    }

    /// True when the request certainly never reached a server (the TCP connect failed),
    /// so a write attempt that ended this way had no effect.
    pub fn is_connect_failure(&self) -> bool {
        matches!(self, Error::Http { source, .. } if source.is_connect())
    }
}

impl fmt::Debug for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{self}")?;
        let mut source = std::error::Error::source(self);
        while let Some(cause) = source {
            write!(f, "\n  caused by: {cause}")?;
            source = cause.source();
        }
        Ok(())
    }
}

pub type Result<T, E = Error> = std::result::Result<T, E>;
