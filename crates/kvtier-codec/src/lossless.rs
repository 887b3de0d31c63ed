//! `lossless` (id 1): byte-plane shuffle, then one lossless backend per plane.
//!
//! fp16/bf16 KV has a structured high byte (sign, exponent, top mantissa bits) and a near-random
//! low byte. Splitting the two into planes lets the backend compress the high plane well and
//! store the low plane (see `streams`), instead of matching over interleaved noise.
//!
//! Params (docs/formats.md §5.2): u8 element bytes (1 = no shuffle, 2 = 16-bit planes), three
//! zero bytes, then the stream table with one stream per plane (plane `i` holds byte `i` of
//! every element).

use crate::codec::Codec;
use crate::error::CodecError;
use crate::header::{self, HEADER_LEN};
use crate::ids::{check_out, with_scratch, CODEC_LOSSLESS};
use crate::streams::{self, Backend, Stage};
pub use crate::streams::{shuffle2, unshuffle2};

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
