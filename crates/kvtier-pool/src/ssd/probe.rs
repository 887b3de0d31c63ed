//! Device bandwidth: measured once by a short write-then-read probe through the device's own
//! worker (same engine, depth and chunk size the pool uses), cached in the pool directory, or
//! given in the config. A failed probe means equal shares, and a warning saying so.
//!
//! Cache file `bandwidth.cache` (text, one line per device after a version line):
//! `index<TAB>path<TAB>data_bytes<TAB>throttle_bytes_per_s<TAB>read_bytes_per_s<TAB>write_bytes_per_s`.
//! A line is used only if index, path, size and throttle all match the open device.

use std::path::Path;
use std::time::Instant;

use super::buffer::AlignedBuf;
use super::device::Device;
use super::worker::{IoWorker, Op, OpKind, OpResult};
use crate::extent::Extent;

pub const CACHE_FILE: &str = "bandwidth.cache";
const CACHE_VERSION_LINE: &str = "kvtier-bandwidth-cache 1";
/// Transfer size of the probe: the size of a large KV object.
pub const PROBE_CHUNK_BYTES: usize = 2 << 20;

/// Measured bandwidth of one device, bytes per second.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Bandwidth {
    pub read_bytes_per_s: f64,
    pub write_bytes_per_s: f64,
}

fn cache_key(device: &Device) -> String {
    let throttle = device.throttle.as_ref().map_or(0.0, |t| t.rate_bytes_per_s());
    format!("{}\t{}\t{}\t{}", device.index, device.path.display(), device.data_bytes, throttle)
}

/// The cached bandwidth of every device, if the cache has a matching line for each.
pub fn load_cache(dir: &Path, devices: &[&Device]) -> Option<Vec<Bandwidth>> {
    let text = std::fs::read_to_string(dir.join(CACHE_FILE)).ok()?;
    let mut lines = text.lines();
    if lines.next()? != CACHE_VERSION_LINE {
        return None;
    }
    let entries: Vec<(String, Bandwidth)> = lines
        .filter_map(|line| {
            let (key, values) = line.rsplit_once('\t').and_then(|(rest, write)| {
                let (key, read) = rest.rsplit_once('\t')?;
                Some((key, (read.parse::<f64>().ok()?, write.parse::<f64>().ok()?)))
            })?;
            let valid = values.0.is_finite() && values.0 > 0.0 && values.1.is_finite() && values.1 > 0.0;
            valid.then(|| {
                (key.to_string(), Bandwidth { read_bytes_per_s: values.0, write_bytes_per_s: values.1 })
            })
        })
        .collect();
    devices.iter().map(|d| entries.iter().find(|(key, _)| *key == cache_key(d)).map(|(_, b)| *b)).collect()
}

/// Writes the cache (best effort: a read-only directory only costs a probe next time).
pub fn save_cache(dir: &Path, devices: &[&Device], values: &[Bandwidth]) {
    let mut text = format!("{CACHE_VERSION_LINE}\n");
    for (d, b) in devices.iter().zip(values) {
        text.push_str(&format!("{}\t{}\t{}\n", cache_key(d), b.read_bytes_per_s, b.write_bytes_per_s));
    }
    let tmp = dir.join(format!("{CACHE_FILE}.tmp"));
    let written = super::files::open_private(&tmp, super::files::Create::Either, true, 0)
        .and_then(|mut f| std::io::Write::write_all(&mut f, text.as_bytes()));
    if written.is_ok() {
        let _ = std::fs::rename(&tmp, dir.join(CACHE_FILE));
    }
}

/// Writes then reads `extent` (free space of `device`'s object space) in chunks; returns the
/// bandwidths. Errors name what failed.
pub fn probe(device: &Device, worker: &IoWorker, extent: Extent) -> Result<Bandwidth, String> {
    let chunk = PROBE_CHUNK_BYTES.min(extent.len as usize);
    let mut buf = AlignedBuf::new(chunk).map_err(|e| e.to_string())?;
    for (i, b) in buf.as_mut_slice().iter_mut().enumerate() {
        *b = (i * 131 % 251) as u8;
    }
    let offsets: Vec<u64> = (0..extent.len / chunk as u64)
        .map(|i| device.data_offset + extent.offset + i * chunk as u64)
        .collect();
    if offsets.is_empty() {
        return Err("no room to probe".into());
    }
    let bytes = (offsets.len() * chunk) as f64;
    let ptr = buf.as_mut_ptr();
    let timed = |write: bool| -> Result<f64, String> {
        let kind =
            if write { OpKind::RawWrite { src: ptr.cast_const() } } else { OpKind::RawRead { dst: ptr } };
        let ops: Vec<Op> = offsets.iter().map(|&offset| Op { offset, len: chunk, kind }).collect();
        let start = Instant::now();
        // SAFETY: `buf` outlives the call, which waits for every transfer. Concurrent reads into
        // the one buffer only overwrite bytes nobody looks at.
        let (results, _) = unsafe { worker.run(ops, false) };
        let seconds = start.elapsed().as_secs_f64();
        match results.iter().find(|r| !matches!(r, OpResult::Written(_) | OpResult::Read)) {
            Some(r) => Err(format!("probe {} failed: {r:?}", if write { "write" } else { "read" })),
            None if seconds > 0.0 => Ok(bytes / seconds),
            None => Err("probe took no measurable time".into()),
        }
    };
    let write_bytes_per_s = timed(true)?;
    let read_bytes_per_s = timed(false)?;
    Ok(Bandwidth { read_bytes_per_s, write_bytes_per_s })
}
