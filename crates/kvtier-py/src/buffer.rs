//! Zero-copy access to caller buffers (numpy arrays, bytearray, memoryview) through the Python
//! buffer protocol, which is part of the stable ABI since 3.11.
//!
//! A [`Buffer`] holds a `Py_buffer` for as long as it lives, so the exporter cannot free or
//! resize the memory while kvtier copies into it with the GIL released. Only C-contiguous
//! buffers are accepted; writable ones when kvtier writes.
//!
//! Every buffer is also checked for what its items are ([`Format`]) before a byte is read or
//! written: an array of Python objects (`dtype=object`) holds `PyObject*` slots, and writing KV
//! over them crashes the process, while reading them would store heap addresses as KV. Only
//! plain little-endian numbers are KV bytes; block ids must be their exact type, token ids any
//! integer type (converted and range-checked in `tokens.rs`).

use std::mem::MaybeUninit;

use pyo3::ffi;
use pyo3::prelude::*;

use crate::errors::buffer_error;

/// What the items of a buffer must be.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Format {
    /// KV bytes: any fixed-size plain number (uint8, int8, bool, float16/32/64, (u)int16/32/64),
    /// native byte order. Objects, pointers, strings, structured and big-endian items are refused.
    Bytes,
    /// Block ids: unsigned 64-bit integers.
    U64,
    /// Any fixed-size integer (signed or unsigned, 1 to 8 bytes): token ids converted in Rust.
    Ints,
    /// fp16 KV for the quant codec: float16, or its raw bytes or 16-bit words (int8 ... uint16).
    /// A float32 array of the right byte count would be read as twice as many fp16 values.
    Fp16,
}

impl Format {
    fn expected(self) -> &'static str {
        match self {
            Format::Bytes => "plain numbers (uint8, float16, ...)",
            Format::U64 => "uint64",
            Format::Ints => "integers (int8 ... uint64)",
            Format::Fp16 => "float16 (or its raw bytes as uint8/uint16)",
        }
    }

    /// Whether a buffer whose struct-module format is `code` with items of `itemsize` bytes fits.
    /// A NULL format means unsigned bytes (PEP 3118).
    fn accepts(self, code: Option<&[u8]>, itemsize: usize) -> bool {
        let code = code.unwrap_or(b"B");
        // One optional byte-order prefix; '>' and '!' are big-endian (kvtier runs little-endian only).
        let body = match code.first() {
            Some(b'@' | b'=' | b'<') => &code[1..],
            Some(b'>' | b'!') => return false,
            _ => code,
        };
        let [c] = body else { return false }; // counts, structs, sub-arrays: refused
        match self {
            Format::Bytes => {
                matches!(c, b'b' | b'B' | b'?' | b'c' | b'h' | b'H' | b'i' | b'I' | b'l' | b'L' | b'q' | b'Q')
                    || matches!(c, b'e' | b'f' | b'd')
            }
            Format::U64 => matches!(c, b'L' | b'Q') && itemsize == 8,
            Format::Ints => {
                matches!(c, b'b' | b'B' | b'h' | b'H' | b'i' | b'I' | b'l' | b'L' | b'q' | b'Q')
                    && matches!(itemsize, 1 | 2 | 4 | 8)
            }
            Format::Fp16 => matches!(c, b'e' | b'b' | b'B' | b'c' | b'h' | b'H') && matches!(itemsize, 1 | 2),
        }
    }
}

/// An acquired, C-contiguous Python buffer. Released on drop (the GIL must be held then).
pub struct Buffer {
    view: Box<ffi::Py_buffer>,
    what: &'static str,
}

// SAFETY: the Py_buffer only carries a pointer and sizes; kvtier reads/writes the memory behind
// it from worker threads while the owning Python object is kept alive by the view itself.
unsafe impl Send for Buffer {}
unsafe impl Sync for Buffer {}

impl Buffer {
    /// Acquires `obj`'s buffer and checks its items are `format`. `what` names the argument in
    /// error messages.
    pub fn get(
        obj: &Bound<'_, PyAny>,
        what: &'static str,
        writable: bool,
        format: Format,
    ) -> PyResult<Buffer> {
        let mut flags = ffi::PyBUF_C_CONTIGUOUS | ffi::PyBUF_FORMAT;
        if writable {
            flags |= ffi::PyBUF_WRITABLE;
        }
        let mut view: Box<MaybeUninit<ffi::Py_buffer>> = Box::new(MaybeUninit::uninit());
        // SAFETY: `view` is valid storage for a Py_buffer; on success it is initialised.
        let rc = unsafe { ffi::PyObject_GetBuffer(obj.as_ptr(), view.as_mut_ptr(), flags) };
        if rc != 0 {
            let cause = PyErr::take(obj.py()).map(|e| e.to_string()).unwrap_or_default();
            let need = if writable { "a writable, C-contiguous buffer" } else { "a C-contiguous buffer" };
            let found = obj.get_type().name().map(|n| n.to_string()).unwrap_or_else(|_| "?".into());
            return Err(buffer_error(format!(
                "{what} must be {need} (e.g. a numpy array); got {found}: {cause}"
            )));
        }
        // SAFETY: PyObject_GetBuffer returned 0, so the view is initialised.
        let view = unsafe { Box::from_raw(Box::into_raw(view).cast::<ffi::Py_buffer>()) };
        // From here on `buffer` releases the view on every path, errors included.
        let buffer = Buffer { view, what };
        let code = buffer.format_code();
        if !format.accepts(code.as_deref(), buffer.view.itemsize.max(0) as usize) {
            let shown = code.map(|c| String::from_utf8_lossy(&c).into_owned()).unwrap_or_else(|| "B".into());
            let found = obj.getattr("dtype").map(|d| d.to_string()).unwrap_or(shown);
            return Err(buffer_error(format!(
                "{what} has items of type {found}; expected {}",
                format.expected()
            )));
        }
        Ok(buffer)
    }

    /// The buffer's struct-module format string, if the exporter gave one.
    fn format_code(&self) -> Option<Vec<u8>> {
        if self.view.format.is_null() {
            return None;
        }
        // SAFETY: a non-NULL format is a NUL-terminated string owned by the exporter, valid
        // while the view is held.
        Some(unsafe { std::ffi::CStr::from_ptr(self.view.format) }.to_bytes().to_vec())
    }

    pub fn len(&self) -> usize {
        self.view.len as usize
    }

    /// Errors unless the buffer is one-dimensional: a sequence of ids (token ids, block ids) in a
    /// 2-D array is a batch or a table, and read flat its rows would run into each other.
    pub fn ensure_1d(&self) -> PyResult<()> {
        let ndim = self.view.ndim;
        if ndim == 1 {
            return Ok(());
        }
        let shape: Vec<isize> = match usize::try_from(ndim) {
            // SAFETY: PyBUF_C_CONTIGUOUS asks for strides, hence the shape: `ndim` entries,
            // valid while the view is held (NULL only for ndim 0).
            Ok(n) if n > 0 && !self.view.shape.is_null() => {
                unsafe { std::slice::from_raw_parts(self.view.shape, n) }.to_vec()
            }
            _ => Vec::new(),
        };
        Err(buffer_error(format!("{} have shape {shape:?}; expected a 1-D sequence of ids", self.what)))
    }

    /// Bytes per item, and whether items are signed (by the format code; unsigned bytes when
    /// the exporter gave none).
    pub fn int_items(&self) -> (usize, bool) {
        let code = self.format_code().unwrap_or_else(|| b"B".to_vec());
        let signed = code.last().is_some_and(|c| c.is_ascii_lowercase());
        (self.view.itemsize.max(1) as usize, signed)
    }

    pub fn ptr(&self) -> *mut u8 {
        self.view.buf.cast::<u8>()
    }

    /// The bytes, read-only.
    ///
    /// # Safety
    /// Nobody may write this memory while the slice is alive (callers check non-aliasing).
    pub unsafe fn as_slice(&self) -> &[u8] {
        if self.len() == 0 {
            return &[];
        }
        // SAFETY: the held buffer view keeps `ptr()..ptr() + len()` alive; the caller rules out
        // writers while the slice lives.
        unsafe { std::slice::from_raw_parts(self.ptr(), self.len()) }
    }

    /// The bytes, writable.
    ///
    /// # Safety
    /// The buffer must have been acquired writable and no other slice of it may be alive.
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn as_mut_slice(&self) -> &mut [u8] {
        if self.len() == 0 {
            return &mut [];
        }
        // SAFETY: as `as_slice`; the caller acquired it writable and holds no other slice of it.
        unsafe { std::slice::from_raw_parts_mut(self.ptr(), self.len()) }
    }
}

impl Drop for Buffer {
    fn drop(&mut self) {
        // SAFETY: the view was filled by PyObject_GetBuffer and is released exactly once; Buffer
        // values are only dropped with the GIL held (they never leave a `#[pyfunction]`).
        unsafe { ffi::PyBuffer_Release(&mut *self.view as *mut ffi::Py_buffer) };
    }
}

/// Errors if two buffers overlap (a pool passed as its own objects would corrupt both).
pub fn ensure_disjoint(a: &Buffer, b: &Buffer) -> PyResult<()> {
    if overlap(a, b) {
        let (x, y) = (a.what, b.what);
        return Err(buffer_error(format!("{x} and {y} share memory; expected separate buffers")));
    }
    Ok(())
}

fn overlap(a: &Buffer, b: &Buffer) -> bool {
    let (start_a, start_b) = (a.ptr() as usize, b.ptr() as usize);
    a.len() > 0 && b.len() > 0 && start_a < start_b + b.len() && start_b < start_a + a.len()
}

/// Errors if any two of `bufs` overlap (a writable view must be the only view of its bytes),
/// naming both by position. In address order, so O(n log n) for a load's one buffer per block: a
/// buffer overlaps an earlier one iff it overlaps the one that reaches furthest.
pub fn ensure_all_disjoint(bufs: &[Buffer]) -> PyResult<()> {
    let mut order: Vec<usize> = (0..bufs.len()).filter(|&i| bufs[i].len() > 0).collect();
    order.sort_unstable_by_key(|&i| bufs[i].ptr() as usize);
    let end = |i: usize| bufs[i].ptr() as usize + bufs[i].len();
    let mut furthest: Option<usize> = None;
    for i in order {
        if let Some(f) = furthest.filter(|&f| overlap(&bufs[f], &bufs[i])) {
            let (a, b) = (f.min(i), f.max(i));
            let (x, y) = (bufs[a].what, bufs[b].what);
            return Err(buffer_error(format!("{x} {a} and {y} {b} share memory; expected separate buffers")));
        }
        furthest = furthest.filter(|&f| end(f) >= end(i)).or(Some(i));
    }
    Ok(())
}
