//! Shared helpers for the store's integration tests.
#![allow(dead_code)]

use std::time::Duration;

use kvtier_core::{block_keys, BlockKey, Dtype, Geometry, Namespace};
use kvtier_store::{DramStoreConfig, SsdConfig, Store, StoreConfig};

/// 2 layers × 2 heads × 64 dims × 16 tokens × fp16 × K,V = 16 KiB per block (5 pages with header).
pub fn namespace(model_id: &str, cache_salt: &str) -> Namespace {
    let geometry = Geometry::new(2, 2, 64, Dtype::F16, 16, vec![]).unwrap();
    Namespace {
        model_id: model_id.into(),
        geometry,
        layout_version: 1,
        cache_salt: cache_salt.into(),
        rank: 0,
    }
}

pub const BLOCK_BYTES: usize = 16 << 10;
/// Arena bytes one block takes: 64-byte header + 16 KiB, rounded up to 4 KiB pages.
pub const OBJECT_BYTES: u64 = 5 * 4096;

pub fn store_with(blocks: u64, ttl: Duration, leases_max: usize, eviction: &str) -> Store {
    let config = StoreConfig {
        dram: DramStoreConfig { capacity_bytes: blocks * OBJECT_BYTES, prefault: blocks % 2 == 0 }, // both paths run
        eviction: eviction.into(),
        copy_threads: 2,
        lease_ttl: ttl,
        leases_max,
        ssd: None,
        remote: None,
    };
    Store::new(namespace("test-model", ""), config).unwrap()
}

pub fn store(blocks: u64) -> Store {
    store_with(blocks, Duration::from_secs(30), 64, "lru")
}

/// Keys of `n` blocks of a prompt that starts with `first_token`.
pub fn keys(store: &Store, first_token: u32, n: usize) -> Vec<BlockKey> {
    let tokens: Vec<u32> = (0..16 * n as u32).map(|t| t.wrapping_add(first_token)).collect();
    block_keys(store.namespace_hash(), &tokens, 16, &[]).unwrap()
}

/// The payload a test stores under `key`: pseudo-random bytes derived from the key alone, so
/// every loaded byte can be checked against the key it was loaded for.
pub fn payload(key: BlockKey) -> Vec<u8> {
    let mut state = xxhash_rust::xxh3::xxh3_64(&key.to_le_bytes());
    let mut out = Vec::with_capacity(BLOCK_BYTES);
    while out.len() < BLOCK_BYTES {
        // splitmix64
        state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = state;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        out.extend_from_slice(&(z ^ (z >> 31)).to_le_bytes());
    }
    out
}

pub fn put_keys(store: &Store, keys: &[BlockKey]) -> kvtier_store::PutReport {
    let payloads: Vec<Vec<u8>> = keys.iter().map(|&k| payload(k)).collect();
    let refs: Vec<&[u8]> = payloads.iter().map(|p| &p[..]).collect();
    store.put(store.namespace_hash(), keys, &refs).unwrap()
}

/// Loads `n` blocks of `lease_id` into fresh buffers.
pub fn load(store: &Store, lease_id: u64, n: usize) -> (kvtier_store::LoadReport, Vec<Vec<u8>>) {
    let mut bufs = vec![vec![0u8; BLOCK_BYTES]; n];
    let mut dst: Vec<&mut [u8]> = bufs.iter_mut().map(|b| &mut b[..]).collect();
    let report = store.load(lease_id, &mut dst).unwrap();
    (report, bufs)
}

pub use tempfile::TempDir;

/// A fresh directory `<name>…` under the cargo target's temporary directory (O_DIRECT works there:
/// it is on the repository's file system), removed when dropped.
pub fn temp_dir(name: &str) -> TempDir {
    tempfile::Builder::new().prefix(name).tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap()
}

/// An SSD pool of `capacity_bytes` on one device file, `a.kvtd` in `dir` (no bandwidth probe).
pub fn one_device_pool(dir: &TempDir, capacity_bytes: u64) -> SsdConfig {
    let mut pool = SsdConfig::new(dir.path());
    pool.devices = vec![dir.path().join("a.kvtd")];
    pool.capacity_bytes = capacity_bytes;
    pool.probe_bytes = 0;
    pool
}
