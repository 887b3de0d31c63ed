//! Jobs whose target is a `PagedPool` (one store call each, on the store workers): layer
//! progress, per-block outcomes (a corrupted block, a miss, bad and repeated ids), stores,
//! cancel, and the engine's bounds.

use crate::common;

use std::sync::Arc;

use common::*;
use kvtier_core::layout::scatter_contiguous;
use kvtier_core::paged::PagedPool;
use kvtier_core::parallel::WorkerPool;
use kvtier_core::Geometry;
use kvtier_transfer::{BlockOutcome, PoolBuffer, TransferConfig, TransferError};

/// A `LayerFirst` buffer of `n` blocks as a paged pool: K and V of each layer, one region each.
fn paged(g: &Geometry, pool: &Arc<PoolBuffer>, n: usize) -> PagedPool {
    paged_as(g, pool, n, &vec![2usize; g.num_layers() as usize])
}

/// [`paged`] with `layers[l]` regions in layer `l`.
fn paged_as(g: &Geometry, pool: &Arc<PoolBuffer>, n: usize, layers: &[usize]) -> PagedPool {
    let seg = g.segment_bytes() as usize;
    let base = pool.as_ptr() as *mut u8;
    let regions: Vec<(*mut u8, usize)> =
        (0..2 * g.num_layers() as usize).map(|r| (unsafe { base.add(r * n * seg) }, seg)).collect();
    // SAFETY: the regions tile the live buffer, which the test keeps until the jobs are collected.
    unsafe { PagedPool::from_regions(&regions, layers, n) }.unwrap()
}

#[test]
fn paged_load_announces_each_layer_once_it_is_in_place() {
    let g = geometry(12, 2, 64, 16);
    let (bb, seg, n) = (g.block_bytes() as usize, g.segment_bytes() as usize, 20usize);
    let store = store(g.clone(), n as u64 + 1);
    let ks = keys(&store, 0, n);
    put_raw(&store, &ks);
    let engine = engine(&store, TransferConfig::default());
    let (pool, _) = new_pool(&g, n as u64);
    let ids: Vec<u64> = (0..n as u64).rev().collect();
    let job = engine.submit_paged_load(&ks, paged(&g, &pool, n), &ids).unwrap();
    for layer in 0..12u32 {
        engine.wait_layer(job, layer).unwrap();
        let l = layer as usize;
        for (i, (&k, &b)) in ks.iter().zip(&ids).enumerate() {
            let want = block(k, bb);
            for kv in 0..2 {
                // SAFETY: layer `l` of this job's blocks is final; nothing writes it now.
                let got = unsafe {
                    std::slice::from_raw_parts(pool.as_ptr().add(((2 * l + kv) * n + b as usize) * seg), seg)
                };
                assert!(got == &want[(2 * l + kv) * seg..][..seg], "layer {layer} block {i} kv {kv}");
            }
        }
    }
    let done = engine.wait(&[job]).unwrap().remove(0);
    assert!(done.outcomes.iter().all(|&o| o == BlockOutcome::Done), "{:?}", done.outcomes);
    for (i, &k) in ks.iter().enumerate() {
        assert_eq!(pool_block(&g, &pool, n as u64, ids[i]), block(k, bb));
    }
    assert_eq!(store.stats().leases_active, 0);
}

#[test]
fn paged_load_outcomes_are_per_block() {
    let g = geometry(3, 1, 32, 8);
    let bb = g.block_bytes() as usize;
    let store = store(g.clone(), 16);
    let ks = keys(&store, 0, 7);
    put_raw(&store, &ks[..6]); // block 6 misses
    assert!(store.corrupt_for_test(ks[2], 5));
    let engine = engine(&store, TransferConfig::default());
    let (pool, _) = new_pool(&g, 8);
    let ids = [0u64, 99, 2, 3, 3, 5, 6];
    let job = engine.submit_paged_load(&ks, paged(&g, &pool, 8), &ids).unwrap();
    let done = engine.wait(&[job]).unwrap().remove(0);
    use BlockOutcome::*;
    assert_eq!(done.outcomes, vec![Done, BadBlockId, ReadFailed, Done, DuplicateBlock, Done, Miss]);
    for i in [0usize, 3, 5] {
        assert_eq!(pool_block(&g, &pool, 8, ids[i]), block(ks[i], bb), "block {i}");
    }
    assert!(pool_block(&g, &pool, 8, 6).iter().all(|&x| x == 0), "a miss writes nothing");
    assert_eq!(store.stats().checksum_failures, 1);
    assert_eq!(store.stats().leases_active, 0);
    // A job of misses only finishes at once; waiting on its layers does not block.
    let job = engine.submit_paged_load(&keys(&store, 1000, 2), paged(&g, &pool, 8), &[1, 2]).unwrap();
    engine.wait_layer(job, 2).unwrap();
    assert_eq!(engine.wait(&[job]).unwrap()[0].outcomes, vec![Miss, Miss]);
}

#[test]
fn paged_store_round_trips() {
    let g = geometry(4, 2, 32, 8);
    let bb = g.block_bytes() as usize;
    let n = 6usize;
    let store = store(g.clone(), 16);
    let ks = keys(&store, 0, n);
    let (src, _) = new_pool(&g, n as u64);
    let objects: Vec<u8> = ks.iter().rev().flat_map(|&k| block(k, bb)).collect();
    let ids: Vec<u64> = (0..n as u64).rev().collect(); // ks[i] sits in pool block n-1-i
    let order: Vec<u64> = (0..n as u64).collect();
    // SAFETY: no job touches the pool yet.
    scatter_contiguous(&g, &objects, n as u64, &order, unsafe { src.as_mut_slice() }, &WorkerPool::new(1))
        .unwrap();
    let engine = engine(&store, TransferConfig::default());
    let put = engine.submit_paged_store(&ks, paged(&g, &src, n), &ids).unwrap();
    let done = engine.wait(&[put]).unwrap().remove(0);
    assert_eq!(done.done_blocks(), n);
    assert_eq!(store.lookup(store.namespace_hash(), &ks).unwrap().hit_blocks, n);
    let (dst, _) = new_pool(&g, n as u64);
    let job = engine.submit_paged_load(&ks, paged(&g, &dst, n), &order).unwrap();
    assert_eq!(engine.wait(&[job]).unwrap()[0].done_blocks(), n);
    for (i, &k) in ks.iter().enumerate() {
        assert_eq!(pool_block(&g, &dst, n as u64, i as u64), block(k, bb));
    }
}

#[test]
fn cancel_stops_a_queued_paged_job_and_releases_its_lease() {
    let g = geometry(8, 4, 64, 16);
    let n = 256usize;
    let store = store(g.clone(), 2 * n as u64 + 8);
    let ks = keys(&store, 0, n);
    let engine = engine(&store, TransferConfig::default()); // one store worker
    let (src, _) = new_pool(&g, n as u64);
    let ids: Vec<u64> = (0..n as u64).collect();
    let big = engine.submit_paged_store(&ks, paged(&g, &src, n), &ids).unwrap();
    put_raw(&store, &keys(&store, 1 << 20, 4));
    let (dst, _) = new_pool(&g, 8);
    // The load goes to other blocks: one into those the queued store reads would race it (refused).
    let (small, other): (Vec<u64>, Vec<u64>) = ((0..4).collect(), (4..8).collect());
    let queued = engine.submit_paged_store(&keys(&store, 1 << 21, 4), paged(&g, &dst, 8), &small).unwrap();
    let load = engine.submit_paged_load(&keys(&store, 1 << 20, 4), paged(&g, &dst, 8), &other).unwrap();
    let (stopped, stopped_load) = (engine.cancel(queued).unwrap(), engine.cancel(load).unwrap());
    let done = engine.wait(&[big, queued, load]).unwrap();
    assert_eq!(done[0].done_blocks(), n);
    for (job, stopped) in [(&done[1], stopped), (&done[2], stopped_load)] {
        assert_eq!(job.cancelled, stopped);
        // Cancelled before it ran (every block), or it had already run (none).
        let cancelled = job.outcomes.iter().filter(|&&o| o == BlockOutcome::Cancelled).count();
        assert!(cancelled == 0 || cancelled == 4, "{:?}", job.outcomes);
        assert!(!stopped || cancelled == 4 || job.done_blocks() == 4);
    }
    assert!(matches!(engine.cancel(big), Err(TransferError::UnknownJob { .. })));
    assert_eq!(store.stats().leases_active, 0);
}

#[test]
fn paged_jobs_keep_the_engine_bounds() {
    let g = geometry(2, 1, 32, 8);
    let bb = g.block_bytes();
    let store = store(g.clone(), 16);
    let ks = keys(&store, 0, 4);
    let config = TransferConfig {
        jobs_in_flight_max: 2,
        inflight_bytes_max: 6 * bb,
        job_blocks_max: 4,
        ..TransferConfig::default()
    };
    let engine = engine(&store, config);
    let (pool, _) = new_pool(&g, 8);
    let a = engine.submit_paged_store(&ks, paged(&g, &pool, 8), &[0, 1, 2, 3]).unwrap();
    let err = engine.submit_paged_store(&ks[..3], paged(&g, &pool, 8), &[4, 5, 6]).unwrap_err();
    assert!(matches!(err, TransferError::TooManyBytes { .. }), "{err}");
    let b = engine.submit_paged_load(&ks[..2], paged(&g, &pool, 8), &[4, 5]).unwrap();
    let err = engine.submit_paged_load(&ks[..1], paged(&g, &pool, 8), &[6]).unwrap_err();
    assert!(matches!(err, TransferError::TooManyJobs { .. }), "{err}");
    engine.wait(&[a, b]).unwrap();
    let five = keys(&store, 0, 5);
    let err = engine.submit_paged_load(&five, paged(&g, &pool, 8), &[0, 1, 2, 3, 4]).unwrap_err();
    assert!(matches!(err, TransferError::JobTooLarge { .. }), "{err}");
    let err = engine.submit_paged_load(&ks, paged(&g, &pool, 8), &[0, 1]).unwrap_err();
    assert!(matches!(err, TransferError::CountMismatch { .. }), "{err}");
    // A pool of another block size.
    let other = geometry(3, 1, 32, 8);
    let (wrong, _) = new_pool(&other, 8);
    let err = engine.submit_paged_load(&ks[..1], paged(&other, &wrong, 8), &[0]).unwrap_err();
    assert!(matches!(err, TransferError::PoolSize { .. }), "{err}");
    // K and V as layers of their own: wait_layer counts the geometry's layers, so a load refuses
    // them (a store does not care).
    let err = engine.submit_paged_load(&ks[..1], paged_as(&g, &pool, 8, &[1; 4]), &[0]).unwrap_err();
    assert!(matches!(err, TransferError::Layout(_)), "{err}");
    let c = engine.submit_paged_store(&ks[..1], paged_as(&g, &pool, 8, &[1; 4]), &[0]).unwrap();
    engine.wait(&[c]).unwrap();
}
