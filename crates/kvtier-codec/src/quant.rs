//! `quant` (id 2): vector-wise binning (CacheGen, as ShadowServe uses it), then a lossless stage.
//!
//! The chunk is `BlockFirst` fp16 KV: `[layer][k|v][token][head][dim]`. Each vector (one token,
//! one head: `head_dim` values) is scaled by its max |x| `s` (kept exactly as fp16) into uniform
//! levels `k s / h` for `k` in `−h..=h`, `h = ⌊(bins − 1)/2⌋` (zero is a level): code
//! `round(x h / s) + h`. So `|x − x̂| ≤ s/(2h)` plus fp16 rounding of `x̂` (2⁻¹¹ s).
//! Codes take 4 bits (bins ≤ 16, two per byte, low nibble first) or 8 bits (bins ≤ 255).
//! Bins depend on the layer and on K vs V ([`BinRule`]; CacheGen's defaults in
//! [`QuantConfig::cachegen`]). The quantized buffer (scales + codes) must be at most half the
//! fp16 size — the buffer math ShadowServe relies on — which is checked at configuration.
//!
//! Params (docs/formats.md §5.3): u16 first layer, u16 layers, u32 tokens, u16 KV heads,
//! u16 head dim, u8 key bins per layer, u8 value bins per layer, then a stream table of three
//! streams: scale low bytes, scale high bytes, codes.

use half::f16;
use half::slice::HalfFloatSliceExt;

use crate::codec::Codec;
use crate::decoder::code_bytes;
use crate::error::CodecError;
use crate::header::{self, HEADER_LEN};
use crate::ids::{check_out, with_scratch, CODEC_QUANT};
use crate::streams::{self, Backend, Stage};

/// Bins for layers `< early_layers`, and for the rest.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BinRule {
    pub early_layers: u16,
    pub early_bins: u8,
    pub late_bins: u8,
}

impl BinRule {
    pub fn bins(&self, layer: u16) -> u8 {
        if layer < self.early_layers {
            self.early_bins
        } else {
            self.late_bins
        }
    }
}

/// CacheGen's keys: 32 bins for layers 0–9, then 16.
pub const CACHEGEN_KEYS: BinRule = BinRule { early_layers: 10, early_bins: 32, late_bins: 16 };
/// CacheGen's values: 32 bins for layers 0–1, then 16.
pub const CACHEGEN_VALUES: BinRule = BinRule { early_layers: 2, early_bins: 32, late_bins: 16 };

/// What one `quant` chunk covers and how it is binned.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QuantConfig {
    pub first_layer: u16,
    pub num_layers: u16,
    pub block_tokens: u32,
    pub num_kv_heads: u16,
    pub head_dim: u16,
    /// Bins of layer `first_layer + i`, keys then values.
    pub key_bins: Vec<u8>,
    pub value_bins: Vec<u8>,
    pub stage: Stage,
}

impl QuantConfig {
    /// Layers `first_layer..first_layer + num_layers` of a block, binned by the two rules.
    #[allow(clippy::too_many_arguments)]
    pub fn with_rules(
        first_layer: u16,
        num_layers: u16,
        block_tokens: u32,
        num_kv_heads: u16,
        head_dim: u16,
        keys: BinRule,
        values: BinRule,
        stage: Stage,
    ) -> Self {
        let layers = first_layer..first_layer.saturating_add(num_layers);
        Self {
            first_layer,
            num_layers,
            block_tokens,
            num_kv_heads,
            head_dim,
            key_bins: layers.clone().map(|l| keys.bins(l)).collect(),
            value_bins: layers.map(|l| values.bins(l)).collect(),
            stage,
        }
    }

    /// CacheGen's bins with deflate level 6 (ShadowServe's choice of backend).
    pub fn cachegen(
        first_layer: u16,
        num_layers: u16,
        block_tokens: u32,
        num_kv_heads: u16,
        head_dim: u16,
    ) -> Self {
        let stage = Stage { backend: Backend::Deflate, level: 6 };
        Self::with_rules(
            first_layer,
            num_layers,
            block_tokens,
            num_kv_heads,
            head_dim,
            CACHEGEN_KEYS,
            CACHEGEN_VALUES,
            stage,
        )
    }

    fn shape(&self) -> Result<Shape, CodecError> {
        Shape::new(
            self.num_layers,
            self.block_tokens,
            self.num_kv_heads,
            self.head_dim,
            &self.key_bins,
            &self.value_bins,
        )
    }

    fn params_len(&self) -> usize {
        16 + 2 * self.num_layers as usize + streams::table_len(3)
    }
}

/// Sizes implied by a chunk's geometry and bins (validated; no overflow).
#[derive(Debug, Clone)]
struct Shape {
    head_dim: usize,
    vectors_per_segment: usize,
    /// Bins of each segment, in `[layer][k|v]` order.
    segment_bins: Vec<u8>,
    decoded_len: usize,
    num_vectors: usize,
    codes_len: usize,
}

impl Shape {
    fn new(
        num_layers: u16,
        tokens: u32,
        heads: u16,
        head_dim: u16,
        key_bins: &[u8],
        value_bins: &[u8],
    ) -> Result<Self, CodecError> {
        let bad = |what, value: u64| CodecError::InvalidParam { what, value };
        if num_layers == 0 || key_bins.len() != num_layers as usize || value_bins.len() != num_layers as usize
        {
            return Err(bad("number of layers (or of bins per layer)", num_layers as u64));
        }
        if tokens == 0 {
            return Err(bad("block tokens", 0));
        }
        if heads == 0 {
            return Err(bad("KV heads", 0));
        }
        if head_dim < 2 || !head_dim.is_multiple_of(2) {
            return Err(bad("head dim (must be even)", head_dim as u64));
        }
        let mut segment_bins = Vec::with_capacity(2 * num_layers as usize);
        for (&k, &v) in key_bins.iter().zip(value_bins) {
            for b in [k, v] {
                if b < 3 {
                    return Err(bad("bins (3..=255)", b as u64));
                }
                segment_bins.push(b);
            }
        }
        let too_big = || bad("chunk size", u64::MAX);
        let vectors_per_segment = (tokens as usize).checked_mul(heads as usize).ok_or_else(too_big)?;
        let num_vectors = vectors_per_segment.checked_mul(segment_bins.len()).ok_or_else(too_big)?;
        let decoded_len = num_vectors.checked_mul(2 * head_dim as usize).ok_or_else(too_big)?;
        if decoded_len > u32::MAX as usize {
            return Err(too_big());
        }
        let codes_len =
            segment_bins.iter().map(|&b| code_bytes(b, head_dim as usize) * vectors_per_segment).sum();
        Ok(Self {
            head_dim: head_dim as usize,
            vectors_per_segment,
            segment_bins,
            decoded_len,
            num_vectors,
            codes_len,
        })
    }

    fn quantized_len(&self) -> usize {
        2 * self.num_vectors + self.codes_len
    }
}

/// Levels on each side of zero: codes `0..=2h` stand for `(code − h) s / h`, so zero is exact
/// (most KV elements are small next to their vector's outlier) and an even `bins` leaves one
/// code unused.
fn half_levels(bins: u8) -> u8 {
    (bins - 1) / 2
}

/// Vector-wise binning + a lossless stage.
#[derive(Debug, Clone)]
pub struct QuantCodec {
    config: QuantConfig,
    shape: Shape,
}

impl QuantCodec {
    /// Validates `config`, including the half-size rule.
    pub fn new(config: QuantConfig) -> Result<Self, CodecError> {
        config.stage.backend.check_level(config.stage.level)?;
        let shape = config.shape()?;
        let (quantized, limit) = (shape.quantized_len() as u64, shape.decoded_len as u64 / 2);
        if quantized > limit {
            return Err(CodecError::ExceedsHalf { quantized, limit });
        }
        Ok(Self { config, shape })
    }

    /// Bytes of the chunk this codec encodes.
    pub fn input_len(&self) -> usize {
        self.shape.decoded_len
    }

    /// Bytes of scales + codes before the lossless stage (≤ half of `input_len`).
    pub fn quantized_len(&self) -> usize {
        self.shape.quantized_len()
    }
}

impl Codec for QuantCodec {
    fn id(&self) -> u16 {
        CODEC_QUANT
    }

    fn name(&self) -> &'static str {
        "quant"
    }

    fn max_encoded_len(&self, _input_len: usize) -> usize {
        HEADER_LEN + self.config.params_len() + self.shape.quantized_len()
    }

    fn encode(&self, input: &[u8], out: &mut [u8]) -> Result<usize, CodecError> {
        if input.is_empty() {
            return Err(CodecError::EmptyInput);
        }
        let shape = &self.shape;
        if input.len() != shape.decoded_len {
            return Err(CodecError::InputSize {
                len: input.len() as u64,
                expected: shape.decoded_len as u64,
            });
        }
        check_non_finite(input)?;
        check_out(self.max_encoded_len(input.len()) as u64, out)?;
        let params_len = self.config.params_len();
        let (head, rest) = out.split_at_mut(HEADER_LEN);
        let (params, body) = rest.split_at_mut(params_len);
        let table_at = self.write_params(params);
        let body_len = with_scratch(shape.quantized_len(), |q| {
            let (scales, codes) = q.split_at_mut(2 * shape.num_vectors);
            quantize(shape, input, scales, codes);
            // Scale high bytes (exponents) compress; low bytes mostly do not: separate streams.
            let mut planes = vec![0u8; 2 * shape.num_vectors];
            let (slo, shi) = planes.split_at_mut(shape.num_vectors);
            crate::streams::shuffle2(scales, slo, shi);
            streams::encode_streams(self.config.stage, &[slo, shi, codes], &mut params[table_at..], body)
        })?;
        header::write_header(head, CODEC_QUANT, shape.decoded_len as u64, params_len as u32, body_len as u32);
        Ok(HEADER_LEN + params_len + body_len)
    }
}

impl QuantCodec {
    /// Writes the geometry and bins; returns where the stream table starts.
    fn write_params(&self, params: &mut [u8]) -> usize {
        let c = &self.config;
        params[0..2].copy_from_slice(&c.first_layer.to_le_bytes());
        params[2..4].copy_from_slice(&c.num_layers.to_le_bytes());
        params[4..8].copy_from_slice(&c.block_tokens.to_le_bytes());
        params[8..10].copy_from_slice(&c.num_kv_heads.to_le_bytes());
        params[10..12].copy_from_slice(&c.head_dim.to_le_bytes());
        params[12..16].fill(0);
        let n = c.num_layers as usize;
        params[16..16 + n].copy_from_slice(&c.key_bins);
        params[16 + n..16 + 2 * n].copy_from_slice(&c.value_bins);
        16 + 2 * n
    }
}

/// Rejects NaN/inf (exponent bits all ones in fp16).
fn check_non_finite(input: &[u8]) -> Result<(), CodecError> {
    let mut count = 0u64;
    let mut first = None;
    for (i, pair) in input.chunks_exact(2).enumerate() {
        if pair[1] & 0x7c == 0x7c {
            count += 1;
            first.get_or_insert(i as u64);
        }
    }
    match first {
        None => Ok(()),
        Some(first_index) => Err(CodecError::NonFinite { count, first_index }),
    }
}

/// Writes each vector's scale (fp16 bits, little-endian) and its packed codes.
fn quantize(shape: &Shape, input: &[u8], scales: &mut [u8], codes: &mut [u8]) {
    let d = shape.head_dim;
    let mut values = vec![0f32; d];
    let mut bits = vec![0u16; d];
    let mut code_pos = 0;
    for (segment, &bins) in shape.segment_bins.iter().enumerate() {
        let width = code_bytes(bins, d);
        for v in 0..shape.vectors_per_segment {
            let index = segment * shape.vectors_per_segment + v;
            let raw = &input[index * 2 * d..(index + 1) * 2 * d];
            for (b, pair) in bits.iter_mut().zip(raw.chunks_exact(2)) {
                *b = u16::from_le_bytes([pair[0], pair[1]]);
            }
            // For finite fp16, magnitude order is integer order of the bits without the sign.
            let scale_bits = bits.iter().map(|b| b & 0x7fff).max().unwrap_or(0);
            scales[2 * index..2 * index + 2].copy_from_slice(&scale_bits.to_le_bytes());
            let halves: &[f16] = bytemuck_u16_as_f16(&bits);
            halves.convert_to_f32_slice(&mut values);
            let s = f16::from_bits(scale_bits).to_f32();
            let half = half_levels(bins) as f32;
            let inv = if s > 0.0 { half / s } else { 0.0 };
            let dst = &mut codes[code_pos..code_pos + width];
            let code = |x: f32| ((x * inv).round().clamp(-half, half) + half) as u8;
            if width == d {
                for (c, &x) in dst.iter_mut().zip(&values) {
                    *c = code(x);
                }
            } else {
                for (c, pair) in dst.iter_mut().zip(values.chunks_exact(2)) {
                    *c = code(pair[0]) | (code(pair[1]) << 4);
                }
            }
            code_pos += width;
        }
    }
}

fn bytemuck_u16_as_f16(bits: &[u16]) -> &[f16] {
    // SAFETY: f16 is `repr(transparent)` over u16: same size, alignment and validity.
    unsafe { std::slice::from_raw_parts(bits.as_ptr().cast::<f16>(), bits.len()) }
}
