//! An S3-compatible object store for tests: moto's server (PyPI package `moto[server]`,
//! which `scripts/test.sh` installs) on a free loopback port, with one bucket. The nodes
//! reach it through the standard `AWS_*` variables ([`S3Server::node_env`]); the test
//! counts objects through the S3 API (`ListObjectsV2`). Stopped by PID when dropped.

use std::net::Ipv4Addr;
use std::net::SocketAddr;
use std::net::TcpListener;
use std::process::Child;
use std::process::Command;
use std::process::Stdio;
use std::time::Duration;
use std::time::Instant;

use crate::Api;
use crate::error::Error;
use crate::error::Result;

/// The server's command: `LOGDEX_S3_SERVER` (a program taking moto_server's `-H HOST -p PORT`),
/// else `python3 -m moto.server`.
fn server_command() -> (String, Vec<String>) {
    match std::env::var("LOGDEX_S3_SERVER") {
        Ok(program) => (program, Vec::new()),
        Err(_) => ("python3".to_string(), vec!["-m".to_string(), "moto.server".to_string()]),
    }
}

const START_TIMEOUT: Duration = Duration::from_secs(30);

pub struct S3Server {
    child: Child,
    addr: SocketAddr,
    bucket: String,
}

impl S3Server {
    /// Starts the server and creates `bucket` in it.
    pub async fn start(api: &Api, bucket: &str) -> Result<S3Server> {
        let port = TcpListener::bind((Ipv4Addr::LOCALHOST, 0))
            .and_then(|l| l.local_addr())
            .map_err(|e| Error::io("finding a free port for the S3 server", e))?
            .port();
        let addr = SocketAddr::from((Ipv4Addr::LOCALHOST, port));
        let (program, args) = server_command();
        let child = Command::new(&program)
            .args(&args)
            .args(["-H", "127.0.0.1", "-p", &port.to_string()])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .map_err(|e| {
                Error::io(
                    format!(
                        "starting the S3 server {program:?} {args:?} (install it with \
                         `pip install 'moto[server]'`, as scripts/test.sh does, or point LOGDEX_S3_SERVER at one)"
                    ),
                    e,
                )
            })?;
        let mut server = S3Server { child, addr, bucket: bucket.to_string() };
        let started = Instant::now();
        loop {
            if let Ok(Some(status)) = server.child.try_wait() {
                return Err(Error::Check(format!(
                    "the S3 server {program:?} {args:?} exited ({status}): is moto installed \
                     (`pip install 'moto[server]'`, as scripts/test.sh does)?"
                )));
            }
            match api.request(reqwest::Method::PUT, &server.bucket_url(), None).await {
                Ok(reply) if reply.status == 200 => return Ok(server),
                Ok(reply) => return Err(Error::Check(format!("creating the bucket: {}", reply.summary()))),
                Err(e) if started.elapsed() < START_TIMEOUT => {
                    let _ = e;
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
                Err(e) => return Err(e),
            }
        }
    }

    fn bucket_url(&self) -> String {
        format!("http://{}/{}", self.addr, self.bucket)
    }

    /// The `--tiered-store` of every node: the bucket, under `prefix`.
    pub fn store_url(&self, prefix: &str) -> String {
        format!("s3://{}/{prefix}", self.bucket)
    }

    /// What a node needs to reach the server.
    pub fn node_env(&self) -> Vec<(String, String)> {
        [
            ("AWS_ENDPOINT", format!("http://{}", self.addr)),
            ("AWS_ALLOW_HTTP", "true".to_string()),
            ("AWS_ACCESS_KEY_ID", "logdex-test".to_string()),
            ("AWS_SECRET_ACCESS_KEY", "logdex-test".to_string()),
            ("AWS_REGION", "us-east-1".to_string()),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect()
    }

    /// The keys of the bucket's objects under `prefix` whose names end in `suffix`.
    pub async fn keys(&self, api: &Api, prefix: &str, suffix: &str) -> Result<Vec<String>> {
        let mut keys = Vec::new();
        let mut token: Option<String> = None;
        loop {
            let mut url = format!("{}?list-type=2&prefix={prefix}", self.bucket_url());
            if let Some(token) = &token {
                url.push_str(&format!("&continuation-token={}", encode_query(token)));
            }
            let reply = api.get_url(&url).await?;
            reply.expect_status(200)?;
            let body = reply.text();
            keys.extend(elements(&body, "Key").into_iter().filter(|k| k.ends_with(suffix)));
            token = elements(&body, "NextContinuationToken").into_iter().next();
            if token.is_none() {
                return Ok(keys);
            }
        }
    }
}

impl Drop for S3Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The texts of every `<tag>...</tag>` in `xml` (S3 keys here hold no markup).
fn elements(xml: &str, tag: &str) -> Vec<String> {
    let (open, close) = (format!("<{tag}>"), format!("</{tag}>"));
    xml.split(open.as_str())
        .skip(1)
        .filter_map(|part| part.split_once(close.as_str()).map(|(t, _)| t.to_string()))
        .collect()
}

/// Percent-encodes everything but unreserved characters.
fn encode_query(text: &str) -> String {
    text.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => (b as char).to_string(),
            _ => format!("%{b:02X}"),
        })
        .collect()
}
