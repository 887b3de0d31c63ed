//! DRAM → SSD: blocks DRAM gives up are written back to SSD (after the admission filter),
//! lookups report where each block is, loads from SSD verify and promote, leases pin SSD
//! blocks, capacities hold, and a restarted store finds what the SSD pool kept.

use crate::common;

use std::time::Duration;

use common::{keys, load, namespace, payload, put_keys, temp_dir, TempDir, OBJECT_BYTES};
use kvtier_store::{
    DramStoreConfig, Durability, SsdConfig, SsdStoreConfig, Store, StoreConfig, StoreError, TierKind,
};

fn ssd_store(
    dir: &TempDir,
    dram_blocks: u64,
    ssd_blocks_per_device: u64,
    tweak: impl FnOnce(&mut SsdStoreConfig),
) -> Store {
    ssd_store_of("test-model", dir, dram_blocks, ssd_blocks_per_device, tweak)
}

fn ssd_store_of(
    model: &str,
    dir: &TempDir,
    dram_blocks: u64,
    ssd_blocks_per_device: u64,
    tweak: impl FnOnce(&mut SsdStoreConfig),
) -> Store {
    let mut pool = SsdConfig::new(dir.path());
    pool.devices = vec![dir.path().join("a.kvtd"), dir.path().join("b.kvtd")];
    pool.capacity_bytes = 2 * ssd_blocks_per_device * OBJECT_BYTES;
    pool.probe_bytes = 0;
    let mut ssd = SsdStoreConfig::new(pool);
    tweak(&mut ssd);
    let config = StoreConfig {
        dram: DramStoreConfig::new(dram_blocks * OBJECT_BYTES),
        copy_threads: 2,
        lease_ttl: Duration::from_secs(30),
        leases_max: 64,
        ssd: Some(ssd),
        ..StoreConfig::default()
    };
    Store::new(namespace(model, ""), config).unwrap()
}

fn tiers(store: &Store, ks: &[u128]) -> Vec<TierKind> {
    store.lookup(store.namespace_hash(), ks).unwrap().tiers
}

fn assert_loads(store: &Store, ks: &[u128]) {
    let lease = store.lease(store.namespace_hash(), ks).unwrap();
    assert_eq!(lease.hit_blocks, ks.len());
    let (report, bufs) = load(store, lease.id, ks.len());
    assert_eq!(report.loaded_blocks, ks.len());
    for (k, b) in ks.iter().zip(&bufs) {
        assert_eq!(*b, payload(*k), "wrong bytes for {k:#x}");
    }
    store.release(lease.id).unwrap();
}

#[test]
fn evicted_blocks_are_written_back_and_promoted_on_hit() {
    let dir = temp_dir("store-ssd-writeback");
    let store = ssd_store(&dir, 4, 32, |_| {});
    assert_eq!(store.tier_kinds(), vec![TierKind::Dram, TierKind::Ssd]);
    let ks = keys(&store, 0, 12);
    assert_eq!(put_keys(&store, &ks).stored, 12);
    let where_ = tiers(&store, &ks);
    assert_eq!(where_[..8], [TierKind::Ssd; 8], "the 8 oldest left DRAM for SSD");
    assert_eq!(where_[8..], [TierKind::Dram; 4]);
    // Key by key, across a gap: each tier is asked about every key.
    let gap = [ks[0], keys(&store, 500, 1)[0], ks[11], ks[3]];
    let each = store.lookup_each(store.namespace_hash(), &gap).unwrap();
    assert_eq!(each, vec![Some(TierKind::Ssd), None, Some(TierKind::Dram), Some(TierKind::Ssd)]);
    let stats = store.stats();
    assert_eq!((stats.demoted_blocks, stats.admission_skipped, stats.dropped_evictions), (8, 0, 0));
    // All 12 leased at once: DRAM's 4 are pinned, so nothing can be promoted.
    assert_loads(&store, &ks);
    assert_eq!(store.stats().promoted_blocks, 0);
    // Two SSD blocks alone: promoted into DRAM (whose unleased blocks go to SSD, already there).
    assert_loads(&store, &ks[..2]);
    assert_eq!(store.stats().promoted_blocks, 2);
    assert_eq!(tiers(&store, &ks[..2]), vec![TierKind::Dram; 2]);
    assert_eq!(store.stats().dropped_evictions, 0);
    assert_loads(&store, &ks);
    store.check_integrity().unwrap();
    let ssd = store.ssd_metrics().unwrap();
    assert!(
        ssd.devices.iter().all(|d| d.objects > 0),
        "both devices used: {:?}",
        ssd.devices.iter().map(|d| d.objects).collect::<Vec<_>>()
    );
    for (kind, t) in store.tier_stats() {
        assert!(t.used_bytes <= t.capacity_bytes, "{kind} over capacity");
    }
}

#[test]
fn admission_filter_needs_k_accesses() {
    let dir = temp_dir("store-ssd-admission");
    let store = ssd_store(&dir, 4, 32, |s| s.admission_k = 2);
    let a = keys(&store, 0, 4);
    let b = keys(&store, 1000, 4);
    let c = keys(&store, 2000, 4);
    put_keys(&store, &a);
    let lease = store.lease(store.namespace_hash(), &a).unwrap(); // second access of each of a
    store.release(lease.id).unwrap();
    put_keys(&store, &b); // a leaves DRAM: 2 accesses, admitted
    put_keys(&store, &c); // b leaves DRAM: 1 access, not admitted
    assert_eq!(tiers(&store, &a), vec![TierKind::Ssd; 4]);
    assert_eq!(store.lookup(store.namespace_hash(), &b).unwrap().hit_blocks, 0);
    let stats = store.stats();
    assert_eq!((stats.demoted_blocks, stats.admission_skipped), (4, 4));
    store.check_integrity().unwrap();
}

#[test]
fn leased_ssd_blocks_are_never_evicted_and_capacity_holds() {
    let dir = temp_dir("store-ssd-leases");
    let store = ssd_store(&dir, 2, 2, |s| s.promote_on_hit = false); // SSD: 4 blocks
    let first = keys(&store, 0, 6);
    put_keys(&store, &first);
    assert_eq!(tiers(&store, &first[..4]), vec![TierKind::Ssd; 4]);
    let lease = store.lease(store.namespace_hash(), &first[..4]).unwrap();
    for round in 1..6u32 {
        put_keys(&store, &keys(&store, round * 1000, 4));
        for (kind, t) in store.tier_stats() {
            assert!(t.used_bytes <= t.capacity_bytes, "{kind} over capacity");
        }
        store.check_integrity().unwrap();
    }
    assert!(store.stats().demotion_failed > 0, "SSD was full of leased blocks");
    let (report, bufs) = load(&store, lease.id, 4);
    assert_eq!(report.loaded_blocks, 4);
    assert!(first[..4].iter().zip(&bufs).all(|(k, b)| *b == payload(*k)));
    store.release(lease.id).unwrap();
    store.check_integrity().unwrap();
}

#[test]
fn a_restarted_store_finds_ssd_blocks() {
    let dir = temp_dir("store-ssd-restart");
    let tweak = |s: &mut SsdStoreConfig| {
        s.write_through = true;
        s.pool.durability = Durability::Fsync;
    };
    let ks = {
        let store = ssd_store(&dir, 4, 32, tweak);
        let ks = keys(&store, 7, 10);
        put_keys(&store, &ks);
        let stats = store.stats();
        assert_eq!(stats.written_through + stats.demoted_blocks, 10, "{stats:?}");
        assert!(stats.written_through > 0);
        ks
    };
    let store = ssd_store(&dir, 4, 32, tweak);
    assert_eq!(store.ssd_metrics().unwrap().recovery.recovered_objects, 10);
    assert_eq!(tiers(&store, &ks), vec![TierKind::Ssd; 10]);
    assert_loads(&store, &ks);
    store.check_integrity().unwrap();
}

#[test]
fn bad_ssd_settings_are_config_errors() {
    let dir = temp_dir("store-ssd-bad");
    let mut ssd = SsdStoreConfig::new(SsdConfig::new(dir.path().join("missing")));
    let config = |ssd: SsdStoreConfig| StoreConfig {
        dram: DramStoreConfig::new(1 << 20),
        ssd: Some(ssd),
        ..StoreConfig::default()
    };
    let err = Store::new(namespace("m", ""), config(ssd.clone())).unwrap_err();
    assert!(
        matches!(&err, StoreError::Config(m) if m.contains("ssd: ssd directory") && m.contains("create it first")),
        "{err}"
    );
    ssd.admission_k = 0;
    let err = Store::new(namespace("m", ""), config(ssd)).unwrap_err();
    assert!(err.to_string().contains("admission_k is 0"), "{err}");
    let mut pool = SsdConfig::new(dir.path());
    pool.capacity_bytes = 4096; // smaller than one 16 KiB block
    pool.probe_bytes = 0;
    let err = Store::new(namespace("m", ""), config(SsdStoreConfig::new(pool))).unwrap_err();
    assert!(err.to_string().contains("expected at least one object (16384 bytes"), "{err}");
}

/// Two models share one pool (one store at a time). Model B given model A's raw keys (keys no
/// real B prompt derives: the adversarial case) finds nothing, loads nothing, drops nothing, and
/// its puts under those keys never overwrite A's objects: A reopens to all 8, byte-exact.
#[test]
fn another_namespace_on_a_shared_pool_is_a_plain_miss_and_never_drops_objects() {
    let dir = temp_dir("store-ssd-namespaces");
    let a_keys = {
        let a = ssd_store_of("model-a", &dir, 2, 32, |s| s.write_through = true);
        let ks = keys(&a, 0, 8);
        assert_eq!(put_keys(&a, &ks).stored, 8);
        a.flush().unwrap();
        ks
    };
    {
        let b = ssd_store_of("model-b", &dir, 2, 32, |s| s.write_through = true);
        let ns = b.namespace_hash();
        assert_eq!(b.lookup(ns, &a_keys).unwrap().hit_blocks, 0, "another namespace's objects are misses");
        let lease = b.lease(ns, &a_keys).unwrap();
        assert_eq!(lease.hit_blocks, 0);
        b.release(lease.id).unwrap();
        put_keys(&b, &a_keys);
        b.flush().unwrap();
        let stats = b.stats();
        assert_eq!(stats.checksum_failures, 0, "nothing was read as corrupt");
        // Only what B's own DRAM holds is a hit for B; A's SSD copies never are.
        let hits = b.lookup(ns, &a_keys).unwrap();
        assert!(hits.tiers.iter().all(|t| *t != TierKind::Ssd), "{:?}", hits.tiers);
    }
    let a = ssd_store_of("model-a", &dir, 2, 32, |s| s.write_through = true);
    assert_eq!(tiers(&a, &a_keys), vec![TierKind::Ssd; 8]);
    assert_loads(&a, &a_keys);
}

/// A cold load large enough to be read in chunks (`Store::read_promoting`: 4400 blocks of
/// 16 KiB are chunks of 2200, 1100 and 1100) promotes each chunk while the next is read: every
/// block exact, and a tampered block in the middle chunk ends the loaded prefix there, with
/// exactly that prefix promoted (the chunk before it promoted while it was read, the blocks
/// after it read but not promoted) and the tampered copy dropped.
#[test]
fn a_chunked_cold_load_promotes_exactly_its_verified_prefix() {
    let dir = temp_dir("store-ssd-chunked-promote");
    let n = 4400;
    let tweak = |s: &mut SsdStoreConfig| {
        s.write_through = true;
        s.pool.durability = Durability::Fsync;
    };
    let ks = {
        let store = ssd_store(&dir, n as u64 + 100, n as u64, tweak);
        let ks = keys(&store, 3, n);
        assert_eq!(put_keys(&store, &ks).stored, n);
        assert_eq!(store.stats().written_through, n as u64);
        ks
    };
    let store = ssd_store(&dir, n as u64 + 100, n as u64, tweak);
    assert_eq!(tiers(&store, &ks), vec![TierKind::Ssd; n]);
    let bad = 2500;
    assert!(store.corrupt_for_test(ks[bad], 999));
    let lease = store.lease(store.namespace_hash(), &ks).unwrap();
    assert_eq!(lease.hit_blocks, n);
    let (report, bufs) = load(&store, lease.id, n);
    store.release(lease.id).unwrap();
    assert_eq!(report.loaded_blocks, bad, "the loaded prefix ends at the tampered block");
    for (k, b) in ks.iter().zip(&bufs).take(bad) {
        assert_eq!(*b, payload(*k), "wrong bytes for {k:#x}");
    }
    let stats = store.stats();
    assert_eq!((stats.promoted_blocks, stats.checksum_failures), (bad as u64, 1), "{stats:?}");
    let after = store.lookup(store.namespace_hash(), &ks).unwrap();
    assert_eq!(after.tiers[..bad], vec![TierKind::Dram; bad][..], "the prefix promoted");
    assert_eq!(after.hit_blocks, bad, "the tampered copy dropped: the lookup stops there");
    // The blocks after it were read and verified, not promoted: a second load takes them from
    // SSD and promotes them all.
    assert_eq!(tiers(&store, &ks[bad + 1..]), vec![TierKind::Ssd; n - bad - 1]);
    assert_loads(&store, &ks[bad + 1..]);
    assert_eq!(store.stats().promoted_blocks, n as u64 - 1);
    assert_eq!(tiers(&store, &ks[bad + 1..]), vec![TierKind::Dram; n - bad - 1]);
    store.check_integrity().unwrap();
}
