//! `Store::clear` is a barrier within the process: a write into any tier that began before it
//! (a DRAM insert, SSD write-through, demotion to SSD or to a write-back remote tier, a remote
//! write-through SET, a load's promotion into DRAM, a put from an engine's paged pool) never
//! lands after it, and no load returns bytes put before it once it returned. Each test holds the write mid-flight at a hook point
//! (a channel, not a sleep), starts the clear, lets the write go once the clear either waits for
//! it or has already returned, and checks what the store holds after both. Without the barrier
//! the clear returns while the write is held, and the write lands after it. Real tiers: DRAM,
//! an SSD pool on files, a loopback redis-server.

use crate::common;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::{keys, load, payload, put_keys, temp_dir, TempDir, BLOCK_BYTES, OBJECT_BYTES};
use kvtier_core::paged::PagedPool;
use kvtier_core::BlockKey;
use kvtier_remote::resp::Reply;
use kvtier_remote::testing::{require_server_binary, LoopbackServer};
use kvtier_store::{
    DramStoreConfig, HookPoint, Lease, RemoteConfig, RemoteStoreConfig, SsdStoreConfig, Store, StoreConfig,
    StoreError, TierKind,
};

/// What the threads of a test report, in the order they happen.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Event {
    /// The held call reached its hook point and waits there.
    Held,
    /// The clear found calls in flight and waits for them (`HookPoint::ClearWaits`).
    ClearWaits,
    ClearReturned,
    /// The held call returned.
    CallReturned,
}

/// Holds the first call that passes `point` until [`Hold::release`]; reports events.
struct Hold {
    events: Receiver<Event>,
    sender: Sender<Event>,
    resume: Sender<()>,
}

impl Hold {
    fn install(store: &Store, point: HookPoint) -> Hold {
        let (sender, events) = channel();
        let (resume, resumed) = channel::<()>();
        let resumed = Mutex::new(resumed);
        let armed = AtomicBool::new(true);
        let tx = Mutex::new(sender.clone());
        store.set_hook_for_test(Some(Arc::new(move |p| {
            if p == HookPoint::ClearWaits {
                tx.lock().unwrap().send(Event::ClearWaits).unwrap();
            } else if p == point && armed.swap(false, Ordering::SeqCst) {
                tx.lock().unwrap().send(Event::Held).unwrap();
                resumed.lock().unwrap().recv().unwrap();
            }
        })));
        Hold { events, sender, resume }
    }

    fn next(&self) -> Event {
        self.events.recv().unwrap()
    }

    fn release(&self) {
        self.resume.send(()).unwrap();
    }
}

/// Sends its event when dropped: when its thread's work returned, or panicked.
struct Report(Sender<Event>, Event);
impl Drop for Report {
    fn drop(&mut self) {
        let _ = self.0.send(self.1);
    }
}

/// Runs `call` on a thread, held at `point`; clears the store meanwhile, and releases the call
/// once the clear waits for it or has returned. Returns what happened first after the clear
/// started: [`Event::ClearWaits`] with the barrier; without it, [`Event::ClearReturned`] (the
/// clear returned while the call was still held). Both threads have returned by then.
fn clear_during(store: &Store, point: HookPoint, call: impl FnOnce() + Send) -> Event {
    let hold = Hold::install(store, point);
    let first = std::thread::scope(|s| {
        let report = Report(hold.sender.clone(), Event::CallReturned);
        s.spawn(move || {
            let _report = report;
            call();
        });
        assert_eq!(hold.next(), Event::Held, "the call reaches {point:?}");
        let report = Report(hold.sender.clone(), Event::ClearReturned);
        s.spawn(move || {
            let _report = report;
            store.clear().unwrap();
        });
        let first = hold.next();
        hold.release();
        let mut rest = vec![hold.next()];
        if first == Event::ClearWaits {
            rest.push(hold.next());
        }
        rest.sort_by_key(|e| *e as u8);
        let expected = if first == Event::ClearWaits {
            vec![Event::ClearReturned, Event::CallReturned]
        } else {
            vec![Event::CallReturned]
        };
        assert_eq!(rest, expected, "after {first:?}");
        first
    });
    store.set_hook_for_test(None);
    first
}

/// What a barrier makes a clear do first: wait for the held call (a clear that returned while
/// the call was held is [`Event::ClearReturned`]).
const FENCED: Event = Event::ClearWaits;

fn dram_store(blocks: u64) -> Store {
    let config = StoreConfig {
        dram: DramStoreConfig::new(blocks * OBJECT_BYTES),
        copy_threads: 2,
        ..StoreConfig::default()
    };
    Store::new(common::namespace("clear-barrier", ""), config).unwrap()
}

fn ssd_store(dir: &TempDir, dram_blocks: u64, write_through: bool) -> Store {
    let mut ssd = SsdStoreConfig::new(common::one_device_pool(dir, 64 * OBJECT_BYTES));
    ssd.write_through = write_through;
    let config = StoreConfig {
        dram: DramStoreConfig::new(dram_blocks * OBJECT_BYTES),
        copy_threads: 2,
        ssd: Some(ssd),
        ..StoreConfig::default()
    };
    Store::new(common::namespace("clear-barrier", ""), config).unwrap()
}

fn remote_store(server: &LoopbackServer, dram_blocks: u64, write_through: bool) -> Store {
    let mut remote = RemoteStoreConfig::new(RemoteConfig::single(&server.url()));
    remote.write_through = write_through;
    let config = StoreConfig {
        dram: DramStoreConfig::new(dram_blocks * OBJECT_BYTES),
        copy_threads: 2,
        remote: Some(remote),
        ..StoreConfig::default()
    };
    Store::new(common::namespace("clear-barrier", ""), config).unwrap()
}

/// Blocks of `keys` some tier still holds (each looked up alone).
fn held(store: &Store, keys: &[BlockKey]) -> Vec<(usize, TierKind)> {
    let ns = store.namespace_hash();
    (0..keys.len())
        .filter_map(|i| store.lookup(ns, &keys[i..i + 1]).unwrap().tiers.first().map(|&t| (i, t)))
        .collect()
}

fn server_keys(server: &LoopbackServer) -> i64 {
    match server.command(&[b"DBSIZE"]) {
        Reply::Int(n) => n,
        other => panic!("DBSIZE answered {other:?}"),
    }
}

#[test]
fn a_put_held_before_its_dram_write_does_not_land_after_the_clear() {
    let store = dram_store(8);
    let ks = keys(&store, 0, 4);
    let events = clear_during(&store, HookPoint::DramWrite, || {
        put_keys(&store, &ks);
    });
    assert_eq!(held(&store, &ks), vec![], "the put landed after the clear");
    assert_eq!(events, FENCED);
    store.check_integrity().unwrap();
    assert_eq!(put_keys(&store, &ks).stored, 4, "a put after the clear stores as usual");
}

#[test]
fn ssd_write_through_held_mid_put_does_not_land_after_the_clear() {
    let dir = temp_dir("clear-write-through");
    let store = ssd_store(&dir, 8, true);
    let ks = keys(&store, 0, 4);
    let events = clear_during(&store, HookPoint::SsdWrite, || {
        put_keys(&store, &ks);
    });
    assert_eq!(held(&store, &ks), vec![], "the write-through landed on SSD after the clear");
    assert_eq!(events, FENCED);
    store.check_integrity().unwrap();
}

#[test]
fn demotion_to_ssd_held_mid_put_does_not_land_after_the_clear() {
    let dir = temp_dir("clear-demotion");
    let store = ssd_store(&dir, 2, false);
    let ks = keys(&store, 0, 4);
    put_keys(&store, &ks[..2]); // DRAM is full: the next put demotes these two to SSD
    let events = clear_during(&store, HookPoint::SsdWrite, || {
        put_keys(&store, &ks[2..]);
    });
    assert_eq!(held(&store, &ks), vec![], "demoted blocks landed on SSD after the clear");
    assert_eq!(events, FENCED);
    store.check_integrity().unwrap();
}

/// A remote store whose put of `ks[2..]` writes to Redis: write-through (the put's own blocks),
/// or write-back (DRAM, full with `ks[..2]`, writes those victims back); the put is held just
/// before its SET while the store is cleared.
fn remote_write_held_during_a_clear(write_through: bool) {
    let server = LoopbackServer::start_anywhere(&require_server_binary(), None);
    let store = remote_store(&server, 2, write_through);
    let ks = keys(&store, 0, 4);
    if !write_through {
        put_keys(&store, &ks[..2]);
    }
    let events = clear_during(&store, HookPoint::RemoteWrite, || {
        put_keys(&store, &ks[2..]);
    });
    assert_eq!(held(&store, &ks), vec![], "a SET landed after the clear");
    assert_eq!(server_keys(&server), 0);
    assert_eq!(events, FENCED);
    store.check_integrity().unwrap();
}

#[test]
fn remote_write_through_held_mid_put_does_not_land_after_the_clear() {
    remote_write_held_during_a_clear(true);
}

#[test]
fn remote_write_back_held_mid_put_does_not_land_after_the_clear() {
    remote_write_held_during_a_clear(false);
}

#[test]
fn a_promotion_into_dram_held_mid_load_does_not_land_after_the_clear() {
    let dir = temp_dir("clear-promotion");
    let store = ssd_store(&dir, 2, true);
    let ks = keys(&store, 0, 4);
    put_keys(&store, &ks); // all on SSD; DRAM keeps the last two
    let ns = store.namespace_hash();
    let lease = store.lease(ns, &ks[..2]).unwrap();
    assert_eq!(lease.tiers, vec![TierKind::Ssd; 2]);
    let events = clear_during(&store, HookPoint::DramWrite, || {
        let (report, bufs) = load(&store, lease.id, 2);
        assert_eq!(report.loaded_blocks, 2, "the load ran before the clear");
        assert!(bufs.iter().zip(&ks).all(|(b, &k)| *b == payload(k)));
    });
    assert_eq!(held(&store, &ks), vec![], "a promotion landed in DRAM after the clear");
    assert_eq!(events, FENCED);
    store.release(lease.id).unwrap();
    store.check_integrity().unwrap();
}

#[test]
fn a_load_in_flight_returns_before_the_clear_and_a_lease_from_before_it_misses() {
    let store = dram_store(8);
    let ks = keys(&store, 0, 2);
    put_keys(&store, &ks);
    let ns = store.namespace_hash();
    let (held_lease, later_lease) = (store.lease(ns, &ks).unwrap(), store.lease(ns, &ks).unwrap());
    let events = clear_during(&store, HookPoint::LoadRead, || {
        assert_eq!(load(&store, held_lease.id, 2).0.loaded_blocks, 2);
    });
    // A lease granted before the clear loads nothing after it: its blocks are gone.
    let missing_before = store.stats().load_missing;
    let (report, _) = load(&store, later_lease.id, 2);
    assert_eq!((report.loaded_blocks, report.checksum_failures), (0, 0), "a lease loaded old bytes");
    assert_eq!(store.stats().load_missing, missing_before + 2);
    assert_eq!(events, FENCED, "the clear returned while a load of old bytes was in flight");
    store.check_integrity().unwrap(); // the clear dropped the leases' pins
    assert_eq!(store.stats().objects, 0, "no block is kept alive by a cleared lease");
    store.release(held_lease.id).unwrap();
    store.release(later_lease.id).unwrap();
    assert_eq!(store.stats().leases_active, 0);
}

#[test]
fn a_write_that_began_before_a_clear_stores_nothing_after_it() {
    let store = dram_store(8);
    let ks = keys(&store, 0, 2);
    let before = store.epoch();
    store.clear().unwrap();
    let payloads: Vec<Vec<u8>> = ks.iter().map(|&k| payload(k)).collect();
    let objects: Vec<&[u8]> = payloads.iter().map(|p| &p[..]).collect();
    let ns = store.namespace_hash();
    let e = store.put_since(before, ns, &ks, &objects).unwrap_err();
    assert_eq!(e, StoreError::ClearedSince { since: before, now: before + 1 });
    assert!(e.to_string().contains("cleared after this write began"), "{e}");
    assert_eq!(held(&store, &ks), vec![]);
    assert_eq!(store.put_since(store.epoch(), ns, &ks, &objects).unwrap().stored, 2);
}

/// A pool of `n` blocks over `buf` (`n` blocks), one region per layer (2 layers).
fn paged(buf: &mut [u8], n: usize) -> PagedPool {
    let half = BLOCK_BYTES / 2;
    let base = buf.as_mut_ptr();
    // SAFETY: the two regions tile `buf`, which outlives the pool in each test, and only the
    // store's copies touch it while they run.
    unsafe { PagedPool::from_regions(&[(base, half), (base.add(n * half), half)], &[1, 1], n) }.unwrap()
}

#[test]
fn a_put_from_pool_held_before_its_dram_write_does_not_land_after_the_clear() {
    let store = dram_store(8);
    let ks = keys(&store, 0, 4);
    let mut buf = vec![7u8; 4 * BLOCK_BYTES];
    let pool = paged(&mut buf, 4);
    let ns = store.namespace_hash();
    let events = clear_during(&store, HookPoint::DramWrite, || {
        assert_eq!(store.put_from_pool(ns, &ks, &pool, &[0, 1, 2, 3]).unwrap().stored, 4);
    });
    assert_eq!(held(&store, &ks), vec![], "the put landed after the clear");
    assert_eq!(events, FENCED);
    store.check_integrity().unwrap();
}

#[test]
fn a_paged_load_from_a_lease_granted_before_a_clear_misses_and_announces_every_layer() {
    let store = dram_store(8);
    let ks = keys(&store, 0, 2);
    put_keys(&store, &ks);
    let ns = store.namespace_hash();
    let lease = store.lease(ns, &ks).unwrap();
    store.clear().unwrap();
    let mut buf = vec![0u8; 2 * BLOCK_BYTES];
    let pool = paged(&mut buf, 2);
    let mut announced = Vec::new();
    let report = store.load_into_pool(lease.id, 0, &pool, &[0, 1], &mut |l| announced.push(l)).unwrap();
    assert_eq!((report.loaded_blocks, report.failed), (0, vec![0, 1]), "a lease loaded old bytes");
    assert_eq!(announced, vec![0, 1], "a layer waiter would wait forever");
    drop(pool);
    assert!(buf.iter().all(|&b| b == 0), "nothing was copied");
    store.release(lease.id).unwrap();
    store.check_integrity().unwrap();
}

/// Runs `lease` of `keys` on a thread held at [`HookPoint::LeaseLocated`] (its blocks found and
/// pinned, not yet granted), runs `meanwhile` on another thread, and releases the lease once
/// `meanwhile` returned. Panics if `meanwhile` has not returned within a minute: it waited for
/// the held lease. Returns the lease.
fn while_a_lease_is_located(store: &Store, keys: &[BlockKey], meanwhile: impl FnOnce() + Send) -> Lease {
    let hold = Hold::install(store, HookPoint::LeaseLocated);
    let lease = std::thread::scope(|s| {
        let leasing = s.spawn(|| store.lease(store.namespace_hash(), keys).unwrap());
        assert_eq!(hold.next(), Event::Held, "the lease reaches LeaseLocated");
        let (done, finished) = channel();
        s.spawn(move || {
            meanwhile();
            done.send(()).unwrap();
        });
        let waited = finished.recv_timeout(Duration::from_secs(60));
        hold.release();
        assert!(waited.is_ok(), "a call waited for a lease being located");
        leasing.join().unwrap()
    });
    store.set_hook_for_test(None);
    lease
}

#[test]
fn a_lease_located_while_a_clear_runs_is_granted_cleared_and_loads_nothing() {
    let store = dram_store(8);
    let ks = keys(&store, 0, 2);
    put_keys(&store, &ks);
    let lease = while_a_lease_is_located(&store, &ks, || {
        store.clear().unwrap();
    });
    assert_eq!(lease.hit_blocks, 2, "the blocks were there when the lease located them");
    store.check_integrity().unwrap(); // the cleared lease's pins were dropped
    assert_eq!(store.stats().objects, 0, "no block is kept alive by a cleared lease");
    let (report, _) = load(&store, lease.id, 2);
    assert_eq!(
        (report.loaded_blocks, report.checksum_failures),
        (0, 0),
        "a lease loaded bytes put before a clear"
    );
    store.release(lease.id).unwrap();
    assert_eq!(put_keys(&store, &ks).stored, 2, "a put after the clear stores as usual");
    let again = store.lease(store.namespace_hash(), &ks).unwrap();
    assert_eq!(load(&store, again.id, 2).0.loaded_blocks, 2);
    store.release(again.id).unwrap();
    store.check_integrity().unwrap();
}

#[test]
fn a_lease_being_located_holds_back_no_put_load_release_or_other_lease() {
    let store = dram_store(16);
    let (ks, others) = (keys(&store, 0, 2), keys(&store, 1000, 2));
    put_keys(&store, &ks);
    let ns = store.namespace_hash();
    let earlier = store.lease(ns, &ks).unwrap();
    let lease = while_a_lease_is_located(&store, &ks, || {
        assert_eq!(put_keys(&store, &others).stored, 2);
        assert_eq!(load(&store, earlier.id, 2).0.loaded_blocks, 2);
        store.release(earlier.id).unwrap();
        let other = store.lease(ns, &others).unwrap();
        assert_eq!(load(&store, other.id, 2).0.loaded_blocks, 2);
        store.release(other.id).unwrap();
        store.check_integrity().unwrap(); // a tier holds the located lease's pins, not yet granted
        assert_eq!(store.stats().leases_active, 0);
    });
    assert_eq!(load(&store, lease.id, 2).0.loaded_blocks, 2, "the located lease loads once granted");
    store.release(lease.id).unwrap();
    store.check_integrity().unwrap();
}

#[test]
fn a_lease_being_located_holds_its_place_under_the_lease_bound() {
    let config = StoreConfig {
        dram: DramStoreConfig::new(8 * OBJECT_BYTES),
        copy_threads: 2,
        leases_max: 1,
        ..StoreConfig::default()
    };
    let store = Store::new(common::namespace("lease-bound", ""), config).unwrap();
    let ks = keys(&store, 0, 2);
    put_keys(&store, &ks);
    let lease = while_a_lease_is_located(&store, &ks, || {
        let second = store.lease(store.namespace_hash(), &ks);
        assert_eq!(second.err(), Some(StoreError::LeaseLimit { max: 1 }));
    });
    assert!(store.lease(store.namespace_hash(), &ks).is_err(), "the granted lease holds the place");
    store.release(lease.id).unwrap();
    let after = store.lease(store.namespace_hash(), &ks).unwrap();
    store.release(after.id).unwrap();
    store.check_integrity().unwrap();
}
