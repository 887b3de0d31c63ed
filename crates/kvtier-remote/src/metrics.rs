//! Remote tier metrics: per operation (batches, keys, bytes, errors, latency percentiles) and
//! per fault (reconnects, misses while down, values that are not this namespace's objects).
//! Counters are atomics, updated without locks; a snapshot is [`RemoteMetrics`].

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// Latency histogram buckets: bucket `b` holds durations in `[2^b, 2^(b+1))` ns.
const BUCKETS: usize = 40;

#[derive(Debug)]
pub(crate) struct Histogram {
    buckets: [AtomicU64; BUCKETS],
}

impl Default for Histogram {
    fn default() -> Self {
        Histogram { buckets: std::array::from_fn(|_| AtomicU64::new(0)) }
    }
}

impl Histogram {
    pub fn record(&self, d: Duration) {
        let ns = d.as_nanos().max(1) as u64;
        let b = (63 - ns.leading_zeros() as usize).min(BUCKETS - 1);
        self.buckets[b].fetch_add(1, Ordering::Relaxed);
    }

    /// Upper bound (seconds) of the bucket holding quantile `q`; 0 when empty.
    pub fn quantile_s(&self, q: f64) -> f64 {
        let counts: Vec<u64> = self.buckets.iter().map(|b| b.load(Ordering::Relaxed)).collect();
        let total: u64 = counts.iter().sum();
        if total == 0 {
            return 0.0;
        }
        let rank = ((total as f64) * q).ceil().max(1.0) as u64;
        let mut seen = 0;
        for (b, c) in counts.iter().enumerate() {
            seen += c;
            if seen >= rank {
                return (1u64 << (b + 1)) as f64 * 1e-9;
            }
        }
        (1u64 << BUCKETS) as f64 * 1e-9
    }
}

/// Counters of one operation kind.
#[derive(Debug, Default)]
pub(crate) struct OpCounters {
    pub batches: AtomicU64,
    pub keys: AtomicU64,
    pub bytes: AtomicU64,
    pub errors: AtomicU64,
    pub latency: Histogram,
}

impl OpCounters {
    pub fn record(&self, keys: usize, bytes: u64, elapsed: Duration) {
        self.batches.fetch_add(1, Ordering::Relaxed);
        self.keys.fetch_add(keys as u64, Ordering::Relaxed);
        self.bytes.fetch_add(bytes, Ordering::Relaxed);
        self.latency.record(elapsed);
    }

    fn snapshot(&self) -> OpMetrics {
        OpMetrics {
            batches: self.batches.load(Ordering::Relaxed),
            keys: self.keys.load(Ordering::Relaxed),
            bytes: self.bytes.load(Ordering::Relaxed),
            errors: self.errors.load(Ordering::Relaxed),
            latency_p50_s: self.latency.quantile_s(0.5),
            latency_p99_s: self.latency.quantile_s(0.99),
        }
    }
}

/// The live counters, named once: each becomes a field of `Counters` and of its `RemoteMetrics`
/// snapshot (operation kinds as `OpCounters` → `OpMetrics`, the rest as `AtomicU64` → `u64`).
macro_rules! counters {
    (ops: $($op:ident),*; counts: $($count:ident),* $(,)?) => {
        #[derive(Debug, Default)]
        pub(crate) struct Counters {
            $(pub $op: OpCounters,)*
            $(pub $count: AtomicU64,)*
        }

        impl Counters {
            pub fn snapshot(&self, nodes: u64, nodes_down: u64) -> RemoteMetrics {
                RemoteMetrics {
                    $($op: self.$op.snapshot(),)*
                    $($count: self.$count.load(Ordering::Relaxed),)*
                    nodes,
                    nodes_down,
                }
            }
        }
    };
}

counters! {
    ops: exists, get, set, del;
    counts: connects, reconnects, connect_failures, auth_failures, down_misses, down_skipped_writes,
        missing_on_get, bad_magic, bad_length, bad_checksum, foreign_objects, redirects, slot_refreshes,
}

pub(crate) fn bump(c: &AtomicU64, by: usize) {
    c.fetch_add(by as u64, Ordering::Relaxed);
}

kvtier_core::fields! {
    /// One operation kind's figures.
    #[derive(Clone, Copy, Debug, Default, PartialEq)]
    pub struct OpMetrics {
        /// Pipelined batches sent (one per server node touched).
        pub batches: u64,
        pub keys: u64,
        /// Value bytes moved (headers included).
        pub bytes: u64,
        /// Keys whose command failed (connection error, timeout, server error reply).
        pub errors: u64,
        /// Batch latency percentiles (upper bounds of power-of-two buckets), seconds.
        pub latency_p50_s: f64,
        pub latency_p99_s: f64,
    }
}

kvtier_core::fields! {
    /// A snapshot of the remote tier's metrics.
    #[derive(Clone, Debug, Default, PartialEq)]
    pub struct RemoteMetrics {
        pub exists: OpMetrics,
        pub get: OpMetrics,
        pub set: OpMetrics,
        pub del: OpMetrics,
        ..
        /// Connections opened, and those opened after a failure (reconnects).
        pub connects: u64,
        pub reconnects: u64,
        pub connect_failures: u64,
        /// Connections the server refused to authenticate (after start; at start it is an error).
        pub auth_failures: u64,
        /// Keys looked up or loaded as misses because their server was down or failed mid-batch.
        pub down_misses: u64,
        /// Keys not written because their server was down or failed mid-batch.
        pub down_skipped_writes: u64,
        /// Keys that existed at lookup and were gone at load (TTL, server eviction, restart).
        pub missing_on_get: u64,
        /// Values that are not kvtier objects: bad magic/version/header, wrong length, payload
        /// checksum mismatch, or another namespace's (or key's) object. Each is a miss and is deleted.
        pub bad_magic: u64,
        pub bad_length: u64,
        pub bad_checksum: u64,
        pub foreign_objects: u64,
        /// Cluster: MOVED/ASK replies, and slot-map refreshes.
        pub redirects: u64,
        pub slot_refreshes: u64,
        /// Nodes known and nodes now in reconnect backoff.
        pub nodes: u64,
        pub nodes_down: u64,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantiles() {
        let h = Histogram::default();
        assert_eq!(h.quantile_s(0.5), 0.0);
        for _ in 0..99 {
            h.record(Duration::from_micros(10));
        }
        h.record(Duration::from_millis(100));
        assert!(h.quantile_s(0.5) >= 10e-6 && h.quantile_s(0.5) < 20e-6 * 1.1);
        assert!(h.quantile_s(0.999) >= 0.1);
    }
}
