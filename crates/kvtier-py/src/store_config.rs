//! The store's configuration crossing from Python as one nested mapping
//! (`kvtier.StoreConfig.core_config()`): the geometry and namespace keys, the store-wide keys,
//! then the `dram`, `ssd` and `remote` sections, parsed into the [`Namespace`] and
//! kvtier-store's [`StoreConfig`] (whose `validate` checks every bound again). A missing or
//! mistyped key is a `ConfigError` naming its path (`dram.capacity_bytes`).

use std::time::Duration;

use pyo3::prelude::*;
use pyo3::types::PyDict;

use kvtier_core::Namespace;
use kvtier_store::config::LEASE_TTL_MAX;
use kvtier_store::{StoreConfig, StoreError, TierCodec};

use crate::errors::{config_error, item, set_present};
use crate::geometry::CoreGeometry;
use crate::remote::store_remote_config;
use crate::ssd::store_ssd_config;

fn required<'py, T: FromPyObject<'py>>(d: &Bound<'py, PyDict>, key: &str) -> PyResult<T> {
    item(d, key, key)?.ok_or_else(|| config_error(format!("store config has no `{key}`")))
}

/// The section `key` (a mapping), or `None` when absent or None.
fn section<'py>(d: &Bound<'py, PyDict>, key: &str) -> PyResult<Option<Bound<'py, PyDict>>> {
    match d.get_item(key)? {
        Some(v) if !v.is_none() => v.downcast_into::<PyDict>().map(Some).map_err(|e| {
            config_error(format!("`{key}` is {}; expected a mapping", e.into_inner().get_type()))
        }),
        _ => Ok(None),
    }
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

/// The `codec`, `codec_backend` and `codec_level` keys of a tier's section (absent: raw).
fn tier_codec(d: &Bound<'_, PyDict>, tier: &str) -> PyResult<TierCodec> {
    let path = |key: &str| format!("{tier}.{key}");
    let name: String = item(d, "codec", &path("codec"))?.unwrap_or_else(|| "raw".to_string());
    let backend: Option<String> = item(d, "codec_backend", &path("codec_backend"))?;
    let level: Option<i64> = item(d, "codec_level", &path("codec_level"))?;
    TierCodec::parse(tier, &name, backend.as_deref(), level)
        .map_err(|e: StoreError| config_error(e.to_string()))
}

/// The namespace and the store config of the mapping; keys the mapping leaves out take the
/// Rust defaults, except the geometry and namespace keys, which are required.
pub fn store_config(d: &Bound<'_, PyDict>) -> PyResult<(Namespace, StoreConfig)> {
    let geometry = d
        .get_item("geometry")?
        .ok_or_else(|| config_error("store config has no `geometry`".into()))?
        .downcast::<CoreGeometry>()
        .map_err(|e| config_error(format!("`geometry`: {e}")))?
        .get()
        .inner
        .clone();
    let namespace = Namespace {
        model_id: required(d, "model_id")?,
        geometry,
        layout_version: required(d, "layout_version")?,
        cache_salt: required(d, "cache_salt")?,
        rank: required(d, "rank")?,
    };
    let mut c = StoreConfig::default();
    set_present!(d, "", c { eviction, copy_threads, leases_max });
    if let Some(v) = item(d, "lease_ttl_s", "lease_ttl_s")? {
        c.lease_ttl = lease_ttl(v)?;
    }
    if let Some(dram) = section(d, "dram")? {
        set_present!(&dram, "dram.", c { capacity_bytes => dram_capacity_bytes, prefault => dram_prefault });
    }
    if let Some(s) = section(d, "ssd")? {
        let mut ssd = store_ssd_config(&s)?;
        ssd.codec = tier_codec(&s, "ssd")?;
        c.ssd = Some(ssd);
    }
    if let Some(r) = section(d, "remote")? {
        let mut remote = store_remote_config(&r)?;
        remote.codec = tier_codec(&r, "remote")?;
        c.remote = Some(remote);
    }
    Ok((namespace, c))
}
