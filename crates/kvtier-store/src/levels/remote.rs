//! The remote level: the Redis/Valkey tier and the codec its values are written in
//! (`remote.codec`). A value of exactly header + `block_bytes` is a raw block, read straight
//! into its destination; other values are codec objects, read whole and decoded by the codec
//! id in their header ([`crate::codec_stage`]).

use std::sync::Arc;

use kvtier_core::{BlockKey, OBJECT_HEADER_BYTES};
use kvtier_pool::{EntryRef, ReadOutcome, Tier, TierKind, TierPutReport};
use kvtier_remote::RemoteTier;

use super::{select, verified_extents, ExtentPayload, Level, LevelRead};
use crate::codec_stage::{decode_stored, verify_stored, Encoded, TierEncoder};
use crate::config::StoreConfig;
use crate::error::StoreError;
use crate::stats::{bump, Counters};
use crate::types::StoredBlock;

/// The remote tier with the encoder of the values written to it.
pub(crate) struct RemoteLevel {
    pub tier: Arc<RemoteTier>,
    encoder: TierEncoder,
    block_bytes: usize,
}

fn add(total: &mut TierPutReport, r: TierPutReport) {
    total.stored += r.stored;
    total.already_present += r.already_present;
    total.rejected += r.rejected;
    total.evicted += r.evicted;
}

impl RemoteLevel {
    /// Opens the remote tier of `config` (if any). Bad settings and refused credentials are
    /// [`StoreError::Config`]; a server that is not reachable yet is not an error (its blocks
    /// miss until it is).
    pub(crate) fn open(
        config: &StoreConfig,
        namespace_hash: u128,
        block_bytes: usize,
        encoder: TierEncoder,
    ) -> Result<Option<RemoteLevel>, StoreError> {
        let Some(remote) = &config.remote else { return Ok(None) };
        let tier = RemoteTier::open(remote.client.clone(), namespace_hash)
            .map_err(|e| StoreError::Config(format!("remote: {e}")))?;
        Ok(Some(RemoteLevel { tier: Arc::new(tier), encoder, block_bytes }))
    }

    /// Writes blocks (`SET NX`), encoded by the remote codec: a codec object is the whole value;
    /// a raw block gets its codec-0 header (from `checksums` when known).
    pub(crate) fn put(
        &self,
        ns: u128,
        keys: &[BlockKey],
        blocks: &[&[u8]],
        checksums: Option<&[u64]>,
        c: &Counters,
    ) -> TierPutReport {
        let remote = &self.tier;
        if self.encoder.is_raw() {
            let r = match checksums {
                Some(sums) => remote.put_with_checksums(ns, keys, blocks, sums),
                None => remote.put(ns, keys, blocks),
            };
            bump(&c.remote_written, r.stored + r.already_present);
            bump(&c.remote_write_failed, r.rejected);
            return r;
        }
        let encoded = Encoded::new(&self.encoder, ns, keys, blocks);
        encoded.count(c, TierKind::Remote);
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
            bump(&c.remote_written, r.stored + r.already_present);
            bump(&c.remote_write_failed, r.rejected);
            add(&mut total, r);
        }
        total
    }

    /// Writes DRAM victims (write-back) from their extents: raw values are sent from the
    /// extents with DRAM's checksums in their headers; through a codec, each payload is first
    /// checked against DRAM's checksum (a mismatch counts in `remote_write_failed`).
    pub(crate) fn put_extents(
        &self,
        ns: u128,
        keys: &[BlockKey],
        extents: &[ExtentPayload<'_>],
        c: &Counters,
    ) -> TierPutReport {
        if self.encoder.is_raw() {
            let payloads: Vec<&[u8]> =
                extents.iter().map(|&(pages, len, _)| &pages[..len as usize]).collect();
            let checksums: Vec<u64> = extents.iter().map(|&(_, _, sum)| sum).collect();
            return self.put(ns, keys, &payloads, Some(&checksums), c);
        }
        let (keys, payloads, failed) = verified_extents(keys, extents);
        bump(&c.remote_write_failed, failed);
        self.put(ns, &keys, &payloads, None, c)
    }
}

impl Level for RemoteLevel {
    fn tier(&self) -> &dyn Tier {
        &*self.tier
    }

    /// Values of exactly header + `block_bytes` (raw) are read straight into `dst`; others
    /// (codec objects) are read whole and decoded by their header's codec id. With a remote
    /// codec configured, values are expected encoded and read whole at once. With `forms`, a
    /// codec object is verified and its payload copied to the front of its destination
    /// undecoded (`forms[i]` locates it). A value that fails to decode is `Corrupt` and deleted.
    fn read(
        &self,
        ns: u128,
        entries: &[EntryRef],
        dst: &mut [&mut [u8]],
        outcomes: &mut [ReadOutcome],
        mut forms: Option<&mut [StoredBlock]>,
    ) -> LevelRead {
        let remote = &self.tier;
        let keys: Vec<BlockKey> = entries.iter().map(|e| e.key).collect();
        let whole: Vec<usize> = if self.encoder.is_raw() {
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
            return LevelRead::default();
        }
        let whole_keys: Vec<BlockKey> = whole.iter().map(|&i| keys[i]).collect();
        let mut undecodable = Vec::new();
        let bb = self.block_bytes;
        let objects = remote.read_objects(ns, &whole_keys, (OBJECT_HEADER_BYTES + bb) as u64);
        for (&i, got) in whole.iter().zip(objects) {
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
                        undecodable.push(keys[i]);
                        ReadOutcome::Corrupt
                    }
                },
            };
        }
        if !undecodable.is_empty() {
            remote.remove(ns, &undecodable);
        }
        LevelRead { decode_failures: undecodable.len() }
    }
}
