"""``kvtier bench vllm``'s concurrent case without vLLM: the window metrics, the per-mode medians,
the JSON it prints and the parsing of its worker's RESULT, from worker output given as data (the
real run is a benchmark: ``kvtier bench vllm --case concurrent``)."""

from __future__ import annotations

import json

import pytest

from kvtier.bench import vllm, vllm_concurrent
from kvtier.errors import KvtierError

SPEC: vllm_concurrent.Spec = {"loaders": [[1] * 4112, [2] * 4112], "background": [[3] * 256, [4] * 256]}


def _run(scale: float) -> dict[str, object]:
    """Two background requests decoding every 10 ms; two loaders whose TTFT scales by `scale`."""
    arrivals = {f"bg{i}": [0.01 * k + 0.001 * i for k in range(1, 60)] for i in range(2)}
    loads = [
        {"t_add": 0.105, "t_first": 0.105 + 0.04 * scale, "steps": 3, "cached": 4096},
        {"t_add": 0.305, "t_first": 0.305 + 0.06 * scale, "steps": 5, "cached": 4096},
    ]
    return {"arrivals": arrivals, "loads": loads, "stats": {"loads": 2, "store": {"objects": 1}}}


def _worker(spec: vllm_concurrent.Spec) -> dict[str, object]:
    assert spec["connector"] is not None
    return _run(0.5 if spec["connector"]["load_async"] else 1.0)


def test_measure_reports_medians_ratios_and_the_keys_it_always_had() -> None:
    result = vllm_concurrent.measure(_worker, SPEC, {"ssd": {}}, 2, lambda _: None)
    out = json.loads(json.dumps(result.as_dict()))
    assert set(out) == {
        "prefix_tokens", "background_requests", "loaders_per_process", "repeats", "tier", "modes", "async_over_sync"
    }  # fmt: skip
    assert (out["prefix_tokens"], out["background_requests"], out["loaders_per_process"]) == (4096, 2, 2)
    sync = out["modes"]["sync"]
    assert set(sync) == {
        "ttft_s_median", "bg_tokens_per_s_median", "bg_max_itl_s_median", "bg_mean_itl_s_median",
        "bg_steady_itl_s_median", "per_load", "worker_stats",
    }  # fmt: skip
    assert set(sync["per_load"][0]) == {
        "ttft_s", "steps", "cached", "bg_tokens_per_s", "bg_max_itl_s", "bg_mean_itl_s"
    }  # fmt: skip
    assert len(sync["per_load"]) == 4  # two loaders x two processes
    assert sync["ttft_s_median"] == pytest.approx(0.05)  # median of 0.04, 0.06, 0.04, 0.06
    assert sync["worker_stats"] == [{"loads": 2}, {"loads": 2}]  # the store's figures left out
    assert out["async_over_sync"]["ttft_s"] == pytest.approx(0.5)
    assert out["async_over_sync"]["bg_mean_itl_s"] == pytest.approx(1.0)  # the background steps every 10 ms
    text = vllm.summary(vllm.VllmBench(concurrent=result))
    assert "load_async sync : loader TTFT 0.050 s" in text and "async / sync: TTFT 0.50x" in text


def test_a_loader_that_missed_kvtier_is_an_error() -> None:
    def missed(spec: vllm_concurrent.Spec) -> dict[str, object]:
        run = _worker(spec)
        run["loads"][0]["cached"] = 0  # type: ignore[index]
        return run

    with pytest.raises(RuntimeError, match="missed kvtier"):
        vllm_concurrent.measure(missed, SPEC, {}, 1, lambda _: None)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"arrivals": None}, "`arrivals` is None; expected dict"),
        ({"loads": {}}, "`loads` is {}; expected list"),
        ({"loads": [{"t_add": 0.1, "t_first": 0.2, "steps": 1.5, "cached": 1}]}, "loads[0]: `steps` is 1.5"),
        ({"loads": [{"t_add": 0.1, "steps": 1, "cached": 1}]}, "loads[0]: `t_first` is missing"),
        ({"loads": [{"t_add": 0.1, "t_first": 0.2, "steps": 1, "cached": "all"}]}, "`cached` is 'all'"),
        ({"arrivals": {"bg0": ["soon"]}}, "`arrivals['bg0']` holds 'soon'"),
    ],
)
def test_an_ill_typed_worker_result_names_the_field(change: dict[str, object], message: str) -> None:
    with pytest.raises(KvtierError, match="vLLM concurrent worker's RESULT") as e:
        vllm_concurrent.parse_run({**_run(1.0), **change})
    assert message in str(e.value)
