//! Certificates for clusters started with TLS (`ClusterOptions::tls`): a CA made for the
//! test, and one node certificate, signed by it, for every loopback name the harness uses.

use std::path::Path;
use std::path::PathBuf;

use crate::Error;
use crate::Result;

/// A CA and a node certificate it signed, as PEM text.
#[derive(Clone, Debug)]
pub struct TestPki {
    pub ca_pem: String,
    pub cert_pem: String,
    pub key_pem: String,
}

/// The files `logdex serve` reads (`--tls-cert-file`, `--tls-key-file`, `--tls-ca-file`).
#[derive(Clone, Debug)]
pub struct TlsFiles {
    pub cert: PathBuf,
    pub key: PathBuf,
    pub ca: PathBuf,
}

fn pki_error(e: rcgen::Error) -> Error {
    Error::Check(format!("cannot make test certificates: {e}"))
}

impl TestPki {
    /// A fresh CA named `ca_name`, and a node certificate for `localhost`, 127.0.0.1 and the
    /// proxied nodes' addresses (127.0.0.10 to 127.0.0.40).
    pub fn generate(ca_name: &str) -> Result<TestPki> {
        let mut ca_params = rcgen::CertificateParams::new(Vec::<String>::new()).map_err(pki_error)?;
        ca_params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        ca_params.distinguished_name.push(rcgen::DnType::CommonName, ca_name);
        let ca = rcgen::CertifiedIssuer::self_signed(ca_params, rcgen::KeyPair::generate().map_err(pki_error)?)
            .map_err(pki_error)?;
        let mut names = vec!["localhost".to_string(), "127.0.0.1".to_string()];
        names.extend((10..=40).map(|i| format!("127.0.0.{i}")));
        let mut params = rcgen::CertificateParams::new(names).map_err(pki_error)?;
        params.distinguished_name.push(rcgen::DnType::CommonName, "logdex node");
        let key = rcgen::KeyPair::generate().map_err(pki_error)?;
        let cert = params.signed_by(&key, &ca).map_err(pki_error)?;
        Ok(TestPki { ca_pem: ca.pem(), cert_pem: cert.pem(), key_pem: key.serialize_pem() })
    }

    /// Writes the three PEM files into `dir` (created if missing).
    pub fn write(&self, dir: &Path) -> Result<TlsFiles> {
        std::fs::create_dir_all(dir).map_err(|e| Error::io(format!("creating {}", dir.display()), e))?;
        let files = TlsFiles { cert: dir.join("node.pem"), key: dir.join("node-key.pem"), ca: dir.join("ca.pem") };
        for (path, text) in [(&files.cert, &self.cert_pem), (&files.key, &self.key_pem), (&files.ca, &self.ca_pem)] {
            std::fs::write(path, text).map_err(|e| Error::io(format!("writing {}", path.display()), e))?;
        }
        Ok(files)
    }
}
