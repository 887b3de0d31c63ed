//! `wait_layer(job, l)` never returns before layer `l` of every block of the job is in place.
//! Checked while later layers are still being written: only layer `l`'s bytes are read.

use crate::common;

use common::*;
use kvtier_transfer::{BlockOutcome, StageWorkers, TransferConfig};

#[test]
fn layer_bytes_are_in_place_when_wait_layer_returns() {
    let g = geometry(16, 2, 64, 16);
    let bb = g.block_bytes() as usize;
    let seg = g.segment_bytes() as usize;
    let n = 24usize;
    let store = store(g.clone(), n as u64 + 1);
    let ks = keys(&store, 0, n);
    put_raw(&store, &ks);
    for round in 0..6 {
        let config = TransferConfig {
            chunk_blocks: 1 + round % 3,
            buffer_chunks: 1 + round % 2,
            stage_workers: StageWorkers { scatter: 1 + round % 2, ..StageWorkers::default() },
            ..TransferConfig::default()
        };
        let engine = engine(&store, config);
        let (pool, r) = new_pool(&g, n as u64);
        let ids: Vec<u64> = (0..n as u64).rev().collect();
        let job = engine.submit_load(&ks, r, &ids).unwrap();
        let layers: Vec<u32> = if round % 2 == 0 { (0..16).collect() } else { (0..16).rev().collect() };
        for layer in layers {
            engine.wait_layer(job, layer).unwrap();
            for (i, (&k, &b)) in ks.iter().zip(&ids).enumerate() {
                let want = block(k, bb);
                for kv in 0..2usize {
                    let l = layer as usize;
                    let pool_off = ((2 * l + kv) * n + b as usize) * seg;
                    // SAFETY: layer `layer` of this job's blocks is final; nothing writes it now.
                    let got = unsafe { std::slice::from_raw_parts(pool.as_ptr().add(pool_off), seg) };
                    assert!(
                        got == &want[(2 * l + kv) * seg..][..seg],
                        "round {round} layer {layer} block {i} kv {kv}"
                    );
                }
            }
        }
        let done = engine.wait(&[job]).unwrap().remove(0);
        assert!(done.outcomes.iter().all(|&o| o == BlockOutcome::Done));
    }
}

#[test]
fn wait_layer_errors() {
    let g = geometry(2, 1, 32, 8);
    let store = store(g.clone(), 4);
    let engine = engine(&store, TransferConfig::default());
    assert!(engine.wait_layer(99, 0).is_err());
    let ks = keys(&store, 0, 1);
    let (_p, r) = new_pool(&g, 1);
    let job = engine.submit_load(&ks, r, &[0]).unwrap(); // a miss: finishes at once
    let err = engine.wait_layer(job, 2).unwrap_err();
    assert!(err.to_string().contains("layer 2"), "{err}");
    engine.wait_layer(job, 1).unwrap();
    assert_eq!(engine.wait(&[job]).unwrap()[0].outcomes, vec![BlockOutcome::Miss]);
}
