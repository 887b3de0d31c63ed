//! The pool never exceeds its capacity (evicting per device, never a pinned object), and a
//! full disk — at creation, on a data write, or on a log append — refuses the put, never
//! crashes, and leaves the pool consistent.

use crate::common;

use common::{assert_all_load, config, get, put, temp_dir};
use kvtier_pool::{EntryRef, ReadOutcome, SsdTier, Tier};

const LEN: usize = 12_000; // 3 pages with the header
const OBJECT: u64 = 3 * 4096;

#[test]
fn eviction_keeps_the_pool_within_capacity_and_spares_pinned_objects() {
    let dir = temp_dir("ssd-capacity");
    let pool = SsdTier::open(config(dir.path(), 2, 10 * OBJECT)).unwrap(); // 10 objects per device
    let capacity = pool.capacity_bytes();
    assert_eq!(capacity, 20 * OBJECT);
    let first: Vec<u128> = (1..=20).collect();
    assert_eq!(put(&pool, &first, LEN).stored, 20);
    // Pin four of them (as a lease would).
    let mut located = vec![None; 4];
    assert_eq!(pool.locate(common::NS, &first[..4], &mut located, true, false), 4);
    let pinned: Vec<EntryRef> = located.iter().map(|l| l.unwrap().entry).collect();
    for round in 0..5u128 {
        let keys: Vec<u128> = (100 + 20 * round..120 + 20 * round).collect();
        let report = put(&pool, &keys, LEN);
        assert_eq!(report.stored + report.rejected, 20);
        assert!(pool.used_bytes() <= capacity, "over capacity: {} > {capacity}", pool.used_bytes());
        pool.check_integrity().unwrap();
    }
    assert!(pool.stats().evictions >= 80);
    assert!(first[..4].iter().all(|&k| pool.contains(common::NS, k)), "a pinned object was evicted");
    pool.unpin(&pinned);
    // Everything unpinned but full: the next put evicts the old pinned ones too.
    put(&pool, &(1000..1020).collect::<Vec<u128>>(), LEN);
    assert!(first[..4].iter().all(|&k| !pool.contains(common::NS, k)));
}

#[test]
fn all_pinned_means_rejected_not_grown() {
    let dir = temp_dir("ssd-all-pinned");
    let pool = SsdTier::open(config(dir.path(), 1, 4 * OBJECT)).unwrap();
    put(&pool, &[1, 2, 3, 4], LEN);
    let mut located = vec![None; 4];
    pool.locate(common::NS, &[1, 2, 3, 4], &mut located, true, false);
    let report = put(&pool, &[5, 6], LEN);
    assert_eq!((report.stored, report.rejected, report.evicted), (0, 2, 0));
    assert_eq!(pool.used_bytes(), pool.capacity_bytes());
    pool.unpin(&located.iter().map(|l| l.unwrap().entry).collect::<Vec<_>>());
    pool.check_integrity().unwrap();
}

#[test]
fn a_device_file_larger_than_the_free_space_is_refused_at_creation() {
    let dir = temp_dir("ssd-too-big");
    let mut c = config(dir.path(), 1, 0);
    c.capacity_bytes = 1 << 50; // 1 PiB
    let message = SsdTier::open(c).unwrap_err().to_string();
    assert!(message.contains("no space left on device") && message.contains("free"), "{message}");
}

#[test]
fn enospc_on_data_writes_refuses_the_put_and_the_pool_recovers() {
    let dir = temp_dir("ssd-enospc-data");
    let c = config(dir.path(), 2, 8 * OBJECT);
    let pool = SsdTier::open(c.clone()).unwrap();
    put(&pool, &[1, 2], LEN);
    pool.inject_device_error_for_test(1, true, libc::ENOSPC);
    let report = put(&pool, &[3, 4, 5, 6], LEN);
    assert_eq!(report.stored + report.rejected, 4);
    assert!(report.rejected >= 1, "{report:?}");
    assert!(pool.metrics().devices[1].io.io_errors >= 1);
    pool.check_integrity().unwrap();
    pool.inject_device_error_for_test(1, true, 0);
    let missing: Vec<u128> =
        [3u128, 4, 5, 6].into_iter().filter(|&k| !pool.contains(common::NS, k)).collect();
    assert_eq!(put(&pool, &missing, LEN).stored, missing.len());
    assert_all_load(&pool, &[1, 2, 3, 4, 5, 6], LEN);
    drop(pool);
    assert_all_load(&SsdTier::open(c).unwrap(), &[1, 2, 3, 4, 5, 6], LEN);
}

#[test]
fn enospc_on_the_log_refuses_the_put_and_puts_evicted_objects_back() {
    let dir = temp_dir("ssd-enospc-log");
    let c = config(dir.path(), 1, 4 * OBJECT);
    let pool = SsdTier::open(c.clone()).unwrap();
    assert_eq!(put(&pool, &[1, 2, 3, 4], LEN).stored, 4);
    pool.inject_log_error_for_test(libc::ENOSPC);
    // Needs evictions, whose Delete records cannot be logged: refused, victims restored.
    let report = put(&pool, &[5, 6], LEN);
    assert_eq!((report.stored, report.rejected, report.evicted), (0, 2, 0));
    assert_all_load(&pool, &[1, 2, 3, 4], LEN);
    pool.check_integrity().unwrap();
    pool.remove(common::NS, &[4]); // room without eviction; the Put record cannot be logged either
    assert_eq!(put(&pool, &[7], LEN).rejected, 1);
    assert_eq!(get(&pool, &[7], LEN)[0].0, None);
    assert!(pool.metrics().log_failures >= 2);
    pool.check_integrity().unwrap();
    pool.inject_log_error_for_test(0);
    assert_eq!(put(&pool, &[7], LEN).stored, 1);
    drop(pool);
    let pool = SsdTier::open(c).unwrap();
    assert_all_load(&pool, &[1, 2, 3, 7], LEN);
    assert_eq!(
        get(&pool, &[5, 6], LEN).iter().map(|r| r.0).collect::<Vec<Option<ReadOutcome>>>(),
        vec![None, None]
    );
    pool.check_integrity().unwrap();
}

#[test]
fn a_put_that_cannot_fit_even_after_evicting_evicts_nothing() {
    for eviction in ["lru", "s3fifo"] {
        let dir = temp_dir("ssd-no-useless-eviction");
        let mut c = config(dir.path(), 1, 10 * 4096);
        c.eviction = eviction.into();
        let pool = SsdTier::open(c.clone()).unwrap();
        let small: Vec<u128> = (1..=10).collect();
        assert_eq!(put(&pool, &small, 4000).stored, 10, "one page each: the device is full");
        // A lease on the object in the middle page: no 6 pages can be free side by side.
        let mut located = vec![None];
        assert_eq!(pool.locate(common::NS, &[6], &mut located, true, false), 1);
        let report = put(&pool, &[100], 6 * 4096 - 100);
        assert_eq!((report.stored, report.rejected, report.evicted), (0, 1, 0), "{eviction}: {report:?}");
        let kept: Vec<u128> = small.iter().copied().filter(|&k| pool.contains(common::NS, k)).collect();
        assert_eq!(kept, small, "{eviction}: objects evicted to make room that never came");
        assert_eq!(pool.stats().evictions, 0);
        pool.check_integrity().unwrap();
        pool.unpin(&[located[0].unwrap().entry]);
        // Room that eviction can make is still made.
        assert_eq!(put(&pool, &[101], 4000).evicted, 1);
        let kept: Vec<u128> = small.iter().copied().filter(|&k| pool.contains(common::NS, k)).collect();
        assert_eq!(kept.len(), 9);
        drop(pool);
        // No Delete record was logged for the objects given back.
        assert_all_load(&SsdTier::open(c).unwrap(), &kept, 4000);
    }
}
