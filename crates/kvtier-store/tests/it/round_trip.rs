//! put → lease → load returns the exact bytes; lookups report the longest consecutive prefix
//! and the tier of each block.

use crate::common;
use common::*;
use kvtier_store::TierKind;

#[test]
fn put_lease_load_returns_exact_bytes() {
    let s = store(32);
    let k = keys(&s, 0, 8);
    let report = put_keys(&s, &k);
    assert_eq!((report.stored, report.already_present, report.rejected), (8, 0, 0));
    let lease = s.lease(s.namespace_hash(), &k).unwrap();
    assert_eq!(lease.hit_blocks, 8);
    assert_eq!(lease.tiers, vec![TierKind::Dram; 8]);
    let (loaded, bufs) = load(&s, lease.id, 8);
    assert_eq!(loaded.loaded_blocks, 8);
    assert_eq!(loaded.checksum_failures, 0);
    for (key, buf) in k.iter().zip(&bufs) {
        assert!(*buf == payload(*key), "block {key:#x} came back different");
    }
    // A load may take fewer blocks than leased, and may be repeated.
    let (partial, bufs) = load(&s, lease.id, 3);
    assert_eq!(partial.loaded_blocks, 3);
    assert!(bufs[2] == payload(k[2]));
    s.release(lease.id).unwrap();
    let stats = s.stats();
    assert_eq!((stats.put_blocks, stats.loaded_blocks, stats.objects), (8, 11, 8));
    assert_eq!(stats.put_bytes, 8 * BLOCK_BYTES as u64);
    assert_eq!(stats.leases_active, 0);
    assert_eq!(stats.used_bytes, 8 * OBJECT_BYTES);
    s.check_integrity().unwrap();
}

#[test]
fn lookup_prefix_stops_at_the_first_missing_key() {
    let s = store(32);
    let k = keys(&s, 100, 6);
    put_keys(&s, &[k[0], k[1], k[2], k[4], k[5]]);
    let lookup = s.lookup(s.namespace_hash(), &k).unwrap();
    assert_eq!(lookup.hit_blocks, 3, "block 3 is missing, so 4 and 5 do not count");
    assert_eq!(lookup.tiers.iter().map(|t| t.name()).collect::<Vec<_>>(), ["dram"; 3]);
    assert_eq!(s.lookup(s.namespace_hash(), &k[3..]).unwrap().hit_blocks, 0);
    assert_eq!(s.lookup(s.namespace_hash(), &[]).unwrap().hit_blocks, 0);
    let stats = s.stats();
    assert_eq!((stats.lookups, stats.hit_blocks, stats.miss_blocks), (3, 3, 6));
}

#[test]
fn lookup_each_finds_keys_after_a_missing_one() {
    let s = store(32);
    let k = keys(&s, 300, 6);
    put_keys(&s, &[k[0], k[2], k[5]]);
    let each = s.lookup_each(s.namespace_hash(), &k).unwrap();
    let d = Some(TierKind::Dram);
    assert_eq!(each, vec![d, None, d, None, None, d]);
    assert!(s.lookup_each(s.namespace_hash(), &[]).unwrap().is_empty());
    let stats = s.stats();
    assert_eq!(
        (stats.lookups, stats.hit_blocks, stats.miss_blocks),
        (2, 0, 0),
        "a lookup each, no prefix counts"
    );
    assert!(s.lookup_each(s.namespace_hash() ^ 1, &k).is_err(), "another namespace's hash is refused");
}

#[test]
fn put_of_a_present_key_is_a_no_op() {
    let s = store(32);
    let k = keys(&s, 7, 4);
    put_keys(&s, &k[..2]);
    let report = put_keys(&s, &k);
    assert_eq!((report.stored, report.already_present), (2, 2));
    assert_eq!(s.stats().objects, 4);
}

#[test]
fn a_zero_hit_lease_is_a_lease() {
    let s = store(8);
    let k = keys(&s, 0, 2);
    let lease = s.lease(s.namespace_hash(), &k).unwrap();
    assert_eq!((lease.hit_blocks, lease.tiers.len()), (0, 0));
    let (report, _) = load(&s, lease.id, 0);
    assert_eq!(report.loaded_blocks, 0);
    s.release(lease.id).unwrap();
    s.check_integrity().unwrap();
}

#[test]
fn tier_names_are_stable() {
    let names: Vec<&str> = TierKind::ALL.iter().map(|t| t.name()).collect();
    assert_eq!(names, ["dram", "ssd", "remote", "noop"]);
}
