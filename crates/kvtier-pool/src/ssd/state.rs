//! The SSD pool's state under its lock: the global lookup table (GLT: key → device, extent,
//! length, checksum), one extent allocator and one eviction policy per device, pins, and the
//! rules that move entries between *writing*, *ready* and *doomed* (as in the DRAM tier).

use std::collections::HashMap;

use kvtier_core::BlockKey;

use super::format::{Record, RECORD_DELETE, RECORD_PUT};
use super::recovery::object_pages;
use crate::eviction::EvictionPolicy;
use crate::extent::{Extent, ExtentAllocator, PAGE_BYTES};
use crate::hash::{key_map, KeyMap};
use crate::tier::EntryRef;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum EntryState {
    /// Space reserved, data being written: invisible, not evictable, no log record yet.
    Writing,
    /// Written and logged: visible; evictable when `pins == 0`.
    Ready,
}

#[derive(Clone, Copy, Debug)]
pub(super) struct Entry {
    pub id: u64,
    pub device: u16,
    pub extent: Extent,
    pub payload_len: u64,
    pub checksum: u64,
    pub namespace: u128,
    pub pins: u32,
    pub state: EntryState,
    /// Sequence number of its `Put` record (0 while writing).
    pub seq: u64,
}

impl Entry {
    pub fn record(&self, kind: u8, key: BlockKey) -> Record {
        Record {
            kind,
            device: self.device,
            pages: (self.extent.len / PAGE_BYTES) as u32,
            seq: self.seq,
            key,
            offset: self.extent.offset,
            payload_len: self.payload_len,
            payload_checksum: self.checksum,
            namespace: self.namespace,
        }
    }
}

/// A generation that left the table while pinned; its extent is freed on its last unpin.
#[derive(Debug)]
pub(super) struct Doomed {
    pub key: BlockKey,
    pub entry: Entry,
    pub corrupt: bool,
}

#[derive(Default, Debug, Clone, Copy)]
pub(super) struct Counters {
    pub stored: u64,
    pub evictions: u64,
    pub rejected: u64,
    pub checksum_failures: u64,
    pub lookup_hits: u64,
    pub lookup_misses: u64,
    pub write_failures: u64,
    pub read_io_errors: u64,
    pub log_failures: u64,
    pub compactions: u64,
}

pub(super) struct DeviceSpace {
    pub allocator: ExtentAllocator,
    pub policy: Box<dyn EvictionPolicy>,
}

pub(super) struct SsdState {
    pub spaces: Vec<DeviceSpace>,
    pub index: KeyMap<Entry>,
    pub doomed: HashMap<u64, Doomed>,
    pub next_entry_id: u64,
    pub writing: u64,
    pub pinned_ready: u64,
    pub counters: Counters,
    /// Round-robin placement: the device the next batch starts at.
    pub rr_cursor: usize,
}

/// Where a pinned entry is, found under the lock.
pub(super) enum PinnedAt {
    Readable(Entry),
    /// Doomed and already found corrupt.
    KnownCorrupt,
}

impl SsdState {
    pub fn new(spaces: Vec<DeviceSpace>) -> Self {
        SsdState {
            spaces,
            index: key_map(),
            doomed: HashMap::new(),
            next_entry_id: 1,
            writing: 0,
            pinned_ready: 0,
            counters: Counters::default(),
            rr_cursor: 0,
        }
    }

    pub fn used_bytes(&self) -> u64 {
        self.spaces.iter().map(|s| s.allocator.used_bytes()).sum()
    }
    pub fn capacity_bytes(&self) -> u64 {
        self.spaces.iter().map(|s| s.allocator.capacity_bytes()).sum()
    }

    /// Adds a recovered, logged object as ready. False if its extent is not free (a bug in
    /// recovery, which removes overlaps).
    pub fn restore(&mut self, r: &Record) -> bool {
        let extent = Extent { offset: r.offset, len: u64::from(r.pages) * PAGE_BYTES };
        let space = &mut self.spaces[usize::from(r.device)];
        if self.index.contains_key(&r.key) || !space.allocator.allocate_at(extent) {
            return false;
        }
        space.policy.on_insert(r.key);
        let id = self.next_entry_id;
        self.next_entry_id += 1;
        let entry = Entry {
            id,
            device: r.device,
            extent,
            payload_len: r.payload_len,
            checksum: r.payload_checksum,
            namespace: r.namespace,
            pins: 0,
            state: EntryState::Ready,
            seq: r.seq,
        };
        self.index.insert(r.key, entry);
        true
    }

    pub fn find_pinned(&self, entry: &EntryRef) -> Option<PinnedAt> {
        if let Some(e) = self.index.get(&entry.key).filter(|e| e.id == entry.entry_id) {
            return (e.pins > 0 && e.state == EntryState::Ready).then_some(PinnedAt::Readable(*e));
        }
        let d = self.doomed.get(&entry.entry_id).filter(|d| d.key == entry.key && d.entry.pins > 0)?;
        Some(if d.corrupt { PinnedAt::KnownCorrupt } else { PinnedAt::Readable(d.entry) })
    }

    /// Allocates `bytes` on `device`, evicting its unpinned ready objects until it fits;
    /// evicted objects' `Delete` records go to `deletes`. If it cannot fit even with every
    /// evictable object gone (pinned or writing objects split the free space), nothing is
    /// evicted: the victims taken so far are put back as they were (nothing was written over
    /// them, and no record of their eviction was made yet).
    pub fn allocate_on(&mut self, device: usize, bytes: u64, deletes: &mut Vec<Record>) -> Option<Extent> {
        if bytes > self.spaces[device].allocator.capacity_bytes() {
            return None;
        }
        let mut victims: Vec<(BlockKey, Entry)> = Vec::new();
        loop {
            if let Some(extent) = self.spaces[device].allocator.allocate(bytes) {
                self.counters.evictions += victims.len() as u64;
                deletes.extend(victims.iter().map(|(key, entry)| entry.record(RECORD_DELETE, *key)));
                return Some(extent);
            }
            let index = &self.index;
            let Some(victim) = self.spaces[device].policy.victim(&mut |key| {
                index.get(&key).is_some_and(|e| e.state == EntryState::Ready && e.pins == 0)
            }) else {
                self.give_back(device, victims);
                return None;
            };
            let entry = self.index.remove(&victim).expect("the policy tracks only indexed keys");
            assert!(entry.state == EntryState::Ready && entry.pins == 0, "policy chose a pinned victim");
            assert_eq!(usize::from(entry.device), device, "a device's policy tracks only its objects");
            self.spaces[device].allocator.free(entry.extent);
            victims.push((victim, entry));
        }
    }

    /// Puts back, oldest first, the victims of an allocation on `device` that failed.
    fn give_back(&mut self, device: usize, victims: Vec<(BlockKey, Entry)>) {
        let space = &mut self.spaces[device];
        for (key, entry) in victims {
            assert!(space.allocator.allocate_at(entry.extent), "a victim's extent was taken meanwhile");
            space.policy.on_insert(key);
            assert!(self.index.insert(key, entry).is_none(), "a victim's key was indexed meanwhile");
        }
    }

    /// Allocates on `preferred`, else on the other devices in `fallback` order.
    pub fn allocate(
        &mut self,
        preferred: usize,
        fallback: &[usize],
        bytes: u64,
        deletes: &mut Vec<Record>,
    ) -> Option<(usize, Extent)> {
        std::iter::once(preferred)
            .chain(fallback.iter().copied().filter(|&d| d != preferred))
            .find_map(|device| self.allocate_on(device, bytes, deletes).map(|e| (device, e)))
    }

    /// Inserts a writing entry for `key` (its checksum is set on publication).
    pub fn insert_writing(
        &mut self,
        key: BlockKey,
        namespace: u128,
        device: usize,
        extent: Extent,
        payload_len: u64,
    ) -> u64 {
        let id = self.next_entry_id;
        self.next_entry_id += 1;
        let device = u16::try_from(device).expect("device index fits u16");
        let entry = Entry {
            id,
            device,
            extent,
            payload_len,
            checksum: 0,
            namespace,
            pins: 0,
            state: EntryState::Writing,
            seq: 0,
        };
        assert!(self.index.insert(key, entry).is_none(), "key {key:#x} was already indexed");
        self.writing += 1;
        id
    }

    /// Drops a writing entry whose write or log record failed, freeing its extent.
    pub fn abandon(&mut self, key: BlockKey) {
        let entry = self.index.remove(&key).expect("abandoning an indexed key");
        assert_eq!(entry.state, EntryState::Writing, "abandoning an entry that was published");
        self.spaces[usize::from(entry.device)].allocator.free(entry.extent);
        self.writing -= 1;
    }

    /// Makes a written, logged entry visible.
    pub fn publish(&mut self, key: BlockKey, checksum: u64, seq: u64) {
        let entry = self.index.get_mut(&key).expect("publishing an indexed key");
        assert_eq!(entry.state, EntryState::Writing, "publishing twice");
        (entry.state, entry.checksum, entry.seq) = (EntryState::Ready, checksum, seq);
        self.spaces[usize::from(entry.device)].policy.on_insert(key);
        self.writing -= 1;
        self.counters.stored += 1;
    }

    /// Takes a ready entry out of the table (freed now if unpinned, else doomed until its last
    /// unpin); returns its `Delete` record.
    pub fn retire(&mut self, key: BlockKey, corrupt: bool) -> Record {
        let entry = self.index.remove(&key).expect("retiring an indexed key");
        assert_eq!(entry.state, EntryState::Ready, "retiring an entry still being written");
        let space = &mut self.spaces[usize::from(entry.device)];
        space.policy.on_remove(key);
        if entry.pins == 0 {
            space.allocator.free(entry.extent);
        } else {
            self.pinned_ready -= 1;
            assert!(
                self.doomed.insert(entry.id, Doomed { key, entry, corrupt }).is_none(),
                "entry id reused"
            );
        }
        entry.record(RECORD_DELETE, key)
    }

    pub fn unpin(&mut self, entry: &EntryRef) {
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
        assert!(d.entry.pins > 0, "unpin of doomed {entry:?}, which holds no pin");
        d.entry.pins -= 1;
        if d.entry.pins == 0 {
            let d = self.doomed.remove(&entry.entry_id).expect("just seen");
            self.spaces[usize::from(d.entry.device)].allocator.free(d.entry.extent);
        }
    }

    /// `Put` records of every ready entry, oldest first (the compacted log).
    pub fn live_records(&self) -> Vec<Record> {
        let mut out: Vec<Record> = self
            .index
            .iter()
            .filter(|(_, e)| e.state == EntryState::Ready)
            .map(|(&key, e)| e.record(RECORD_PUT, key))
            .collect();
        out.sort_unstable_by_key(|r| r.seq);
        out
    }

    /// Verifies accounting, the policies' view and extents; returns the ready entries for the
    /// caller to check on disk.
    pub fn check(&self) -> Result<Vec<(BlockKey, Entry)>, String> {
        let mut extents: Vec<Vec<Extent>> = vec![Vec::new(); self.spaces.len()];
        let (mut writing, mut pinned) = (0u64, 0u64);
        let mut ready = Vec::new();
        let mut tracked = vec![0usize; self.spaces.len()];
        for (&key, e) in &self.index {
            let device = usize::from(e.device);
            if device >= self.spaces.len() {
                return Err(format!("key {key:#x} on device {device} of {}", self.spaces.len()));
            }
            extents[device].push(e.extent);
            if object_pages(e.payload_len).map(|p| p * PAGE_BYTES) != Some(e.extent.len) {
                return Err(format!(
                    "key {key:#x}: extent {:?} for {} payload bytes",
                    e.extent, e.payload_len
                ));
            }
            let in_policy = self.spaces[device].policy.contains(key);
            if e.state == EntryState::Writing {
                writing += 1;
                if e.pins > 0 || in_policy {
                    return Err(format!("writing key {key:#x} is pinned or evictable"));
                }
                continue;
            }
            tracked[device] += 1;
            pinned += u64::from(e.pins > 0);
            if !in_policy {
                return Err(format!("ready key {key:#x} is unknown to device {device}'s eviction policy"));
            }
            ready.push((key, *e));
        }
        for (id, d) in &self.doomed {
            extents[usize::from(d.entry.device)].push(d.entry.extent);
            if d.entry.pins == 0 {
                return Err(format!("doomed entry {id} holds no pin but was not freed"));
            }
        }
        if writing != self.writing || pinned != self.pinned_ready {
            return Err(format!(
                "counts disagree: writing {writing} vs {}, pinned {pinned} vs {}",
                self.writing, self.pinned_ready
            ));
        }
        for (device, space) in self.spaces.iter().enumerate() {
            space.policy.check_integrity().map_err(|d| format!("device {device} eviction policy: {d}"))?;
            if space.policy.len() != tracked[device] {
                return Err(format!(
                    "device {device}: policy tracks {} of {} ready objects",
                    space.policy.len(),
                    tracked[device]
                ));
            }
            space
                .allocator
                .check_allocated(&mut extents[device])
                .map_err(|d| format!("device {device}: {d}"))?;
        }
        Ok(ready)
    }
}
