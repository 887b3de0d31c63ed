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

mod codec;
pub mod decoder;
mod error;
pub mod header;
mod ids;
pub mod lossless;
pub mod quant;
pub mod raw;
pub mod streams;

pub use codec::Codec;
pub use decoder::{decode, decode_into, decoded_len};
pub use error::CodecError;
pub use ids::{codec_id, CODEC_LOSSLESS, CODEC_NAMES, CODEC_QUANT, CODEC_RAW};
