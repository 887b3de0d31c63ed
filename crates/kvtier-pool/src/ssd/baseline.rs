//! The limits and baselines `kvtier bench ssd` compares the pool against, measured on the same
//! device in the same run:
//! - [`raw_sequential`]: a raw O_DIRECT loop over one pre-allocated file, sequential offsets,
//!   one transfer at a time (`depth` 1, like `dd iflag=direct`) or `depth` in flight (io_uring),
//!   into one buffer or a ring of them;
//! - [`file_per_object_write`] / [`file_per_object_read`]: the LMCache-style local-disk
//!   backend, one file per object, written and read through the file system and page cache;
//!   reads are made cold by syncing and dropping each file's cached pages first
//!   (`posix_fadvise(DONTNEED)`).

use std::fs::{File, OpenOptions};
use std::io::{Read, Write};
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::time::Instant;

use super::buffer::AlignedBuf;
use super::device::system_open;
use super::engine::{Engine, SyncEngine, UringEngine};
use super::files::{open_private, Create};

fn preallocate(path: &Path, bytes: u64) -> std::io::Result<File> {
    let file = open_private(path, Create::Either, false, libc::O_DIRECT)?;
    // SAFETY: fallocate on an open descriptor.
    if unsafe { libc::fallocate(file.as_raw_fd(), 0, 0, bytes as libc::off_t) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(file)
}

/// Seconds to write (or read) `total_bytes` of `path` sequentially in `chunk_bytes` transfers
/// with O_DIRECT, `depth` at a time, cycling through `buffer_bytes` of memory (one chunk: the
/// `dd` loop; the size of a pool read: the same memory traffic as the pool). Writing creates and
/// pre-allocates the file; reading needs it written. No fsync: an O_DIRECT write is complete
/// when it returns, as the pool's are with `none` durability.
pub fn raw_sequential(
    path: &Path,
    total_bytes: u64,
    chunk_bytes: usize,
    write: bool,
    depth: usize,
    buffer_bytes: usize,
) -> std::io::Result<f64> {
    let file = if write { preallocate(path, total_bytes)? } else { system_open(path, false, true)? };
    let slots = (buffer_bytes / chunk_bytes).max(1);
    let mut buf = AlignedBuf::new(slots * chunk_bytes).map_err(|e| std::io::Error::other(e.to_string()))?;
    for (i, b) in buf.as_mut_slice().iter_mut().enumerate() {
        *b = (i * 7 % 253) as u8;
    }
    let base = buf.as_mut_ptr();
    let at = |i: u64| base.wrapping_add((i as usize % slots) * chunk_bytes);
    let chunks = total_bytes / chunk_bytes as u64;
    let fd = file.as_raw_fd();
    let start = Instant::now();
    let mut engine: Box<dyn Engine> =
        if depth <= 1 { Box::new(SyncEngine::default()) } else { Box::new(UringEngine::new(depth)?) };
    let (mut next, mut inflight) = (0u64, 0usize);
    while next < chunks || inflight > 0 {
        while next < chunks && inflight < depth.max(1) {
            // Transfers may share a buffer slot: the bytes are a load pattern, never checked.
            engine.submit(fd, write, at(next), chunk_bytes, next * chunk_bytes as u64, next);
            next += 1;
            inflight += 1;
        }
        let (_, n) = engine.wait();
        inflight -= 1;
        if n != chunk_bytes as i64 {
            return Err(std::io::Error::other(format!("raw transfer moved {n} of {chunk_bytes} bytes")));
        }
    }
    Ok(start.elapsed().as_secs_f64())
}

fn object_path(dir: &Path, i: usize) -> PathBuf {
    dir.join(format!("obj-{i:08}.kv"))
}

/// Seconds to write `count` files of `object` into `dir`, then make them durable (`syncfs`), as
/// a file-per-object backend does.
pub fn file_per_object_write(dir: &Path, count: usize, object: &[u8]) -> std::io::Result<f64> {
    let start = Instant::now();
    for i in 0..count {
        let mut f = OpenOptions::new().write(true).create(true).truncate(true).open(object_path(dir, i))?;
        f.write_all(object)?;
    }
    let d = File::open(dir)?;
    // SAFETY: syncfs on an open descriptor.
    if unsafe { libc::syncfs(d.as_raw_fd()) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(start.elapsed().as_secs_f64())
}

/// Drops the page cache of every object file (they are clean after `file_per_object_write`).
pub fn drop_object_cache(dir: &Path, count: usize) -> std::io::Result<()> {
    for i in 0..count {
        let f = File::open(object_path(dir, i))?;
        f.sync_data()?;
        // SAFETY: advice on an open descriptor.
        unsafe { libc::posix_fadvise(f.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
    }
    Ok(())
}

/// Seconds to read the `count` object files back into `buf` (each exactly `buf.len()` bytes),
/// opening and closing each, after dropping their cached pages.
pub fn file_per_object_read(dir: &Path, count: usize, buf: &mut [u8]) -> std::io::Result<f64> {
    drop_object_cache(dir, count)?;
    let start = Instant::now();
    for i in 0..count {
        File::open(object_path(dir, i))?.read_exact(buf)?;
    }
    Ok(start.elapsed().as_secs_f64())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn baselines_run_and_read_back() {
        let dir = std::env::temp_dir().join(format!("kvtier-baseline-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let raw = dir.join("raw.bin");
        assert!(raw_sequential(&raw, 4 << 20, 1 << 20, true, 1, 1 << 20).unwrap() > 0.0);
        assert!(raw_sequential(&raw, 4 << 20, 1 << 20, false, 1, 4 << 20).unwrap() > 0.0);
        if super::super::engine::probe_io_uring().is_ok() {
            assert!(raw_sequential(&raw, 4 << 20, 1 << 20, false, 4, 2 << 20).unwrap() > 0.0);
        }
        let object = vec![9u8; 10_000];
        file_per_object_write(&dir, 3, &object).unwrap();
        let mut back = vec![0u8; 10_000];
        file_per_object_read(&dir, 3, &mut back).unwrap();
        assert_eq!(back, object);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
