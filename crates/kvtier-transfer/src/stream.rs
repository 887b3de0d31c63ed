//! Streaming (non-temporal) copies for swap transfers. A swap-out's destination (a host slot) is
//! not read soon; a swap-in's (device blocks the next forward pass reads) is a step's worth of
//! blocks, megabytes each, which would not stay in cache either. Writing around the cache saves
//! the read-for-ownership of every destination line — a third of a copy's memory traffic — which
//! leaves bandwidth for the other direction of a duplex swap (SuperInfer §4.3.2).

use std::ptr;

/// Copies shorter than this use `copy_nonoverlapping` (streaming pays off on whole pages).
const STREAM_MIN_BYTES: usize = 4096;

/// Copies `len` bytes from `src` to `dst` with streaming stores where the CPU has them (x86-64
/// with AVX2), else as `copy_nonoverlapping`. Call [`fence`] before another thread may read
/// `dst`.
///
/// # Safety
/// As [`ptr::copy_nonoverlapping`].
#[inline]
pub(crate) unsafe fn copy(dst: *mut u8, src: *const u8, len: usize) {
    #[cfg(target_arch = "x86_64")]
    {
        if len >= STREAM_MIN_BYTES && has_avx2() {
            return stream_avx2(dst, src, len);
        }
    }
    ptr::copy_nonoverlapping(src, dst, len);
}

/// Orders this thread's streaming stores before its later stores (e.g. the release of a
/// transfer's completion), so a thread that sees the completion sees the bytes.
#[inline]
pub(crate) fn fence() {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: sfence has no preconditions (SSE is baseline on x86-64).
    unsafe {
        std::arch::x86_64::_mm_sfence()
    };
}

#[cfg(target_arch = "x86_64")]
fn has_avx2() -> bool {
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
    use std::arch::x86_64::{__m256i, _mm256_loadu_si256, _mm256_stream_si256};
    // Head: up to the destination's next 32-byte boundary.
    let head = dst.align_offset(32).min(len);
    ptr::copy_nonoverlapping(src, dst, head);
    let (mut d, mut s, mut left) = (dst.add(head), src.add(head), len - head);
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
    ptr::copy_nonoverlapping(s, d, left);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn copies_every_length_and_alignment() {
        let src: Vec<u8> = (0..20_000u32).map(|i| (i * 7 + i / 251) as u8).collect();
        for len in [0, 1, 31, 4095, 4096, 4097, 8191, 12_345, 16_384] {
            for (so, d_off) in [(0, 0), (1, 0), (0, 3), (5, 17), (32, 64)] {
                let mut dst = vec![0xeeu8; len + 100];
                unsafe { copy(dst.as_mut_ptr().add(d_off), src.as_ptr().add(so), len) };
                fence();
                assert_eq!(&dst[d_off..d_off + len], &src[so..so + len], "len {len} src+{so} dst+{d_off}");
                assert!(dst[..d_off].iter().all(|&x| x == 0xee));
                assert!(dst[d_off + len..].iter().all(|&x| x == 0xee), "len {len}: wrote past the end");
            }
        }
    }
}
