//! Writing a batch into the pool: place (Algorithm 1 or round-robin), reserve extents (evicting
//! per device), write on every device at once, then log and publish what was written.

use kvtier_core::BlockKey;

use super::config::{Durability, Placement};
use super::format::{Record, RECORD_PUT};
use super::placement::{algorithm1_counts, assign_in_order, round_robin};
use super::recovery::object_pages;
use super::state::SsdState;
use super::worker::{Op, OpKind, OpResult, Pending};
use super::SsdTier;
use crate::extent::{Extent, PAGE_BYTES};
use crate::tier::TierPutReport;

/// Where the bytes of one object to write come from.
#[derive(Clone, Copy)]
pub(super) enum Source<'a> {
    /// A payload: written from where it is when page-aligned and of whole pages, else copied
    /// into a staging buffer and zero-padded. The worker computes its checksum.
    Payload(&'a [u8]),
    /// A payload already in page-aligned whole pages (e.g. a DRAM extent being demoted), with
    /// its length and checksum: written as it is.
    Pages { pages: &'a [u8], payload_len: u64, checksum: u64 },
}

struct WriteJob {
    item: usize,
    device: usize,
    extent: Extent,
    payload_len: u64,
    /// Known checksum (pages); payload writes learn it from the worker.
    checksum: u64,
}

impl SsdTier {
    /// Devices in descending bandwidth order: where placement falls back when a device is full.
    fn fallback_order(&self) -> Vec<usize> {
        let bw = self.read_bandwidths();
        let mut order: Vec<usize> = (0..bw.len()).collect();
        order.sort_by(|&a, &b| bw[b].total_cmp(&bw[a]).then(a.cmp(&b)));
        order
    }

    /// The target device of each of `n` new objects, in batch order.
    fn place(&self, st: &mut SsdState, n: usize) -> Vec<usize> {
        let devices = self.devices.len();
        match self.config.placement {
            Placement::Bandwidth => assign_in_order(&algorithm1_counts(&self.read_bandwidths(), n)),
            Placement::RoundRobin => {
                let start = st.rr_cursor;
                st.rr_cursor = (start + n) % devices;
                round_robin(devices, start, n)
            }
        }
    }

    /// Reserves extents for every new key; returns the jobs and the eviction `Delete` records.
    fn reserve(
        &self,
        namespace: u128,
        keys: &[BlockKey],
        sources: &[Source<'_>],
        report: &mut TierPutReport,
    ) -> (Vec<WriteJob>, Vec<Record>) {
        let fallback = self.fallback_order();
        let mut deletes = Vec::new();
        let mut jobs = Vec::with_capacity(keys.len());
        let mut st = self.state.lock();
        let mut fresh = Vec::with_capacity(keys.len());
        for (i, key) in keys.iter().enumerate() {
            match st.index.get(key) {
                None => fresh.push(i),
                Some(e) if e.namespace == namespace => report.already_present += 1,
                // Another namespace's copy of this key: never overwritten, never this one's hit.
                Some(_) => report.rejected += 1,
            }
        }
        let targets = self.place(&mut st, fresh.len());
        for (&item, &target) in fresh.iter().zip(&targets) {
            let key = keys[item];
            if st.index.contains_key(&key) {
                report.already_present += 1; // the same key twice in one batch
                continue;
            }
            let (payload_len, checksum) = match sources[item] {
                Source::Payload(p) => (p.len() as u64, 0),
                Source::Pages { pages, payload_len, checksum } => {
                    let whole = object_pages(payload_len).map(|n| n * PAGE_BYTES) == Some(pages.len() as u64);
                    if !whole || pages.as_ptr() as u64 % PAGE_BYTES != 0 {
                        report.rejected += 1; // not page-aligned whole pages: refuse, never store
                        continue;
                    }
                    (payload_len, checksum)
                }
            };
            let Some(need) = object_pages(payload_len).map(|n| n * PAGE_BYTES) else {
                report.rejected += 1;
                continue;
            };
            match st.allocate(target, &fallback, need, &mut deletes) {
                Some((device, extent)) => {
                    st.insert_writing(key, namespace, device, extent, payload_len);
                    jobs.push(WriteJob { item, device, extent, payload_len, checksum });
                }
                None => report.rejected += 1,
            }
        }
        st.counters.rejected += report.rejected as u64;
        report.evicted = deletes.len();
        (jobs, deletes)
    }

    /// Stores a batch (see [`Tier::put`](crate::Tier::put)) of `namespace`.
    pub(super) fn put_sources(
        &self,
        namespace: u128,
        keys: &[BlockKey],
        sources: &[Source<'_>],
    ) -> TierPutReport {
        assert_eq!(keys.len(), sources.len(), "one source per key");
        let mut report = TierPutReport::default();
        let (mut jobs, deletes) = self.reserve(namespace, keys, sources, &mut report);
        // Evicted objects' extents are about to be overwritten: their `Delete` records go to the
        // log first, so a crash never leaves the log naming an extent this put wrote. (Freed
        // space this batch does not take may be written by a concurrent put before then; a
        // crash in between is caught by the payload checksum: docs/formats.md §4.)
        if !deletes.is_empty() && !self.log_evictions(keys, &jobs, deletes, &mut report) {
            return report;
        }
        let sync = self.config.durability == Durability::Fsync;
        let mut per_device: Vec<Vec<Op>> = vec![Vec::new(); self.devices.len()];
        let mut slot_of = Vec::with_capacity(jobs.len()); // (device, index in its batch)
        for job in &jobs {
            let device = &self.devices[job.device];
            let offset = device.data_offset + job.extent.offset;
            let kind = match sources[job.item] {
                Source::Payload(p) => OpKind::WritePayload { src: p.as_ptr(), payload_len: p.len() },
                Source::Pages { pages, .. } => OpKind::WriteAligned { src: pages.as_ptr() },
            };
            slot_of.push((job.device, per_device[job.device].len()));
            per_device[job.device].push(Op { offset, len: job.extent.len as usize, kind });
        }
        // Every device writes at once; each batch is waited for before this function returns,
        // and the sources are borrowed for all of it.
        let pending: Vec<Option<Pending>> = per_device
            .into_iter()
            .enumerate()
            // SAFETY: the sources outlive this function, which waits for every batch below.
            .map(|(d, ops)| (!ops.is_empty()).then(|| unsafe { self.workers[d].submit(ops, sync) }))
            .collect();
        let results: Vec<Option<(Vec<OpResult>, Option<i32>)>> =
            pending.into_iter().map(|p| p.map(Pending::wait)).collect();
        let mut written = vec![false; jobs.len()];
        for (j, job) in jobs.iter_mut().enumerate() {
            let (device, index) = slot_of[j];
            let (device_results, sync_error) =
                results[device].as_ref().expect("a batch per device with jobs");
            if let (OpResult::Written(sum), None) = (device_results[index], sync_error) {
                if matches!(sources[job.item], Source::Payload(_)) {
                    job.checksum = sum;
                }
                written[j] = true;
            }
        }
        self.log_and_publish(namespace, keys, &jobs, &written, &mut report);
        report
    }

    /// Appends the `Delete` records of a batch's evictions. If that fails, the batch is
    /// refused and the evicted objects are put back (their extents were only reserved).
    fn log_evictions(
        &self,
        keys: &[BlockKey],
        jobs: &[WriteJob],
        mut deletes: Vec<Record>,
        report: &mut TierPutReport,
    ) -> bool {
        let mut log = self.log.lock();
        if log.append(&mut deletes).is_ok() {
            return true;
        }
        let mut st = self.state.lock();
        st.counters.log_failures += 1;
        for job in jobs {
            st.abandon(keys[job.item]);
        }
        st.counters.rejected += jobs.len() as u64;
        report.rejected += jobs.len();
        for victim in &deletes {
            if st.restore(victim) {
                st.counters.evictions -= 1;
                report.evicted -= 1;
            }
        }
        false
    }

    /// Appends `Put` records for the written objects, then publishes them (or abandons them if
    /// the append failed: their bytes are on disk but nothing names them).
    fn log_and_publish(
        &self,
        namespace: u128,
        keys: &[BlockKey],
        jobs: &[WriteJob],
        written: &[bool],
        report: &mut TierPutReport,
    ) {
        let mut records = Vec::with_capacity(jobs.len());
        for (job, _) in jobs.iter().zip(written).filter(|(_, &ok)| ok) {
            let pages = (job.extent.len / PAGE_BYTES) as u32;
            records.push(Record {
                kind: RECORD_PUT,
                device: job.device as u16,
                pages,
                seq: 0,
                key: keys[job.item],
                offset: job.extent.offset,
                payload_len: job.payload_len,
                payload_checksum: job.checksum,
                namespace,
            });
        }
        let mut log = self.log.lock();
        let appended = log.append(&mut records);
        let mut st = self.state.lock();
        let mut puts = records.iter();
        for (job, &ok) in jobs.iter().zip(written) {
            let key = keys[job.item];
            if ok && appended.is_ok() {
                let record = puts.next().expect("one record per written object");
                st.publish(key, job.checksum, record.seq);
                report.stored += 1;
            } else {
                st.abandon(key);
                report.rejected += 1;
                st.counters.rejected += 1;
                if ok {
                    st.counters.log_failures += 1;
                } else {
                    st.counters.write_failures += 1;
                }
            }
        }
        let live = st.index.len() as u64;
        if log.records() > self.config.compact_min_records.max(2 * live) {
            let snapshot = st.live_records();
            drop(st);
            if log.rewrite(&snapshot).is_ok() {
                self.state.lock().counters.compactions += 1;
            }
        }
    }
}
