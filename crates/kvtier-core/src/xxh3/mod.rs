//! XXH3-64 (seed 0, default secret) as a streaming hasher whose long-input loop can also copy: each
//! 64-byte stripe is stored to the destination from the registers it is hashed from, so a checked
//! copy reads its source once ([`Xxh3::update_copying`]).
//!
//! Why our own: `xxhash-rust` picks its SIMD at compile time, which for the x86-64 baseline this
//! project builds for is SSE2, and it has no copying form, so a fused copy re-read each chunk from
//! L1 with 16-byte lanes. Here the stripe loop is AVX2 where the CPU has it (runtime detection, as
//! [`crate::copy`] does) and portable scalar code elsewhere.
//!
//! Invariant: every digest equals `xxhash_rust::xxh3::xxh3_64` of the bytes fed, however they were
//! split (the checksums on SSD and remote tiers are this value: docs/formats.md). Inputs of at most
//! 240 bytes are hashed by `xxhash-rust` itself (they are kept whole); longer ones follow the
//! reference's long-input algorithm: stripes accumulated into eight lanes, a scramble after every
//! 16 stripes (a block), and the last 64 bytes of the input, always held back, accumulated with
//! their own secret offset before the lanes are merged. A stripe is consumed only once more input
//! follows it, so a block's scramble can run as soon as its 16th stripe is in.

#[cfg(target_arch = "x86_64")]
mod avx2;
mod spec;
#[cfg(test)]
mod tests;

use crate::copy;
use spec::{
    INITIAL_ACC, LAST_STRIPE_AT, MERGE_AT, PRIME32_1, PRIME64_1, SCRAMBLE_AT, SECRET, SHORT_MAX, STRIPE,
    STRIPES_PER_BLOCK,
};

/// Chunk of the unfused fallback copy ([`Xxh3::update_copying`] where the fused loop cannot store):
/// each chunk is hashed from L1 right after its copy.
pub(crate) const FALLBACK_CHUNK: usize = 4 << 10;

/// Streaming XXH3-64 (seed 0): [`Xxh3::update`] or [`Xxh3::update_copying`] any number of times,
/// then [`Xxh3::digest`]; the digest is that of all bytes fed, in order.
#[derive(Clone)]
pub struct Xxh3 {
    /// The eight accumulator lanes (long inputs only).
    acc: [u64; 8],
    /// Stripes of the current block already accumulated (0..16).
    in_block: usize,
    /// Bytes fed so far.
    total: u64,
    /// Up to 240 bytes fed: all of them. Past that: the bytes not yet consumed, `pending` of them
    /// (1..=64 between calls: the input's last stripe is never consumed before the digest).
    buf: [u8; SHORT_MAX],
    pending: usize,
    /// The last stripe consumed: the digest's last 64 bytes reach into it when `pending < 64`.
    prev: [u8; STRIPE],
    /// Whether the stripe loops use AVX2 (detected once at construction).
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    simd: bool,
}

impl Default for Xxh3 {
    fn default() -> Self {
        Self::new()
    }
}

impl Xxh3 {
    /// A hasher that has seen no bytes.
    pub fn new() -> Self {
        Self::with_simd(simd_available())
    }

    fn with_simd(simd: bool) -> Self {
        Xxh3 {
            acc: INITIAL_ACC,
            in_block: 0,
            total: 0,
            buf: [0; SHORT_MAX],
            pending: 0,
            prev: [0; STRIPE],
            simd,
        }
    }

    /// Feeds `bytes`.
    pub fn update(&mut self, bytes: &[u8]) {
        // SAFETY: a null destination copies nothing.
        unsafe { self.feed(bytes, std::ptr::null_mut()) }
    }

    /// Feeds `src` and copies it to `dst` in the same pass: where the CPU has AVX2 and `dst` is
    /// 16-byte aligned, each stripe is stored with streaming stores from the registers it is hashed
    /// from (the destination is then not in the cache; see [`crate::copy`]); otherwise, and for
    /// copies shorter than [`copy::STREAM_MIN_BYTES`], 4 KiB chunks are copied with
    /// [`copy::copy_unfenced`] and hashed right after. Does not fence: call [`copy::fence`] before
    /// another thread may read `dst`.
    ///
    /// # Safety
    /// `dst` is valid for `src.len()` bytes of writes and does not overlap `src`.
    pub unsafe fn update_copying(&mut self, dst: *mut u8, src: &[u8]) {
        debug_assert!(!dst.is_null() || src.is_empty());
        // SAFETY: as the caller promised.
        unsafe { self.feed(src, dst) }
    }

    /// XXH3-64 (seed 0) of every byte fed.
    pub fn digest(&self) -> u64 {
        if self.total <= SHORT_MAX as u64 {
            return xxhash_rust::xxh3::xxh3_64(&self.buf[..self.total as usize]);
        }
        let mut acc = self.acc;
        let p = self.pending;
        let mut last = [0u8; STRIPE];
        last[..STRIPE - p].copy_from_slice(&self.prev[p..]);
        last[STRIPE - p..].copy_from_slice(&self.buf[..p]);
        accumulate(&mut acc, &last, LAST_STRIPE_AT);
        merge(&acc, self.total.wrapping_mul(PRIME64_1))
    }

    /// Feeds `src`, copying it to `dst` unless `dst` is null.
    ///
    /// # Safety
    /// A non-null `dst` is valid for `src.len()` bytes of writes and does not overlap `src`.
    unsafe fn feed(&mut self, src: &[u8], dst: *mut u8) {
        // SAFETY: as the caller promised.
        if let Some((src, dst)) = unsafe { self.lead_in(src, dst) } {
            let stripes = (src.len() - 1) / STRIPE;
            // SAFETY: `src` holds `stripes` whole stripes; `dst` as the caller promised.
            unsafe { self.stripes(src, dst, stripes) };
            self.lead_out(src, stripes);
        }
    }

    /// Feeds `a` and `b` (each a hasher, a destination, a source) as [`Xxh3::update_copying`]
    /// would one after the other, but where both go through the fused loop with sources of one
    /// length and 64-byte-aligned destinations, reads both sources in one loop, stripe by stripe:
    /// two streams of memory reads in flight instead of one, which hides part of the cost of
    /// starting to read a new stretch of memory (a put from a paged pool reads 32 KiB pieces
    /// scattered over the pool into page-aligned extents). Destinations off a line are copied one
    /// after the other: interleaved, their split lines cost more than the second stream gains.
    ///
    /// # Safety
    /// Each destination is valid for its source's length of writes and overlaps neither source
    /// nor the other destination.
    pub unsafe fn update_copying_pair(a: (&mut Xxh3, *mut u8, &[u8]), b: (&mut Xxh3, *mut u8, &[u8])) {
        let ((ha, da, sa), (hb, db, sb)) = (a, b);
        debug_assert!(!da.is_null() && !db.is_null());
        // SAFETY (whole body): as the caller promised; the lead-ins return the rest of each.
        unsafe {
            let Some((sa, da)) = ha.lead_in(sa, da) else { return hb.feed(sb, db) };
            let Some((sb, db)) = hb.lead_in(sb, db) else {
                let stripes = (sa.len() - 1) / STRIPE;
                ha.stripes(sa, da, stripes);
                return ha.lead_out(sa, stripes);
            };
            let stripes = (sa.len() - 1) / STRIPE;
            #[cfg(target_arch = "x86_64")]
            {
                let lines = da.align_offset(64) == 0 && db.align_offset(64) == 0;
                if ha.simd && hb.simd && sa.len() == sb.len() && copy::streams(sa.len()) && lines {
                    avx2::copy_hash_pair(
                        (&mut ha.acc, &mut ha.in_block, sa, da),
                        (&mut hb.acc, &mut hb.in_block, sb, db),
                        stripes,
                    );
                    ha.lead_out(sa, stripes);
                    return hb.lead_out(sb, stripes);
                }
            }
            ha.stripes(sa, da, stripes);
            ha.lead_out(sa, stripes);
            let stripes_b = (sb.len() - 1) / STRIPE;
            hb.stripes(sb, db, stripes_b);
            hb.lead_out(sb, stripes_b);
        }
    }

    /// Takes `src` up to the first stripe boundary of the input (the short form's bytes and the
    /// pending stripe, consumed once more input follows it) and returns the rest, stripe-aligned
    /// and not empty, with its destination; `None` if nothing is left.
    ///
    /// # Safety
    /// As [`Xxh3::feed`].
    unsafe fn lead_in<'s>(&mut self, mut src: &'s [u8], mut dst: *mut u8) -> Option<(&'s [u8], *mut u8)> {
        let len = src.len();
        if self.total + len as u64 <= SHORT_MAX as u64 {
            let at = self.total as usize;
            self.buf[at..at + len].copy_from_slice(src);
            self.total += len as u64;
            // SAFETY: as the caller promised.
            unsafe { copy_plain(dst, src) };
            return None;
        }
        if self.total <= SHORT_MAX as u64 {
            // Leaving the short form: every whole stripe held is followed by `src`.
            let held = self.total as usize;
            let whole = held / STRIPE;
            for i in 0..whole {
                let stripe: [u8; STRIPE] = self.buf[i * STRIPE..][..STRIPE].try_into().unwrap();
                self.consume(&stripe);
            }
            self.buf.copy_within(whole * STRIPE..held, 0);
            self.pending = held - whole * STRIPE;
        }
        self.total += len as u64;
        if self.pending > 0 {
            let take = (STRIPE - self.pending).min(len);
            self.buf[self.pending..self.pending + take].copy_from_slice(&src[..take]);
            // SAFETY: as the caller promised; `dst + take` stays in bounds.
            unsafe {
                copy_plain(dst, &src[..take]);
                dst = if dst.is_null() { dst } else { dst.add(take) };
            }
            self.pending += take;
            src = &src[take..];
            if src.is_empty() {
                return None; // the stripe, full or not, may be the input's last
            }
            let stripe: [u8; STRIPE] = self.buf[..STRIPE].try_into().unwrap();
            self.consume(&stripe);
            self.pending = 0;
        }
        Some((src, dst))
    }

    /// After `stripes` stripes of `src` (all but its last 1..=64 bytes) were consumed: keeps the
    /// last one consumed and the rest pending.
    fn lead_out(&mut self, src: &[u8], stripes: usize) {
        if stripes > 0 {
            self.prev.copy_from_slice(&src[(stripes - 1) * STRIPE..stripes * STRIPE]);
        }
        let rest = &src[stripes * STRIPE..];
        self.buf[..rest.len()].copy_from_slice(rest);
        self.pending = rest.len();
    }

    /// Accumulates one stripe held in memory (the scalar loop: a few per call at most).
    fn consume(&mut self, stripe: &[u8; STRIPE]) {
        accumulate(&mut self.acc, stripe, self.in_block * 8);
        self.end_stripe();
        self.prev = *stripe;
    }

    fn end_stripe(&mut self) {
        self.in_block += 1;
        if self.in_block == STRIPES_PER_BLOCK {
            scramble(&mut self.acc);
            self.in_block = 0;
        }
    }

    /// Accumulates the first `stripes` stripes of `src` and, unless `dst` is null, copies all of
    /// `src` to `dst`.
    ///
    /// # Safety
    /// `src` holds at least `stripes * 64` bytes; a non-null `dst` is valid for `src.len()` bytes
    /// of writes and does not overlap `src`.
    unsafe fn stripes(&mut self, src: &[u8], dst: *mut u8, stripes: usize) {
        #[cfg(target_arch = "x86_64")]
        if self.simd {
            if dst.is_null() {
                // SAFETY: AVX2 is present (`simd`); `src` holds `stripes` stripes.
                return unsafe { avx2::hash(&mut self.acc, &mut self.in_block, src.as_ptr(), stripes) };
            }
            if fusable(src.len(), dst) {
                // SAFETY: AVX2 is present; bounds and alignment as checked and promised.
                return unsafe { avx2::copy_hash(&mut self.acc, &mut self.in_block, src, dst, stripes) };
            }
        }
        if !dst.is_null() {
            // The unfused form: copy a chunk, then hash its stripes while they are in L1.
            for (i, chunk) in src.chunks(FALLBACK_CHUNK).enumerate() {
                // SAFETY: chunk `i` of `dst` is in bounds per the caller's contract.
                unsafe { copy::copy_unfenced(dst.add(i * FALLBACK_CHUNK), chunk.as_ptr(), chunk.len()) };
                let first = i * FALLBACK_CHUNK / STRIPE;
                let here = (chunk.len() / STRIPE).min(stripes.saturating_sub(first));
                // SAFETY: `here` whole stripes lie in `chunk`.
                unsafe { self.hash_only(&chunk[..here * STRIPE], here) };
            }
            return;
        }
        // SAFETY: `src` holds `stripes` stripes.
        unsafe { self.hash_only(src, stripes) }
    }

    /// # Safety
    /// `src` holds at least `stripes * 64` bytes.
    unsafe fn hash_only(&mut self, src: &[u8], stripes: usize) {
        debug_assert!(src.len() >= stripes * STRIPE);
        #[cfg(target_arch = "x86_64")]
        if self.simd {
            // SAFETY: AVX2 is present; `src` holds `stripes` stripes.
            return unsafe { avx2::hash(&mut self.acc, &mut self.in_block, src.as_ptr(), stripes) };
        }
        for stripe in src[..stripes * STRIPE].chunks_exact(STRIPE) {
            accumulate(&mut self.acc, stripe.try_into().unwrap(), self.in_block * 8);
            self.end_stripe();
        }
    }
}

/// Whether the stripe loops can use AVX2 on this CPU.
fn simd_available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        copy::has_avx2()
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// Whether a copy of `len` bytes to `dst` can go through the fused loop (AVX2 checked apart).
#[cfg(target_arch = "x86_64")]
fn fusable(len: usize, dst: *mut u8) -> bool {
    copy::streams(len) && dst.align_offset(16) == 0
}

/// Copies `src` to a non-null `dst` with plain stores (a few bytes at the edges of a call).
///
/// # Safety
/// As [`Xxh3::feed`].
unsafe fn copy_plain(dst: *mut u8, src: &[u8]) {
    if !dst.is_null() {
        // SAFETY: as the caller promised.
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), dst, src.len()) };
    }
}

fn read64(bytes: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(bytes[at..at + 8].try_into().unwrap())
}

/// One stripe into the lanes, keyed by the secret from `key_at` (the scalar form of the loop).
fn accumulate(acc: &mut [u64; 8], stripe: &[u8; STRIPE], key_at: usize) {
    for i in 0..8 {
        let data = read64(stripe, 8 * i);
        let keyed = data ^ read64(&SECRET, key_at + 8 * i);
        acc[i ^ 1] = acc[i ^ 1].wrapping_add(data);
        acc[i] = acc[i].wrapping_add((keyed & 0xFFFF_FFFF) * (keyed >> 32));
    }
}

fn scramble(acc: &mut [u64; 8]) {
    for (i, lane) in acc.iter_mut().enumerate() {
        let mixed = (*lane ^ (*lane >> 47)) ^ read64(&SECRET, SCRAMBLE_AT + 8 * i);
        *lane = mixed.wrapping_mul(PRIME32_1);
    }
}

fn merge(acc: &[u64; 8], start: u64) -> u64 {
    let mut result = start;
    for i in 0..4 {
        let lo = acc[2 * i] ^ read64(&SECRET, MERGE_AT + 16 * i);
        let hi = acc[2 * i + 1] ^ read64(&SECRET, MERGE_AT + 16 * i + 8);
        let product = u128::from(lo) * u128::from(hi);
        result = result.wrapping_add(product as u64 ^ (product >> 64) as u64);
    }
    result ^= result >> 37;
    result = result.wrapping_mul(0x1656_6791_9E37_79F9);
    result ^ (result >> 32)
}
