//! The store's view of its tiers: each level is one [`Tier`] trait object together with the
//! codec its blocks are stored in, so a level owns its bytes — it writes blocks in its stored
//! form, and reads them back verified (and decoded) into the caller's buffers. The store reads
//! through [`Level`] only and never asks which kind of tier it is talking to.
//!
//! - DRAM ([`RawLevel`]) holds raw blocks: a read is the tier's own verified read.
//! - SSD ([`ssd::SsdLevel`]) and remote ([`remote::RemoteLevel`]) may hold codec objects
//!   ([`crate::codec_stage`]): reads decode by the object's header, and writes encode with the
//!   level's configured codec. Their `put_extents` writes DRAM victims straight from their
//!   extents (demotion, zero-copy for raw blocks).

pub(crate) mod remote;
pub(crate) mod ssd;

use std::sync::Arc;

use kvtier_core::checksum::checksum;
use kvtier_core::BlockKey;
use kvtier_pool::{EntryRef, ReadOutcome, Tier};

use crate::types::StoredBlock;

/// One DRAM victim's payload as it sits in its extent: `(pages, payload_len, checksum)` — the
/// payload starts the page-aligned extent, and its checksum comes from the DRAM header.
pub(crate) type ExtentPayload<'a> = (&'a [u8], u64, u64);

/// The keys and payloads of the extents whose payload still matches its DRAM checksum (a
/// level encoding them must not encode flipped bytes under a fresh checksum), and how many
/// did not.
pub(crate) fn verified_extents<'a>(
    keys: &[BlockKey],
    extents: &[ExtentPayload<'a>],
) -> (Vec<BlockKey>, Vec<&'a [u8]>, usize) {
    let (mut ok_keys, mut payloads) = (Vec::with_capacity(keys.len()), Vec::with_capacity(keys.len()));
    for (&key, &(pages, len, sum)) in keys.iter().zip(extents) {
        let payload = &pages[..len as usize];
        if checksum(payload) == sum {
            ok_keys.push(key);
            payloads.push(payload);
        }
    }
    let failed = keys.len() - ok_keys.len();
    (ok_keys, payloads, failed)
}

/// The typed outcome of one level's batch read, besides the per-block [`ReadOutcome`]s.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct LevelRead {
    /// Stored copies whose bytes verified but did not decode (or did not fit their
    /// destination): each was reported `Corrupt` and is already dropped from the tier.
    pub decode_failures: usize,
}

/// One level of the store's hierarchy: a tier and the form its blocks are stored in.
pub(crate) trait Level: Send + Sync {
    /// The tier itself (locate, pin, unpin, remove, stats and integrity are the tier's).
    fn tier(&self) -> &dyn Tier;

    /// Reads pinned `entries` into `dst` (each exactly the block size), verified and decoded;
    /// `outcomes[i]` says how each went. With `forms` ([`Store::load_range_stored`]), codec
    /// objects are verified and left encoded in their destinations, `forms[i]` locating the
    /// payload (untouched for raw blocks).
    ///
    /// [`Store::load_range_stored`]: crate::Store::load_range_stored
    fn read(
        &self,
        namespace: u128,
        entries: &[EntryRef],
        dst: &mut [&mut [u8]],
        outcomes: &mut [ReadOutcome],
        forms: Option<&mut [StoredBlock]>,
    ) -> LevelRead;
}

/// A level of raw blocks only (DRAM, noop): the tier's own verified read is the whole read.
pub(crate) struct RawLevel(pub Arc<dyn Tier>);

impl Level for RawLevel {
    fn tier(&self) -> &dyn Tier {
        &*self.0
    }

    fn read(
        &self,
        namespace: u128,
        entries: &[EntryRef],
        dst: &mut [&mut [u8]],
        outcomes: &mut [ReadOutcome],
        _forms: Option<&mut [StoredBlock]>,
    ) -> LevelRead {
        self.0.read_pinned(namespace, entries, dst, outcomes);
        LevelRead::default()
    }
}

/// The keys and objects of items `items`, in that order.
pub(crate) fn select<'a>(
    keys: &[BlockKey],
    objects: &[&'a [u8]],
    items: &[usize],
) -> (Vec<BlockKey>, Vec<&'a [u8]>) {
    (items.iter().map(|&i| keys[i]).collect(), items.iter().map(|&i| objects[i]).collect())
}
