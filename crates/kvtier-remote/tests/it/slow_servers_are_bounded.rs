//! `io_timeout` bounds a whole reply and the whole connection handshake, not each socket read:
//! a server that trickles its replies one byte at a time (a malicious or broken server) cannot
//! hold `open` or a lookup for longer than about one timeout.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::time::{Duration, Instant};

use kvtier_core::tier::Tier;
use kvtier_remote::{RemoteConfig, RemoteTier};

/// Each byte of every reply comes this long after the previous one.
const TRICKLE: Duration = Duration::from_millis(400);
const IO_TIMEOUT: Duration = Duration::from_millis(1000);

/// Serves every connection: each command read gets `+PONG` (during the handshake, answered at
/// once when `quick_handshake`) or `:1`, sent one byte per [`TRICKLE`] — or, with `late`, whole
/// but that long after the command (`:N` to a multi-key `EXISTS` of N keys).
fn trickling_server(quick_handshake: bool) -> u16 {
    server(move |conn| serve(conn, quick_handshake))
}

fn server(handler: impl Fn(TcpStream) + Copy + Send + 'static) -> u16 {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    std::thread::spawn(move || {
        for conn in listener.incoming() {
            let Ok(conn) = conn else { return };
            std::thread::spawn(move || handler(conn));
        }
    });
    port
}

/// Commands in one read: each is an array, so count the `*` that start a line (a test server's
/// view: the commands these tests send have no `*` at a line start inside their arguments).
fn commands_in(bytes: &[u8]) -> usize {
    bytes.iter().enumerate().filter(|&(i, &b)| b == b'*' && (i == 0 || bytes[i - 1] == b'\n')).count()
}

fn serve(mut conn: TcpStream, quick_handshake: bool) {
    let mut buf = [0u8; 65536];
    let mut commands = 0;
    loop {
        let n = match conn.read(&mut buf) {
            Ok(0) | Err(_) => return,
            Ok(n) => n,
        };
        let asked = commands_in(&buf[..n]);
        for _ in 0..asked {
            commands += 1;
            let handshake = commands == 1;
            let reply: &[u8] = if handshake { b"+PONG\r\n" } else { b":1\r\n" };
            if handshake && quick_handshake {
                if conn.write_all(reply).is_err() {
                    return;
                }
                continue;
            }
            for &b in reply {
                std::thread::sleep(TRICKLE);
                if conn.write_all(&[b]).is_err() {
                    return;
                }
            }
        }
    }
}

fn config(port: u16) -> RemoteConfig {
    RemoteConfig {
        io_timeout: IO_TIMEOUT,
        connect_timeout: Duration::from_millis(500),
        // Long enough that a failed exchange is not retried within the test's lookup.
        reconnect_backoff_min: Duration::from_secs(5),
        reconnect_backoff_max: Duration::from_secs(5),
        ..RemoteConfig::single(&format!("redis://127.0.0.1:{port}"))
    }
}

/// With a bound per socket read, the 7-byte PONG took 7 × 400 ms = 2.8 s to arrive and `open`
/// waited for it; a deadline ends the handshake after one timeout (the server counts as down).
#[test]
fn a_trickling_handshake_ends_after_one_timeout() {
    let port = trickling_server(false);
    let started = Instant::now();
    let tier = RemoteTier::open(config(port), 1);
    let took = started.elapsed();
    assert!(tier.is_ok(), "a server that does not answer in time is down, not a config error");
    assert!(took < IO_TIMEOUT + Duration::from_millis(1200), "open took {took:?}; the reply takes 2.8 s");
}

/// Every reply of a lookup trickles in (4 bytes: 1.6 s each): the lookup ends after about one
/// timeout, with misses, instead of waiting for each reply in turn.
#[test]
fn a_trickling_lookup_ends_after_one_timeout_with_misses() {
    let port = trickling_server(true);
    let tier = RemoteTier::open(config(port), 1).unwrap();
    let keys: Vec<u128> = (1..=8).collect();
    let mut located = vec![None; keys.len()];
    let started = Instant::now();
    let found = tier.locate(1, &keys, &mut located, false, false);
    let took = started.elapsed();
    assert_eq!(found, 0, "replies that never completed are misses");
    assert!(took < IO_TIMEOUT + Duration::from_millis(1200), "the lookup took {took:?}");
}

/// Answers each command whole, [`LATE`] after it arrives: `+PONG`, then `:8` (a multi-key
/// `EXISTS` of 8 keys: all present).
fn late_server() -> u16 {
    server(|mut conn| {
        let mut buf = [0u8; 65536];
        let mut commands = 0;
        while let Ok(n) = conn.read(&mut buf) {
            if n == 0 {
                return;
            }
            let asked = commands_in(&buf[..n]);
            for _ in 0..asked {
                commands += 1;
                std::thread::sleep(LATE);
                let reply: &[u8] = if commands == 1 { b"+PONG\r\n" } else { b":8\r\n" };
                if conn.write_all(reply).is_err() {
                    return;
                }
            }
        }
    })
}

/// Later than half the timeout: the socket's own timeout (half of what is left) fires first.
const LATE: Duration = Duration::from_millis(700);

/// A reply that comes whole within the timeout, but after the socket's shorter timeout, is
/// waited for (the call is retried until the deadline), not taken for a dead server.
#[test]
fn a_late_reply_within_the_timeout_is_not_a_failure() {
    let port = late_server();
    let tier = RemoteTier::open(config(port), 1).unwrap();
    let keys: Vec<u128> = (1..=8).collect();
    let mut located = vec![None; keys.len()];
    assert_eq!(tier.locate(1, &keys, &mut located, false, false), 8, "the late replies were used");
}
