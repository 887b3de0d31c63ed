//! [`Tier`] for the SSD pool, batched reads grouped by device, and the pool's metrics
//! ([`SsdMetrics`], defined in `metrics.rs`).

use kvtier_core::BlockKey;

use super::buffer::AlignedBuf;
use super::device::transfer_exact;
use super::metrics::{SsdDeviceReport, SsdMetrics};
use super::state::{Entry, EntryState, PinnedAt};
use super::worker::{Op, OpKind, OpResult, Pending};
use super::writes::Source;
use super::SsdTier;
use crate::error::{integrity, PoolError};
use crate::extent::PAGE_BYTES;
use crate::tier::IntegrityError;
use crate::tier::{
    locate_each, ClearError, EntryRef, Located, ReadOutcome, Tier, TierKind, TierPutReport, TierStats,
};
use kvtier_core::checksum::checksum;

impl SsdTier {
    /// Stores payloads that already sit in page-aligned whole pages (e.g. DRAM extents being
    /// demoted), with their lengths and checksums, without copying them: `objects[i]` is
    /// `(pages, payload_len, checksum)`. Pages that are not aligned, or not exactly the payload
    /// rounded up to pages, are rejected.
    pub fn put_pages(
        &self,
        namespace: u128,
        keys: &[BlockKey],
        objects: &[(&[u8], u64, u64)],
    ) -> TierPutReport {
        let sources: Vec<Source<'_>> = objects
            .iter()
            .map(|&(pages, payload_len, checksum)| Source::Pages { pages, payload_len, checksum })
            .collect();
        self.put_sources(namespace, keys, &sources)
    }

    /// Looks up, pins, reads and unpins `keys` into `dst` (pool-level API for benchmarks and
    /// tests; the store uses `locate`/`read_pinned` with leases). `None`: not in the pool.
    /// Errors, reading nothing, if a buffer is not the size of the object found for its key.
    pub fn get(
        &self,
        namespace: u128,
        keys: &[BlockKey],
        dst: &mut [&mut [u8]],
    ) -> Result<Vec<Option<ReadOutcome>>, PoolError> {
        assert_eq!(keys.len(), dst.len(), "one destination per key");
        let mut located = vec![None; keys.len()];
        self.locate(namespace, keys, &mut located, true, false);
        let items: Vec<usize> = (0..keys.len()).filter(|&i| located[i].is_some()).collect();
        let entries: Vec<EntryRef> = items.iter().map(|&i| located[i].expect("located").entry).collect();
        // `read_pinned` asserts the sizes (the store sizes its buffers from the entries); a
        // caller's buffers are checked here. A pinned entry's length cannot change meanwhile.
        let wrong = items.iter().zip(&entries).find_map(|(&index, entry)| {
            let stored = self.pinned_payload_len(entry)?;
            let buffer = dst[index].len() as u64;
            (buffer != stored).then_some(PoolError::BufferSize { index, buffer, stored })
        });
        if let Some(e) = wrong {
            self.unpin(&entries);
            return Err(e);
        }
        let mut outcomes = vec![ReadOutcome::NotPinned; items.len()];
        {
            let mut mine: Vec<&mut [u8]> =
                dst.iter_mut().zip(&located).filter(|(_, l)| l.is_some()).map(|(d, _)| &mut **d).collect();
            self.read_pinned(namespace, &entries, &mut mine, &mut outcomes);
        }
        self.unpin(&entries);
        let mut out = vec![None; keys.len()];
        for (&i, o) in items.iter().zip(outcomes) {
            out[i] = Some(o);
        }
        Ok(out)
    }

    /// The stored payload length of a pinned entry (so a reader can size its buffer for
    /// [`Tier::read_pinned`] when payloads vary, e.g. encoded blocks); `None` if the entry is
    /// not pinned or is known corrupt.
    pub fn pinned_payload_len(&self, entry: &EntryRef) -> Option<u64> {
        match self.state.lock().find_pinned(entry) {
            Some(PinnedAt::Readable(e)) => Some(e.payload_len),
            _ => None,
        }
    }

    pub fn metrics(&self) -> SsdMetrics {
        let (tier, counters, per_device) = {
            let st = self.state.lock();
            let mut objects = vec![0u64; self.devices.len()];
            for e in st.index.values().filter(|e| e.state == EntryState::Ready) {
                objects[usize::from(e.device)] += 1;
            }
            let spaces: Vec<(u64, u64)> =
                st.spaces.iter().map(|s| (s.allocator.used_bytes(), s.allocator.capacity_bytes())).collect();
            (self.stats_locked(&st), st.counters, objects.into_iter().zip(spaces).collect::<Vec<_>>())
        };
        let (log_records, log_bytes, log_generation) = {
            let log = self.log.lock();
            (log.records(), log.bytes(), log.header().generation)
        };
        let total_bw: f64 = self.read_bandwidths().iter().sum();
        let devices = self
            .devices
            .iter()
            .zip(&self.bandwidths)
            .zip(per_device)
            .map(|((d, bw), (objects, (used_bytes, capacity_bytes)))| SsdDeviceReport {
                path: d.path.display().to_string(),
                direct_io: d.direct,
                block_device: d.is_block_device,
                read_bytes_per_s: bw.read_bytes_per_s,
                write_bytes_per_s: bw.write_bytes_per_s,
                placement_share: if total_bw > 0.0 { bw.read_bytes_per_s / total_bw } else { 0.0 },
                throttle_bytes_per_s: d.throttle.as_ref().map_or(0.0, |t| t.rate_bytes_per_s()),
                objects,
                used_bytes,
                capacity_bytes,
                io: d.metrics.snapshot(),
            })
            .collect();
        SsdMetrics {
            engine: self.engine_name(),
            durability: self.config.durability.name(),
            placement: self.config.placement.name(),
            bandwidth_source: self.bandwidth_source.clone(),
            devices,
            tier,
            lookup_hits: counters.lookup_hits,
            lookup_misses: counters.lookup_misses,
            write_failures: counters.write_failures,
            read_io_errors: counters.read_io_errors,
            log_failures: counters.log_failures,
            log_records,
            log_bytes,
            log_generation,
            compactions: counters.compactions,
            recovery: self.recovery,
            warnings: self.warnings.clone(),
        }
    }

    fn stats_locked(&self, st: &super::state::SsdState) -> TierStats {
        TierStats {
            objects: st.index.len() as u64 - st.writing,
            pinned_objects: st.pinned_ready,
            doomed_objects: st.doomed.len() as u64,
            used_bytes: st.used_bytes(),
            capacity_bytes: st.capacity_bytes(),
            stored: st.counters.stored,
            evictions: st.counters.evictions,
            rejected: st.counters.rejected,
            checksum_failures: st.counters.checksum_failures,
        }
    }

    /// Removes the ready copies of `namespace` of `targets` (key, and the copy's entry id, or
    /// `None` for whichever copy is there), logging their removal: [`Tier::remove`] and
    /// [`Tier::remove_entries`].
    fn remove_where(&self, namespace: u128, targets: impl Iterator<Item = (BlockKey, Option<u64>)>) -> usize {
        let mut log = self.log.lock();
        let mut st = self.state.lock();
        let mut deletes = Vec::new();
        for (key, id) in targets {
            let named = |e: &Entry| {
                e.state == EntryState::Ready && e.namespace == namespace && id.map_or(true, |id| id == e.id)
            };
            if st.index.get(&key).is_some_and(named) {
                deletes.push(st.retire(key, false));
            }
        }
        let removed = deletes.len();
        // Appended under the lock, as in `settle_failed_reads`.
        if log.append(&mut deletes).is_err() {
            st.counters.log_failures += 1;
        }
        removed
    }

    /// Dooms entries that failed verification (or whose read failed), counting each stored copy
    /// once, and logs their removal.
    fn settle_failed_reads(
        &self,
        entries: &[EntryRef],
        failed: &[(usize, bool)],
        outcomes: &mut [ReadOutcome],
    ) {
        let mut log = self.log.lock();
        let mut st = self.state.lock();
        let mut deletes = Vec::new();
        for &(item, io_error) in failed {
            let entry = entries[item];
            if st.index.get(&entry.key).is_some_and(|e| e.id == entry.entry_id) {
                deletes.push(st.retire(entry.key, true));
            } else if let Some(doomed) = st.doomed.get_mut(&entry.entry_id).filter(|d| d.key == entry.key) {
                if doomed.corrupt {
                    outcomes[item] = ReadOutcome::CorruptKnown;
                    continue;
                }
                doomed.corrupt = true;
            }
            if io_error {
                st.counters.read_io_errors += 1;
            } else {
                st.counters.checksum_failures += 1;
            }
        }
        // Appended before the lock drops, so no put can reuse a freed extent before its Delete
        // record is in the log. (A lost record is harmless: reads verify every object.)
        if log.append(&mut deletes).is_err() {
            st.counters.log_failures += 1;
        }
    }
}

impl Tier for SsdTier {
    fn kind(&self) -> TierKind {
        TierKind::Ssd
    }

    fn capacity_bytes(&self) -> u64 {
        self.state.lock().capacity_bytes()
    }

    fn used_bytes(&self) -> u64 {
        self.state.lock().used_bytes()
    }

    fn put(&self, namespace: u128, keys: &[BlockKey], payloads: &[&[u8]]) -> TierPutReport {
        let sources: Vec<Source<'_>> = payloads.iter().map(|&p| Source::Payload(p)).collect();
        self.put_sources(namespace, keys, &sources)
    }

    fn locate(
        &self,
        namespace: u128,
        keys: &[BlockKey],
        located: &mut [Option<Located>],
        pin: bool,
        stop_at_miss: bool,
    ) -> usize {
        let mut st = self.state.lock();
        let st = &mut *st;
        locate_each(TierKind::Ssd, keys, located, stop_at_miss, |_, key| {
            // A shared pool holds many namespaces: another one's copy of this key is a plain miss.
            let visible = |e: &&mut Entry| e.state == EntryState::Ready && e.namespace == namespace;
            let Some(entry) = st.index.get_mut(key).filter(visible) else {
                st.counters.lookup_misses += 1;
                return None;
            };
            if pin {
                if entry.pins == 0 {
                    st.pinned_ready += 1;
                }
                entry.pins = entry.pins.checked_add(1).expect("pin count overflow");
                st.spaces[usize::from(entry.device)].policy.on_access(*key);
            }
            st.counters.lookup_hits += 1;
            Some(entry.id)
        })
    }

    fn read_pinned(
        &self,
        namespace: u128,
        entries: &[EntryRef],
        dst: &mut [&mut [u8]],
        outcomes: &mut [ReadOutcome],
    ) {
        assert!(entries.len() == dst.len() && dst.len() == outcomes.len(), "one destination per entry");
        let mut per_device: Vec<Vec<Op>> = vec![Vec::new(); self.devices.len()];
        let mut items: Vec<Vec<usize>> = vec![Vec::new(); self.devices.len()];
        let mut failed = Vec::new();
        {
            let st = self.state.lock();
            for (item, (entry, d)) in entries.iter().zip(dst.iter_mut()).enumerate() {
                let e = match st.find_pinned(entry) {
                    Some(PinnedAt::Readable(e)) => e,
                    Some(PinnedAt::KnownCorrupt) => {
                        outcomes[item] = ReadOutcome::CorruptKnown;
                        continue;
                    }
                    None => {
                        outcomes[item] = ReadOutcome::NotPinned;
                        continue;
                    }
                };
                assert_eq!(d.len() as u64, e.payload_len, "destination {item} has the wrong length");
                if e.namespace != namespace {
                    // Located for another namespace (a caller bug): never served, never dropped.
                    outcomes[item] = ReadOutcome::Missing;
                    continue;
                }
                let device = usize::from(e.device);
                let kind =
                    OpKind::ReadObject { payload_len: d.len(), checksum: e.checksum, dst: d.as_mut_ptr() };
                per_device[device].push(Op {
                    offset: self.devices[device].data_offset + e.extent.offset,
                    len: e.extent.len as usize,
                    kind,
                });
                items[device].push(item);
            }
        }
        // Grouped by device, all devices at once. SAFETY: `dst` is borrowed mutably for this
        // whole call, and every batch is waited for before it returns.
        let pending: Vec<Option<Pending>> = per_device
            .into_iter()
            .enumerate()
            .map(|(d, ops)| (!ops.is_empty()).then(|| unsafe { self.workers[d].submit(ops, false) }))
            .collect();
        for (device, p) in pending.into_iter().enumerate() {
            let Some(p) = p else { continue };
            let (results, _) = p.wait();
            for (&item, result) in items[device].iter().zip(results) {
                outcomes[item] = match result {
                    OpResult::Read => ReadOutcome::Loaded,
                    other => {
                        failed.push((item, matches!(other, OpResult::IoError(_))));
                        ReadOutcome::Corrupt
                    }
                };
            }
        }
        if !failed.is_empty() {
            self.settle_failed_reads(entries, &failed, outcomes);
        }
    }

    fn unpin(&self, entries: &[EntryRef]) {
        let mut st = self.state.lock();
        for entry in entries {
            st.unpin(entry);
        }
    }

    fn contains(&self, namespace: u128, key: BlockKey) -> bool {
        self.state
            .lock()
            .index
            .get(&key)
            .is_some_and(|e| e.state == EntryState::Ready && e.namespace == namespace)
    }

    fn remove(&self, namespace: u128, keys: &[BlockKey]) -> usize {
        self.remove_where(namespace, keys.iter().map(|&key| (key, None)))
    }

    fn remove_entries(&self, namespace: u128, entries: &[EntryRef]) -> usize {
        self.remove_where(namespace, entries.iter().map(|e| (e.key, Some(e.entry_id))))
    }

    fn clear(&self, namespace: u128) -> Result<usize, ClearError> {
        let mut log = self.log.lock();
        let mut st = self.state.lock();
        let keys: Vec<BlockKey> = st
            .index
            .iter()
            .filter(|(_, e)| e.state == EntryState::Ready && e.namespace == namespace)
            .map(|(&key, _)| key)
            .collect();
        let mut deletes: Vec<_> = keys.iter().map(|&key| st.retire(key, false)).collect();
        // Logged under the lock, as `remove` does, and synced: a restart must not bring them back.
        let logged =
            log.append(&mut deletes).map_err(std::io::Error::from_raw_os_error).and_then(|()| log.sync());
        if let Err(e) = logged {
            st.counters.log_failures += 1;
            let detail =
                format!("the index log did not take the deletes ({e}): a restart may bring them back");
            return Err(ClearError { tier: "ssd", detail });
        }
        Ok(keys.len())
    }

    fn pins(&self) -> Vec<(EntryRef, u32)> {
        let st = self.state.lock();
        let ready = st
            .index
            .iter()
            .filter(|(_, e)| e.pins > 0)
            .map(|(&key, e)| (EntryRef { key, entry_id: e.id }, e.pins));
        let doomed = st.doomed.iter().map(|(&entry_id, d)| (EntryRef { key: d.key, entry_id }, d.entry.pins));
        ready.chain(doomed).collect()
    }

    fn stats(&self) -> TierStats {
        self.stats_locked(&self.state.lock())
    }

    /// Checks the table, allocators and policies, then reads every ready object back from its
    /// device and checks its payload checksum (under the lock, so none is evicted or rewritten
    /// meanwhile). Reads the whole pool: a debugging and test aid, not for a hot path.
    fn check_integrity(&self) -> Result<(), IntegrityError> {
        let st = self.state.lock();
        let ready = st.check().map_err(|d| integrity::<IntegrityError>("ssd", d))?;
        let aligned = |len: usize| {
            AlignedBuf::new(len)
                .map_err(|e| integrity::<IntegrityError>("ssd", format!("no read buffer: {e}")))
        };
        let mut buf = aligned(PAGE_BYTES as usize)?;
        for (key, e) in ready {
            let device = &self.devices[usize::from(e.device)];
            let len = e.extent.len as usize;
            if buf.len() < len {
                buf = aligned(len)?;
            }
            transfer_exact(&device.file, &mut buf, device.data_offset + e.extent.offset, len, false)
                .map_err(|err| integrity::<IntegrityError>("ssd", format!("reading key {key:#x}: {err}")))?;
            if checksum(&buf.as_slice()[..e.payload_len as usize]) != e.checksum {
                return Err(integrity(
                    "ssd",
                    format!(
                        "key {key:#x}: the {} bytes on device {} fail their checksum",
                        e.payload_len, e.device
                    ),
                ));
            }
        }
        Ok(())
    }

    #[cfg(feature = "test-hooks")]
    fn corrupt_for_test(&self, key: BlockKey, payload_byte_offset: usize) -> bool {
        let st = self.state.lock();
        let Some(e) = st.index.get(&key).filter(|e| e.state == EntryState::Ready) else { return false };
        if e.pins > 0 || payload_byte_offset as u64 >= e.payload_len {
            return false;
        }
        let device = &self.devices[usize::from(e.device)];
        let byte = e.extent.offset + payload_byte_offset as u64;
        let page_offset = device.data_offset + byte / PAGE_BYTES * PAGE_BYTES;
        let Ok(mut page) = AlignedBuf::new(PAGE_BYTES as usize) else { return false };
        // Under the lock, on an unpinned entry: no read of it is in flight, none can start.
        if transfer_exact(&device.file, &mut page, page_offset, PAGE_BYTES as usize, false).is_err() {
            return false;
        }
        page.as_mut_slice()[(byte % PAGE_BYTES) as usize] ^= 1;
        transfer_exact(&device.file, &mut page, page_offset, PAGE_BYTES as usize, true).is_ok()
    }
}
