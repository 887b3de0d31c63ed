//! Error families of kvtier-core, one enum per operation family. Messages name the wrong value
//! and the expected one, because they reach users verbatim through the Python exceptions.

use thiserror::Error;

/// A geometry that cannot describe a KV cache.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[non_exhaustive]
pub enum GeometryError {
    #[error("geometry field `{field}` is {value}; expected {expected}")]
    OutOfRange { field: &'static str, value: u64, expected: String },
    #[error("unknown dtype {0:?}; expected one of fp16, bf16, fp32, fp8_e4m3, fp8_e5m2")]
    UnknownDtype(String),
    #[error("extra KV group #{index} has an empty name; expected a non-empty name")]
    EmptyGroupName { index: usize },
    #[error("extra KV group name {0:?} appears twice; expected unique names")]
    DuplicateGroupName(String),
    #[error("block of {bytes} bytes is too large; expected at most {max} bytes per block")]
    BlockTooLarge { bytes: u64, max: u64 },
}

/// Bad input to key hashing.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[non_exhaustive]
pub enum KeyError {
    #[error("block_tokens is 0; expected at least 1")]
    ZeroBlockTokens,
    #[error("namespace field `{field}` is too long ({len} bytes); expected at most {max} bytes")]
    FieldTooLong { field: &'static str, len: usize, max: usize },
    #[error("token id {value} at index {index} is out of range; expected 0 <= id < 2**32")]
    TokenOutOfRange { index: usize, value: String },
    #[error("tokens have {bytes} bytes; expected whole items of {item_bytes} bytes (1, 2, 4 or 8)")]
    TokenItems { bytes: usize, item_bytes: usize },
}

/// Bad buffers or block tables given to a layout copy.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[non_exhaustive]
pub enum LayoutError {
    #[error("{what} buffer has {actual} bytes; expected {expected} bytes")]
    BufferSize { what: &'static str, actual: usize, expected: usize },
    #[error("block id {block_id} at position {index} is out of range; the pool has {num_blocks} blocks")]
    BlockOutOfRange { index: usize, block_id: u64, num_blocks: u64 },
    #[error("block table has {table} entries but {objects} objects were given; expected equal counts")]
    CountMismatch { table: usize, objects: usize },
    #[error("block id {block_id} appears twice in a scatter block table; expected distinct destinations")]
    DuplicateBlock { block_id: u64 },
    #[error("pool has 0 blocks; expected at least 1")]
    EmptyPool,
    #[error("object {index} has {actual} bytes; expected {expected} bytes (one block)")]
    ObjectSize { index: usize, actual: usize, expected: usize },
    #[error("paged pool: {0}")]
    Regions(String),
}

/// Bytes that are not a valid kvtier object. Corrupt bytes are reported, never used.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[non_exhaustive]
pub enum ObjectError {
    #[error("object is {len} bytes; expected at least the {need}-byte header")]
    TooShort { len: usize, need: usize },
    #[error("bad object magic {found:02x?}; expected {expected:02x?} (b\"KVTO\")")]
    BadMagic { found: [u8; 4], expected: [u8; 4] },
    #[error("object format version {found} is not supported; expected {supported}")]
    UnsupportedVersion { found: u16, supported: u16 },
    #[error("object header checksum is {found:#018x}; expected {expected:#018x} (header corrupt)")]
    HeaderChecksum { found: u64, expected: u64 },
    #[error("object payload is {actual} bytes; the header says {expected} bytes")]
    LengthMismatch { expected: u64, actual: u64 },
    #[error("object payload checksum is {found:#018x}; expected {expected:#018x} (payload corrupt)")]
    PayloadChecksum { found: u64, expected: u64 },
    #[error("object belongs to namespace {found:#034x}; expected {expected:#034x}")]
    ForeignNamespace { found: u128, expected: u128 },
    #[error("object holds key {found:#034x}; expected {expected:#034x}")]
    WrongKey { found: u128, expected: u128 },
}
