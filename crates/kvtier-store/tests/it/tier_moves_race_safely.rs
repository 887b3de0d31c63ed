//! Blocks moving between tiers (DRAM victims demoted to SSD, SSD hits promoted into DRAM) while
//! other threads lease, load, put and clear the same keys: no panic, no lost pin, and every byte a
//! load reports loaded is the block of its key. Real tiers: DRAM and an SSD pool on files; calls
//! are held mid-flight at the store's hook points (a channel, not a sleep).

use crate::common;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{channel, Receiver};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::{keys, load, payload, put_keys, temp_dir, TempDir, OBJECT_BYTES};
use kvtier_store::{DramStoreConfig, HookPoint, SsdStoreConfig, Store, StoreConfig, TierKind};

fn ssd_store(dir: &TempDir, dram_blocks: u64, ssd_blocks: u64, leases_max: usize) -> Store {
    let ssd = SsdStoreConfig::new(common::one_device_pool(dir, ssd_blocks * OBJECT_BYTES));
    let config = StoreConfig {
        dram: DramStoreConfig::new(dram_blocks * OBJECT_BYTES),
        copy_threads: 2,
        lease_ttl: Duration::from_secs(60),
        leases_max,
        ssd: Some(ssd),
        ..StoreConfig::default()
    };
    Store::new(common::namespace("tier-races", ""), config).unwrap()
}

/// Holds the first call that reaches `point` until the returned sender sends; the receiver
/// hears when it got there.
fn hold_at(store: &Store, point: HookPoint) -> (Receiver<()>, std::sync::mpsc::Sender<()>) {
    let (held, on_held) = channel();
    let (resume, resumed) = channel::<()>();
    let (held, resumed) = (Mutex::new(held), Mutex::new(resumed));
    let armed = AtomicBool::new(true);
    store.set_hook_for_test(Some(Arc::new(move |p| {
        if p == point && armed.swap(false, Ordering::SeqCst) {
            held.lock().unwrap().send(()).unwrap();
            resumed.lock().unwrap().recv().unwrap();
        }
    })));
    (on_held, resume)
}

/// A load that finds a DRAM block corrupt while a put is demoting that very block (it is still
/// visible and leasable then) drops it from DRAM. The demotion must then leave it be, not panic
/// the put ("a demoting entry changed under its demotion") and leak the rest of its victims.
#[test]
fn a_block_found_corrupt_while_it_is_demoted_does_not_panic_the_put() {
    let dir = temp_dir("race-demote-corrupt");
    let store = ssd_store(&dir, 4, 32, 64);
    let ns = store.namespace_hash();
    let ks = keys(&store, 0, 5);
    assert_eq!(put_keys(&store, &ks[..4]).stored, 4);
    assert!(store.corrupt_for_test(ks[0], 100), "the oldest DRAM block, next to be demoted");
    let (on_held, resume) = hold_at(&store, HookPoint::SsdWrite);
    let put = std::thread::scope(|s| {
        let putter = s.spawn(|| put_keys(&store, &ks[4..]));
        on_held.recv().unwrap();
        // ks[0] is being demoted: still in DRAM, leasable, and its load finds it corrupt.
        let lease = store.lease(ns, &ks[..1]).unwrap();
        assert_eq!(lease.tiers, vec![TierKind::Dram]);
        let (report, _) = load(&store, lease.id, 1);
        assert_eq!((report.loaded_blocks, report.checksum_failures), (0, 1));
        resume.send(()).unwrap();
        let put = putter.join();
        store.release(lease.id).unwrap();
        put
    });
    store.set_hook_for_test(None);
    let put = put.expect("the put demoting the block a load found corrupt returns");
    assert_eq!(put.stored, 1);
    // Whatever holds ks[0] now (the demotion wrote its flipped bytes to SSD under the checksum
    // DRAM recorded: a counted miss there), a load never serves other bytes than its block's.
    let lease = store.lease(ns, &ks).unwrap();
    let (report, bufs) = load(&store, lease.id, lease.hit_blocks);
    for (k, b) in ks.iter().zip(&bufs).take(report.loaded_blocks) {
        assert!(*b == payload(*k), "wrong bytes for {k:#x}");
    }
    store.release(lease.id).unwrap();
    store.check_integrity().unwrap();
}
