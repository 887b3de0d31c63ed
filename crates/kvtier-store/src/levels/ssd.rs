//! The SSD level: the SSD pool and the codec its blocks are written in (`ssd.codec`). On SSD a
//! payload of exactly `block_bytes` is a raw block, read straight into its destination; any
//! other length is a codec object, read whole and decoded by the codec id in its own header
//! ([`crate::codec_stage`]).

use std::sync::Arc;

use kvtier_core::BlockKey;
use kvtier_pool::{EntryRef, PoolError, ReadOutcome, SsdTier, Tier, TierKind, TierPutReport, PAGE_BYTES};

use super::{verified_extents, ExtentPayload, Level, LevelRead};
use crate::codec_stage::{decode_stored, par_each, verify_stored, Encoded, TierEncoder};
use crate::config::SsdStoreConfig;
use crate::error::StoreError;
use crate::stats::{bump, Counters};
use crate::types::StoredBlock;

/// The SSD pool with the encoder of the blocks written to it.
pub(crate) struct SsdLevel {
    pub tier: Arc<SsdTier>,
    encoder: TierEncoder,
    block_bytes: usize,
}

/// One SSD codec object to decode: item, stored bytes, destination, outcome, whether decoding
/// failed.
type DecodeItem<'a> = (usize, &'a [u8], &'a mut [u8], ReadOutcome, bool);

/// Codec objects per chunk of a decoding read ([`SsdLevel::read_decoded`]): the I/O worker's
/// default depth, so a chunk keeps the device as busy as one batch did.
const READ_CHUNK: usize = 8;

/// A decoded chunk: its buffers (to reuse) and each item's (index, outcome, decoding failed).
type DecodedChunk = (Vec<Vec<u8>>, Vec<(usize, ReadOutcome, bool)>);

/// The codec objects of one read: items `coded` of `entries`, of SSD payload lengths `lens`.
struct Coded<'a> {
    ns: u128,
    entries: &'a [EntryRef],
    coded: &'a [usize],
    lens: &'a [Option<u64>],
}

impl SsdLevel {
    /// Opens (and recovers from its index log) the SSD pool of `config`, for blocks of
    /// `block_bytes` evicted by `eviction`.
    pub(crate) fn open(
        config: &SsdStoreConfig,
        eviction: &str,
        block_bytes: usize,
        encoder: TierEncoder,
    ) -> Result<SsdLevel, StoreError> {
        let mut pool = config.pool.clone();
        pool.min_object_bytes = (block_bytes as u64).div_ceil(PAGE_BYTES).max(1) * PAGE_BYTES;
        pool.eviction = eviction.to_string();
        let tier = Arc::new(SsdTier::open(pool).map_err(|e| match e {
            PoolError::SsdConfig(message) => StoreError::Config(format!("ssd: {message}")),
            other => StoreError::Tier(other),
        })?);
        Ok(SsdLevel { tier, encoder, block_bytes })
    }

    /// Writes whole blocks (write-through), encoded by the SSD codec. Through a codec, blocks
    /// SSD already holds are not encoded again (see [`Self::absent`]).
    pub(crate) fn put(&self, ns: u128, keys: &[BlockKey], objects: &[&[u8]], c: &Counters) -> TierPutReport {
        if self.encoder.is_raw() {
            return self.tier.put(ns, keys, objects);
        }
        let (keys, objects, held) = self.absent(ns, keys, objects);
        let encoded = Encoded::new(&self.encoder, ns, &keys, &objects);
        encoded.count(c, TierKind::Ssd);
        let stored: Vec<&[u8]> = (0..keys.len()).map(|i| encoded.stored(i, objects[i])).collect();
        let mut report = self.tier.put(ns, &keys, &stored);
        report.already_present += held;
        report
    }

    /// The blocks of a coded write SSD does not hold ready in `ns` yet, and how many it does.
    /// Keys are content addresses (same key, same bytes), so a held block needs no write, as
    /// the pool's own put would find; filtering first spares the encoding, which costs 4-12×
    /// the device's time per byte: a load's promotion (`Hierarchy::promote`, write-through on)
    /// hands every block it read from SSD back here. A block removed between this check and the
    /// put is simply not on SSD, as if evicted just after its write.
    fn absent<T: Copy>(&self, ns: u128, keys: &[BlockKey], objects: &[T]) -> (Vec<BlockKey>, Vec<T>, usize) {
        let (mut fk, mut fo) = (Vec::with_capacity(keys.len()), Vec::with_capacity(keys.len()));
        for (&key, &object) in keys.iter().zip(objects) {
            if !self.tier.contains(ns, key) {
                fk.push(key);
                fo.push(object);
            }
        }
        let held = keys.len() - fk.len();
        (fk, fo, held)
    }

    /// Writes DRAM victims straight from their extents (demotion). Raw blocks go to the device
    /// from the extents' pages without a copy (O_DIRECT). Through a codec, each payload is first
    /// checked against the checksum DRAM recorded (the encoded form gets a checksum of its own,
    /// so a DRAM bit flip must be caught here, not baked in; a mismatch counts in
    /// `demotion_failed`).
    pub(crate) fn put_extents(
        &self,
        ns: u128,
        keys: &[BlockKey],
        extents: &[ExtentPayload<'_>],
        c: &Counters,
    ) -> TierPutReport {
        if self.encoder.is_raw() {
            return self.tier.put_pages(ns, keys, extents);
        }
        // Blocks SSD already holds need no check or encode.
        let (todo_keys, todo_extents, held) = self.absent(ns, keys, extents);
        let (ok_keys, raw, failed) = verified_extents(&todo_keys, &todo_extents);
        bump(&c.demotion_failed, failed);
        let mut report = self.put(ns, &ok_keys, &raw, c);
        report.already_present += held;
        report
    }

    /// The codec objects of a read with `forms`: each
    /// read into the front of its destination and verified in place ([`verify_stored`]), never
    /// decoded. One that does not fit its destination or fails verification is `Corrupt` and
    /// listed in `undecodable`.
    fn read_stored(
        &self,
        Coded { ns, entries, coded, lens }: Coded<'_>,
        dst: &mut [&mut [u8]],
        outcomes: &mut [ReadOutcome],
        forms: &mut [StoredBlock],
        undecodable: &mut Vec<EntryRef>,
    ) {
        let len = |i: usize| lens[i].map_or(usize::MAX, |l| usize::try_from(l).unwrap_or(usize::MAX));
        let mut fit = vec![false; entries.len()];
        for &i in coded {
            if len(i) <= dst[i].len() {
                fit[i] = true;
            } else {
                outcomes[i] = ReadOutcome::Corrupt;
                undecodable.push(entries[i]);
            }
        }
        let items: Vec<usize> = coded.iter().copied().filter(|&i| fit[i]).collect();
        let ce: Vec<EntryRef> = items.iter().map(|&i| entries[i]).collect();
        let mut cout = vec![ReadOutcome::NotPinned; items.len()];
        {
            let mut cd: Vec<&mut [u8]> =
                dst.iter_mut().enumerate().filter(|(i, _)| fit[*i]).map(|(i, d)| &mut d[..len(i)]).collect();
            self.tier.read_pinned(ns, &ce, &mut cd, &mut cout);
        }
        for (&i, mut o) in items.iter().zip(cout) {
            if o == ReadOutcome::Loaded {
                match verify_stored(ns, entries[i].key, &dst[i][..len(i)], self.block_bytes) {
                    Ok((codec_id, offset, len)) => forms[i] = StoredBlock { codec_id, offset, len },
                    Err(()) => {
                        o = ReadOutcome::Corrupt;
                        undecodable.push(entries[i]);
                    }
                }
            }
            outcomes[i] = o;
        }
    }

    /// The codec objects `coded` of a decoding read, [`READ_CHUNK`] at a time: each chunk read
    /// whole into buffers of their sizes, then decoded into its destinations (on up to one
    /// thread per core) while the next chunk is read; the last one on this thread. Two sets of buffers, reused from chunk to
    /// chunk, so the read faults in at most `2 × READ_CHUNK` buffers, not one per object. One
    /// that fails to decode is `Corrupt` and listed in `undecodable`.
    fn read_decoded(
        &self,
        Coded { ns, entries, coded, lens }: Coded<'_>,
        dst: &mut [&mut [u8]],
        outcomes: &mut [ReadOutcome],
        undecodable: &mut Vec<EntryRef>,
    ) {
        let block_bytes = self.block_bytes;
        let mut slots: Vec<Option<&mut [u8]>> = dst.iter_mut().map(|d| Some(&mut **d)).collect();
        let mut spare: Vec<Vec<Vec<u8>>> = Vec::new();
        let mut results: Vec<(usize, ReadOutcome, bool)> = Vec::with_capacity(coded.len());
        std::thread::scope(|s| {
            let mut decoding: Option<std::thread::ScopedJoinHandle<'_, DecodedChunk>> = None;
            let last = coded.len().div_ceil(READ_CHUNK).saturating_sub(1);
            for (n, chunk) in coded.chunks(READ_CHUNK).enumerate() {
                let mut bufs = spare.pop().unwrap_or_default();
                bufs.resize_with(chunk.len(), || Vec::with_capacity(block_bytes));
                for (b, &i) in bufs.iter_mut().zip(chunk) {
                    b.resize(lens[i].expect("sized") as usize, 0);
                }
                let ce: Vec<EntryRef> = chunk.iter().map(|&i| entries[i]).collect();
                let mut cout = vec![ReadOutcome::NotPinned; chunk.len()];
                {
                    let mut cd: Vec<&mut [u8]> = bufs.iter_mut().map(|b| &mut b[..]).collect();
                    self.tier.read_pinned(ns, &ce, &mut cd, &mut cout);
                }
                let ds: Vec<&mut [u8]> =
                    chunk.iter().map(|&i| slots[i].take().expect("each item once")).collect();
                if let Some(h) = decoding.take() {
                    let (b, r) = h.join().expect("decode thread");
                    spare.push(b);
                    results.extend(r);
                }
                if n == last {
                    // the last chunk: nothing left to read, decode it here
                    results.extend(decode_chunk(ns, entries, chunk, cout, &bufs, ds, block_bytes));
                } else {
                    decoding = Some(s.spawn(move || {
                        let r = decode_chunk(ns, entries, chunk, cout, &bufs, ds, block_bytes);
                        (bufs, r)
                    }));
                }
            }
            if let Some(h) = decoding.take() {
                results.extend(h.join().expect("decode thread").1);
            }
        });
        for (i, o, failed) in results {
            outcomes[i] = o;
            if failed {
                undecodable.push(entries[i]);
            }
        }
    }
}

/// Decodes the codec objects `bufs` of items `chunk` (read with outcomes `cout`) into `ds`, on
/// up to one thread per core; returns each item's (index, outcome, whether decoding failed).
fn decode_chunk(
    ns: u128,
    entries: &[EntryRef],
    chunk: &[usize],
    cout: Vec<ReadOutcome>,
    bufs: &[Vec<u8>],
    ds: Vec<&mut [u8]>,
    block_bytes: usize,
) -> Vec<(usize, ReadOutcome, bool)> {
    let mut work: Vec<DecodeItem<'_>> = chunk
        .iter()
        .zip(cout)
        .zip(bufs)
        .zip(ds)
        .map(|(((&i, o), buf), d)| (i, &buf[..], d, o, false))
        .collect();
    par_each(&mut work, chunk.len() * block_bytes, |(i, buf, d, o, failed)| {
        if *o == ReadOutcome::Loaded && decode_stored(ns, entries[*i].key, buf, d).is_err() {
            *o = ReadOutcome::Corrupt;
            *failed = true;
        }
    });
    work.into_iter().map(|(i, _, _, o, failed)| (i, o, failed)).collect()
}

impl Level for SsdLevel {
    fn tier(&self) -> &dyn Tier {
        &*self.tier
    }

    /// Raw blocks (payload of exactly `block_bytes`) straight from the device; codec objects
    /// decoded (or, with `forms`, verified in place). Undecodable copies are dropped from SSD.
    fn read(
        &self,
        ns: u128,
        entries: &[EntryRef],
        dst: &mut [&mut [u8]],
        outcomes: &mut [ReadOutcome],
        forms: Option<&mut [StoredBlock]>,
    ) -> LevelRead {
        let lens: Vec<Option<u64>> = entries.iter().map(|e| self.tier.pinned_payload_len(e)).collect();
        let is_object = |i: usize| lens[i].is_some_and(|l| l != self.block_bytes as u64);
        let direct: Vec<usize> = (0..entries.len()).filter(|&i| !is_object(i)).collect();
        let coded: Vec<usize> = (0..entries.len()).filter(|&i| is_object(i)).collect();
        if !direct.is_empty() {
            let de: Vec<EntryRef> = direct.iter().map(|&i| entries[i]).collect();
            let mut dd: Vec<&mut [u8]> =
                dst.iter_mut().enumerate().filter(|(i, _)| !is_object(*i)).map(|(_, d)| &mut **d).collect();
            let mut dout = vec![ReadOutcome::NotPinned; direct.len()];
            self.tier.read_pinned(ns, &de, &mut dd, &mut dout);
            for (&i, o) in direct.iter().zip(dout) {
                outcomes[i] = o;
            }
        }
        if coded.is_empty() {
            return LevelRead::default();
        }
        let mut undecodable = Vec::new();
        let batch = Coded { ns, entries, coded: &coded, lens: &lens };
        match forms {
            Some(forms) => self.read_stored(batch, dst, outcomes, forms, &mut undecodable),
            None => self.read_decoded(batch, dst, outcomes, &mut undecodable),
        }
        if !undecodable.is_empty() {
            self.tier.remove_entries(ns, &undecodable);
        }
        LevelRead { decode_failures: undecodable.len() }
    }
}
