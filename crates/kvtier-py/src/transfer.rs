//! `TransferEngine` and `DuplexEngine` for Python: jobs over numpy pools and paged pools (region
//! lists), the GIL released while waiting. A job's pool buffers are held (their Py_buffers
//! acquired) from submission until the job is collected by `finished()` or `wait()`, so Python
//! cannot free them under the workers.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use pyo3::prelude::*;
use pyo3::types::PyBool;

use kvtier_store::Store as CoreStore;
use kvtier_transfer::cuda::{link_duplex_seconds, Cuda};
use kvtier_transfer::duplex::BlockState;
use kvtier_transfer::{
    DuplexConfig, DuplexEngine as CoreDuplex, FinishedJob, JobKind, PoolRef, StageWorkers, StoreHandle,
    TransferEngine as CoreEngine, TransferError,
};

use crate::args::{JobBlockIds, Keys};
use crate::buffer::{Buffer, Format};
use crate::config::transfer_config;
use crate::errors::{config_error, raise};
use crate::geometry::CoreGeometry;
use crate::paged::paged_pool;
use crate::store::Store;

/// The Python store, as the engine's store handle.
struct PyStore(Py<Store>);

impl StoreHandle for PyStore {
    fn store(&self) -> &CoreStore {
        &self.0.get().inner
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// A writable pool buffer of `num_blocks` (default: all it holds) blocks; `what` names it in
/// errors (a duplex engine's two pools are told apart).
fn pool_ref(
    pool: &Bound<'_, PyAny>,
    what: &'static str,
    block_bytes: usize,
    num_blocks: Option<u64>,
) -> PyResult<(Buffer, PoolRef)> {
    let buf = Buffer::get(pool, what, true, Format::Bytes)?;
    let n = num_blocks.unwrap_or((buf.len() / block_bytes.max(1)) as u64);
    // SAFETY: the Buffer is kept (in the engine's map) until the job is collected, so the
    // memory stays valid; Python-side writes to blocks in flight are the caller's contract.
    let r = unsafe { PoolRef::from_raw(buf.ptr(), buf.len(), n) };
    Ok((buf, r))
}

fn job_tuple(j: &FinishedJob) -> JobTuple {
    let kind = if j.kind == JobKind::Load { "load" } else { "store" };
    let outcomes = j.outcomes.iter().map(|o| o.name()).collect();
    (j.id, kind, outcomes, j.cancelled, j.rounds, j.elapsed.as_secs_f64())
}

/// (id, kind, outcome names, cancelled, rounds, elapsed seconds).
type JobTuple = (u64, &'static str, Vec<&'static str>, bool, usize, f64);

#[pyclass(frozen, name = "TransferEngine", module = "kvtier._core")]
pub struct TransferEngine {
    // Declared first: dropped (cancelling and draining every job) before the buffers below.
    inner: CoreEngine,
    buffers: Mutex<HashMap<u64, Vec<Buffer>>>,
    block_bytes: usize,
}

#[pymethods]
impl TransferEngine {
    /// An engine on `store` shaped by `config` (a `kvtier.TransferConfig`, or a mapping of its
    /// keys; a key left out takes the Rust default).
    #[new]
    fn new(py: Python<'_>, store: Py<Store>, config: &Bound<'_, PyAny>) -> PyResult<Self> {
        let c = transfer_config(config)?;
        let block_bytes = store.get().inner.block_bytes();
        let handle: Arc<dyn StoreHandle> = Arc::new(PyStore(store));
        let inner = py.allow_threads(|| CoreEngine::new(handle, c)).map_err(raise)?;
        Ok(TransferEngine { inner, buffers: Mutex::new(HashMap::new()), block_bytes })
    }

    /// A job into (`load`) or from a pool buffer of whole blocks; returns the job id.
    #[pyo3(signature = (load, keys, pool, block_ids, num_blocks=None))]
    fn submit(
        &self,
        py: Python<'_>,
        load: bool,
        keys: Keys,
        pool: &Bound<'_, PyAny>,
        block_ids: JobBlockIds,
        num_blocks: Option<u64>,
    ) -> PyResult<u64> {
        let (buf, r) = pool_ref(pool, "pool", self.block_bytes, num_blocks)?;
        self.hold(py, vec![buf], || match load {
            true => self.inner.submit_load(&keys.0, r, &block_ids.0),
            false => self.inner.submit_store(&keys.0, r, &block_ids.0),
        })
    }

    /// A job into (`load`) or from an engine's `PagedPool` (see `kvtier_core::paged`).
    fn submit_paged(
        &self,
        py: Python<'_>,
        load: bool,
        keys: Keys,
        pool: &Bound<'_, PyAny>,
        block_ids: JobBlockIds,
    ) -> PyResult<u64> {
        let (views, pool) = paged_pool(pool)?;
        self.hold(py, views, || match load {
            true => self.inner.submit_paged_load(&keys.0, pool, &block_ids.0),
            false => self.inner.submit_paged_store(&keys.0, pool, &block_ids.0),
        })
    }

    fn finished(&self) -> Vec<JobTuple> {
        let jobs = self.inner.finished();
        self.collect(&jobs)
    }

    fn wait(&self, py: Python<'_>, ids: Vec<u64>) -> PyResult<Vec<JobTuple>> {
        let jobs = py.allow_threads(|| self.inner.wait(&ids)).map_err(raise)?;
        Ok(self.collect(&jobs))
    }

    fn wait_layer(&self, py: Python<'_>, id: u64, layer: u32) -> PyResult<()> {
        py.allow_threads(|| self.inner.wait_layer(id, layer)).map_err(raise)
    }

    fn outcomes(&self, id: u64) -> PyResult<Vec<&'static str>> {
        Ok(self.inner.outcomes(id).map_err(raise)?.iter().map(|o| o.name()).collect())
    }

    fn cancel(&self, id: u64) -> PyResult<bool> {
        self.inner.cancel(id).map_err(raise)
    }

    fn jobs(&self) -> usize {
        self.inner.jobs()
    }

    /// Tests only (`test-hooks`): the `nth` (from 1) pass of a worker through `site` ("read",
    /// "decompress", "dequantize", "scatter", "paged_load", "store") panics; 0 disarms it.
    #[cfg(feature = "test-hooks")]
    fn panic_for_test(&self, site: &str, nth: u64) -> PyResult<()> {
        let at =
            kvtier_transfer::PanicSite::from_name(site).filter(|&s| s != kvtier_transfer::PanicSite::Swap);
        let at = at.ok_or_else(|| crate::errors::config_error(format!("unknown panic site {site:?}")))?;
        self.inner.panic_for_test(at, nth);
        Ok(())
    }

    /// Per stage: (name, workers, busy_s, bytes, chunks, stored_bytes).
    fn stage_stats(&self) -> Vec<(&'static str, usize, f64, u64, u64, u64)> {
        self.inner
            .stage_stats()
            .iter()
            .map(|s| (s.name, s.workers, s.busy_s, s.bytes, s.chunks, s.stored_bytes))
            .collect()
    }

    /// The sequential baseline: returns (job, seconds per stage).
    #[cfg(feature = "bench-baselines")]
    #[pyo3(signature = (keys, pool, block_ids, num_blocks=None, per_chunk=false))]
    fn load_sequential(
        &self,
        py: Python<'_>,
        keys: Keys,
        pool: &Bound<'_, PyAny>,
        block_ids: JobBlockIds,
        num_blocks: Option<u64>,
        per_chunk: bool,
    ) -> PyResult<(JobTuple, [f64; 4])> {
        let (buf, r) = pool_ref(pool, "pool", self.block_bytes, num_blocks)?;
        let result = py
            .allow_threads(|| self.inner.load_sequential(&keys.0, r, &block_ids.0, per_chunk))
            .map_err(raise);
        drop(buf);
        let (job, times) = result?;
        Ok((job_tuple(&job), times))
    }
}

impl TransferEngine {
    /// Submits a job with `submit` and holds `bufs` (its pool's views) until it is collected. The
    /// GIL (`_py`) stays held (submission only leases and queues): no other Python thread can
    /// collect the job before its buffers are registered, and the buffer map's lock is only ever
    /// taken with the GIL held, so the two locks cannot deadlock. A pool sharing memory with an
    /// in-flight job's pool laid out otherwise is refused by the engine's claims
    /// (`kvtier_transfer::submission`).
    fn hold(
        &self,
        _py: Python<'_>,
        bufs: Vec<Buffer>,
        submit: impl FnOnce() -> Result<u64, TransferError>,
    ) -> PyResult<u64> {
        let mut buffers = lock(&self.buffers);
        let id = submit().map_err(raise)?;
        buffers.insert(id, bufs);
        Ok(id)
    }

    /// Drops the buffers of collected jobs (the GIL is held: this runs inside a method).
    fn collect(&self, jobs: &[FinishedJob]) -> Vec<JobTuple> {
        let mut buffers = lock(&self.buffers);
        jobs.iter()
            .map(|j| {
                buffers.remove(&j.id);
                job_tuple(j)
            })
            .collect()
    }
}

fn state_name(s: BlockState) -> (&'static str, Option<u64>) {
    match s {
        BlockState::Free => ("free", None),
        BlockState::Dirty => ("dirty", None),
        BlockState::Synced { host } => ("synced", Some(host)),
    }
}

/// The duplex swap engine over a device pool and a host swap space, both held for its life
/// (a CUDA engine's device pool is its own).
#[pyclass(frozen, name = "DuplexEngine", module = "kvtier._core")]
pub struct DuplexEngine {
    // Declared first: dropped (its transfers waited for) before the buffers below.
    inner: CoreDuplex,
    buffers: Vec<Buffer>,
    block_bytes: usize,
}

#[pymethods]
impl DuplexEngine {
    #[new]
    fn new(
        geometry: &CoreGeometry,
        device: &Bound<'_, PyAny>,
        host: &Bound<'_, PyAny>,
        queued_transfers_max: usize,
        step_blocks_max: usize,
    ) -> PyResult<Self> {
        let bb = geometry.inner.block_bytes() as usize;
        let (dbuf, dref) = pool_ref(device, "device", bb, None)?;
        let (hbuf, href) = pool_ref(host, "host", bb, None)?;
        crate::buffer::ensure_disjoint(&dbuf, &hbuf)?;
        let config = DuplexConfig { queued_transfers_max, step_blocks_max };
        let inner = CoreDuplex::new(&geometry.inner, dref, href, config).map_err(raise)?;
        Ok(DuplexEngine { inner, buffers: vec![dbuf, hbuf], block_bytes: bb })
    }

    /// A device pool of `device_blocks` blocks in CUDA memory on GPU `device`.
    #[staticmethod]
    fn on_cuda(
        geometry: &CoreGeometry,
        device_blocks: u64,
        host: &Bound<'_, PyAny>,
        queued_transfers_max: usize,
        step_blocks_max: usize,
        device: i32,
    ) -> PyResult<Self> {
        let (hbuf, href) = pool_ref(host, "host", geometry.inner.block_bytes() as usize, None)?;
        let config = DuplexConfig { queued_transfers_max, step_blocks_max };
        let cuda = Cuda::load(device).map_err(raise)?;
        let inner = CoreDuplex::on_cuda(&geometry.inner, device_blocks, href, config, cuda).map_err(raise)?;
        let block_bytes = geometry.inner.block_bytes() as usize;
        Ok(DuplexEngine { inner, buffers: vec![hbuf], block_bytes })
    }

    fn read_block(&self, py: Python<'_>, dev: u64, out: &Bound<'_, PyAny>) -> PyResult<()> {
        let buf = self.block_buffer(out, "out", true)?;
        // SAFETY: the buffer is held (valid, writable, one block, apart from the engine's own
        // memory) for the whole call.
        let out = unsafe { std::slice::from_raw_parts_mut(buf.ptr(), buf.len()) };
        py.allow_threads(|| self.inner.read_block(dev, out)).map_err(raise)
    }
    fn write_block(&self, py: Python<'_>, dev: u64, data: &Bound<'_, PyAny>) -> PyResult<()> {
        let buf = self.block_buffer(data, "data", false)?;
        // SAFETY: as in `read_block`.
        let data = unsafe { std::slice::from_raw_parts(buf.ptr().cast_const(), buf.len()) };
        py.allow_threads(|| self.inner.write_block(dev, data)).map_err(raise)
    }

    fn state(&self, dev: u64) -> PyResult<(&'static str, Option<u64>)> {
        Ok(state_name(self.inner.state(dev).map_err(raise)?))
    }
    fn write(&self, dev: u64) -> PyResult<()> {
        self.inner.write(dev).map_err(raise)
    }
    fn wait_block(&self, py: Python<'_>, dev: u64) -> PyResult<()> {
        py.allow_threads(|| self.inner.wait_block(dev)).map_err(raise)
    }
    fn rotate(&self, dev: u64, host: u64) -> PyResult<()> {
        self.inner.rotate(dev, host).map_err(raise)
    }
    fn swap_out(&self, dev: u64, host: u64) -> PyResult<bool> {
        self.inner.swap_out(dev, host).map_err(raise)
    }
    fn swap_in(&self, host: u64, dev: u64) -> PyResult<()> {
        self.inner.swap_in(host, dev).map_err(raise)
    }
    fn free(&self, dev: u64) -> PyResult<()> {
        self.inner.free(dev).map_err(raise)
    }
    fn dirty_blocks(&self, devs: Vec<u64>) -> PyResult<Vec<u64>> {
        self.inner.dirty_blocks(&devs).map_err(raise)
    }
    /// Returns (swap-out transfer id or None, swap-in transfer id or None).
    fn submit_step(&self) -> PyResult<(Option<u64>, Option<u64>)> {
        let t = self.inner.submit_step().map_err(raise)?;
        Ok((t.swap_out, t.swap_in))
    }
    fn swap_out_per_segment(&self, pairs: Vec<(u64, u64)>) -> PyResult<Option<u64>> {
        self.inner.swap_out_per_segment(&pairs).map_err(raise)
    }
    fn wait(&self, py: Python<'_>, seq: u64) -> PyResult<()> {
        py.allow_threads(|| self.inner.wait(seq)).map_err(raise)
    }
    /// Tests only (`test-hooks`): the `nth` (from 1) transfer a swap worker starts panics.
    #[cfg(feature = "test-hooks")]
    fn panic_for_test(&self, nth: u64) {
        self.inner.panic_for_test(nth);
    }

    fn wait_all(&self, py: Python<'_>) -> PyResult<()> {
        py.allow_threads(|| self.inner.wait_all()).map_err(raise)
    }
}

impl DuplexEngine {
    /// A caller's one-block buffer: plain numbers, C-contiguous, `block_bytes` long (never a
    /// null pointer), and apart from the engine's device pool and host swap space.
    fn block_buffer(&self, obj: &Bound<'_, PyAny>, what: &'static str, writable: bool) -> PyResult<Buffer> {
        let buf = Buffer::get(obj, what, writable, Format::Bytes)?;
        if buf.len() != self.block_bytes {
            let (n, bb) = (buf.len(), self.block_bytes);
            return Err(crate::errors::buffer_error(format!(
                "{what} has {n} bytes; expected one block of {bb}"
            )));
        }
        self.buffers.iter().try_for_each(|b| crate::buffer::ensure_disjoint(&buf, b))?;
        Ok(buf)
    }
}

/// Per-stage worker counts balanced from measured per-worker rates (ShadowServe §4.3). A rate
/// is finite bytes/s >= 0 (0: the stage did no work, one worker), `threads` an int >= 1; any
/// other value is a `ConfigError` naming it.
#[pyfunction]
pub fn balanced_stage_workers(
    rates_bytes_per_s: [f64; 4],
    threads: &Bound<'_, PyAny>,
) -> PyResult<[usize; 4]> {
    if let Some((i, r)) = rates_bytes_per_s.iter().enumerate().find(|(_, r)| !r.is_finite() || **r < 0.0) {
        return Err(config_error(format!("rates_bytes_per_s[{i}] is {r}; expected finite bytes/s >= 0")));
    }
    let n = threads.extract::<usize>().unwrap_or(0);
    if n == 0 || threads.is_instance_of::<PyBool>() {
        return Err(config_error(format!("threads is {}; expected an int >= 1", threads.repr()?)));
    }
    Ok(StageWorkers::balanced(rates_bytes_per_s, n).as_array())
}

/// The host link's limits on GPU `device`: (host→device, device→host, both at once) seconds for
/// `nbytes` each way as one copy per direction, best of `rounds`.
#[pyfunction]
pub fn cuda_link_duplex(
    py: Python<'_>,
    nbytes: usize,
    rounds: usize,
    device: i32,
) -> PyResult<(f64, f64, f64)> {
    let cuda = Cuda::load(device).map_err(raise)?;
    py.allow_threads(|| link_duplex_seconds(&cuda, nbytes, rounds)).map_err(raise)
}
