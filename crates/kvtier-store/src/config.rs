//! Store configuration, validated by [`Store::new`](crate::Store::new).

use std::time::Duration;

use kvtier_pool::SsdConfig;
use kvtier_remote::RemoteConfig;

use crate::error::StoreError;

/// The codec a lower tier encodes blocks with as they are written to it (`docs/formats.md` §2,
/// §5). Reading never depends on it: each stored object's header names its codec, so a store
/// reads objects written under any codec setting. DRAM, the hot tier, always holds raw blocks
/// (loads from it are plain copies, and leases hand out its bytes as they are).
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub enum TierCodec {
    /// Stored as given (codec id 0).
    #[default]
    Raw,
    /// Byte-plane shuffle of 16-bit values, then `backend` (`"zstd"`, `"lz4"` or `"deflate"`)
    /// at `level` (`None`: the backend's default). Exact.
    Lossless { backend: String, level: Option<i8> },
    /// CacheGen/ShadowServe vector-wise binning with CacheGen's default bins, then deflate 6.
    /// Lossy (error bound in `kvtier-codec`); needs fp16 KV with no extra groups.
    Quant,
}

impl TierCodec {
    /// `"raw"`, `"lossless"` or `"quant"`.
    pub fn name(&self) -> &'static str {
        match self {
            TierCodec::Raw => "raw",
            TierCodec::Lossless { .. } => "lossless",
            TierCodec::Quant => "quant",
        }
    }

    /// Parses the `codec`, `codec_backend` and `codec_level` keys of a tier's section; `tier`
    /// (`"ssd"`, `"remote"`) names the keys in errors (`ssd.codec_level`).
    pub fn parse(
        tier: &str,
        name: &str,
        backend: Option<&str>,
        level: Option<i64>,
    ) -> Result<Self, StoreError> {
        let bad = |msg: String| Err(StoreError::Config(msg));
        let codec = match name {
            "raw" => TierCodec::Raw,
            "lossless" => {
                let level = match level {
                    None => None,
                    Some(l) => match i8::try_from(l) {
                        Ok(l) => Some(l),
                        Err(_) => {
                            return bad(format!("{tier}.codec_level is {l}; out of range for any backend"))
                        }
                    },
                };
                TierCodec::Lossless { backend: backend.unwrap_or("zstd").to_string(), level }
            }
            "quant" => TierCodec::Quant,
            other => {
                return bad(format!("{tier}.codec is {other:?}; expected \"raw\", \"lossless\" or \"quant\""))
            }
        };
        if !matches!(codec, TierCodec::Lossless { .. }) && (backend.is_some() || level.is_some()) {
            return bad(format!(
                "{tier}.codec_backend/{tier}.codec_level are set but {tier}.codec is {name:?}; they apply to \"lossless\" only"
            ));
        }
        codec.validate(tier)?;
        Ok(codec)
    }

    /// Checks backend and level (geometry-dependent checks happen in [`Store::new`]).
    ///
    /// [`Store::new`]: crate::Store::new
    pub(crate) fn validate(&self, tier: &str) -> Result<(), StoreError> {
        if let TierCodec::Lossless { backend, level } = self {
            let Some(b) = kvtier_codec::streams::Backend::from_name(backend).filter(|b| b.name() != "none")
            else {
                return Err(StoreError::Config(format!(
                    "{tier}.codec_backend is {backend:?}; expected \"zstd\", \"lz4\" or \"deflate\""
                )));
            };
            if let Some(l) = level {
                b.check_level(*l)
                    .map_err(|e| StoreError::Config(format!("{tier}.codec_level is {l}: {e}")))?;
            }
        }
        Ok(())
    }
}

/// Default DRAM tier size: 1 GiB.
pub const DRAM_CAPACITY_BYTES_DEFAULT: u64 = 1 << 30;
/// Largest DRAM tier size accepted: `isize::MAX`, the most one mapping (and one Rust slice) may
/// span on this machine. (The kernel may still refuse less, which [`Store::new`] reports.)
///
/// [`Store::new`]: crate::Store::new
pub const DRAM_CAPACITY_BYTES_MAX: u64 = isize::MAX as u64;
/// Default lease time-to-live.
pub const LEASE_TTL_DEFAULT: Duration = Duration::from_secs(30);
/// Longest lease TTL accepted (one year: keeps deadlines far from `Instant` overflow). A TTL
/// must also be more than 0 (at nanosecond resolution).
pub const LEASE_TTL_MAX: Duration = Duration::from_secs(365 * 24 * 3600);
/// Default bound on leases held at once.
pub const LEASES_MAX_DEFAULT: usize = 4096;
/// Largest `leases_max` accepted.
pub const LEASES_MAX_LIMIT: usize = 1 << 24;
/// Largest `copy_threads` accepted.
pub const COPY_THREADS_MAX: usize = 256;
/// Largest SSD admission threshold accepted.
pub const ADMISSION_K_MAX: u32 = 1 << 20;

/// The DRAM tier (host memory), always present: the top of the hierarchy.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DramStoreConfig {
    /// Bytes of host memory (rounded down to 4 KiB pages). Each block takes a 64-byte header
    /// plus `block_bytes`, rounded up to whole pages.
    pub capacity_bytes: u64,
    /// Fault the whole arena in at construction (with the copy workers), so the first puts run
    /// at memcpy speed instead of paying page faults. Costs the time and commits the memory up
    /// front.
    pub prefault: bool,
}

impl DramStoreConfig {
    /// `capacity_bytes` of host memory, faulted in on first use.
    pub fn new(capacity_bytes: u64) -> Self {
        DramStoreConfig { capacity_bytes, prefault: false }
    }
}

impl Default for DramStoreConfig {
    fn default() -> Self {
        DramStoreConfig::new(DRAM_CAPACITY_BYTES_DEFAULT)
    }
}

/// The SSD tier below DRAM, and how blocks move between the two.
#[derive(Clone, Debug, PartialEq)]
pub struct SsdStoreConfig {
    /// The pool itself. Its `min_object_bytes` and `eviction` are set by the store.
    pub pool: SsdConfig,
    /// A block goes to SSD only once it has had this many accesses (its put counts as one, each
    /// lease of it in DRAM as one more): 1 = every block.
    pub admission_k: u32,
    /// Also write every admitted block to SSD when it is put (default: only when DRAM evicts
    /// it, i.e. write-back).
    pub write_through: bool,
    /// Copy blocks loaded from SSD into DRAM.
    pub promote_on_hit: bool,
    /// Codec blocks are encoded with as they are written to SSD (default raw).
    pub codec: TierCodec,
}

impl SsdStoreConfig {
    /// Write-back, admission after 1 access, promotion on hit, raw.
    pub fn new(pool: SsdConfig) -> Self {
        SsdStoreConfig {
            pool,
            admission_k: 1,
            write_through: false,
            promote_on_hit: true,
            codec: TierCodec::Raw,
        }
    }
}

/// The remote tier (Redis/Valkey server or cluster) at the bottom of the hierarchy, and how
/// blocks move to and from it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RemoteStoreConfig {
    /// Where the server is and how to talk to it.
    pub client: RemoteConfig,
    /// Write every block to the remote tier when it is put, so other processes see it at once
    /// (default). `false`: write-back — a block goes remote only when DRAM gives it up.
    pub write_through: bool,
    /// Copy blocks loaded from the remote tier into DRAM.
    pub promote_on_hit: bool,
    /// Codec blocks are encoded with as they are written to the server (default raw).
    pub codec: TierCodec,
}

impl RemoteStoreConfig {
    /// Write-through, promotion on hit, raw.
    pub fn new(client: RemoteConfig) -> Self {
        RemoteStoreConfig { client, write_through: true, promote_on_hit: true, codec: TierCodec::Raw }
    }
}

/// The store's settings: the store-wide ones, then one section per tier (`dram`, `ssd`,
/// `remote`), as `kvtier.StoreConfig` has them.
#[derive(Clone, Debug, PartialEq)]
pub struct StoreConfig {
    /// Eviction policy name: `"lru"` (default) or `"s3fifo"`.
    pub eviction: String,
    /// Workers copying objects in `put`/`load` (0 = one per core).
    pub copy_threads: usize,
    /// How long a lease pins its blocks if it is never released.
    pub lease_ttl: Duration,
    /// Bound on leases held at once (each pins blocks: a leak must not pin the whole cache).
    pub leases_max: usize,
    /// The DRAM tier.
    pub dram: DramStoreConfig,
    /// An SSD tier below DRAM (`None`: DRAM only).
    pub ssd: Option<SsdStoreConfig>,
    /// A remote tier below DRAM and SSD (`None`: local tiers only).
    pub remote: Option<RemoteStoreConfig>,
}

impl Default for StoreConfig {
    fn default() -> Self {
        StoreConfig {
            eviction: "lru".to_string(),
            copy_threads: 0,
            lease_ttl: LEASE_TTL_DEFAULT,
            leases_max: LEASES_MAX_DEFAULT,
            dram: DramStoreConfig::default(),
            ssd: None,
            remote: None,
        }
    }
}

impl StoreConfig {
    /// Checks every field that does not depend on the namespace.
    pub(crate) fn validate(&self) -> Result<(), StoreError> {
        let bad = |msg: String| Err(StoreError::Config(msg));
        if self.dram.capacity_bytes == 0 {
            return bad("dram.capacity_bytes is 0; expected at least one block's worth of bytes".into());
        }
        if self.dram.capacity_bytes > DRAM_CAPACITY_BYTES_MAX {
            return bad(format!(
                "dram.capacity_bytes is {}; expected at most {DRAM_CAPACITY_BYTES_MAX} (the address space)",
                self.dram.capacity_bytes
            ));
        }
        if self.copy_threads > COPY_THREADS_MAX {
            return bad(format!(
                "copy_threads is {}; expected 0 (one per core) to {COPY_THREADS_MAX}",
                self.copy_threads
            ));
        }
        if self.lease_ttl.is_zero() || self.lease_ttl > LEASE_TTL_MAX {
            return bad(format!(
                "lease_ttl is {:?}; expected more than 0 and at most {LEASE_TTL_MAX:?}",
                self.lease_ttl
            ));
        }
        if self.leases_max == 0 || self.leases_max > LEASES_MAX_LIMIT {
            return bad(format!("leases_max is {}; expected 1 to {LEASES_MAX_LIMIT}", self.leases_max));
        }
        if let Some(ssd) = &self.ssd {
            if ssd.admission_k == 0 || ssd.admission_k > ADMISSION_K_MAX {
                return bad(format!(
                    "ssd.admission_k is {}; expected 1 (every block) to {ADMISSION_K_MAX} accesses",
                    ssd.admission_k
                ));
            }
            ssd.pool.validate().map_err(|e| StoreError::Config(e.to_string()))?;
            ssd.codec.validate("ssd")?;
        }
        if let Some(remote) = &self.remote {
            remote.codec.validate("remote")?;
            remote.client.resolve().map_err(|e| StoreError::Config(format!("remote: {e}")))?;
        }
        Ok(())
    }
}
