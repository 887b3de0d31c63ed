//! Write-through from DRAM: [`DramTier::pin_pages`] pins the ready copies of a batch (without
//! counting an access: the eviction policy sees nothing) and lends out each one's payload pages
//! (page-aligned, as [`crate::Demotion`] does) with the checksum from its header, so a lower tier
//! writes them with O_DIRECT straight from DRAM: no staging copy of a caller's unaligned buffer
//! and no second checksum pass. The pins are dropped with the returned [`PinnedPages`].

use kvtier_core::{BlockKey, ObjectHeader};

use super::state::EntryState;
use super::{DramTier, HEADER};
use crate::extent::{round_up_to_pages, PAGE_BYTES};
use crate::tier::EntryRef;

/// One pinned copy: the batch item it is, its payload length and its header's checksum (`None`
/// if the header no longer decodes: a corrupt copy, not to be written anywhere).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PinnedPage {
    pub item: usize,
    pub payload_len: u64,
    pub checksum: Option<u64>,
    offset: usize,
}

/// The pinned DRAM copies of a batch; see the module docs.
pub struct PinnedPages<'a> {
    tier: &'a DramTier,
    entries: Vec<EntryRef>,
    pages: Vec<PinnedPage>,
}

impl DramTier {
    /// Pins the ready copies of `keys` in `namespace` (items absent, of another namespace or not
    /// ready are left out), counting no access.
    pub fn pin_pages(&self, namespace: u128, keys: &[BlockKey]) -> PinnedPages<'_> {
        let mut entries = Vec::with_capacity(keys.len());
        let mut pages = Vec::with_capacity(keys.len());
        let mut st = self.state.lock();
        let st = &mut *st;
        for (item, key) in keys.iter().enumerate() {
            let Some(e) = st.index.get_mut(key) else { continue };
            if e.state != EntryState::Ready || e.namespace != namespace {
                continue;
            }
            if e.pins == 0 {
                st.pinned_ready += 1;
            }
            e.pins = e.pins.checked_add(1).expect("pin count overflow");
            let offset = usize::try_from(e.extent.offset).expect("arena offsets fit usize");
            let payload_len = e.payload_len;
            entries.push(EntryRef { key: *key, entry_id: e.id });
            // SAFETY: a ready entry's header is written once, before publication, and never again.
            let header = unsafe { self.arena.bytes(offset + payload_len as usize, HEADER) };
            let checksum =
                ObjectHeader::decode(header).ok().filter(|h| h.key == *key).map(|h| h.payload_checksum);
            pages.push(PinnedPage { item, payload_len, checksum, offset });
        }
        PinnedPages { tier: self, entries, pages }
    }
}

impl PinnedPages<'_> {
    pub fn pages(&self) -> &[PinnedPage] {
        &self.pages
    }

    /// The payload pages of pinned copy `i`: page-aligned, the payload rounded up to whole pages
    /// (at least one; the bytes past the payload are its header and padding).
    pub fn payload_pages(&self, i: usize) -> &[u8] {
        let p = &self.pages[i];
        let len = round_up_to_pages(p.payload_len).max(PAGE_BYTES) as usize;
        // SAFETY: a pinned entry's extent (payload + header, whole pages: at least `len`) is
        // neither freed nor reused until its last unpin (a removal only dooms it), and writers
        // write only extents of writing entries; the pins are dropped with `self`, after this
        // borrow ends.
        unsafe { self.tier.arena.bytes(p.offset, len) }
    }
}

impl Drop for PinnedPages<'_> {
    fn drop(&mut self) {
        if self.entries.is_empty() {
            return;
        }
        let mut st = self.tier.state.lock();
        for entry in &self.entries {
            st.unpin(entry);
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use kvtier_core::parallel::WorkerPool;

    use crate::eviction::by_name;
    use crate::extent::PAGE_BYTES;
    use crate::tier::Tier;
    use crate::DramTier;

    #[test]
    fn pins_ready_copies_and_lends_their_pages() {
        let tier = DramTier::new(1 << 20, by_name("lru").unwrap(), Arc::new(WorkerPool::new(1))).unwrap();
        let a: Vec<u8> = (0..8192u32).map(|i| (i * 7) as u8).collect();
        let b: Vec<u8> = (0..100u32).map(|i| i as u8).collect();
        tier.put(5, &[1, 2], &[&a, &b]);
        tier.put(6, &[3], &[&a]); // another namespace: left out
        let pinned = tier.pin_pages(5, &[3, 1, 9, 2]);
        let items: Vec<usize> = pinned.pages().iter().map(|p| p.item).collect();
        assert_eq!(items, vec![1, 3]);
        assert_eq!(pinned.payload_pages(0), &a[..]);
        assert_eq!(pinned.payload_pages(1).len(), PAGE_BYTES as usize);
        assert_eq!(&pinned.payload_pages(1)[..100], &b[..]);
        assert_eq!(pinned.pages()[0].checksum, Some(kvtier_core::checksum::checksum(&a)));
        assert_eq!(pinned.payload_pages(0).as_ptr() as u64 % PAGE_BYTES, 0);
        // Pinned: a removal dooms the copy, but its pages stay until the pins drop.
        assert_eq!(tier.remove(5, &[1]), 1);
        assert_eq!(pinned.payload_pages(0), &a[..]);
        assert_eq!(tier.pins().len(), 2);
        tier.check_integrity().unwrap();
        drop(pinned);
        assert!(tier.pins().is_empty());
        tier.check_integrity().unwrap();
    }
}
