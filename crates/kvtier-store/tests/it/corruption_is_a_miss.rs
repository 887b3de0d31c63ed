//! A corrupted stored byte is never served: the load stops before the corrupt block, the
//! failure is counted, and the block is a miss from then on.

use crate::common;
use common::*;

#[test]
fn corrupt_block_stops_the_load_and_becomes_a_miss() {
    let s = store(16);
    let k = keys(&s, 0, 5);
    put_keys(&s, &k);
    assert!(s.corrupt_for_test(k[2], 1234));
    assert!(!s.corrupt_for_test(k[2], BLOCK_BYTES), "offset past the payload");
    let lease = s.lease(s.namespace_hash(), &k).unwrap();
    assert_eq!(lease.hit_blocks, 5, "corruption is found on read, not on lookup");
    let (report, bufs) = load(&s, lease.id, 5);
    assert_eq!(report.loaded_blocks, 2, "blocks 0 and 1 are good; 2 is corrupt, so loading stops there");
    assert_eq!(report.checksum_failures, 1);
    for i in 0..2 {
        assert!(bufs[i] == payload(k[i]));
    }
    assert_eq!(s.stats().checksum_failures, 1);
    assert_eq!(s.lookup(s.namespace_hash(), &k).unwrap().hit_blocks, 2, "the corrupt block is dropped");
    s.check_integrity().unwrap();
    s.release(lease.id).unwrap();
    s.check_integrity().unwrap();
    // The block can be stored again, correctly, and then loads.
    assert_eq!(put_keys(&s, &k[2..3]).stored, 1);
    let lease = s.lease(s.namespace_hash(), &k).unwrap();
    let (report, bufs) = load(&s, lease.id, 5);
    assert_eq!(report.loaded_blocks, 5);
    assert!(bufs[2] == payload(k[2]));
    s.release(lease.id).unwrap();
    assert_eq!(s.stats().objects, 5);
    s.check_integrity().unwrap();
}

#[test]
fn corrupt_first_block_loads_nothing() {
    let s = store(8);
    let k = keys(&s, 9, 2);
    put_keys(&s, &k);
    assert!(s.corrupt_for_test(k[0], 0));
    let lease = s.lease(s.namespace_hash(), &k).unwrap();
    let (report, _) = load(&s, lease.id, 2);
    assert_eq!((report.loaded_blocks, report.checksum_failures), (0, 1));
    s.release(lease.id).unwrap();
    assert_eq!(s.lookup(s.namespace_hash(), &k).unwrap().hit_blocks, 0);
}

#[test]
fn a_corrupt_copy_is_counted_once_however_often_it_is_loaded() {
    let s = store(16);
    let k = keys(&s, 3, 4);
    put_keys(&s, &k);
    assert!(s.corrupt_for_test(k[1], 77));
    let a = s.lease(s.namespace_hash(), &k).unwrap();
    let b = s.lease(s.namespace_hash(), &k).unwrap();
    for id in [a.id, a.id, b.id, a.id] {
        let (report, bufs) = load(&s, id, 4);
        // Every load stops at the corrupt copy and says why ...
        assert_eq!((report.loaded_blocks, report.checksum_failures), (1, 1));
        assert!(bufs[0] == payload(k[0]));
        s.check_integrity().unwrap();
    }
    // ... but the store found one corrupt copy, once.
    assert_eq!(s.stats().checksum_failures, 1);
    s.release(a.id).unwrap();
    s.release(b.id).unwrap();
    s.check_integrity().unwrap();
}

#[test]
fn corrupting_a_leased_block_is_refused() {
    // A leased block may be being loaded: flipping a bit then would race with the load's read.
    let s = store(8);
    let k = keys(&s, 5, 2);
    put_keys(&s, &k);
    let lease = s.lease(s.namespace_hash(), &k[..1]).unwrap();
    assert!(!s.corrupt_for_test(k[0], 0), "leased: refused");
    assert!(s.corrupt_for_test(k[1], 0), "not leased: flipped");
    let (report, bufs) = load(&s, lease.id, 1);
    assert_eq!((report.loaded_blocks, report.checksum_failures), (1, 0));
    assert!(bufs[0] == payload(k[0]));
    s.release(lease.id).unwrap();
    assert!(s.corrupt_for_test(k[0], 0), "released: flipped");
}
