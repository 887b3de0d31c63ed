"""The rows of ``kvtier bench peers`` (:mod:`kvtier.bench.peers`), its typed result, the per-round
ratios with their median and range, and the summary table: pure functions of the workers'
:class:`~kvtier.bench.peers_worker.WorkerResult`, no processes or I/O."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TypeAlias

from kvtier.bench.peers_protocol import WorkerResult
from kvtier.results import OMIT, Result, Spread


@dataclass(frozen=True)
class Row:
    key: str
    label: str
    part: str  # which worker run measures it
    op: str  # the operation's name in both workers' results
    peer: str
    vs_memcpy: bool  # whether each side's share of memcpy is reported


ROWS = (
    Row("dram_store", "DRAM store (hash + put)", "dram", "store", "lmcache", True),
    Row(
        "dram_retrieve", "DRAM retrieve (hash + lease + load + release)", "dram", "retrieve", "lmcache", True
    ),
    Row("pool_store", "store from a paged pool (put_from_pool)", "dram", "pool_store", "lmcache", True),
    Row(
        "pool_retrieve",
        "retrieve into a paged pool (load_into_pool)",
        "dram",
        "pool_retrieve",
        "lmcache",
        True,
    ),
    Row("lookup_list", "hash + lookup of 128K tokens, Python list", "lookup", "list", "lmcache", False),
    Row("lookup_array", "hash + lookup of 128K tokens, int64 array", "lookup", "array", "lmcache", False),
    Row("remote_put", "remote put, 32 x 4 MiB (Redis vs Mooncake TCP)", "remote", "put", "mooncake", False),
    Row("remote_get", "remote get, 32 x 4 MiB (Redis vs Mooncake TCP)", "remote", "get", "mooncake", False),
    Row(
        "ssd_put",
        "SSD put, both in the page cache (write-through, direct_io=False vs LocalDiskBackend, writes done)",
        "ssd",
        "ssd_put",
        "lmcache",
        True,
    ),
    Row(
        "ssd_direct_put",
        "SSD put, kvtier on the device (O_DIRECT) vs LMCache in the page cache",
        "ssd",
        "ssd_direct_put",
        "lmcache",
        True,
    ),
    Row(
        "ssd_durable_put",
        "SSD durable put (fsync mode vs LocalDiskBackend + fsync of its files)",
        "ssd",
        "ssd_durable_put",
        "lmcache",
        True,
    ),
    Row("ssd_cold_get", "SSD cold get (page cache cold, DRAM empty)", "ssd", "ssd_cold_get", "lmcache", True),
)
PARTS = {"dram": "lmcache", "lookup": "lmcache", "remote": "mooncake", "ssd": "lmcache"}
NOT_MEASURED = {
    "lmcache_odirect": "LMCache's LocalDiskBackend with extra_config use_odirect=True (off by default) is "
    "not measured: the ssd rows run its default, buffered file I/O (kvtier: buffered in ssd_put, O_DIRECT in the others)",
}


#: One round: per part, each side's :class:`WorkerResult` under its name and ``load_avg_1m``.
PartRound: TypeAlias = dict[str, "WorkerResult | float"]
Round: TypeAlias = dict[str, PartRound]


@dataclass(frozen=True)
class PeerRow(Result):
    """One table row: spreads over the rounds, or ``not_run`` with the reason."""

    key: str
    label: str
    peer: str
    not_run: str | None = field(default=None, metadata=OMIT)
    kvtier_s: Spread | None = field(default=None, metadata=OMIT)
    peer_s: Spread | None = field(default=None, metadata=OMIT)
    speed_ratio: Spread | None = field(default=None, metadata=OMIT)
    kvtier_vs_memcpy: Spread | None = field(default=None, metadata=OMIT)
    peer_vs_memcpy: Spread | None = field(default=None, metadata=OMIT)
    load_avg_1m: Spread | None = field(default=None, metadata=OMIT)


@dataclass(frozen=True)
class PeersResult(Result):
    """What ``kvtier bench peers`` reports (``--json`` prints :meth:`as_dict`)."""

    bytes: int
    rounds: int
    parts: list[str]
    copy_threads: int
    versions: dict[str, str | None]
    unavailable: dict[str, str]
    not_measured: dict[str, str]
    rows: list[PeerRow]
    ssd_bytes: int = 0
    ssd_filesystem: str | None = None
    ssd_codec: str = "raw"  # kvtier's ssd.codec in the ssd rows
    redis_server: dict[str, str] | None = None
    python: str = ""
    per_round: list[Round] = field(default_factory=list)
    bench: str = "peers"


# ---------------------------------------------------------------- aggregation and the table
def _side(part: PartRound, side: str) -> WorkerResult:
    value = part.get(side, {})
    return value if isinstance(value, dict) else {}


def _load(part: PartRound) -> float:
    value = part["load_avg_1m"]
    assert isinstance(value, float | int)
    return float(value)


def aggregate(
    per_round: list[Round], unavailable: dict[str, str], parts: tuple[str, ...] = tuple(PARTS)
) -> list[PeerRow]:
    """Per row of ``parts``: each side ÷ memcpy and kvtier's speed ÷ the peer's, per round (both
    from the same round's processes), with median and range; or why the row did not run."""
    rows = []
    for row in (row for row in ROWS if row.part in parts):
        errors = [
            side["error"]
            for done in per_round
            for side in (_side(done.get(row.part, {}), "kvtier"), _side(done.get(row.part, {}), row.peer))
            if "error" in side
        ]
        measured = [p[row.part] for p in per_round if row.part in p]
        if row.peer in unavailable or errors or not measured:
            rows.append(
                PeerRow(
                    row.key,
                    row.label,
                    row.peer,
                    not_run=unavailable.get(row.peer) or (errors[0] if errors else "no rounds ran"),
                )
            )
            continue
        kv = [_side(m, "kvtier") for m in measured]
        peer = [_side(m, row.peer) for m in measured]
        memcpy = row.vs_memcpy
        rows.append(
            PeerRow(
                row.key,
                row.label,
                row.peer,
                kvtier_s=Spread.of([k["ops"][row.op] for k in kv]),
                peer_s=Spread.of([p["ops"][row.op] for p in peer]),
                speed_ratio=Spread.of(
                    [p["ops"][row.op] / k["ops"][row.op] for k, p in zip(kv, peer, strict=True)]
                ),
                kvtier_vs_memcpy=Spread.of([k["memcpy_s"] / k["ops"][row.op] for k in kv])
                if memcpy
                else None,
                peer_vs_memcpy=Spread.of([p["memcpy_s"] / p["ops"][row.op] for p in peer])
                if memcpy
                else None,
                load_avg_1m=Spread.of([_load(m) for m in measured]),
            )
        )
    return rows


def _cell(s: Spread | None) -> str:
    if s is None:
        return "-"
    return f"{s.median:.2f} ({s.min:.2f}-{s.max:.2f})"


def summary(r: PeersResult) -> str:
    v = r.versions
    parts = r.parts
    lines = [
        f"bench peers: {r.bytes / 2**30:.2f} GiB of Llama-3-8B bf16 KV per round (dram rows), {r.rounds} rounds, "
        f"kvtier and peer alternating; lmcache {v.get('lmcache')}, mooncake "
        f"{v.get('mooncake-transfer-engine-non-cuda')}, torch {v.get('torch')}; parts {','.join(parts)}",
        f"kvtier copy threads {r.copy_threads} (0 = one per core); LMCache's numpy copies use one; "
        "memcpy is one thread; median (min-max) over rounds; speed ratio above 1 = kvtier faster",
    ]
    if "ssd" in parts:
        lines.append(
            f"ssd rows: {r.ssd_bytes / 2**20:.0f} MiB of KV-like bf16 values per round on "
            f"{r.ssd_filesystem}; kvtier write-through, codec {r.ssd_codec}, put into the "
            "page cache (direct_io=False), O_DIRECT put, fsync put, O_DIRECT cold get; LMCache "
            "LocalDiskBackend, buffered, timed until its writes are done"
        )
    if r.redis_server:
        rs = r.redis_server
        lines.append(f"remote rows: {rs['version'].split(' sha=')[0]}, MALLOC_CONF={rs['malloc_conf']}")
    lines += [
        "",
        "| work | kvtier ÷ memcpy | peer ÷ memcpy | kvtier speed ÷ peer | peer | load avg 1m |",
        "|---|---|---|---|---|---|",
    ]
    for row in r.rows:
        if row.not_run is not None:
            why = row.not_run.strip().splitlines()[0][:160]
            lines.append(f"| {row.label} | - | - | not run: {why} | {row.peer} | - |")
            continue
        lines.append(
            f"| {row.label} | {_cell(row.kvtier_vs_memcpy)} | {_cell(row.peer_vs_memcpy)} "
            f"| **{_cell(row.speed_ratio)}** | {row.peer} | {_cell(row.load_avg_1m)} |"
        )
    for name, why in {**r.not_measured, **r.unavailable}.items():
        lines.append(f"{name}: {why.strip().splitlines()[0][:200]}")
    return "\n".join(lines)
