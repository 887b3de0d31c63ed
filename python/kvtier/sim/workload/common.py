"""What every workload shares: block-key allocation, keys of a growing context, parameter checks,
clipped log-normal token draws and locating the bundled traces.

Block keys follow chained semantics (see :mod:`kvtier.sim.request`): a key names the whole prefix
up to the end of its block. So once a prompt's content diverges from everything seen before, that
block and every block after it get fresh keys, never reused by another request unless that request
repeats the same content up to there by construction (a later turn of the same stream, another
query on the same document). Fresh keys come from one counter per workload instance.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TextIO

import numpy as np

from kvtier.errors import ConfigError, TraceError
from kvtier.sim.request import Request

#: Environment variable naming a data directory (like the repository's ``data/``) to find traces in.
DATA_DIR_ENV = "KVTIER_DATA_DIR"


def num_blocks(tokens: int, block_tokens: int) -> int:
    """Blocks needed for ``tokens`` tokens: ``ceil(tokens / block_tokens)``."""
    return -(-tokens // block_tokens)


class KeyAllocator:
    """Hands out block keys never handed out before by this allocator (a counter)."""

    def __init__(self, start: int = 0) -> None:
        self._next = start

    def fresh(self, count: int) -> range:
        assert count >= 0, count
        keys = range(self._next, self._next + count)
        self._next += count
        return keys


class ContextKeys:
    """Block keys of one growing token stream (a chat session, an agent trajectory).

    Every prompt of the stream is a prefix of the stream, so block ``j`` of the stream always holds
    the same tokens and keeps one key once it is full. A prompt's partial tail block holds tokens
    that a later, longer prompt continues differently (with the model's output or the next message),
    so the tail gets a key of its own, shared with nothing. ``shared_prefix`` are the keys of full
    blocks the stream shares with other streams (a common system prompt).
    """

    def __init__(self, keys: KeyAllocator, block_tokens: int, shared_prefix: Sequence[int] = ()) -> None:
        self._keys = keys
        self._block_tokens = block_tokens
        self._stream: list[int] = list(shared_prefix)
        self._last_prompt_tokens = 0

    def prompt_keys(self, prompt_tokens: int) -> tuple[int, ...]:
        # A stream only grows: a shorter prompt would not be a continuation of the previous one.
        assert prompt_tokens >= self._last_prompt_tokens, (prompt_tokens, self._last_prompt_tokens)
        self._last_prompt_tokens = prompt_tokens
        full_blocks, tail_tokens = divmod(prompt_tokens, self._block_tokens)
        if full_blocks > len(self._stream):
            self._stream.extend(self._keys.fresh(full_blocks - len(self._stream)))
        head = tuple(self._stream[:full_blocks])
        return head + tuple(self._keys.fresh(1)) if tail_tokens else head


class Session:
    """One chained stream of requests (a chat session, an agent trajectory) arriving at
    ``start_s``: each turn's prompt extends the stream's :class:`ContextKeys` and names the turn
    before it as its parent; every turn after the first waits a think (or tool) time first."""

    def __init__(self, context: ContextKeys, req_ids: Iterator[int], session_id: int, start_s: float) -> None:
        self._context = context
        self._req_ids = req_ids
        self._session_id = session_id
        self._start_s = start_s
        self.parent_id: int | None = None

    def turn(
        self, prompt_tokens: int, output_tokens: int, rng: np.random.Generator, think_mean_s: float
    ) -> Request:
        """The next turn; its think time is drawn from ``rng`` (exponential, mean
        ``think_mean_s``) unless it is the first."""
        think_time_s = 0.0 if self.parent_id is None else float(rng.exponential(think_mean_s))
        req_id = next(self._req_ids)
        request = Request(
            req_id=req_id,
            arrival_s=self._start_s,
            prompt_tokens=prompt_tokens,
            output_tokens=output_tokens,
            block_keys=self._context.prompt_keys(prompt_tokens),
            session_id=self._session_id,
            parent_id=self.parent_id,
            think_time_s=think_time_s,
        )
        self.parent_id = req_id
        return request


# --- parameter checks: ConfigError naming the parameter, its value and what is expected ---------


def require_int(name: str, value: object, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < minimum:
        raise ConfigError(f"workload parameter `{name}` is {value!r}; expected an integer >= {minimum}")
    return int(value)


def require_positive(name: str, value: object) -> float:
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not (math.isfinite(value) and value > 0)
    ):
        raise ConfigError(f"workload parameter `{name}` is {value!r}; expected a finite number > 0")
    return float(value)


def require_non_negative(name: str, value: object) -> float:
    return require_at_least(name, value, 0.0)


def require_at_least(name: str, value: object, minimum: float) -> float:
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not (math.isfinite(value) and value >= minimum)
    ):
        raise ConfigError(
            f"workload parameter `{name}` is {value!r}; expected a finite number >= {minimum:g}"
        )
    return float(value)


def require_choice(name: str, value: object, choices: Sequence[str]) -> str:
    if not isinstance(value, str) or value not in choices:
        raise ConfigError(f"workload parameter `{name}` is {value!r}; expected one of {', '.join(choices)}")
    return value


def require_ordered(low_name: str, low: int, high_name: str, high: int) -> None:
    if low > high:
        raise ConfigError(
            f"workload parameter `{low_name}` ({low}) exceeds `{high_name}` ({high}); expected <="
        )


def require_block_tokens(block_tokens: object) -> int:
    return require_int("block_tokens", block_tokens, 1)


# --- draws ---------------------------------------------------------------------------------------


def lognormal_tokens(rng: np.random.Generator, mean: float, sigma: float, low: int, high: int) -> int:
    """A token count from a log-normal with the given mean (not median), rounded, clipped to
    ``[low, high]``. Clipping moves the mean a little when much mass lies outside the range."""
    mu = math.log(mean) - sigma * sigma / 2.0
    return int(min(max(round(float(rng.lognormal(mu, sigma))), low), high))


# --- traces --------------------------------------------------------------------------------------


def find_trace(file_name: str) -> Path:
    """The bundled trace ``file_name``: first under ``$KVTIER_DATA_DIR`` (``<dir>/traces/<name>`` or
    ``<dir>/<name>``), then in the nearest ``data/traces`` walking up from this file (the package's
    own ``kvtier/data/traces``, shipped in the wheel)."""
    tried: list[Path] = []
    data_dir = os.environ.get(DATA_DIR_ENV)
    if data_dir:
        tried += [Path(data_dir) / "traces" / file_name, Path(data_dir) / file_name]
    tried += [parent / "data" / "traces" / file_name for parent in Path(__file__).resolve().parents]
    for candidate in tried:
        if candidate.is_file():
            return candidate
    shown = ", ".join(str(path) for path in tried[:4])
    raise TraceError(
        f"trace {file_name} not found (looked in {shown}, ...); pass `path` or set {DATA_DIR_ENV}"
    )


def check_trace_path(path: str | os.PathLike[str] | None, default_name: str) -> Path:
    """``path`` if given (it must be a file), else the bundled ``default_name``."""
    if path is None:
        return find_trace(default_name)
    resolved = Path(path)
    if not resolved.is_file():
        raise TraceError(f"trace file {resolved} does not exist or is not a file")
    return resolved


def open_trace(path: Path, newline: str | None = None) -> TextIO:
    """``path`` opened for reading as UTF-8 text (a leading BOM skipped), bytes that are not UTF-8
    kept as lone surrogates: the reader that meets one names its line (:func:`not_utf8`) instead of
    the decoder failing somewhere in a buffered chunk."""
    return path.open(encoding="utf-8-sig", errors="surrogateescape", newline=newline)


_GZIP_MAGIC = "\x1f\udc8b"  # the bytes 1f 8b read through open_trace


def not_utf8(path: Path, line_no: int, text: str) -> TraceError | None:
    """The :class:`TraceError` for a line of ``path`` that holds bytes that are not UTF-8 (a
    gzip-compressed file, on its first line, is named as such); None for a line that does not.
    Called only where a line failed to parse, so it costs good lines nothing."""
    if line_no == 1 and text.startswith(_GZIP_MAGIC):
        return TraceError(f"{path}:1: the file is gzip-compressed; decompress it first (gunzip -k {path})")
    bad = next((c for c in text if "\udc80" <= c <= "\udcff"), None)
    if bad is None:
        return None
    return TraceError(
        f"{path}:{line_no}: byte 0x{ord(bad) - 0xDC00:02x} is not UTF-8 text; expected a UTF-8 file"
    )


def no_requests(path: Path) -> TraceError:
    """The error for a trace that holds no request (replaying it would report nothing as a run)."""
    return TraceError(f"{path}: no requests (the file is empty or holds only blank lines or a header)")


def check_replay_params(time_scale: object, max_requests: object) -> tuple[float, int | None]:
    scale = require_positive("time_scale", time_scale)
    limit = None if max_requests is None else require_int("max_requests", max_requests, 1)
    return scale, limit
