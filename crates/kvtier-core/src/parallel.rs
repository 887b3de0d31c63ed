//! The bounded worker pool that runs large copies (gather/scatter, store put/load).
//!
//! One pool per owner (a `Store`, a layout `Copier`), sized at construction: `threads` is the
//! bound on concurrent copy workers. Work smaller than [`INLINE_BYTES_MAX`] runs on the caller's
//! thread, because waking workers costs more than copying a few hundred KiB.

/// Jobs below this many bytes are copied inline on the calling thread.
pub const INLINE_BYTES_MAX: usize = 512 << 10;

/// A fixed-size pool of copy workers.
pub struct WorkerPool {
    pool: rayon::ThreadPool,
    threads: usize,
}

impl WorkerPool {
    /// A pool of `threads` workers (0 = one per available core).
    pub fn new(threads: usize) -> Self {
        let threads = if threads == 0 {
            std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1)
        } else {
            threads
        };
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .thread_name(|i| format!("kvtier-copy-{i}"))
            .build()
            .expect("spawning copy worker threads");
        WorkerPool { pool, threads }
    }

    pub fn threads(&self) -> usize {
        self.threads
    }

    /// Runs `f` on every item, spread over the workers; inline when `total_bytes` is small or the
    /// pool has one worker. Returns when every item is done.
    pub fn for_each<T: Sync, F: Fn(&T) + Sync + Send>(&self, items: &[T], total_bytes: usize, f: F) {
        if self.threads <= 1 || items.len() <= 1 || total_bytes <= INLINE_BYTES_MAX {
            items.iter().for_each(f);
            return;
        }
        use rayon::prelude::*;
        self.pool.install(|| items.par_iter().with_min_len(1).for_each(f));
    }
}

impl std::fmt::Debug for WorkerPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WorkerPool").field("threads", &self.threads).finish()
    }
}
