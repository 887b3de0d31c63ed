"""``kvtier sim size``: the smallest cluster that serves a trace within a TTFT SLO.

A production trace replayed on one engine is usually far beyond what one GPU serves: the queue
grows without bound and every latency figure measures the queue, not the policy. Sizing replays
the trace (or any colocated simulation config) on ``engines = 1, 2, 4, ...`` behind the config's
router until the run keeps its queue bounded at the SLO: every request finished, and at least
``attainment`` of them (default 0.9) with TTFT within ``ttft_slo_s`` (a queue that grows through the
run fails this, since its late requests wait ever longer). It then bisects between the last
failing and the first passing size, so the answer is the smallest passing engine count, assuming
more engines never serve worse (true of the routers here, each engine with the same hardware).
Every replay it ran is reported, so the curve is visible too.

Only colocated clusters are sized (``engines``); P/D configs (``prefill_engines`` and
``decode_engines``, DualPath's groups) are refused with a ConfigError: their two group sizes trade
against each other and need a search of their own.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvtier.errors import ConfigError
from kvtier.results import Result
from kvtier.sim.config import SimConfig

#: Trace file suffix -> workload that replays it (with the config that `trace_config` builds).
TRACE_WORKLOADS = {".jsonl": "mooncake", ".csv": "azure"}
_COMPRESSED = (".gz", ".bz2", ".xz", ".zst", ".zip")


def trace_config(path: str | Path, policy: str = "hicache") -> SimConfig:
    """One H100 (SXM) with Llama-3.1-8B and a host tier (`auto`), replaying the trace at `path`
    at its own rate: a Mooncake-format JSONL trace (512-token blocks, as its ``hash_ids`` name) or
    an Azure LLM inference CSV trace (16-token blocks)."""
    p = Path(path)
    workload = TRACE_WORKLOADS.get(p.suffix)
    if workload is None:
        raise ConfigError(
            f"trace {str(p)!r}: expected a Mooncake-format .jsonl or an Azure .csv trace, or a sim config"
        )
    if not p.is_file():
        problem = "is a directory; expected a trace file" if p.is_dir() else "does not exist"
        raise ConfigError(f"trace {str(p)!r} {problem}")
    return SimConfig(
        name=f"size-{p.stem}-{policy}",
        hardware="h100-sxm",
        model="llama-3.1-8b",
        policy={"name": policy},
        block_tokens=512 if workload == "mooncake" else 16,
        workload={"name": workload, "path": str(p)},
    )


def source_config(source: str, policy: str | None = None, engines: int | None = None) -> SimConfig:
    """The config of `source` (`kvtier sim run` and `sim size`): a trace (:func:`trace_config`,
    `policy` default hicache) or a sim config (YAML path or bundled name; it names its own policy,
    so `policy` is refused). `engines`, where given, replaces the config's colocated engine count."""
    if Path(source).suffix in _COMPRESSED and Path(Path(source).stem).suffix in TRACE_WORKLOADS:
        raise ConfigError(f"{source!r} is a compressed trace; decompress it first (kvtier reads .jsonl/.csv)")
    if Path(source).suffix in TRACE_WORKLOADS:
        config = trace_config(source, policy or "hicache")
    elif policy is not None:
        raise ConfigError(f"--policy {policy!r} applies to a trace; the config {source!r} names its policy")
    else:
        config = SimConfig.from_yaml(source)
    if engines is None:
        return config
    if isinstance(engines, bool) or not isinstance(engines, int) or engines < 1:
        raise ConfigError(f"--engines is {engines!r}; expected a whole number >= 1")
    if config.disaggregated:
        raise ConfigError(
            f"--engines {engines}: config {config.name!r} is a P/D cluster (`prefill_engines` "
            f"{config.prefill_engines}, `decode_engines` {config.decode_engines}); set those instead"
        )
    return config.with_overrides(engines=engines)


@dataclass(frozen=True)
class SizeRun(Result):
    """One replay of the search: its engine count, whether it met the SLO, and its figures."""

    engines: int
    passes: bool
    ttft_attainment: float
    ttft_p50_s: float
    ttft_p90_s: float
    ttft_p99_s: float
    requests: int
    unfinished_requests: int
    wall_s: float


@dataclass(frozen=True)
class Sizing(Result):
    """What ``kvtier sim size`` reports: the smallest passing engine count (``None`` when even the
    limit fails) and every replay it ran, by engine count."""

    engines: int | None
    ttft_slo_s: float
    attainment: float
    runs: list[SizeRun]


def size(
    config: SimConfig,
    ttft_slo_s: float,
    attainment: float = 0.9,
    max_engines: int = 1024,
    on_run: Callable[[SizeRun], None] | None = None,
) -> Sizing:
    """Searches ``engines`` for `config` (see the module doc); `on_run` sees each row as it is
    measured."""
    if config.prefill_engines or config.decode_engines:
        raise ConfigError(
            "`kvtier sim size` sizes colocated clusters (`engines`); this config has P/D groups "
            "(`prefill_engines`/`decode_engines`)"
        )
    if not (ttft_slo_s > 0 and math.isfinite(ttft_slo_s)):
        raise ConfigError(f"TTFT SLO is {ttft_slo_s!r}; expected seconds > 0")
    if not 0 < attainment <= 1:
        raise ConfigError(f"attainment is {attainment!r}; expected a fraction in (0, 1]")
    if not (isinstance(max_engines, int) and max_engines >= 1):
        raise ConfigError(f"max engines is {max_engines!r}; expected a whole number >= 1")
    from kvtier.sim.run import run  # the whole simulator: imported when a search runs, not by the CLI

    slo = {**config.slo, "ttft_s": ttft_slo_s}
    rows: dict[int, SizeRun] = {}

    def trial(n: int) -> bool:
        result = run(config.with_overrides(engines=n, slo=slo, name=f"{config.name}-x{n}"))
        within: float = result["slo"]["ttft_attainment"]
        unfinished: int = result["unfinished_requests"]
        ttft = result["ttft_s"]
        row = SizeRun(
            engines=n,
            passes=bool(unfinished == 0 and within >= attainment),
            ttft_attainment=within,
            ttft_p50_s=ttft["p50"],
            ttft_p90_s=ttft["p90"],
            ttft_p99_s=ttft["p99"],
            requests=result["requests"],
            unfinished_requests=unfinished,
            wall_s=result["wall_s"],
        )
        rows[n] = row
        if on_run is not None:
            on_run(row)
        return row.passes

    low, high = 0, 1  # low: the largest size known to fail (0: none tried)
    while not trial(high):
        if high >= max_engines:
            return Sizing(None, ttft_slo_s, attainment, _sorted(rows))
        low, high = high, min(2 * high, max_engines)
    while high - low > 1:
        mid = (low + high) // 2
        if trial(mid):
            high = mid
        else:
            low = mid
    return Sizing(high, ttft_slo_s, attainment, _sorted(rows))


def _sorted(rows: dict[int, SizeRun]) -> list[SizeRun]:
    return [rows[n] for n in sorted(rows)]


def summary(result: Sizing) -> str:
    lines = [f"{'engines':>7}  {'TTFT p50':>9}  {'p90':>9}  {'p99':>9}  {'within SLO':>10}  ok"]
    for r in result.runs:
        lines.append(
            f"{r.engines:>7}  {r.ttft_p50_s:>8.2f}s  {r.ttft_p90_s:>8.2f}s  {r.ttft_p99_s:>8.2f}s"
            f"  {r.ttft_attainment:>10.1%}  {'yes' if r.passes else 'no'}"
        )
    slo = f"TTFT <= {result.ttft_slo_s:g} s for {result.attainment:.0%} of requests"
    n = result.engines
    lines.append(f"smallest cluster: {n} engines ({slo})" if n else f"no cluster up to the limit meets {slo}")
    return "\n".join(lines)


def add_command(sim_sub: Any, emit: Callable[[Any, bool, Callable[[Any], str]], None]) -> None:
    """`kvtier sim size` (registered by the CLI beside `sim run`)."""
    cmd = sim_sub.add_parser("size", help="smallest cluster that serves a trace or config within a TTFT SLO")
    cmd.add_argument("source", help="a sim config (YAML path or bundled name) or a .jsonl/.csv trace")
    cmd.add_argument("--policy", default=None, help="policy for a trace (default hicache)")
    cmd.add_argument(
        "--ttft-slo", type=float, default=None, help="TTFT SLO in seconds (default: the config's, else 5)"
    )
    cmd.add_argument(
        "--attainment", type=float, default=0.9, help="share of requests within it (default 0.9)"
    )
    cmd.add_argument("--max-engines", type=int, default=1024, help="largest cluster tried (default 1024)")
    cmd.add_argument("--json", action="store_true", help="print one JSON object")

    def main(args: argparse.Namespace) -> None:
        config = source_config(str(args.source), args.policy)
        slo = args.ttft_slo if args.ttft_slo is not None else float(config.slo.get("ttft_s", 5.0))

        def show(row: SizeRun) -> None:  # each replay as it ends: stdout, or stderr beside --json
            line = f"  {row.engines} engines: {row.ttft_attainment:.1%} within SLO, {row.wall_s:.1f} s"
            print(line, file=sys.stderr if args.json else sys.stdout, flush=True)

        emit(size(config, slo, args.attainment, args.max_engines, on_run=show), args.json, summary)

    cmd.set_defaults(func=main)
