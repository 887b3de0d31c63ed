//! Codecs per lower tier: blocks written to SSD or remote are encoded by that tier's codec and
//! the object records the codec id; loads decode by that id whatever the reader's config says;
//! corrupt or undecodable codec objects are counted misses. `quant` is checked against its
//! documented bound, the others for exact bytes.
//!
//! The remote tests need `redis-server` (or `valkey-server`) on PATH (`make rust-test` installs
//! it); without it they fail, as `kvtier-remote`'s do.

use crate::common;

use common::{keys, temp_dir, TempDir};
use kvtier_core::checksum::checksum;
use kvtier_core::{BlockKey, Dtype, Geometry, Namespace, ObjectHeader};
use kvtier_remote::pipeline::{HeaderSpec, SetItem};
use kvtier_remote::testing::{require_server_binary, LoopbackServer};
use kvtier_remote::{key_name, RemoteClient};
use kvtier_store::{
    DramStoreConfig, RemoteConfig, RemoteStoreConfig, SsdStoreConfig, Store, StoreConfig, StoreError,
    TierCodec, TierKind,
};

/// 4 layers × 2 heads × 64 dims × 16 tokens × fp16 × K,V = 32 KiB per block. (`quant` with
/// CacheGen's bins needs at least 3 layers to fit in half the fp16 size: layers 0–1 take 32
/// bins, 8-bit codes, for keys and values.)
fn namespace(model_id: &str, cache_salt: &str) -> Namespace {
    let geometry = Geometry::new(4, 2, 64, Dtype::F16, 16, vec![]).unwrap();
    Namespace { geometry, ..common::namespace(model_id, cache_salt) }
}
const BLOCK_BYTES: usize = 32 << 10;
/// DRAM bytes per block: 64-byte header + 32 KiB, rounded up to 4 KiB pages.
const OBJECT_BYTES: u64 = 9 * 4096;

fn lossless(backend: &str) -> TierCodec {
    TierCodec::Lossless { backend: backend.into(), level: None }
}

/// Whether `codec` shrinks `kv_block`s: every codec but raw shrinks this test data (a codec that
/// did not would be stored raw, counted in `*_encode_fallbacks`).
fn shrinks(codec: &TierCodec) -> bool {
    !matches!(codec, TierCodec::Raw)
}

fn all_codecs() -> Vec<TierCodec> {
    vec![TierCodec::Raw, lossless("zstd"), lossless("lz4"), lossless("deflate"), TierCodec::Quant]
}

fn ssd_config(dir: &TempDir, codec: TierCodec, write_through: bool) -> SsdStoreConfig {
    let mut ssd = SsdStoreConfig::new(common::one_device_pool(dir, 64 * OBJECT_BYTES));
    ssd.write_through = write_through;
    ssd.codec = codec;
    ssd
}

fn ssd_store(dir: &TempDir, codec: TierCodec, write_through: bool) -> Store {
    let config = StoreConfig {
        dram: DramStoreConfig::new(2 * OBJECT_BYTES),
        copy_threads: 2,
        ssd: Some(ssd_config(dir, codec, write_through)),
        ..StoreConfig::default()
    };
    Store::new(namespace("test-model", ""), config).unwrap()
}

/// fp16 KV-like values derived from the key: |x| < 1, smooth enough to compress, distinct per
/// key so a block loaded for the wrong key is caught.
fn kv_block(key: BlockKey) -> Vec<u8> {
    let mut state = xxhash_rust::xxh3::xxh3_64(&key.to_le_bytes());
    let mut out = Vec::with_capacity(BLOCK_BYTES);
    while out.len() < BLOCK_BYTES {
        state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        let r = (state >> 33) as u16;
        // sign, exponent 11..=14 (|x| in [2^-4, 1)), the top 2 bits of the mantissa: the low
        // byte plane is all zeros, so even lz4 (no entropy coder) shrinks it
        let bits = ((r & 1) << 15) | ((11 + ((r >> 1) & 3)) << 10) | ((r >> 3) & 0x300);
        out.extend_from_slice(&bits.to_le_bytes());
    }
    out
}

fn f16_to_f32(b: u16) -> f32 {
    let sign = if b >> 15 == 1 { -1.0 } else { 1.0 };
    let exp = i32::from((b >> 10) & 0x1f);
    let man = f32::from(b & 0x3ff);
    match exp {
        0 => sign * man / 1024.0 * 2f32.powi(-14),
        31 => f32::NAN,
        e => sign * (1.0 + man / 1024.0) * 2f32.powi(e - 15),
    }
}

/// `quant`'s documented bound (kvtier-codec, python/kvtier/codec.py): per element
/// `scale × (1/(2h) + 2⁻¹⁰)`, `h = ⌊(bins − 1)/2⌋`; bins ≥ 16 (h ≥ 7) and scale < 1 here.
const QUANT_BOUND: f32 = 1.0 / 14.0 + 1.0 / 1024.0;

fn assert_block(codec_written: &TierCodec, key: BlockKey, got: &[u8]) {
    let want = kv_block(key);
    if *codec_written != TierCodec::Quant {
        assert!(got == want, "block {key:#x} differs ({})", codec_written.name());
        return;
    }
    let mut worst = 0f32;
    for (g, w) in got.chunks_exact(2).zip(want.chunks_exact(2)) {
        let g = f16_to_f32(u16::from_le_bytes([g[0], g[1]]));
        let w = f16_to_f32(u16::from_le_bytes([w[0], w[1]]));
        worst = worst.max((g - w).abs());
    }
    assert!(worst <= QUANT_BOUND, "quant error {worst} over the bound {QUANT_BOUND}");
    assert!(got != vec![0u8; got.len()], "quant decoded to zeros");
}

fn put(store: &Store, ks: &[BlockKey]) {
    let blocks: Vec<Vec<u8>> = ks.iter().map(|&k| kv_block(k)).collect();
    let refs: Vec<&[u8]> = blocks.iter().map(|b| &b[..]).collect();
    // One block per put: a write-through remote store without demotion cannot take a batch
    // larger than DRAM.
    for (k, b) in ks.iter().zip(&refs) {
        let r = store.put(store.namespace_hash(), &[*k], &[b]).unwrap();
        assert_eq!(r.rejected, 0);
    }
}

/// Leases and loads `ks`; returns the tiers they came from and the loaded blocks.
fn load_all(store: &Store, ks: &[BlockKey]) -> (Vec<TierKind>, usize, Vec<Vec<u8>>) {
    let lease = store.lease(store.namespace_hash(), ks).unwrap();
    let mut bufs = vec![vec![0u8; BLOCK_BYTES]; lease.hit_blocks];
    let mut dst: Vec<&mut [u8]> = bufs.iter_mut().map(|b| &mut b[..]).collect();
    let report = store.load(lease.id, &mut dst).unwrap();
    store.release(lease.id).unwrap();
    (lease.tiers, report.loaded_blocks, bufs)
}

#[test]
fn ssd_round_trip_per_codec_write_back_and_write_through() {
    for write_through in [false, true] {
        for codec in all_codecs() {
            let dir = temp_dir(&format!("codec-rt-{}-{write_through}", codec.name()));
            let store = ssd_store(&dir, codec.clone(), write_through);
            let ks = keys(&store, 1, 8);
            put(&store, &ks); // DRAM holds 2: the rest are demoted (or were written through)
            let (tiers, loaded, bufs) = load_all(&store, &ks);
            assert_eq!(loaded, ks.len(), "{}", codec.name());
            assert!(tiers.contains(&TierKind::Ssd));
            for (k, b) in ks.iter().zip(&bufs) {
                assert_block(&codec, *k, b);
            }
            // Promoted blocks are decoded in DRAM: load them again from there.
            let (_, loaded, bufs) = load_all(&store, &ks[..1]);
            assert_eq!(loaded, 1);
            assert_block(&codec, ks[0], &bufs[0]);
            let s = store.stats();
            if codec == TierCodec::Raw {
                assert_eq!(s.ssd_encoded_blocks + s.ssd_encode_fallbacks, 0);
            } else if !shrinks(&codec) {
                assert!(s.ssd_encode_fallbacks >= 6 && s.ssd_encoded_blocks == 0, "{s:?}");
            } else {
                assert!(s.ssd_encoded_blocks >= 6, "{codec:?} encoded {}: {s:?}", s.ssd_encoded_blocks);
                assert!(s.ssd_encoded_bytes_after < s.ssd_encoded_bytes_before, "{s:?}");
                assert_eq!(s.ssd_encoded_bytes_before, s.ssd_encoded_blocks * BLOCK_BYTES as u64);
                // The SSD pool holds the smaller codec objects.
                let ssd = store.tier_stats().into_iter().find(|(k, _)| *k == TierKind::Ssd).unwrap().1;
                assert!(ssd.used_bytes < ssd.objects * BLOCK_BYTES as u64, "{ssd:?}");
            }
            assert_eq!(s.checksum_failures, 0);
            assert_eq!(s.decode_failures, 0);
            store.check_integrity().unwrap();
        }
    }
}

/// A block SSD already holds is never encoded again: not when a load promotes it into DRAM
/// (write-through hands it back to SSD), nor when DRAM demotes it, nor when it is put again.
/// Each block is encoded at most once, and still read back exactly.
#[test]
fn ssd_blocks_held_are_not_encoded_again() {
    for write_through in [false, true] {
        for codec in [lossless("zstd"), TierCodec::Quant] {
            let dir = temp_dir(&format!("codec-once-{}-{write_through}", codec.name()));
            let mut ssd = ssd_config(&dir, codec.clone(), write_through);
            ssd.promote_on_hit = true;
            let config = StoreConfig {
                dram: DramStoreConfig::new(2 * OBJECT_BYTES),
                ssd: Some(ssd),
                ..StoreConfig::default()
            };
            let store = Store::new(namespace("test-model", ""), config).unwrap();
            let ks = keys(&store, 3, 8);
            put(&store, &ks);
            for _ in 0..2 {
                for k in &ks {
                    // one at a time: each promoted into DRAM (2 blocks), evicting, demoting
                    let (_, loaded, bufs) = load_all(&store, &[*k]);
                    assert_eq!(loaded, 1);
                    assert_block(&codec, *k, &bufs[0]);
                }
                put(&store, &ks);
            }
            let s = store.stats();
            let encoded = s.ssd_encoded_blocks + s.ssd_encode_fallbacks;
            assert!(
                encoded <= ks.len() as u64,
                "{} encoded {encoded} times for {} blocks",
                codec.name(),
                ks.len()
            );
            assert!(s.promoted_blocks >= 6, "{s:?}");
            assert_eq!(s.checksum_failures + s.decode_failures, 0);
            store.check_integrity().unwrap();
        }
    }
}

#[test]
fn ssd_reader_follows_the_header_not_its_config() {
    for (writer, reader) in [
        (lossless("deflate"), TierCodec::Raw),
        (TierCodec::Raw, lossless("zstd")),
        (TierCodec::Quant, lossless("lz4")),
        (lossless("lz4"), TierCodec::Quant),
    ] {
        let dir = temp_dir(&format!("codec-mixed-{}-{}", writer.name(), reader.name()));
        let ks = {
            let store = ssd_store(&dir, writer.clone(), true);
            let ks = keys(&store, 7, 6);
            put(&store, &ks);
            store.flush().unwrap();
            ks
        };
        let store = ssd_store(&dir, reader.clone(), false);
        let (tiers, loaded, bufs) = load_all(&store, &ks);
        assert_eq!(loaded, ks.len(), "{} read by {}", writer.name(), reader.name());
        assert!(tiers.iter().all(|t| *t == TierKind::Ssd));
        for (k, b) in ks.iter().zip(&bufs) {
            assert_block(&writer, *k, b);
        }
        assert_eq!(store.stats().decode_failures, 0);
    }
}

#[test]
fn corrupt_encoded_ssd_object_is_a_counted_miss() {
    let dir = temp_dir("codec-corrupt");
    let store = ssd_store(&dir, lossless("zstd"), true);
    let ks = keys(&store, 3, 6);
    put(&store, &ks);
    // ks[0..4] are only on SSD (DRAM kept the last two); flip a byte inside the codec payload.
    assert!(store.corrupt_for_test(ks[1], 100));
    let (_, loaded, bufs) = load_all(&store, &ks);
    assert_eq!(loaded, 1, "the loaded prefix ends at the corrupt block");
    assert_block(&lossless("zstd"), ks[0], &bufs[0]);
    assert_eq!(store.stats().checksum_failures, 1);
    assert_eq!(store.lookup(store.namespace_hash(), &ks).unwrap().hit_blocks, 1, "dropped from SSD");
}

/// A decoding read of more codec objects than one chunk (the SSD level reads and decodes them
/// 8 at a time, overlapped): a tampered object in a later chunk is refused there, every block
/// before it is loaded exactly, and the tampered copy is dropped.
#[test]
fn corrupt_encoded_object_in_a_later_chunk_is_refused() {
    let dir = temp_dir("codec-corrupt-chunks");
    let store = ssd_store(&dir, lossless("zstd"), true);
    let ks = keys(&store, 5, 20);
    put(&store, &ks);
    // DRAM keeps the last two: ks[0..18] come from SSD, two and a bit chunks.
    assert!(store.corrupt_for_test(ks[13], 200));
    let (_, loaded, bufs) = load_all(&store, &ks);
    assert_eq!(loaded, 13, "the loaded prefix ends at the tampered block");
    for (k, b) in ks.iter().zip(&bufs).take(13) {
        assert_block(&lossless("zstd"), *k, b);
    }
    let s = store.stats();
    assert_eq!(s.checksum_failures, 1, "{s:?}");
    assert_eq!(store.lookup(store.namespace_hash(), &ks).unwrap().hit_blocks, 13, "dropped from SSD");
}

/// Writes three blocks through a lossless SSD store in `dir`, then replaces blocks 1 and 2,
/// through the pool itself, with codec objects whose headers verify but which do not decode: an
/// unknown codec id, and a lossless payload of garbage. Returns the namespace hash and the keys.
fn plant_undecodable_objects(dir: &TempDir) -> (u128, Vec<BlockKey>) {
    let (ns_hash, ks) = {
        let store = ssd_store(dir, lossless("zstd"), true);
        let ks = keys(&store, 11, 3);
        put(&store, &ks);
        store.flush().unwrap();
        (store.namespace_hash(), ks)
    };
    let mut pool = ssd_config(dir, TierCodec::Raw, false).pool;
    pool.min_object_bytes = BLOCK_BYTES as u64;
    let ssd = kvtier_pool::SsdTier::open(pool).unwrap();
    assert_eq!(kvtier_pool::Tier::remove(&ssd, ns_hash, &ks[1..]), 2);
    let bad: Vec<Vec<u8>> = [(ks[1], 7u16), (ks[2], 1u16)]
        .iter()
        .map(|&(k, id)| kvtier_core::object::encode_object(ns_hash, k, id, &[0x5a; 900]))
        .collect();
    let refs: Vec<&[u8]> = bad.iter().map(|b| &b[..]).collect();
    assert_eq!(kvtier_pool::Tier::put(&ssd, ns_hash, &ks[1..], &refs).stored, 2);
    ssd.flush().unwrap();
    (ns_hash, ks)
}

#[test]
fn undecodable_ssd_objects_are_counted_misses() {
    let dir = temp_dir("codec-undecodable");
    let (ns_hash, ks) = plant_undecodable_objects(&dir);
    let store = ssd_store(&dir, TierCodec::Raw, false);
    assert_eq!(store.lookup(ns_hash, &ks).unwrap().hit_blocks, 3);
    let (_, loaded, _) = load_all(&store, &ks);
    assert_eq!(loaded, 1);
    let (_, loaded, _) = load_all(&store, &ks[2..]);
    assert_eq!(loaded, 0);
    let s = store.stats();
    assert_eq!(s.decode_failures, 2);
    assert_eq!(store.lookup(ns_hash, &ks).unwrap().hit_blocks, 1, "both dropped from SSD");
    store.check_integrity().unwrap();
}

#[test]
fn bad_codec_config_is_a_clear_error() {
    let dir = temp_dir("codec-badconfig");
    let e = TierCodec::parse("ssd", "gzip", None, None).unwrap_err().to_string();
    assert!(e.contains("ssd.codec") && e.contains("gzip"), "{e}");
    let e = TierCodec::parse("remote", "lossless", Some("brotli"), None).unwrap_err().to_string();
    assert!(e.contains("remote.codec_backend") && e.contains("brotli"), "{e}");
    let e = TierCodec::parse("ssd", "lossless", Some("deflate"), Some(40)).unwrap_err().to_string();
    assert!(e.contains("ssd.codec_level"), "{e}");
    let e = TierCodec::parse("ssd", "raw", Some("zstd"), None).unwrap_err().to_string();
    assert!(e.contains("ssd.codec_backend"), "{e}");
    assert_eq!(TierCodec::parse("ssd", "lossless", None, None).unwrap(), lossless("zstd"));

    // Backend checked by Store::new too (a config built in Rust, not parsed).
    let config = StoreConfig {
        dram: DramStoreConfig::new(2 * OBJECT_BYTES),
        ssd: Some(ssd_config(&dir, lossless("snappy"), false)),
        ..StoreConfig::default()
    };
    let e = Store::new(namespace("m", ""), config).unwrap_err();
    assert!(matches!(&e, StoreError::Config(m) if m.contains("ssd.codec_backend")), "{e}");

    // quant needs fp16 and no extra groups.
    let geometry = Geometry::new(2, 2, 64, Dtype::Bf16, 16, vec![]).unwrap();
    let ns =
        Namespace { model_id: "m".into(), geometry, layout_version: 1, cache_salt: String::new(), rank: 0 };
    let config = StoreConfig {
        dram: DramStoreConfig::new(2 * OBJECT_BYTES),
        ssd: Some(ssd_config(&dir, TierCodec::Quant, false)),
        ..StoreConfig::default()
    };
    let e = Store::new(ns, config).unwrap_err();
    assert!(matches!(&e, StoreError::Config(m) if m.contains("ssd.codec") && m.contains("fp16")), "{e}");
}

// ---- remote ----

/// A loopback server (kvtier-remote's test harness), killed by pid on drop.
struct Server(LoopbackServer);

impl Server {
    fn start() -> Server {
        Server(LoopbackServer::start_anywhere(&require_server_binary(), None))
    }

    fn config(&self, prefix: &str) -> RemoteConfig {
        RemoteConfig { key_prefix: prefix.into(), ..RemoteConfig::single(&self.0.url()) }
    }
}

fn remote_store(server: &Server, prefix: &str, codec: TierCodec, write_through: bool) -> Store {
    let mut remote = RemoteStoreConfig::new(server.config(prefix));
    remote.codec = codec;
    remote.write_through = write_through;
    let config = StoreConfig {
        dram: DramStoreConfig::new(2 * OBJECT_BYTES),
        copy_threads: 2,
        remote: Some(remote),
        ..StoreConfig::default()
    };
    Store::new(namespace("test-model", ""), config).unwrap()
}

#[test]
fn remote_round_trip_and_mixed_readers() {
    let server = Server::start();
    for (n, writer) in all_codecs().into_iter().enumerate() {
        for write_through in [true, false] {
            let prefix = format!("w{n}{write_through}:");
            let ks = {
                let store = remote_store(&server, &prefix, writer.clone(), write_through);
                let ks = keys(&store, 5, 6);
                put(&store, &ks); // write-back: DRAM's 4 victims go remote
                let s = store.stats();
                if shrinks(&writer) {
                    assert!(s.remote_encoded_blocks >= 4, "{s:?}");
                    assert!(s.remote_encoded_bytes_after < s.remote_encoded_bytes_before, "{s:?}");
                }
                // Every value on the server records its codec in its header.
                let client = RemoteClient::open(server.config(&prefix)).unwrap();
                let name = key_name(&prefix, store.namespace_hash(), ks[0]);
                let value = client.get_values(&[&name[..]], 0).pop().unwrap().expect("written");
                let header = ObjectHeader::decode(&value).unwrap();
                let want = if shrinks(&writer) { kvtier_codec::codec_id(writer.name()).unwrap() } else { 0 };
                assert_eq!(header.codec_id, want, "{}", writer.name());
                let stored_on_server = if write_through { 6 } else { 4 };
                ks[..stored_on_server].to_vec()
            };
            // Fresh stores (empty DRAM), each with another codec setting, read every value.
            for reader in [TierCodec::Raw, lossless("lz4"), TierCodec::Quant] {
                let store = remote_store(&server, &prefix, reader.clone(), true);
                let (tiers, loaded, bufs) = load_all(&store, &ks);
                assert_eq!(loaded, ks.len(), "{} read by {}", writer.name(), reader.name());
                assert!(tiers.iter().all(|t| *t == TierKind::Remote));
                for (k, b) in ks.iter().zip(&bufs) {
                    assert_block(&writer, *k, b);
                }
                assert_eq!(store.stats().decode_failures, 0);
            }
        }
    }
}

#[test]
fn undecodable_remote_values_are_counted_misses() {
    let server = Server::start();
    for reader in [TierCodec::Raw, lossless("zstd")] {
        let prefix = format!("bad-{}:", reader.name());
        let store = remote_store(&server, &prefix, reader, true);
        let ns = store.namespace_hash();
        let ks = keys(&store, 9, 4);
        let client = RemoteClient::open(server.config(&prefix)).unwrap();
        // ks[0]: a good lossless value; ks[1]: unknown codec id; ks[2]: garbage lossless
        // payload; ks[3]: a codec payload whose checksum fails. All headers name the right key.
        let good = {
            let w = remote_store(&server, &prefix, lossless("deflate"), true);
            put(&w, &ks[..1]);
            w.stats().remote_encoded_blocks
        };
        assert_eq!(good, 1);
        let garbage = vec![0x5au8; 700];
        let unknown = kvtier_core::object::encode_object(ns, ks[1], 9, &garbage);
        let undecodable = kvtier_core::object::encode_object(ns, ks[2], 1, &garbage);
        let mut bad_sum =
            ObjectHeader::with_checksum(ns, ks[3], 1, 700, checksum(&garbage) ^ 1).encode().to_vec();
        bad_sum.extend_from_slice(&garbage);
        let names: Vec<Vec<u8>> = ks[1..].iter().map(|&k| key_name(&prefix, ns, k)).collect();
        let name_refs: Vec<&[u8]> = names.iter().map(|n| &n[..]).collect();
        let items: Vec<SetItem<'_>> = [&unknown, &undecodable, &bad_sum]
            .iter()
            .map(|v| SetItem { header: HeaderSpec::None, payload: v })
            .collect();
        client.set(&name_refs, &items, false);
        let (_, loaded, bufs) = load_all(&store, &ks);
        assert_eq!(loaded, 1);
        assert_block(&lossless("deflate"), ks[0], &bufs[0]);
        for k in &ks[1..] {
            let (_, loaded, _) = load_all(&store, &[*k]);
            assert_eq!(loaded, 0, "key {k:#x}");
        }
        // ks[1], ks[2]: headers verify, payloads do not decode. ks[3]: the remote tier's own
        // verification fails it (counted there as a bad checksum).
        assert_eq!(store.stats().decode_failures, 2);
        assert_eq!(store.stats().checksum_failures, 3);
        assert_eq!(store.remote_metrics().unwrap().bad_checksum, 1);
        // Deleted from the server: later lookups miss at once.
        assert_eq!(
            client
                .exists(&name_refs)
                .iter()
                .filter(|r| **r == kvtier_remote::pipeline::Res::Bool(false))
                .count(),
            3
        );
    }
}

/// Leases `ks` and reads them undecoded with `load_range_stored`, in two ranges; returns the
/// tiers, each block's stored form, and the destinations.
fn load_all_stored(
    store: &Store,
    ks: &[BlockKey],
) -> (Vec<TierKind>, Vec<Option<kvtier_store::StoredBlock>>, Vec<Vec<u8>>) {
    let lease = store.lease(store.namespace_hash(), ks).unwrap();
    let mut bufs = vec![vec![0u8; BLOCK_BYTES]; lease.hit_blocks];
    let split = lease.hit_blocks / 2;
    let mut forms = Vec::new();
    let (a, b) = bufs.split_at_mut(split);
    for (first, part) in [(0, a), (split, b)] {
        let mut dst: Vec<&mut [u8]> = part.iter_mut().map(|b| &mut b[..]).collect();
        forms.extend(store.load_range_stored(lease.id, first, &mut dst).unwrap().blocks);
    }
    store.release(lease.id).unwrap();
    (lease.tiers, forms, bufs)
}

#[test]
fn stored_loads_hand_out_verified_encoded_payloads() {
    for codec in all_codecs() {
        let dir = temp_dir(&format!("codec-stored-{}", codec.name()));
        let store = ssd_store(&dir, codec.clone(), true);
        let ks = keys(&store, 21, 8);
        put(&store, &ks);
        let (tiers, forms, bufs) = load_all_stored(&store, &ks);
        assert_eq!(forms.len(), ks.len());
        for ((k, tier), (form, buf)) in ks.iter().zip(&tiers).zip(forms.iter().zip(&bufs)) {
            let form = form.expect("verified");
            let payload = &buf[form.offset..form.offset + form.len];
            let encoded = *tier == TierKind::Ssd && shrinks(&codec);
            let want_id = if encoded { kvtier_codec::codec_id(codec.name()).unwrap() } else { 0 };
            assert_eq!(form.codec_id, want_id, "{} from {tier:?}", codec.name());
            if encoded {
                assert!(form.len < BLOCK_BYTES / 2 + 1024, "{} payload of {} bytes", codec.name(), form.len);
            } else {
                assert_eq!((form.offset, form.len), (0, BLOCK_BYTES));
            }
            let mut out = vec![0u8; BLOCK_BYTES];
            assert_eq!(kvtier_codec::decode(form.codec_id, payload, &mut out).unwrap(), BLOCK_BYTES);
            assert_block(&codec, *k, &out);
        }
        let s = store.stats();
        assert_eq!((s.checksum_failures, s.decode_failures), (0, 0));
        // Nothing was promoted: the SSD blocks are still read from SSD.
        assert_eq!(store.lookup(store.namespace_hash(), &ks).unwrap().tiers, tiers);
        store.check_integrity().unwrap();
    }
}

#[test]
fn stored_loads_never_hand_out_unverified_bytes() {
    // A flipped payload byte: the pool checksum fails the block; the others are still read.
    let dir = temp_dir("codec-stored-corrupt");
    let store = ssd_store(&dir, TierCodec::Quant, true);
    let ks = keys(&store, 3, 6);
    put(&store, &ks);
    assert!(store.corrupt_for_test(ks[1], 100));
    let (_, forms, _) = load_all_stored(&store, &ks);
    assert!(forms[1].is_none());
    assert!(forms.iter().enumerate().all(|(i, f)| i == 1 || f.is_some()), "{forms:?}");
    assert_eq!(store.stats().checksum_failures, 1);
    // Objects whose pool checksum holds but whose codec header does not: an unknown codec id,
    // and a lossless payload of garbage. Counted as decode failures and dropped.
    let dir = temp_dir("codec-stored-undecodable");
    let (ns_hash, ks) = plant_undecodable_objects(&dir);
    let store = ssd_store(&dir, TierCodec::Raw, false);
    let (_, forms, _) = load_all_stored(&store, &ks);
    assert!(forms[0].is_some() && forms[1].is_none() && forms[2].is_none(), "{forms:?}");
    assert_eq!(store.stats().decode_failures, 2);
    assert_eq!(store.lookup(ns_hash, &ks).unwrap().hit_blocks, 1, "both dropped from SSD");
    store.check_integrity().unwrap();
}

#[test]
fn stored_load_readers_report_back_to_the_store() {
    // SSD promote_on_hit is on in `ssd_config`; six blocks, DRAM keeps two.
    let dir = temp_dir("codec-stored-report");
    let store = ssd_store(&dir, lossless("zstd"), true);
    assert!(store.promotes_on_hit());
    let ns = store.namespace_hash();
    let ks = keys(&store, 40, 6);
    put(&store, &ks);
    assert_eq!(store.lookup(ns, &ks).unwrap().tiers[..2], [TierKind::Ssd, TierKind::Ssd]);
    // The lease covers the two SSD blocks only: DRAM's two blocks stay unpinned, evictable.
    let lease = store.lease(ns, &ks[..2]).unwrap();
    // Bad calls name the problem and change nothing.
    let e = store.report_undecodable(lease.id, &[2]).unwrap_err();
    assert!(matches!(e, StoreError::LoadTooMany { requested: 3, leased: 2 }), "{e}");
    let short = vec![0u8; BLOCK_BYTES - 1];
    let e = store.promote_decoded(lease.id, 0, &[Some(&short[..])]).unwrap_err().to_string();
    assert!(e.contains(&(BLOCK_BYTES - 1).to_string()), "{e}");
    assert!(store.promote_decoded(lease.id, 1, &[None, None]).is_err());
    assert!(store.report_undecodable(lease.id + 1, &[0]).is_err(), "an unknown lease");
    assert_eq!(store.stats().decode_failures, 0);
    // Block 0 decoded by its reader is promoted; block 1 is reported undecodable and dropped.
    let b0 = kv_block(ks[0]);
    assert_eq!(store.promote_decoded(lease.id, 0, &[Some(&b0[..]), None]).unwrap(), 1);
    assert_eq!(store.report_undecodable(lease.id, &[1, 1]).unwrap(), 1, "a position listed twice");
    store.release(lease.id).unwrap();
    assert_eq!(store.stats().decode_failures, 1);
    assert_eq!(store.stats().promoted_blocks, 1);
    let after = store.lookup(ns, &ks).unwrap();
    assert_eq!((after.hit_blocks, after.tiers[0]), (1, TierKind::Dram));
    let (_, loaded, bufs) = load_all(&store, &ks[..1]);
    assert_eq!((loaded, &bufs[0]), (1, &b0));
    store.check_integrity().unwrap();
}

#[test]
fn an_undecodable_report_drops_the_reported_copy_not_a_newer_one() {
    // Two readers lease the same SSD copy of block 0. The first reports it undecodable (it is
    // doomed, its pins held); block 0 is then stored again, a new good copy. The second
    // reader's report names the old copy: the new one stays.
    let dir = temp_dir("codec-stored-report-newer");
    let store = ssd_store(&dir, lossless("zstd"), true);
    let ns = store.namespace_hash();
    let ks = keys(&store, 50, 6);
    put(&store, &ks);
    assert_eq!(store.lookup(ns, &ks[..1]).unwrap().tiers[..1], [TierKind::Ssd]);
    let ssd_objects = |store: &Store| {
        store.tier_stats().into_iter().find(|(k, _)| *k == TierKind::Ssd).expect("an SSD tier").1.objects
    };
    let (first, second) = (store.lease(ns, &ks[..1]).unwrap(), store.lease(ns, &ks[..1]).unwrap());
    assert_eq!(store.report_undecodable(first.id, &[0]).unwrap(), 1);
    assert_eq!(ssd_objects(&store), 5, "the reported copy is doomed");
    put(&store, &ks[..1]);
    assert_eq!(ssd_objects(&store), 6, "block 0 stored again");
    assert_eq!(store.report_undecodable(second.id, &[0]).unwrap(), 0, "the reported copy was gone already");
    assert_eq!(ssd_objects(&store), 6, "the new copy of block 0 stays");
    store.release(first.id).unwrap();
    store.release(second.id).unwrap();
    assert_eq!(store.stats().decode_failures, 2);
    store.check_integrity().unwrap();
}
