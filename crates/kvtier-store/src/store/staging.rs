//! Staging memory reused across calls, for objects passing between an engine's pool and the
//! lower tiers (SSD, remote) whole.
//!
//! A fresh `vec![0u8; n]` of a prompt's KV (189 MB for 4K tokens of SmolLM2 in float32) is
//! fresh pages: on the 2-core development VM, faulting them in ran at 0.8 GB/s, slower than the
//! SSD read or the Redis transfer it staged. Buffers handed back are kept (at most
//! [`KEEP_BUFFERS`], each at most [`KEEP_BYTES_MAX`]), so a server's loads and saves after the
//! first touch only memory already mapped. A reused buffer holds stale bytes of an earlier call:
//! callers overwrite what they read (a failed read's bytes are never used: its outcome says so).

use std::ops::{Deref, DerefMut};

use parking_lot::Mutex;

/// Buffers kept for reuse (one load and one save in flight at once).
pub(crate) const KEEP_BUFFERS: usize = 2;
/// A buffer larger than this is freed after use, not kept.
pub(crate) const KEEP_BYTES_MAX: usize = 1 << 30;

#[derive(Default)]
pub(crate) struct Staging {
    free: Mutex<Vec<Vec<u8>>>,
}

/// A staging buffer of the asked length; back to its [`Staging`] on drop.
pub(crate) struct Staged<'a> {
    owner: &'a Staging,
    buf: Vec<u8>,
    len: usize,
}

impl Staging {
    /// A buffer of `len` bytes: a kept one (the smallest that fits, else the largest, grown),
    /// or a new one.
    pub(crate) fn take(&self, len: usize) -> Staged<'_> {
        let mut buf = {
            let mut free = self.free.lock();
            let fits = (0..free.len()).filter(|&i| free[i].len() >= len).min_by_key(|&i| free[i].len());
            let pick = fits.or_else(|| (0..free.len()).max_by_key(|&i| free[i].len()));
            pick.map(|i| free.swap_remove(i)).unwrap_or_default()
        };
        if buf.len() < len {
            buf.resize(len, 0); // only the new tail is written
        }
        Staged { owner: self, buf, len }
    }

    /// Bytes held by kept buffers.
    #[cfg(test)]
    fn kept_bytes(&self) -> usize {
        self.free.lock().iter().map(Vec::len).sum()
    }
}

impl Deref for Staged<'_> {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        &self.buf[..self.len]
    }
}

impl DerefMut for Staged<'_> {
    fn deref_mut(&mut self) -> &mut [u8] {
        &mut self.buf[..self.len]
    }
}

impl Drop for Staged<'_> {
    fn drop(&mut self) {
        let buf = std::mem::take(&mut self.buf);
        if buf.is_empty() || buf.len() > KEEP_BYTES_MAX {
            return;
        }
        let mut free = self.owner.free.lock();
        free.push(buf);
        if free.len() > KEEP_BUFFERS {
            // Keep the largest: the next big load then reuses mapped memory.
            let smallest = (0..free.len()).min_by_key(|&i| free[i].len()).expect("non-empty");
            free.swap_remove(smallest);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_returned_buffer_is_reused_not_reallocated() {
        let staging = Staging::default();
        let first = {
            let mut a = staging.take(4096);
            a[0] = 7;
            a.as_ptr()
        };
        let b = staging.take(1000);
        assert_eq!(b.len(), 1000);
        assert_eq!(b.as_ptr(), first, "the kept buffer serves a smaller request");
    }

    #[test]
    fn at_most_two_buffers_are_kept_and_the_largest_survive() {
        let staging = Staging::default();
        let (a, b, c) = (staging.take(100), staging.take(300), staging.take(200));
        drop((a, b, c));
        assert_eq!(staging.kept_bytes(), 500);
        let big = staging.take(1000); // grows the largest kept one
        assert_eq!(big.len(), 1000);
        drop(big);
        assert_eq!(staging.kept_bytes(), 1200);
    }

    #[test]
    fn oversized_buffers_are_not_kept() {
        let staging = Staging::default();
        drop(staging.take(KEEP_BYTES_MAX + 1));
        assert_eq!(staging.kept_bytes(), 0);
    }
}
