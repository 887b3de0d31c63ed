//! One pool device: a raw block device or a large pre-allocated file, opened with O_DIRECT.
//!
//! Layout (`docs/formats.md` §4): page 0 is the [`Superblock`]; the object space starts at
//! `data_offset` (one page) and holds `data_bytes`. Files are created with `fallocate`, after
//! checking the file system has the room (a full disk is a clear error at creation, not a
//! failure later). A file system that rejects O_DIRECT (EINVAL) gets buffered I/O, with a warning.

use std::fs::{File, Metadata};
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileTypeExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicI32, Ordering};

use super::buffer::AlignedBuf;
use super::files::{lock_exclusive, open_private, Create};
use super::format::{Superblock, SUPERBLOCK_BYTES};
use super::metrics::DeviceMetrics;
use super::throttle::TokenBucket;
use crate::error::PoolError;
use crate::extent::PAGE_BYTES;

/// An open pool device.
#[derive(Debug)]
pub struct Device {
    pub index: u16,
    pub path: PathBuf,
    pub file: File,
    /// O_DIRECT is in effect (false after a fallback to buffered I/O).
    pub direct: bool,
    pub is_block_device: bool,
    pub data_offset: u64,
    pub data_bytes: u64,
    /// Test/bench devices only: the rate limit (see [`TokenBucket`]).
    pub throttle: Option<TokenBucket>,
    pub metrics: DeviceMetrics,
    /// Fault injection (tests): a nonzero errno fails every write (or read) with it, no I/O done.
    pub fail_writes_errno: AtomicI32,
    pub fail_reads_errno: AtomicI32,
}

fn io_error(what: &'static str, path: &Path, e: &std::io::Error) -> PoolError {
    PoolError::SsdIo { what, path: path.display().to_string(), reason: e.to_string() }
}

/// Opens `path` read-write, with O_DIRECT when `direct`. If the file system rejects O_DIRECT
/// (EINVAL), opens it buffered and says so in `warnings`. Returns the file and whether O_DIRECT
/// is in effect. `open` is the system call (a parameter so the fallback can be tested).
pub fn open_with_fallback(
    path: &Path,
    create: bool,
    direct: bool,
    warnings: &mut Vec<String>,
    open: &dyn Fn(&Path, bool, bool) -> std::io::Result<File>,
) -> std::io::Result<(File, bool)> {
    if !direct {
        return Ok((open(path, create, false)?, false));
    }
    match open(path, create, true) {
        Ok(file) => Ok((file, true)),
        Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {
            warnings.push(format!(
                "{}: the file system rejects O_DIRECT (EINVAL); using buffered I/O through the \
                 page cache (reads may be served from memory; put the pool on a file system or \
                 block device that supports O_DIRECT)",
                path.display()
            ));
            // The rejected open may have created the file already: open it, do not create again.
            Ok((open(path, create && std::fs::symlink_metadata(path).is_err(), false)?, false))
        }
        Err(e) => Err(e),
    }
}

/// The real `open(2)`: never through a symbolic link; `create` makes a new file (`O_EXCL`, mode
/// 0600), never takes over one that appeared meanwhile.
pub fn system_open(path: &Path, create: bool, direct: bool) -> std::io::Result<File> {
    let how = if create { Create::New } else { Create::No };
    open_private(path, how, false, if direct { libc::O_DIRECT } else { 0 })
}

/// The path to open for device `path`, and what is there now (`None`: nothing). A symbolic link
/// is followed only to a block device (`/dev/disk/by-id/...`): the pool never writes a file
/// through a link, where a planted link would make it overwrite the link's target.
fn device_target(path: &Path) -> Result<(PathBuf, Option<Metadata>), PoolError> {
    let meta = match std::fs::symlink_metadata(path) {
        Ok(m) => m,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok((path.to_path_buf(), None)),
        Err(e) => return Err(io_error("inspecting device", path, &e)),
    };
    if !meta.file_type().is_symlink() {
        return Ok((path.to_path_buf(), Some(meta)));
    }
    let target =
        std::fs::canonicalize(path).map_err(|e| io_error("resolving the link of device", path, &e))?;
    match std::fs::metadata(&target) {
        Ok(m) if m.file_type().is_block_device() => Ok((target, Some(m))),
        _ => Err(PoolError::SsdConfig(format!(
            "device {} is a symbolic link to {}, not to a block device; the pool never writes a \
             file through a link (give the file's own path)",
            path.display(),
            target.display()
        ))),
    }
}

/// Locks an opened device file for this pool's lifetime (it is closed with the [`Device`]), so
/// no other pool takes it over while this one serves objects from it (a second pool's create
/// would write its own superblock and objects over them). Errors naming the device if another
/// open pool holds it.
fn lock_device(file: &File, path: &Path) -> Result<(), PoolError> {
    match lock_exclusive(file) {
        Ok(true) => Ok(()),
        Ok(false) => Err(PoolError::SsdConfig(format!(
            "device {} is in use by another open pool (its file is locked); expected each device \
             in one pool at a time: close that pool first, or list another device",
            path.display()
        ))),
        Err(e) => Err(io_error("locking device", path, &e)),
    }
}

/// What the first page of an existing device holds.
enum FirstPage {
    /// All zeros, or no bytes at all: nothing to lose.
    Blank,
    /// A kvtier superblock (of this pool or another).
    Kvtier,
    /// Anything else: somebody's data.
    Foreign,
}

fn first_page(path: &Path, len: u64) -> Result<FirstPage, PoolError> {
    if len == 0 {
        return Ok(FirstPage::Blank);
    }
    let file = open_private(path, Create::No, false, 0).map_err(|e| io_error("opening device", path, &e))?;
    let mut page = vec![0u8; PAGE_BYTES.min(len) as usize];
    std::os::unix::fs::FileExt::read_exact_at(&file, &mut page, 0)
        .map_err(|e| io_error("reading the first page of", path, &e))?;
    if page.iter().all(|&b| b == 0) {
        return Ok(FirstPage::Blank);
    }
    page.resize(PAGE_BYTES as usize, 0);
    Ok(if Superblock::decode(&page).is_ok() { FirstPage::Kvtier } else { FirstPage::Foreign })
}

/// Size of a block device in bytes.
fn block_device_bytes(file: &File) -> std::io::Result<u64> {
    // BLKGETSIZE64 = _IOR(0x12, 114, size_t)
    const BLKGETSIZE64: libc::c_ulong = 0x8008_1272;
    let mut size: u64 = 0;
    // SAFETY: the ioctl writes one u64 into `size`, which lives across the call.
    let rc = unsafe { libc::ioctl(file.as_raw_fd(), BLKGETSIZE64, &mut size as *mut u64) };
    if rc != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(size)
}

/// Bytes available to unprivileged users on the file system holding `path`.
pub fn free_bytes(path: &Path) -> std::io::Result<u64> {
    let c = std::ffi::CString::new(path.as_os_str().as_encoded_bytes())
        .map_err(|_| std::io::Error::from_raw_os_error(libc::EINVAL))?;
    // SAFETY: statvfs fills the zeroed struct; `c` is a valid NUL-terminated path.
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    if unsafe { libc::statvfs(c.as_ptr(), &mut st) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(st.f_bavail as u64 * st.f_frsize as u64)
}

/// Reads or writes exactly `buf.len()` bytes at `offset` (page-aligned) with one or more calls.
pub fn transfer_exact(
    file: &File,
    buf: &mut AlignedBuf,
    offset: u64,
    len: usize,
    write: bool,
) -> std::io::Result<()> {
    assert!(len <= buf.len() && offset % PAGE_BYTES == 0, "unaligned or oversized transfer");
    let fd = file.as_raw_fd();
    let mut done = 0usize;
    while done < len {
        let ptr = buf.as_mut_ptr().wrapping_add(done);
        let at = (offset + done as u64) as libc::off_t;
        // SAFETY: `ptr..ptr + len - done` lies inside the owned buffer.
        let n = unsafe {
            if write {
                libc::pwrite(fd, ptr.cast(), len - done, at)
            } else {
                libc::pread(fd, ptr.cast(), len - done, at)
            }
        };
        match n {
            n if n > 0 => done += n as usize,
            0 => return Err(std::io::Error::from_raw_os_error(libc::EIO)),
            _ => {
                let e = std::io::Error::last_os_error();
                if e.kind() != std::io::ErrorKind::Interrupted {
                    return Err(e);
                }
            }
        }
    }
    Ok(())
}

/// What a device must be made into.
pub struct DeviceSpec<'a> {
    pub index: u16,
    pub count: u16,
    pub path: &'a Path,
    pub pool_id: u128,
    pub data_bytes: u64,
    pub min_object_bytes: u64,
    pub direct: bool,
    /// Write a superblock over an existing file or block device that holds other data.
    pub format: bool,
}

impl Device {
    fn assemble(spec: &DeviceSpec<'_>, file: File, direct: bool, block: bool, sb: &Superblock) -> Device {
        Device {
            index: spec.index,
            path: spec.path.to_path_buf(),
            file,
            direct,
            is_block_device: block,
            data_offset: sb.data_offset,
            data_bytes: sb.data_bytes,
            throttle: None,
            metrics: DeviceMetrics::default(),
            fail_writes_errno: AtomicI32::new(0),
            fail_reads_errno: AtomicI32::new(0),
        }
    }

    /// Creates (or re-initialises) a device: sizes the file, writes a fresh superblock. An
    /// existing file or block device is taken only when it is empty (zero bytes, or a first page
    /// of zeros) or already a kvtier device that no open pool holds ([`lock_device`]), or when
    /// `spec.format` says to overwrite it.
    pub fn create(spec: &DeviceSpec<'_>, warnings: &mut Vec<String>) -> Result<Device, PoolError> {
        let path = spec.path;
        let (target, existing) = device_target(path)?;
        let block = existing.as_ref().is_some_and(|m| m.file_type().is_block_device());
        if let Some(m) = &existing {
            if !block && !m.file_type().is_file() {
                return Err(PoolError::SsdConfig(format!(
                    "device {} exists and is neither a regular file nor a block device; expected \
                     a file path (created if missing) or a block device",
                    path.display()
                )));
            }
            let len = if block { PAGE_BYTES } else { m.len() };
            if !spec.format && matches!(first_page(&target, len)?, FirstPage::Foreign) {
                let what = if block { "block device".to_string() } else { format!("file of {len} bytes") };
                return Err(PoolError::SsdConfig(format!(
                    "device {} is a {what} holding other data (no kvtier superblock); the pool \
                     will not overwrite it: give a new or empty path, or set format_devices \
                     (a store config's ssd.format_devices) to format it",
                    path.display()
                )));
            }
        }
        let (file, direct) =
            open_with_fallback(&target, existing.is_none(), spec.direct, warnings, &system_open)
                .map_err(|e| io_error("opening device", path, &e))?;
        lock_device(&file, path)?;
        let data_bytes = if block {
            let size = block_device_bytes(&file).map_err(|e| io_error("sizing block device", path, &e))?;
            spec.data_bytes.min(size.saturating_sub(SUPERBLOCK_BYTES)) / PAGE_BYTES * PAGE_BYTES
        } else {
            spec.data_bytes / PAGE_BYTES * PAGE_BYTES
        };
        if data_bytes < spec.min_object_bytes || data_bytes == 0 {
            return Err(PoolError::SsdConfig(format!(
                "device {} would hold {data_bytes} bytes of object space; expected at least one \
                 object ({} bytes with header and page padding): raise capacity_bytes or use \
                 fewer devices",
                path.display(),
                spec.min_object_bytes
            )));
        }
        if !block {
            Self::preallocate(&file, path, SUPERBLOCK_BYTES + data_bytes)?;
        }
        let sb = Superblock {
            pool_id: spec.pool_id,
            device_index: spec.index,
            device_count: spec.count,
            data_offset: SUPERBLOCK_BYTES,
            data_bytes,
        };
        let mut page = AlignedBuf::new(PAGE_BYTES as usize)?;
        page.as_mut_slice()[..64].copy_from_slice(&sb.encode());
        transfer_exact(&file, &mut page, 0, PAGE_BYTES as usize, true)
            .and_then(|()| file.sync_all())
            .map_err(|e| io_error("writing the superblock of", path, &e))?;
        Ok(Self::assemble(spec, file, direct, block, &sb))
    }

    /// Sizes a device file to `total` bytes with `fallocate`, after checking the room.
    fn preallocate(file: &File, path: &Path, total: u64) -> Result<(), PoolError> {
        let meta = file.metadata().map_err(|e| io_error("inspecting device", path, &e))?;
        let allocated = std::os::unix::fs::MetadataExt::blocks(&meta) * 512;
        let needed = total.saturating_sub(allocated);
        let dir = path.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
        let free = free_bytes(dir).map_err(|e| io_error("checking free space for", path, &e))?;
        if needed > free {
            return Err(PoolError::SsdConfig(format!(
                "device file {} needs {needed} more bytes but its file system has {free} free \
                 (no space left on device); lower capacity_bytes or free space",
                path.display()
            )));
        }
        let len = libc::off_t::try_from(total)
            .map_err(|_| PoolError::SsdConfig(format!("device size {total} too large")))?;
        // SAFETY: plain fallocate on an open descriptor.
        let rc = unsafe { libc::fallocate(file.as_raw_fd(), 0, 0, len) };
        if rc != 0 {
            let e = std::io::Error::last_os_error();
            if e.raw_os_error() == Some(libc::ENOSPC) {
                return Err(PoolError::SsdConfig(format!(
                    "pre-allocating {total} bytes for device file {}: no space left on device",
                    path.display()
                )));
            }
            // A file system without fallocate: size the file sparsely instead.
            if e.raw_os_error() == Some(libc::EOPNOTSUPP) {
                return file.set_len(total).map_err(|e| io_error("sizing device file", path, &e));
            }
            return Err(io_error("pre-allocating device file", path, &e));
        }
        Ok(())
    }

    /// Opens an existing device and checks that its superblock names this pool and position.
    pub fn open(spec: &DeviceSpec<'_>, warnings: &mut Vec<String>) -> Result<Device, PoolError> {
        let path = spec.path;
        let (target, meta) = device_target(path)?;
        let Some(meta) = meta else {
            return Err(PoolError::SsdConfig(format!(
                "device {} of the existing pool in this directory does not exist (list the \
                 devices it was created with, or delete the directory's index.log to start over)",
                path.display()
            )));
        };
        let block = meta.file_type().is_block_device();
        if !block && meta.len() < SUPERBLOCK_BYTES {
            return Err(PoolError::SsdConfig(format!(
                "device {} of an existing pool is {} bytes, too short to hold its superblock ({} \
                 bytes): it was truncated or replaced (delete the directory's index.log to start \
                 over)",
                path.display(),
                meta.len(),
                SUPERBLOCK_BYTES
            )));
        }
        let (file, direct) = open_with_fallback(&target, false, spec.direct, warnings, &system_open)
            .map_err(|e| io_error("opening device", path, &e))?;
        lock_device(&file, path)?;
        let mut page = AlignedBuf::new(PAGE_BYTES as usize)?;
        transfer_exact(&file, &mut page, 0, PAGE_BYTES as usize, false)
            .map_err(|e| io_error("reading the superblock of", path, &e))?;
        let sb = Superblock::decode(page.as_slice())
            .map_err(|e| PoolError::SsdConfig(format!("device {}: {e}", path.display())))?;
        if sb.pool_id != spec.pool_id || sb.device_index != spec.index || sb.device_count != spec.count {
            return Err(PoolError::SsdConfig(format!(
                "device {} is device {} of {} of pool {:#x}; expected device {} of {} of pool {:#x} \
                 (list the devices in the order the pool was created with)",
                path.display(),
                sb.device_index,
                sb.device_count,
                sb.pool_id,
                spec.index,
                spec.count,
                spec.pool_id
            )));
        }
        let size = if block {
            block_device_bytes(&file).map_err(|e| io_error("sizing block device", path, &e))?
        } else {
            meta.len()
        };
        if size < sb.data_offset + sb.data_bytes {
            return Err(PoolError::SsdConfig(format!(
                "device {} is {size} bytes; its superblock says {} (truncated?)",
                path.display(),
                sb.data_offset + sb.data_bytes
            )));
        }
        Ok(Self::assemble(spec, file, direct, block, &sb))
    }

    pub fn fd(&self) -> i32 {
        self.file.as_raw_fd()
    }

    /// `fdatasync` of the device file; fails with the injected write errno, if any (tests: a
    /// device failing its writes fails its syncs too).
    pub fn sync_data(&self) -> std::io::Result<()> {
        match self.injected_errno(true) {
            0 => self.file.sync_data(),
            errno => Err(std::io::Error::from_raw_os_error(errno)),
        }
    }

    pub fn injected_errno(&self, write: bool) -> i32 {
        let cell = if write { &self.fail_writes_errno } else { &self.fail_reads_errno };
        cell.load(Ordering::Relaxed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn o_direct_rejection_falls_back_with_a_warning() {
        let rejecting = |_: &Path, _: bool, direct: bool| -> std::io::Result<File> {
            if direct {
                Err(std::io::Error::from_raw_os_error(libc::EINVAL))
            } else {
                File::open("/dev/null")
            }
        };
        let mut warnings = Vec::new();
        let (_, direct) =
            open_with_fallback(Path::new("/x/dev"), true, true, &mut warnings, &rejecting).unwrap();
        assert!(!direct);
        assert_eq!(warnings.len(), 1);
        assert!(warnings[0].contains("rejects O_DIRECT"), "{}", warnings[0]);
        let other = |_: &Path, _: bool, _: bool| -> std::io::Result<File> {
            Err(std::io::Error::from_raw_os_error(libc::EACCES))
        };
        assert!(open_with_fallback(Path::new("/x"), true, true, &mut warnings, &other).is_err());
    }
}
