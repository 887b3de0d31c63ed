//! Page-aligned I/O buffers (O_DIRECT needs aligned memory, offsets and lengths), carved from
//! the same page-aligned [`Arena`] the DRAM tier uses: one anonymous mapping per buffer, sized
//! once and reused, never a per-operation allocation.

use crate::arena::Arena;
use crate::error::PoolError;
use crate::extent::round_up_to_pages;

/// An owned, page-aligned, zero-initialised byte buffer of whole pages.
#[derive(Debug)]
pub struct AlignedBuf {
    arena: Arena,
    len: usize,
}

impl AlignedBuf {
    /// A buffer of at least `len` bytes (rounded up to whole pages, at least one page).
    pub fn new(len: usize) -> Result<Self, PoolError> {
        let len = round_up_to_pages(len.max(1) as u64);
        let arena = Arena::new(len)?;
        let len = arena.len_bytes();
        Ok(AlignedBuf { arena, len })
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: the buffer is owned; writes need `&mut self`, so none overlaps this borrow.
        unsafe { self.arena.bytes(0, self.len) }
    }

    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: `&mut self` is the only access to the owned buffer.
        unsafe { self.arena.bytes_mut(0, self.len) }
    }

    /// Base address, for handing to the kernel (the caller keeps the buffer alive and untouched
    /// until the I/O completes).
    pub fn as_mut_ptr(&mut self) -> *mut u8 {
        self.as_mut_slice().as_mut_ptr()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn aligned_and_rounded() {
        let mut b = AlignedBuf::new(5000).unwrap();
        assert_eq!(b.len(), 8192);
        assert_eq!(b.as_mut_ptr() as usize % 4096, 0);
        b.as_mut_slice()[8191] = 3;
        assert_eq!(b.as_slice()[8191], 3);
    }
}
