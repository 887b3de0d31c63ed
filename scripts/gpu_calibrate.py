"""Measure what the simulator's GPU constants stand for, on a real NVIDIA GPU (torch only).

The simulator's roofline cost model (``kvtier.sim.cost.RooflineCostModel``) and its host-link model
(``transfer_work_s``: bytes / bandwidth + segments x per-segment overhead) carry constants taken
from the literature (MFU, HBM efficiency, PCIe rates, 5 us a copy). This script times, on the GPU
it runs on:

- ``links``: pinned host <-> GPU copies by segment size, one ``copy_`` per segment (what a naive
  per-page swap issues) and one copy of everything, each direction; both directions at once.
- ``steps``: one forward step of a Llama-3.1-8B-shaped model (random bf16 weights, the published
  shapes) for batch shapes of prefill chunks and decodes, packed varlen flash attention over one KV
  buffer, eager and replayed as a CUDA graph.
- ``kvtier``: kvtier's DRAM tier on this host: ``Store.put`` / lease + ``load`` of 16-token
  Llama-3-8B objects into a pinned buffer, then that buffer to the GPU, against a memcpy into the
  same pinned buffer (only when kvtier imports).

Writes one JSON file; ``python -m kvtier.sim.gpu_check FILE`` (run where kvtier is installed)
compares it with the simulator's predictions. ``--tiny`` runs a toy model on the CPU to check the
script itself.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

LLAMA_8B = dict(hidden=4096, layers=32, heads=32, kv_heads=8, head_dim=128, ffn=14336, vocab=128256)
TINY = dict(hidden=256, layers=2, heads=4, kv_heads=2, head_dim=64, ffn=512, vocab=1000)

# (prefills as (new, context) pairs, decode contexts): GPU-scale counterparts of the simulator's
# calibration shapes (kvtier.sim.calibrate.DEFAULT_SHAPES), interleaved so every other one is a
# held-out shape of the same kind.
SHAPES: list[tuple[list[tuple[int, int]], list[int]]] = [
    ([(128, 0)], []),
    ([(512, 0)], []),
    ([(1024, 0)], []),
    ([(2048, 0)], []),
    ([(4096, 0)], []),
    ([(8192, 0)], []),
    ([(512, 4096)], []),
    ([(256, 16384)], []),
    ([(2048, 2048)], []),
    ([(1024, 8192)], []),
    ([], [1024]),
    ([], [4096]),
    ([], [16384]),
    ([], [1024] * 4),
    ([], [2048] * 8),
    ([], [1024] * 16),
    ([], [4096] * 16),
    ([], [1024] * 32),
    ([], [2048] * 32),
    ([], [1024] * 64),
    ([], [4096] * 48),
    ([], [1024] * 128),
    ([], [512] * 256),
    ([], [2048] * 96),
    ([(512, 0)], [1024] * 16),
    ([(2048, 0)], [2048] * 32),
    ([(512, 8192)], [4096] * 16),
    ([(256, 0), (256, 1024)], [1024] * 64),
    ([(1024, 0)], [512] * 128),
    ([(128, 2048)], [2048] * 8),
]
TINY_SHAPES = [([(16, 0)], []), ([(8, 24)], []), ([], [32] * 3), ([(8, 0)], [16] * 2)]


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def machine() -> dict[str, Any]:
    info: dict[str, Any] = {"python": platform.python_version(), "torch": torch.__version__}
    info["cpu_count"] = os.cpu_count()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                info["cpu"] = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        info.update(gpu=p.name, sms=p.multi_processor_count, gpu_memory_bytes=p.total_memory)
        try:
            out = subprocess.run(
                [
                    "nvidia-smi",
                    "--query-gpu=driver_version,pcie.link.gen.max,pcie.link.width.max,clocks.max.sm",
                    "--format=csv,noheader",
                ],
                capture_output=True,
                text=True,
                timeout=20,
            ).stdout.strip()
            info["nvidia_smi"] = out
        except (OSError, subprocess.SubprocessError):
            pass
    return info


# ---------------------------------------------------------------------------------------- links


def time_cuda(fn: Any, repeats: int) -> list[float]:
    """Seconds of each of ``repeats`` calls of ``fn`` (CUDA events on the current stream)."""
    out = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        out.append(start.elapsed_time(end) / 1e3)
    return out


def links() -> dict[str, Any]:
    total_max = 1 << 30
    host = torch.empty(total_max, dtype=torch.uint8, pin_memory=True)
    host.fill_(7)
    dev = torch.empty(total_max, dtype=torch.uint8, device="cuda")
    dev.fill_(3)
    rows = []
    for seg in (4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20):
        total = max(64 << 20, min(total_max, seg * 4096))
        n = total // seg
        hs, ds = host[: n * seg].view(n, seg), dev[: n * seg].view(n, seg)
        for direction in ("h2d", "d2h"):
            src, dst = (hs, ds) if direction == "h2d" else (ds, hs)

            def per_segment(src: torch.Tensor = src, dst: torch.Tensor = dst) -> None:
                for i in range(src.shape[0]):
                    dst[i].copy_(src[i], non_blocking=True)

            def one_copy(src: torch.Tensor = src, dst: torch.Tensor = dst) -> None:
                dst.copy_(src, non_blocking=True)

            per_segment()
            torch.cuda.synchronize()
            seg_s = statistics.median(time_cuda(per_segment, 3))
            one_s = statistics.median(time_cuda(one_copy, 5))
            rows.append(
                dict(
                    direction=direction,
                    segment_bytes=seg,
                    segments=n,
                    bytes=n * seg,
                    per_segment_s=seg_s,
                    one_copy_s=one_s,
                )
            )
            log(
                f"link {direction} {seg >> 10} KiB x {n}: {n * seg / seg_s / 1e9:.1f} GB/s per segment, "
                f"{n * seg / one_s / 1e9:.1f} GB/s one copy"
            )
    # Both directions at once, 64 MiB copies on two streams.
    half = total_max // 2
    a, b = torch.cuda.Stream(), torch.cuda.Stream()
    chunk = 64 << 20

    def duplex() -> None:
        with torch.cuda.stream(a):
            for off in range(0, half, chunk):
                dev[off : off + chunk].copy_(host[off : off + chunk], non_blocking=True)
        with torch.cuda.stream(b):
            for off in range(half, total_max, chunk):
                host[off : off + chunk].copy_(dev[off : off + chunk], non_blocking=True)
        torch.cuda.synchronize()

    duplex()
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        duplex()
        times.append(time.perf_counter() - t0)
    duplex_s = statistics.median(times)
    log(f"duplex: {total_max / duplex_s / 1e9:.1f} GB/s both directions together")
    return {"rows": rows, "duplex_bytes": total_max, "duplex_s": duplex_s}


# ---------------------------------------------------------------------------------------- steps


class Attention:
    """Packed varlen causal attention, bottom-right aligned (a query sees its own context)."""

    def __init__(self, device: str) -> None:
        self.kind = "sdpa_loop"
        if device != "cuda":
            return
        for kind in ("aten_flash", "varlen_attn"):
            self.kind = kind
            try:
                if self._check():
                    log(f"attention: {kind} (checked against SDPA per sequence)")
                    return
                log(f"attention: {kind} disagrees with SDPA; not used")
            except Exception as e:  # any failure means: do not use this kernel
                log(f"attention: {kind} unavailable: {type(e).__name__}: {e}")
        self.kind = "sdpa_loop"
        log("attention: SDPA per sequence (slow on many sequences)")

    def _check(self) -> bool:
        torch.manual_seed(0)
        lens_q, lens_k = [5, 1, 3], [9, 7, 3]
        q = torch.randn(sum(lens_q), 8, 128, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(sum(lens_k), 2, 128, device="cuda", dtype=torch.bfloat16)
        v = torch.randn_like(k)
        got = self(q, k, v, lens_q, lens_k, *self.cu(lens_q, lens_k, "cuda"))
        kind, self.kind = self.kind, "sdpa_loop"
        want = self(q, k, v, lens_q, lens_k, *self.cu(lens_q, lens_k, "cuda"))
        self.kind = kind
        return bool(torch.allclose(got.float(), want.float(), atol=3e-2, rtol=3e-2))

    @staticmethod
    def cu(lens_q: list[int], lens_k: list[int], device: str) -> tuple[torch.Tensor, torch.Tensor]:
        cq = torch.tensor([0, *itertools.accumulate(lens_q)], dtype=torch.int32, device=device)
        ck = torch.tensor([0, *itertools.accumulate(lens_k)], dtype=torch.int32, device=device)
        return cq, ck

    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        lens_q: list[int],
        lens_k: list[int],
        cq: torch.Tensor,
        ck: torch.Tensor,
    ) -> torch.Tensor:
        scale = q.shape[-1] ** -0.5
        if self.kind == "aten_flash":
            return torch.ops.aten._flash_attention_forward(
                q, k, v, cq, ck, max(lens_q), max(lens_k), 0.0, True, False, scale=scale
            )[0]
        if self.kind == "varlen_attn":
            from torch.nn.attention.varlen import varlen_attn

            try:  # torch 2.13 spells causal as a window and asks for GQA explicitly
                return varlen_attn(
                    q, k, v, cq, ck, max(lens_q), max(lens_k), window_size=(-1, 0), enable_gqa=True
                )
            except TypeError:
                return varlen_attn(q, k, v, cq, ck, max(lens_q), max(lens_k), is_causal=True)
        outs, oq, ok = [], 0, 0
        group = q.shape[1] // k.shape[1]
        for nq, nk in zip(lens_q, lens_k, strict=True):
            qi = q[oq : oq + nq].transpose(0, 1)[None]
            ki = k[ok : ok + nk].repeat_interleave(group, dim=1).transpose(0, 1)[None]
            vi = v[ok : ok + nk].repeat_interleave(group, dim=1).transpose(0, 1)[None]
            # bottom-right causal: query j (of nq) sees keys < nk - nq + j + 1
            mask = torch.ones(nq, nk, dtype=torch.bool, device=q.device).tril(nk - nq)
            outs.append(
                F.scaled_dot_product_attention(qi, ki, vi, attn_mask=mask, scale=scale)[0].transpose(0, 1)
            )
            oq, ok = oq + nq, ok + nk
        return torch.cat(outs)


class Model:
    def __init__(self, cfg: dict[str, int], device: str, dtype: torch.dtype, kv_tokens: int) -> None:
        self.cfg, self.device, self.dtype = cfg, device, dtype
        h, f, nh, kvh, hd = cfg["hidden"], cfg["ffn"], cfg["heads"], cfg["kv_heads"], cfg["head_dim"]

        def w(*shape: int) -> torch.Tensor:
            return torch.empty(*shape, device=device, dtype=dtype).normal_(0, 0.02)

        self.layers = [
            dict(
                qkv=w(h, (nh + 2 * kvh) * hd),
                o=w(nh * hd, h),
                gu=w(h, 2 * f),
                down=w(f, h),
                n1=torch.ones(h, device=device, dtype=dtype),
                n2=torch.ones(h, device=device, dtype=dtype),
            )
            for _ in range(cfg["layers"])
        ]
        self.lm = w(h, cfg["vocab"])
        self.norm = torch.ones(h, device=device, dtype=dtype)
        # One KV buffer (K and V) that every layer reads and writes: the bytes a layer moves are a
        # real layer's; sharing it only saves memory.
        self.kv = torch.zeros(2, kv_tokens, kvh, hd, device=device, dtype=dtype)
        self.attn = Attention(device)
        inv = 1.0 / (500000.0 ** (torch.arange(0, hd, 2, device=device, dtype=torch.float32) / hd))
        self.inv_freq = inv

    def inputs(self, prefills: list[tuple[int, int]], decodes: list[int]) -> dict[str, Any]:
        seqs = [(n, c) for n, c in prefills] + [(1, c) for c in decodes]
        lens_q = [n for n, _ in seqs]
        lens_k = [n + c for n, c in seqs]
        if sum(lens_k) > self.kv.shape[1]:
            raise ValueError(f"shape needs {sum(lens_k)} KV tokens; buffer holds {self.kv.shape[1]}")
        slots, pos, last, off, oq = [], [], [], 0, 0
        for n, c in seqs:
            slots.append(torch.arange(off + c, off + c + n))
            pos.append(torch.arange(c, c + n))
            off += n + c
            oq += n
            last.append(oq - 1)
        cq, ck = Attention.cu(lens_q, lens_k, self.device)
        p = torch.cat(pos).to(self.device, torch.float32)
        ang = p[:, None] * self.inv_freq[None]
        return dict(
            x=torch.empty(sum(lens_q), self.cfg["hidden"], device=self.device, dtype=self.dtype).normal_(),
            slots=torch.cat(slots).to(self.device),
            cos=torch.cos(ang).to(self.dtype)[:, None],
            sin=torch.sin(ang).to(self.dtype)[:, None],
            last=torch.tensor(last, device=self.device),
            lens_q=lens_q,
            lens_k=lens_k,
            cq=cq,
            ck=ck,
            total_k=sum(lens_k),
        )

    def forward(self, a: dict[str, Any]) -> torch.Tensor:
        cfg = self.cfg
        nh, kvh, hd = cfg["heads"], cfg["kv_heads"], cfg["head_dim"]
        x = a["x"]
        t = x.shape[0]
        kbuf, vbuf = self.kv[0], self.kv[1]
        for L in self.layers:
            hdn = F.rms_norm(x, (x.shape[-1],), L["n1"])
            qkv = hdn @ L["qkv"]
            q = qkv[:, : nh * hd].view(t, nh, hd)
            k = qkv[:, nh * hd : (nh + kvh) * hd].view(t, kvh, hd)
            v = qkv[:, (nh + kvh) * hd :].view(t, kvh, hd)
            q, k = rope(q, a["cos"], a["sin"]), rope(k, a["cos"], a["sin"])
            kbuf.index_copy_(0, a["slots"], k)
            vbuf.index_copy_(0, a["slots"], v)
            o = self.attn(
                q, kbuf[: a["total_k"]], vbuf[: a["total_k"]], a["lens_q"], a["lens_k"], a["cq"], a["ck"]
            )
            x = x + o.reshape(t, nh * hd) @ L["o"]
            hdn = F.rms_norm(x, (x.shape[-1],), L["n2"])
            g, u = (hdn @ L["gu"]).chunk(2, dim=-1)
            x = x + (F.silu(g) * u) @ L["down"]
        h = F.rms_norm(x[a["last"]], (x.shape[-1],), self.norm)
        return (h @ self.lm).argmax(-1)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    c, s = cos, sin
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)


def steps(tiny: bool, budget_s: float) -> dict[str, Any]:
    cfg = TINY if tiny else LLAMA_8B
    device = "cpu" if tiny else "cuda"
    dtype = torch.float32 if tiny else torch.bfloat16
    shapes = TINY_SHAPES if tiny else SHAPES
    kv_tokens = max(sum(n + c for n, c in p) + sum(c + 1 for c in d) for p, d in shapes)
    t0 = time.perf_counter()
    model = Model(cfg, device, dtype, kv_tokens)
    if device == "cuda":
        torch.cuda.synchronize()
    log(
        f"model built in {time.perf_counter() - t0:.1f} s; KV buffer {kv_tokens} tokens; attention {model.attn.kind}"
    )
    rows = []
    start = time.perf_counter()
    for prefills, decodes in shapes:
        if time.perf_counter() - start > budget_s:
            log("step budget spent; remaining shapes skipped")
            break
        a = model.inputs(prefills, decodes)
        row: dict[str, Any] = dict(prefills=prefills, decodes=decodes)
        with torch.inference_mode():
            if device == "cpu":
                model.forward(a)
                ts = []
                for _ in range(3):
                    t1 = time.perf_counter()
                    model.forward(a)
                    ts.append(time.perf_counter() - t1)
                row["eager_s"] = statistics.median(ts)
            else:
                for _ in range(2):
                    model.forward(a)
                torch.cuda.synchronize()
                row["eager_s"] = statistics.median(time_cuda(lambda a=a: model.forward(a), 5))
                try:
                    side = torch.cuda.Stream()
                    side.wait_stream(torch.cuda.current_stream())
                    with torch.cuda.stream(side):
                        model.forward(a)
                    torch.cuda.current_stream().wait_stream(side)
                    g = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(g):
                        model.forward(a)
                    g.replay()
                    torch.cuda.synchronize()
                    row["graph_s"] = statistics.median(time_cuda(g.replay, 10))
                    del g
                except Exception as e:  # report and keep the eager time
                    row["graph_error"] = f"{type(e).__name__}: {e}"[:300]
                torch.cuda.empty_cache()
        rows.append(row)
        log(
            f"step {prefills} + {len(decodes)} decodes @ {decodes[0] if decodes else 0}: "
            f"eager {row['eager_s'] * 1e3:.2f} ms, graph {row.get('graph_s', math.nan) * 1e3:.2f} ms"
        )
    return {
        "model": "tiny" if tiny else "Llama-3.1-8B-shaped",
        "config": cfg,
        "dtype": str(dtype),
        "attention": model.attn.kind,
        "rows": rows,
    }


# --------------------------------------------------------------------------------------- kvtier


def kvtier_part(repo: Path) -> dict[str, Any]:
    sys.path.insert(0, str(repo / "python"))
    import numpy as np

    from kvtier.config import DramConfig, StoreConfig
    from kvtier.geometry import Geometry
    from kvtier.store import Store

    geometry = Geometry.llama3_8b()
    n = (1 << 30) // geometry.block_bytes
    nbytes = n * geometry.block_bytes
    pinned_t = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    pinned = pinned_t.numpy().reshape(n, geometry.block_bytes)
    pinned.fill(0)
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    objects = np.random.default_rng(0).integers(0, 255, (n, geometry.block_bytes), dtype=np.uint8)
    out: dict[str, Any] = {"objects": n, "bytes": nbytes, "threads": os.cpu_count()}
    for threads in sorted({1, min(8, os.cpu_count() or 1)}):
        store = Store(
            StoreConfig(
                geometry=geometry,
                model_id="gpu-check",
                dram=DramConfig(capacity_bytes=int(2.2 * nbytes), prefault=True),
                copy_threads=threads,
            )
        )
        tokens = np.arange(n * geometry.block_tokens) % 128_000
        store.put(store.namespace.block_keys(tokens + 128_000), objects)  # faults the arena in
        puts, loads, h2d, memcpys = [], [], [], []
        for r in range(5):  # fresh keys each round: a put of present keys stores nothing
            keys = store.namespace.block_keys((tokens + 7 * r) % 128_000)
            t0 = time.perf_counter()
            rep = store.put(keys, objects)
            puts.append(time.perf_counter() - t0)
            if rep.stored != n:
                raise RuntimeError(f"kvtier stored {rep.stored} of {n}")
            t0 = time.perf_counter()
            with store.lease(keys) as lease:
                if lease.hit_blocks != n or store.load(lease, pinned).loaded_blocks != n:
                    raise RuntimeError("kvtier missed its own objects")
            t1 = time.perf_counter()
            dev.copy_(pinned_t, non_blocking=True)
            torch.cuda.synchronize()
            t2 = time.perf_counter()
            loads.append(t1 - t0)
            h2d.append(t2 - t1)
            t0 = time.perf_counter()
            np.copyto(pinned, objects)
            memcpys.append(time.perf_counter() - t0)
        if not np.array_equal(pinned[-1], objects[-1]) or not torch.equal(dev[-16:].cpu(), pinned_t[-16:]):
            raise RuntimeError("wrong bytes")
        out[f"threads_{threads}"] = dict(
            put_s=statistics.median(puts),
            load_s=statistics.median(loads),
            h2d_s=statistics.median(h2d),
            memcpy_s=statistics.median(memcpys),
        )
        log(f"kvtier {threads} copy thread(s): {out[f'threads_{threads}']}")
        del store
    return out


def overlap() -> dict[str, Any]:
    """Does a DMA copy stream slow a step, or a step the copies? The simulator charges them
    independently (a link and the GPU are separate resources)."""
    model = Model(LLAMA_8B, "cuda", torch.bfloat16, 70_000)
    nbytes, chunk = 1 << 30, 64 << 20
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    host.fill_(5)
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    copy_stream = torch.cuda.Stream()

    def copies(direction: str, rounds: int) -> None:
        with torch.cuda.stream(copy_stream):
            for _ in range(rounds):
                for off in range(0, nbytes, chunk):
                    if direction in ("h2d", "both"):
                        dev[off : off + chunk].copy_(host[off : off + chunk], non_blocking=True)
                    if direction in ("d2h", "both"):
                        j = (off + nbytes // 2) % nbytes
                        host[j : j + chunk].copy_(dev[j : j + chunk], non_blocking=True)

    rows = []
    for prefills, decodes in (([(4096, 0)], []), ([], [1024] * 64), ([(512, 0)], [1024] * 16)):
        a = model.inputs(prefills, decodes)
        with torch.inference_mode():
            for _ in range(2):
                model.forward(a)
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                model.forward(a)
            g.replay()
            torch.cuda.synchronize()
            step_alone = statistics.median(time_cuda(g.replay, 10))
            for direction in ("h2d", "d2h", "both"):
                e0, c1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                e0.record()
                copy_stream.wait_event(e0)
                copies(direction, 1)
                c1.record(copy_stream)
                c1.synchronize()
                copy_alone = e0.elapsed_time(c1) / 1e3
                rounds = 3
                replays = max(3, round(rounds * copy_alone / step_alone))
                m1 = torch.cuda.Event(enable_timing=True)
                c1 = torch.cuda.Event(enable_timing=True)
                e0 = torch.cuda.Event(enable_timing=True)
                e0.record()
                copy_stream.wait_event(e0)
                copies(direction, rounds)
                c1.record(copy_stream)
                for _ in range(replays):
                    g.replay()
                m1.record()
                torch.cuda.synchronize()
                copy_together = e0.elapsed_time(c1) / 1e3 / rounds
                step_together = e0.elapsed_time(m1) / 1e3 / replays
                row = dict(
                    prefills=prefills,
                    decodes=len(decodes),
                    direction=direction,
                    step_alone_s=step_alone,
                    step_together_s=step_together,
                    copy_bytes=nbytes * (2 if direction == "both" else 1),
                    copy_alone_s=copy_alone,
                    copy_together_s=copy_together,
                    replays=replays,
                )
                rows.append(row)
                log(
                    f"overlap {prefills} + {len(decodes)} decodes, {direction}: step {step_alone * 1e3:.2f} -> "
                    f"{step_together * 1e3:.2f} ms, copies {row['copy_bytes'] / copy_alone / 1e9:.1f} -> "
                    f"{row['copy_bytes'] / copy_together / 1e9:.1f} GB/s"
                )
            del g
    return {"rows": rows}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--parts", default="links,steps,kvtier")
    ap.add_argument("--step-budget-s", type=float, default=240.0)
    args = ap.parse_args()
    parts = set(args.parts.split(","))
    result: dict[str, Any] = {
        "machine": machine(),
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    log(f"machine: {result['machine']}")

    def save() -> None:
        args.out.write_text(json.dumps(result, indent=1))

    for part, fn in (
        ("links", links),
        ("steps", lambda: steps(args.tiny, args.step_budget_s)),
        ("overlap", overlap),
        ("kvtier", lambda: kvtier_part(Path(__file__).resolve().parent.parent)),
    ):
        if part not in parts or (args.tiny and part != "steps"):
            continue
        try:
            result[part] = fn()
        except Exception as e:  # keep the other parts' figures
            result[f"{part}_error"] = f"{type(e).__name__}: {e}"[:1000]
            log(f"{part} failed: {result[f'{part}_error']}")
        save()
    save()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
