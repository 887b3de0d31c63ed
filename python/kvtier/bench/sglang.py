"""`kvtier bench sglang`: kvtier as SGLang's HiCache storage backend against SGLang's built-in `file`
backend and SGLang's own Mooncake backend, on SGLang's own host KV pool, in the same run.

The kvtier CLI runs in kvtier's environment; the measurement runs in the engine environment
(`.venv-vllm`, `make vllm-env`, sglang pinned) as `python -m kvtier.bench.sglang --worker`.
Mooncake's store (`mooncake-transfer-engine-non-cuda`, :mod:`kvtier.bench.mooncake_env`) is
installed into that environment on first use and its master runs on loopback for the run:

- pages: an MHA `page_first` host pool of Llama-3-8B-like pages (32 layers, 8 KV heads, head dim
  128, bf16, 64 tokens: 8 MiB a page) holding `--bytes` (default 1 GiB) of random pages. Each
  repeat stores them under fresh keys and loads them back into other pages of the pool, each
  backend the way SGLang's cache controller drives it: kvtier and Mooncake through
  `batch_set_v1`/`batch_get_v1` (`interface_v1`, zero copy; Mooncake over TCP, this process
  contributing the memory segment that holds the pages, as an SGLang instance does), the file
  backend (which has no v1 calls) through `_generic_page_set`/`_generic_page_get` (flat page
  tensors; the same code as SGLang's `HiCacheController`). kvtier runs with its DRAM tier; the
  file backend writes files (the page cache keeps them). Every backend is emptied (`clear`)
  between repeats.
- exists: `batch_exists` of a 128K-token prefix (2,048 pages of 64 tokens, all present).

Reported: median seconds per case, `{set,get,exists}_ratio_to_file_backend` and
`..._to_mooncake` (speed, above 1 = kvtier faster; None with `mooncake_unavailable` saying why
when Mooncake cannot run) and, as the limit, kvtier's bandwidth as a share of a plain memcpy of
the same bytes measured in the same run.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import tempfile
import time
from collections.abc import Callable, Mapping
from contextlib import ExitStack
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, NotRequired, TypedDict

from kvtier.bench.engine_env import engine_python, run_worker
from kvtier.bench.mooncake_env import MooncakeServers, install_mooncake, mooncake_master
from kvtier.errors import KvtierError
from kvtier.results import OMIT, Result, json_text

PAGE_TOKENS = 64
EXISTS_TOKENS = 128 * 1024
LAYERS, HEADS, HEAD_DIM = 32, 8, 128
#: The cases each backend is timed in (medians over the repeats).
CASES = ("set", "get", "exists")


class Spec(TypedDict):
    """What the worker runs (JSON)."""

    bytes: int
    repeats: int
    directory: str | None
    mooncake: NotRequired[MooncakeServers]


@dataclass(frozen=True)
class BackendTimes(Result):
    """One backend: median seconds per case, and the bandwidth of set and get."""

    set_s: float
    get_s: float
    exists_s: float
    set_gb_per_s: float
    get_gb_per_s: float

    def seconds(self, case: str) -> float:
        return {"set": self.set_s, "get": self.get_s, "exists": self.exists_s}[case]


@dataclass(frozen=True)
class SglangBench(Result):
    """What ``kvtier bench sglang`` reports; a ratio is the peer's time over kvtier's (above 1:
    kvtier faster), None where the peer was not measured."""

    page_bytes: int
    pages: int
    bytes: int
    repeats: int
    memcpy_gb_per_s: float
    exists_pages: int
    exists_tokens: int
    kvtier: BackendTimes
    file: BackendTimes
    set_ratio_to_file_backend: float
    get_ratio_to_file_backend: float
    exists_ratio_to_file_backend: float
    set_ratio_to_mooncake: float | None
    get_ratio_to_mooncake: float | None
    exists_ratio_to_mooncake: float | None
    kvtier_set_fraction_of_memcpy: float
    kvtier_get_fraction_of_memcpy: float
    mooncake: BackendTimes | None = field(default=None, metadata=OMIT)
    mooncake_unavailable: str | None = field(default=None, metadata=OMIT)  # why it was not measured

    def ratio(self, case: str, peer: str) -> float | None:
        return {
            ("set", "file"): self.set_ratio_to_file_backend,
            ("get", "file"): self.get_ratio_to_file_backend,
            ("exists", "file"): self.exists_ratio_to_file_backend,
            ("set", "mooncake"): self.set_ratio_to_mooncake,
            ("get", "mooncake"): self.get_ratio_to_mooncake,
            ("exists", "mooncake"): self.exists_ratio_to_mooncake,
        }[case, peer]


def run(
    venv: Path, total_bytes: int, repeats: int = 3, directory: str | None = None, show: bool = True
) -> SglangBench:
    """Runs the worker in the engine environment and returns its figures. Mooncake is installed
    into that environment when missing and its master started here; when it cannot run, the
    result says why (``mooncake_unavailable``) and has no Mooncake figures."""
    args: Spec = {"bytes": total_bytes, "repeats": repeats, "directory": directory}
    unavailable = install_mooncake(engine_python(venv), show, "sglang")
    with tempfile.TemporaryDirectory(prefix="kvtier-bench-sglang-mooncake-") as tmp, ExitStack() as stack:
        if unavailable is None:
            try:
                args["mooncake"] = stack.enter_context(mooncake_master(venv, Path(tmp)))
            except KvtierError as e:
                unavailable = str(e)
        data = run_worker(
            venv, "kvtier.bench.sglang", ["--worker", json_text(args)], "SGLang bench worker", 3600
        )
    result = SglangBench.from_json(data, "SGLang bench worker's RESULT")
    return dataclasses.replace(result, mooncake_unavailable=unavailable)


def summary(r: SglangBench) -> str:
    peers = {"file": r.file, "mooncake": r.mooncake}
    measured = {p: times for p, times in peers.items() if times is not None}
    head = "".join(f"{p:>10} ms  ratio" for p in measured)
    lines = [
        f"SGLang HiCache storage: {r.pages} pages of {r.page_bytes / 2**20:.1f} MiB "
        f"({r.bytes / 2**30:.2f} GiB), median of {r.repeats}; memcpy {r.memcpy_gb_per_s:.2f} GB/s",
        f"  {'':<34}{'kvtier ms':>10}{head}   (ratio = peer time / kvtier time, above 1: kvtier faster)",
    ]
    names = {
        "set": "batch_set",
        "get": "batch_get",
        "exists": f"batch_exists ({r.exists_pages} pages, 128K tokens)",
    }
    for case, name in names.items():
        row = f"  {name:<34}{r.kvtier.seconds(case) * 1e3:10.2f}"
        for p, times in measured.items():
            row += f"{times.seconds(case) * 1e3:13.2f}{r.ratio(case, p):7.2f}x"
        lines.append(row)
    lines.append(
        f"  kvtier set/get at {r.kvtier_set_fraction_of_memcpy:.2f}/{r.kvtier_get_fraction_of_memcpy:.2f} of memcpy"
    )
    if r.mooncake_unavailable is not None:
        lines.append(f"  mooncake not measured: {r.mooncake_unavailable}")
    return "\n".join(lines)


def add_command(bench_sub: Any, positive: Callable[[str], int], emit: Callable[..., None]) -> None:
    """`kvtier bench sglang` (called where the CLI registers its bench subcommands)."""
    from kvtier.config import parse_size

    cmd = bench_sub.add_parser(
        "sglang",
        help="kvtier as SGLang's HiCache storage backend vs SGLang's file and Mooncake backends, same run",
    )
    cmd.add_argument("--venv", default=".venv-vllm", help="the engine environment (make vllm-env)")
    cmd.add_argument("--bytes", default="1GiB", help="pages stored and loaded per repeat (e.g. 256MiB)")
    cmd.add_argument("--repeats", type=positive, default=3, help="rounds per figure (default 3)")
    cmd.add_argument("--directory", default=None, help="where the file backend's temp dir goes")
    cmd.add_argument("--json", action="store_true", help="print one JSON object")

    def main(args: argparse.Namespace) -> None:
        total = parse_size(args.bytes, "--bytes")
        emit(
            run(Path(args.venv), total, args.repeats, args.directory, show=not args.json), args.json, summary
        )

    cmd.set_defaults(func=main)


# ---------------------------------------------------------------- the worker (engine environment)
def _worker(spec: Spec) -> SglangBench:
    import torch
    from sglang.srt.mem_cache.hicache_storage import HiCacheFile, HiCacheStorageConfig  # type: ignore[import-not-found, unused-ignore]

    from kvtier.integrations.sglang import KvtierHiCacheStorage

    torch.manual_seed(0)
    repeats = spec["repeats"]
    probe = _pool(1, LAYERS, HEADS, HEAD_DIM)
    page_bytes = probe.get_size_per_token() * PAGE_TOKENS
    pages = max(1, spec["bytes"] // page_bytes)
    pool = _pool(2 * pages, LAYERS, HEADS, HEAD_DIM)
    src = pool.alloc(pages * PAGE_TOKENS)
    dst = pool.alloc(pages * PAGE_TOKENS)
    pool.kv_buffer.view(torch.uint8).random_()

    def config(extra: Mapping[str, object], model: str) -> Any:
        return HiCacheStorageConfig(
            tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
            is_mla_model=False, enable_storage_metrics=False, is_page_first_layout=True,
            model_name=model, extra_config=extra,
        )  # fmt: skip

    mooncake = spec.get("mooncake")
    with tempfile.TemporaryDirectory(prefix="kvtier-bench-sglang-", dir=spec["directory"]) as tmp:
        kv = KvtierHiCacheStorage(
            config({"dram": {"capacity_bytes": int(page_bytes * pages * 1.5)}}, "bench"), {}
        )
        kv.register_mem_pool_host(pool)
        kv.on_host_pools_registered()  # as SGLang attaches it: the store opens (and prefaults) here
        file = HiCacheFile(config({"file_storage_path": str(Path(tmp) / "pages")}, "bench"))
        file.register_mem_pool_host(pool)
        sides: dict[str, tuple[Callable[[list[str]], object], Callable[[list[str]], object], Any]] = {
            "kvtier": (partial(kv.batch_set_v1, host_indices=src), partial(kv.batch_get_v1, host_indices=dst), None),
            "file": (partial(_generic_set, file, pool, slots=src), partial(_generic_get, file, pool, slots=dst), file),
        }  # fmt: skip
        if mooncake is not None:
            # Room for every repeat: Mooncake keeps objects read in the last seconds (its lease TTL)
            # through clear(), so a repeat may not find the previous one's space free yet.
            mc = _mooncake(config, mooncake, pool, (repeats + 1) * page_bytes * pages + (256 << 20))
            sides["mooncake"] = (
                partial(mc.batch_set_v1, host_indices=src),
                partial(mc.batch_get_v1, host_indices=dst),
                mc,
            )
        times: dict[str, dict[str, list[float]]] = {name: {} for name in sides}
        for r in range(repeats):
            keys = [f"r{r}-page{i}" for i in range(pages)]
            for name, (set_pages, get_pages, backend) in sides.items():
                _time(times[name], "set", name, partial(set_pages, keys))
                _time(times[name], "get", name, partial(get_pages, keys))
                _check(pool, src, dst, pages, name)
                if backend is not None:
                    backend.clear()  # the next repeat stores fresh keys into an empty store
        memcpy_s = statistics.median(_memcpy(pool, src, dst) for _ in range(repeats))
        exists = _exists(config, Path(tmp) / "exists", repeats, mooncake)
    total = pages * page_bytes
    medians = {
        name: {case: statistics.median(values) for case, values in cases.items()}
        for name, cases in times.items()
    }
    backends = {
        name: BackendTimes(
            set_s=m["set"], get_s=m["get"], exists_s=exists[name],
            set_gb_per_s=total / m["set"] / 1e9, get_gb_per_s=total / m["get"] / 1e9,
        )
        for name, m in medians.items()
    }  # fmt: skip
    kv, file, mc = backends["kvtier"], backends["file"], backends.get("mooncake")
    memcpy_gb_per_s = total / memcpy_s / 1e9
    return SglangBench(
        page_bytes=page_bytes, pages=pages, bytes=total, repeats=repeats, memcpy_gb_per_s=memcpy_gb_per_s,
        exists_pages=EXISTS_TOKENS // PAGE_TOKENS, exists_tokens=EXISTS_TOKENS, kvtier=kv, file=file,
        set_ratio_to_file_backend=file.set_s / kv.set_s,
        get_ratio_to_file_backend=file.get_s / kv.get_s,
        exists_ratio_to_file_backend=file.exists_s / kv.exists_s,
        set_ratio_to_mooncake=None if mc is None else mc.set_s / kv.set_s,
        get_ratio_to_mooncake=None if mc is None else mc.get_s / kv.get_s,
        exists_ratio_to_mooncake=None if mc is None else mc.exists_s / kv.exists_s,
        kvtier_set_fraction_of_memcpy=kv.set_gb_per_s / memcpy_gb_per_s,
        kvtier_get_fraction_of_memcpy=kv.get_gb_per_s / memcpy_gb_per_s,
        mooncake=mc,
    )  # fmt: skip


def _mooncake(
    config: Callable[[Mapping[str, object], str], Any], servers: MooncakeServers, pool: Any, segment: int
) -> Any:
    """SGLang's own Mooncake backend (``MooncakeStore``, through SGLang's factory) over TCP on
    loopback, this process contributing ``segment`` bytes to the store as an SGLang instance does."""
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory  # type: ignore[import-not-found, unused-ignore]

    extra = {
        "master_server_address": servers["master"], "metadata_server": servers["metadata"],
        "protocol": "tcp", "device_name": "", "global_segment_size": segment, "local_buffer_size": 0,
    }  # fmt: skip
    backend = StorageBackendFactory.create_backend("mooncake", config(extra, "bench"), pool)
    backend.register_mem_pool_host(pool)
    return backend


def _pool(pages: int, layers: int, heads: int, head_dim: int) -> Any:
    import torch
    from sglang.srt.mem_cache.device_pool_info import KVBufferLayout, KVBuffers, MHABufferInfo  # type: ignore[import-not-found, unused-ignore]
    from sglang.srt.mem_cache.pool_host.base import host_memory_budget_scope  # type: ignore[import-not-found, unused-ignore]
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost  # type: ignore[import-not-found, unused-ignore]

    k = tuple(torch.empty(PAGE_TOKENS, heads, head_dim, dtype=torch.bfloat16) for _ in range(layers))
    v = tuple(torch.empty(PAGE_TOKENS, heads, head_dim, dtype=torch.bfloat16) for _ in range(layers))
    ptrs = [torch.tensor([t.data_ptr() for t in x], dtype=torch.uint64) for x in (k, v)]
    buffers = KVBuffers(k=k, v=v, k_data_ptrs=ptrs[0], v_data_ptrs=ptrs[1], layout=KVBufferLayout.NHD)
    info = MHABufferInfo(
        buffers=buffers, page_size=PAGE_TOKENS, head_num=heads, head_dim=head_dim, v_head_dim=head_dim,
        dtype=torch.bfloat16, device=torch.device("cpu"),
    )  # fmt: skip
    with host_memory_budget_scope(1 << 40):  # sized by the caller, not from free RAM
        return MHATokenToKVPoolHost(
            info, 1.0, 0, PAGE_TOKENS, "page_first", pin_memory=False, device="cpu",
            device_capacity_tokens=PAGE_TOKENS, start_layer=0, end_layer=layers,
            host_token_capacity=pages * PAGE_TOKENS,
        )  # fmt: skip


def _generic_set(backend: Any, pool: Any, keys: list[str], slots: Any) -> None:
    """SGLang's `HiCacheController._generic_page_set` (the path of backends without v1 calls)."""
    data = [pool.get_data_page(slots[i * pool.page_size]) for i in range(len(keys))]
    if not backend.batch_set(keys, data):
        raise KvtierError("the file backend refused a page")


def _generic_get(backend: Any, pool: Any, keys: list[str], slots: Any) -> None:
    """SGLang's `HiCacheController._generic_page_get`."""
    dummy = [pool.get_dummy_flat_data_page() for _ in keys]
    got = backend.batch_get(keys, dummy)
    for i, page in enumerate(got):
        if page is None:
            raise KvtierError(f"the file backend lost page {i}")
        pool.set_from_flat_data_page(slots[i * pool.page_size], page)


def _time(into: dict[str, list[float]], case: str, who: str, fn: Callable[[], object]) -> None:
    start = time.perf_counter()
    result = fn()
    into.setdefault(case, []).append(time.perf_counter() - start)
    if isinstance(result, list) and not all(result):
        raise KvtierError(f"{who} {case}: {result.count(False)} of {len(result)} pages failed")


def _check(pool: Any, src: Any, dst: Any, pages: int, who: str) -> None:
    import torch

    for i in (0, pages - 1):
        a = pool.get_data_page(int(src[i * PAGE_TOKENS]))
        b = pool.get_data_page(int(dst[i * PAGE_TOKENS]))
        if not torch.equal(a.view(torch.uint8), b.view(torch.uint8)):
            raise KvtierError(f"{who}: page {i} came back different")
    pool.kv_buffer[:, dst[0] : dst[-1] + 1].zero_()  # the next load must write every byte again


def _memcpy(pool: Any, src: Any, dst: Any) -> float:
    a = pool.kv_buffer[:, src[0] : src[-1] + 1]
    b = pool.kv_buffer[:, dst[0] : dst[-1] + 1]
    start = time.perf_counter()
    b.copy_(a)
    return time.perf_counter() - start


def _exists(
    config: Callable[[Mapping[str, object], str], Any],
    directory: Path,
    repeats: int,
    mooncake: MooncakeServers | None,
) -> dict[str, float]:
    """`batch_exists` of a 128K-token prefix, every page present, on small pages (lookup cost
    does not depend on page size): each backend's median seconds."""
    from sglang.srt.mem_cache.hicache_storage import HiCacheFile  # type: ignore[import-not-found, unused-ignore]

    from kvtier.integrations.sglang import KvtierHiCacheStorage

    n = EXISTS_TOKENS // PAGE_TOKENS
    pool = _pool(n, 1, 1, 8)
    slots = pool.alloc(n * PAGE_TOKENS)
    keys = [f"prefix-page{i}" for i in range(n)]
    kv = KvtierHiCacheStorage(config({"dram": {"capacity_bytes": "64MiB"}}, "bench-exists"), {})
    kv.register_mem_pool_host(pool)
    kv.on_host_pools_registered()
    file = HiCacheFile(config({"file_storage_path": str(directory)}, "bench-exists"))
    kv.batch_set_v1(keys, slots)
    _generic_set(file, pool, keys, slots)
    backends: dict[str, Any] = {"kvtier": kv, "file": file}
    if mooncake is not None:
        backends["mooncake"] = _mooncake(config, mooncake, pool, 512 << 20)
        _time({}, "set", "mooncake", partial(backends["mooncake"].batch_set_v1, keys, slots))
    out: dict[str, list[float]] = {name: [] for name in backends}
    for _ in range(repeats):
        for name, backend in backends.items():
            start = time.perf_counter()
            hit = backend.batch_exists(keys)
            out[name].append(time.perf_counter() - start)
            if hit != n:
                raise KvtierError(f"{name}: batch_exists found {hit} of {n} pages")
    return {name: statistics.median(times) for name, times in out.items()}


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--worker", required=True)
    result = _worker(json.loads(parser.parse_args().worker))
    print("RESULT " + json_text(result, sort_keys=True), flush=True)
