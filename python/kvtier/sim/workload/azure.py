"""Replay of an Azure LLM inference trace (CSV ``TIMESTAMP,ContextTokens,GeneratedTokens``, 2023).

``TIMESTAMP`` is a datetime (``2023-11-16 18:15:46.6805900``; digits past microseconds are dropped);
``arrival_s`` is the time since the first row, times ``time_scale`` (0.5 replays twice as fast).
``ContextTokens`` is the prompt length, ``GeneratedTokens`` the output length. The trace carries no
prefix information, so every block of every prompt gets a fresh key (no sharing: a cache sees only
misses, and any hit rate must come from elsewhere). Rows with 0 generated tokens are replayed with 1
output token: such a request still ran a prefill and returned (at least) a first token, and
:class:`~kvtier.sim.request.Request` needs ``output_tokens >= 1``; the bundled file has none.

Every request is open-loop. The file is read as requests are consumed. A malformed row (wrong
number of fields, a bad datetime or integer, bytes that are not UTF-8, ``ContextTokens < 1``,
``GeneratedTokens < 0``, a timestamp earlier than the row before) or a header without the three
columns raises :class:`~kvtier.errors.TraceError` naming the file and line number (the header is
line 1); so do a gzip-compressed file and a file with no row after the header.
"""

from __future__ import annotations

import csv
import os
from collections.abc import Iterator
from datetime import UTC, datetime
from itertools import islice
from pathlib import Path

from kvtier.errors import TraceError
from kvtier.sim.request import Request
from kvtier.sim.workload.common import (
    KeyAllocator,
    check_replay_params,
    check_trace_path,
    find_trace,
    no_requests,
    not_utf8,
    num_blocks,
    open_trace,
    require_block_tokens,
)

AZURE_TRACE = "azure_llm_2023_conv.csv"
AZURE_COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")


def azure_workload(
    *,
    block_tokens: int,
    path: str | os.PathLike[str] | None = None,
    time_scale: float = 1.0,
    max_requests: int | None = None,
    seed: int = 0,
) -> Iterator[Request]:
    """Requests of the trace at ``path`` (default: the bundled conversation trace), the first
    ``max_requests`` of them if given. ``seed`` is unused (a replay draws nothing); it is accepted so
    that every workload takes the run's seed."""
    block_tokens = require_block_tokens(block_tokens)
    time_scale, limit = check_replay_params(time_scale, max_requests)
    trace = check_trace_path(path, AZURE_TRACE)

    def generate() -> Iterator[Request]:
        keys = KeyAllocator()
        first: datetime | None = None
        for req_id, (_, timestamp, context_tokens, generated_tokens) in enumerate(
            islice(read_azure(trace), limit)
        ):
            if first is None:
                first = timestamp
            yield Request(
                req_id=req_id,
                arrival_s=(timestamp - first).total_seconds() * time_scale,
                prompt_tokens=context_tokens,
                output_tokens=max(generated_tokens, 1),
                block_keys=tuple(keys.fresh(num_blocks(context_tokens, block_tokens))),
            )

    return generate()


def default_trace_path() -> Path:
    """The bundled Azure conversation trace (see :func:`~kvtier.sim.workload.common.find_trace`)."""
    return find_trace(AZURE_TRACE)


def read_azure(path: Path) -> Iterator[tuple[int, datetime, int, int]]:
    """``(line, timestamp, context_tokens, generated_tokens)`` per row, checked; blank rows skipped."""
    with open_trace(path, newline="") as file:
        rows = csv.reader(file)
        header = next(rows, None)
        names = [name.strip() for name in header] if header is not None else []
        missing = [name for name in AZURE_COLUMNS if name not in names]
        if missing:
            raise not_utf8(path, 1, ",".join(header or ())) or TraceError(
                f"{path}:1: header {names} lacks column(s) {', '.join(missing)}; expected {','.join(AZURE_COLUMNS)}"
            )
        columns = [names.index(name) for name in AZURE_COLUMNS]
        previous: datetime | None = None
        for row in rows:
            if not row or not any(field.strip() for field in row):
                continue
            line_no = rows.line_num
            if len(row) != len(names):
                raise TraceError(
                    f"{path}:{line_no}: {len(row)} fields; expected {len(names)} like the header"
                )
            timestamp, context_tokens, generated_tokens = (row[column].strip() for column in columns)
            try:
                parsed = _parse_row(path, line_no, timestamp, context_tokens, generated_tokens)
            except TraceError as error:  # a row that does not parse may hold bytes that are not UTF-8
                raise not_utf8(path, line_no, ",".join(row)) or error from None
            if previous is not None and parsed[1] < previous:
                raise TraceError(
                    f"{path}:{line_no}: TIMESTAMP {timestamp} is earlier than the previous row's; "
                    f"expected non-decreasing timestamps"
                )
            previous = parsed[1]
            yield parsed
    if previous is None:
        raise no_requests(path)


def _parse_row(
    path: Path, line_no: int, timestamp: str, context_tokens: str, generated_tokens: str
) -> tuple[int, datetime, int, int]:
    where = f"{path}:{line_no}"
    try:
        when = datetime.fromisoformat(timestamp)
    except ValueError:
        raise TraceError(
            f"{where}: TIMESTAMP {timestamp!r} is not a datetime like 2023-11-16 18:15:46.68"
        ) from None
    if when.tzinfo is not None:  # compare zoned and plain timestamps alike: zoned ones as UTC
        when = when.astimezone(UTC).replace(tzinfo=None)
    try:
        context, generated = int(context_tokens), int(generated_tokens)
    except ValueError:
        raise TraceError(
            f"{where}: ContextTokens {context_tokens!r} / GeneratedTokens {generated_tokens!r}; expected integers"
        ) from None
    if context < 1:
        raise TraceError(f"{where}: ContextTokens is {context}; expected >= 1")
    if generated < 0:
        raise TraceError(f"{where}: GeneratedTokens is {generated}; expected >= 0")
    return line_no, when, context, generated
