//! Allocation-free decoders for the codec payloads the store keeps in its lower tiers
//! (`ssd_codec`, `remote_codec`; docs/formats.md §2, §5), split into the pipeline's stages
//! (docs/transfer.md §2). The read stage hands over each block's verified payload as its tier
//! stores it, with the codec id its object records:
//!
//! - `raw` (0): the block; decompress and dequantize pass it through.
//! - `lossless` (1): decompress undoes the backend and the byte-plane shuffle.
//! - `quant` (2): decompress undoes the backend of its three streams (scale low bytes, scale
//!   high bytes, codes) into the next stage buffer; dequantize turns them, with the params still
//!   in the read buffer, into fp16 values. So the two are separate stages with their own workers.
//!
//! Each decoder validates its payload as `kvtier_codec`'s decoders do (same checks, same
//! output) but without their per-call vectors.

use half::f16;
use half::slice::HalfFloatSliceExt;
use kvtier_codec::header;
use kvtier_codec::lossless::{unshuffle2, LosslessCodec};
use kvtier_codec::streams::{self, Backend, Stream};
use kvtier_codec::{Codec, CodecError, CODEC_LOSSLESS, CODEC_QUANT};

fn u16_at(b: &[u8], at: usize) -> usize {
    u16::from_le_bytes([b[at], b[at + 1]]) as usize
}
fn u32_at(b: &[u8], at: usize) -> usize {
    u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]]) as usize
}

/// Parses a stream table at the start of `table` (`raw_lens.len()` streams whose raw lengths
/// must be `raw_lens`) over `body`, into `parts`; the table must end `table`. Checks as
/// `kvtier_codec::streams::parse_streams`, without allocating.
fn parse_table<'a>(
    table: &[u8],
    raw_lens: &[usize],
    body: &'a [u8],
    parts: &mut [Stream<'a>],
) -> Result<Backend, CodecError> {
    let invalid = |what, value: u64| CodecError::InvalidParam { what, value };
    let count = raw_lens.len();
    if table.len() != streams::table_len(count) {
        return Err(CodecError::LengthMismatch {
            what: "stream table",
            declared: table.len() as u64,
            actual: streams::table_len(count) as u64,
        });
    }
    let backend = Backend::from_code(table[0])?;
    backend.check_level(table[1] as i8)?;
    if table[2] as usize != count {
        return Err(invalid("stream count", table[2] as u64));
    }
    if table[3] != 0 {
        return Err(invalid("stream table reserved byte", 1));
    }
    let mut pos = 0usize;
    for (i, part) in parts.iter_mut().enumerate().take(count) {
        let e = &table[4 + 12 * i..4 + 12 * (i + 1)];
        let mode = e[0];
        if mode > 1 || (mode == 1 && backend == Backend::None) || e[1..4] != [0, 0, 0] {
            return Err(invalid("stream mode", mode as u64));
        }
        let (raw_len, stored_len) = (u32_at(e, 4), u32_at(e, 8));
        if raw_len != raw_lens[i] || (mode == 0 && stored_len != raw_len) {
            return Err(CodecError::LengthMismatch {
                what: "stream raw length",
                declared: raw_len as u64,
                actual: raw_lens[i] as u64,
            });
        }
        let end = pos.checked_add(stored_len).filter(|&e| e <= body.len()).ok_or(CodecError::Truncated {
            what: "stream body",
            needed: (pos + stored_len) as u64,
            have: body.len() as u64,
        })?;
        *part = Stream { compressed: mode == 1, stored: &body[pos..end], raw_len };
        pos = end;
    }
    if pos != body.len() {
        return Err(CodecError::LengthMismatch {
            what: "body",
            declared: body.len() as u64,
            actual: pos as u64,
        });
    }
    Ok(backend)
}

const NO_STREAM: Stream<'static> = Stream { compressed: false, stored: &[], raw_len: 0 };

/// Decompress stage for a `lossless` payload (exactly the payload): decodes into `out`, which
/// must be exactly the decoded length it declares. `scratch` (at least that long) holds the
/// byte planes.
pub(crate) fn decompress_lossless(
    payload: &[u8],
    out: &mut [u8],
    scratch: &mut [u8],
) -> Result<(), CodecError> {
    let framed = header::parse(payload, CODEC_LOSSLESS)?;
    let n = usize::try_from(framed.decoded_len).unwrap_or(usize::MAX);
    if n != out.len() || n > scratch.len() {
        return Err(CodecError::LengthMismatch {
            what: "decoded length",
            declared: framed.decoded_len,
            actual: out.len() as u64,
        });
    }
    let p = framed.params;
    if p.len() < 4 {
        return Err(CodecError::Truncated { what: "lossless params", needed: 4, have: p.len() as u64 });
    }
    let planes = p[0] as usize;
    if !(1..=2).contains(&planes) || n % planes != 0 || p[1..4] != [0, 0, 0] {
        return Err(CodecError::InvalidParam { what: "element bytes", value: planes as u64 });
    }
    let plane_len = n / planes;
    let mut parts = [NO_STREAM; 2];
    let backend = parse_table(&p[4..], &[plane_len; 2][..planes], framed.body, &mut parts)?;
    if planes == 1 {
        streams::decode_stream(backend, &parts[0], out)?;
    } else {
        let (lo, hi) = scratch[..n].split_at_mut(plane_len);
        streams::decode_stream(backend, &parts[0], lo)?;
        streams::decode_stream(backend, &parts[1], hi)?;
        unshuffle2(lo, hi, out);
    }
    Ok(())
}

/// A `quant` payload's params, validated (as `kvtier_codec::quant::decode` does).
struct QuantLayout<'a> {
    layers: usize,
    head_dim: usize,
    per_segment: usize,
    /// Key bins then value bins, one per layer.
    bins: &'a [u8],
    vectors: usize,
    codes_len: usize,
    table: &'a [u8],
    body: &'a [u8],
}

impl QuantLayout<'_> {
    fn segment_bins(&self, s: usize) -> u8 {
        if s % 2 == 0 {
            self.bins[s / 2]
        } else {
            self.bins[self.layers + s / 2]
        }
    }

    fn quantized_len(&self) -> usize {
        2 * self.vectors + self.codes_len
    }
}

fn code_bytes(bins: u8, head_dim: usize) -> usize {
    if bins <= 16 {
        head_dim / 2
    } else {
        head_dim
    }
}

/// Parses and checks a `quant` payload whose decoded length must be `decoded_len`.
fn quant_layout(payload: &[u8], decoded_len: usize) -> Result<QuantLayout<'_>, CodecError> {
    let framed = header::parse(payload, CODEC_QUANT)?;
    let invalid = |what, value: u64| CodecError::InvalidParam { what, value };
    let p = framed.params;
    if p.len() < 16 {
        return Err(CodecError::Truncated { what: "quant params", needed: 16, have: p.len() as u64 });
    }
    let (layers, tokens, heads, d) = (u16_at(p, 2), u32_at(p, 4), u16_at(p, 8), u16_at(p, 10));
    if p[12..16] != [0, 0, 0, 0] {
        return Err(invalid("quant reserved bytes", 1));
    }
    if layers == 0 {
        return Err(invalid("number of layers (or of bins per layer)", 0));
    }
    if tokens == 0 || heads == 0 || d < 2 || d % 2 != 0 {
        return Err(invalid("quant shape", d as u64));
    }
    let table_at = 16 + 2 * layers;
    if p.len() < table_at {
        return Err(CodecError::Truncated {
            what: "quant params",
            needed: table_at as u64,
            have: p.len() as u64,
        });
    }
    let bins = &p[16..table_at];
    if let Some(&b) = bins.iter().find(|&&b| b < 3) {
        return Err(invalid("bins (3..=255)", b as u64));
    }
    let too_big = || invalid("chunk size", u64::MAX);
    let per_segment = tokens.checked_mul(heads).ok_or_else(too_big)?;
    let vectors = per_segment.checked_mul(2 * layers).ok_or_else(too_big)?;
    let decoded = vectors.checked_mul(2 * d).ok_or_else(too_big)?;
    if decoded as u64 != framed.decoded_len || decoded != decoded_len {
        return Err(CodecError::LengthMismatch {
            what: "decoded length",
            declared: framed.decoded_len,
            actual: decoded_len as u64,
        });
    }
    let mut layout = QuantLayout {
        layers,
        head_dim: d,
        per_segment,
        bins,
        vectors,
        codes_len: 0,
        table: &p[table_at..],
        body: framed.body,
    };
    layout.codes_len = (0..2 * layers).map(|s| code_bytes(layout.segment_bins(s), d) * per_segment).sum();
    Ok(layout)
}

/// Decompress stage for a `quant` payload: decodes its three streams into the front of `out`
/// (scale low bytes, scale high bytes, codes, back to back); `out.len()` is the decoded block
/// length (at least twice the quantized length, which the codec guarantees).
pub(crate) fn decompress_quant(payload: &[u8], out: &mut [u8]) -> Result<(), CodecError> {
    let q = quant_layout(payload, out.len())?;
    let mut parts = [NO_STREAM; 3];
    let backend = parse_table(q.table, &[q.vectors, q.vectors, q.codes_len], q.body, &mut parts)?;
    if q.quantized_len() > out.len() {
        return Err(CodecError::OutputTooSmall { needed: q.quantized_len() as u64, have: out.len() as u64 });
    }
    let (lo, rest) = out.split_at_mut(q.vectors);
    let (hi, rest) = rest.split_at_mut(q.vectors);
    streams::decode_stream(backend, &parts[0], lo)?;
    streams::decode_stream(backend, &parts[1], hi)?;
    streams::decode_stream(backend, &parts[2], &mut rest[..q.codes_len])
}

/// Dequantize stage: the streams [`decompress_quant`] wrote into `quantized`, binned by the
/// params of `payload` (the same `quant` payload, still in the read buffer), into `out`
/// (fp16 `BlockFirst` bytes, the block). Fixed stack buffers, no allocation.
pub(crate) fn dequantize(payload: &[u8], quantized: &[u8], out: &mut [u8]) -> Result<(), CodecError> {
    let q = quant_layout(payload, out.len())?;
    if quantized.len() < q.quantized_len() {
        return Err(CodecError::Truncated {
            what: "quantized streams",
            needed: q.quantized_len() as u64,
            have: quantized.len() as u64,
        });
    }
    let (lo, rest) = quantized.split_at(q.vectors);
    let (hi, codes) = rest.split_at(q.vectors);
    let d = q.head_dim;
    let mut levels = [0f32; 256];
    let mut halves = [f16::ZERO; 256];
    let mut code_pos = 0;
    for segment in 0..2 * q.layers {
        let b = q.segment_bins(segment);
        let width = code_bytes(b, d);
        let half = ((b - 1) / 2) as f32;
        let top = (b - 1) / 2 * 2;
        for v in 0..q.per_segment {
            let index = segment * q.per_segment + v;
            let bits = u16::from_le_bytes([lo[index], hi[index]]);
            if bits & 0x8000 != 0 || bits & 0x7c00 == 0x7c00 {
                return Err(CodecError::Corrupt { backend: "quant scale" });
            }
            let step = f16::from_bits(bits).to_f32() / half;
            let src = &codes[code_pos..code_pos + width];
            let dst = &mut out[index * 2 * d..(index + 1) * 2 * d];
            let level = |c: u8| (c.min(top) as f32 - half) * step;
            // In pieces of 256 values: fixed stack buffers, converted to fp16 in bulk.
            for piece in 0..d.div_ceil(256) {
                let (start, end) = (piece * 256, ((piece + 1) * 256).min(d));
                let vals = &mut levels[..end - start];
                if width == d {
                    for (x, &c) in vals.iter_mut().zip(&src[start..end]) {
                        *x = level(c);
                    }
                } else {
                    for (pair, &c) in vals.chunks_exact_mut(2).zip(&src[start / 2..end / 2]) {
                        pair[0] = level(c & 0x0f);
                        pair[1] = level(c >> 4);
                    }
                }
                let hs = &mut halves[..end - start];
                hs.convert_from_f32_slice(vals);
                for (pair, h) in dst[2 * start..2 * end].chunks_exact_mut(2).zip(hs.iter()) {
                    pair.copy_from_slice(&h.to_bits().to_le_bytes());
                }
            }
            code_pos += width;
        }
    }
    Ok(())
}

/// Sets up this thread's decoder contexts (zstd, deflate) by decoding one `block_bytes`
/// payload of each, so a decompress worker allocates them at start rather than on its first
/// chunk. `scratch` is the worker's plane scratch (`block_bytes`).
pub(crate) fn warm_up(block_bytes: usize, scratch: &mut [u8]) {
    // Compressible (zeros), so the backend really runs.
    let block = vec![0u8; block_bytes - block_bytes % 2];
    let mut out = vec![0u8; block.len()];
    for backend in [Backend::Zstd, Backend::Deflate] {
        let Ok(codec) = LosslessCodec::new(backend, backend.default_level()) else { continue };
        let mut payload = vec![0u8; codec.max_encoded_len(block.len())];
        if let Ok(n) = codec.encode(&block, &mut payload) {
            let _ = decompress_lossless(&payload[..n], &mut out, scratch);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvtier_codec::quant::{QuantCodec, QuantConfig};
    use kvtier_codec::streams::Stage;

    fn fp16_block(values: usize, seed: u32) -> Vec<u8> {
        (0..values as u32)
            .flat_map(|i| {
                f16::from_f32(((i.wrapping_mul(2654435761) ^ seed) % 2000) as f32 / 500.0 - 2.0).to_le_bytes()
            })
            .collect()
    }

    fn quant_payload(layers: u16, dim: u16, backend: Backend, level: i8) -> (Vec<u8>, Vec<u8>) {
        let mut config = QuantConfig::cachegen(0, layers, 4, 2, dim);
        config.stage = Stage::new(backend, level).unwrap();
        let codec = match QuantCodec::new(config.clone()) {
            Ok(c) => c,
            Err(_) => {
                config.key_bins.iter_mut().chain(config.value_bins.iter_mut()).for_each(|b| *b = 16);
                QuantCodec::new(config).unwrap()
            }
        };
        let block = fp16_block(codec.input_len() / 2, layers as u32);
        let mut payload = vec![0u8; codec.max_encoded_len(block.len())];
        let n = codec.encode(&block, &mut payload).unwrap();
        payload.truncate(n);
        (block, payload)
    }

    fn two_stage(payload: &[u8], bb: usize) -> Result<Vec<u8>, CodecError> {
        let (mut mid, mut out) = (vec![0u8; bb], vec![0u8; bb]);
        decompress_quant(payload, &mut mid)?;
        dequantize(payload, &mid, &mut out)?;
        Ok(out)
    }

    #[test]
    fn quant_stages_match_the_codec_crate() {
        for (layers, dim) in [(2u16, 64u16), (12, 8), (3, 300), (32, 128)] {
            for (backend, level) in
                [(Backend::Deflate, 6), (Backend::Zstd, 1), (Backend::Lz4, 0), (Backend::None, 0)]
            {
                let (block, payload) = quant_payload(layers, dim, backend, level);
                let ours = two_stage(&payload, block.len()).unwrap();
                let mut theirs = vec![0u8; block.len()];
                kvtier_codec::decode(CODEC_QUANT, &payload, &mut theirs).unwrap();
                assert_eq!(ours, theirs, "layers {layers} dim {dim} {backend:?}");
            }
        }
    }

    #[test]
    fn lossless_matches_the_codec_crate() {
        let block = fp16_block(4096, 7);
        for backend in [Backend::Zstd, Backend::Deflate, Backend::Lz4, Backend::None] {
            for element_bytes in [1u8, 2] {
                let codec =
                    LosslessCodec::with_element_bytes(backend, backend.default_level(), element_bytes)
                        .unwrap();
                let mut payload = vec![0u8; codec.max_encoded_len(block.len())];
                let n = codec.encode(&block, &mut payload).unwrap();
                let (mut out, mut scratch) = (vec![0u8; block.len()], vec![0u8; block.len()]);
                decompress_lossless(&payload[..n], &mut out, &mut scratch).unwrap();
                assert_eq!(out, block, "{backend:?} {element_bytes}");
                // Exactly the payload: a longer or shorter slice is refused, as is a wrong size.
                assert!(decompress_lossless(&payload[..n - 1], &mut out, &mut scratch).is_err());
                assert!(decompress_lossless(&payload[..n], &mut out[..64], &mut scratch).is_err());
            }
        }
    }

    proptest::proptest! {
        /// Stored payloads are checksummed, but the decoders still take untrusted bytes: any
        /// flip or truncation is an error or some output, never a panic.
        #[test]
        fn decoders_never_panic(flips in proptest::collection::vec((0usize..4096, 0u8..8), 0..6),
                                cut in 0usize..4096, quant in proptest::bool::ANY) {
            let (block, mut payload) = if quant {
                quant_payload(2, 64, Backend::Deflate, 1)
            } else {
                let block = fp16_block(1024, 3);
                let codec = LosslessCodec::new(Backend::Zstd, 1).unwrap();
                let mut payload = vec![0u8; codec.max_encoded_len(block.len())];
                let n = codec.encode(&block, &mut payload).unwrap();
                payload.truncate(n);
                (block, payload)
            };
            let len = payload.len();
            for (pos, bit) in flips {
                payload[pos % len] ^= 1 << bit;
            }
            payload.truncate((cut % len).max(1).max(len / 2));
            let bb = block.len();
            let _ = two_stage(&payload, bb);
            let (mut out, mut scratch) = (vec![0u8; bb], vec![0u8; bb]);
            let _ = decompress_lossless(&payload, &mut out, &mut scratch);
            let _ = dequantize(&payload, &out.clone(), &mut out);
        }

        #[test]
        fn random_bytes_never_panic(bytes in proptest::collection::vec(proptest::num::u8::ANY, 0..600)) {
            let (mut out, mut scratch) = (vec![0u8; 512], vec![0u8; 512]);
            let _ = decompress_lossless(&bytes, &mut out, &mut scratch);
            let _ = decompress_quant(&bytes, &mut out);
            let _ = dequantize(&bytes, &[0u8; 512], &mut out);
        }
    }
}
