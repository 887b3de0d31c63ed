"""Every buffer that crosses into Rust is checked for what its items are (issue 15, defect 1).

An array of Python objects holds `PyObject*` slots: writing KV over them crashed the process when
the array was freed, and reading them stored heap addresses as KV. Each call that takes a buffer
must refuse such arrays (and any item type it does not define) with a `kvtier.errors.BufferError`
naming the type, and must give correct bytes for every plain numeric type. A crash is possible
in the bad cases, so each runs in a subprocess: a crash is a failed test, not a dead pytest.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import kvtier
from kvtier import layout
from kvtier.errors import BufferError

# The body run in a subprocess: it defines the store, geometry and helpers, runs CALL on an array
# of DTYPE, and prints one JSON line: {"ok": true} or {"error": class name, "message": ...}.
PRELUDE = """
import json, sys
import numpy as np
import kvtier
from kvtier import layout, codec, _core
g = kvtier.Geometry(num_layers=2, num_kv_heads=1, head_dim=8, dtype="fp16", block_tokens=4)
store = kvtier.Store(kvtier.StoreConfig(geometry=g, model_id="fmt-test", dram=kvtier.DramConfig(capacity_bytes="1MiB")))
keys = store.namespace.block_keys(list(range(8)))
good = np.arange(2 * g.block_bytes, dtype=np.uint8).reshape(2, g.block_bytes)
store.put(keys, good)
def like(dtype, nbytes):
    dt = np.dtype(dtype)
    return np.zeros(nbytes // dt.itemsize, dtype=dt)
def run(call, dtype):
    try:
        call(dtype)
    except kvtier.KvtierError as e:
        print(json.dumps({"error": type(e).__name__, "message": str(e)}))
    else:
        print(json.dumps({"ok": True}))
    sys.stdout.flush()
"""

CALLS = {
    "store.load": """
def call(dtype):
    out = like(dtype, 2 * g.block_bytes).reshape(2, -1)
    with store.lease(keys) as lease:
        store.load(lease, out)
    assert out.view(np.uint8).reshape(2, -1).tobytes() == good.tobytes(), "load gave wrong bytes"
""",
    "store.put": """
def call(dtype):
    arr = like(dtype, 2 * g.block_bytes).reshape(2, -1)
    k = store.namespace.block_keys(list(range(100, 108)))
    store.put(k, arr)
""",
    "layout.scatter": """
def call(dtype):
    pool = like(dtype, g.pool_bytes(4))
    layout.scatter(g, good, [1, 3], pool)
    back = layout.gather(g, pool.view(np.uint8), [1, 3])
    assert back.tobytes() == good.tobytes(), "scatter gave wrong bytes"
""",
    "layout.gather": """
def call(dtype):
    pool = layout.alloc_pool(g, 4)
    layout.scatter(g, good, [0, 2], pool)
    out = like(dtype, 2 * g.block_bytes).reshape(2, -1)
    layout.gather(g, pool, [0, 2], out)
    assert out.view(np.uint8).tobytes() == good.tobytes(), "gather gave wrong bytes"
""",
    "memcpy": """
def call(dtype):
    dst = like(dtype, 64)
    _core.memcpy(dst, np.arange(64, dtype=np.uint8))
    assert dst.view(np.uint8).tobytes() == bytes(range(64)), "memcpy gave wrong bytes"
""",
    "codec.decode": """
def call(dtype):
    payload = codec.encode(good, "lossless")
    out = like(dtype, good.nbytes)
    codec.decode(payload, "lossless", out)
    assert out.view(np.uint8).tobytes() == good.tobytes(), "decode gave wrong bytes"
""",
}

PLAIN = ["uint8", "int8", "bool", "float16", "float32", "float64", "uint16", "int32", "uint64", "<f2"]
REFUSED = ["object", ">f2", ">u4", "complex64", "S4", "U1", "V4", "u1,u1"]


def run_case(call: str, dtype: str) -> dict[str, object]:
    script = PRELUDE + textwrap.dedent(CALLS[call]) + f"\nrun(call, {dtype!r})\n"
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, (
        f"{call} on a {dtype} array killed the process (exit {proc.returncode}): {proc.stderr[-2000:]}"
    )
    return dict(json.loads(proc.stdout.strip().splitlines()[-1]))


@pytest.mark.parametrize("call", sorted(CALLS))
def test_object_arrays_are_refused_without_a_crash(call: str) -> None:
    result = run_case(call, "object")
    assert result.get("error") == "BufferError", result
    assert "object" in str(result["message"]), result


@pytest.mark.parametrize("call", sorted(CALLS))
def test_every_item_type_is_refused_or_gives_correct_bytes(call: str) -> None:
    # One subprocess per call, all dtypes in it (a crash still fails the test: exit code checked).
    lines = "".join(f"run(call, {d!r})\n" for d in PLAIN + REFUSED)
    script = PRELUDE + textwrap.dedent(CALLS[call]) + "\n" + lines
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"{call} crashed (exit {proc.returncode}): {proc.stderr[-2000:]}"
    results = [json.loads(line) for line in proc.stdout.strip().splitlines()]
    assert len(results) == len(PLAIN) + len(REFUSED)
    for dtype, result in zip(PLAIN + REFUSED, results, strict=True):
        if dtype in PLAIN:
            assert result == {"ok": True}, f"{call} refused a plain {dtype} array: {result}"
        else:
            assert result.get("error") == "BufferError", f"{call} accepted a {dtype} array: {result}"


def test_object_arrays_never_reach_the_store_in_process() -> None:
    """In process (after the subprocess tests showed no crash): nothing is stored, counters unmoved."""
    g = kvtier.Geometry(num_layers=2, num_kv_heads=1, head_dim=8, dtype="fp16", block_tokens=4)
    store = kvtier.Store(
        kvtier.StoreConfig(geometry=g, model_id="fmt-test", dram=kvtier.DramConfig(capacity_bytes="1MiB"))
    )
    keys = store.namespace.block_keys(list(range(8)))
    objs = np.empty((2, g.block_bytes // 8), dtype=object)
    with pytest.raises(BufferError, match="object"):
        store.put(keys, objs)
    assert store.lookup(keys).hit_blocks == 0


def test_token_buffers_must_be_integers_and_block_id_buffers_their_exact_type() -> None:
    from kvtier import _core

    ns = bytes(16)
    with pytest.raises(BufferError, match="integers"):
        _core.block_keys(ns, np.arange(8, dtype=np.float32), 4, b"")
    with pytest.raises(BufferError, match="integers"):
        _core.block_keys(ns, np.arange(8, dtype=object), 4, b"")
    expected = _core.block_keys(ns, np.arange(8, dtype=np.uint32), 4, b"")
    assert len(expected) == 2 * 16
    for dtype in (np.int8, np.uint16, np.int32, np.int64, np.uint64):
        assert _core.block_keys(ns, np.arange(8, dtype=dtype), 4, b"") == expected, dtype
    g = kvtier.Geometry(num_layers=2, num_kv_heads=1, head_dim=8, dtype="fp16", block_tokens=4)
    copier = layout.Copier(1)
    pool = layout.alloc_pool(g, 4)
    out = np.empty((1, g.block_bytes), np.uint8)
    with pytest.raises(BufferError, match="uint64"):
        copier._core.copy(True, g._handle, pool, 4, np.array([1.0]), out, False)
    with pytest.raises(BufferError, match="uint64"):
        copier._core.copy(True, g._handle, pool, 4, np.array([1], dtype=object), out, False)
