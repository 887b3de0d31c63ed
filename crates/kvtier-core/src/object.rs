//! The byte format of a stored block: a 64-byte little-endian header, then the payload.
//! Byte-by-byte description: `docs/formats.md`. Decoding untrusted bytes never panics; every
//! failure is a typed [`ObjectError`], which stores turn into a counted miss.

use crate::checksum::checksum;
use crate::error::ObjectError;
use crate::keys::BlockKey;

pub const OBJECT_MAGIC: [u8; 4] = *b"KVTO";
pub const OBJECT_FORMAT_VERSION: u16 = 1;
pub const OBJECT_HEADER_BYTES: usize = 64;
/// Codec id of an uncompressed payload. Other ids belong to `kvtier-codec`.
pub const CODEC_RAW: u16 = 0;

/// Decoded header of an object.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ObjectHeader {
    pub codec_id: u16,
    pub payload_len: u64,
    pub namespace: u128,
    pub key: BlockKey,
    pub payload_checksum: u64,
}

impl ObjectHeader {
    /// Header for `payload`, computing its checksum.
    pub fn for_payload(namespace: u128, key: BlockKey, codec_id: u16, payload: &[u8]) -> Self {
        Self::with_checksum(namespace, key, codec_id, payload.len() as u64, checksum(payload))
    }

    /// Header for a payload whose checksum was computed elsewhere (e.g. during a fused copy).
    pub fn with_checksum(
        namespace: u128,
        key: BlockKey,
        codec_id: u16,
        payload_len: u64,
        payload_checksum: u64,
    ) -> Self {
        ObjectHeader { codec_id, payload_len, namespace, key, payload_checksum }
    }

    pub fn encode(&self) -> [u8; OBJECT_HEADER_BYTES] {
        let mut h = [0u8; OBJECT_HEADER_BYTES];
        h[0..4].copy_from_slice(&OBJECT_MAGIC);
        h[4..6].copy_from_slice(&OBJECT_FORMAT_VERSION.to_le_bytes());
        h[6..8].copy_from_slice(&self.codec_id.to_le_bytes());
        h[8..16].copy_from_slice(&self.payload_len.to_le_bytes());
        h[16..32].copy_from_slice(&self.namespace.to_le_bytes());
        h[32..48].copy_from_slice(&self.key.to_le_bytes());
        h[48..56].copy_from_slice(&self.payload_checksum.to_le_bytes());
        let header_checksum = checksum(&h[0..56]);
        h[56..64].copy_from_slice(&header_checksum.to_le_bytes());
        h
    }

    /// Decodes and verifies the header at the start of `bytes` (the payload is not checked here).
    pub fn decode(bytes: &[u8]) -> Result<Self, ObjectError> {
        if bytes.len() < OBJECT_HEADER_BYTES {
            return Err(ObjectError::TooShort { len: bytes.len(), need: OBJECT_HEADER_BYTES });
        }
        let h = &bytes[..OBJECT_HEADER_BYTES];
        let magic: [u8; 4] = h[0..4].try_into().expect("4 bytes");
        if magic != OBJECT_MAGIC {
            return Err(ObjectError::BadMagic { found: magic, expected: OBJECT_MAGIC });
        }
        let version = u16::from_le_bytes(h[4..6].try_into().expect("2 bytes"));
        if version != OBJECT_FORMAT_VERSION {
            return Err(ObjectError::UnsupportedVersion { found: version, supported: OBJECT_FORMAT_VERSION });
        }
        let stored = u64::from_le_bytes(h[56..64].try_into().expect("8 bytes"));
        let computed = checksum(&h[0..56]);
        if stored != computed {
            return Err(ObjectError::HeaderChecksum { found: stored, expected: computed });
        }
        Ok(ObjectHeader {
            codec_id: u16::from_le_bytes(h[6..8].try_into().expect("2 bytes")),
            payload_len: u64::from_le_bytes(h[8..16].try_into().expect("8 bytes")),
            namespace: u128::from_le_bytes(h[16..32].try_into().expect("16 bytes")),
            key: u128::from_le_bytes(h[32..48].try_into().expect("16 bytes")),
            payload_checksum: u64::from_le_bytes(h[48..56].try_into().expect("8 bytes")),
        })
    }

    /// Checks that this header belongs to `namespace`/`key`.
    pub fn expect_identity(&self, namespace: u128, key: BlockKey) -> Result<(), ObjectError> {
        if self.namespace != namespace {
            return Err(ObjectError::ForeignNamespace { found: self.namespace, expected: namespace });
        }
        if self.key != key {
            return Err(ObjectError::WrongKey { found: self.key, expected: key });
        }
        Ok(())
    }
}

/// Header followed by payload, as written to SSD and remote tiers.
pub fn encode_object(namespace: u128, key: BlockKey, codec_id: u16, payload: &[u8]) -> Vec<u8> {
    let header = ObjectHeader::for_payload(namespace, key, codec_id, payload);
    let mut out = Vec::with_capacity(OBJECT_HEADER_BYTES + payload.len());
    out.extend_from_slice(&header.encode());
    out.extend_from_slice(payload);
    out
}

/// Decodes a whole object, verifying header, length and payload checksum.
pub fn decode_object(bytes: &[u8]) -> Result<(ObjectHeader, &[u8]), ObjectError> {
    let header = ObjectHeader::decode(bytes)?;
    let payload = &bytes[OBJECT_HEADER_BYTES..];
    if payload.len() as u64 != header.payload_len {
        return Err(ObjectError::LengthMismatch {
            expected: header.payload_len,
            actual: payload.len() as u64,
        });
    }
    let found = checksum(payload);
    if found != header.payload_checksum {
        return Err(ObjectError::PayloadChecksum { found, expected: header.payload_checksum });
    }
    Ok((header, payload))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn round_trip() {
        let payload = b"hello kv".to_vec();
        let obj = encode_object(7, 9, CODEC_RAW, &payload);
        let (h, p) = decode_object(&obj).unwrap();
        assert_eq!((h.namespace, h.key, h.payload_len), (7, 9, 8));
        assert_eq!(p, &payload[..]);
        h.expect_identity(7, 9).unwrap();
        assert!(matches!(h.expect_identity(8, 9), Err(ObjectError::ForeignNamespace { .. })));
        assert!(matches!(h.expect_identity(7, 8), Err(ObjectError::WrongKey { .. })));
    }

    #[test]
    fn typed_errors() {
        let obj = encode_object(1, 2, CODEC_RAW, &[5u8; 100]);
        assert!(matches!(decode_object(&obj[..10]), Err(ObjectError::TooShort { .. })));
        let mut bad = obj.clone();
        bad[0] = b'X';
        assert!(matches!(decode_object(&bad), Err(ObjectError::BadMagic { .. })));
        let mut bad = obj.clone();
        bad[4] = 9;
        assert!(matches!(decode_object(&bad), Err(ObjectError::UnsupportedVersion { found: 9, .. })));
        let mut bad = obj.clone();
        bad[20] ^= 1;
        assert!(matches!(decode_object(&bad), Err(ObjectError::HeaderChecksum { .. })));
        assert!(matches!(decode_object(&obj[..obj.len() - 1]), Err(ObjectError::LengthMismatch { .. })));
        let mut bad = obj.clone();
        bad[OBJECT_HEADER_BYTES + 50] ^= 0x10;
        assert!(matches!(decode_object(&bad), Err(ObjectError::PayloadChecksum { .. })));
    }

    proptest! {
        #[test]
        fn any_single_byte_flip_is_detected(payload in proptest::collection::vec(any::<u8>(), 1..512),
                                            pos in any::<prop::sample::Index>(), bit in 0u8..8) {
            let mut obj = encode_object(3, 4, CODEC_RAW, &payload);
            let i = pos.index(obj.len());
            obj[i] ^= 1 << bit;
            prop_assert!(decode_object(&obj).is_err());
        }

        #[test]
        fn decode_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..200)) {
            let _ = decode_object(&bytes);
        }
    }
}
