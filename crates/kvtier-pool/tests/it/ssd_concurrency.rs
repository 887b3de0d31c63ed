//! Readers and writers at once, on a pool small enough to evict constantly: every read either
//! misses or returns the exact bytes of its key, and the accounting stays consistent.

use crate::common;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use common::{config, get, put, temp_dir};
use kvtier_pool::{ReadOutcome, SsdTier, Tier};

const LEN: usize = 9_000;

#[test]
fn concurrent_readers_and_writers_never_see_wrong_bytes() {
    let dir = temp_dir("ssd-concurrency");
    let mut c = config(dir.path(), 2, 48 * 3 * 4096); // 48 objects per device
    c.compact_min_records = 128;
    let pool = SsdTier::open(c.clone()).unwrap();
    let stop = AtomicBool::new(false);
    let loaded = AtomicU64::new(0);
    std::thread::scope(|s| {
        for w in 0..3u128 {
            let pool = &pool;
            s.spawn(move || {
                for round in 0..60u128 {
                    let base = 1 + (w * 1000 + round * 7) % 400; // overlapping key ranges
                    let keys: Vec<u128> = (base..base + 8).collect();
                    let report = put(pool, &keys, LEN);
                    assert_eq!(report.stored + report.already_present + report.rejected, 8);
                }
            });
        }
        for r in 0..3u128 {
            let (pool, stop, loaded) = (&pool, &stop, &loaded);
            s.spawn(move || {
                let mut k = 1 + r * 50;
                while !stop.load(Ordering::Relaxed) {
                    let keys: Vec<u128> = (k..k + 6).collect();
                    for (i, (outcome, right)) in get(pool, &keys, LEN).into_iter().enumerate() {
                        if outcome == Some(ReadOutcome::Loaded) {
                            assert!(right, "key {} loaded wrong bytes", keys[i]);
                            loaded.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                    k = 1 + (k + 13) % 400;
                }
            });
        }
        s.spawn(|| {
            for _ in 0..20 {
                pool.check_integrity().unwrap();
                std::thread::sleep(std::time::Duration::from_millis(5));
            }
        });
        std::thread::sleep(std::time::Duration::from_millis(300));
        stop.store(true, Ordering::Relaxed);
    });
    assert!(loaded.load(Ordering::Relaxed) > 0, "the readers never hit");
    assert!(pool.stats().evictions > 0, "the test did not evict");
    assert!(pool.used_bytes() <= pool.capacity_bytes());
    assert!(pool.pins().is_empty());
    pool.check_integrity().unwrap();
    let objects = pool.stats().objects;
    drop(pool);
    let pool = SsdTier::open(c).unwrap();
    assert_eq!(pool.stats().objects, objects, "a restart recovers exactly the live set");
    pool.check_integrity().unwrap();
}
