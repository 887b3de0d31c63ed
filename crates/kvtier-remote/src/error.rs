//! Errors of the remote tier. Only configuration and start-up failures the caller must fix
//! (bad URL, wrong password, TLS asked of a build without it) are errors a user sees; a server
//! that is down or answers garbage during serving is a counted miss.

use thiserror::Error;

#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[non_exhaustive]
pub enum RemoteError {
    /// A setting is wrong; the message names it and what was expected.
    #[error("invalid remote config: {0}")]
    Config(String),
    /// The server refused the credentials (`AUTH`), at start.
    #[error("remote {endpoint}: authentication failed for user {user:?}: {reply}; expected the server's password (and user) in the remote config")]
    Auth { endpoint: String, user: String, reply: String },
    /// The TLS handshake failed (certificate not trusted, name mismatch, protocol), at start.
    #[error("remote {endpoint}: TLS handshake failed: {reason}; expected a server certificate the configured CA (tls ca_file) vouches for, under the URL's host name (or tls server_name)")]
    Tls { endpoint: String, reason: String },
    /// Connecting or talking to a server failed (the tier turns this into misses while serving).
    #[error("remote {endpoint}: {reason}")]
    Io { endpoint: String, reason: String },
    /// The server answered something this client does not expect.
    #[error("remote {endpoint}: unexpected reply: {reason}")]
    Protocol { endpoint: String, reason: String },
    /// The server is in reconnect backoff: not tried now.
    #[error("remote {endpoint}: down (next reconnect attempt in {retry_in_ms} ms)")]
    Down { endpoint: String, retry_in_ms: u64 },
}

/// A [`RemoteError::Config`] with `message`, as an `Err`.
pub(crate) fn bad<T>(message: String) -> Result<T, RemoteError> {
    Err(RemoteError::Config(message))
}
