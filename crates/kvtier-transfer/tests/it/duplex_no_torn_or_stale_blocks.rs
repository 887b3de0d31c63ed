//! The duplex engine under random interleavings of writes, eager rotation, preemption (swap-out
//! then free), swap-ins that reuse just-freed device blocks, steps and waits: every device
//! block and host slot always ends up holding exactly what a sequential execution of the same
//! submissions would put there (no torn block, no stale block), and `Synced` is never a lie.
//!
//! The same interleavings run on a GPU (`DuplexEngine::on_cuda`, a device pool in CUDA memory and
//! two copy streams) in the `#[ignore]`d tests below: `cargo test -p kvtier-transfer --test
//! duplex_no_torn_or_stale_blocks -- --ignored` on a machine with an NVIDIA GPU.

use crate::common;

use std::collections::HashSet;
use std::sync::Arc;

use common::*;
use kvtier_core::{Dtype, ExtraGroup, Geometry};
use kvtier_transfer::cuda::Cuda;
use kvtier_transfer::{BlockState, DuplexConfig, DuplexEngine, PoolBuffer, TransferError};
use proptest::prelude::*;

const DEV: u64 = 6;
const HOST: u64 = 6;

/// An engine over `DEV` device blocks (host memory, or CUDA memory with `cuda`) and `HOST` slots.
fn engine(g: &Geometry, cuda: bool) -> (DuplexEngine, Arc<PoolBuffer>) {
    let (host, host_ref) = new_pool(g, HOST);
    let engine = if cuda {
        DuplexEngine::on_cuda(g, DEV, host_ref, DuplexConfig::default(), Cuda::load(0).unwrap()).unwrap()
    } else {
        let (_device, device_ref) = new_pool(g, DEV); // kept alive by the reference
        DuplexEngine::new(g, device_ref, host_ref, DuplexConfig::default()).unwrap()
    };
    (engine, host)
}

fn read_device(engine: &DuplexEngine, g: &Geometry, b: u64) -> Vec<u8> {
    let mut out = vec![0u8; g.block_bytes() as usize];
    engine.read_block(b, &mut out).unwrap();
    out
}

fn read_host(g: &Geometry, host: &PoolBuffer, h: u64) -> Vec<u8> {
    let bb = g.block_bytes() as usize;
    unsafe { std::slice::from_raw_parts(host.as_ptr().add(h as usize * bb), bb) }.to_vec()
}

fn content(tag: u64, bb: usize) -> Vec<u8> {
    block(tag as u128 * 0x9e37_79b9 + 1, bb)
}

struct Model {
    dev: Vec<Option<u64>>,
    /// What a block held when it was freed (its pending swap-outs copy that).
    freed: Vec<Option<u64>>,
    host: Vec<Option<u64>>,
    /// Device blocks targeted by a swap-in intent not yet submitted.
    reserved: HashSet<u64>,
    pending_out: Vec<(u64, u64)>,
    pending_in: Vec<(u64, u64)>,
    next_tag: u64,
}

impl Model {
    fn out_pending(&self, d: u64) -> bool {
        self.pending_out.iter().any(|&(pd, _)| pd == d)
    }

    /// Applies a submitted step: swap-outs first (the engine enqueues them first and orders a
    /// same-step swap-in after a conflicting swap-out), then swap-ins.
    fn submit(&mut self) {
        for (d, h) in std::mem::take(&mut self.pending_out) {
            self.host[h as usize] = self.dev[d as usize].or(self.freed[d as usize]);
        }
        for (h, d) in std::mem::take(&mut self.pending_in) {
            self.dev[d as usize] = self.host[h as usize];
            self.reserved.remove(&d);
        }
    }
}

fn run(ops: &[(u8, u8, u8)]) {
    run_on(ops, false)
}

fn run_on(ops: &[(u8, u8, u8)], cuda: bool) {
    // 32 KiB of K/V per block and an extra group (its own region of the pool).
    let extra = vec![ExtraGroup { name: "state".into(), bytes_per_token: 24 }];
    let g = Geometry::new(4, 2, 64, Dtype::F16, 16, extra).unwrap();
    let bb = g.block_bytes() as usize;
    let (engine, host) = engine(&g, cuda);
    let mut m = Model {
        dev: vec![None; DEV as usize],
        freed: vec![None; DEV as usize],
        host: vec![None; HOST as usize],
        reserved: HashSet::new(),
        pending_out: vec![],
        pending_in: vec![],
        next_tag: 1,
    };
    let mut tickets = vec![];
    for &(op, a, b) in ops {
        let (d, h) = (a as u64 % DEV, b as u64 % HOST);
        let di = d as usize;
        let busy = m.reserved.contains(&d) || m.out_pending(d);
        match op % 7 {
            // The serving engine writes new KV into a block (refused while a copy is queued).
            0 if !busy => {
                engine.wait_block(d).unwrap();
                let tag = m.next_tag;
                m.next_tag += 1;
                engine.write_block(d, &content(tag, bb)).unwrap();
                m.dev[di] = Some(tag);
            }
            // Eager rotation of a full block.
            1 if m.dev[di].is_some() && !m.reserved.contains(&d) => {
                engine.rotate(d, h).unwrap();
                m.pending_out.push((d, h));
            }
            // Preemption: swap out (only if not synced), then free at once.
            2 if m.dev[di].is_some() && !m.reserved.contains(&d) => {
                let state = engine.state(d).unwrap();
                if engine.swap_out(d, h).unwrap() {
                    m.pending_out.push((d, h));
                } else {
                    assert_eq!(state, BlockState::Synced { host: h });
                    // Synced is never a lie: the slot holds the block's bytes already.
                    assert_eq!(m.host[h as usize], m.dev[di], "synced block {d} vs slot {h}");
                }
                engine.free(d).unwrap();
                m.freed[di] = m.dev[di];
                m.dev[di] = None;
            }
            // Swap-in into a free device block, possibly one a preemption freed just now whose
            // swap-out has not even been submitted.
            3 if m.dev[di].is_none() && !m.reserved.contains(&d) && m.host[h as usize].is_some() => {
                engine.swap_in(h, d).unwrap();
                m.pending_in.push((h, d));
                m.reserved.insert(d);
            }
            4 => {
                let t = engine.submit_step().unwrap();
                m.submit();
                tickets.extend(t.swap_in.into_iter().chain(t.swap_out));
            }
            5 if !tickets.is_empty() => engine.wait(tickets[a as usize % tickets.len()]).unwrap(),
            // Check one device block once nothing moves it.
            6 if !busy => {
                engine.wait_block(d).unwrap();
                if let Some(tag) = m.dev[di] {
                    assert!(
                        read_device(&engine, &g, d) == content(tag, bb),
                        "device block {d} torn or stale"
                    );
                }
            }
            _ => {}
        }
    }
    engine.submit_step().unwrap();
    m.submit();
    engine.wait_all().unwrap();
    for d in 0..DEV {
        if let Some(tag) = m.dev[d as usize] {
            assert!(read_device(&engine, &g, d) == content(tag, bb), "device block {d} at the end");
        }
    }
    for h in 0..HOST {
        if let Some(tag) = m.host[h as usize] {
            assert!(read_host(&g, &host, h) == content(tag, bb), "host slot {h} at the end");
        }
    }
}

const PREEMPT_THEN_REUSE: [(u8, u8, u8); 9] =
    [(0, 0, 0), (0, 1, 1), (1, 1, 1), (4, 0, 0), (2, 0, 2), (3, 0, 1), (4, 0, 0), (6, 0, 0), (6, 0, 0)];

#[test]
fn preempt_then_reuse_in_the_same_step() {
    // Block 0 is swapped out and freed, and a swap-in into block 0 is queued in the same step:
    // the swap-in must wait for the swap-out's read.
    for i in 0..200u8 {
        run(&[
            (0, 0, 0),
            (0, 1, 1),
            (1, 1, 1),
            (4, 0, 0),
            (2, 0, 2),
            (3, 0, 1),
            (4, 0, 0),
            (6, i, 0),
            (6, 0, 0),
        ]);
    }
}

#[test]
fn one_step_writing_one_slot_twice_syncs_only_the_last() {
    // Found by `random_interleavings`: two rotations into slot 4 in one step; block 2's copy
    // lands last, so block 5 must not be reported synced with slot 4.
    run(&[(0, 5, 0), (1, 5, 4), (0, 2, 0), (1, 2, 4), (4, 0, 0), (5, 0, 0), (2, 5, 4), (4, 0, 0)]);
    let g = geometry(2, 2, 64, 16);
    let (_d, device_ref) = new_pool(&g, 6);
    let (_h, host_ref) = new_pool(&g, 6);
    let engine = DuplexEngine::new(&g, device_ref, host_ref, DuplexConfig::default()).unwrap();
    engine.write(5).unwrap();
    engine.write(2).unwrap();
    engine.rotate(5, 4).unwrap();
    engine.rotate(2, 4).unwrap();
    engine.submit_step().unwrap();
    engine.wait_all().unwrap();
    assert_eq!(engine.state(5).unwrap(), BlockState::Dirty);
    assert_eq!(engine.state(2).unwrap(), BlockState::Synced { host: 4 });
    assert!(engine.swap_out(5, 4).unwrap(), "block 5 is not in slot 4: it must move");
}

#[test]
fn writes_to_blocks_in_flight_are_refused() {
    let g = geometry(2, 2, 64, 16);
    let (_d, device_ref) = new_pool(&g, 4);
    let (_h, host_ref) = new_pool(&g, 4);
    let engine = DuplexEngine::new(&g, device_ref, host_ref, DuplexConfig::default()).unwrap();
    engine.write(1).unwrap();
    engine.rotate(1, 2).unwrap();
    assert!(engine.write(1).is_err(), "a queued copy-out must read the bytes it was queued for");
    engine.submit_step().unwrap();
    engine.wait_all().unwrap();
    assert_eq!(engine.state(1).unwrap(), BlockState::Synced { host: 2 });
    assert_eq!(engine.dirty_blocks(&[0, 1]).unwrap(), vec![0]);
    assert!(!engine.swap_out(1, 2).unwrap(), "a synced block moves nothing on preemption");
    assert!(engine.swap_out(1, 3).unwrap(), "to another slot it must move");
    assert!(engine.swap_in(9, 0).is_err() && engine.write(4).is_err());
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 200, ..ProptestConfig::default() })]
    #[test]
    fn random_interleavings(ops in prop::collection::vec((0u8..7, any::<u8>(), any::<u8>()), 1..120)) {
        run(&ops);
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU and libcudart: run with --ignored (docs/transfer.md section 6)"]
fn on_a_gpu_preempt_then_reuse_in_the_same_step() {
    for _ in 0..50 {
        run_on(&PREEMPT_THEN_REUSE, true);
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 200, ..ProptestConfig::default() })]
    #[test]
    #[ignore = "needs an NVIDIA GPU and libcudart: run with --ignored (docs/transfer.md section 6)"]
    fn on_a_gpu_random_interleavings(ops in prop::collection::vec((0u8..7, any::<u8>(), any::<u8>()), 1..120)) {
        run_on(&ops, true);
    }
}

#[test]
fn without_the_cuda_runtime_a_gpu_engine_is_refused_by_name() {
    // On a machine without libcudart (CI), asking for a CUDA engine is an error that names what
    // is missing and how to point at it, never a crash or a host engine in disguise. An empty
    // KVTIER_CUDART is no path (dlopen("") would open this program itself).
    let before = std::env::var_os("KVTIER_CUDART");
    for path in ["/nonexistent/libcudart.so", ""] {
        std::env::set_var("KVTIER_CUDART", path);
        match Cuda::load(0) {
            Err(TransferError::Device(m)) => {
                assert!(m.contains("libcudart") && m.contains("KVTIER_CUDART"), "{m}");
                assert!(!m.contains("no symbol"), "{path:?} opened something: {m}");
            }
            Err(e) => panic!("expected a device error, got {e}"),
            Ok(cuda) => {
                // A GPU machine: a device that does not exist is refused instead.
                let e = Cuda::load(cuda.device() + 4096).err().expect("device 4096 does not exist");
                assert!(e.to_string().contains("does not exist"), "{e}");
            }
        }
    }
    // The GPU tests of this binary may run after this one: give them the runtime path back.
    match before {
        Some(v) => std::env::set_var("KVTIER_CUDART", v),
        None => std::env::remove_var("KVTIER_CUDART"),
    }
}
