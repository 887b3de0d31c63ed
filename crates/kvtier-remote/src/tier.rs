//! [`RemoteTier`]: the [`Tier`] over a Redis/Valkey server or cluster.
//!
//! Objects are stored whole — the 64-byte kvtier header then the payload (`docs/formats.md`) —
//! under `<key_prefix><namespace:032x>:<key:032x>`. Nothing from the network is ever
//! interpreted beyond that header: every GET is checked for length, header checksum,
//! namespace, key and payload checksum before its bytes count as loaded.
//!
//! The server is shared and may drop keys (TTL, `maxmemory` eviction, restart) at any time, so
//! pins here are local bookkeeping (the store's lease cross-check), not a guarantee: a block
//! located and then gone at load is [`ReadOutcome::Missing`], a miss. A value that fails
//! verification is a miss too, counted by kind, and deleted so later lookups miss it at once.
//! A down server makes lookups and loads return misses (counted) and puts skip (counted).

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};

use kvtier_core::checksum::checksum;
use kvtier_core::object::CODEC_RAW;
use kvtier_core::tier::{
    locate_each, ClearError, EntryRef, IntegrityError, Located, ReadOutcome, Tier, TierKind, TierPutReport,
    TierStats,
};
use kvtier_core::{BlockKey, ObjectError, ObjectHeader, OBJECT_HEADER_BYTES};
use parking_lot::Mutex;

use crate::client::RemoteClient;
use crate::config::RemoteConfig;
use crate::error::RemoteError;
use crate::metrics::{bump, RemoteMetrics};
use crate::pipeline::{GetItem, HeaderSpec, Res, SetItem};

/// Keys in the first `EXISTS` batch of a prefix lookup (later batches double).
pub const LOCATE_CHUNK_KEYS: usize = 512;

/// The server key of a block: `<prefix><namespace:032x>:<key:032x>`.
pub fn key_name(prefix: &str, namespace: u128, key: BlockKey) -> Vec<u8> {
    format!("{prefix}{namespace:032x}:{key:032x}").into_bytes()
}

/// The remote tier of one namespace.
pub struct RemoteTier {
    client: RemoteClient,
    namespace: u128,
    pins: Mutex<HashMap<EntryRef, u32>>,
    next_entry_id: AtomicU64,
    stored: AtomicU64,
    rejected: AtomicU64,
    checksum_failures: AtomicU64,
}

impl std::fmt::Debug for RemoteTier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RemoteTier")
            .field("client", &self.client)
            .field("namespace", &self.namespace)
            .finish()
    }
}

impl RemoteTier {
    /// Connects (see [`RemoteClient::open`]): bad settings and refused credentials are errors.
    pub fn open(config: RemoteConfig, namespace: u128) -> Result<RemoteTier, RemoteError> {
        Ok(RemoteTier {
            client: RemoteClient::open(config)?,
            namespace,
            pins: Mutex::new(HashMap::new()),
            next_entry_id: AtomicU64::new(1),
            stored: AtomicU64::new(0),
            rejected: AtomicU64::new(0),
            checksum_failures: AtomicU64::new(0),
        })
    }

    /// The raw client under the tier (the raw-client baseline and the tests reach the server
    /// through it, bypassing the object format).
    #[cfg(any(feature = "bench-baselines", feature = "test-hooks"))]
    pub fn client(&self) -> &RemoteClient {
        &self.client
    }

    /// The server key of block `key` of `namespace`.
    pub fn key_name(&self, namespace: u128, key: BlockKey) -> Vec<u8> {
        key_name(&self.client.config().key_prefix, namespace, key)
    }

    pub fn metrics(&self) -> RemoteMetrics {
        self.client.metrics()
    }

    /// Deletes every object of `namespace` under this tier's key prefix — on the server, or on
    /// every master of a cluster — and nothing else (no other namespace, prefix or key; see
    /// [`namespace_pattern`](crate::clear::namespace_pattern)); returns how many it deleted.
    /// Not atomic: objects written while it runs may survive (a store fences its own writes
    /// around it, `Store::clear`; other processes' are not). Costs a `SCAN` of every key in
    /// the database. Errors as [`RemoteClient::delete_matching`]: objects may remain then.
    pub fn clear_namespace(&self, namespace: u128) -> Result<u64, RemoteError> {
        let prefix = &self.client.config().key_prefix;
        let pattern = crate::clear::namespace_pattern(prefix, namespace);
        self.client.delete_matching(&pattern, &|name| crate::clear::is_namespace_key(prefix, namespace, name))
    }

    fn name(&self, namespace: u128, key: BlockKey) -> Vec<u8> {
        key_name(&self.client.config().key_prefix, namespace, key)
    }

    /// Stores objects whose payload checksums are known (e.g. DRAM victims): `SET .. NX`.
    pub fn put_with_checksums(
        &self,
        namespace: u128,
        keys: &[BlockKey],
        payloads: &[&[u8]],
        checksums: &[u64],
    ) -> TierPutReport {
        assert_eq!(keys.len(), checksums.len(), "one checksum per key");
        let header = |i: usize| {
            let len = payloads[i].len() as u64;
            HeaderSpec::Known(
                ObjectHeader::with_checksum(namespace, keys[i], CODEC_RAW, len, checksums[i]).encode(),
            )
        };
        self.put_items(namespace, keys, payloads, header)
    }

    /// Stores values that are whole objects already, header included (e.g. the store's codec
    /// objects, whose header records their codec): `SET .. NX`.
    pub fn put_objects(&self, namespace: u128, keys: &[BlockKey], objects: &[&[u8]]) -> TierPutReport {
        self.put_items(namespace, keys, objects, |_| HeaderSpec::None)
    }

    fn put_items(
        &self,
        namespace: u128,
        keys: &[BlockKey],
        payloads: &[&[u8]],
        header: impl Fn(usize) -> HeaderSpec,
    ) -> TierPutReport {
        assert_eq!(keys.len(), payloads.len(), "one payload per key");
        let names: Vec<Vec<u8>> = keys.iter().map(|&k| self.name(namespace, k)).collect();
        let name_refs: Vec<&[u8]> = names.iter().map(|n| &n[..]).collect();
        let items: Vec<SetItem<'_>> =
            (0..keys.len()).map(|i| SetItem { header: header(i), payload: payloads[i] }).collect();
        let results = self.client.set(&name_refs, &items, true);
        let mut report = TierPutReport::default();
        for r in results {
            match r {
                Res::Bool(true) => report.stored += 1,
                Res::Bool(false) => report.already_present += 1,
                Res::Failed => {
                    report.rejected += 1;
                    bump(&self.client.counters().down_skipped_writes, 1);
                }
                _ => report.rejected += 1,
            }
        }
        self.stored.fetch_add(report.stored as u64, Ordering::Relaxed);
        self.rejected.fetch_add(report.rejected as u64, Ordering::Relaxed);
        report
    }

    /// Checks one GET result against the object this key must be; counts what is wrong.
    fn verify(&self, namespace: u128, key: BlockKey, item: &GetItem<'_>) -> Result<(), ()> {
        let c = self.client.counters();
        let header = match ObjectHeader::decode(&item.header) {
            Ok(h) => h,
            Err(_) => {
                bump(&c.bad_magic, 1);
                return Err(());
            }
        };
        if header.expect_identity(namespace, key).is_err() {
            bump(&c.foreign_objects, 1);
            return Err(());
        }
        if header.payload_len != item.dst.len() as u64 || header.codec_id != CODEC_RAW {
            bump(&c.bad_length, 1);
            return Err(());
        }
        if checksum(item.dst) != header.payload_checksum {
            bump(&c.bad_checksum, 1);
            return Err(());
        }
        Ok(())
    }

    /// GETs `keys` straight into `dst` (each exactly one payload long) and verifies them:
    /// [`ReadOutcome::Loaded`], `Corrupt` (counted by kind, and deleted from the server) or
    /// `Missing` (no such key, server down or failing). Needs no pins (the server has none).
    pub fn read_blocks(&self, namespace: u128, keys: &[BlockKey], dst: &mut [&mut [u8]]) -> Vec<ReadOutcome> {
        self.read_blocks_inner(namespace, keys, dst, false)
            .into_iter()
            .map(|o| o.expect("wrong lengths are outcomes here"))
            .collect()
    }

    /// Like [`read_blocks`](Self::read_blocks), except that a value whose length is not
    /// header + `dst[i].len()` is `None` (neither counted nor deleted): an object stored under
    /// another codec, which the caller reads whole (e.g. with [`read_objects`](Self::read_objects)).
    pub fn read_blocks_sized(
        &self,
        namespace: u128,
        keys: &[BlockKey],
        dst: &mut [&mut [u8]],
    ) -> Vec<Option<ReadOutcome>> {
        self.read_blocks_inner(namespace, keys, dst, true)
    }

    fn read_blocks_inner(
        &self,
        namespace: u128,
        keys: &[BlockKey],
        dst: &mut [&mut [u8]],
        other_lengths_ok: bool,
    ) -> Vec<Option<ReadOutcome>> {
        assert_eq!(keys.len(), dst.len(), "one destination per key");
        let items: Vec<GetItem<'_>> = dst
            .iter_mut()
            .map(|d| GetItem { with_header: true, header: [0u8; OBJECT_HEADER_BYTES], dst: d })
            .collect();
        let names: Vec<Vec<u8>> = keys.iter().map(|&k| self.name(namespace, k)).collect();
        let name_refs: Vec<&[u8]> = names.iter().map(|n| &n[..]).collect();
        let (results, items) = self.client.get(&name_refs, items);
        let c = self.client.counters();
        let mut bad: Vec<&[u8]> = Vec::new();
        let mut outcomes = Vec::with_capacity(keys.len());
        for (i, (r, item)) in results.into_iter().zip(&items).enumerate() {
            if other_lengths_ok && r == Res::WrongLength {
                outcomes.push(None);
                continue;
            }
            let outcome = match r {
                Res::Filled => match self.verify(namespace, keys[i], item) {
                    Ok(()) => ReadOutcome::Loaded,
                    Err(()) => ReadOutcome::Corrupt,
                },
                Res::WrongLength => {
                    bump(&c.bad_length, 1);
                    ReadOutcome::Corrupt
                }
                Res::Nil => {
                    bump(&c.missing_on_get, 1);
                    ReadOutcome::Missing
                }
                Res::Failed => {
                    bump(&c.down_misses, 1);
                    ReadOutcome::Missing
                }
                Res::WrongType => {
                    // Not an object (another program's list or hash under a kvtier name): deleted
                    // below like garbage, or every lookup would report it present forever.
                    bump(&c.bad_magic, 1);
                    ReadOutcome::Corrupt
                }
                Res::Bool(_) | Res::Redirect | Res::ServerError => ReadOutcome::Missing,
            };
            if outcome == ReadOutcome::Corrupt {
                bad.push(name_refs[i]);
            }
            outcomes.push(Some(outcome));
        }
        if !bad.is_empty() {
            self.checksum_failures.fetch_add(bad.len() as u64, Ordering::Relaxed);
            // Doom the bad values: the next lookup misses them instead of failing again.
            self.client.del(&bad);
        }
        outcomes
    }

    /// GETs whole values of any length (objects stored under a codec, whose payload is shorter
    /// than a block) and verifies each as the object of its key: `Ok(value)` (header, identity,
    /// length and payload checksum verified; the payload starts at byte 64), or the outcome of
    /// a miss — `Missing` (no such key, server down), `Corrupt` (counted by kind as
    /// [`read_blocks`](Self::read_blocks) counts, and deleted; so is a value longer than
    /// `value_bytes_max`, an object's most: header and block). The GETs are pipelined, in a
    /// window of `inflight_bytes_max` counting each value as `value_bytes_max`.
    pub fn read_objects(
        &self,
        namespace: u128,
        keys: &[BlockKey],
        value_bytes_max: u64,
    ) -> Vec<Result<Vec<u8>, ReadOutcome>> {
        let names: Vec<Vec<u8>> = keys.iter().map(|&k| self.name(namespace, k)).collect();
        let name_refs: Vec<&[u8]> = names.iter().map(|n| &n[..]).collect();
        let values = self.client.get_values_res(&name_refs, value_bytes_max);
        let c = self.client.counters();
        let mut bad: Vec<&[u8]> = Vec::new();
        let mut out = Vec::with_capacity(keys.len());
        for (i, value) in values.into_iter().enumerate() {
            let value = match value {
                Ok(value) => value,
                Err(bad_value @ (Res::WrongType | Res::WrongLength)) => {
                    // Not an object (a list under a kvtier name), or longer than any object is.
                    bump(if bad_value == Res::WrongType { &c.bad_magic } else { &c.bad_length }, 1);
                    bad.push(name_refs[i]);
                    out.push(Err(ReadOutcome::Corrupt));
                    continue;
                }
                Err(_) => {
                    bump(&c.missing_on_get, 1);
                    out.push(Err(ReadOutcome::Missing));
                    continue;
                }
            };
            let verdict = kvtier_core::object::decode_object(&value)
                .and_then(|(header, _)| header.expect_identity(namespace, keys[i]));
            let counter = match verdict {
                Ok(()) => {
                    out.push(Ok(value));
                    continue;
                }
                Err(ObjectError::TooShort { .. } | ObjectError::LengthMismatch { .. }) => &c.bad_length,
                Err(ObjectError::PayloadChecksum { .. }) => &c.bad_checksum,
                Err(ObjectError::ForeignNamespace { .. } | ObjectError::WrongKey { .. }) => {
                    &c.foreign_objects
                }
                Err(_) => &c.bad_magic,
            };
            bump(counter, 1);
            bad.push(name_refs[i]);
            out.push(Err(ReadOutcome::Corrupt));
        }
        if !bad.is_empty() {
            self.checksum_failures.fetch_add(bad.len() as u64, Ordering::Relaxed);
            self.client.del(&bad);
        }
        out
    }

    /// Which of `keys` the server holds (`None`: unknown, server down or failing).
    pub fn exists(&self, namespace: u128, keys: &[BlockKey]) -> Vec<Option<bool>> {
        let names: Vec<Vec<u8>> = keys.iter().map(|&k| self.name(namespace, k)).collect();
        let name_refs: Vec<&[u8]> = names.iter().map(|n| &n[..]).collect();
        let results = self.client.exists(&name_refs);
        bump(&self.client.counters().down_misses, results.iter().filter(|r| **r == Res::Failed).count());
        results.into_iter().map(|r| if let Res::Bool(b) = r { Some(b) } else { None }).collect()
    }

    /// Decodes a whole value (tests, tools): the payload if it is this key's object.
    pub fn decode_value(namespace: u128, key: BlockKey, value: &[u8]) -> Result<Vec<u8>, ObjectError> {
        let (header, payload) = kvtier_core::object::decode_object(value)?;
        header.expect_identity(namespace, key)?;
        Ok(payload.to_vec())
    }
}

impl Tier for RemoteTier {
    fn kind(&self) -> TierKind {
        TierKind::Remote
    }

    /// The server manages its own memory: reported as 0 (unknown) here.
    fn capacity_bytes(&self) -> u64 {
        0
    }

    fn used_bytes(&self) -> u64 {
        0
    }

    fn put(&self, namespace: u128, keys: &[BlockKey], payloads: &[&[u8]]) -> TierPutReport {
        // Each header (and its payload checksum) is computed as its SET is sent.
        self.put_items(namespace, keys, payloads, |i| HeaderSpec::Compute { namespace, key: keys[i] })
    }

    fn locate(
        &self,
        namespace: u128,
        keys: &[BlockKey],
        located: &mut [Option<Located>],
        pin: bool,
        stop_at_miss: bool,
    ) -> usize {
        let ask: Vec<usize> = (0..keys.len()).filter(|&i| located[i].is_none()).collect();
        if ask.is_empty() {
            return 0;
        }
        let mut present = vec![false; keys.len()];
        // With `stop_at_miss` only the consecutive prefix matters: ask in chunks that double
        // from LOCATE_CHUNK_KEYS and stop after the chunk holding the first miss, so a long prompt
        // with a short cached prefix costs one small batch, not one EXISTS per block.
        let mut chunk = if stop_at_miss { LOCATE_CHUNK_KEYS } else { ask.len() };
        let mut start = 0;
        while start < ask.len() {
            let part = &ask[start..(start + chunk).min(ask.len())];
            let names: Vec<Vec<u8>> = part.iter().map(|&i| self.name(namespace, keys[i])).collect();
            let name_refs: Vec<&[u8]> = names.iter().map(|n| &n[..]).collect();
            // A cached prefix is usually whole: one multi-key EXISTS confirms a chunk at once, and
            // only a chunk with a miss (or a cluster) is asked name by name.
            let results = if self.client.exists_all(&name_refs) == Some(true) {
                vec![Res::Bool(true); part.len()]
            } else {
                self.client.exists(&name_refs)
            };
            let down = results.iter().filter(|r| **r == Res::Failed).count();
            bump(&self.client.counters().down_misses, down);
            let mut missed = false;
            for (&i, r) in part.iter().zip(&results) {
                present[i] = *r == Res::Bool(true);
                missed |= !present[i];
            }
            if stop_at_miss && missed {
                break;
            }
            start += part.len();
            chunk = chunk.saturating_mul(2);
        }
        let mut pins = self.pins.lock();
        locate_each(TierKind::Remote, keys, located, stop_at_miss, |i, key| {
            if !present[i] {
                return None;
            }
            let entry = EntryRef { key: *key, entry_id: self.next_entry_id.fetch_add(1, Ordering::Relaxed) };
            if pin {
                *pins.entry(entry).or_insert(0) += 1;
            }
            Some(entry.entry_id)
        })
    }

    fn read_pinned(
        &self,
        namespace: u128,
        entries: &[EntryRef],
        dst: &mut [&mut [u8]],
        outcomes: &mut [ReadOutcome],
    ) {
        assert_eq!(entries.len(), dst.len(), "one destination per entry");
        assert_eq!(entries.len(), outcomes.len(), "one outcome per entry");
        let pinned: Vec<bool> = {
            let pins = self.pins.lock();
            entries.iter().map(|e| pins.contains_key(e)).collect()
        };
        let idx: Vec<usize> = (0..entries.len()).filter(|&i| pinned[i]).collect();
        let keys: Vec<BlockKey> = idx.iter().map(|&i| entries[i].key).collect();
        let mut mine: Vec<&mut [u8]> =
            dst.iter_mut().zip(&pinned).filter(|(_, &p)| p).map(|(d, _)| &mut **d).collect();
        let got = self.read_blocks(namespace, &keys, &mut mine);
        outcomes.fill(ReadOutcome::NotPinned);
        for (&i, o) in idx.iter().zip(got) {
            outcomes[i] = o;
        }
    }

    fn unpin(&self, entries: &[EntryRef]) {
        let mut pins = self.pins.lock();
        for e in entries {
            let n = pins.get_mut(e).unwrap_or_else(|| panic!("unpin of {e:?}, which holds no pin"));
            *n -= 1;
            if *n == 0 {
                pins.remove(e);
            }
        }
    }

    fn contains(&self, namespace: u128, key: BlockKey) -> bool {
        let name = self.name(namespace, key);
        self.client.exists(&[&name[..]]) == [Res::Bool(true)]
    }

    fn remove(&self, namespace: u128, keys: &[BlockKey]) -> usize {
        let names: Vec<Vec<u8>> = keys.iter().map(|&k| self.name(namespace, k)).collect();
        let name_refs: Vec<&[u8]> = names.iter().map(|n| &n[..]).collect();
        self.client.del(&name_refs).iter().filter(|r| **r == Res::Bool(true)).count()
    }

    fn clear(&self, namespace: u128) -> Result<usize, ClearError> {
        let detail = |e: RemoteError| e.to_string();
        self.clear_namespace(namespace)
            .map(|n| n as usize)
            .map_err(|e| ClearError { tier: "remote", detail: detail(e) })
    }

    fn pins(&self) -> Vec<(EntryRef, u32)> {
        self.pins.lock().iter().map(|(e, n)| (*e, *n)).collect()
    }

    fn stats(&self) -> TierStats {
        TierStats {
            pinned_objects: self.pins.lock().len() as u64,
            stored: self.stored.load(Ordering::Relaxed),
            rejected: self.rejected.load(Ordering::Relaxed),
            checksum_failures: self.checksum_failures.load(Ordering::Relaxed),
            ..TierStats::default()
        }
    }

    fn check_integrity(&self) -> Result<(), IntegrityError> {
        // Only the pin table is local; the store cross-checks it against its leases.
        Ok(())
    }

    #[cfg(feature = "test-hooks")]
    fn corrupt_for_test(&self, key: BlockKey, payload_byte_offset: usize) -> bool {
        let name = self.name(self.namespace, key);
        let Some(Some(mut value)) = self.client.get_values(&[&name[..]], 0).pop() else { return false };
        let Some(byte) = value.get_mut(OBJECT_HEADER_BYTES + payload_byte_offset) else { return false };
        *byte ^= 1;
        self.client.set(&[&name[..]], &[SetItem { header: HeaderSpec::None, payload: &value }], false)
            == [Res::Bool(true)]
    }
}
