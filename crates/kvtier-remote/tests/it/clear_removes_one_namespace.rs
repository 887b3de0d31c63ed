//! `RemoteTier::clear_namespace` against a real loopback `redis-server` (single and a
//! three-master Redis Cluster): it deletes exactly the objects of one namespace under the tier's
//! key prefix — not another namespace's, another prefix's (glob metacharacters in a prefix
//! included) or an unrelated key — and a server that is down, silent or answering garbage is an
//! error, not a panic or a hang past the timeouts.
//!
//! Needs the server binary on PATH (`make rust-test` installs it); without it these tests fail.

use std::io::{Read, Write};
use std::net::TcpListener;
use std::time::{Duration, Instant};

use kvtier_core::tier::{ReadOutcome, Tier};
use kvtier_remote::pipeline::{HeaderSpec, Res, SetItem};
use kvtier_remote::resp::Reply;
use kvtier_remote::testing::{free_port, require_server_binary, LoopbackCluster, LoopbackServer as Server};
use kvtier_remote::{key_name, namespace_pattern, RemoteClient, RemoteConfig, RemoteError, RemoteTier};

const NS: u128 = 0x1234;
const OTHER_NS: u128 = 0x1235;
const BLOCK_BYTES: usize = 256;

fn config(urls: &[String], cluster: bool, prefix: &str) -> RemoteConfig {
    RemoteConfig {
        urls: urls.to_vec(),
        cluster,
        key_prefix: prefix.into(),
        reconnect_backoff_min: Duration::from_millis(5),
        reconnect_backoff_max: Duration::from_millis(20),
        connect_timeout: Duration::from_millis(500),
        ..RemoteConfig::default()
    }
}

fn payload(key: u128) -> Vec<u8> {
    (0..BLOCK_BYTES).map(|j| (j as u8).wrapping_mul(31) ^ key as u8).collect()
}

/// Stores blocks `keys` of `namespace` through `tier`.
fn put(tier: &RemoteTier, namespace: u128, keys: &[u128]) {
    let payloads: Vec<Vec<u8>> = keys.iter().map(|&k| payload(k)).collect();
    let refs: Vec<&[u8]> = payloads.iter().map(|p| &p[..]).collect();
    assert_eq!(tier.put(namespace, keys, &refs).stored, keys.len());
}

/// Every block of `keys` reads back whole and verified (`true`), or every one is a miss.
fn all_readable(tier: &RemoteTier, namespace: u128, keys: &[u128]) -> bool {
    let mut bufs = vec![vec![0u8; BLOCK_BYTES]; keys.len()];
    let mut dst: Vec<&mut [u8]> = bufs.iter_mut().map(|b| &mut b[..]).collect();
    let outcomes = tier.read_blocks(namespace, keys, &mut dst);
    if outcomes.iter().all(|o| *o == ReadOutcome::Missing) {
        return false;
    }
    assert_eq!(outcomes, vec![ReadOutcome::Loaded; keys.len()], "all or nothing");
    assert!(keys.iter().zip(&bufs).all(|(&k, b)| *b == payload(k)));
    true
}

fn set_raw(client: &RemoteClient, name: &[u8], value: &[u8]) {
    let item = SetItem { header: HeaderSpec::None, payload: value };
    assert_eq!(client.set(&[name], &[item], false), vec![Res::Bool(true)]);
}

fn dbsize(server: &Server) -> i64 {
    match server.command(&[b"DBSIZE"]) {
        Reply::Int(n) => n,
        other => panic!("DBSIZE answered {other:?}"),
    }
}

/// What every test plants: `NS` and `OTHER_NS` objects under `prefix`, `NS` objects under each
/// of `neighbours` (other prefixes), and keys that are not kvtier objects (one under `prefix`
/// and `NS` but not a key name). Returns the tiers of the neighbours and the unrelated names.
struct Planted {
    tier: RemoteTier,
    neighbours: Vec<RemoteTier>,
    unrelated: Vec<Vec<u8>>,
}

const CLEARED: std::ops::Range<u128> = 0..300;
const KEPT: std::ops::Range<u128> = 1000..1120;
const CLEARED_LEN: usize = (CLEARED.end - CLEARED.start) as usize;
const KEPT_LEN: usize = (KEPT.end - KEPT.start) as usize;

fn plant(urls: &[String], cluster: bool, prefix: &str, neighbours: &[&str]) -> Planted {
    let tier = RemoteTier::open(config(urls, cluster, prefix), NS).unwrap();
    put(&tier, NS, &CLEARED.collect::<Vec<_>>());
    put(&tier, OTHER_NS, &KEPT.collect::<Vec<_>>());
    let neighbours: Vec<RemoteTier> = neighbours
        .iter()
        .map(|p| {
            let t = RemoteTier::open(config(urls, cluster, p), NS).unwrap();
            put(&t, NS, &KEPT.collect::<Vec<_>>());
            t
        })
        .collect();
    let mut unrelated = vec![b"unrelated".to_vec(), format!("{prefix}{NS:032x}:not-a-key").into_bytes()];
    let mut upper = key_name(prefix, NS, 0xab);
    upper.make_ascii_uppercase(); // same length, not a kvtier key name
    unrelated.push(upper);
    for name in &unrelated {
        set_raw(tier.client(), name, b"keep me");
    }
    Planted { tier, neighbours, unrelated }
}

/// After `NS` was cleared under `planted.tier`'s prefix: nothing else is gone.
fn check_rest_intact(planted: &Planted) {
    let cleared: Vec<u128> = CLEARED.collect();
    let kept: Vec<u128> = KEPT.collect();
    let tier = &planted.tier;
    assert!(tier.exists(NS, &cleared).iter().all(|e| *e == Some(false)), "a cleared object remains");
    assert!(all_readable(tier, OTHER_NS, &kept), "another namespace's objects were deleted");
    for t in &planted.neighbours {
        assert!(all_readable(t, NS, &kept), "another prefix's objects were deleted");
    }
    let names: Vec<&[u8]> = planted.unrelated.iter().map(|n| &n[..]).collect();
    let values = tier.client().get_values(&names, 0);
    assert!(values.iter().all(|v| v.as_deref() == Some(&b"keep me"[..])), "an unrelated key was deleted");
}

#[test]
fn clear_deletes_exactly_one_namespace_of_one_prefix() {
    let binary = require_server_binary();
    let server = Server::start_anywhere(&binary, None);
    let urls = [server.url()];
    // Neighbours: longer and shorter prefixes, and one that nests this prefix and namespace
    // (`kvtier:<NS>:*` would match its keys).
    let nested = format!("kvtier:{NS:032x}:");
    let planted = plant(&urls, false, "kvtier:", &["kvtier:x", "kvtier", "other:", &nested]);
    let before = dbsize(&server);
    assert_eq!(planted.tier.clear_namespace(NS), Ok(CLEARED_LEN as u64));
    assert_eq!(dbsize(&server), before - CLEARED_LEN as i64);
    check_rest_intact(&planted);
    assert_eq!(planted.tier.clear_namespace(NS), Ok(0), "nothing left to clear");
    assert!(planted.tier.metrics().del.keys >= CLEARED_LEN as u64, "the UNLINKs are counted");
}

/// Over an authenticated connection to a database other than 0 (the pooled connections' `AUTH`
/// and `SELECT`): only that database is cleared; the same names in database 0 stay.
#[test]
fn clear_stays_in_the_configured_database() {
    let binary = require_server_binary();
    let server = Server::start_anywhere(&binary, Some("sesame"));
    let url = |db: u32| format!("redis://:sesame@127.0.0.1:{}/{db}", server.port);
    let db0 = RemoteTier::open(config(&[url(0)], false, "kvtier:"), NS).unwrap();
    put(&db0, NS, &CLEARED.collect::<Vec<_>>());
    let planted = plant(&[url(3)], false, "kvtier:", &["other:"]);
    assert_eq!(planted.tier.clear_namespace(NS), Ok(CLEARED_LEN as u64));
    check_rest_intact(&planted);
    assert!(all_readable(&db0, NS, &CLEARED.collect::<Vec<_>>()), "database 0 was cleared too");
}

/// The server-side pattern alone (no client-side check) selects exactly the namespace's
/// objects, with glob metacharacters in the prefix: a pattern that forgot the namespace, or
/// did not escape the prefix, fails here even though the client-side check would catch it.
#[test]
fn the_namespace_pattern_alone_matches_exactly_its_objects() {
    let binary = require_server_binary();
    let server = Server::start_anywhere(&binary, None);
    let urls = [server.url()];
    let prefix = "a*b?c[xy]d\\e:";
    // What the unescaped pattern would match: `*`, `?`, `[xy]` and `\e` as globs.
    let planted = plant(&urls, false, prefix, &["aZZbQcxde:", "ab!cyde:", "a*b?c[xy]d\\e:z"]);
    let pattern = namespace_pattern(prefix, NS);
    assert_eq!(planted.tier.client().delete_matching(&pattern, &|_| true), Ok(CLEARED_LEN as u64));
    check_rest_intact(&planted);
}

#[test]
fn a_prefix_with_glob_metacharacters_does_not_over_match() {
    let binary = require_server_binary();
    let server = Server::start_anywhere(&binary, None);
    let urls = [server.url()];
    let planted = plant(&urls, false, "k*[v]?\\", &["kXXvY\\", "kvY", "k*[v]?\\\\", "k*[v]"]);
    assert_eq!(planted.tier.clear_namespace(NS), Ok(CLEARED_LEN as u64));
    check_rest_intact(&planted);
}

#[test]
fn cluster_clear_reaches_every_master() {
    let binary = require_server_binary();
    let cluster = LoopbackCluster::start(&binary, 3);
    let planted = plant(&cluster.urls()[..1], true, "kvtier:", &["other:"]);
    let before: Vec<i64> = cluster.nodes.iter().map(dbsize).collect();
    // Each master's share of the cleared objects (by hash slot and the formed slot ranges).
    let per_node = cluster.nodes.len();
    let mut share = vec![0i64; per_node];
    for k in CLEARED {
        let slot = kvtier_remote::cluster::slot(&key_name("kvtier:", NS, k)) as usize;
        share[slot / kvtier_remote::cluster::SLOTS.div_ceil(per_node)] += 1;
    }
    assert!(share.iter().all(|&n| n > 0), "every master holds some cleared objects: {share:?}");
    assert_eq!(planted.tier.clear_namespace(NS), Ok(CLEARED_LEN as u64));
    let after: Vec<i64> = cluster.nodes.iter().map(dbsize).collect();
    let expected: Vec<i64> = before.iter().zip(&share).map(|(b, s)| b - s).collect();
    assert_eq!(after, expected, "each master lost exactly its share");
    check_rest_intact(&planted);
    // Seeded with another node only, a second tier sees nothing left to clear.
    let other = RemoteTier::open(config(&cluster.urls()[2..], true, "kvtier:"), NS).unwrap();
    assert_eq!(other.clear_namespace(NS), Ok(0));
}

#[test]
fn a_down_server_is_an_error() {
    let binary = require_server_binary();
    let port = free_port();
    let tier =
        RemoteTier::open(config(&[format!("redis://127.0.0.1:{port}")], false, "kvtier:"), NS).unwrap();
    let err = tier.clear_namespace(NS).unwrap_err();
    assert!(matches!(err, RemoteError::Io { .. } | RemoteError::Down { .. }), "{err}");

    let mut server = Server::start(&binary, port, None);
    let deadline = Instant::now() + Duration::from_secs(5);
    while tier.put(NS, &[7], &[&payload(7)]).stored != 1 {
        assert!(Instant::now() < deadline, "never reconnected");
        std::thread::sleep(Duration::from_millis(10));
    }
    server.kill();
    let err = tier.clear_namespace(NS).unwrap_err();
    assert!(matches!(err, RemoteError::Io { .. } | RemoteError::Down { .. }), "{err}");
    server.restart(); // an empty server (no persistence): nothing to clear, and no error
    let deadline = Instant::now() + Duration::from_secs(5);
    while tier.clear_namespace(NS) != Ok(0) {
        assert!(Instant::now() < deadline, "never reconnected after restart");
        std::thread::sleep(Duration::from_millis(10));
    }
}

#[test]
fn a_cluster_with_a_master_down_is_an_error() {
    let binary = require_server_binary();
    let mut cluster = LoopbackCluster::start(&binary, 3);
    let planted = plant(&cluster.urls()[..1], true, "kvtier:", &[]);
    cluster.nodes[2].kill();
    let err = planted.tier.clear_namespace(NS).unwrap_err();
    assert!(matches!(err, RemoteError::Io { .. } | RemoteError::Down { .. }), "{err}");
    // The live masters were cleared all the same.
    let remaining: i64 = cluster.nodes[..2].iter().map(dbsize).sum();
    assert_eq!(remaining, (KEPT_LEN + planted.unrelated.len()) as i64 - on_node_2(&cluster, &planted));
}

/// How many of the kept objects and unrelated keys hash to the third master's slots.
fn on_node_2(cluster: &LoopbackCluster, planted: &Planted) -> i64 {
    let slots_per_node = kvtier_remote::cluster::SLOTS.div_ceil(cluster.nodes.len());
    let mut names: Vec<Vec<u8>> = KEPT.map(|k| key_name("kvtier:", OTHER_NS, k)).collect();
    names.extend(planted.unrelated.iter().cloned());
    names.iter().filter(|n| kvtier_remote::cluster::slot(n) as usize / slots_per_node == 2).count() as i64
}

/// A fake server: `+PONG` to the handshake, then `replies` in turn, one per command; silent
/// after the last (the connection stays open).
fn scripted_server(replies: Vec<Vec<u8>>) -> u16 {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    std::thread::spawn(move || {
        let Ok((mut conn, _)) = listener.accept() else { return };
        let mut script = std::iter::once(b"+PONG\r\n".to_vec()).chain(replies);
        let mut buf = [0u8; 65536];
        while let Ok(n) = conn.read(&mut buf) {
            if n == 0 {
                return;
            }
            let commands = (0..n).filter(|&i| buf[i] == b'*' && (i == 0 || buf[i - 1] == b'\n')).count();
            for _ in 0..commands {
                // After the last reply: silent (no reply, the connection stays open).
                if let Some(reply) = script.next() {
                    if conn.write_all(&reply).is_err() {
                        return;
                    }
                }
            }
        }
    });
    port
}

fn scripted_tier(replies: &[&[u8]], io_timeout: Duration) -> RemoteTier {
    let port = scripted_server(replies.iter().map(|r| r.to_vec()).collect());
    let cfg = RemoteConfig { io_timeout, ..config(&[format!("redis://127.0.0.1:{port}")], false, "kvtier:") };
    RemoteTier::open(cfg, NS).unwrap()
}

/// Replies that are not what `DBSIZE`, `SCAN` or `UNLINK` must answer are protocol errors.
#[test]
fn malformed_replies_are_errors_not_panics() {
    let second = Duration::from_secs(2);
    let key = key_name("kvtier:", NS, 1);
    let page_of_key =
        format!("*2\r\n$1\r\n0\r\n*1\r\n${}\r\n{}\r\n", key.len(), String::from_utf8_lossy(&key));
    let cases: Vec<Vec<&[u8]>> = vec![
        vec![b"+OK\r\n"],                                         // DBSIZE not an integer
        vec![b":5\r\n", b"*2\r\n$2\r\n1x\r\n*0\r\n"],             // cursor not a number
        vec![b":5\r\n", b"*2\r\n$1\r\n0\r\n:3\r\n"],              // keys not an array
        vec![b":5\r\n", b"*1\r\n$1\r\n0\r\n"],                    // one element
        vec![b":5\r\n", b"*2\r\n$1\r\n0\r\n*1\r\n:1\r\n"],        // a key that is not a string
        vec![b":5\r\n", b"*2\r\n$1\r\n0\r\n*99999999\r\n"],       // more keys than a reply may hold
        vec![b":5\r\n", b"*2\r\n$1\r\n0\r\n*1\r\n$17825792\r\n"], // a page over 16 MiB
        vec![b":5\r\n", page_of_key.as_bytes(), b"+OK\r\n"],      // UNLINK not an integer
    ];
    for replies in cases {
        let err = scripted_tier(&replies, second).clear_namespace(NS).unwrap_err();
        assert!(matches!(err, RemoteError::Protocol { .. }), "{replies:?}: {err}");
    }
    let refused =
        scripted_tier(&[b":5\r\n", b"-NOPERM this user has no permissions to run 'scan'\r\n"], second);
    let err = refused.clear_namespace(NS).unwrap_err();
    assert!(matches!(&err, RemoteError::Protocol { reason, .. } if reason.contains("NOPERM")), "{err}");
    let fine = scripted_tier(&[b":5\r\n", page_of_key.as_bytes(), b":1\r\n"], second);
    assert_eq!(fine.clear_namespace(NS), Ok(1), "the well-formed script clears one key");
}

/// A cursor that never returns to 0 ends after [`kvtier_remote::clear::scan_calls_max`] calls.
#[test]
fn a_scan_that_never_ends_is_an_error() {
    let calls = kvtier_remote::clear::scan_calls_max(0) as usize;
    let mut replies: Vec<&[u8]> = vec![b":0\r\n"];
    replies.extend(std::iter::repeat(&b"*2\r\n$1\r\n7\r\n*0\r\n"[..]).take(calls + 1));
    let err = scripted_tier(&replies, Duration::from_secs(2)).clear_namespace(NS).unwrap_err();
    assert!(matches!(&err, RemoteError::Protocol { reason, .. } if reason.contains("did not end")), "{err}");
}

/// A server that stops answering mid-clear: an error after about one `io_timeout`.
#[test]
fn a_silent_server_is_an_error_after_the_timeout() {
    let io_timeout = Duration::from_millis(500);
    let tier = scripted_tier(&[b":5\r\n"], io_timeout); // then silent: SCAN gets no reply
    let started = Instant::now();
    let err = tier.clear_namespace(NS).unwrap_err();
    let took = started.elapsed();
    assert!(matches!(err, RemoteError::Io { .. }), "{err}");
    assert!(took < io_timeout + Duration::from_millis(1500), "the clear took {took:?}");
}
