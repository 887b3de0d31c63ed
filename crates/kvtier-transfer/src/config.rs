//! [`TransferConfig`]: the engine's shape and every bound, with its unit in its name.

use crate::error::TransferError;

/// Stages of a load, in order. A store job runs gather → encode → write on store workers.
pub const STAGE_NAMES: [&str; 4] = ["read", "decompress", "dequantize", "scatter"];

/// Worker threads per load stage.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StageWorkers {
    pub read: usize,
    pub decompress: usize,
    pub dequantize: usize,
    pub scatter: usize,
}

impl StageWorkers {
    pub fn as_array(&self) -> [usize; 4] {
        [self.read, self.decompress, self.dequantize, self.scatter]
    }

    pub fn from_array(a: [usize; 4]) -> Self {
        StageWorkers { read: a[0], decompress: a[1], dequantize: a[2], scatter: a[3] }
    }

    /// ShadowServe §4.3: splits `threads` among the stages so their throughputs match. A stage
    /// measured at `rates_bytes_per_s[i]` per worker needs workers in proportion to its time per
    /// byte `1 / rate`. Every stage keeps at least one worker; a stage with rate 0 or non-finite
    /// (not run, e.g. decompress when every block is stored raw) gets exactly one. The total is
    /// `max(threads, 4)`, remainders going to the largest fractional shares, except that no stage
    /// gets more than [`STAGE_WORKERS_MAX`] (what [`TransferConfig::validate`] accepts): a capped
    /// stage's excess goes to the other working stages, and threads no working stage can take are
    /// not used (a many-core machine with one dominant stage gets a config it can run).
    pub fn balanced(rates_bytes_per_s: [f64; 4], threads: usize) -> Self {
        let threads = threads.max(4);
        let cost: Vec<f64> =
            rates_bytes_per_s.iter().map(|&r| if r.is_finite() && r > 0.0 { 1.0 / r } else { 0.0 }).collect();
        let total_cost: f64 = cost.iter().sum();
        let active = cost.iter().filter(|&&c| c > 0.0).count();
        let mut out = [1usize; 4];
        if total_cost <= 0.0 {
            out[3] += threads - 4;
            return Self::from_array(out);
        }
        // Threads beyond one per stage, shared among stages that do work.
        let spare = threads - 4;
        let share: Vec<f64> = cost.iter().map(|c| c / total_cost * (spare + active) as f64).collect();
        let mut given = 0;
        for i in 0..4 {
            if cost[i] > 0.0 {
                let extra = (share[i].floor() as usize).saturating_sub(1);
                out[i] += extra;
                given += extra;
            }
        }
        let mut order: Vec<usize> = (0..4).filter(|&i| cost[i] > 0.0).collect();
        order.sort_by(|&a, &b| (share[b] - share[b].floor()).total_cmp(&(share[a] - share[a].floor())));
        while given > spare {
            // Stages raised to their one-worker floor took more than their share.
            let i = (0..4).max_by_key(|&i| out[i]).expect("four stages");
            out[i] -= 1;
            given -= 1;
        }
        let mut k = 0;
        while given < spare {
            out[order[k % order.len()]] += 1;
            given += 1;
            k += 1;
        }
        // The cap: a stage's excess goes, a worker at a time, to the working stage under the cap
        // that is then slowest (the most time per byte per worker).
        let excess: usize = out.iter().map(|&n| n.saturating_sub(STAGE_WORKERS_MAX)).sum();
        out.iter_mut().for_each(|n| *n = (*n).min(STAGE_WORKERS_MAX));
        for _ in 0..excess {
            let open = order.iter().copied().filter(|&i| out[i] < STAGE_WORKERS_MAX);
            let Some(i) =
                open.max_by(|&a, &b| (cost[a] / out[a] as f64).total_cmp(&(cost[b] / out[b] as f64)))
            else {
                break;
            };
            out[i] += 1;
        }
        Self::from_array(out)
    }
}

impl Default for StageWorkers {
    fn default() -> Self {
        StageWorkers { read: 1, decompress: 1, dequantize: 1, scatter: 1 }
    }
}

/// Shape and bounds of a [`TransferEngine`](crate::TransferEngine).
#[derive(Clone, Debug, PartialEq)]
///
/// How blocks are stored is the store's business (`ssd_codec`, `remote_codec`): loads decode each
/// block by the codec its stored object records, stores put raw blocks (docs/transfer.md §2).
pub struct TransferConfig {
    /// Blocks per chunk: the unit a stage processes at once.
    pub chunk_blocks: usize,
    /// Chunk regions in each stage buffer: chunks in flight at once. A job of more chunks runs
    /// in rounds as regions free up. Stage buffers total `buffer_chunks × chunk_blocks ×
    /// block_bytes` per stage, allocated once at construction.
    pub buffer_chunks: usize,
    pub stage_workers: StageWorkers,
    /// Threads running store jobs (gather → encode → put).
    pub store_workers: usize,
    /// Jobs submitted and not yet collected (by `finished` or `wait`), at most.
    pub jobs_in_flight_max: usize,
    /// Bytes (`blocks × block_bytes`) of jobs submitted and not yet finished, at most.
    pub inflight_bytes_max: u64,
    /// Blocks in one job, at most.
    pub job_blocks_max: usize,
    /// Benchmark only (ShadowServe "No MM"): allocate every stage buffer per chunk instead of
    /// using the buffers allocated at start.
    pub allocate_per_chunk: bool,
}

impl Default for TransferConfig {
    fn default() -> Self {
        TransferConfig {
            chunk_blocks: 4,
            buffer_chunks: 8,
            stage_workers: StageWorkers::default(),
            store_workers: 1,
            jobs_in_flight_max: 64,
            inflight_bytes_max: 8 << 30,
            job_blocks_max: 1 << 16,
            allocate_per_chunk: false,
        }
    }
}

/// Largest worker count per stage accepted.
pub const STAGE_WORKERS_MAX: usize = 64;

impl TransferConfig {
    pub fn validate(&self) -> Result<(), TransferError> {
        let bad = |m: String| Err(TransferError::Config(m));
        if self.chunk_blocks == 0 || self.chunk_blocks > 4096 {
            return bad(format!("chunk_blocks is {}; expected 1..=4096", self.chunk_blocks));
        }
        if self.buffer_chunks == 0 || self.buffer_chunks > 1024 {
            return bad(format!("buffer_chunks is {}; expected 1..=1024", self.buffer_chunks));
        }
        for (name, n) in STAGE_NAMES.iter().zip(self.stage_workers.as_array()) {
            if n == 0 || n > STAGE_WORKERS_MAX {
                return bad(format!("stage_workers.{name} is {n}; expected 1..={STAGE_WORKERS_MAX}"));
            }
        }
        if self.store_workers == 0 || self.store_workers > STAGE_WORKERS_MAX {
            return bad(format!("store_workers is {}; expected 1..={STAGE_WORKERS_MAX}", self.store_workers));
        }
        if self.jobs_in_flight_max == 0 || self.jobs_in_flight_max > 1 << 20 {
            return bad(format!("jobs_in_flight_max is {}; expected 1..=1048576", self.jobs_in_flight_max));
        }
        if self.inflight_bytes_max == 0 {
            return bad("inflight_bytes_max is 0; expected a positive number of bytes".into());
        }
        if self.job_blocks_max == 0 {
            return bad("job_blocks_max is 0; expected at least 1".into());
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn balanced_split_follows_time_per_byte() {
        // Decompress is 4x slower than the others: it gets the most workers.
        let w = StageWorkers::balanced([4e9, 1e9, 4e9, 4e9], 8);
        assert_eq!(w.as_array().iter().sum::<usize>(), 8);
        assert!(w.decompress >= 3, "{w:?}");
        assert!(w.as_array().iter().all(|&n| n >= 1));
        // Stages that did not run keep one worker.
        let w = StageWorkers::balanced([1e9, 0.0, 0.0, 1e9], 6);
        assert_eq!((w.decompress, w.dequantize), (1, 1));
        assert_eq!(w.as_array().iter().sum::<usize>(), 6);
        assert_eq!(StageWorkers::balanced([1.0; 4], 2).as_array(), [1, 1, 1, 1]);
    }

    #[test]
    fn balanced_split_stays_within_the_per_stage_bound() {
        // 512 threads, decompress 100x slower: it would get ~500 workers, which no config accepts.
        let w = StageWorkers::balanced([1e10, 1e8, 1e10, 1e10], 512);
        let a = w.as_array();
        assert!(a.iter().all(|&n| (1..=STAGE_WORKERS_MAX).contains(&n)), "{w:?}");
        assert_eq!(w.decompress, STAGE_WORKERS_MAX, "{w:?}");
        // The capped stage's excess went to the others, up to their bound too.
        assert_eq!(a.iter().sum::<usize>(), 4 * STAGE_WORKERS_MAX, "{w:?}");
        let c = TransferConfig { stage_workers: w, ..TransferConfig::default() };
        c.validate().expect("a balanced split is a valid config");
        // The excess goes to the next slowest stage first: dequantize (10x) before read and scatter.
        let w = StageWorkers::balanced([1e10, 1e8, 1e9, 1e10], 100);
        assert_eq!(w.decompress, STAGE_WORKERS_MAX, "{w:?}");
        // 100 threads: [1, 89, 9, 1] before the cap; decompress's 25 extra workers go to dequantize
        // until its time per byte per worker (1e-9 / n) falls to read's and scatter's (1e-10 / n).
        assert_eq!(w.as_array(), [3, 64, 30, 3], "{w:?}");
        assert_eq!(w.as_array().iter().sum::<usize>(), 100, "{w:?}");
        // Only one stage working: the others keep one worker, the threads past the bound go unused.
        let w = StageWorkers::balanced([0.0, 1e9, 0.0, 0.0], 300);
        assert_eq!(w.as_array(), [1, STAGE_WORKERS_MAX, 1, 1]);
        // Below the bound nothing changes: 200 threads over four equal stages.
        assert_eq!(StageWorkers::balanced([1e9; 4], 200).as_array(), [50; 4]);
    }

    #[test]
    fn validation_names_the_field() {
        let c = TransferConfig { chunk_blocks: 0, ..TransferConfig::default() };
        assert!(c.validate().unwrap_err().to_string().contains("chunk_blocks"));
        let c = TransferConfig {
            stage_workers: StageWorkers { scatter: 0, ..StageWorkers::default() },
            ..TransferConfig::default()
        };
        assert!(c.validate().unwrap_err().to_string().contains("scatter"));
    }
}
