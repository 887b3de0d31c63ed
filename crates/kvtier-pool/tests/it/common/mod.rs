//! Shared helpers of the SSD pool's integration tests.
#![allow(dead_code)]

use std::os::unix::fs::PermissionsExt;
use std::path::Path;

use kvtier_core::BlockKey;
use kvtier_pool::{ReadOutcome, SsdConfig, SsdTier, Tier};

pub const NS: u128 = 0x6b76_7469_6572_7465_7374;

pub use tempfile::TempDir;

/// A fresh directory `<name>…` under the cargo target's temporary directory (O_DIRECT works there:
/// it is on the repository's file system), removed when dropped. Mode 0700 whatever the umask:
/// `pool_files_are_private_and_a_shared_directory_is_refused` sets the process's umask to 0 for
/// a moment, and a directory another test made meanwhile would be every user's, which the pool
/// refuses.
pub fn temp_dir(name: &str) -> TempDir {
    let private = std::fs::Permissions::from_mode(0o700);
    tempfile::Builder::new()
        .prefix(name)
        .permissions(private)
        .tempdir_in(env!("CARGO_TARGET_TMPDIR"))
        .unwrap()
}

/// A pool config over `devices` files in `dir` of `per_device` bytes each, no probe.
pub fn config(dir: &Path, devices: usize, per_device: u64) -> SsdConfig {
    let mut c = SsdConfig::new(dir);
    c.devices = (0..devices).map(|i| dir.join(format!("dev{i}.kvtd"))).collect();
    c.capacity_bytes = per_device * devices as u64;
    c.probe_bytes = 0;
    c.io_depth = 4;
    c
}

/// Pseudo-random bytes derived from the key alone.
pub fn payload(key: BlockKey, len: usize) -> Vec<u8> {
    let mut state = xxhash_rust::xxh3::xxh3_64(&key.to_le_bytes());
    let mut out = Vec::with_capacity(len + 8);
    while out.len() < len {
        state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = state;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        out.extend_from_slice(&(z ^ (z >> 31)).to_le_bytes());
    }
    out.truncate(len);
    out
}

pub fn put(pool: &SsdTier, keys: &[BlockKey], len: usize) -> kvtier_pool::TierPutReport {
    let payloads: Vec<Vec<u8>> = keys.iter().map(|&k| payload(k, len)).collect();
    let refs: Vec<&[u8]> = payloads.iter().map(|p| &p[..]).collect();
    pool.put(NS, keys, &refs)
}

/// Reads `keys`; returns each outcome and whether the bytes are the key's payload.
pub fn get(pool: &SsdTier, keys: &[BlockKey], len: usize) -> Vec<(Option<ReadOutcome>, bool)> {
    let mut bufs = vec![vec![0u8; len]; keys.len()];
    let mut dst: Vec<&mut [u8]> = bufs.iter_mut().map(|b| &mut b[..]).collect();
    let outcomes = pool.get(NS, keys, &mut dst).expect("buffers of the payload's size");
    outcomes.into_iter().zip(keys).zip(&bufs).map(|((o, &k), b)| (o, *b == payload(k, len))).collect()
}

/// Every key loads with its exact bytes.
pub fn assert_all_load(pool: &SsdTier, keys: &[BlockKey], len: usize) {
    for (i, (outcome, right)) in get(pool, keys, len).into_iter().enumerate() {
        assert_eq!(outcome, Some(ReadOutcome::Loaded), "key {i}");
        assert!(right, "key {i} loaded wrong bytes");
    }
}
