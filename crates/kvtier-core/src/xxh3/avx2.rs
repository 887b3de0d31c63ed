//! The AVX2 stripe loops: one stripe is two 256-bit lanes of data, accumulated as the reference's
//! `XXH3_accumulate_512_avx2` does; [`copy_hash`] also stores each stripe to the destination with
//! streaming stores from the same registers, so the source is read once.

use std::arch::x86_64::{
    __m128i, __m256i, _mm256_add_epi64, _mm256_castsi256_si128, _mm256_extracti128_si256,
    _mm256_loadu_si256, _mm256_mul_epu32, _mm256_set1_epi32, _mm256_shuffle_epi32,
    _mm256_slli_epi64, _mm256_srli_epi64, _mm256_storeu_si256, _mm256_stream_si256,
    _mm256_xor_si256, _mm_loadu_si128, _mm_stream_si128,
};
use std::ptr;

use super::{PRIME32_1, SCRAMBLE_AT, SECRET, STRIPE, STRIPES_PER_BLOCK};

/// `acc += swap_pairs(data) + lo32(data ^ key) * hi32(data ^ key)`, per 64-bit lane.
#[target_feature(enable = "avx2")]
#[inline]
unsafe fn accumulate(acc: __m256i, data: __m256i, key: *const u8) -> __m256i {
    // SAFETY: `key` points at 32 readable bytes of the secret (the caller's offsets).
    let keyed = _mm256_xor_si256(data, unsafe { _mm256_loadu_si256(key.cast::<__m256i>()) });
    let product = _mm256_mul_epu32(keyed, _mm256_srli_epi64::<32>(keyed));
    let swapped = _mm256_shuffle_epi32::<0b01_00_11_10>(data);
    _mm256_add_epi64(product, _mm256_add_epi64(acc, swapped))
}

/// `acc = (acc ^ acc >> 47 ^ key) * PRIME32_1`, per 64-bit lane.
#[target_feature(enable = "avx2")]
#[inline]
unsafe fn scramble(acc: __m256i, key: *const u8) -> __m256i {
    let prime = _mm256_set1_epi32(PRIME32_1 as i32);
    let mixed = _mm256_xor_si256(acc, _mm256_srli_epi64::<47>(acc));
    // SAFETY: `key` points at 32 readable bytes of the secret.
    let keyed = _mm256_xor_si256(mixed, unsafe { _mm256_loadu_si256(key.cast::<__m256i>()) });
    let low = _mm256_mul_epu32(keyed, prime);
    let high = _mm256_mul_epu32(_mm256_srli_epi64::<32>(keyed), prime);
    _mm256_add_epi64(low, _mm256_slli_epi64::<32>(high))
}

/// Accumulates `stripes` stripes from `src` into `acc`, scrambling after each block's 16th.
///
/// # Safety
/// AVX2 is present; `src` is valid for `stripes * 64` bytes of reads.
#[target_feature(enable = "avx2")]
pub(super) unsafe fn hash(acc: &mut [u64; 8], in_block: &mut usize, src: *const u8, stripes: usize) {
    let secret = SECRET.as_ptr();
    // SAFETY (whole body): reads stay inside `src..src + stripes * 64` and the secret (stripe
    // keys at 8 * (0..16) + 64 <= 192, the scramble's at 128 + 64); `acc` is 64 bytes.
    unsafe {
        let mut lo = _mm256_loadu_si256(acc.as_ptr().cast::<__m256i>());
        let mut hi = _mm256_loadu_si256(acc.as_ptr().add(4).cast::<__m256i>());
        let mut k = *in_block;
        for i in 0..stripes {
            let s = src.add(i * STRIPE);
            lo = accumulate(lo, _mm256_loadu_si256(s.cast::<__m256i>()), secret.add(8 * k));
            hi = accumulate(hi, _mm256_loadu_si256(s.add(32).cast::<__m256i>()), secret.add(8 * k + 32));
            k += 1;
            if k == STRIPES_PER_BLOCK {
                lo = scramble(lo, secret.add(SCRAMBLE_AT));
                hi = scramble(hi, secret.add(SCRAMBLE_AT + 32));
                k = 0;
            }
        }
        _mm256_storeu_si256(acc.as_mut_ptr().cast::<__m256i>(), lo);
        _mm256_storeu_si256(acc.as_mut_ptr().add(4).cast::<__m256i>(), hi);
        *in_block = k;
    }
}

/// Copies `src` to `dst` with streaming stores and accumulates its first `stripes` stripes on the
/// way, each from the registers it is stored from. Stores are 32 bytes wide where `dst` is 32-byte
/// aligned, else 16; the bytes past the last whole stripe stream in 16-byte steps, plain below 16.
///
/// # Safety
/// AVX2 is present; `dst` is 16-byte aligned and valid for `src.len()` bytes of writes, does not
/// overlap `src`; `stripes * 64 <= src.len()`.
#[target_feature(enable = "avx2")]
pub(super) unsafe fn copy_hash(
    acc: &mut [u64; 8],
    in_block: &mut usize,
    src: &[u8],
    dst: *mut u8,
    stripes: usize,
) {
    debug_assert!(dst.align_offset(16) == 0 && stripes * STRIPE <= src.len());
    // SAFETY: as the caller promised.
    unsafe {
        if dst.align_offset(32) == 0 {
            fused::<true>(acc, in_block, src.as_ptr(), dst, stripes)
        } else {
            fused::<false>(acc, in_block, src.as_ptr(), dst, stripes)
        }
        let done = stripes * STRIPE;
        let (mut s, mut d, mut left) = (src.as_ptr().add(done), dst.add(done), src.len() - done);
        while left >= 16 {
            _mm_stream_si128(d.cast::<__m128i>(), _mm_loadu_si128(s.cast::<__m128i>()));
            (s, d, left) = (s.add(16), d.add(16), left - 16);
        }
        ptr::copy_nonoverlapping(s, d, left);
    }
}

/// The fused loop; `WIDE`: `dst` is 32-byte aligned (two 32-byte stores per stripe, else four of
/// 16 bytes at 16-byte-aligned addresses).
#[target_feature(enable = "avx2")]
#[inline]
unsafe fn fused<const WIDE: bool>(
    acc: &mut [u64; 8],
    in_block: &mut usize,
    src: *const u8,
    dst: *mut u8,
    stripes: usize,
) {
    let secret = SECRET.as_ptr();
    // SAFETY (whole body): as `copy_hash`'s contract and `hash`'s secret offsets.
    unsafe {
        let mut lo = _mm256_loadu_si256(acc.as_ptr().cast::<__m256i>());
        let mut hi = _mm256_loadu_si256(acc.as_ptr().add(4).cast::<__m256i>());
        let mut k = *in_block;
        for i in 0..stripes {
            let (s, d) = (src.add(i * STRIPE), dst.add(i * STRIPE));
            let a = _mm256_loadu_si256(s.cast::<__m256i>());
            let b = _mm256_loadu_si256(s.add(32).cast::<__m256i>());
            if WIDE {
                _mm256_stream_si256(d.cast::<__m256i>(), a);
                _mm256_stream_si256(d.add(32).cast::<__m256i>(), b);
            } else {
                _mm_stream_si128(d.cast::<__m128i>(), _mm256_castsi256_si128(a));
                _mm_stream_si128(d.add(16).cast::<__m128i>(), _mm256_extracti128_si256::<1>(a));
                _mm_stream_si128(d.add(32).cast::<__m128i>(), _mm256_castsi256_si128(b));
                _mm_stream_si128(d.add(48).cast::<__m128i>(), _mm256_extracti128_si256::<1>(b));
            }
            lo = accumulate(lo, a, secret.add(8 * k));
            hi = accumulate(hi, b, secret.add(8 * k + 32));
            k += 1;
            if k == STRIPES_PER_BLOCK {
                lo = scramble(lo, secret.add(SCRAMBLE_AT));
                hi = scramble(hi, secret.add(SCRAMBLE_AT + 32));
                k = 0;
            }
        }
        _mm256_storeu_si256(acc.as_mut_ptr().cast::<__m256i>(), lo);
        _mm256_storeu_si256(acc.as_mut_ptr().add(4).cast::<__m256i>(), hi);
        *in_block = k;
    }
}
