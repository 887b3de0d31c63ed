//! Encoding blocks for a lower tier, and decoding what a lower tier returns, by the codec id
//! the stored object records (`docs/formats.md` §2, §5; `docs/architecture.md`).
//!
//! **Stored form.** A block a tier's codec encodes is stored as a *codec object*: the 64-byte
//! object header (`KVTO`, with `codec id` = the codec, `payload length` and checksum of the
//! encoded bytes, namespace and key) followed by the codec payload (`KVCP` header, parameters,
//! body). On SSD the codec object is the pool object's payload; on the remote tier it is the
//! whole value (exactly the documented remote value format, with the codec id now set). A block
//! that does not shrink (encoded object ≥ `block_bytes`) or that the codec refuses (NaN/inf for
//! `quant`) is stored raw, as before: the plain `block_bytes` payload on SSD, a codec-0 value on
//! the server. So on SSD a payload of exactly `block_bytes` is a raw block and any other length
//! is a codec object, whose own header then says how to decode it (and is verified first).
//!
//! **Reading.** The object header decides, never the reader's configuration: a store configured
//! `raw` reads `lossless` objects, and so on. A codec object whose header fails, whose codec id
//! is unknown, or whose payload fails to decode to exactly `block_bytes` is a miss, counted in
//! `decode_failures` and dropped from its tier: never wrong bytes, never a panic.

use kvtier_codec::lossless::LosslessCodec;
use kvtier_codec::quant::{QuantCodec, QuantConfig};
use kvtier_codec::streams::Backend;
use kvtier_codec::Codec;
use kvtier_core::checksum::checksum;
use kvtier_core::object::decode_object;
use kvtier_core::{BlockKey, Dtype, Geometry, ObjectHeader, OBJECT_HEADER_BYTES};
use kvtier_pool::TierKind;

use crate::config::TierCodec;
use crate::error::StoreError;
use crate::stats::{bump, Counters};

/// The configured encoder of one lower tier (`None` inside: raw, nothing to encode).
pub(crate) struct TierEncoder {
    codec: Option<Box<dyn Codec>>,
}

impl std::fmt::Debug for TierEncoder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.codec.as_ref().map_or("raw", |c| c.name()))
    }
}

impl TierEncoder {
    /// Builds `codec` for blocks of `geometry`; `tier` names the config keys in errors.
    pub(crate) fn new(codec: &TierCodec, tier: &str, geometry: &Geometry) -> Result<Self, StoreError> {
        let bad = |msg: String| StoreError::Config(msg);
        let codec: Option<Box<dyn Codec>> = match codec {
            TierCodec::Raw => None,
            TierCodec::Lossless { backend, level } => {
                let b = Backend::from_name(backend).ok_or_else(|| {
                    bad(format!("{tier}.codec_backend is {backend:?}; expected zstd, lz4 or deflate"))
                })?;
                let level = level.unwrap_or_else(|| b.default_level());
                Some(Box::new(
                    LosslessCodec::new(b, level).map_err(|e| bad(format!("{tier}.codec (lossless): {e}")))?,
                ))
            }
            TierCodec::Quant => {
                if geometry.dtype() != Dtype::F16 || !geometry.extra_groups().is_empty() {
                    return Err(bad(format!(
                        "{tier}.codec is \"quant\", which needs fp16 KV with no extra groups; this store's \
                         geometry is {} with {} extra group(s) (use \"lossless\" or \"raw\")",
                        geometry.dtype().name(),
                        geometry.extra_groups().len()
                    )));
                }
                let narrow = |what: &str, v: u32| {
                    u16::try_from(v).map_err(|_| {
                        bad(format!("{tier}.codec is \"quant\": {what} {v} exceeds {}", u16::MAX))
                    })
                };
                let config = QuantConfig::cachegen(
                    0,
                    narrow("num_layers", geometry.num_layers())?,
                    geometry.block_tokens(),
                    narrow("num_kv_heads", geometry.num_kv_heads())?,
                    narrow("head_dim", geometry.head_dim())?,
                );
                Some(Box::new(
                    QuantCodec::new(config).map_err(|e| bad(format!("{tier}.codec (quant): {e}")))?,
                ))
            }
        };
        Ok(TierEncoder { codec })
    }

    /// Whether blocks are stored as given.
    pub(crate) fn is_raw(&self) -> bool {
        self.codec.is_none()
    }

    /// The codec object of `block` (header + encoded payload), or `None` when the block is to be
    /// stored raw: raw codec, the codec refused it, or it would not be smaller than the block.
    pub(crate) fn encode(&self, namespace: u128, key: BlockKey, block: &[u8]) -> Option<Vec<u8>> {
        let codec = self.codec.as_ref()?;
        let mut out = vec![0u8; OBJECT_HEADER_BYTES + codec.max_encoded_len(block.len())];
        let n = codec.encode(block, &mut out[OBJECT_HEADER_BYTES..]).ok()?;
        if OBJECT_HEADER_BYTES + n >= block.len() {
            return None;
        }
        out.truncate(OBJECT_HEADER_BYTES + n);
        let payload = &out[OBJECT_HEADER_BYTES..];
        let header = ObjectHeader::with_checksum(namespace, key, codec.id(), n as u64, checksum(payload));
        out[..OBJECT_HEADER_BYTES].copy_from_slice(&header.encode());
        Some(out)
    }
}

/// Encoded forms of a batch: `objects[i]` is `Some(codec object)` or `None` (store raw).
pub(crate) struct Encoded {
    pub objects: Vec<Option<Vec<u8>>>,
    /// Raw bytes of the blocks encoded, and the bytes of their codec objects.
    pub bytes_before: usize,
    pub bytes_after: usize,
    /// Blocks the codec refused or did not shrink (stored raw).
    pub fallbacks: usize,
}

impl Encoded {
    /// Encodes a batch, its blocks spread over up to one thread per core ([`par_each`]).
    pub(crate) fn new(encoder: &TierEncoder, namespace: u128, keys: &[BlockKey], blocks: &[&[u8]]) -> Self {
        let mut objects: Vec<Option<Vec<u8>>> = vec![None; keys.len()];
        if !encoder.is_raw() {
            let mut items: Vec<(usize, &mut Option<Vec<u8>>)> = objects.iter_mut().enumerate().collect();
            let bytes = blocks.iter().map(|b| b.len()).sum();
            par_each(&mut items, bytes, |(i, slot)| **slot = encoder.encode(namespace, keys[*i], blocks[*i]));
        }
        let mut e = Encoded {
            objects: Vec::with_capacity(keys.len()),
            bytes_before: 0,
            bytes_after: 0,
            fallbacks: 0,
        };
        for (object, block) in objects.into_iter().zip(blocks) {
            match &object {
                Some(o) => {
                    e.bytes_before += block.len();
                    e.bytes_after += o.len();
                }
                None => e.fallbacks += 1,
            }
            e.objects.push(object);
        }
        e
    }

    /// Adds this batch to the codec counters of `tier` (SSD or remote).
    pub(crate) fn count(&self, c: &Counters, tier: TierKind) {
        let (blocks, before, after, fallbacks) = match tier {
            TierKind::Ssd => (
                &c.ssd_encoded_blocks,
                &c.ssd_encoded_bytes_before,
                &c.ssd_encoded_bytes_after,
                &c.ssd_encode_fallbacks,
            ),
            _ => (
                &c.remote_encoded_blocks,
                &c.remote_encoded_bytes_before,
                &c.remote_encoded_bytes_after,
                &c.remote_encode_fallbacks,
            ),
        };
        bump(blocks, self.objects.len() - self.fallbacks);
        bump(before, self.bytes_before);
        bump(after, self.bytes_after);
        bump(fallbacks, self.fallbacks);
    }

    /// The bytes to store for item `i`: its codec object, or `raw` itself.
    pub(crate) fn stored<'a>(&'a self, i: usize, raw: &'a [u8]) -> &'a [u8] {
        self.objects[i].as_deref().unwrap_or(raw)
    }
}

/// Below this many bytes a batch is encoded or decoded on the calling thread.
const PARALLEL_BYTES_MIN: usize = 1 << 20;

/// Runs `f` on every item, spread over up to one scoped thread per core (at least 256 KiB of
/// blocks each) when the batch holds at least [`PARALLEL_BYTES_MIN`] bytes of blocks: codecs run
/// at roughly 0.1–3 GB/s per core, so a large batch on one thread would stall the put or load.
pub(crate) fn par_each<T: Send>(items: &mut [T], bytes: usize, f: impl Fn(&mut T) + Sync) {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let threads = cores.min(items.len()).min(bytes / (PARALLEL_BYTES_MIN / 4)).max(1);
    if threads == 1 || bytes < PARALLEL_BYTES_MIN {
        items.iter_mut().for_each(f);
        return;
    }
    let chunk = items.len().div_ceil(threads);
    let f = &f;
    std::thread::scope(|s| {
        for part in items.chunks_mut(chunk) {
            s.spawn(move || part.iter_mut().for_each(f));
        }
    });
}

/// Verifies the codec object `stored`: its header (magic, version, checksum, length), identity
/// (namespace, key) and payload checksum. Returns the codec id and the payload.
fn verified(namespace: u128, key: BlockKey, stored: &[u8]) -> Result<(u16, &[u8]), ()> {
    let (header, payload) = decode_object(stored).map_err(|_| ())?;
    header.expect_identity(namespace, key).map_err(|_| ())?;
    Ok((header.codec_id, payload))
}

/// Verifies the codec object `stored` as [`decode_stored`] does, without decoding it: also its
/// codec id must be known and its payload header must declare `block_bytes` decoded bytes.
/// Returns the codec id and where the payload starts in `stored` and its length.
pub(crate) fn verify_stored(
    namespace: u128,
    key: BlockKey,
    stored: &[u8],
    block_bytes: usize,
) -> Result<(u16, usize, usize), ()> {
    let (codec_id, payload) = verified(namespace, key, stored)?;
    match kvtier_codec::decoded_len(codec_id, payload) {
        Ok(n) if n == block_bytes => Ok((codec_id, OBJECT_HEADER_BYTES, payload.len())),
        _ => Err(()),
    }
}

/// Verifies the codec object `stored` (header, identity, payload checksum) and decodes it, by
/// the codec id its header names, into `dst` (exactly `dst.len()` bytes must come out).
pub(crate) fn decode_stored(namespace: u128, key: BlockKey, stored: &[u8], dst: &mut [u8]) -> Result<(), ()> {
    let (codec_id, payload) = verified(namespace, key, stored)?;
    match kvtier_codec::decode(codec_id, payload, dst) {
        Ok(n) if n == dst.len() => Ok(()),
        _ => Err(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// 4 layers: CacheGen's bins fit half the fp16 size from 3 layers on.
    fn geometry() -> Geometry {
        Geometry::new(4, 2, 64, Dtype::F16, 16, vec![]).unwrap()
    }

    #[test]
    fn encode_then_decode_by_header() {
        let g = geometry();
        let block: Vec<u8> =
            (0..g.block_bytes() as usize / 2).flat_map(|i| ((i % 13) as u16).to_le_bytes()).collect();
        let enc =
            TierEncoder::new(&TierCodec::Lossless { backend: "deflate".into(), level: None }, "ssd", &g)
                .unwrap();
        let object = enc.encode(5, 9, &block).expect("compressible");
        assert!(object.len() < block.len());
        let mut out = vec![0u8; block.len()];
        decode_stored(5, 9, &object, &mut out).unwrap();
        assert_eq!(out, block);
        assert!(decode_stored(5, 8, &object, &mut out).is_err(), "wrong key");
        let mut bad = object.clone();
        *bad.last_mut().unwrap() ^= 1;
        assert!(decode_stored(5, 9, &bad, &mut out).is_err(), "payload checksum");
    }

    #[test]
    fn incompressible_blocks_fall_back_to_raw() {
        let g = geometry();
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        let block: Vec<u8> = (0..g.block_bytes())
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x as u8
            })
            .collect();
        let enc = TierEncoder::new(&TierCodec::Lossless { backend: "zstd".into(), level: None }, "ssd", &g)
            .unwrap();
        assert!(enc.encode(1, 2, &block).is_none());
    }

    #[test]
    fn par_each_visits_every_item_once() {
        for (n, bytes) in [(1, 1 << 30), (3, 100), (64, 64 << 20), (1000, 8 << 20)] {
            let mut items: Vec<(usize, u32)> = (0..n).map(|i| (i, 0)).collect();
            par_each(&mut items, bytes, |(i, hits)| *hits += 1 + (*i as u32 % 2));
            assert!(items.iter().all(|&(i, hits)| hits == 1 + (i as u32 % 2)), "{n} items");
        }
    }

    #[test]
    fn quant_needs_fp16_without_extra_groups() {
        let g = Geometry::new(2, 2, 64, Dtype::Bf16, 16, vec![]).unwrap();
        let e = TierEncoder::new(&TierCodec::Quant, "remote", &g).unwrap_err().to_string();
        assert!(e.contains("remote.codec") && e.contains("fp16"), "{e}");
        assert!(TierEncoder::new(&TierCodec::Quant, "remote", &geometry()).is_ok());
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(128))]

        /// The store reads codec objects from SSD and remote as untrusted bytes: any flipped
        /// byte or truncation of a stored object (lossless or quant) is refused by both readers
        /// (`decode_stored` and `verify_stored`), never decoded into wrong bytes, never a panic.
        #[test]
        fn tampered_stored_objects_never_decode(quant in proptest::bool::ANY,
                                                 at in 0usize..1 << 20, flip in 1u8..=255, cut in 0usize..1 << 20) {
            let g = geometry();
            let block: Vec<u8> =
                (0..g.block_bytes() as usize / 2).flat_map(|i| ((i % 13) as u16 | 0x3c00).to_le_bytes()).collect();
            let codec = if quant { TierCodec::Quant } else { TierCodec::Lossless { backend: "zstd".into(), level: None } };
            let object = TierEncoder::new(&codec, "ssd", &g).unwrap().encode(5, 9, &block).expect("shrinks");
            let mut out = vec![0u8; block.len()];
            proptest::prop_assert!(decode_stored(5, 9, &object, &mut out).is_ok());
            let mut flipped = object.clone();
            flipped[at % object.len()] ^= flip;
            proptest::prop_assert!(decode_stored(5, 9, &flipped, &mut out).is_err());
            proptest::prop_assert!(verify_stored(5, 9, &flipped, block.len()).is_err());
            let cut = &object[..cut % object.len()];
            proptest::prop_assert!(decode_stored(5, 9, cut, &mut out).is_err());
            proptest::prop_assert!(verify_stored(5, 9, cut, block.len()).is_err());
        }
    }
}
