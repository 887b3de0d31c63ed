//! The I/O worker of one device: a thread that takes batches of operations, keeps up to
//! `io_depth` of them in flight through its [`Engine`], and answers each batch with one result
//! per operation.
//!
//! Objects on a device are bare payloads in whole pages. A payload (or destination) that is
//! page-aligned and of whole pages is transferred in place, with O_DIRECT, without a copy: a
//! write checksums it first (a read-only pass), a read checksums what landed. Otherwise it goes
//! through one of the worker's `io_depth` staging buffers, the copy computing the checksum. The
//! CPU work of one operation overlaps the I/O of the others in flight.
//!
//! Soundness of the raw pointers in [`Op`]: a batch is submitted by [`IoWorker::run`], which
//! blocks until the worker has answered, i.e. until every transfer of the batch completed. The
//! caller's buffers therefore outlive every use, and it holds them exclusively meanwhile.

use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Instant;

use kvtier_core::checksum::{checksum, copy_with_checksum};

use super::buffer::AlignedBuf;
use super::device::Device;
use super::engine::Engine;
use crate::extent::PAGE_BYTES;

/// What one operation does. Offsets are absolute device offsets; `len` is the bytes moved (the
/// object's extent: its payload rounded up to whole pages).
#[derive(Clone, Copy, Debug)]
pub enum OpKind {
    /// Writes the `payload_len` bytes at `src`, zero-padded to `len`; reports their checksum.
    WritePayload {
        src: *const u8,
        payload_len: usize,
    },
    /// Writes the `len` bytes at `src` (page-aligned) unchanged.
    WriteAligned {
        src: *const u8,
    },
    /// Reads an object into `dst` (`payload_len` bytes) and checks it against `checksum`.
    ReadObject {
        payload_len: usize,
        checksum: u64,
        dst: *mut u8,
    },
    /// Raw transfers from or into a page-aligned caller buffer (probe, benchmarks).
    RawWrite {
        src: *const u8,
    },
    RawRead {
        dst: *mut u8,
    },
}

/// Whether `len` bytes at `ptr` can be the whole transfer of an O_DIRECT op of `op_len` bytes.
fn in_place(ptr: *const u8, len: usize, op_len: usize) -> bool {
    ptr as usize % PAGE_BYTES as usize == 0 && len == op_len
}

#[derive(Clone, Copy, Debug)]
pub struct Op {
    pub offset: u64,
    pub len: usize,
    pub kind: OpKind,
}

// SAFETY: see the module docs: pointers are used only while their batch's submitter waits.
unsafe impl Send for Op {}

impl Op {
    fn is_write(&self) -> bool {
        matches!(
            self.kind,
            OpKind::WritePayload { .. } | OpKind::WriteAligned { .. } | OpKind::RawWrite { .. }
        )
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OpResult {
    /// Written; the payload checksum (WritePayload), else 0.
    Written(u64),
    /// Read and, for objects, verified (and copied out if staged).
    Read,
    /// Read, but the object failed verification: the destination must not be used.
    Corrupt,
    /// The transfer failed with this errno (or was cut short: EIO).
    IoError(i32),
    NotRun,
}

struct Batch {
    ops: Vec<Op>,
    sync: bool,
    reply: Sender<(Vec<OpResult>, Option<i32>)>,
}

/// Handle to a device's worker thread.
pub struct IoWorker {
    sender: Option<Sender<Batch>>,
    thread: Option<JoinHandle<()>>,
    device: Arc<Device>,
    engine_name: &'static str,
}

/// A pending batch: [`Pending::wait`] blocks until its results arrive.
pub struct Pending {
    receiver: Receiver<(Vec<OpResult>, Option<i32>)>,
    count: usize,
}

impl Pending {
    /// One result per operation, and the `fdatasync` errno if one was asked for and failed.
    pub fn wait(self) -> (Vec<OpResult>, Option<i32>) {
        // A worker that died (a bug) is an I/O error for every operation, never silence.
        self.receiver
            .recv()
            .unwrap_or_else(|_| (vec![OpResult::IoError(libc::EIO); self.count], Some(libc::EIO)))
    }
}

impl IoWorker {
    pub fn spawn(device: Arc<Device>, engine: Box<dyn Engine>, depth: usize) -> std::io::Result<Self> {
        let (sender, receiver) = channel::<Batch>();
        let engine_name = engine.name();
        let state = WorkerState { device: Arc::clone(&device), engine, slots: Vec::new(), depth };
        let thread = std::thread::Builder::new()
            .name(format!("kvtier-ssd-{}", device.index))
            .spawn(move || state.serve(receiver))?;
        Ok(IoWorker { sender: Some(sender), thread: Some(thread), device, engine_name })
    }

    pub fn engine_name(&self) -> &'static str {
        self.engine_name
    }

    /// Hands `ops` to the worker; `sync` asks for an `fdatasync` after them if any write
    /// succeeded (its failure is reported for the whole batch).
    ///
    /// # Safety
    /// Every pointer in `ops` must stay valid (and, for destinations, unaliased) until the
    /// returned [`Pending`] has been waited on.
    pub unsafe fn submit(&self, ops: Vec<Op>, sync: bool) -> Pending {
        let (reply, receiver) = channel();
        let count = ops.len();
        self.device.metrics.enqueue(count);
        let sender = self.sender.as_ref().expect("worker running");
        if let Err(failed) = sender.send(Batch { ops, sync, reply }) {
            // The worker is gone: answer for it (its receiver dropped, so nothing runs).
            let batch = failed.0;
            for _ in 0..count {
                self.device.metrics.complete(false, 0, std::time::Duration::ZERO, false);
            }
            let _ = batch.reply.send((vec![OpResult::IoError(libc::EIO); count], Some(libc::EIO)));
        }
        Pending { receiver, count }
    }

    /// Runs `ops` and waits for them.
    ///
    /// # Safety
    /// As for [`submit`](Self::submit).
    pub unsafe fn run(&self, ops: Vec<Op>, sync: bool) -> (Vec<OpResult>, Option<i32>) {
        unsafe { self.submit(ops, sync) }.wait()
    }
}

impl Drop for IoWorker {
    fn drop(&mut self) {
        drop(self.sender.take());
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

struct Slot {
    buf: Option<AlignedBuf>,
    /// Checksum of the payload a WritePayload in this slot is writing.
    checksum: u64,
    op: usize,
    done: usize,
    ptr: *mut u8,
    started: Instant,
}

// SAFETY: a slot's pointer is into its own staging buffer or a submitter's buffer, used only
// while that batch's submitter waits (module docs).
unsafe impl Send for Slot {}

struct WorkerState {
    device: Arc<Device>,
    engine: Box<dyn Engine>,
    slots: Vec<Slot>,
    depth: usize,
}

impl WorkerState {
    fn serve(mut self, receiver: Receiver<Batch>) {
        self.slots = (0..self.depth)
            .map(|_| Slot {
                buf: None,
                checksum: 0,
                op: 0,
                done: 0,
                ptr: std::ptr::null_mut(),
                started: Instant::now(),
            })
            .collect();
        while let Ok(batch) = receiver.recv() {
            let results = self.run_batch(&batch.ops);
            // Every write that landed is synced, even when another of the batch failed: the
            // caller publishes the ones that landed, and with `fsync` durability a published
            // object must be on stable storage.
            let wrote = results.iter().any(|r| matches!(r, OpResult::Written(_)));
            let sync_error = if batch.sync && wrote {
                // SAFETY: fdatasync on the device's open descriptor.
                (unsafe { libc::fdatasync(self.device.fd()) } != 0)
                    .then(|| std::io::Error::last_os_error().raw_os_error().unwrap_or(libc::EIO))
            } else {
                None
            };
            let _ = batch.reply.send((results, sync_error));
        }
    }

    /// Runs every op with up to `depth` in flight.
    fn run_batch(&mut self, ops: &[Op]) -> Vec<OpResult> {
        let mut run = Run {
            results: vec![OpResult::NotRun; ops.len()],
            free: (0..self.depth).rev().collect(),
            next: 0,
            inflight: 0,
        };
        loop {
            self.refill(ops, &mut run);
            if run.inflight == 0 {
                return run.results;
            }
            let (tag, n) = self.engine.wait();
            let slot = tag as usize;
            let index = self.slots[slot].op;
            let op = ops[index];
            if n > 0 {
                self.slots[slot].done += n as usize;
                if self.slots[slot].done < op.len {
                    self.resubmit(&op, slot); // a short transfer: move the rest
                    continue;
                }
            }
            run.inflight -= 1;
            let latency = self.slots[slot].started.elapsed();
            let (ptr, sum) = (self.slots[slot].ptr, self.slots[slot].checksum);
            let result = if n < 0 {
                run.free.push(slot);
                OpResult::IoError(i32::try_from(-n).unwrap_or(libc::EIO))
            } else if n == 0 {
                run.free.push(slot);
                OpResult::IoError(libc::EIO) // end of device: a transfer cut short
            } else if is_staged_read(&op, ptr) {
                let result = self.complete(&op, ptr, sum, Some(slot)); // needs the staging buffer
                run.free.push(slot);
                result
            } else {
                // The slot is not needed to finish this op: keep the device busy first.
                run.free.push(slot);
                self.refill(ops, &mut run);
                self.complete(&op, ptr, sum, None)
            };
            let ok = matches!(result, OpResult::Written(_) | OpResult::Read | OpResult::Corrupt);
            self.device.metrics.complete(op.is_write(), op.len, latency, ok);
            run.results[index] = result;
        }
    }

    /// Starts ops while slots are free.
    fn refill(&mut self, ops: &[Op], run: &mut Run) {
        while run.next < ops.len() && !run.free.is_empty() {
            let slot = run.free.pop().expect("checked non-empty");
            match self.start(ops, run.next, slot) {
                Ok(()) => run.inflight += 1,
                Err(result) => {
                    self.device.metrics.complete(
                        ops[run.next].is_write(),
                        ops[run.next].len,
                        std::time::Duration::ZERO,
                        false,
                    );
                    run.results[run.next] = result;
                    run.free.push(slot);
                }
            }
            run.next += 1;
        }
    }

    /// A staging buffer of at least `len` bytes in `slot`.
    fn staging(&mut self, slot: usize, len: usize) -> Result<*mut u8, OpResult> {
        let s = &mut self.slots[slot];
        let big_enough = matches!(&s.buf, Some(b) if b.len() >= len);
        if !big_enough {
            s.buf = None; // free the old one first: staging stays bounded by depth × largest object
            s.buf = Some(AlignedBuf::new(len).map_err(|_| OpResult::IoError(libc::ENOMEM))?);
        }
        Ok(s.buf.as_mut().expect("just set").as_mut_ptr())
    }

    /// Prepares op `index` in `slot` and submits it.
    fn start(&mut self, ops: &[Op], index: usize, slot: usize) -> Result<(), OpResult> {
        let op = ops[index];
        let errno = self.device.injected_errno(op.is_write());
        if errno != 0 {
            return Err(OpResult::IoError(errno));
        }
        if let Some(bucket) = &self.device.throttle {
            bucket.take(op.len);
        }
        let ptr = match op.kind {
            OpKind::WritePayload { src, payload_len } => {
                if in_place(src, payload_len, op.len) {
                    src.cast_mut() // hashed once the write is on its way, below
                } else {
                    // SAFETY: `src` holds `payload_len` bytes, borrowed for the batch (module docs).
                    let payload = unsafe { std::slice::from_raw_parts(src, payload_len) };
                    let base = self.staging(slot, op.len)?;
                    // SAFETY: the staging buffer holds `op.len` bytes and is this slot's alone.
                    let staged = unsafe { std::slice::from_raw_parts_mut(base, op.len) };
                    let (dst, padding) = staged.split_at_mut(payload_len);
                    self.slots[slot].checksum = copy_with_checksum(dst, payload);
                    padding.fill(0);
                    base
                }
            }
            OpKind::ReadObject { payload_len, dst, .. } if in_place(dst, payload_len, op.len) => dst,
            OpKind::ReadObject { .. } => self.staging(slot, op.len)?,
            OpKind::WriteAligned { src } | OpKind::RawWrite { src } => src.cast_mut(),
            OpKind::RawRead { dst } => dst,
        };
        let s = &mut self.slots[slot];
        (s.op, s.done, s.ptr, s.started) = (index, 0, ptr, Instant::now());
        self.engine.submit(self.device.fd(), op.is_write(), ptr, op.len, op.offset, slot as u64);
        if let OpKind::WritePayload { src, payload_len } = op.kind {
            if ptr == src.cast_mut() {
                // Written in place: checksum the payload while the device writes it (the
                // caller's buffer is stable until the batch completes).
                self.engine.flush();
                // SAFETY: `src` holds `payload_len` bytes, borrowed for the batch (module docs).
                self.slots[slot].checksum = checksum(unsafe { std::slice::from_raw_parts(src, payload_len) });
            }
        }
        Ok(())
    }

    fn resubmit(&mut self, op: &Op, slot: usize) {
        let s = &self.slots[slot];
        let ptr = s.ptr.wrapping_add(s.done);
        self.engine.submit(
            self.device.fd(),
            op.is_write(),
            ptr,
            op.len - s.done,
            op.offset + s.done as u64,
            slot as u64,
        );
    }

    /// The result of a fully transferred op that moved `ptr` (its checksum `sum` for payload
    /// writes); `slot` holds the staged bytes of a staged read.
    fn complete(&self, op: &Op, ptr: *mut u8, sum: u64, slot: Option<usize>) -> OpResult {
        match op.kind {
            OpKind::WritePayload { .. } => OpResult::Written(sum),
            OpKind::WriteAligned { .. } | OpKind::RawWrite { .. } => OpResult::Written(0),
            OpKind::RawRead { .. } => OpResult::Read,
            OpKind::ReadObject { payload_len, checksum: expected, dst } => {
                // SAFETY: `dst` holds `payload_len` bytes, exclusively the caller's (module docs).
                let dst_slice = unsafe { std::slice::from_raw_parts_mut(dst, payload_len) };
                let found = match slot {
                    None => {
                        debug_assert_eq!(ptr, dst, "an unstaged read lands in place");
                        checksum(dst_slice)
                    }
                    Some(slot) => {
                        let staged = self.slots[slot].buf.as_ref().expect("staged read").as_slice();
                        copy_with_checksum(dst_slice, &staged[..payload_len])
                    }
                };
                if found == expected {
                    OpResult::Read
                } else {
                    OpResult::Corrupt
                }
            }
        }
    }
}

/// Whether `op`, which moved `ptr`, read into a staging buffer (rather than its destination).
fn is_staged_read(op: &Op, ptr: *mut u8) -> bool {
    matches!(op.kind, OpKind::ReadObject { dst, .. } if dst != ptr)
}

/// Progress of one batch.
struct Run {
    results: Vec<OpResult>,
    free: Vec<usize>,
    next: usize,
    inflight: usize,
}

#[cfg(test)]
mod tests {
    use std::collections::VecDeque;
    use std::fs::File;
    use std::os::fd::{FromRawFd, OwnedFd};
    use std::sync::atomic::AtomicI32;

    use super::*;
    use crate::ssd::metrics::DeviceMetrics;

    /// Completes every transfer at once without touching the descriptor; the one at
    /// `failing_offset` fails with EIO (a bad sector, say).
    struct OneBadOffset {
        failing_offset: u64,
        done: VecDeque<(u64, i64)>,
    }

    impl Engine for OneBadOffset {
        fn name(&self) -> &'static str {
            "one-bad-offset"
        }
        fn submit(&mut self, _fd: i32, _write: bool, _ptr: *mut u8, len: usize, offset: u64, tag: u64) {
            let n = if offset == self.failing_offset { -i64::from(libc::EIO) } else { len as i64 };
            self.done.push_back((tag, n));
        }
        fn wait(&mut self) -> (u64, i64) {
            self.done.pop_front().expect("a transfer was submitted")
        }
    }

    /// A device whose descriptor is a pipe: `fdatasync` on it fails (EINVAL), so a test sees
    /// whether the worker asked for one.
    fn pipe_device() -> (Arc<Device>, OwnedFd) {
        let mut fds = [0; 2];
        // SAFETY: pipe(2) fills two descriptors, owned below.
        assert_eq!(unsafe { libc::pipe(fds.as_mut_ptr()) }, 0);
        // SAFETY: fresh descriptors from pipe(2), each owned once.
        let (read_end, write_end) = unsafe { (OwnedFd::from_raw_fd(fds[0]), File::from_raw_fd(fds[1])) };
        let device = Device {
            index: 0,
            path: "pipe".into(),
            file: write_end,
            direct: false,
            is_block_device: false,
            data_offset: PAGE_BYTES,
            data_bytes: 16 * PAGE_BYTES,
            throttle: None,
            metrics: DeviceMetrics::default(),
            fail_writes_errno: AtomicI32::new(0),
            fail_reads_errno: AtomicI32::new(0),
        };
        (Arc::new(device), read_end)
    }

    #[test]
    fn a_batch_with_a_failed_write_still_syncs_the_writes_that_landed() {
        let (device, _read_end) = pipe_device();
        let engine = OneBadOffset { failing_offset: 2 * PAGE_BYTES, done: VecDeque::new() };
        let worker = IoWorker::spawn(device, Box::new(engine), 2).unwrap();
        let mut page = AlignedBuf::new(PAGE_BYTES as usize).unwrap();
        let src = page.as_mut_ptr().cast_const();
        let write = |offset| Op { offset, len: PAGE_BYTES as usize, kind: OpKind::WriteAligned { src } };
        // SAFETY: `page` outlives the call, which waits for the batch.
        let (results, sync_error) =
            unsafe { worker.run(vec![write(PAGE_BYTES), write(2 * PAGE_BYTES)], true) };
        assert_eq!(results, vec![OpResult::Written(0), OpResult::IoError(libc::EIO)]);
        // The first write is acknowledged as durable only if the device was synced after it:
        // the sync ran (and, on a pipe, failed), so its failure reaches the caller.
        assert_eq!(sync_error, Some(libc::EINVAL), "the written page was never fdatasync'ed");
        // Nothing written: nothing to sync.
        // SAFETY: as above.
        let (results, sync_error) = unsafe { worker.run(vec![write(2 * PAGE_BYTES)], true) };
        assert_eq!((results, sync_error), (vec![OpResult::IoError(libc::EIO)], None));
    }
}
