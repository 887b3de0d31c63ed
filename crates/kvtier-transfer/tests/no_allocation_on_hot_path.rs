//! The load hot path (stage workers processing a chunk) allocates nothing: every stage buffer
//! was allocated when the engine started. A counting global allocator records allocations made
//! on threads marked as on the hot path; store calls (marked foreign) are counted apart and
//! must never allocate a data-sized buffer. The "No MM" variant (`allocate_per_chunk`) shows
//! the counter works: it must allocate.

#[path = "it/common/mod.rs"]
mod common;

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};

use common::*;
use kvtier_store::TierCodec;
use kvtier_transfer::hot_path::{in_foreign_call, in_hot_path};
use kvtier_transfer::{BlockOutcome, StageWorkers, TransferConfig};

struct Counting;

static HOT_ALLOCATIONS: AtomicUsize = AtomicUsize::new(0);
static FOREIGN_LARGEST: AtomicUsize = AtomicUsize::new(0);

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        record(layout);
        // SAFETY: forwarded with this function's contract.
        unsafe { System.alloc(layout) }
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        record(layout);
        // SAFETY: forwarded with this function's contract.
        unsafe { System.alloc_zeroed(layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: `realloc`'s contract makes `new_size` with `layout`'s alignment a valid
        // layout; the call is forwarded with that contract.
        unsafe {
            record(Layout::from_size_align_unchecked(new_size, layout.align()));
            System.realloc(ptr, layout, new_size)
        }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: forwarded with this function's contract.
        unsafe { System.dealloc(ptr, layout) }
    }
}

fn record(layout: Layout) {
    if in_hot_path() {
        HOT_ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
    } else if in_foreign_call() {
        FOREIGN_LARGEST.fetch_max(layout.size(), Ordering::Relaxed);
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

fn run(codec: &TierCodec, allocate_per_chunk: bool) -> (usize, usize, usize) {
    let g = geometry(4, 2, 64, 16);
    let bb = g.block_bytes() as usize;
    let n = 40usize;
    // Loads from SSD (DRAM keeps one block), each block stored under `codec`.
    let dir = temp_dir(&format!("no-alloc-{}-{allocate_per_chunk}", codec.name()));
    let store = coded_ssd_store(&dir, g.clone(), 1, n as u64 + 2, codec.clone()).unwrap();
    let ks = keys(&store, 0, n);
    let config = TransferConfig {
        chunk_blocks: 3,
        buffer_chunks: 2,
        stage_workers: StageWorkers { read: 2, decompress: 2, dequantize: 1, scatter: 2 },
        allocate_per_chunk,
        ..TransferConfig::default()
    };
    let engine = engine(&store, config);
    let (src, src_ref) = new_pool(&g, n as u64);
    {
        let staging: Vec<u8> = ks.iter().flat_map(|&k| block(k, bb)).collect();
        let ids: Vec<u64> = (0..n as u64).collect();
        kvtier_core::layout::scatter_contiguous(
            &g,
            &staging,
            n as u64,
            &ids,
            unsafe { src.as_mut_slice() },
            &kvtier_core::parallel::WorkerPool::new(1),
        )
        .unwrap();
    }
    let ids: Vec<u64> = (0..n as u64).collect();
    let s = engine.submit_store(&ks, src_ref, &ids).unwrap();
    assert_eq!(engine.wait(&[s]).unwrap()[0].done_blocks(), n);
    // No warm-up load: the very first load's chunks must not allocate either.
    HOT_ALLOCATIONS.store(0, Ordering::SeqCst);
    FOREIGN_LARGEST.store(0, Ordering::SeqCst);
    let (_p, r) = new_pool(&g, n as u64);
    let ids: Vec<u64> = (0..n as u64).rev().collect();
    let j = engine.submit_load(&ks, r, &ids).unwrap();
    let done = engine.wait(&[j]).unwrap().remove(0);
    assert!(done.outcomes.iter().all(|&o| o == BlockOutcome::Done));
    assert!(done.rounds > 1, "the job ran in rounds");
    (HOT_ALLOCATIONS.load(Ordering::SeqCst), FOREIGN_LARGEST.load(Ordering::SeqCst), bb)
}

#[test]
fn preallocated_pipeline_allocates_nothing_on_the_hot_path() {
    for codec in tier_codecs() {
        let (hot, foreign_largest, block_bytes) = run(&codec, false);
        assert_eq!(hot, 0, "codec {}: {hot} allocations on the hot path", codec.name());
        assert!(
            foreign_largest < block_bytes,
            "the store allocated {foreign_largest} bytes at once (block {block_bytes})"
        );
        // And the counter sees per-chunk buffers when they exist.
        let (hot, _, _) = run(&codec, true);
        assert!(hot >= 14, "codec {}: allocate_per_chunk made only {hot} allocations", codec.name());
    }
}
