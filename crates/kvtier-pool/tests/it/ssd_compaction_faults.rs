//! A compaction whose rename landed but whose directory sync failed still leaves one log: every
//! later record goes to the file the directory names, so a restart finds exactly what the pool
//! acknowledged (and nothing it removed). With `fsync` durability, a put is acknowledged only
//! once the rename is durable too.

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
