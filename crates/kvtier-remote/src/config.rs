//! Remote tier configuration: server URLs, credentials, timeouts and bounds, validated once at
//! start ([`RemoteConfig::resolve`]) so that a wrong setting is a clear error there, never a
//! stream of misses later.

use std::time::Duration;

use crate::error::{bad, RemoteError};
pub use crate::url::{parse_url, redact_url, Credentials, Endpoint, ParsedUrl};

/// Default connect timeout: 1 s.
pub const CONNECT_TIMEOUT_DEFAULT: Duration = Duration::from_secs(1);
/// Default read/write timeout of one socket operation: 5 s (a 4 MiB value on a slow link).
pub const IO_TIMEOUT_DEFAULT: Duration = Duration::from_secs(5);
/// Default first reconnect delay after a failure: 50 ms, doubling up to the max.
pub const RECONNECT_BACKOFF_MIN_DEFAULT: Duration = Duration::from_millis(50);
/// Default longest reconnect delay: 2 s.
pub const RECONNECT_BACKOFF_MAX_DEFAULT: Duration = Duration::from_secs(2);
/// Default bound on value bytes in flight per pipeline (sent and not yet answered): 64 MiB.
pub const INFLIGHT_BYTES_MAX_DEFAULT: u64 = 64 << 20;
/// Default bound on connections per server node: 8.
pub const CONNECTIONS_PER_NODE_DEFAULT: usize = 8;
/// Largest `connections_per_node_max` accepted.
pub const CONNECTIONS_PER_NODE_LIMIT: usize = 256;
/// Longest timeout or backoff accepted: 1 hour.
pub const DURATION_MAX: Duration = Duration::from_secs(3600);
/// Longest TTL accepted: 10 years (Redis takes seconds as a signed 64-bit integer).
pub const TTL_MAX: Duration = Duration::from_secs(10 * 365 * 24 * 3600);
/// Longest key prefix accepted, in bytes.
pub const KEY_PREFIX_BYTES_MAX: usize = 256;
/// Most seed URLs accepted.
pub const URLS_MAX: usize = 64;

/// TLS settings, used with `rediss://` URLs (TLS is on exactly when the URLs say `rediss://`).
/// Built with the `tls` feature (default): rustls, server certificates verified against
/// `ca_file` or, without one, the Mozilla root store compiled in. Without the feature any TLS
/// setting is a configuration error at start that says so, never a silently unencrypted link.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TlsConfig {
    /// PEM file of the CA that signed the server certificate (default: system roots).
    pub ca_file: Option<String>,
    /// PEM client certificate and key (mutual TLS).
    pub cert_file: Option<String>,
    pub key_file: Option<String>,
    /// Name to verify in the server certificate (default: the URL's host).
    pub server_name: Option<String>,
}

/// How to reach the Redis/Valkey server (or cluster) and how to talk to it. Its `Debug` shows
/// URLs with passwords redacted and never the password field.
#[derive(Clone, PartialEq, Eq)]
pub struct RemoteConfig {
    /// `redis://[user[:password]@]host[:port][/db]`; `rediss://` asks for TLS. In cluster mode,
    /// one or more seed nodes (the rest are discovered with `CLUSTER SLOTS`).
    pub urls: Vec<String>,
    /// Redis Cluster (keys spread over masters by hash slot) instead of one server.
    pub cluster: bool,
    /// ACL user (`AUTH user password`); overrides the URL's. `None` with a password: `default`.
    pub username: Option<String>,
    /// Password; overrides the URL's.
    pub password: Option<String>,
    /// Expiry of every stored object (`SET .. EX`), counted from the write that created it.
    /// `None`: no expiry (the server's `maxmemory-policy` decides).
    pub ttl: Option<Duration>,
    pub connect_timeout: Duration,
    /// Read and write timeout of each socket operation.
    pub io_timeout: Duration,
    /// After a failure, a node is not tried again for this long, doubling per failure up to
    /// `reconnect_backoff_max`; meanwhile its keys are (counted) misses.
    pub reconnect_backoff_min: Duration,
    pub reconnect_backoff_max: Duration,
    /// Value bytes a pipeline may have sent without their replies (bounds both client and
    /// server buffers); at least one object is always allowed.
    pub inflight_bytes_max: u64,
    /// Connections kept per server node (concurrent batches beyond it wait).
    pub connections_per_node_max: usize,
    /// Keys are `<key_prefix><namespace hex>:<block key hex>`.
    pub key_prefix: String,
    pub tls: Option<TlsConfig>,
}

impl Default for RemoteConfig {
    fn default() -> Self {
        RemoteConfig {
            urls: vec!["redis://127.0.0.1:6379".to_string()],
            cluster: false,
            username: None,
            password: None,
            ttl: None,
            connect_timeout: CONNECT_TIMEOUT_DEFAULT,
            io_timeout: IO_TIMEOUT_DEFAULT,
            reconnect_backoff_min: RECONNECT_BACKOFF_MIN_DEFAULT,
            reconnect_backoff_max: RECONNECT_BACKOFF_MAX_DEFAULT,
            inflight_bytes_max: INFLIGHT_BYTES_MAX_DEFAULT,
            connections_per_node_max: CONNECTIONS_PER_NODE_DEFAULT,
            key_prefix: "kvtier:".to_string(),
            tls: None,
        }
    }
}

impl std::fmt::Debug for RemoteConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let urls: Vec<String> = self.urls.iter().map(|u| redact_url(u)).collect();
        f.debug_struct("RemoteConfig")
            .field("urls", &urls)
            .field("cluster", &self.cluster)
            .field("username", &self.username)
            .field("password", &self.password.as_ref().map(|_| "***"))
            .field("ttl", &self.ttl)
            .field("connect_timeout", &self.connect_timeout)
            .field("io_timeout", &self.io_timeout)
            .field("reconnect_backoff_min", &self.reconnect_backoff_min)
            .field("reconnect_backoff_max", &self.reconnect_backoff_max)
            .field("inflight_bytes_max", &self.inflight_bytes_max)
            .field("connections_per_node_max", &self.connections_per_node_max)
            .field("key_prefix", &self.key_prefix)
            .field("tls", &self.tls)
            .finish()
    }
}

/// A validated config: endpoints parsed, credentials resolved.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Resolved {
    pub seeds: Vec<Endpoint>,
    pub db: u32,
    pub credentials: Credentials,
    /// TLS settings when the URLs are `rediss://`.
    pub tls: Option<TlsConfig>,
}

fn check_duration(name: &str, d: Duration, zero_ok: bool) -> Result<(), RemoteError> {
    if (!zero_ok && d.is_zero()) || d > DURATION_MAX {
        return bad(format!("{name} is {d:?}; expected more than 0 and at most {DURATION_MAX:?}"));
    }
    Ok(())
}

impl RemoteConfig {
    /// A single-server config for `url`, other settings default.
    pub fn single(url: &str) -> Self {
        RemoteConfig { urls: vec![url.to_string()], ..RemoteConfig::default() }
    }

    /// Validates every field and parses the URLs.
    pub fn resolve(&self) -> Result<Resolved, RemoteError> {
        if self.urls.is_empty() || self.urls.len() > URLS_MAX {
            return bad(format!("urls has {} entries; expected 1 to {URLS_MAX}", self.urls.len()));
        }
        if !self.cluster && self.urls.len() != 1 {
            return bad(format!(
                "urls has {} entries but cluster is false; expected exactly one server URL \
                 (or cluster: true with seed nodes)",
                self.urls.len()
            ));
        }
        let parsed: Vec<ParsedUrl> = self.urls.iter().map(|u| parse_url(u)).collect::<Result<_, _>>()?;
        let tls_urls = parsed.iter().filter(|p| p.tls).count();
        if tls_urls != 0 && tls_urls != parsed.len() {
            return bad("urls mix redis:// and rediss://; expected one scheme for all".to_string());
        }
        if tls_urls == 0 && self.tls.is_some() {
            return bad(
                "tls settings were given but the urls are redis://; expected rediss:// urls for TLS".into()
            );
        }
        if tls_urls != 0 && !cfg!(feature = "tls") {
            return bad("TLS was asked for (rediss://), but this kvtier build has no TLS support (built \
                 without the `tls` feature); expected redis:// on a trusted network, or a build with TLS"
                .to_string());
        }
        let tls = (tls_urls != 0).then(|| self.tls.clone().unwrap_or_default());
        if let Some(t) = &tls {
            if t.cert_file.is_some() != t.key_file.is_some() {
                return bad(
                    "tls cert_file and key_file go together (mutual TLS); expected both or neither".into()
                );
            }
        }
        let db = parsed[0].db;
        if parsed.iter().any(|p| p.db != db) {
            return bad("urls name different databases; expected one database for all".to_string());
        }
        if self.cluster && db != 0 {
            return bad(format!(
                "cluster url names database {db}; expected database 0 (the only one Redis Cluster has)"
            ));
        }
        let mut credentials = parsed[0].credentials.clone();
        if self.username.is_some() {
            credentials.username = self.username.clone();
        }
        if self.password.is_some() {
            credentials.password = self.password.clone();
        }
        if credentials.username.is_some() && credentials.password.is_none() {
            return bad("a username was given without a password; expected both (AUTH user password)".into());
        }
        if let Some(ttl) = self.ttl {
            if ttl < Duration::from_secs(1) || ttl > TTL_MAX {
                return bad(format!("ttl is {ttl:?}; expected None or 1 s to {TTL_MAX:?} (whole seconds)"));
            }
        }
        check_duration("connect_timeout", self.connect_timeout, false)?;
        check_duration("io_timeout", self.io_timeout, false)?;
        check_duration("reconnect_backoff_min", self.reconnect_backoff_min, false)?;
        check_duration("reconnect_backoff_max", self.reconnect_backoff_max, false)?;
        if self.reconnect_backoff_max < self.reconnect_backoff_min {
            return bad(format!(
                "reconnect_backoff_max ({:?}) is below reconnect_backoff_min ({:?}); expected max >= min",
                self.reconnect_backoff_max, self.reconnect_backoff_min
            ));
        }
        if self.inflight_bytes_max == 0 {
            return bad("inflight_bytes_max is 0; expected a positive number of bytes".into());
        }
        if self.connections_per_node_max == 0 || self.connections_per_node_max > CONNECTIONS_PER_NODE_LIMIT {
            return bad(format!(
                "connections_per_node_max is {}; expected 1 to {CONNECTIONS_PER_NODE_LIMIT}",
                self.connections_per_node_max
            ));
        }
        if self.key_prefix.len() > KEY_PREFIX_BYTES_MAX
            || self.key_prefix.bytes().any(|b| b.is_ascii_whitespace() || b.is_ascii_control())
            || self.key_prefix.contains(['{', '}'])
        {
            return bad(format!(
                "key_prefix {:?} is not usable; expected at most {KEY_PREFIX_BYTES_MAX} bytes without \
                 whitespace, control characters or braces (braces are cluster hash tags)",
                self.key_prefix
            ));
        }
        let mut seeds: Vec<Endpoint> = parsed.into_iter().map(|p| p.endpoint).collect();
        seeds.dedup();
        Ok(Resolved { seeds, db, credentials, tls })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn validates_fields() {
        let ok = RemoteConfig::single("redis://127.0.0.1:1");
        assert!(ok.resolve().is_ok());
        let cases = [
            RemoteConfig { urls: vec![], ..ok.clone() },
            RemoteConfig { urls: vec!["redis://a".into(), "redis://b".into()], ..ok.clone() },
            RemoteConfig { urls: vec!["rediss://a".into(), "redis://b".into()], cluster: true, ..ok.clone() },
            RemoteConfig { tls: Some(TlsConfig::default()), ..ok.clone() },
            RemoteConfig {
                urls: vec!["rediss://a".into()],
                tls: Some(TlsConfig { cert_file: Some("c.pem".into()), ..TlsConfig::default() }),
                ..ok.clone()
            },
            RemoteConfig { ttl: Some(Duration::from_millis(10)), ..ok.clone() },
            RemoteConfig { connect_timeout: Duration::ZERO, ..ok.clone() },
            RemoteConfig { reconnect_backoff_max: Duration::from_millis(1), ..ok.clone() },
            RemoteConfig { inflight_bytes_max: 0, ..ok.clone() },
            RemoteConfig { key_prefix: "a{b}".into(), ..ok.clone() },
            RemoteConfig { username: Some("u".into()), ..ok.clone() },
            RemoteConfig { cluster: true, urls: vec!["redis://a/2".into()], ..ok.clone() },
        ];
        for c in cases {
            let e = c.resolve().unwrap_err().to_string();
            assert!(e.contains("expected") || e.contains("TLS"), "{e}");
        }
    }
}
