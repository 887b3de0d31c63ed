//! Bulk byte copies at memory speed whatever the buffers' addresses.
//!
//! Why not plain `memcpy`: on x86-64, glibc copies large buffers with `rep movsb`, which slows
//! to a third of its speed when the destination lies a little *ahead* of the source modulo
//! 4 KiB (measured on this project's AMD EPYC VM: 3.1–4.1 GiB/s for a destination 16–256 bytes
//! ahead, against 10–11 GiB/s otherwise). Every DRAM-tier object starts on a page and numpy
//! places large arrays 16 bytes past one, so a store-to-array load hit this every time (the
//! "load slower than put" of issue 19). A loop of 32-byte loads and *streaming* stores does not
//! depend on that distance (9–11 GiB/s at every offset) and skips the read-for-ownership of the
//! destination lines, a third of a copy's memory traffic. The destination is then not in the
//! cache, which suits copies of megabytes that no one reads right away.
//!
//! Streaming stores are weakly ordered: a copier must call [`fence`] before another thread may
//! read what it wrote. [`copy`] fences; the raw [`copy_unfenced`] leaves it to the caller.

use std::ptr;

/// Copies shorter than this use `copy_nonoverlapping` (streaming pays off on whole pages).
pub const STREAM_MIN_BYTES: usize = 4096;

/// Copies `src` into `dst` (equal lengths), streaming where the CPU allows, and fences.
pub fn copy(dst: &mut [u8], src: &[u8]) {
    assert_eq!(dst.len(), src.len(), "copy needs equal lengths");
    // SAFETY: both slices are valid for their length; `&mut` and `&` cannot overlap.
    unsafe { copy_unfenced(dst.as_mut_ptr(), src.as_ptr(), src.len()) };
    fence();
}

/// Whether copies of `len` bytes stream (their destination bypasses the cache).
#[inline]
pub fn streams(len: usize) -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        len >= STREAM_MIN_BYTES && has_avx2()
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = len;
        false
    }
}

/// Copies `len` bytes from `src` to `dst`, with streaming stores where [`streams`] says so.
/// Call [`fence`] before another thread may read `dst`.
///
/// # Safety
/// As [`ptr::copy_nonoverlapping`].
#[inline]
pub unsafe fn copy_unfenced(dst: *mut u8, src: *const u8, len: usize) {
    #[cfg(target_arch = "x86_64")]
    {
        if streams(len) {
            // SAFETY: AVX2 is present (checked by `streams`); bounds as the caller promised.
            return unsafe { stream_avx2(dst, src, len) };
        }
    }
    // SAFETY: as the caller promised.
    unsafe { ptr::copy_nonoverlapping(src, dst, len) };
}

/// Orders this thread's streaming stores before its later stores (e.g. the release of a copy's
/// completion), so a thread that sees the completion sees the bytes.
#[inline]
pub fn fence() {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: sfence has no preconditions (SSE is baseline on x86-64).
    unsafe {
        std::arch::x86_64::_mm_sfence()
    };
}

#[cfg(target_arch = "x86_64")]
pub(crate) fn has_avx2() -> bool {
    use std::sync::atomic::{AtomicU8, Ordering};
    static STATE: AtomicU8 = AtomicU8::new(0); // 0 unknown, 1 no, 2 yes
    match STATE.load(Ordering::Relaxed) {
        0 => {
            let yes = std::is_x86_feature_detected!("avx2");
            STATE.store(if yes { 2 } else { 1 }, Ordering::Relaxed);
            yes
        }
        s => s == 2,
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn stream_avx2(dst: *mut u8, src: *const u8, len: usize) {
    use std::arch::x86_64::{
        __m128i, __m256i, _mm256_loadu_si256, _mm256_stream_si256, _mm_loadu_si128, _mm_stream_si128,
    };
    // SAFETY (whole body): every access stays inside `dst..dst + len` / `src..src + len`, which
    // the caller promised valid and disjoint; 32-byte streaming stores go to 32-byte-aligned
    // addresses, 16-byte ones to 16-byte-aligned addresses.
    unsafe {
        // Head: plain stores only up to the destination's next 16-byte boundary (none for numpy
        // arrays and arena extents), then one 16-byte streaming store if needed for 32. A plain
        // store into a line that streaming stores have just sent to memory reads the line back
        // first: numpy arrays start 16 bytes past a page, so plain 32-byte heads and tails cost
        // two such reads per copy, which paid off per 64 KiB chunk but not per 32 KiB pool piece
        // (chunks are 4 KiB since: `checksum::FUSED_CHUNK_BYTES`).
        let head = dst.align_offset(16).min(len);
        ptr::copy_nonoverlapping(src, dst, head);
        let (mut d, mut s, mut left) = (dst.add(head), src.add(head), len - head);
        if left >= 16 && d.align_offset(32) != 0 {
            _mm_stream_si128(d.cast::<__m128i>(), _mm_loadu_si128(s.cast::<__m128i>()));
            d = d.add(16);
            s = s.add(16);
            left -= 16;
        }
        while left >= 128 {
            let a = _mm256_loadu_si256(s.cast::<__m256i>());
            let b = _mm256_loadu_si256(s.add(32).cast::<__m256i>());
            let c = _mm256_loadu_si256(s.add(64).cast::<__m256i>());
            let e = _mm256_loadu_si256(s.add(96).cast::<__m256i>());
            _mm256_stream_si256(d.cast::<__m256i>(), a);
            _mm256_stream_si256(d.add(32).cast::<__m256i>(), b);
            _mm256_stream_si256(d.add(64).cast::<__m256i>(), c);
            _mm256_stream_si256(d.add(96).cast::<__m256i>(), e);
            d = d.add(128);
            s = s.add(128);
            left -= 128;
        }
        // Tail: streaming down to the last 16-byte step, plain stores below it.
        while left >= 32 {
            _mm256_stream_si256(d.cast::<__m256i>(), _mm256_loadu_si256(s.cast::<__m256i>()));
            d = d.add(32);
            s = s.add(32);
            left -= 32;
        }
        if left >= 16 {
            _mm_stream_si128(d.cast::<__m128i>(), _mm_loadu_si128(s.cast::<__m128i>()));
            d = d.add(16);
            s = s.add(16);
            left -= 16;
        }
        ptr::copy_nonoverlapping(s, d, left);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn copies_every_length_and_alignment() {
        let src: Vec<u8> = (0..20_000u32).map(|i| (i * 7 + i / 251) as u8).collect();
        for len in [0, 1, 31, 4095, 4096, 4097, 4112, 4127, 4144, 8191, 12_345, 16_384] {
            for (so, d_off) in [(0, 0), (1, 0), (0, 3), (5, 17), (32, 64), (0, 16), (3, 48), (0, 8), (7, 24)]
            {
                let mut dst = vec![0xeeu8; len + 100];
                // SAFETY: both ranges are inside their vectors.
                unsafe { copy_unfenced(dst.as_mut_ptr().add(d_off), src.as_ptr().add(so), len) };
                fence();
                assert_eq!(&dst[d_off..d_off + len], &src[so..so + len], "len {len} src+{so} dst+{d_off}");
                assert!(dst[..d_off].iter().all(|&x| x == 0xee));
                assert!(dst[d_off + len..].iter().all(|&x| x == 0xee), "len {len}: wrote past the end");
            }
        }
    }

    #[test]
    fn safe_copy_checks_lengths() {
        let mut dst = [0u8; 8];
        copy(&mut dst, &[1, 2, 3, 4, 5, 6, 7, 8]);
        assert_eq!(dst, [1, 2, 3, 4, 5, 6, 7, 8]);
        assert!(std::panic::catch_unwind(|| copy(&mut [0u8; 3], &[0u8; 4])).is_err());
    }
}
