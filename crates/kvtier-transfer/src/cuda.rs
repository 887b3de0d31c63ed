//! The CUDA runtime, loaded when first asked for (docs/transfer.md §6): device memory, pinned
//! host memory, one stream per swap direction, and the copies the duplex engine issues.
//!
//! kvtier links no CUDA library: [`Cuda::load`] opens `libcudart` with `dlopen` (the path in
//! `KVTIER_CUDART`, else the usual names and `/usr/local/cuda/lib64`), so the same build runs on
//! a machine without a GPU and fails there only when a CUDA engine is asked for, with an error
//! naming what is missing. Every runtime call's status is checked; an error carries the call's
//! name and the runtime's own message.

use std::ffi::{c_char, c_int, c_uint, c_void, CStr, CString};
use std::sync::Arc;
use std::time::Instant;

use crate::error::TransferError;

type Status = c_int;
type RawStream = *mut c_void;

/// `cudaMemcpyKind`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(i32)]
pub enum CopyKind {
    HostToDevice = 1,
    DeviceToHost = 2,
}

struct Fns {
    get_error_string: unsafe extern "C" fn(Status) -> *const c_char,
    get_device_count: unsafe extern "C" fn(*mut c_int) -> Status,
    get_device: unsafe extern "C" fn(*mut c_int) -> Status,
    set_device: unsafe extern "C" fn(c_int) -> Status,
    malloc: unsafe extern "C" fn(*mut *mut c_void, usize) -> Status,
    free: unsafe extern "C" fn(*mut c_void) -> Status,
    memset: unsafe extern "C" fn(*mut c_void, c_int, usize) -> Status,
    host_register: unsafe extern "C" fn(*mut c_void, usize, c_uint) -> Status,
    host_unregister: unsafe extern "C" fn(*mut c_void) -> Status,
    stream_create: unsafe extern "C" fn(*mut RawStream, c_uint) -> Status,
    stream_destroy: unsafe extern "C" fn(RawStream) -> Status,
    stream_synchronize: unsafe extern "C" fn(RawStream) -> Status,
    memcpy_async: unsafe extern "C" fn(*mut c_void, *const c_void, usize, c_int, RawStream) -> Status,
    #[allow(clippy::type_complexity)]
    memcpy_2d_async: unsafe extern "C" fn(
        *mut c_void,
        usize,
        *const c_void,
        usize,
        usize,
        usize,
        c_int,
        RawStream,
    ) -> Status,
}

/// The loaded runtime, bound to one device.
pub struct Cuda {
    fns: Fns,
    device: c_int,
    _lib: *mut c_void,
}

// SAFETY: the runtime API is thread-safe; the handle and function pointers never change.
unsafe impl Send for Cuda {}
unsafe impl Sync for Cuda {}

fn device_err(m: String) -> TransferError {
    TransferError::Device(m)
}

fn candidates() -> Vec<String> {
    let mut names: Vec<String> =
        std::env::var("KVTIER_CUDART").into_iter().filter(|p| !p.is_empty()).collect();
    for name in ["libcudart.so", "libcudart.so.13", "libcudart.so.12"] {
        names.push(name.into());
        names.push(format!("/usr/local/cuda/lib64/{name}"));
    }
    names
}

fn open() -> Result<(*mut c_void, String), TransferError> {
    for name in candidates() {
        let c = CString::new(name.clone()).map_err(|e| device_err(format!("KVTIER_CUDART: {e}")))?;
        // SAFETY: `c` is a NUL-terminated, non-empty path; dlopen has no other precondition.
        let lib = unsafe { libc::dlopen(c.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
        if !lib.is_null() {
            return Ok((lib, name));
        }
    }
    Err(device_err(format!(
        "the CUDA runtime (libcudart) was not found; tried {}; set KVTIER_CUDART to its path",
        candidates().join(", ")
    )))
}

/// # Safety
/// `T` must be the C signature of the symbol `name` in the CUDA runtime.
unsafe fn symbol<T: Copy>(lib: *mut c_void, path: &str, name: &str) -> Result<T, TransferError> {
    let c = CString::new(name).expect("symbol names hold no NUL");
    // SAFETY: `lib` is an open handle and `c` a NUL-terminated name.
    let p = unsafe { libc::dlsym(lib, c.as_ptr()) };
    if p.is_null() {
        return Err(device_err(format!("{path} has no symbol {name}: not the CUDA runtime (libcudart)?")));
    }
    // SAFETY: the caller names the symbol's C signature; a function pointer is pointer-sized.
    Ok(unsafe { std::mem::transmute_copy::<*mut c_void, T>(&p) })
}

impl Cuda {
    /// Opens the runtime and checks that device `device` exists.
    pub fn load(device: i32) -> Result<Arc<Cuda>, TransferError> {
        let (lib, path) = open()?;
        // SAFETY: each name is paired with its signature from the CUDA runtime API.
        let fns = unsafe {
            Fns {
                get_error_string: symbol(lib, &path, "cudaGetErrorString")?,
                get_device_count: symbol(lib, &path, "cudaGetDeviceCount")?,
                get_device: symbol(lib, &path, "cudaGetDevice")?,
                set_device: symbol(lib, &path, "cudaSetDevice")?,
                malloc: symbol(lib, &path, "cudaMalloc")?,
                free: symbol(lib, &path, "cudaFree")?,
                memset: symbol(lib, &path, "cudaMemset")?,
                host_register: symbol(lib, &path, "cudaHostRegister")?,
                host_unregister: symbol(lib, &path, "cudaHostUnregister")?,
                stream_create: symbol(lib, &path, "cudaStreamCreateWithFlags")?,
                stream_destroy: symbol(lib, &path, "cudaStreamDestroy")?,
                stream_synchronize: symbol(lib, &path, "cudaStreamSynchronize")?,
                memcpy_async: symbol(lib, &path, "cudaMemcpyAsync")?,
                memcpy_2d_async: symbol(lib, &path, "cudaMemcpy2DAsync")?,
            }
        };
        let cuda = Cuda { fns, device, _lib: lib };
        let mut count: c_int = 0;
        // SAFETY: `count` is a valid out-pointer.
        cuda.check(unsafe { (cuda.fns.get_device_count)(&mut count) }, "cudaGetDeviceCount")?;
        if device < 0 || device >= count {
            return Err(device_err(format!("CUDA device {device} does not exist; this machine has {count}")));
        }
        drop(cuda.current()?);
        Ok(Arc::new(cuda))
    }

    pub fn device(&self) -> i32 {
        self.device
    }

    fn check(&self, status: Status, call: &str) -> Result<(), TransferError> {
        if status == 0 {
            return Ok(());
        }
        // SAFETY: cudaGetErrorString returns a static NUL-terminated string for any status.
        let msg = unsafe { CStr::from_ptr((self.fns.get_error_string)(status)) };
        Err(device_err(format!("{call} failed: {} (error {status})", msg.to_string_lossy())))
    }

    /// Makes this engine's device current on the calling thread for good (the engine's own
    /// worker threads call it once).
    pub fn bind(&self) -> Result<(), TransferError> {
        // SAFETY: plain call with a checked device ordinal.
        self.check(unsafe { (self.fns.set_device)(self.device) }, "cudaSetDevice")
    }

    /// Makes this engine's device current on a caller's thread until the guard drops, which
    /// gives the thread back the device it had (a torch user's current device is not moved).
    pub fn current(&self) -> Result<Current<'_>, TransferError> {
        let mut previous: c_int = 0;
        // SAFETY: `previous` is a valid out-pointer.
        self.check(unsafe { (self.fns.get_device)(&mut previous) }, "cudaGetDevice")?;
        self.bind()?;
        Ok(Current { cuda: self, previous })
    }

    /// `len` bytes of device memory, zeroed (the zeroing finished before this returns).
    pub fn alloc(self: &Arc<Self>, len: usize) -> Result<DeviceBuffer, TransferError> {
        let _on = self.current()?;
        let mut ptr = std::ptr::null_mut();
        // SAFETY: `ptr` is a valid out-pointer.
        self.check(unsafe { (self.fns.malloc)(&mut ptr, len) }, "cudaMalloc")?;
        let buffer = DeviceBuffer { cuda: self.clone(), ptr: ptr.cast(), len };
        // SAFETY: `ptr..ptr + len` was just allocated on this device.
        self.check(unsafe { (self.fns.memset)(ptr, 0, len) }, "cudaMemset")?;
        // cudaMemset may return before it finished, on the legacy stream, which the engine's
        // non-blocking streams do not wait for: wait here, or a first write could be zeroed.
        // SAFETY: the null stream is the legacy default stream.
        self.check(unsafe { (self.fns.stream_synchronize)(std::ptr::null_mut()) }, "cudaStreamSynchronize")?;
        Ok(buffer)
    }

    /// Pins `ptr..ptr + len` (host memory the caller keeps alive longer than the guard).
    ///
    /// # Safety
    /// The range must be valid host memory for the guard's life.
    pub unsafe fn pin(self: &Arc<Self>, ptr: *mut u8, len: usize) -> Result<Pinned, TransferError> {
        let _on = self.current()?;
        // SAFETY: as this function's contract; flags 0 = cudaHostRegisterDefault.
        let status = unsafe { (self.fns.host_register)(ptr.cast(), len, 0) };
        if status == HOST_MEMORY_ALREADY_REGISTERED {
            // Pinned by its owner (a torch pin_memory tensor, another engine): theirs to unpin.
            return Ok(Pinned { cuda: self.clone(), ptr, owned: false });
        }
        self.check(status, "cudaHostRegister")?;
        Ok(Pinned { cuda: self.clone(), ptr, owned: true })
    }

    /// A non-blocking stream (cudaStreamNonBlocking: no implicit sync with the legacy stream).
    pub fn stream(self: &Arc<Self>) -> Result<Stream, TransferError> {
        let _on = self.current()?;
        let mut raw = std::ptr::null_mut();
        // SAFETY: `raw` is a valid out-pointer; flag 1 = cudaStreamNonBlocking.
        self.check(unsafe { (self.fns.stream_create)(&mut raw, 1) }, "cudaStreamCreateWithFlags")?;
        Ok(Stream { cuda: self.clone(), raw })
    }
}

/// `cudaErrorHostMemoryAlreadyRegistered`.
const HOST_MEMORY_ALREADY_REGISTERED: Status = 712;

/// The engine's device, current on this thread while it lives ([`Cuda::current`]).
pub struct Current<'a> {
    cuda: &'a Cuda,
    previous: c_int,
}

impl Drop for Current<'_> {
    fn drop(&mut self) {
        if self.previous != self.cuda.device {
            // SAFETY: plain call with the ordinal the thread had.
            unsafe { (self.cuda.fns.set_device)(self.previous) };
        }
    }
}

/// Device memory, freed on drop.
pub struct DeviceBuffer {
    cuda: Arc<Cuda>,
    ptr: *mut u8,
    len: usize,
}

// SAFETY: a device address and a length; the engine's rules keep concurrent copies disjoint.
unsafe impl Send for DeviceBuffer {}
unsafe impl Sync for DeviceBuffer {}

impl DeviceBuffer {
    pub fn ptr(&self) -> *mut u8 {
        self.ptr
    }
    pub fn len(&self) -> usize {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

impl Drop for DeviceBuffer {
    fn drop(&mut self) {
        // This thread may never have used the device.
        let _on = self.cuda.current();
        // SAFETY: allocated by cudaMalloc; every copy that used it was waited for.
        unsafe { (self.cuda.fns.free)(self.ptr.cast()) };
    }
}

/// Pinned host memory, unpinned on drop (unless it was pinned already by its owner).
pub struct Pinned {
    cuda: Arc<Cuda>,
    ptr: *mut u8,
    owned: bool,
}

// SAFETY: only the address, to unpin it.
unsafe impl Send for Pinned {}
unsafe impl Sync for Pinned {}

impl Drop for Pinned {
    fn drop(&mut self) {
        if self.owned {
            let _on = self.cuda.current(); // a registration belongs to its device
                                           // SAFETY: registered by `Cuda::pin`.
            unsafe { (self.cuda.fns.host_unregister)(self.ptr.cast()) };
        }
    }
}

/// One CUDA stream, destroyed on drop.
pub struct Stream {
    cuda: Arc<Cuda>,
    raw: RawStream,
}

// SAFETY: a stream handle may be used from any thread; each is used by one worker at a time.
unsafe impl Send for Stream {}
unsafe impl Sync for Stream {}

/// A strided copy: `rows` rows of `width` bytes, `src_pitch` apart at the source and
/// `dst_pitch` apart at the destination (`cudaMemcpy2DAsync`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Rows {
    pub dst: *mut u8,
    pub dst_pitch: usize,
    pub src: *const u8,
    pub src_pitch: usize,
    pub width: usize,
    pub rows: usize,
}

impl Stream {
    /// Queues `copy` on this stream.
    ///
    /// # Safety
    /// Both ranges are valid for the copy's rows (device or pinned host as `kind` says) until
    /// [`synchronize`](Self::synchronize) returns, and nothing else writes the destination.
    pub unsafe fn copy_rows(&self, copy: Rows, kind: CopyKind) -> Result<(), TransferError> {
        let f = &self.cuda.fns;
        // SAFETY: as this function's contract.
        let status = unsafe {
            if copy.rows == 1 {
                (f.memcpy_async)(copy.dst.cast(), copy.src.cast(), copy.width, kind as c_int, self.raw)
            } else {
                (f.memcpy_2d_async)(
                    copy.dst.cast(),
                    copy.dst_pitch,
                    copy.src.cast(),
                    copy.src_pitch,
                    copy.width,
                    copy.rows,
                    kind as c_int,
                    self.raw,
                )
            }
        };
        self.cuda.check(status, if copy.rows == 1 { "cudaMemcpyAsync" } else { "cudaMemcpy2DAsync" })
    }

    /// Waits for everything queued on this stream.
    pub fn synchronize(&self) -> Result<(), TransferError> {
        // SAFETY: a live stream.
        self.cuda.check(unsafe { (self.cuda.fns.stream_synchronize)(self.raw) }, "cudaStreamSynchronize")
    }
}

impl Drop for Stream {
    fn drop(&mut self) {
        let _on = self.cuda.current();
        // SAFETY: created by `Cuda::stream`; nothing is queued on it any more.
        unsafe { (self.cuda.fns.stream_destroy)(self.raw) };
    }
}

/// The link's own limits: `bytes` host→device and `bytes` device→host as one plain copy each,
/// alone and both at once on two streams (best of `rounds`). Returns (host→device seconds,
/// device→host seconds, both-at-once seconds).
pub fn link_duplex_seconds(
    cuda: &Arc<Cuda>,
    bytes: usize,
    rounds: usize,
) -> Result<(f64, f64, f64), TransferError> {
    let _on = cuda.current()?;
    let (dev_in, dev_out) = (cuda.alloc(bytes)?, cuda.alloc(bytes)?);
    let mut host_in = vec![1u8; bytes];
    let mut host_out = vec![0u8; bytes];
    // SAFETY: both vectors outlive their guards (dropped at the end of this function, after them).
    let _pins = unsafe { (cuda.pin(host_in.as_mut_ptr(), bytes)?, cuda.pin(host_out.as_mut_ptr(), bytes)?) };
    let (s_in, s_out) = (cuda.stream()?, cuda.stream()?);
    let one = |dst: *mut u8, src: *const u8| Rows {
        dst,
        dst_pitch: bytes,
        src,
        src_pitch: bytes,
        width: bytes,
        rows: 1,
    };
    let h2d = one(dev_in.ptr(), host_in.as_ptr());
    let d2h = one(host_out.as_mut_ptr(), dev_out.ptr());
    // Issues the copies, then waits for both streams even after an error (nothing may still be
    // copying when the buffers are freed). Returns the seconds it took.
    let timed = |copies: &[(&Stream, Rows, CopyKind)]| -> Result<f64, TransferError> {
        let t = Instant::now();
        // SAFETY: device buffers and pinned host vectors live until the end of the function.
        let issued = copies.iter().try_for_each(|&(s, r, k)| unsafe { s.copy_rows(r, k) });
        let synced = s_in.synchronize().and(s_out.synchronize());
        issued.and(synced).map(|()| t.elapsed().as_secs_f64())
    };
    let (mut h2d_s, mut d2h_s, mut at_once) = (f64::INFINITY, f64::INFINITY, f64::INFINITY);
    for _ in 0..rounds.max(1) {
        h2d_s = h2d_s.min(timed(&[(&s_in, h2d, CopyKind::HostToDevice)])?);
        d2h_s = d2h_s.min(timed(&[(&s_out, d2h, CopyKind::DeviceToHost)])?);
        at_once = at_once
            .min(timed(&[(&s_in, h2d, CopyKind::HostToDevice), (&s_out, d2h, CopyKind::DeviceToHost)])?);
    }
    Ok((h2d_s, d2h_s, at_once))
}
