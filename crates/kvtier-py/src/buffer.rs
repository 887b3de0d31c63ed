//! Zero-copy access to caller buffers (numpy arrays, bytearray, memoryview) through the Python
//! buffer protocol, which is part of the stable ABI since 3.11.
//!
//! A [`Buffer`] holds a `Py_buffer` for as long as it lives, so the exporter cannot free or
//! resize the memory while kvtier copies into it with the GIL released. Only C-contiguous
//! buffers are accepted; writable ones when kvtier writes.

use std::mem::MaybeUninit;

use pyo3::ffi;
use pyo3::prelude::*;

use crate::errors::buffer_error;

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
    /// Acquires `obj`'s buffer. `what` names the argument in error messages.
    pub fn get(obj: &Bound<'_, PyAny>, what: &'static str, writable: bool) -> PyResult<Buffer> {
        let mut flags = ffi::PyBUF_C_CONTIGUOUS;
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
        Ok(Buffer { view, what })
    }

    pub fn len(&self) -> usize {
        self.view.len as usize
    }

    pub fn ptr(&self) -> *mut u8 {
        self.view.buf.cast::<u8>()
    }

    /// Byte range covered, to detect aliasing between source and destination.
    pub fn range(&self) -> std::ops::Range<usize> {
        let start = self.view.buf as usize;
        start..start + self.len()
    }

    pub fn what(&self) -> &'static str {
        self.what
    }

    /// The bytes, read-only.
    ///
    /// # Safety
    /// Nobody may write this memory while the slice is alive (callers check non-aliasing).
    pub unsafe fn as_slice(&self) -> &[u8] {
        if self.len() == 0 {
            return &[];
        }
        std::slice::from_raw_parts(self.ptr(), self.len())
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
        std::slice::from_raw_parts_mut(self.ptr(), self.len())
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
    let (ra, rb) = (a.range(), b.range());
    if a.len() > 0 && b.len() > 0 && ra.start < rb.end && rb.start < ra.end {
        return Err(buffer_error(format!(
            "{} and {} share memory; expected separate buffers",
            a.what(),
            b.what()
        )));
    }
    Ok(())
}
