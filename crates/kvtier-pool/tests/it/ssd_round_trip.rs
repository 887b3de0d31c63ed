//! Objects written across several devices come back byte for byte, where Algorithm 1 (or
//! round-robin) put them, and again after the pool is closed and reopened.

use crate::common;

use common::{assert_all_load, config, put, temp_dir};
use kvtier_pool::{Placement, SsdTier, Tier, TierKind};

const LEN: usize = 40_000; // 10 pages with the header

#[test]
fn round_trip_across_devices_with_bandwidth_placement() {
    let dir = temp_dir("ssd-round-trip");
    let mut c = config(dir.path(), 3, 4 << 20);
    c.bandwidth_bytes_per_s = Some(vec![3e9, 2e9, 1e9]);
    let keys: Vec<u128> = (1..=12).collect();
    {
        let pool = SsdTier::open(c.clone()).unwrap();
        assert_eq!(pool.kind(), TierKind::Ssd);
        assert_eq!(pool.bandwidth_source(), "config");
        let report = put(&pool, &keys, LEN);
        assert_eq!((report.stored, report.already_present, report.rejected), (12, 0, 0));
        // 12 objects at 3:2:1 → exactly 6, 4, 2.
        let per_device: Vec<u64> = pool.metrics().devices.iter().map(|d| d.objects).collect();
        assert_eq!(per_device, vec![6, 4, 2]);
        assert_all_load(&pool, &keys, LEN);
        assert_eq!(put(&pool, &keys[..3], LEN).already_present, 3, "content-addressed: same key, no rewrite");
        pool.check_integrity().unwrap();
        let m = pool.metrics();
        assert!(m.devices.iter().all(|d| d.io.bytes_written > 0 && d.io.bytes_read > 0 && d.direct_io));
        assert_eq!(m.devices.iter().map(|d| d.io.write_ops).sum::<u64>(), 12);
    }
    let pool = SsdTier::open(c).unwrap();
    assert_eq!(pool.recovery().recovered_objects, 12);
    assert_eq!(pool.stats().objects, 12);
    assert_all_load(&pool, &keys, LEN);
    pool.check_integrity().unwrap();
}

#[test]
fn round_robin_spreads_evenly_across_batches() {
    let dir = temp_dir("ssd-round-robin");
    let mut c = config(dir.path(), 2, 4 << 20);
    c.placement = Placement::RoundRobin;
    c.bandwidth_bytes_per_s = Some(vec![3e9, 1e9]);
    let pool = SsdTier::open(c).unwrap();
    for k in 1..=6u128 {
        put(&pool, &[k], LEN); // batches of one still alternate
    }
    let per_device: Vec<u64> = pool.metrics().devices.iter().map(|d| d.objects).collect();
    assert_eq!(per_device, vec![3, 3]);
    assert_all_load(&pool, &(1..=6).collect::<Vec<u128>>(), LEN);
}

#[test]
fn pread_engine_and_fsync_durability_round_trip() {
    let dir = temp_dir("ssd-pread");
    let mut c = config(dir.path(), 2, 4 << 20);
    c.io_engine = kvtier_pool::IoEngineKind::Pread;
    c.durability = kvtier_pool::Durability::Fsync;
    let pool = SsdTier::open(c).unwrap();
    assert_eq!(pool.engine_name(), "pread");
    let keys: Vec<u128> = (100..120).collect();
    assert_eq!(put(&pool, &keys, 5000).stored, 20);
    assert_all_load(&pool, &keys, 5000);
    pool.check_integrity().unwrap();
}

#[test]
fn the_index_log_is_compacted_and_recovery_still_finds_everything() {
    let dir = temp_dir("ssd-compaction");
    let mut c = config(dir.path(), 2, 20 * 4096); // 20 one-page objects per device
    c.compact_min_records = 32;
    let pool = SsdTier::open(c.clone()).unwrap();
    for round in 0..20u128 {
        let keys: Vec<u128> = (round * 10..round * 10 + 10).collect();
        assert_eq!(put(&pool, &keys, 100).stored, 10);
    }
    let m = pool.metrics();
    assert!(m.compactions > 0, "200 puts and 160 evictions over 40 slots never compacted");
    assert!(
        m.log_records <= 2 * m.tier.objects + 32,
        "log holds {} records for {} objects",
        m.log_records,
        m.tier.objects
    );
    assert!(m.log_generation > 0);
    let live: Vec<u128> = (0..200).filter(|&k| pool.contains(common::NS, k)).collect();
    assert_eq!(live.len() as u64, m.tier.objects);
    drop(pool);
    let pool = SsdTier::open(c).unwrap();
    assert_eq!(pool.recovery().recovered_objects, live.len() as u64);
    assert_all_load(&pool, &live, 100);
    pool.check_integrity().unwrap();
}

/// `clear` drops every object of one namespace (and logs it: a reopened pool does not bring them
/// back); another namespace's objects stay and load.
#[test]
fn a_cleared_namespace_stays_gone_after_reopening() {
    let dir = temp_dir("ssd-clear");
    let c = config(dir.path(), 2, 64 * 4096);
    let pool = SsdTier::open(c.clone()).unwrap();
    let ours: Vec<u128> = (0..12).collect();
    let theirs: Vec<u128> = (100..104).collect();
    let other = common::NS + 1;
    assert_eq!(put(&pool, &ours, 3000).stored, 12);
    let payloads: Vec<Vec<u8>> = theirs.iter().map(|&k| common::payload(k, 3000)).collect();
    let refs: Vec<&[u8]> = payloads.iter().map(|p| &p[..]).collect();
    assert_eq!(pool.put(other, &theirs, &refs).stored, 4);
    assert_eq!(pool.clear(common::NS), Ok(12));
    assert!(ours.iter().all(|&k| !pool.contains(common::NS, k)));
    assert!(theirs.iter().all(|&k| pool.contains(other, k)));
    assert_eq!(pool.clear(common::NS), Ok(0));
    pool.check_integrity().unwrap();
    drop(pool);
    let pool = SsdTier::open(c).unwrap();
    assert_eq!(pool.recovery().recovered_objects, 4);
    assert!(ours.iter().all(|&k| !pool.contains(common::NS, k)));
    let mut bufs = vec![vec![0u8; 3000]; 4];
    let mut dst: Vec<&mut [u8]> = bufs.iter_mut().map(|b| &mut b[..]).collect();
    let outcomes = pool.get(other, &theirs, &mut dst).unwrap();
    assert!(outcomes.iter().all(|o| *o == Some(kvtier_pool::ReadOutcome::Loaded)));
    assert!(bufs.iter().zip(&payloads).all(|(b, p)| b == p));
    pool.check_integrity().unwrap();
}
