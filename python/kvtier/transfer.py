"""The transfer engine: asynchronous load and store jobs between a :class:`~kvtier.Store` and an
engine's paged KV pool, and the duplex swap engine (SuperInfer §4.3.2). See ``docs/transfer.md``.

A pool is a ``LayerFirst`` numpy array, whose loads run through a chunked multi-stage pipeline
(read → decompress → dequantize → scatter, ShadowServe §4.2-4.3), or a
:class:`~kvtier.layout.PagedPool` (e.g. vLLM's per-layer tensors), whose jobs are one store call
each on the engine's store workers (``Store.load_into_pool`` / ``Store.put_from_pool``: one copy
per block from and into DRAM, layers announced as they land).

>>> engine = TransferEngine(store, TransferConfig(chunk_blocks=4))
>>> job = engine.submit_load(keys, pool, block_ids)   # leases the hit prefix until done
>>> engine.wait_layer(job, 0)                         # layer 0 of every block is in place
>>> [done] = engine.wait([job])
>>> done.failed                                       # [(index, "miss" | "read_failed" | ...)]

Every block of a job ends with one outcome; only ``"done"`` blocks hold their bytes. A block that
failed is listed, never left as silent garbage. A job's pool array is held until the job is
collected (by :meth:`TransferEngine.finished` or :meth:`TransferEngine.wait`); do not write the
blocks of a job in flight.
"""

from __future__ import annotations

import functools
import numbers
import operator
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import numpy.typing as npt

from kvtier import _core
from kvtier.errors import BufferError, ConfigError, KvtierError, NamespaceError, shown
from kvtier.geometry import Geometry
from kvtier.keys import BlockKeys
from kvtier.layout import PagedPool, buffer_array, int64_overflow, pool_num_blocks
from kvtier.schema import Section
from kvtier.store import Store

#: Every block outcome, in the order of the Rust enum.
OUTCOMES = (
    "pending",
    "done",
    "miss",
    "read_failed",
    "decode_failed",
    "cancelled",
    "bad_block_id",
    "duplicate_block",
    "rejected",
    "store_failed",
    "panicked",
)
STAGE_NAMES = ("read", "decompress", "dequantize", "scatter")


class TransferError(KvtierError):
    """A job cannot be submitted (a bound is reached), is unknown, or a swap is misused."""


def _index(value: object, what: str, end: int = 2**64) -> int:
    """A number from the caller (a job id, a layer, a duplex block or slot) checked before it
    becomes a Rust unsigned int: a bool is not one (True would be 1), a negative or too large
    one is named (pyo3 raises a bare OverflowError). Rust checks it against what exists."""
    try:
        index = None if isinstance(value, bool | np.bool_) else operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        index = None
    if index is None:
        raise TransferError(f"{what} {value!r} is a {type(value).__name__}; expected an int")
    if not 0 <= index < end:
        expected = "an int >= 0" if end == 2**64 else f"an int in [0, {end})"
        raise TransferError(f"{what} {value!r} is out of range; expected {expected}")
    return index


def _block(value: object, what: str = "device block") -> int:
    return _index(value, f"duplex: {what}")


def _slot(value: object) -> int:
    return _block(value, "host slot")


def _positive(name: str, value: object, most: int | None = None) -> None:
    """``value`` is an int >= 1 (and <= ``most``): the Rust side's bound, checked first."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1 or (most and value > most):
        expected = f"an int in [1, {most}]" if most else "an int >= 1"
        raise ConfigError(f"{name} is {value!r}; expected {expected}")


#: The Rust ``TransferConfig::validate`` bounds (crates/kvtier-transfer/src/config.rs); the
#: byte and block counts are u64/usize there.
_CONFIG_MOST = {
    "chunk_blocks": 4096,
    "buffer_chunks": 1024,
    "store_workers": 64,
    "jobs_in_flight_max": 1 << 20,
    "inflight_bytes_max": 2**64 - 1,
    "job_blocks_max": 2**64 - 1,
}
STAGE_WORKERS_MAX = 64


@dataclass(frozen=True)
class TransferConfig(Section):
    """Shape and bounds of a :class:`TransferEngine` (units in the names); :meth:`from_dict` reads
    a mapping of these fields (an unknown key is a :class:`ConfigError` naming it).

    How blocks are stored is the store's configuration (``ssd.codec``, ``remote.codec``): a load
    moves each block's bytes as its tier stores them and decodes them by the codec the stored
    object records; a store job puts raw blocks and the store encodes them per tier.
    """

    LABEL: ClassVar[str] = "transfer config"
    #: Blocks per chunk (the unit each stage processes).
    chunk_blocks: int = 4
    #: Chunk regions per stage buffer: chunks in flight. Bigger jobs run in rounds.
    buffer_chunks: int = 8
    #: Workers for read, decompress, dequantize, scatter.
    stage_workers: tuple[int, int, int, int] = (1, 1, 1, 1)
    store_workers: int = 1
    #: Jobs submitted and not yet collected, at most.
    jobs_in_flight_max: int = 64
    #: Bytes of unfinished jobs, at most.
    inflight_bytes_max: int = 8 << 30
    job_blocks_max: int = 1 << 16
    #: Benchmark only (ShadowServe "No MM"): allocate stage buffers per chunk.
    allocate_per_chunk: bool = False

    def check(self) -> None:
        for name, most in _CONFIG_MOST.items():
            _positive(name, getattr(self, name), most)
        if not isinstance(self.stage_workers, Sequence) or len(self.stage_workers) != 4:
            raise ConfigError(
                f"stage_workers is {shown(self.stage_workers)}; expected 4 worker counts {STAGE_NAMES}"
            )
        object.__setattr__(self, "stage_workers", tuple(self.stage_workers))
        for name, n in zip(STAGE_NAMES, self.stage_workers, strict=True):
            _positive(f"stage_workers[{name}]", n, STAGE_WORKERS_MAX)


@dataclass(frozen=True)
class FinishedJob:
    """A collected job: one outcome per block, in the order of its keys."""

    id: int
    kind: str
    outcomes: tuple[str, ...]
    cancelled: bool
    #: Times the job wrapped around the stage buffers (1 when it fit at once).
    rounds: int
    #: Seconds from submission until its last block settled (0 for ``load_sequential``).
    elapsed_s: float = 0.0

    @property
    def done_blocks(self) -> int:
        return sum(1 for o in self.outcomes if o == "done")

    @property
    def ok(self) -> bool:
        return all(o == "done" for o in self.outcomes)

    @property
    def failed(self) -> list[tuple[int, str]]:
        return [(i, o) for i, o in enumerate(self.outcomes) if o != "done"]


@dataclass(frozen=True)
class StageStats:
    name: str
    workers: int
    busy_s: float
    #: Block bytes processed (decoded size).
    bytes: int
    chunks: int
    #: Read stage: bytes as the tiers store them (encoded), i.e. what was read; 0 for the others.
    stored_bytes: int = 0

    @property
    def rate_bytes_per_s(self) -> float:
        """Bytes per second one worker of this stage moves (0 if it never ran)."""
        return self.bytes / self.busy_s if self.busy_s > 0 else 0.0


def _stage_stats(core: _core.TransferEngine) -> list[StageStats]:
    return [StageStats(*s) for s in core.stage_stats()]


def _job(t: tuple[int, str, list[str], bool, int, float]) -> FinishedJob:
    return FinishedJob(t[0], t[1], tuple(t[2]), t[3], t[4], t[5])


def _ids(block_ids: Sequence[int] | npt.NDArray[np.integer]) -> bytes:
    ids = np.asarray(block_ids)
    if ids.dtype.kind in "fO" and int64_overflow(block_ids) is not None:
        # Python ints past int64: out of range like any id past the pool (-1: "bad_block_id").
        ids = np.array([b if -(2**63) <= b < 2**63 else -1 for b in block_ids], dtype=np.int64)
    if ids.ndim != 1 or (ids.size and not np.issubdtype(ids.dtype, np.integer)):
        raise BufferError(
            f"block_ids must be a 1-D sequence of ints; got shape {ids.shape}, dtype {ids.dtype}"
        )
    return np.ascontiguousarray(ids, dtype="<i8").tobytes()


def balanced_stage_workers(rates_bytes_per_s: Sequence[float], threads: int) -> tuple[int, int, int, int]:
    """Workers per stage so stage throughputs match, from per-worker rates (ShadowServe §4.3): one
    rate per stage of :data:`STAGE_NAMES`, finite bytes/s >= 0 (0: the stage did no work; it keeps
    one worker), ``threads`` >= 1 (fewer than 4 still give each stage one). No stage gets more than
    ``stage_workers``' bound (64): the excess goes to the other working stages, and threads none
    can take are left unused, so the split is always a config the engine accepts. A bad value is a
    :class:`ConfigError` naming it."""
    rates = rates_bytes_per_s
    if isinstance(rates, str | bytes) or not isinstance(rates, Sequence) or len(rates) != 4:
        raise ConfigError(f"rates_bytes_per_s is {shown(rates)}; expected 4 stage rates {STAGE_NAMES}")
    for i, x in enumerate(rates):
        # Compared before any float conversion (a huge int would overflow it); NaN fails.
        if isinstance(x, bool) or not isinstance(x, numbers.Real) or not 0 <= x <= sys.float_info.max:
            raise ConfigError(f"rates_bytes_per_s[{i}] is {shown(x)}; expected finite bytes/s >= 0")
    r = [float(x) for x in rates]
    w = _core.balanced_stage_workers((r[0], r[1], r[2], r[3]), threads)
    return (w[0], w[1], w[2], w[3])


class TransferEngine:
    """Asynchronous load/store jobs between ``store`` and pools: ``LayerFirst`` numpy arrays or
    :class:`~kvtier.layout.PagedPool` objects. Paged jobs queue for the ``store_workers`` (loads
    first)."""

    def __init__(self, store: Store, config: TransferConfig | Mapping[str, Any] | None = None) -> None:
        if not isinstance(store, Store):
            raise TypeError(f"TransferEngine needs a kvtier.Store; got {type(store).__name__}")
        if isinstance(config, Mapping):
            config = TransferConfig.from_dict(config)
        elif config is not None and not isinstance(config, TransferConfig):
            raise TypeError(
                f"TransferEngine's config is a {type(config).__name__}; expected a TransferConfig"
            )
        self.config = config if config is not None else TransferConfig()
        self.store = store
        self.geometry: Geometry = store.config.geometry
        self._core = _core.TransferEngine(store._core, self.config)
        if store.config.metrics_port is not None:  # its stage statistics join the store's metrics
            from kvtier.metrics import watch_engine

            watch_engine(self, functools.partial(_stage_stats, self._core))

    def _check(self, keys: BlockKeys, pool: np.ndarray) -> int:
        self._check_keys(keys)
        return pool_num_blocks(self.geometry, pool)

    def _check_keys(self, keys: BlockKeys) -> None:
        if not isinstance(keys, BlockKeys):
            raise TypeError(f"keys must be kvtier.keys.BlockKeys; got {type(keys).__name__}")
        if keys.namespace_hash != self.store.namespace.hash:
            raise NamespaceError("keys belong to another namespace than the engine's store")

    def _submit(self, load: bool, keys: BlockKeys, pool: np.ndarray | PagedPool, block_ids: bytes) -> int:
        if isinstance(pool, PagedPool):
            self._check_keys(keys)
            return int(self._core.submit_paged(load, keys.raw, pool, block_ids))
        n = self._check(keys, pool)
        return int(self._core.submit(load, keys.raw, pool, block_ids, n))

    def submit_load(
        self,
        keys: BlockKeys,
        pool: np.ndarray | PagedPool,
        block_ids: Sequence[int] | npt.NDArray[np.integer],
    ) -> int:
        """Starts loading ``keys[i]`` into pool block ``block_ids[i]``; returns the job id.

        The hit prefix is leased now and released when the job finishes. Blocks past it finish as
        ``"miss"``, ids out of range as ``"bad_block_id"``, repeated ids as ``"duplicate_block"``,
        blocks that fail verification as ``"read_failed"``. Into a :class:`PagedPool`, the job's
        layers are announced to :meth:`wait_layer` as they land, before the verdicts: drop what
        was computed from a block that then fails. Its layers must be the geometry's (as
        :meth:`PagedPool.layer_first` groups them; :class:`LayoutError` otherwise).
        """
        return self._submit(True, keys, pool, _ids(block_ids))

    def submit_store(
        self,
        keys: BlockKeys,
        pool: np.ndarray | PagedPool,
        block_ids: Sequence[int] | npt.NDArray[np.integer],
    ) -> int:
        """Starts storing pool block ``block_ids[i]`` under ``keys[i]``; returns the job id."""
        return self._submit(False, keys, pool, _ids(block_ids))

    def finished(self) -> list[FinishedJob]:
        """Collects every finished job (each job is reported once, here or by :meth:`wait`)."""
        return [_job(t) for t in self._core.finished()]

    def wait(self, ids: int | Iterable[int]) -> list[FinishedJob]:
        """Waits for the jobs and collects them, in the order given. Raises :class:`TransferError`
        for an unknown or already collected id, also one another thread collected (``wait`` or
        :meth:`finished`) while this call waited, or an id given twice: each job is reported
        once; none is collected then."""
        wanted: list[object] = [ids]
        if isinstance(ids, Iterable) and not isinstance(ids, str | bytes):
            wanted = list(ids)
        return [_job(t) for t in self._core.wait([_index(i, "job") for i in wanted])]

    def wait_layer(self, job: int, layer: int) -> None:
        """Returns once layer ``layer`` of every block of ``job`` is in place (or failed).

        Raises :class:`TransferError` if a transfer worker panicked over some of the job's blocks
        (a bug; their outcome is ``"panicked"``): that layer is not in place for every block.
        """
        self._core.wait_layer(_index(job, "job"), _index(layer, "layer", 2**32))

    def outcomes(self, job: int) -> tuple[str, ...]:
        """Outcomes so far (``"pending"`` for blocks still moving); does not collect the job."""
        return tuple(self._core.outcomes(_index(job, "job")))

    def cancel(self, job: int) -> bool:
        """Cancels a running job (True); a finished one is a no-op (False); unknown ids raise."""
        return bool(self._core.cancel(_index(job, "job")))

    def jobs(self) -> int:
        """Jobs submitted and not yet collected (bounded by ``jobs_in_flight_max``)."""
        return int(self._core.jobs())

    def stage_stats(self) -> list[StageStats]:
        """Busy time, bytes and chunks per stage since the engine started."""
        return _stage_stats(self._core)

    def balanced_stage_workers(self, threads: int) -> tuple[int, int, int, int]:
        """A stage split for ``threads`` from this engine's measured per-worker stage rates: the
        ``stage_workers`` of the next engine (ShadowServe §4.3)."""
        return balanced_stage_workers([s.rate_bytes_per_s for s in self.stage_stats()], threads)

    def load_sequential(
        self,
        keys: BlockKeys,
        pool: np.ndarray,
        block_ids: Sequence[int] | npt.NDArray[np.integer],
        per_chunk: bool = False,
    ) -> tuple[FinishedJob, dict[str, float]]:
        """The same load without pipelining (benchmark baselines): stage after stage over the whole
        request, each stage with its workers; or, with ``per_chunk``, one thread taking each chunk
        through every stage before the next, in one chunk-sized region."""
        n = self._check(keys, pool)
        job, times = self._core.load_sequential(keys.raw, pool, _ids(block_ids), n, per_chunk)
        return _job(job), dict(zip(STAGE_NAMES, times, strict=True))


class DuplexEngine:
    """Concurrent swap-out (pool → host) and swap-in (host → pool) with dirty/synced tracking.

    ``device`` is a ``LayerFirst`` pool array; ``host`` holds ``BlockFirst`` objects, one per slot
    (an ``(slots, block_bytes)`` uint8 array). Both are held for the engine's life.
    :meth:`on_cuda` puts the device pool in GPU memory instead (docs/transfer.md §6).
    """

    def __init__(
        self,
        geometry: Geometry,
        device: np.ndarray,
        host: np.ndarray,
        queued_transfers_max: int = 64,
        step_blocks_max: int = 1 << 16,
    ) -> None:
        # Both checked here, so errors name them (the binding calls either of them "pool").
        pool_num_blocks(geometry, device, "device")
        if not device.flags.writeable:
            raise BufferError("device is read-only; expected a writable array")
        _host_slots(geometry, host)
        if np.may_share_memory(device, host):  # both C-contiguous: exact
            raise BufferError("device and host share memory; expected separate arrays")
        _positive("queued_transfers_max", queued_transfers_max)
        _positive("step_blocks_max", step_blocks_max)
        self._core = _core.DuplexEngine(geometry._handle, device, host, queued_transfers_max, step_blocks_max)
        self._block_bytes = geometry.block_bytes

    @classmethod
    def on_cuda(
        cls,
        geometry: Geometry,
        device_blocks: int,
        host: np.ndarray,
        queued_transfers_max: int = 64,
        step_blocks_max: int = 1 << 16,
        device: int = 0,
    ) -> DuplexEngine:
        """A device pool of ``device_blocks`` zeroed blocks in the memory of CUDA GPU ``device``;
        ``host`` is pinned for the engine's life and each swap direction copies on its own stream.
        The CUDA runtime is loaded now (``KVTIER_CUDART`` names it if it is not found): without
        one this raises :class:`TransferError`."""
        _positive("device_blocks", device_blocks)
        _host_slots(geometry, host)
        _positive("queued_transfers_max", queued_transfers_max)
        _positive("step_blocks_max", step_blocks_max)
        if isinstance(device, bool) or not isinstance(device, int) or device < 0:
            raise ConfigError(f"device is {device!r}; expected a CUDA device index >= 0")
        engine = cls.__new__(cls)
        engine._core = _core.DuplexEngine.on_cuda(
            geometry._handle, device_blocks, host, queued_transfers_max, step_blocks_max, device
        )
        engine._block_bytes = geometry.block_bytes
        return engine

    def state(self, block: int) -> tuple[str, int | None]:
        """``("free" | "dirty", None)`` or ``("synced", host_slot)``."""
        return self._core.state(_block(block))

    def write(self, block: int) -> None:
        self._core.write(_block(block))

    def wait_block(self, block: int) -> None:
        self._core.wait_block(_block(block))

    def rotate(self, block: int, slot: int) -> None:
        self._core.rotate(_block(block), _slot(slot))

    def swap_out(self, block: int, slot: int) -> bool:
        return bool(self._core.swap_out(_block(block), _slot(slot)))

    def swap_in(self, slot: int, block: int) -> None:
        self._core.swap_in(_slot(slot), _block(block))

    def free(self, block: int) -> None:
        self._core.free(_block(block))

    def dirty_blocks(self, blocks: Sequence[int]) -> list[int]:
        return list(self._core.dirty_blocks([_block(b) for b in blocks]))

    def submit_step(self) -> tuple[int | None, int | None]:
        """One batched transfer per direction: (swap-out id, swap-in id), None when empty."""
        return self._core.submit_step()

    def swap_out_per_segment(self, pairs: Sequence[tuple[int, int]]) -> int | None:
        return self._core.swap_out_per_segment([(_block(b), _slot(s)) for b, s in pairs])

    def wait(self, transfer: int) -> None:
        self._core.wait(_index(transfer, "duplex: transfer"))

    def wait_all(self) -> None:
        """Waits for every transfer; raises :class:`TransferError` naming each that failed."""
        self._core.wait_all()

    def read_block(self, block: int) -> np.ndarray:
        """Device block ``block`` as one ``BlockFirst`` object (a new uint8 array)."""
        out = np.empty(self._block_bytes, dtype=np.uint8)
        self._core.read_block(_block(block), out)
        return out

    def write_block(self, block: int, data: np.ndarray) -> None:
        """Writes one ``BlockFirst`` object into device block ``block`` (it becomes dirty)."""
        array = buffer_array(data, "data")
        if array.nbytes != self._block_bytes:
            raise BufferError(f"data has {array.nbytes} bytes; expected one block of {self._block_bytes}")
        self._core.write_block(_block(block), array)


def _host_slots(geometry: Geometry, host: object) -> None:
    """Checks a duplex engine's host swap space: a writable numpy array of whole slots."""
    if not isinstance(host, np.ndarray):
        raise BufferError(f"host is {type(host).__name__}; expected a numpy array")
    buffer_array(host, "host", writable=True)
    if host.nbytes == 0 or host.nbytes % geometry.block_bytes:
        raise BufferError(
            f"host has {host.nbytes} bytes; expected a positive multiple of {geometry.block_bytes} "
            f"bytes (whole slots of one BlockFirst object each)"
        )


def cuda_link_duplex(nbytes: int, rounds: int = 5, device: int = 0) -> tuple[float, float, float]:
    """The host link's own limits on CUDA GPU ``device``: (host-to-device s, device-to-host s,
    both at once s) for ``nbytes`` each way as one copy per direction, alone and on two streams
    at once (best of ``rounds``)."""
    _positive("nbytes", nbytes)
    _positive("rounds", rounds)
    h2d, d2h, at_once = _core.cuda_link_duplex(nbytes, rounds, device)
    return float(h2d), float(d2h), float(at_once)
