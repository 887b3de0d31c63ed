//! Shared helpers for the transfer engine's integration tests.
#![allow(dead_code)]

use std::sync::Arc;
use std::time::Duration;

use half::f16;
use kvtier_core::layout::gather_contiguous;
use kvtier_core::parallel::WorkerPool;
use kvtier_core::{block_keys, BlockKey, Dtype, Geometry, Namespace};
use kvtier_store::{DramStoreConfig, SsdConfig, SsdStoreConfig, Store, StoreConfig, StoreError, TierCodec};
use kvtier_transfer::{PoolBuffer, PoolRef, StoreHandle, TransferConfig, TransferEngine};

pub fn namespace(geometry: Geometry) -> Namespace {
    Namespace {
        model_id: "transfer-test".into(),
        geometry,
        layout_version: 1,
        cache_salt: String::new(),
        rank: 0,
    }
}

pub fn geometry(layers: u32, heads: u32, dim: u32, tokens: u32) -> Geometry {
    Geometry::new(layers, heads, dim, Dtype::F16, tokens, vec![]).unwrap()
}

fn object_bytes(geometry: &Geometry) -> u64 {
    (geometry.block_bytes() + 64).div_ceil(4096) * 4096
}

pub fn store(geometry: Geometry, blocks: u64) -> Arc<Store> {
    let config = StoreConfig {
        dram: DramStoreConfig::new(blocks * object_bytes(&geometry)),
        copy_threads: 1,
        lease_ttl: Duration::from_secs(60),
        leases_max: 256,
        ..StoreConfig::default()
    };
    Arc::new(Store::new(namespace(geometry), config).unwrap())
}

pub use tempfile::TempDir;

/// A fresh directory `<name>…` under the cargo target's temporary directory (O_DIRECT works there:
/// it is on the repository's file system), removed when dropped.
pub fn temp_dir(name: &str) -> TempDir {
    tempfile::Builder::new().prefix(name).tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap()
}

/// A store whose DRAM holds `dram_blocks` and whose SSD pool holds `ssd_blocks`.
pub fn ssd_store(dir: &TempDir, geometry: Geometry, dram_blocks: u64, ssd_blocks: u64) -> Arc<Store> {
    let mut ssd = SsdStoreConfig::new(ssd_pool_config(dir, &geometry, ssd_blocks));
    ssd.promote_on_hit = false;
    store_over(geometry, dram_blocks, ssd).unwrap()
}

/// A store of `dram_blocks` of DRAM over the SSD tier `ssd`.
fn store_over(geometry: Geometry, dram_blocks: u64, ssd: SsdStoreConfig) -> Result<Arc<Store>, StoreError> {
    let config = StoreConfig {
        dram: DramStoreConfig::new(dram_blocks * object_bytes(&geometry)),
        copy_threads: 1,
        lease_ttl: Duration::from_secs(60),
        leases_max: 256,
        ssd: Some(ssd),
        ..StoreConfig::default()
    };
    Store::new(namespace(geometry), config).map(Arc::new)
}

/// A store whose DRAM holds `dram_blocks` and whose SSD pool (`ssd_blocks`) stores every put
/// block through `codec` (write-through): all but the blocks DRAM keeps are read from SSD.
pub fn coded_ssd_store(
    dir: &TempDir,
    geometry: Geometry,
    dram_blocks: u64,
    ssd_blocks: u64,
    codec: TierCodec,
) -> Result<Arc<Store>, StoreError> {
    coded_ssd_store_promoting(dir, geometry, dram_blocks, ssd_blocks, codec, false)
}

/// The SSD pool configuration of [`ssd_store`] and [`coded_ssd_store`] in `dir`, to reopen it
/// without a store.
pub fn ssd_pool_config(dir: &TempDir, geometry: &Geometry, ssd_blocks: u64) -> SsdConfig {
    let object = object_bytes(geometry);
    let mut pool = SsdConfig::new(dir.path());
    pool.capacity_bytes = ssd_blocks * object;
    pool.probe_bytes = 0;
    pool
}

/// [`coded_ssd_store`], with the SSD tier's `promote_on_hit` set as given.
pub fn coded_ssd_store_promoting(
    dir: &TempDir,
    geometry: Geometry,
    dram_blocks: u64,
    ssd_blocks: u64,
    codec: TierCodec,
    promote_on_hit: bool,
) -> Result<Arc<Store>, StoreError> {
    let mut ssd = SsdStoreConfig::new(ssd_pool_config(dir, &geometry, ssd_blocks));
    ssd.promote_on_hit = promote_on_hit;
    ssd.write_through = true;
    ssd.admission_k = 1;
    ssd.codec = codec;
    store_over(geometry, dram_blocks, ssd)
}

/// The SSD codecs the tests cover: raw, lossless zstd and deflate, quant.
pub fn tier_codecs() -> Vec<TierCodec> {
    vec![
        TierCodec::Raw,
        TierCodec::Lossless { backend: "zstd".into(), level: Some(1) },
        TierCodec::Lossless { backend: "deflate".into(), level: Some(1) },
        TierCodec::Quant,
    ]
}

/// Whether `got` is `want` after `quant` (CacheGen bins, at least 16: `h >= 7`): every value
/// within `scale × (1/(2h) + 2⁻¹⁰)` of the original, `scale` its vector's max |x|.
pub fn within_quant_bound(geometry: &Geometry, want: &[u8], got: &[u8]) -> bool {
    let d = geometry.head_dim() as usize;
    let f = |b: &[u8]| -> Vec<f32> {
        b.chunks_exact(2).map(|p| f16::from_le_bytes([p[0], p[1]]).to_f32()).collect()
    };
    let (w, g) = (f(want), f(got));
    w.chunks(d).zip(g.chunks(d)).all(|(wv, gv)| {
        let scale = wv.iter().fold(0f32, |m, x| m.max(x.abs()));
        let bound = scale * (1.0 / 14.0 + 1.0 / 1024.0) + 1e-6;
        wv.iter().zip(gv).all(|(a, b)| (a - b).abs() <= bound)
    })
}

pub fn engine(store: &Arc<Store>, config: TransferConfig) -> TransferEngine {
    let handle: Arc<dyn StoreHandle> = store.clone();
    TransferEngine::new(handle, config).unwrap()
}

pub fn keys(store: &Store, first_token: u32, n: usize) -> Vec<BlockKey> {
    let bt = store.namespace().geometry.block_tokens();
    let tokens: Vec<u32> = (0..bt * n as u32).map(|t| t.wrapping_add(first_token)).collect();
    block_keys(store.namespace_hash(), &tokens, bt, &[]).unwrap()
}

/// fp16 values in [-2, 2) derived from the key alone (finite, so `quant` accepts them).
pub fn block(key: BlockKey, block_bytes: usize) -> Vec<u8> {
    let mut state = xxhash_rust::xxh3::xxh3_64(&key.to_le_bytes());
    let mut out = Vec::with_capacity(block_bytes);
    while out.len() < block_bytes {
        state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let z = (state ^ (state >> 29)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        let v = ((z >> 40) % 4096) as f32 / 1024.0 - 2.0;
        out.extend_from_slice(&f16::from_f32(v).to_le_bytes());
    }
    out
}

pub fn new_pool(geometry: &Geometry, num_blocks: u64) -> (Arc<PoolBuffer>, PoolRef) {
    let buf = PoolBuffer::new((num_blocks * geometry.block_bytes()) as usize);
    let r = PoolRef::owned(&buf, num_blocks);
    (buf, r)
}

/// Pool block `b` as a BlockFirst object. Call only when no job touches the pool.
pub fn pool_block(geometry: &Geometry, pool: &PoolBuffer, num_blocks: u64, b: u64) -> Vec<u8> {
    let mut out = vec![0u8; geometry.block_bytes() as usize];
    let bytes = unsafe { pool.as_slice() };
    gather_contiguous(geometry, bytes, num_blocks, &[b], &mut out, &WorkerPool::new(1)).unwrap();
    out
}

/// Puts `keys` with their [`block`] payloads as raw objects.
pub fn put_raw(store: &Store, keys: &[BlockKey]) {
    let blocks: Vec<Vec<u8>> = keys.iter().map(|&k| block(k, store.block_bytes())).collect();
    let refs: Vec<&[u8]> = blocks.iter().map(|b| &b[..]).collect();
    let r = store.put(store.namespace_hash(), keys, &refs).unwrap();
    assert_eq!(r.rejected, 0);
}
