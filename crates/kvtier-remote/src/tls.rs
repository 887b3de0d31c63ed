//! TLS for `rediss://` URLs: rustls with the `ring` provider (feature `tls`, on by default).
//!
//! The client config is built once at start from [`TlsConfig`] (CA file or the compiled-in
//! Mozilla roots, optional client certificate), so an unreadable file is a configuration error
//! then. Each connection completes its handshake in [`TlsClient::connect`], so a certificate the
//! CA does not vouch for (or a name mismatch) surfaces at start as [`RemoteError::Tls`], not as
//! a stream of misses.

use std::io;
use std::net::TcpStream;

use crate::config::TlsConfig;
use crate::error::RemoteError;

#[cfg(feature = "tls")]
mod imp {
    use std::io::{self, BufReader};
    use std::net::TcpStream;
    use std::sync::Arc;

    use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
    use rustls::{ClientConfig, ClientConnection, RootCertStore, StreamOwned};

    use crate::config::TlsConfig;
    use crate::error::RemoteError;

    pub type TlsStream = StreamOwned<ClientConnection, TcpStream>;

    fn bad(message: String) -> RemoteError {
        RemoteError::Config(message)
    }

    fn open(path: &str, what: &str) -> Result<BufReader<std::fs::File>, RemoteError> {
        std::fs::File::open(path)
            .map(BufReader::new)
            .map_err(|e| bad(format!("tls {what} {path:?} cannot be read: {e}; expected a PEM file")))
    }

    fn certs(path: &str, what: &str) -> Result<Vec<CertificateDer<'static>>, RemoteError> {
        let certs: Vec<_> = rustls_pemfile::certs(&mut open(path, what)?)
            .collect::<Result<_, _>>()
            .map_err(|e| bad(format!("tls {what} {path:?} is not valid PEM: {e}")))?;
        if certs.is_empty() {
            return Err(bad(format!("tls {what} {path:?} holds no certificate; expected PEM certificates")));
        }
        Ok(certs)
    }

    fn key(path: &str) -> Result<PrivateKeyDer<'static>, RemoteError> {
        rustls_pemfile::private_key(&mut open(path, "key_file")?)
            .map_err(|e| bad(format!("tls key_file {path:?} is not valid PEM: {e}")))?
            .ok_or_else(|| bad(format!("tls key_file {path:?} holds no private key; expected a PEM key")))
    }

    /// A TLS client configuration, shared by every connection.
    #[derive(Clone)]
    pub struct TlsClient {
        config: Arc<ClientConfig>,
        server_name: Option<String>,
    }

    impl TlsClient {
        pub fn new(t: &TlsConfig) -> Result<TlsClient, RemoteError> {
            let mut roots = RootCertStore::empty();
            match &t.ca_file {
                Some(path) => {
                    for cert in certs(path, "ca_file")? {
                        roots.add(cert).map_err(|e| bad(format!("tls ca_file {path:?}: {e}")))?;
                    }
                }
                None => roots.extend(webpki_roots::TLS_SERVER_ROOTS.iter().cloned()),
            }
            let provider = Arc::new(rustls::crypto::ring::default_provider());
            let builder = ClientConfig::builder_with_provider(provider)
                .with_safe_default_protocol_versions()
                .map_err(|e| bad(format!("tls: {e}")))?
                .with_root_certificates(roots);
            let config = match (&t.cert_file, &t.key_file) {
                (Some(cert), Some(k)) => builder
                    .with_client_auth_cert(certs(cert, "cert_file")?, key(k)?)
                    .map_err(|e| bad(format!("tls client certificate: {e}")))?,
                _ => builder.with_no_client_auth(),
            };
            Ok(TlsClient { config: Arc::new(config), server_name: t.server_name.clone() })
        }

        /// Wraps a connected socket and completes the handshake.
        pub fn connect(&self, host: &str, mut tcp: TcpStream) -> io::Result<TlsStream> {
            let name = self.server_name.as_deref().unwrap_or(host).to_string();
            let server_name = ServerName::try_from(name.clone()).map_err(|e| {
                io::Error::new(io::ErrorKind::InvalidInput, format!("tls server name {name:?}: {e}"))
            })?;
            let mut conn = ClientConnection::new(self.config.clone(), server_name)
                .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))?;
            while conn.is_handshaking() {
                conn.complete_io(&mut tcp)?;
            }
            Ok(StreamOwned::new(conn, tcp))
        }
    }

    pub fn is_tls_error(e: &io::Error) -> bool {
        e.get_ref().is_some_and(|inner| inner.is::<rustls::Error>())
    }
}

#[cfg(not(feature = "tls"))]
mod imp {
    use std::io;
    use std::net::TcpStream;

    use crate::config::TlsConfig;
    use crate::error::RemoteError;

    /// Never constructed without the `tls` feature.
    pub type TlsStream = TcpStream;

    #[derive(Clone)]
    pub struct TlsClient;

    impl TlsClient {
        pub fn new(_: &TlsConfig) -> Result<TlsClient, RemoteError> {
            Err(RemoteError::Config("this kvtier build has no TLS support (built without `tls`)".into()))
        }

        pub fn connect(&self, _: &str, _: TcpStream) -> io::Result<TlsStream> {
            Err(io::Error::new(io::ErrorKind::Unsupported, "built without TLS"))
        }
    }

    pub fn is_tls_error(_: &io::Error) -> bool {
        false
    }
}

pub use imp::{is_tls_error, TlsClient, TlsStream};

impl std::fmt::Debug for TlsClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("TlsClient")
    }
}

/// The TLS client for a resolved config, or `None` for plain `redis://`.
pub fn client(tls: Option<&TlsConfig>) -> Result<Option<TlsClient>, RemoteError> {
    tls.map(TlsClient::new).transpose()
}

/// Completes a TLS connection over `tcp` (used by [`crate::resp::Conn::connect`]).
pub(crate) fn wrap(client: &TlsClient, host: &str, tcp: TcpStream) -> io::Result<TlsStream> {
    client.connect(host, tcp)
}
