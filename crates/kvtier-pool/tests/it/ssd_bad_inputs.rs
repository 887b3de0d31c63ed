//! Every bad input to the SSD pool is an error whose message names the problem — or, for a
//! failed bandwidth probe, a working pool with equal shares and a warning saying so.

use crate::common;

use common::{assert_all_load, config, put, temp_dir};
use kvtier_pool::{PoolError, SsdTier, Tier};

fn open_error(c: kvtier_pool::SsdConfig) -> String {
    match SsdTier::open(c) {
        Err(PoolError::SsdConfig(message)) => message,
        other => panic!("expected a config error, got {other:?}"),
    }
}

#[test]
fn missing_directory() {
    let dir = temp_dir("ssd-missing");
    let message = open_error(config(&dir.path().join("no/such/dir"), 1, 1 << 20));
    assert!(message.contains("does not exist") || message.contains("No such file"), "{message}");
    assert!(message.contains("expected an existing, writable directory"), "{message}");
}

#[test]
fn unwritable_directory() {
    // Root ignores permission bits; /sys refuses file creation even to root.
    let dir = temp_dir("ssd-unwritable");
    let target = if unsafe { libc::geteuid() } == 0 {
        std::path::PathBuf::from("/sys")
    } else {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o500)).unwrap();
        dir.path().to_path_buf()
    };
    let mut c = config(&target, 1, 1 << 20);
    c.devices = vec![dir.path().join("dev.kvtd")];
    let message = open_error(c);
    assert!(message.contains("is not writable"), "{message}");
    use std::os::unix::fs::PermissionsExt;
    let _ = std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755));
}

#[test]
fn device_smaller_than_one_object() {
    let dir = temp_dir("ssd-small-device");
    let mut c = config(dir.path(), 2, 8192);
    c.min_object_bytes = 3 * 4096;
    let message = open_error(c);
    assert!(message.contains("expected at least one object (12288 bytes"), "{message}");
}

#[test]
fn a_directory_in_use_by_another_pool() {
    let dir = temp_dir("ssd-in-use");
    let c = config(dir.path(), 1, 1 << 20);
    let _first = SsdTier::open(c.clone()).unwrap();
    let message = open_error(c);
    assert!(message.contains("in use by another store"), "{message}");
}

#[test]
fn a_device_in_use_by_another_open_pool_is_refused() {
    // Pool B, in its own directory, lists pool A's device: taking it would write B's
    // superblock and objects over A's, which A is still serving.
    let (dir_a, dir_b) = (temp_dir("ssd-device-in-use-a"), temp_dir("ssd-device-in-use-b"));
    let a_config = config(dir_a.path(), 1, 1 << 20);
    let a = SsdTier::open(a_config.clone()).unwrap();
    assert_eq!(put(&a, &[1, 2, 3], 9_000).stored, 3);
    let mut b_config = config(dir_b.path(), 1, 1 << 20);
    b_config.devices = a_config.devices.clone();
    let message = open_error(b_config.clone());
    let device = a_config.devices[0].display().to_string();
    assert!(message.contains(&device) && message.contains("in use by another open pool"), "{message}");
    assert_all_load(&a, &[1, 2, 3], 9_000);
    a.check_integrity().unwrap();
    drop(a);
    // Once A is closed its device is a kvtier device like any other: B may take it over.
    SsdTier::open(b_config).unwrap();
}

#[test]
fn devices_listed_differently_from_creation() {
    let dir = temp_dir("ssd-reordered");
    let c = config(dir.path(), 2, 1 << 20);
    drop(SsdTier::open(c.clone()).unwrap());
    let mut swapped = c.clone();
    swapped.devices.reverse();
    let message = open_error(swapped);
    assert!(message.contains("is device 1 of 2") && message.contains("expected device 0 of 2"), "{message}");
    let mut fewer = c.clone();
    fewer.devices.pop();
    let message = open_error(fewer);
    assert!(message.contains("has 2 devices; the config lists 1"), "{message}");
    std::fs::write(&c.devices[1], vec![0xAB; 8192]).unwrap();
    let message = open_error(c);
    assert!(message.contains("no kvtier device superblock"), "{message}");
}

#[test]
fn a_failed_bandwidth_probe_means_equal_shares_and_a_warning() {
    let dir = temp_dir("ssd-probe-fail");
    let mut c = config(dir.path(), 2, 1 << 20); // 1 MiB per device: no room for a 2 MiB probe
    c.probe_bytes = 8 << 20;
    let pool = SsdTier::open(c).unwrap();
    assert!(pool.bandwidth_source().starts_with("equal (probe failed"), "{}", pool.bandwidth_source());
    assert!(
        pool.warnings().iter().any(|w| w.contains("placing objects in equal shares")),
        "{:?}",
        pool.warnings()
    );
    let keys: Vec<u128> = (1..=10).collect();
    assert_eq!(put(&pool, &keys, 5000).stored, 10);
    assert_eq!(pool.metrics().devices.iter().map(|d| d.objects).collect::<Vec<_>>(), vec![5, 5]);
    assert_all_load(&pool, &keys, 5000);
}

#[test]
fn a_successful_probe_is_cached_in_the_pool_directory() {
    let dir = temp_dir("ssd-probe");
    let mut c = config(dir.path(), 1, 8 << 20);
    c.probe_bytes = 4 << 20;
    let first = SsdTier::open(c.clone()).unwrap();
    assert_eq!(first.bandwidth_source(), "probe");
    assert!(first.read_bandwidths()[0] > 1e6, "{:?}", first.read_bandwidths());
    drop(first);
    assert!(dir.path().join("bandwidth.cache").exists());
    let second = SsdTier::open(c).unwrap();
    assert_eq!(second.bandwidth_source(), "cache");
}

#[test]
fn invalid_values() {
    let dir = temp_dir("ssd-invalid");
    let mut c = config(dir.path(), 2, 1 << 20);
    c.bandwidth_bytes_per_s = Some(vec![1e9]);
    assert!(open_error(c).contains("expected one per device (2)"));
}

#[test]
fn reopening_with_another_capacity_keeps_the_pool_and_says_so() {
    let dir = temp_dir("ssd-resize");
    let c = config(dir.path(), 1, 1 << 20);
    put(&SsdTier::open(c.clone()).unwrap(), &[1, 2], 5000);
    let mut bigger = c;
    bigger.capacity_bytes = 4 << 20;
    let pool = SsdTier::open(bigger).unwrap();
    assert!(
        pool.warnings().iter().any(|w| w.contains("was created with 1048576 bytes")),
        "{:?}",
        pool.warnings()
    );
    assert_eq!(pool.capacity_bytes(), 1 << 20);
    assert_all_load(&pool, &[1, 2], 5000);
}

/// An existing file of other data named as a device is refused, untouched (not overwritten, not
/// grown); `format_devices` takes it over on purpose. An empty file is taken as it is.
#[test]
fn a_file_of_other_data_is_never_taken_over() {
    let dir = temp_dir("ssd-foreign-file");
    let mut c = config(dir.path(), 1, 1 << 20);
    let data: Vec<u8> = (0..10_000u32).map(|i| (i % 251) as u8 + 1).collect();
    std::fs::write(&c.devices[0], &data).unwrap();
    let message = open_error(c.clone());
    assert!(message.contains("holding other data") && message.contains("ssd.format_devices"), "{message}");
    assert_eq!(std::fs::read(&c.devices[0]).unwrap(), data, "the file was changed");
    c.format_devices = true;
    let pool = SsdTier::open(c.clone()).unwrap();
    assert_eq!(put(&pool, &[1, 2], 5000).stored, 2);
    drop(pool);
    // An empty file is the user's file for the pool: no flag needed.
    let dir = temp_dir("ssd-empty-file");
    let c = config(dir.path(), 1, 1 << 20);
    std::fs::write(&c.devices[0], b"").unwrap();
    let pool = SsdTier::open(c).unwrap();
    assert_eq!(put(&pool, &[1], 5000).stored, 1);
}

/// A symbolic link where a device file goes (the default one in the pool directory, or a listed
/// one) is refused before anything is written: the link's target keeps its bytes.
#[test]
fn a_planted_link_is_never_written_through() {
    for listed in [false, true] {
        let dir = temp_dir(&format!("ssd-link-{listed}"));
        let pool_dir = dir.path().join("pool");
        std::fs::create_dir(&pool_dir).unwrap();
        let target = dir.path().join("victim");
        std::fs::write(&target, b"").unwrap(); // empty: only the link makes it off limits
        let mut c = kvtier_pool::SsdConfig::new(&pool_dir);
        c.capacity_bytes = 1 << 20;
        c.probe_bytes = 0;
        let link =
            pool_dir.join(if listed { "listed.kvtd" } else { kvtier_pool::ssd::config::DEFAULT_DEVICE_FILE });
        if listed {
            c.devices = vec![link.clone()];
        }
        std::os::unix::fs::symlink(&target, &link).unwrap();
        let message = open_error(c);
        assert!(message.contains("symbolic link"), "{message}");
        assert_eq!(std::fs::metadata(&target).unwrap().len(), 0, "the link's target was written");
    }
}

/// Files the pool creates are owner-only whatever the umask; a directory every user can write
/// is refused.
#[test]
fn pool_files_are_private_and_a_shared_directory_is_refused() {
    use std::os::unix::fs::PermissionsExt;
    let dir = temp_dir("ssd-modes");
    // SAFETY: umask is process-wide; this test's files are created while it is 0. Other tests
    // running meanwhile create files with wider modes than usual: the pool narrows its own files,
    // and `temp_dir` gives its directories mode 0700 explicitly.
    let old = unsafe { libc::umask(0) };
    let pool = SsdTier::open(config(dir.path(), 2, 1 << 20));
    unsafe { libc::umask(old) };
    let pool = pool.unwrap();
    assert_eq!(put(&pool, &[1], 5000).stored, 1);
    pool.flush().unwrap();
    drop(pool);
    let mut seen = 0;
    for entry in std::fs::read_dir(dir.path()).unwrap() {
        let entry = entry.unwrap();
        let mode = entry.metadata().unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600, "{} is {mode:o}", entry.path().display());
        seen += 1;
    }
    assert!(seen >= 4, "lock, log and two devices: saw {seen}");
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o777)).unwrap();
    let message = open_error(config(dir.path(), 2, 1 << 20));
    assert!(message.contains("writable by every user"), "{message}");
}

/// A device of an existing pool truncated to nothing is named as such, not an I/O error.
#[test]
fn a_truncated_device_is_named() {
    let dir = temp_dir("ssd-zero-device");
    let c = config(dir.path(), 1, 1 << 20);
    drop(SsdTier::open(c.clone()).unwrap());
    std::fs::File::create(&c.devices[0]).unwrap();
    let message = open_error(c);
    assert!(message.contains("0 bytes") && message.contains("too short"), "{message}");
}
