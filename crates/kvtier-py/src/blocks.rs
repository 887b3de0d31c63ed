//! Caller buffers of whole blocks (one contiguous buffer, or one buffer per block) split into
//! block slices after their sizes are checked: shared by the store, the SSD pool and the remote
//! pool bindings.

use pyo3::prelude::*;
use pyo3::types::{PyList, PyTuple};

use crate::buffer::{ensure_all_disjoint, Buffer, Format};
use crate::errors::buffer_error;

/// Caller buffers holding `count` blocks of `block_bytes`, sizes checked: one contiguous buffer,
/// or a list or tuple of one buffer per block; `writable` ones are checked pairwise disjoint too
/// (as [`write_blocks`] needs). (Other sequences are not taken apart here: a numpy array is a
/// sequence too. The Python wrapper turns any sequence of blocks into a list.)
fn block_buffers(
    obj: &Bound<'_, PyAny>,
    what: &'static str,
    writable: bool,
    count: usize,
    block_bytes: usize,
) -> PyResult<Vec<Buffer>> {
    let items: Vec<Bound<'_, PyAny>> = match (obj.downcast::<PyList>(), obj.downcast::<PyTuple>()) {
        (Ok(list), _) => list.iter().collect(),
        (_, Ok(tuple)) => tuple.iter().collect(),
        _ => vec![obj.clone()],
    };
    let bufs: Vec<Buffer> =
        items.iter().map(|i| Buffer::get(i, what, writable, Format::Bytes)).collect::<PyResult<_>>()?;
    if writable {
        ensure_all_disjoint(&bufs)?;
    }
    if block_bytes == 0 && count > 0 {
        return Err(buffer_error(format!(
            "{what}: blocks of 0 bytes for {count} keys; expected at least 1 byte per block"
        )));
    }
    let total: usize = bufs.iter().map(Buffer::len).sum();
    if count.checked_mul(block_bytes).is_none() {
        return Err(buffer_error(format!(
            "{what}: {count} blocks of {block_bytes} bytes overflow the address space"
        )));
    }
    let per_block_ok =
        bufs.len() == 1 || (bufs.len() == count && bufs.iter().all(|b| b.len() == block_bytes));
    if total != count * block_bytes || !per_block_ok {
        return Err(buffer_error(format!(
            "{what} holds {total} bytes in {} buffer(s); expected {count} blocks of {block_bytes} bytes",
            bufs.len()
        )));
    }
    Ok(bufs)
}

/// Runs `f` over `count` read-only blocks of `block_bytes` from `obj` ([`block_buffers`], sizes
/// checked); the buffers are held until it returns.
pub(crate) fn read_blocks<R>(
    obj: &Bound<'_, PyAny>,
    what: &'static str,
    count: usize,
    block_bytes: usize,
    f: impl FnOnce(&[&[u8]]) -> R,
) -> PyResult<R> {
    let bufs = block_buffers(obj, what, false, count, block_bytes)?;
    let blocks: Vec<&[u8]> = bufs
        .iter()
        .filter(|b| b.len() > 0)
        // SAFETY: the buffers are live until `f` returns, and kvtier only reads them.
        .flat_map(|b| unsafe { b.as_slice() }.chunks_exact(block_bytes))
        .collect();
    Ok(f(&blocks))
}

/// Runs `f` over `count` writable blocks of `block_bytes` from `obj` ([`block_buffers`]: sizes
/// checked, writable, pairwise disjoint); the buffers are held until it returns.
pub(crate) fn write_blocks<R>(
    obj: &Bound<'_, PyAny>,
    what: &'static str,
    count: usize,
    block_bytes: usize,
    f: impl FnOnce(&mut [&mut [u8]]) -> R,
) -> PyResult<R> {
    let bufs = block_buffers(obj, what, true, count, block_bytes)?;
    let mut blocks: Vec<&mut [u8]> = bufs
        .iter()
        .filter(|b| b.len() > 0)
        // SAFETY: writable buffers, live until `f` returns, pairwise disjoint (checked by
        // `block_buffers`): these slices are their only views.
        .flat_map(|b| unsafe { b.as_mut_slice() }.chunks_exact_mut(block_bytes))
        .collect();
    Ok(f(&mut blocks))
}
