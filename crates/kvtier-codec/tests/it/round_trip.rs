//! `raw` and `lossless` round-trip exactly; `quant` stays within its documented error bound.

use half::f16;
use kvtier_codec::lossless::LosslessCodec;
use kvtier_codec::quant::{QuantCodec, QuantConfig, CACHEGEN_KEYS, CACHEGEN_VALUES};
use kvtier_codec::raw::RawCodec;
use kvtier_codec::streams::{Backend, Stage};
use kvtier_codec::{decode, decoded_len, Codec, CodecError};
use proptest::prelude::*;

fn round_trip(codec: &dyn Codec, input: &[u8]) -> Vec<u8> {
    let mut payload = vec![0; codec.max_encoded_len(input.len())];
    let n = codec.encode(input, &mut payload).unwrap();
    assert_eq!(decoded_len(codec.id(), &payload[..n]).unwrap(), input.len());
    let mut out = vec![0; input.len()];
    assert_eq!(decode(codec.id(), &payload[..n], &mut out).unwrap(), input.len());
    out
}

/// fp16 values shaped like KV: small magnitudes, a few outlier channels.
fn kv_like(len_values: usize, seed: u64) -> Vec<u8> {
    let mut state = seed | 1;
    (0..len_values)
        .flat_map(|i| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            let unit = (state >> 11) as f32 / (1u64 << 53) as f32 - 0.5;
            let outlier = if i % 64 == 3 { 20.0 } else { 1.0 };
            f16::from_f32(unit * outlier).to_bits().to_le_bytes()
        })
        .collect()
}

fn lossless_codecs() -> Vec<LosslessCodec> {
    let mut codecs = vec![];
    for backend in Backend::ALL {
        for element_bytes in [1, 2] {
            let level = backend.default_level();
            codecs.push(LosslessCodec::with_element_bytes(backend, level, element_bytes).unwrap());
        }
    }
    codecs
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    #[test]
    fn raw_round_trips(input in proptest::collection::vec(any::<u8>(), 1..4096)) {
        prop_assert_eq!(round_trip(&RawCodec, &input), input);
    }

    #[test]
    fn lossless_round_trips_random_bytes(half_len in 1usize..4096, seed in any::<u64>(), fill in any::<bool>()) {
        let input: Vec<u8> = if fill { vec![seed as u8; 2 * half_len] } else { kv_like(half_len, seed) };
        for codec in lossless_codecs() {
            prop_assert_eq!(&round_trip(&codec, &input), &input);
        }
    }

    #[test]
    fn quant_error_within_bound(tokens in 1u32..20, heads in 1u16..4, half_dim in 4u16..40, seed in any::<u64>()) {
        let head_dim = 2 * half_dim;
        let config = QuantConfig::with_rules(8, 4, tokens, heads, head_dim, CACHEGEN_KEYS, CACHEGEN_VALUES,
            Stage::new(Backend::Deflate, 6).unwrap());
        let codec = QuantCodec::new(config.clone()).unwrap();
        let input = kv_like(codec.input_len() / 2, seed);
        let out = round_trip(&codec, &input);
        check_bound(&config, &input, &out);
    }
}

/// `|x − x̂| ≤ s (1/(2h) + 2⁻¹⁰)` per element, `h = ⌊(bins − 1)/2⌋`, `s` the vector's max |x|.
fn check_bound(config: &QuantConfig, input: &[u8], out: &[u8]) {
    let d = config.head_dim as usize;
    let per_segment = config.block_tokens as usize * config.num_kv_heads as usize;
    let to_f32 = |b: &[u8]| f16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32();
    for (index, (vin, vout)) in input.chunks_exact(2 * d).zip(out.chunks_exact(2 * d)).enumerate() {
        let segment = index / per_segment;
        let layer = segment / 2;
        let bins = if segment.is_multiple_of(2) { config.key_bins[layer] } else { config.value_bins[layer] };
        let xs: Vec<f32> = vin.chunks_exact(2).map(to_f32).collect();
        let s = xs.iter().fold(0f32, |m, x| m.max(x.abs()));
        let bound = s * (1.0 / (2.0 * ((bins - 1) / 2) as f32) + 1.0 / 1024.0);
        for (x, y) in xs.iter().zip(vout.chunks_exact(2).map(to_f32)) {
            assert!((x - y).abs() <= bound, "|{x} - {y}| > {bound} (bins {bins})");
        }
    }
}

#[test]
fn quant_is_at_most_half_before_lossless_and_rejects_nan() {
    let config = QuantConfig::cachegen(0, 30, 16, 3, 64);
    let codec = QuantCodec::new(config).unwrap();
    assert!(codec.quantized_len() * 2 <= codec.input_len());
    let mut input = kv_like(codec.input_len() / 2, 7);
    input[101] = 0x7c; // element 50 → +inf (0x7c00)
    input[100] = 0x00;
    input[201] = 0x7e; // element 100 → NaN
    let mut out = vec![0; codec.max_encoded_len(input.len())];
    assert_eq!(codec.encode(&input, &mut out), Err(CodecError::NonFinite { count: 2, first_index: 50 }));
}

#[test]
fn quant_all_32_bins_exceeds_half_and_is_refused() {
    let stage = Stage::new(Backend::Deflate, 6).unwrap();
    let rule = kvtier_codec::quant::BinRule { early_layers: 0, early_bins: 32, late_bins: 32 };
    let config = QuantConfig::with_rules(0, 2, 16, 3, 64, rule, rule, stage);
    assert!(matches!(QuantCodec::new(config), Err(CodecError::ExceedsHalf { .. })));
}

#[test]
fn all_zero_vectors_decode_to_zero() {
    let codec = QuantCodec::new(QuantConfig::cachegen(10, 2, 4, 1, 8)).unwrap();
    let input = vec![0u8; codec.input_len()];
    assert_eq!(round_trip(&codec, &input), input);
}

#[test]
fn near_random_planes_are_stored_not_compressed() {
    // Low bytes of KV-like data are noise: the payload stays close to the raw size, never above.
    let input = kv_like(1 << 15, 3);
    let codec = LosslessCodec::new(Backend::Deflate, 6).unwrap();
    let mut payload = vec![0; codec.max_encoded_len(input.len())];
    let n = codec.encode(&input, &mut payload).unwrap();
    assert!(n <= codec.max_encoded_len(input.len()));
    assert!(n < input.len(), "high-byte plane should compress: {n} vs {}", input.len());
}

/// Every compressing backend shrinks a compressible input (a backend that always falls back to
/// storing its streams would pass the round trips above and still be broken).
#[test]
fn every_compressing_backend_compresses() {
    let input: Vec<u8> = (0..16384u32).flat_map(|i| ((i % 7) as u16).to_le_bytes()).collect();
    for backend in [Backend::Zstd, Backend::Lz4, Backend::Deflate] {
        let codec = LosslessCodec::with_element_bytes(backend, backend.default_level(), 2).unwrap();
        let mut payload = vec![0; codec.max_encoded_len(input.len())];
        let n = codec.encode(&input, &mut payload).unwrap();
        assert!(n * 4 < input.len(), "{backend:?}: {n} bytes for {}", input.len());
        assert_eq!(round_trip(&codec, &input), input);
    }
}
