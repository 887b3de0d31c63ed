//! The AVX2 stripe loops: one stripe is two 256-bit lanes of data, accumulated as the reference's
//! `XXH3_accumulate_512_avx2` does; [`copy_hash`] also stores each stripe to the destination with
//! streaming stores from the same registers, so the source is read once.

use std::arch::x86_64::{
    __m128i, __m256i, _mm256_add_epi64, _mm256_castsi256_si128, _mm256_extracti128_si256, _mm256_loadu_si256,
    _mm256_mul_epu32, _mm256_set1_epi32, _mm256_shuffle_epi32, _mm256_slli_epi64, _mm256_srli_epi64,
    _mm256_storeu_si256, _mm256_stream_si256, _mm256_xor_si256, _mm_loadu_si128, _mm_stream_si128,
};
use std::ptr;

use super::spec::{PRIME32_1, SCRAMBLE_AT, SECRET, STRIPE, STRIPES_PER_BLOCK};

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
    // SAFETY (whole body): as the caller promised.
    unsafe {
        let mut lanes = Lanes::load(acc, *in_block);
        if dst.align_offset(32) == 0 {
            for i in 0..stripes {
                lanes.step::<true>(src.as_ptr().add(i * STRIPE), dst.add(i * STRIPE));
            }
        } else {
            for i in 0..stripes {
                lanes.step::<false>(src.as_ptr().add(i * STRIPE), dst.add(i * STRIPE));
            }
        }
        *in_block = lanes.store(acc);
        stream_rest(src, dst, stripes * STRIPE);
    }
}

/// One hasher's part in [`copy_hash_pair`]: lanes, stripes into the block, source, destination.
pub(super) type PairPart<'a, 's> = (&'a mut [u64; 8], &'a mut usize, &'s [u8], *mut u8);

/// [`copy_hash`] of two sources of one length at once, alternating stripe by stripe, so the
/// reads of both are in flight together. Destinations are 64-byte aligned, so each stripe fills
/// one whole line of each: with a line split between two stripes, two interleaved streams of
/// partial lines made a load into a pool (destinations 16 bytes past a line) 65% slower.
///
/// # Safety
/// As [`copy_hash`] for each part, with both destinations 64-byte aligned; neither destination
/// overlaps the other or either source.
#[target_feature(enable = "avx2")]
pub(super) unsafe fn copy_hash_pair(a: PairPart<'_, '_>, b: PairPart<'_, '_>, stripes: usize) {
    let ((acc_a, k_a, src_a, dst_a), (acc_b, k_b, src_b, dst_b)) = (a, b);
    debug_assert!(src_a.len() == src_b.len() && stripes * STRIPE <= src_a.len());
    debug_assert!(dst_a.align_offset(64) == 0 && dst_b.align_offset(64) == 0);
    // SAFETY (whole body): as the caller promised.
    unsafe {
        let (mut la, mut lb) = (Lanes::load(acc_a, *k_a), Lanes::load(acc_b, *k_b));
        let (sa, sb) = (src_a.as_ptr(), src_b.as_ptr());
        for i in 0..stripes {
            la.step::<true>(sa.add(i * STRIPE), dst_a.add(i * STRIPE));
            lb.step::<true>(sb.add(i * STRIPE), dst_b.add(i * STRIPE));
        }
        *k_a = la.store(acc_a);
        *k_b = lb.store(acc_b);
        stream_rest(src_a, dst_a, stripes * STRIPE);
        stream_rest(src_b, dst_b, stripes * STRIPE);
    }
}

/// A hasher's eight lanes in two registers, and its stripes into the current block.
struct Lanes {
    lo: __m256i,
    hi: __m256i,
    in_block: usize,
}

impl Lanes {
    #[target_feature(enable = "avx2")]
    #[inline]
    unsafe fn load(acc: &[u64; 8], in_block: usize) -> Lanes {
        // SAFETY: `acc` is 64 readable bytes.
        unsafe {
            Lanes {
                lo: _mm256_loadu_si256(acc.as_ptr().cast::<__m256i>()),
                hi: _mm256_loadu_si256(acc.as_ptr().add(4).cast::<__m256i>()),
                in_block,
            }
        }
    }

    /// Writes the lanes back; returns the stripes into the block.
    #[target_feature(enable = "avx2")]
    #[inline]
    unsafe fn store(self, acc: &mut [u64; 8]) -> usize {
        // SAFETY: `acc` is 64 writable bytes.
        unsafe {
            _mm256_storeu_si256(acc.as_mut_ptr().cast::<__m256i>(), self.lo);
            _mm256_storeu_si256(acc.as_mut_ptr().add(4).cast::<__m256i>(), self.hi);
        }
        self.in_block
    }

    /// Copies the stripe at `s` to `d` (32-byte stores if `WIDE`, else 16-byte ones, streaming)
    /// and accumulates it, scrambling after a block's 16th stripe.
    ///
    /// # Safety
    /// `s` is valid for 64 bytes of reads, `d` for 64 bytes of writes, 32-byte aligned if `WIDE`,
    /// else 16-byte aligned.
    #[target_feature(enable = "avx2")]
    #[inline]
    unsafe fn step<const WIDE: bool>(&mut self, s: *const u8, d: *mut u8) {
        let secret = SECRET.as_ptr();
        // SAFETY: as the caller promised; secret offsets as in `hash`.
        unsafe {
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
            let k = self.in_block;
            self.lo = accumulate(self.lo, a, secret.add(8 * k));
            self.hi = accumulate(self.hi, b, secret.add(8 * k + 32));
            if k + 1 == STRIPES_PER_BLOCK {
                self.lo = scramble(self.lo, secret.add(SCRAMBLE_AT));
                self.hi = scramble(self.hi, secret.add(SCRAMBLE_AT + 32));
                self.in_block = 0;
            } else {
                self.in_block = k + 1;
            }
        }
    }
}

/// Copies `src[done..]` to `dst + done` (16-byte aligned): streaming 16-byte steps, plain below.
///
/// # Safety
/// `dst` is valid for `src.len()` bytes of writes and `dst + done` is 16-byte aligned.
#[target_feature(enable = "avx2")]
#[inline]
unsafe fn stream_rest(src: &[u8], dst: *mut u8, done: usize) {
    // SAFETY: as the caller promised.
    unsafe {
        let (mut s, mut d, mut left) = (src.as_ptr().add(done), dst.add(done), src.len() - done);
        while left >= 16 {
            _mm_stream_si128(d.cast::<__m128i>(), _mm_loadu_si128(s.cast::<__m128i>()));
            (s, d, left) = (s.add(16), d.add(16), left - 16);
        }
        ptr::copy_nonoverlapping(s, d, left);
    }
}
