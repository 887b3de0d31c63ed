//! The duplex swap engine (SuperInfer §4.3.2, DuplexKV): swap-out (device pool → host swap
//! space) and swap-in (host → device) run at the same time on their own workers and queues.
//!
//! - **Block states**: every device block is `Free`, `Dirty` (written since its last copy-out)
//!   or `Synced { host }` (host slot `host` holds the same bytes). [`rotate`](DuplexEngine::rotate)
//!   copies a full (immutable) block out eagerly in the background ("eager block rotation"), so a
//!   later [`swap_out`](DuplexEngine::swap_out) of a preempted request moves only its dirty tail.
//! - **No read or clobber of in-flight data**: each step's transfers record which earlier,
//!   unfinished transfers touch the same device blocks or host slots, and wait for them first:
//!   a swap-in into a block that a swap-out just released (and is still reading) waits for that
//!   read; a swap-in from a host slot still being written waits for the write; a swap-out into a
//!   host slot a swap-in is still reading waits for the read. Dependencies point only to earlier
//!   transfers and each queue runs in order, so there is no deadlock.
//! - **Batched**: intents are collected during a step and [`submit_step`](DuplexEngine::submit_step)
//!   makes at most one transfer per direction, of whole `BlockFirst` objects (host slot `h` is
//!   bytes `h × block_bytes ..`), never one call per small segment.
//!   [`swap_out_per_segment`](DuplexEngine::swap_out_per_segment) is that naive baseline, kept
//!   for the benchmark.
//! - Bounded: at most `queued_transfers_max` unfinished transfers per direction (a step beyond
//!   that is an error), at most `step_blocks_max` blocks per direction per step.
//! - **On a GPU** ([`on_cuda`](DuplexEngine::on_cuda), docs/transfer.md §6): the device pool is
//!   CUDA memory, the host swap space is pinned, and each direction's worker issues its copies on
//!   its own stream (one strided `cudaMemcpy2DAsync` per block), so swap-out and swap-in use the
//!   two directions of the link at once. The states and dependency rules are the same code.

use std::collections::{BTreeMap, VecDeque};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;

use kvtier_core::Geometry;

use crate::cuda::{CopyKind, Cuda};
use crate::duplex_queue::{enqueue, lock, worker, Copier, Direction, Shared, State};
pub use crate::duplex_queue::{BlockState, DuplexConfig};
use crate::error::TransferError;
use crate::pool::{PoolRef, PoolShape};

/// Transfers made by one [`DuplexEngine::submit_step`]: ids to [`DuplexEngine::wait`] on.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StepTickets {
    pub swap_out: Option<u64>,
    pub swap_in: Option<u64>,
}

/// Concurrent swap-in/swap-out between a `LayerFirst` device pool and a host swap space of
/// `BlockFirst` objects.
pub struct DuplexEngine {
    shared: Arc<Shared>,
    threads: Vec<JoinHandle<()>>,
}

fn duplex_err(m: String) -> TransferError {
    TransferError::Duplex(m)
}

/// The caller writes device block `dev` (index `d`): refused while a copy of it is queued or in
/// flight; its host copy, if any, is stale from now on.
fn mark_written(st: &mut State, dev: u64, d: usize) -> Result<(), TransferError> {
    let queued =
        st.pending_out.iter().any(|&(p, _)| p == dev) || st.pending_in.iter().any(|&(_, p)| p == dev);
    if queued || !st.finished(st.dev_read[d]) || !st.finished(st.dev_write[d]) {
        return Err(duplex_err(format!(
            "device block {dev} is queued or in flight; submit the step and wait for it before writing"
        )));
    }
    st.blocks[d] = BlockState::Dirty;
    st.generation[d] += 1;
    Ok(())
}

/// `p` holds `num_blocks` whole blocks of `bb` bytes, at least one.
fn check_size(what: &str, p: &PoolRef, bb: u64) -> Result<(), TransferError> {
    if p.num_blocks() == 0 || p.len() as u64 != p.num_blocks().saturating_mul(bb) {
        let e = TransferError::PoolSize {
            actual: p.len(),
            expected: p.num_blocks().saturating_mul(bb),
            num_blocks: p.num_blocks(),
            block_bytes: bb,
        };
        return Err(duplex_err(format!("{what}: {e}")));
    }
    Ok(())
}

impl DuplexEngine {
    /// `device`: `num_blocks × block_bytes` (LayerFirst); `host`: `slots × block_bytes`
    /// (BlockFirst objects, `host.num_blocks()` slots). Both must outlive the engine.
    pub fn new(
        geometry: &Geometry,
        device: PoolRef,
        host: PoolRef,
        config: DuplexConfig,
    ) -> Result<Self, TransferError> {
        Self::start(geometry, device, host, config, Copier::Host)
    }

    /// The device pool is `device_blocks` blocks of fresh CUDA memory (zeroed) on `cuda`'s
    /// device; `host` is pinned for the engine's life. Read and write device blocks with
    /// [`read_block`](Self::read_block) / [`write_block`](Self::write_block).
    pub fn on_cuda(
        geometry: &Geometry,
        device_blocks: u64,
        host: PoolRef,
        config: DuplexConfig,
        cuda: Arc<Cuda>,
    ) -> Result<Self, TransferError> {
        let len = device_blocks.checked_mul(geometry.block_bytes()).and_then(|n| usize::try_from(n).ok());
        let Some(len) = len.filter(|_| device_blocks > 0) else {
            return Err(duplex_err(format!(
                "device pool of {device_blocks} blocks; expected 1 or more that fit"
            )));
        };
        check_size("host swap space", &host, geometry.block_bytes())?;
        let memory = Arc::new(cuda.alloc(len)?);
        // SAFETY: the reference keeps the allocation alive; only the engine's workers and its
        // own read/write_block copy into it, under the engine's rules.
        let device = unsafe { PoolRef::kept(memory.ptr(), memory.len(), device_blocks, memory.clone()) };
        // SAFETY: `host` stays valid for the engine's life (the PoolRef contract); the guard is
        // dropped with the engine, after its workers stopped.
        let pinned = unsafe { cuda.pin(host.ptr(), host.len())? };
        let streams = [cuda.stream()?, cuda.stream()?, cuda.stream()?];
        Self::start(geometry, device, host, config, Copier::Cuda { cuda, streams, _pinned: pinned })
    }

    fn start(
        geometry: &Geometry,
        device: PoolRef,
        host: PoolRef,
        config: DuplexConfig,
        copier: Copier,
    ) -> Result<Self, TransferError> {
        let bb = geometry.block_bytes();
        check_size("device pool", &device, bb)?;
        check_size("host swap space", &host, bb)?;
        if config.queued_transfers_max == 0 || config.step_blocks_max == 0 {
            return Err(TransferError::Config("duplex bounds must be at least 1".into()));
        }
        let n = device.num_blocks() as usize;
        let h = host.num_blocks() as usize;
        let state = State {
            blocks: vec![BlockState::Free; n],
            generation: vec![0; n],
            dev_read: vec![0; n],
            dev_write: vec![0; n],
            host_read: vec![0; h],
            host_write: vec![0; h],
            host_synced: vec![Vec::new(); h],
            pending_out: Vec::new(),
            pending_in: Vec::new(),
            queues: [VecDeque::new(), VecDeque::new()],
            unfinished: [VecDeque::new(), VecDeque::new()],
            next_seq: 1,
            shutdown: false,
            failed: BTreeMap::new(),
            host_failed: vec![0; h],
        };
        let shared = Arc::new(Shared {
            shape: PoolShape::new(geometry, device.num_blocks()),
            device,
            host,
            config,
            copier,
            state: Mutex::new(state),
            changed: Condvar::new(),
            faults: Default::default(),
        });
        let threads = [Direction::Out, Direction::In]
            .into_iter()
            .map(|d| {
                let s = shared.clone();
                std::thread::Builder::new()
                    .name(format!("kvtier-swap-{}", if d == Direction::Out { "out" } else { "in" }))
                    .spawn(move || worker(&s, d))
                    .expect("spawning swap worker")
            })
            .collect();
        Ok(DuplexEngine { shared, threads })
    }

    fn check_dev(&self, dev: u64) -> Result<usize, TransferError> {
        let n = self.shared.device.num_blocks();
        if dev >= n {
            return Err(duplex_err(format!("device block {dev} is out of range; the pool has {n} blocks")));
        }
        Ok(dev as usize)
    }

    fn check_host(&self, host: u64) -> Result<usize, TransferError> {
        let n = self.shared.host.num_blocks();
        if host >= n {
            return Err(duplex_err(format!(
                "host slot {host} is out of range; the swap space has {n} slots"
            )));
        }
        Ok(host as usize)
    }

    pub fn state(&self, dev: u64) -> Result<BlockState, TransferError> {
        let d = self.check_dev(dev)?;
        Ok(lock(&self.shared.state).blocks[d])
    }

    /// The caller wrote (or is about to write) KV into `dev`: its host copy, if any, is stale.
    /// Errors if a transfer still reads or writes `dev` (wait with [`wait_block`](Self::wait_block)).
    pub fn write(&self, dev: u64) -> Result<(), TransferError> {
        let d = self.check_dev(dev)?;
        mark_written(&mut lock(&self.shared.state), dev, d)
    }

    /// Waits until no submitted transfer reads or writes device block `dev`.
    pub fn wait_block(&self, dev: u64) -> Result<(), TransferError> {
        let d = self.check_dev(dev)?;
        let mut st = lock(&self.shared.state);
        while !(st.finished(st.dev_read[d]) && st.finished(st.dev_write[d])) {
            st = self.shared.changed.wait(st).unwrap_or_else(|e| e.into_inner());
        }
        Ok(())
    }

    /// Eager rotation: `dev` is full and will not change; copy it to host slot `host` in the
    /// background with this step's swap-outs. When done it is `Synced { host }` (unless written
    /// or freed meanwhile).
    pub fn rotate(&self, dev: u64, host: u64) -> Result<(), TransferError> {
        self.queue_out(dev, host, false).map(|_| ())
    }

    /// Preemption: `dev` must be in host slot `host`. A block already `Synced { host }` moves
    /// nothing (returns false); a dirty one is copied with this step's swap-outs (true). The
    /// caller may [`free`](Self::free) `dev` right after: later swap-ins into it wait for the read.
    pub fn swap_out(&self, dev: u64, host: u64) -> Result<bool, TransferError> {
        self.queue_out(dev, host, true)
    }

    fn queue_out(&self, dev: u64, host: u64, skip_synced: bool) -> Result<bool, TransferError> {
        let d = self.check_dev(dev)?;
        self.check_host(host)?;
        let mut st = lock(&self.shared.state);
        match st.blocks[d] {
            BlockState::Free => {
                return Err(duplex_err(format!("device block {dev} is free; nothing to swap out")))
            }
            BlockState::Synced { host: h } if h == host && skip_synced => return Ok(false),
            _ => {}
        }
        if st.pending_out.len() >= self.shared.config.step_blocks_max {
            return Err(duplex_err(format!(
                "step_blocks_max = {} swap-outs queued this step",
                self.shared.config.step_blocks_max
            )));
        }
        st.pending_out.push((dev, host));
        Ok(true)
    }

    /// Swap-in: copy host slot `host` into device block `dev` (free, or about to be reused)
    /// with this step's swap-ins.
    pub fn swap_in(&self, host: u64, dev: u64) -> Result<(), TransferError> {
        self.check_dev(dev)?;
        self.check_host(host)?;
        let mut st = lock(&self.shared.state);
        if st.pending_in.len() >= self.shared.config.step_blocks_max {
            return Err(duplex_err(format!(
                "step_blocks_max = {} swap-ins queued this step",
                self.shared.config.step_blocks_max
            )));
        }
        st.pending_in.push((host, dev));
        Ok(())
    }

    /// The caller no longer uses `dev`. It may be the target of a swap-in at once.
    pub fn free(&self, dev: u64) -> Result<(), TransferError> {
        let d = self.check_dev(dev)?;
        let mut st = lock(&self.shared.state);
        st.blocks[d] = BlockState::Free;
        st.generation[d] += 1;
        Ok(())
    }

    /// Of `devs`, the blocks a preemption must copy (not `Synced`): the dirty tail.
    pub fn dirty_blocks(&self, devs: &[u64]) -> Result<Vec<u64>, TransferError> {
        let st = lock(&self.shared.state);
        let n = st.blocks.len() as u64;
        devs.iter()
            .map(
                |&d| if d < n { Ok(d) } else { Err(duplex_err(format!("device block {d} is out of range"))) },
            )
            .filter(|d| !matches!(d, Ok(d) if matches!(st.blocks[*d as usize], BlockState::Synced { .. })))
            .collect()
    }

    /// Submits this step's swap-outs as one transfer and its swap-ins as another; both run at
    /// once on their workers.
    pub fn submit_step(&self) -> Result<StepTickets, TransferError> {
        let mut st = lock(&self.shared.state);
        let outs = std::mem::take(&mut st.pending_out);
        let ins = std::mem::take(&mut st.pending_in);
        let max = self.shared.config.queued_transfers_max;
        for (dir, any) in [(0usize, !outs.is_empty()), (1, !ins.is_empty())] {
            if any && st.unfinished[dir].len() >= max {
                // Put the intents back: the step can be submitted again after a wait.
                st.pending_out = outs;
                st.pending_in = ins;
                return Err(duplex_err(format!(
                    "queued_transfers_max = {max} transfers unfinished in one direction; wait first"
                )));
            }
        }
        let mut tickets = StepTickets::default();
        if !outs.is_empty() {
            tickets.swap_out =
                Some(enqueue(&mut st, Direction::Out, outs.iter().map(|&(d, h)| (d, h)).collect(), None));
        }
        if !ins.is_empty() {
            tickets.swap_in =
                Some(enqueue(&mut st, Direction::In, ins.iter().map(|&(h, d)| (d, h)).collect(), None));
        }
        self.shared.changed.notify_all();
        Ok(tickets)
    }

    /// The naive baseline of SuperInfer Table 1: swaps `pairs` (device, host) out with one
    /// transfer per (block, layer) segment. Returns the last transfer's id.
    pub fn swap_out_per_segment(&self, pairs: &[(u64, u64)]) -> Result<Option<u64>, TransferError> {
        for &(d, h) in pairs {
            self.check_dev(d)?;
            self.check_host(h)?;
        }
        let mut last = None;
        for &(d, h) in pairs {
            for layer in 0..self.shared.shape.layers {
                let mut st = lock(&self.shared.state);
                last = Some(enqueue(&mut st, Direction::Out, vec![(d, h)], Some(layer)));
                drop(st);
                self.shared.changed.notify_all();
            }
        }
        Ok(last)
    }

    /// Tests only (`test-hooks`): the `nth` (from 1) transfer a swap worker starts from now
    /// panics before its copies (it fails as a device error does); 0 disarms it.
    #[cfg(feature = "test-hooks")]
    pub fn panic_for_test(&self, nth: u64) {
        self.shared.faults.arm(crate::panics::PanicSite::Swap, nth);
    }

    /// Waits until transfer `seq` (and so every earlier one of its direction) finished.
    pub fn wait(&self, seq: u64) -> Result<(), TransferError> {
        let mut st = lock(&self.shared.state);
        if seq == 0 || seq >= st.next_seq {
            return Err(duplex_err(format!("transfer {seq} was never submitted")));
        }
        while !st.finished(seq) {
            st = self.shared.changed.wait(st).unwrap_or_else(|e| e.into_inner());
        }
        match st.failed.remove(&seq) {
            Some(e) => Err(TransferError::Device(format!("transfer {seq} failed: {e}"))),
            None => Ok(()),
        }
    }

    /// Waits for every submitted transfer; errors naming each failed one not yet reported.
    pub fn wait_all(&self) -> Result<(), TransferError> {
        let mut st = lock(&self.shared.state);
        while st.unfinished.iter().any(|q| !q.is_empty()) {
            st = self.shared.changed.wait(st).unwrap_or_else(|e| e.into_inner());
        }
        let failed = std::mem::take(&mut st.failed);
        if failed.is_empty() {
            return Ok(());
        }
        let each: Vec<String> = failed.iter().map(|(seq, e)| format!("transfer {seq}: {e}")).collect();
        Err(TransferError::Device(format!("{} transfers failed: {}", failed.len(), each.join("; "))))
    }

    /// Copies device block `dev` (as one `BlockFirst` object) into `out`. Errors while a
    /// swap-in into `dev` is queued or in flight.
    ///
    /// The copy runs under the engine's lock (as does [`write_block`](Self::write_block)'s), so no
    /// swap of `dev` can be queued or submitted from another thread while it runs.
    pub fn read_block(&self, dev: u64, out: &mut [u8]) -> Result<(), TransferError> {
        self.check_object(out.len())?;
        let d = self.check_dev(dev)?;
        let st = lock(&self.shared.state);
        if st.pending_in.iter().any(|&(_, p)| p == dev) || !st.finished(st.dev_write[d]) {
            return Err(duplex_err(format!("device block {dev} is being swapped in; wait for it first")));
        }
        let copied = self.caller_copy(d, out.as_mut_ptr(), true);
        drop(st);
        copied
    }

    /// The caller's write of KV into device block `dev`: [`write`](Self::write), then `data`
    /// (one `BlockFirst` object) copied in, under the engine's lock.
    pub fn write_block(&self, dev: u64, data: &[u8]) -> Result<(), TransferError> {
        self.check_object(data.len())?;
        let d = self.check_dev(dev)?;
        let mut st = lock(&self.shared.state);
        mark_written(&mut st, dev, d)?;
        let copied = self.caller_copy(d, data.as_ptr().cast_mut(), false);
        drop(st);
        copied
    }

    fn check_object(&self, len: usize) -> Result<(), TransferError> {
        let bb = self.shared.shape.block_bytes;
        if len != bb {
            return Err(duplex_err(format!("block buffer of {len} bytes; expected {bb}")));
        }
        Ok(())
    }

    /// One block between the device pool and `object`, on the caller's thread (the third
    /// stream on a GPU); `to_object` reads the pool. Callers checked the block is not in flight.
    fn caller_copy(&self, d: usize, object: *mut u8, to_object: bool) -> Result<(), TransferError> {
        let (sh, device) = (&self.shared, self.shared.device.ptr());
        let Copier::Cuda { cuda, streams, .. } = &sh.copier else {
            // SAFETY: `d` was checked, `object` holds `block_bytes`, and no transfer touches `d`.
            unsafe {
                if to_object {
                    sh.shape.gather_block(device, d, object);
                } else {
                    sh.shape.scatter_block(device, object, d);
                }
            }
            kvtier_core::copy::fence();
            return Ok(());
        };
        let _on = cuda.current()?;
        let kind = if to_object { CopyKind::DeviceToHost } else { CopyKind::HostToDevice };
        // SAFETY: as above; `object` is pageable host memory, which the runtime stages itself.
        let issued = unsafe { sh.shape.block_rows(device, d, object, None, to_object) }
            .into_iter()
            // SAFETY: the rows stay inside the pool and the object; synchronized below.
            .try_for_each(|rows| unsafe { streams[2].copy_rows(rows, kind) });
        let synced = streams[2].synchronize();
        issued.and(synced)
    }
}

impl Drop for DuplexEngine {
    fn drop(&mut self) {
        let _ = self.wait_all(); // failures were the caller's to collect
        lock(&self.shared.state).shutdown = true;
        self.shared.changed.notify_all();
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}
