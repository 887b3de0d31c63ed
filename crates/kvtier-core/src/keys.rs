//! Namespaced, chained 128-bit block keys (DESIGN §2).
//!
//! ```text
//! ns      = XXH3-128(seed = KEY_SEED, "kvtier-ns" ‖ NAMESPACE_VERSION ‖ model_id ‖ geometry ‖
//!                    layout_version ‖ cache_salt ‖ rank)
//! h_0     = XXH3-128(seed = KEY_SEED, ns ‖ tokens of block 0 ‖ extra)
//! h_i     = XXH3-128(seed = KEY_SEED, h_{i-1} ‖ tokens of block i ‖ extra)
//! ```
//! All integers little-endian; strings are a u32 byte length then UTF-8 bytes; `ns` and `h` are
//! 16 bytes, u128 little-endian; tokens are u32. The seed is fixed, so every process and node
//! derives the same keys without configuration. Only full blocks get keys: the trailing partial
//! block of a prompt is never cached (its KV would change as tokens are appended).
//! Golden vectors: `tests/it/golden_keys.rs` (Rust) and `tests/test_keys.py` (Python).

use xxhash_rust::xxh3::xxh3_128_with_seed;

use crate::error::KeyError;
use crate::geometry::Geometry;

/// A block key. Two blocks share a key only if they share namespace and every token before them.
pub type BlockKey = u128;

/// Fixed hash seed: ASCII "kvtier\0\x01". Changing it invalidates every stored cache.
pub const KEY_SEED: u64 = 0x6b76_7469_6572_0001;
/// Version of the namespace encoding above; bump when it changes.
pub const NAMESPACE_VERSION: u32 = 1;
/// Bound on each namespace string (model id, salt), in bytes.
pub const NAMESPACE_FIELD_BYTES_MAX: usize = 4096;

/// What keeps caches apart: model weights, KV geometry, layout version, tenant salt, parallel rank.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Namespace {
    /// Identifies the weights (e.g. `meta-llama/Llama-3.1-8B@<revision>`).
    pub model_id: String,
    pub geometry: Geometry,
    /// Version of the object layout; bump when BlockFirst byte order changes.
    pub layout_version: u32,
    /// Tenant isolation salt (vLLM's `cache_salt`); empty string for a shared cache.
    pub cache_salt: String,
    /// Tensor/pipeline-parallel rank whose shard of KV this is.
    pub rank: u32,
}

fn push_str(out: &mut Vec<u8>, field: &'static str, s: &str) -> Result<(), KeyError> {
    if s.len() > NAMESPACE_FIELD_BYTES_MAX {
        return Err(KeyError::FieldTooLong { field, len: s.len(), max: NAMESPACE_FIELD_BYTES_MAX });
    }
    out.extend_from_slice(&(s.len() as u32).to_le_bytes());
    out.extend_from_slice(s.as_bytes());
    Ok(())
}

impl Namespace {
    /// The namespace hash that seeds every key chain of this namespace.
    pub fn hash(&self) -> Result<u128, KeyError> {
        let mut buf = Vec::with_capacity(128);
        buf.extend_from_slice(b"kvtier-ns");
        buf.extend_from_slice(&NAMESPACE_VERSION.to_le_bytes());
        push_str(&mut buf, "model_id", &self.model_id)?;
        buf.extend_from_slice(&self.geometry.fingerprint_bytes());
        buf.extend_from_slice(&self.layout_version.to_le_bytes());
        push_str(&mut buf, "cache_salt", &self.cache_salt)?;
        buf.extend_from_slice(&self.rank.to_le_bytes());
        Ok(xxh3_128_with_seed(&buf, KEY_SEED))
    }
}

/// Keys of every full block of `tokens`, chained from `namespace_hash`.
///
/// `extra` is mixed into every block (e.g. a LoRA adapter id or a multimodal content hash); pass
/// `&[]` for none. One call hashes a whole prompt: 128K tokens take well under a millisecond.
pub fn block_keys(
    namespace_hash: u128,
    tokens: &[u32],
    block_tokens: u32,
    extra: &[u8],
) -> Result<Vec<BlockKey>, KeyError> {
    if block_tokens == 0 {
        return Err(KeyError::ZeroBlockTokens);
    }
    let block_tokens = block_tokens as usize;
    let num_blocks = tokens.len() / block_tokens;
    let mut keys = Vec::with_capacity(num_blocks);
    let mut buf = Vec::with_capacity(16 + 4 * block_tokens + extra.len());
    let mut parent = namespace_hash;
    for block in tokens.chunks_exact(block_tokens) {
        buf.clear();
        buf.extend_from_slice(&parent.to_le_bytes());
        for token in block {
            buf.extend_from_slice(&token.to_le_bytes());
        }
        buf.extend_from_slice(extra);
        parent = xxh3_128_with_seed(&buf, KEY_SEED);
        keys.push(parent);
    }
    Ok(keys)
}

/// Token ids from native-endian integer items of `item_bytes` (1, 2, 4 or 8) bytes each, signed
/// or not (an integer buffer: numpy arrays of any int dtype, `array.array`). Every id must be
/// `0 <= id < 2**32`; the first that is not is named with its index.
pub fn token_ids_from_ints(bytes: &[u8], item_bytes: usize, signed: bool) -> Result<Vec<u32>, KeyError> {
    let mut ids = Vec::with_capacity(bytes.len() / item_bytes.max(1));
    macro_rules! convert {
        ($t:ty) => {
            for (index, c) in bytes.chunks_exact(item_bytes).enumerate() {
                let v = <$t>::from_ne_bytes(c.try_into().expect("item size"));
                let out_of_range = || KeyError::TokenOutOfRange { index, value: v.to_string() };
                ids.push(u32::try_from(v).map_err(|_| out_of_range())?);
            }
        };
    }
    match (item_bytes, signed) {
        _ if item_bytes == 0 || !bytes.len().is_multiple_of(item_bytes) => {
            return Err(KeyError::TokenItems { bytes: bytes.len(), item_bytes });
        }
        (1, false) => ids.extend(bytes.iter().map(|&b| u32::from(b))),
        (1, true) => convert!(i8),
        (2, false) => convert!(u16),
        (2, true) => convert!(i16),
        (4, false) => convert!(u32),
        (4, true) => convert!(i32),
        (8, false) => convert!(u64),
        (8, true) => convert!(i64),
        _ => return Err(KeyError::TokenItems { bytes: bytes.len(), item_bytes }),
    }
    Ok(ids)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::geometry::Dtype;

    fn ns(salt: &str) -> Namespace {
        Namespace {
            model_id: "m".into(),
            geometry: Geometry::new(2, 2, 4, Dtype::F16, 4, vec![]).unwrap(),
            layout_version: 1,
            cache_salt: salt.into(),
            rank: 0,
        }
    }

    #[test]
    fn partial_block_gets_no_key() {
        let h = ns("").hash().unwrap();
        assert_eq!(block_keys(h, &[1, 2, 3], 4, &[]).unwrap().len(), 0);
        assert_eq!(block_keys(h, &[1, 2, 3, 4, 5], 4, &[]).unwrap().len(), 1);
    }

    #[test]
    fn chain_depends_on_prefix() {
        let h = ns("").hash().unwrap();
        let a = block_keys(h, &[1, 2, 3, 4, 5, 6, 7, 8], 4, &[]).unwrap();
        let b = block_keys(h, &[9, 2, 3, 4, 5, 6, 7, 8], 4, &[]).unwrap();
        assert_ne!(a[1], b[1], "second block must differ when the first differs");
        let c = block_keys(h, &[1, 2, 3, 4], 4, &[]).unwrap();
        assert_eq!(a[0], c[0], "a prefix has the same keys");
    }

    #[test]
    fn salt_and_extra_separate() {
        let t = [1, 2, 3, 4];
        let a = block_keys(ns("").hash().unwrap(), &t, 4, &[]).unwrap();
        let b = block_keys(ns("tenant-b").hash().unwrap(), &t, 4, &[]).unwrap();
        let c = block_keys(ns("").hash().unwrap(), &t, 4, b"lora-1").unwrap();
        assert_ne!(a, b);
        assert_ne!(a, c);
    }

    #[test]
    fn rejects_zero_block_tokens_and_long_fields() {
        assert_eq!(block_keys(0, &[1], 0, &[]), Err(KeyError::ZeroBlockTokens));
        let mut n = ns("");
        n.model_id = "x".repeat(NAMESPACE_FIELD_BYTES_MAX + 1);
        assert!(matches!(n.hash(), Err(KeyError::FieldTooLong { field: "model_id", .. })));
    }

    #[test]
    fn token_ids_from_ints_convert_every_width_and_name_the_first_bad_id() {
        let ne = |v: &[i64]| v.iter().flat_map(|x| x.to_ne_bytes()).collect::<Vec<u8>>();
        assert_eq!(token_ids_from_ints(&ne(&[0, 7, u32::MAX.into()]), 8, true).unwrap(), [0, 7, u32::MAX]);
        assert_eq!(token_ids_from_ints(&[255, 1], 1, false).unwrap(), [255, 1]);
        assert_eq!(token_ids_from_ints(&(-1i16).to_ne_bytes(), 2, false).unwrap(), [65535]);
        let e = token_ids_from_ints(&ne(&[1, -5]), 8, true).unwrap_err();
        assert_eq!(e, KeyError::TokenOutOfRange { index: 1, value: "-5".into() });
        let big = ne(&[1, 2, 1 << 32]);
        assert!(token_ids_from_ints(&big, 8, true)
            .unwrap_err()
            .to_string()
            .contains("4294967296 at index 2"));
        assert!(matches!(token_ids_from_ints(&[0; 3], 2, false), Err(KeyError::TokenItems { bytes: 3, .. })));
        assert!(matches!(token_ids_from_ints(&[0; 3], 3, false), Err(KeyError::TokenItems { .. })));
    }
}
