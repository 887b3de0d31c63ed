//! The one decoder of untrusted codec payloads: [`decode_into`], allocation-free, and its
//! stages, which the transfer engine runs as separate pipeline stages (docs/transfer.md §2):
//!
//! - `raw` (0): the block itself; copied.
//! - `lossless` (1): [`decompress_lossless`] undoes the backend and the byte-plane shuffle.
//! - `quant` (2): [`decompress_quant`] undoes the backend of the three streams (scale low
//!   bytes, scale high bytes, codes) into a buffer; [`dequantize`] turns them, with the params
//!   still in the payload, into fp16 values.
//!
//! Every size is declared by the payload, checked against the others and against the caller's
//! buffers before anything is written; nothing here allocates (the caller lends `scratch`, and
//! dequantization works in fixed stack buffers). [`crate::decode`] is this decoder with a
//! reusable per-thread scratch buffer.

use half::f16;
use half::slice::HalfFloatSliceExt;

use crate::error::CodecError;
use crate::header::{self, Reader};
use crate::ids::{check_out, with_scratch, CODEC_LOSSLESS, CODEC_QUANT, CODEC_RAW};
use crate::streams::{self, unshuffle2, Stream, NO_STREAM};

/// Decoded size of a payload of codec `codec_id`, from its header alone.
pub fn decoded_len(codec_id: u16, payload: &[u8]) -> Result<usize, CodecError> {
    match codec_id {
        CODEC_RAW if payload.is_empty() => Err(CodecError::EmptyInput),
        CODEC_RAW => Ok(payload.len()),
        CODEC_LOSSLESS | CODEC_QUANT => {
            let framed = header::parse(payload, codec_id)?;
            usize::try_from(framed.decoded_len)
                .map_err(|_| CodecError::InvalidParam { what: "decoded length", value: framed.decoded_len })
        }
        id => Err(CodecError::UnknownCodec { id }),
    }
}

/// Decodes a payload of codec `codec_id` (from the object header) into `out`; returns the
/// decoded length. Errors if the payload says another codec, or on any corruption. This is
/// [`decode_into`] with this thread's reusable scratch buffer.
pub fn decode(codec_id: u16, payload: &[u8], out: &mut [u8]) -> Result<usize, CodecError> {
    let n = check_out(decoded_len(codec_id, payload)? as u64, out)?;
    let scratch_len = if codec_id == CODEC_RAW { 0 } else { n };
    with_scratch(scratch_len, |scratch| decode_into(codec_id, payload, out, scratch))
}

/// Decodes a payload of codec `codec_id` (from the object header) into `out[..n]`, `n` the
/// decoded length its header declares (at most `out.len()`); returns `n`. `scratch` must hold
/// at least `n` bytes (byte planes, quantized streams); `out[n..]` is not written. Errors if the
/// payload says another codec, or on any corruption the payload's structure reveals.
pub fn decode_into(
    codec_id: u16,
    payload: &[u8],
    out: &mut [u8],
    scratch: &mut [u8],
) -> Result<usize, CodecError> {
    let n = check_out(decoded_len(codec_id, payload)? as u64, out)?;
    let out = &mut out[..n];
    match codec_id {
        CODEC_RAW => out.copy_from_slice(payload),
        CODEC_LOSSLESS => decompress_lossless(payload, out, scratch)?,
        CODEC_QUANT => {
            let have = scratch.len() as u64;
            let scratch =
                scratch.get_mut(..n).ok_or(CodecError::OutputTooSmall { needed: n as u64, have })?;
            decompress_quant(payload, scratch)?;
            dequantize(payload, scratch, out)?;
        }
        id => return Err(CodecError::UnknownCodec { id }),
    }
    Ok(n)
}

/// Decompress stage for a `lossless` payload (exactly the payload): decodes into `out`, which
/// must be exactly the decoded length it declares. `scratch` (at least that long) holds the
/// byte planes.
pub fn decompress_lossless(payload: &[u8], out: &mut [u8], scratch: &mut [u8]) -> Result<(), CodecError> {
    let framed = header::parse(payload, CODEC_LOSSLESS)?;
    let n = usize::try_from(framed.decoded_len).unwrap_or(usize::MAX);
    if n != out.len() || n > scratch.len() {
        return Err(CodecError::LengthMismatch {
            what: "decoded length",
            declared: framed.decoded_len,
            actual: out.len() as u64,
        });
    }
    let mut r = Reader::new(framed.params, "lossless params");
    let planes = r.u8()? as usize;
    if !(1..=2).contains(&planes) || !n.is_multiple_of(planes) {
        return Err(CodecError::InvalidParam { what: "element bytes", value: planes as u64 });
    }
    if r.bytes(3)? != [0, 0, 0] {
        return Err(CodecError::InvalidParam { what: "lossless reserved bytes", value: 1 });
    }
    let plane_len = n / planes;
    let mut parts = [NO_STREAM; 2];
    let backend = streams::parse_streams(&mut r, &[plane_len; 2][..planes], framed.body, &mut parts)?;
    if r.remaining() != 0 {
        return Err(CodecError::LengthMismatch {
            what: "lossless params",
            declared: framed.params.len() as u64,
            actual: (framed.params.len() - r.remaining()) as u64,
        });
    }
    if planes == 1 {
        return streams::decode_stream(backend, &parts[0], out);
    }
    let (lo, hi) = scratch[..n].split_at_mut(plane_len);
    streams::decode_stream(backend, &parts[0], lo)?;
    streams::decode_stream(backend, &parts[1], hi)?;
    unshuffle2(lo, hi, out);
    Ok(())
}

/// A `quant` payload's params, validated.
struct QuantLayout<'a> {
    head_dim: usize,
    per_segment: usize,
    key_bins: &'a [u8],
    value_bins: &'a [u8],
    vectors: usize,
    codes_len: usize,
    /// The stream table (the rest of the params) and the body it splits.
    table: &'a [u8],
    body: &'a [u8],
}

impl QuantLayout<'_> {
    /// Bins of segment `s` (key of layer `s / 2` for even `s`, its value for odd `s`).
    fn segment_bins(&self, s: usize) -> u8 {
        if s.is_multiple_of(2) {
            self.key_bins[s / 2]
        } else {
            self.value_bins[s / 2]
        }
    }

    fn segments(&self) -> usize {
        2 * self.key_bins.len()
    }

    fn quantized_len(&self) -> usize {
        2 * self.vectors + self.codes_len
    }
}

/// Bytes of codes per vector of `head_dim` values with `bins` bins (two codes a byte up to 16).
pub(crate) fn code_bytes(bins: u8, head_dim: usize) -> usize {
    if bins <= 16 {
        head_dim / 2
    } else {
        head_dim
    }
}

/// Parses and checks a `quant` payload whose decoded length must be `decoded_len`.
fn quant_layout(payload: &[u8], decoded_len: usize) -> Result<QuantLayout<'_>, CodecError> {
    let framed = header::parse(payload, CODEC_QUANT)?;
    let bad = |what, value: u64| CodecError::InvalidParam { what, value };
    let mut r = Reader::new(framed.params, "quant params");
    let _first_layer = r.u16()?;
    let layers = r.u16()?;
    let tokens = r.u32()? as usize;
    let heads = r.u16()? as usize;
    let d = r.u16()?;
    if r.bytes(4)? != [0, 0, 0, 0] {
        return Err(bad("quant reserved bytes", 1));
    }
    let key_bins = r.bytes(layers as usize)?;
    let value_bins = r.bytes(layers as usize)?;
    if layers == 0 {
        return Err(bad("number of layers (or of bins per layer)", 0));
    }
    if tokens == 0 {
        return Err(bad("block tokens", 0));
    }
    if heads == 0 {
        return Err(bad("KV heads", 0));
    }
    if d < 2 || !d.is_multiple_of(2) {
        return Err(bad("head dim (must be even)", d as u64));
    }
    if let Some(&b) = key_bins.iter().chain(value_bins).find(|&&b| b < 3) {
        return Err(bad("bins (3..=255)", b as u64));
    }
    let d = d as usize;
    let too_big = || bad("chunk size", u64::MAX);
    let per_segment = tokens.checked_mul(heads).ok_or_else(too_big)?;
    let vectors = per_segment.checked_mul(2 * layers as usize).ok_or_else(too_big)?;
    let decoded = vectors.checked_mul(2 * d).ok_or_else(too_big)?;
    if decoded > u32::MAX as usize {
        return Err(too_big());
    }
    if decoded as u64 != framed.decoded_len || decoded != decoded_len {
        return Err(CodecError::LengthMismatch {
            what: "decoded length",
            declared: framed.decoded_len,
            actual: decoded as u64,
        });
    }
    let table = r.bytes(r.remaining())?;
    let mut q = QuantLayout {
        head_dim: d,
        per_segment,
        key_bins,
        value_bins,
        vectors,
        codes_len: 0,
        table,
        body: framed.body,
    };
    q.codes_len = (0..q.segments()).map(|s| code_bytes(q.segment_bins(s), d) * per_segment).sum();
    Ok(q)
}

/// Decompress stage for a `quant` payload: decodes its three streams into the front of `out`
/// (scale low bytes, scale high bytes, codes, back to back); `out.len()` is the decoded block
/// length (at least the quantized length, which the format guarantees for head dim ≥ 2).
pub fn decompress_quant(payload: &[u8], out: &mut [u8]) -> Result<(), CodecError> {
    let q = quant_layout(payload, out.len())?;
    let mut r = Reader::new(q.table, "quant params");
    let mut parts: [Stream<'_>; 3] = [NO_STREAM; 3];
    let backend = streams::parse_streams(&mut r, &[q.vectors, q.vectors, q.codes_len], q.body, &mut parts)?;
    if r.remaining() != 0 {
        return Err(CodecError::InvalidParam {
            what: "quant params trailing bytes",
            value: r.remaining() as u64,
        });
    }
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
/// params of `payload` (the same `quant` payload), into `out` (fp16 `BlockFirst` bytes, the
/// block). Fixed stack buffers, no allocation.
pub fn dequantize(payload: &[u8], quantized: &[u8], out: &mut [u8]) -> Result<(), CodecError> {
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
    for segment in 0..q.segments() {
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
