//! The RESP reader on untrusted bytes: a fake server answers with garbage (random bytes, and
//! well-formed prefixes with absurd lengths, negative sizes, deep nesting) and every read ends in
//! a value or an error — never a panic, a hang, or an allocation the length field asked for.

use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener};
use std::time::Duration;

use kvtier_remote::resp::Conn;

fn cases() -> Vec<Vec<u8>> {
    let mut out: Vec<Vec<u8>> = vec![
        b"$99999999999999\r\n".to_vec(),
        b"$-5\r\n".to_vec(),
        b"$4194368\r\nshort".to_vec(),
        b"*99999999999\r\n".to_vec(),
        b"*1\r\n".repeat(64),
        b":notanumber\r\n".to_vec(),
        b"+no line end".to_vec(),
        vec![b'-'; 100_000],
        b"$3\r\nabcXY".to_vec(),
        b"?what\r\n".to_vec(),
        Vec::new(),
    ];
    // A fixed budget in `make test`; a longer run: KVTIER_FUZZ_CASES=100000 KVTIER_FUZZ_SEED=<n>
    // (docs/security.md).
    let count: usize = std::env::var("KVTIER_FUZZ_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(200);
    let seed: u64 = std::env::var("KVTIER_FUZZ_SEED").ok().and_then(|v| v.parse().ok()).unwrap_or(0);
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15 ^ seed.wrapping_mul(0x2545_f491_4f6c_dd1d) | 1;
    for n in 0..count {
        let len = (n * 37) % 600;
        let mut v = Vec::with_capacity(len + 1);
        v.push(b"+-:$*"[n % 5]);
        for _ in 0..len {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            v.push(if x % 7 == 0 {
                b'\r'
            } else if x % 11 == 0 {
                b'\n'
            } else {
                (x >> 24) as u8
            });
        }
        out.push(v);
    }
    out
}

#[test]
fn reader_survives_garbage() {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let cases = cases();
    let n = cases.len();
    let server = std::thread::spawn(move || {
        for reply in cases {
            let (mut s, _) = listener.accept().unwrap();
            let mut sink = [0u8; 64];
            let _ = s.read(&mut sink);
            let _ = s.write_all(&reply);
            let _ = s.shutdown(Shutdown::Write);
            let _ = s.read(&mut sink); // wait for the client to hang up
        }
    });
    for i in 0..n {
        let mut conn =
            Conn::connect("127.0.0.1", port, Duration::from_secs(2), Duration::from_secs(2), None).unwrap();
        conn.write_command(&[b"GET", b"k"]).unwrap();
        conn.flush().unwrap();
        if i % 3 == 0 {
            while conn.read_reply().is_ok() {}
        } else if i % 3 == 1 {
            while conn.read_bulk_whole(4096 + 64).is_ok() {}
        } else {
            let mut header = [0u8; 64];
            let mut dst = vec![0u8; 4096];
            while conn.read_bulk_into(&mut header, &mut dst).is_ok() {}
        }
    }
    server.join().unwrap();
}
