//! On-disk byte formats of the SSD pool (described byte by byte in `docs/formats.md` §4):
//! the device superblock, the index log's file header, and its 80-byte records. Objects on a
//! device are bare payloads (zero-padded to whole pages): their identity, length and checksum
//! live in the log records, and every read checks the payload against them.
//!
//! Every structure ends with an XXH3-64 checksum of the bytes before it, so a torn or flipped
//! write is detected. Log records are checksummed with a seed derived from the pool id and the
//! log generation, so a record of another pool or of an older log never validates. Decoding
//! untrusted bytes never panics.

use xxhash_rust::xxh3::xxh3_64_with_seed;

use crate::extent::PAGE_BYTES;

pub const DEVICE_MAGIC: [u8; 4] = *b"KVTD";
pub const LOG_MAGIC: [u8; 4] = *b"KVTL";
pub const SSD_FORMAT_VERSION: u16 = 1;
/// Bytes of the device superblock region (one page; the first 64 bytes are used).
pub const SUPERBLOCK_BYTES: u64 = PAGE_BYTES;
pub const LOG_HEADER_BYTES: usize = 64;
pub const RECORD_BYTES: usize = 80;

pub const RECORD_PUT: u8 = 1;
pub const RECORD_DELETE: u8 = 2;

fn u16_at(b: &[u8], at: usize) -> u16 {
    u16::from_le_bytes(b[at..at + 2].try_into().expect("2 bytes"))
}
fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(b[at..at + 4].try_into().expect("4 bytes"))
}
fn u64_at(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().expect("8 bytes"))
}
fn u128_at(b: &[u8], at: usize) -> u128 {
    u128::from_le_bytes(b[at..at + 16].try_into().expect("16 bytes"))
}

/// Page 0 of every device: which pool it belongs to and where its object space lies.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Superblock {
    pub pool_id: u128,
    pub device_index: u16,
    pub device_count: u16,
    /// Byte offset of the object space from the start of the device (page-aligned).
    pub data_offset: u64,
    /// Bytes of object space (page multiple).
    pub data_bytes: u64,
}

impl Superblock {
    pub fn encode(&self) -> [u8; 64] {
        let mut b = [0u8; 64];
        b[0..4].copy_from_slice(&DEVICE_MAGIC);
        b[4..6].copy_from_slice(&SSD_FORMAT_VERSION.to_le_bytes());
        b[6..8].copy_from_slice(&self.device_index.to_le_bytes());
        b[8..24].copy_from_slice(&self.pool_id.to_le_bytes());
        b[24..32].copy_from_slice(&self.data_offset.to_le_bytes());
        b[32..40].copy_from_slice(&self.data_bytes.to_le_bytes());
        b[40..42].copy_from_slice(&self.device_count.to_le_bytes());
        b[42..46].copy_from_slice(&(PAGE_BYTES as u32).to_le_bytes());
        let sum = xxh3_64_with_seed(&b[0..56], 0);
        b[56..64].copy_from_slice(&sum.to_le_bytes());
        b
    }

    /// Decodes the first 64 bytes of a device; `Err` says what is wrong.
    pub fn decode(b: &[u8]) -> Result<Superblock, String> {
        if b.len() < 64 {
            return Err(format!("superblock is {} bytes; expected 64", b.len()));
        }
        if b[0..4] != DEVICE_MAGIC {
            return Err("no kvtier device superblock (magic is not KVTD)".into());
        }
        let version = u16_at(b, 4);
        if version != SSD_FORMAT_VERSION {
            return Err(format!("device format version {version}; this build reads {SSD_FORMAT_VERSION}"));
        }
        if u64_at(b, 56) != xxh3_64_with_seed(&b[0..56], 0) {
            return Err("device superblock checksum mismatch".into());
        }
        let page = u32_at(b, 42);
        if u64::from(page) != PAGE_BYTES {
            return Err(format!("device page size {page}; expected {PAGE_BYTES}"));
        }
        let sb = Superblock {
            pool_id: u128_at(b, 8),
            device_index: u16_at(b, 6),
            device_count: u16_at(b, 40),
            data_offset: u64_at(b, 24),
            data_bytes: u64_at(b, 32),
        };
        if sb.data_offset % PAGE_BYTES != 0 || sb.data_bytes % PAGE_BYTES != 0 || sb.data_offset == 0 {
            return Err(format!("device regions not page-aligned: {sb:?}"));
        }
        Ok(sb)
    }
}

/// The first 64 bytes of the index log.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LogHeader {
    pub pool_id: u128,
    pub device_count: u16,
    /// Bumped by every compaction (a new log file replaces the old one).
    pub generation: u64,
}

impl LogHeader {
    pub fn encode(&self) -> [u8; LOG_HEADER_BYTES] {
        let mut b = [0u8; LOG_HEADER_BYTES];
        b[0..4].copy_from_slice(&LOG_MAGIC);
        b[4..6].copy_from_slice(&SSD_FORMAT_VERSION.to_le_bytes());
        b[6..8].copy_from_slice(&self.device_count.to_le_bytes());
        b[8..24].copy_from_slice(&self.pool_id.to_le_bytes());
        b[24..32].copy_from_slice(&self.generation.to_le_bytes());
        let sum = xxh3_64_with_seed(&b[0..56], 0);
        b[56..64].copy_from_slice(&sum.to_le_bytes());
        b
    }

    pub fn decode(b: &[u8]) -> Result<LogHeader, String> {
        if b.len() < LOG_HEADER_BYTES {
            return Err(format!(
                "index log is {} bytes; expected at least a {LOG_HEADER_BYTES}-byte header",
                b.len()
            ));
        }
        if b[0..4] != LOG_MAGIC {
            return Err("not a kvtier index log (magic is not KVTL)".into());
        }
        let version = u16_at(b, 4);
        if version != SSD_FORMAT_VERSION {
            return Err(format!("index log format version {version}; this build reads {SSD_FORMAT_VERSION}"));
        }
        if u64_at(b, 56) != xxh3_64_with_seed(&b[0..56], 0) {
            return Err("index log header checksum mismatch".into());
        }
        Ok(LogHeader { pool_id: u128_at(b, 8), device_count: u16_at(b, 6), generation: u64_at(b, 24) })
    }

    /// Seed of this log's record checksums.
    pub fn record_seed(&self) -> u64 {
        (self.pool_id as u64)
            ^ ((self.pool_id >> 64) as u64)
            ^ self.generation.wrapping_mul(0x9e37_79b9_7f4a_7c15)
    }
}

/// One index-log record: an object became readable (`Put`) or left the pool (`Delete`), with
/// everything a read needs to verify it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Record {
    pub kind: u8,
    pub device: u16,
    /// Extent length in pages (the payload rounded up; at least one).
    pub pages: u32,
    /// Position in the pool's history; increases by one per record.
    pub seq: u64,
    pub key: u128,
    /// Byte offset of the object inside the device's object space.
    pub offset: u64,
    pub payload_len: u64,
    /// XXH3-64 (seed 0) of the payload.
    pub payload_checksum: u64,
    /// Namespace hash of the store that wrote it.
    pub namespace: u128,
}

impl Record {
    pub fn encode(&self, seed: u64) -> [u8; RECORD_BYTES] {
        let mut b = [0u8; RECORD_BYTES];
        b[0] = self.kind;
        b[2..4].copy_from_slice(&self.device.to_le_bytes());
        b[4..8].copy_from_slice(&self.pages.to_le_bytes());
        b[8..16].copy_from_slice(&self.seq.to_le_bytes());
        b[16..32].copy_from_slice(&self.key.to_le_bytes());
        b[32..40].copy_from_slice(&self.offset.to_le_bytes());
        b[40..48].copy_from_slice(&self.payload_len.to_le_bytes());
        b[48..56].copy_from_slice(&self.payload_checksum.to_le_bytes());
        b[56..72].copy_from_slice(&self.namespace.to_le_bytes());
        let sum = xxh3_64_with_seed(&b[0..72], seed);
        b[72..80].copy_from_slice(&sum.to_le_bytes());
        b
    }

    /// `None` for a torn, flipped or foreign record.
    pub fn decode(b: &[u8], seed: u64) -> Option<Record> {
        if b.len() < RECORD_BYTES || u64_at(b, 72) != xxh3_64_with_seed(&b[0..72], seed) {
            return None;
        }
        let kind = b[0];
        if (kind != RECORD_PUT && kind != RECORD_DELETE) || b[1] != 0 {
            return None;
        }
        Some(Record {
            kind,
            device: u16_at(b, 2),
            pages: u32_at(b, 4),
            seq: u64_at(b, 8),
            key: u128_at(b, 16),
            offset: u64_at(b, 32),
            payload_len: u64_at(b, 40),
            payload_checksum: u64_at(b, 48),
            namespace: u128_at(b, 56),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn round_trips() {
        let sb = Superblock {
            pool_id: 7 << 70,
            device_index: 1,
            device_count: 2,
            data_offset: 4096,
            data_bytes: 1 << 20,
        };
        assert_eq!(Superblock::decode(&sb.encode()), Ok(sb));
        let header = LogHeader { pool_id: 9, device_count: 2, generation: 3 };
        assert_eq!(LogHeader::decode(&header.encode()), Ok(header));
        let r = Record {
            kind: RECORD_PUT,
            device: 1,
            pages: 3,
            seq: 5,
            key: 11,
            offset: 8192,
            payload_len: 9000,
            payload_checksum: 77,
            namespace: 3 << 100,
        };
        let seed = header.record_seed();
        assert_eq!(Record::decode(&r.encode(seed), seed), Some(r));
        let other = LogHeader { generation: 4, ..header }.record_seed();
        assert_eq!(Record::decode(&r.encode(seed), other), None, "a record of another generation");
    }

    proptest! {
        #[test]
        fn any_flipped_bit_is_detected(pos in 0usize..80, bit in 0u8..8) {
            let r = Record { kind: RECORD_DELETE, device: 0, pages: 1, seq: 1, key: 2, offset: 0, payload_len: 1, payload_checksum: 3, namespace: 4 };
            let mut b = r.encode(42);
            b[pos] ^= 1 << bit;
            prop_assert_eq!(Record::decode(&b, 42), None);
            let mut s = Superblock { pool_id: 1, device_index: 0, device_count: 1, data_offset: 4096, data_bytes: 4096 }.encode();
            s[pos % 64] ^= 1 << bit;
            prop_assert!(Superblock::decode(&s).is_err());
        }

        #[test]
        fn decoding_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..100)) {
            let _ = Record::decode(&bytes, 0);
            let _ = Superblock::decode(&bytes);
            let _ = LogHeader::decode(&bytes);
        }
    }
}
