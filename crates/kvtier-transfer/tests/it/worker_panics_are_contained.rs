//! A panic on a transfer worker (injected with `panic_for_test`, the `test-hooks` feature) fails
//! the blocks of the chunk it held as `Panicked`, never the job or the thread: `wait` returns the
//! job, `wait_layer` errors instead of claiming a layer landed, the lease and the chunk's buffer
//! region come back, jobs before and after it load and store the right bytes, and drop returns.
//!
//! Every engine call runs under [`within`], so code that hangs (the engine before this was
//! contained) fails the test instead of hanging the run.

use crate::common;

use std::sync::{mpsc, Arc};
use std::time::Duration;

use common::*;
use kvtier_core::layout::scatter_contiguous;
use kvtier_core::paged::PagedPool;
use kvtier_core::parallel::WorkerPool;
use kvtier_core::{BlockKey, Geometry};
use kvtier_store::{Store, TierCodec};
use kvtier_transfer::{
    BlockOutcome, DuplexConfig, DuplexEngine, PanicSite, PoolBuffer, PoolRef, TransferConfig, TransferEngine,
    TransferError,
};

use BlockOutcome::{Done, Miss, Panicked};

/// Runs `f` on its own thread; fails (naming `what`) if it does not return within a minute.
fn within<T: Send + 'static>(what: &str, f: impl FnOnce() -> T + Send + 'static) -> T {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    match rx.recv_timeout(Duration::from_secs(60)) {
        Ok(v) => v,
        Err(mpsc::RecvTimeoutError::Timeout) => panic!("{what}: hung (no result within 60 s)"),
        Err(mpsc::RecvTimeoutError::Disconnected) => panic!("{what}: panicked"),
    }
}

/// One engine per test over `store`, shared with the threads `within` starts.
fn start(store: &Arc<Store>, chunk_blocks: usize, buffer_chunks: usize) -> Arc<TransferEngine> {
    Arc::new(engine(store, TransferConfig { chunk_blocks, buffer_chunks, ..TransferConfig::default() }))
}

/// Drops the last handle to `engine` (cancel, drain, join) within the time limit.
fn drop_within(engine: Arc<TransferEngine>) {
    within("drop", move || drop(Arc::into_inner(engine).expect("the last handle")));
}

fn is_worker_panic(r: &Result<(), TransferError>) -> bool {
    matches!(r, Err(TransferError::WorkerPanicked { .. }))
}

/// Loads `ks` into a fresh pool of `ks.len()` blocks (block `i` into pool block `i`); returns the
/// outcomes, whether `wait_layer` of the last layer errored as a worker panic, and the pool.
fn load(
    engine: &Arc<TransferEngine>,
    g: &Geometry,
    ks: &[BlockKey],
) -> (Vec<BlockOutcome>, bool, Arc<PoolBuffer>) {
    let (pool, r) = new_pool(g, ks.len() as u64);
    let ids: Vec<u64> = (0..ks.len() as u64).collect();
    let job = engine.submit_load(ks, r, &ids).unwrap();
    let last = g.num_layers() - 1;
    let e = engine.clone();
    let (layer, done) = within("wait_layer, wait", move || (e.wait_layer(job, last), e.wait(&[job])));
    (done.unwrap().remove(0).outcomes, is_worker_panic(&layer), pool)
}

/// Each `Done` block `i` holds `ks[i]`'s bytes in pool block `i`; each `Panicked` one is named in
/// `panicked`. The pool holds `ks.len()` blocks.
fn check_blocks(
    g: &Geometry,
    pool: &PoolBuffer,
    ks: &[BlockKey],
    outcomes: &[BlockOutcome],
    panicked: &[usize],
) {
    check_pool(g, pool, ks.len() as u64, ks, outcomes, panicked)
}

/// [`check_blocks`] in a pool of `num_blocks` blocks.
fn check_pool(
    g: &Geometry,
    pool: &PoolBuffer,
    num_blocks: u64,
    ks: &[BlockKey],
    outcomes: &[BlockOutcome],
    panicked: &[usize],
) {
    let bb = g.block_bytes() as usize;
    for (i, &o) in outcomes.iter().enumerate() {
        assert_eq!(o == Panicked, panicked.contains(&i), "block {i}: {outcomes:?}");
        if o == Done {
            assert_eq!(pool_block(g, pool, num_blocks, i as u64), block(ks[i], bb), "block {i}");
        }
    }
}

/// A job, a job whose chunk panics at `site`, a job after: returns the middle job's outcomes
/// and whether its `wait_layer` errored. `nth` counts passes through `site` from the first job on.
fn around_a_panic(
    store: &Arc<Store>,
    g: &Geometry,
    ks: &[BlockKey],
    site: PanicSite,
    nth: u64,
    chunk_blocks: usize,
) -> (Vec<BlockOutcome>, bool) {
    let engine = start(store, chunk_blocks, 1);
    let (before, before_panicked, pool) = load(&engine, g, ks);
    check_blocks(g, &pool, ks, &before, &[]);
    assert!(!before_panicked);
    engine.panic_for_test(site, nth);
    let (outcomes, layer_panicked, pool) = load(&engine, g, ks);
    let panicked: Vec<usize> = (0..ks.len()).filter(|&i| outcomes[i] == Panicked).collect();
    check_blocks(g, &pool, ks, &outcomes, &panicked);
    let (after, after_panicked, pool) = load(&engine, g, ks);
    check_blocks(g, &pool, ks, &after, &[]);
    assert!(!after_panicked && after.iter().all(|&o| o == Done), "{after:?}");
    assert_eq!(store.stats().leases_active, 0, "every lease released");
    drop_within(engine);
    (outcomes, layer_panicked)
}

#[test]
fn a_read_panic_fails_its_chunk_and_frees_its_region() {
    let g = geometry(3, 2, 32, 8);
    let store = store(g.clone(), 16);
    let ks = keys(&store, 0, 9);
    put_raw(&store, &ks);
    // One buffer region: a region the panicked chunk kept would stop every later chunk.
    let (outcomes, layer_panicked) = around_a_panic(&store, &g, &ks, PanicSite::Read, 2, 3);
    assert_eq!(outcomes, [[Done; 3], [Panicked; 3], [Done; 3]].concat());
    assert!(layer_panicked, "wait_layer must not report a layer of a panicked chunk as in place");
}

#[test]
fn a_scatter_panic_after_a_layer_fails_the_chunk_and_no_later_layer_is_announced() {
    let g = geometry(4, 2, 32, 8);
    let store = store(g.clone(), 16);
    let ks = keys(&store, 0, 6);
    put_raw(&store, &ks);
    // The scatter of chunk 0 panics after its layer 0 is in place.
    let (outcomes, layer_panicked) = around_a_panic(&store, &g, &ks, PanicSite::Scatter, 1, 2);
    assert_eq!(outcomes, [&[Panicked; 2][..], &[Done; 4]].concat());
    assert!(layer_panicked);
}

#[test]
fn a_panic_in_each_decode_stage_fails_its_chunk() {
    let g = geometry(4, 2, 64, 16);
    for (codec, site) in [
        (TierCodec::Lossless { backend: "zstd".into(), level: Some(1) }, PanicSite::Decompress),
        (TierCodec::Quant, PanicSite::Decompress),
        (TierCodec::Quant, PanicSite::Dequantize),
    ] {
        let dir = temp_dir(&format!("panic-{}-{site:?}", codec.name()));
        let store = coded_ssd_store(&dir, g.clone(), 1, 32, codec.clone()).unwrap();
        let ks = keys(&store, 0, 8);
        // Zeros: exact under every codec, so `check_blocks` compares bytes.
        let zeros = vec![0u8; store.block_bytes()];
        for k in &ks {
            assert_eq!(store.put(store.namespace_hash(), &[*k], &[&zeros[..]]).unwrap().rejected, 0);
        }
        assert!(store.stats().ssd_encoded_blocks > 0, "{codec:?}");
        let engine = start(&store, 2, 2);
        engine.panic_for_test(site, 1);
        let (outcomes, layer_panicked, pool) = load(&engine, &g, &ks);
        let panicked: Vec<usize> = (0..8).filter(|&i| outcomes[i] == Panicked).collect();
        assert!(!panicked.is_empty() && panicked.len() <= 2, "{site:?} {codec:?}: {outcomes:?}");
        assert_eq!(panicked[0] / 2, panicked[panicked.len() - 1] / 2, "one chunk: {outcomes:?}");
        assert!(layer_panicked, "{site:?} {codec:?}");
        for (i, &o) in outcomes.iter().enumerate() {
            assert!(o == Done || o == Panicked, "{site:?} {codec:?} block {i}: {o:?}");
            if o == Done {
                assert_eq!(pool_block(&g, &pool, 8, i as u64), zeros, "{site:?} {codec:?} block {i}");
            }
        }
        let (after, _, _) = load(&engine, &g, &ks);
        assert!(after.iter().all(|&o| o == Done), "{site:?} {codec:?}: {after:?}");
        assert_eq!(store.stats().leases_active, 0);
        drop_within(engine);
    }
}

/// A `LayerFirst` buffer of `n` blocks as a paged pool: K and V of each layer, one region each.
fn paged(g: &Geometry, pool: &Arc<PoolBuffer>, n: usize) -> PagedPool {
    let seg = g.segment_bytes() as usize;
    let base = pool.as_ptr() as *mut u8;
    let regions: Vec<(*mut u8, usize)> =
        (0..2 * g.num_layers() as usize).map(|r| (unsafe { base.add(r * n * seg) }, seg)).collect();
    let layers = vec![2usize; g.num_layers() as usize];
    // SAFETY: the regions tile the live buffer, which the test keeps until the jobs are collected.
    unsafe { PagedPool::from_regions(&regions, &layers, n) }.unwrap()
}

#[test]
fn a_store_side_panic_in_a_paged_load_fails_the_job_and_later_loads_go_on() {
    let g = geometry(4, 2, 32, 8);
    let n = 6usize;
    let store = store(g.clone(), 16);
    let ks = keys(&store, 0, n);
    put_raw(&store, &ks[..4]); // blocks 4 and 5 miss
    let engine = start(&store, 4, 2);
    // Inside `Store::load_into_pool`, after layer 0 is announced.
    engine.panic_for_test(PanicSite::PagedLoad, 1);
    let (pool, _) = new_pool(&g, n as u64);
    let ids: Vec<u64> = (0..n as u64).collect();
    let job = engine.submit_paged_load(&ks, paged(&g, &pool, n), &ids).unwrap();
    let e = engine.clone();
    let (layer, done) = within("paged wait_layer, wait", move || (e.wait_layer(job, 3), e.wait(&[job])));
    assert!(is_worker_panic(&layer), "layer 3 was never written: {layer:?}");
    assert_eq!(done.unwrap()[0].outcomes, [&[Panicked; 4][..], &[Miss; 2]].concat());
    assert_eq!(store.stats().leases_active, 0);
    // The next paged load, on the same store worker, loads every block.
    let (pool, _) = new_pool(&g, n as u64);
    let job = engine.submit_paged_load(&ks[..4], paged(&g, &pool, n), &ids[..4]).unwrap();
    let e = engine.clone();
    let (layer, done) = within("paged load after", move || (e.wait_layer(job, 3), e.wait(&[job])));
    layer.unwrap();
    check_pool(&g, &pool, n as u64, &ks[..4], &done.unwrap()[0].outcomes, &[]);
    store.check_integrity().unwrap();
    drop_within(engine);
}

#[test]
fn a_panic_in_a_store_job_fails_its_chunk_and_stores_nothing_of_it() {
    let g = geometry(2, 2, 32, 8);
    let n = 6usize;
    let store = store(g.clone(), 32);
    let ks = keys(&store, 0, 2 * n);
    let (pool, _) = new_pool(&g, n as u64);
    // The pool's blocks hold the payloads of keys 0..n (so a load reads them back).
    let objects: Vec<u8> = ks[..n].iter().flat_map(|&k| block(k, g.block_bytes() as usize)).collect();
    let order: Vec<u64> = (0..n as u64).collect();
    // SAFETY: no job touches the pool yet.
    scatter_contiguous(&g, &objects, n as u64, &order, unsafe { pool.as_mut_slice() }, &WorkerPool::new(1))
        .unwrap();
    let engine = start(&store, 2, 2);
    let ids: Vec<u64> = (0..n as u64).collect();
    let ns = store.namespace_hash();
    // A LayerFirst store job (chunk 1 panics), then a paged store job (its one chunk panics).
    engine.panic_for_test(PanicSite::Store, 2);
    let job = engine.submit_store(&ks[..n], PoolRef::owned(&pool, n as u64), &ids).unwrap();
    let e = engine.clone();
    let (layer, done) = within("store job", move || (e.wait_layer(job, 0), e.wait(&[job])));
    assert!(is_worker_panic(&layer));
    assert_eq!(done.unwrap()[0].outcomes, [[Done; 2], [Panicked; 2], [Done; 2]].concat());
    let present = |k: &BlockKey| store.lookup(ns, std::slice::from_ref(k)).unwrap().hit_blocks == 1;
    assert_eq!(ks[..n].iter().map(present).collect::<Vec<_>>(), [true, true, false, false, true, true]);
    engine.panic_for_test(PanicSite::Store, 1);
    let job = engine.submit_paged_store(&ks[n..], paged(&g, &pool, n), &ids).unwrap();
    let e = engine.clone();
    let done = within("paged store job", move || e.wait(&[job])).unwrap();
    assert_eq!(done[0].outcomes, vec![Panicked; n]);
    assert!(!ks[n..].iter().any(present));
    // The store worker goes on: the same paged store, unarmed, stores every block.
    let job = engine.submit_paged_store(&ks[n..], paged(&g, &pool, n), &ids).unwrap();
    let e = engine.clone();
    let done = within("paged store after", move || e.wait(&[job])).unwrap();
    assert_eq!(done[0].outcomes, vec![Done; n]);
    let (outcomes, _, loaded) = load(&engine, &g, &ks[n..]);
    check_blocks(&g, &loaded, &ks[..n], &outcomes, &[]);
    drop_within(engine);
}

#[test]
fn drop_returns_while_a_job_whose_worker_panicked_is_uncollected() {
    let g = geometry(2, 2, 32, 8);
    let store = store(g.clone(), 16);
    let ks = keys(&store, 0, 8);
    put_raw(&store, &ks);
    let engine = start(&store, 2, 1);
    engine.panic_for_test(PanicSite::Read, 1);
    let (_pool, r) = new_pool(&g, 8);
    let ids: Vec<u64> = (0..8).collect();
    engine.submit_load(&ks, r, &ids).unwrap();
    drop_within(engine);
    assert_eq!(store.stats().leases_active, 0);
}

#[test]
fn a_panicked_swap_fails_its_transfer_and_the_duplex_engine_goes_on() {
    let g = geometry(2, 2, 64, 16);
    let bb = g.block_bytes() as usize;
    let (_device, device_ref) = new_pool(&g, 4);
    let (host, host_ref) = new_pool(&g, 4);
    let engine = Arc::new(DuplexEngine::new(&g, device_ref, host_ref, DuplexConfig::default()).unwrap());
    let data = block(7, bb);
    engine.write_block(1, &data).unwrap();
    engine.panic_for_test(1);
    engine.rotate(1, 2).unwrap();
    let out = engine.submit_step().unwrap().swap_out.unwrap();
    let e = engine.clone();
    let failed = within("duplex wait", move || e.wait(out));
    assert!(matches!(&failed, Err(TransferError::Device(m)) if m.contains("panicked")), "{failed:?}");
    assert_eq!(engine.state(1).unwrap(), kvtier_transfer::BlockState::Dirty, "never synced");
    // The swap-out worker goes on: the same rotation now lands.
    engine.rotate(1, 2).unwrap();
    let out = engine.submit_step().unwrap().swap_out.unwrap();
    let e = engine.clone();
    within("duplex wait after", move || e.wait(out)).unwrap();
    let slot = unsafe { std::slice::from_raw_parts(host.as_ptr().add(2 * bb), bb) };
    assert_eq!(slot, &data[..]);
    within("duplex drop", move || drop(Arc::into_inner(engine).expect("the last handle")));
}
