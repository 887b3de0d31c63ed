//! KV codecs: turn a chunk of KV bytes (a `BlockFirst` object or a slice of one) into a
//! self-describing payload and back, writing into caller buffers.
//!
//! | id | codec | what | payload |
//! |---|---|---|---|
//! | 0 | [`raw`] | identity | the chunk bytes (no header) |
//! | 1 | [`lossless`] | byte-plane shuffle of 16-bit values, then zstd / lz4 / deflate | `KVCP` header |
//! | 2 | [`quant`] | CacheGen/ShadowServe vector-wise binning, then a lossless stage | `KVCP` header |
//!
//! The codec id goes in the object header (`docs/formats.md` §2) and is repeated in the payload
//! header (§5), with every parameter a decoder needs, so a reader never guesses.
//!
//! Invariants:
//! - Decoding untrusted bytes never panics: every size is declared, checked against the others
//!   and against the caller's buffer before anything is allocated or written.
//! - `raw` and `lossless` round-trip exactly. `quant` errs by at most
//!   `scale × (1/(2h) + 2⁻¹⁰)` per element, `h = ⌊(bins − 1)/2⌋`, `scale` the vector's max |x|.
//! - `quant` rejects NaN/inf input with [`CodecError::NonFinite`] and never emits more than half
//!   the fp16 size before its lossless stage ([`CodecError::ExceedsHalf`] at configuration).
//!
//! ```
//! use kvtier_codec::{decode, Codec, lossless::LosslessCodec, streams::Backend};
//! let kv: Vec<u8> = (0..4096u32).flat_map(|i| ((i % 97) as u16).to_le_bytes()).collect();
//! let codec = LosslessCodec::new(Backend::Deflate, 6).unwrap();
//! let mut payload = vec![0; codec.max_encoded_len(kv.len())];
//! let n = codec.encode(&kv, &mut payload).unwrap();
//! let mut out = vec![0; kv.len()];
//! decode(codec.id(), &payload[..n], &mut out).unwrap();
//! assert_eq!(out, kv);
//! ```

mod error;
pub mod header;
pub mod lossless;
pub mod quant;
pub mod raw;
pub mod streams;

pub use error::CodecError;

/// Codec ids, as recorded in the object header's `codec id` field.
pub const CODEC_RAW: u16 = 0;
pub const CODEC_LOSSLESS: u16 = 1;
pub const CODEC_QUANT: u16 = 2;

/// Names of the known codecs, indexed by id.
pub const CODEC_NAMES: [&str; 3] = ["raw", "lossless", "quant"];

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

/// The id of the codec called `name`, or `None`.
pub fn codec_id(name: &str) -> Option<u16> {
    CODEC_NAMES.iter().position(|n| *n == name).map(|i| i as u16)
}

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
/// decoded length. Errors if the payload says another codec, or on any corruption.
pub fn decode(codec_id: u16, payload: &[u8], out: &mut [u8]) -> Result<usize, CodecError> {
    match codec_id {
        CODEC_RAW => raw::decode(payload, out),
        CODEC_LOSSLESS => lossless::decode(payload, out),
        CODEC_QUANT => quant::decode(payload, out),
        id => Err(CodecError::UnknownCodec { id }),
    }
}

/// Checks that `out` can hold `needed` bytes.
pub(crate) fn check_out(needed: u64, out: &[u8]) -> Result<usize, CodecError> {
    if (out.len() as u64) < needed {
        return Err(CodecError::OutputTooSmall { needed, have: out.len() as u64 });
    }
    Ok(needed as usize)
}

/// A thread's reusable scratch buffer (decoders run on many threads at once).
pub(crate) fn with_scratch<R>(len: usize, f: impl FnOnce(&mut [u8]) -> R) -> R {
    thread_local! {
        static SCRATCH: std::cell::RefCell<Vec<u8>> = const { std::cell::RefCell::new(Vec::new()) };
    }
    SCRATCH.with(|s| {
        let mut s = s.borrow_mut();
        if s.len() < len {
            s.resize(len, 0);
        }
        f(&mut s[..len])
    })
}
