//! Cross-cutting HTTP concerns: bearer-token auth, the in-flight request
//! bound, JSON error bodies for every rejection, per-client lookup rate limit,
//! and request metrics by route and status.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::Arc;
use std::sync::Mutex;
use std::time::Duration;
use std::time::Instant;

use axum::body::Body;
use axum::extract::ConnectInfo;
use axum::extract::MatchedPath;
use axum::extract::Request;
use axum::extract::State;
use axum::http::HeaderValue;
use axum::http::StatusCode;
use axum::middleware::Next;
use axum::response::IntoResponse;
use axum::response::Response;
use serde_json::json;
use tokio::sync::Semaphore;

use crate::error::ApiError;

/// Upper bounds of the request latency histogram buckets, in seconds.
pub const LATENCY_BUCKETS_S: [f64; 12] =
    [0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5, 2.0];
/// Distinct clients tracked by the lookup rate limiter before old entries are dropped.
const RATE_CLIENTS_MAX: usize = 100_000;

/// Shared state of the middleware.
pub struct Guard {
    /// Required `Authorization: Bearer <token>`, when set.
    pub token: Option<String>,
    in_flight: Semaphore,
    lookup_rate: Option<RateLimiter>,
    pub metrics: Metrics,
    /// The request body limit, named in a 413 for a body over it.
    body_bytes_max: Option<usize>,
}

impl Guard {
    pub fn new(token: Option<String>, requests_in_flight_max: usize, lookups_per_client_per_s: Option<u32>) -> Guard {
        Guard {
            token,
            in_flight: Semaphore::new(requests_in_flight_max),
            lookup_rate: lookups_per_client_per_s.map(RateLimiter::new),
            metrics: Metrics::default(),
            body_bytes_max: None,
        }
    }

    /// Names `bytes`, the request body limit, in the 413 of a body over it.
    pub fn with_body_limit(mut self, bytes: usize) -> Guard {
        self.body_bytes_max = Some(bytes);
        self
    }
}

/// Auth, in-flight bound, rate limit, metrics and JSON errors, in that order.
pub async fn guard(State(g): State<Arc<Guard>>, request: Request, next: Next) -> Response {
    let started = Instant::now();
    // A shared handle on the route's text (no copy): the request is consumed below.
    let matched = request.extensions().get::<MatchedPath>().cloned();
    let route = matched.as_ref().map_or(UNMATCHED_ROUTE, MatchedPath::as_str);
    let method = request.method().clone();
    let origin = Origin::of(&request);
    let response = match admit(&g, &request, route) {
        Err(e) => e.into_response(),
        // Health and metrics answer on a node busy to its bound too: a liveness probe must not
        // take "busy" for "dead".
        Ok(()) if open_route(route) => next.run(request).await,
        Ok(()) => match g.in_flight_slot() {
            Err(e) => e.into_response(),
            Ok(_permit) => next.run(request).await,
        },
    };
    let response = json_error_body(response, g.body_bytes_max).await;
    g.metrics.observe(origin, &method, route, response.status(), started.elapsed());
    response
}

/// Where a request counted in the request metrics came from: each request a client sent
/// counts once as `http` or `grpc` on the node it reached, and once more as `forwarded` on
/// each node it was forwarded to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Origin {
    /// A client's HTTP request.
    Http,
    /// A client's gRPC call, counted as the HTTP route it stands for.
    Grpc,
    /// A request another node forwarded here.
    Forwarded,
}

/// Marks a request the gRPC API made of a call (`grpc::Service::call`).
#[derive(Clone, Copy, Debug)]
pub struct GrpcCall;

impl Origin {
    pub fn of(request: &Request) -> Origin {
        if request.headers().contains_key(crate::routing::FORWARDED_HEADER) {
            Origin::Forwarded
        } else if request.extensions().get::<GrpcCall>().is_some() {
            Origin::Grpc
        } else {
            Origin::Http
        }
    }

    fn label(self) -> &'static str {
        match self {
            Origin::Http => "http",
            Origin::Grpc => "grpc",
            Origin::Forwarded => "forwarded",
        }
    }
}

/// The route label of a request that matched no route.
pub const UNMATCHED_ROUTE: &str = "unmatched";

/// The answer to a request that matched no route, counted as route [`UNMATCHED_ROUTE`].
pub async fn route_not_found(g: &Guard, request: Request) -> Response {
    g.metrics.observe(Origin::of(&request), request.method(), UNMATCHED_ROUTE, StatusCode::NOT_FOUND, Duration::ZERO);
    json_error_body(ApiError::RouteNotFound.into_response(), g.body_bytes_max).await
}

/// The route of key lookups, as requests and metrics name it.
pub const LOOKUP_ROUTE: &str = "/kv/{topic}/{*key}";

/// Routes open to every client, without the bearer token or a place among the requests in
/// flight.
fn open_route(route: &str) -> bool {
    matches!(route, "/healthz" | "/readyz" | "/metrics")
}

fn admit(g: &Guard, request: &Request, route: &str) -> Result<(), ApiError> {
    if !open_route(route) {
        g.check_token(request.headers().get("authorization").and_then(|v| v.to_str().ok()))?;
    }
    let forwarded = request.headers().contains_key(crate::routing::FORWARDED_HEADER);
    // A HEAD is a lookup too: it answers whether the key exists, and its offset, in headers.
    let lookup = matches!(*request.method(), axum::http::Method::GET | axum::http::Method::HEAD);
    if route == LOOKUP_ROUTE && lookup && !forwarded {
        let ip = request.extensions().get::<ConnectInfo<crate::tls::ClientAddr>>().map(|c| c.0.0.ip());
        g.check_lookup_rate(ip)?;
    }
    Ok(())
}

impl Guard {
    /// The bearer token, when one is required: `authorization` is the request's
    /// `Authorization` header.
    pub fn check_token(&self, authorization: Option<&str>) -> Result<(), ApiError> {
        let Some(token) = &self.token else { return Ok(()) };
        // The scheme is case-insensitive (RFC 7235): `bearer` is `Bearer`.
        let given = authorization
            .and_then(|v| v.split_once(' '))
            .and_then(|(scheme, token)| scheme.eq_ignore_ascii_case("bearer").then_some(token));
        if given.is_some_and(|t| constant_time_eq(t.as_bytes(), token.as_bytes())) {
            Ok(())
        } else {
            Err(ApiError::Unauthorized)
        }
    }

    /// The per-client lookup rate, when limited (a client whose address is unknown is not).
    fn check_lookup_rate(&self, client: Option<IpAddr>) -> Result<(), ApiError> {
        match (&self.lookup_rate, client) {
            (Some(limiter), Some(ip)) => limiter.check(ip),
            _ => Ok(()),
        }
    }

    /// What [`guard`] checks before a key lookup, for one that does not go through the HTTP
    /// router (the gRPC `Get`): the bearer token, the client's lookup rate and the in-flight
    /// bound. The permit holds the request's place until it is dropped.
    pub fn admit_lookup(
        &self,
        authorization: Option<&str>,
        client: Option<IpAddr>,
    ) -> Result<tokio::sync::SemaphorePermit<'_>, ApiError> {
        self.check_token(authorization)?;
        self.check_lookup_rate(client)?;
        self.in_flight_slot()
    }

    /// What [`guard`] checks before a call that is neither a lookup nor open (the gRPC `Noop`):
    /// the bearer token and the in-flight bound.
    pub fn admit_call(&self, authorization: Option<&str>) -> Result<tokio::sync::SemaphorePermit<'_>, ApiError> {
        self.check_token(authorization)?;
        self.in_flight_slot()
    }

    /// A place among the requests in flight, or 503 when all are taken.
    fn in_flight_slot(&self) -> Result<tokio::sync::SemaphorePermit<'_>, ApiError> {
        self.in_flight
            .try_acquire()
            .map_err(|_| ApiError::Unavailable("too many requests in flight on this node".into()))
    }
}

fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// How axum's text of a query string it cannot read begins.
const QUERY_REJECTION: &str = "Failed to deserialize query string: ";

/// `param: reason` of a query rejection, with Rust's words for a number it could not read
/// (`-1` is an "invalid digit found in string") replaced by what the parameter takes.
fn plain_query_reason(rest: &str) -> String {
    const NOT_A_COUNT: [&str; 3] = [
        "invalid digit found in string",
        "cannot parse integer from empty string",
        "number too large to fit in target type",
    ];
    match rest.split_once(": ") {
        Some((param, reason)) if NOT_A_COUNT.contains(&reason) => {
            // Page limits start at 1 (a zero is `invalid_limit`); larger ones are taken as
            // their bound.
            let low = if matches!(param, "max_records" | "max_bytes") { 1 } else { 0 };
            format!("{param}: it takes a whole number from {low} to {}", u64::MAX)
        }
        _ => rest.to_string(),
    }
}

/// Rewrites a non-JSON error answer (an extractor rejection, an unknown
/// route) into the JSON error shape, keeping its status and headers.
async fn json_error_body(response: Response, body_bytes_max: Option<usize>) -> Response {
    let status = response.status();
    let is_json = response
        .headers()
        .get("content-type")
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("application/json"));
    if !(status.is_client_error() || status.is_server_error()) || is_json {
        return response;
    }
    let (mut parts, body) = response.into_parts();
    let text = axum::body::to_bytes(body, 64 * 1024).await.unwrap_or_default();
    let code = match status {
        StatusCode::NOT_FOUND => "route_not_found",
        StatusCode::METHOD_NOT_ALLOWED => "method_not_allowed",
        StatusCode::PAYLOAD_TOO_LARGE => "too_large",
        StatusCode::UNSUPPORTED_MEDIA_TYPE => "unsupported_media_type",
        StatusCode::UNPROCESSABLE_ENTITY | StatusCode::BAD_REQUEST => "invalid_request",
        _ => "error",
    };
    let mut message = String::from_utf8_lossy(&text).into_owned();
    // axum's query rejection names the parameter after its own prefix: keep the parameter
    // and the reason, under a code of their own.
    let code = match message.strip_prefix(QUERY_REJECTION) {
        Some(rest) if status == StatusCode::BAD_REQUEST => {
            message = format!("bad query parameter {}", plain_query_reason(rest));
            "invalid_query"
        }
        _ => code,
    };
    if let (StatusCode::PAYLOAD_TOO_LARGE, Some(limit)) = (status, body_bytes_max) {
        // axum's text says only that a length limit was exceeded.
        message = format!("the request body is over the limit of {limit} bytes");
    }
    if message.is_empty() {
        // axum's 405 (a method a route does not take) carries no text: say what was wrong.
        message = match status {
            StatusCode::METHOD_NOT_ALLOWED => {
                "this path does not take this method; the Allow header lists those it takes".to_string()
            }
            _ => status.canonical_reason().unwrap_or("error").to_lowercase(),
        };
    }
    let status = if status == StatusCode::UNPROCESSABLE_ENTITY { StatusCode::BAD_REQUEST } else { status };
    let body = json!({"error": {"code": code, "message": message}});
    parts.status = status;
    parts.headers.insert("content-type", HeaderValue::from_static("application/json"));
    parts.headers.remove("content-length");
    Response::from_parts(parts, Body::from(body.to_string()))
}

/// A token bucket per client address.
struct RateLimiter {
    per_s: u32,
    buckets: Mutex<HashMap<IpAddr, (f64, Instant)>>,
}

impl RateLimiter {
    fn new(per_s: u32) -> RateLimiter {
        RateLimiter { per_s: per_s.max(1), buckets: Mutex::new(HashMap::new()) }
    }

    fn check(&self, ip: IpAddr) -> Result<(), ApiError> {
        let mut buckets = self.buckets.lock().unwrap_or_else(|e| e.into_inner());
        if buckets.len() >= RATE_CLIENTS_MAX {
            buckets.clear();
        }
        let now = Instant::now();
        let rate = f64::from(self.per_s);
        let (tokens, last) = buckets.entry(ip).or_insert((rate, now));
        *tokens = (*tokens + now.duration_since(*last).as_secs_f64() * rate).min(rate);
        *last = now;
        if *tokens >= 1.0 {
            *tokens -= 1.0;
            Ok(())
        } else {
            Err(ApiError::RateLimited(format!("more than {} lookups per second from {ip}", self.per_s)))
        }
    }
}

/// Request counts and latency histograms by origin, method, route and status.
#[derive(Default)]
pub struct Metrics {
    /// Route -> the series of each (origin, method, status) seen on it. A request finds its
    /// series without allocating: the route is looked up by `&str`, and a route sees few.
    series: Mutex<HashMap<String, Vec<RouteSeries>>>,
}

/// One (origin, method, status) series of a route.
type RouteSeries = (Origin, axum::http::Method, u16, Series);

/// The method label of a request: its method when HTTP defines it, else `OTHER`, so that
/// made-up methods add no series.
fn method_label(method: &axum::http::Method) -> axum::http::Method {
    use axum::http::Method;
    let known = [
        Method::GET,
        Method::HEAD,
        Method::POST,
        Method::PUT,
        Method::DELETE,
        Method::PATCH,
        Method::OPTIONS,
        Method::CONNECT,
        Method::TRACE,
    ];
    if known.contains(method) { method.clone() } else { Method::from_bytes(b"OTHER").unwrap_or_default() }
}

#[derive(Default, Clone)]
struct Series {
    count: u64,
    sum_s: f64,
    buckets: [u64; LATENCY_BUCKETS_S.len()],
}

impl Metrics {
    pub fn observe(
        &self,
        origin: Origin,
        method: &axum::http::Method,
        route: &str,
        status: StatusCode,
        elapsed: Duration,
    ) {
        let secs = elapsed.as_secs_f64();
        let status = status.as_u16();
        let mut series = self.series.lock().unwrap_or_else(|e| e.into_inner());
        if !series.contains_key(route) {
            series.insert(route.to_string(), Vec::new());
        }
        let Some(per_route) = series.get_mut(route) else { return };
        let method = method_label(method);
        let at = match per_route.iter().position(|(o, m, st, _)| *o == origin && *m == method && *st == status) {
            Some(at) => at,
            None => {
                per_route.push((origin, method, status, Series::default()));
                per_route.len() - 1
            }
        };
        let s = &mut per_route[at].3;
        s.count += 1;
        s.sum_s += secs;
        for (i, bound) in LATENCY_BUCKETS_S.iter().enumerate() {
            if secs <= *bound {
                s.buckets[i] += 1;
            }
        }
    }

    /// Prometheus text exposition of the request series.
    pub fn render(&self, out: &mut String) {
        use std::fmt::Write;
        let mut series: Vec<(Origin, String, String, u16, Series)> = {
            let series = self.series.lock().unwrap_or_else(|e| e.into_inner());
            series
                .iter()
                .flat_map(|(route, seen)| {
                    seen.iter().map(|(origin, method, status, s)| {
                        (*origin, method.to_string(), route.clone(), *status, s.clone())
                    })
                })
                .collect()
        };
        series.sort_by(|a, b| (a.0, &a.1, &a.2, a.3).cmp(&(b.0, &b.1, &b.2, b.3)));
        let _ = writeln!(
            out,
            "# HELP logdex_http_request_duration_seconds Request latency by origin (http, grpc: a client's call, \
             under the HTTP route it stands for; forwarded: from another node), method, route and status."
        );
        let _ = writeln!(out, "# TYPE logdex_http_request_duration_seconds histogram");
        for (origin, method, route, status, s) in &series {
            let origin = origin.label();
            let labels = format!("origin=\"{origin}\",method=\"{method}\",route=\"{route}\",status=\"{status}\"");
            for (i, bound) in LATENCY_BUCKETS_S.iter().enumerate() {
                let _ = writeln!(
                    out,
                    "logdex_http_request_duration_seconds_bucket{{{labels},le=\"{bound}\"}} {}",
                    s.buckets[i]
                );
            }
            let _ = writeln!(out, "logdex_http_request_duration_seconds_bucket{{{labels},le=\"+Inf\"}} {}", s.count);
            let _ = writeln!(out, "logdex_http_request_duration_seconds_sum{{{labels}}} {}", s.sum_s);
            let _ = writeln!(out, "logdex_http_request_duration_seconds_count{{{labels}}} {}", s.count);
        }
    }
}

impl std::fmt::Debug for Metrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Metrics")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn request_series_are_counted_per_origin_method_route_and_status_and_rendered_in_order() {
        use axum::http::Method;
        let metrics = Metrics::default();
        let ms = Duration::from_millis(1);
        metrics.observe(Origin::Http, &Method::PUT, "/kv/{topic}/{*key}", StatusCode::OK, ms);
        metrics.observe(Origin::Http, &Method::GET, "/kv/{topic}/{*key}", StatusCode::OK, ms);
        metrics.observe(Origin::Http, &Method::GET, "/kv/{topic}/{*key}", StatusCode::OK, ms);
        metrics.observe(Origin::Http, &Method::GET, "/kv/{topic}/{*key}", StatusCode::NOT_FOUND, ms);
        metrics.observe(Origin::Http, &Method::GET, "/topics", StatusCode::OK, Duration::from_secs(100));
        metrics.observe(Origin::Grpc, &Method::GET, "/kv/{topic}/{*key}", StatusCode::OK, ms);
        metrics.observe(Origin::Forwarded, &Method::GET, "/kv/{topic}/{*key}", StatusCode::OK, ms);
        // Made-up methods share one label.
        for made_up in [&b"BREW"[..], b"WHEN", b"BREW"] {
            let method = Method::from_bytes(made_up).unwrap_or_default();
            metrics.observe(Origin::Http, &method, UNMATCHED_ROUTE, StatusCode::NOT_FOUND, ms);
        }
        let mut out = String::new();
        metrics.render(&mut out);
        let counts: Vec<&str> =
            out.lines().filter(|l| l.starts_with("logdex_http_request_duration_seconds_count")).collect();
        assert_eq!(
            counts,
            [
                r#"logdex_http_request_duration_seconds_count{origin="http",method="GET",route="/kv/{topic}/{*key}",status="200"} 2"#,
                r#"logdex_http_request_duration_seconds_count{origin="http",method="GET",route="/kv/{topic}/{*key}",status="404"} 1"#,
                r#"logdex_http_request_duration_seconds_count{origin="http",method="GET",route="/topics",status="200"} 1"#,
                r#"logdex_http_request_duration_seconds_count{origin="http",method="OTHER",route="unmatched",status="404"} 3"#,
                r#"logdex_http_request_duration_seconds_count{origin="http",method="PUT",route="/kv/{topic}/{*key}",status="200"} 1"#,
                r#"logdex_http_request_duration_seconds_count{origin="grpc",method="GET",route="/kv/{topic}/{*key}",status="200"} 1"#,
                r#"logdex_http_request_duration_seconds_count{origin="forwarded",method="GET",route="/kv/{topic}/{*key}",status="200"} 1"#,
            ]
        );
        // A request slower than every bucket is counted only in +Inf.
        assert!(out.contains(r#"route="/topics",status="200",le="+Inf"} 1"#), "{out}");
        let last_bound = LATENCY_BUCKETS_S[LATENCY_BUCKETS_S.len() - 1];
        assert!(out.contains(&format!(r#"route="/topics",status="200",le="{last_bound}"}} 0"#)), "{out}");
    }
}
