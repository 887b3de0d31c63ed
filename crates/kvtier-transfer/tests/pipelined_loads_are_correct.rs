//! Pipelined loads put the right bytes in the right pool blocks, for random geometries, chunk
//! sizes, buffer sizes (so, numbers of rounds), codecs and block tables; a store job followed
//! by a load job round-trips.

mod common;

use common::*;
use kvtier_transfer::{Backend, BlockOutcome, StageWorkers, TransferCodec, TransferConfig};
use proptest::prelude::*;

fn codec_of(i: u8) -> TransferCodec {
    match i % 4 {
        0 => TransferCodec::Raw,
        // Entropy-coding backends: the test blocks' random mantissas defeat lz4 (tested in
        // failures_are_reported.rs: such blocks are refused, not stored wrong).
        1 => TransferCodec::Lossless { backend: Backend::Zstd, level: 1 },
        2 => TransferCodec::Lossless { backend: Backend::Deflate, level: 1 },
        _ => TransferCodec::Quant { backend: Backend::Lz4, level: 0 },
    }
}

/// Stores `n` blocks through a store job from a source pool, then loads them through a load job
/// into a permuted table of a second pool, and checks every block.
#[allow(clippy::too_many_arguments)]
fn round_trip(
    layers: u32,
    heads: u32,
    dim: u32,
    tokens: u32,
    n: usize,
    chunk: usize,
    buffers: usize,
    codec: u8,
    workers: [usize; 4],
) {
    let g = geometry(layers, heads, dim, tokens);
    let bb = g.block_bytes() as usize;
    let store = store(g.clone(), n as u64 + 2);
    let codec = match codec_of(codec) {
        // 4-bit codes plus a 2-byte scale exceed half of a 2-value vector: quant refuses.
        TransferCodec::Quant { .. } if dim < 4 => TransferCodec::Raw,
        // Tiny blocks cannot hold a codec payload's headers: those are refused (tested in
        // failures_are_reported.rs).
        TransferCodec::Lossless { .. } | TransferCodec::Quant { .. } if g.block_bytes() < 1024 => {
            TransferCodec::Raw
        }
        c => c,
    };
    let config = TransferConfig {
        codec,
        chunk_blocks: chunk,
        buffer_chunks: buffers,
        stage_workers: StageWorkers::from_array(workers),
        ..TransferConfig::default()
    };
    let engine = engine(&store, config);
    let ks = keys(&store, 7, n);
    let num_blocks = n as u64 + 3;
    let (src, src_ref) = new_pool(&g, num_blocks);
    // Source pool block n - 1 - i holds key i's block.
    {
        let mut staging = vec![0u8; n * bb];
        for (i, &k) in ks.iter().enumerate() {
            staging[i * bb..(i + 1) * bb].copy_from_slice(&block(k, bb));
        }
        let ids: Vec<u64> = (0..n as u64).map(|i| n as u64 - 1 - i).collect();
        let pool = unsafe { src.as_mut_slice() };
        kvtier_core::layout::scatter_contiguous(
            &g,
            &staging,
            num_blocks,
            &ids,
            pool,
            &kvtier_core::parallel::WorkerPool::new(1),
        )
        .unwrap();
    }
    let src_ids: Vec<u64> = (0..n as u64).map(|i| n as u64 - 1 - i).collect();
    let stored = engine.submit_store(&ks, src_ref, &src_ids).unwrap();
    let done = engine.wait(&[stored]).unwrap();
    assert!(
        done[0].outcomes.iter().all(|&o| o == BlockOutcome::Done),
        "{:?} codec {:?} block {}",
        done[0].outcomes,
        codec,
        bb
    );

    let (dst, dst_ref) = new_pool(&g, num_blocks);
    // Descending, skipping pool blocks 0, n + 1 and n + 2.
    let dst_ids: Vec<u64> = (0..n as u64).map(|i| n as u64 - i).collect();
    let job = engine.submit_load(&ks, dst_ref, &dst_ids).unwrap();
    let done = engine.wait(&[job]).unwrap().remove(0);
    assert_eq!(done.rounds, n.div_ceil(chunk).div_ceil(buffers).max(1));
    for (i, (&k, &b)) in ks.iter().zip(&dst_ids).enumerate() {
        assert_eq!(done.outcomes[i], BlockOutcome::Done);
        let got = pool_block(&g, &dst, num_blocks, b);
        let want = expected(codec, &g, &block(k, bb));
        assert!(got == want, "block {i} (pool block {b}) differs; codec {}", codec.name());
    }
    // Blocks outside the table were never written.
    for b in (0..num_blocks).filter(|b| !dst_ids.contains(b)) {
        assert!(pool_block(&g, &dst, num_blocks, b).iter().all(|&x| x == 0), "pool block {b} was written");
    }
    store.check_integrity().unwrap();
    assert_eq!(store.stats().leases_active, 0, "the job released its lease");
}

/// What a block looks like after a round trip through `codec`.
fn expected(codec: TransferCodec, g: &kvtier_core::Geometry, block: &[u8]) -> Vec<u8> {
    match codec {
        TransferCodec::Quant { .. } => {
            use kvtier_codec::quant::{BinRule, QuantCodec, QuantConfig, CACHEGEN_KEYS, CACHEGEN_VALUES};
            use kvtier_codec::streams::Stage;
            use kvtier_codec::Codec;
            let rules = |keys, values| {
                QuantConfig::with_rules(
                    0,
                    g.num_layers() as u16,
                    g.block_tokens(),
                    g.num_kv_heads() as u16,
                    g.head_dim() as u16,
                    keys,
                    values,
                    Stage::new(Backend::None, 0).unwrap(),
                )
            };
            // The engine's rule: CacheGen's bins, or 16 everywhere when those exceed half size.
            let sixteen = BinRule { early_layers: 0, early_bins: 16, late_bins: 16 };
            let q = QuantCodec::new(rules(CACHEGEN_KEYS, CACHEGEN_VALUES))
                .or_else(|_| QuantCodec::new(rules(sixteen, sixteen)))
                .unwrap();
            let mut payload = vec![0u8; q.max_encoded_len(block.len())];
            let n = q.encode(block, &mut payload).unwrap();
            let mut out = vec![0u8; block.len()];
            kvtier_codec::decode(kvtier_codec::CODEC_QUANT, &payload[..n], &mut out).unwrap();
            out
        }
        _ => block.to_vec(),
    }
}

#[test]
fn one_round_and_many_rounds_every_codec() {
    for codec in 0..4 {
        round_trip(2, 2, 64, 16, 9, 2, 8, codec, [1, 1, 1, 1]); // fits: 1 round
        round_trip(3, 2, 32, 8, 17, 2, 2, codec, [2, 1, 2, 2]); // 9 chunks in 2 regions: 5 rounds
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]
    #[test]
    fn random_geometries_and_rounds(
        layers in 1u32..6, heads in 1u32..4, dim in prop::sample::select(vec![2u32, 8, 64, 130]),
        tokens in 1u32..9, n in 1usize..20, chunk in 1usize..6, buffers in 1usize..4, codec in 0u8..4,
        workers in prop::array::uniform4(1usize..3),
    ) {
        round_trip(layers, heads, dim, tokens, n, chunk, buffers, codec, workers);
    }
}

#[test]
fn loads_from_the_ssd_tier() {
    let dir = TempDir::new("transfer-ssd");
    let g = geometry(4, 2, 64, 16);
    // DRAM holds 2 blocks: most of the 12 live on SSD.
    let store = ssd_store(&dir, g.clone(), 2, 32);
    let ks = keys(&store, 3, 12);
    for k in ks.chunks(1) {
        put_raw(&store, k); // one at a time, so demotion to SSD keeps every block
    }
    let tiers = store.lookup(store.namespace_hash(), &ks).unwrap().tiers;
    assert!(tiers.iter().filter(|t| t.name() == "ssd").count() >= 8, "{tiers:?}");
    let engine =
        engine(&store, TransferConfig { chunk_blocks: 3, buffer_chunks: 2, ..TransferConfig::default() });
    let (pool, pool_ref) = new_pool(&g, 12);
    let ids: Vec<u64> = (0..12).rev().collect();
    let job = engine.submit_load(&ks, pool_ref, &ids).unwrap();
    let done = engine.wait(&[job]).unwrap().remove(0);
    assert_eq!(done.done_blocks(), 12, "{:?}", done.failed());
    for (&k, &b) in ks.iter().zip(&ids) {
        assert_eq!(pool_block(&g, &pool, 12, b), block(k, g.block_bytes() as usize));
    }
}

#[test]
fn sequential_baseline_loads_the_same_bytes() {
    let g = geometry(3, 2, 64, 16);
    let bb = g.block_bytes() as usize;
    let store = store(g.clone(), 16);
    let ks = keys(&store, 1, 10);
    let codec = TransferCodec::Quant { backend: Backend::Lz4, level: 0 };
    let engine = engine(&store, TransferConfig { codec, chunk_blocks: 3, ..TransferConfig::default() });
    let (src, src_ref) = new_pool(&g, 10);
    {
        let staging: Vec<u8> = ks.iter().flat_map(|&k| block(k, bb)).collect();
        let ids: Vec<u64> = (0..10).collect();
        kvtier_core::layout::scatter_contiguous(
            &g,
            &staging,
            10,
            &ids,
            unsafe { src.as_mut_slice() },
            &kvtier_core::parallel::WorkerPool::new(1),
        )
        .unwrap();
    }
    let ids: Vec<u64> = (0..10).collect();
    let s = engine.submit_store(&ks, src_ref, &ids).unwrap();
    engine.wait(&[s]).unwrap();
    let (a, a_ref) = new_pool(&g, 10);
    let (b, b_ref) = new_pool(&g, 10);
    let j = engine.submit_load(&ks, a_ref, &ids).unwrap();
    engine.wait(&[j]).unwrap();
    let (done, times) = engine.load_sequential(&ks, b_ref, &ids, false).unwrap();
    assert_eq!(done.done_blocks(), 10);
    assert!(times.iter().all(|&t| t >= 0.0) && times[2] > 0.0);
    assert!(unsafe { a.as_slice() == b.as_slice() });
    let (c, c_ref) = new_pool(&g, 10);
    let (done, times) = engine.load_sequential(&ks, c_ref, &ids, true).unwrap();
    assert_eq!(done.done_blocks(), 10);
    assert!(times[1] > 0.0 && times[2] > 0.0);
    assert!(unsafe { a.as_slice() == c.as_slice() });
    assert!(unsafe { a.as_slice().iter().any(|&x| x != 0) });
}
