//! API errors and their one mapping to HTTP status codes and JSON bodies.
//!
//! Error codes are stable and append-only: scripts match on them.

use axum::http::HeaderValue;
use axum::http::StatusCode;
use axum::response::IntoResponse;
use axum::response::Response;
use serde_json::json;

#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    #[error("{message}")]
    BadRequest { code: &'static str, message: String },
    #[error("key not found")]
    KeyNotFound,
    #[error("topic {0} does not exist")]
    TopicNotFound(String),
    #[error("topic {0} has kv.index.enabled=false")]
    TopicNotIndexed(String),
    #[error("record at offset {0} was removed by retention")]
    Gone(u64),
    #[error("{0}")]
    Conflict(String),
    /// A conflict with a code of its own (a node that runs, or still holds replicas).
    #[error("{message}")]
    ConflictWith { code: &'static str, message: String },
    #[error("{0}")]
    TooLarge(String),
    #[error("{message}")]
    Misdirected { message: String, redirect: Option<String> },
    #[error("{0}")]
    Unavailable(String),
    /// The request never reached the node it was forwarded to: safe to retry elsewhere.
    #[error("{0}")]
    NodeUnreachable(String),
    #[error("{0}")]
    Timeout(String),
    #[error("{0}")]
    Internal(String),
    /// The replica asked holds damaged data for this request (a batch failing its crc or
    /// framing, or its key index and segment log disagreeing) and refuses to answer from it.
    /// Other replicas may answer; the request changed nothing.
    #[error("{0}")]
    CorruptData(String),
    #[error("missing or wrong bearer token")]
    Unauthorized,
    #[error("no such route")]
    RouteNotFound,
    #[error("{0}")]
    RateLimited(String),
    #[error("{0}")]
    NotFound(String),
    #[error("node {0} is not registered")]
    NodeNotFound(u64),
}

impl ApiError {
    pub fn bad(code: &'static str, message: impl Into<String>) -> ApiError {
        ApiError::BadRequest { code, message: message.into() }
    }

    pub fn status(&self) -> StatusCode {
        match self {
            ApiError::BadRequest { .. } => StatusCode::BAD_REQUEST,
            ApiError::KeyNotFound
            | ApiError::TopicNotFound(_)
            | ApiError::TopicNotIndexed(_)
            | ApiError::NotFound(_)
            | ApiError::NodeNotFound(_) => StatusCode::NOT_FOUND,
            ApiError::Gone(_) => StatusCode::GONE,
            ApiError::Conflict(_) | ApiError::ConflictWith { .. } => StatusCode::CONFLICT,
            ApiError::TooLarge(_) => StatusCode::PAYLOAD_TOO_LARGE,
            ApiError::Misdirected { .. } => StatusCode::MISDIRECTED_REQUEST,
            ApiError::Unavailable(_) | ApiError::NodeUnreachable(_) => StatusCode::SERVICE_UNAVAILABLE,
            ApiError::Timeout(_) => StatusCode::GATEWAY_TIMEOUT,
            ApiError::Internal(_) | ApiError::CorruptData(_) => StatusCode::INTERNAL_SERVER_ERROR,
            ApiError::Unauthorized => StatusCode::UNAUTHORIZED,
            ApiError::RouteNotFound => StatusCode::NOT_FOUND,
            ApiError::RateLimited(_) => StatusCode::TOO_MANY_REQUESTS,
        }
    }

    pub fn code(&self) -> &'static str {
        match self {
            ApiError::BadRequest { code, .. } => code,
            ApiError::KeyNotFound => "key_not_found",
            ApiError::TopicNotFound(_) => "topic_not_found",
            ApiError::TopicNotIndexed(_) => "topic_not_indexed",
            ApiError::NotFound(_) => "not_found",
            ApiError::NodeNotFound(_) => "node_not_found",
            ApiError::Gone(_) => "record_removed",
            ApiError::Conflict(_) => "conflict",
            ApiError::ConflictWith { code, .. } => code,
            ApiError::TooLarge(_) => "too_large",
            ApiError::Misdirected { .. } => "misdirected",
            ApiError::Unavailable(_) | ApiError::NodeUnreachable(_) => "unavailable",
            ApiError::Timeout(_) => "timeout",
            ApiError::Internal(_) => "internal",
            ApiError::CorruptData(_) => "corrupt_data",
            ApiError::Unauthorized => "unauthorized",
            ApiError::RouteNotFound => "route_not_found",
            ApiError::RateLimited(_) => "rate_limited",
        }
    }
}

impl From<logdex_raft::Error> for ApiError {
    fn from(e: logdex_raft::Error) -> ApiError {
        use logdex_raft::Error as E;
        if e.is_corrupt_data() {
            return ApiError::CorruptData(e.to_string());
        }
        match e {
            E::Invalid(m) => ApiError::bad("invalid", m),
            E::TooLarge(m) => ApiError::TooLarge(m),
            E::Timeout(m) => ApiError::Timeout(m),
            E::NotFound(m) => ApiError::NotFound(m),
            E::Conflict(m) => ApiError::Conflict(m),
            // The code says "unavailable" already: the message does not repeat it.
            E::Unavailable(m) => ApiError::Unavailable(m),
            E::NodeUnreachable(m) => ApiError::NodeUnreachable(m),
            E::NotLeader { .. } | E::NotHosted { .. } | E::TierMiss { .. } => ApiError::Unavailable(e.to_string()),
            other => ApiError::Internal(other.to_string()),
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let status = self.status();
        let body = json!({"error": {"code": self.code(), "message": self.to_string()}});
        let mut response = (status, axum::Json(body)).into_response();
        let headers = response.headers_mut();
        if status == StatusCode::SERVICE_UNAVAILABLE || status == StatusCode::TOO_MANY_REQUESTS {
            headers.insert("retry-after", HeaderValue::from_static("1"));
        }
        if status == StatusCode::UNAUTHORIZED {
            // RFC 6750: a 401 names the scheme the client must use.
            headers.insert("www-authenticate", HeaderValue::from_static("Bearer"));
        }
        if let ApiError::Misdirected { redirect: Some(url), .. } = &self
            && let Ok(v) = HeaderValue::from_str(url)
        {
            headers.insert("x-kv-redirect", v);
        }
        response
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A replica refusing damaged data answers 500 with its own code, whether the segment log
    /// found the damage (crc) or the lookup did (index and log disagree); other storage errors
    /// stay `internal`.
    #[test]
    fn damaged_data_maps_to_corrupt_data() {
        let crc = logdex_log::Error::Corrupt {
            path: "00000000000000000000.log".into(),
            base_offset: 0,
            position: 122,
            source: Box::new(logdex_log::Error::CrcMismatch { expected: 1, actual: 2 }),
        };
        let mismatch = logdex_raft::Error::CorruptData { group: 3, detail: "another key".into() };
        for e in [logdex_raft::Error::Log(crc), mismatch] {
            let api = ApiError::from(e);
            assert_eq!((api.status(), api.code()), (StatusCode::INTERNAL_SERVER_ERROR, "corrupt_data"));
        }
        let io = ApiError::from(logdex_raft::Error::Log(logdex_log::Error::Poisoned));
        assert_eq!(io.code(), "internal");
    }

    #[test]
    fn unauthorized_names_the_bearer_scheme() {
        let response = ApiError::Unauthorized.into_response();
        assert_eq!(response.status(), StatusCode::UNAUTHORIZED);
        assert_eq!(response.headers().get("www-authenticate").map(HeaderValue::as_bytes), Some(&b"Bearer"[..]));
    }
}
