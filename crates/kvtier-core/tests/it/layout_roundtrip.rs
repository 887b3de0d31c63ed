//! Gather and scatter move exactly the bytes the layout formulas say, on any geometry:
//! scatter∘gather is the identity, the fast path equals the per-segment baseline and an
//! element-wise reference, scatter touches only the listed blocks, and thread counts agree.

use kvtier_core::layout::{
    gather, gather_contiguous, gather_contiguous_per_segment, gather_per_segment, pool_bytes, scatter,
    scatter_contiguous, scatter_contiguous_per_segment, COPY_CHUNK_BYTES,
};
use kvtier_core::parallel::{WorkerPool, INLINE_BYTES_MAX};
use kvtier_core::{Dtype, ExtraGroup, Geometry};
use proptest::prelude::*;

/// Deterministic filler, so failing cases shrink on the seed instead of on megabytes.
fn bytes(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 24) as u8
        })
        .collect()
}

/// `map[object_byte] = pool_byte` for pool block `block`, from element-wise index math written
/// independently of the library: `[layer][k|v][block][token][head][dim][byte]` in the pool,
/// `[layer][k|v][token][head][dim][byte]` in the object, then extra groups `[block][token][byte]`.
fn reference_map(g: &Geometry, num_blocks: usize, block: usize) -> Vec<usize> {
    let (layers, heads, dims) = (g.num_layers() as usize, g.num_kv_heads() as usize, g.head_dim() as usize);
    let (tokens, elem) = (g.block_tokens() as usize, g.dtype().size_bytes() as usize);
    let mut map = Vec::new();
    for l in 0..layers {
        for c in 0..2 {
            for t in 0..tokens {
                for h in 0..heads {
                    for d in 0..dims {
                        for e in 0..elem {
                            let inner = ((t * heads + h) * dims + d) * elem + e;
                            let pool =
                                (((l * 2 + c) * num_blocks + block) * tokens * heads * dims) * elem + inner;
                            map.push(pool);
                        }
                    }
                }
            }
        }
    }
    let mut region = 2 * layers * num_blocks * tokens * heads * dims * elem;
    for group in g.extra_groups() {
        let per_token = group.bytes_per_token as usize;
        for t in 0..tokens {
            for e in 0..per_token {
                map.push(region + (block * tokens + t) * per_token + e);
            }
        }
        region += num_blocks * tokens * per_token;
    }
    assert_eq!(map.len() as u64, g.block_bytes());
    map
}

fn reference_gather(g: &Geometry, pool: &[u8], num_blocks: usize, ids: &[u64]) -> Vec<u8> {
    ids.iter().flat_map(|&b| reference_map(g, num_blocks, b as usize).into_iter().map(|p| pool[p])).collect()
}

fn geometry() -> impl Strategy<Value = Geometry> {
    (1u32..4, 1u32..3, 1u32..8, 0usize..Dtype::ALL.len(), 1u32..5, prop::collection::vec(1u32..7, 0..=2))
        .prop_map(|(layers, heads, dim, dtype, tokens, extra)| {
            let extra = extra
                .iter()
                .enumerate()
                .map(|(i, &b)| ExtraGroup { name: format!("g{i}"), bytes_per_token: b });
            Geometry::new(layers, heads, dim, Dtype::ALL[dtype], tokens, extra.collect()).unwrap()
        })
}

/// A pool size and a block table of distinct ids (a shuffled subset of the pool).
fn distinct_table() -> impl Strategy<Value = (u64, Vec<u64>)> {
    (1u64..9).prop_flat_map(|n| {
        let table = prop::sample::subsequence((0..n).collect::<Vec<_>>(), 0..=n as usize).prop_shuffle();
        (Just(n), table)
    })
}

/// A pool size and a gather table, ids possibly repeated.
fn any_table() -> impl Strategy<Value = (u64, Vec<u64>)> {
    (1u64..9).prop_flat_map(|n| (Just(n), prop::collection::vec(0..n, 0..10)))
}

fn gather_all_ways(g: &Geometry, pool: &[u8], n: u64, ids: &[u64]) -> Vec<u8> {
    let len = ids.len() * g.block_bytes() as usize;
    let mut one = vec![0u8; len];
    let mut four = vec![0u8; len];
    let mut naive = vec![0u8; len];
    let fast = gather_contiguous(g, pool, n, ids, &mut one, &WorkerPool::new(1)).unwrap();
    gather_contiguous(g, pool, n, ids, &mut four, &WorkerPool::new(4)).unwrap();
    let slow = gather_contiguous_per_segment(g, pool, n, ids, &mut naive).unwrap();
    assert_eq!(one, four, "threads=1 and threads=4 disagree");
    assert_eq!(one, naive, "merged gather differs from the per-segment baseline");
    assert_eq!((fast.bytes, fast.segments), (slow.bytes, slow.segments));
    assert!(fast.copies <= fast.segments);
    one
}

proptest! {
    #[test]
    fn gather_matches_baseline_and_reference(g in geometry(), (n, ids) in any_table(), seed: u64) {
        let pool = bytes(seed, pool_bytes(&g, n) as usize);
        let got = gather_all_ways(&g, &pool, n, &ids);
        prop_assert_eq!(got, reference_gather(&g, &pool, n as usize, &ids));
    }

    #[test]
    fn gather_after_scatter_is_identity(g in geometry(), (n, ids) in distinct_table(), seed: u64) {
        let objects = bytes(seed, ids.len() * g.block_bytes() as usize);
        let mut pool = bytes(!seed, pool_bytes(&g, n) as usize);
        scatter_contiguous(&g, &objects, n, &ids, &mut pool, &WorkerPool::new(2)).unwrap();
        prop_assert_eq!(gather_all_ways(&g, &pool, n, &ids), objects);
    }

    #[test]
    fn scatter_touches_only_listed_blocks(g in geometry(), (n, ids) in distinct_table(), seed: u64) {
        let objects = bytes(seed, ids.len() * g.block_bytes() as usize);
        let before = bytes(!seed, pool_bytes(&g, n) as usize);
        let mut one = before.clone();
        let mut four = before.clone();
        let mut naive = before.clone();
        scatter_contiguous(&g, &objects, n, &ids, &mut one, &WorkerPool::new(1)).unwrap();
        scatter_contiguous(&g, &objects, n, &ids, &mut four, &WorkerPool::new(4)).unwrap();
        scatter_contiguous_per_segment(&g, &objects, n, &ids, &mut naive).unwrap();
        prop_assert!(one == four, "threads=1 and threads=4 disagree");
        prop_assert!(one == naive, "merged scatter differs from the per-segment baseline");

        let mut expected = before;
        let block_bytes = g.block_bytes() as usize;
        for (i, &b) in ids.iter().enumerate() {
            for (o, p) in reference_map(&g, n as usize, b as usize).into_iter().enumerate() {
                expected[p] = objects[i * block_bytes + o];
            }
        }
        prop_assert!(one == expected, "scatter wrote outside the listed blocks or misplaced bytes");
    }
}

/// Geometries with large blocks, so merged runs are cut into chunks. Whether a copy runs on the
/// workers also depends on how many blocks it moves: many of these cases stay under
/// `INLINE_BYTES_MAX` and run inline, so [`threaded_case`] sizes tables to force the threaded path.
fn large_geometry() -> impl Strategy<Value = Geometry> {
    (1u32..4, 1u32..9, prop::sample::select(vec![64u32, 128]), prop::collection::vec(1u32..4096, 0..=2))
        .prop_map(|(layers, heads, dim, extra)| {
            let extra = extra
                .iter()
                .enumerate()
                .map(|(i, &b)| ExtraGroup { name: format!("g{i}"), bytes_per_token: b });
            Geometry::new(layers, heads, dim, Dtype::Bf16, 16, extra.collect()).unwrap()
        })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(24))]

    #[test]
    fn large_copies_agree_across_threads(g in large_geometry(), (n, ids) in distinct_table(), seed: u64) {
        let objects = bytes(seed, ids.len() * g.block_bytes() as usize);
        let mut pool = bytes(!seed, pool_bytes(&g, n) as usize);
        let mut naive = pool.clone();
        scatter_contiguous(&g, &objects, n, &ids, &mut pool, &WorkerPool::new(4)).unwrap();
        scatter_contiguous_per_segment(&g, &objects, n, &ids, &mut naive).unwrap();
        prop_assert!(pool == naive, "threaded scatter differs from the per-segment baseline");
        prop_assert_eq!(gather_all_ways(&g, &pool, n, &ids), objects);
    }
}

/// Bytes of objects that make a copy run on the worker threads: above [`INLINE_BYTES_MAX`], and
/// at least two copy batches (a batch closes once it holds `COPY_CHUNK_BYTES`, and runs are cut
/// to at most that, so a batch is under `2 * COPY_CHUNK_BYTES`).
const THREADED_BYTES_MIN: usize = {
    let batches = 2 * COPY_CHUNK_BYTES;
    if batches > INLINE_BYTES_MAX {
        batches + 1
    } else {
        INLINE_BYTES_MAX + 1
    }
};

/// A geometry (any block size from 4 KiB to ~330 KiB) with a pool and a distinct block table
/// whose objects total at least [`THREADED_BYTES_MIN`], so `WorkerPool::new(4)` does not run
/// them inline and the threaded path is what gets compared with one thread.
fn threaded_case() -> impl Strategy<Value = (Geometry, u64, Vec<u64>)> {
    large_geometry().prop_flat_map(|g| {
        let count = THREADED_BYTES_MIN.div_ceil(g.block_bytes() as usize) as u64;
        (count..count + 6).prop_flat_map(move |n| {
            let all: Vec<u64> = (0..n).collect();
            let table = prop::sample::subsequence(all, count as usize..=n as usize).prop_shuffle();
            (Just(g.clone()), Just(n), table)
        })
    })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(12))]

    #[test]
    fn threaded_copies_above_the_inline_threshold_match_one_thread(
        (g, n, ids) in threaded_case(),
        seed: u64,
    ) {
        let object_bytes = ids.len() * g.block_bytes() as usize;
        prop_assert!(object_bytes >= THREADED_BYTES_MIN, "{} bytes would run inline", object_bytes);
        let objects = bytes(seed, object_bytes);
        let before = bytes(!seed, pool_bytes(&g, n) as usize);
        let mut one = before.clone();
        let mut four = before.clone();
        scatter_contiguous(&g, &objects, n, &ids, &mut one, &WorkerPool::new(1)).unwrap();
        scatter_contiguous(&g, &objects, n, &ids, &mut four, &WorkerPool::new(4)).unwrap();
        prop_assert!(one == four, "threaded scatter differs from one thread");
        // gather_all_ways compares threads=1 with threads=4 and the per-segment baseline.
        let got = gather_all_ways(&g, &four, n, &ids);
        prop_assert!(got == objects, "gather after threaded scatter is not the identity");
        // Spot-check against the element-wise reference (first, last and one middle block).
        let block_bytes = g.block_bytes() as usize;
        for i in [0, ids.len() / 2, ids.len() - 1] {
            let reference = reference_gather(&g, &four, n as usize, &ids[i..=i]);
            prop_assert!(reference[..] == objects[i * block_bytes..(i + 1) * block_bytes]);
        }
    }
}

#[test]
fn slice_and_contiguous_entry_points_agree() {
    let g = Geometry::new(2, 2, 4, Dtype::F32, 3, vec![ExtraGroup { name: "s".into(), bytes_per_token: 5 }])
        .unwrap();
    let (n, ids) = (5u64, [3u64, 0, 4]);
    let block_bytes = g.block_bytes() as usize;
    let pool = bytes(7, pool_bytes(&g, n) as usize);
    let workers = WorkerPool::new(2);

    let mut contiguous = vec![0u8; ids.len() * block_bytes];
    gather_contiguous(&g, &pool, n, &ids, &mut contiguous, &workers).unwrap();
    let mut separate: Vec<Vec<u8>> = ids.iter().map(|_| vec![0u8; block_bytes]).collect();
    let mut slices: Vec<&mut [u8]> = separate.iter_mut().map(|o| o.as_mut_slice()).collect();
    gather(&g, &pool, n, &ids, &mut slices, &workers).unwrap();
    assert_eq!(separate.concat(), contiguous);
    let mut naive: Vec<Vec<u8>> = ids.iter().map(|_| vec![0u8; block_bytes]).collect();
    let mut slices: Vec<&mut [u8]> = naive.iter_mut().map(|o| o.as_mut_slice()).collect();
    gather_per_segment(&g, &pool, n, &ids, &mut slices).unwrap();
    assert_eq!(naive.concat(), contiguous);

    let shared: Vec<&[u8]> = separate.iter().map(|o| o.as_slice()).collect();
    let mut pool_a = vec![0u8; pool.len()];
    let mut pool_b = vec![0u8; pool.len()];
    scatter(&g, &shared, n, &ids, &mut pool_a, &workers).unwrap();
    kvtier_core::layout::scatter_per_segment(&g, &shared, n, &ids, &mut pool_b).unwrap();
    assert_eq!(pool_a, pool_b);
    // Blocks 1 and 2 were not listed: still zero. Blocks 3, 0, 4 hold the gathered bytes again.
    let mut unlisted = vec![1u8; 2 * block_bytes];
    gather_contiguous(&g, &pool_a, n, &[1, 2], &mut unlisted, &workers).unwrap();
    assert!(unlisted.iter().all(|&b| b == 0));
    let mut round = vec![0u8; ids.len() * block_bytes];
    gather_contiguous(&g, &pool_a, n, &ids, &mut round, &workers).unwrap();
    assert_eq!(round, contiguous);
}

#[test]
fn single_block_pool_merges_and_chunks_across_workers() {
    // One 2 MiB block (Llama-3-8B-like): the whole block is one merged run, cut into 1 MiB chunks.
    let g = Geometry::new(32, 8, 128, Dtype::Bf16, 16, vec![]).unwrap();
    let pool = bytes(3, pool_bytes(&g, 1) as usize);
    let mut object = vec![0u8; pool.len()];
    let stats = gather_contiguous(&g, &pool, 1, &[0], &mut object, &WorkerPool::new(4)).unwrap();
    assert_eq!(object, pool);
    assert_eq!((stats.segments, stats.copies), (64, 1));
    let mut back = vec![0u8; pool.len()];
    scatter_contiguous(&g, &object, 1, &[0], &mut back, &WorkerPool::new(4)).unwrap();
    assert_eq!(back, pool);
}
