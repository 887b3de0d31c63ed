"""A real GPU's measurement (``scripts/gpu_calibrate.py``, ``scripts/gpu_links.cu``) read once into
typed values, for :mod:`kvtier.sim.gpu_check`.

The file is untrusted JSON: :func:`parse` checks every field it reads (its kind, and that every
time is a positive, finite number of seconds) and a :class:`ConfigError` names the part, the row
and the field that is missing or wrong. Parts are optional (a run may time only steps or only
copies); what is absent is ``None``. The ``machine`` description and the ``kvtier`` part are also
kept as written, since the check's report echoes them.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from kvtier.errors import ConfigError, KvtierError
from kvtier.results import field_of
from kvtier.sim.cost import BatchShape, PrefillChunk

T = TypeVar("T")
HINT = "is this a scripts/gpu_calibrate.py output?"


@dataclass(frozen=True)
class StepRow:
    shape: BatchShape
    seconds: float
    clock: str  # "graph" (CUDA-graph replay) or "eager"


@dataclass(frozen=True)
class Steps:
    """One forward step per batch shape (``steps``, or ``steps_repeat``: the same shapes again)."""

    model: str | None
    attention: str | None
    rows: tuple[StepRow, ...]


@dataclass(frozen=True)
class Copies:
    """Copies of ``bytes`` in ``segments`` segments of ``segment_bytes`` one way (``direction``)."""

    direction: str
    segment_bytes: int
    segments: int
    bytes: int


@dataclass(frozen=True)
class CopyRow(Copies):
    """``links``: torch ``copy_`` per segment taking ``per_segment_s``, and one copy of everything
    taking ``one_copy_s``."""

    per_segment_s: float
    one_copy_s: float


@dataclass(frozen=True)
class Links:
    rows: tuple[CopyRow, ...]
    duplex_bytes: int
    duplex_s: float  # both directions at once


@dataclass(frozen=True)
class CppCopyRow(Copies):
    """``links_cpp``: ``method`` is ``memcpy_async_per_segment`` or ``gather_kernel``."""

    seconds: float
    method: str


@dataclass(frozen=True)
class OverlapRow:
    """A step timed alone and with ``copy_bytes`` of DMA copies in flight on another stream."""

    prefills: tuple[PrefillChunk, ...]
    decodes: int
    direction: str
    step_alone_s: float
    step_together_s: float
    copy_bytes: int
    copy_alone_s: float
    copy_together_s: float


@dataclass(frozen=True)
class CopyTimes:
    put_s: float
    load_s: float
    h2d_s: float
    memcpy_s: float


@dataclass(frozen=True)
class KvtierCopies:
    """``kvtier``: the DRAM tier's put and lease+load of ``bytes``, per copy-thread count."""

    bytes: int
    threads: tuple[tuple[int, CopyTimes], ...]  # ascending thread counts
    raw: Mapping[str, object]  # as written (echoed by the report)


@dataclass(frozen=True)
class Measurement:
    machine: Mapping[str, object]  # as written (echoed by the report)
    gpu: str  # torch's name for the GPU, "" where not recorded
    steps: Steps | None
    steps_repeat: Steps | None
    links: Links | None
    links_cpp: tuple[CppCopyRow, ...] | None
    overlap: tuple[OverlapRow, ...] | None
    kvtier: KvtierCopies | None


def read(path: Path) -> Measurement:
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(f"{path}: not a readable JSON file: {e}") from e
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a JSON object")
    return parse(data, str(path))


def parse(data: Mapping[str, object], where: str = "measurement") -> Measurement:
    """``data`` (a measurement file's JSON object) checked and typed; see the module docs."""
    machine = _get(data, "machine", dict, where)
    gpu = _get(machine, "gpu", str, f"{where}: machine") if "gpu" in machine else ""
    links_cpp = _part(data, "links_cpp", where)
    overlap = _part(data, "overlap", where)
    return Measurement(
        machine=machine,
        gpu=gpu,
        steps=_steps(data, "steps", where),
        steps_repeat=_steps(data, "steps_repeat", where),
        links=_links(data, where),
        links_cpp=None
        if links_cpp is None
        else tuple(_cpp_row(r, w) for r, w in _rows(links_cpp, "links_cpp")),
        overlap=None if overlap is None else tuple(_overlap_row(r, w) for r, w in _rows(overlap, "overlap")),
        kvtier=_kvtier(data, where),
    )


def _get(data: Mapping[str, object], key: str, kind: type[T], where: str) -> T:
    try:
        return field_of(data, key, kind, where)
    except KvtierError as e:
        raise ConfigError(f"{e} ({HINT})") from None


def _seconds(data: Mapping[str, object], key: str, where: str) -> float:
    seconds = _get(data, key, float, where)
    if not (seconds > 0 and math.isfinite(seconds)):
        raise ConfigError(f"{where}: `{key}` is {seconds!r}; expected a positive number of seconds")
    return seconds


def _part(data: Mapping[str, object], key: str, where: str) -> dict[str, object] | None:
    return _get(data, key, dict, where) if key in data else None


def _rows(part: Mapping[str, object], name: str) -> list[tuple[Mapping[str, object], str]]:
    """``part["rows"]``, each a JSON object, with the name an error gives it (``steps.rows[3]``)."""
    rows = _get(part, "rows", list, name)
    for i, row in enumerate(rows):
        if not isinstance(row, dict):
            raise ConfigError(f"{name}.rows[{i}] is {row!r}; expected a JSON object")
    return [(row, f"{name}.rows[{i}]") for i, row in enumerate(rows)]


def _int(value: object, where: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ConfigError(f"{where} is {value!r}; expected a non-negative whole number")
    return value


def _prefills(row: Mapping[str, object], where: str) -> tuple[PrefillChunk, ...]:
    chunks = []
    for i, pair in enumerate(_get(row, "prefills", list, where)):
        if not (isinstance(pair, list) and len(pair) == 2):
            raise ConfigError(f"{where}: `prefills`[{i}] is {pair!r}; expected [new tokens, context tokens]")
        chunks.append(
            PrefillChunk(
                _int(pair[0], f"{where}: `prefills`[{i}][0]"), _int(pair[1], f"{where}: `prefills`[{i}][1]")
            )
        )
    return tuple(chunks)


def _steps(data: Mapping[str, object], key: str, where: str) -> Steps | None:
    part = _part(data, key, where)
    if part is None:
        return None
    rows = []
    for raw, at in _rows(part, key):
        decodes = tuple(
            _int(c, f"{at}: `decodes`[{i}]") for i, c in enumerate(_get(raw, "decodes", list, at))
        )
        clock = "graph" if "graph_s" in raw else "eager"
        rows.append(StepRow(BatchShape(_prefills(raw, at), decodes), _seconds(raw, f"{clock}_s", at), clock))
    if not rows:
        raise ConfigError(f"{where}: `{key}` has no step rows")
    model, attention = part.get("model"), part.get("attention")
    return Steps(
        None if model is None else _get(part, "model", str, key),
        None if attention is None else _get(part, "attention", str, key),
        tuple(rows),
    )


def _links(data: Mapping[str, object], where: str) -> Links | None:
    part = _part(data, "links", where)
    if part is None:
        return None
    rows = tuple(
        CopyRow(*_copies(r, at), _seconds(r, "per_segment_s", at), _seconds(r, "one_copy_s", at))
        for r, at in _rows(part, "links")
    )
    return Links(rows, _get(part, "duplex_bytes", int, "links"), _seconds(part, "duplex_s", "links"))


def _copies(r: Mapping[str, object], at: str) -> tuple[str, int, int, int]:
    """:class:`Copies`' fields of row ``r``, in their order."""
    return (
        _get(r, "direction", str, at),
        _get(r, "segment_bytes", int, at),
        _get(r, "segments", int, at),
        _get(r, "bytes", int, at),
    )


def _cpp_row(r: Mapping[str, object], at: str) -> CppCopyRow:
    return CppCopyRow(*_copies(r, at), _seconds(r, "seconds", at), _get(r, "method", str, at))


def _overlap_row(r: Mapping[str, object], at: str) -> OverlapRow:
    return OverlapRow(
        _prefills(r, at),
        _int(_get(r, "decodes", int, at), f"{at}: `decodes`"),
        _get(r, "direction", str, at),
        _seconds(r, "step_alone_s", at),
        _seconds(r, "step_together_s", at),
        _get(r, "copy_bytes", int, at),
        _seconds(r, "copy_alone_s", at),
        _seconds(r, "copy_together_s", at),
    )


def _kvtier(data: Mapping[str, object], where: str) -> KvtierCopies | None:
    part = _part(data, "kvtier", where)
    if part is None:
        return None
    threads = []
    for key in part:
        if key.startswith("threads_"):
            at = f"kvtier: {key}"
            count = key.removeprefix("threads_")
            if not count.isdigit():
                raise ConfigError(f"kvtier: `{key}` is not threads_<count>")
            times = _get(part, key, dict, "kvtier")
            threads.append(
                (
                    int(count),
                    CopyTimes(*(_seconds(times, k, at) for k in ("put_s", "load_s", "h2d_s", "memcpy_s"))),
                )
            )
    return KvtierCopies(_get(part, "bytes", int, "kvtier"), tuple(sorted(threads, key=lambda t: t[0])), part)
