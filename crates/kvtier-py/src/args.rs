//! Arguments checked and converted as pyo3 extracts them, before a method body runs: ids and keys
//! as little-endian bytes, block ids as a uint64 buffer. A bad one raises `BufferError` naming
//! the argument (a value that is not `bytes` at all stays pyo3's `TypeError` naming it).

use pyo3::prelude::*;
use pyo3::types::PyBytes;

use crate::buffer::{Buffer, Format};
use crate::errors::buffer_error;

/// Declares each `Name(T)` argument type, extracted by its closure.
macro_rules! args {
    ($($(#[$doc:meta])* $name:ident($ty:ty) = |$ob:ident| $body:expr;)+) => {$(
        $(#[$doc])*
        pub(crate) struct $name(pub $ty);

        impl<'py> FromPyObject<'py> for $name {
            fn extract_bound($ob: &Bound<'py, PyAny>) -> PyResult<Self> {
                $body.map($name)
            }
        }
    )+};
}

args! {
    /// A `namespace_hash`: 16 little-endian bytes.
    NamespaceHash(u128) = |ob| u128_from(bytes(ob)?, "namespace_hash");
    /// A block `key`: 16 little-endian bytes.
    Key(u128) = |ob| u128_from(bytes(ob)?, "key");
    /// Block `keys`: 16 little-endian bytes each.
    Keys(Vec<u128>) = |ob| items(bytes(ob)?, "keys", "a multiple of 16", u128::from_le_bytes);
    /// A transfer job's `block_ids`: little-endian int64 bytes; a negative id becomes out of range
    /// (reported per block).
    JobBlockIds(Vec<u64>) = |ob| items(bytes(ob)?, "block_ids", "int64 values", |b| {
        u64::try_from(i64::from_le_bytes(b)).unwrap_or(u64::MAX)
    });
    /// `block_ids` as a uint64 buffer, copied out while the GIL is held. A copy, not a view: the
    /// ids may live in the very buffer a copy writes (a view of the pool or of `out`), and reading
    /// them while workers write there would be a data race. They are few (8 bytes per block).
    BlockIds(Vec<u64>) = |ob| u64_buffer(ob);
}

fn bytes<'a>(ob: &'a Bound<'_, PyAny>) -> PyResult<&'a [u8]> {
    Ok(ob.downcast::<PyBytes>()?.as_bytes())
}

/// A 16-byte little-endian id (a namespace hash, a key) from a caller's bytes.
fn u128_from(bytes: &[u8], what: &str) -> PyResult<u128> {
    let arr: [u8; 16] = bytes
        .try_into()
        .map_err(|_| buffer_error(format!("{what} has {} bytes; expected 16", bytes.len())))?;
    Ok(u128::from_le_bytes(arr))
}

/// `raw` as `N`-byte items, each converted by `f`; an error names them (`what`) and what was
/// `expected` unless `raw` is a whole number of items.
fn items<const N: usize, T>(
    raw: &[u8],
    what: &str,
    expected: &str,
    f: impl Fn([u8; N]) -> T,
) -> PyResult<Vec<T>> {
    if !raw.len().is_multiple_of(N) {
        return Err(buffer_error(format!("{what} have {} bytes; expected {expected}", raw.len())));
    }
    Ok(raw.chunks_exact(N).map(|c| f(c.try_into().expect("N bytes"))).collect())
}

fn u64_buffer(block_ids: &Bound<'_, PyAny>) -> PyResult<Vec<u64>> {
    let buf = Buffer::get(block_ids, "block_ids", false, Format::U64)?;
    buf.ensure_1d()?;
    if !buf.len().is_multiple_of(8) || !(buf.ptr() as usize).is_multiple_of(8) {
        return Err(buffer_error(format!(
            "block_ids buffer has {} bytes; expected aligned uint64 ids",
            buf.len()
        )));
    }
    // SAFETY: aligned, a multiple of 8 bytes, alive while `buf` is; read with the GIL held and
    // before any copy starts, so no kvtier thread writes it meanwhile.
    Ok(unsafe { std::slice::from_raw_parts(buf.ptr().cast::<u64>(), buf.len() / 8) }.to_vec())
}
