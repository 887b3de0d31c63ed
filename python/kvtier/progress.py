"""Progress of long work on stderr (rich), silent when stderr is not a terminal."""

from __future__ import annotations

import sys
from collections.abc import Iterable, Iterator
from typing import TypeVar

T = TypeVar("T")


def progress(items: Iterable[T], total: int | None, label: str, enabled: bool = True) -> Iterator[T]:
    """Yields ``items`` while rich draws ``label``, a bar (a count when ``total`` is unknown),
    the elapsed and remaining time on stderr. Redraws a few times a second, so it costs nothing on
    fast loops; rich is imported only when a bar is shown (``import kvtier`` stays light)."""
    if not (enabled and sys.stderr.isatty()):
        yield from items
        return
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    columns = [TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn()]
    if total:
        columns.append(TimeRemainingColumn())
    with Progress(*columns, console=Console(stderr=True), transient=False, refresh_per_second=8) as bar:
        task = bar.add_task(label, total=total)
        for item in items:
            yield item
            bar.advance(task)
