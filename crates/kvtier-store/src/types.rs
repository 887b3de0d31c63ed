//! The store's result types, below every module that produces them: what a lookup, lease, put or
//! load reports, and where a block read undecoded sits in its destination ([`StoredBlock`]).

use kvtier_pool::{TierKind, TierPutReport};

/// Result of [`Store::lookup`](crate::Store::lookup): the longest consecutive prefix of present
/// blocks.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Lookup {
    pub hit_blocks: usize,
    /// Where each hit block lives; `tiers.len() == hit_blocks`.
    pub tiers: Vec<TierKind>,
}

/// Result of [`Store::lease`](crate::Store::lease): like [`Lookup`], and the hit blocks are pinned
/// until [`Store::release`](crate::Store::release) or TTL expiry. Every lease (even one with 0
/// hits) must be released.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Lease {
    pub id: u64,
    pub hit_blocks: usize,
    pub tiers: Vec<TierKind>,
}

/// Blocks of one put written to each tier (new copies only; on SSD both written through and
/// demoted to make room for the put, which may be older blocks).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TierWrites {
    pub dram: usize,
    pub ssd: usize,
    pub remote: usize,
}

/// What a put did in the hierarchy: counts over its keys (a block DRAM had no room for counts as
/// stored when a lower tier holds it after the put, rejected only when no tier does), and the
/// writes per tier.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct HierarchyPut {
    pub report: TierPutReport,
    pub writes: TierWrites,
}

/// Result of [`Store::put`](crate::Store::put). `stored + already_present + rejected` equals the
/// keys given.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PutReport {
    /// Blocks this put wrote: into DRAM, or, where DRAM had no room, through (or by demotion)
    /// to SSD or the remote tier.
    pub stored: usize,
    /// Blocks DRAM held (or a lower tier, for those DRAM had no room for).
    pub already_present: usize,
    /// Blocks no tier holds after the put: DRAM had no room (every block that could make room
    /// is leased, or the put is larger than DRAM) and no lower tier took them.
    pub rejected: usize,
    /// Blocks evicted from DRAM to make room for this put.
    pub evicted: usize,
    /// New copies written to each tier by this put.
    pub written: TierWrites,
}

/// Result of [`Store::load`](crate::Store::load).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LoadReport {
    /// Destinations `0..loaded_blocks` hold verified bytes; later ones must not be used.
    pub loaded_blocks: usize,
    /// Blocks of this load that failed verification (each dropped from its tier). A stored copy
    /// found corrupt by an earlier load is reported again here, but counted only once in
    /// [`StoreStats::checksum_failures`](crate::StoreStats).
    pub checksum_failures: usize,
}

/// Where one block read undecoded by
/// [`Store::load_range_stored`](crate::Store::load_range_stored) sits in its destination:
/// `dst[offset..offset + len]` is the verified payload of codec `codec_id` (0: raw, the block
/// itself, `offset` 0 and `len` = `block_bytes`; 1 `lossless`, 2 `quant`: a `KVCP` payload
/// whose header declares `block_bytes` decoded bytes). Bytes of `dst` outside it are unspecified.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StoredBlock {
    pub codec_id: u16,
    pub offset: usize,
    pub len: usize,
}

impl StoredBlock {
    /// A raw block of `block_bytes`.
    pub fn raw(block_bytes: usize) -> Self {
        StoredBlock { codec_id: 0, offset: 0, len: block_bytes }
    }
}

/// Result of [`Store::load_range_stored`](crate::Store::load_range_stored).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct StoredLoadReport {
    /// Per block of the range: where its verified stored bytes are, or `None` if it failed
    /// verification or its read failed (dropped from its tier and counted, as in
    /// [`Store::load`](crate::Store::load)); its destination bytes must not be used then.
    pub blocks: Vec<Option<StoredBlock>>,
    /// Blocks of this load that failed verification (as [`LoadReport::checksum_failures`]).
    pub checksum_failures: usize,
}

/// What a load into a pool did ([`Store::load_into_pool`](crate::Store::load_into_pool)).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PoolLoadReport {
    /// Blocks `0..loaded_blocks` of the call all verified (the consecutive prefix an engine may
    /// count as cached).
    pub loaded_blocks: usize,
    /// Positions (in the call's block table) of every block that did not verify or was gone:
    /// its pool block holds no usable bytes.
    pub failed: Vec<usize>,
    /// Blocks that failed verification in this load (each stored copy is counted in the store's
    /// stats once).
    pub checksum_failures: usize,
}
