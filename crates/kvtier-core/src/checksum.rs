//! Payload checksums: XXH3-64 with seed 0, computed while copying so a checked copy costs about
//! one pass over memory instead of two: each 64-byte stripe is hashed from the registers it is
//! copied from ([`crate::xxh3`], where the CPU has AVX2), or, where it cannot be, each 4 KiB chunk
//! is hashed from L1 right after its copy.

pub use crate::xxh3::Xxh3;

use crate::copy;

/// Chunk of the unfused copy+hash (no AVX2, a destination not 16-byte aligned): each chunk is
/// hashed from L1 right after its copy. 4 KiB against the former 64 KiB, whose hash read from L2:
/// docs/benchmarks.md "Fused chunks of 4 KiB". The fused stripe loop replaced it on AVX2:
/// docs/benchmarks.md "Copy and hash in one loop".
pub const FUSED_CHUNK_BYTES: usize = crate::xxh3::FALLBACK_CHUNK;

/// XXH3-64 (seed 0) of `bytes`.
pub fn checksum(bytes: &[u8]) -> u64 {
    let mut hasher = Xxh3::new();
    hasher.update(bytes);
    hasher.digest()
}

/// Copies `src` into `dst` (same length) and returns the checksum of the bytes copied, in one
/// pass over memory ([`Xxh3::update_copying`]).
///
/// Large copies use streaming stores ([`crate::copy`]), which leave the destination out of the
/// cache, so the hash takes each stripe from the *source* just read. The caller must
/// therefore keep `src` unchanged during the call (a pinned arena extent, the store's own read
/// buffer) or accept that a concurrent change makes the checksum disagree with what `dst` holds:
/// a put whose source changes under it stores an object that fails verification when read (an
/// honest miss), never one that passes with other bytes. Fences before returning.
pub fn copy_with_checksum(dst: &mut [u8], src: &[u8]) -> u64 {
    assert_eq!(dst.len(), src.len(), "copy_with_checksum needs equal lengths");
    let mut hasher = Xxh3::new();
    // SAFETY: `dst` is valid for `src.len()` bytes and cannot overlap the shared `src`.
    unsafe { copy_hashing(dst.as_mut_ptr(), src, &mut hasher) };
    copy::fence();
    hasher.digest()
}

/// Copies `src` to `dst` and feeds `src` to `hasher` in the same pass (the piecewise form of
/// [`copy_with_checksum`], for objects copied to several destinations: the hasher carries on from
/// piece to piece). Does not fence: call
/// [`copy::fence`] before another thread may read `dst`. Same rule on `src` as
/// [`copy_with_checksum`].
///
/// # Safety
/// `dst` is valid for `src.len()` bytes of writes and does not overlap `src`.
pub unsafe fn copy_hashing(dst: *mut u8, src: &[u8], hasher: &mut Xxh3) {
    // SAFETY: as the caller promised.
    unsafe { hasher.update_copying(dst, src) }
}

#[cfg(test)]
mod tests {
    use super::*;
    use xxhash_rust::xxh3::xxh3_64;

    #[test]
    fn fused_equals_one_shot() {
        for len in [0usize, 1, 1000, 4095, 4096, 4097, 5000, 65_536, FUSED_CHUNK_BYTES * 3 + 17] {
            let src: Vec<u8> = (0..len).map(|i| (i * 31 % 251) as u8).collect();
            let mut dst = vec![0u8; len];
            assert_eq!(copy_with_checksum(&mut dst, &src), xxh3_64(&src));
            assert_eq!(dst, src);
        }
    }

    #[test]
    fn a_wrong_byte_anywhere_changes_the_sum() {
        // Every chunk boundary and its neighbours, every 61st byte between: the copy is exact and
        // one flipped source byte gives another checksum, whatever chunk it falls in.
        let len = FUSED_CHUNK_BYTES * 5 + 100;
        let src: Vec<u8> = (0..len).map(|i| (i * 13 % 251) as u8).collect();
        let mut dst = vec![0u8; len];
        let good = copy_with_checksum(&mut dst, &src);
        assert_eq!((good, &dst), (xxh3_64(&src), &src));
        let edges = (1..=5).flat_map(|c| [c * FUSED_CHUNK_BYTES - 1, c * FUSED_CHUNK_BYTES]);
        for at in edges.chain((0..len).step_by(61)).chain([len - 1]) {
            let mut bad = src.clone();
            bad[at] ^= 0x40;
            let mut hasher = Xxh3::new();
            let mut out = vec![0u8; len];
            for (a, b) in [(0, 3000), (3000, FUSED_CHUNK_BYTES * 2 + 7), (FUSED_CHUNK_BYTES * 2 + 7, len)] {
                // SAFETY: in bounds of `out`, which does not overlap `bad`.
                unsafe { copy_hashing(out.as_mut_ptr().add(a), &bad[a..b], &mut hasher) };
            }
            copy::fence();
            assert_ne!(hasher.digest(), good, "byte {at}");
            assert_eq!(out, bad, "byte {at} copied wrong");
        }
    }

    #[test]
    fn piecewise_equals_one_shot() {
        let src: Vec<u8> = (0..300_000u32).map(|i| (i * 17 % 253) as u8).collect();
        let mut dst = vec![0u8; src.len()];
        let mut hasher = Xxh3::new();
        for (a, b) in [(0, 5000), (5000, 70_000), (70_000, 70_001), (70_001, 300_000)] {
            // SAFETY: in bounds of `dst`, which does not overlap `src`.
            unsafe { copy_hashing(dst.as_mut_ptr().add(a), &src[a..b], &mut hasher) };
        }
        copy::fence();
        assert_eq!(hasher.digest(), xxh3_64(&src));
        assert_eq!(dst, src);
    }
}
