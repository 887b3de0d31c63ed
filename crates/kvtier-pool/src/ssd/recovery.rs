//! Rebuilding the lookup table from the index log's records.
//!
//! Records are applied in log order: a `Put` makes its key live at its extent (replacing an
//! older location of the same key), a `Delete` removes the key if it still lives at the named
//! extent. Robustness against a log that lost records (a `none`-durability log after a power
//! loss may keep a later record but lose an earlier one):
//! - a `Put` whose extent overlaps live extents drops those older entries: their bytes were
//!   (or were about to be) overwritten;
//! - a `Put` naming a device, range or size that cannot be right is dropped and counted.
//!
//! What survives is still only a claim: every read verifies the object's header and checksums,
//! so a stale entry is a counted miss, never wrong bytes.

use std::collections::BTreeMap;

use super::format::{Record, RECORD_DELETE, RECORD_PUT};
use crate::extent::PAGE_BYTES;
use crate::hash::key_map;

kvtier_core::fields! {
    /// Counts of one recovery.
    #[derive(Clone, Copy, Debug, Default, PartialEq)]
    pub struct RecoveryStats {
        pub records: u64,
        /// Objects readable after recovery.
        pub recovered_objects: u64,
        /// `Put` records naming an impossible location.
        pub invalid_records: u64,
        /// Entries dropped because a later `Put` overwrote their extent.
        pub overwritten_entries: u64,
        /// Bytes of a torn append cut off the end of the log.
        pub dropped_tail_bytes: u64,
        /// Wall time of opening the log and rebuilding the table and allocators.
        pub seconds: f64,
    }
}

/// Pages an object with `payload_len` payload bytes occupies on a device (at least one).
pub fn object_pages(payload_len: u64) -> Option<u64> {
    Some(payload_len.checked_add(PAGE_BYTES - 1)?.max(PAGE_BYTES) / PAGE_BYTES)
}

/// The live `Put` records, oldest first, from `records` over devices of `data_bytes` each.
pub fn rebuild(records: &[Record], data_bytes: &[u64], stats: &mut RecoveryStats) -> Vec<Record> {
    let mut live = key_map::<Record>();
    let mut by_offset: Vec<BTreeMap<u64, (u128, u64)>> = vec![BTreeMap::new(); data_bytes.len()];
    stats.records = records.len() as u64;
    for r in records {
        let device = usize::from(r.device);
        match r.kind {
            RECORD_PUT => {
                let len = u64::from(r.pages) * PAGE_BYTES;
                let valid = device < data_bytes.len()
                    && r.offset % PAGE_BYTES == 0
                    && r.pages > 0
                    && object_pages(r.payload_len) == Some(u64::from(r.pages))
                    && r.offset.checked_add(len).is_some_and(|end| end <= data_bytes[device]);
                if !valid {
                    stats.invalid_records += 1;
                    continue;
                }
                if let Some(old) = live.remove(&r.key) {
                    by_offset[usize::from(old.device)].remove(&old.offset);
                }
                let end = r.offset + len;
                let overlapping: Vec<(u64, u128)> = by_offset[device]
                    .range(..end)
                    .rev()
                    .take_while(|(_, &(_, other_end))| other_end > r.offset)
                    .map(|(&offset, &(key, _))| (offset, key))
                    .collect();
                for (offset, key) in overlapping {
                    by_offset[device].remove(&offset);
                    live.remove(&key);
                    stats.overwritten_entries += 1;
                }
                by_offset[device].insert(r.offset, (r.key, end));
                live.insert(r.key, *r);
            }
            RECORD_DELETE => {
                if live.get(&r.key).is_some_and(|l| l.device == r.device && l.offset == r.offset) {
                    live.remove(&r.key);
                    by_offset[device].remove(&r.offset);
                }
            }
            _ => unreachable!("decode accepts only put and delete records"),
        }
    }
    let mut out: Vec<Record> = live.into_values().collect();
    out.sort_unstable_by_key(|r| r.seq);
    stats.recovered_objects = out.len() as u64;
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn put(seq: u64, key: u128, device: u16, page: u64, payload_len: u64) -> Record {
        let pages = object_pages(payload_len).unwrap() as u32;
        Record {
            kind: RECORD_PUT,
            device,
            pages,
            seq,
            key,
            offset: page * PAGE_BYTES,
            payload_len,
            payload_checksum: 0,
            namespace: 1,
        }
    }

    fn delete(seq: u64, of: &Record) -> Record {
        Record { kind: RECORD_DELETE, seq, ..*of }
    }

    #[test]
    fn puts_deletes_overlaps_and_bad_records() {
        let a = put(1, 10, 0, 0, 5000); // pages 0..2
        let b = put(2, 11, 0, 2, 100); // page 2
        let c = put(3, 12, 1, 0, 100);
        let d = put(5, 13, 0, 1, 100); // overwrites part of a: a is dropped
        let bad_device = put(6, 14, 7, 0, 100);
        let bad_range = put(7, 15, 1, 15, 5000); // pages 15..17 of a 16-page device
        let mut wrong_pages = put(8, 16, 1, 3, 100);
        wrong_pages.pages = 3;
        let c_moved = put(9, 12, 1, 5, 100);
        let records =
            [a, b, c, delete(4, &b), d, bad_device, bad_range, wrong_pages, delete(10, &c), c_moved];
        let mut stats = RecoveryStats::default();
        let live = rebuild(&records, &[16 * PAGE_BYTES, 16 * PAGE_BYTES], &mut stats);
        // b deleted; a overwritten by d; c deleted, then stored again at page 5.
        assert_eq!(
            live.iter().map(|r| (r.key, r.offset / PAGE_BYTES)).collect::<Vec<_>>(),
            vec![(13, 1), (12, 5)]
        );
        assert_eq!((stats.invalid_records, stats.overwritten_entries, stats.recovered_objects), (3, 1, 2));
    }
}
