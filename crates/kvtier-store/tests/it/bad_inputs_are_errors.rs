//! Every misuse is a typed error whose message names the wrong value and the expected one, and
//! leaves the store unchanged.

use crate::common;
use std::time::Duration;

use common::*;
use kvtier_store::{DramStoreConfig, Store, StoreConfig, StoreError};

fn config(capacity: u64) -> StoreConfig {
    StoreConfig { dram: DramStoreConfig::new(capacity), ..StoreConfig::default() }
}

#[test]
fn wrong_object_size() {
    let s = store(8);
    let k = keys(&s, 0, 2);
    let good = payload(k[0]);
    let short = vec![0u8; BLOCK_BYTES - 1];
    let err = s.put(s.namespace_hash(), &k, &[&good, &short]).unwrap_err();
    assert_eq!(err, StoreError::ObjectSize { index: 1, actual: BLOCK_BYTES - 1, expected: BLOCK_BYTES });
    assert!(err.to_string().contains("16383") && err.to_string().contains("16384"), "{err}");
    assert_eq!(s.stats().objects, 0, "nothing of a bad batch is stored");
}

#[test]
fn count_mismatch() {
    let s = store(8);
    let k = keys(&s, 0, 2);
    let block = payload(k[0]);
    let err = s.put(s.namespace_hash(), &k, &[&block]).unwrap_err();
    assert_eq!(err, StoreError::CountMismatch { keys: 2, objects: 1 });
}

#[test]
fn unknown_lease() {
    let s = store(8);
    let mut buf = vec![0u8; BLOCK_BYTES];
    assert_eq!(s.load(42, &mut [&mut buf[..]]), Err(StoreError::LeaseUnknown { id: 42 }));
    assert_eq!(s.release(42), Err(StoreError::LeaseUnknown { id: 42 }));
    assert!(StoreError::LeaseUnknown { id: 42 }.to_string().contains("42"));
}

#[test]
fn too_many_loads_and_wrong_destination_size() {
    let s = store(8);
    let k = keys(&s, 0, 2);
    put_keys(&s, &k[..1]);
    let lease = s.lease(s.namespace_hash(), &k).unwrap();
    let mut a = vec![0u8; BLOCK_BYTES];
    let mut b = vec![0u8; BLOCK_BYTES];
    let err = s.load(lease.id, &mut [&mut a[..], &mut b[..]]).unwrap_err();
    assert_eq!(err, StoreError::LoadTooMany { requested: 2, leased: 1 });
    let mut small = [0u8; 10];
    let err = s.load(lease.id, &mut [&mut small[..]]).unwrap_err();
    assert_eq!(err, StoreError::ObjectSize { index: 0, actual: 10, expected: BLOCK_BYTES });
    // Positions past the lease, up to the largest, for the calls a reader of stored bytes makes.
    for position in [1, usize::MAX] {
        let err = s.report_undecodable(lease.id, &[0, position]).unwrap_err();
        assert!(matches!(err, StoreError::LoadTooMany { leased: 1, .. }), "{err:?}");
        let err = s.load_range(lease.id, position, &mut [&mut a[..]]).unwrap_err();
        assert!(matches!(err, StoreError::LoadTooMany { leased: 1, .. }), "{err:?}");
        let err = s.promote_decoded(lease.id, position, &[None]).unwrap_err();
        assert!(matches!(err, StoreError::LoadTooMany { leased: 1, .. }), "{err:?}");
    }
    // The lease is intact after every error.
    assert_eq!(s.load(lease.id, &mut [&mut a[..]]).unwrap().loaded_blocks, 1);
    s.release(lease.id).unwrap();
    s.check_integrity().unwrap();
}

#[test]
fn zero_or_too_small_capacity() {
    let err = Store::new(namespace("m", ""), config(0)).unwrap_err();
    assert!(matches!(&err, StoreError::Config(m) if m.contains("dram.capacity_bytes is 0")), "{err}");
    let err = Store::new(namespace("m", ""), config(OBJECT_BYTES - 1)).unwrap_err();
    let message = err.to_string();
    assert!(
        message.contains(&format!("{}", OBJECT_BYTES - 1)) && message.contains(&OBJECT_BYTES.to_string()),
        "{message}"
    );
    assert!(Store::new(namespace("m", ""), config(OBJECT_BYTES)).is_ok(), "exactly one block fits");
}

#[test]
fn capacity_beyond_the_address_space() {
    for capacity in [u64::MAX, 1 << 63] {
        let err = Store::new(namespace("m", ""), config(capacity)).unwrap_err();
        assert!(
            matches!(&err, StoreError::Config(m) if m.contains("dram.capacity_bytes") && m.contains(&capacity.to_string())),
            "{err}"
        );
    }
}

#[test]
fn unknown_eviction_name_lists_the_known_ones() {
    let config = StoreConfig { eviction: "random".into(), ..config(1 << 20) };
    let err = Store::new(namespace("m", ""), config).unwrap_err();
    let message = err.to_string();
    assert!(matches!(err, StoreError::Config(_)));
    assert!(
        message.contains("\"random\"") && message.contains("lru") && message.contains("s3fifo"),
        "{message}"
    );
}

#[test]
fn other_bad_config_values() {
    let bad = [
        StoreConfig { lease_ttl: Duration::ZERO, ..config(1 << 20) },
        StoreConfig { leases_max: 0, ..config(1 << 20) },
        StoreConfig { copy_threads: 100_000, ..config(1 << 20) },
    ];
    for c in bad {
        assert!(matches!(Store::new(namespace("m", ""), c.clone()), Err(StoreError::Config(_))), "{c:?}");
    }
    let mut ns = namespace("m", "");
    ns.model_id = "x".repeat(5000);
    assert!(matches!(Store::new(ns, config(1 << 20)), Err(StoreError::Config(_))));
}
