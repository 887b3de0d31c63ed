//! The remote tier against a real loopback `redis-server` (or `valkey-server`): round trip, and
//! every fault — server down at start, killed mid-run, garbage values, wrong password — is a
//! counted miss or a clear start-up error, never wrong bytes or a panic.
//!
//! Needs the server binary on PATH (`make rust-test` installs the Debian package); without it
//! these tests fail, naming the fix: passing without a server would have tested nothing.

use std::time::{Duration, Instant};

use kvtier_core::tier::{Located, ReadOutcome, Tier};
use kvtier_remote::pipeline::{HeaderSpec, Res, SetItem};
use kvtier_remote::testing::{free_port, require_server_binary, LoopbackServer as Server};
use kvtier_remote::{key_name, RemoteConfig, RemoteError, RemoteTier};

fn config(url: &str) -> RemoteConfig {
    RemoteConfig {
        reconnect_backoff_min: Duration::from_millis(5),
        reconnect_backoff_max: Duration::from_millis(20),
        connect_timeout: Duration::from_millis(500),
        ..RemoteConfig::single(url)
    }
}

const NS: u128 = 0x1234;

fn payload(i: u8) -> Vec<u8> {
    (0..4096u32).map(|j| (j as u8).wrapping_mul(31).wrapping_add(i)).collect()
}

fn read(tier: &RemoteTier, keys: &[u128]) -> (Vec<ReadOutcome>, Vec<Vec<u8>>) {
    let mut bufs = vec![vec![0u8; 4096]; keys.len()];
    let mut dst: Vec<&mut [u8]> = bufs.iter_mut().map(|b| &mut b[..]).collect();
    let outcomes = tier.read_blocks(NS, keys, &mut dst);
    (outcomes, bufs)
}

#[test]
fn round_trip_with_pins() {
    let binary = require_server_binary();
    let server = Server::start_anywhere(&binary, None);
    let tier = RemoteTier::open(config(&server.url()), NS).unwrap();
    let keys: Vec<u128> = (1..=8).collect();
    let payloads: Vec<Vec<u8>> = (0..8).map(payload).collect();
    let refs: Vec<&[u8]> = payloads.iter().map(|p| &p[..]).collect();
    let r = tier.put(NS, &keys, &refs);
    assert_eq!((r.stored, r.already_present, r.rejected), (8, 0, 0));
    assert_eq!(tier.put(NS, &keys, &refs).already_present, 8);

    let mut asked: Vec<u128> = keys.clone();
    asked.push(99); // absent
    let mut located: Vec<Option<Located>> = vec![None; asked.len()];
    assert_eq!(tier.locate(NS, &asked, &mut located, true, true), 8);
    assert!(located[8].is_none());
    let entries: Vec<_> = located[..8].iter().map(|l| l.unwrap().entry).collect();
    assert_eq!(tier.pins().len(), 8);
    let mut bufs = vec![vec![0u8; 4096]; 8];
    let mut dst: Vec<&mut [u8]> = bufs.iter_mut().map(|b| &mut b[..]).collect();
    let mut outcomes = vec![ReadOutcome::NotPinned; 8];
    tier.read_pinned(NS, &entries, &mut dst, &mut outcomes);
    assert_eq!(outcomes, vec![ReadOutcome::Loaded; 8]);
    assert_eq!(bufs, payloads);
    tier.unpin(&entries);
    assert!(tier.pins().is_empty());
    assert_eq!(tier.remove(NS, &keys[..2]), 2);
    assert!(!tier.contains(NS, 1) && tier.contains(NS, 3));
}

#[test]
fn garbage_values_are_counted_misses_and_deleted() {
    let binary = require_server_binary();
    let server = Server::start_anywhere(&binary, None);
    let tier = RemoteTier::open(config(&server.url()), NS).unwrap();
    let good = payload(1);
    tier.put(NS, &[1, 2, 3, 4], &[&good, &good, &good, &good]);
    let name = |k: u128| key_name("kvtier:", NS, k);
    let mut object = tier.client().get_values(&[&name(3)], 0).pop().unwrap().unwrap();
    assert_eq!(object.len(), 64 + 4096);
    let mut bad_magic = object.clone(); // key 3's object: only magic differs for key 1
    bad_magic[0] = b'X';
    let truncated = object[..1000].to_vec();
    object[64 + 100] ^= 1; // payload checksum mismatch
    let foreign = kvtier_core::object::encode_object(NS + 1, 4, 0, &good);
    let plant: Vec<(Vec<u8>, &[u8])> =
        vec![(name(1), &bad_magic), (name(2), &truncated), (name(3), &object), (name(4), &foreign)];
    for (n, v) in &plant {
        assert_eq!(
            tier.client().set(&[&n[..]], &[SetItem { header: HeaderSpec::None, payload: v }], false),
            vec![Res::Bool(true)]
        );
    }
    let (outcomes, _) = read(&tier, &[1, 2, 3, 4]);
    assert_eq!(outcomes, vec![ReadOutcome::Corrupt; 4]);
    let m = tier.metrics();
    assert_eq!((m.bad_magic, m.bad_length, m.bad_checksum, m.foreign_objects), (1, 1, 1, 1));
    assert_eq!(tier.stats().checksum_failures, 4);
    let (outcomes, _) = read(&tier, &[1, 2, 3, 4]);
    assert_eq!(outcomes, vec![ReadOutcome::Missing; 4], "bad values were deleted");
}

/// A kvtier name holding another type of value (another program's list) answers `EXISTS`
/// but not `GET`: it is a counted miss and is deleted, not reported present forever.
#[test]
fn a_key_of_the_wrong_type_is_a_counted_miss_and_deleted() {
    use std::io::{Read, Write};
    let binary = require_server_binary();
    let server = Server::start_anywhere(&binary, None);
    let tier = RemoteTier::open(config(&server.url()), NS).unwrap();
    let name = key_name("kvtier:", NS, 9);
    let mut raw = std::net::TcpStream::connect(("127.0.0.1", server.port)).unwrap();
    let mut cmd = format!("*3\r\n$5\r\nRPUSH\r\n${}\r\n", name.len()).into_bytes();
    cmd.extend_from_slice(&name);
    cmd.extend_from_slice(b"\r\n$1\r\nx\r\n");
    raw.write_all(&cmd).unwrap();
    let mut reply = [0u8; 4];
    raw.read_exact(&mut reply).unwrap();
    assert_eq!(&reply, b":1\r\n");
    let mut located = [None];
    assert_eq!(tier.locate(NS, &[9], &mut located, false, true), 1, "EXISTS sees the list");
    let (outcomes, _) = read(&tier, &[9]);
    assert_eq!(outcomes, vec![ReadOutcome::Corrupt]);
    assert_eq!(tier.metrics().bad_magic, 1);
    let mut located = [None];
    assert_eq!(tier.locate(NS, &[9], &mut located, false, true), 0, "deleted: a plain miss now");
    // Through the whole-value path (codec objects) too.
    raw.write_all(&cmd).unwrap();
    raw.read_exact(&mut reply).unwrap();
    let got = tier.read_objects(NS, &[9], 0);
    assert!(matches!(got[0], Err(ReadOutcome::Corrupt)), "{got:?}");
    assert!(!tier.contains(NS, 9));
}

/// A value longer than any object of the store (here past 64 MiB, the most a whole reply could be)
/// under a kvtier name is a counted miss, deleted, read over a connection that stays in step. It
/// was a protocol error: the connection dropped, the batch's other values lost, the server put in
/// backoff on every load, and the value never deleted — as every codec object of a store whose
/// blocks exceed 64 MiB was (a 70B model's 256-token block is 80 MiB).
#[test]
fn an_oversized_value_is_a_counted_miss_and_deleted() {
    let binary = require_server_binary();
    let server = Server::start_anywhere(&binary, None);
    let tier = RemoteTier::open(config(&server.url()), NS).unwrap();
    let good = payload(1);
    assert_eq!(tier.put(NS, &[1], &[&good]).stored, 1);
    let huge = vec![7u8; (64 << 20) + 1];
    let name = key_name("kvtier:", NS, 2);
    let plant = [SetItem { header: HeaderSpec::None, payload: &huge }];
    assert_eq!(tier.client().set(&[&name[..]], &plant, false), vec![Res::Bool(true)]);
    let connects = tier.metrics().connects;
    // As the store reads a value that is not a raw block: whole, bounded by header + block.
    let got = tier.read_objects(NS, &[2, 1], 64 + 4096);
    assert!(matches!(got[0], Err(ReadOutcome::Corrupt)), "{:?}", got[0]);
    let object = got[1].as_ref().expect("the next value of the batch is read");
    assert_eq!(&object[64..], &good[..]);
    assert_eq!(tier.metrics().bad_length, 1);
    assert_eq!(tier.metrics().connects, connects, "the connection stayed in step");
    assert!(!tier.contains(NS, 2), "the oversized value was deleted");
}

#[test]
fn down_at_start_then_up_then_killed_then_restarted() {
    let binary = require_server_binary();
    let port = free_port();
    let tier = RemoteTier::open(config(&format!("redis://127.0.0.1:{port}")), NS).unwrap();
    let p = payload(5);
    assert_eq!(tier.put(NS, &[7], &[&p]).rejected, 1);
    assert_eq!(read(&tier, &[7]).0, vec![ReadOutcome::Missing]);
    assert!(tier.metrics().down_misses >= 1 && tier.metrics().down_skipped_writes >= 1);

    let mut server = Server::start(&binary, port, None);
    let deadline = Instant::now() + Duration::from_secs(5);
    while tier.put(NS, &[7], &[&p]).stored != 1 {
        assert!(Instant::now() < deadline, "never reconnected");
        std::thread::sleep(Duration::from_millis(10));
    }
    let (o, bufs) = read(&tier, &[7]);
    assert_eq!(o, vec![ReadOutcome::Loaded]);
    assert_eq!(bufs[0], p);

    server.kill();
    for _ in 0..5 {
        assert_eq!(read(&tier, &[7]).0, vec![ReadOutcome::Missing]);
        let mut located = vec![None];
        assert_eq!(tier.locate(NS, &[7], &mut located, false, true), 0);
    }
    server.restart();
    let deadline = Instant::now() + Duration::from_secs(5);
    while tier.put(NS, &[7], &[&p]).stored != 1 {
        assert!(Instant::now() < deadline, "never reconnected after restart");
        std::thread::sleep(Duration::from_millis(10));
    }
    assert_eq!(read(&tier, &[7]).0, vec![ReadOutcome::Loaded]);
    assert!(tier.metrics().reconnects >= 2);
}

/// A server restarted with a dataset answers `-LOADING` until it has read it (minutes, for a
/// large one): a store opened meanwhile opens, misses, and hits once loading ends. The handshake
/// took `-LOADING` for a protocol error, which fails `open` (a `ConfigError` from the store).
#[test]
fn a_server_loading_its_dataset_at_start_is_down_not_an_error() {
    let binary = require_server_binary();
    let dir = std::env::temp_dir().join(format!("kvtier-loading-{}-{}", std::process::id(), free_port()));
    std::fs::create_dir_all(&dir).unwrap();
    let dir_arg = dir.to_string_lossy().into_owned();
    let mut server = Server::start_anywhere_with(&binary, None, &["--dir", &dir_arg]);
    let port = server.port;
    let tier = RemoteTier::open(config(&server.url()), NS).unwrap();
    let good = payload(3);
    assert_eq!(tier.put(NS, &[1], &[&good]).stored, 1);
    // Filler keys, each loaded 1 ms apart at the restart: the server loads for 2 s at least.
    let names: Vec<Vec<u8>> = (0..2000).map(|i| format!("filler:{i}").into_bytes()).collect();
    let name_refs: Vec<&[u8]> = names.iter().map(|n| &n[..]).collect();
    let items = vec![SetItem { header: HeaderSpec::None, payload: b"x" }; names.len()];
    assert!(tier.client().set(&name_refs, &items, false).iter().all(|r| *r == Res::Bool(true)));
    assert_eq!(server.command(&[b"SAVE"]), kvtier_remote::resp::Reply::Status("OK".into()));
    drop(tier);
    server.kill();
    let slow_load = ["--key-load-delay", "1000", "--loading-process-events-interval-bytes", "1024"];
    let server = Server::start_with(&binary, port, None, &[&["--dir", &dir_arg][..], &slow_load].concat());

    let opened = RemoteTier::open(config(&server.url()), NS);
    let loading = server.command(&[b"PING"]);
    assert!(
        matches!(&loading, kvtier_remote::resp::Reply::Error(e) if e.starts_with("LOADING")),
        "{loading:?}"
    );
    let tier = opened.expect("a loading server is down for now, not a configuration error");
    let deadline = Instant::now() + Duration::from_secs(60);
    while read(&tier, &[1]).0 != vec![ReadOutcome::Loaded] {
        assert!(Instant::now() < deadline, "never hit after loading");
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(read(&tier, &[1]).1[0], good);
    drop(server);
    let _ = std::fs::remove_dir_all(&dir);
}

/// A pooled connection the server closed while it sat idle (its `timeout`, a proxy's idle limit;
/// here `CLIENT KILL`) fails at once, before any reply: the batch runs again on a new connection.
/// It used to fail — a load missed, a put was dropped, a clear was an error — and put a server
/// that was up in backoff, so the next batches missed too.
#[test]
fn connections_closed_while_idle_are_replaced_not_misses() {
    let binary = require_server_binary();
    let server = Server::start_anywhere(&binary, None);
    let tier = RemoteTier::open(config(&server.url()), NS).unwrap();
    let p = payload(4);
    assert_eq!(tier.put(NS, &[1, 2], &[&p, &p]).stored, 2);
    let close_idle = || {
        let killed = server.command(&[b"CLIENT", b"KILL", b"TYPE", b"normal"]);
        assert_eq!(killed, kvtier_remote::resp::Reply::Int(1), "the tier's one idle connection");
    };
    close_idle();
    assert_eq!(read(&tier, &[1]).0, vec![ReadOutcome::Loaded]);
    close_idle();
    assert_eq!(tier.put(NS, &[3], &[&p]).stored, 1);
    close_idle();
    let mut located = vec![None; 3];
    assert_eq!(tier.locate(NS, &[1, 2, 3], &mut located, false, true), 3);
    close_idle();
    assert_eq!(tier.clear_namespace(NS), Ok(3));
    let m = tier.metrics();
    assert_eq!((m.down_misses, m.down_skipped_writes, m.connect_failures, m.nodes_down), (0, 0, 0, 0));
    assert_eq!(m.connects, 5, "one new connection after each close");
}

#[test]
fn wrong_or_missing_password_is_an_error_at_start() {
    let binary = require_server_binary();
    let server = Server::start_anywhere(&binary, Some("sesame"));
    let wrong =
        RemoteTier::open(config(&format!("redis://:nope@127.0.0.1:{}", server.port)), NS).unwrap_err();
    assert!(matches!(&wrong, RemoteError::Auth { reply, .. } if reply.contains("WRONGPASS")), "{wrong}");
    let missing = RemoteTier::open(config(&server.url()), NS).unwrap_err();
    assert!(missing.to_string().contains("needs a password"), "{missing}");
    let ok = RemoteTier::open(RemoteConfig { password: Some("sesame".into()), ..config(&server.url()) }, NS);
    assert!(ok.is_ok());
}

#[test]
fn whole_prefixes_are_confirmed_by_one_multi_key_exists() {
    let binary = require_server_binary();
    let mut server = Server::start_anywhere(&binary, None);
    let tier = RemoteTier::open(config(&server.url()), NS).unwrap();
    let keys: Vec<u128> = (1000..1600).collect(); // two locate chunks (512 + 88)
    let p = payload(1);
    let refs: Vec<&[u8]> = keys.iter().map(|_| &p[..]).collect();
    assert_eq!(tier.put(NS, &keys, &refs).stored, 600);
    let name = |k: u128| key_name("kvtier:", NS, k);
    let (a, b, absent) = (name(1000), name(1001), name(99));
    let client = tier.client();
    assert_eq!(client.exists_all(&[&a[..], &b[..], &a[..]]), Some(true), "a name listed twice");
    assert_eq!(client.exists_all(&[&a[..], &absent[..], &b[..]]), Some(false));
    assert_eq!(client.exists_all(&[]), Some(true));

    // All present: each chunk is one EXISTS command of many names (the server's own count of
    // EXISTS calls), not one command per name.
    let before = exists_calls(server.port);
    let mut located = vec![None; keys.len()];
    assert_eq!(tier.locate(NS, &keys, &mut located, false, true), 600);
    assert_eq!(exists_calls(server.port) - before, 2, "one multi-key EXISTS per chunk");
    // A miss in the middle: that chunk is asked name by name, and the prefix stops there.
    assert_eq!(tier.remove(NS, &keys[300..301]), 1);
    let mut located = vec![None; keys.len()];
    assert_eq!(tier.locate(NS, &keys, &mut located, false, true), 300);
    assert!(located[299].is_some() && located[300].is_none());
    let mut located = vec![None; keys.len()];
    assert_eq!(tier.locate(NS, &keys, &mut located, false, false), 599, "without stop_at_miss");
    assert!(located[301].is_some() && located[300].is_none());

    server.kill();
    assert_eq!(client.exists_all(&[&a[..]]), None, "unknown while the server is down");
    let mut located = vec![None; 4];
    assert_eq!(tier.locate(NS, &keys[..4], &mut located, false, true), 0);
}

/// A server busy with a script answers `-BUSY` to everything for a while: a multi-key `EXISTS`
/// that meets it is unknown that once. It used to count as the server refusing multi-key `EXISTS`
/// (a proxy's answer), so every later lookup asked name by name, for good.
#[test]
fn a_busy_server_does_not_turn_off_the_multi_key_exists() {
    let binary = require_server_binary();
    let server = Server::start_anywhere(&binary, None);
    let tier = RemoteTier::open(config(&server.url()), NS).unwrap();
    let p = payload(1);
    assert_eq!(tier.put(NS, &[1, 2], &[&p, &p]).stored, 2);
    let (a, b) = (key_name("kvtier:", NS, 1), key_name("kvtier:", NS, 2));
    let names: [&[u8]; 2] = [&a, &b];
    assert_eq!(tier.client().exists_all(&names), Some(true));
    let ok = kvtier_remote::resp::Reply::Status("OK".into());
    assert_eq!(server.command(&[b"CONFIG", b"SET", b"busy-reply-threshold", b"50"]), ok);
    // Spins for 1.5 s by the server's clock; other clients get -BUSY after 50 ms of it.
    let script: &[u8] = b"local t0 = redis.call('TIME') while true do local t = redis.call('TIME') \
        if (t[1] - t0[1]) * 1000000 + (t[2] - t0[2]) > 1500000 then return 1 end end";
    std::thread::scope(|s| {
        s.spawn(|| server.command(&[b"EVAL", script, b"0"]));
        let deadline = Instant::now() + Duration::from_secs(10);
        while !matches!(server.command(&[b"PING"]), kvtier_remote::resp::Reply::Error(e) if e.starts_with("BUSY"))
        {
            assert!(Instant::now() < deadline, "the script never made the server busy");
        }
        assert_eq!(tier.client().exists_all(&names), None, "unknown while the server is busy");
    });
    assert_eq!(tier.client().exists_all(&names), Some(true), "asked in one command again");
}

/// The server's count of EXISTS commands served (`INFO commandstats`).
fn exists_calls(port: u16) -> u64 {
    use std::io::{Read, Write};
    let mut c = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
    c.write_all(b"*2\r\n$4\r\nINFO\r\n$12\r\ncommandstats\r\n").unwrap();
    let mut reply = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        let n = c.read(&mut buf).unwrap();
        reply.extend_from_slice(&buf[..n]);
        let text = String::from_utf8_lossy(&reply);
        // "$<len>\r\n<body>\r\n": done when the whole body arrived.
        if let Some((head, body)) = text.split_once("\r\n") {
            let len: usize = head[1..].parse().unwrap();
            if body.len() >= len + 2 {
                return body
                    .lines()
                    .find_map(|l| l.strip_prefix("cmdstat_exists:calls="))
                    .map_or(0, |rest| rest.split(',').next().unwrap().parse().unwrap());
            }
        }
        assert!(n > 0, "server closed the connection");
    }
}
