//! The [`Tier`] trait: one level of the hierarchy (DRAM, SSD, remote, noop), batched. It lives
//! here, below every tier, so that kvtier-pool (DRAM, SSD, noop) and kvtier-remote implement it
//! without depending on each other, and the store holds tiers as trait objects only.
//!
//! Every method takes a whole batch and takes the tier's lock once per batch, never once per
//! key: a 128K-token prompt is 8192 blocks. Large copies happen outside the lock.
//!
//! Lifecycle of an object in a tier: *writing* (space reserved, bytes being copied; invisible
//! and not evictable) → *ready* (visible, evictable when unpinned) → gone (evicted or removed),
//! or *doomed* (failed its checksum or removed while pinned: invisible at once, its space freed
//! when the last pin drops). A pin is held per [`EntryRef`], i.e. per stored generation of a
//! key, so a key stored again after being doomed is never confused with the doomed copy.

use thiserror::Error;

use crate::keys::BlockKey;

/// A tier's own state disagrees with itself ([`Tier::check_integrity`]): allocator accounting,
/// index and allocator, the eviction policy's view, or a ready object's header.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[error("{tier} tier integrity check failed: {detail}")]
pub struct IntegrityError {
    pub tier: &'static str,
    pub detail: String,
}

/// A tier that could not drop a namespace's objects ([`Tier::clear`]): a remote store that is
/// unreachable or answers out of protocol.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[error("{tier} tier could not clear the namespace: {detail}")]
pub struct ClearError {
    pub tier: &'static str,
    pub detail: String,
}

/// Shorthand for an integrity failure of `tier`, as any error type that wraps one.
pub fn integrity<E: From<IntegrityError>>(tier: &'static str, detail: impl Into<String>) -> E {
    E::from(IntegrityError { tier, detail: detail.into() })
}

/// Which kind of storage a tier is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum TierKind {
    Dram,
    Ssd,
    Remote,
    Noop,
}

impl TierKind {
    pub const ALL: [TierKind; 4] = [TierKind::Dram, TierKind::Ssd, TierKind::Remote, TierKind::Noop];

    pub fn name(&self) -> &'static str {
        match self {
            TierKind::Dram => "dram",
            TierKind::Ssd => "ssd",
            TierKind::Remote => "remote",
            TierKind::Noop => "noop",
        }
    }
}

impl std::fmt::Display for TierKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// One stored generation of a key in a tier: what a pin holds on to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct EntryRef {
    pub key: BlockKey,
    /// Unique within its tier for the tier's lifetime.
    pub entry_id: u64,
}

/// Where a located block lives.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Located {
    pub tier: TierKind,
    pub entry: EntryRef,
}

/// The walk every tier's [`Tier::locate`] makes: for each empty slot `i` of `located`, in key
/// order, `probe(i, &keys[i])` returns the tier's entry id (having pinned it when asked), or `None`;
/// with `stop_at_miss` the walk ends at the first key located neither before nor by `probe`.
/// Returns how many keys `probe` located.
pub fn locate_each(
    tier: TierKind,
    keys: &[BlockKey],
    located: &mut [Option<Located>],
    stop_at_miss: bool,
    mut probe: impl FnMut(usize, &BlockKey) -> Option<u64>,
) -> usize {
    assert_eq!(keys.len(), located.len(), "one slot per key");
    let mut found = 0;
    for (i, (key, slot)) in keys.iter().zip(located.iter_mut()).enumerate() {
        if slot.is_some() {
            continue;
        }
        match probe(i, key) {
            Some(entry_id) => {
                *slot = Some(Located { tier, entry: EntryRef { key: *key, entry_id } });
                found += 1;
            }
            None if stop_at_miss => break,
            None => {}
        }
    }
    found
}

/// Outcome of one batched put.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TierPutReport {
    /// Objects written and now visible.
    pub stored: usize,
    /// Keys already present or being written (content-addressed: same key, same bytes).
    pub already_present: usize,
    /// Objects refused because no space could be freed (everything else pinned or too large).
    pub rejected: usize,
    /// Blocks evicted to make room for this batch.
    pub evicted: usize,
}

/// Outcome of reading one pinned block.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReadOutcome {
    /// The destination holds the exact stored payload (checksum verified).
    Loaded,
    /// Header or payload failed verification in this read; the block is doomed (and counted,
    /// once, by this read) and the destination's bytes must not be used.
    Corrupt,
    /// This stored copy already failed verification in an earlier read (counted then); it was
    /// not read again, and the destination's bytes must not be used.
    CorruptKnown,
    /// The entry was not pinned in this tier (a caller bug; nothing was copied).
    NotPinned,
    /// The object was gone when read (a remote server dropped it after it was located: TTL,
    /// server-side eviction, restart, or the server is down). A miss, not corruption; the
    /// destination's bytes must not be used.
    Missing,
}

impl ReadOutcome {
    /// The outcome's name in reports (`"loaded"`, `"corrupt"`, ...).
    pub fn name(self) -> &'static str {
        match self {
            ReadOutcome::Loaded => "loaded",
            ReadOutcome::Corrupt => "corrupt",
            ReadOutcome::CorruptKnown => "corrupt_known",
            ReadOutcome::NotPinned => "not_pinned",
            ReadOutcome::Missing => "missing",
        }
    }
}

crate::fields! {
    /// Counters and gauges of one tier.
    #[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
    pub struct TierStats {
        /// Ready (visible) objects.
        pub objects: u64,
        /// Ready objects with at least one pin.
        pub pinned_objects: u64,
        /// Doomed objects still held by pins.
        pub doomed_objects: u64,
        pub used_bytes: u64,
        pub capacity_bytes: u64,
        pub stored: u64,
        pub evictions: u64,
        pub rejected: u64,
        pub checksum_failures: u64,
    }
}

/// One level of the store's hierarchy. Implementations are internally synchronised.
pub trait Tier: Send + Sync {
    fn kind(&self) -> TierKind;
    /// Bytes this tier may hold at most (never exceeded).
    fn capacity_bytes(&self) -> u64;
    /// Bytes reserved by objects (ready, writing and doomed), including headers and padding.
    fn used_bytes(&self) -> u64;

    /// Stores `payloads[i]` under `keys[i]` (same lengths), evicting unpinned blocks as needed.
    /// A key already present or being written for `namespace` is skipped as already present; one
    /// held by another namespace is rejected (never overwritten, never reported as present).
    fn put(&self, namespace: u128, keys: &[BlockKey], payloads: &[&[u8]]) -> TierPutReport;

    /// For each `i` with `located[i] == None` whose key this tier holds (ready) for
    /// `namespace`, sets `located[i]` and, when `pin`, pins it (and counts it as an access for
    /// eviction). A copy of the key written for another namespace is a plain miss: never located,
    /// never read, never removed by this namespace. With `stop_at_miss` (the caller's last tier),
    /// stops at the first key located neither before nor here. Returns how many keys this call
    /// located.
    fn locate(
        &self,
        namespace: u128,
        keys: &[BlockKey],
        located: &mut [Option<Located>],
        pin: bool,
        stop_at_miss: bool,
    ) -> usize;

    /// Copies pinned entries into `dst` (`dst[i]` exactly the payload length of `entries[i]`),
    /// verifying each object's header and payload checksum; `outcomes[i]` says how each went.
    /// A corrupt entry is doomed (lookups miss it from now on) and counted once, by the read that
    /// found it; later reads of that copy report [`ReadOutcome::CorruptKnown`].
    fn read_pinned(
        &self,
        namespace: u128,
        entries: &[EntryRef],
        dst: &mut [&mut [u8]],
        outcomes: &mut [ReadOutcome],
    );

    /// Drops one pin from each entry. Panics on an entry that holds no pin (a caller bug).
    fn unpin(&self, entries: &[EntryRef]);

    /// Whether a ready copy of `key` of `namespace` is here.
    fn contains(&self, namespace: u128, key: BlockKey) -> bool;

    /// Removes the keys' ready copies of `namespace` (pinned ones are doomed and freed on their
    /// last unpin); another namespace's copy of the same key is left alone.
    /// Returns how many were removed or doomed.
    fn remove(&self, namespace: u128, keys: &[BlockKey]) -> usize;

    /// Removes exactly the stored copies `entries` of `namespace` (as [`remove`](Self::remove):
    /// a pinned one is doomed), for a caller that found *those* copies bad: a copy already gone
    /// or doomed, and a newer copy of the same key stored since (a re-put after a removal), are
    /// left alone. Returns how many were removed or doomed.
    ///
    /// The default removes by key, for a tier whose stored objects carry no generation to
    /// compare an entry id with (remote: the ids are the client's, given at each locate; a
    /// value written again since is deleted with it). A tier with generations (DRAM, SSD)
    /// overrides it.
    fn remove_entries(&self, namespace: u128, entries: &[EntryRef]) -> usize {
        let keys: Vec<BlockKey> = entries.iter().map(|e| e.key).collect();
        self.remove(namespace, &keys)
    }

    /// Removes every ready copy of `namespace`, as [`remove`](Self::remove) of all its keys
    /// (pinned ones are doomed); other namespaces' objects stay. Returns how many were removed.
    /// A put running at the same time may leave its blocks: the store fences its own writes
    /// around a clear (`Store::clear` in kvtier-store).
    fn clear(&self, namespace: u128) -> Result<usize, ClearError>;

    /// Every entry holding pins, with its pin count (for the store's lease cross-check).
    fn pins(&self) -> Vec<(EntryRef, u32)>;

    fn stats(&self) -> TierStats;

    /// Checks allocator accounting, index/allocator agreement, the eviction policy's view and
    /// every ready object's header.
    fn check_integrity(&self) -> Result<(), IntegrityError>;

    /// Flips one bit of the stored payload of `key` (fault injection for tests; only with the
    /// `test-hooks` feature). False, changing
    /// nothing, if the key is not here, is pinned (a read may be copying it: flipping then would
    /// be a data race), or the offset is past the payload.
    #[cfg(feature = "test-hooks")]
    fn corrupt_for_test(&self, _key: BlockKey, _payload_byte_offset: usize) -> bool {
        false
    }
}
