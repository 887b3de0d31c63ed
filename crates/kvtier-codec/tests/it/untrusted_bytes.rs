//! Decoders of untrusted bytes never panic and name what is wrong.

use kvtier_codec::lossless::LosslessCodec;
use kvtier_codec::quant::{QuantCodec, QuantConfig};
use kvtier_codec::streams::Backend;
use kvtier_codec::{decode, decoded_len, Codec, CodecError, CODEC_LOSSLESS, CODEC_QUANT, CODEC_RAW};
use proptest::prelude::*;

fn sample_kv(len: usize) -> Vec<u8> {
    (0..len / 2)
        .flat_map(|i| half::f16::from_f32(((i * 37) % 101) as f32 / 50.0 - 1.0).to_bits().to_le_bytes())
        .collect()
}

fn valid_payloads() -> Vec<(u16, Vec<u8>, usize)> {
    let mut payloads = vec![];
    let quant = QuantCodec::new(QuantConfig::cachegen(8, 3, 4, 2, 16)).unwrap();
    let input = sample_kv(quant.input_len());
    let mut codecs: Vec<Box<dyn Codec>> = vec![Box::new(quant)];
    for backend in Backend::ALL {
        codecs.push(Box::new(LosslessCodec::new(backend, backend.default_level()).unwrap()));
    }
    for codec in codecs {
        let mut out = vec![0; codec.max_encoded_len(input.len())];
        let n = codec.encode(&input, &mut out).unwrap();
        out.truncate(n);
        payloads.push((codec.id(), out, input.len()));
    }
    payloads
}

/// 512 cases in `make test`; `PROPTEST_CASES` sets a longer run (docs/security.md).
fn cases() -> u32 {
    std::env::var("PROPTEST_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(512)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(cases()))]

    #[test]
    fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..512), id in 0u16..4) {
        let mut out = vec![0; 4096];
        let _ = decoded_len(id, &bytes);
        let _ = decode(id, &bytes, &mut out);
        // Also with a valid-looking header in front, so the params and body parsers are reached.
        for codec in [CODEC_LOSSLESS, CODEC_QUANT] {
            let mut framed = b"KVCP".to_vec();
            framed.extend_from_slice(&1u16.to_le_bytes());
            framed.extend_from_slice(&codec.to_le_bytes());
            framed.extend_from_slice(&bytes);
            let _ = decode(codec, &framed, &mut out);
        }
    }

    #[test]
    fn corrupted_valid_payloads_never_panic(which in 0usize..5, flips in proptest::collection::vec((any::<usize>(), any::<u8>()), 1..8)) {
        let (id, mut payload, len) = valid_payloads().swap_remove(which);
        for (at, byte) in flips {
            let at = at % payload.len();
            payload[at] ^= byte;
        }
        let mut out = vec![0; len];
        let _ = decode(id, &payload, &mut out);
    }

    #[test]
    fn every_truncation_is_an_error(which in 0usize..5, cut in any::<usize>()) {
        let (id, payload, len) = valid_payloads().swap_remove(which);
        let cut = cut % payload.len();
        let mut out = vec![0; len];
        prop_assert!(decode(id, &payload[..cut], &mut out).is_err());
    }
}

#[test]
fn named_bad_inputs() {
    let mut out = vec![0; 1 << 16];
    for id in [CODEC_RAW, CODEC_LOSSLESS, CODEC_QUANT] {
        assert_eq!(decode(id, &[], &mut out), Err(CodecError::EmptyInput));
    }
    assert_eq!(decode(9, b"x", &mut out), Err(CodecError::UnknownCodec { id: 9 }));
    let (id, payload, len) = valid_payloads().swap_remove(0);
    assert_eq!(id, CODEC_QUANT);
    // The object header says lossless but the payload is quant: the reader errs.
    assert_eq!(
        decode(CODEC_LOSSLESS, &payload, &mut out),
        Err(CodecError::CodecMismatch { expected: CODEC_LOSSLESS, found: CODEC_QUANT })
    );
    assert!(matches!(decode(id, &payload, &mut out[..len - 1]), Err(CodecError::OutputTooSmall { .. })));
    let mut bad_magic = payload.clone();
    bad_magic[0] = b'X';
    assert_eq!(decode(id, &bad_magic, &mut out), Err(CodecError::BadMagic));
    let mut bad_version = payload.clone();
    bad_version[4] = 2;
    assert_eq!(decode(id, &bad_version, &mut out), Err(CodecError::UnsupportedVersion { version: 2 }));
    let mut wrong_size = payload.clone();
    wrong_size[8] ^= 2; // declared decoded length disagrees with the geometry
    assert!(matches!(decode(id, &wrong_size, &mut out), Err(CodecError::LengthMismatch { .. })));
    let mut trailing = payload.clone();
    trailing.push(0);
    assert!(matches!(decode(id, &trailing, &mut out), Err(CodecError::LengthMismatch { .. })));
}

/// A header may claim any decoded length; one beyond `DECODED_LEN_MAX` (2^40, 2^64 - 1) is an
/// error naming it before anything is sized from it, for every codec with a header.
#[test]
fn absurd_decoded_lengths_are_refused_before_allocating() {
    for (id, payload, _) in valid_payloads() {
        for claim in [kvtier_codec::header::DECODED_LEN_MAX + 1, 1 << 40, u64::MAX] {
            let mut forged = payload.clone();
            forged[8..16].copy_from_slice(&claim.to_le_bytes());
            let e = decoded_len(id, &forged).unwrap_err();
            assert!(
                matches!(e, CodecError::InvalidParam { what: "decoded length", value } if value == claim),
                "{e}"
            );
            assert!(decode(id, &forged, &mut [0u8; 64]).is_err());
        }
    }
}
