//! Configs crossing from Python, each as one object: `kvtier.StoreConfig` (its `dram`, `ssd` and
//! `remote` sections map 1:1 to kvtier-store's [`StoreConfig`]), `kvtier.SsdConfig` for an
//! `SsdPool`, `kvtier.RemoteConfig` for a `RemotePool`, `kvtier.TransferConfig` for a
//! `TransferEngine`. A config (or a section of it) is its own config dataclass (one of another class is
//! refused: read by attribute, it would give only the keys it shares), read by attribute, or a
//! mapping of the same keys, read by item. Each key is read here once, under the name Python
//! declares it with; a missing or mistyped one is a `ConfigError` naming its path
//! (`ssd.io_depth`), and so is a mapping's key that nothing reads (a misspelt key would
//! otherwise leave its setting at the default). Keys left out (or None) take the Rust defaults,
//! and the Rust configs check every bound again.

use std::cell::RefCell;
use std::collections::BTreeSet;
use std::path::PathBuf;
use std::time::Duration;

use pyo3::prelude::*;
use pyo3::types::PyDict;

use kvtier_core::Namespace;
use kvtier_pool::{Durability, IoEngineKind, Placement, PoolError, SsdConfig};
use kvtier_remote::{RemoteConfig, TlsConfig};
use kvtier_store::config::LEASE_TTL_MAX;
use kvtier_store::{RemoteStoreConfig, SsdStoreConfig, StoreConfig, TierCodec};
use kvtier_transfer::{StageWorkers, TransferConfig};

use crate::errors::{config_error, raise};
use crate::geometry::CoreGeometry;

/// A key's name, as Rust reads it (and as Python declares it).
type Key = &'static str;

/// A config or one of its sections: a config dataclass or a mapping, and its key path.
pub(crate) struct Section<'py> {
    value: Bound<'py, PyAny>,
    /// The section's path (`""` at the root, `"ssd"`), prefixed to each key in errors.
    path: String,
    /// The whole config, as a missing key's error names it (`"store config"`).
    what: &'static str,
    /// The keys read so far: the section's known keys, so that no second list can drift from them.
    read: RefCell<Vec<Key>>,
}

impl<'py> Section<'py> {
    /// The config `value`, a mapping or a `kvtier.<class>` (a config dataclass of another class is
    /// refused, not read for the keys it happens to share while the rest take defaults); its keys
    /// are named `<path>.<key>` in errors (`path` empty: `<key>`).
    pub fn root(
        value: &Bound<'py, PyAny>,
        what: &'static str,
        path: &str,
        class: &'static str,
    ) -> PyResult<Self> {
        Section::of(value.clone(), what, path.to_string(), class)
    }

    fn of(value: Bound<'py, PyAny>, what: &'static str, path: String, class: &'static str) -> PyResult<Self> {
        // The class or a subclass of it (its name anywhere in the MRO).
        let of_class = || {
            let mro = value.get_type().mro();
            mro.iter().any(|c| c.getattr("__name__").is_ok_and(|n| n.to_string() == class))
        };
        let config_dataclass = value.hasattr("__dataclass_fields__")? && of_class();
        if !(value.is_instance_of::<PyDict>() || config_dataclass) {
            let shown = if path.is_empty() { what.to_string() } else { format!("`{path}`") };
            return Err(config_error(format!(
                "{shown} is {}; expected a mapping or a kvtier.{class}",
                value.get_type()
            )));
        }
        Ok(Section { value, path, what, read: RefCell::default() })
    }

    /// `read(self)`, then [`Section::finish`]: a whole config of the keys `read` takes.
    pub fn read<T>(&self, read: fn(&Self) -> PyResult<T>) -> PyResult<T> {
        let out = read(self)?;
        self.finish()?;
        Ok(out)
    }

    /// A `ConfigError` naming each key of a mapping that was not read (once every key is), and
    /// the read key it resembles (`kvtier.errors.did_you_mean`). A dataclass has no other keys.
    pub fn finish(&self) -> PyResult<()> {
        let Ok(d) = self.value.downcast::<PyDict>() else { return Ok(()) };
        let known: BTreeSet<Key> = self.read.borrow().iter().copied().collect();
        let known_key = |k: &Bound<'_, PyAny>| k.extract().is_ok_and(|k: String| known.contains(&*k));
        let unknown: Vec<_> = d.keys().into_iter().filter(|k| !known_key(k)).collect();
        if unknown.is_empty() {
            return Ok(());
        }
        let hint = self.value.py().import("kvtier.errors")?.getattr("did_you_mean")?;
        let hint = hint.call1((&unknown, &known))?;
        let names: Vec<_> = unknown.iter().map(|k| format!("`{}`", self.key_path(&k.to_string()))).collect();
        let (what, names) = (self.what, names.join(", "));
        Err(config_error(format!("unknown {what} key(s) {names}{hint}; expected some of {known:?}")))
    }

    fn key_path(&self, key: &str) -> String {
        if self.path.is_empty() {
            key.to_string()
        } else {
            format!("{}.{key}", self.path)
        }
    }

    /// `key`'s value; `None` when absent or None.
    fn any(&self, key: Key) -> PyResult<Option<Bound<'py, PyAny>>> {
        self.read.borrow_mut().push(key);
        let v = match self.value.downcast::<PyDict>() {
            Ok(d) => d.get_item(key)?,
            Err(_) => self.value.getattr_opt(key)?,
        };
        Ok(v.filter(|v| !v.is_none()))
    }

    /// `key`'s value as a `T`; `None` when absent or None.
    pub fn get<T: FromPyObject<'py>>(&self, key: Key) -> PyResult<Option<T>> {
        self.any(key)?
            .map(|v| v.extract().map_err(|e| config_error(format!("`{}`: {e}", self.key_path(key)))))
            .transpose()
    }

    pub fn required<T: FromPyObject<'py>>(&self, key: Key) -> PyResult<T> {
        self.get(key)?.ok_or_else(|| config_error(format!("{} has no `{}`", self.what, self.key_path(key))))
    }

    /// The section `key` (a mapping or a `kvtier.<class>`); `None` when absent or None.
    pub fn section(&self, key: Key, class: &'static str) -> PyResult<Option<Section<'py>>> {
        self.any(key)?.map(|v| Section::of(v, self.what, self.key_path(key), class)).transpose()
    }
}

/// For each `key` the section `s` holds (not None), sets `c.key` to its value, of the field's
/// type: the Rust field and the Python key have one name.
macro_rules! set_present {
    ($s:expr, $c:ident { $($key:ident),+ $(,)? }) => {
        $(
            if let Some(v) = $s.get(stringify!($key))? {
                $c.$key = v;
            }
        )+
    };
}

/// `lease_ttl_s` as a `Duration`, within the bounds the store enforces: more than 0 once rounded
/// to nanoseconds, at most [`LEASE_TTL_MAX`]. NaN, infinities and values past `u64` seconds are
/// errors here, not panics.
fn lease_ttl(lease_ttl_s: f64) -> PyResult<Duration> {
    match Duration::try_from_secs_f64(lease_ttl_s) {
        Ok(ttl) if !ttl.is_zero() && ttl <= LEASE_TTL_MAX => Ok(ttl),
        _ => Err(config_error(format!(
            "lease_ttl_s is {lease_ttl_s}; expected a positive number of seconds (at least 1 ns \
             once rounded to nanoseconds) and at most {} ({} days)",
            LEASE_TTL_MAX.as_secs(),
            LEASE_TTL_MAX.as_secs() / 86_400
        ))),
    }
}

/// The `key` of `s` in seconds as a `Duration` (NaN, negative and huge values are errors).
fn seconds(s: &Section<'_>, key: Key) -> PyResult<Option<Duration>> {
    let Some(v) = s.get::<f64>(key)? else { return Ok(None) };
    Duration::try_from_secs_f64(v).map(Some).map_err(|_| {
        config_error(format!("`{}` is {v}; expected a non-negative number of seconds", s.key_path(key)))
    })
}

/// The `codec`, `codec_backend` and `codec_level` keys of a lower tier's section (absent: raw).
fn tier_codec(s: &Section<'_>) -> PyResult<TierCodec> {
    let name: String = s.get("codec")?.unwrap_or_else(|| "raw".to_string());
    let backend: Option<String> = s.get("codec_backend")?;
    TierCodec::parse(&s.path, &name, backend.as_deref(), s.get("codec_level")?).map_err(raise)
}

/// The name `key` of `s` parsed by `parse` (an SSD pool setting such as `durability`).
fn parsed<T>(s: &Section<'_>, key: Key, parse: fn(&str) -> Result<T, PoolError>) -> PyResult<Option<T>> {
    let name: Option<String> = s.get(key)?;
    name.map(|v| parse(&v).map_err(raise)).transpose()
}

/// An SSD pool's config (`kvtier.SsdConfig`'s keys, and the pool-only `throttle_bytes_per_s`,
/// `min_object_bytes` and `compact_min_records`).
pub fn ssd_pool_config(s: &Section<'_>) -> PyResult<SsdConfig> {
    let mut c = SsdConfig::new(s.required::<String>("directory")?);
    if let Some(devices) = s.get::<Vec<String>>("devices")? {
        c.devices = devices.into_iter().map(PathBuf::from).collect();
    }
    c.durability = parsed(s, "durability", Durability::parse)?.unwrap_or(c.durability);
    c.placement = parsed(s, "placement", Placement::parse)?.unwrap_or(c.placement);
    c.io_engine = parsed(s, "io_engine", IoEngineKind::parse)?.unwrap_or(c.io_engine);
    c.bandwidth_bytes_per_s = s.get("bandwidth_bytes_per_s")?;
    c.throttle_bytes_per_s = s.get("throttle_bytes_per_s")?;
    set_present!(s, c { capacity_bytes, io_depth, probe_bytes, direct_io, format_devices });
    set_present!(s, c { min_object_bytes, compact_min_records });
    Ok(c)
}

/// A remote client's config (`kvtier.RemoteConfig`'s keys).
pub fn remote_client_config(s: &Section<'_>) -> PyResult<RemoteConfig> {
    let mut c = RemoteConfig::default();
    set_present!(s, c { urls, cluster, inflight_bytes_max, connections_per_node_max, key_prefix });
    c.username = s.get("username")?;
    c.password = s.get("password")?;
    c.ttl = seconds(s, "ttl_s")?;
    for (key, field) in [
        ("connect_timeout_s", &mut c.connect_timeout),
        ("io_timeout_s", &mut c.io_timeout),
        ("reconnect_backoff_min_s", &mut c.reconnect_backoff_min),
        ("reconnect_backoff_max_s", &mut c.reconnect_backoff_max),
    ] {
        *field = seconds(s, key)?.unwrap_or(*field);
    }
    let tls = TlsConfig {
        ca_file: s.get("tls_ca_file")?,
        cert_file: s.get("tls_cert_file")?,
        key_file: s.get("tls_key_file")?,
        server_name: s.get("tls_server_name")?,
    };
    c.tls = (tls != TlsConfig::default()).then_some(tls);
    Ok(c)
}

/// The namespace and the store config of `kvtier.StoreConfig` (or a mapping of its keys, with
/// `geometry` a `kvtier.Geometry` or its handle); the geometry and namespace keys are required.
pub fn store_config(config: &Bound<'_, PyAny>) -> PyResult<(Namespace, StoreConfig)> {
    let s = Section::root(config, "store config", "", "StoreConfig")?;
    let g: Bound<'_, PyAny> = s.required("geometry")?;
    let g = if g.is_instance_of::<CoreGeometry>() { g } else { g.getattr_opt("_handle")?.unwrap_or(g) };
    let geometry = g.downcast::<CoreGeometry>().map_err(|e| config_error(format!("`geometry`: {e}")))?;
    let namespace = Namespace {
        model_id: s.required("model_id")?,
        geometry: geometry.get().inner.clone(),
        layout_version: s.required("layout_version")?,
        cache_salt: s.required("cache_salt")?,
        rank: s.required("rank")?,
    };
    let mut c = StoreConfig::default();
    set_present!(s, c { eviction, copy_threads, leases_max });
    if let Some(v) = s.get("lease_ttl_s")? {
        c.lease_ttl = lease_ttl(v)?;
    }
    if let Some(dram) = s.section("dram", "DramConfig")? {
        let d = &mut c.dram;
        set_present!(dram, d { capacity_bytes, prefault });
        dram.finish()?;
    }
    if let Some(ssd) = s.section("ssd", "SsdConfig")? {
        let mut t = SsdStoreConfig::new(ssd_pool_config(&ssd)?);
        set_present!(ssd, t { admission_k, write_through, promote_on_hit });
        t.codec = tier_codec(&ssd)?;
        ssd.finish()?;
        c.ssd = Some(t);
    }
    if let Some(remote) = s.section("remote", "RemoteConfig")? {
        let mut t = RemoteStoreConfig::new(remote_client_config(&remote)?);
        set_present!(remote, t { write_through, promote_on_hit });
        t.codec = tier_codec(&remote)?;
        remote.finish()?;
        c.remote = Some(t);
    }
    s.finish()?;
    Ok((namespace, c))
}

/// A transfer engine's config (`kvtier.TransferConfig`'s keys; one left out takes the Rust
/// default).
pub fn transfer_config(config: &Bound<'_, PyAny>) -> PyResult<TransferConfig> {
    let s = Section::root(config, "transfer config", "", "TransferConfig")?;
    let mut c = TransferConfig::default();
    set_present!(
        s,
        c {
            chunk_blocks,
            buffer_chunks,
            store_workers,
            jobs_in_flight_max,
            inflight_bytes_max,
            job_blocks_max,
            allocate_per_chunk,
        }
    );
    if let Some(workers) = s.get("stage_workers")? {
        c.stage_workers = StageWorkers::from_array(workers);
    }
    s.finish()?;
    Ok(c)
}
