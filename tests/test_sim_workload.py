from __future__ import annotations

import csv
import gzip
import inspect
import json
import math
import re
from collections import Counter
from collections.abc import Iterable, Iterator
from datetime import datetime
from itertools import islice, pairwise
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvtier.errors import ConfigError, TraceError
from kvtier.sim.request import Request
from kvtier.sim.workload import (
    AGENTIC_DATASETS,
    agentic_workload,
    azure_workload,
    gamma_arrivals,
    longdoc_workload,
    make_arrivals,
    make_workload,
    mooncake_block_hit_rate,
    mooncake_workload,
    multiturn_workload,
    poisson_arrivals,
    workload_names,
)
from kvtier.sim.workload.mooncake import default_trace_path

TRACES = Path(__file__).resolve().parents[1] / "data" / "traces"
MOONCAKE = TRACES / "mooncake_synthetic_trace.jsonl"
AZURE = TRACES / "azure_llm_2023_conv.csv"

# Small instances of each synthetic workload (block_tokens and seed added per test).
SYNTHETIC: dict[str, dict[str, Any]] = {
    "longdoc": {"num_requests": 300, "num_documents": 12},
    "multiturn": {"num_sessions": 60, "system_prompt_tokens": 100},
    "agentic": {"num_trajectories": 6, "dataset": "32k"},
}


def synthetic(name: str, block_tokens: int = 16, seed: int = 0, **extra: Any) -> list[Request]:
    return list(make_workload(name, block_tokens=block_tokens, seed=seed, **{**SYNTHETIC[name], **extra}))


def assert_chained(requests: Iterable[Request], block_tokens: int) -> None:
    """Keys cover the prompt; a key always sits at the same position after the same key (it names
    the whole prefix); a partial tail block's key is used by no other request."""
    where: dict[int, tuple[int, int | None]] = {}
    uses: Counter[int] = Counter()
    tails = []
    for request in requests:
        assert len(request.block_keys) == math.ceil(request.prompt_tokens / block_tokens)
        previous = None
        for position, key in enumerate(request.block_keys):
            assert where.setdefault(key, (position, previous)) == (position, previous), (request, key)
            previous = key
        uses.update(request.block_keys)
        if request.prompt_tokens % block_tokens:
            tails.append(request.block_keys[-1])
    assert tails or block_tokens == 1, "the test needs partial tail blocks"
    assert all(uses[key] == 1 for key in tails)


def common_prefix(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    length = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        length += 1
    return length


# --- registry ---------------------------------------------------------------------------------


def test_registry_names_and_errors() -> None:
    assert workload_names() == ("agentic", "azure", "long_doc_qa", "longdoc", "mooncake", "multiturn")
    with pytest.raises(
        ConfigError, match="unknown workload 'chat'; known: agentic, azure, long_doc_qa, longdoc"
    ):
        make_workload("chat", block_tokens=16)
    with pytest.raises(ConfigError, match=r"no parameter.*num_sessions.*accepted: block_tokens"):
        make_workload("longdoc", block_tokens=16, num_sessions=3)
    with pytest.raises(ConfigError, match=r"needs parameter.*block_tokens"):
        make_workload("multiturn")
    assert inspect.isgenerator(make_workload("longdoc", block_tokens=16))


@pytest.mark.parametrize("name", workload_names())
@pytest.mark.parametrize("block_tokens", [0, -16, 1.5, True])
def test_bad_block_tokens(name: str, block_tokens: object) -> None:
    with pytest.raises(ConfigError, match=r"`block_tokens`.*expected"):
        make_workload(name, block_tokens=block_tokens)


@pytest.mark.parametrize(
    ("name", "params", "needle"),
    [
        ("longdoc", {"rate_per_s": 0}, "`rate_per_s` is 0; expected a finite number > 0"),
        ("multiturn", {"rate_per_s": -1.0}, "`rate_per_s`"),
        ("agentic", {"arrival": "gamma", "cv": 0}, "`cv` is 0"),
        ("longdoc", {"arrival": "uniform"}, "`arrival`.*poisson, gamma, batch"),
        ("longdoc", {"popularity": "pareto"}, "`popularity`"),
        ("longdoc", {"dataset": "squad"}, "`dataset`.*loogle, narrativeqa"),
        ("longdoc", {"num_requests": 0}, "`num_requests` is 0; expected an integer >= 1"),
        ("longdoc", {"doc_tokens_min": 200_000}, "`doc_tokens_min`.*exceeds `doc_tokens_max`"),
        ("multiturn", {"think_time_mean_s": -1}, "`think_time_mean_s`"),
        ("multiturn", {"turns_mean": 0.5}, "`turns_mean` is 0.5; expected a finite number >= 1"),
        ("agentic", {"dataset": "128k"}, "`dataset`.*32k, 48k, 64k"),
        ("agentic", {"append_tokens_mean": float("nan")}, "`append_tokens_mean`"),
        ("agentic", {"seed": -1}, "`seed`"),
        ("mooncake", {"time_scale": 0}, "`time_scale`"),
        ("azure", {"max_requests": 0}, "`max_requests`"),
    ],
)
def test_bad_parameters(name: str, params: dict[str, Any], needle: str) -> None:
    with pytest.raises(ConfigError, match=needle):
        make_workload(name, block_tokens=512, **params)


# --- arrivals ---------------------------------------------------------------------------------


def test_poisson_and_gamma_arrivals() -> None:
    rng = np.random.default_rng(0)
    times = np.fromiter(islice(poisson_arrivals(4.0, rng), 20_000), float)
    gaps = np.diff(times, prepend=0.0)
    assert (gaps >= 0).all()
    assert gaps.mean() == pytest.approx(0.25, rel=0.03)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, rel=0.05)
    gaps = np.diff(np.fromiter(islice(gamma_arrivals(4.0, 3.0, rng), 20_000), float), prepend=0.0)
    assert gaps.mean() == pytest.approx(0.25, rel=0.1)
    assert gaps.std() / gaps.mean() == pytest.approx(3.0, rel=0.1)
    assert list(islice(make_arrivals("batch", 1.0, rng), 3)) == [0.0, 0.0, 0.0]


@pytest.mark.parametrize(
    ("kind", "rate_per_s", "cv", "needle"),
    [
        ("poisson", 0.0, 1.0, "`rate_per_s` is 0.0"),
        ("poisson", -2.0, 1.0, "`rate_per_s` is -2.0"),
        ("gamma", float("inf"), 1.0, "`rate_per_s`"),
        ("gamma", 1.0, 0.0, "`cv` is 0.0; expected a finite number > 0"),
        ("gamma", 1.0, -1.0, "`cv` is -1.0"),
        ("weibull", 1.0, 1.0, "`arrival` is 'weibull'"),
    ],
)
def test_bad_arrivals(kind: str, rate_per_s: float, cv: float, needle: str) -> None:
    with pytest.raises(ConfigError, match=needle):
        make_arrivals(kind, rate_per_s, np.random.default_rng(0), cv=cv)


# --- properties of every synthetic workload ---------------------------------------------------


@pytest.mark.parametrize("name", sorted(SYNTHETIC))
def test_deterministic_for_a_seed(name: str) -> None:
    first = synthetic(name, seed=7)
    assert first == synthetic(name, seed=7)
    assert first != synthetic(name, seed=8)


@pytest.mark.parametrize("name", sorted(SYNTHETIC))
@pytest.mark.parametrize("block_tokens", [1, 16, 512])
def test_keys_are_chained(name: str, block_tokens: int) -> None:
    assert_chained(synthetic(name, block_tokens=block_tokens), block_tokens)


@pytest.mark.parametrize("name", sorted(SYNTHETIC))
def test_arrivals_sorted_and_children_follow_parents(name: str) -> None:
    requests = synthetic(name, arrival="gamma", cv=2.0, rate_per_s=3.0)
    arrivals = [request.arrival_s for request in requests]
    assert arrivals == sorted(arrivals)
    assert [request.req_id for request in requests] == list(range(len(requests)))
    for previous, request in pairwise(requests):
        if request.parent_id is not None:
            assert request.parent_id == previous.req_id
            assert request.session_id == previous.session_id
            assert request.arrival_s == previous.arrival_s


def test_arrival_process_does_not_change_shapes() -> None:
    slow = synthetic("longdoc", rate_per_s=0.5)
    fast = synthetic("longdoc", rate_per_s=50.0, arrival="gamma", cv=4.0)
    assert [r.block_keys for r in slow] == [r.block_keys for r in fast]
    assert slow[-1].arrival_s > 10 * fast[-1].arrival_s


# --- long-document QA -------------------------------------------------------------------------


@pytest.mark.parametrize("block_tokens", [16, 512, 1000])
def test_longdoc_queries_share_exactly_the_documents_full_blocks(block_tokens: int) -> None:
    question_tokens = 37
    requests = synthetic(
        "longdoc",
        block_tokens=block_tokens,
        question_tokens_min=question_tokens,
        question_tokens_max=question_tokens,
    )
    by_document: dict[int, list[Request]] = {}
    for request in requests:
        assert request.parent_id is None and request.session_id == -1
        by_document.setdefault(request.block_keys[0], []).append(request)
    assert len(by_document) > 5
    for queries in by_document.values():
        doc_tokens = queries[0].prompt_tokens - question_tokens
        assert 10_000 <= doc_tokens <= 100_000
        assert all(query.prompt_tokens == doc_tokens + question_tokens for query in queries)
        for other in queries[1:]:
            assert common_prefix(queries[0].block_keys, other.block_keys) == doc_tokens // block_tokens
    firsts = [queries[0].block_keys for queries in by_document.values()]
    assert len({key for keys in firsts for key in keys}) == sum(len(keys) for keys in firsts)


def test_longdoc_shapes_and_popularity() -> None:
    def top_share(popularity: str) -> float:
        requests = synthetic("longdoc", num_requests=2000, num_documents=50, popularity=popularity)
        return Counter(r.block_keys[0] for r in requests).most_common(1)[0][1] / len(requests)

    assert top_share("zipf") > 0.15  # 1/H(50) = 0.22 for s = 1
    assert top_share("uniform") < 0.05
    requests = list(longdoc_workload(block_tokens=64, num_requests=3000, dataset="narrativeqa"))
    assert np.mean([r.prompt_tokens for r in requests]) == pytest.approx(54_797 + 60, rel=0.15)
    assert all(8 <= r.output_tokens <= 24 for r in requests)
    assert len({r.block_keys[0] for r in requests}) <= 50


# --- multi-turn chat and agentic trajectories -------------------------------------------------


def sessions(requests: list[Request]) -> dict[int, list[Request]]:
    grouped: dict[int, list[Request]] = {}
    for request in requests:
        grouped.setdefault(request.session_id, []).append(request)
    return grouped


@pytest.mark.parametrize("name", ["multiturn", "agentic"])
@pytest.mark.parametrize("block_tokens", [16, 512])
def test_next_turn_extends_the_previous_prompt(name: str, block_tokens: int) -> None:
    tails_checked = 0
    for turns in sessions(synthetic(name, block_tokens=block_tokens)).values():
        first = turns[0]
        assert first.parent_id is None and first.think_time_s == 0.0
        for parent, child in pairwise(turns):
            assert child.parent_id == parent.req_id
            assert child.prompt_tokens > parent.prompt_tokens + parent.output_tokens
            full = parent.prompt_tokens // block_tokens
            assert child.block_keys[:full] == parent.block_keys[:full]
            if parent.prompt_tokens % block_tokens:
                assert parent.block_keys[-1] not in child.block_keys
                assert child.block_keys[full] != parent.block_keys[full]
                tails_checked += 1
    assert tails_checked > 0


def test_multiturn_system_prompt_and_think_time() -> None:
    requests = synthetic("multiturn", num_sessions=400, think_time_mean_s=30.0)
    grouped = sessions(requests)
    assert len(grouped) == 400
    firsts = [turns[0].block_keys for turns in grouped.values()]
    assert len({keys[:6] for keys in firsts}) == 1  # 100 system tokens = 6 full 16-token blocks
    assert len({keys[6] for keys in firsts}) == 400
    thinks = [r.think_time_s for r in requests if r.parent_id is not None]
    assert len(thinks) > 300
    assert np.mean(thinks) == pytest.approx(30.0, rel=0.15)
    assert all(r.prompt_tokens + r.output_tokens <= 32_768 for r in requests)
    # No system prompt: sessions share nothing.
    alone = list(multiturn_workload(block_tokens=16, num_sessions=30))
    owners = {key: r.session_id for r in alone for key in r.block_keys}
    assert all(owners[key] == r.session_id for r in alone for key in r.block_keys)


@pytest.mark.parametrize("dataset", sorted(AGENTIC_DATASETS))
def test_agentic_follows_dualpath_table2(dataset: str) -> None:
    shape = AGENTIC_DATASETS[dataset]
    requests = list(agentic_workload(block_tokens=64, num_trajectories=60, dataset=dataset, arrival="batch"))
    assert all(r.arrival_s == 0.0 for r in requests)
    assert all(r.prompt_tokens + r.output_tokens <= shape.max_context_tokens for r in requests)
    appends = []
    for turns in sessions(requests).values():
        context = 0
        for turn in turns:
            appends.append(turn.prompt_tokens - context)
            context = turn.prompt_tokens + turn.output_tokens
    assert np.mean(appends) == pytest.approx(shape.append_tokens_mean, rel=0.15)
    assert np.mean([r.output_tokens for r in requests]) == pytest.approx(shape.gen_tokens_mean, rel=0.1)
    mean_prompt = np.mean([r.prompt_tokens for r in requests])
    assert 0.35 * shape.max_context_tokens < mean_prompt < 0.6 * shape.max_context_tokens
    owners = {key: r.session_id for r in requests for key in r.block_keys}
    assert all(owners[key] == r.session_id for r in requests for key in r.block_keys)


def test_agentic_tool_time() -> None:
    requests = list(agentic_workload(block_tokens=64, num_trajectories=5, tool_time_mean_s=2.0))
    children = [r.think_time_s for r in requests if r.parent_id is not None]
    assert np.mean(children) == pytest.approx(2.0, rel=0.15)
    assert all(r.think_time_s == 0.0 for r in requests if r.parent_id is None)


# --- Mooncake replay --------------------------------------------------------------------------


def test_mooncake_replays_the_trace() -> None:
    raw = [json.loads(line) for line in MOONCAKE.read_text().splitlines()]
    requests = list(mooncake_workload(block_tokens=512))
    assert len(requests) == len(raw) == 3993
    for record, request in zip(raw, requests, strict=True):
        assert request.block_keys == tuple(record["hash_ids"])
        assert request.prompt_tokens == record["input_length"]
        assert request.output_tokens == record["output_length"]
        assert request.arrival_s == pytest.approx((record["timestamp"] - raw[0]["timestamp"]) / 1000)
        assert request.parent_id is None
    fast = list(mooncake_workload(block_tokens=512, time_scale=0.5, max_requests=100))
    assert len(fast) == 100
    assert fast[-1].arrival_s == pytest.approx(requests[99].arrival_s / 2)


def independent_hit_rate(lines: list[str]) -> float:
    seen: set[int] = set()
    blocks = hits = 0
    for line in lines:
        ids = json.loads(line)["hash_ids"]
        blocks += len(ids)
        hits += sum(hash_id in seen for hash_id in ids)
        seen |= set(ids)
    return hits / blocks


def test_mooncake_block_hit_rate_matches_an_independent_count() -> None:
    lines = MOONCAKE.read_text().splitlines()
    assert mooncake_block_hit_rate() == pytest.approx(independent_hit_rate(lines))
    assert mooncake_block_hit_rate(MOONCAKE) == pytest.approx(0.64, abs=0.01)
    first = independent_hit_rate(lines[:500])
    assert first != pytest.approx(independent_hit_rate(lines))
    assert mooncake_block_hit_rate(default_trace_path(), max_requests=500) == pytest.approx(first)
    assert default_trace_path().samefile(MOONCAKE)


def test_mooncake_hit_rate_on_a_small_trace(tmp_path: Path) -> None:
    trace = write_mooncake(tmp_path, [[1, 2], [1, 3], [1, 2, 4]])
    assert mooncake_block_hit_rate(trace) == pytest.approx(3 / 7)


def test_mooncake_rejects_other_block_sizes() -> None:
    with pytest.raises(ConfigError, match=r"`block_tokens` is 16; expected 512.*trace fixes"):
        mooncake_workload(block_tokens=16)


def mooncake_line(hash_ids: list[int], timestamp: int = 0) -> str:
    record = {
        "timestamp": timestamp,
        "input_length": 512 * len(hash_ids) - 3,
        "output_length": 5,
        "hash_ids": hash_ids,
    }
    return json.dumps(record)


def write_mooncake(tmp_path: Path, requests: list[list[int]], tail: str = "") -> Path:
    path = tmp_path / "trace.jsonl"
    lines = [mooncake_line(ids, timestamp=10 * i) for i, ids in enumerate(requests)]
    path.write_text("\n".join(lines) + "\n" + tail)
    return path


def test_mooncake_streams(tmp_path: Path) -> None:
    # Ten good lines, then garbage: reading the first ten must not touch line 11.
    path = write_mooncake(tmp_path, [[i] for i in range(10)], tail="not json at all\n")
    workload = mooncake_workload(block_tokens=512, path=path)
    assert isinstance(workload, Iterator)
    assert [r.block_keys for r in islice(workload, 10)] == [(i,) for i in range(10)]
    assert len(list(mooncake_workload(block_tokens=512, path=path, max_requests=10))) == 10
    with pytest.raises(TraceError, match=f"{re.escape(str(path))}:11: not valid JSON"):
        list(mooncake_workload(block_tokens=512, path=path))


class CountingFile:
    """A text file that counts the lines handed out by iteration."""

    def __init__(self, file: Any) -> None:
        self.file = file
        self.lines_read = 0

    def __enter__(self) -> CountingFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.file.close()

    def __iter__(self) -> Iterator[str]:
        for line in self.file:
            self.lines_read += 1
            yield line


def test_mooncake_first_requests_read_only_their_lines(monkeypatch: pytest.MonkeyPatch) -> None:
    opened: list[CountingFile] = []
    real_open = Path.open

    def counting_open(path: Path, *args: Any, **kwargs: Any) -> CountingFile:
        opened.append(CountingFile(real_open(path, *args, **kwargs)))
        return opened[-1]

    monkeypatch.setattr(Path, "open", counting_open)
    workload = mooncake_workload(block_tokens=512)
    assert not opened  # nothing read before the first request is asked for
    assert len(list(islice(workload, 10))) == 10
    assert len(opened) == 1 and opened[0].lines_read <= 11
    workload.close()  # type: ignore[attr-defined]
    assert opened[0].file.closed


@pytest.mark.parametrize(
    ("line", "needle"),
    [
        ("{not json", "not valid JSON"),
        ("[1, 2]", "expected a JSON object"),
        ('{"timestamp": 50, "input_length": 10, "output_length": 1}', "missing field `hash_ids`"),
        ('{"timestamp": 50, "output_length": 1, "hash_ids": [1]}', "missing field `input_length`"),
        ('{"timestamp": 50, "input_length": 0, "output_length": 1, "hash_ids": []}', "`input_length` is 0"),
        (
            '{"timestamp": 50, "input_length": 10, "output_length": -2, "hash_ids": [1]}',
            "`output_length` is -2",
        ),
        (
            '{"timestamp": 50, "input_length": 10, "output_length": 0, "hash_ids": [1]}',
            "`output_length` is 0",
        ),
        (
            '{"timestamp": 50, "input_length": 10.5, "output_length": 3, "hash_ids": [1]}',
            "`input_length` is 10.5",
        ),
        ('{"timestamp": 50, "input_length": 10, "output_length": 3, "hash_ids": "1"}', "list of integers"),
        (
            '{"timestamp": 50, "input_length": 10, "output_length": 3, "hash_ids": [1, "a"]}',
            "list of integers",
        ),
        (
            '{"timestamp": 50, "input_length": 1000, "output_length": 3, "hash_ids": [1]}',
            "1 hash_ids.*expected",
        ),
        ('{"timestamp": "x", "input_length": 10, "output_length": 3, "hash_ids": [1]}', "`timestamp`"),
        (
            '{"timestamp": 5, "input_length": 10, "output_length": 3, "hash_ids": [1]}',
            "earlier than the previous",
        ),
        # Python's json reads NaN and Infinity: they reached the metrics as NaN (a traceback).
        ('{"timestamp": NaN, "input_length": 10, "output_length": 3, "hash_ids": [1]}', "`timestamp` is nan"),
        (
            '{"timestamp": Infinity, "input_length": 10, "output_length": 3, "hash_ids": [1]}',
            "`timestamp` is inf",
        ),
        # Far past 2**53 ms, arrivals lose all precision (the run reported 1e297 s simulated).
        (
            '{"timestamp": 1e300, "input_length": 10, "output_length": 3, "hash_ids": [1]}',
            "`timestamp` is 1e",
        ),
        # Negative ids collided between `copies` (each copy's ids shifted by the largest id + 1).
        ('{"timestamp": 50, "input_length": 10, "output_length": 3, "hash_ids": [-1]}', "`hash_ids` must be"),
        (
            '{"timestamp": 50, "input_length": 10, "output_length": 3, "hash_ids": [1.0]}',
            "`hash_ids` must be",
        ),
        (
            '{"timestamp": 50, "input_length": 10, "output_length": 3, "hash_ids": [true]}',
            "`hash_ids` must be",
        ),
        (
            '{"timestamp": 50, "input_length": 10, "output_length": 3, "hash_ids": [1, -7]}',
            "`hash_ids` must be",
        ),
    ],
)
def test_mooncake_malformed_line_names_its_number(tmp_path: Path, line: str, needle: str) -> None:
    # Lines 1-2 good (timestamps 0, 10), line 3 blank (still counted), line 4 bad.
    path = write_mooncake(tmp_path, [[1], [2]], tail="\n" + line + "\n")
    with pytest.raises(TraceError, match=f"{re.escape(str(path))}:4: .*{needle}"):
        list(mooncake_workload(block_tokens=512, path=path))
    with pytest.raises(TraceError, match=f"{re.escape(str(path))}:4: "):
        mooncake_block_hit_rate(path)


def test_mooncake_bytes_that_are_not_utf8_name_their_line(tmp_path: Path) -> None:
    # The reader's UnicodeDecodeError escaped as a traceback, without the file or line.
    path = write_mooncake(tmp_path, [[1], [2]], tail="\n")
    path.write_bytes(path.read_bytes() + b'{"timestamp": 5\xff0, "input_length": 10}\n')
    with pytest.raises(TraceError, match=f"{re.escape(str(path))}:4: .*not UTF-8"):
        list(mooncake_workload(block_tokens=512, path=path))
    path.write_bytes(b"\xff\xfe\x00{\n")
    with pytest.raises(TraceError, match=f"{re.escape(str(path))}:1: .*not UTF-8"):
        list(mooncake_workload(block_tokens=512, path=path))


def test_a_gzipped_trace_is_named_as_such(tmp_path: Path) -> None:
    source = write_mooncake(tmp_path, [[1], [2]])
    path = tmp_path / "packed.jsonl"
    path.write_bytes(gzip.compress(source.read_bytes()))
    with pytest.raises(TraceError, match=f"{re.escape(str(path))}:1: .*gzip.*decompress"):
        list(mooncake_workload(block_tokens=512, path=path))
    csv_path = tmp_path / "packed.csv"
    csv_path.write_bytes(gzip.compress((AZURE_HEADER + AZURE_GOOD).encode()))
    with pytest.raises(TraceError, match=f"{re.escape(str(csv_path))}:1: .*gzip.*decompress"):
        list(azure_workload(block_tokens=16, path=csv_path))


@pytest.mark.parametrize("text", ["", "\n\n  \n"])
def test_a_trace_without_requests_is_refused(tmp_path: Path, text: str) -> None:
    # An empty trace replayed as 0 requests (NaN latencies, exit 0); `sim size` tried 11 sizes.
    path = tmp_path / "empty.jsonl"
    path.write_text(text)
    with pytest.raises(TraceError, match=f"{re.escape(str(path))}: no requests"):
        list(mooncake_workload(block_tokens=512, path=path))
    with pytest.raises(TraceError, match=f"{re.escape(str(path))}: no requests"):
        mooncake_block_hit_rate(path)
    csv_path = tmp_path / "empty.csv"
    csv_path.write_text(AZURE_HEADER + text)
    with pytest.raises(TraceError, match=f"{re.escape(str(csv_path))}: no requests"):
        list(azure_workload(block_tokens=16, path=csv_path))


def test_azure_bytes_that_are_not_utf8_name_their_line(tmp_path: Path) -> None:
    path = tmp_path / "azure.csv"
    path.write_bytes(
        (AZURE_HEADER + AZURE_GOOD + AZURE_GOOD).encode() + b"2023-11-16 18:15:50.1,1\xff0,4\r\n"
    )
    workload = azure_workload(block_tokens=16, path=path)
    assert len(list(islice(workload, 2))) == 2
    with pytest.raises(TraceError, match=f"{re.escape(str(path))}:4: .*not UTF-8"):
        next(workload)


def test_missing_trace_files(tmp_path: Path) -> None:
    missing = tmp_path / "nope.jsonl"
    with pytest.raises(TraceError, match=f"{re.escape(str(missing))} does not exist"):
        mooncake_workload(block_tokens=512, path=missing)
    with pytest.raises(TraceError, match=f"{re.escape(str(missing))} does not exist"):
        azure_workload(block_tokens=16, path=missing)
    with pytest.raises(TraceError, match=f"{re.escape(str(missing))} does not exist"):
        mooncake_block_hit_rate(missing)


def test_default_trace_found_through_data_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "traces").mkdir()
    (tmp_path / "traces" / "mooncake_synthetic_trace.jsonl").write_text(mooncake_line([7, 8]) + "\n")
    monkeypatch.setenv("KVTIER_DATA_DIR", str(tmp_path))
    assert [r.block_keys for r in mooncake_workload(block_tokens=512)] == [(7, 8)]
    monkeypatch.delenv("KVTIER_DATA_DIR")
    assert sum(1 for _ in mooncake_workload(block_tokens=512)) == 3993


# --- Azure replay -----------------------------------------------------------------------------


def test_azure_replays_the_trace() -> None:
    with AZURE.open(newline="") as file:
        rows = list(csv.DictReader(file))
    requests = list(azure_workload(block_tokens=16))
    assert len(requests) == len(rows) == 19_366
    first = datetime.fromisoformat(rows[0]["TIMESTAMP"])
    last = datetime.fromisoformat(rows[-1]["TIMESTAMP"])
    assert requests[0].arrival_s == 0.0
    assert requests[-1].arrival_s == pytest.approx((last - first).total_seconds())
    assert [r.arrival_s for r in requests] == sorted(r.arrival_s for r in requests)
    assert all(r.prompt_tokens == int(row["ContextTokens"]) for r, row in zip(requests, rows, strict=True))
    assert all(r.output_tokens == int(row["GeneratedTokens"]) for r, row in zip(requests, rows, strict=True))
    keys = [key for r in requests for key in r.block_keys]
    assert len(keys) == len(set(keys))  # no prefix information: nothing shared
    assert all(len(r.block_keys) == math.ceil(r.prompt_tokens / 16) for r in requests)
    half = list(azure_workload(block_tokens=512, time_scale=0.5, max_requests=50))
    assert len(half) == 50 and half[-1].arrival_s == pytest.approx(requests[49].arrival_s / 2)


AZURE_HEADER = "TIMESTAMP,ContextTokens,GeneratedTokens\r\n"
AZURE_GOOD = "2023-11-16 18:15:46.6805900,374,44\r\n"


def test_azure_zero_generated_tokens_become_one(tmp_path: Path) -> None:
    path = tmp_path / "azure.csv"
    path.write_text(AZURE_HEADER + AZURE_GOOD + "2023-11-16 18:15:47.5,100,0\r\n")
    requests = list(azure_workload(block_tokens=16, path=path))
    assert [r.output_tokens for r in requests] == [44, 1]
    assert requests[1].arrival_s == pytest.approx(0.81941)


@pytest.mark.parametrize(
    ("row", "needle"),
    [
        ("yesterday,374,44", "TIMESTAMP 'yesterday' is not a datetime"),
        ("2023-11-16 18:15:50.1,abc,44", "expected integers"),
        ("2023-11-16 18:15:50.1,0,44", "ContextTokens is 0"),
        ("2023-11-16 18:15:50.1,10,-1", "GeneratedTokens is -1"),
        ("2023-11-16 18:15:50.1,10", "2 fields; expected 3"),
        ("2023-11-16 18:15:40.0,10,5", "earlier than the previous"),
    ],
)
def test_azure_malformed_row_names_its_line(tmp_path: Path, row: str, needle: str) -> None:
    path = tmp_path / "azure.csv"
    path.write_text(AZURE_HEADER + AZURE_GOOD + AZURE_GOOD + row + "\r\n")
    workload = azure_workload(block_tokens=16, path=path)
    assert len(list(islice(workload, 2))) == 2
    with pytest.raises(TraceError, match=f"{re.escape(str(path))}:4: .*{needle}"):
        next(workload)


def test_azure_bad_header(tmp_path: Path) -> None:
    path = tmp_path / "azure.csv"
    path.write_text("TIMESTAMP,Context,GeneratedTokens\n" + AZURE_GOOD)
    with pytest.raises(TraceError, match=f"{re.escape(str(path))}:1: header .* lacks column.*ContextTokens"):
        list(azure_workload(block_tokens=16, path=path))
    path.write_text("")
    with pytest.raises(TraceError, match=f"{re.escape(str(path))}:1: header"):
        list(azure_workload(block_tokens=16, path=path))


def test_mooncake_copies_run_back_to_back_with_fresh_hash_ids() -> None:
    one = list(mooncake_workload(block_tokens=512))
    three = list(mooncake_workload(block_tokens=512, copies=3))
    assert len(three) == 3 * len(one)
    assert [r.req_id for r in three] == list(range(len(three)))
    n, top = len(one), max(max(r.block_keys) for r in one)
    gap = (one[-1].arrival_s - one[0].arrival_s) / (n - 1)
    for k in (1, 2):
        copy = three[k * n : (k + 1) * n]
        assert copy[0].arrival_s == pytest.approx(k * (one[-1].arrival_s + gap))
        assert copy[0].arrival_s > three[k * n - 1].arrival_s
        for a, b in zip(one, copy, strict=True):
            assert b.block_keys == tuple(key + k * (top + 1) for key in a.block_keys)
            assert b.arrival_s - copy[0].arrival_s == pytest.approx(a.arrival_s)
    assert all(a.arrival_s <= b.arrival_s for a, b in pairwise(three))
    # No prefix is shared across copies: each copy hits as the trace alone does.
    assert mooncake_block_hit_rate(copies=3) == pytest.approx(mooncake_block_hit_rate())
    assert len(list(mooncake_workload(block_tokens=512, copies=3, max_requests=n + 5))) == n + 5
    with pytest.raises(ConfigError, match="`copies`"):
        mooncake_workload(block_tokens=512, copies=0)
