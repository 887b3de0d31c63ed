//! Demotion: handing blocks the DRAM tier must give up to a lower tier (write-back) instead of
//! dropping them.
//!
//! [`DramTier::take_victims`] picks unpinned blocks in eviction order and marks them
//! *demoting*: still visible and readable (a lease may pin one meanwhile), no longer evictable,
//! and their extents neither freed nor written. The returned [`Demotion`] lends out each
//! block's payload pages (the payload starts its extent, so they are page-aligned) with the
//! checksum from its header, so the lower tier can write them with O_DIRECT without a copy; it
//! retires the blocks when finished or dropped (a block a lease pinned meanwhile is freed on
//! its last unpin). A read that finds a victim corrupt meanwhile drops it from the index at once
//! (no new lease sees it) but leaves its extent to the demotion, which frees it when it finishes.

use kvtier_core::{BlockKey, ObjectHeader};

use super::state::EntryState;
use super::{DramTier, HEADER};
use crate::extent::{round_up_to_pages, PAGE_BYTES};

/// One block chosen for demotion.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Victim {
    pub key: BlockKey,
    pub entry_id: u64,
    /// Puts of the key and leases of this copy while it was in DRAM.
    pub accesses: u32,
    pub payload_len: u64,
    /// The payload checksum from the stored header; `None` if the header no longer decodes
    /// (a corrupted block: not demoted).
    pub checksum: Option<u64>,
    offset: usize,
}

/// Blocks being demoted; see the module docs.
pub struct Demotion<'a> {
    tier: &'a DramTier,
    victims: Vec<Victim>,
}

impl DramTier {
    /// Marks unpinned blocks, in eviction order, as demoting until the free space plus theirs
    /// reaches `bytes` (or none is left to take).
    pub fn take_victims(&self, bytes: u64) -> Demotion<'_> {
        let mut victims = Vec::new();
        let mut st = self.state.lock();
        let st = &mut *st;
        let mut freed = st.allocator.free_bytes();
        while freed < bytes {
            let index = &st.index;
            let chosen = st.policy.victim(&mut |key| {
                index.get(&key).is_some_and(|e| e.state == EntryState::Ready && e.pins == 0)
            });
            let Some(key) = chosen else { break };
            let entry = st.index.get_mut(&key).expect("the policy tracks only indexed keys");
            entry.state = EntryState::Demoting;
            st.demoting += 1;
            freed += entry.extent.len;
            let offset = usize::try_from(entry.extent.offset).expect("arena offsets fit usize");
            let (id, accesses, payload_len) = (entry.id, entry.accesses, entry.payload_len);
            // SAFETY: a ready entry's header is written once, before publication, and never again.
            let header = unsafe { self.arena.bytes(offset + payload_len as usize, HEADER) };
            let checksum =
                ObjectHeader::decode(header).ok().filter(|h| h.key == key).map(|h| h.payload_checksum);
            victims.push(Victim { key, entry_id: id, accesses, payload_len, checksum, offset });
        }
        Demotion { tier: self, victims }
    }
}

impl Demotion<'_> {
    pub fn victims(&self) -> &[Victim] {
        &self.victims
    }

    pub fn is_empty(&self) -> bool {
        self.victims.is_empty()
    }

    /// The payload pages of victim `i`: page-aligned, the payload rounded up to whole pages (at
    /// least one; the bytes past the payload are its header and padding).
    pub fn payload_pages(&self, i: usize) -> &[u8] {
        let v = &self.victims[i];
        let len = round_up_to_pages(v.payload_len).max(PAGE_BYTES) as usize;
        // SAFETY: a demoting entry's extent (payload + header, whole pages: at least `len`) is
        // never freed, reused or written (writers write only extents of writing entries; fault
        // injection only ready ones) until `finish`, which takes `self`, so this borrow ends first.
        unsafe { self.tier.arena.bytes(v.offset, len) }
    }

    /// Retires every victim (they count as evictions of the DRAM tier).
    pub fn finish(self) {
        // Drop does the work.
    }
}

impl Drop for Demotion<'_> {
    fn drop(&mut self) {
        if self.victims.is_empty() {
            return;
        }
        let mut st = self.tier.state.lock();
        for v in &self.victims {
            if st.finish_demoting(v.key, v.entry_id) {
                st.counters.evictions += 1;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use kvtier_core::parallel::WorkerPool;

    use crate::eviction::by_name;
    use crate::tier::{ReadOutcome, Tier};
    use crate::DramTier;

    #[test]
    fn victims_stay_readable_until_finished_then_leave() {
        let tier = DramTier::new(4 * 8192, by_name("lru").unwrap(), Arc::new(WorkerPool::new(1))).unwrap();
        let payload = vec![5u8; 5000];
        tier.put(1, &[10, 11, 12, 13], &[&payload, &payload, &payload, &payload]);
        let mut refused = Vec::new();
        let report = tier.put_with(1, &[14], &[&payload], false, &mut refused);
        assert_eq!((report.rejected, refused), (1, vec![0]), "no eviction without `evict`");
        let demotion = tier.take_victims(8192);
        assert_eq!(demotion.victims().iter().map(|v| v.key).collect::<Vec<_>>(), vec![10], "LRU order");
        let v = demotion.victims()[0];
        assert_eq!((v.payload_len, v.checksum), (5000, Some(kvtier_core::checksum::checksum(&payload))));
        assert_eq!(&demotion.payload_pages(0)[..5000], &payload[..]);
        assert_eq!(demotion.payload_pages(0).len(), 8192);
        assert_eq!(demotion.payload_pages(0).as_ptr() as usize % 4096, 0);
        // Still visible and readable while demoting; a lease-like pin survives the finish.
        let mut located = [None];
        assert_eq!(tier.locate(1, &[10], &mut located, true, false), 1);
        tier.check_integrity().unwrap();
        demotion.finish();
        assert!(!tier.contains(1, 10));
        let entry = located[0].unwrap().entry;
        let mut out = vec![0u8; 5000];
        let mut outcome = [ReadOutcome::NotPinned];
        tier.read_pinned(1, &[entry], &mut [&mut out], &mut outcome);
        assert_eq!((outcome[0], out == payload), (ReadOutcome::Loaded, true));
        tier.unpin(&[entry]);
        assert_eq!(tier.put_with(1, &[14], &[&payload], false, &mut Vec::new()).stored, 1);
        assert_eq!(tier.stats().evictions, 1);
        tier.check_integrity().unwrap();
    }

    #[test]
    fn a_victim_found_corrupt_keeps_its_extent_until_the_demotion_finishes() {
        let tier = DramTier::new(4 * 8192, by_name("lru").unwrap(), Arc::new(WorkerPool::new(1))).unwrap();
        let payload = vec![5u8; 5000];
        tier.put(1, &[10, 11, 12, 13], &[&payload, &payload, &payload, &payload]);
        let demotion = tier.take_victims(8192);
        assert_eq!(demotion.victims()[0].key, 10);
        let mut located = [None];
        assert_eq!(tier.locate(1, &[10], &mut located, true, false), 1);
        let entry = located[0].unwrap().entry;
        // SAFETY: nothing reads or writes the arena meanwhile (one thread).
        unsafe { tier.arena.flip_bit(demotion.victims()[0].offset + 7, 0) };
        let mut out = vec![0u8; 5000];
        let mut outcome = [ReadOutcome::NotPinned];
        tier.read_pinned(1, &[entry], &mut [&mut out], &mut outcome);
        assert_eq!(outcome[0], ReadOutcome::Corrupt);
        assert!(!tier.contains(1, 10), "a corrupt copy leaves the index at once");
        tier.unpin(&[entry]);
        tier.check_integrity().unwrap();
        // The demotion still writes from the extent: the space must not be reused meanwhile.
        let before = demotion.payload_pages(0).to_vec();
        let other = vec![9u8; 5000];
        let free_put = tier.put_with(1, &[20], &[&other], false, &mut Vec::new());
        assert_eq!(free_put.stored, 0, "the victim's extent was freed under its demotion");
        assert_eq!(tier.put(1, &[20, 21], &[&other, &other]).stored, 2, "by evicting 11 and 12");
        assert_eq!(
            demotion.payload_pages(0),
            &before[..],
            "the victim's pages were reused under its demotion"
        );
        demotion.finish();
        assert_eq!(tier.stats().evictions, 2, "the corrupt victim is not counted as evicted");
        assert!(tier.pins().is_empty());
        tier.check_integrity().unwrap();
        let after = tier.put_with(1, &[22], &[&other], false, &mut Vec::new());
        assert_eq!(after.stored, 1, "its extent is free once the demotion finished");
        tier.check_integrity().unwrap();
    }
}
