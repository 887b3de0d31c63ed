//! put/load bandwidth against a single-thread memcpy of the same bytes, measured in the same
//! run, and lookup latency for a 128K-token prompt (8192 blocks).
//!
//! `cargo bench -p kvtier-store --bench put_load [-- --total-mib N]`
//! Prints a human summary and one JSON line (`{"bench": "store_put_load", ...}`).

use std::hint::black_box;
use std::time::{Duration, Instant};

use kvtier_core::{block_keys, Dtype, Geometry, Namespace};
use kvtier_store::{DramStoreConfig, Store, StoreConfig};

const ROUNDS: usize = 3;

fn namespace(geometry: Geometry) -> Namespace {
    Namespace { model_id: "bench".into(), geometry, layout_version: 1, cache_salt: String::new(), rank: 0 }
}

fn best_of<F: FnMut() -> Duration>(rounds: usize, mut f: F) -> Duration {
    (0..rounds).map(|_| f()).min().expect("at least one round")
}

fn gib_per_s(bytes: usize, time: Duration) -> f64 {
    bytes as f64 / time.as_secs_f64() / f64::from(1u32 << 30)
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let total_mib: usize = args
        .iter()
        .position(|a| a == "--total-mib")
        .and_then(|i| args.get(i + 1))
        .map_or(1024, |v| v.parse().expect("--total-mib takes an integer"));

    // Llama-3-8B geometry: 2 MiB blocks.
    let geometry = Geometry::new(32, 8, 128, Dtype::Bf16, 16, vec![]).unwrap();
    let block_bytes = geometry.block_bytes() as usize;
    let blocks = total_mib * (1 << 20) / block_bytes;
    let total_bytes = blocks * block_bytes;
    let object_bytes = kvtier_pool::object_extent_bytes(block_bytes as u64);

    // Limit: one thread copying one contiguous buffer into another, both pre-faulted.
    let src: Vec<u8> = (0..total_bytes).map(|i| (i * 131 % 251) as u8).collect();
    let mut dst_flat = vec![1u8; total_bytes];
    let memcpy = best_of(ROUNDS, || {
        let t = Instant::now();
        dst_flat.copy_from_slice(black_box(&src));
        black_box(&dst_flat);
        t.elapsed()
    });
    drop(dst_flat);

    let config =
        StoreConfig { dram: DramStoreConfig::new(blocks as u64 * object_bytes), ..StoreConfig::default() };
    let store = Store::new(namespace(geometry), config).unwrap();
    let ns = store.namespace_hash();
    let objects: Vec<&[u8]> = src.chunks_exact(block_bytes).collect();
    let mut round = 0u32;
    let mut put_round = |store: &Store| {
        round += 1;
        let tokens: Vec<u32> = (0..blocks as u32 * 16).map(|t| t ^ (round << 24)).collect();
        let keys = block_keys(ns, &tokens, 16, &[]).unwrap();
        let t = Instant::now();
        let report = store.put(ns, &keys, &objects).unwrap();
        let elapsed = t.elapsed();
        assert_eq!(report.stored, blocks);
        (elapsed, keys)
    };
    // First put touches fresh arena pages (page faults); later puts evict and reuse them.
    let (put_cold, _) = put_round(&store);
    let mut put_warm = Duration::MAX;
    let mut keys = Vec::new();
    for _ in 0..ROUNDS {
        let (t, k) = put_round(&store);
        put_warm = put_warm.min(t);
        keys = k;
    }

    let mut dst_bufs: Vec<Vec<u8>> = (0..blocks).map(|_| vec![1u8; block_bytes]).collect();
    let load = best_of(ROUNDS, || {
        let lease = store.lease(ns, &keys).unwrap();
        assert_eq!(lease.hit_blocks, blocks);
        let mut dst: Vec<&mut [u8]> = dst_bufs.iter_mut().map(|b| &mut b[..]).collect();
        let t = Instant::now();
        let report = store.load(lease.id, &mut dst).unwrap();
        let elapsed = t.elapsed();
        assert_eq!(report.loaded_blocks, blocks);
        store.release(lease.id).unwrap();
        elapsed
    });
    assert!(dst_bufs.iter().zip(&objects).all(|(d, s)| d[..] == s[..]), "loaded bytes differ");
    drop(dst_bufs);
    drop(store);

    // Lookup of a 128K-token prompt: 8192 blocks, all present (small blocks keep memory low).
    let small = Geometry::new(1, 1, 64, Dtype::F16, 16, vec![]).unwrap();
    let small_object = kvtier_pool::object_extent_bytes(small.block_bytes());
    let config = StoreConfig { dram: DramStoreConfig::new(8192 * small_object), ..StoreConfig::default() };
    let store = Store::new(namespace(small), config).unwrap();
    let ns = store.namespace_hash();
    let tokens: Vec<u32> = (0..8192 * 16).collect();
    let keys = block_keys(ns, &tokens, 16, &[]).unwrap();
    let block = vec![3u8; store.block_bytes()];
    let refs: Vec<&[u8]> = keys.iter().map(|_| &block[..]).collect();
    store.put(ns, &keys, &refs).unwrap();
    let lookup = best_of(20, || {
        let t = Instant::now();
        let hit = store.lookup(ns, black_box(&keys)).unwrap().hit_blocks;
        let elapsed = t.elapsed();
        assert_eq!(hit, 8192);
        elapsed
    });
    let lease = best_of(20, || {
        let t = Instant::now();
        let lease = store.lease(ns, black_box(&keys)).unwrap();
        store.release(lease.id).unwrap();
        t.elapsed()
    });

    let put_ratio = memcpy.as_secs_f64() / put_warm.as_secs_f64();
    let load_ratio = memcpy.as_secs_f64() / load.as_secs_f64();
    println!("store put/load: {blocks} objects of {} KiB = {total_mib} MiB", block_bytes >> 10);
    println!("  memcpy (1 thread, contiguous)  {:7.2} GiB/s", gib_per_s(total_bytes, memcpy));
    println!(
        "  put, fresh arena pages         {:7.2} GiB/s  (first touch: page faults)",
        gib_per_s(total_bytes, put_cold)
    );
    println!(
        "  put, steady state (evicting)   {:7.2} GiB/s  = {put_ratio:.2}x memcpy",
        gib_per_s(total_bytes, put_warm)
    );
    println!(
        "  load                           {:7.2} GiB/s  = {load_ratio:.2}x memcpy",
        gib_per_s(total_bytes, load)
    );
    println!("  lookup 8192 keys (all hit)     {:7.1} us", lookup.as_secs_f64() * 1e6);
    println!("  lease+release 8192 keys        {:7.1} us", lease.as_secs_f64() * 1e6);
    println!(
        "{{\"bench\": \"store_put_load\", \"total_bytes\": {total_bytes}, \"block_bytes\": {block_bytes}, \
         \"memcpy_s\": {:.6}, \"put_cold_s\": {:.6}, \"put_s\": {:.6}, \"load_s\": {:.6}, \
         \"put_vs_memcpy\": {put_ratio:.3}, \"load_vs_memcpy\": {load_ratio:.3}, \
         \"lookup_8192_us\": {:.1}, \"lease_release_8192_us\": {:.1}}}",
        memcpy.as_secs_f64(),
        put_cold.as_secs_f64(),
        put_warm.as_secs_f64(),
        load.as_secs_f64(),
        lookup.as_secs_f64() * 1e6,
        lease.as_secs_f64() * 1e6
    );
}
