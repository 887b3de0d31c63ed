//! The DRAM tier never exceeds its capacity, never evicts a pinned block, and keeps its
//! accounting exact under any sequence of puts, pins, reads, unpins and removes.

use std::sync::Arc;

use kvtier_core::parallel::WorkerPool;
use kvtier_pool::{eviction_by_name, object_extent_bytes, DramTier, EntryRef, ReadOutcome, Tier, PAGE_BYTES};
use proptest::prelude::*;

const NS: u128 = 0xabc;

fn payload(key: u128, len: usize) -> Vec<u8> {
    (0..len).map(|i| (key as usize).wrapping_mul(31).wrapping_add(i) as u8).collect()
}

fn tier(capacity_bytes: u64, policy: &str) -> DramTier {
    DramTier::new(capacity_bytes, eviction_by_name(policy).unwrap(), Arc::new(WorkerPool::new(2))).unwrap()
}

fn pin(tier: &DramTier, keys: &[u128]) -> Vec<EntryRef> {
    let mut located = vec![None; keys.len()];
    tier.locate(NS, keys, &mut located, true, true);
    located.iter().map_while(|l| l.map(|l| l.entry)).collect()
}

#[test]
fn pinned_blocks_survive_a_flood_and_unpinned_ones_go() {
    let len = 3000;
    let t = tier(4 * PAGE_BYTES, "lru");
    let p = payload(1, len);
    assert_eq!(t.put(NS, &[1, 2], &[&p, &p]).stored, 2);
    let pinned = pin(&t, &[1]);
    assert_eq!(pinned.len(), 1);
    for key in 10..100u128 {
        let q = payload(key, len);
        let report = t.put(NS, &[key], &[&q]);
        assert_eq!(report.stored, 1, "there is always one unpinned slot to reuse");
        assert!(t.used_bytes() <= t.capacity_bytes());
    }
    assert!(t.contains(NS, 1) && !t.contains(NS, 2), "pinned 1 survived, unpinned 2 was evicted");
    let mut dst = vec![0u8; len];
    let mut outcomes = [ReadOutcome::NotPinned];
    t.read_pinned(NS, &pinned, &mut [&mut dst[..]], &mut outcomes);
    assert_eq!(outcomes[0], ReadOutcome::Loaded);
    assert_eq!(dst, payload(1, len));
    t.unpin(&pinned);
    t.put(NS, &[200, 201, 202, 203], &[&p, &p, &p, &p]);
    assert!(!t.contains(NS, 1), "unpinned, block 1 is evictable again");
    t.check_integrity().unwrap();
}

#[test]
fn full_of_pins_rejects_instead_of_growing() {
    let t = tier(2 * PAGE_BYTES, "s3fifo");
    let p = payload(0, 100);
    assert_eq!(t.put(NS, &[1, 2], &[&p, &p]).stored, 2);
    let pinned = pin(&t, &[1, 2]);
    let report = t.put(NS, &[3, 4], &[&p, &p]);
    assert_eq!((report.stored, report.rejected, report.evicted), (0, 2, 0));
    assert_eq!(t.stats().rejected, 2);
    let too_big = payload(0, 2 * PAGE_BYTES as usize);
    t.unpin(&pinned);
    assert_eq!(t.put(NS, &[9], &[&too_big]).rejected, 1, "larger than capacity: rejected, nothing evicted");
    assert!(t.contains(NS, 1) && t.contains(NS, 2));
    t.check_integrity().unwrap();
}

#[test]
fn put_is_content_addressed() {
    let t = tier(8 * PAGE_BYTES, "lru");
    let p = payload(5, 64);
    let report = t.put(NS, &[5, 5], &[&p, &p]);
    assert_eq!((report.stored, report.already_present), (1, 1), "a key twice in one batch is stored once");
    assert_eq!(t.put(NS, &[5], &[&p]).already_present, 1);
    assert_eq!(t.used_bytes(), object_extent_bytes(64));
}

#[test]
fn removing_a_pinned_block_hides_it_and_frees_on_unpin() {
    let t = tier(8 * PAGE_BYTES, "lru");
    let p = payload(7, 500);
    t.put(NS, &[7], &[&p]);
    let pinned = pin(&t, &[7]);
    assert_eq!(t.remove(NS, &[7]), 1);
    assert!(!t.contains(NS, 7));
    assert_eq!(t.stats().doomed_objects, 1);
    // The pinned generation still reads correctly; a new generation of the key can coexist.
    t.put(NS, &[7], &[&p]);
    let mut dst = vec![0u8; 500];
    let mut outcomes = [ReadOutcome::NotPinned];
    t.read_pinned(NS, &pinned, &mut [&mut dst[..]], &mut outcomes);
    assert_eq!((outcomes[0], dst == p), (ReadOutcome::Loaded, true));
    t.check_integrity().unwrap();
    t.unpin(&pinned);
    assert_eq!(t.stats().doomed_objects, 0);
    assert_eq!(t.used_bytes(), object_extent_bytes(500));
    assert!(t.contains(NS, 7));
    t.check_integrity().unwrap();
}

#[derive(Clone, Debug)]
enum Op {
    Put(Vec<u8>),
    Pin(Vec<u8>),
    Unpin(usize),
    Read(usize),
    Remove(u8),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        proptest::collection::vec(0u8..24, 1..6).prop_map(Op::Put),
        proptest::collection::vec(0u8..24, 1..6).prop_map(Op::Pin),
        any::<usize>().prop_map(Op::Unpin),
        any::<usize>().prop_map(Op::Read),
        (0u8..24).prop_map(Op::Remove),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]
    #[test]
    fn random_operations_keep_every_invariant(ops in proptest::collection::vec(op(), 1..60), lru in any::<bool>()) {
        let t = tier(10 * PAGE_BYTES, if lru { "lru" } else { "s3fifo" });
        let mut held: Vec<Vec<EntryRef>> = Vec::new();
        // Each key always stores the same length (1 byte to 3 pages), as content addressing implies.
        let len_of = |key: u128| (key as usize * 997) % (3 * PAGE_BYTES as usize) + 1;
        for op in ops {
            match op {
                Op::Put(keys) => {
                    let keys: Vec<u128> = keys.into_iter().map(u128::from).collect();
                    let payloads: Vec<Vec<u8>> = keys.iter().map(|&k| payload(k, len_of(k))).collect();
                    let refs: Vec<&[u8]> = payloads.iter().map(|p| &p[..]).collect();
                    let r = t.put(NS, &keys, &refs);
                    prop_assert_eq!(r.stored + r.already_present + r.rejected, keys.len());
                }
                Op::Pin(keys) => {
                    let keys: Vec<u128> = keys.into_iter().map(u128::from).collect();
                    held.push(pin(&t, &keys));
                }
                Op::Unpin(i) if !held.is_empty() => {
                    let entries = held.swap_remove(i % held.len());
                    t.unpin(&entries);
                }
                Op::Read(i) if !held.is_empty() => {
                    let entries = &held[i % held.len()];
                    let mut bufs: Vec<Vec<u8>> = entries.iter().map(|e| vec![0u8; len_of(e.key)]).collect();
                    let mut dst: Vec<&mut [u8]> = bufs.iter_mut().map(|b| &mut b[..]).collect();
                    let mut outcomes = vec![ReadOutcome::NotPinned; entries.len()];
                    t.read_pinned(NS, entries, &mut dst, &mut outcomes);
                    for (entry, (buf, outcome)) in entries.iter().zip(bufs.iter().zip(&outcomes)) {
                        prop_assert_eq!(*outcome, ReadOutcome::Loaded);
                        prop_assert_eq!(buf, &payload(entry.key, len_of(entry.key)));
                    }
                }
                Op::Remove(key) => {
                    t.remove(NS, &[u128::from(key)]);
                }
                _ => {}
            }
            prop_assert!(t.used_bytes() <= t.capacity_bytes());
            prop_assert_eq!(t.check_integrity(), Ok(()));
            let pins: u32 = t.pins().iter().map(|(_, n)| n).sum();
            prop_assert_eq!(pins as usize, held.iter().map(Vec::len).sum::<usize>());
        }
        for entries in held {
            t.unpin(&entries);
        }
        prop_assert!(t.pins().is_empty());
        prop_assert_eq!(t.check_integrity(), Ok(()));
    }
}

/// A key held for one namespace is a plain miss for another: not located, not contained, not
/// removed, and another namespace's put of it is rejected rather than reported as present.
#[test]
fn another_namespace_never_sees_or_drops_a_block() {
    let t = tier(8 * PAGE_BYTES, "lru");
    let p = payload(5, 3000);
    assert_eq!(t.put(NS, &[5], &[&p]).stored, 1);
    let other = NS + 1;
    let mut located = [None];
    assert_eq!(t.locate(other, &[5], &mut located, true, true), 0);
    assert!(located[0].is_none() && !t.contains(other, 5) && t.contains(NS, 5));
    assert_eq!(t.remove(other, &[5]), 0);
    let report = t.put(other, &[5], &[&payload(6, 3000)]);
    assert_eq!((report.stored, report.already_present, report.rejected), (0, 0, 1));
    let entries = pin(&t, &[5]);
    let mut out = vec![0u8; 3000];
    let mut outcomes = [ReadOutcome::NotPinned];
    t.read_pinned(NS, &entries, &mut [&mut out[..]], &mut outcomes);
    assert_eq!((outcomes[0], out == p), (ReadOutcome::Loaded, true));
    t.unpin(&entries);
}

/// `clear` drops every block of one namespace: unpinned ones free their space at once, a pinned
/// one is hidden and still reads for its holder until unpinned; another namespace's block stays.
#[test]
fn clearing_a_namespace_drops_only_its_blocks() {
    let t = tier(16 * PAGE_BYTES, "s3fifo");
    let other = NS + 1;
    for key in 1..=6u128 {
        assert_eq!(t.put(NS, &[key], &[&payload(key, 3000)]).stored, 1);
    }
    assert_eq!(t.put(other, &[10], &[&payload(10, 3000)]).stored, 1);
    let pinned = pin(&t, &[1]);
    assert_eq!(t.clear(NS), Ok(6));
    assert!((1..=6u128).all(|k| !t.contains(NS, k)) && t.contains(other, 10));
    assert_eq!((t.stats().objects, t.stats().doomed_objects), (1, 1));
    let mut dst = vec![0u8; 3000];
    let mut outcomes = [ReadOutcome::NotPinned];
    t.read_pinned(NS, &pinned, &mut [&mut dst[..]], &mut outcomes);
    assert_eq!((outcomes[0], dst == payload(1, 3000)), (ReadOutcome::Loaded, true));
    t.unpin(&pinned);
    assert_eq!(t.used_bytes(), object_extent_bytes(3000));
    assert_eq!(t.clear(NS), Ok(0));
    t.check_integrity().unwrap();
}
