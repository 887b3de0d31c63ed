//! A submission whose pool blocks race a job in flight on the same pool (submitted, not yet
//! collected) is refused with `BlockInUse`, naming the block and the job, and starts nothing:
//! load vs load, a load into a block a store reads, a store from a block a load writes. Stores
//! may share blocks; other blocks and other pools are free; collection releases the blocks.
//! Claims last until collection, so these tests need no timing: a finished job still holds.

use crate::common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::*;
use kvtier_core::paged::PagedPool;
use kvtier_core::{BlockKey, Geometry};
use kvtier_store::Store;
use kvtier_transfer::{PoolBuffer, PoolRef, TransferConfig, TransferEngine, TransferError};

fn in_use(err: TransferError) -> (u64, &'static str, u64, &'static str) {
    match err {
        TransferError::BlockInUse { block, kind, job, held_kind } => (block, kind, job, held_kind),
        other => panic!("expected BlockInUse, got {other:?}"),
    }
}

/// A `LayerFirst` buffer of `n` blocks as a paged pool (K and V of each layer, one region each).
fn paged(g: &Geometry, pool: &Arc<PoolBuffer>, n: usize) -> PagedPool {
    let seg = g.segment_bytes() as usize;
    let base = pool.as_ptr() as *mut u8;
    let regions: Vec<(*mut u8, usize)> =
        (0..2 * g.num_layers() as usize).map(|r| (unsafe { base.add(r * n * seg) }, seg)).collect();
    // SAFETY: the regions tile the live buffer, which the test keeps until the jobs are collected.
    unsafe { PagedPool::from_regions(&regions, &vec![2usize; g.num_layers() as usize], n) }.unwrap()
}

/// Collects with `finished()` until job `id` shows up.
fn collect(engine: &TransferEngine, id: u64) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while !engine.finished().iter().any(|j| j.id == id) {
        assert!(Instant::now() < deadline, "job {id} never finished");
        std::thread::sleep(Duration::from_millis(1));
    }
}

#[test]
fn a_load_into_a_block_an_uncollected_load_holds_is_refused_until_collected() {
    let g = geometry(2, 1, 32, 8);
    let store = store(g.clone(), 16);
    let ks = keys(&store, 0, 4);
    put_raw(&store, &ks);
    let engine = engine(&store, TransferConfig::default());
    let (_buf, pool) = new_pool(&g, 8);
    let first = engine.submit_load(&ks[..2], pool.clone(), &[1, 2]).unwrap();
    let err = engine.submit_load(&ks[2..], pool.clone(), &[5, 2]).unwrap_err();
    assert_eq!(in_use(err.clone()), (2, "load", first, "load"));
    assert!(err.to_string().contains("pool block 2") && err.to_string().contains(&format!("job {first}")));
    assert_eq!(engine.jobs(), 1, "the refused submission started nothing");
    // Other blocks are free; out-of-range ids hold nothing (they settle as BadBlockId in each job).
    let other = engine.submit_load(&ks[2..], pool.clone(), &[5, 6]).unwrap();
    let bad = engine.submit_load(&ks[..1], pool.clone(), &[99]).unwrap();
    let bad2 = engine.submit_load(&ks[1..2], pool.clone(), &[99]).unwrap();
    engine.wait(&[first, other, bad, bad2]).unwrap();
    let again = engine.submit_load(&ks[2..], pool.clone(), &[5, 2]).unwrap(); // collected: released
    collect(&engine, again);
    assert_eq!(store.stats().leases_active, 0, "a refused load leased nothing");
}

#[test]
fn loads_and_stores_on_one_block_are_refused_both_ways_and_stores_share() {
    let g = geometry(2, 1, 32, 8);
    let store = store(g.clone(), 16);
    let ks = keys(&store, 0, 4);
    put_raw(&store, &ks[..2]);
    let engine = engine(&store, TransferConfig::default());
    let (_buf, pool) = new_pool(&g, 8);
    let save = engine.submit_store(&ks[2..3], pool.clone(), &[3]).unwrap();
    let save2 = engine.submit_store(&ks[3..4], pool.clone(), &[3]).unwrap(); // readers share
    let err = engine.submit_load(&ks[..1], pool.clone(), &[3]).unwrap_err();
    assert_eq!(in_use(err).0, 3);
    engine.wait(&[save]).unwrap();
    let err = engine.submit_load(&ks[..1], pool.clone(), &[3]).unwrap_err(); // one reader left
    assert_eq!(in_use(err), (3, "load", save2, "store"));
    engine.wait(&[save2]).unwrap();
    let load = engine.submit_load(&ks[..2], pool.clone(), &[3, 4]).unwrap();
    let err = engine.submit_store(&ks[2..], pool.clone(), &[0, 4]).unwrap_err();
    assert_eq!(in_use(err), (4, "store", load, "load"));
    collect(&engine, load);
    let save3 = engine.submit_store(&ks[2..], pool.clone(), &[0, 4]).unwrap();
    engine.wait(&[save3]).unwrap();
}

#[test]
fn paged_pools_over_the_same_memory_are_one_pool_and_other_memory_is_free() {
    let g = geometry(3, 1, 32, 8);
    let n = 8usize;
    let store = store(g.clone(), 16);
    let ks = keys(&store, 0, 2);
    put_raw(&store, &ks);
    let engine = engine(&store, TransferConfig::default());
    let (buf, _) = new_pool(&g, n as u64);
    let (other_buf, _) = new_pool(&g, n as u64);
    let load = engine.submit_paged_load(&ks, paged(&g, &buf, n), &[6, 7]).unwrap();
    // A second PagedPool object over the same tensors is the same pool.
    let err = engine.submit_paged_store(&ks[..1], paged(&g, &buf, n), &[7]).unwrap_err();
    assert_eq!(in_use(err), (7, "store", load, "load"));
    let err = engine.submit_paged_load(&ks[..1], paged(&g, &buf, n), &[6]).unwrap_err();
    assert_eq!(in_use(err).0, 6);
    let elsewhere = engine.submit_paged_load(&ks, paged(&g, &other_buf, n), &[6, 7]).unwrap();
    engine.wait(&[load, elsewhere]).unwrap();
    let save = engine.submit_paged_store(&ks[..1], paged(&g, &buf, n), &[7]).unwrap();
    engine.wait(&[save]).unwrap();
    assert_eq!(store.stats().leases_active, 0);
}

/// An 8-block pool, a 4-block view of the same buffer starting `first_block` blocks in, and a
/// store holding the two keys the tests load.
struct PoolAndView {
    store: Arc<Store>,
    ks: Vec<BlockKey>,
    engine: TransferEngine,
    _buf: Arc<PoolBuffer>,
    pool: PoolRef,
    view: PoolRef,
}

fn pool_and_view(first_block: usize) -> PoolAndView {
    let g = geometry(2, 1, 32, 8);
    let store = store(g.clone(), 16);
    let ks = keys(&store, 0, 2);
    put_raw(&store, &ks);
    let engine = engine(&store, TransferConfig::default());
    let (buf, pool) = new_pool(&g, 8);
    let bb = g.block_bytes() as usize;
    // SAFETY: blocks first_block..first_block + 4 of the live buffer, kept alive by `_buf`, which
    // each test binds for its whole body.
    let view = unsafe { PoolRef::from_raw((buf.as_ptr() as *mut u8).add(first_block * bb), 4 * bb, 4) };
    PoolAndView { store, ks, engine, _buf: buf, pool, view }
}

/// `job` was refused as a job on the 4-block view of the 8-block pool a load `load` holds.
fn refused_beside_the_load(what: &str, job: Result<u64, TransferError>, load: u64) {
    match job.unwrap_err() {
        TransferError::PoolShapeInUse {
            job, held_kind: "load", num_blocks: 4, held_num_blocks: 8, ..
        } => {
            assert_eq!(job, load, "{what}")
        }
        other => panic!("{what}: expected PoolShapeInUse, got {other:?}"),
    }
}

/// The same memory seen with another block count puts other bytes under the same ids: layer 0's
/// V of block 0 of a 4-block view is layer 0's K of block 4 of the 8-block pool. A job on such a
/// view while the pool is held is refused, whatever its ids; the same count, or after collection,
/// is free.
#[test]
fn a_pool_seen_with_another_block_count_while_held_is_refused() {
    let PoolAndView { store, ks, engine, _buf, pool, view: half } = pool_and_view(0);
    let load = engine.submit_load(&ks[..1], pool.clone(), &[4]).unwrap();
    refused_beside_the_load(
        "a load on the half view",
        engine.submit_load(&ks[1..], half.clone(), &[0]),
        load,
    );
    refused_beside_the_load(
        "a store on the half view",
        engine.submit_store(&ks[1..], half.clone(), &[0]),
        load,
    );
    assert_eq!(engine.jobs(), 1, "the refused submissions started nothing");
    // Ids past the view hold nothing, so they race nothing.
    let bad = engine.submit_load(&ks[1..], half.clone(), &[9]).unwrap();
    engine.wait(&[load, bad]).unwrap();
    let view = engine.submit_load(&ks[1..], half.clone(), &[0]).unwrap(); // collected: released
    engine.wait(&[view]).unwrap();
    assert_eq!(store.stats().leases_active, 0);
}

/// A view that starts one block in (another base address, so the claims' keys differ) overlaps
/// the pool under other ids: a load on it while the pool is loaded is refused, and so is a store
/// on it while a load holds the pool; two stores only read, and may share the bytes.
#[test]
fn an_offset_view_of_a_held_pool_is_refused_when_either_job_loads() {
    let PoolAndView { store, ks, engine, _buf, pool, view: offset } = pool_and_view(1);
    let load = engine.submit_load(&ks[..1], pool.clone(), &[7]).unwrap();
    refused_beside_the_load(
        "a load on the offset view",
        engine.submit_load(&ks[1..], offset.clone(), &[0]),
        load,
    );
    refused_beside_the_load(
        "a store on the offset view",
        engine.submit_store(&ks[1..], offset.clone(), &[0]),
        load,
    );
    engine.wait(&[load]).unwrap();
    let stores = [
        engine.submit_store(&ks[..1], pool.clone(), &[2]).unwrap(),
        engine.submit_store(&ks[1..], offset.clone(), &[0]).unwrap(),
    ];
    let err = engine.submit_load(&ks[1..], offset.clone(), &[1]).unwrap_err();
    assert!(
        err.to_string().starts_with("the load job's pool shares memory with the pool of store job"),
        "{err}"
    );
    engine.wait(&stores).unwrap();
    assert_eq!(engine.jobs(), 0);
    assert_eq!(store.stats().leases_active, 0);
}
