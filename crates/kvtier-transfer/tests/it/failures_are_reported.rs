//! Bad input and faults: every failed block is listed in its job's outcomes, never left as
//! silent garbage; other blocks and other jobs go on; misuse is a clear error.

use crate::common;

use std::sync::Arc;

use common::*;
use kvtier_transfer::{BlockOutcome, PoolBuffer, PoolRef, TransferConfig, TransferError};

#[test]
fn checksum_failure_mid_job_fails_only_that_block() {
    let g = geometry(2, 2, 64, 16);
    let bb = g.block_bytes() as usize;
    let store = store(g.clone(), 16);
    let ks = keys(&store, 0, 10);
    put_raw(&store, &ks);
    // Blocks 4 and 5 (the middle of chunk 1 with chunk_blocks 3, and the start of... ) go bad.
    assert!(store.corrupt_for_test(ks[4], 100));
    assert!(store.corrupt_for_test(ks[5], 7));
    let engine =
        engine(&store, TransferConfig { chunk_blocks: 3, buffer_chunks: 2, ..TransferConfig::default() });
    let (pool, r) = new_pool(&g, 10);
    let ids: Vec<u64> = (0..10).collect();
    let job = engine.submit_load(&ks, r, &ids).unwrap();
    // A second job goes on while the first has failures.
    let (pool2, r2) = new_pool(&g, 10);
    let job2 = engine.submit_load(&ks[..3], r2, &[9, 8, 7]).unwrap();
    let done = engine.wait(&[job, job2]).unwrap();
    assert_eq!(done[0].failed(), vec![(4, BlockOutcome::ReadFailed), (5, BlockOutcome::ReadFailed)]);
    for i in [0usize, 1, 2, 3, 6, 7, 8, 9] {
        assert_eq!(pool_block(&g, &pool, 10, i as u64), block(ks[i], bb), "block {i}");
    }
    // The failed blocks were not written: no garbage in their pool blocks.
    assert!(pool_block(&g, &pool, 10, 4).iter().all(|&x| x == 0));
    assert_eq!(done[1].done_blocks(), 3);
    assert_eq!(pool_block(&g, &pool2, 10, 8), block(ks[1], bb));
    assert_eq!(store.stats().checksum_failures, 2);
    store.check_integrity().unwrap();
}

#[test]
fn misses_bad_ids_and_duplicates_are_per_block() {
    let g = geometry(2, 1, 32, 8);
    let bb = g.block_bytes() as usize;
    let store = store(g.clone(), 16);
    let ks = keys(&store, 0, 6);
    put_raw(&store, &ks[..4]); // blocks 4 and 5 miss
    let engine = engine(&store, TransferConfig { chunk_blocks: 2, ..TransferConfig::default() });
    let (pool, r) = new_pool(&g, 8);
    let ids = [0u64, 99, 2, 0, 5, 6];
    let job = engine.submit_load(&ks, r, &ids).unwrap();
    let done = engine.wait(&[job]).unwrap().remove(0);
    use BlockOutcome::*;
    assert_eq!(done.outcomes, vec![Done, BadBlockId, Done, DuplicateBlock, Miss, Miss]);
    assert_eq!(pool_block(&g, &pool, 8, 0), block(ks[0], bb), "the first of a duplicate id loads");
    assert_eq!(pool_block(&g, &pool, 8, 2), block(ks[2], bb));
    assert!(pool_block(&g, &pool, 8, 5).iter().all(|&x| x == 0), "a miss writes nothing");
    assert_eq!(store.stats().leases_active, 0);
}

#[test]
fn submission_errors_start_nothing() {
    let g = geometry(2, 1, 32, 8);
    let store = store(g.clone(), 16);
    let ks = keys(&store, 0, 2);
    let engine = engine(
        &store,
        TransferConfig {
            jobs_in_flight_max: 2,
            inflight_bytes_max: 5 * g.block_bytes(),
            ..TransferConfig::default()
        },
    );
    // A pool of the wrong geometry (one byte short; and a pool sized for another block size).
    let short = PoolBuffer::new(4 * g.block_bytes() as usize - 1);
    let err = engine.submit_load(&ks, PoolRef::owned(&short, 4), &[0, 1]).unwrap_err();
    assert!(matches!(err, TransferError::PoolSize { .. }), "{err}");
    let other = geometry(3, 1, 32, 8);
    let (_p, wrong) = new_pool(&other, 4);
    assert!(matches!(engine.submit_store(&ks, wrong, &[0, 1]).unwrap_err(), TransferError::PoolSize { .. }));
    let (_p, r) = new_pool(&g, 4);
    assert!(matches!(
        engine.submit_load(&ks, r.clone(), &[0]).unwrap_err(),
        TransferError::CountMismatch { .. }
    ));
    // Bounds: bytes, then jobs (uncollected finished jobs count).
    let many = keys(&store, 100, 6);
    let ids: Vec<u64> = (0..6).map(|i| i % 4).collect();
    let err = engine.submit_load(&many, r.clone(), &ids).unwrap_err();
    assert!(matches!(err, TransferError::TooManyBytes { .. }), "{err}");
    let a = engine.submit_load(&ks[..1], r.clone(), &[0]).unwrap();
    let b = engine.submit_load(&ks[..1], r.clone(), &[1]).unwrap();
    let err = engine.submit_load(&ks[..1], r.clone(), &[2]).unwrap_err();
    assert!(matches!(err, TransferError::TooManyJobs { active: 2, max: 2 }), "{err}");
    assert!(err.to_string().contains("jobs_in_flight_max"));
    engine.wait(&[a, b]).unwrap();
    engine.submit_load(&ks[..1], r, &[2]).unwrap();
    assert_eq!(store.stats().leases_active, 0, "refused submissions hold no lease");
}

#[test]
fn cancel_unknown_finished_and_running() {
    let g = geometry(4, 2, 64, 16);
    let store = store(g.clone(), 64);
    let ks = keys(&store, 0, 48);
    put_raw(&store, &ks);
    let engine =
        engine(&store, TransferConfig { chunk_blocks: 1, buffer_chunks: 1, ..TransferConfig::default() });
    assert!(matches!(engine.cancel(12345).unwrap_err(), TransferError::UnknownJob { id: 12345 }));
    let (_p, r) = new_pool(&g, 48);
    let ids: Vec<u64> = (0..48).collect();
    let small = engine.submit_load(&ks[..1], r.clone(), &[0]).unwrap();
    engine.wait_layer(small, 3).unwrap();
    while engine.outcomes(small).unwrap()[0] == BlockOutcome::Pending {
        std::thread::yield_now();
    }
    // Finished (not collected): cancelling is a no-op.
    let mut spins = 0;
    while engine.cancel(small).unwrap() {
        spins += 1;
        assert!(spins < 1_000_000, "the job never finished");
    }
    assert_eq!(engine.wait(&[small]).unwrap()[0].done_blocks(), 1);
    // Collected: unknown.
    assert!(matches!(engine.cancel(small).unwrap_err(), TransferError::UnknownJob { .. }));
    // Running: queued behind a 48-chunk job (oldest jobs are read first, one region), so none of
    // its 48 chunks can have finished when it is cancelled right away.
    let (_b, blocker_pool) = new_pool(&g, 48);
    let blocker = engine.submit_load(&ks, blocker_pool, &ids).unwrap();
    let big = engine.submit_load(&ks, r, &ids).unwrap();
    assert!(engine.cancel(big).unwrap(), "the job was still running");
    let done = engine.wait(&[big, blocker]).unwrap();
    assert!(done[0].cancelled && !done[1].cancelled);
    assert!(done[0].outcomes.iter().all(|&o| o == BlockOutcome::Done || o == BlockOutcome::Cancelled));
    assert!(done[0].outcomes.contains(&BlockOutcome::Cancelled), "{:?}", done[0].outcomes);
    assert_eq!(done[1].done_blocks(), 48, "the other job went on");
    assert_eq!(store.stats().leases_active, 0, "a cancelled job releases its lease");
    store.check_integrity().unwrap();
}

#[test]
fn incompressible_blocks_are_stored_raw_and_load_exactly() {
    // 64-byte blocks: no room for a codec object's headers, so the SSD tier stores them raw.
    let g = geometry(1, 1, 8, 2);
    let dir = temp_dir("transfer-incompressible");
    let codec = kvtier_store::TierCodec::Lossless { backend: "lz4".into(), level: None };
    let store = coded_ssd_store(&dir, g.clone(), 1, 8, codec).unwrap();
    let engine = engine(&store, TransferConfig::default());
    let ks = keys(&store, 0, 3);
    put_raw(&store, &ks);
    assert!(store.stats().ssd_encode_fallbacks >= 3); // write-through, and demotion of victims
    let (p, r) = new_pool(&g, 3);
    let job = engine.submit_load(&ks, r, &[0, 1, 2]).unwrap();
    let done = engine.wait(&[job]).unwrap().remove(0);
    assert_eq!(done.done_blocks(), 3);
    for (i, &k) in ks.iter().enumerate() {
        assert_eq!(pool_block(&g, &p, 3, i as u64), block(k, g.block_bytes() as usize));
    }
}

#[test]
fn dropping_the_engine_drains_jobs_and_releases_leases() {
    let g = geometry(2, 2, 64, 16);
    let store = store(g.clone(), 32);
    let ks = keys(&store, 0, 32);
    put_raw(&store, &ks);
    let pool: Arc<PoolBuffer>;
    {
        let engine =
            engine(&store, TransferConfig { chunk_blocks: 1, buffer_chunks: 1, ..TransferConfig::default() });
        let (p, r) = new_pool(&g, 32);
        pool = p;
        let ids: Vec<u64> = (0..32).collect();
        engine.submit_load(&ks, r, &ids).unwrap();
    }
    assert_eq!(store.stats().leases_active, 0);
    assert!(Arc::strong_count(&pool) == 1, "the engine let go of the pool");
    store.check_integrity().unwrap();
}

#[test]
fn a_failing_ssd_fails_its_blocks_and_other_jobs_go_on() {
    let dir = temp_dir("transfer-ssd-fault");
    let g = geometry(2, 2, 64, 16);
    let bb = g.block_bytes() as usize;
    let store = ssd_store(&dir, g.clone(), 3, 32);
    let ks = keys(&store, 0, 10);
    for k in ks.chunks(1) {
        put_raw(&store, k);
    }
    let tiers = store.lookup(store.namespace_hash(), &ks).unwrap().tiers;
    let on_ssd: Vec<usize> = (0..10).filter(|&i| tiers[i].name() == "ssd").collect();
    assert!(on_ssd.len() >= 6, "{tiers:?}");
    let engine =
        engine(&store, TransferConfig { chunk_blocks: 2, buffer_chunks: 2, ..TransferConfig::default() });
    let ids: Vec<u64> = (0..10).collect();
    // The device fails every read (EIO): SSD blocks fail, DRAM blocks load, in the same job.
    assert!(store.inject_ssd_error_for_test(0, false, 5));
    let (pool, r) = new_pool(&g, 10);
    let job = engine.submit_load(&ks, r, &ids).unwrap();
    let done = engine.wait(&[job]).unwrap().remove(0);
    for i in 0..10 {
        let want = if on_ssd.contains(&i) { BlockOutcome::ReadFailed } else { BlockOutcome::Done };
        assert_eq!(done.outcomes[i], want, "block {i} ({:?})", tiers[i]);
        if want == BlockOutcome::Done {
            assert_eq!(pool_block(&g, &pool, 10, i as u64), block(ks[i], bb));
        } else {
            assert!(pool_block(&g, &pool, 10, i as u64).iter().all(|&x| x == 0), "block {i} written");
        }
    }
    // The device recovers: a later job loads whatever the store still holds.
    assert!(store.inject_ssd_error_for_test(0, false, 0));
    let (pool2, r2) = new_pool(&g, 10);
    let hit = store.lookup(store.namespace_hash(), &ks).unwrap().hit_blocks;
    let job = engine.submit_load(&ks[..hit], r2, &ids[..hit]).unwrap();
    let done = engine.wait(&[job]).unwrap().remove(0);
    assert_eq!(done.done_blocks(), hit);
    for (i, &k) in ks[..hit].iter().enumerate() {
        assert_eq!(pool_block(&g, &pool2, 10, i as u64), block(k, bb));
    }
    assert_eq!(store.stats().leases_active, 0);
    store.check_integrity().unwrap();
}

/// Puts 4 blocks through a deflate SSD store in `dir`, then replaces block 2 with a codec object
/// that verifies (object checksum; a lossless header that declares block_bytes) but whose deflate
/// streams are garbage: only decoding finds it out. Returns the namespace hash and the keys.
fn plant_undecodable_block(dir: &TempDir, g: &kvtier_core::Geometry) -> (u128, Vec<kvtier_core::BlockKey>) {
    use kvtier_codec::{header, lossless::LosslessCodec, streams::Backend, Codec, CODEC_LOSSLESS};
    let bb = g.block_bytes() as usize;
    let (ns_hash, ks) = {
        let store = coded_ssd_store(dir, g.clone(), 1, 8, deflate()).unwrap();
        let ks = keys(&store, 0, 4);
        put_raw(&store, &ks);
        store.flush().unwrap();
        (store.namespace_hash(), ks)
    };
    let mut pool = ssd_pool_config(dir, g, 8);
    pool.min_object_bytes = bb as u64;
    let ssd = kvtier_pool::SsdTier::open(pool).unwrap();
    assert_eq!(kvtier_pool::Tier::remove(&ssd, ns_hash, &ks[2..3]), 1);
    let codec = LosslessCodec::new(Backend::Deflate, 1).unwrap();
    let mut payload = vec![0u8; codec.max_encoded_len(bb)];
    let n = codec.encode(&block(ks[2], bb), &mut payload).unwrap();
    payload.truncate(n);
    let body = header::parse(&payload, CODEC_LOSSLESS).unwrap().body.len();
    payload[n - body..].fill(0xff);
    let object = kvtier_core::object::encode_object(ns_hash, ks[2], CODEC_LOSSLESS, &payload);
    assert_eq!(kvtier_pool::Tier::put(&ssd, ns_hash, &ks[2..3], &[&object[..]]).stored, 1);
    ssd.flush().unwrap();
    (ns_hash, ks)
}

fn deflate() -> kvtier_store::TierCodec {
    kvtier_store::TierCodec::Lossless { backend: "deflate".into(), level: Some(1) }
}

#[test]
fn undecodable_blocks_are_reported_to_the_store_and_dropped() {
    let g = geometry(2, 2, 64, 16);
    let bb = g.block_bytes() as usize;
    // The pipeline, and the two sequential baselines (same stage code, same reporting).
    for mode in ["pipelined", "sequential", "chunk-sequential"] {
        let dir = temp_dir(&format!("transfer-undecodable-{mode}"));
        let (ns_hash, ks) = plant_undecodable_block(&dir, &g);
        let store = coded_ssd_store(&dir, g.clone(), 1, 8, deflate()).unwrap();
        assert_eq!(store.lookup(ns_hash, &ks).unwrap().hit_blocks, 4, "the planted object verifies");
        let engine =
            engine(&store, TransferConfig { chunk_blocks: 2, buffer_chunks: 2, ..TransferConfig::default() });
        let (pool, r) = new_pool(&g, 4);
        let done = match mode {
            "pipelined" => {
                let job = engine.submit_load(&ks, r, &[0, 1, 2, 3]).unwrap();
                engine.wait(&[job]).unwrap().remove(0)
            }
            _ => engine.load_sequential(&ks, r, &[0, 1, 2, 3], mode == "chunk-sequential").unwrap().0,
        };
        assert_eq!(done.failed(), vec![(2, BlockOutcome::DecodeFailed)], "{mode}");
        for i in [0usize, 1, 3] {
            assert_eq!(pool_block(&g, &pool, 4, i as u64), block(ks[i], bb), "{mode} block {i}");
        }
        assert!(pool_block(&g, &pool, 4, 2).iter().all(|&x| x == 0), "{mode}: garbage in the failed block");
        // Reported to the store: counted, and dropped, so no later load reads it again.
        assert_eq!(store.stats().decode_failures, 1, "{mode}");
        assert_eq!(store.lookup(ns_hash, &ks).unwrap().hit_blocks, 2, "{mode}");
        assert_eq!(store.lookup(ns_hash, &ks[3..]).unwrap().hit_blocks, 1, "{mode}");
        let (_, r) = new_pool(&g, 4);
        let job = engine.submit_load(&ks[2..3], r, &[0]).unwrap();
        assert_eq!(engine.wait(&[job]).unwrap()[0].failed(), vec![(0, BlockOutcome::Miss)], "{mode}");
        assert_eq!(store.stats().leases_active, 0);
        store.check_integrity().unwrap();
    }
}

#[test]
fn pipelined_loads_promote_lower_tier_blocks_into_dram() {
    let g = geometry(4, 2, 64, 16); // quant fits half the fp16 size from 3 layers on
    let bb = g.block_bytes() as usize;
    for codec in tier_codecs() {
        let dir = temp_dir("transfer-promote");
        let store = coded_ssd_store_promoting(&dir, g.clone(), 4, 16, codec.clone(), true).unwrap();
        let ns = store.namespace_hash();
        let ks = keys(&store, 0, 8);
        put_raw(&store, &ks);
        let before = store.lookup(ns, &ks[..4]).unwrap().tiers;
        assert!(before.iter().all(|t| t.name() == "ssd"), "{codec:?}: {before:?}");
        let engine =
            engine(&store, TransferConfig { chunk_blocks: 3, buffer_chunks: 2, ..TransferConfig::default() });
        let mut loaded = Vec::new();
        for round in 0..2 {
            let (pool, r) = new_pool(&g, 4);
            let job = engine.submit_load(&ks[..4], r, &[3, 2, 1, 0]).unwrap();
            assert_eq!(engine.wait(&[job]).unwrap()[0].done_blocks(), 4, "{codec:?} round {round}");
            let blocks: Vec<Vec<u8>> = (0..4).map(|i| pool_block(&g, &pool, 4, 3 - i)).collect();
            for (i, got) in blocks.iter().enumerate() {
                let want = block(ks[i], bb);
                let ok = if codec == kvtier_store::TierCodec::Quant {
                    within_quant_bound(&g, &want, got)
                } else {
                    *got == want
                };
                assert!(ok, "{codec:?} round {round} block {i}");
            }
            loaded.push(blocks);
            if round == 0 {
                // Promoted, decoded: the next load reads them from DRAM.
                assert_eq!(store.stats().promoted_blocks, 4, "{codec:?}");
                let after = store.lookup(ns, &ks[..4]).unwrap().tiers;
                assert!(after.iter().all(|t| t.name() == "dram"), "{codec:?}: {after:?}");
            }
        }
        assert_eq!(loaded[0], loaded[1], "{codec:?}: the promoted copy is the decoded block");
        assert_eq!(store.stats().promoted_blocks, 4, "{codec:?}: DRAM hits are not promoted again");
        store.check_integrity().unwrap();
    }
}
