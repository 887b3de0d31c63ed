//! A compaction whose rename landed but whose directory sync failed still leaves one log: every
//! later record goes to the file the directory names, so a restart finds exactly what the pool
//! acknowledged (and nothing it removed). With `fsync` durability, a put is acknowledged only
//! once the rename is durable too. A compaction that cannot run at open (a full disk) is skipped
//! with a warning, never a reason to refuse the pool.

use crate::common;

use common::{assert_all_load, config, get, put, temp_dir, NS};
use kvtier_pool::{Durability, SsdTier, Tier};

const LEN: usize = 9_000;

#[test]
fn records_after_a_compaction_whose_directory_sync_failed_survive_a_restart() {
    for durability in [Durability::None, Durability::Fsync] {
        let dir = temp_dir("ssd-compaction-dir-sync");
        let mut c = config(dir.path(), 1, 64 * 3 * 4096);
        c.durability = durability;
        let pool = SsdTier::open(c.clone()).unwrap();
        assert_eq!(put(&pool, &[1, 2, 3, 4], LEN).stored, 4);
        assert_eq!(pool.remove(NS, &[1]), 1);
        pool.inject_dir_sync_error_for_test(libc::EIO);
        assert!(pool.compact().is_err(), "the directory sync failed");
        pool.inject_dir_sync_error_for_test(0);
        // Acknowledged after the failed sync: these records must reach the log a restart reads.
        assert_eq!(put(&pool, &[5, 6, 7, 8], LEN).stored, 4, "{}", durability.name());
        assert_eq!(pool.remove(NS, &[2]), 1);
        drop(pool);
        let pool = SsdTier::open(c).unwrap();
        assert_all_load(&pool, &[3, 4, 5, 6, 7, 8], LEN);
        let removed: Vec<bool> = get(&pool, &[1, 2], LEN).iter().map(|r| r.0.is_some()).collect();
        assert_eq!(removed, vec![false, false], "{}: a removed object came back", durability.name());
        pool.check_integrity().unwrap();
    }
}

#[test]
fn with_fsync_a_put_is_refused_until_the_compacted_log_is_durable() {
    let dir = temp_dir("ssd-compaction-dir-sync-fsync");
    let mut c = config(dir.path(), 1, 64 * 3 * 4096);
    c.durability = Durability::Fsync;
    let pool = SsdTier::open(c.clone()).unwrap();
    assert_eq!(put(&pool, &[1, 2], LEN).stored, 2);
    pool.inject_dir_sync_error_for_test(libc::EIO);
    let failed = pool.compact().unwrap_err().to_string();
    assert!(failed.contains("syncing the pool directory"), "{failed}");
    // The rename may not survive a power loss: nothing can be acknowledged as durable yet.
    let refused = put(&pool, &[3], LEN);
    assert_eq!((refused.stored, refused.rejected), (0, 1), "{refused:?}");
    assert!(!pool.contains(NS, 3));
    assert!(pool.metrics().log_failures >= 1);
    pool.inject_dir_sync_error_for_test(0);
    assert_eq!(put(&pool, &[3], LEN).stored, 1);
    drop(pool);
    let pool = SsdTier::open(c).unwrap();
    assert_all_load(&pool, &[1, 2, 3], LEN);
    pool.check_integrity().unwrap();
}

#[test]
fn a_compaction_that_fails_at_open_leaves_the_pool_usable() {
    let dir = temp_dir("ssd-compaction-at-open");
    let mut c = config(dir.path(), 1, 64 * 3 * 4096);
    let pool = SsdTier::open(c.clone()).unwrap();
    let keys: Vec<u128> = (1..=40).collect();
    assert_eq!(put(&pool, &keys, LEN).stored, 40);
    assert_eq!(pool.remove(NS, &keys[4..]), 36);
    drop(pool);
    // 76 records for 4 live objects: the next open compacts, and cannot write the compacted
    // file (a directory is in its way here; a full file system fails it the same way).
    c.compact_min_records = 8;
    let tmp = dir.path().join("index.log.tmp");
    std::fs::create_dir(&tmp).unwrap();
    let pool = SsdTier::open(c.clone()).expect("compaction only saves space: the pool opens without it");
    assert!(pool.warnings().iter().any(|w| w.contains("compacting")), "{:?}", pool.warnings());
    assert_all_load(&pool, &keys[..4], LEN);
    assert_eq!(put(&pool, &[50], LEN).stored, 1);
    drop(pool);
    std::fs::remove_dir(&tmp).unwrap();
    let pool = SsdTier::open(c).unwrap();
    assert_eq!(pool.metrics().log_records, 5, "compacted at this open");
    assert_all_load(&pool, &[1, 2, 3, 4, 50], LEN);
    pool.check_integrity().unwrap();
}

#[test]
fn flush_syncs_the_devices_data_before_the_log() {
    // A log synced first would name objects whose bytes a crash before the devices' sync
    // loses. Here both syncs fail, each with its own errno: the device's error is the one
    // flush reports, so the log was never synced ahead of the data.
    let dir = temp_dir("ssd-flush-order");
    let pool = SsdTier::open(config(dir.path(), 1, 64 * 3 * 4096)).unwrap();
    assert_eq!(put(&pool, &[1, 2], LEN).stored, 2);
    pool.inject_dir_sync_error_for_test(libc::EIO);
    assert!(pool.compact().is_err(), "the directory sync failed: the log's sync is pending");
    pool.inject_device_error_for_test(0, true, libc::ENOSPC);
    let failed = pool.flush().unwrap_err();
    assert_eq!(failed.raw_os_error(), Some(libc::ENOSPC), "the log was synced first: {failed}");
    pool.inject_device_error_for_test(0, true, 0);
    pool.inject_dir_sync_error_for_test(0);
    pool.flush().unwrap();
    assert_all_load(&pool, &[1, 2], LEN);
    pool.check_integrity().unwrap();
}
