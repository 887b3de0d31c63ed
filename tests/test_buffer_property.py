"""Property test of every public function that takes a buffer (issue 15, hardening).

Hypothesis draws arguments of many item types (every int/uint size, float16/32/64, float128,
bool, complex, object, ``U``/``S`` strings, void and structured records, big-endian numbers,
datetime64/timedelta64), shapes (0-size, 0-d, 1-D, 2-D, 3-D), layouts (C, Fortran, stepped,
reversed, transposed, unaligned), read-only arrays, wrappers (memoryview, a list of row arrays)
and things that are not arrays at all (bytes, bytearray, a list, a tuple, None, an int, a str).
Each call must end one of two ways:

- a :class:`kvtier.KvtierError` whose message names a problem the argument has (its item type,
  ``contiguous``, ``read-only``/``writable``, its size or shape, its Python type), and the
  argument is unchanged; an argument with no problem at all must not be refused;
- success with correct bytes, checked against a reference computed here (round trips, a numpy
  reimplementation of the LayerFirst/BlockFirst layouts, the bytes of the argument itself).
  An array of Python objects (also behind a memoryview or in a list) must never be accepted,
  a read-only argument never written, and an input never modified.

Anything else fails: a crash, a non-kvtier exception (a Rust panic included), silent wrong bytes.

Functions covered (one target each; ``[arg]`` is the argument drawn, the others are valid):

- ``Store.put[objects]``, ``Store.load[out]``
- ``layout.gather[pool]``, ``layout.gather[out]``, ``layout.gather[block_ids]`` (module function
  and ``Copier.gather``, per-segment or merged), ``layout.scatter[objects|pool|block_ids]`` (same)
- ``layout.kv_view[pool]`` (and ``layout.pool_num_blocks``, which it calls)
- ``codec.encode[data]``, ``codec.decoded_len[payload]``, ``codec.decode[payload]``,
  ``codec.decode[out]``, ``codec.quant_error[original]``
- ``objects.encode_object[payload]``, ``objects.decode_object[data]``
- ``keys.block_keys[tokens]`` (= ``Namespace.block_keys``)
- ``TransferEngine.submit_load[pool]``, ``TransferEngine.submit_load[block_ids]``,
  ``TransferEngine.submit_store[pool]``, ``TransferEngine.load_sequential[pool]``
- ``DuplexEngine[device]``, ``DuplexEngine[host]`` (constructed, then a swap-out and a swap-in)
- ``remote.RemotePool.put[objects]``, ``.get[out]``, ``.raw_set[values]``, ``.raw_get[out]``
  (on a loopback redis-server; skipped without one)
- ``_core.SsdPool.put[objects]``, ``_core.SsdPool.get[out]`` (the SSD tier alone, as the bench
  uses it), ``_core.memcpy[dst]``, ``_core.memcpy[src]``, ``_core.checksum[data]``

Not covered: ``codec.encode(..., "quant")`` (its numeric checks need fp16 geometry and data this
file does not draw; it takes the same buffer path as ``lossless``), and the bench-only
``_core.ssd_file_per_object`` and ``_core.ssd_raw_sequential`` (they write files and drop the
page cache).

Crash isolation: the hypothesis searches run in a child process (this file run as a script),
one target after another, with a fixed seed per target and a fixed budget. The child prints each
case before running it, so when it dies (a segfault gives a negative exit status) the parent
names the target and the case, and starts a new child for the targets after it. pytest then has
one test per target, which fails with the falsifying example, or with the crash and its case.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import traceback
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, given, seed, settings
from hypothesis import strategies as st

import kvtier
from kvtier import _core, codec, layout, objects
from kvtier.errors import KvtierError
from kvtier.geometry import ExtraGroup
from kvtier.transfer import DuplexEngine, TransferConfig, TransferEngine

# 2 layers, 1 head, head dim 4, fp16, 2-token blocks, one 8-byte-per-token extra group:
# 16-byte segments, 80-byte blocks (64 of K/V + 16 extra), so LayerFirst != BlockFirst.
GEOMETRY = kvtier.Geometry(2, 1, 4, "fp16", 2, (ExtraGroup("state", 8),))
BB = GEOMETRY.block_bytes
POOL_BLOCKS = 4
POOL_BYTES = GEOMETRY.pool_bytes(POOL_BLOCKS)
EXAMPLES = 80  # per target in the free search, plus CORNER_EXAMPLES per corner
CORNER_EXAMPLES = 8

# ---------------------------------------------------------------------------------------------
# Drawn arguments
# ---------------------------------------------------------------------------------------------

PLAIN = ["bool", "int8", "uint8", "int16", "uint16", "int32", "uint32", "int64", "uint64"]
PLAIN += ["float16", "float32", "float64"]
ODD = ["longdouble", "complex64", "complex128", "U1", "U2", "S4", "S8", "V4", "V8", "u1,u1"]
ODD += ["u1,u2,u1", "u4,u4", ">u2", ">i4", ">f2", ">f4", ">f8", ">u8", "M8[s]", "m8[ns]"]
DTYPES = [*PLAIN, *ODD, "object", "object", "object"]
KINDS = ["ndarray"] * 6 + ["memoryview", "memoryview", "rows", "rows", "tuple_rows"]
KINDS += ["bytes", "bytearray", "list", "none", "int", "str"]
LAYOUTS = ["C", "C", "C", "F", "step", "reversed", "transposed", "unaligned"]
# Kinds of argument each API takes (anything else must be refused or converted correctly).
BUFFERS = frozenset({"ndarray", "memoryview", "bytes", "bytearray"})
PLAIN_CHARS = set("?bBhHiIlLqQefd")


def plain(dt: np.dtype) -> bool:
    """Whether items of ``dt`` are KV bytes: a native plain number (the rule of buffer.rs)."""
    return dt.fields is None and dt.isnative and dt.char in PLAIN_CHARS


@dataclass(frozen=True)
class Recipe:
    """How to build one argument; ``make(recipe)`` rebuilds it (the repr is a reproducer)."""

    kind: str
    dtype: str = "uint8"
    shape: tuple[int, ...] = (0,)
    layout: str = "C"
    readonly: bool = False
    seed: int = 0


@dataclass(frozen=True)
class Need:
    """What a call needs of one argument."""

    nbytes: int
    exact: bool = True  # False: at least nbytes (codec.decode's out)
    rows: int | None = None  # blocks: items of a list of arrays (and axis 0 of an array if axis0)
    axis0: bool = False
    writable: bool = False
    kinds: frozenset[str] = BUFFERS
    content: tuple[str, ...] = ()  # message words for bytes that are not a valid payload/object
    # The bytes of a valid argument, where the call checks content (a payload, an object): an
    # argument holding other bytes may be refused for them (e.g. `bytes` made from an object
    # array: the right length, but heap pointers instead of the payload).
    valid: bytes | None = None


def _shape(n: int, ndim: int, rows: int | None) -> tuple[int, ...]:
    if ndim == 0:
        return () if n == 1 else (n,)
    if ndim == 1:
        return (n,)
    r = rows if rows and n % rows == 0 else 1
    if ndim == 2:
        return (r, n // r)
    c = 2 if (n // r) % 2 == 0 else 1
    return (r, c, n // r // c)


# Arguments that fail in one known way (or not at all): a round of these runs first for every
# target, then a freer search that also mixes kinds, sizes, layouts and read-only flags.
CORNERS = ["clean", "object:ndarray", "object:memoryview", "object:rows", "readonly", "strided"]
FREE = ["free", "free", "free", *CORNERS]
FOCUSES = FREE  # set per round by run_target


@st.composite
def buffers(draw: st.DrawFn, need: Need) -> Recipe:
    """An argument for ``need``: often the right size, often one failing in a single way."""
    focus = draw(st.sampled_from(FOCUSES))
    if focus == "free":
        kind = draw(st.sampled_from(KINDS))
        if kind in ("none", "int", "str"):
            return Recipe(kind, seed=draw(st.integers(0, 99)))
        dtype = draw(st.sampled_from(DTYPES))
    elif focus.startswith("object:"):
        kind, dtype = focus.split(":")[1], "object"
    else:  # a kind the call takes, plain items: at most the focus is wrong with it
        kind = draw(st.sampled_from([k for k in ("ndarray", "memoryview", "rows") if k in need.kinds]))
        dtype = draw(st.sampled_from(PLAIN))
    dt = np.dtype(dtype)
    if dt.kind in "Mm" and kind == "memoryview":  # numpy cannot export these
        kind = "ndarray"
    itemsize = dt.itemsize
    sizes = [need.nbytes] * 4 + [0, need.nbytes // 2, need.nbytes + itemsize]
    sizes += [max(itemsize, need.nbytes - itemsize)]
    nbytes = need.nbytes if focus != "free" else draw(st.sampled_from(sizes))
    # Blocks along axis 0 (or one array per block) need 2-D or 3-D arrays, unless free.
    ndim = draw(st.integers(2 if need.rows and focus != "free" else 0, 3))
    shape = _shape(nbytes // itemsize, ndim, need.rows)
    layout_ = draw(st.sampled_from(LAYOUTS))
    if focus == "strided":
        layout_ = draw(st.sampled_from(["F", "step", "reversed", "transposed"]))
    elif focus != "free":
        layout_ = "C"
    if not shape or (layout_ == "unaligned" and dtype == "object"):
        layout_ = "C"
    readonly = focus == "readonly" or (focus == "free" and draw(st.booleans()))
    return Recipe(kind, dtype, shape, layout_, readonly, draw(st.integers(0, 2**16)))


def _fill(dt: np.dtype, n: int, rng: np.random.Generator, content: bytes | None) -> np.ndarray:
    if dt == np.dtype(object):  # heap objects: real pointers, refcounts that a write would break
        flat = np.empty(n, dtype=object)
        for i in range(n):
            flat[i] = [i] if i % 3 == 0 else (f"s{i}" if i % 3 == 1 else 10**9 + i)
        return flat
    need = n * dt.itemsize
    if content is not None:
        data = (content + bytes(need))[:need]
    elif dt.kind == "U":  # valid code points (ASCII)
        data = rng.integers(32, 127, need // 4, dtype=np.uint32).tobytes()
    elif dt.kind == "b":
        data = rng.integers(0, 2, need, dtype=np.uint8).tobytes()
    else:
        data = rng.integers(0, 256, need, dtype=np.uint8).tobytes()
    return np.frombuffer(bytearray(data), dtype=dt)


def build_array(r: Recipe, content: bytes | None = None) -> np.ndarray:
    """The array of ``r`` (before wrapping); with ``content``, its logical bytes are those."""
    dt = np.dtype(r.dtype)
    rng = np.random.default_rng(r.seed)
    logical = _fill(dt, int(np.prod(r.shape, dtype=np.int64)), rng, content).reshape(r.shape)
    if r.layout == "F":
        arr = np.asfortranarray(logical)
    elif r.layout == "step":
        base = np.empty((*r.shape[:-1], 2 * r.shape[-1]), dtype=dt)
        base[..., ::2] = logical
        arr = base[..., ::2]
    elif r.layout == "reversed":
        arr = logical[::-1].copy()[::-1]
    elif r.layout == "transposed":
        arr = np.ascontiguousarray(logical.T).T
    elif r.layout == "unaligned":
        raw = np.zeros(logical.nbytes + 1, dtype=np.uint8)[1:]
        arr = raw.view(dt).reshape(r.shape)
        arr[...] = logical
    else:
        arr = logical.copy()
    if r.readonly:
        arr.flags.writeable = False
    return arr


def make(r: Recipe, content: bytes | None = None) -> Any:
    """The argument of ``r``."""
    if r.kind == "none":
        return None
    if r.kind == "int":
        return 7 + r.seed
    if r.kind == "str":
        return "kv" * (1 + r.seed % 5)
    if r.dtype.startswith("U") and r.kind in ("rows", "tuple_rows", "list"):
        content = None  # Python str items need valid code points; no plain bytes here anyway
    arr = build_array(r, content)
    if r.kind == "memoryview":
        return memoryview(arr)
    if r.kind == "rows":
        return list(arr) if arr.ndim else [arr]
    if r.kind == "tuple_rows":
        return tuple(arr) if arr.ndim else (arr,)
    if r.kind == "bytes":
        return arr.tobytes()
    if r.kind == "bytearray":
        return bytearray(arr.tobytes())
    if r.kind == "list":
        return arr.tolist()
    return arr


# ---------------------------------------------------------------------------------------------
# What an argument is, and the oracle
# ---------------------------------------------------------------------------------------------


@dataclass
class Info:
    kind: str
    type_name: str
    dtypes: list[np.dtype] = field(default_factory=list)
    contiguous: bool = True
    readonly: bool = False
    aligned: bool = True
    nbytes: int = 0
    count: int | None = None  # blocks along axis 0 / items of a list of arrays
    ndim: int = 1
    row_nbytes: tuple[int, ...] = ()
    has_object: bool = False
    item_types: tuple[str, ...] = ()


def _view_dtype(v: memoryview) -> np.dtype:
    if isinstance(v.obj, np.ndarray):
        return v.obj.dtype
    try:
        return np.dtype(v.format)
    except TypeError:
        return np.dtype(object)


def describe(v: object) -> Info:
    if isinstance(v, np.ndarray):
        return Info(
            "ndarray",
            "ndarray",
            [v.dtype],
            v.flags.c_contiguous,
            not v.flags.writeable,
            v.flags.aligned,
            v.nbytes,
            v.shape[0] if v.ndim else None,
            v.ndim,
            has_object=v.dtype.hasobject,
        )
    if isinstance(v, memoryview):
        dt = _view_dtype(v)
        return Info(
            "memoryview",
            "memoryview",
            [dt],
            v.c_contiguous,
            v.readonly,
            True,
            v.nbytes,
            v.shape[0] if v.ndim else None,
            v.ndim,
            has_object=dt.hasobject or "O" in v.format,
        )
    if isinstance(v, bytes | bytearray):
        return Info(
            type(v).__name__,
            type(v).__name__,
            [np.dtype(np.uint8)],
            readonly=isinstance(v, bytes),
            nbytes=len(v),
        )
    if isinstance(v, list | tuple) and v and all(isinstance(x, np.ndarray) for x in v):
        rows = [describe(x) for x in v]
        return Info(
            "rows",
            type(v).__name__,
            [dt for r in rows for dt in r.dtypes],
            all(r.contiguous for r in rows),
            any(r.readonly for r in rows),
            all(r.aligned for r in rows),
            sum(r.nbytes for r in rows),
            len(v),
            1,
            tuple(r.nbytes for r in rows),
            any(r.has_object for r in rows),
        )
    try:
        arr = np.asarray(v)  # what the numpy-converting wrappers make of it
    except ValueError:  # a list of mixed Python objects
        arr = np.empty(0, dtype=object)
    items = tuple(sorted({type(x).__name__ for x in v})) if isinstance(v, list | tuple) else ()
    return Info(
        "list" if isinstance(v, list | tuple) else "scalar",
        type(v).__name__,
        [arr.dtype],
        nbytes=arr.nbytes,
        count=len(v) if isinstance(v, list | tuple) else None,
        ndim=arr.ndim,
        has_object=arr.dtype.hasobject,
        item_types=items,
    )


def problem_tokens(info: Info, need: Need) -> list[str]:
    """Words one of which an error message about this argument must contain ([] = no problem)."""
    tokens: list[str] = []
    if info.kind not in need.kinds:  # refused, or converted (bytes that may not be the same)
        tokens += [info.type_name, "numpy array", "buffer", "bytes-like", *info.item_types]
        tokens += need.content
    bad = [dt for dt in info.dtypes if not plain(dt)]
    if bad or info.has_object:
        tokens += ["items of type", "dtype", *(str(dt) for dt in bad), *(dt.name for dt in bad)]
    if not info.contiguous:
        tokens.append("contiguous")
    if not info.aligned:
        tokens.append("aligned")
    if need.writable and info.readonly:
        tokens += ["read-only", "writable"]
    size_bad = info.nbytes == 0 or (info.nbytes != need.nbytes if need.exact else info.nbytes < need.nbytes)
    if need.rows is not None:
        if info.kind == "rows":
            size_bad |= info.count != need.rows or len(set(info.row_nbytes)) > 1
        elif need.axis0:
            size_bad |= info.ndim == 0 or info.count != need.rows
    if size_bad:
        tokens += ["bytes", "blocks", "shape", "0-d", "slots", "empty", str(info.nbytes), *need.content]
    return tokens


def snapshot(v: object) -> object:
    if isinstance(v, np.ndarray | memoryview):
        return v.tobytes()
    if isinstance(v, list | tuple):
        return tuple(snapshot(x) if isinstance(x, np.ndarray) else x for x in v)
    if isinstance(v, bytearray):
        return bytes(v)
    return v


def logical_bytes(v: object) -> bytes:
    """The bytes a correct call sees in ``v`` (C order; a list of arrays: concatenated)."""
    if isinstance(v, np.ndarray | memoryview):
        return v.tobytes()
    if isinstance(v, bytes | bytearray):
        return bytes(v)
    if isinstance(v, list | tuple) and v and all(isinstance(x, np.ndarray) for x in v):
        return b"".join(x.tobytes() for x in v)
    return np.asarray(v).tobytes()


def bytes_or(value: object, default: bytes) -> bytes:
    """``value``'s logical bytes, or ``default`` if it has none (a list of mixed Python objects)."""
    try:
        return logical_bytes(value)
    except (ValueError, TypeError):
        return default


def holds(value: object, expected: bytes) -> bool:
    """Whether ``value``'s logical bytes are ``expected`` (False if it has none)."""
    try:
        return logical_bytes(value) == expected
    except (ValueError, TypeError):  # e.g. a list of mixed Python objects
        return False


def log_case(target: str, case: str) -> None:
    """Printed before each call: the last one names the case if the process dies."""
    sys.stdout.write(f"##CASE {target} :: {case}\n")
    sys.stdout.flush()


def judge(
    value: object,
    need: Need,
    call: Callable[[object], object],
    check: Callable[[object, object], None],
    none_ok: bool = False,
) -> None:
    """Runs ``call(value)``; asserts a named kvtier error or success that ``check`` accepts.

    ``none_ok``: None is a valid value (an output the call allocates)."""
    info = describe(value)
    if none_ok and value is None:
        info.has_object = False
    before = snapshot(value)
    tokens = problem_tokens(info, need)
    if need.valid is not None and not holds(value, need.valid):
        tokens += need.content
    try:
        result = call(value)
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as e:  # a Rust panic is a BaseException: it fails here, named
        kind = f"{type(e).__module__}.{type(e).__qualname__}"
        assert isinstance(e, KvtierError), f"not a kvtier error: {kind}: {e}"
        assert tokens, f"refused an argument with no problem: {kind}: {e}"
        msg = str(e)
        assert any(t in msg for t in tokens), f"message names none of {tokens}: {kind}: {msg}"
        assert snapshot(value) == before, f"the argument changed although the call failed ({msg})"
        return
    assert not info.has_object, "accepted Python objects as KV bytes (heap pointers)"
    if need.writable:
        assert not info.readonly or snapshot(value) == before, "wrote into a read-only argument"
        check(value, result)
    else:
        assert snapshot(value) == before, "modified an argument it only reads"
        check(value, result)


# ---------------------------------------------------------------------------------------------
# References
# ---------------------------------------------------------------------------------------------


def _block_ranges(num_blocks: int, block: int) -> list[tuple[int, int]]:
    """(offset, length) of each part of pool block ``block``, in BlockFirst order."""
    g, seg = GEOMETRY, GEOMETRY.segment_bytes
    parts = []
    for layer in range(g.num_layers):
        for kv in range(2):
            parts.append((((layer * 2 + kv) * num_blocks + block) * seg, seg))
    base = g.num_layers * 2 * num_blocks * seg
    for grp in g.extra_groups:
        gb = grp.bytes_per_token * g.block_tokens
        parts.append((base + block * gb, gb))
        base += num_blocks * gb
    return parts


def ref_gather(pool: bytes, ids: list[int], num_blocks: int = POOL_BLOCKS) -> bytes:
    return b"".join(pool[o : o + n] for b in ids for o, n in _block_ranges(num_blocks, b))


def ref_scatter(pool: bytes, ids: list[int], objs: bytes, num_blocks: int = POOL_BLOCKS) -> bytes:
    out = bytearray(pool)
    for i, b in enumerate(ids):
        pos = i * BB
        for o, n in _block_ranges(num_blocks, b):
            out[o : o + n] = objs[pos : pos + n]
            pos += n
    return bytes(out)


def random_bytes(n: int, salt: int) -> bytes:
    return np.random.default_rng(salt).integers(0, 256, n, dtype=np.uint8).tobytes()


def u8(data: bytes, rows: int | None = None) -> np.ndarray:
    arr = np.frombuffer(bytearray(data), dtype=np.uint8)
    return arr.reshape(rows, -1) if rows else arr


# ---------------------------------------------------------------------------------------------
# Block-id and token vectors
# ---------------------------------------------------------------------------------------------

ID_DTYPES = ["int8", "uint8", "int16", "int32", "uint32", "int64", "uint64", ">i8", ">u4"]
ID_DTYPES += ["float64", "bool", "object", "U2", "M8[s]", "complex64"]
ID_KINDS = ["ndarray"] * 4 + ["list", "tuple", "memoryview", "2d", "0d", "step", "reversed"]
ID_KINDS += ["readonly", "unaligned", "none", "str"]


@dataclass(frozen=True)
class Ids:
    values: tuple[int, ...]
    dtype: str
    kind: str


def ids_strategy(lo: int, hi: int, max_len: int) -> st.SearchStrategy[Ids]:
    return st.builds(
        Ids,
        st.lists(st.integers(lo, hi), max_size=max_len).map(tuple),
        st.sampled_from(ID_DTYPES),
        st.sampled_from(ID_KINDS),
    )


def make_ids(r: Ids) -> Any:
    if r.kind == "none":
        return None
    if r.kind == "str":
        return "0123"[: len(r.values)]
    with np.errstate(all="ignore"):
        arr = np.array(r.values, dtype=np.int64).astype(r.dtype)  # wraps when out of the dtype
    if r.kind == "list":
        return arr.tolist()
    if r.kind == "tuple":
        return tuple(arr.tolist())
    if r.kind == "memoryview" and arr.dtype.kind not in "Mm":
        return memoryview(arr)
    if r.kind == "2d":
        return arr.reshape(1, -1)
    if r.kind == "0d" and arr.size:
        return arr[0, ...] if arr.ndim else arr
    if r.kind == "step":
        base = np.empty(2 * arr.size, dtype=arr.dtype)
        base[::2] = arr
        return base[::2]
    if r.kind == "reversed":
        return arr[::-1].copy()[::-1]
    if r.kind == "readonly":
        arr.flags.writeable = False
    if r.kind == "unaligned" and arr.dtype != np.dtype(object):
        raw = np.zeros(arr.nbytes + 1, dtype=np.uint8)[1:].view(arr.dtype)
        raw[...] = arr
        return raw
    return arr


def ids_verdict(value: object, hi: int, distinct: bool, ranged: bool) -> tuple[list[int] | None, list[str]]:
    """(the ids, or None if the call must refuse them; words its message may contain).

    ``ranged``: ids out of ``0..hi`` are errors (else they are per-block outcomes)."""
    arr = np.asarray(value)
    if arr.ndim != 1:
        return None, ["shape", "1-D"]
    if arr.size == 0:
        return [], []
    if arr.dtype.kind not in "iu":
        return None, ["dtype", str(arr.dtype), "integer", "ints"]
    ids = [int(x) for x in arr]
    if not ranged:
        return ids, []
    if min(ids) < 0:
        return None, ["negative", "out of range"]
    if max(ids) >= hi:
        return None, ["out of range"]
    if distinct and len(set(ids)) < len(ids):
        return None, ["twice", "distinct", "duplicate"]
    return ids, []


def judge_ids(
    value: object,
    hi: int,
    distinct: bool,
    call: Callable[[object], object],
    check: Callable[[list[int], object], None],
    ranged: bool = True,
) -> None:
    ids, tokens = ids_verdict(value, hi, distinct, ranged)
    if isinstance(value, np.ndarray) and not value.flags.aligned:
        tokens = [*tokens, "aligned"]
    before = snapshot(value)
    try:
        result = call(value)
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as e:
        kind = f"{type(e).__module__}.{type(e).__qualname__}"
        assert isinstance(e, KvtierError), f"not a kvtier error: {kind}: {e}"
        assert tokens, f"refused valid ids {ids}: {kind}: {e}"
        assert any(t in str(e) for t in tokens), f"message names none of {tokens}: {kind}: {e}"
    else:
        assert ids is not None, f"accepted ids it must refuse ({tokens}): {value!r}"
        check(ids, result)
    assert snapshot(value) == before, "modified the ids"


# ---------------------------------------------------------------------------------------------
# Targets (run in the child)
# ---------------------------------------------------------------------------------------------


class Ctx:
    """Shared state of the child: a store with known blocks, counters for fresh keys."""

    def __init__(self) -> None:
        self.store = kvtier.Store(
            kvtier.StoreConfig(
                geometry=GEOMETRY, model_id="buffer-prop", dram=kvtier.DramConfig(capacity_bytes="64MiB")
            )
        )
        self.ns = self.store.namespace
        self.keys = self.ns.block_keys(range(2 * POOL_BLOCKS * GEOMETRY.block_tokens))[:POOL_BLOCKS]
        self.blocks = random_bytes(POOL_BLOCKS * BB, 1)
        self.store.put(self.keys, u8(self.blocks, POOL_BLOCKS))
        self.pool = random_bytes(POOL_BYTES, 2)
        self.payload_src = random_bytes(2 * BB, 3)
        self.payload = codec.encode(u8(self.payload_src), "lossless")
        self.fresh = 10**6
        self._engine: TransferEngine | None = None
        self._remote: Any = None
        self._ssd: Any = None

    def fresh_keys(self, n: int = 2) -> kvtier.BlockKeys:
        self.fresh += 1000
        return self.ns.block_keys(range(self.fresh, self.fresh + n * GEOMETRY.block_tokens))

    @property
    def engine(self) -> TransferEngine:
        if self._engine is None:
            self._engine = TransferEngine(self.store, TransferConfig(chunk_blocks=2, buffer_chunks=2))
        return self._engine

    @property
    def remote(self) -> Any:
        if self._remote is None:
            from kvtier.remote import RemotePool

            url = os.environ["KVTIER_PROP_REDIS_URL"]
            config = kvtier.StoreConfig(
                geometry=GEOMETRY, model_id="buffer-prop", remote=kvtier.RemoteConfig(urls=url)
            )
            self._remote = RemotePool(config.remote, self.ns.hash)
        return self._remote

    @property
    def ssd(self) -> Any:
        if self._ssd is None:
            root = os.environ.get("KVTIER_PROP_TMP") or tempfile.mkdtemp(prefix="kvtier-buffer-prop-")
            directory = Path(root) / f"ssd-{os.getpid()}"
            directory.mkdir(parents=True, exist_ok=True)
            self._ssd = _core.SsdPool(
                {"directory": str(directory), "capacity_bytes": 64 << 20, "probe_bytes": 0}
            )
        return self._ssd


CTX: Ctx | None = None


def ctx() -> Ctx:
    global CTX
    if CTX is None:
        CTX = Ctx()
    return CTX


Body = Callable[[st.DataObject, str], None]
TARGETS: dict[str, Body] = {}
NEEDS_REDIS: set[str] = set()


def target(name: str, redis: bool = False) -> Callable[[Body], Body]:
    def register(fn: Body) -> Body:
        TARGETS[name] = fn
        if redis:
            NEEDS_REDIS.add(name)
        return fn

    return register


def draw_buffer(data: st.DataObject, name: str, need: Need, extra: str = "") -> Recipe:
    r = data.draw(buffers(need), label="arg")
    log_case(name, f"{extra}{r!r}")
    return r


BLOCKS2 = Need(2 * BB, rows=2, axis0=True, kinds=frozenset({"ndarray", "rows"}))


@target("Store.put[objects]")
def _store_put(data: st.DataObject, name: str) -> None:
    c = ctx()
    keys = c.fresh_keys()
    value = make(draw_buffer(data, name, BLOCKS2))

    def check(v: object, report: Any) -> None:
        assert report.stored == 2, report
        out = np.zeros((2, BB), np.uint8)
        with c.store.lease(keys) as lease:
            assert lease.hit_blocks == 2
            c.store.load(lease, out)
        assert out.tobytes() == logical_bytes(v), "put stored other bytes than given"

    judge(value, BLOCKS2, lambda v: c.store.put(keys, v), check)


@target("Store.load[out]")
def _store_load(data: st.DataObject, name: str) -> None:
    c = ctx()
    need = Need(2 * BB, rows=2, axis0=True, writable=True, kinds=frozenset({"ndarray", "rows"}))
    value = make(draw_buffer(data, name, need))

    def call(v: object) -> Any:
        with c.store.lease(c.keys[:2]) as lease:
            return c.store.load(lease, v)

    def check(v: object, report: Any) -> None:
        got = logical_bytes(v)
        assert report.loaded_blocks * BB == len(got), report
        assert got == c.blocks[: len(got)], "load wrote other bytes than stored"

    judge(value, need, call, check)


def _copier(data: st.DataObject) -> tuple[layout.Copier | None, bool]:
    threads = data.draw(st.sampled_from([0, 1, 2]), label="threads (0: module function)")
    per_segment = data.draw(st.booleans(), label="per_segment") if threads else False
    return (layout.Copier(threads) if threads else None), per_segment


def _gather(copier: layout.Copier | None, per_segment: bool, pool: Any, ids: Any, out: Any = None) -> Any:
    if copier is None:
        return layout.gather(GEOMETRY, pool, ids, out)
    return copier.gather(GEOMETRY, pool, ids, out, per_segment=per_segment)


def _scatter(copier: layout.Copier | None, per_segment: bool, objs: Any, ids: Any, pool: Any) -> Any:
    if copier is None:
        return layout.scatter(GEOMETRY, objs, ids, pool)
    return copier.scatter(GEOMETRY, objs, ids, pool, per_segment=per_segment)


POOL_NEED = Need(POOL_BYTES, rows=POOL_BLOCKS, kinds=frozenset({"ndarray"}))


@target("layout.gather[pool]")
def _gather_pool(data: st.DataObject, name: str) -> None:
    copier, per_segment = _copier(data)
    value = make(draw_buffer(data, name, POOL_NEED), ctx().pool)

    def check(v: object, out: Any) -> None:
        assert out.tobytes() == ref_gather(logical_bytes(v), [1, 3]), "gather read wrong bytes"

    judge(value, POOL_NEED, lambda v: _gather(copier, per_segment, v, [1, 3]), check)


@target("layout.gather[out]")
def _gather_out(data: st.DataObject, name: str) -> None:
    copier, per_segment = _copier(data)
    need = Need(2 * BB, rows=2, axis0=True, writable=True, kinds=frozenset({"ndarray"}))
    value = make(draw_buffer(data, name, need))
    pool = u8(ctx().pool)

    def check(v: object, out: Any) -> None:
        assert v is None or out is v, "gather returned another array than `out`"
        assert out.tobytes() == ref_gather(ctx().pool, [1, 3]), "gather wrote wrong bytes"

    call = lambda v: _gather(copier, per_segment, pool, [1, 3], v)  # noqa: E731
    judge(value, need, call, check, none_ok=True)


@target("layout.gather[block_ids]")
def _gather_ids(data: st.DataObject, name: str) -> None:
    copier, per_segment = _copier(data)
    r = data.draw(ids_strategy(-2, POOL_BLOCKS + 1, 4), label="ids")
    log_case(name, repr(r))
    pool = u8(ctx().pool)

    def check(ids: list[int], out: Any) -> None:
        assert out.tobytes() == ref_gather(ctx().pool, ids), "gather copied wrong blocks"

    judge_ids(make_ids(r), POOL_BLOCKS, False, lambda v: _gather(copier, per_segment, pool, v), check)


@target("layout.scatter[objects]")
def _scatter_objects(data: st.DataObject, name: str) -> None:
    copier, per_segment = _copier(data)
    need = Need(2 * BB, rows=2, axis0=True, kinds=frozenset({"ndarray"}))
    value = make(draw_buffer(data, name, need))
    pool = u8(ctx().pool)

    def check(v: object, _stats: Any) -> None:
        expected = ref_scatter(ctx().pool, [1, 3], logical_bytes(v))
        assert pool.tobytes() == expected, "scatter wrote wrong bytes"

    judge(value, need, lambda v: _scatter(copier, per_segment, v, [1, 3], pool), check)


@target("layout.scatter[pool]")
def _scatter_pool(data: st.DataObject, name: str) -> None:
    copier, per_segment = _copier(data)
    need = Need(POOL_BYTES, writable=True, kinds=frozenset({"ndarray"}))
    value = make(draw_buffer(data, name, need), ctx().pool)
    objs = random_bytes(2 * BB, 4)
    before = logical_bytes(value) if isinstance(value, np.ndarray) else b""

    def check(v: object, _stats: Any) -> None:
        assert logical_bytes(v) == ref_scatter(before, [1, 3], objs), "scatter wrote wrong bytes"

    judge(value, need, lambda v: _scatter(copier, per_segment, u8(objs, 2), [1, 3], v), check)


@target("layout.scatter[block_ids]")
def _scatter_ids(data: st.DataObject, name: str) -> None:
    copier, per_segment = _copier(data)
    r = data.draw(ids_strategy(-2, POOL_BLOCKS + 1, 4), label="ids")
    log_case(name, repr(r))
    value = make_ids(r)
    n = len(r.values)
    objs = random_bytes(n * BB, 5)
    pool = u8(ctx().pool)

    def check(ids: list[int], _stats: Any) -> None:
        assert pool.tobytes() == ref_scatter(ctx().pool, ids, objs), "scatter wrote wrong blocks"

    call = lambda v: _scatter(copier, per_segment, u8(objs).reshape(n, BB), v, pool)  # noqa: E731
    judge_ids(value, POOL_BLOCKS, True, call, check)


@target("layout.kv_view[pool]")
def _kv_view(data: st.DataObject, name: str) -> None:
    value = make(draw_buffer(data, name, POOL_NEED), ctx().pool)
    per_block = GEOMETRY.pool_bytes(1)
    need = Need(POOL_BYTES, rows=POOL_BLOCKS, kinds=frozenset({"ndarray"}))
    if isinstance(value, np.ndarray) and value.nbytes and value.nbytes % per_block == 0:
        need = Need(value.nbytes, kinds=need.kinds)  # any whole number of blocks is a pool

    def call(v: object) -> Any:
        n = layout.pool_num_blocks(GEOMETRY, v)  # type: ignore[arg-type]
        return n, layout.kv_view(GEOMETRY, v)  # type: ignore[arg-type]

    def check(v: object, result: Any) -> None:
        n, view = result
        assert n * per_block == len(logical_bytes(v)), n
        kv_bytes = GEOMETRY.num_layers * 2 * n * GEOMETRY.segment_bytes
        assert view.tobytes() == logical_bytes(v)[:kv_bytes], "kv_view shows wrong bytes"
        assert np.shares_memory(view, v), "kv_view returned a copy: writes through it are lost"

    judge(value, need, call, check)


ENCODE_NEED = Need(2 * BB, exact=False, content=("empty",))


@target("codec.encode[data]")
def _encode(data: st.DataObject, name: str) -> None:
    name_ = data.draw(st.sampled_from(["raw", "lossless"]), label="codec")
    backend = data.draw(st.sampled_from(codec.BACKENDS), label="backend")
    value = make(draw_buffer(data, name, ENCODE_NEED, f"{name_}/{backend} "))

    def check(v: object, payload: Any) -> None:
        back = codec.decode(payload, name_)
        assert back.tobytes() == logical_bytes(v), "encode/decode does not round-trip the bytes"

    judge(value, ENCODE_NEED, lambda v: codec.encode(v, name_, backend=backend), check)


PAYLOAD_WORDS = ("payload", "magic", "truncated", "implied", "codec", "header")


def _payload_need() -> Need:
    return Need(len(ctx().payload), content=PAYLOAD_WORDS, valid=ctx().payload)


@target("codec.decoded_len[payload]")
def _decoded_len(data: st.DataObject, name: str) -> None:
    need = _payload_need()
    value = make(draw_buffer(data, name, need), ctx().payload)

    def check(v: object, n: Any) -> None:
        assert n == codec.decoded_len(logical_bytes(v), "lossless"), n

    judge(value, need, lambda v: codec.decoded_len(v, "lossless"), check)


@target("codec.decode[payload]")
def _decode_payload(data: st.DataObject, name: str) -> None:
    need = _payload_need()
    value = make(draw_buffer(data, name, need), ctx().payload)

    def check(v: object, out: Any) -> None:
        assert out.tobytes() == codec.decode(logical_bytes(v), "lossless").tobytes()

    judge(value, need, lambda v: codec.decode(v, "lossless"), check)


@target("codec.decode[out]")
def _decode_out(data: st.DataObject, name: str) -> None:
    c = ctx()
    need = Need(2 * BB, exact=False, writable=True, kinds=frozenset({"ndarray", "memoryview", "bytearray"}))
    value = make(draw_buffer(data, name, need))
    before = logical_bytes(value) if not isinstance(value, list | tuple) else b""

    def check(v: object, out: Any) -> None:
        assert out.tobytes() == c.payload_src, "decode returned wrong bytes"
        if v is None:  # allocated
            return
        got = logical_bytes(v)
        assert got[: 2 * BB] == c.payload_src, "decode succeeded but `out` does not hold the bytes"
        assert got[2 * BB :] == before[2 * BB :], "decode wrote past the decoded bytes"

    judge(value, need, lambda v: codec.decode(c.payload, "lossless", v), check, none_ok=True)


QUANT_GEOMETRY = kvtier.Geometry(2, 1, 4, "fp16", 2)  # quant: K and V only, no extra groups


@target("codec.quant_error[original]")
def _quant_error(data: st.DataObject, name: str) -> None:
    qbb = QUANT_GEOMETRY.block_bytes
    need = Need(2 * qbb, rows=2, kinds=frozenset({"ndarray", "memoryview", "bytes", "bytearray"}))
    value = make(draw_buffer(data, name, need))

    def check(v: object, result: Any) -> None:
        same = np.frombuffer(logical_bytes(v), np.float16)
        finite = bool(np.isfinite(same).all())
        assert not finite or result["max_abs_error"] == 0.0, result

    def call(v: object) -> Any:
        return codec.quant_error(v, u8(bytes_or(v, bytes(2 * qbb))), QUANT_GEOMETRY)

    judge(value, need, call, check)


@target("objects.encode_object[payload]")
def _encode_object(data: st.DataObject, name: str) -> None:
    need = Need(2 * BB, exact=False)
    value = make(draw_buffer(data, name, need))
    ns = ctx().ns.hash

    def check(v: object, obj: Any) -> None:
        decoded = objects.decode_object(obj)
        assert (decoded.namespace_hash, decoded.key) == (ns, 77)
        assert decoded.payload == logical_bytes(v), "encode_object stored other bytes"

    judge(value, need, lambda v: objects.encode_object(ns, 77, v), check)


@target("objects.decode_object[data]")
def _decode_object(data: st.DataObject, name: str) -> None:
    payload = random_bytes(BB, 6)
    obj = objects.encode_object(ctx().ns.hash, 5, payload)
    need = Need(len(obj), content=("object", "header", "payload", "magic", "checksum"), valid=obj)
    value = make(draw_buffer(data, name, need), obj)

    def check(v: object, decoded: Any) -> None:
        assert logical_bytes(v) == obj  # any other bytes must fail verification
        assert decoded.payload == payload and decoded.key == 5, decoded

    judge(value, need, objects.decode_object, check)


@target("keys.block_keys[tokens]")
def _block_keys(data: st.DataObject, name: str) -> None:
    r = data.draw(ids_strategy(-1, 2**33, 9), label="tokens")
    log_case(name, repr(r))
    ns = ctx().ns

    def check(tokens: list[int], keys: Any) -> None:
        assert keys == ns.block_keys(np.array(tokens, dtype=np.uint32)), "keys of other tokens"

    judge_ids(make_ids(r), 2**32, False, ns.block_keys, check)


TRANSFER_KW: dict[str, Any] = {"writable": True, "kinds": frozenset({"ndarray"})}
TRANSFER_POOL = Need(POOL_BYTES, **TRANSFER_KW)


def _transfer_pool(value: object) -> tuple[Need, list[int], int]:
    """The need, block ids and block count for a drawn pool: any whole number of blocks is a pool
    (as for kv_view), and ids past its end are per-block outcomes, not errors; so a pool of 2 or
    3 blocks is moved with ids inside it."""
    per_block = GEOMETRY.pool_bytes(1)
    whole = isinstance(value, np.ndarray) and value.nbytes > 0 and value.nbytes % per_block == 0
    n = value.nbytes // per_block if whole else 0  # type: ignore[attr-defined]
    if n < 2:  # (one block is never drawn: sizes are POOL_BYTES, half of it, or not whole blocks)
        return TRANSFER_POOL, [1, 3], POOL_BLOCKS
    return Need(value.nbytes, **TRANSFER_KW), [1, 3] if n >= 4 else [1, 0], n  # type: ignore[attr-defined]


def _wait_done(engine: TransferEngine, job: int) -> None:
    [done] = engine.wait([job])
    assert done.ok, done


@target("TransferEngine.submit_load[pool]")
def _submit_load(data: st.DataObject, name: str) -> None:
    c = ctx()
    value = make(draw_buffer(data, name, TRANSFER_POOL), c.pool)
    need, ids, n = _transfer_pool(value)

    def call(v: object) -> Any:
        job = c.engine.submit_load(c.keys[:2], v, ids)  # type: ignore[arg-type]
        _wait_done(c.engine, job)

    def check(v: object, _: Any) -> None:
        assert ref_gather(logical_bytes(v), ids, n) == c.blocks[: 2 * BB], "load job wrote wrong bytes"

    judge(value, need, call, check)


@target("TransferEngine.load_sequential[pool]")
def _load_sequential(data: st.DataObject, name: str) -> None:
    c = ctx()
    per_chunk = data.draw(st.booleans(), label="per_chunk")
    value = make(draw_buffer(data, name, TRANSFER_POOL), c.pool)
    need, ids, n = _transfer_pool(value)

    def call(v: object) -> Any:
        job, _times = c.engine.load_sequential(c.keys[:2], v, ids, per_chunk)  # type: ignore[arg-type]
        assert job.ok, job

    def check(v: object, _: Any) -> None:
        assert ref_gather(logical_bytes(v), ids, n) == c.blocks[: 2 * BB], "load wrote wrong bytes"

    judge(value, need, call, check)


@target("TransferEngine.submit_store[pool]")
def _submit_store(data: st.DataObject, name: str) -> None:
    c = ctx()
    keys = c.fresh_keys()
    value = make(draw_buffer(data, name, TRANSFER_POOL), c.pool)
    need, ids, n = _transfer_pool(value)

    def call(v: object) -> Any:
        _wait_done(c.engine, c.engine.submit_store(keys, v, ids))  # type: ignore[arg-type]

    def check(v: object, _: Any) -> None:
        out = np.zeros((2, BB), np.uint8)
        with c.store.lease(keys) as lease:
            c.store.load(lease, out)
        assert out.tobytes() == ref_gather(logical_bytes(v), ids, n), "store job stored wrong bytes"

    judge(value, need, call, check)


@target("TransferEngine.submit_load[block_ids]")
def _submit_load_ids(data: st.DataObject, name: str) -> None:
    c = ctx()
    r = data.draw(ids_strategy(-2, POOL_BLOCKS + 1, 4), label="ids")
    log_case(name, repr(r))
    value = make_ids(r)
    pool = u8(c.pool)
    # Bad ids are per-block outcomes here, not errors: only the shape and type are refused.

    def call(v: object) -> Any:
        job = c.engine.submit_load(c.keys[: len(r.values)], pool, v)  # type: ignore[arg-type]
        [done] = c.engine.wait([job])
        return done

    def check(ids: list[int], done: Any) -> None:
        with np.errstate(all="ignore"):
            wrapped = [int(x) for x in np.asarray(value).astype("<i8")]
        seen: set[int] = set()
        for i, b in enumerate(wrapped):
            if not 0 <= b < POOL_BLOCKS:
                assert done.outcomes[i] == "bad_block_id", (wrapped, done)
            elif b in seen:
                assert done.outcomes[i] == "duplicate_block", (wrapped, done)
            else:
                seen.add(b)
                assert done.outcomes[i] == "done", (wrapped, done)
                got = ref_gather(pool.tobytes(), [b])
                assert got == c.blocks[i * BB : (i + 1) * BB], "load job wrote a wrong block"

    judge_ids(value, POOL_BLOCKS, False, call, check, ranged=False)


def _duplex(device: Any, host: Any) -> Any:
    engine = DuplexEngine(GEOMETRY, device, host)
    engine.write(0)
    assert engine.swap_out(0, 1) is True
    engine.submit_step()
    engine.wait_all()
    engine.swap_in(1, 2)
    engine.submit_step()
    engine.wait_all()
    return engine


@target("DuplexEngine[device]")
def _duplex_device(data: st.DataObject, name: str) -> None:
    need = Need(POOL_BYTES, writable=True, kinds=frozenset({"ndarray"}))
    value = make(draw_buffer(data, name, need), ctx().pool)
    host = np.zeros((POOL_BLOCKS, BB), np.uint8)
    block0 = ref_gather(ctx().pool, [0])

    def check(v: object, _engine: Any) -> None:
        assert host[1].tobytes() == block0, "swap-out copied wrong bytes"
        assert ref_gather(logical_bytes(v), [2]) == block0, "swap-in copied wrong bytes"

    judge(value, need, lambda v: _duplex(v, host), check)


@target("DuplexEngine[host]")
def _duplex_host(data: st.DataObject, name: str) -> None:
    need = Need(POOL_BLOCKS * BB, writable=True, kinds=frozenset({"ndarray"}))
    value = make(draw_buffer(data, name, need))
    device = u8(ctx().pool)
    block0 = ref_gather(ctx().pool, [0])

    def check(v: object, _engine: Any) -> None:
        assert logical_bytes(v)[BB : 2 * BB] == block0, "swap-out copied wrong bytes"
        assert ref_gather(device.tobytes(), [2]) == block0, "swap-in copied wrong bytes"

    judge(value, need, lambda v: _duplex(device, v), check)


TIER_KINDS = BUFFERS | {"rows"}
TIER_OBJECTS = Need(2 * BB, rows=2, kinds=TIER_KINDS)
TIER_OUT = Need(2 * BB, rows=2, writable=True, kinds=TIER_KINDS)


@target("RemotePool.put[objects]", redis=True)
def _remote_put(data: st.DataObject, name: str) -> None:
    c = ctx()
    keys = c.fresh_keys()
    value = make(draw_buffer(data, name, TIER_OBJECTS))

    def check(v: object, result: Any) -> None:
        assert result == (2, 0, 0), result
        out = np.zeros((2, BB), np.uint8)
        assert c.remote.get(keys.raw, out, BB) == ["loaded"] * 2
        assert out.tobytes() == logical_bytes(v), "remote put stored other bytes"

    judge(value, TIER_OBJECTS, lambda v: c.remote.put(keys.raw, v, BB), check)


@target("RemotePool.get[out]", redis=True)
def _remote_get(data: st.DataObject, name: str) -> None:
    c = ctx()
    c.remote.put(c.keys.raw[:32], u8(c.blocks[: 2 * BB], 2), BB)
    value = make(draw_buffer(data, name, TIER_OUT))

    def check(v: object, outcomes: Any) -> None:
        assert outcomes == ["loaded"] * 2, outcomes
        assert logical_bytes(v) == c.blocks[: 2 * BB], "remote get wrote wrong bytes"

    judge(value, TIER_OUT, lambda v: c.remote.get(c.keys.raw[:32], v, BB), check)


VALUE_BYTES = st.sampled_from([BB, BB, 16, 1, 0])


@target("RemotePool.raw_set[values]", redis=True)
def _remote_raw_set(data: st.DataObject, name: str) -> None:
    c = ctx()
    size = data.draw(VALUE_BYTES, label="value_bytes")
    c.fresh += 1
    names = [b"prop:%d:0" % c.fresh, b"prop:%d:1" % c.fresh]
    need = Need(2 * size, rows=2, kinds=TIER_KINDS)
    value = make(draw_buffer(data, name, need, f"value_bytes={size} "))

    def check(v: object, result: Any) -> None:
        assert result == ["ok", "ok"], result
        out = np.zeros(2 * size, np.uint8)
        assert c.remote.raw_get(names, out, size) == ["loaded"] * 2
        assert out.tobytes() == logical_bytes(v), "raw_set stored other bytes"

    judge(value, need, lambda v: c.remote.raw_set(names, v, size), check)


@target("RemotePool.raw_get[out]", redis=True)
def _remote_raw_get(data: st.DataObject, name: str) -> None:
    c = ctx()
    size = data.draw(VALUE_BYTES, label="value_bytes")
    c.fresh += 1
    names = [b"prop:%d:0" % c.fresh, b"prop:%d:1" % c.fresh]
    stored = random_bytes(2 * size, c.fresh)
    if size:
        c.remote.raw_set(names, u8(stored, 2), size)
    need = Need(2 * size, rows=2, writable=True, kinds=TIER_KINDS)
    value = make(draw_buffer(data, name, need, f"value_bytes={size} "))

    def check(v: object, result: Any) -> None:
        assert result == ["loaded"] * 2, result
        assert logical_bytes(v) == stored, "raw_get wrote wrong bytes"

    judge(value, need, lambda v: c.remote.raw_get(names, v, size), check)


OBJECT_BYTES = st.sampled_from([BB, BB, 16, 0])


@target("SsdPool.put[objects]")
def _ssd_put(data: st.DataObject, name: str) -> None:
    c = ctx()
    size = data.draw(OBJECT_BYTES, label="object_bytes")
    keys = c.fresh_keys()
    need = Need(2 * size, rows=2, kinds=TIER_KINDS)
    value = make(draw_buffer(data, name, need, f"object_bytes={size} "))

    def check(v: object, result: Any) -> None:
        assert result[0] == 2, result
        out = np.zeros(2 * size, np.uint8)
        assert c.ssd.get(c.ns.hash, keys.raw, out, size) == ["loaded"] * 2
        assert out.tobytes() == logical_bytes(v), "ssd put stored other bytes"

    judge(value, need, lambda v: c.ssd.put(c.ns.hash, keys.raw, v, size), check)


@target("SsdPool.get[out]")
def _ssd_get(data: st.DataObject, name: str) -> None:
    c = ctx()
    size = data.draw(OBJECT_BYTES, label="object_bytes")
    keys = c.fresh_keys()
    stored = random_bytes(2 * size, c.fresh)
    if size:
        c.ssd.put(c.ns.hash, keys.raw, u8(stored, 2), size)
    need = Need(2 * size, rows=2, writable=True, kinds=TIER_KINDS)
    value = make(draw_buffer(data, name, need, f"object_bytes={size} "))

    def check(v: object, outcomes: Any) -> None:
        assert outcomes == ["loaded"] * 2, outcomes
        assert logical_bytes(v) == stored, "ssd get wrote wrong bytes"

    judge(value, need, lambda v: c.ssd.get(c.ns.hash, keys.raw, v, size), check)


MEMCPY = Need(64)


@target("_core.memcpy[dst]")
def _memcpy_dst(data: st.DataObject, name: str) -> None:
    need = Need(64, writable=True)
    value = make(draw_buffer(data, name, need))
    src = u8(random_bytes(64, 7))

    def check(v: object, _: Any) -> None:
        assert logical_bytes(v) == src.tobytes(), "memcpy wrote wrong bytes"

    judge(value, need, lambda v: _core.memcpy(v, src), check)


@target("_core.memcpy[src]")
def _memcpy_src(data: st.DataObject, name: str) -> None:
    value = make(draw_buffer(data, name, MEMCPY))
    dst = np.zeros(64, np.uint8)

    def check(v: object, _: Any) -> None:
        assert dst.tobytes() == logical_bytes(v), "memcpy copied wrong bytes"

    judge(value, MEMCPY, lambda v: _core.memcpy(dst, v), check)


@target("_core.checksum[data]")
def _checksum(data: st.DataObject, name: str) -> None:
    need = Need(64, exact=False)
    value = make(draw_buffer(data, name, need))

    def check(v: object, result: Any) -> None:
        assert result == _core.checksum(logical_bytes(v)), "checksum of other bytes"

    judge(value, need, _core.checksum, check)


# ---------------------------------------------------------------------------------------------
# The child: runs the searches, one line of JSON per target
# ---------------------------------------------------------------------------------------------

START, CASE, RESULT = "##START ", "##CASE ", "##RESULT "


def run_target(name: str) -> dict[str, str]:
    if name in NEEDS_REDIS and not os.environ.get("KVTIER_PROP_REDIS_URL"):
        return {"target": name, "status": "skip", "detail": "no redis-server/valkey-server installed"}
    global FOCUSES
    failures = []
    # One short round per corner (a failure ends a round early, so corners do not hide each
    # other), then the free search.
    rounds = [(focus, [focus], CORNER_EXAMPLES) for focus in CORNERS] + [("free", FREE, EXAMPLES)]
    for round_, focuses, examples in rounds:
        FOCUSES = focuses
        try:
            make_search(name, round_, examples)()
        except Exception as e:
            failures.append(f"[{round_}] {_describe_failure(e)}")
    if failures:
        return {"target": name, "status": "fail", "detail": "\n".join(failures)}
    return {"target": name, "status": "ok", "detail": ""}


def _describe_failure(e: BaseException) -> str:
    """The failure and hypothesis's falsifying example (no frames: they are hypothesis's)."""
    if isinstance(e, BaseExceptionGroup):
        return "\n".join(_describe_failure(sub) for sub in e.exceptions)
    if not type(e).__name__.startswith("PropertyFailure"):  # a bug of this file: show where
        return "".join(traceback.format_exception(e))
    text = "".join(traceback.format_exception_only(e))
    return re.sub(r"^PropertyFailure\d+: AssertionError: ", "", text)


def make_search(name: str, round_: str, examples: int) -> Callable[[], None]:
    body = TARGETS[name]

    @seed(zlib.crc32(f"{name} {round_}".encode()))
    @settings(
        max_examples=examples,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
        phases=[Phase.explicit, Phase.generate, Phase.shrink],
        print_blob=False,
    )
    @given(st.data())
    def search(data: st.DataObject) -> None:
        failure = None
        try:
            body(data, name)
        except Exception as e:
            failure = (_category(e), "".join(traceback.format_exception_only(e)).strip())
            if not isinstance(e, AssertionError):  # a bug of this file: keep where it happened
                failure = (failure[0], "".join(traceback.format_exception(e)))
        # Out of the except block the traceback is gone, and with it the frames holding the
        # argument: a crash it causes when freed (a written-over object array) happens in this
        # case, after its ##CASE line, not in a later one.
        if failure is not None:
            raise _failure_type(failure[0])(failure[1])

    return search


_FAILURE_TYPES: dict[str, type[AssertionError]] = {}


def _category(e: Exception) -> str:
    """What kind of failure ``e`` is: hypothesis reports one example of each kind."""
    parts = str(e).split(":")
    return ":".join(parts[:2]) if parts[0] == "not a kvtier error" else parts[0][:40]


def _failure_type(category: str) -> type[AssertionError]:
    if category not in _FAILURE_TYPES:
        _FAILURE_TYPES[category] = type(f"PropertyFailure{len(_FAILURE_TYPES)}", (AssertionError,), {})
    return _FAILURE_TYPES[category]


def child_main(names: list[str]) -> int:
    for name in names:
        sys.stdout.write(f"{START}{name}\n")
        sys.stdout.flush()
        result = run_target(name)
        sys.stdout.write(RESULT + json.dumps(result) + "\n")
        sys.stdout.flush()
    return 0


# ---------------------------------------------------------------------------------------------
# The parent (pytest)
# ---------------------------------------------------------------------------------------------


CHILD_TIMEOUT_S = 300


def run_children(names: list[str], env: dict[str, str]) -> dict[str, dict[str, str]]:
    """Runs the targets in child processes; a child that dies is replaced for the rest."""
    results: dict[str, dict[str, str]] = {}
    remaining = list(names)
    while remaining:
        try:
            proc = subprocess.run(
                [sys.executable, __file__, *remaining], capture_output=True, timeout=CHILD_TIMEOUT_S, env=env
            )
            stdout, stderr, rc = proc.stdout, proc.stderr, proc.returncode
        except subprocess.TimeoutExpired as e:  # a hang: killed; blame the target it was in
            stdout, stderr, rc = e.stdout or b"", e.stderr or b"", None
        current: str | None = None
        last_case = "(none printed)"
        for line in stdout.decode(errors="replace").splitlines():
            if line.startswith(START):
                current, last_case = line[len(START) :], "(none printed)"
            elif line.startswith(CASE):
                last_case = line[len(CASE) :]
            elif line.startswith(RESULT):
                result = json.loads(line[len(RESULT) :])
                results[result["target"]] = result
                current = None
        remaining = [n for n in remaining if n not in results]
        if not remaining:
            break
        if rc is None:
            how = f"killed after {CHILD_TIMEOUT_S} s"
        else:
            how = f"signal {signal.Signals(-rc).name}" if rc < 0 else f"exit status {rc}"
        crashed = current or remaining[0]
        tail = stderr.decode(errors="replace")[-3000:]
        results[crashed] = {
            "target": crashed,
            "status": "crash",
            "detail": f"the process died ({how}) on the case: {last_case}\nstderr:\n{tail}",
        }
        remaining = [n for n in remaining if n not in results]
    return results


@contextlib.contextmanager
def _redis(tmp: Path) -> Iterator[str | None]:
    from kvtier.testing.redis import LocalRedis, server_binaries

    try:
        server_binaries()
    except RuntimeError:
        yield None
        return
    with LocalRedis(tmp / "redis") as server:
        yield server.url


@pytest.fixture(scope="module")
def results(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, dict[str, str]]]:
    """Every selected target's result, from one child (or more, after crashes)."""
    selected = [
        item.callspec.params["name"]
        for item in request.session.items
        if isinstance(item, pytest.Function)
        and item.originalname == test_buffer_arguments_fail_cleanly_or_give_correct_bytes.__name__
    ]
    names = [n for n in TARGETS if n in selected]
    tmp = tmp_path_factory.mktemp("buffer-prop")
    redis = any(n in NEEDS_REDIS for n in names)
    with _redis(tmp) if redis else contextlib.nullcontext() as url:
        env = {**os.environ, "KVTIER_PROP_TMP": str(tmp), "PYTHONFAULTHANDLER": "1", "RUST_BACKTRACE": "0"}
        if url:
            env["KVTIER_PROP_REDIS_URL"] = url
        yield run_children(names, env)


@pytest.mark.parametrize("name", list(TARGETS))
def test_buffer_arguments_fail_cleanly_or_give_correct_bytes(
    results: dict[str, dict[str, str]], name: str
) -> None:
    result = results[name]
    if result["status"] == "skip":
        pytest.skip(result["detail"])
    assert result["status"] == "ok", f"{name}: {result['status']}\n{result['detail']}"


if __name__ == "__main__":
    sys.exit(child_main(sys.argv[1:]))
