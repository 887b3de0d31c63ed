//! The DRAM tier's state under its lock: the index, the allocator, the eviction policy, and
//! the rules that move entries between *writing*, *ready* and *doomed*.

use std::collections::HashMap;

use kvtier_core::{BlockKey, ObjectHeader, OBJECT_HEADER_BYTES};

use crate::arena::Arena;
use crate::eviction::EvictionPolicy;
use crate::extent::{round_up_to_pages, Extent, ExtentAllocator};
use crate::hash::{key_map, KeyMap};
use crate::tier::EntryRef;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum EntryState {
    /// Space reserved, bytes being copied: invisible, not evictable.
    Writing,
    /// Visible; evictable when `pins == 0`.
    Ready,
    /// Chosen for demotion to a lower tier: still visible and readable (leases may pin it), not
    /// tracked by the policy, and its extent is neither freed nor written until the demotion
    /// finishes and retires it.
    Demoting,
}

#[derive(Debug)]
pub(super) struct Entry {
    pub(super) id: u64,
    pub(super) extent: Extent,
    pub(super) payload_len: u64,
    /// The namespace it was written for: other namespaces never see it.
    pub(super) namespace: u128,
    pub(super) pins: u32,
    pub(super) state: EntryState,
    /// Puts of this key and leases of this copy (for the lower tier's admission filter).
    pub(super) accesses: u32,
}

impl Entry {
    /// Visible to lookups and readable under a pin.
    pub(super) fn visible(&self) -> bool {
        matches!(self.state, EntryState::Ready | EntryState::Demoting)
    }
}

/// Bytes of the object header in front of each payload.
pub(super) const HEADER: usize = OBJECT_HEADER_BYTES;

/// Bytes an object with `payload_len` payload bytes occupies in the arena.
pub fn object_extent_bytes(payload_len: u64) -> u64 {
    round_up_to_pages(HEADER as u64 + payload_len)
}

/// A generation that left the index while pinned; freed on its last unpin.
#[derive(Debug)]
pub(super) struct Doomed {
    pub(super) key: BlockKey,
    pub(super) extent: Extent,
    pub(super) payload_len: u64,
    pub(super) pins: u32,
    /// Failed verification (and was counted): later reads fail without reading or counting.
    pub(super) corrupt: bool,
}

#[derive(Default, Debug)]
pub(super) struct Counters {
    pub(super) stored: u64,
    pub(super) evictions: u64,
    pub(super) rejected: u64,
    pub(super) checksum_failures: u64,
}

pub(super) struct DramState {
    pub(super) allocator: ExtentAllocator,
    pub(super) policy: Box<dyn EvictionPolicy>,
    pub(super) index: KeyMap<Entry>,
    pub(super) doomed: HashMap<u64, Doomed>,
    pub(super) next_entry_id: u64,
    pub(super) writing: u64,
    pub(super) demoting: u64,
    pub(super) pinned_ready: u64,
    pub(super) counters: Counters,
}

/// Where a pinned entry lives, found under the lock.
pub(super) enum PinnedAt {
    Ready(Extent, u64),
    /// Doomed; `true` if it already failed verification.
    Doomed(Extent, u64, bool),
}

impl DramState {
    pub(super) fn new(allocator: ExtentAllocator, policy: Box<dyn EvictionPolicy>) -> Self {
        DramState {
            allocator,
            policy,
            index: key_map(),
            doomed: HashMap::new(),
            next_entry_id: 1,
            writing: 0,
            demoting: 0,
            pinned_ready: 0,
            counters: Counters::default(),
        }
    }

    pub(super) fn find_pinned(&self, entry: &EntryRef) -> Option<PinnedAt> {
        if let Some(e) = self.index.get(&entry.key).filter(|e| e.id == entry.entry_id) {
            return (e.pins > 0 && e.visible()).then_some(PinnedAt::Ready(e.extent, e.payload_len));
        }
        let d = self.doomed.get(&entry.entry_id).filter(|d| d.key == entry.key && d.pins > 0)?;
        Some(PinnedAt::Doomed(d.extent, d.payload_len, d.corrupt))
    }

    /// Allocates `bytes`, evicting unpinned ready blocks while that can help. Once the policy
    /// has no victim, `victims_left` turns false so the rest of the batch does not rescan.
    pub(super) fn allocate_evicting(
        &mut self,
        bytes: u64,
        victims_left: &mut bool,
        evicted: &mut usize,
    ) -> Option<Extent> {
        if bytes > self.allocator.capacity_bytes() {
            return None;
        }
        loop {
            if let Some(extent) = self.allocator.allocate(bytes) {
                return Some(extent);
            }
            if !*victims_left {
                return None;
            }
            let index = &self.index;
            let victim = self.policy.victim(&mut |key| {
                index.get(&key).is_some_and(|e| e.state == EntryState::Ready && e.pins == 0)
            });
            let Some(key) = victim else {
                *victims_left = false;
                return None;
            };
            let entry = self.index.remove(&key).expect("the policy tracks only indexed keys");
            assert!(entry.state == EntryState::Ready && entry.pins == 0, "policy chose a pinned victim");
            self.allocator.free(entry.extent);
            self.counters.evictions += 1;
            *evicted += 1;
        }
    }

    /// Retires the ready copies of `namespace` of `targets` (key, and the copy's entry id, or
    /// `None` for whichever copy is there): [`Tier::remove`](crate::tier::Tier::remove) and
    /// `remove_entries`. Returns how many.
    pub(super) fn remove_where(
        &mut self,
        namespace: u128,
        targets: impl Iterator<Item = (BlockKey, Option<u64>)>,
    ) -> usize {
        let mut removed = 0;
        for (key, id) in targets {
            let named = |e: &Entry| {
                e.state == EntryState::Ready && e.namespace == namespace && id.map_or(true, |id| id == e.id)
            };
            if self.index.get(&key).is_some_and(named) {
                self.retire(key, false);
                removed += 1;
            }
        }
        removed
    }

    /// Takes a visible entry out of the index: freed now if unpinned, else doomed until unpinned.
    /// `corrupt` marks it as having failed verification. A *demoting* entry (a read found it
    /// corrupt while a demotion writes it from its extent) is doomed with one more pin, the
    /// demotion's: its extent must not be freed and reused under that write; the demotion drops
    /// the pin when it finishes ([`Self::finish_demoting`]).
    pub(super) fn retire(&mut self, key: BlockKey, corrupt: bool) {
        let demoting = self.index.get(&key).is_some_and(|e| e.state == EntryState::Demoting);
        self.take_out(key, corrupt, u32::from(demoting));
    }

    /// Retires victim `entry_id` of `key` as its demotion finishes: out of the index (freed, or
    /// doomed while leases pin it), or, if a read retired it meanwhile, its doomed copy loses the
    /// demotion's pin. Returns whether it was still indexed (an eviction).
    pub(super) fn finish_demoting(&mut self, key: BlockKey, entry_id: u64) -> bool {
        if let Some(e) = self.index.get(&key).filter(|e| e.id == entry_id) {
            assert_eq!(e.state, EntryState::Demoting, "a demoting entry changed under its demotion");
            self.take_out(key, false, 0);
            return true;
        }
        // Retired by a read that found it corrupt, which left the demotion a pin of its own.
        self.unpin(&EntryRef { key, entry_id });
        false
    }

    /// Removes `key` from the index; its extent is freed unless it or `extra_pins` pin it.
    fn take_out(&mut self, key: BlockKey, corrupt: bool, extra_pins: u32) {
        let entry = self.index.remove(&key).expect("retiring an indexed key");
        assert!(entry.visible(), "retiring an entry still being written");
        if entry.state == EntryState::Demoting {
            self.demoting -= 1; // the policy forgot it when it was chosen
        } else {
            self.policy.on_remove(key);
        }
        if entry.pins > 0 {
            self.pinned_ready -= 1;
        }
        let pins = entry.pins + extra_pins;
        if pins == 0 {
            self.allocator.free(entry.extent);
        } else {
            let doomed = Doomed { key, extent: entry.extent, payload_len: entry.payload_len, pins, corrupt };
            assert!(self.doomed.insert(entry.id, doomed).is_none(), "entry id reused");
        }
    }

    /// Drops one pin of `entry`; a doomed entry is freed with its last pin.
    pub(super) fn unpin(&mut self, entry: &EntryRef) {
        if let Some(e) = self.index.get_mut(&entry.key).filter(|e| e.id == entry.entry_id) {
            assert!(e.pins > 0, "unpin of {entry:?}, which holds no pin");
            e.pins -= 1;
            if e.pins == 0 {
                self.pinned_ready -= 1;
            }
            return;
        }
        let d = self.doomed.get_mut(&entry.entry_id).filter(|d| d.key == entry.key);
        let d = d.unwrap_or_else(|| panic!("unpin of {entry:?}, which is not stored here"));
        assert!(d.pins > 0, "unpin of doomed {entry:?}, which holds no pin");
        d.pins -= 1;
        if d.pins == 0 {
            let extent = d.extent;
            self.doomed.remove(&entry.entry_id);
            self.allocator.free(extent);
        }
    }

    /// Verifies accounting, the policy's view and every ready object's header.
    pub(super) fn check(&self, arena: &Arena) -> Result<(), String> {
        self.allocator.check_integrity()?;
        self.policy.check_integrity().map_err(|d| format!("eviction policy: {d}"))?;
        let mut extents = Vec::with_capacity(self.index.len() + self.doomed.len());
        let (mut writing, mut demoting, mut ready, mut pinned) = (0u64, 0u64, 0usize, 0u64);
        for (&key, entry) in &self.index {
            extents.push(entry.extent);
            if entry.extent.len != object_extent_bytes(entry.payload_len) {
                return Err(format!(
                    "key {key:#x}: extent {:?} for {} payload bytes",
                    entry.extent, entry.payload_len
                ));
            }
            if entry.state == EntryState::Writing {
                writing += 1;
                if entry.pins > 0 || self.policy.contains(key) {
                    return Err(format!("writing key {key:#x} is pinned or evictable"));
                }
                continue;
            }
            pinned += u64::from(entry.pins > 0);
            if entry.state == EntryState::Demoting {
                demoting += 1;
                if self.policy.contains(key) {
                    return Err(format!("demoting key {key:#x} is still evictable"));
                }
            } else {
                ready += 1;
                if !self.policy.contains(key) {
                    return Err(format!("ready key {key:#x} is unknown to the eviction policy"));
                }
            }
            // SAFETY: ready headers are written once, before publication, and never again.
            let at = (entry.extent.offset + entry.payload_len) as usize;
            let header_bytes = unsafe { arena.bytes(at, HEADER) };
            let header = ObjectHeader::decode(header_bytes).map_err(|e| format!("key {key:#x}: {e}"))?;
            if header.key != key || header.payload_len != entry.payload_len {
                return Err(format!(
                    "index key {key:#x} ({} bytes) holds an object of key {:#x} ({} bytes)",
                    entry.payload_len, header.key, header.payload_len
                ));
            }
        }
        for (id, d) in &self.doomed {
            extents.push(d.extent);
            if d.pins == 0 {
                return Err(format!("doomed entry {id} holds no pin but was not freed"));
            }
        }
        if writing != self.writing
            || demoting != self.demoting
            || pinned != self.pinned_ready
            || ready != self.policy.len()
        {
            return Err(format!(
                "counts disagree: writing {writing} vs {}, demoting {demoting} vs {}, pinned {pinned} vs {}, \
                 ready {ready} vs policy {}",
                self.writing,
                self.demoting,
                self.pinned_ready,
                self.policy.len()
            ));
        }
        self.allocator.check_allocated(&mut extents)
    }
}
