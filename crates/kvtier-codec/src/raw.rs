//! `raw` (id 0): the payload is the chunk itself, as the object format stores it.

use crate::codec::Codec;
use crate::error::CodecError;
use crate::ids::{check_out, CODEC_RAW};

/// The identity codec.
#[derive(Debug, Clone, Copy, Default)]
pub struct RawCodec;

impl Codec for RawCodec {
    fn id(&self) -> u16 {
        CODEC_RAW
    }

    fn name(&self) -> &'static str {
        "raw"
    }

    fn max_encoded_len(&self, input_len: usize) -> usize {
        input_len
    }

    fn encode(&self, input: &[u8], out: &mut [u8]) -> Result<usize, CodecError> {
        decode(input, out)
    }
}

/// Copies `payload` into `out`.
pub fn decode(payload: &[u8], out: &mut [u8]) -> Result<usize, CodecError> {
    if payload.is_empty() {
        return Err(CodecError::EmptyInput);
    }
    let n = check_out(payload.len() as u64, out)?;
    out[..n].copy_from_slice(payload);
    Ok(n)
}
