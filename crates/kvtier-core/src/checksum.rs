//! Payload checksums: XXH3-64 with seed 0, computed while copying so a checked copy costs about
//! one pass over memory instead of two (the chunk just written is hashed while it is in cache).

use xxhash_rust::xxh3::{xxh3_64, Xxh3};

/// Chunk of a fused copy+hash, in bytes: small enough to stay in L2 between copy and hash.
pub const FUSED_CHUNK_BYTES: usize = 64 << 10;

/// XXH3-64 (seed 0) of `bytes`.
pub fn checksum(bytes: &[u8]) -> u64 {
    xxh3_64(bytes)
}

/// Copies `src` into `dst` (same length) and returns the checksum of the bytes copied.
///
/// The checksum is computed over `dst` after each chunk lands, so it covers exactly the bytes the
/// caller will use, even if `src` were changed concurrently.
pub fn copy_with_checksum(dst: &mut [u8], src: &[u8]) -> u64 {
    assert_eq!(dst.len(), src.len(), "copy_with_checksum needs equal lengths");
    let mut hasher = Xxh3::new();
    for (d, s) in dst.chunks_mut(FUSED_CHUNK_BYTES).zip(src.chunks(FUSED_CHUNK_BYTES)) {
        d.copy_from_slice(s);
        hasher.update(d);
    }
    hasher.digest()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fused_equals_one_shot() {
        for len in [0usize, 1, 1000, FUSED_CHUNK_BYTES, FUSED_CHUNK_BYTES * 3 + 17] {
            let src: Vec<u8> = (0..len).map(|i| (i * 31 % 251) as u8).collect();
            let mut dst = vec![0u8; len];
            assert_eq!(copy_with_checksum(&mut dst, &src), checksum(&src));
            assert_eq!(dst, src);
        }
    }
}
