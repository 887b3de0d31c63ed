//! Configuration of the SSD pool, validated by [`SsdConfig::validate`] before any file is touched.

use std::path::PathBuf;

use crate::error::PoolError;
use crate::eviction::POLICY_NAMES;

/// Default total pool size: 8 GiB.
pub const SSD_CAPACITY_BYTES_DEFAULT: u64 = 8 << 30;
/// Default in-flight I/O operations per device.
pub const IO_DEPTH_DEFAULT: usize = 8;
/// Largest `io_depth` accepted.
pub const IO_DEPTH_MAX: usize = 256;
/// Most devices in one pool (device indexes are `u16` on disk; this is the practical bound).
pub const DEVICES_MAX: usize = 64;
/// Default bytes written then read per device by the bandwidth probe.
pub const PROBE_BYTES_DEFAULT: u64 = 64 << 20;
/// Largest probe accepted.
pub const PROBE_BYTES_MAX: u64 = 4 << 30;
/// The index log is compacted once it holds more than this many records and more than twice
/// as many as there are live objects.
pub const COMPACT_MIN_RECORDS_DEFAULT: u64 = 1 << 16;
/// Name of the default device file, created in the pool directory when no device is named.
pub const DEFAULT_DEVICE_FILE: &str = "device-0.kvtd";

/// When a `put` returns.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Durability {
    /// When the data writes completed and the index records are written to the log file (in the
    /// page cache): survives a killed process, not necessarily a power loss.
    None,
    /// When the data and the index records are on stable storage (`fdatasync` of every device
    /// written and of the log): every acknowledged object survives a crash or power loss.
    Fsync,
}

impl Durability {
    pub fn parse(name: &str) -> Result<Self, PoolError> {
        match name {
            "none" => Ok(Durability::None),
            "fsync" => Ok(Durability::Fsync),
            _ => Err(PoolError::SsdConfig(format!("durability is {name:?}; expected \"none\" or \"fsync\""))),
        }
    }
    pub fn name(self) -> &'static str {
        match self {
            Durability::None => "none",
            Durability::Fsync => "fsync",
        }
    }
}

/// How a batch of new objects is spread over the devices.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Placement {
    /// In proportion to each device's bandwidth (Unified KV pooling, Algorithm 1).
    Bandwidth,
    /// One object per device in turn (for comparison).
    RoundRobin,
}

impl Placement {
    pub fn parse(name: &str) -> Result<Self, PoolError> {
        match name {
            "bandwidth" => Ok(Placement::Bandwidth),
            "round_robin" => Ok(Placement::RoundRobin),
            _ => Err(PoolError::SsdConfig(format!(
                "placement is {name:?}; expected \"bandwidth\" or \"round_robin\""
            ))),
        }
    }
    pub fn name(self) -> &'static str {
        match self {
            Placement::Bandwidth => "bandwidth",
            Placement::RoundRobin => "round_robin",
        }
    }
}

/// Which I/O engine the device workers use.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum IoEngineKind {
    /// io_uring if the kernel allows it (probed at start), else pread/pwrite.
    Auto,
    /// io_uring; opening fails if the kernel refuses it.
    IoUring,
    /// pread/pwrite, one operation at a time per device.
    Pread,
}

impl IoEngineKind {
    pub fn parse(name: &str) -> Result<Self, PoolError> {
        match name {
            "auto" => Ok(IoEngineKind::Auto),
            "io_uring" => Ok(IoEngineKind::IoUring),
            "pread" => Ok(IoEngineKind::Pread),
            _ => Err(PoolError::SsdConfig(format!(
                "io_engine is {name:?}; expected \"auto\", \"io_uring\" or \"pread\""
            ))),
        }
    }
}

/// Everything the SSD pool needs.
#[derive(Clone, Debug, PartialEq)]
pub struct SsdConfig {
    /// Holds the index log, the bandwidth cache, the lock file and (when `devices` is empty) the
    /// one device file. Must exist and be writable.
    pub directory: PathBuf,
    /// Device paths: raw block devices, or files (created and pre-allocated if missing). Empty:
    /// one file, [`DEFAULT_DEVICE_FILE`], in `directory`.
    pub devices: Vec<PathBuf>,
    /// Bytes of object space over all devices, split equally between them (a block device gives
    /// at most its size). Used when the pool is created; an existing pool keeps its size.
    pub capacity_bytes: u64,
    pub durability: Durability,
    pub placement: Placement,
    /// Bandwidth per device in bytes/s (one per device), instead of probing.
    pub bandwidth_bytes_per_s: Option<Vec<f64>>,
    /// Test/bench only: limits each device to this many bytes/s with a token bucket (one per
    /// device; 0 = unlimited). Emulates devices of different speeds on one disk.
    pub throttle_bytes_per_s: Option<Vec<f64>>,
    pub io_engine: IoEngineKind,
    /// In-flight I/O operations per device (io_uring queue depth; staging buffers per device).
    pub io_depth: usize,
    /// Bytes written then read per device to measure its bandwidth when the pool directory has
    /// no cached measurement. 0: no probe (equal shares unless `bandwidth_bytes_per_s` is set).
    pub probe_bytes: u64,
    /// Open devices with O_DIRECT (the page cache is bypassed). If a filesystem rejects it the
    /// pool falls back to buffered I/O with a warning.
    pub direct_io: bool,
    /// Eviction policy name per device (`"lru"` or `"s3fifo"`).
    pub eviction: String,
    /// See [`COMPACT_MIN_RECORDS_DEFAULT`].
    pub compact_min_records: u64,
    /// The smallest object the pool must hold (bytes, header included): each device must fit one.
    pub min_object_bytes: u64,
    /// When the pool is created, write superblocks over device files or block devices that hold
    /// other data (without it such a device is refused: the pool takes only new or empty files,
    /// blank block devices and its own devices).
    pub format_devices: bool,
}

impl SsdConfig {
    /// A config with defaults for everything but the directory.
    pub fn new(directory: impl Into<PathBuf>) -> Self {
        SsdConfig {
            directory: directory.into(),
            devices: Vec::new(),
            capacity_bytes: SSD_CAPACITY_BYTES_DEFAULT,
            durability: Durability::None,
            placement: Placement::Bandwidth,
            bandwidth_bytes_per_s: None,
            throttle_bytes_per_s: None,
            io_engine: IoEngineKind::Auto,
            io_depth: IO_DEPTH_DEFAULT,
            probe_bytes: PROBE_BYTES_DEFAULT,
            direct_io: true,
            eviction: "lru".into(),
            compact_min_records: COMPACT_MIN_RECORDS_DEFAULT,
            min_object_bytes: crate::extent::PAGE_BYTES,
            format_devices: false,
        }
    }

    /// Device paths, with the default device file filled in.
    pub fn device_paths(&self) -> Vec<PathBuf> {
        if self.devices.is_empty() {
            vec![self.directory.join(DEFAULT_DEVICE_FILE)]
        } else {
            self.devices.clone()
        }
    }

    /// Checks every field that needs no file system access.
    pub fn validate(&self) -> Result<(), PoolError> {
        let bad = |msg: String| Err(PoolError::SsdConfig(msg));
        let devices = self.device_paths().len();
        if devices > DEVICES_MAX {
            return bad(format!("{devices} devices; expected at most {DEVICES_MAX}"));
        }
        let mut seen = std::collections::HashSet::new();
        for path in &self.devices {
            if path.as_os_str().is_empty() {
                return bad("a device path is empty; expected a file or block device path".into());
            }
            if !seen.insert(path) {
                return bad(format!("device {path:?} is listed twice; expected distinct devices"));
            }
        }
        if self.capacity_bytes == 0 {
            return bad("capacity_bytes is 0; expected room for at least one object per device".into());
        }
        if self.io_depth == 0 || self.io_depth > IO_DEPTH_MAX {
            return bad(format!("io_depth is {}; expected 1 to {IO_DEPTH_MAX}", self.io_depth));
        }
        if self.probe_bytes > PROBE_BYTES_MAX {
            return bad(format!("probe_bytes is {}; expected at most {PROBE_BYTES_MAX}", self.probe_bytes));
        }
        if !POLICY_NAMES.contains(&self.eviction.as_str()) {
            return bad(format!(
                "eviction is {:?}; expected one of: {}",
                self.eviction,
                POLICY_NAMES.join(", ")
            ));
        }
        per_device("bandwidth_bytes_per_s", self.bandwidth_bytes_per_s.as_deref(), devices, false)?;
        per_device("throttle_bytes_per_s", self.throttle_bytes_per_s.as_deref(), devices, true)?;
        Ok(())
    }
}

/// One positive finite rate per device (`zero_ok`: 0 means "none").
fn per_device(name: &str, values: Option<&[f64]>, devices: usize, zero_ok: bool) -> Result<(), PoolError> {
    let Some(values) = values else { return Ok(()) };
    if values.len() != devices {
        return Err(PoolError::SsdConfig(format!(
            "{name} has {} values; expected one per device ({devices})",
            values.len()
        )));
    }
    for (i, &v) in values.iter().enumerate() {
        let ok = v.is_finite() && (v > 0.0 || (zero_ok && v == 0.0));
        if !ok {
            let expected = if zero_ok { "0 (unlimited) or a positive" } else { "a positive" };
            return Err(PoolError::SsdConfig(format!(
                "{name}[{i}] is {v}; expected {expected} number of bytes per second"
            )));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn message(config: &SsdConfig) -> String {
        config.validate().unwrap_err().to_string()
    }

    #[test]
    fn bad_values_name_the_field() {
        let ok = SsdConfig::new("/tmp");
        ok.validate().unwrap();
        assert!(message(&SsdConfig { io_depth: 0, ..ok.clone() }).contains("io_depth is 0"));
        assert!(message(&SsdConfig { capacity_bytes: 0, ..ok.clone() }).contains("capacity_bytes is 0"));
        let twice = SsdConfig { devices: vec!["/a".into(), "/a".into()], ..ok.clone() };
        assert!(message(&twice).contains("listed twice"));
        let bw = SsdConfig { bandwidth_bytes_per_s: Some(vec![1.0, 2.0]), ..ok.clone() };
        assert!(message(&bw).contains("expected one per device (1)"));
        let bw = SsdConfig { bandwidth_bytes_per_s: Some(vec![f64::NAN]), ..ok.clone() };
        assert!(message(&bw).contains("bandwidth_bytes_per_s[0] is NaN"));
        let throttle = SsdConfig { throttle_bytes_per_s: Some(vec![0.0]), ..ok.clone() };
        throttle.validate().unwrap();
        assert!(message(&SsdConfig { eviction: "fifo".into(), ..ok }).contains("lru, s3fifo"));
        assert!(Durability::parse("sync").unwrap_err().to_string().contains("\"none\" or \"fsync\""));
        assert!(Placement::parse("rr").is_err() && IoEngineKind::parse("aio").is_err());
    }
}
