//! What a store reports about itself: its counters, each tier's stats and metrics, the
//! integrity check of every tier against the lease table; flushing, and fault injection.

#[cfg(feature = "test-hooks")]
use kvtier_core::BlockKey;
use kvtier_pool::ssd::SsdMetrics;
use kvtier_pool::{PoolError, TierKind, TierStats};
use kvtier_remote::RemoteMetrics;

use super::Store;
use crate::error::StoreError;
use crate::stats::{read, StoreStats};

impl Store {
    pub fn stats(&self) -> StoreStats {
        let (leases_active, leases_expired) = {
            let mut table = self.leases.lock();
            self.reclaim_expired(&mut table);
            (table.active() as u64, table.expired_total)
        };
        let c = &self.counters;
        let mut stats = StoreStats {
            lookups: read(&c.lookups),
            hit_blocks: read(&c.hit_blocks),
            miss_blocks: read(&c.miss_blocks),
            put_blocks: read(&c.put_blocks),
            put_bytes: read(&c.put_bytes),
            loaded_blocks: read(&c.loaded_blocks),
            loaded_bytes: read(&c.loaded_bytes),
            evictions: read(&c.evictions),
            rejected_puts: read(&c.rejected_puts),
            checksum_failures: read(&c.checksum_failures),
            leases_active,
            leases_expired,
            demoted_blocks: read(&c.demoted_blocks),
            admission_skipped: read(&c.admission_skipped),
            demotion_failed: read(&c.demotion_failed),
            promoted_blocks: read(&c.promoted_blocks),
            written_through: read(&c.written_through),
            dropped_evictions: read(&c.dropped_evictions),
            remote_written: read(&c.remote_written),
            remote_write_failed: read(&c.remote_write_failed),
            load_missing: read(&c.load_missing),
            ssd_encoded_blocks: read(&c.ssd_encoded_blocks),
            ssd_encoded_bytes_before: read(&c.ssd_encoded_bytes_before),
            ssd_encoded_bytes_after: read(&c.ssd_encoded_bytes_after),
            ssd_encode_fallbacks: read(&c.ssd_encode_fallbacks),
            remote_encoded_blocks: read(&c.remote_encoded_blocks),
            remote_encoded_bytes_before: read(&c.remote_encoded_bytes_before),
            remote_encoded_bytes_after: read(&c.remote_encoded_bytes_after),
            remote_encode_fallbacks: read(&c.remote_encode_fallbacks),
            decode_failures: read(&c.decode_failures),
            ..StoreStats::default()
        };
        for tier in self.tiers() {
            let t = tier.stats();
            stats.objects += t.objects;
            stats.used_bytes += t.used_bytes;
            stats.capacity_bytes += t.capacity_bytes;
        }
        stats
    }

    /// Each tier's own counters and gauges, fastest tier first.
    pub fn tier_stats(&self) -> Vec<(TierKind, TierStats)> {
        self.tiers().map(|t| (t.kind(), t.stats())).collect()
    }

    /// The SSD pool's metrics (per device bytes, queue depth, latency percentiles; recovery),
    /// or `None` without an SSD tier.
    pub fn ssd_metrics(&self) -> Option<SsdMetrics> {
        self.hierarchy.ssd.as_ref().map(|s| s.tier.metrics())
    }

    /// The remote tier's metrics (per-operation latency, bytes, errors; reconnects; misses while
    /// down; bad values), or `None` without a remote tier.
    pub fn remote_metrics(&self) -> Option<RemoteMetrics> {
        self.hierarchy.remote.as_ref().map(|r| r.tier.metrics())
    }

    /// Makes every block the SSD tier holds durable now (no-op without one).
    pub fn flush(&self) -> Result<(), StoreError> {
        match self.hierarchy.ssd.as_ref().map(|s| &s.tier) {
            Some(ssd) => ssd.flush().map_err(|e| {
                StoreError::Tier(PoolError::SsdIo {
                    what: "flushing",
                    path: ssd.config().directory.display().to_string(),
                    reason: e.to_string(),
                })
            }),
            None => Ok(()),
        }
    }

    /// Verifies every tier (allocator accounting, index/extents, object headers, policy) and
    /// that each tier's pin counts equal what active leases hold. While a lease is being
    /// located (`leasing.rs`: its pins are taken before it is in the table), a tier may hold
    /// more pins than the leases: then each must hold at least theirs.
    pub fn check_integrity(&self) -> Result<(), StoreError> {
        let table = self.leases.lock();
        table.check_integrity().map_err(StoreError::Integrity)?;
        let locating = table.reserved() > 0;
        let mut expected = table.expected_pins();
        for (t, tier) in self.tiers().enumerate() {
            tier.check_integrity()?;
            if tier.used_bytes() > tier.capacity_bytes() {
                return Err(StoreError::Integrity(format!(
                    "{} tier uses {} bytes of {}",
                    tier.kind(),
                    tier.used_bytes(),
                    tier.capacity_bytes()
                )));
            }
            for (entry, pins) in tier.pins() {
                let leased = expected.remove(&(t, entry)).unwrap_or(0);
                if leased > pins || (leased < pins && !locating) {
                    return Err(StoreError::Integrity(format!(
                        "{} tier: {entry:?} has {pins} pins; leases hold {leased}",
                        tier.kind()
                    )));
                }
            }
        }
        if let Some(((t, entry), n)) = expected.into_iter().next() {
            return Err(StoreError::Integrity(format!(
                "leases hold {n} pins on {entry:?} in the {} tier, which has none",
                self.levels[t].tier().kind()
            )));
        }
        Ok(())
    }

    /// Flips one bit of a stored payload (fault injection). False, changing nothing, if no tier
    /// holds `key` unleased (a leased block may be being loaded: flipping then would race with
    /// the load) or the offset is past the payload.
    #[cfg(feature = "test-hooks")]
    pub fn corrupt_for_test(&self, key: BlockKey, payload_byte_offset: usize) -> bool {
        self.tiers().any(|t| t.corrupt_for_test(key, payload_byte_offset))
    }

    /// Fault injection (tests): fail every read (or, with `write`, write) of SSD device `device`
    /// with `errno` (0 clears). False, changing nothing, without an SSD tier or such a device.
    #[cfg(feature = "test-hooks")]
    pub fn inject_ssd_error_for_test(&self, device: usize, write: bool, errno: i32) -> bool {
        match self.hierarchy.ssd.as_ref().map(|s| &s.tier) {
            Some(ssd) if device < ssd.device_count() => {
                ssd.inject_device_error_for_test(device, write, errno);
                true
            }
            _ => false,
        }
    }
}
