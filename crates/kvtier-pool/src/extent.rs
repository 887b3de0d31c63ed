//! Extent allocator over a byte range, in whole 4 KiB pages, best-fit in O(log n).
//!
//! Free space is two ordered maps kept in step: offset → length (to coalesce neighbours on free)
//! and (length, offset) (to find the smallest free extent that fits). The allocator does not
//! remember live extents — their owner (a tier's index) does, and hands them back on free.
//!
//! Invariants (checked by [`ExtentAllocator::check_integrity`]):
//! - every free extent is page-aligned, non-empty, inside `0..capacity_bytes`;
//! - free extents never overlap or touch (neighbours are always coalesced);
//! - `used_bytes + Σ free lengths == capacity_bytes`, so `used_bytes <= capacity_bytes` always.
//!
//! A double free or a free of bytes never allocated overlaps a free extent and panics: that is
//! a bug in the owner, and continuing would hand the same bytes to two objects.

use std::collections::{BTreeMap, BTreeSet};

/// Allocation unit, in bytes. Page-aligned extents serve O_DIRECT and pinned DMA unchanged.
pub const PAGE_BYTES: u64 = 4096;

/// `bytes` rounded up to whole pages.
pub fn round_up_to_pages(bytes: u64) -> u64 {
    bytes.div_ceil(PAGE_BYTES) * PAGE_BYTES
}

/// A run of whole pages: `offset` and `len` are byte counts, both multiples of [`PAGE_BYTES`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Extent {
    pub offset: u64,
    pub len: u64,
}

impl Extent {
    pub fn end(&self) -> u64 {
        self.offset + self.len
    }
}

/// Best-fit page allocator over `0..capacity_bytes`.
#[derive(Debug)]
pub struct ExtentAllocator {
    capacity_bytes: u64,
    used_bytes: u64,
    live_extents: u64,
    free_by_offset: BTreeMap<u64, u64>,
    free_by_len: BTreeSet<(u64, u64)>,
}

impl ExtentAllocator {
    /// An allocator over `capacity_bytes` rounded down to whole pages.
    pub fn new(capacity_bytes: u64) -> Self {
        let capacity_bytes = capacity_bytes / PAGE_BYTES * PAGE_BYTES;
        let mut allocator = ExtentAllocator {
            capacity_bytes,
            used_bytes: 0,
            live_extents: 0,
            free_by_offset: BTreeMap::new(),
            free_by_len: BTreeSet::new(),
        };
        if capacity_bytes > 0 {
            allocator.insert_free(0, capacity_bytes);
        }
        allocator
    }

    pub fn capacity_bytes(&self) -> u64 {
        self.capacity_bytes
    }
    pub fn used_bytes(&self) -> u64 {
        self.used_bytes
    }
    pub fn free_bytes(&self) -> u64 {
        self.capacity_bytes - self.used_bytes
    }
    /// Extents handed out and not yet freed.
    pub fn live_extents(&self) -> u64 {
        self.live_extents
    }
    /// Free extents (a measure of fragmentation).
    pub fn free_extents(&self) -> usize {
        self.free_by_offset.len()
    }

    /// Whether `bytes` (rounded up to pages) would fit now, without allocating.
    pub fn can_allocate(&self, bytes: u64) -> bool {
        let len = round_up_to_pages(bytes.max(1));
        self.free_by_len.last().is_some_and(|&(free_len, _)| free_len >= len)
    }

    /// The smallest free extent that holds `bytes` (rounded up to pages), lowest offset first.
    pub fn allocate(&mut self, bytes: u64) -> Option<Extent> {
        assert!(bytes > 0, "allocating 0 bytes");
        let len = round_up_to_pages(bytes);
        let &(free_len, offset) = self.free_by_len.range((len, 0)..).next()?;
        self.remove_free(offset, free_len);
        if free_len > len {
            self.insert_free(offset + len, free_len - len);
        }
        self.used_bytes += len;
        self.live_extents += 1;
        assert!(self.used_bytes <= self.capacity_bytes, "allocator handed out more than its capacity");
        Some(Extent { offset, len })
    }

    /// Allocates exactly `extent` (page-aligned, inside the capacity) if every byte of it is
    /// free: how a pool rebuilds its allocator from an index on restart. False, changing nothing,
    /// if any byte of it is already allocated.
    pub fn allocate_at(&mut self, extent: Extent) -> bool {
        assert!(
            extent.len > 0 && extent.offset % PAGE_BYTES == 0 && extent.len % PAGE_BYTES == 0,
            "allocating a malformed extent {extent:?}"
        );
        if extent.end() > self.capacity_bytes {
            return false;
        }
        let Some((&free_offset, &free_len)) = self.free_by_offset.range(..=extent.offset).next_back() else {
            return false;
        };
        if free_offset + free_len < extent.end() {
            return false;
        }
        self.remove_free(free_offset, free_len);
        if free_offset < extent.offset {
            self.insert_free(free_offset, extent.offset - free_offset);
        }
        if extent.end() < free_offset + free_len {
            self.insert_free(extent.end(), free_offset + free_len - extent.end());
        }
        self.used_bytes += extent.len;
        self.live_extents += 1;
        true
    }

    /// The largest free extent's length in bytes (0 when full).
    pub fn largest_free_bytes(&self) -> u64 {
        self.free_by_len.last().map_or(0, |&(len, _)| len)
    }

    /// Returns `extent` (exactly as allocated) to the free space, merging it with its neighbours.
    pub fn free(&mut self, extent: Extent) {
        assert!(
            extent.len > 0 && extent.offset % PAGE_BYTES == 0 && extent.len % PAGE_BYTES == 0,
            "freeing a malformed extent {extent:?}"
        );
        assert!(
            extent.end() <= self.capacity_bytes,
            "freeing {extent:?} beyond capacity {}",
            self.capacity_bytes
        );
        assert!(self.used_bytes >= extent.len && self.live_extents > 0, "freeing more than is allocated");
        let mut offset = extent.offset;
        let mut len = extent.len;
        if let Some((&prev_offset, &prev_len)) = self.free_by_offset.range(..offset).next_back() {
            assert!(prev_offset + prev_len <= offset, "double free: {extent:?} overlaps free space");
            if prev_offset + prev_len == offset {
                self.remove_free(prev_offset, prev_len);
                offset = prev_offset;
                len += prev_len;
            }
        }
        if let Some((&next_offset, &next_len)) = self.free_by_offset.range(extent.offset..).next() {
            assert!(next_offset >= extent.end(), "double free: {extent:?} overlaps free space");
            if next_offset == extent.end() {
                self.remove_free(next_offset, next_len);
                len += next_len;
            }
        }
        self.insert_free(offset, len);
        self.used_bytes -= extent.len;
        self.live_extents -= 1;
    }

    fn insert_free(&mut self, offset: u64, len: u64) {
        let fresh = self.free_by_offset.insert(offset, len).is_none();
        assert!(fresh && self.free_by_len.insert((len, offset)), "free maps out of step at {offset}");
    }

    fn remove_free(&mut self, offset: u64, len: u64) {
        let by_offset = self.free_by_offset.remove(&offset);
        assert!(by_offset == Some(len) && self.free_by_len.remove(&(len, offset)), "free maps out of step");
    }

    /// Checks the free maps against each other and the accounting identity.
    pub fn check_integrity(&self) -> Result<(), String> {
        if self.free_by_offset.len() != self.free_by_len.len() {
            return Err(format!(
                "free maps disagree: {} by offset, {} by length",
                self.free_by_offset.len(),
                self.free_by_len.len()
            ));
        }
        let mut free_total = 0u64;
        let mut previous_end: Option<u64> = None;
        for (&offset, &len) in &self.free_by_offset {
            if len == 0 || offset % PAGE_BYTES != 0 || len % PAGE_BYTES != 0 {
                return Err(format!("malformed free extent {offset}+{len}"));
            }
            if offset + len > self.capacity_bytes {
                return Err(format!("free extent {offset}+{len} beyond capacity {}", self.capacity_bytes));
            }
            if let Some(end) = previous_end {
                if offset <= end {
                    return Err(format!(
                        "free extent at {offset} overlaps or touches the one ending at {end}"
                    ));
                }
            }
            if !self.free_by_len.contains(&(len, offset)) {
                return Err(format!("free extent {offset}+{len} missing from the length index"));
            }
            free_total += len;
            previous_end = Some(offset + len);
        }
        if self.used_bytes + free_total != self.capacity_bytes {
            return Err(format!(
                "used {} + free {free_total} != capacity {}",
                self.used_bytes, self.capacity_bytes
            ));
        }
        Ok(())
    }

    /// Checks that `allocated` (the owner's live extents) and the free space tile the range
    /// exactly: no overlap, no gap, and `used_bytes` equals their total.
    pub fn check_allocated(&self, allocated: &mut [Extent]) -> Result<(), String> {
        self.check_integrity()?;
        if allocated.len() as u64 != self.live_extents {
            return Err(format!(
                "owner holds {} extents; allocator counts {}",
                allocated.len(),
                self.live_extents
            ));
        }
        allocated.sort_unstable();
        let mut all: Vec<(Extent, bool)> = allocated.iter().map(|&e| (e, true)).collect();
        all.extend(self.free_by_offset.iter().map(|(&offset, &len)| (Extent { offset, len }, false)));
        all.sort_unstable();
        let mut cursor = 0u64;
        let mut used = 0u64;
        for (extent, is_live) in all {
            if extent.offset != cursor {
                let what = if extent.offset < cursor { "overlap" } else { "gap" };
                return Err(format!("{what} at byte {cursor}: next extent is {extent:?}"));
            }
            cursor = extent.end();
            if is_live {
                used += extent.len;
            }
        }
        if cursor != self.capacity_bytes || used != self.used_bytes {
            return Err(format!(
                "extents cover {cursor} of {} bytes; live extents total {used}, allocator says {}",
                self.capacity_bytes, self.used_bytes
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn best_fit_and_coalescing() {
        let mut a = ExtentAllocator::new(10 * PAGE_BYTES + 100);
        assert_eq!(a.capacity_bytes(), 10 * PAGE_BYTES, "capacity rounds down to pages");
        let x = a.allocate(1).unwrap();
        let y = a.allocate(PAGE_BYTES + 1).unwrap();
        let z = a.allocate(PAGE_BYTES).unwrap();
        assert_eq!((x.len, y.len, z.len), (PAGE_BYTES, 2 * PAGE_BYTES, PAGE_BYTES));
        a.free(x);
        // A one-page request takes the one-page hole, not the big tail.
        assert_eq!(a.allocate(PAGE_BYTES).unwrap(), x);
        a.free(x);
        a.free(y);
        assert_eq!(a.free_extents(), 2, "x and y merged; the tail stays separate");
        a.free(z);
        assert_eq!(a.free_extents(), 1);
        assert_eq!(a.used_bytes(), 0);
        a.check_allocated(&mut []).unwrap();
    }

    #[test]
    fn allocate_at_takes_exactly_free_bytes() {
        let mut a = ExtentAllocator::new(8 * PAGE_BYTES);
        let mid = Extent { offset: 2 * PAGE_BYTES, len: 3 * PAGE_BYTES };
        assert!(a.allocate_at(mid));
        assert!(!a.allocate_at(Extent { offset: 4 * PAGE_BYTES, len: PAGE_BYTES }), "overlaps mid");
        assert!(!a.allocate_at(Extent { offset: 7 * PAGE_BYTES, len: 2 * PAGE_BYTES }), "past the end");
        assert!(a.allocate_at(Extent { offset: 0, len: PAGE_BYTES }));
        assert_eq!((a.used_bytes(), a.free_extents()), (4 * PAGE_BYTES, 2));
        assert_eq!(a.largest_free_bytes(), 3 * PAGE_BYTES);
        a.check_allocated(&mut [mid, Extent { offset: 0, len: PAGE_BYTES }]).unwrap();
        a.free(mid);
        assert_eq!(a.largest_free_bytes(), 7 * PAGE_BYTES, "freed mid merges with pages 1 and 5..8");
    }

    #[test]
    fn full_means_none() {
        let mut a = ExtentAllocator::new(2 * PAGE_BYTES);
        assert!(a.allocate(3 * PAGE_BYTES).is_none());
        let e = a.allocate(2 * PAGE_BYTES).unwrap();
        assert!(!a.can_allocate(1) && a.allocate(1).is_none());
        a.free(e);
        assert!(a.can_allocate(2 * PAGE_BYTES));
    }

    #[test]
    #[should_panic(expected = "double free")]
    fn double_free_panics() {
        let mut a = ExtentAllocator::new(4 * PAGE_BYTES);
        let e = a.allocate(PAGE_BYTES).unwrap();
        let _keep = a.allocate(PAGE_BYTES).unwrap();
        a.free(e);
        a.free(e);
    }

    #[test]
    fn check_allocated_finds_a_lost_extent() {
        let mut a = ExtentAllocator::new(4 * PAGE_BYTES);
        let e = a.allocate(PAGE_BYTES).unwrap();
        let f = a.allocate(PAGE_BYTES).unwrap();
        assert!(a.check_allocated(&mut [e]).is_err());
        a.check_allocated(&mut [f, e]).unwrap();
        assert!(a.check_allocated(&mut [e, e]).is_err());
    }

    proptest! {
        #[test]
        fn random_alloc_free_keeps_accounting(ops in proptest::collection::vec((any::<bool>(), 1u64..5 * PAGE_BYTES, any::<prop::sample::Index>()), 1..200)) {
            let mut a = ExtentAllocator::new(64 * PAGE_BYTES);
            let mut live: Vec<Extent> = Vec::new();
            for (alloc, bytes, pick) in ops {
                if alloc || live.is_empty() {
                    if let Some(e) = a.allocate(bytes) {
                        prop_assert!(e.len >= bytes && e.len < bytes + PAGE_BYTES);
                        live.push(e);
                    } else {
                        prop_assert!(!a.can_allocate(bytes));
                    }
                } else {
                    let e = live.swap_remove(pick.index(live.len()));
                    a.free(e);
                }
                prop_assert!(a.used_bytes() <= a.capacity_bytes());
                let mut snapshot = live.clone();
                prop_assert_eq!(a.check_allocated(&mut snapshot), Ok(()));
            }
        }
    }
}
