//! Clearing: deleting every key that matches a glob pattern — `SCAN cursor MATCH pattern COUNT n`
//! on the server, or on every master of a cluster, and `UNLINK` of the keys each page returns —
//! and the pattern that matches exactly one namespace's objects under one key prefix.
//!
//! SCAN is not a snapshot: a key present from the first call to the last is returned (so
//! deleted) at least once, but a key written while the scan runs may or may not be; and the cost
//! is O(keys in the database), since SCAN walks the whole keyspace and MATCH filters on the
//! server. Every exchange is bounded by `io_timeout`, as every other command is.
//!
//! Untrusted replies: each page is bounded as a whole ([`SCAN_REPLY_BYTES_MAX`]) and its shape
//! checked (a cursor of ASCII digits, an array of bulk strings); the number of pages is bounded
//! from `DBSIZE` ([`scan_calls_max`]), so a server whose cursor never ends is an error, not a
//! hang; and a key is deleted only if the caller's own check accepts it too, so a server whose
//! glob differs from Redis' cannot make it delete other keys.

use std::io;
use std::time::Instant;

use crate::client::RemoteClient;
use crate::error::RemoteError;
use crate::metrics::OpCounters;
use crate::node::Node;
use crate::pipeline::{self, Res};
use crate::resp::{Conn, Reply};

/// `COUNT` of each `SCAN` call: keys the server looks at per call (a hint, not a bound).
pub const SCAN_COUNT: u64 = 1000;
/// Largest `SCAN` page read (keys and overhead together).
pub const SCAN_REPLY_BYTES_MAX: usize = 16 << 20;
/// `SCAN` calls allowed on top of the 16 per `SCAN_COUNT` keys `DBSIZE` reported at the start.
pub const SCAN_CALLS_SLACK: u64 = 4096;

/// Most `SCAN` calls on a server that held `dbsize` keys at the start: a full iteration takes
/// about `2 * dbsize / SCAN_COUNT` calls (Redis visits at least `COUNT` keys, or `10 * COUNT`
/// empty buckets, per call), so this allows the database to grow eightfold during the clear.
pub fn scan_calls_max(dbsize: u64) -> u64 {
    SCAN_CALLS_SLACK.saturating_add((dbsize / SCAN_COUNT + 1).saturating_mul(16))
}

/// `literal` as a Redis glob that matches exactly it: `* ? [ ] \` are escaped with `\`.
pub fn glob_escape(literal: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(literal.len() + 8);
    for &b in literal {
        if matches!(b, b'*' | b'?' | b'[' | b']' | b'\\') {
            out.push(b'\\');
        }
        out.push(b);
    }
    out
}

/// The glob of every object of `namespace` under `prefix` (see [`crate::tier::key_name`]):
/// `<prefix escaped><namespace:032x>:` then exactly 32 lowercase hex digits. The fixed length
/// means no key of another prefix can match, even one that starts with this prefix and
/// namespace (its key names are longer).
pub fn namespace_pattern(prefix: &str, namespace: u128) -> Vec<u8> {
    let mut pattern = glob_escape(prefix.as_bytes());
    pattern.extend_from_slice(format!("{namespace:032x}:").as_bytes());
    for _ in 0..32 {
        pattern.extend_from_slice(b"[0-9a-f]");
    }
    pattern
}

/// Whether `name` is the name of an object of `namespace` under `prefix`: the same set of names
/// as [`namespace_pattern`] matches, checked on the client.
pub fn is_namespace_key(prefix: &str, namespace: u128, name: &[u8]) -> bool {
    let head = format!("{prefix}{namespace:032x}:");
    name.len() == head.len() + 32
        && name.starts_with(head.as_bytes())
        && name[head.len()..].iter().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
}

/// A target check for [`RemoteClient::delete_matching`].
pub type IsTarget<'f> = dyn Fn(&[u8]) -> bool + Sync + 'f;

impl RemoteClient {
    /// Deletes (`UNLINK`) every key of the server, or of every master of a cluster, that
    /// `SCAN .. MATCH pattern` returns and `is_target` accepts; returns how many it deleted.
    /// `pattern` is a Redis glob (escape literal parts with [`glob_escape`]); `is_target` is
    /// the same test on the client, so a server that matches differently deletes nothing else.
    ///
    /// Every master is tried, then the first failure is returned: a node down or unreachable
    /// ([`RemoteError::Down`], [`RemoteError::Io`]), a reply that is not what `DBSIZE`, `SCAN`
    /// or `UNLINK` must answer, an error reply (an ACL refusing `SCAN`, a slot moved), or hash
    /// slots no known master serves ([`RemoteError::Protocol`]). Matching keys may remain then
    /// (those of the failed node); calling again is safe.
    pub fn delete_matching(&self, pattern: &[u8], is_target: &IsTarget<'_>) -> Result<u64, RemoteError> {
        let (nodes, uncovered) = self.masters()?;
        let results: Vec<Result<u64, RemoteError>> = if nodes.len() == 1 {
            vec![self.delete_matching_on(&nodes[0], pattern, is_target)]
        } else {
            std::thread::scope(|s| {
                let handles: Vec<_> = nodes
                    .iter()
                    .map(|node| s.spawn(move || self.delete_matching_on(node, pattern, is_target)))
                    .collect();
                handles.into_iter().map(|h| h.join().expect("a clear thread panicked")).collect()
            })
        };
        let mut deleted = 0;
        let mut first_error = None;
        for result in results {
            match result {
                Ok(n) => deleted += n,
                Err(e) => {
                    first_error.get_or_insert(e);
                }
            }
        }
        if uncovered > 0 {
            first_error.get_or_insert(RemoteError::Protocol {
                endpoint: "cluster".into(),
                reason: format!("{uncovered} hash slots have no known master; their keys were not cleared"),
            });
        }
        first_error.map_or(Ok(deleted), Err)
    }

    /// [`delete_matching`](Self::delete_matching) on one node, over one pooled connection.
    fn delete_matching_on(
        &self,
        node: &Node,
        pattern: &[u8],
        is_target: &IsTarget<'_>,
    ) -> Result<u64, RemoteError> {
        let del = &self.counters().del;
        // An error reply leaves the connection in step (checked in); an I/O error drops it.
        let result =
            node.run(self.settings(), self.counters(), |conn| unlink_pages(conn, pattern, is_target, del))?;
        let endpoint = node.endpoint.to_string();
        match result {
            Ok(Ok(deleted)) => Ok(deleted),
            Ok(Err(reason)) => Err(RemoteError::Protocol { endpoint, reason }),
            Err(e) => {
                let reason = e.to_string();
                Err(if e.kind() == io::ErrorKind::InvalidData {
                    RemoteError::Protocol { endpoint, reason }
                } else {
                    RemoteError::Io { endpoint, reason }
                })
            }
        }
    }
}

fn invalid(msg: String) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, msg)
}

/// The SCAN/UNLINK loop on one connection: `Ok(Ok(deleted))`, `Ok(Err(reason))` after an error
/// reply (the connection stays usable), `Err` on I/O failure or a malformed reply.
fn unlink_pages(
    conn: &mut Conn,
    pattern: &[u8],
    is_target: &IsTarget<'_>,
    del: &OpCounters,
) -> io::Result<Result<u64, String>> {
    conn.write_command(&[b"DBSIZE"])?;
    conn.flush()?;
    let calls_max = match conn.read_reply()? {
        Reply::Int(n) if n >= 0 => scan_calls_max(n as u64),
        Reply::Error(e) => return Ok(Err(format!("DBSIZE answered {e}"))),
        other => return Err(invalid(format!("DBSIZE answered {other:?}; expected an integer"))),
    };
    let count = SCAN_COUNT.to_string();
    let mut cursor = b"0".to_vec();
    let mut deleted = 0;
    for _ in 0..calls_max {
        conn.write_command(&[b"SCAN", &cursor, b"MATCH", pattern, b"COUNT", count.as_bytes()])?;
        conn.flush()?;
        let Page { cursor: next, keys } = match scan_page(conn.read_reply_within(SCAN_REPLY_BYTES_MAX)?)? {
            Ok(page) => page,
            Err(e) => return Ok(Err(format!("SCAN answered {e}"))),
        };
        let names: Vec<&[u8]> = keys.iter().map(|k| &k[..]).filter(|k| is_target(k)).collect();
        if !names.is_empty() {
            let start = Instant::now();
            let mut out = vec![Res::Failed; names.len()];
            pipeline::unlink(conn, &names, &mut out)?;
            del.record(names.len(), 0, start.elapsed());
            for r in out {
                match r {
                    Res::Bool(gone) => deleted += u64::from(gone),
                    Res::Redirect => {
                        return Ok(Err("UNLINK was redirected: a slot moved during the clear".into()))
                    }
                    other => return Ok(Err(format!("UNLINK answered {other:?}"))),
                }
            }
        }
        if next == b"0" {
            return Ok(Ok(deleted));
        }
        cursor = next;
    }
    Err(invalid(format!(
        "SCAN did not end within {calls_max} calls (the database grew more than eightfold, or the \
         server never ends its cursor)"
    )))
}

/// One page of a `SCAN`: the cursor of the next call (`0`: done) and the keys listed.
#[derive(Debug, PartialEq, Eq)]
struct Page {
    cursor: Vec<u8>,
    keys: Vec<Vec<u8>>,
}

/// A `SCAN` reply: `Ok(Ok(page))`, `Ok(Err(text))` for an error reply, `Err` for anything else
/// than `[cursor digits, [bulk strings]]`.
fn scan_page(reply: Reply) -> io::Result<Result<Page, String>> {
    let parts = match reply {
        Reply::Array(Some(parts)) if parts.len() == 2 => parts,
        Reply::Error(e) => return Ok(Err(e)),
        other => return Err(invalid(format!("SCAN answered {other:?}; expected [cursor, keys]"))),
    };
    let mut parts = parts.into_iter();
    let (Some(Reply::Bulk(Some(cursor))), Some(Reply::Array(Some(items)))) = (parts.next(), parts.next())
    else {
        return Err(invalid("SCAN answered a page that is not [cursor, keys]".into()));
    };
    if cursor.is_empty() || cursor.len() > 20 || !cursor.iter().all(u8::is_ascii_digit) {
        return Err(invalid(format!(
            "SCAN cursor {:?} is not a decimal number",
            String::from_utf8_lossy(&cursor)
        )));
    }
    let keys = items
        .into_iter()
        .map(|item| match item {
            Reply::Bulk(Some(key)) => Ok(key),
            other => Err(invalid(format!("SCAN listed {other:?}; expected key names"))),
        })
        .collect::<io::Result<Vec<_>>>()?;
    Ok(Ok(Page { cursor, keys }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn escapes_every_glob_metacharacter() {
        assert_eq!(glob_escape(b"a*b?c[x]d\\e:"), b"a\\*b\\?c\\[x\\]d\\\\e:".to_vec());
        assert_eq!(glob_escape("ключ^-!".as_bytes()), "ключ^-!".as_bytes().to_vec());
    }

    #[test]
    fn namespace_pattern_and_check_agree_on_names() {
        let name = crate::tier::key_name("kv*:", 7, 0xabc);
        let pattern = namespace_pattern("kv*:", 7);
        let expected = format!("kv\\*:{:032x}:{}", 7, "[0-9a-f]".repeat(32));
        assert_eq!(pattern, expected.into_bytes());
        assert!(is_namespace_key("kv*:", 7, &name));
        assert!(!is_namespace_key("kv*:", 8, &name), "another namespace");
        assert!(!is_namespace_key("kv", 7, &name), "a shorter prefix");
        assert!(!is_namespace_key("kv*:", 7, &name[..name.len() - 1]), "a shorter name");
        let mut longer = name.clone();
        longer.push(b'0');
        assert!(!is_namespace_key("kv*:", 7, &longer), "a longer name");
        let mut upper = name.clone();
        *upper.last_mut().unwrap() = b'C';
        assert!(!is_namespace_key("kv*:", 7, &upper), "not a key name (upper-case hex)");
        // A prefix that extends this one by a namespace and `:` holds longer names.
        let nested = crate::tier::key_name(&format!("kv*:{:032x}:", 7), 7, 1);
        assert!(!is_namespace_key("kv*:", 7, &nested));
    }

    #[test]
    fn scan_pages_are_checked() {
        let bulk = |b: &[u8]| Reply::Bulk(Some(b.to_vec()));
        let page = |cursor: Reply, keys: Reply| Reply::Array(Some(vec![cursor, keys]));
        let ok = scan_page(page(bulk(b"17"), Reply::Array(Some(vec![bulk(b"k")])))).unwrap().unwrap();
        assert_eq!(ok, Page { cursor: b"17".to_vec(), keys: vec![b"k".to_vec()] });
        assert_eq!(scan_page(Reply::Error("NOPERM".into())).unwrap(), Err("NOPERM".to_string()));
        let bad = [
            page(bulk(b"1x"), Reply::Array(Some(vec![]))),
            page(bulk(b""), Reply::Array(Some(vec![]))),
            page(bulk(&[b'9'; 21]), Reply::Array(Some(vec![]))),
            page(Reply::Int(0), Reply::Array(Some(vec![]))),
            page(bulk(b"0"), Reply::Array(None)),
            page(bulk(b"0"), Reply::Array(Some(vec![Reply::Int(3)]))),
            page(bulk(b"0"), Reply::Array(Some(vec![Reply::Bulk(None)]))),
            Reply::Array(Some(vec![bulk(b"0")])),
            Reply::Status("OK".into()),
        ];
        for reply in bad {
            assert!(scan_page(reply.clone()).is_err(), "{reply:?}");
        }
    }

    #[test]
    fn scan_calls_are_bounded_but_allow_growth() {
        assert_eq!(scan_calls_max(0), SCAN_CALLS_SLACK + 16);
        assert!(scan_calls_max(1_000_000) >= 8 * 2 * 1_000_000 / SCAN_COUNT);
        assert!(scan_calls_max(u64::MAX) >= u64::MAX / SCAN_COUNT, "saturates, no overflow");
    }
}
