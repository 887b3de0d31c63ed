//! The one decoder of untrusted bytes, [`decode_into`], fuzzed: on corrupted or truncated
//! payloads it never panics, never writes past the length it reports, and never reports success
//! on a payload whose framing was tampered with (truncated, extended, or a header, params or
//! stream-table byte changed so the declared sizes disagree); what it decodes is exactly what
//! [`decode`] (the same decoder with a per-thread scratch) decodes.

use kvtier_codec::lossless::LosslessCodec;
use kvtier_codec::quant::{QuantCodec, QuantConfig};
use kvtier_codec::streams::Backend;
use kvtier_codec::{decode, decode_into, decoded_len, Codec, CodecError};
use proptest::prelude::*;

fn sample_kv(len: usize) -> Vec<u8> {
    (0..len / 2)
        .flat_map(|i| half::f16::from_f32(((i * 37) % 101) as f32 / 50.0 - 1.0).to_bits().to_le_bytes())
        .collect()
}

/// (codec id, payload, the block it encodes): quant (two shapes) and lossless with every backend
/// (raw has no framing: its bytes are the block, verified by the object checksum only).
fn payloads() -> Vec<(u16, Vec<u8>, Vec<u8>)> {
    let mut coded: Vec<(Box<dyn Codec>, usize)> = vec![];
    // The second: head dim 300 (dequantized in several 256-value pieces), 16 bins everywhere.
    let mut wide = QuantConfig::cachegen(0, 3, 4, 2, 300);
    wide.key_bins.iter_mut().chain(wide.value_bins.iter_mut()).for_each(|b| *b = 16);
    for config in [QuantConfig::cachegen(8, 3, 4, 2, 16), wide] {
        let codec = QuantCodec::new(config).unwrap();
        let len = codec.input_len();
        coded.push((Box::new(codec), len));
    }
    for backend in Backend::ALL {
        coded.push((Box::new(LosslessCodec::new(backend, backend.default_level()).unwrap()), 4096));
    }
    coded
        .into_iter()
        .map(|(codec, len)| {
            let block = sample_kv(len);
            let mut payload = vec![0; codec.max_encoded_len(block.len())];
            let n = codec.encode(&block, &mut payload).unwrap();
            payload.truncate(n);
            (codec.id(), payload, block)
        })
        .collect()
}

/// `decode_into` into a buffer with a sentinel tail; checks the tail and that `decode` agrees.
fn decode_checked(id: u16, payload: &[u8], len: usize) -> Result<Vec<u8>, CodecError> {
    let mut out = vec![0xA5u8; len + 64];
    let mut scratch = vec![0u8; len];
    let got = decode_into(id, payload, &mut out, &mut scratch);
    let mut other = vec![0u8; len + 64];
    let again = decode(id, payload, &mut other);
    assert_eq!(got.is_ok(), again.is_ok(), "decode and decode_into disagree");
    let n = got?;
    assert!(out[n..].iter().all(|&b| b == 0xA5), "wrote past the decoded length");
    assert_eq!(Ok(n), decoded_len(id, payload), "reported another length than declared");
    assert_eq!(out[..n], other[..n], "decode and decode_into decoded differently");
    Ok(out[..n].to_vec())
}

#[test]
fn valid_payloads_decode_as_the_codecs_encoded_them() {
    for (id, payload, block) in payloads() {
        let out = decode_checked(id, &payload, block.len()).unwrap();
        assert_eq!(out.len(), block.len());
        if id == kvtier_codec::CODEC_LOSSLESS {
            assert_eq!(out, block);
        }
        // Too little scratch or output is an error, never a panic or a partial success.
        let mut out = vec![0u8; block.len()];
        assert!(decode_into(id, &payload, &mut out, &mut vec![0u8; block.len() - 1]).is_err());
        assert!(decode_into(id, &payload, &mut out[..block.len() - 1], &mut vec![0u8; block.len()]).is_err());
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// Any bit flips anywhere: never a panic, never a write past the reported length.
    #[test]
    fn flipped_payloads_never_panic(which in 0usize..6, flips in proptest::collection::vec((any::<usize>(), 0u8..8), 1..8)) {
        let (id, mut payload, block) = payloads().swap_remove(which);
        for (at, bit) in flips {
            let at = at % payload.len();
            payload[at] ^= 1 << bit;
        }
        let _ = decode_checked(id, &payload, block.len());
    }

    /// Truncated or extended payloads, and a changed byte in the framing (header, params and
    /// stream table: every size there is cross-checked), are always errors.
    #[test]
    fn tampered_framing_never_succeeds(which in 0usize..6, cut in any::<usize>(), extra in 1usize..64, at in any::<usize>(), byte in 1u8..=255) {
        let (id, payload, block) = payloads().swap_remove(which);
        let len = block.len();
        let cut = cut % payload.len();
        prop_assert!(decode_checked(id, &payload[..cut], len).is_err());
        let mut longer = payload.clone();
        longer.extend(std::iter::repeat_n(0u8, extra));
        prop_assert!(decode_checked(id, &longer, len).is_err());
        // Bytes 8..24 of the header: decoded length, params length, body length.
        let mut forged = payload.clone();
        let at = 8 + at % 16;
        forged[at] ^= byte;
        prop_assert!(decode_checked(id, &forged, len).is_err(), "header byte {at} changed and still decoded");
    }

    #[test]
    fn random_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..600), id in 0u16..4) {
        let _ = decode_checked(id, &bytes, 512);
    }
}
