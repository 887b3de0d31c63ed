//! A writer process killed with SIGKILL in the middle of a write burst: after reopening, every
//! object whose put returned is readable with `fsync` durability, and in any mode no read ever
//! returns wrong bytes (torn objects and torn log records are dropped).
//!
//! The writer is this test binary run again (`child_writer`, ignored in normal runs), driven
//! by environment variables; it prints `ACK <first> <last>` after each put returns.

use crate::common;

use std::io::{BufRead, BufReader, Write};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::{config, get, payload, temp_dir, TempDir, NS};
use kvtier_pool::{Durability, ReadOutcome, SsdConfig, SsdTier, Tier};

const BATCH: u128 = 8;

fn len_of(key: u128) -> usize {
    4096 * (1 + (key % 3) as usize) + 100
}

fn crash_config(dir: &std::path::Path, durability: Durability, per_device: u64) -> SsdConfig {
    let mut c = config(dir, 2, per_device);
    c.durability = durability;
    c.compact_min_records = 64; // compactions happen during the burst too
    c
}

/// The writer: puts batches of keys from `KVTIER_CRASH_START` until killed.
#[test]
#[ignore = "run by the crash tests as a child process"]
fn child_writer() {
    let Ok(dir) = std::env::var("KVTIER_CRASH_DIR") else { return };
    let durability = Durability::parse(&std::env::var("KVTIER_CRASH_DURABILITY").unwrap()).unwrap();
    let per_device: u64 = std::env::var("KVTIER_CRASH_DEVICE_BYTES").unwrap().parse().unwrap();
    let mut key: u128 = std::env::var("KVTIER_CRASH_START").unwrap().parse().unwrap();
    let pool = SsdTier::open(crash_config(dir.as_ref(), durability, per_device)).unwrap();
    let mut out = std::io::stdout().lock();
    writeln!(out, "READY").unwrap();
    out.flush().unwrap();
    loop {
        let keys: Vec<u128> = (key..key + BATCH).collect();
        let payloads: Vec<Vec<u8>> = keys.iter().map(|&k| payload(k, len_of(k))).collect();
        let refs: Vec<&[u8]> = payloads.iter().map(|p| &p[..]).collect();
        let report = pool.put(NS, &keys, &refs);
        assert_eq!(report.stored, BATCH as usize, "{report:?}");
        writeln!(out, "ACK {} {}", key, key + BATCH - 1).unwrap();
        out.flush().unwrap();
        key += BATCH;
    }
}

/// Runs the writer from `start`, kills it after `acks_wanted` acknowledged batches (plus a
/// little more writing), and returns the acknowledged keys.
fn write_and_kill(
    dir: &TempDir,
    durability: Durability,
    per_device: u64,
    start: u128,
    acks_wanted: usize,
    extra: Duration,
) -> Vec<u128> {
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "ssd_crash_recovery::child_writer",
            "--include-ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .env("KVTIER_CRASH_DIR", dir.path())
        .env("KVTIER_CRASH_DURABILITY", durability.name())
        .env("KVTIER_CRASH_DEVICE_BYTES", per_device.to_string())
        .env("KVTIER_CRASH_START", start.to_string())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let mut acked = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut batches = 0;
    while batches < acks_wanted {
        let line = lines.next().expect("writer exited early").unwrap();
        if let Some(rest) = line.strip_prefix("ACK ") {
            let (a, b) = rest.split_once(' ').unwrap();
            acked.extend(a.parse::<u128>().unwrap()..=b.parse::<u128>().unwrap());
            batches += 1;
        }
        assert!(Instant::now() < deadline, "writer too slow");
    }
    std::thread::sleep(extra);
    child.kill().unwrap(); // SIGKILL
    child.wait().unwrap();
    for line in lines {
        if let Some(rest) = line.unwrap().strip_prefix("ACK ") {
            let (a, b) = rest.split_once(' ').unwrap();
            acked.extend(a.parse::<u128>().unwrap()..=b.parse::<u128>().unwrap());
        }
    }
    acked
}

/// Reads every key the writer could have written; returns how many loaded. Panics on any
/// wrong byte.
fn loaded_and_never_wrong(pool: &SsdTier, keys: &[u128]) -> usize {
    let mut loaded = 0;
    for &k in keys {
        let (outcome, right) = get(pool, &[k], len_of(k))[0];
        if outcome == Some(ReadOutcome::Loaded) {
            assert!(right, "key {k} loaded WRONG bytes after a crash");
            loaded += 1;
        }
    }
    loaded
}

#[test]
fn fsync_every_acknowledged_object_survives_sigkill() {
    let dir = temp_dir("ssd-crash-fsync");
    let per_device = 64 << 20; // no eviction: every acknowledged object must be there
    let mut start = 1u128;
    let mut all_acked = Vec::new();
    for (round, extra_ms) in [(0, 3u64), (1, 0), (2, 11)] {
        let acked = write_and_kill(
            &dir,
            Durability::Fsync,
            per_device,
            start,
            4 + round,
            Duration::from_millis(extra_ms),
        );
        assert!(!acked.is_empty());
        all_acked.extend(&acked);
        let pool = SsdTier::open(crash_config(dir.path(), Durability::Fsync, per_device)).unwrap();
        pool.check_integrity().unwrap();
        assert_eq!(pool.stats().evictions, 0);
        for &k in &all_acked {
            let (outcome, right) = get(&pool, &[k], len_of(k))[0];
            assert_eq!(outcome, Some(ReadOutcome::Loaded), "round {round}: acknowledged key {k} lost");
            assert!(right, "round {round}: key {k} loaded wrong bytes");
        }
        let written_max = acked.iter().max().unwrap() + 4 * BATCH; // maybe written, unacknowledged
        loaded_and_never_wrong(&pool, &(1..written_max).collect::<Vec<_>>());
        start = written_max;
    }
}

#[test]
fn none_durability_with_eviction_never_returns_wrong_bytes() {
    let dir = temp_dir("ssd-crash-none");
    let per_device = 1 << 20; // ~80 objects per device: constant eviction and extent reuse
    let mut start = 1u128;
    for (round, extra_ms) in [(0, 5u64), (1, 1), (2, 17)] {
        let acked = write_and_kill(
            &dir,
            Durability::None,
            per_device,
            start,
            40 + round,
            Duration::from_millis(extra_ms),
        );
        let pool = SsdTier::open(crash_config(dir.path(), Durability::None, per_device)).unwrap();
        pool.check_integrity().unwrap();
        let end = acked.iter().max().unwrap() + 4 * BATCH;
        let loaded = loaded_and_never_wrong(&pool, &(1..end).collect::<Vec<_>>());
        assert!(loaded > 0, "round {round}: nothing recovered");
        // The newest acknowledged batch cannot have been evicted by anything acknowledged later.
        let newest: Vec<u128> = acked.iter().rev().take(BATCH as usize).copied().collect();
        for k in newest {
            assert_eq!(
                get(&pool, &[k], len_of(k))[0],
                (Some(ReadOutcome::Loaded), true),
                "round {round}: key {k}"
            );
        }
        start = end;
    }
}
