//! `kvtier-codec` for Python (`kvtier.codec` wraps these). Encode/decode release the GIL, so
//! Python threads run codecs on all cores. Errors raise `kvtier.codec.CodecError` (a
//! `KvtierError`), or its subclass `NonFiniteError` for NaN/inf given to `quant`.

use pyo3::prelude::*;
use pyo3::types::PyBytes;

use kvtier_codec::lossless::LosslessCodec;
use kvtier_codec::quant::{QuantCodec, QuantConfig};
use kvtier_codec::streams::{Backend, Stage};
use kvtier_codec::{Codec, CodecError};

use crate::buffer::{ensure_disjoint, Buffer, Format};
use crate::errors::raise;

fn stage(backend: &str, level: Option<i8>) -> PyResult<Stage> {
    let backend = Backend::from_name(backend).ok_or_else(|| {
        raise(CodecError::InvalidParam { what: "backend name (none, zstd, lz4, deflate)", value: 0 })
    })?;
    Stage::new(backend, level.unwrap_or(backend.default_level())).map_err(raise)
}

fn encode_with<'py>(
    py: Python<'py>,
    codec: &dyn Codec,
    data: &Bound<'py, PyAny>,
    format: Format,
) -> PyResult<Bound<'py, PyBytes>> {
    let buf = Buffer::get(data, "data", false, format)?;
    let mut out = vec![0u8; codec.max_encoded_len(buf.len())];
    // SAFETY: read-only view of a live buffer; `out` is ours.
    let n = py.allow_threads(|| codec.encode(unsafe { buf.as_slice() }, &mut out)).map_err(raise)?;
    Ok(PyBytes::new(py, &out[..n]))
}

/// `lossless` payload of `data`: byte planes of `element_bytes`-byte values, then `backend`.
#[pyfunction]
#[pyo3(signature = (data, backend, level=None, element_bytes=2))]
pub fn codec_encode_lossless<'py>(
    py: Python<'py>,
    data: &Bound<'py, PyAny>,
    backend: &str,
    level: Option<i8>,
    element_bytes: u8,
) -> PyResult<Bound<'py, PyBytes>> {
    let stage = stage(backend, level)?;
    let codec =
        LosslessCodec::with_element_bytes(stage.backend, stage.level, element_bytes).map_err(raise)?;
    encode_with(py, &codec, data, Format::Bytes)
}

/// `quant` payload of an fp16 `BlockFirst` chunk of `len(key_bins)` layers.
#[pyfunction]
#[pyo3(signature = (data, first_layer, block_tokens, num_kv_heads, head_dim, key_bins, value_bins, backend, level=None))]
#[allow(clippy::too_many_arguments)]
pub fn codec_encode_quant<'py>(
    py: Python<'py>,
    data: &Bound<'py, PyAny>,
    first_layer: u16,
    block_tokens: u32,
    num_kv_heads: u16,
    head_dim: u16,
    key_bins: Vec<u8>,
    value_bins: Vec<u8>,
    backend: &str,
    level: Option<i8>,
) -> PyResult<Bound<'py, PyBytes>> {
    let num_layers = u16::try_from(key_bins.len()).map_err(|_| {
        raise(CodecError::InvalidParam { what: "number of layers", value: key_bins.len() as u64 })
    })?;
    let config = QuantConfig {
        first_layer,
        num_layers,
        block_tokens,
        num_kv_heads,
        head_dim,
        key_bins,
        value_bins,
        stage: stage(backend, level)?,
    };
    let codec = QuantCodec::new(config).map_err(raise)?;
    encode_with(py, &codec, data, Format::Fp16)
}

/// Decoded size of a payload of codec `codec_id`.
#[pyfunction]
pub fn codec_decoded_len(codec_id: u16, payload: &Bound<'_, PyAny>) -> PyResult<usize> {
    let buf = Buffer::get(payload, "payload", false, Format::Bytes)?;
    // SAFETY: read-only view of a live buffer.
    kvtier_codec::decoded_len(codec_id, unsafe { buf.as_slice() }).map_err(raise)
}

/// Decodes a payload of codec `codec_id` into the writable buffer `out`; returns bytes written.
#[pyfunction]
pub fn codec_decode(
    py: Python<'_>,
    codec_id: u16,
    payload: &Bound<'_, PyAny>,
    out: &Bound<'_, PyAny>,
) -> PyResult<usize> {
    let src = Buffer::get(payload, "payload", false, Format::Bytes)?;
    let dst = Buffer::get(out, "out", true, Format::Bytes)?;
    ensure_disjoint(&dst, &src)?;
    // SAFETY: disjoint live buffers; `out` acquired writable.
    py.allow_threads(|| {
        kvtier_codec::decode(codec_id, unsafe { src.as_slice() }, unsafe { dst.as_mut_slice() })
    })
    .map_err(raise)
}
