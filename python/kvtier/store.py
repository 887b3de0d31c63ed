"""The kvtier store: put KV objects for consecutive block keys, find the longest cached prefix,
lease it so eviction cannot take it, and load it into your buffers.

>>> store = Store(StoreConfig(geometry=Geometry.llama3_8b(), dram=DramConfig(capacity_bytes="1GiB")))
>>> keys = store.namespace.block_keys(tokens)
>>> store.put(keys, objects)                      # objects: (len(keys), block_bytes) array
>>> with store.lease(keys) as lease:              # pins the hit prefix
...     store.load(lease, out[: lease.hit_blocks])

A miss is a normal result (``hit_blocks`` smaller than ``len(keys)``). A block whose checksum fails
on load is counted, dropped, and ends the loaded prefix: never wrong KV.
"""

from __future__ import annotations

import contextlib
import logging
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import TYPE_CHECKING

import numpy as np

from kvtier import _core
from kvtier.config import StoreConfig
from kvtier.errors import BufferError, KvtierError, LeaseError, NamespaceError
from kvtier.keys import BlockKeys, Namespace
from kvtier.layout import PagedPool, _block_ids, buffer_array, is_buffer

if TYPE_CHECKING:
    from kvtier._core import RemoteMetrics, SsdMetrics

ObjectsArg = np.ndarray | Sequence[np.ndarray]

log = logging.getLogger("kvtier")


@dataclass(frozen=True)
class Lookup:
    """Longest consecutive prefix of keys present, and the tier holding each hit block."""

    hit_blocks: int
    tiers: tuple[str, ...]


@dataclass(frozen=True)
class TierWrites:
    """New copies a put wrote to each tier (on SSD: written through, or demoted to make room)."""

    dram: int = 0
    ssd: int = 0
    remote: int = 0


@dataclass(frozen=True)
class PutReport:
    """What a put did: ``stored + already_present + rejected`` is the number of keys.

    ``stored``: blocks this put wrote (into DRAM, or where DRAM had no room, through or by
    demotion to SSD or the remote tier); ``already_present``: blocks DRAM held (or a lower tier,
    for those DRAM had no room for); ``rejected``: blocks no tier holds after the put; ``evicted``: DRAM blocks evicted to make room; ``written``: the new
    copies per tier (not part of equality: where they went is a detail of the hierarchy)."""

    stored: int
    already_present: int
    rejected: int
    evicted: int
    written: TierWrites = field(default=TierWrites(), compare=False)

    @classmethod
    def _from_core(cls, t: tuple[int, int, int, int, int, int, int]) -> PutReport:
        return cls(t[0], t[1], t[2], t[3], TierWrites(t[4], t[5], t[6]))


@dataclass(frozen=True)
class LoadReport:
    loaded_blocks: int
    checksum_failures: int


@dataclass(frozen=True)
class PoolLoadReport:
    """What :meth:`Store.load_into_pool` did. Blocks ``0..loaded_blocks`` all verified; every
    position in ``failed`` (of the call's block table) holds no usable bytes."""

    loaded_blocks: int
    failed: tuple[int, ...]
    checksum_failures: int


#: Layers of a layerwise load that are in place. A loading thread passes it to
#: :meth:`Store.load_into_pool`; engine threads call ``progress.wait(layer)`` (GIL released) to
#: start on a layer once it is in place. ``close()`` ends it: every wait returns from then on
#: (call it when the load ends, whatever happened, so no waiter hangs).
LayerProgress = _core.LayerProgress


#: The store's counters and gauges (:meth:`Store.stats`): a frozen class made in Rust from the
#: Rust ``StoreStats``'s one field list, each field a read-only ``int`` attribute (``_core.pyi``
#: lists and documents them), ``as_dict()`` a dict of them.
StoreStats = _core.StoreStats

#: Counters and gauges of one tier (:meth:`Store.tier_stats`), made as :data:`StoreStats` is.
TierStats = _core.TierStats


def _release_quietly(core: _core.Store, lease_id: int) -> None:
    """Releases a lease from a finalizer: errors are swallowed (nobody could handle them there)."""
    # A finalizer must not raise (e.g. a store being torn down); the TTL reclaims the lease anyway.
    with contextlib.suppress(Exception):
        core.release(lease_id)


class Lease:
    """Pins the hit prefix of a lookup until released (or until the store's lease TTL passes).

    Use as a context manager so it is always released. Releasing is idempotent, and also fine
    after the TTL passed. A lease that is garbage-collected without being released is released
    then (by a ``weakref.finalize``), so a forgotten lease pins its blocks until it is collected,
    not for the whole TTL; do not rely on that for timing (collection may be late, e.g. in a
    reference cycle).
    """

    def __init__(self, store: Store, lease_id: int, hit_blocks: int, tiers: tuple[str, ...]) -> None:
        self._store = store
        self.id = lease_id
        self.hit_blocks = hit_blocks
        self.tiers = tiers
        self.released = False
        # Holds the core store, not this Lease, so it can run once this Lease is unreachable.
        self._finalizer = weakref.finalize(self, _release_quietly, store._core, lease_id)
        self._finalizer.atexit = False  # at exit the whole store goes; nothing to unpin

    def release(self) -> None:
        """Unpins the lease's blocks. Calling it again (or after the TTL passed) does nothing."""
        if not self.released:
            self.released = True
            self._finalizer.detach()
            self._store._core.release(self.id)

    def __enter__(self) -> Lease:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc is None:
            self.release()
            return
        # Never mask the body's exception with a failure to release (the TTL reclaims the lease).
        try:
            self.release()
        except Exception as release_error:
            exc.add_note(f"kvtier: releasing lease {self.id} also failed: {release_error!r}")

    def __repr__(self) -> str:
        return f"Lease(id={self.id}, hit_blocks={self.hit_blocks}, released={self.released})"


class Store:
    """A KV-cache store over the tier hierarchy: DRAM, then (with an ``ssd`` section) an SSD pool.

    With an SSD tier, blocks DRAM gives up are written to SSD first (write-back; after
    ``ssd.admission_k`` accesses), lookups report ``"ssd"`` for blocks found there, loads from SSD
    verify every checksum and copy the blocks back into DRAM, and a restarted store finds what
    the pool kept (its index log is replayed when the store opens).

    With a ``remote`` section, a Redis/Valkey server (or cluster) is the last tier: puts are written
    through to it (or DRAM's victims are, with ``remote.write_through=False``), lookups report
    ``"remote"`` for blocks only it holds, and loads verify every object and copy it into DRAM.
    Stores in other processes with the same namespace share those blocks. A server that is down
    gives counted misses, never exceptions (``docs/remote.md``).
    """

    def __init__(self, config: StoreConfig) -> None:
        if not isinstance(config, StoreConfig):
            raise TypeError(f"Store needs a kvtier.StoreConfig; got {type(config).__name__}")
        self.config = config
        self.namespace: Namespace = config.namespace
        self.block_bytes = config.geometry.block_bytes
        self._core = _core.Store(config)
        assert bytes(self._core.namespace_hash) == self.namespace.hash
        #: This store's ``namespace`` label on its metrics endpoint (None: no endpoint).
        self.metrics_label: str | None = None
        if config.metrics_port is not None:
            from kvtier.metrics import serve

            self.metrics_label = serve(self, config.metrics_port, config.metrics_addr)
        metrics = self._core.ssd_metrics()
        if metrics is not None:
            for warning in metrics["warnings"]:
                log.warning("kvtier ssd: %s", warning)

    def _check_keys(self, keys: BlockKeys) -> None:
        if not isinstance(keys, BlockKeys):
            raise TypeError(f"keys must be kvtier.keys.BlockKeys; got {type(keys).__name__}")
        if keys.namespace_hash != self.namespace.hash:
            raise NamespaceError(
                f"keys belong to namespace {keys.namespace_hash[::-1].hex()}; this store serves "
                f"{self.namespace.hash[::-1].hex()} (model {self.namespace.model_id!r}, salt "
                f"{self.namespace.cache_salt!r}, rank {self.namespace.rank}); hash keys with store.namespace"
            )

    @staticmethod
    def _blocks_arg(arr: object, what: str, writable: bool) -> ObjectsArg:
        """``arr`` as the store takes blocks: a numpy array (any other buffer, e.g. a memoryview or
        bytes, becomes one, over the same memory, checked by ``buffer_array``), or a sequence of
        one buffer per block; BufferError for anything else."""
        if isinstance(arr, np.ndarray | list | tuple):
            return arr
        if is_buffer(arr):  # memoryview, bytes, ...: a sequence too, but of items, not blocks
            return buffer_array(arr, what, writable=writable)
        if isinstance(arr, Sequence) and not isinstance(arr, str):
            return arr
        raise BufferError(f"{what} is {type(arr).__name__}; expected a numpy array or a list of arrays")

    def _block_count(self, arr: object, what: str) -> int:
        """Blocks in ``arr`` (rows of an array, each of ``block_bytes``, or items of a sequence);
        BufferError for anything else, before the count is held against a lease."""
        given = arr
        arr = self._blocks_arg(arr, what, writable=False)
        if isinstance(arr, np.ndarray):
            if arr.ndim == 0 or arr.nbytes != arr.shape[0] * self.block_bytes:
                label = what if arr is given else f"{what} (a {type(given).__name__})"
                raise BufferError(
                    f"{label} has shape {arr.shape} ({arr.nbytes} bytes, {arr.dtype}); expected blocks "
                    f"along axis 0, shape (n, {self.block_bytes}) in bytes"
                )
            return int(arr.shape[0])
        return len(arr)

    def _check_blocks(self, arr: object, count: int, what: str, writable: bool) -> ObjectsArg:
        """Validates ``count`` blocks; returns what the Rust store takes (an array, or a list of
        arrays). Every buffer is checked by ``buffer_array`` (plain-number items, C-contiguous,
        writable when ``writable``) and for its size."""
        given = arr
        arr = self._blocks_arg(arr, what, writable)
        if isinstance(arr, np.ndarray):
            # A buffer made an array (a memoryview, bytes): the message names what was given.
            label = what if arr is given else f"{what} (a {type(given).__name__})"
            if arr.ndim == 0 or arr.shape[0] != count:
                raise BufferError(
                    f"{label} has shape {arr.shape}; expected {count} blocks along axis 0 "
                    f"({count} x {self.block_bytes} bytes)"
                )
            if arr.nbytes != count * self.block_bytes:
                raise BufferError(
                    f"{label} has {arr.nbytes} bytes ({arr.shape}, {arr.dtype}); expected "
                    f"{count} x {self.block_bytes} = {count * self.block_bytes} bytes"
                )
            return buffer_array(arr, what, writable=writable)
        if len(arr) != count:
            raise BufferError(f"{what} holds {len(arr)} blocks; expected {count}")
        blocks = []  # the binding takes lists (and tuples) of buffers, not any sequence
        for i, item in enumerate(arr):
            block = buffer_array(item, f"{what}[{i}]", writable=writable)
            if block.nbytes != self.block_bytes:
                raise BufferError(
                    f"{what}[{i}] has {block.nbytes} bytes; expected a block of {self.block_bytes} bytes"
                )
            blocks.append(block)
        return blocks

    def put(self, keys: BlockKeys, objects: ObjectsArg) -> PutReport:
        """Stores ``objects[i]`` (BlockFirst bytes of one block) under ``keys[i]``.

        Keys already present are skipped (content-addressed). When full, unleased blocks are
        evicted; if none can be, the put is rejected and counted, never over capacity.
        """
        self._check_keys(keys)
        objects = self._check_blocks(objects, len(keys), "objects", writable=False)
        return PutReport._from_core(self._core.put(keys.namespace_hash, keys.raw, objects))

    def put_from_pool(
        self, keys: BlockKeys, pool: PagedPool, block_ids: Sequence[int] | np.ndarray
    ) -> PutReport:
        """Stores the engine's pool block ``block_ids[i]`` under ``keys[i]``, as :meth:`put` stores
        objects. With DRAM as the only tier each block is gathered straight into its DRAM slot (one
        copy, checksummed on the way); with SSD or remote tiers, through a staging object per
        block. Ids may repeat. Do not write those pool blocks until it returns."""
        self._check_keys(keys)
        if not isinstance(pool, PagedPool):
            raise BufferError(f"pool is {type(pool).__name__}; expected a kvtier.layout.PagedPool")
        ids = _block_ids(block_ids, pool.num_blocks)
        if ids.size != len(keys):
            raise BufferError(f"{len(keys)} keys but {ids.size} block ids; expected one block per key")
        return PutReport._from_core(self._core.put_from_pool(keys.namespace_hash, keys.raw, pool, ids))

    def lookup(self, keys: BlockKeys) -> Lookup:
        """Longest consecutive prefix of ``keys`` present, with its tiers. Pins nothing."""
        self._check_keys(keys)
        hit, tiers = self._core.lookup(keys.namespace_hash, keys.raw)
        return Lookup(hit, tuple(tiers))

    def lookup_each(self, keys: BlockKeys) -> tuple[str | None, ...]:
        """The tier holding each of ``keys``, or None, key by key: keys after a missing one are
        asked too (one call; every tier is asked once for all of them). Pins nothing."""
        self._check_keys(keys)
        return tuple(self._core.lookup_each(keys.namespace_hash, keys.raw))

    def lease(self, keys: BlockKeys) -> Lease:
        """Like :meth:`lookup`, and pins the hit prefix until the lease is released."""
        self._check_keys(keys)
        lease_id, hit, tiers = self._core.lease(keys.namespace_hash, keys.raw)
        return Lease(self, lease_id, hit, tuple(tiers))

    def load(self, lease: Lease, out: ObjectsArg) -> LoadReport:
        """Copies the first ``len(out)`` leased blocks into ``out`` (at most ``lease.hit_blocks``).

        ``out`` is an ``(n, block_bytes)`` array (or another writable buffer of that shape, e.g. a
        memoryview) or a sequence of ``n`` writable buffers of ``block_bytes`` each.
        ``loaded_blocks`` is smaller than asked only if a block failed its checksum: that block
        and those after it were not loaded (their bytes in ``out`` are unspecified). Loading the
        same corrupt copy again fails there again (``checksum_failures`` says so each time), but
        :attr:`StoreStats.checksum_failures` counts each corrupt copy once.
        """
        if not isinstance(lease, Lease) or lease._store is not self:
            raise LeaseError("lease was not issued by this store")
        if lease.released:
            raise LeaseError(f"lease {lease.id} was already released; take a new lease")
        count = self._block_count(out, "out")
        if count > lease.hit_blocks:
            raise LeaseError(f"asked to load {count} blocks; lease {lease.id} holds {lease.hit_blocks}")
        out = self._check_blocks(out, count, "out", writable=True)
        loaded, failures = self._core.load(lease.id, out, count)
        return LoadReport(loaded, failures)

    def load_into_pool(
        self,
        lease: Lease,
        pool: PagedPool,
        block_ids: Sequence[int] | np.ndarray,
        *,
        first: int = 0,
        progress: LayerProgress | None = None,
    ) -> PoolLoadReport:
        """Copies leased blocks ``first..first + len(block_ids)`` straight into the engine's pool
        blocks ``block_ids`` (one copy from DRAM, no staging object), layer by layer, verifying
        every block. ``progress`` (a :data:`LayerProgress`) advances as each layer of every block
        lands; it is not closed here. A progress serves one load (it never moves back, so a second
        load's waiters would not wait): one already given to a load, or closed, is refused
        (:class:`BufferError`), unless that load failed before copying.

        A block that fails verification is in ``failed`` only once the call returns, after its
        layers were announced: drop whatever was computed from it. Errors before any copy: the
        lease errors of :meth:`load`; a pool whose objects are not ``block_bytes``
        (:class:`BufferError`); block ids out of range or repeated (:class:`LayoutError`).
        """
        if not isinstance(lease, Lease) or lease._store is not self:
            raise LeaseError("lease was not issued by this store")
        if lease.released:
            raise LeaseError(f"lease {lease.id} was already released; take a new lease")
        if not isinstance(pool, PagedPool):
            raise BufferError(f"pool is {type(pool).__name__}; expected a kvtier.layout.PagedPool")
        if pool.block_bytes != self.config.geometry.block_bytes:
            raise BufferError(
                f"pool blocks hold {pool.block_bytes} bytes; expected {self.config.geometry.block_bytes} "
                "(this store's block_bytes)"
            )
        if isinstance(first, bool) or not isinstance(first, int) or first < 0:
            raise LeaseError(f"first is {first!r}; expected an int >= 0")
        ids = _block_ids(block_ids, pool.num_blocks)
        if first + ids.size > lease.hit_blocks:
            raise LeaseError(
                f"asked to load blocks {first}..{first + ids.size}; lease {lease.id} holds {lease.hit_blocks}"
            )
        loaded, failed, failures = self._core.load_into_pool(lease.id, first, pool, ids, progress)
        return PoolLoadReport(loaded, tuple(failed), failures)

    def stats(self) -> StoreStats:
        return self._core.stats()

    def tier_stats(self) -> dict[str, TierStats]:
        """Each tier's counters, by tier name (``"dram"``, ``"ssd"``), fastest first."""
        return self._core.tier_stats()

    def ssd_metrics(self) -> SsdMetrics | None:
        """The SSD pool's metrics (JSON-ready), or ``None`` without an SSD tier.

        Per device: bytes and operations read/written, I/O errors, queue depth (now and max),
        read/write latency p50/p99 (seconds), bandwidth and placement share, objects and bytes
        used. Pool: lookup hits/misses, evictions, checksum failures, index-log records,
        compactions, ``recovery`` (objects recovered, records dropped, seconds), ``warnings``.
        """
        return self._core.ssd_metrics()

    def remote_metrics(self) -> RemoteMetrics | None:
        """The remote tier's metrics (JSON-ready), or ``None`` without a remote tier.

        Per operation (``exists``, ``get``, ``set``, ``del``): batches, keys, bytes, errors,
        latency p50/p99 (seconds). Faults: ``connects``, ``reconnects``, ``connect_failures``,
        ``auth_failures``, ``down_misses`` (keys missed because their server was down),
        ``down_skipped_writes``, ``missing_on_get``, and values that were not this namespace's
        objects: ``bad_magic``, ``bad_length``, ``bad_checksum``, ``foreign_objects``. Cluster:
        ``redirects``, ``slot_refreshes``, ``nodes``, ``nodes_down``.
        """
        return self._core.remote_metrics()

    def clear(self) -> int:
        """Drops every block of this store's namespace from every tier and returns how many:
        what to call when the model's weights change under the same name (keys cannot tell).

        Other namespaces sharing the SSD pool or the Redis keep theirs; every process sharing
        this namespace's remote tier loses it too. A barrier within this process: it waits for
        the puts and loads in flight (and holds new ones back while it runs), so once it returns no
        write that began before it lands in any tier, and leases granted before it load nothing
        (misses). Writers in other processes sharing the remote tier are not fenced. The SSD tier's
        deletes are synced to its index log (a restart does not bring them back). Raises
        :class:`kvtier.errors.StoreError` if a tier could not be cleared (Redis down), after
        clearing the others.
        """
        return int(self._core.clear())

    def flush(self) -> None:
        """Makes every block the SSD tier holds durable now (``ssd.durability="none"`` otherwise
        leaves the index log's tail to the page cache until the store closes)."""
        self._core.flush()

    def check_integrity(self) -> None:
        """Raises :class:`kvtier.errors.IntegrityError` if an internal invariant does not hold."""
        self._core.check_integrity()

    def _corrupt_for_test(self, key: int, payload_byte_offset: int) -> bool:
        """Flips one stored bit (tests only): the next load of that block must fail its checksum.

        False, changing nothing, if the block is absent or leased (a load may be reading it).
        Only in builds with the ``test-hooks`` feature (``make build``; wheels leave it out).
        """
        hook = getattr(self._core, "corrupt_for_test", None)
        if hook is None:
            raise KvtierError("this kvtier build has no test hooks (build it with `make build`)")
        return bool(hook(key.to_bytes(16, "little"), payload_byte_offset))
