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
use kvtier_remote::testing::{require_server_binary, LoopbackServer};
use kvtier_store::{
    DramStoreConfig, HookPoint, RemoteConfig, RemoteStoreConfig, SsdStoreConfig, Store, StoreConfig, TierKind,
};

/// How a stress run configures its store (a DRAM tier and an SSD pool, optionally Redis).
#[derive(Clone, Copy, Debug)]
struct Setup {
    eviction: &'static str,
    ssd_write_through: bool,
    admission_k: u32,
    lease_ttl: Duration,
    /// A remote tier on a loopback redis-server, written back from DRAM's victims.
    remote_write_back: bool,
    /// Workers flip bits of stored blocks now and then (`Store::corrupt_for_test`).
    corrupt: bool,
}

const PLAIN: Setup = Setup {
    eviction: "lru",
    ssd_write_through: false,
    admission_k: 1,
    lease_ttl: Duration::from_secs(60),
    remote_write_back: false,
    corrupt: false,
};

fn ssd_store(dir: &TempDir, dram_blocks: u64, ssd_blocks: u64, setup: Setup, remote: Option<&str>) -> Store {
    let mut ssd = SsdStoreConfig::new(common::one_device_pool(dir, ssd_blocks * OBJECT_BYTES));
    ssd.write_through = setup.ssd_write_through;
    ssd.admission_k = setup.admission_k;
    let remote = remote.map(|url| {
        let mut r = RemoteStoreConfig::new(RemoteConfig::single(url));
        r.write_through = false;
        r
    });
    let config = StoreConfig {
        dram: DramStoreConfig::new(dram_blocks * OBJECT_BYTES),
        eviction: setup.eviction.into(),
        copy_threads: 2,
        lease_ttl: setup.lease_ttl,
        leases_max: 16,
        ssd: Some(ssd),
        remote,
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
    let store = ssd_store(&dir, 4, 32, PLAIN, None);
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

/// A small deterministic generator (xorshift64*), one per thread.
struct Rng(u64);
impl Rng {
    fn below(&mut self, n: usize) -> usize {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        (self.0.wrapping_mul(0x2545_f491_4f6c_dd1d) >> 33) as usize % n.max(1)
    }
}

/// An engine pool of `n` blocks with two regions per layer (K and V of each layer apart), one
/// buffer per region: `bufs[r]` holds region `r` (`SEGMENT` bytes of each block).
const SEGMENT: usize = common::BLOCK_BYTES / 4;
fn pool_over(bufs: &mut [Vec<u8>]) -> kvtier_core::paged::PagedPool {
    let n = bufs[0].len() / SEGMENT;
    let regions: Vec<(*mut u8, usize)> = bufs.iter_mut().map(|b| (b.as_mut_ptr(), SEGMENT)).collect();
    // SAFETY: four disjoint buffers of `n` segments each, alive while the pool is used, touched
    // only by the store's copies while they run.
    unsafe { kvtier_core::paged::PagedPool::from_regions(&regions, &[2, 2], n) }.unwrap()
}

/// Pool block `b` as one object (its four segments in object order).
fn pool_block(bufs: &[Vec<u8>], b: usize) -> Vec<u8> {
    bufs.iter().flat_map(|r| r[b * SEGMENT..(b + 1) * SEGMENT].iter().copied()).collect()
}

/// One worker of the stress test: `rounds` random puts (from buffers and from an engine pool),
/// leases, loads (whole, ranges, into a pool), releases (some twice, some kept a while),
/// lookups, bit flips (with `corrupt`) and, rarely, clears, over the same few prompts as every other worker. Every byte a
/// load reports loaded must be its key's block. Returns the lease it left unreleased.
fn worker(store: &Store, prompts: &[Vec<u128>], corrupt: bool, seed: u64, rounds: usize) -> Option<u64> {
    let ns = store.namespace_hash();
    let mut rng = Rng(seed);
    let mut kept = None;
    let mut bufs = vec![vec![0u8; 8 * SEGMENT]; 4];
    for _ in 0..rounds {
        let prompt = &prompts[rng.below(prompts.len())];
        let n = 1 + rng.below(prompt.len());
        match rng.below(100) {
            0..=29 => {
                put_keys(store, &prompt[..n]);
            }
            30..=39 => {
                let n = n.min(8);
                for (b, &k) in prompt[..n].iter().enumerate() {
                    let p = payload(k);
                    for (r, buf) in bufs.iter_mut().enumerate() {
                        buf[b * SEGMENT..(b + 1) * SEGMENT]
                            .copy_from_slice(&p[r * SEGMENT..(r + 1) * SEGMENT]);
                    }
                }
                let ids: Vec<u64> = (0..n as u64).collect();
                let pool = pool_over(&mut bufs);
                store.put_from_pool(ns, &prompt[..n], &pool, &ids).unwrap();
            }
            40..=97 => {
                let Ok(lease) = store.lease(ns, &prompt[..n]) else { continue }; // leases_max
                let hit = lease.hit_blocks;
                let first = rng.below(hit + 1);
                let count = rng.below(hit - first + 1).min(8);
                match rng.below(3) {
                    0 => {
                        let mut out = vec![vec![0u8; common::BLOCK_BYTES]; count];
                        let mut dst: Vec<&mut [u8]> = out.iter_mut().map(|b| &mut b[..]).collect();
                        if let Ok(r) = store.load_range(lease.id, first, &mut dst) {
                            for (i, b) in out.iter().enumerate().take(r.loaded_blocks) {
                                assert!(*b == payload(prompt[first + i]), "load_range served wrong bytes");
                            }
                        }
                    }
                    1 => {
                        let ids: Vec<u64> = (0..count as u64).rev().collect();
                        let pool = pool_over(&mut bufs);
                        if let Ok(r) = store.load_into_pool(lease.id, first, &pool, &ids, &mut |_| {}) {
                            drop(pool);
                            assert!(r.failed.iter().all(|&f| f >= r.loaded_blocks));
                            for (i, &b) in ids.iter().enumerate().filter(|(i, _)| !r.failed.contains(i)) {
                                let got = pool_block(&bufs, b as usize);
                                assert!(
                                    got == payload(prompt[first + i]),
                                    "load_into_pool served wrong bytes"
                                );
                            }
                        }
                    }
                    _ => {
                        let mut out = vec![vec![0u8; common::BLOCK_BYTES]; count];
                        let mut dst: Vec<&mut [u8]> = out.iter_mut().map(|b| &mut b[..]).collect();
                        if let Ok(r) = store.load_range_stored(lease.id, first, &mut dst) {
                            for (i, form) in r.blocks.iter().enumerate() {
                                if form.is_some() {
                                    assert!(
                                        out[i] == payload(prompt[first + i]),
                                        "a stored load served wrong bytes"
                                    );
                                }
                            }
                        }
                    }
                }
                match rng.below(10) {
                    0 => {
                        // Left unreleased a while (at most one per worker), so a lease outlives
                        // other workers' puts, demotions and clears.
                        if let Some(old) = kept.replace(lease.id) {
                            store.release(old).unwrap();
                        }
                    }
                    1 => {
                        store.release(lease.id).unwrap();
                        store.release(lease.id).unwrap();
                    }
                    _ => store.release(lease.id).unwrap(),
                }
            }
            98 if corrupt => {
                // Only an unleased copy is flipped (never one a load may be reading).
                store.corrupt_for_test(prompt[n - 1], rng.below(common::BLOCK_BYTES));
            }
            98 => {
                store.lookup(ns, prompt).unwrap();
            }
            _ => {
                store.clear().unwrap();
            }
        }
    }
    kept
}

/// Runs the stress workers on a fresh store of `setup`; then, all leases released, the tiers'
/// pins and accounting check out, before and after a clear.
fn stress(setup: Setup, server: Option<&LoopbackServer>, seed: u64) {
    let dir = temp_dir("race-stress");
    let url = server.map(|s| {
        s.command(&[b"FLUSHALL"]);
        s.url()
    });
    let store = ssd_store(&dir, 8, 32, setup, url.as_deref());
    let prompts: Vec<Vec<u128>> = (0..5).map(|p| keys(&store, 1000 * p, 8)).collect();
    let kept: Vec<u64> = std::thread::scope(|s| {
        let workers: Vec<_> = (0..4)
            .map(|t| {
                let (store, prompts) = (&store, &prompts);
                s.spawn(move || worker(store, prompts, setup.corrupt, seed + t, 400))
            })
            .collect();
        workers.into_iter().flat_map(|w| w.join().unwrap()).collect()
    });
    for id in kept {
        store.release(id).unwrap();
    }
    assert_eq!(store.stats().leases_active, 0, "{setup:?}");
    if !setup.corrupt {
        // (Flipped DRAM blocks demoted raw reach SSD as they are, with DRAM's checksum: a
        // counted miss when read, but a failure of SSD's read-everything integrity check.)
        store.check_integrity().unwrap();
    }
    store.clear().unwrap();
    store.check_integrity().unwrap();
}

/// Several threads putting, leasing, loading, releasing, flipping bits and clearing the same
/// keys over a DRAM tier of 8 blocks, an SSD pool of 32 and (in one setup) a write-back Redis,
/// so blocks are demoted and promoted all the time: no panic, no wrong byte, and once every
/// lease is released the tiers' pins and accounting check out.
#[test]
fn many_threads_on_the_same_keys_never_see_wrong_bytes() {
    let server = LoopbackServer::start_anywhere(&require_server_binary(), None);
    let short_ttl = Duration::from_millis(2); // leases expire between and during loads
    let setups = [
        Setup { corrupt: true, ..PLAIN },
        Setup { eviction: "s3fifo", ssd_write_through: true, lease_ttl: short_ttl, ..PLAIN },
        Setup { admission_k: 2, remote_write_back: true, corrupt: true, ..PLAIN },
    ];
    for (i, setup) in setups.into_iter().enumerate() {
        let remote = setup.remote_write_back.then_some(&server);
        stress(setup, remote, 0x9e37_79b9 + 101 * i as u64);
    }
}
