"""``kvtier top``: a live terminal view of running stores, read from their metrics endpoint.

Every ``--interval`` seconds it scrapes ``/metrics`` (a store started with ``metrics_port``,
docs/metrics.md) and shows, per store (its ``namespace`` label) and tier: occupancy, objects,
hit rate, bytes put and loaded per second, evictions per second; per SSD device and per remote
operation: bandwidth and p99 latency; per transfer-engine stage: workers, share of their time
busy, and bytes per second. Rates are differences of two scrapes (a counter that went back was
reset: all of its value counts). ``--once`` prints one
view (two scrapes ``--interval`` apart) and exits, for scripts and logs. The first scrape must
succeed; after it, a scrape that fails (a store restarting, a network blip) keeps the last view
under a line naming the failure and its time, and the view resumes when the endpoint answers again
(its rates then span the gap).
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Mapping
from typing import Any

from kvtier.errors import KvtierError, shown
from kvtier.metrics import parse
from kvtier.transfer import STAGE_NAMES

Samples = Mapping[tuple[str, tuple[tuple[str, str], ...]], float]


#: Longest ``--interval``: one scrape an hour.
INTERVAL_MAX_S = 3600.0
#: Most bytes read from one scrape (a store's is a few KiB): a URL that streams without end is an
#: error, not a process that grows until it is killed.
SCRAPE_BYTES_MAX = 64 * 2**20


def check_url(url: str) -> str:
    """``url`` if it is an http(s) URL with a host; else a KvtierError naming it."""
    try:
        parts = urllib.parse.urlsplit(url)
        ok = url.isprintable() and parts.scheme in ("http", "https") and bool(parts.hostname)
    except ValueError:  # an unclosed or invalid bracketed (IPv6) host
        ok = False
    if not ok:
        raise KvtierError(
            f"metrics URL {url!r} is not an http(s) URL with a host; expected one such as "
            "http://127.0.0.1:9464/metrics"
        )
    return url


def scrape(url: str) -> Samples:
    """The samples at ``url``; an endpoint that cannot be read, or whose answer is not a
    Prometheus text exposition, is a KvtierError naming the URL."""
    try:
        with urllib.request.urlopen(check_url(url), timeout=5) as r:
            body = r.read(SCRAPE_BYTES_MAX + 1)
    except (urllib.error.URLError, http.client.HTTPException, OSError, ValueError) as e:
        raise KvtierError(
            f"cannot read metrics from {url}: {e}; is a store running with metrics_port?"
        ) from e
    try:
        if len(body) > SCRAPE_BYTES_MAX:
            raise ValueError(f"the answer is over {SCRAPE_BYTES_MAX} bytes")
        return parse(body.decode())
    except ValueError as e:  # UnicodeDecodeError too
        raise KvtierError(
            f"{url} did not answer with Prometheus metrics ({shown(str(e))}); expected a store's /metrics"
        ) from None


def _by(samples: Samples, name: str, *keys: str) -> dict[tuple[str, ...], float]:
    """Values of metric `name` keyed by the label values `keys`."""
    out: dict[tuple[str, ...], float] = {}
    for (n, labels), v in samples.items():
        if n == name:
            d = dict(labels)
            out[tuple(d.get(k, "") for k in keys)] = out.get(tuple(d.get(k, "") for k in keys), 0.0) + v
    return out


def _rate(new: Samples, old: Samples, name: str, seconds: float, *keys: str) -> dict[tuple[str, ...], float]:
    """Per-second growth of counter `name`; one that went back was reset (its store is another),
    so all of its value is growth, as Prometheus counts it."""
    a, b = _by(new, name, *keys), _by(old, name, *keys)
    return {k: (v - b.get(k, 0.0) if v >= b.get(k, 0.0) else v) / seconds for k, v in a.items()}


def _bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def tables(new: Samples, old: Samples, seconds: float) -> list[Any]:
    """The view: rich tables built from two scrapes `seconds` apart."""
    from rich.table import Table

    stores = Table(title="kvtier stores", title_justify="left")
    for col in ("namespace", "tier", "occupancy", "objects", "hit rate", "put/s", "loaded/s", "evictions/s"):
        stores.add_column(col, justify="left" if col in ("namespace", "tier") else "right")
    used = _by(new, "kvtier_tier_used_bytes", "namespace", "tier")
    cap = _by(new, "kvtier_tier_capacity_bytes", "namespace", "tier")
    objects = _by(new, "kvtier_tier_objects", "namespace", "tier")
    evict = _rate(new, old, "kvtier_tier_evictions_total", seconds, "namespace", "tier")
    hits = _rate(new, old, "kvtier_store_hit_blocks_total", seconds, "namespace")
    misses = _rate(new, old, "kvtier_store_miss_blocks_total", seconds, "namespace")
    put = _rate(new, old, "kvtier_store_put_bytes_total", seconds, "namespace")
    loaded = _rate(new, old, "kvtier_store_loaded_bytes_total", seconds, "namespace")
    for ns, tier in sorted(used):
        first = tier == min(t for n, t in used if n == ns)
        looked = hits.get((ns,), 0.0) + misses.get((ns,), 0.0)
        hit_rate = f"{hits.get((ns,), 0.0) / looked:.0%}" if first and looked else ("-" if first else "")
        capacity = cap.get((ns, tier), 0.0)
        stores.add_row(
            ns if first else "", tier,
            f"{used[ns, tier] / capacity:.0%} of {_bytes(capacity)}" if capacity else "-",
            f"{objects.get((ns, tier), 0.0):.0f}", hit_rate,
            f"{_bytes(put.get((ns,), 0.0))}/s" if first else "", f"{_bytes(loaded.get((ns,), 0.0))}/s" if first else "",
            f"{evict.get((ns, tier), 0.0):.1f}",
        )  # fmt: skip
    out: list[Any] = [stores]
    read = _rate(new, old, "kvtier_ssd_device_bytes_read_total", seconds, "namespace", "device")
    if read:
        written = _rate(new, old, "kvtier_ssd_device_bytes_written_total", seconds, "namespace", "device")
        lat = _by(new, "kvtier_ssd_device_latency_seconds", "namespace", "device", "op", "quantile")
        ssd = Table(title="SSD devices", title_justify="left")
        for col in ("namespace", "device", "read/s", "write/s", "read p99", "write p99"):
            ssd.add_column(col, justify="left" if col == "namespace" else "right")
        for ns, dev in sorted(read):
            ssd.add_row(
                ns, dev, f"{_bytes(read[ns, dev])}/s", f"{_bytes(written.get((ns, dev), 0.0))}/s",
                f"{lat.get((ns, dev, 'read', '0.99'), 0.0) * 1e3:.2f} ms",
                f"{lat.get((ns, dev, 'write', '0.99'), 0.0) * 1e3:.2f} ms",
            )  # fmt: skip
        out.append(ssd)
    moved = _rate(new, old, "kvtier_remote_bytes_total", seconds, "namespace", "op")
    if moved:
        lat = _by(new, "kvtier_remote_latency_seconds", "namespace", "op", "quantile")
        errors = _rate(new, old, "kvtier_remote_errors_total", seconds, "namespace", "op")
        down = _by(new, "kvtier_remote_nodes_down", "namespace")
        remote = Table(title="remote tier", title_justify="left")
        for col in ("namespace", "op", "bytes/s", "p99", "errors/s", "nodes down"):
            remote.add_column(col, justify="left" if col in ("namespace", "op") else "right")
        for ns, op in sorted(moved):
            remote.add_row(
                ns, op, f"{_bytes(moved[ns, op])}/s", f"{lat.get((ns, op, '0.99'), 0.0) * 1e3:.2f} ms",
                f"{errors.get((ns, op), 0.0):.1f}", f"{down.get((ns,), 0.0):.0f}",
            )  # fmt: skip
        out.append(remote)
    staged = _rate(new, old, "kvtier_transfer_stage_bytes_total", seconds, "namespace", "stage")
    if staged:
        busy = _rate(new, old, "kvtier_transfer_stage_busy_seconds_total", seconds, "namespace", "stage")
        workers = _by(new, "kvtier_transfer_stage_workers", "namespace", "stage")
        transfer = Table(title="transfer engines", title_justify="left")
        for col in ("namespace", "stage", "workers", "busy", "bytes/s"):
            transfer.add_column(col, justify="left" if col in ("namespace", "stage") else "right")
        for ns, stage in sorted(
            staged, key=lambda k: (k[0], STAGE_NAMES.index(k[1]) if k[1] in STAGE_NAMES else 9)
        ):
            n = workers.get((ns, stage), 0.0)
            transfer.add_row(
                ns, stage, f"{n:.0f}", f"{busy.get((ns, stage), 0.0) / n:.0%}" if n else "-",
                f"{_bytes(staged[ns, stage])}/s",
            )  # fmt: skip
        out.append(transfer)
    return out


def run(url: str, interval: float, once: bool) -> None:
    from rich.console import Console, Group
    from rich.live import Live

    console = Console()
    old, t_old = scrape(url), time.monotonic()
    if once:
        time.sleep(interval)
        new, t_new = scrape(url), time.monotonic()
        for table in tables(new, old, t_new - t_old):
            console.print(table)
        return
    view = LiveView(url, interval, old, t_old)
    with Live(console=console, refresh_per_second=4, screen=False) as live:
        while True:
            time.sleep(interval)
            live.update(Group(*view.refresh()))


class LiveView:
    """What the live view shows after each scrape: the tables of the rates since the last
    successful scrape; while scrapes fail, the last tables under a line naming the failure."""

    def __init__(self, url: str, interval: float, first: Samples, t_first: float) -> None:
        self.url, self.interval = url, interval
        self.last, self.t_last = first, t_first
        self.shown: list[Any] = []

    def refresh(self) -> list[Any]:
        from rich.text import Text

        try:
            new, t_new = scrape(self.url), time.monotonic()
        except KvtierError as e:
            since = time.strftime("%H:%M:%S", time.localtime())
            note = Text(f"{since}: {e}; retrying every {self.interval:g} s", style="bold red")
            return [*self.shown, note]
        self.shown = tables(new, self.last, t_new - self.t_last)
        self.last, self.t_last = new, t_new
        return self.shown


def add_command(sub: Any) -> None:
    """`kvtier top` (called where the CLI registers its subcommands)."""
    cmd = sub.add_parser("top", help="live view of running stores (their metrics endpoint)")
    cmd.add_argument("url", nargs="?", default="http://127.0.0.1:9464/metrics", help="a store's /metrics URL")
    cmd.add_argument("--interval", type=float, default=1.0, help="seconds between scrapes (default 1)")
    cmd.add_argument("--once", action="store_true", help="print one view and exit")

    def main(args: argparse.Namespace) -> None:
        if not 0 < args.interval <= INTERVAL_MAX_S:  # NaN fails too
            raise KvtierError(f"--interval is {args.interval}; expected seconds in (0, {INTERVAL_MAX_S:g}]")
        check_url(args.url)
        with contextlib.suppress(KeyboardInterrupt):
            run(args.url, args.interval, args.once)

    cmd.set_defaults(func=main)
