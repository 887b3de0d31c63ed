"""Replay of a Mooncake trace (JSONL, one request a line, FAST'25 release format).

Each line is ``{"timestamp": ms, "input_length": tokens, "output_length": tokens, "hash_ids": [...]}``;
``hash_ids`` name the prompt's 512-token blocks with chained semantics (equal leading ids = equal
prefix KV), one id per block, ``ceil(input_length / 512)`` of them. They become the requests'
``block_keys`` as they are, so the run's ``block_tokens`` must be 512: the trace fixes the block size.

``arrival_s = (timestamp - first timestamp) / 1000 * time_scale``: ``time_scale`` 0.5 replays twice as
fast, 2 half as fast. Every request is open-loop (the trace has no dependencies). ``copies`` > 1
replays the trace that many times back to back (copy ``k`` starts one trace span plus one mean
inter-arrival gap after copy ``k - 1``), each copy with fresh ``hash_ids`` (offset by ``k`` times one
more than the trace's largest id): a longer trace at the same rate, sharing no prefix across copies,
for measuring how the simulator scales with the number of requests (``kvtier bench sim``). The file is read
line by line as requests are consumed, so a replay holds one line at a time. A malformed line (bad
JSON, bytes that are not UTF-8, a missing or mistyped field, a length < 1, a timestamp that is not a
number of ms in [0, 2**53] (NaN and Infinity, which Python's json reads, included), a ``hash_id``
< 0, a wrong number of ``hash_ids``, a timestamp earlier than the line before) raises
:class:`~kvtier.errors.TraceError` naming the file and line number; so do a gzip-compressed file
and a file with no request at all.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from itertools import islice
from pathlib import Path

from kvtier.errors import ConfigError, TraceError
from kvtier.sim.request import Request
from kvtier.sim.workload.common import (
    check_replay_params,
    check_trace_path,
    find_trace,
    no_requests,
    not_utf8,
    num_blocks,
    open_trace,
    require_block_tokens,
    require_int,
)

MOONCAKE_TRACE = "mooncake_synthetic_trace.jsonl"
#: Tokens per block named by one ``hash_id`` in the Mooncake traces.
MOONCAKE_BLOCK_TOKENS = 512
#: The largest ``timestamp`` (ms) read: 2**53, past which a double no longer holds every whole ms
#: (285,000 years; epoch milliseconds are ~1.7e12).
TIMESTAMP_MS_MAX = float(2**53)


@dataclass(frozen=True, slots=True)
class MooncakeRecord:
    line: int
    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


def mooncake_workload(
    *,
    block_tokens: int,
    path: str | os.PathLike[str] | None = None,
    time_scale: float = 1.0,
    max_requests: int | None = None,
    seed: int = 0,
    copies: int = 1,
) -> Iterator[Request]:
    """Requests of the trace at ``path`` (default: the bundled synthetic trace), ``copies`` times
    back to back (see the module doc), the first ``max_requests`` of them if given. ``seed`` is unused
    (a replay draws nothing); it is accepted so that every workload takes the run's seed."""
    if require_block_tokens(block_tokens) != MOONCAKE_BLOCK_TOKENS:
        raise ConfigError(
            f"workload parameter `block_tokens` is {block_tokens}; expected {MOONCAKE_BLOCK_TOKENS}: "
            f"the Mooncake trace's hash_ids name {MOONCAKE_BLOCK_TOKENS}-token blocks, so the trace fixes "
            f"the run's block size"
        )
    time_scale, limit = check_replay_params(time_scale, max_requests)
    trace = check_trace_path(path, MOONCAKE_TRACE)
    copies = require_int("copies", copies, 1)

    def generate() -> Iterator[Request]:
        first_ms: float | None = None
        for req_id, (offset_ms, record) in enumerate(islice(_copied(trace, copies), limit)):
            if first_ms is None:
                first_ms = record.timestamp_ms
            yield Request(
                req_id=req_id,
                arrival_s=(record.timestamp_ms + offset_ms - first_ms) / 1000.0 * time_scale,
                prompt_tokens=record.input_length,
                output_tokens=record.output_length,
                block_keys=record.hash_ids,
            )

    return generate()


def _copied(trace: Path, copies: int) -> Iterator[tuple[float, MooncakeRecord]]:
    """(time offset in ms, record) of ``copies`` back-to-back copies of the trace, each with its
    ``hash_ids`` shifted past every id of the copies before it. One copy is read lazily as is."""
    if copies == 1:
        yield from ((0.0, record) for record in read_mooncake(trace))
        return
    first_ms = last_ms = 0.0
    max_id, count = -1, 0
    for record in read_mooncake(trace):  # a first pass: the span and the id range of one copy
        if count == 0:
            first_ms = record.timestamp_ms
        last_ms, count = record.timestamp_ms, count + 1
        max_id = max(max_id, *record.hash_ids)
    period_ms = (last_ms - first_ms) + (last_ms - first_ms) / max(count - 1, 1)
    for k in range(copies):
        shift = k * (max_id + 1)
        for record in read_mooncake(trace):
            ids = record.hash_ids if shift == 0 else tuple(i + shift for i in record.hash_ids)
            yield k * period_ms, dataclasses.replace(record, hash_ids=ids)


def default_trace_path() -> Path:
    """The bundled Mooncake synthetic trace (see :func:`~kvtier.sim.workload.common.find_trace`)."""
    return find_trace(MOONCAKE_TRACE)


def mooncake_block_hit_rate(
    path: str | os.PathLike[str] | None = None, max_requests: int | None = None, copies: int = 1
) -> float:
    """Fraction of all blocks (``hash_ids`` occurrences) whose id appeared in an earlier request: the
    hit rate of an infinite cache replaying the trace (``copies`` times, as :func:`mooncake_workload`
    does; its first ``max_requests`` requests if given). 0.6396 for the bundled trace."""
    _, limit = check_replay_params(1.0, max_requests)
    copies = require_int("copies", copies, 1)
    seen: set[int] = set()
    blocks = hits = 0
    for _, record in islice(_copied(check_trace_path(path, MOONCAKE_TRACE), copies), limit):
        blocks += len(record.hash_ids)
        hits += sum(1 for hash_id in record.hash_ids if hash_id in seen)
        seen.update(record.hash_ids)
    return hits / blocks if blocks else 0.0


def read_mooncake(path: Path) -> Iterator[MooncakeRecord]:
    """The trace's records, checked, one line at a time (blank lines skipped); lines count from 1."""
    with open_trace(path) as lines:
        previous_ms = float("-inf")
        for line_no, text in enumerate(lines, start=1):
            if not text.strip():
                continue
            record = _parse_line(path, line_no, text)
            if record.timestamp_ms < previous_ms:
                raise TraceError(
                    f"{path}:{line_no}: timestamp {record.timestamp_ms:g} ms is earlier than the previous "
                    f"line's {previous_ms:g} ms; expected non-decreasing timestamps"
                )
            previous_ms = record.timestamp_ms
            yield record
    if previous_ms == float("-inf"):
        raise no_requests(path)


def _parse_line(path: Path, line_no: int, text: str) -> MooncakeRecord:
    where = f"{path}:{line_no}"
    try:
        data = json.loads(text)
    except json.JSONDecodeError as error:
        raise not_utf8(path, line_no, text) or TraceError(f"{where}: not valid JSON ({error.msg})") from None
    if not isinstance(data, dict):
        raise TraceError(f"{where}: expected a JSON object, got {type(data).__name__}")
    for field in ("timestamp", "input_length", "output_length", "hash_ids"):
        if field not in data:
            raise TraceError(f"{where}: missing field `{field}`")
    timestamp = data["timestamp"]
    # The chained comparison is false for NaN, which Python's json reads (as it does Infinity).
    if (
        isinstance(timestamp, bool)
        or not isinstance(timestamp, int | float)
        or not 0 <= timestamp <= TIMESTAMP_MS_MAX
    ):
        raise TraceError(f"{where}: `timestamp` is {timestamp!r}; expected a number of ms in [0, 2**53]")
    lengths = []
    for field in ("input_length", "output_length"):
        value = data[field]
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise TraceError(f"{where}: `{field}` is {value!r}; expected an integer >= 1")
        lengths.append(value)
    hash_ids = data["hash_ids"]
    # `type(...) is int` refuses bools and floats; ids >= 0 keep `copies`' shifted ids apart.
    if (
        not isinstance(hash_ids, list)
        or not all(type(hash_id) is int for hash_id in hash_ids)
        or (hash_ids and min(hash_ids) < 0)
    ):
        raise TraceError(f"{where}: `hash_ids` must be a list of integers >= 0")
    input_length, output_length = lengths
    expected = num_blocks(input_length, MOONCAKE_BLOCK_TOKENS)
    if len(hash_ids) != expected:
        raise TraceError(
            f"{where}: {len(hash_ids)} hash_ids for input_length {input_length}; expected "
            f"ceil({input_length} / {MOONCAKE_BLOCK_TOKENS}) = {expected}"
        )
    return MooncakeRecord(line_no, float(timestamp), input_length, output_length, tuple(hash_ids))
