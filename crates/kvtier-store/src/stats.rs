//! Store counters (monotonic since creation) and gauges (now).

use std::sync::atomic::{AtomicU64, Ordering};

kvtier_core::fields! {
    /// A snapshot of the store's counters and gauges.
    #[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
    pub struct StoreStats {
        /// `lookup`, `lookup_each` and `lease` calls.
        pub lookups: u64,
        /// Blocks found in the consecutive prefix, over all lookups and leases.
        pub hit_blocks: u64,
        /// Keys asked for beyond the hit prefix.
        pub miss_blocks: u64,
        /// Blocks newly stored by `put`, and their payload bytes.
        pub put_blocks: u64,
        pub put_bytes: u64,
        /// Blocks copied out by `load` and verified, and their payload bytes.
        pub loaded_blocks: u64,
        pub loaded_bytes: u64,
        /// Blocks evicted to make room.
        pub evictions: u64,
        /// Blocks `put` refused because no space could be freed.
        pub rejected_puts: u64,
        /// Stored copies that failed verification on load (each then dropped), each counted once
        /// however many loads hit it.
        pub checksum_failures: u64,
        /// Leases granted and not yet released or expired.
        pub leases_active: u64,
        /// Leases reclaimed because their TTL passed.
        pub leases_expired: u64,
        /// Blocks DRAM gave up that are now in the SSD tier (written there, or already there).
        pub demoted_blocks: u64,
        /// Blocks DRAM gave up without writing them to SSD: fewer accesses than `admission_k`.
        pub admission_skipped: u64,
        /// Blocks DRAM gave up that the SSD tier refused (full of leased blocks, or an I/O error).
        pub demotion_failed: u64,
        /// Blocks loaded from SSD and copied into DRAM.
        pub promoted_blocks: u64,
        /// Blocks written to SSD at put time (write-through).
        pub written_through: u64,
        /// Blocks DRAM evicted without trying SSD (after the bounded demotion rounds of a put).
        pub dropped_evictions: u64,
        /// Blocks written to the remote tier (write-through at put, or write-back from DRAM), or
        /// found already there.
        pub remote_written: u64,
        /// Blocks the remote tier did not take (server down or failing; the put still succeeded).
        pub remote_write_failed: u64,
        /// Leased blocks that were gone when loaded (a remote server dropped them, or is down).
        pub load_missing: u64,
        /// Blocks the SSD codec encoded as they were written, their raw bytes, and the bytes of
        /// their codec objects (header + codec payload) as stored.
        pub ssd_encoded_blocks: u64,
        pub ssd_encoded_bytes_before: u64,
        pub ssd_encoded_bytes_after: u64,
        /// Blocks written to SSD raw although a codec is configured (it refused them, e.g. NaN/inf
        /// for `quant`, or they would not shrink).
        pub ssd_encode_fallbacks: u64,
        /// The same for the remote tier.
        pub remote_encoded_blocks: u64,
        pub remote_encoded_bytes_before: u64,
        pub remote_encoded_bytes_after: u64,
        pub remote_encode_fallbacks: u64,
        /// Stored codec objects (SSD or remote) that passed their tier's checksum but failed to
        /// decode (unknown codec id, corrupt codec payload, wrong decoded size; on SSD also a codec
        /// object header that fails): each a miss, dropped from its tier, and also counted in
        /// `checksum_failures`.
        pub decode_failures: u64,
        /// Blocks stored now, bytes they occupy (headers and page padding included), and the bound,
        /// summed over tiers (a block in DRAM and in SSD counts in both).
        pub objects: u64,
        pub used_bytes: u64,
        pub capacity_bytes: u64,
    }
}

/// The monotonic counters, updated without the store's locks.
#[derive(Debug, Default)]
pub(crate) struct Counters {
    pub lookups: AtomicU64,
    pub hit_blocks: AtomicU64,
    pub miss_blocks: AtomicU64,
    pub put_blocks: AtomicU64,
    pub put_bytes: AtomicU64,
    pub loaded_blocks: AtomicU64,
    pub loaded_bytes: AtomicU64,
    pub evictions: AtomicU64,
    pub rejected_puts: AtomicU64,
    pub checksum_failures: AtomicU64,
    pub demoted_blocks: AtomicU64,
    pub admission_skipped: AtomicU64,
    pub demotion_failed: AtomicU64,
    pub promoted_blocks: AtomicU64,
    pub written_through: AtomicU64,
    pub dropped_evictions: AtomicU64,
    pub remote_written: AtomicU64,
    pub remote_write_failed: AtomicU64,
    pub load_missing: AtomicU64,
    pub ssd_encoded_blocks: AtomicU64,
    pub ssd_encoded_bytes_before: AtomicU64,
    pub ssd_encoded_bytes_after: AtomicU64,
    pub ssd_encode_fallbacks: AtomicU64,
    pub remote_encoded_blocks: AtomicU64,
    pub remote_encoded_bytes_before: AtomicU64,
    pub remote_encoded_bytes_after: AtomicU64,
    pub remote_encode_fallbacks: AtomicU64,
    pub decode_failures: AtomicU64,
}

pub(crate) fn bump(counter: &AtomicU64, by: usize) {
    counter.fetch_add(by as u64, Ordering::Relaxed);
}

pub(crate) fn read(counter: &AtomicU64) -> u64 {
    counter.load(Ordering::Relaxed)
}
