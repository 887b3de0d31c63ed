//! Per-device I/O metrics: bytes, operations, errors, queue depth and latency percentiles.
//! Updated with relaxed atomics by the device worker and the submitting threads; read as a
//! [`DeviceMetricsSnapshot`]; and the pool's whole report, [`SsdMetrics`].

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use super::recovery::RecoveryStats;
use crate::tier::TierStats;

/// Sub-buckets per power of two: latencies are recorded to within 1/8 (12.5%) of their value.
const SUB_BITS: u32 = 3;
const SUBS: usize = 1 << SUB_BITS;
const BUCKETS: usize = 64 * SUBS;

/// A log-linear latency histogram over nanoseconds, lock-free.
pub struct LatencyHistogram {
    buckets: Box<[AtomicU64]>,
    count: AtomicU64,
}

impl Default for LatencyHistogram {
    fn default() -> Self {
        LatencyHistogram {
            buckets: (0..BUCKETS).map(|_| AtomicU64::new(0)).collect(),
            count: AtomicU64::new(0),
        }
    }
}

fn bucket_of(ns: u64) -> usize {
    if ns < SUBS as u64 {
        return ns as usize;
    }
    let top = 63 - ns.leading_zeros();
    let sub = (ns >> (top - SUB_BITS)) as usize & (SUBS - 1);
    ((top - SUB_BITS + 1) as usize) * SUBS + sub
}

/// Largest value that lands in bucket `index`.
fn bucket_upper_ns(index: usize) -> u64 {
    if index < SUBS {
        return index as u64;
    }
    let top = (index / SUBS) as u32 + SUB_BITS - 1;
    let sub = (index % SUBS) as u64;
    let low = (SUBS as u64 | sub) << (top - SUB_BITS);
    low + ((1u64 << (top - SUB_BITS)) - 1)
}

impl LatencyHistogram {
    pub fn record(&self, latency: Duration) {
        let ns = u64::try_from(latency.as_nanos()).unwrap_or(u64::MAX);
        self.buckets[bucket_of(ns)].fetch_add(1, Ordering::Relaxed);
        self.count.fetch_add(1, Ordering::Relaxed);
    }

    pub fn count(&self) -> u64 {
        self.count.load(Ordering::Relaxed)
    }

    /// The latency at quantile `q` (0..=1), in seconds, to within 12.5%; 0 when empty.
    pub fn quantile_s(&self, q: f64) -> f64 {
        let counts: Vec<u64> = self.buckets.iter().map(|b| b.load(Ordering::Relaxed)).collect();
        let total: u64 = counts.iter().sum();
        if total == 0 {
            return 0.0;
        }
        let rank = ((q.clamp(0.0, 1.0) * total as f64).ceil() as u64).max(1);
        let mut seen = 0;
        for (index, &c) in counts.iter().enumerate() {
            seen += c;
            if seen >= rank {
                return bucket_upper_ns(index) as f64 * 1e-9;
            }
        }
        bucket_upper_ns(BUCKETS - 1) as f64 * 1e-9
    }
}

/// Counters of one device.
#[derive(Default)]
pub struct DeviceMetrics {
    pub bytes_read: AtomicU64,
    pub bytes_written: AtomicU64,
    pub read_ops: AtomicU64,
    pub write_ops: AtomicU64,
    pub io_errors: AtomicU64,
    /// Operations handed to the device worker and not yet completed.
    pub queue_depth: AtomicU64,
    pub queue_depth_max: AtomicU64,
    pub read_latency: LatencyHistogram,
    pub write_latency: LatencyHistogram,
}

kvtier_core::fields! {
    /// A copy of one device's metrics.
    #[derive(Clone, Debug, Default, PartialEq)]
    pub struct DeviceMetricsSnapshot {
        pub bytes_read: u64,
        pub bytes_written: u64,
        pub read_ops: u64,
        pub write_ops: u64,
        pub io_errors: u64,
        pub queue_depth: u64,
        pub queue_depth_max: u64,
        pub read_p50_s: f64,
        pub read_p99_s: f64,
        pub write_p50_s: f64,
        pub write_p99_s: f64,
    }
}

impl DeviceMetrics {
    pub fn enqueue(&self, ops: usize) {
        let depth = self.queue_depth.fetch_add(ops as u64, Ordering::Relaxed) + ops as u64;
        self.queue_depth_max.fetch_max(depth, Ordering::Relaxed);
    }

    /// One operation completed (`ok`: without error).
    pub fn complete(&self, write: bool, bytes: usize, latency: Duration, ok: bool) {
        self.queue_depth.fetch_sub(1, Ordering::Relaxed);
        if !ok {
            self.io_errors.fetch_add(1, Ordering::Relaxed);
            return;
        }
        let (total, ops, histogram) = if write {
            (&self.bytes_written, &self.write_ops, &self.write_latency)
        } else {
            (&self.bytes_read, &self.read_ops, &self.read_latency)
        };
        total.fetch_add(bytes as u64, Ordering::Relaxed);
        ops.fetch_add(1, Ordering::Relaxed);
        histogram.record(latency);
    }

    pub fn snapshot(&self) -> DeviceMetricsSnapshot {
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        DeviceMetricsSnapshot {
            bytes_read: get(&self.bytes_read),
            bytes_written: get(&self.bytes_written),
            read_ops: get(&self.read_ops),
            write_ops: get(&self.write_ops),
            io_errors: get(&self.io_errors),
            queue_depth: get(&self.queue_depth),
            queue_depth_max: get(&self.queue_depth_max),
            read_p50_s: self.read_latency.quantile_s(0.5),
            read_p99_s: self.read_latency.quantile_s(0.99),
            write_p50_s: self.write_latency.quantile_s(0.5),
            write_p99_s: self.write_latency.quantile_s(0.99),
        }
    }
}

impl std::fmt::Debug for DeviceMetrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.snapshot().fmt(f)
    }
}

kvtier_core::fields! {
    /// One device of the pool, as reported (`io`'s fields are reported beside the listed ones).
    #[derive(Clone, Debug, PartialEq)]
    pub struct SsdDeviceReport {
        pub io: DeviceMetricsSnapshot,
        ..
        pub path: String,
        pub direct_io: bool,
        pub block_device: bool,
        pub read_bytes_per_s: f64,
        pub write_bytes_per_s: f64,
        /// Fraction of each batch placed here by Algorithm 1.
        pub placement_share: f64,
        pub throttle_bytes_per_s: f64,
        pub objects: u64,
        pub used_bytes: u64,
        pub capacity_bytes: u64,
    }
}

kvtier_core::fields! {
    /// Everything the pool counts.
    #[derive(Clone, Debug, PartialEq)]
    pub struct SsdMetrics {
        pub devices: Vec<SsdDeviceReport>,
        pub tier: TierStats,
        pub recovery: RecoveryStats,
        pub warnings: Vec<String>,
        ..
        pub engine: &'static str,
        pub durability: &'static str,
        pub placement: &'static str,
        pub bandwidth_source: String,
        pub lookup_hits: u64,
        pub lookup_misses: u64,
        pub write_failures: u64,
        pub read_io_errors: u64,
        pub log_failures: u64,
        pub log_records: u64,
        pub log_bytes: u64,
        pub log_generation: u64,
        pub compactions: u64,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_bound_their_values() {
        for ns in [0u64, 1, 7, 8, 9, 15, 16, 17, 1000, 123_456_789, u64::MAX / 3, u64::MAX] {
            let b = bucket_of(ns);
            assert!(bucket_upper_ns(b) >= ns, "{ns} above its bucket {b}");
            if ns >= 8 {
                assert!(bucket_upper_ns(b) as f64 <= ns as f64 * 1.125 + 1.0, "{ns}: bucket too wide");
                assert!(bucket_upper_ns(b - 1) < ns, "{ns}: not the lowest bucket holding it");
            }
        }
    }

    #[test]
    fn quantiles() {
        let h = LatencyHistogram::default();
        assert_eq!(h.quantile_s(0.5), 0.0);
        for us in 1..=100u64 {
            h.record(Duration::from_micros(us));
        }
        let p50 = h.quantile_s(0.5);
        let p99 = h.quantile_s(0.99);
        assert!((50e-6..=50e-6 * 1.125).contains(&p50), "{p50}");
        assert!((99e-6..=99e-6 * 1.125).contains(&p99), "{p99}");
        assert_eq!(h.count(), 100);
    }
}
