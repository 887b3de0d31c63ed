//! I/O engines behind the device workers: io_uring (many operations in flight from one
//! thread) or pread/pwrite (one at a time). [`probe_io_uring`] decides at start which the
//! kernel allows (a seccomp filter or `kernel.io_uring_disabled` makes `io_uring_setup` fail).

use std::collections::VecDeque;

use io_uring::{opcode, types, IoUring};

/// One submitted transfer's completion: its tag and the syscall-style result (bytes moved, or a
/// negative errno).
pub type Completion = (u64, i64);

/// Submits transfers and reaps their completions, in any order.
pub trait Engine: Send {
    fn name(&self) -> &'static str;
    /// Queues one transfer of `len` bytes between `ptr` and `fd` at `offset`. The memory must stay
    /// valid and untouched until its completion is reaped. It may complete short (fewer bytes
    /// moved, as pread/pwrite may): the caller submits the rest.
    fn submit(&mut self, fd: i32, write: bool, ptr: *mut u8, len: usize, offset: u64, tag: u64);
    /// Blocks until one completion is available and returns it. Only called with transfers queued.
    fn wait(&mut self) -> Completion;
    /// Hands queued transfers to the kernel now, without waiting (so CPU work can overlap them).
    fn flush(&mut self) {}
}

/// Whether io_uring works here: sets up (and drops) a small ring.
pub fn probe_io_uring() -> Result<(), String> {
    IoUring::new(2).map(drop).map_err(|e| e.to_string())
}

/// pread/pwrite, performed at submission.
#[derive(Default)]
pub struct SyncEngine {
    done: VecDeque<Completion>,
}

impl Engine for SyncEngine {
    fn name(&self) -> &'static str {
        "pread"
    }

    fn submit(&mut self, fd: i32, write: bool, ptr: *mut u8, len: usize, offset: u64, tag: u64) {
        let result = loop {
            // SAFETY: the caller guarantees `ptr..ptr + len` is valid for this transfer.
            let n = unsafe {
                if write {
                    libc::pwrite(fd, ptr.cast(), len, offset as libc::off_t)
                } else {
                    libc::pread(fd, ptr.cast(), len, offset as libc::off_t)
                }
            };
            if n >= 0 {
                break n as i64;
            }
            let errno = std::io::Error::last_os_error().raw_os_error().unwrap_or(libc::EIO);
            if errno != libc::EINTR {
                break -i64::from(errno);
            }
        };
        self.done.push_back((tag, result));
    }

    fn wait(&mut self) -> Completion {
        self.done.pop_front().expect("wait with nothing submitted")
    }
}

/// Most bytes one io_uring submission moves (1 GiB; its length field is 32 bits).
const URING_TRANSFER_BYTES_MAX: usize = 1 << 30;

/// Most times `submit` enters the kernel again after a transient error before it fails the
/// transfer instead.
const URING_ENTER_TRIES_MAX: u32 = 1024;

/// Whether an `io_uring_enter` error passes: interrupted, or the kernel short of room for
/// completions (EBUSY) or of memory (EAGAIN, ENOMEM) for now.
fn transient(e: &std::io::Error) -> bool {
    matches!(e.raw_os_error(), Some(libc::EINTR | libc::EBUSY | libc::EAGAIN | libc::ENOMEM))
}

/// Stops the process: `io_uring_enter` failed for good (a broken ring: EBADF, EFAULT, EINVAL,
/// ...) while `pending` transfers are in the kernel. Their buffers are submitters' memory that
/// the kernel may still read or write (O_DIRECT pins the pages), so they cannot be handed back;
/// a panic would hand them back (the worker's batch replies drop, and each waiter takes that as
/// an I/O error and reuses its buffer) and let a late transfer write KV into reused memory.
fn abort_with_transfers_in_flight(e: &std::io::Error, pending: usize) -> ! {
    eprintln!(
        "kvtier: io_uring_enter failed ({e}) with {pending} SSD transfers in flight; stopping the \
         process: their buffers cannot be released while the kernel may still write them"
    );
    std::process::abort()
}

/// io_uring with a fixed queue depth; submissions are flushed when the caller waits.
pub struct UringEngine {
    ring: IoUring,
    /// Transfers handed to the ring whose completion is still in the kernel's queue.
    pending: usize,
    /// Completions taken off the ring by `submit`, and transfers `submit` failed: `wait`
    /// returns these first.
    done: VecDeque<Completion>,
    /// Errnos the next `io_uring_enter` calls of `submit` return instead of entering (tests).
    #[cfg(test)]
    enter_errors: VecDeque<i32>,
}

impl UringEngine {
    pub fn new(depth: usize) -> std::io::Result<Self> {
        let entries = u32::try_from(depth.next_power_of_two().max(2)).unwrap_or(4096);
        Ok(UringEngine {
            ring: IoUring::new(entries)?,
            pending: 0,
            done: VecDeque::new(),
            #[cfg(test)]
            enter_errors: VecDeque::new(),
        })
    }

    /// Hands the queued submissions to the kernel (`io_uring_enter`).
    fn enter(&mut self) -> std::io::Result<usize> {
        #[cfg(test)]
        if let Some(errno) = self.enter_errors.pop_front() {
            return Err(std::io::Error::from_raw_os_error(errno));
        }
        self.ring.submit()
    }

    /// Hands the queued submissions to the kernel and waits for one completion.
    fn enter_and_wait(&mut self) -> std::io::Result<usize> {
        #[cfg(test)]
        if let Some(errno) = self.enter_errors.pop_front() {
            return Err(std::io::Error::from_raw_os_error(errno));
        }
        self.ring.submit_and_wait(1)
    }

    /// Moves the completions in the kernel's queue to `done`, making room there.
    fn reap(&mut self) {
        for cqe in self.ring.completion() {
            self.pending -= 1;
            self.done.push_back((cqe.user_data(), i64::from(cqe.result())));
        }
    }
}

impl Engine for UringEngine {
    fn name(&self) -> &'static str {
        "io_uring"
    }

    /// A submission queue that stays full is entered again after a transient error (EINTR,
    /// EBUSY, EAGAIN), reaping completions in between, up to [`URING_ENTER_TRIES_MAX`] times;
    /// any other error, or one that persists, fails this transfer with its errno (the worker
    /// reports it as that op's I/O error), never a panic: a panic killed the device's worker,
    /// failing every later transfer on the device.
    fn submit(&mut self, fd: i32, write: bool, ptr: *mut u8, len: usize, offset: u64, tag: u64) {
        // An io_uring transfer length is a u32: a longer one is submitted in part and completes
        // short, and the worker moves the rest as for any short transfer. (It panicked here,
        // killing the device's worker, for a payload of 4 GiB or more.)
        let len = u32::try_from(len.min(URING_TRANSFER_BYTES_MAX)).expect("capped below u32::MAX");
        let entry = if write {
            opcode::Write::new(types::Fd(fd), ptr, len).offset(offset).build()
        } else {
            opcode::Read::new(types::Fd(fd), ptr, len).offset(offset).build()
        }
        .user_data(tag);
        let mut tries = 0;
        loop {
            // SAFETY: the caller keeps the buffer valid until the completion is reaped.
            if unsafe { self.ring.submission().push(&entry) }.is_ok() {
                self.pending += 1;
                return;
            }
            // Submission queue full: hand what is queued to the kernel and retry.
            match self.enter() {
                Ok(_) => {}
                Err(e) if transient(&e) && tries < URING_ENTER_TRIES_MAX => {
                    tries += 1;
                    self.reap();
                    std::thread::yield_now();
                }
                Err(e) => {
                    self.done.push_back((tag, -i64::from(e.raw_os_error().unwrap_or(libc::EIO))));
                    return;
                }
            }
        }
    }

    fn flush(&mut self) {
        // A failure here is retried by the next `wait`, which submits too.
        let _ = self.ring.submit();
    }

    fn wait(&mut self) -> Completion {
        if let Some(done) = self.done.pop_front() {
            return done;
        }
        assert!(self.pending > 0, "wait with nothing submitted");
        loop {
            if let Some(cqe) = self.ring.completion().next() {
                self.pending -= 1;
                return (cqe.user_data(), i64::from(cqe.result()));
            }
            // A transient error is entered again (after a pause when memory is short); any other
            // leaves transfers in the kernel that nothing can wait for.
            match self.enter_and_wait() {
                Ok(_) => {}
                Err(e) if e.raw_os_error() == Some(libc::ENOMEM) => {
                    std::thread::sleep(std::time::Duration::from_millis(1));
                }
                Err(e) if transient(&e) => {}
                Err(e) => abort_with_transfers_in_flight(&e, self.pending),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ssd::buffer::AlignedBuf;
    use std::io::Write;
    use std::os::fd::AsRawFd;

    fn round_trip(engine: &mut dyn Engine) {
        let path =
            std::env::temp_dir().join(format!("kvtier-engine-{}-{}", engine.name(), std::process::id()));
        let mut file =
            std::fs::File::options().read(true).write(true).create(true).truncate(true).open(&path).unwrap();
        file.write_all(&[0u8; 8192]).unwrap();
        let mut out = AlignedBuf::new(8192).unwrap();
        out.as_mut_slice().fill(7);
        let mut back = AlignedBuf::new(8192).unwrap();
        engine.submit(file.as_raw_fd(), true, out.as_mut_ptr(), 8192, 0, 1);
        assert_eq!(engine.wait(), (1, 8192));
        engine.submit(file.as_raw_fd(), false, back.as_mut_ptr(), 4096, 4096, 2);
        engine.submit(file.as_raw_fd(), false, back.as_mut_ptr(), 4096, 1 << 20, 3);
        let mut got = [engine.wait(), engine.wait()];
        got.sort();
        assert_eq!(got, [(2, 4096), (3, 0)], "a read past the end returns 0 bytes");
        assert!(back.as_slice()[..4096].iter().all(|&b| b == 7));
        std::fs::remove_file(path).unwrap();
    }

    #[test]
    fn sync_engine_round_trip() {
        round_trip(&mut SyncEngine::default());
    }

    #[test]
    fn a_transfer_of_4_gib_or_more_is_a_short_transfer_not_a_panic() {
        let Ok(mut engine) = UringEngine::new(4) else {
            eprintln!("io_uring unavailable here; nothing to check");
            return;
        };
        let path = std::env::temp_dir().join(format!("kvtier-engine-4gib-{}", std::process::id()));
        std::fs::write(&path, [5u8; 8192]).unwrap();
        let file = std::fs::File::open(&path).unwrap();
        // A destination past u32::MAX bytes, reserved but never touched beyond the file's pages.
        let len = (4usize << 30) + 8192;
        // SAFETY: a fresh private anonymous mapping, unmapped below.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                -1,
                0,
            )
        };
        assert_ne!(ptr, libc::MAP_FAILED);
        engine.submit(file.as_raw_fd(), false, ptr.cast(), len, 0, 9);
        // The worker moves the rest of a short transfer with further submissions.
        assert_eq!(engine.wait(), (9, 8192));
        // SAFETY: the transfer completed; the mapping is ours.
        assert!(unsafe { std::slice::from_raw_parts(ptr.cast::<u8>(), 8192) }.iter().all(|&b| b == 5));
        unsafe { libc::munmap(ptr, len) };
        std::fs::remove_file(path).unwrap();
    }

    #[test]
    fn a_failed_io_uring_enter_is_retried_or_a_failed_transfer_not_a_panic() {
        let Ok(mut engine) = UringEngine::new(2) else {
            eprintln!("io_uring unavailable here; nothing to check");
            return;
        };
        let path = std::env::temp_dir().join(format!("kvtier-engine-enter-{}", std::process::id()));
        std::fs::write(&path, [3u8; 5 * 4096]).unwrap();
        let file = std::fs::File::open(&path).unwrap();
        let mut bufs: Vec<AlignedBuf> = (0..5).map(|_| AlignedBuf::new(4096).unwrap()).collect();
        // The submission queue holds two. The third submit enters the kernel, which answers
        // EAGAIN, then EBUSY (transient: entered again); the fifth's gets EINVAL (that transfer
        // fails, the queued ones complete).
        let submit = |engine: &mut UringEngine, b: &mut AlignedBuf, tag: u64| {
            engine.submit(file.as_raw_fd(), false, b.as_mut_ptr(), 4096, tag * 4096, tag)
        };
        let (first, rest) = bufs.split_at_mut(2);
        submit(&mut engine, &mut first[0], 0);
        submit(&mut engine, &mut first[1], 1);
        engine.enter_errors.extend([libc::EAGAIN, libc::EBUSY]);
        submit(&mut engine, &mut rest[0], 2);
        submit(&mut engine, &mut rest[1], 3);
        engine.enter_errors.push_back(libc::EINVAL);
        submit(&mut engine, &mut rest[2], 4);
        let mut got: Vec<Completion> = (0..5).map(|_| engine.wait()).collect();
        got.sort();
        assert_eq!(got, [(0, 4096), (1, 4096), (2, 4096), (3, 4096), (4, -i64::from(libc::EINVAL))]);
        assert!(bufs[..4].iter().all(|b| b.as_slice().iter().all(|&x| x == 3)));
        std::fs::remove_file(path).unwrap();
    }

    #[test]
    fn a_transient_error_while_waiting_is_entered_again() {
        let Ok(mut engine) = UringEngine::new(4) else {
            eprintln!("io_uring unavailable here; nothing to check");
            return;
        };
        let path = std::env::temp_dir().join(format!("kvtier-engine-wait-{}", std::process::id()));
        std::fs::write(&path, [4u8; 4096]).unwrap();
        let file = std::fs::File::open(&path).unwrap();
        let mut buf = AlignedBuf::new(4096).unwrap();
        // Queued, not yet handed to the kernel: the wait enters it, and meets these first.
        engine.submit(file.as_raw_fd(), false, buf.as_mut_ptr(), 4096, 0, 7);
        engine.enter_errors.extend([libc::ENOMEM, libc::EINTR, libc::EAGAIN, libc::EBUSY]);
        assert_eq!(engine.wait(), (7, 4096));
        assert!(engine.enter_errors.is_empty(), "each error was met and entered again");
        assert!(buf.as_slice().iter().all(|&b| b == 4));
        std::fs::remove_file(path).unwrap();
    }

    /// Run as a child by the test below (`KVTIER_ENGINE_ABORT_CHILD` set): waits on a transfer
    /// whose `io_uring_enter` fails for good, which must stop the process.
    #[test]
    fn child_waits_through_a_broken_ring() {
        if std::env::var_os("KVTIER_ENGINE_ABORT_CHILD").is_none() {
            return;
        }
        let mut engine = UringEngine::new(4).unwrap();
        let path = std::env::temp_dir().join(format!("kvtier-engine-abort-{}", std::process::id()));
        std::fs::write(&path, [1u8; 4096]).unwrap();
        let file = std::fs::File::open(&path).unwrap();
        std::fs::remove_file(&path).unwrap();
        let mut buf = AlignedBuf::new(4096).unwrap();
        engine.submit(file.as_raw_fd(), false, buf.as_mut_ptr(), 4096, 0, 1);
        engine.enter_errors.push_back(libc::EBADF);
        let got = engine.wait();
        println!("the wait returned {got:?}");
    }

    #[test]
    fn a_broken_ring_with_transfers_in_flight_stops_the_process_never_returns_their_buffers() {
        if UringEngine::new(4).is_err() {
            eprintln!("io_uring unavailable here; nothing to check");
            return;
        }
        let child = std::process::Command::new(std::env::current_exe().unwrap())
            .args(["--exact", "ssd::engine::tests::child_waits_through_a_broken_ring", "--nocapture"])
            .env("KVTIER_ENGINE_ABORT_CHILD", "1")
            .output()
            .unwrap();
        let (stdout, stderr) =
            (String::from_utf8_lossy(&child.stdout), String::from_utf8_lossy(&child.stderr));
        use std::os::unix::process::ExitStatusExt;
        assert_eq!(child.status.signal(), Some(libc::SIGABRT), "{}\n{stdout}\n{stderr}", child.status);
        assert!(!stdout.contains("the wait returned"), "{stdout}");
        assert!(stderr.contains("with 1 SSD transfers in flight; stopping the process"), "{stderr}");
    }

    #[test]
    fn uring_engine_round_trip_where_allowed() {
        match UringEngine::new(4) {
            Ok(mut engine) => round_trip(&mut engine),
            Err(e) => eprintln!("io_uring unavailable here ({e}); the pread engine is used instead"),
        }
    }
}
