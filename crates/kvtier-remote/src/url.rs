//! Redis URLs: `redis://[user[:password]@]host[:port][/db]` (`rediss://` for TLS) parsed into an
//! endpoint, a database and credentials, and the one redaction rule every message, `repr` and
//! log line shows a URL by ([`redact_url`]). Parser and redaction agree on where the user
//! information ends (the last `@`), so a parse error only ever quotes what the redaction shows.

use crate::error::{bad, RemoteError};

/// A server address.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Endpoint {
    pub host: String,
    pub port: u16,
}

impl std::fmt::Display for Endpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.host.contains(':') {
            write!(f, "[{}]:{}", self.host, self.port)
        } else {
            write!(f, "{}:{}", self.host, self.port)
        }
    }
}

/// Credentials sent with `AUTH` on every new connection. `Debug` never shows the password.
#[derive(Clone, Default, PartialEq, Eq)]
pub struct Credentials {
    pub username: Option<String>,
    pub password: Option<String>,
}

impl std::fmt::Debug for Credentials {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Credentials")
            .field("username", &self.username)
            .field("password", &self.password.as_ref().map(|_| "***"))
            .finish()
    }
}

/// `url` with the password of its user information, and any `?query`, replaced by `***`
/// (`redis://alice:***@h`, `redis://:***@h`), for every message and display that shows a URL.
/// Malformed URLs are the ones messages show: the user information is everything before the
/// last `@`, even past a `/` (a password may hold one).
pub fn redact_url(url: &str) -> String {
    let (scheme, rest) = match url.find("://") {
        Some(i) => url.split_at(i + 3),
        None => ("", url),
    };
    let (userinfo, hostpart) = match rest.rfind('@') {
        Some(at) => (Some(&rest[..at]), &rest[at + 1..]),
        None => (None, rest),
    };
    let hostpart = match hostpart.find('?') {
        Some(q) => format!("{}?***", &hostpart[..q]),
        None => hostpart.to_string(),
    };
    match userinfo {
        Some(info) => match info.find(':') {
            Some(i) => format!("{scheme}{}:***@{hostpart}", &info[..i]),
            None => format!("{scheme}{info}@{hostpart}"),
        },
        None => format!("{scheme}{hostpart}"),
    }
}

/// Whether `host` (without brackets) is an IP address or a DNS name: letters, digits, `-`,
/// `_` and dots, labels of 1 to 63 bytes, 253 bytes in all.
pub(crate) fn valid_host(host: &str) -> bool {
    if host.parse::<std::net::IpAddr>().is_ok() {
        return true;
    }
    let name = host.strip_suffix('.').unwrap_or(host);
    !name.is_empty()
        && name.len() <= 253
        && name.split('.').all(|label| {
            (1..=63).contains(&label.len())
                && label.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
        })
}

fn percent_decode(s: &str, what: &str) -> Result<String, RemoteError> {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' {
            let hex = s.get(i + 1..i + 3).and_then(|h| u8::from_str_radix(h, 16).ok());
            let Some(b) = hex else {
                return bad(format!("{what} has a bad %-escape; expected %XX with two hex digits"));
            };
            out.push(b);
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8(out).or_else(|_| bad(format!("{what} is not UTF-8 once %-decoded")))
}

/// Parsed form of one URL.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ParsedUrl {
    pub endpoint: Endpoint,
    pub tls: bool,
    pub db: u32,
    pub credentials: Credentials,
}

/// Parses `redis://[user[:password]@]host[:port][/db]` (or `rediss://`).
pub fn parse_url(url: &str) -> Result<ParsedUrl, RemoteError> {
    let shown = redact_url(url);
    let expected = "expected redis://[user[:password]@]host[:port][/db] or rediss://...";
    let (tls, rest) = if let Some(r) = url.strip_prefix("redis://") {
        (false, r)
    } else if let Some(r) = url.strip_prefix("rediss://") {
        (true, r)
    } else {
        return bad(format!("url {shown:?} has no redis:// or rediss:// scheme; {expected}"));
    };
    // The user information is everything before the last `@`, as `redact_url` takes it: what
    // follows (host, port, database) is what a message may show, so no piece of a password or a
    // query can reach one as a "port" or a "database".
    let (userinfo, after) = match rest.rfind('@') {
        Some(i) => (Some(&rest[..i]), &rest[i + 1..]),
        None => (None, rest),
    };
    if userinfo.is_some_and(|info| info.contains('/')) {
        return bad(format!(
            "url {shown:?} has a '/' before its '@'; write a '/' in the user or password as %2F; {expected}"
        ));
    }
    if after.contains('?') {
        return bad(format!(
            "url {shown:?} has a ?query, which this client does not read; give the password in the \
             url's user information or in remote.password; {expected}"
        ));
    }
    let (hostport, path) = match after.find('/') {
        Some(i) => (&after[..i], &after[i + 1..]),
        None => (after, ""),
    };
    let mut credentials = Credentials::default();
    if let Some(info) = userinfo {
        let (user, password) = match info.find(':') {
            Some(i) => (&info[..i], Some(&info[i + 1..])),
            None => (info, None),
        };
        if !user.is_empty() {
            credentials.username = Some(percent_decode(user, "url user")?);
        }
        if let Some(p) = password {
            credentials.password = Some(percent_decode(p, "url password")?);
        }
    }
    let (host, port) = if let Some(stripped) = hostport.strip_prefix('[') {
        let Some(end) = stripped.find(']') else {
            return bad(format!("url {shown:?} has an unclosed [IPv6] host; {expected}"));
        };
        if stripped[..end].parse::<std::net::Ipv6Addr>().is_err() {
            return bad(format!(
                "url {shown:?} has [{}], which is not an IPv6 address; {expected}",
                &stripped[..end]
            ));
        }
        (&stripped[..end], stripped[end + 1..].strip_prefix(':'))
    } else {
        match hostport.rfind(':') {
            Some(i) => (&hostport[..i], Some(&hostport[i + 1..])),
            None => (hostport, None),
        }
    };
    if host.is_empty() {
        return bad(format!("url {shown:?} has no host; {expected}"));
    }
    if !valid_host(host) {
        return bad(format!(
            "url {shown:?} has host {host:?}, which is neither an IP address nor a DNS name; {expected}"
        ));
    }
    let port = match port {
        None => 6379,
        Some(p) => match p.parse::<u16>() {
            Ok(p) if p > 0 => p,
            _ => return bad(format!("url {shown:?} has port {p:?}; expected 1 to 65535")),
        },
    };
    let db = if path.is_empty() {
        0
    } else {
        match path.parse::<u32>() {
            Ok(db) => db,
            Err(_) => {
                return bad(format!("url {shown:?} has database {path:?}; expected a number such as /0"))
            }
        }
    };
    Ok(ParsedUrl { endpoint: Endpoint { host: host.to_string(), port }, tls, db, credentials })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::RemoteConfig;

    #[test]
    fn parses_urls() {
        let p = parse_url("redis://alice:s%40cret@example.com:7000/3").unwrap();
        assert_eq!(p.endpoint, Endpoint { host: "example.com".into(), port: 7000 });
        assert_eq!(p.db, 3);
        assert_eq!(p.credentials.username.as_deref(), Some("alice"));
        assert_eq!(p.credentials.password.as_deref(), Some("s@cret"));
        let p = parse_url("redis://:pw@[::1]").unwrap();
        assert_eq!(p.endpoint, Endpoint { host: "::1".into(), port: 6379 });
        assert_eq!(p.credentials.username, None);
        assert_eq!(p.credentials.password.as_deref(), Some("pw"));
        assert!(parse_url("rediss://h:1").unwrap().tls);
    }

    #[test]
    fn rejects_bad_urls() {
        for url in [
            "http://h",
            "redis://",
            "redis://h:0",
            "redis://h:70000",
            "redis://h:1/x",
            "redis://[::1",
            "redis://127.0.0.1 :6379",
            "redis://ho\0st:1",
            "redis://a..b",
            "redis://[not-an-ip]:1",
            "redis://h\tx",
        ] {
            assert!(matches!(parse_url(url), Err(RemoteError::Config(_))), "{url}");
        }
        for url in ["redis://my_host-1.example.com.:1", "redis://[fe80::1]", "redis://10.0.0.1"] {
            assert!(parse_url(url).is_ok(), "{url}");
        }
    }

    #[test]
    fn passwords_never_show() {
        assert_eq!(redact_url("redis://alice:s3cret@h:1/2"), "redis://alice:***@h:1/2");
        assert_eq!(redact_url("redis://:s3cret@h"), "redis://:***@h");
        assert_eq!(redact_url("redis://alice@h"), "redis://alice@h");
        assert_eq!(redact_url("redis://h:1/0"), "redis://h:1/0");
        assert_eq!(redact_url("redis://:s3cret/x@h"), "redis://:***@h");
        assert_eq!(redact_url("redis://h/0?password=s3cret"), "redis://h/0?***");
        for url in [
            "redis://:s3cret@h:notaport",
            "redis://:s3cret@h:1/x",
            "http://:s3cret@h",
            "redis://:s3cret@",
            "redis://:s3cret@bad host",
            // A '/' in the password (unescaped): its pieces were read as a port or a database.
            "redis://alice:s3cret/x@h",
            "redis://alice:1/s3cret@h",
            // A query (redis-py's `?password=`): it was read as a database, a host or a port.
            "redis://h/0?password=s3cret",
            "redis://h?password=s3cret",
            "redis://h:1?password=s3cret",
        ] {
            let e = parse_url(url).unwrap_err().to_string();
            assert!(!e.contains("s3cret") && e.contains("***"), "{e}");
        }
        let c =
            RemoteConfig { password: Some("s3cret".into()), ..RemoteConfig::single("redis://u:s3cret@h") };
        let shown = format!("{c:?} {:?}", c.resolve().unwrap());
        assert!(!shown.contains("s3cret"), "{shown}");
    }
}
