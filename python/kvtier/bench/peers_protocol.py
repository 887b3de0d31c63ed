"""What ``kvtier bench peers`` (:mod:`kvtier.bench.peers`) and its worker processes
(:mod:`kvtier.bench.peers_worker`, :mod:`kvtier.bench.peers_ssd`) pass each other as JSON. The
workers run where kvtier is not installed, so they import these types for checking only."""

from __future__ import annotations

from typing import TypedDict


class Spec(TypedDict, total=False):
    """A round's settings, as :func:`kvtier.bench.peers.run` hands them to a worker."""

    seed: int
    bytes: int
    lookup_tokens: int
    lookup_repeats: int
    copy_threads: int
    ssd_bytes: int
    ssd_codec: str  # kvtier's ssd.codec in the ssd rows
    ssd_root: str
    ssd_directory: str  # the cold get's: the ``ssd_put`` directory it reopens
    #: The ssd rows': the real KV their objects' values are drawn from (kvtier.bench.kv_fixture).
    kv_fixture: str
    redis_url: str | None
    redis_server: dict[str, str] | None
    metadata: str  # Mooncake's metadata server and master
    master: str
    segment_bytes: int


class WorkerResult(TypedDict, total=False):
    """One worker's ``RESULT`` line: seconds per operation, the bytes moved and, where a row has
    one, the memcpy of the same bytes in the same process; the cold-get child's three figures; or
    ``error`` (set by :func:`kvtier.bench.peers.worker`) when the worker failed. Read back through
    :func:`kvtier.bench.peers.parse_result`."""

    ops: dict[str, float]
    memcpy_s: float
    bytes: int
    config: str
    get_s: float
    resident_bytes: int
    device_read_bytes: int
    stored_bytes: int  # the cold get: bytes its objects hold on the device (after the codec)
    error: str
