//! A flipped byte on disk — found by scanning the raw device file the way an outside fault
//! would hit it, or through the pool's fault injection — is a counted miss, never data.

use crate::common;

use std::os::unix::fs::FileExt;

use common::{config, get, payload, put, temp_dir};
use kvtier_pool::{ReadOutcome, SsdTier, Tier};

const LEN: usize = 20_000;

/// Byte offset in the device file of the payload of `key` (scans page starts for its first bytes:
/// objects are bare payloads, page-aligned).
fn find_object(path: &std::path::Path, key: u128) -> u64 {
    let bytes = std::fs::read(path).unwrap();
    let head = &payload(key, LEN)[..64];
    (0..bytes.len()).step_by(4096).find(|&at| &bytes[at..at + 64] == head).expect("object on disk") as u64
}

fn flip(path: &std::path::Path, at: u64) {
    let file = std::fs::OpenOptions::new().read(true).write(true).open(path).unwrap();
    let mut b = [0u8; 1];
    file.read_exact_at(&mut b, at).unwrap();
    b[0] ^= 0x20;
    file.write_all_at(&b, at).unwrap();
    file.sync_all().unwrap();
}

#[test]
fn flipped_bytes_on_disk_are_counted_misses() {
    let dir = temp_dir("ssd-corrupt");
    let c = config(dir.path(), 1, 4 << 20);
    let device = c.devices[0].clone();
    let pool = SsdTier::open(c.clone()).unwrap();
    let keys: Vec<u128> = (1..=4).collect();
    assert_eq!(put(&pool, &keys, LEN).stored, 4);
    // Bytes of keys 1 and 2 (first and last payload byte), flipped behind the pool's back.
    flip(&device, find_object(&device, 1) + 12_345);
    flip(&device, find_object(&device, 2) + LEN as u64 - 1);
    assert!(pool.corrupt_for_test(3, 7), "pool-level fault injection");
    let results = get(&pool, &keys, LEN);
    assert_eq!(results[0].0, Some(ReadOutcome::Corrupt));
    assert_eq!(results[1].0, Some(ReadOutcome::Corrupt));
    assert_eq!(results[2].0, Some(ReadOutcome::Corrupt));
    assert_eq!(results[3], (Some(ReadOutcome::Loaded), true));
    assert_eq!(pool.stats().checksum_failures, 3);
    // Dropped: later lookups miss them, and the check passes without them.
    assert_eq!(get(&pool, &keys[..3], LEN).iter().map(|r| r.0).collect::<Vec<_>>(), vec![None; 3]);
    assert!(!pool.contains(common::NS, 1));
    pool.check_integrity().unwrap();
    drop(pool);
    // Their removal was logged: a restart does not bring them back.
    let pool = SsdTier::open(c).unwrap();
    assert_eq!(pool.recovery().recovered_objects, 1);
    assert_eq!(get(&pool, &keys, LEN)[3], (Some(ReadOutcome::Loaded), true));
}

#[test]
fn corruption_after_a_restart_is_still_caught() {
    let dir = temp_dir("ssd-corrupt-restart");
    let c = config(dir.path(), 1, 4 << 20);
    let device = c.devices[0].clone();
    put(&SsdTier::open(c.clone()).unwrap(), &[9], LEN);
    flip(&device, find_object(&device, 9));
    let pool = SsdTier::open(c).unwrap();
    assert_eq!(pool.recovery().recovered_objects, 1, "recovery trusts the log; reads verify");
    assert_eq!(get(&pool, &[9], LEN)[0].0, Some(ReadOutcome::Corrupt));
    assert_eq!(pool.stats().checksum_failures, 1);
}
