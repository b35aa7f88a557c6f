//! logdex's edge: the HTTP and gRPC APIs, routing (serve here, forward once,
//! or 421), Kafka's partitioner, and the `logdex` command line.
//!
//! Only this crate maps errors to HTTP and gRPC status codes.

pub mod bench;
pub mod bench_measure;
pub mod bench_restart;
pub mod cli;
pub mod client;
#[cfg(feature = "failpoints")]
pub mod crash_points;
pub mod dev;
pub mod error;
pub mod grpc;
pub mod http;
pub mod idle;
pub mod middleware;
pub mod murmur2;
pub mod routing;
pub mod serve;
pub mod tls;
