//! The index log: an append-only file of checksummed 80-byte [`Record`]s after a [`LogHeader`],
//! from which a restarted pool rebuilds its lookup table.
//!
//! Crash safety rests on three rules:
//! - a `Put` record is appended only after its object's data write completed (and, with
//!   `fsync` durability, after the device was `fdatasync`ed), so a record never names bytes
//!   that were not fully written;
//! - replay stops at the first record whose checksum fails (a torn or partial append) and
//!   truncates the file there, so later appends never follow garbage;
//! - compaction writes the live set to `index.log.tmp`, syncs it, and renames it over the log
//!   (atomic), then syncs the directory: a crash leaves the old log or the new one, never a mix.
//!   From the rename on, records go to the new file, even if the directory sync failed (then
//!   retried before an `fsync` append or a [`IndexLog::sync`] reports success).
//!
//! A failed append (e.g. ENOSPC) truncates the file back to its last good record and reports
//! the errno; the caller then abandons the objects it was about to publish.

use std::fs::File;
use std::io::Read;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use super::config::Durability;
use super::files::{open_private, Create};
use super::format::{LogHeader, Record, LOG_HEADER_BYTES, RECORD_BYTES};
use crate::error::PoolError;

pub const LOG_FILE: &str = "index.log";
const LOG_TMP_FILE: &str = "index.log.tmp";

/// What replaying a log found.
#[derive(Debug, Default)]
pub struct Replay {
    pub records: Vec<Record>,
    /// Bytes after the last valid record (a torn append), cut off.
    pub dropped_tail_bytes: u64,
}

#[derive(Debug)]
pub struct IndexLog {
    dir: PathBuf,
    file: File,
    header: LogHeader,
    seed: u64,
    /// Bytes of header and valid records: where the next append goes.
    end: u64,
    records: u64,
    next_seq: u64,
    durability: Durability,
    /// A compaction renamed its file into place but the directory sync failed: the rename may
    /// not survive a power loss until a later sync of the directory succeeds.
    dir_sync_pending: bool,
    /// Fault injection (tests): a nonzero errno fails every append with it.
    pub fail_errno: i32,
    /// Fault injection (tests): a nonzero errno fails every sync of the pool directory with it.
    pub fail_dir_sync_errno: i32,
}

fn io_error(what: &'static str, path: &Path, e: &std::io::Error) -> PoolError {
    PoolError::SsdIo { what, path: path.display().to_string(), reason: e.to_string() }
}

/// fsyncs a directory, so a rename or create inside it is durable.
pub fn sync_dir(dir: &Path) -> std::io::Result<()> {
    File::open(dir)?.sync_all()
}

impl IndexLog {
    pub fn path(dir: &Path) -> PathBuf {
        dir.join(LOG_FILE)
    }

    pub fn header(&self) -> LogHeader {
        self.header
    }
    /// Records in the current log file.
    pub fn records(&self) -> u64 {
        self.records
    }
    pub fn bytes(&self) -> u64 {
        self.end
    }

    /// Writes `header` and `records` to a temporary file, syncs it and renames it into place.
    /// The rename is durable once the directory is synced ([`Self::sync_directory`]).
    fn write_whole(dir: &Path, header: LogHeader, records: &[Record]) -> std::io::Result<File> {
        let tmp = dir.join(LOG_TMP_FILE);
        let seed = header.record_seed();
        let mut bytes = Vec::with_capacity(LOG_HEADER_BYTES + records.len() * RECORD_BYTES);
        bytes.extend_from_slice(&header.encode());
        for r in records {
            bytes.extend_from_slice(&r.encode(seed));
        }
        let file = open_private(&tmp, Create::Either, true, 0)?;
        file.write_all_at(&bytes, 0)?;
        file.sync_data()?;
        std::fs::rename(&tmp, dir.join(LOG_FILE))?;
        Ok(file)
    }

    /// Syncs the pool directory, making the last rename of the log durable.
    fn sync_directory(&mut self) -> std::io::Result<()> {
        if self.fail_dir_sync_errno != 0 {
            return Err(std::io::Error::from_raw_os_error(self.fail_dir_sync_errno));
        }
        sync_dir(&self.dir)?;
        self.dir_sync_pending = false;
        Ok(())
    }

    /// A new, empty log for a new pool.
    pub fn create(
        dir: &Path,
        pool_id: u128,
        device_count: u16,
        durability: Durability,
    ) -> Result<IndexLog, PoolError> {
        let header = LogHeader { pool_id, device_count, generation: 0 };
        let file = Self::write_whole(dir, header, &[])
            .and_then(|file| sync_dir(dir).map(|()| file))
            .map_err(|e| io_error("creating index log", &Self::path(dir), &e))?;
        Ok(IndexLog {
            dir: dir.to_path_buf(),
            file,
            header,
            seed: header.record_seed(),
            end: LOG_HEADER_BYTES as u64,
            records: 0,
            next_seq: 1,
            durability,
            dir_sync_pending: false,
            fail_errno: 0,
            fail_dir_sync_errno: 0,
        })
    }

    /// Opens an existing log and replays it, cutting off a torn tail.
    pub fn open(dir: &Path, durability: Durability) -> Result<(IndexLog, Replay), PoolError> {
        let path = Self::path(dir);
        let _ = std::fs::remove_file(dir.join(LOG_TMP_FILE)); // an unfinished compaction
        let file = open_private(&path, Create::No, false, 0)
            .map_err(|e| io_error("opening index log", &path, &e))?;
        let mut bytes = Vec::new();
        (&file).read_to_end(&mut bytes).map_err(|e| io_error("reading index log", &path, &e))?;
        let header = LogHeader::decode(&bytes)
            .map_err(|e| PoolError::SsdConfig(format!("{}: {e}", path.display())))?;
        let seed = header.record_seed();
        let mut replay = Replay::default();
        let mut end = LOG_HEADER_BYTES;
        for chunk in bytes[LOG_HEADER_BYTES..].chunks(RECORD_BYTES) {
            match Record::decode(chunk, seed) {
                Some(record) => {
                    replay.records.push(record);
                    end += RECORD_BYTES;
                }
                None => break,
            }
        }
        replay.dropped_tail_bytes = (bytes.len() - end) as u64;
        if replay.dropped_tail_bytes > 0 {
            file.set_len(end as u64)
                .and_then(|()| file.sync_data())
                .map_err(|e| io_error("truncating the torn tail of index log", &path, &e))?;
        }
        let next_seq = replay.records.iter().map(|r| r.seq).max().unwrap_or(0) + 1;
        let log = IndexLog {
            dir: dir.to_path_buf(),
            file,
            header,
            seed,
            end: end as u64,
            records: replay.records.len() as u64,
            next_seq,
            durability,
            dir_sync_pending: false,
            fail_errno: 0,
            fail_dir_sync_errno: 0,
        };
        Ok((log, replay))
    }

    /// Appends `records`, giving each the next sequence number; with `fsync` durability they
    /// are on stable storage when this returns `Ok`. On failure nothing of them stays in the file.
    pub fn append(&mut self, records: &mut [Record]) -> Result<(), i32> {
        if records.is_empty() {
            return Ok(());
        }
        if self.fail_errno != 0 {
            return Err(self.fail_errno);
        }
        if self.durability == Durability::Fsync && self.dir_sync_pending {
            // These records go to the compacted file: durable only once its rename is.
            self.sync_directory().map_err(|e| e.raw_os_error().unwrap_or(libc::EIO))?;
        }
        let mut bytes = Vec::with_capacity(records.len() * RECORD_BYTES);
        for r in records.iter_mut() {
            r.seq = self.next_seq;
            self.next_seq += 1;
            bytes.extend_from_slice(&r.encode(self.seed));
        }
        let mut result = self.file.write_all_at(&bytes, self.end);
        if result.is_ok() && self.durability == Durability::Fsync {
            result = self.file.sync_data();
        }
        match result {
            Ok(()) => {
                self.end += bytes.len() as u64;
                self.records += records.len() as u64;
                Ok(())
            }
            Err(e) => {
                // Cut off whatever part landed, so the next append follows a good record.
                let _ = self.file.set_len(self.end);
                Err(e.raw_os_error().unwrap_or(libc::EIO))
            }
        }
    }

    /// Compaction: replaces the log with one holding exactly `live` (a new generation).
    ///
    /// Once the rename has happened the new file *is* the log, whatever follows: later records
    /// go to it (appending to the replaced file would lose them at the next open). A failed
    /// directory sync after the rename is reported, and retried before the next record is
    /// acknowledged as durable (`fsync` appends, [`Self::sync`]).
    pub fn rewrite(&mut self, live: &[Record]) -> Result<(), PoolError> {
        let header = LogHeader { generation: self.header.generation + 1, ..self.header };
        let path = Self::path(&self.dir);
        let file = Self::write_whole(&self.dir, header, live)
            .map_err(|e| io_error("compacting index log", &path, &e))?;
        self.file = file;
        self.header = header;
        self.seed = header.record_seed();
        self.end = (LOG_HEADER_BYTES + live.len() * RECORD_BYTES) as u64;
        self.records = live.len() as u64;
        self.dir_sync_pending = true;
        self.sync_directory()
            .map_err(|e| io_error("syncing the pool directory after compacting index log", &path, &e))
    }

    /// Makes every appended record durable (used on close with `none` durability), and a
    /// compaction's rename with them.
    pub fn sync(&mut self) -> std::io::Result<()> {
        if self.dir_sync_pending {
            self.sync_directory()?;
        }
        self.file.sync_data()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ssd::format::RECORD_PUT;

    fn record(key: u128) -> Record {
        Record {
            kind: RECORD_PUT,
            device: 0,
            pages: 1,
            seq: 0,
            key,
            offset: 4096 * key as u64,
            payload_len: 10,
            payload_checksum: 1,
            namespace: 7,
        }
    }

    #[test]
    fn append_replay_torn_tail_and_compaction() {
        let dir = std::env::temp_dir().join(format!("kvtier-log-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let mut log = IndexLog::create(&dir, 5, 1, Durability::Fsync).unwrap();
        let mut batch = [record(1), record(2)];
        log.append(&mut batch).unwrap();
        assert_eq!((batch[0].seq, batch[1].seq), (1, 2));
        log.append(&mut [record(3)]).unwrap();
        drop(log);
        // A torn append: half a record after the good ones.
        let path = IndexLog::path(&dir);
        let mut bytes = std::fs::read(&path).unwrap();
        bytes.extend_from_slice(&[0xAB; 40]);
        std::fs::write(&path, &bytes).unwrap();
        let (mut log, replay) = IndexLog::open(&dir, Durability::None).unwrap();
        assert_eq!(replay.records.iter().map(|r| r.key).collect::<Vec<_>>(), vec![1, 2, 3]);
        assert_eq!(replay.dropped_tail_bytes, 40);
        assert_eq!(std::fs::metadata(&path).unwrap().len(), (LOG_HEADER_BYTES + 3 * RECORD_BYTES) as u64);
        log.rewrite(&[replay.records[2]]).unwrap();
        log.append(&mut [record(4)]).unwrap();
        log.fail_errno = libc::ENOSPC;
        assert_eq!(log.append(&mut [record(5)]), Err(libc::ENOSPC));
        drop(log);
        let (log, replay) = IndexLog::open(&dir, Durability::None).unwrap();
        assert_eq!(replay.records.iter().map(|r| (r.key, r.seq)).collect::<Vec<_>>(), vec![(3, 3), (4, 4)]);
        assert_eq!(log.header().generation, 1);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
