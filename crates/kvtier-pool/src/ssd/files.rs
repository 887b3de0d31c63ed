//! How the pool opens the files it creates in its directory (lock, index log, bandwidth cache,
//! device files), and locks the ones only one pool may use ([`lock_exclusive`]): never through
//! a symbolic link (`O_NOFOLLOW`; `O_EXCL` where it creates), and readable and writable by the
//! owner only (mode 0600 whatever the umask), in a directory no other user can write
//! (`docs/security.md`). Every tenant's KV lives in these files, and the
//! index log decides which bytes a key is served from.

use std::fs::{File, OpenOptions, Permissions};
use std::io::ErrorKind;
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::Path;

use crate::error::PoolError;

/// Mode of every file the pool creates.
pub const FILE_MODE: u32 = 0o600;

/// How [`open_private`] may create the file.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Create {
    /// The file must exist.
    No,
    /// The file must not exist (`O_EXCL`): a file or link already there is an error.
    New,
    /// Open it if it is there, create it if not.
    Either,
}

/// Opens `path` read-write without following a final symbolic link, creating it per `create`
/// with mode [`FILE_MODE`], plus `flags` (e.g. `O_DIRECT`). A file this process can write that
/// other users may read or write is narrowed to [`FILE_MODE`]; `truncate` empties it.
pub fn open_private(path: &Path, create: Create, truncate: bool, flags: i32) -> std::io::Result<File> {
    let mut options = OpenOptions::new();
    options.read(true).write(true).truncate(truncate).mode(FILE_MODE);
    options.custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC | flags);
    match create {
        Create::No => {}
        Create::New => {
            options.create_new(true);
        }
        Create::Either => {
            options.create(true);
        }
    }
    let file = options.open(path).map_err(|e| explain_link(path, e))?;
    let mode = file.metadata()?.permissions().mode();
    if mode & 0o077 != 0 {
        // Created under a permissive umask's neighbour, or by an older version: owner-only now.
        file.set_permissions(Permissions::from_mode(FILE_MODE))?;
    }
    Ok(file)
}

/// How long [`lock_exclusive`] waits for a held lock to be released.
pub const LOCK_RETRY: std::time::Duration = std::time::Duration::from_millis(500);

/// Takes an exclusive `flock` on `file` (the pool directory's lock file, a device), held until
/// the file is closed: `Ok(false)` if another open file (another pool, in this process or
/// another) still holds it after [`LOCK_RETRY`]. A lock can outlive its pool by a moment: a
/// child process forked by another thread (a server a test starts, say) shares the descriptor
/// until it execs, hence the retry.
pub fn lock_exclusive(file: &File) -> std::io::Result<bool> {
    let deadline = std::time::Instant::now() + LOCK_RETRY;
    loop {
        // SAFETY: flock on an open descriptor.
        if unsafe { libc::flock(std::os::fd::AsRawFd::as_raw_fd(file), libc::LOCK_EX | libc::LOCK_NB) } == 0 {
            return Ok(true);
        }
        let e = std::io::Error::last_os_error();
        if e.raw_os_error() != Some(libc::EWOULDBLOCK) {
            return Err(e);
        }
        if std::time::Instant::now() >= deadline {
            return Ok(false);
        }
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
}

/// `O_NOFOLLOW` on a link fails with ELOOP, whose text ("too many levels of symbolic links")
/// does not say what happened.
fn explain_link(path: &Path, e: std::io::Error) -> std::io::Error {
    if e.raw_os_error() == Some(libc::ELOOP) {
        return std::io::Error::other(format!(
            "{} is a symbolic link; the pool never writes through a link",
            path.display()
        ));
    }
    e
}

/// Checks that `dir` is a directory other users cannot write into (they could plant links or
/// records there). Returns a config error that says what to do.
pub fn check_directory(dir: &Path) -> Result<(), PoolError> {
    let bad = |msg: String| Err(PoolError::SsdConfig(msg));
    let meta = match std::fs::metadata(dir) {
        Ok(m) => m,
        Err(e) if e.kind() == ErrorKind::NotFound => {
            return bad(format!(
                "ssd directory {} does not exist; expected an existing, writable directory (create it first)",
                dir.display()
            ))
        }
        Err(e) => {
            return bad(format!(
                "ssd directory {} cannot be used ({e}); expected an existing, writable directory (create it first)",
                dir.display()
            ))
        }
    };
    if !meta.is_dir() {
        return bad(format!(
            "ssd directory {} is not a directory; expected an existing, writable directory",
            dir.display()
        ));
    }
    let mode = meta.permissions().mode();
    if mode & 0o002 != 0 {
        return bad(format!(
            "ssd directory {} is writable by every user (mode {:o}); expected a directory only its \
             owner can write (`chmod o-w` it, or use a private subdirectory, e.g. mode 700)",
            dir.display(),
            mode & 0o7777
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scratch(name: &str) -> std::path::PathBuf {
        let dir = std::env::temp_dir().join(format!("kvtier-files-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::set_permissions(&dir, Permissions::from_mode(0o700)).unwrap();
        dir
    }

    #[test]
    fn creates_owner_only_and_never_follows_links() {
        let dir = scratch("modes");
        let path = dir.join("f");
        // SAFETY: umask only changes this process's default mode; restored below.
        let old = unsafe { libc::umask(0) };
        let file = open_private(&path, Create::New, false, 0);
        unsafe { libc::umask(old) };
        assert_eq!(file.unwrap().metadata().unwrap().permissions().mode() & 0o777, FILE_MODE);
        assert!(open_private(&path, Create::New, false, 0).is_err(), "O_EXCL");
        std::fs::set_permissions(&path, Permissions::from_mode(0o666)).unwrap();
        open_private(&path, Create::No, false, 0).unwrap();
        assert_eq!(std::fs::metadata(&path).unwrap().permissions().mode() & 0o777, FILE_MODE, "narrowed");
        let target = dir.join("target");
        std::fs::write(&target, b"other data").unwrap();
        let link = dir.join("link");
        std::os::unix::fs::symlink(&target, &link).unwrap();
        for create in [Create::No, Create::Either, Create::New] {
            let e = open_private(&link, create, true, 0).unwrap_err();
            assert!(e.to_string().contains("symbolic link") || e.kind() == ErrorKind::AlreadyExists, "{e}");
        }
        assert_eq!(std::fs::read(&target).unwrap(), b"other data");
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_directory_every_user_can_write_is_refused() {
        let dir = scratch("dir");
        check_directory(&dir).unwrap();
        std::fs::set_permissions(&dir, Permissions::from_mode(0o777)).unwrap();
        let e = check_directory(&dir).unwrap_err().to_string();
        assert!(e.contains("writable by every user") && e.contains("777"), "{e}");
        std::fs::set_permissions(&dir, Permissions::from_mode(0o1777)).unwrap();
        assert!(check_directory(&dir).is_err(), "sticky does not help: others can still plant files");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
