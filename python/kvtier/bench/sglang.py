"""`kvtier bench sglang`: kvtier as SGLang's HiCache storage backend against SGLang's built-in `file`
backend, on SGLang's own host KV pool, in the same run.

The kvtier CLI runs in kvtier's environment; the measurement runs in the engine environment
(`.venv-vllm`, `make vllm-env`, sglang pinned) as `python -m kvtier.bench.sglang --worker`:

- pages: an MHA `page_first` host pool of Llama-3-8B-like pages (32 layers, 8 KV heads, head dim
  128, bf16, 64 tokens: 8 MiB a page) holding `--bytes` of random pages. Each repeat stores them
  under fresh keys and loads them back into other pages of the pool, each backend the way SGLang's
  cache controller drives it: kvtier through `batch_set_v1`/`batch_get_v1` (`interface_v1`, zero
  copy), the file backend (which has no v1 calls) through `_generic_page_set`/`_generic_page_get`
  (flat page tensors; the same code as SGLang's `HiCacheController`). kvtier runs with its DRAM
  tier; the file backend writes files (the page cache keeps them).
- exists: `batch_exists` of a 128K-token prefix (2,048 pages of 64 tokens, all present).

Reported: median seconds per case, `set_ratio_to_file_backend`, `get_ratio_to_file_backend`,
`exists_ratio_to_file_backend` (speed, above 1 = kvtier faster) and, as the limit, kvtier's
bandwidth as a share of a plain memcpy of the same bytes measured in the same run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

from kvtier.bench.engine_env import run_worker
from kvtier.errors import KvtierError

PAGE_TOKENS = 64
EXISTS_TOKENS = 128 * 1024
LAYERS, HEADS, HEAD_DIM = 32, 8, 128


def run(venv: Path, total_bytes: int, repeats: int = 3, directory: str | None = None) -> dict[str, Any]:
    """Runs the worker in the engine environment and returns its figures."""
    args = {"bytes": total_bytes, "repeats": repeats, "directory": directory}
    return run_worker(
        venv, "kvtier.bench.sglang", ["--worker", json.dumps(args)], "SGLang bench worker", 3600
    )


def summary(r: dict[str, Any]) -> str:
    k, f = r["kvtier"], r["file"]
    return "\n".join(
        [
            f"SGLang HiCache storage: {r['pages']} pages of {r['page_bytes'] / 2**20:.1f} MiB "
            f"({r['bytes'] / 2**30:.2f} GiB), median of {r['repeats']}; memcpy {r['memcpy_gb_per_s']:.2f} GB/s",
            f"  batch_set  kvtier {k['set_s'] * 1e3:8.1f} ms ({k['set_gb_per_s']:.2f} GB/s)   "
            f"file {f['set_s'] * 1e3:8.1f} ms   ratio {r['set_ratio_to_file_backend']:.2f}x",
            f"  batch_get  kvtier {k['get_s'] * 1e3:8.1f} ms ({k['get_gb_per_s']:.2f} GB/s)   "
            f"file {f['get_s'] * 1e3:8.1f} ms   ratio {r['get_ratio_to_file_backend']:.2f}x",
            f"  batch_exists ({r['exists_pages']} pages, 128K tokens)  kvtier {k['exists_s'] * 1e3:.2f} ms   "
            f"file {f['exists_s'] * 1e3:.2f} ms   ratio {r['exists_ratio_to_file_backend']:.2f}x",
            f"  kvtier set/get at {r['kvtier_set_fraction_of_memcpy']:.2f}/{r['kvtier_get_fraction_of_memcpy']:.2f} of memcpy",
        ]
    )


def add_command(bench_sub: Any, positive: Callable[[str], int], emit: Callable[..., None]) -> None:
    """`kvtier bench sglang` (called where the CLI registers its bench subcommands)."""
    from kvtier.config import parse_size

    cmd = bench_sub.add_parser(
        "sglang", help="kvtier as SGLang's HiCache storage backend vs SGLang's file backend, same run"
    )
    cmd.add_argument("--venv", default=".venv-vllm", help="the engine environment (make vllm-env)")
    cmd.add_argument("--bytes", default="256MiB", help="pages stored and loaded per repeat (e.g. 1GiB)")
    cmd.add_argument("--repeats", type=positive, default=3)
    cmd.add_argument("--directory", default=None, help="where the file backend's temp dir goes")
    cmd.add_argument("--json", action="store_true")

    def main(args: argparse.Namespace) -> None:
        total = parse_size(args.bytes, "--bytes")
        emit(run(Path(args.venv), total, args.repeats, args.directory), args.json, summary)

    cmd.set_defaults(func=main)


# ---------------------------------------------------------------- the worker (engine environment)
def _worker(spec: dict[str, Any]) -> dict[str, Any]:
    import torch
    from sglang.srt.mem_cache.hicache_storage import HiCacheFile, HiCacheStorageConfig  # type: ignore[import-not-found, unused-ignore]

    from kvtier.integrations.sglang import KvtierHiCacheStorage

    torch.manual_seed(0)
    repeats = int(spec["repeats"])
    probe = _pool(1, LAYERS, HEADS, HEAD_DIM)
    page_bytes = probe.get_size_per_token() * PAGE_TOKENS
    pages = max(1, int(spec["bytes"]) // page_bytes)
    pool = _pool(2 * pages, LAYERS, HEADS, HEAD_DIM)
    src = pool.alloc(pages * PAGE_TOKENS)
    dst = pool.alloc(pages * PAGE_TOKENS)
    pool.kv_buffer.view(torch.uint8).random_()

    def config(extra: dict[str, Any], model: str) -> Any:
        return HiCacheStorageConfig(
            tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
            is_mla_model=False, enable_storage_metrics=False, is_page_first_layout=True,
            model_name=model, extra_config=extra,
        )  # fmt: skip

    with tempfile.TemporaryDirectory(prefix="kvtier-bench-sglang-", dir=spec.get("directory")) as tmp:
        kv = KvtierHiCacheStorage(config({"dram_capacity_bytes": int(page_bytes * pages * 1.5)}, "bench"), {})
        kv.register_mem_pool_host(pool)
        file = HiCacheFile(config({"file_storage_path": str(Path(tmp) / "pages")}, "bench"))
        file.register_mem_pool_host(pool)
        times: dict[str, dict[str, list[float]]] = {"kvtier": {}, "file": {}}
        for r in range(repeats):
            keys = [f"r{r}-page{i}" for i in range(pages)]
            _time(times["kvtier"], "set", partial(kv.batch_set_v1, keys, src))
            _time(times["kvtier"], "get", partial(kv.batch_get_v1, keys, dst))
            _check(pool, src, dst, pages, "kvtier")
            _time(times["file"], "set", partial(_generic_set, file, pool, keys, src))
            _time(times["file"], "get", partial(_generic_get, file, pool, keys, dst))
            _check(pool, src, dst, pages, "file")
            file.clear()
        memcpy_s = statistics.median(_memcpy(pool, src, dst) for _ in range(repeats))
        exists = _exists(config, Path(tmp) / "exists", repeats)
    out: dict[str, Any] = {"page_bytes": page_bytes, "pages": pages, "bytes": pages * page_bytes}
    out |= {"repeats": repeats, "memcpy_gb_per_s": pages * page_bytes / memcpy_s / 1e9, **exists}
    for name, cases in times.items():
        entry = {f"{case}_s": statistics.median(values) for case, values in cases.items()}
        entry |= {f"{case}_gb_per_s": out["bytes"] / entry[f"{case}_s"] / 1e9 for case in ("set", "get")}
        out.setdefault(name, {}).update(entry)
    for case in ("set", "get", "exists"):
        out[f"{case}_ratio_to_file_backend"] = out["file"][f"{case}_s"] / out["kvtier"][f"{case}_s"]
    for case in ("set", "get"):
        out[f"kvtier_{case}_fraction_of_memcpy"] = out["kvtier"][f"{case}_gb_per_s"] / out["memcpy_gb_per_s"]
    return out


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


def _time(into: dict[str, list[float]], case: str, fn: Callable[[], object]) -> None:
    start = time.perf_counter()
    result = fn()
    into.setdefault(case, []).append(time.perf_counter() - start)
    if isinstance(result, list) and not all(result):
        raise KvtierError(f"kvtier {case}: {result.count(False)} pages failed")


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


def _exists(config: Callable[[dict[str, Any], str], Any], directory: Path, repeats: int) -> dict[str, Any]:
    """`batch_exists` of a 128K-token prefix, every page present, on small pages (lookup cost
    does not depend on page size)."""
    from sglang.srt.mem_cache.hicache_storage import HiCacheFile  # type: ignore[import-not-found, unused-ignore]

    from kvtier.integrations.sglang import KvtierHiCacheStorage

    n = EXISTS_TOKENS // PAGE_TOKENS
    pool = _pool(n, 1, 1, 8)
    slots = pool.alloc(n * PAGE_TOKENS)
    keys = [f"prefix-page{i}" for i in range(n)]
    kv = KvtierHiCacheStorage(config({"dram_capacity_bytes": "64MiB"}, "bench-exists"), {})
    kv.register_mem_pool_host(pool)
    file = HiCacheFile(config({"file_storage_path": str(directory)}, "bench-exists"))
    kv.batch_set_v1(keys, slots)
    _generic_set(file, pool, keys, slots)
    out: dict[str, list[float]] = {"kvtier": [], "file": []}
    for _ in range(repeats):
        for name, backend in (("kvtier", kv), ("file", file)):
            start = time.perf_counter()
            hit = backend.batch_exists(keys)
            out[name].append(time.perf_counter() - start)
            if hit != n:
                raise KvtierError(f"{name}: batch_exists found {hit} of {n} pages")
    return {
        "exists_pages": n,
        "exists_tokens": EXISTS_TOKENS,
        "kvtier": {"exists_s": statistics.median(out["kvtier"])},
        "file": {"exists_s": statistics.median(out["file"])},
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--worker", required=True)
    result = _worker(json.loads(parser.parse_args().worker))
    print("RESULT " + json.dumps(result, sort_keys=True), flush=True)
