//! TLS of a node (`--tls-cert-file`, `--tls-key-file`, `--tls-ca-file`): its HTTP and RPC
//! listeners serve only TLS with its certificate, and its calls to other nodes (Raft RPC,
//! forwarded HTTP requests) trust only the cluster's CA. rustls, with ring as its crypto.

use std::net::SocketAddr;
use std::path::Path;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use rustls::pki_types::CertificateDer;
use rustls::pki_types::PrivateKeyDer;
use rustls::pki_types::pem::PemObject;
use tokio::net::TcpListener;
use tokio::net::TcpStream;
use tokio_rustls::TlsAcceptor;
use tokio_rustls::server::TlsStream;

use crate::idle::IdleListener;

/// How long a client has to finish its TLS handshake.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// Handshakes under way at once on a listener; more connections wait in the kernel's queue.
const HANDSHAKES_IN_FLIGHT_MAX: usize = 256;

#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("cannot read {path}: {source}")]
    Read { path: PathBuf, source: std::io::Error },
    #[error("{path} holds no PEM certificate")]
    NoCertificate { path: PathBuf },
    #[error("{path}: {message}")]
    Invalid { path: PathBuf, message: String },
    #[error("{0}")]
    Config(String),
}

/// A node's certificate, its key and the cluster's CA, read and checked once at start.
#[derive(Clone)]
pub struct NodeTls {
    cert_pem: Vec<u8>,
    key_pem: Vec<u8>,
    ca_pem: Vec<u8>,
    server: Arc<rustls::ServerConfig>,
}

impl std::fmt::Debug for NodeTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NodeTls").finish_non_exhaustive()
    }
}

fn read(path: &Path) -> Result<Vec<u8>, TlsError> {
    std::fs::read(path).map_err(|source| TlsError::Read { path: path.to_path_buf(), source })
}

/// Every certificate of a PEM file; at least one.
fn certificates(path: &Path, pem: &[u8]) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let certs = CertificateDer::pem_slice_iter(pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| TlsError::Invalid { path: path.to_path_buf(), message: e.to_string() })?;
    if certs.is_empty() {
        return Err(TlsError::NoCertificate { path: path.to_path_buf() });
    }
    Ok(certs)
}

impl NodeTls {
    /// Reads the node's certificate chain (PEM, the node's own certificate first), its
    /// private key (PEM: PKCS#8, PKCS#1 or SEC1) and the CA certificates that signed every
    /// node's certificate (PEM), and checks that key and certificate go together.
    pub fn load(cert: &Path, key: &Path, ca: &Path) -> Result<NodeTls, TlsError> {
        let (cert_pem, key_pem, ca_pem) = (read(cert)?, read(key)?, read(ca)?);
        let chain = certificates(cert, &cert_pem)?;
        certificates(ca, &ca_pem)?;
        let private_key = PrivateKeyDer::from_pem_slice(&key_pem)
            .map_err(|e| TlsError::Invalid { path: key.to_path_buf(), message: format!("no private key: {e}") })?;
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let mut server = rustls::ServerConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .map_err(|e| TlsError::Config(e.to_string()))?
            .with_no_client_auth()
            .with_single_cert(chain, private_key)
            .map_err(|e| TlsError::Invalid {
                path: key.to_path_buf(),
                message: format!("does not go with the certificate of {}: {e}", cert.display()),
            })?;
        server.alpn_protocols = vec![b"http/1.1".to_vec()];
        Ok(NodeTls { cert_pem, key_pem, ca_pem, server: Arc::new(server) })
    }

    /// Checks the node's certificate as its peers and clients will: it chains to the CA file,
    /// is valid now, and names the host of each address the node advertises. A node whose
    /// peers would refuse its certificate is refused at start, naming the reason, instead of
    /// registering and then never hearing from them.
    pub fn check_valid_for(&self, addresses: &[&str]) -> Result<(), TlsError> {
        use rustls::client::danger::ServerCertVerifier;
        let mut roots = rustls::RootCertStore::empty();
        for ca in CertificateDer::pem_slice_iter(&self.ca_pem).flatten() {
            roots.add(ca).map_err(|e| TlsError::Config(format!("a CA certificate of --tls-ca-file: {e}")))?;
        }
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let verifier = rustls::client::WebPkiServerVerifier::builder_with_provider(Arc::new(roots), provider)
            .build()
            .map_err(|e| TlsError::Config(format!("--tls-ca-file: {e}")))?;
        let chain = CertificateDer::pem_slice_iter(&self.cert_pem)
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| TlsError::Config(e.to_string()))?;
        let Some((own, intermediates)) = chain.split_first() else {
            return Err(TlsError::Config("--tls-cert-file holds no certificate".into()));
        };
        for address in addresses {
            let host = host_of(address);
            let name = rustls::pki_types::ServerName::try_from(host.to_string())
                .map_err(|e| TlsError::Config(format!("the host of advertised address {address}: {e}")))?;
            verifier.verify_server_cert(own, intermediates, &name, &[], rustls::pki_types::UnixTime::now()).map_err(
                |e| {
                    TlsError::Config(format!(
                        "peers and clients would refuse this node's certificate (--tls-cert-file) at {address}: {e}"
                    ))
                },
            )?;
        }
        Ok(())
    }

    /// The CA certificates (PEM) peers are verified against.
    pub fn ca_pem(&self) -> &[u8] {
        &self.ca_pem
    }

    /// The RPC listener's TLS (tonic negotiates HTTP/2 itself).
    pub fn rpc_server(&self) -> tonic::transport::ServerTlsConfig {
        let identity = tonic::transport::Identity::from_pem(&self.cert_pem, &self.key_pem);
        tonic::transport::ServerTlsConfig::new().identity(identity)
    }

    /// The CA as roots of an HTTP client (`reqwest`).
    pub fn http_roots(&self) -> Result<Vec<reqwest::Certificate>, TlsError> {
        reqwest::Certificate::from_pem_bundle(&self.ca_pem).map_err(|e| TlsError::Config(e.to_string()))
    }

    /// The HTTP listener, accepting only TLS connections.
    pub fn listener(&self, tcp: TcpListener) -> TlsListener {
        TlsListener::new(tcp, TlsAcceptor::from(self.server.clone()))
    }
}

/// The host of a `host:port` address, without an IPv6 address's brackets.
fn host_of(address: &str) -> &str {
    let host = address.rsplit_once(':').map_or(address, |(host, _)| host);
    host.strip_prefix('[').and_then(|h| h.strip_suffix(']')).unwrap_or(host)
}

/// An HTTP client trusting only the CA certificates of the PEM file at `path` (the
/// `logdex` client commands' `--ca-file`), besides any plain-HTTP URL.
pub fn client_roots(path: &Path) -> Result<Vec<reqwest::Certificate>, TlsError> {
    let pem = read(path)?;
    certificates(path, &pem)?;
    reqwest::Certificate::from_pem_bundle(&pem)
        .map_err(|e| TlsError::Invalid { path: path.to_path_buf(), message: e.to_string() })
}

/// A TCP listener whose connections come out of a TLS handshake, for `axum::serve`.
/// Handshakes run in tasks of their own (at most [`HANDSHAKES_IN_FLIGHT_MAX`] at once,
/// each bounded by [`HANDSHAKE_TIMEOUT`]), so a slow or silent client holds up no other;
/// a failed handshake closes its connection and is logged at debug level.
pub struct TlsListener {
    accepted: tokio::sync::mpsc::Receiver<(TlsStream<TcpStream>, SocketAddr)>,
    local_addr: SocketAddr,
    accept_task: tokio::task::JoinHandle<()>,
}

impl TlsListener {
    fn new(tcp: TcpListener, acceptor: TlsAcceptor) -> TlsListener {
        let local_addr = tcp.local_addr().unwrap_or_else(|_| SocketAddr::from(([0, 0, 0, 0], 0)));
        let (ready, accepted) = tokio::sync::mpsc::channel(HANDSHAKES_IN_FLIGHT_MAX);
        let slots = Arc::new(tokio::sync::Semaphore::new(HANDSHAKES_IN_FLIGHT_MAX));
        let accept_task = tokio::spawn(async move {
            loop {
                let Ok(slot) = slots.clone().acquire_owned().await else { return };
                let (stream, peer) = match tcp.accept().await {
                    Ok(accepted) => accepted,
                    Err(e) => {
                        // Out of file descriptors, say: wait instead of spinning.
                        tracing::warn!(error = %e, "cannot accept an HTTPS connection");
                        tokio::time::sleep(Duration::from_millis(100)).await;
                        continue;
                    }
                };
                let _ = stream.set_nodelay(true);
                let (acceptor, ready) = (acceptor.clone(), ready.clone());
                tokio::spawn(async move {
                    let _slot = slot;
                    let handshake = async {
                        let mut stream = stream;
                        if answered_plain_http(&mut stream).await {
                            return Err(std::io::Error::other("a plain HTTP request; answered 400"));
                        }
                        acceptor.accept(stream).await
                    };
                    match tokio::time::timeout(HANDSHAKE_TIMEOUT, handshake).await {
                        Ok(Ok(tls)) => {
                            let _ = ready.send((tls, peer)).await;
                        }
                        Ok(Err(e)) => tracing::debug!(%peer, error = %e, "TLS handshake failed"),
                        Err(_) => tracing::debug!(%peer, "TLS handshake timed out"),
                    }
                });
            }
        });
        TlsListener { accepted, local_addr, accept_task }
    }
}

/// The first byte of a TLS connection: a handshake record.
const TLS_HANDSHAKE_RECORD: u8 = 0x16;

/// The body of the answer to plain HTTP on the HTTPS listener.
const PLAIN_HTTP_BODY: &str =
    r#"{"error":{"code":"tls_required","message":"this port serves HTTPS only: use https://"}}"#;

/// Answers a connection whose first byte opens no TLS record (plain HTTP: a method's first
/// letter) with a 400 that says to use `https://`, and tells so; a TLS client, whose first
/// record is a handshake, is left to the handshake.
async fn answered_plain_http(stream: &mut TcpStream) -> bool {
    use tokio::io::AsyncWriteExt;
    let mut first = [0u8; 1];
    match stream.peek(&mut first).await {
        Ok(1) if first[0] != TLS_HANDSHAKE_RECORD && first[0].is_ascii_alphabetic() => {
            let answer = format!(
                "HTTP/1.1 400 Bad Request\r\ncontent-type: application/json\r\nconnection: close\r\n\
                 content-length: {}\r\n\r\n{PLAIN_HTTP_BODY}",
                PLAIN_HTTP_BODY.len()
            );
            let _ = stream.write_all(answer.as_bytes()).await;
            let _ = stream.shutdown().await;
            true
        }
        _ => false,
    }
}

impl Drop for TlsListener {
    fn drop(&mut self) {
        self.accept_task.abort();
    }
}

impl axum::serve::Listener for TlsListener {
    type Io = TlsStream<TcpStream>;
    type Addr = SocketAddr;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        match self.accepted.recv().await {
            Some(accepted) => accepted,
            // The accept task ended (its runtime is shutting down): nothing more comes.
            None => std::future::pending().await,
        }
    }

    fn local_addr(&self) -> std::io::Result<Self::Addr> {
        Ok(self.local_addr)
    }
}

/// The client's address of an HTTP connection, plain or TLS, behind the idle limit
/// (`ConnectInfo<ClientAddr>`).
#[derive(Clone, Copy, Debug)]
pub struct ClientAddr(pub SocketAddr);

impl axum::extract::connect_info::Connected<axum::serve::IncomingStream<'_, IdleListener<TcpListener>>> for ClientAddr {
    fn connect_info(stream: axum::serve::IncomingStream<'_, IdleListener<TcpListener>>) -> ClientAddr {
        ClientAddr(*stream.remote_addr())
    }
}

impl axum::extract::connect_info::Connected<axum::serve::IncomingStream<'_, IdleListener<TlsListener>>> for ClientAddr {
    fn connect_info(stream: axum::serve::IncomingStream<'_, IdleListener<TlsListener>>) -> ClientAddr {
        ClientAddr(*stream.remote_addr())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    type TestResult = Result<(), Box<dyn std::error::Error>>;

    /// A self-signed CA's PEM and a certificate for 127.0.0.1 it signed, with its key's PEM.
    fn pki() -> Result<(String, String, String), rcgen::Error> {
        let mut ca_params = rcgen::CertificateParams::new(Vec::<String>::new())?;
        ca_params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        let ca = rcgen::CertifiedIssuer::self_signed(ca_params, rcgen::KeyPair::generate()?)?;
        let key = rcgen::KeyPair::generate()?;
        let cert = rcgen::CertificateParams::new(vec!["127.0.0.1".to_string()])?.signed_by(&key, &ca)?;
        Ok((ca.pem(), cert.pem(), key.serialize_pem()))
    }

    fn write(dir: &Path, name: &str, text: &str) -> std::io::Result<PathBuf> {
        let path = dir.join(name);
        std::fs::write(&path, text)?;
        Ok(path)
    }

    #[test]
    fn a_certificate_its_key_and_a_ca_load() -> TestResult {
        let dir = tempfile::tempdir()?;
        let (ca, cert, key) = pki()?;
        let tls = NodeTls::load(
            &write(dir.path(), "cert.pem", &cert)?,
            &write(dir.path(), "key.pem", &key)?,
            &write(dir.path(), "ca.pem", &ca)?,
        )?;
        assert_eq!(tls.ca_pem(), ca.as_bytes());
        assert_eq!(tls.http_roots()?.len(), 1);
        Ok(())
    }

    #[test]
    fn a_certificate_is_checked_against_the_ca_and_the_advertised_hosts() -> TestResult {
        let dir = tempfile::tempdir()?;
        let (ca, cert, key) = pki()?;
        let (other_ca, _, _) = pki()?;
        let (cert, key) = (write(dir.path(), "cert.pem", &cert)?, write(dir.path(), "key.pem", &key)?);
        let tls = NodeTls::load(&cert, &key, &write(dir.path(), "ca.pem", &ca)?)?;
        tls.check_valid_for(&["127.0.0.1:9091", "127.0.0.1:8081"])?;
        let elsewhere =
            tls.check_valid_for(&["127.0.0.1:9091", "127.0.0.2:8081"]).err().ok_or("another host passed")?;
        assert!(elsewhere.to_string().contains("at 127.0.0.2:8081"), "{elsewhere}");
        let untrusted = NodeTls::load(&cert, &key, &write(dir.path(), "other-ca.pem", &other_ca)?)?
            .check_valid_for(&["127.0.0.1:9091"])
            .err()
            .ok_or("a certificate of another CA passed")?;
        // Both test CAs bear rcgen's default name, so the check fails on the signature.
        assert!(untrusted.to_string().contains("invalid peer certificate"), "{untrusted}");
        assert_eq!(host_of("[::1]:9091"), "::1");
        assert_eq!(host_of("node-1.example:9091"), "node-1.example");
        Ok(())
    }

    #[test]
    fn a_key_of_another_certificate_is_refused_naming_both_files() -> TestResult {
        let dir = tempfile::tempdir()?;
        let (ca, cert, _) = pki()?;
        let (_, _, other_key) = pki()?;
        let err = NodeTls::load(
            &write(dir.path(), "cert.pem", &cert)?,
            &write(dir.path(), "other-key.pem", &other_key)?,
            &write(dir.path(), "ca.pem", &ca)?,
        )
        .err()
        .ok_or("a key of another certificate was accepted")?
        .to_string();
        assert!(err.contains("other-key.pem") && err.contains("cert.pem"), "{err}");
        Ok(())
    }

    #[test]
    fn files_without_pem_certificates_or_keys_are_refused_by_name() -> TestResult {
        let dir = tempfile::tempdir()?;
        let (ca, cert, key) = pki()?;
        let (cert, key, ca) = (
            write(dir.path(), "cert.pem", &cert)?,
            write(dir.path(), "key.pem", &key)?,
            write(dir.path(), "ca.pem", &ca)?,
        );
        let junk = write(dir.path(), "junk.pem", "not a certificate\n")?;
        for (c, k, a) in [(&junk, &key, &ca), (&cert, &junk, &ca), (&cert, &key, &junk)] {
            let err = NodeTls::load(c, k, a).err().ok_or("junk was accepted")?.to_string();
            assert!(err.contains("junk.pem"), "{err}");
        }
        let missing = dir.path().join("missing.pem");
        let err = NodeTls::load(&missing, &key, &ca).err().ok_or("a missing file was accepted")?.to_string();
        assert!(err.contains("cannot read") && err.contains("missing.pem"), "{err}");
        assert!(client_roots(&junk).is_err());
        assert_eq!(client_roots(&ca)?.len(), 1);
        Ok(())
    }
}
