"""A small progress bar on stderr for long work; silent when stderr is not a terminal."""

from __future__ import annotations

import sys
import time
from collections.abc import Iterable, Iterator
from typing import TypeVar

T = TypeVar("T")


def progress(items: Iterable[T], total: int, label: str, enabled: bool = True) -> Iterator[T]:
    """Yields ``items`` while drawing ``label [#####.....] i/total`` on stderr."""
    show = enabled and sys.stderr.isatty()
    start = time.perf_counter()
    for i, item in enumerate(items):
        if show:
            done = int(30 * i / max(total, 1))
            sys.stderr.write(f"\r{label} [{'#' * done}{'.' * (30 - done)}] {i}/{total}")
            sys.stderr.flush()
        yield item
    if show:
        elapsed = time.perf_counter() - start
        sys.stderr.write(f"\r{label} [{'#' * 30}] {total}/{total} {elapsed:.1f}s\n")
        sys.stderr.flush()
