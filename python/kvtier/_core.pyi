"""Type stubs of the Rust extension. Use the Python wrappers (kvtier.Store, kvtier.layout, ...)."""

from collections.abc import Mapping
from typing import Any, TypedDict

from kvtier.schema import Section
from kvtier.transfer import TransferConfig

class GeometrySizes(TypedDict):
    dtype: str
    dtype_bytes: int
    segment_bytes: int
    layer_block_bytes: int
    kv_block_bytes: int
    block_bytes: int
    bytes_per_token: int
    pool_bytes_per_block: int

class SsdRecovery(TypedDict):
    records: int
    recovered_objects: int
    invalid_records: int
    overwritten_entries: int
    dropped_tail_bytes: int
    seconds: float

class SsdDevice(TypedDict):
    path: str
    direct_io: bool
    block_device: bool
    read_bytes_per_s: float
    write_bytes_per_s: float
    placement_share: float
    throttle_bytes_per_s: float
    objects: int
    used_bytes: int
    capacity_bytes: int
    bytes_read: int
    bytes_written: int
    read_ops: int
    write_ops: int
    io_errors: int
    queue_depth: int
    queue_depth_max: int
    read_p50_s: float
    read_p99_s: float
    write_p50_s: float
    write_p99_s: float

class TierStatsDict(TypedDict):
    """The fields of the Rust ``TierStats`` (``crates/kvtier-core/src/tier.rs``) as a dict:
    :meth:`TierStats.as_dict`, and the tier part of :class:`SsdMetrics`."""

    objects: int
    pinned_objects: int
    doomed_objects: int
    used_bytes: int
    capacity_bytes: int
    stored: int
    evictions: int
    rejected: int
    checksum_failures: int

class SsdMetrics(TierStatsDict):
    """``crates/kvtier-py/src/ssd.rs::metrics_dict``: the pool's own fields beside its
    ``TierStats``'s (:class:`TierStatsDict`)."""

    engine: str
    durability: str
    placement: str
    bandwidth_source: str
    lookup_hits: int
    lookup_misses: int
    write_failures: int
    read_io_errors: int
    log_failures: int
    log_records: int
    log_bytes: int
    log_generation: int
    compactions: int
    recovery: SsdRecovery
    devices: list[SsdDevice]
    warnings: list[str]

class RemoteOp(TypedDict):
    batches: int
    keys: int
    bytes: int
    errors: int
    latency_p50_s: float
    latency_p99_s: float

# ``crates/kvtier-py/src/remote.rs::metrics_dict`` (functional form: ``del`` is a keyword).
RemoteMetrics = TypedDict(
    "RemoteMetrics",
    {
        "exists": RemoteOp, "get": RemoteOp, "set": RemoteOp, "del": RemoteOp, "connects": int,
        "reconnects": int, "connect_failures": int, "auth_failures": int, "down_misses": int,
        "down_skipped_writes": int, "missing_on_get": int, "bad_magic": int, "bad_length": int,
        "bad_checksum": int, "foreign_objects": int, "redirects": int, "slot_refreshes": int,
        "nodes": int, "nodes_down": int,
    },
)  # fmt: skip

class StoreStats:
    """``Store.stats()``: the Rust ``StoreStats`` (``crates/kvtier-store/src/stats.rs``), each field
    a read-only attribute (``crates/kvtier-py/src/reports.rs``)."""

    lookups: int
    hit_blocks: int
    miss_blocks: int
    put_blocks: int
    put_bytes: int
    loaded_blocks: int
    loaded_bytes: int
    evictions: int
    rejected_puts: int
    checksum_failures: int
    leases_active: int
    leases_expired: int
    #: Blocks DRAM gave up that are now in the SSD tier (written there, or already there).
    demoted_blocks: int
    #: Blocks DRAM gave up without writing them to SSD (fewer accesses than ``ssd.admission_k``).
    admission_skipped: int
    #: Blocks DRAM gave up that the SSD tier refused (full of leased blocks, or an I/O error).
    demotion_failed: int
    #: Blocks loaded from SSD and copied into DRAM.
    promoted_blocks: int
    #: Blocks written to SSD at put time (``ssd.write_through``).
    written_through: int
    #: Blocks DRAM evicted without trying SSD (after a put's bounded demotion rounds).
    dropped_evictions: int
    #: Blocks written to the remote tier (write-through, or write-back from DRAM), or already there.
    remote_written: int
    #: Blocks the remote tier did not take (server down or failing); the put still succeeded.
    remote_write_failed: int
    #: Leased blocks gone when loaded (a remote server dropped them, or is down): misses.
    load_missing: int
    #: Blocks the SSD codec (``ssd.codec``) encoded as they were written, their raw bytes and the
    #: bytes stored (object header + codec payload); blocks stored raw because the codec refused
    #: them (NaN/inf for ``quant``) or they would not shrink.
    ssd_encoded_blocks: int
    ssd_encoded_bytes_before: int
    ssd_encoded_bytes_after: int
    ssd_encode_fallbacks: int
    #: The same for the remote tier (``remote.codec``).
    remote_encoded_blocks: int
    remote_encoded_bytes_before: int
    remote_encoded_bytes_after: int
    remote_encode_fallbacks: int
    #: Stored codec objects (SSD or remote) that passed their tier's checksum but failed to decode
    #: (unknown codec id, corrupt codec payload): each a miss, dropped from its tier, also counted
    #: in ``checksum_failures``.
    decode_failures: int
    #: Summed over tiers (a block in DRAM and in SSD counts in both); see :meth:`Store.tier_stats`.
    objects: int
    used_bytes: int
    capacity_bytes: int
    def as_dict(self) -> dict[str, int]: ...

class TierStats:
    """Counters and gauges of one tier (``Store.tier_stats()``): the Rust ``TierStats``
    (``crates/kvtier-core/src/tier.rs``), as :class:`StoreStats`: the attributes are the keys of
    :class:`TierStatsDict`, in its order (``tests/test_core_stub_dicts.py`` checks both)."""

    objects: int
    pinned_objects: int
    doomed_objects: int
    used_bytes: int
    capacity_bytes: int
    stored: int
    evictions: int
    rejected: int
    checksum_failures: int
    def as_dict(self) -> TierStatsDict: ...

class CoreGeometry:
    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: str,
        block_tokens: int,
        extra_groups: list[tuple[str, int]],
    ) -> None: ...
    def sizes(self) -> GeometrySizes: ...
    def namespace_hash(self, model_id: str, layout_version: int, cache_salt: str, rank: int) -> bytes: ...

class Copier:
    threads: int
    def __init__(self, threads: int) -> None: ...
    def copy(
        self,
        gather: bool,
        geometry: CoreGeometry,
        src: Any,
        num_blocks: int,
        block_ids: Any,
        dst: Any,
        per_segment: bool,
    ) -> tuple[int, int, int]: ...

class LayerProgress:
    def __init__(self) -> None: ...
    def wait(self, layer: int, timeout_s: float | None = None) -> bool: ...
    @property
    def done_layers(self) -> int: ...
    def close(self) -> None: ...
    @property
    def closed(self) -> bool: ...

class Store:
    namespace_hash: bytes
    block_bytes: int
    def __init__(self, config: Section | Mapping[str, Any]) -> None: ...
    def put(
        self, namespace_hash: bytes, keys: bytes, objects: Any
    ) -> tuple[int, int, int, int, int, int, int]: ...
    def lookup(self, namespace_hash: bytes, keys: bytes) -> tuple[int, list[str]]: ...
    def lookup_each(self, namespace_hash: bytes, keys: bytes) -> list[str | None]: ...
    def lease(self, namespace_hash: bytes, keys: bytes) -> tuple[int, int, list[str]]: ...
    def load(self, lease_id: int, out: Any, count: int) -> tuple[int, int]: ...
    # `pool`: a kvtier.layout.PagedPool (its regions, layer_regions and num_blocks are read).
    def put_from_pool(
        self, namespace_hash: bytes, keys: bytes, pool: Any, block_ids: Any
    ) -> tuple[int, int, int, int, int, int, int]: ...
    def load_into_pool(
        self, lease_id: int, first: int, pool: Any, block_ids: Any, progress: LayerProgress | None = None
    ) -> tuple[int, list[int], int]: ...
    def release(self, lease_id: int) -> None: ...
    def stats(self) -> StoreStats: ...
    def tier_stats(self) -> dict[str, TierStats]: ...
    def ssd_metrics(self) -> SsdMetrics | None: ...
    def remote_metrics(self) -> RemoteMetrics | None: ...
    def clear(self) -> int: ...
    def flush(self) -> None: ...
    def check_integrity(self) -> None: ...
    # Only with the `test-hooks` feature (make build); absent from wheels.
    def corrupt_for_test(self, key: bytes, payload_byte_offset: int) -> bool: ...

class SsdPool:
    def __init__(self, config: Section | Mapping[str, Any]) -> None: ...
    def put(
        self, namespace_hash: bytes, keys: bytes, objects: Any, object_bytes: int
    ) -> tuple[int, int, int, int]: ...
    def get(self, namespace_hash: bytes, keys: bytes, out: Any, object_bytes: int) -> list[str]: ...
    def metrics(self) -> SsdMetrics: ...
    def check_integrity(self) -> None: ...
    def flush(self) -> None: ...
    def close(self) -> None: ...

class RemotePool:
    def __init__(self, config: Section | Mapping[str, Any], namespace_hash: bytes) -> None: ...
    def key_name(self, key: bytes) -> bytes: ...
    def put(self, keys: bytes, objects: Any, block_bytes: int) -> tuple[int, int, int]: ...
    def get(self, keys: bytes, out: Any, block_bytes: int) -> list[str]: ...
    def exists(self, keys: bytes) -> list[bool | None]: ...
    def remove(self, keys: bytes) -> int: ...
    def raw_set(self, names: list[bytes], values: Any, value_bytes: int) -> list[str]: ...
    def raw_get(self, names: list[bytes], out: Any, value_bytes: int) -> list[str]: ...
    def raw_del(self, names: list[bytes]) -> int: ...
    def metrics(self) -> RemoteMetrics: ...

def ssd_placement_counts(bandwidths: list[float], n: int) -> list[int]: ...
def ssd_raw_sequential(
    path: str, total_bytes: int, chunk_bytes: int, write: bool, depth: int, buffer_bytes: int
) -> float: ...
def ssd_file_per_object(directory: str, count: int, buffer: Any, write: bool) -> float: ...
def block_keys(namespace_hash: bytes, tokens: Any, block_tokens: int, extra: bytes) -> bytes: ...
def encode_object(namespace_hash: bytes, key: bytes, payload: Any) -> bytes: ...
def decode_object(data: Any) -> tuple[bytes, bytes, int, bytes]: ...
def memcpy(dst: Any, src: Any) -> None: ...
def checksum(data: Any) -> int: ...
def redact_url(url: str) -> str: ...
def check_url(url: str) -> None: ...
def codec_encode_lossless(
    data: Any, backend: str, level: int | None = None, element_bytes: int = 2
) -> bytes: ...
def codec_encode_quant(
    data: Any,
    first_layer: int,
    block_tokens: int,
    num_kv_heads: int,
    head_dim: int,
    key_bins: list[int],
    value_bins: list[int],
    backend: str,
    level: int | None = None,
) -> bytes: ...
def codec_decoded_len(codec_id: int, payload: Any) -> int: ...
def codec_decode(codec_id: int, payload: Any, out: Any) -> int: ...

class TransferEngine:
    def __init__(self, store: Store, config: TransferConfig | Mapping[str, Any]) -> None: ...
    def submit(
        self, load: bool, keys: bytes, pool: Any, block_ids: bytes, num_blocks: int | None = None
    ) -> int: ...
    def submit_paged(self, load: bool, keys: bytes, pool: Any, block_ids: bytes) -> int: ...
    def finished(self) -> list[tuple[int, str, list[str], bool, int, float]]: ...
    def wait(self, ids: list[int]) -> list[tuple[int, str, list[str], bool, int, float]]: ...
    def wait_layer(self, id: int, layer: int) -> None: ...
    def outcomes(self, id: int) -> list[str]: ...
    def cancel(self, id: int) -> bool: ...
    def jobs(self) -> int: ...
    def stage_stats(self) -> list[tuple[str, int, float, int, int, int]]: ...
    # Only with the `test-hooks` feature (make build); absent from wheels.
    def panic_for_test(self, site: str, nth: int) -> None: ...
    def load_sequential(
        self,
        keys: bytes,
        pool: Any,
        block_ids: bytes,
        num_blocks: int | None = None,
        per_chunk: bool = False,
    ) -> tuple[tuple[int, str, list[str], bool, int, float], list[float]]: ...

class DuplexEngine:
    def __init__(
        self, geometry: CoreGeometry, device: Any, host: Any, queued_transfers_max: int, step_blocks_max: int
    ) -> None: ...
    def state(self, dev: int) -> tuple[str, int | None]: ...
    def write(self, dev: int) -> None: ...
    def wait_block(self, dev: int) -> None: ...
    def rotate(self, dev: int, host: int) -> None: ...
    def swap_out(self, dev: int, host: int) -> bool: ...
    def swap_in(self, host: int, dev: int) -> None: ...
    def free(self, dev: int) -> None: ...
    def dirty_blocks(self, devs: list[int]) -> list[int]: ...
    def submit_step(self) -> tuple[int | None, int | None]: ...
    def swap_out_per_segment(self, pairs: list[tuple[int, int]]) -> int | None: ...
    def wait(self, seq: int) -> None: ...
    def wait_all(self) -> None: ...
    # Only with the `test-hooks` feature (make build); absent from wheels.
    def panic_for_test(self, nth: int) -> None: ...
    @staticmethod
    def on_cuda(
        geometry: CoreGeometry,
        device_blocks: int,
        host: Any,
        queued_transfers_max: int,
        step_blocks_max: int,
        device: int,
    ) -> DuplexEngine: ...
    def read_block(self, dev: int, out: Any) -> None: ...
    def write_block(self, dev: int, data: Any) -> None: ...

def cuda_link_duplex(nbytes: int, rounds: int, device: int) -> tuple[float, float, float]: ...
def balanced_stage_workers(
    rates_bytes_per_s: tuple[float, float, float, float], threads: int
) -> list[int]: ...

__version__: str
#: The store's tier names, fastest first (``Lookup.tiers``, ``tier_stats()``); ``kvtier.tiers`` maps them.
STORE_TIERS: tuple[str, ...]
