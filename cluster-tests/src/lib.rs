//! logdex cluster tests: a harness that runs real `logdex serve` processes on loopback, a
//! typed HTTP client for the public API, and checkers for what a client was acknowledged.
//!
//! The tests in `tests/` drive the built binary only (DESIGN.md section 12), never the
//! server's crates. See README.md for how to run them, replay a seed and find node logs.

pub mod chaos;
pub mod client;
pub mod cluster;
pub mod damage;
pub mod error;
pub mod history;
pub mod murmur2;
pub mod power;
pub mod proxy;
pub mod s3;
pub mod support;
pub mod tls;

pub use client::Api;
pub use client::Read;
pub use client::ReadMode;
pub use client::Reply;
pub use client::TopicDescription;
pub use client::TopicSpec;
pub use client::Written;
pub use cluster::Cluster;
pub use cluster::ClusterOptions;
pub use error::Error;
pub use error::Result;

/// Returns `Err(Error::Check(..))` with a formatted message unless the condition holds.
#[macro_export]
macro_rules! ensure {
    ($cond:expr, $($fmt:tt)+) => {
        if !$cond {
            return Err($crate::Error::Check(format!($($fmt)+)));
        }
    };
}

/// `ensure_eq!(actual, expected, "what")`: returns `Err(Error::Check(..))` showing both unless equal.
#[macro_export]
macro_rules! ensure_eq {
    ($left:expr, $right:expr, $($fmt:tt)+) => {
        match (&$left, &$right) {
            (left, right) => {
                if left != right {
                    return Err($crate::Error::Check(format!(
                        "{}: expected {:?}, got {:?}",
                        format!($($fmt)+),
                        right,
                        left
                    )));
                }
            }
        }
    };
}
