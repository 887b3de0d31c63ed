//! The duplex engine's bookkeeping and workers: block states, the per-direction queues with
//! their dependencies, and the copies a worker makes, on the host or on a CUDA device
//! ([`Copier`]). [`crate::duplex`] is the API over them.

use std::collections::{BTreeMap, VecDeque};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};

use crate::cuda::{CopyKind, Cuda, Pinned, Stream};
use crate::error::TransferError;
use crate::panics::{panic_message, Faults, PanicSite};
use crate::pool::{PoolRef, PoolShape};

/// Bounds of a [`DuplexEngine`](crate::DuplexEngine).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DuplexConfig {
    /// Unfinished transfers per direction, at most.
    pub queued_transfers_max: usize,
    /// Blocks per direction in one step, at most.
    pub step_blocks_max: usize,
}

impl Default for DuplexConfig {
    fn default() -> Self {
        DuplexConfig { queued_transfers_max: 64, step_blocks_max: 1 << 16 }
    }
}

/// State of one device block.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BlockState {
    Free,
    Dirty,
    Synced { host: u64 },
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) enum Direction {
    Out,
    In,
}

pub(crate) struct Transfer {
    seq: u64,
    direction: Direction,
    /// (device block, host slot, device generation at submission, live). A pair is not live
    /// when a later pair of the same transfer writes the same destination (host slot for a
    /// swap-out, device block for a swap-in): its copy would be overwritten, so it is skipped
    /// (and a skipped swap-out never marks its block synced).
    pairs: Vec<(u64, u64, u64, bool)>,
    /// `Some(layer)`: copy only that layer's K and V (the per-segment baseline).
    layer: Option<usize>,
    /// Earlier transfers that must finish first.
    deps: Vec<u64>,
}

pub(crate) struct State {
    pub blocks: Vec<BlockState>,
    pub generation: Vec<u64>,
    /// Last transfer to read / write each device block and host slot (0 = none).
    pub dev_read: Vec<u64>,
    pub dev_write: Vec<u64>,
    pub host_read: Vec<u64>,
    pub host_write: Vec<u64>,
    /// Device blocks made `Synced` with each host slot (several blocks can be swapped in from one
    /// slot); entries may be stale, the block's state decides.
    pub host_synced: Vec<Vec<usize>>,
    pub pending_out: Vec<(u64, u64)>,
    pub pending_in: Vec<(u64, u64)>,
    pub queues: [VecDeque<Transfer>; 2],
    /// Unfinished transfer seqs, per direction.
    pub unfinished: [VecDeque<u64>; 2],
    pub next_seq: u64,
    pub shutdown: bool,
    /// Transfers whose copies failed (a device error), with the error: reported once by `wait`.
    pub failed: BTreeMap<u64, String>,
    /// Per host slot, the failed swap-out that last wrote it (0 = none): a swap-in from it fails
    /// too, naming that transfer, until a swap-out rewrites the slot.
    pub host_failed: Vec<u64>,
}

impl State {
    pub fn finished(&self, seq: u64) -> bool {
        seq == 0 || !self.unfinished.iter().any(|q| q.contains(&seq))
    }
}

/// Where the device pool lives, and so how a worker copies.
pub(crate) enum Copier {
    /// Host memory: `kvtier_core::copy` (streaming stores), a store fence before completion.
    Host,
    /// CUDA device memory: one stream per direction (`streams[Direction as usize]`) and one for
    /// the caller's [`read_block`](crate::DuplexEngine::read_block) /
    /// [`write_block`](crate::DuplexEngine::write_block); the host swap space is pinned.
    Cuda { cuda: Arc<Cuda>, streams: [Stream; 3], _pinned: Pinned },
}

pub(crate) struct Shared {
    // Dropped first (fields drop in order): streams destroyed and the host swap space unpinned
    // while the device memory and the host memory behind `device` / `host` still exist.
    pub copier: Copier,
    pub shape: PoolShape,
    pub device: PoolRef,
    pub host: PoolRef,
    pub config: DuplexConfig,
    pub state: Mutex<State>,
    pub changed: Condvar,
    /// Injected panics (`test-hooks`; empty otherwise).
    pub faults: Faults,
}

pub(crate) fn lock(m: &Mutex<State>) -> MutexGuard<'_, State> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Records a transfer with its dependencies and hazards; returns its id.
pub(crate) fn enqueue(
    st: &mut State,
    direction: Direction,
    pairs: Vec<(u64, u64)>,
    layer: Option<usize>,
) -> u64 {
    let seq = st.next_seq;
    st.next_seq += 1;
    let mut deps = Vec::new();
    let mut with_gen = Vec::with_capacity(pairs.len());
    for &(d, h) in &pairs {
        let (di, hi) = (d as usize, h as usize);
        let conflicts = match direction {
            // Reads the device block, writes the host slot.
            Direction::Out => [st.dev_write[di], st.host_read[hi], st.host_write[hi]],
            // Reads the host slot, writes the device block.
            Direction::In => [st.dev_read[di], st.dev_write[di], st.host_write[hi]],
        };
        deps.extend(conflicts.into_iter().filter(|&s| s != 0 && !st.finished(s)));
        match direction {
            Direction::Out => {
                st.dev_read[di] = seq;
                st.host_write[hi] = seq;
                // The slot's old contents are being replaced: blocks synced to it are not any more.
                for b in std::mem::take(&mut st.host_synced[hi]) {
                    if st.blocks[b] == (BlockState::Synced { host: h }) {
                        if b == di {
                            st.host_synced[hi].push(b); // rewritten with its own bytes
                        } else {
                            st.blocks[b] = BlockState::Dirty;
                        }
                    }
                }
            }
            Direction::In => {
                st.host_read[hi] = seq;
                st.dev_write[di] = seq;
                st.generation[di] += 1;
                st.blocks[di] = BlockState::Synced { host: h };
                if !st.host_synced[hi].contains(&di) {
                    st.host_synced[hi].push(di);
                }
            }
        }
        with_gen.push((d, h, st.generation[di], true));
    }
    // A pair whose destination a later pair of the same transfer overwrites is skipped: its copy
    // would be overwritten anyway (and two streaming writes of one destination must not meet
    // without a fence). Swap-out writes host slots, swap-in device blocks.
    let mut later = std::collections::HashSet::with_capacity(with_gen.len());
    for pair in with_gen.iter_mut().rev() {
        pair.3 = later.insert(if direction == Direction::Out { pair.1 } else { pair.0 });
    }
    deps.sort_unstable();
    deps.dedup();
    let q = direction as usize;
    st.unfinished[q].push_back(seq);
    st.queues[q].push_back(Transfer { seq, direction, pairs: with_gen, layer, deps });
    seq
}

pub(crate) fn worker(sh: &Shared, direction: Direction) {
    let q = direction as usize;
    // A CUDA worker makes the engine's device current on its thread once; if it cannot, each of
    // its transfers fails with that error.
    let bound = match &sh.copier {
        Copier::Cuda { cuda, .. } => cuda.bind().map_err(|e| e.to_string()),
        Copier::Host => Ok(()),
    };
    loop {
        let transfer = {
            let mut st = lock(&sh.state);
            loop {
                if let Some(t) = st.queues[q].front() {
                    if t.deps.iter().all(|&s| st.finished(s)) {
                        break st.queues[q].pop_front().expect("front exists");
                    }
                } else if st.shutdown {
                    return;
                }
                st = sh.changed.wait(st).unwrap_or_else(|e| e.into_inner());
            }
        };
        let outcome = contained(sh, direction, || {
            sh.faults.hit(PanicSite::Swap);
            let copied = |()| copy(sh, &transfer).map_err(|e| e.to_string());
            bound.clone().and_then(|()| unwritten_source(sh, &transfer)).and_then(copied)
        });
        let mut st = lock(&sh.state);
        if transfer.direction == Direction::Out && transfer.layer.is_none() {
            let failed = if outcome.is_ok() { 0 } else { transfer.seq };
            for &(_, h, _, _) in transfer.pairs.iter().filter(|p| p.3) {
                st.host_failed[h as usize] = failed;
            }
        }
        match outcome {
            Ok(()) if transfer.direction == Direction::Out && transfer.layer.is_none() => {
                for &(d, h, generation, _) in transfer.pairs.iter().filter(|p| p.3) {
                    // Synced only if nobody wrote or freed the block since the copy was submitted.
                    if st.generation[d as usize] == generation && st.host_write[h as usize] == transfer.seq {
                        st.blocks[d as usize] = BlockState::Synced { host: h };
                        if !st.host_synced[h as usize].contains(&(d as usize)) {
                            st.host_synced[h as usize].push(d as usize);
                        }
                    }
                }
            }
            Ok(()) => {}
            Err(e) => {
                // A failed swap-in leaves its device blocks holding nothing trustworthy: they are
                // free again (never `Synced` with a slot they do not match). A failed swap-out
                // never marks its blocks synced. `wait` reports the error.
                if transfer.direction == Direction::In {
                    for &(d, _, _, _) in &transfer.pairs {
                        if st.dev_write[d as usize] == transfer.seq {
                            st.blocks[d as usize] = BlockState::Free;
                            st.generation[d as usize] += 1;
                        }
                    }
                }
                st.failed.insert(transfer.seq, e);
            }
        }
        st.unfinished[q].retain(|&s| s != transfer.seq);
        sh.changed.notify_all();
    }
}

/// Runs a transfer's copies (`run`); a panic there is the transfer's failure, as a device error
/// is (below: a swap-in's device blocks are freed, a swap-out marks nothing synced, `wait`
/// reports it), so the transfer finishes and the worker goes on instead of leaving `wait` and the
/// engine's drop hanging. `AssertUnwindSafe`: the state lock is not held across the copies (a
/// guard dropped by the unwind leaves a poisoned lock, which `lock` ignores), and the bytes a
/// half-done copy wrote belong to a transfer published as failed. Copies already queued on the
/// direction's CUDA stream finish before the failure is published, as after an error.
fn contained(
    sh: &Shared,
    direction: Direction,
    run: impl FnOnce() -> Result<(), String>,
) -> Result<(), String> {
    catch_unwind(AssertUnwindSafe(run)).unwrap_or_else(|payload| {
        if let Copier::Cuda { streams, .. } = &sh.copier {
            let _ = streams[direction as usize].synchronize();
        }
        Err(format!("a swap worker panicked: {}", panic_message(&*payload)))
    })
}

/// A swap-in whose host slot a failed swap-out last wrote has nothing valid to read.
fn unwritten_source(sh: &Shared, t: &Transfer) -> Result<(), String> {
    if t.direction == Direction::Out {
        return Ok(());
    }
    let st = lock(&sh.state);
    match t.pairs.iter().filter(|p| p.3).find(|p| st.host_failed[p.1 as usize] != 0) {
        Some(&(_, h, _, _)) => Err(format!(
            "host slot {h} holds no valid copy: transfer {}, which wrote it, failed",
            st.host_failed[h as usize]
        )),
        None => Ok(()),
    }
}

fn copy(sh: &Shared, t: &Transfer) -> Result<(), TransferError> {
    let Copier::Cuda { streams, .. } = &sh.copier else {
        copy_host(sh, t);
        kvtier_core::copy::fence();
        return Ok(());
    };
    let stream = &streams[t.direction as usize];
    let (kind, to_object) = match t.direction {
        Direction::Out => (CopyKind::DeviceToHost, true),
        Direction::In => (CopyKind::HostToDevice, false),
    };
    let (device, host, bb) = (sh.device.ptr(), sh.host.ptr(), sh.shape.block_bytes);
    let issue = || -> Result<(), TransferError> {
        for &(d, h, _, _) in t.pairs.iter().filter(|p| p.3) {
            // SAFETY: as `copy_host`; the device pool is device memory of this shape and the
            // host swap space is pinned for the engine's life.
            for rows in unsafe {
                sh.shape.block_rows(device, d as usize, host.add(h as usize * bb), t.layer, to_object)
            } {
                // SAFETY: `block_rows` stays inside the pool and the object; synchronized below.
                unsafe { stream.copy_rows(rows, kind)? };
            }
        }
        Ok(())
    };
    let issued = issue();
    // Whatever was queued finishes before the transfer is published, even after an error.
    let synced = stream.synchronize();
    issued.and(synced)
}

fn copy_host(sh: &Shared, t: &Transfer) {
    let bb = sh.shape.block_bytes;
    let (device, host) = (sh.device.ptr(), sh.host.ptr());
    for &(d, h, _, _) in t.pairs.iter().filter(|p| p.3) {
        // SAFETY: ids were checked in range; the dependency rules guarantee no other transfer
        // touches these bytes now, and the caller does not write blocks in flight (`write`
        // refuses them).
        unsafe {
            let object = host.add(h as usize * bb);
            match (t.direction, t.layer) {
                (Direction::Out, None) => sh.shape.gather_block(device, d as usize, object),
                (Direction::Out, Some(layer)) => {
                    sh.shape.gather_segment(device, d as usize, layer, object.add(2 * layer * sh.shape.seg))
                }
                (Direction::In, _) => sh.shape.scatter_block(device, object, d as usize),
            }
        }
    }
}
