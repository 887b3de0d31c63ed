//! The baselines `kvtier bench ssd|remote` measure kvtier against (built with the
//! `bench-baselines` feature, on by default for the extension): a raw sequential O_DIRECT loop
//! and the file-per-object backend of `kvtier_pool::ssd::baseline`, and plain GET/SET/DEL of
//! values through the remote tier's raw client. Every buffer is checked (bytes, sizes,
//! writability, disjointness); the GIL is released while they run.

use std::path::PathBuf;

use pyo3::prelude::*;

use kvtier_pool::ssd::baseline;
use kvtier_remote::pipeline::{GetItem, HeaderSpec, Res, SetItem};
use kvtier_remote::RemoteTier;

use crate::blocks::{read_blocks, write_blocks};
use crate::buffer::{Buffer, Format};
use crate::errors::kvtier_error;

/// Seconds of a raw sequential O_DIRECT loop over `path` (see `kvtier_pool::ssd::baseline`).
#[pyfunction]
pub fn ssd_raw_sequential(
    py: Python<'_>,
    path: PathBuf,
    total_bytes: u64,
    chunk_bytes: usize,
    write: bool,
    depth: usize,
    buffer_bytes: usize,
) -> PyResult<f64> {
    py.allow_threads(|| baseline::raw_sequential(&path, total_bytes, chunk_bytes, write, depth, buffer_bytes))
        .map_err(|e| kvtier_error("StoreError", format!("raw device loop on {}: {e}", path.display())))
}

/// Seconds of one pass of the file-per-object backend in `directory`: `write` writes `count`
/// files of `buffer` (one object), then syncfs; otherwise reads the `count` files back (cold:
/// their cached pages dropped first) into `buffer` (checked writable).
#[pyfunction]
pub fn ssd_file_per_object(
    py: Python<'_>,
    directory: PathBuf,
    count: usize,
    buffer: &Bound<'_, PyAny>,
    write: bool,
) -> PyResult<f64> {
    let buf = Buffer::get(buffer, if write { "object" } else { "out" }, !write, Format::Bytes)?;
    let result = if write {
        // SAFETY: read-only view of a live buffer.
        let bytes = unsafe { buf.as_slice() };
        py.allow_threads(|| baseline::file_per_object_write(&directory, count, bytes))
    } else {
        // SAFETY: writable, live buffer; this is its only view.
        let bytes = unsafe { buf.as_mut_slice() };
        py.allow_threads(|| baseline::file_per_object_read(&directory, count, bytes))
    };
    let what = if write { "write" } else { "read" };
    result.map_err(|e| {
        kvtier_error("StoreError", format!("file-per-object {what} in {}: {e}", directory.display()))
    })
}

/// `names` as the byte slices the client takes.
fn name_refs(names: &[Vec<u8>]) -> Vec<&[u8]> {
    names.iter().map(|n| &n[..]).collect()
}

fn res_name(r: Res) -> &'static str {
    match r {
        Res::Failed => "failed",
        Res::Bool(true) => "ok",
        Res::Bool(false) => "no",
        Res::Filled => "loaded",
        Res::Nil => "missing",
        Res::WrongLength => "wrong_length",
        Res::Redirect => "redirect",
        Res::WrongType => "wrong_type",
        Res::ServerError => "server_error",
    }
}

/// `RemotePool.raw_set`: plain `SET name value` of each value of `value_bytes` (checked buffers).
pub fn raw_set(
    py: Python<'_>,
    tier: &RemoteTier,
    names: &[Vec<u8>],
    values: &Bound<'_, PyAny>,
    value_bytes: usize,
) -> PyResult<Vec<&'static str>> {
    let r = read_blocks(values, "values", names.len(), value_bytes, |values| {
        let items: Vec<SetItem<'_>> =
            values.iter().map(|v| SetItem { header: HeaderSpec::None, payload: v }).collect();
        py.allow_threads(|| tier.client().set(&name_refs(names), &items, false))
    })?;
    Ok(r.into_iter().map(res_name).collect())
}

/// `RemotePool.raw_get`: plain `GET name` of each name into `out` (values of exactly
/// `value_bytes`; writable, pairwise-disjoint buffers), no object checks.
pub fn raw_get(
    py: Python<'_>,
    tier: &RemoteTier,
    names: &[Vec<u8>],
    out: &Bound<'_, PyAny>,
    value_bytes: usize,
) -> PyResult<Vec<&'static str>> {
    let r = write_blocks(out, "out", names.len(), value_bytes, |dst| {
        let items: Vec<GetItem<'_>> =
            dst.iter_mut().map(|d| GetItem { with_header: false, header: [0u8; 64], dst: d }).collect();
        py.allow_threads(|| tier.client().get(&name_refs(names), items).0)
    })?;
    Ok(r.into_iter().map(res_name).collect())
}

/// `RemotePool.raw_del`: plain `DEL name` of each name; returns how many existed.
pub fn raw_del(py: Python<'_>, tier: &RemoteTier, names: &[Vec<u8>]) -> usize {
    let names = name_refs(names);
    let r = py.allow_threads(|| tier.client().del(&names));
    r.into_iter().filter(|r| *r == Res::Bool(true)).count()
}
