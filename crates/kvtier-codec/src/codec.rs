//! The [`Codec`] trait every codec implements.

use crate::decoder::decode;
use crate::error::CodecError;

/// A codec: configured for encoding; any instance decodes any payload of its id (the payload
/// header carries the parameters).
pub trait Codec: Send + Sync {
    /// The id recorded in object and payload headers.
    fn id(&self) -> u16;
    /// The registry name (`raw`, `lossless`, `quant`).
    fn name(&self) -> &'static str;
    /// An upper bound on the payload size for an input of `input_len` bytes.
    fn max_encoded_len(&self, input_len: usize) -> usize;
    /// Encodes `input` into `out` (at least `max_encoded_len` bytes); returns the payload length.
    fn encode(&self, input: &[u8], out: &mut [u8]) -> Result<usize, CodecError>;
    /// Decodes `payload` into `out`; returns the decoded length.
    fn decode(&self, payload: &[u8], out: &mut [u8]) -> Result<usize, CodecError> {
        decode(self.id(), payload, out)
    }
}
