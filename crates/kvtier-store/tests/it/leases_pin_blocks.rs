//! A leased block survives any eviction pressure until it is released or its TTL passes;
//! after that it is evictable like any other. Leases are bounded.

use crate::common;
use std::time::Duration;

use common::*;
use kvtier_store::StoreError;

#[test]
fn leased_blocks_survive_a_flood_and_release_frees_them() {
    for eviction in ["lru", "s3fifo"] {
        let s = store_with(8, Duration::from_secs(30), 16, eviction);
        let held = keys(&s, 0, 3);
        put_keys(&s, &held);
        let lease = s.lease(s.namespace_hash(), &held).unwrap();
        assert_eq!(lease.hit_blocks, 3);
        // Fill 25× beyond capacity while the lease is held.
        for round in 0..50u32 {
            let flood = keys(&s, 1_000_000 + round * 1000, 4);
            let report = put_keys(&s, &flood);
            assert_eq!(report.stored + report.rejected, 4);
            assert!(s.stats().used_bytes <= s.stats().capacity_bytes);
        }
        assert!(s.stats().evictions > 100, "{eviction}: the flood evicted");
        let (report, bufs) = load(&s, lease.id, 3);
        assert_eq!(report.loaded_blocks, 3, "{eviction}: leased blocks survived the flood");
        for (key, buf) in held.iter().zip(&bufs) {
            assert!(*buf == payload(*key));
        }
        s.check_integrity().unwrap();
        s.release(lease.id).unwrap();
        // Flood with blocks that are reused (leased once), so that scan-resistant policies
        // (S3-FIFO keeps accessed blocks over one-hit ones) must also give up old blocks.
        for round in 0..30u32 {
            let reused = keys(&s, 2_000_000 + round * 1000, 4);
            put_keys(&s, &reused);
            let lease = s.lease(s.namespace_hash(), &reused).unwrap();
            s.release(lease.id).unwrap();
        }
        assert_eq!(
            s.lookup(s.namespace_hash(), &held).unwrap().hit_blocks,
            0,
            "{eviction}: released, then evicted"
        );
        s.check_integrity().unwrap();
    }
}

#[test]
fn a_store_full_of_leased_blocks_rejects_puts() {
    let s = store(4);
    let held = keys(&s, 0, 4);
    put_keys(&s, &held);
    let lease = s.lease(s.namespace_hash(), &held).unwrap();
    let report = put_keys(&s, &keys(&s, 500, 2));
    assert_eq!((report.stored, report.rejected, report.evicted), (0, 2, 0));
    assert_eq!(s.stats().rejected_puts, 2);
    s.release(lease.id).unwrap();
    assert_eq!(put_keys(&s, &keys(&s, 500, 2)).stored, 2);
}

#[test]
fn expired_lease_unpins_and_says_expired() {
    let s = store_with(4, Duration::from_millis(50), 16, "lru");
    let held = keys(&s, 0, 4);
    put_keys(&s, &held);
    let lease = s.lease(s.namespace_hash(), &held).unwrap();
    assert_eq!(put_keys(&s, &keys(&s, 500, 1)).rejected, 1, "pinned while the lease lives");
    std::thread::sleep(Duration::from_millis(120));
    // The put reclaims the expired lease, then evicts to make room.
    assert_eq!(put_keys(&s, &keys(&s, 500, 1)).stored, 1);
    let mut buf = vec![0u8; BLOCK_BYTES];
    assert_eq!(s.load(lease.id, &mut [&mut buf[..]]), Err(StoreError::LeaseExpired { id: lease.id }));
    let stats = s.stats();
    assert_eq!((stats.leases_expired, stats.leases_active), (1, 0));
    assert_eq!(s.release(lease.id), Ok(()), "releasing an expired lease is harmless");
    s.check_integrity().unwrap();
}

#[test]
fn expired_but_unreclaimed_lease_cannot_load() {
    let s = store_with(4, Duration::from_millis(30), 16, "lru");
    let k = keys(&s, 0, 1);
    put_keys(&s, &k);
    let lease = s.lease(s.namespace_hash(), &k).unwrap();
    std::thread::sleep(Duration::from_millis(60));
    let mut buf = vec![0u8; BLOCK_BYTES];
    assert_eq!(s.load(lease.id, &mut [&mut buf[..]]), Err(StoreError::LeaseExpired { id: lease.id }));
}

#[test]
fn leases_are_bounded_and_release_is_idempotent() {
    let s = store_with(4, Duration::from_secs(30), 3, "lru");
    let k = keys(&s, 0, 1);
    put_keys(&s, &k);
    let ids: Vec<u64> = (0..3).map(|_| s.lease(s.namespace_hash(), &k).unwrap().id).collect();
    assert_eq!(s.lease(s.namespace_hash(), &k), Err(StoreError::LeaseLimit { max: 3 }));
    s.check_integrity().unwrap();
    s.release(ids[0]).unwrap();
    assert_eq!(s.release(ids[0]), Ok(()), "releasing twice is harmless");
    let mut buf = vec![0u8; BLOCK_BYTES];
    assert_eq!(s.load(ids[0], &mut [&mut buf[..]]), Err(StoreError::LeaseEnded { id: ids[0] }));
    let never = ids[2] + 100;
    assert_eq!(s.release(never), Err(StoreError::LeaseUnknown { id: never }));
    assert!(s.lease(s.namespace_hash(), &k).is_ok());
    assert_eq!(s.stats().leases_active, 3);
    s.check_integrity().unwrap();
}

#[test]
fn expired_lease_releases_after_more_than_leases_max_later_expiries() {
    let s = store_with(4, Duration::from_millis(20), 2, "lru");
    let k = keys(&s, 0, 1);
    put_keys(&s, &k);
    let first = s.lease(s.namespace_hash(), &k).unwrap().id;
    let mut later = Vec::new();
    for _ in 0..4 {
        // Each lease expires before the next is granted: 5 expiries, more than leases_max = 2.
        std::thread::sleep(Duration::from_millis(40));
        later.push(s.lease(s.namespace_hash(), &k).unwrap().id);
    }
    std::thread::sleep(Duration::from_millis(40));
    assert_eq!(s.stats().leases_expired, 5);
    assert_eq!(s.release(first), Ok(()), "an expired lease releases however long ago it expired");
    let mut buf = vec![0u8; BLOCK_BYTES];
    assert_eq!(s.load(first, &mut [&mut buf[..]]), Err(StoreError::LeaseEnded { id: first }));
    let last = *later.last().unwrap();
    assert_eq!(s.load(last, &mut [&mut buf[..]]), Err(StoreError::LeaseExpired { id: last }));
    for id in later {
        assert_eq!(s.release(id), Ok(()));
    }
    assert_eq!(s.stats().leases_active, 0);
    s.check_integrity().unwrap();
}
