//! How a block sits in its store object under each [`TransferCodec`], and the allocation-free
//! decode steps the pipeline runs (docs/transfer.md §2).
//!
//! The store holds objects of exactly `block_bytes`. A compressed block is a codec payload
//! (docs/formats.md §5) followed by zeros to `block_bytes`; its own header says how long it is.
//! `quant` blocks are a `quant` payload whose streams are stored (backend none), wrapped in a
//! `lossless` payload without shuffle: decompress undoes the outer stage, dequantize the
//! binning, so the two are separate pipeline stages with their own workers.

use half::f16;
use half::slice::HalfFloatSliceExt;
use kvtier_codec::header::{self, HEADER_LEN};
use kvtier_codec::lossless::{unshuffle2, LosslessCodec};
use kvtier_codec::quant::{BinRule, QuantCodec, QuantConfig, CACHEGEN_KEYS, CACHEGEN_VALUES};
use kvtier_codec::streams::{self, Backend, Stage, Stream};
use kvtier_codec::{Codec, CodecError, CODEC_LOSSLESS, CODEC_QUANT};
use kvtier_core::{Dtype, Geometry};

use crate::config::TransferCodec;
use crate::error::TransferError;

/// Length of the codec payload at the start of a padded object: `24 + params + body` from its
/// header, or `None` if the header is not there or claims more than the object holds.
pub(crate) fn framed_len(object: &[u8]) -> Option<usize> {
    if object.len() < HEADER_LEN || object[0..4] != header::MAGIC {
        return None;
    }
    let params = u32::from_le_bytes(object[16..20].try_into().ok()?) as usize;
    let body = u32::from_le_bytes(object[20..24].try_into().ok()?) as usize;
    let total = HEADER_LEN.checked_add(params)?.checked_add(body)?;
    (total <= object.len()).then_some(total)
}

/// Decompress stage: the outer `lossless` payload of `object` into `out` (the decoded length
/// it declares, at most `out.len()`); returns that length. `scratch` (at least the decoded
/// length) holds the byte planes. Validates as `kvtier_codec::lossless::decode` does (formats
/// §5.2), but without its per-call allocations.
pub(crate) fn decompress(object: &[u8], out: &mut [u8], scratch: &mut [u8]) -> Result<usize, CodecError> {
    let len = framed_len(object).ok_or(CodecError::BadMagic)?;
    let framed = header::parse(&object[..len], CODEC_LOSSLESS)?;
    let n = usize::try_from(framed.decoded_len).unwrap_or(usize::MAX);
    if n > out.len() || n > scratch.len() {
        return Err(CodecError::OutputTooSmall {
            needed: framed.decoded_len,
            have: out.len().min(scratch.len()) as u64,
        });
    }
    let p = framed.params;
    let invalid = |what, value: u64| CodecError::InvalidParam { what, value };
    if p.len() < 8 {
        return Err(CodecError::Truncated { what: "lossless params", needed: 8, have: p.len() as u64 });
    }
    let planes = p[0] as usize;
    if !(1..=2).contains(&planes) || n % planes != 0 || p[1..4] != [0, 0, 0] {
        return Err(invalid("element bytes", planes as u64));
    }
    let table = &p[4..];
    if table.len() != 4 + 12 * planes {
        return Err(CodecError::LengthMismatch {
            what: "lossless params",
            declared: p.len() as u64,
            actual: (8 + 12 * planes) as u64,
        });
    }
    let backend = Backend::from_code(table[0])?;
    backend.check_level(table[1] as i8)?;
    if table[2] as usize != planes || table[3] != 0 {
        return Err(invalid("stream count", table[2] as u64));
    }
    let plane_len = n / planes;
    let mut parts = [Stream { compressed: false, stored: &[], raw_len: 0 }; 2];
    let mut pos = 0usize;
    for (i, part) in parts.iter_mut().enumerate().take(planes) {
        let e = &table[4 + 12 * i..4 + 12 * (i + 1)];
        let mode = e[0];
        if mode > 1 || (mode == 1 && backend == Backend::None) || e[1..4] != [0, 0, 0] {
            return Err(invalid("stream mode", mode as u64));
        }
        let (raw_len, stored_len) = (u32_at(e, 4), u32_at(e, 8));
        if raw_len != plane_len || (mode == 0 && stored_len != raw_len) {
            return Err(CodecError::LengthMismatch {
                what: "stream raw length",
                declared: raw_len as u64,
                actual: plane_len as u64,
            });
        }
        let end =
            pos.checked_add(stored_len).filter(|&e| e <= framed.body.len()).ok_or(CodecError::Truncated {
                what: "stream body",
                needed: (pos + stored_len) as u64,
                have: framed.body.len() as u64,
            })?;
        *part = Stream { compressed: mode == 1, stored: &framed.body[pos..end], raw_len };
        pos = end;
    }
    if pos != framed.body.len() {
        return Err(CodecError::LengthMismatch {
            what: "body",
            declared: framed.body.len() as u64,
            actual: pos as u64,
        });
    }
    if planes == 1 {
        streams::decode_stream(backend, &parts[0], &mut out[..n])?;
    } else {
        let (lo, hi) = scratch[..n].split_at_mut(plane_len);
        streams::decode_stream(backend, &parts[0], lo)?;
        streams::decode_stream(backend, &parts[1], hi)?;
        unshuffle2(lo, hi, &mut out[..n]);
    }
    Ok(n)
}

/// Dequantize stage: a `quant` payload (at the start of `payload`) into `out`
/// (`block_bytes`). Streams stored as written by [`Encoder`] decode here without allocating;
/// any other valid payload goes through the codec crate's decoder.
pub(crate) fn dequantize(payload: &[u8], out: &mut [u8]) -> Result<(), CodecError> {
    let len = framed_len(payload).ok_or(CodecError::BadMagic)?;
    let payload = &payload[..len];
    if let Some(result) = dequantize_stored(payload, out) {
        return result;
    }
    let n = kvtier_codec::decode(CODEC_QUANT, payload, out)?;
    if n != out.len() {
        return Err(CodecError::LengthMismatch {
            what: "dequantized block",
            declared: n as u64,
            actual: out.len() as u64,
        });
    }
    Ok(())
}

fn u16_at(b: &[u8], at: usize) -> usize {
    u16::from_le_bytes([b[at], b[at + 1]]) as usize
}
fn u32_at(b: &[u8], at: usize) -> usize {
    u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]]) as usize
}

/// The fast path of [`dequantize`]; `None` when the payload is not of the stored-streams form
/// (the caller then uses the general decoder, which validates everything).
fn dequantize_stored(payload: &[u8], out: &mut [u8]) -> Option<Result<(), CodecError>> {
    let framed = header::parse(payload, CODEC_QUANT).ok()?;
    let p = framed.params;
    if p.len() < 16 {
        return None;
    }
    let (layers, tokens, heads, d) = (u16_at(p, 2), u32_at(p, 4), u16_at(p, 8), u16_at(p, 10));
    let table = 16 + 2 * layers;
    if layers == 0 || tokens == 0 || heads == 0 || d < 2 || d % 2 != 0 || p.len() != table + 4 + 36 {
        return None;
    }
    if p[table + 2] != 3 || (0..3).any(|i| p[table + 4 + 12 * i] != 0) {
        return None; // compressed streams: the general decoder
    }
    let bins = &p[16..table];
    if bins.iter().any(|&b| b < 3) {
        return None;
    }
    let per_segment = tokens * heads;
    let vectors = per_segment * 2 * layers;
    let code_bytes = |b: u8| if b <= 16 { d / 2 } else { d };
    let codes_len: usize =
        (0..2 * layers).map(|s| code_bytes(segment_bins(bins, layers, s)) * per_segment).sum();
    let stream_len = |i: usize| u32_at(p, table + 4 + 12 * i + 4);
    if stream_len(0) != vectors || stream_len(1) != vectors || stream_len(2) != codes_len {
        return None;
    }
    if framed.body.len() != 2 * vectors + codes_len || out.len() != vectors * 2 * d {
        return None;
    }
    let (lo, rest) = framed.body.split_at(vectors);
    let (hi, codes) = rest.split_at(vectors);
    let mut levels = [0f32; 256];
    let mut halves = [f16::ZERO; 256];
    let mut code_pos = 0;
    for segment in 0..2 * layers {
        let b = segment_bins(bins, layers, segment);
        let width = code_bytes(b);
        let half = ((b - 1) / 2) as f32;
        let top = (b - 1) / 2 * 2;
        for v in 0..per_segment {
            let index = segment * per_segment + v;
            let bits = u16::from_le_bytes([lo[index], hi[index]]);
            if bits & 0x8000 != 0 || bits & 0x7c00 == 0x7c00 {
                return Some(Err(CodecError::Corrupt { backend: "quant scale" }));
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
    Some(Ok(()))
}

/// Sets up this thread's decoder contexts (zstd, deflate) by decoding one block-sized payload,
/// so a decompress worker allocates them at start rather than on its first chunk.
pub(crate) fn warm_up(codec: TransferCodec, geometry: &Geometry, scratch: &mut [u8]) {
    let (TransferCodec::Lossless { backend, level } | TransferCodec::Quant { backend, level }) = codec else {
        return;
    };
    let Ok(outer) = LosslessCodec::new(backend, level) else { return };
    // Compressible (zeros), so the backend really runs.
    let block = vec![0u8; geometry.block_bytes() as usize];
    let mut payload = vec![0u8; outer.max_encoded_len(block.len())];
    if let Ok(n) = outer.encode(&block, &mut payload) {
        let mut out = vec![0u8; block.len()];
        let _ = decompress(&payload[..n], &mut out, scratch);
    }
}

/// Bins of segment `s` (`[layer][k|v]` order) from the params' key bins then value bins.
fn segment_bins(bins: &[u8], layers: usize, s: usize) -> u8 {
    if s % 2 == 0 {
        bins[s / 2]
    } else {
        bins[layers + s / 2]
    }
}

/// 16 bins (4-bit codes) for every layer: the fallback when CacheGen's bins exceed half size.
const SIXTEEN_BINS: BinRule = BinRule { early_layers: 0, early_bins: 16, late_bins: 16 };

/// Encodes blocks into padded objects for store jobs (not on the load hot path).
pub(crate) struct Encoder {
    codec: TransferCodec,
    outer: Option<LosslessCodec>,
    quant: Option<QuantCodec>,
    scratch: Vec<u8>,
}

impl Encoder {
    pub fn new(codec: TransferCodec, geometry: &Geometry) -> Result<Self, TransferError> {
        let cfg = |e: CodecError| TransferError::Config(format!("codec {}: {e}", codec.name()));
        let block_bytes = geometry.block_bytes() as usize;
        let (outer, quant) = match codec {
            TransferCodec::Raw => (None, None),
            TransferCodec::Lossless { backend, level } => {
                (Some(LosslessCodec::new(backend, level).map_err(cfg)?), None)
            }
            TransferCodec::Quant { backend, level } => {
                if geometry.dtype() != Dtype::F16 || !geometry.extra_groups().is_empty() {
                    return Err(TransferError::Config(
                        "codec quant needs an fp16 geometry without extra groups".into(),
                    ));
                }
                let narrow = |v: u32, what: &str| {
                    u16::try_from(v)
                        .map_err(|_| TransferError::Config(format!("codec quant: {what} {v} exceeds 65535")))
                };
                let rules = |keys, values| -> Result<QuantConfig, TransferError> {
                    Ok(QuantConfig::with_rules(
                        0,
                        narrow(geometry.num_layers(), "num_layers")?,
                        geometry.block_tokens(),
                        narrow(geometry.num_kv_heads(), "num_kv_heads")?,
                        narrow(geometry.head_dim(), "head_dim")?,
                        keys,
                        values,
                        Stage::new(Backend::None, 0).map_err(cfg)?,
                    ))
                };
                // CacheGen's bins; a model with few layers cannot keep its 8-bit early layers
                // within half the fp16 size, and gets 16 bins (4-bit codes) everywhere.
                let quant = match QuantCodec::new(rules(CACHEGEN_KEYS, CACHEGEN_VALUES)?) {
                    Ok(q) => q,
                    Err(CodecError::ExceedsHalf { .. }) => {
                        QuantCodec::new(rules(SIXTEEN_BINS, SIXTEEN_BINS)?).map_err(cfg)?
                    }
                    Err(e) => return Err(cfg(e)),
                };
                let outer = LosslessCodec::with_element_bytes(backend, level, 1).map_err(cfg)?;
                (Some(outer), Some(quant))
            }
        };
        let scratch = match &quant {
            Some(q) => vec![0u8; q.max_encoded_len(block_bytes).max(block_bytes)],
            None => Vec::new(),
        };
        Ok(Encoder { codec, outer, quant, scratch })
    }

    pub fn codec(&self) -> TransferCodec {
        self.codec
    }

    /// Encodes `block` into `object` (both `block_bytes`), zero-padding the payload.
    pub fn encode(&mut self, block: &[u8], object: &mut [u8]) -> Result<(), CodecError> {
        let Some(outer) = &self.outer else {
            object.copy_from_slice(block);
            return Ok(());
        };
        let inner: &[u8] = match &self.quant {
            Some(q) => {
                let n = q.encode(block, &mut self.scratch)?;
                &self.scratch[..n]
            }
            None => block,
        };
        // The payload must fit the object: `max_encoded_len` may exceed it, so encode into a
        // buffer of that bound when the object is too small for the worst case.
        let bound = outer.max_encoded_len(inner.len());
        let n = if bound <= object.len() {
            outer.encode(inner, object)?
        } else {
            let mut tmp = vec![0u8; bound];
            let n = outer.encode(inner, &mut tmp)?;
            if n > object.len() {
                return Err(CodecError::InputSize { len: n as u64, expected: object.len() as u64 });
            }
            object[..n].copy_from_slice(&tmp[..n]);
            n
        };
        object[n..].fill(0);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fp16_block(geometry: &Geometry, seed: u32) -> Vec<u8> {
        let n = geometry.block_bytes() as usize / 2;
        (0..n as u32)
            .flat_map(|i| {
                f16::from_f32(((i.wrapping_mul(2654435761) ^ seed) % 2000) as f32 / 500.0 - 2.0).to_le_bytes()
            })
            .collect()
    }

    #[test]
    fn quant_round_trip_matches_the_codec_crate() {
        for (layers, dim) in [(2u32, 64u32), (12, 8), (3, 300), (32, 128)] {
            let g = Geometry::new(layers, 2, dim, Dtype::F16, 4, vec![]).unwrap();
            let block = fp16_block(&g, layers);
            let bb = block.len();
            let mut enc = Encoder::new(TransferCodec::Quant { backend: Backend::Lz4, level: 0 }, &g).unwrap();
            let mut object = vec![0u8; bb];
            enc.encode(&block, &mut object).unwrap();
            let mut quantized = vec![0u8; bb];
            let qlen = decompress(&object, &mut quantized, &mut vec![0u8; bb]).unwrap();
            let mut ours = vec![0u8; bb];
            dequantize(&quantized, &mut ours).unwrap();
            let mut theirs = vec![0u8; bb];
            kvtier_codec::decode(CODEC_QUANT, &quantized[..qlen], &mut theirs).unwrap();
            assert_eq!(ours, theirs, "layers {layers} dim {dim}");
            assert!(dequantize_stored(&quantized[..qlen], &mut ours).is_some(), "fast path taken");
        }
    }

    proptest::proptest! {
        /// Stored payloads are checksummed, but the decoders still take untrusted bytes: any
        /// flip or truncation is an error or some output, never a panic.
        #[test]
        fn decoders_never_panic(flips in proptest::collection::vec((0usize..4096, 0u8..8), 0..6),
                                cut in 0usize..4096, quant in proptest::bool::ANY) {
            let g = Geometry::new(2, 2, 64, Dtype::F16, 4, vec![]).unwrap();
            let block = fp16_block(&g, 3);
            let bb = block.len();
            let codec = if quant {
                TransferCodec::Quant { backend: Backend::Deflate, level: 1 }
            } else {
                TransferCodec::Lossless { backend: Backend::Zstd, level: 1 }
            };
            let mut object = vec![0u8; bb];
            Encoder::new(codec, &g).unwrap().encode(&block, &mut object).unwrap();
            let len = framed_len(&object).unwrap();
            for (pos, bit) in flips {
                object[pos % len] ^= 1 << bit;
            }
            object[(cut % bb).max(1)..].iter_mut().for_each(|b| *b = 0);
            let (mut mid, mut out, mut scratch) = (vec![0u8; bb], vec![0u8; bb], vec![0u8; bb]);
            if decompress(&object, &mut mid, &mut scratch).is_ok() && quant {
                let _ = dequantize(&mid, &mut out);
            }
            let _ = dequantize(&object, &mut out);
        }

        #[test]
        fn random_bytes_never_panic(bytes in proptest::collection::vec(proptest::num::u8::ANY, 0..600)) {
            let (mut out, mut scratch) = (vec![0u8; 512], vec![0u8; 512]);
            let _ = decompress(&bytes, &mut out, &mut scratch);
            let _ = dequantize(&bytes, &mut out);
        }
    }

    #[test]
    fn lossless_round_trip_and_corruption() {
        let g = Geometry::new(2, 2, 64, Dtype::F16, 16, vec![]).unwrap();
        let block = fp16_block(&g, 1);
        let mut enc = Encoder::new(TransferCodec::Lossless { backend: Backend::Zstd, level: 3 }, &g).unwrap();
        let mut object = vec![0u8; block.len()];
        enc.encode(&block, &mut object).unwrap();
        let mut out = vec![0u8; block.len()];
        let mut scratch = vec![0u8; block.len()];
        assert_eq!(decompress(&object, &mut out, &mut scratch).unwrap(), block.len());
        assert_eq!(out, block);
        // Same result as the codec crate's decoder.
        let len = framed_len(&object).unwrap();
        let mut theirs = vec![0u8; block.len()];
        kvtier_codec::decode(CODEC_LOSSLESS, &object[..len], &mut theirs).unwrap();
        assert_eq!(theirs, block);
        for flip in [0usize, 6, 16, 24, 25, 28, 40, len - 1] {
            let mut bad = object.clone();
            bad[flip] ^= 0x41;
            // Never a panic; a flipped header or table byte is an error (body flips may decode
            // to other bytes: the store's checksum is what catches those).
            let _ = decompress(&bad, &mut out, &mut scratch);
        }
        object[0] ^= 1;
        assert!(decompress(&object, &mut out, &mut scratch).is_err());
        assert!(framed_len(&[0u8; 10]).is_none());
    }
}
