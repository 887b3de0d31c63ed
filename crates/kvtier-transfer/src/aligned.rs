//! Page-aligned, pre-faulted stage buffers. Aligned to 4 KiB so the SSD tier can read whole-page
//! objects straight into them with O_DIRECT (no staging copy); faulted in at allocation so the
//! first chunk does not pay for page faults on the hot path.

use std::alloc::{alloc_zeroed, dealloc, handle_alloc_error, Layout};
use std::ptr::NonNull;

pub(crate) const PAGE_BYTES: usize = 4096;

pub(crate) struct AlignedBuf {
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: an owned allocation, like a Vec<u8>.
unsafe impl Send for AlignedBuf {}
unsafe impl Sync for AlignedBuf {}

impl AlignedBuf {
    /// `len` zero bytes (possibly 0), pages mapped on first use (the `allocate_per_chunk`
    /// baseline: what a fresh allocation costs).
    pub fn fresh(len: usize) -> Self {
        if len == 0 {
            return AlignedBuf { ptr: NonNull::dangling(), len: 0 };
        }
        let layout = Layout::from_size_align(len, PAGE_BYTES).expect("stage buffer size");
        // SAFETY: non-zero size.
        let ptr = unsafe { alloc_zeroed(layout) };
        let Some(ptr) = NonNull::new(ptr) else { handle_alloc_error(layout) };
        AlignedBuf { ptr, len }
    }

    /// `len` zero bytes (possibly 0), every page touched.
    pub fn prefaulted(len: usize) -> Self {
        let buf = Self::fresh(len);
        for i in (0..len).step_by(PAGE_BYTES) {
            // SAFETY: in bounds. Volatile, so the page is really touched (zeroed pages are
            // otherwise mapped on first use).
            unsafe { std::ptr::write_volatile(buf.ptr.as_ptr().add(i), 0) };
        }
        buf
    }

    pub fn as_mut_ptr(&mut self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: `len` initialised bytes owned by self.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        if self.len > 0 {
            // SAFETY: allocated in `prefaulted` with this layout.
            unsafe { dealloc(self.ptr.as_ptr(), Layout::from_size_align_unchecked(self.len, PAGE_BYTES)) };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn aligned_and_zeroed() {
        let mut b = AlignedBuf::prefaulted(3 * PAGE_BYTES + 5);
        assert_eq!(b.as_mut_ptr() as usize % PAGE_BYTES, 0);
        assert!(b.as_mut_slice().iter().all(|&x| x == 0));
        assert_eq!(AlignedBuf::prefaulted(0).as_mut_slice().len(), 0);
    }
}
