//! `lossless` (id 1): byte-plane shuffle, then one lossless backend per plane.
//!
//! fp16/bf16 KV has a structured high byte (sign, exponent, top mantissa bits) and a near-random
//! low byte. Splitting the two into planes lets the backend compress the high plane well and
//! store the low plane (see `streams`), instead of matching over interleaved noise.
//!
//! Params (docs/formats.md §5.2): u8 element bytes (1 = no shuffle, 2 = 16-bit planes), three
//! zero bytes, then the stream table with one stream per plane (plane `i` holds byte `i` of
//! every element).

use crate::header::{self, Reader, HEADER_LEN};
use crate::streams::{self, Backend, Stage};
use crate::{check_out, with_scratch, Codec, CodecError, CODEC_LOSSLESS};

/// Byte-plane shuffle + a lossless backend.
#[derive(Debug, Clone, Copy)]
pub struct LosslessCodec {
    stage: Stage,
    element_bytes: u8,
}

impl LosslessCodec {
    /// Shuffles 16-bit values into two planes, then compresses with `backend` at `level`.
    pub fn new(backend: Backend, level: i8) -> Result<Self, CodecError> {
        Self::with_element_bytes(backend, level, 2)
    }

    /// `element_bytes` 1 skips the shuffle; 2 splits 16-bit values into two planes.
    pub fn with_element_bytes(backend: Backend, level: i8, element_bytes: u8) -> Result<Self, CodecError> {
        if !(1..=2).contains(&element_bytes) {
            return Err(CodecError::InvalidParam { what: "element bytes", value: element_bytes as u64 });
        }
        Ok(Self { stage: Stage::new(backend, level)?, element_bytes })
    }

    fn params_len(&self) -> usize {
        4 + streams::table_len(self.element_bytes as usize)
    }
}

impl Codec for LosslessCodec {
    fn id(&self) -> u16 {
        CODEC_LOSSLESS
    }

    fn name(&self) -> &'static str {
        "lossless"
    }

    fn max_encoded_len(&self, input_len: usize) -> usize {
        HEADER_LEN + self.params_len() + input_len
    }

    fn encode(&self, input: &[u8], out: &mut [u8]) -> Result<usize, CodecError> {
        if input.is_empty() {
            return Err(CodecError::EmptyInput);
        }
        let planes = self.element_bytes as usize;
        if !input.len().is_multiple_of(planes) {
            return Err(CodecError::InputSize {
                len: input.len() as u64,
                expected: (input.len() / planes * planes) as u64,
            });
        }
        check_out(self.max_encoded_len(input.len()) as u64, out)?;
        let (head, rest) = out.split_at_mut(HEADER_LEN);
        let (params, body) = rest.split_at_mut(self.params_len());
        params[0] = self.element_bytes;
        params[1..4].fill(0);
        let body_len = if planes == 1 {
            streams::encode_streams(self.stage, &[input], &mut params[4..], body)?
        } else {
            with_scratch(input.len(), |scratch| {
                let (lo, hi) = scratch.split_at_mut(input.len() / 2);
                shuffle2(input, lo, hi);
                streams::encode_streams(self.stage, &[lo, hi], &mut params[4..], body)
            })?
        };
        header::write_header(
            head,
            CODEC_LOSSLESS,
            input.len() as u64,
            self.params_len() as u32,
            body_len as u32,
        );
        Ok(HEADER_LEN + self.params_len() + body_len)
    }
}

/// Decodes a `lossless` payload into `out`.
pub fn decode(payload: &[u8], out: &mut [u8]) -> Result<usize, CodecError> {
    let framed = header::parse(payload, CODEC_LOSSLESS)?;
    let n = check_out(framed.decoded_len, out)?;
    let mut r = Reader::new(framed.params, "lossless params");
    let planes = r.u8()? as usize;
    if !(1..=2).contains(&planes) || !n.is_multiple_of(planes) {
        return Err(CodecError::InvalidParam { what: "element bytes", value: planes as u64 });
    }
    if r.bytes(3)? != [0, 0, 0] {
        return Err(CodecError::InvalidParam { what: "lossless reserved bytes", value: 1 });
    }
    let plane_len = n / planes;
    let (backend, parts) = streams::parse_streams(&mut r, &vec![plane_len; planes], framed.body)?;
    if r.remaining() != 0 {
        return Err(CodecError::LengthMismatch {
            what: "lossless params",
            declared: framed.params.len() as u64,
            actual: (framed.params.len() - r.remaining()) as u64,
        });
    }
    let out = &mut out[..n];
    if planes == 1 {
        streams::decode_stream(backend, &parts[0], out)?;
        return Ok(n);
    }
    with_scratch(n, |scratch| {
        let (lo, hi) = scratch.split_at_mut(plane_len);
        streams::decode_stream(backend, &parts[0], lo)?;
        streams::decode_stream(backend, &parts[1], hi)?;
        unshuffle2(lo, hi, out);
        Ok(n)
    })
}

/// Splits 16-bit little-endian values into low and high byte planes.
pub fn shuffle2(input: &[u8], lo: &mut [u8], hi: &mut [u8]) {
    for ((pair, l), h) in input.chunks_exact(2).zip(lo.iter_mut()).zip(hi.iter_mut()) {
        *l = pair[0];
        *h = pair[1];
    }
}

/// Interleaves low and high byte planes back into 16-bit little-endian values.
pub fn unshuffle2(lo: &[u8], hi: &[u8], out: &mut [u8]) {
    for ((pair, &l), &h) in out.chunks_exact_mut(2).zip(lo).zip(hi) {
        pair[0] = l;
        pair[1] = h;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shuffle_round_trips() {
        let input: Vec<u8> = (0..64u8).collect();
        let (mut lo, mut hi) = (vec![0; 32], vec![0; 32]);
        shuffle2(&input, &mut lo, &mut hi);
        assert_eq!(lo[1], 2);
        assert_eq!(hi[1], 3);
        let mut out = vec![0; 64];
        unshuffle2(&lo, &hi, &mut out);
        assert_eq!(out, input);
    }
}
