//! Every digest against `xxhash-rust`'s (the checksum's reference): one-shot and streamed, split
//! anywhere, hashed alone or while copying to any alignment, on the AVX2 and the scalar loops.

use proptest::prelude::*;
use xxhash_rust::xxh3::xxh3_64;

use super::*;

fn bytes(len: usize, seed: u64) -> Vec<u8> {
    let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state as u8
        })
        .collect()
}

/// The loops to test: scalar always, AVX2 where this CPU has it.
fn loops() -> Vec<bool> {
    if simd_available() {
        vec![false, true]
    } else {
        vec![false]
    }
}

/// Hashes `src` fed in pieces ending at `cuts`, copying to a buffer at `dst_offset` when `copying`;
/// checks the copy and that nothing around it was written.
fn streamed(src: &[u8], cuts: &[usize], simd: bool, copying: Option<usize>) -> u64 {
    let mut hasher = Xxh3::with_simd(simd);
    let mut out = vec![0xa5u8; src.len() + 70 + 128];
    // `off` bytes past a 64-byte line, whatever the allocator returned.
    let off = out.as_ptr().align_offset(64) + copying.unwrap_or(0);
    let mut from = 0;
    for &to in cuts.iter().chain([&src.len()]) {
        let to = to.clamp(from, src.len());
        match copying {
            // SAFETY: `out[off + from..off + to]` is in bounds and does not overlap `src`.
            Some(_) => unsafe { hasher.update_copying(out.as_mut_ptr().add(off + from), &src[from..to]) },
            None => hasher.update(&src[from..to]),
        }
        from = to;
    }
    copy::fence();
    if copying.is_some() {
        assert_eq!(&out[off..off + src.len()], src, "copy differs");
        assert!(out[..off].iter().chain(&out[off + src.len()..]).all(|&b| b == 0xa5), "wrote outside");
    }
    hasher.digest()
}

const EDGES: [usize; 24] = [
    0, 1, 3, 4, 8, 9, 16, 17, 63, 64, 65, 127, 128, 129, 239, 240, 241, 255, 256, 1023, 1024, 1025, 4096,
    4097,
];

#[test]
fn one_shot_lengths_match_the_reference() {
    let src = bytes(70_000, 1);
    let lens = EDGES.iter().copied().chain([1087, 1088, 1089, 2048, 2049, 8191, 16_385, 65_536, 70_000]);
    for len in lens.chain((0..600).step_by(7)) {
        let want = xxh3_64(&src[..len]);
        for simd in loops() {
            assert_eq!(streamed(&src[..len], &[], simd, None), want, "len {len} simd {simd}");
            for dst_off in [0, 1, 7, 16, 32, 48] {
                assert_eq!(
                    streamed(&src[..len], &[], simd, Some(dst_off)),
                    want,
                    "len {len} copy +{dst_off}"
                );
            }
        }
    }
}

#[test]
fn unaligned_sources_match_the_reference() {
    let buf = bytes(40_000, 2);
    for src_off in [1, 3, 8, 16, 31, 33] {
        for len in [65, 241, 1024, 4096, 5000, 32_768] {
            let src = &buf[src_off..src_off + len];
            for simd in loops() {
                for dst_off in [0, 5, 16, 32] {
                    let got = streamed(src, &[], simd, Some(dst_off));
                    assert_eq!(got, xxh3_64(src), "src +{src_off} len {len} dst +{dst_off}");
                }
            }
        }
    }
}

#[test]
fn pieces_of_pool_blocks_match_the_reference() {
    // An object copied as 64 pieces of 32 KiB (the pool path), and the same with odd pieces.
    let src = bytes(64 * 32_768, 3);
    let want = xxh3_64(&src);
    let even: Vec<usize> = (1..64).map(|i| i * 32_768).collect();
    let odd: Vec<usize> = (1..64).map(|i| i * 32_768 - 40 + i % 3).collect();
    for simd in loops() {
        for cuts in [&even, &odd] {
            assert_eq!(streamed(&src, cuts, simd, None), want);
            assert_eq!(streamed(&src, cuts, simd, Some(16)), want);
            assert_eq!(streamed(&src, cuts, simd, Some(0)), want);
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn any_split_matches_the_reference(
        len in 0usize..6000,
        seed in any::<u64>(),
        mut cuts in proptest::collection::vec(0usize..6000, 0..6),
        dst_off in 0usize..70,
        copying in any::<bool>(),
    ) {
        let src = bytes(len, seed);
        cuts.sort_unstable();
        let want = xxh3_64(&src);
        for simd in loops() {
            let got = streamed(&src, &cuts, simd, copying.then_some(dst_off));
            prop_assert_eq!(got, want, "simd {}", simd);
        }
    }
}

#[test]
fn a_flipped_byte_changes_the_digest() {
    let src = bytes(9000, 4);
    let good = xxh3_64(&src);
    for at in (0..src.len()).step_by(97).chain([0, 63, 64, 1023, 1024, 8999]) {
        let mut bad = src.clone();
        bad[at] ^= 1;
        for simd in loops() {
            assert_ne!(streamed(&bad, &[4096], simd, Some(16)), good, "byte {at}");
        }
    }
}

/// Feeds two sources in pieces ending at `cuts` through [`Xxh3::update_copying_pair`], copying to
/// buffers at `offs`; checks both copies.
fn paired(a: &[u8], b: &[u8], cuts: &[usize], simd: bool, offs: (usize, usize)) -> (u64, u64) {
    let (mut ha, mut hb) = (Xxh3::with_simd(simd), Xxh3::with_simd(simd));
    let mut out_a = vec![0x5au8; a.len() + offs.0 + 128];
    let mut out_b = vec![0x5au8; b.len() + offs.1 + 128];
    // `offs` bytes past a 64-byte line, whatever the allocator returned.
    let offs = (out_a.as_ptr().align_offset(64) + offs.0, out_b.as_ptr().align_offset(64) + offs.1);
    let (mut fa, mut fb) = (0, 0);
    for &to in cuts.iter().chain([&usize::MAX]) {
        let (ta, tb) = (to.clamp(fa, a.len()), to.clamp(fb, b.len()));
        // SAFETY: each piece of the outputs is in bounds; outputs and sources are distinct.
        unsafe {
            Xxh3::update_copying_pair(
                (&mut ha, out_a.as_mut_ptr().add(offs.0 + fa), &a[fa..ta]),
                (&mut hb, out_b.as_mut_ptr().add(offs.1 + fb), &b[fb..tb]),
            )
        };
        (fa, fb) = (ta, tb);
    }
    copy::fence();
    assert_eq!(&out_a[offs.0..offs.0 + a.len()], a, "copy a differs");
    assert_eq!(&out_b[offs.1..offs.1 + b.len()], b, "copy b differs");
    assert!(out_a[..offs.0].iter().chain(&out_a[offs.0 + a.len()..]).all(|&x| x == 0x5a));
    assert!(out_b[..offs.1].iter().chain(&out_b[offs.1 + b.len()..]).all(|&x| x == 0x5a));
    (ha.digest(), hb.digest())
}

#[test]
fn pairs_match_the_reference() {
    let (a, b) = (bytes(3 * 32_768 + 100, 5), bytes(3 * 32_768 + 100, 6));
    let pieces: Vec<usize> = (1..4).map(|i| i * 32_768).collect();
    for simd in loops() {
        for offs in [(0, 0), (16, 0), (0, 16), (16, 48), (3, 16), (7, 9)] {
            for (la, lb) in [(a.len(), b.len()), (a.len(), 70_000), (5000, b.len()), (100, 241), (0, 4096)] {
                let got = paired(&a[..la], &b[..lb], &pieces, simd, offs);
                assert_eq!(got, (xxh3_64(&a[..la]), xxh3_64(&b[..lb])), "{la} {lb} {offs:?} simd {simd}");
            }
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(128))]

    #[test]
    fn any_paired_split_matches_the_reference(
        len_a in 0usize..20_000,
        len_b in 0usize..20_000,
        seed in any::<u64>(),
        mut cuts in proptest::collection::vec(0usize..20_000, 0..5),
        offs in prop_oneof![Just((0usize, 0usize)), (0usize..40, 0usize..40)],
        same_len in any::<bool>(),
    ) {
        let len_b = if same_len { len_a } else { len_b };
        let (a, b) = (bytes(len_a, seed), bytes(len_b, seed ^ 1));
        cuts.sort_unstable();
        for simd in loops() {
            let got = paired(&a, &b, &cuts, simd, offs);
            prop_assert_eq!(got, (xxh3_64(&a), xxh3_64(&b)), "simd {}", simd);
        }
    }
}
