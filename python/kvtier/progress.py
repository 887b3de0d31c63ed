"""A small progress bar on stderr for long work; silent when stderr is not a terminal."""

from __future__ import annotations

import sys
import time
from collections.abc import Iterable, Iterator
from typing import TypeVar

T = TypeVar("T")


def progress(items: Iterable[T], total: int | None, label: str, enabled: bool = True) -> Iterator[T]:
    """Yields ``items`` while drawing ``label [#####.....] i/total`` on stderr (a count when the
    total is unknown). Redraws at most every 0.1 s, so it costs nothing on fast loops."""
    show = enabled and sys.stderr.isatty()
    start = last = time.perf_counter()
    count = 0
    for count, item in enumerate(items, 1):
        if show and (now := time.perf_counter()) - last >= 0.1:
            last = now
            if total:
                done = int(30 * (count - 1) / total)
                sys.stderr.write(f"\r{label} [{'#' * done}{'.' * (30 - done)}] {count - 1}/{total}")
            else:
                sys.stderr.write(f"\r{label} {count - 1} ...")
            sys.stderr.flush()
        yield item
    if show:
        elapsed = time.perf_counter() - start
        bar = f"[{'#' * 30}] " if total else ""
        sys.stderr.write(f"\r{label} {bar}{count}{f'/{total}' if total else ''} {elapsed:.1f}s\n")
        sys.stderr.flush()
