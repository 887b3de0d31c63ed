//! `kvtier._core`: the thin PyO3 layer over the Rust data plane.
//!
//! Python never reaches past this module into Rust internals (DESIGN §1). Every function
//! validates its buffers, then releases the GIL for the copy or hash. Errors are raised as the
//! classes of `kvtier.errors`.

mod args;
#[cfg(feature = "bench-baselines")]
mod baselines;
mod blocks;
mod buffer;
mod codec;
mod config;
mod errors;
mod geometry;
mod layout;
mod paged;
mod remote;
mod reports;
mod ssd;
mod store;
mod tokens;
mod transfer;

use pyo3::prelude::*;
use pyo3::types::PyBytes;

use kvtier_core::object::{decode_object as core_decode, encode_object as core_encode, CODEC_RAW};

use crate::args::{Key, NamespaceHash};
use crate::buffer::{ensure_disjoint, Buffer, Format};
use crate::errors::{buffer_error, raise};

/// Keys of every full block of `tokens` (a list or tuple of ints, or a 1-D integer buffer; see
/// `tokens.rs`), as `n * 16` bytes.
#[pyfunction]
fn block_keys<'py>(
    py: Python<'py>,
    namespace_hash: NamespaceHash,
    tokens: &Bound<'py, PyAny>,
    block_tokens: u32,
    extra: &[u8],
) -> PyResult<Bound<'py, PyBytes>> {
    let ids = tokens::token_ids(tokens)?;
    let keys = py
        .allow_threads(|| kvtier_core::block_keys(namespace_hash.0, &ids, block_tokens, extra))
        .map_err(raise)?;
    let raw: Vec<u8> = keys.iter().flat_map(|k| k.to_le_bytes()).collect();
    Ok(PyBytes::new(py, &raw))
}

/// Header + payload bytes of one object (raw codec).
#[pyfunction]
fn encode_object<'py>(
    py: Python<'py>,
    namespace_hash: NamespaceHash,
    key: Key,
    payload: &Bound<'py, PyAny>,
) -> PyResult<Bound<'py, PyBytes>> {
    let buf = Buffer::get(payload, "payload", false, Format::Bytes)?;
    // SAFETY: read-only view of a live buffer.
    let bytes = core_encode(namespace_hash.0, key.0, CODEC_RAW, unsafe { buf.as_slice() });
    Ok(PyBytes::new(py, &bytes))
}

/// Verifies an object and returns (namespace hash, key, codec id, payload).
#[pyfunction]
#[allow(clippy::type_complexity)]
fn decode_object<'py>(
    py: Python<'py>,
    data: &Bound<'py, PyAny>,
) -> PyResult<(Bound<'py, PyBytes>, Bound<'py, PyBytes>, u16, Bound<'py, PyBytes>)> {
    let buf = Buffer::get(data, "data", false, Format::Bytes)?;
    // SAFETY: read-only view of a live buffer.
    let (header, payload) = core_decode(unsafe { buf.as_slice() }).map_err(raise)?;
    Ok((
        PyBytes::new(py, &header.namespace.to_le_bytes()),
        PyBytes::new(py, &header.key.to_le_bytes()),
        header.codec_id,
        PyBytes::new(py, payload),
    ))
}

/// One contiguous single-threaded memcpy of `src` into `dst`: the limit benchmarks compare to.
#[pyfunction]
fn memcpy(py: Python<'_>, dst: &Bound<'_, PyAny>, src: &Bound<'_, PyAny>) -> PyResult<()> {
    let d = Buffer::get(dst, "dst", true, Format::Bytes)?;
    let s = Buffer::get(src, "src", false, Format::Bytes)?;
    ensure_disjoint(&d, &s)?;
    if d.len() != s.len() {
        return Err(buffer_error(format!(
            "dst has {} bytes; expected {} (the size of src)",
            d.len(),
            s.len()
        )));
    }
    // SAFETY: disjoint live buffers of equal length; dst acquired writable.
    py.allow_threads(|| unsafe { d.as_mut_slice().copy_from_slice(s.as_slice()) });
    Ok(())
}

/// XXH3-64 checksum of a buffer (the object payload checksum).
#[pyfunction]
fn checksum(py: Python<'_>, data: &Bound<'_, PyAny>) -> PyResult<u64> {
    let b = Buffer::get(data, "data", false, Format::Bytes)?;
    // SAFETY: read-only view of a live buffer.
    Ok(py.allow_threads(|| kvtier_core::checksum::checksum(unsafe { b.as_slice() })))
}

/// The module: its classes and functions, and the constants `init` adds.
#[pymodule]
mod _core {
    #[cfg(feature = "bench-baselines")]
    #[pymodule_export]
    use crate::baselines::{ssd_file_per_object, ssd_raw_sequential};
    #[pymodule_export]
    use crate::codec::{codec_decode, codec_decoded_len, codec_encode_lossless, codec_encode_quant};
    #[pymodule_export]
    use crate::geometry::CoreGeometry;
    #[pymodule_export]
    use crate::layout::Copier;
    #[pymodule_export]
    use crate::paged::LayerProgress;
    #[pymodule_export]
    use crate::remote::{check_url, redact_url, RemotePool};
    #[pymodule_export]
    use crate::reports::{StoreStats, TierStats};
    #[pymodule_export]
    use crate::ssd::{ssd_placement_counts, SsdPool};
    #[pymodule_export]
    use crate::store::Store;
    #[pymodule_export]
    use crate::transfer::{balanced_stage_workers, cuda_link_duplex, DuplexEngine, TransferEngine};
    #[pymodule_export]
    use crate::{block_keys, checksum, decode_object, encode_object, memcpy};

    use kvtier_core::tier::TierKind;
    use pyo3::prelude::*;

    #[pymodule_init]
    fn init(m: &Bound<'_, PyModule>) -> PyResult<()> {
        m.add("__version__", env!("CARGO_PKG_VERSION"))?;
        // The store's tier names, fastest first (`Lookup.tiers`, `tier_stats()`): kvtier.tiers maps them.
        m.add("STORE_TIERS", [TierKind::Dram, TierKind::Ssd, TierKind::Remote].map(|k| k.name()))
    }
}
