//! Moving blocks between the tiers: DRAM → SSD (write-back demotion with an admission filter,
//! optional write-through) and → remote (write-through by default, or write-back), and
//! promotion on hit from either lower tier.
//!
//! **Demotion (write-back).** A put first takes only DRAM's free space. For blocks that did not
//! fit, DRAM picks victims in eviction order and marks them *demoting* (still readable, not
//! evictable); those with at least `admission_k` accesses and not already in SSD are written
//! there straight from their DRAM extents (the payload starts each extent, page-aligned: O_DIRECT,
//! no copy); with a write-back remote tier, every victim whose header verifies is also written
//! there (`SET NX`, from the same extent). Then they leave DRAM and the put retries. A block
//! leaves DRAM only after those writes finished, so it is never in no tier while a lookup could
//! want it. Bounded: at most [`DEMOTION_ROUNDS_MAX`] rounds per put (other threads may take the
//! room freed); after that DRAM evicts without demoting, counted.
//!
//! **Remote write-through** (the default): a put also writes to the remote tier the blocks DRAM
//! did not already hold, and those it held that the server lacks (one `EXISTS` batch: the
//! server may have restarted), so stores in other processes see them at once. A server that is
//! down skips the write (counted in `remote_write_failed`); the put itself still succeeds.
//!
//! **Promotion.** Blocks a load read from SSD or remote are put into DRAM (with demotion as
//! above, but never written back to remote: they came from there, or were written through
//! when first put), so the next hit is a DRAM hit; the lower copy stays (inclusive).
//!
//! **Codecs** (`ssd.codec`, `remote.codec`; [`crate::codec_stage`]): every write to a lower tier
//! (write-through, demotion) stores the block encoded by that tier's codec as a codec object
//! whose header records the codec id; every read from a lower tier decodes by that header into
//! the caller's buffer, whatever this store's codec settings are. Promotion puts the decoded
//! block into DRAM, which holds raw blocks only.

use std::sync::Arc;

use kvtier_core::checksum::checksum;
use kvtier_core::{BlockKey, OBJECT_HEADER_BYTES};
use kvtier_pool::{object_extent_bytes, Demotion, EntryRef, ReadOutcome, Tier, TierKind, TierPutReport};
use kvtier_remote::{key_name, RemoteTier};

use crate::codec_stage::{decode_stored, par_each, verify_stored, Encoded};

use crate::config::StoreConfig;
use crate::error::StoreError;
use crate::lease::LeasedBlock;
use crate::stats::{bump, Counters};
use crate::store::{Store, StoredBlock};

/// Blocks of one put written to each tier (new copies only; on SSD both written through and
/// demoted to make room for the put, which may be older blocks).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TierWrites {
    pub dram: usize,
    pub ssd: usize,
    pub remote: usize,
}

/// What a put did in the hierarchy: counts over its keys (a block DRAM had no room for counts as
/// stored when a lower tier holds it after the put, rejected only when no tier does), and the
/// writes per tier.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct HierarchyPut {
    pub report: TierPutReport,
    pub writes: TierWrites,
}

/// A put into DRAM and SSD: the report, writes, and the items no local tier holds.
struct LocalPut {
    report: TierPutReport,
    writes: TierWrites,
    unplaced: Vec<usize>,
}

/// Demote-and-retry rounds per put before DRAM evicts without demoting.
pub const DEMOTION_ROUNDS_MAX: usize = 4;

fn add(total: &mut TierPutReport, r: TierPutReport) {
    total.stored += r.stored;
    total.already_present += r.already_present;
    total.rejected += r.rejected;
    total.evicted += r.evicted;
}

/// Opens the remote tier of `config` (if any). Bad settings and refused credentials are
/// [`StoreError::Config`]; a server that is not reachable yet is not an error (its blocks miss
/// until it is).
pub(crate) fn open_remote(
    config: &StoreConfig,
    namespace_hash: u128,
) -> Result<Option<Arc<RemoteTier>>, StoreError> {
    let Some(remote) = &config.remote else { return Ok(None) };
    let tier = RemoteTier::open(remote.client.clone(), namespace_hash)
        .map_err(|e| StoreError::Config(format!("remote: {e}")))?;
    Ok(Some(Arc::new(tier)))
}

impl Store {
    fn remote_write_back(&self) -> bool {
        self.config().remote.as_ref().is_some_and(|r| !r.write_through)
    }

    /// Puts a batch into the hierarchy: DRAM (demoting what it gives up), then, with a
    /// write-through remote tier, the remote copy of the blocks DRAM did not already hold.
    pub(crate) fn put_hierarchy(&self, keys: &[BlockKey], objects: &[&[u8]]) -> HierarchyPut {
        let through = match (&self.remote, &self.config().remote) {
            (Some(remote), Some(rc)) if rc.write_through => Some(remote),
            _ => None,
        };
        let fresh: Vec<usize> = match through {
            Some(remote) => self.missing_remotely(remote, keys),
            None => Vec::new(),
        };
        let LocalPut { mut report, mut writes, unplaced } = self.put_local(keys, objects);
        if let Some(remote) = through {
            if !fresh.is_empty() {
                let (fk, fo) = select(keys, objects, &fresh);
                writes.remote += self.put_remote(remote, &fk, &fo, None).stored;
            }
            if !unplaced.is_empty() {
                // DRAM had no room for these: they are stored if the server holds them now (one
                // EXISTS batch, only when a put overflowed every local tier).
                let uk: Vec<BlockKey> = unplaced.iter().map(|&i| keys[i]).collect();
                let held =
                    remote.exists(self.namespace_hash(), &uk).iter().filter(|p| **p == Some(true)).count();
                report.rejected -= held;
                report.stored += held;
            }
        }
        HierarchyPut { report, writes }
    }

    /// Which of `keys` a write-through put must send: those DRAM does not hold (never written
    /// through, or evicted since), and those DRAM holds but the server lacks (it restarted, or
    /// dropped them) — found with one pipelined `EXISTS` batch, so a repeated put of a cached
    /// prompt sends no values.
    fn missing_remotely(&self, remote: &RemoteTier, keys: &[BlockKey]) -> Vec<usize> {
        let (mut fresh, held): (Vec<usize>, Vec<usize>) =
            (0..keys.len()).partition(|&i| !self.dram.contains(self.namespace_hash(), keys[i]));
        if !held.is_empty() {
            let held_keys: Vec<BlockKey> = held.iter().map(|&i| keys[i]).collect();
            let present = remote.exists(self.namespace_hash(), &held_keys);
            fresh.extend(held.iter().zip(present).filter(|(_, p)| *p == Some(false)).map(|(&i, _)| i));
            fresh.sort_unstable();
        }
        fresh
    }

    /// Puts a batch into DRAM, demoting what DRAM gives up to SSD and/or a write-back remote.
    fn put_local(&self, keys: &[BlockKey], objects: &[&[u8]]) -> LocalPut {
        let ns = self.namespace_hash();
        if self.ssd.is_none() && !self.remote_write_back() {
            let mut unplaced = Vec::new();
            let report = self.dram.put_with(ns, keys, objects, true, &mut unplaced);
            let writes = TierWrites { dram: report.stored, ..TierWrites::default() };
            return LocalPut { report, writes, unplaced };
        }
        let mut writes = TierWrites::default();
        let admission_k = self.config().ssd.as_ref().map_or(1, |s| s.admission_k);
        let mut total = TierPutReport::default();
        let mut refused = Vec::new();
        let mut r = self.dram.put_with(ns, keys, objects, false, &mut refused);
        r.rejected -= refused.len(); // refused items are retried below (the rest: other namespaces)
        writes.dram += r.stored;
        add(&mut total, r);
        let mut pending = refused;
        let object_bytes = object_extent_bytes(self.block_bytes() as u64);
        for _ in 0..DEMOTION_ROUNDS_MAX {
            if pending.is_empty() {
                break;
            }
            let demotion = self.dram.take_victims(pending.len() as u64 * object_bytes);
            if demotion.is_empty() {
                break;
            }
            total.evicted += demotion.victims().len();
            writes.ssd += self.demote(&demotion, admission_k);
            demotion.finish();
            let (pk, po) = select(keys, objects, &pending);
            let mut refused = Vec::new();
            let mut r = self.dram.put_with(ns, &pk, &po, false, &mut refused);
            r.rejected -= refused.len();
            writes.dram += r.stored;
            add(&mut total, r);
            pending = refused.iter().map(|&j| pending[j]).collect();
        }
        if !pending.is_empty() {
            // Nothing left to demote (all leased), or other threads kept taking the room.
            let (pk, po) = select(keys, objects, &pending);
            let mut refused = Vec::new();
            let r = self.dram.put_with(ns, &pk, &po, true, &mut refused);
            bump(&self.counters.dropped_evictions, r.evicted);
            writes.dram += r.stored;
            add(&mut total, r);
            pending = refused.iter().map(|&j| pending[j]).collect();
        }
        if let (Some(ssd), Some(ssd_config)) = (&self.ssd, &self.config().ssd) {
            // Blocks DRAM had no room for that SSD held before this put (already present there).
            let on_ssd_before: Vec<bool> = pending.iter().map(|&i| ssd.contains(ns, keys[i])).collect();
            if ssd_config.write_through && ssd_config.admission_k <= 1 {
                let r = if self.ssd_encoder.is_raw() {
                    ssd.put(ns, keys, objects)
                } else {
                    let encoded = Encoded::new(&self.ssd_encoder, ns, keys, objects);
                    count_encoded(&self.counters, TierKind::Ssd, &encoded);
                    let stored: Vec<&[u8]> = (0..keys.len()).map(|i| encoded.stored(i, objects[i])).collect();
                    ssd.put(ns, keys, &stored)
                };
                bump(&self.counters.written_through, r.stored);
                writes.ssd += r.stored;
            }
            // A block SSD holds is not refused, whichever tier DRAM's lack of room sent it to.
            let mut unplaced = Vec::with_capacity(pending.len());
            for (&i, before) in pending.iter().zip(on_ssd_before) {
                if before {
                    total.rejected -= 1;
                    total.already_present += 1;
                } else if ssd.contains(ns, keys[i]) {
                    total.rejected -= 1;
                    total.stored += 1;
                } else {
                    unplaced.push(i);
                }
            }
            pending = unplaced;
        }
        LocalPut { report: total, writes, unplaced: pending }
    }

    /// Writes the victims of `demotion` to SSD (admitted ones) and to a write-back remote tier
    /// (all whose DRAM header verifies), from their DRAM extents; returns the SSD writes.
    fn demote(&self, demotion: &Demotion<'_>, admission_k: u32) -> usize {
        if self.remote_write_back() {
            self.demote_remote(demotion);
        }
        let Some(ssd) = self.ssd.as_ref() else { return 0 };
        let mut keys = Vec::new();
        let mut objects = Vec::new();
        for (i, v) in demotion.victims().iter().enumerate() {
            if v.accesses < admission_k {
                bump(&self.counters.admission_skipped, 1);
            } else if ssd.contains(self.namespace_hash(), v.key) {
                bump(&self.counters.demoted_blocks, 1);
            } else if let Some(checksum) = v.checksum {
                keys.push(v.key);
                objects.push((demotion.payload_pages(i), v.payload_len, checksum));
            } else {
                bump(&self.counters.demotion_failed, 1); // its DRAM header is corrupt: not spread
            }
        }
        if keys.is_empty() {
            return 0;
        }
        let r = if self.ssd_encoder.is_raw() {
            ssd.put_pages(self.namespace_hash(), &keys, &objects)
        } else {
            self.demote_encoded(ssd, &keys, &objects)
        };
        bump(&self.counters.demoted_blocks, r.stored + r.already_present);
        bump(&self.counters.demotion_failed, r.rejected);
        r.stored
    }

    /// Demotes DRAM victims to SSD through the SSD codec. Each payload is checked against the
    /// checksum DRAM recorded before it is encoded (the encoded form gets a checksum of its own,
    /// so a DRAM bit flip must be caught here, not baked in).
    fn demote_encoded(
        &self,
        ssd: &kvtier_pool::SsdTier,
        keys: &[BlockKey],
        objects: &[(&[u8], u64, u64)],
    ) -> TierPutReport {
        let ns = self.namespace_hash();
        let mut ok_keys = Vec::with_capacity(keys.len());
        let mut raw = Vec::with_capacity(keys.len());
        for (&key, &(pages, len, sum)) in keys.iter().zip(objects) {
            let payload = &pages[..len as usize];
            if checksum(payload) == sum {
                ok_keys.push(key);
                raw.push(payload);
            } else {
                bump(&self.counters.demotion_failed, 1);
            }
        }
        let encoded = Encoded::new(&self.ssd_encoder, ns, &ok_keys, &raw);
        count_encoded(&self.counters, TierKind::Ssd, &encoded);
        let stored: Vec<&[u8]> = (0..ok_keys.len()).map(|i| encoded.stored(i, raw[i])).collect();
        ssd.put(ns, &ok_keys, &stored)
    }

    /// Writes blocks to the remote tier (`SET NX`), encoded by the remote codec: a codec object
    /// is the whole value; a raw block gets its codec-0 header (from `checksums` when known).
    fn put_remote(
        &self,
        remote: &RemoteTier,
        keys: &[BlockKey],
        blocks: &[&[u8]],
        checksums: Option<&[u64]>,
    ) -> TierPutReport {
        let ns = self.namespace_hash();
        if self.remote_encoder.is_raw() {
            let r = match checksums {
                Some(sums) => remote.put_with_checksums(ns, keys, blocks, sums),
                None => remote.put(ns, keys, blocks),
            };
            bump(&self.counters.remote_written, r.stored + r.already_present);
            bump(&self.counters.remote_write_failed, r.rejected);
            return r;
        }
        let encoded = Encoded::new(&self.remote_encoder, ns, keys, blocks);
        count_encoded(&self.counters, TierKind::Remote, &encoded);
        let (coded, raw): (Vec<usize>, Vec<usize>) =
            (0..keys.len()).partition(|&i| encoded.objects[i].is_some());
        let mut reports = Vec::with_capacity(2);
        if !coded.is_empty() {
            let ck: Vec<BlockKey> = coded.iter().map(|&i| keys[i]).collect();
            let co: Vec<&[u8]> = coded.iter().map(|&i| encoded.stored(i, blocks[i])).collect();
            reports.push(remote.put_objects(ns, &ck, &co));
        }
        if !raw.is_empty() {
            let (rk, rb) = select(keys, blocks, &raw);
            reports.push(remote.put(ns, &rk, &rb));
        }
        let mut total = TierPutReport::default();
        for r in reports {
            bump(&self.counters.remote_written, r.stored + r.already_present);
            bump(&self.counters.remote_write_failed, r.rejected);
            add(&mut total, r);
        }
        total
    }

    /// Reads pinned SSD entries into `dst`: raw blocks (payload of exactly `block_bytes`)
    /// straight from the device, codec objects through a buffer of their size, then decoded by
    /// the codec id in their header. A codec object that fails to decode is `Corrupt`, counted
    /// in `decode_failures`, and dropped from SSD.
    ///
    /// With `forms` ([`Store::load_range_stored`]), codec objects are read straight into the
    /// front of their destinations, verified and left encoded; `forms[i]` locates the payload.
    pub(crate) fn read_ssd(
        &self,
        entries: &[EntryRef],
        dst: &mut [&mut [u8]],
        outcomes: &mut [ReadOutcome],
        forms: Option<&mut [StoredBlock]>,
    ) {
        let ssd = self.ssd.as_ref().expect("an SSD entry implies an SSD tier");
        let ns = self.namespace_hash();
        let lens: Vec<Option<u64>> = entries.iter().map(|e| ssd.pinned_payload_len(e)).collect();
        let is_object = |i: usize| lens[i].is_some_and(|l| l != self.block_bytes() as u64);
        let direct: Vec<usize> = (0..entries.len()).filter(|&i| !is_object(i)).collect();
        let coded: Vec<usize> = (0..entries.len()).filter(|&i| is_object(i)).collect();
        if !direct.is_empty() {
            let de: Vec<EntryRef> = direct.iter().map(|&i| entries[i]).collect();
            let mut dd: Vec<&mut [u8]> =
                dst.iter_mut().enumerate().filter(|(i, _)| !is_object(*i)).map(|(_, d)| &mut **d).collect();
            let mut dout = vec![ReadOutcome::NotPinned; direct.len()];
            ssd.read_pinned(ns, &de, &mut dd, &mut dout);
            for (&i, o) in direct.iter().zip(dout) {
                outcomes[i] = o;
            }
        }
        if coded.is_empty() {
            return;
        }
        if let Some(forms) = forms {
            return self.read_ssd_stored(entries, &coded, &lens, dst, outcomes, forms);
        }
        let ce: Vec<EntryRef> = coded.iter().map(|&i| entries[i]).collect();
        let mut bufs: Vec<Vec<u8>> =
            coded.iter().map(|&i| vec![0u8; lens[i].expect("sized") as usize]).collect();
        let mut cout = vec![ReadOutcome::NotPinned; coded.len()];
        {
            let mut cd: Vec<&mut [u8]> = bufs.iter_mut().map(|b| &mut b[..]).collect();
            ssd.read_pinned(ns, &ce, &mut cd, &mut cout);
        }
        // Decode what the pool verified, in parallel: (item, stored bytes, destination, outcome,
        // whether decoding failed).
        let mut slots: Vec<Option<&mut [u8]>> = dst.iter_mut().map(|d| Some(&mut **d)).collect();
        let mut work: Vec<DecodeItem<'_>> = coded
            .iter()
            .zip(cout)
            .zip(&bufs)
            .map(|((&i, o), buf)| (i, &buf[..], slots[i].take().expect("each item once"), o, false))
            .collect();
        let bytes = work.len() * self.block_bytes();
        par_each(&mut work, bytes, |(i, buf, d, o, failed)| {
            if *o == ReadOutcome::Loaded && decode_stored(ns, entries[*i].key, buf, d).is_err() {
                *o = ReadOutcome::Corrupt;
                *failed = true;
            }
        });
        let mut undecodable = Vec::new();
        for (i, _, _, o, failed) in work {
            outcomes[i] = o;
            if failed {
                undecodable.push(entries[i].key);
            }
        }
        if !undecodable.is_empty() {
            bump(&self.counters.decode_failures, undecodable.len());
            ssd.remove(self.namespace_hash(), &undecodable);
        }
    }

    /// The codec objects (`coded`, of SSD payload lengths `lens`) of [`read_ssd`](Self::read_ssd)
    /// with `forms`: each read into the front of its destination and verified in place
    /// ([`verify_stored`]), never decoded. One that does not fit its destination or fails
    /// verification is `Corrupt`, counted in `decode_failures`, and dropped from SSD.
    fn read_ssd_stored(
        &self,
        entries: &[EntryRef],
        coded: &[usize],
        lens: &[Option<u64>],
        dst: &mut [&mut [u8]],
        outcomes: &mut [ReadOutcome],
        forms: &mut [StoredBlock],
    ) {
        let ssd = self.ssd.as_ref().expect("an SSD entry implies an SSD tier");
        let ns = self.namespace_hash();
        let len = |i: usize| lens[i].map_or(usize::MAX, |l| usize::try_from(l).unwrap_or(usize::MAX));
        let mut undecodable = Vec::new();
        let mut fit = vec![false; entries.len()];
        for &i in coded {
            if len(i) <= dst[i].len() {
                fit[i] = true;
            } else {
                outcomes[i] = ReadOutcome::Corrupt;
                undecodable.push(entries[i].key);
            }
        }
        let items: Vec<usize> = coded.iter().copied().filter(|&i| fit[i]).collect();
        let ce: Vec<EntryRef> = items.iter().map(|&i| entries[i]).collect();
        let mut cout = vec![ReadOutcome::NotPinned; items.len()];
        {
            let mut cd: Vec<&mut [u8]> =
                dst.iter_mut().enumerate().filter(|(i, _)| fit[*i]).map(|(i, d)| &mut d[..len(i)]).collect();
            ssd.read_pinned(ns, &ce, &mut cd, &mut cout);
        }
        for (&i, mut o) in items.iter().zip(cout) {
            if o == ReadOutcome::Loaded {
                match verify_stored(ns, entries[i].key, &dst[i][..len(i)], self.block_bytes()) {
                    Ok((codec_id, offset, len)) => forms[i] = StoredBlock { codec_id, offset, len },
                    Err(()) => {
                        o = ReadOutcome::Corrupt;
                        undecodable.push(entries[i].key);
                    }
                }
            }
            outcomes[i] = o;
        }
        if !undecodable.is_empty() {
            bump(&self.counters.decode_failures, undecodable.len());
            ssd.remove(self.namespace_hash(), &undecodable);
        }
    }

    /// Reads remote blocks into `dst`. Values of exactly header + `block_bytes` (raw) are read
    /// straight into `dst`; others (codec objects) are read whole and decoded by their header's
    /// codec id. With a remote codec configured, values are expected encoded and read whole
    /// at once. A value that fails to decode is `Corrupt`, counted, and deleted. With `forms`
    /// ([`Store::load_range_stored`]), a codec object is verified and its payload copied to the
    /// front of its destination undecoded (`forms[i]` locates it).
    pub(crate) fn read_remote(
        &self,
        entries: &[EntryRef],
        dst: &mut [&mut [u8]],
        outcomes: &mut [ReadOutcome],
        mut forms: Option<&mut [StoredBlock]>,
    ) {
        let remote = self.remote.as_ref().expect("a remote entry implies a remote tier");
        let ns = self.namespace_hash();
        let keys: Vec<BlockKey> = entries.iter().map(|e| e.key).collect();
        let whole: Vec<usize> = if self.remote_encoder.is_raw() {
            let got = remote.read_blocks_sized(ns, &keys, dst);
            let mut whole = Vec::new();
            for (i, o) in got.into_iter().enumerate() {
                match o {
                    Some(o) => outcomes[i] = o,
                    None => whole.push(i),
                }
            }
            whole
        } else {
            (0..keys.len()).collect()
        };
        if whole.is_empty() {
            return;
        }
        let whole_keys: Vec<BlockKey> = whole.iter().map(|&i| keys[i]).collect();
        let mut undecodable = Vec::new();
        let objects = remote.read_objects(ns, &whole_keys, (OBJECT_HEADER_BYTES + self.block_bytes()) as u64);
        for (&i, got) in whole.iter().zip(objects) {
            let bb = self.block_bytes();
            let decoded = |value: &[u8], d: &mut [u8], forms: Option<&mut [StoredBlock]>| match forms {
                None => decode_stored(ns, keys[i], value, d),
                Some(forms) => {
                    let (codec_id, offset, len) = verify_stored(ns, keys[i], value, bb)?;
                    let payload = &value[offset..offset + len];
                    d.get_mut(..len).ok_or(())?.copy_from_slice(payload);
                    forms[i] = StoredBlock { codec_id, offset: 0, len };
                    Ok(())
                }
            };
            outcomes[i] = match got {
                Err(outcome) => outcome,
                Ok(value) => match decoded(&value, dst[i], forms.as_deref_mut()) {
                    Ok(()) => ReadOutcome::Loaded,
                    Err(()) => {
                        undecodable.push(key_name(&remote.client().config().key_prefix, ns, keys[i]));
                        ReadOutcome::Corrupt
                    }
                },
            };
        }
        if !undecodable.is_empty() {
            bump(&self.counters.decode_failures, undecodable.len());
            let names: Vec<&[u8]> = undecodable.iter().map(|n| &n[..]).collect();
            remote.client().del(&names);
        }
    }

    fn demote_remote(&self, demotion: &Demotion<'_>) {
        let remote = self.remote.as_ref().expect("a remote config opens a remote tier");
        let (mut keys, mut payloads, mut checksums) = (Vec::new(), Vec::new(), Vec::new());
        for (i, v) in demotion.victims().iter().enumerate() {
            if let Some(checksum) = v.checksum {
                keys.push(v.key);
                payloads.push(&demotion.payload_pages(i)[..v.payload_len as usize]);
                checksums.push(checksum);
            }
        }
        if keys.is_empty() {
            return;
        }
        if !self.remote_encoder.is_raw() {
            // Verified against DRAM's checksum before encoding (see `demote_encoded`).
            let ok: Vec<usize> = (0..keys.len()).filter(|&i| checksum(payloads[i]) == checksums[i]).collect();
            bump(&self.counters.remote_write_failed, keys.len() - ok.len());
            let (keys, payloads) = select(&keys, &payloads, &ok);
            self.put_remote(remote, &keys, &payloads, None);
            return;
        }
        self.put_remote(remote, &keys, &payloads, Some(&checksums));
    }

    /// Copies the blocks of a load that came from SSD or remote into DRAM; returns how many.
    pub(crate) fn promote<D: AsRef<[u8]>>(&self, blocks: &[LeasedBlock], dst: &[D]) -> usize {
        let mut from = Vec::new();
        if self.config().ssd.as_ref().is_some_and(|s| s.promote_on_hit) {
            from.push(self.tier_index(TierKind::Ssd));
        }
        if self.config().remote.as_ref().is_some_and(|r| r.promote_on_hit) {
            from.push(self.tier_index(TierKind::Remote));
        }
        if from.is_empty() {
            return 0;
        }
        let (keys, objects): (Vec<BlockKey>, Vec<&[u8]>) = blocks
            .iter()
            .zip(dst)
            .filter(|(b, _)| from.contains(&b.tier))
            .map(|(b, d)| (b.entry.key, d.as_ref()))
            .unzip();
        if keys.is_empty() {
            return 0;
        }
        let r = self.put_local(&keys, &objects).report;
        bump(&self.counters.promoted_blocks, r.stored);
        r.stored
    }
}

/// One SSD codec object to decode: item, stored bytes, destination, outcome, whether decoding
/// failed.
type DecodeItem<'a> = (usize, &'a [u8], &'a mut [u8], ReadOutcome, bool);

/// Adds one encoded batch to the tier's codec counters.
fn count_encoded(c: &Counters, tier: TierKind, e: &Encoded) {
    let (blocks, before, after, fallbacks) = match tier {
        TierKind::Ssd => (
            &c.ssd_encoded_blocks,
            &c.ssd_encoded_bytes_before,
            &c.ssd_encoded_bytes_after,
            &c.ssd_encode_fallbacks,
        ),
        _ => (
            &c.remote_encoded_blocks,
            &c.remote_encoded_bytes_before,
            &c.remote_encoded_bytes_after,
            &c.remote_encode_fallbacks,
        ),
    };
    bump(blocks, e.objects.len() - e.fallbacks);
    bump(before, e.bytes_before);
    bump(after, e.bytes_after);
    bump(fallbacks, e.fallbacks);
}

fn select<'a>(keys: &[BlockKey], objects: &[&'a [u8]], items: &[usize]) -> (Vec<BlockKey>, Vec<&'a [u8]>) {
    (items.iter().map(|&i| keys[i]).collect(), items.iter().map(|&i| objects[i]).collect())
}
