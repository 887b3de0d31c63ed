//! A page-aligned host arena of bounded capacity: one anonymous `mmap`, never grown, never
//! split into per-object allocations.
//!
//! Pages are mapped lazily by the kernel (first touch), asked for as transparent huge pages
//! where the kernel allows (fewer faults, fewer TLB misses on 2 MiB objects). The same buffers
//! will later serve O_DIRECT I/O and pinned-memory DMA, both of which need page alignment.
//!
//! The arena hands out raw byte ranges; it does not know who owns them. Its owner (a tier)
//! guarantees through its index and extent allocator that a range being written is never read
//! or written by anyone else, which is what makes the `unsafe` accessors sound.

use std::ptr::NonNull;

use crate::error::PoolError;
use crate::extent::PAGE_BYTES;

/// Bounded, page-aligned host memory.
pub struct Arena {
    base: NonNull<u8>,
    len_bytes: usize,
}

// SAFETY: the arena is plain memory; synchronising access to its ranges is the owner's duty
// (see the module docs), exactly as for a `&[UnsafeCell<u8>]`.
unsafe impl Send for Arena {}
unsafe impl Sync for Arena {}

impl Arena {
    /// Reserves `capacity_bytes` rounded up to whole pages.
    pub fn new(capacity_bytes: u64) -> Result<Self, PoolError> {
        if capacity_bytes == 0 {
            return Err(PoolError::CapacityTooSmall { bytes: 0, page: PAGE_BYTES });
        }
        let reserve_error = |reason: String| PoolError::ArenaReserve { bytes: capacity_bytes, reason };
        let len_bytes = usize::try_from(capacity_bytes.div_ceil(PAGE_BYTES) * PAGE_BYTES)
            .map_err(|_| reserve_error("larger than the address space".into()))?;
        // SAFETY: an anonymous private mapping with no address hint has no preconditions.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len_bytes,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(reserve_error(std::io::Error::last_os_error().to_string()));
        }
        // Advice only: failure (no THP support) leaves ordinary pages, which work the same.
        // SAFETY: the range is the mapping just created.
        unsafe {
            libc::madvise(ptr, len_bytes, libc::MADV_HUGEPAGE);
        }
        let base =
            NonNull::new(ptr.cast::<u8>()).ok_or_else(|| reserve_error("mmap returned null".into()))?;
        assert_eq!(base.as_ptr() as usize % PAGE_BYTES as usize, 0, "mmap returned an unaligned address");
        Ok(Arena { base, len_bytes })
    }

    /// Bytes reserved (capacity rounded up to whole pages).
    pub fn len_bytes(&self) -> usize {
        self.len_bytes
    }

    fn check_range(&self, offset: usize, len: usize) {
        assert!(
            offset.checked_add(len).is_some_and(|end| end <= self.len_bytes),
            "arena range {offset}+{len} outside {} bytes",
            self.len_bytes
        );
    }

    /// Bytes `offset..offset + len`.
    ///
    /// # Safety
    /// No one may write this range while the returned slice lives.
    pub unsafe fn bytes(&self, offset: usize, len: usize) -> &[u8] {
        self.check_range(offset, len);
        // SAFETY: in bounds (checked); exclusivity of writers is the caller's promise.
        unsafe { std::slice::from_raw_parts(self.base.as_ptr().add(offset), len) }
    }

    /// Bytes `offset..offset + len`, writable.
    ///
    /// # Safety
    /// No one else may read or write this range while the returned slice lives.
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn bytes_mut(&self, offset: usize, len: usize) -> &mut [u8] {
        self.check_range(offset, len);
        // SAFETY: in bounds (checked); exclusivity is the caller's promise.
        unsafe { std::slice::from_raw_parts_mut(self.base.as_ptr().add(offset), len) }
    }

    /// Faults in (and zero-fills) `offset..offset + len` now, without changing any byte, so
    /// later copies into it run at memory speed. Safe to run while the range is in use. Returns
    /// false where the kernel lacks `MADV_POPULATE_WRITE` (before Linux 5.14): pages then fault
    /// in on first use, as without prefaulting.
    pub fn prefault(&self, offset: usize, len: usize) -> bool {
        self.check_range(offset, len);
        let page = PAGE_BYTES as usize;
        let start = offset / page * page;
        let end = (offset + len).div_ceil(page) * page;
        // SAFETY: a page-aligned range inside the mapping; populating does not change contents.
        let rc = unsafe {
            libc::madvise(self.base.as_ptr().add(start).cast(), end - start, libc::MADV_POPULATE_WRITE)
        };
        rc == 0
    }

    /// Flips bit `bit` of the byte at `offset` (fault injection for tests).
    ///
    /// # Safety
    /// No one else may read or write that byte during the call (a plain write: a concurrent
    /// reader copying the range would be a data race).
    pub unsafe fn flip_bit(&self, offset: usize, bit: u32) {
        // SAFETY: exclusivity is the caller's promise; `bytes_mut` checks the bounds.
        let byte = unsafe { self.bytes_mut(offset, 1) };
        byte[0] ^= 1 << (bit % 8);
    }
}

impl Drop for Arena {
    fn drop(&mut self) {
        // SAFETY: unmapping exactly the mapping created in `new`; no borrows outlive `self`.
        let rc = unsafe { libc::munmap(self.base.as_ptr().cast(), self.len_bytes) };
        debug_assert_eq!(rc, 0, "munmap failed: {}", std::io::Error::last_os_error());
    }
}

impl std::fmt::Debug for Arena {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Arena").field("len_bytes", &self.len_bytes).finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn aligned_zeroed_and_writable() {
        let arena = Arena::new(3 * PAGE_BYTES + 1).unwrap();
        assert_eq!(arena.len_bytes(), 4 * PAGE_BYTES as usize);
        // SAFETY: single-threaded test, no other borrows.
        unsafe {
            assert!(arena.bytes(0, arena.len_bytes()).iter().all(|&b| b == 0));
            arena.bytes_mut(PAGE_BYTES as usize, 3).copy_from_slice(&[1, 2, 3]);
        }
        // SAFETY: as above.
        unsafe { arena.flip_bit(PAGE_BYTES as usize, 7) };
        arena.prefault(0, arena.len_bytes());
        // SAFETY: as above.
        assert_eq!(unsafe { arena.bytes(PAGE_BYTES as usize, 3) }, &[0x81, 2, 3]);
    }

    #[test]
    fn zero_capacity_is_an_error() {
        assert!(matches!(Arena::new(0), Err(PoolError::CapacityTooSmall { .. })));
    }

    #[test]
    #[should_panic(expected = "outside")]
    fn out_of_range_panics() {
        let arena = Arena::new(PAGE_BYTES).unwrap();
        // SAFETY: never reached past the bounds check.
        let _ = unsafe { arena.bytes(PAGE_BYTES as usize - 1, 2) };
    }
}
