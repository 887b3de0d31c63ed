//! The codec error family. Every decoder of untrusted bytes returns one of these; none panics.

use thiserror::Error;

/// Why a codec could not encode or decode a chunk.
#[derive(Debug, Error, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum CodecError {
    #[error("empty input: codecs encode and decode at least one byte")]
    EmptyInput,
    #[error("unknown codec id {id}; known: 0 (raw), 1 (lossless), 2 (quant)")]
    UnknownCodec { id: u16 },
    #[error("payload is codec {found}; the reader expected codec {expected}")]
    CodecMismatch { expected: u16, found: u16 },
    #[error("unknown lossless backend {code}; known: 0 (none), 1 (zstd), 2 (lz4), 3 (deflate)")]
    UnknownBackend { code: u8 },
    #[error("payload magic is not KVCP")]
    BadMagic,
    #[error("codec payload version {version} is not supported (expected 1)")]
    UnsupportedVersion { version: u16 },
    #[error("payload truncated: {what} needs {needed} bytes, {have} present")]
    Truncated { what: &'static str, needed: u64, have: u64 },
    #[error("{what} declares {declared} bytes but {actual} are implied")]
    LengthMismatch { what: &'static str, declared: u64, actual: u64 },
    #[error("invalid {what}: {value}")]
    InvalidParam { what: &'static str, value: u64 },
    #[error("output buffer has {have} bytes; the decoded chunk needs {needed}")]
    OutputTooSmall { needed: u64, have: u64 },
    #[error("input has {len} bytes; expected {expected}")]
    InputSize { len: u64, expected: u64 },
    #[error("{backend} stream is corrupt (or does not decode to its declared size)")]
    Corrupt { backend: &'static str },
    #[error("{backend} compression failed")]
    CompressFailed { backend: &'static str },
    #[error("input holds {count} NaN/inf values (first at element {first_index}); quant rejects them")]
    NonFinite { count: u64, first_index: u64 },
    #[error("quantized size {quantized} bytes exceeds half the fp16 size ({limit} bytes); use fewer bins")]
    ExceedsHalf { quantized: u64, limit: u64 },
}
