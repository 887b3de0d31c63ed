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

use std::collections::VecDeque;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;

use kvtier_core::Geometry;

use crate::error::TransferError;
use crate::pool::{PoolRef, PoolShape};

/// Bounds of a [`DuplexEngine`].
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

/// Transfers made by one [`DuplexEngine::submit_step`]: ids to [`DuplexEngine::wait`] on.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StepTickets {
    pub swap_out: Option<u64>,
    pub swap_in: Option<u64>,
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Direction {
    Out,
    In,
}

struct Transfer {
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

struct State {
    blocks: Vec<BlockState>,
    generation: Vec<u64>,
    /// Last transfer to read / write each device block and host slot (0 = none).
    dev_read: Vec<u64>,
    dev_write: Vec<u64>,
    host_read: Vec<u64>,
    host_write: Vec<u64>,
    /// Device blocks made `Synced` with each host slot (several blocks can be swapped in from one
    /// slot); entries may be stale, the block's state decides.
    host_synced: Vec<Vec<usize>>,
    pending_out: Vec<(u64, u64)>,
    pending_in: Vec<(u64, u64)>,
    queues: [VecDeque<Transfer>; 2],
    /// Unfinished transfer seqs, per direction.
    unfinished: [VecDeque<u64>; 2],
    next_seq: u64,
    shutdown: bool,
}

impl State {
    fn finished(&self, seq: u64) -> bool {
        seq == 0 || !self.unfinished.iter().any(|q| q.contains(&seq))
    }
}

struct Shared {
    shape: PoolShape,
    device: PoolRef,
    host: PoolRef,
    config: DuplexConfig,
    state: Mutex<State>,
    changed: Condvar,
}

fn lock(m: &Mutex<State>) -> MutexGuard<'_, State> {
    m.lock().unwrap_or_else(|e| e.into_inner())
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

impl DuplexEngine {
    /// `device`: `num_blocks × block_bytes` (LayerFirst); `host`: `slots × block_bytes`
    /// (BlockFirst objects, `host.num_blocks()` slots). Both must outlive the engine.
    pub fn new(
        geometry: &Geometry,
        device: PoolRef,
        host: PoolRef,
        config: DuplexConfig,
    ) -> Result<Self, TransferError> {
        let bb = geometry.block_bytes();
        for (what, p) in [("device pool", &device), ("host swap space", &host)] {
            if p.num_blocks() == 0 || p.len() as u64 != p.num_blocks().saturating_mul(bb) {
                return Err(TransferError::PoolSize {
                    actual: p.len(),
                    expected: p.num_blocks().saturating_mul(bb),
                    num_blocks: p.num_blocks(),
                    block_bytes: bb,
                })
                .map_err(|e| duplex_err(format!("{what}: {e}")));
            }
        }
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
        };
        let shared = Arc::new(Shared {
            shape: PoolShape::new(geometry, device.num_blocks()),
            device,
            host,
            config,
            state: Mutex::new(state),
            changed: Condvar::new(),
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
        let mut st = lock(&self.shared.state);
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

    /// Waits until transfer `seq` (and so every earlier one of its direction) finished.
    pub fn wait(&self, seq: u64) -> Result<(), TransferError> {
        let mut st = lock(&self.shared.state);
        if seq == 0 || seq >= st.next_seq {
            return Err(duplex_err(format!("transfer {seq} was never submitted")));
        }
        while !st.finished(seq) {
            st = self.shared.changed.wait(st).unwrap_or_else(|e| e.into_inner());
        }
        Ok(())
    }

    /// Waits for every submitted transfer.
    pub fn wait_all(&self) {
        let mut st = lock(&self.shared.state);
        while st.unfinished.iter().any(|q| !q.is_empty()) {
            st = self.shared.changed.wait(st).unwrap_or_else(|e| e.into_inner());
        }
    }
}

/// Records a transfer with its dependencies and hazards; returns its id.
fn enqueue(st: &mut State, direction: Direction, pairs: Vec<(u64, u64)>, layer: Option<usize>) -> u64 {
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

fn worker(sh: &Shared, direction: Direction) {
    let q = direction as usize;
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
        copy(sh, &transfer);
        kvtier_core::copy::fence();
        let mut st = lock(&sh.state);
        if transfer.direction == Direction::Out && transfer.layer.is_none() {
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
        st.unfinished[q].retain(|&s| s != transfer.seq);
        sh.changed.notify_all();
    }
}

fn copy(sh: &Shared, t: &Transfer) {
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
                (Direction::In, _) => {
                    sh.shape.scatter_groups(device, object, d as usize);
                    for layer in 0..sh.shape.layers {
                        sh.shape.scatter_layer(device, object, d as usize, layer);
                    }
                }
            }
        }
    }
}

impl Drop for DuplexEngine {
    fn drop(&mut self) {
        self.wait_all();
        lock(&self.shared.state).shutdown = true;
        self.shared.changed.notify_all();
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}
