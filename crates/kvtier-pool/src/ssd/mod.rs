//! The SSD tier: a unified pool over several devices with KV-passthrough (Unified KV pooling,
//! §IV): no file per object and no file system on the read path.
//!
//! - **Devices** ([`device`]): raw block devices or large pre-allocated files, O_DIRECT, each
//!   with a superblock naming its pool and position; one [`worker`] thread per device running
//!   io_uring (where the kernel allows, [`engine`]) or pread/pwrite, up to `io_depth` in flight.
//! - **Allocation and lookup** ([`state`]): an extent allocator and an eviction policy per
//!   device, and one global lookup table key → (device, extent, length, checksum).
//! - **Placement** ([`placement`]): a batch of new objects is spread in proportion to each
//!   device's bandwidth ([`probe`], cached, or configured) by Algorithm 1, or round-robin.
//!   Reads of a batch are grouped by device and run on all devices at once.
//! - **Crash safety** ([`log`], [`recovery`]): an append-only, checksummed index log, compacted
//!   when it holds mostly dead records. An object becomes visible only after its data write
//!   completed and its record was appended (and, with `fsync` durability, both were synced).
//!   A restart replays the log; torn records and objects without a record are dropped.
//!
//! An object on a device is its bare payload, zero-padded to whole 4 KiB pages, so a 2 MiB
//! block is one aligned 2 MiB transfer, moved in place to or from a page-aligned buffer (a DRAM
//! extent being demoted, an engine's pinned buffer) without a copy. What the object is — key,
//! namespace, length, XXH3 checksum — lives in the table and the index log (`docs/formats.md`
//! §4). Every read checks the payload's checksum (and the namespace): a stale entry, a torn or
//! flipped byte is a counted miss, never data.
//!
//! Lock order: `log`, then `state`. No lock is held during data I/O; the log lock is held while
//! appending (and syncing) records and publishing their entries, so a compaction's snapshot can
//! never miss an object whose record went to the log it replaces.

#[cfg(feature = "bench-baselines")]
pub mod baseline;
pub mod buffer;
pub mod config;
pub mod device;
pub mod engine;
pub mod files;
pub mod format;
pub mod log;
pub mod metrics;
pub use metrics::{SsdDeviceReport, SsdMetrics};
pub mod placement;
pub mod probe;
pub mod recovery;
mod state;
pub mod throttle;
mod tier_impl;
mod worker;
mod writes;

use std::fs::File;
use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use parking_lot::Mutex;

pub use config::{Durability, IoEngineKind, Placement, SsdConfig};
pub use metrics::DeviceMetricsSnapshot;
pub use recovery::RecoveryStats;

use device::{Device, DeviceSpec};
use engine::{probe_io_uring, Engine, SyncEngine, UringEngine};
use log::IndexLog;
use probe::Bandwidth;
use state::{DeviceSpace, SsdState};
use throttle::TokenBucket;
use worker::IoWorker;

use crate::error::PoolError;
use crate::eviction;
use crate::extent::{ExtentAllocator, PAGE_BYTES};

const LOCK_FILE: &str = "lock";

/// What [`SsdTier::attach`] opens: the log, its replay, the devices, the pool id.
type Attached = (IndexLog, log::Replay, Vec<Device>, u128);

/// The SSD pool tier. Internally synchronised; see the module docs.
pub struct SsdTier {
    config: SsdConfig,
    devices: Vec<Arc<Device>>,
    workers: Vec<IoWorker>,
    /// Read bandwidth per device (bytes/s) that placement weighs by, and where it came from.
    bandwidths: Vec<Bandwidth>,
    bandwidth_source: String,
    state: Mutex<SsdState>,
    log: Mutex<IndexLog>,
    recovery: RecoveryStats,
    warnings: Vec<String>,
    pool_id: u128,
    /// Held (flock) for the tier's lifetime: one process per pool directory.
    _lock: File,
}

fn config_error(msg: String) -> PoolError {
    PoolError::SsdConfig(msg)
}

/// Takes the pool directory's lock, or says why not.
fn lock_directory(dir: &Path) -> Result<File, PoolError> {
    files::check_directory(dir)?;
    let path = dir.join(LOCK_FILE);
    let file = files::open_private(&path, files::Create::Either, false, 0).map_err(|e| {
        config_error(format!(
            "ssd directory {} is not writable ({e}); expected an existing, writable directory",
            dir.display()
        ))
    })?;
    match files::lock_exclusive(&file) {
        Ok(true) => Ok(file),
        Ok(false) => Err(config_error(format!(
            "ssd directory {} is in use by another store (its lock file is held); expected one store per directory",
            dir.display()
        ))),
        Err(e) => Err(config_error(format!("ssd directory {}: cannot lock {LOCK_FILE} ({e})", dir.display()))),
    }
}

/// A fresh pool id: not secret, only distinct between pools.
fn new_pool_id() -> u128 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos()),
    );
    h.write_u32(std::process::id());
    let a = h.finish();
    h.write_u64(a);
    (u128::from(a) << 64) | u128::from(h.finish())
}

impl SsdTier {
    /// Opens the pool in `config.directory`, creating it if it has no index log yet, and
    /// recovers every object the log names.
    pub fn open(config: SsdConfig) -> Result<SsdTier, PoolError> {
        config.validate()?;
        let dir = config.directory.clone();
        let lock = lock_directory(&dir)?;
        let mut warnings = Vec::new();
        let started = Instant::now();
        let throttles =
            config.throttle_bytes_per_s.clone().unwrap_or_else(|| vec![0.0; config.device_paths().len()]);
        let (log, replay, devices, pool_id) = Self::attach(&config, &mut warnings)?;
        let mut devices: Vec<Arc<Device>> = devices
            .into_iter()
            .zip(&throttles)
            .map(|(mut d, &rate)| {
                d.throttle = (rate > 0.0).then(|| TokenBucket::new(rate));
                Arc::new(d)
            })
            .collect();
        let mut state = Self::new_state(&config, &devices)?;
        let mut recovery =
            RecoveryStats { dropped_tail_bytes: replay.dropped_tail_bytes, ..RecoveryStats::default() };
        let data_bytes: Vec<u64> = devices.iter().map(|d| d.data_bytes).collect();
        for record in recovery::rebuild(&replay.records, &data_bytes, &mut recovery) {
            assert!(state.restore(&record), "recovery yielded an overlapping or duplicate entry");
        }
        let mut log = log;
        if log.records() > config.compact_min_records.max(2 * state.index.len() as u64) {
            // Compaction only saves space: a full disk must not keep the pool from opening.
            match log.rewrite(&state.live_records()) {
                Ok(()) => state.counters.compactions += 1,
                Err(e) => warnings.push(format!(
                    "compacting the index log at open failed ({e}); continuing with the log as it is"
                )),
            }
        }
        recovery.seconds = started.elapsed().as_secs_f64();
        let workers = Self::spawn_workers(&config, &mut devices, &mut warnings)?;
        let mut tier = SsdTier {
            config,
            devices,
            workers,
            bandwidths: Vec::new(),
            bandwidth_source: String::new(),
            state: Mutex::new(state),
            log: Mutex::new(log),
            recovery,
            warnings,
            pool_id,
            _lock: lock,
        };
        tier.measure_bandwidths();
        Ok(tier)
    }

    /// Opens the pool's log and devices, or creates them (devices first: a log marks a
    /// complete pool). Returns the log, what replaying it found, the devices and the pool id.
    fn attach(config: &SsdConfig, warnings: &mut Vec<String>) -> Result<Attached, PoolError> {
        let dir = &config.directory;
        let paths = config.device_paths();
        let count = u16::try_from(paths.len()).expect("validated device count");
        if IndexLog::path(dir).exists() {
            let (log, replay) = IndexLog::open(dir, config.durability)?;
            let header = log.header();
            if header.device_count != count {
                return Err(config_error(format!(
                    "the pool in {} has {} devices; the config lists {count} (list the devices it was created with)",
                    dir.display(),
                    header.device_count
                )));
            }
            let mut devices = Vec::new();
            for (i, path) in paths.iter().enumerate() {
                let spec = spec(config, i as u16, count, path, header.pool_id, 0);
                devices.push(Device::open(&spec, warnings)?);
            }
            let existing: u64 = devices.iter().map(|d| d.data_bytes).sum();
            let wanted =
                config.capacity_bytes / u64::from(count) / PAGE_BYTES * PAGE_BYTES * u64::from(count);
            if existing != wanted && devices.iter().all(|d| !d.is_block_device) {
                warnings.push(format!(
                    "the pool in {} was created with {existing} bytes of object space; keeping that \
                     (capacity_bytes {} applies to a new pool: delete the directory to resize)",
                    dir.display(),
                    config.capacity_bytes
                ));
            }
            Ok((log, replay, devices, header.pool_id))
        } else {
            let pool_id = new_pool_id();
            let share = config.capacity_bytes / u64::from(count);
            let mut devices = Vec::new();
            for (i, path) in paths.iter().enumerate() {
                devices.push(Device::create(&spec(config, i as u16, count, path, pool_id, share), warnings)?);
            }
            let log = IndexLog::create(dir, pool_id, count, config.durability)?;
            Ok((log, log::Replay::default(), devices, pool_id))
        }
    }

    fn new_state(config: &SsdConfig, devices: &[Arc<Device>]) -> Result<SsdState, PoolError> {
        let mut spaces = Vec::new();
        for d in devices {
            if d.data_bytes < config.min_object_bytes {
                return Err(config_error(format!(
                    "device {} holds {} bytes of object space; expected at least one object ({} bytes)",
                    d.path.display(),
                    d.data_bytes,
                    config.min_object_bytes
                )));
            }
            spaces.push(DeviceSpace {
                allocator: ExtentAllocator::new(d.data_bytes),
                policy: eviction::by_name(&config.eviction)?,
            });
        }
        Ok(SsdState::new(spaces))
    }

    fn spawn_workers(
        config: &SsdConfig,
        devices: &mut [Arc<Device>],
        warnings: &mut Vec<String>,
    ) -> Result<Vec<IoWorker>, PoolError> {
        let use_uring = match config.io_engine {
            IoEngineKind::Pread => false,
            IoEngineKind::IoUring => {
                probe_io_uring().map_err(|e| config_error(format!("io_engine is \"io_uring\" but the kernel refuses it ({e}); use \"auto\" or \"pread\"")))?;
                true
            }
            IoEngineKind::Auto => {
                match probe_io_uring() {
                    Ok(()) => true,
                    Err(e) => {
                        warnings.push(format!("io_uring is unavailable ({e}); devices use pread/pwrite, one operation at a time"));
                        false
                    }
                }
            }
        };
        let mut workers = Vec::new();
        for d in devices.iter() {
            let engine: Box<dyn Engine> = if use_uring {
                Box::new(UringEngine::new(config.io_depth).map_err(|e| PoolError::SsdIo {
                    what: "setting up io_uring for",
                    path: d.path.display().to_string(),
                    reason: e.to_string(),
                })?)
            } else {
                Box::new(SyncEngine::default())
            };
            let worker =
                IoWorker::spawn(Arc::clone(d), engine, config.io_depth).map_err(|e| PoolError::SsdIo {
                    what: "starting the I/O worker of",
                    path: d.path.display().to_string(),
                    reason: e.to_string(),
                })?;
            workers.push(worker);
        }
        Ok(workers)
    }

    /// Sets `bandwidths`: from the config, the cache, or a probe of free space on each device.
    fn measure_bandwidths(&mut self) {
        let n = self.devices.len();
        if let Some(values) = &self.config.bandwidth_bytes_per_s {
            self.bandwidths =
                values.iter().map(|&b| Bandwidth { read_bytes_per_s: b, write_bytes_per_s: b }).collect();
            self.bandwidth_source = "config".into();
            return;
        }
        let devices: Vec<&Device> = self.devices.iter().map(|d| &**d).collect();
        if let Some(cached) = probe::load_cache(&self.config.directory, &devices) {
            self.bandwidths = cached;
            self.bandwidth_source = "cache".into();
            return;
        }
        let equal = vec![Bandwidth { read_bytes_per_s: 1.0, write_bytes_per_s: 1.0 }; n];
        if self.config.probe_bytes == 0 {
            self.bandwidths = equal;
            self.bandwidth_source = "equal (probe disabled)".into();
            return;
        }
        match self.probe_all() {
            Ok(values) => {
                probe::save_cache(&self.config.directory, &devices, &values);
                self.bandwidths = values;
                self.bandwidth_source = "probe".into();
            }
            Err(e) => {
                self.warnings.push(format!("bandwidth probe failed ({e}); placing objects in equal shares"));
                self.bandwidths = equal;
                self.bandwidth_source = format!("equal (probe failed: {e})");
            }
        }
    }

    fn probe_all(&self) -> Result<Vec<Bandwidth>, String> {
        let mut values = Vec::new();
        for (i, device) in self.devices.iter().enumerate() {
            let extent = {
                let mut st = self.state.lock();
                let allocator = &mut st.spaces[i].allocator;
                let bytes = self.config.probe_bytes.min(allocator.largest_free_bytes())
                    / probe::PROBE_CHUNK_BYTES as u64
                    * probe::PROBE_CHUNK_BYTES as u64;
                if bytes == 0 {
                    return Err(format!(
                        "device {} has no free {}-byte extent to probe",
                        device.path.display(),
                        probe::PROBE_CHUNK_BYTES
                    ));
                }
                allocator.allocate(bytes).expect("the largest free extent fits")
            };
            let result = probe::probe(device, &self.workers[i], extent);
            self.state.lock().spaces[i].allocator.free(extent);
            values.push(result.map_err(|e| format!("device {}: {e}", device.path.display()))?);
        }
        Ok(values)
    }

    /// Warnings from opening (O_DIRECT or io_uring fallbacks, a failed probe, ...).
    pub fn warnings(&self) -> &[String] {
        &self.warnings
    }
    pub fn recovery(&self) -> RecoveryStats {
        self.recovery
    }
    pub fn pool_id(&self) -> u128 {
        self.pool_id
    }
    pub fn device_count(&self) -> usize {
        self.devices.len()
    }
    /// Read bandwidth per device, bytes/s, as placement uses it.
    pub fn read_bandwidths(&self) -> Vec<f64> {
        self.bandwidths.iter().map(|b| b.read_bytes_per_s).collect()
    }
    pub fn bandwidth_source(&self) -> &str {
        &self.bandwidth_source
    }
    pub fn engine_name(&self) -> &'static str {
        self.workers.first().map_or("none", |w| w.engine_name())
    }
    pub fn config(&self) -> &SsdConfig {
        &self.config
    }

    /// Makes every acknowledged object durable now: every device's data synced, then the log.
    /// In that order, as a put writes its bytes before its record: a crash between the two
    /// leaves durable bytes no record names (free space at restart), never a record naming
    /// bytes that are not; a failed device sync returns before the log is synced.
    pub fn flush(&self) -> std::io::Result<()> {
        for d in &self.devices {
            d.sync_data()?;
        }
        self.log.lock().sync()
    }

    /// Rewrites the index log to hold only the live objects.
    pub fn compact(&self) -> Result<(), PoolError> {
        let mut log = self.log.lock();
        let live = self.state.lock().live_records();
        log.rewrite(&live)?;
        self.state.lock().counters.compactions += 1;
        Ok(())
    }

    /// Fault injection (tests): fail every write (`write`: and every sync of `flush`) or read
    /// of `device` with `errno` (0 clears).
    #[cfg(feature = "test-hooks")]
    pub fn inject_device_error_for_test(&self, device: usize, write: bool, errno: i32) {
        let cell = if write {
            &self.devices[device].fail_writes_errno
        } else {
            &self.devices[device].fail_reads_errno
        };
        cell.store(errno, std::sync::atomic::Ordering::Relaxed);
    }

    /// Fault injection (tests): fail every index-log append with `errno` (0 clears).
    #[cfg(feature = "test-hooks")]
    pub fn inject_log_error_for_test(&self, errno: i32) {
        self.log.lock().fail_errno = errno;
    }

    /// Fault injection (tests): fail every sync of the pool directory (after a compaction's
    /// rename) with `errno` (0 clears).
    #[cfg(feature = "test-hooks")]
    pub fn inject_dir_sync_error_for_test(&self, errno: i32) {
        self.log.lock().fail_dir_sync_errno = errno;
    }
}

fn spec<'a>(
    config: &SsdConfig,
    index: u16,
    count: u16,
    path: &'a Path,
    pool_id: u128,
    data_bytes: u64,
) -> DeviceSpec<'a> {
    DeviceSpec {
        index,
        count,
        path,
        pool_id,
        data_bytes,
        min_object_bytes: config.min_object_bytes,
        direct: config.direct_io,
        format: config.format_devices,
    }
}

impl Drop for SsdTier {
    fn drop(&mut self) {
        // Workers first (they finish nothing in flight: every batch is waited for), then make
        // what `none` durability left in the page cache durable.
        self.workers.clear();
        let _ = self.flush();
    }
}

impl std::fmt::Debug for SsdTier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SsdTier")
            .field("directory", &self.config.directory)
            .field("devices", &self.devices.iter().map(|d| &d.path).collect::<Vec<_>>())
            .field("engine", &self.engine_name())
            .finish()
    }
}
