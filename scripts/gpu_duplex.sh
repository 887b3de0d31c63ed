#!/usr/bin/env bash
# The duplex swap engine on a real GPU (docs/transfer.md section 6): its correctness tests and
# `kvtier bench transfer --device cuda:0`. Run from the repository root on a machine with an NVIDIA
# GPU, numpy, pyyaml, pytest and hypothesis, with kvtier's extension built elsewhere and carried
# (python/kvtier/_core.abi3.so; it links no CUDA library and loads libcudart at run time).
#   $1: the Rust test binary of crates/kvtier-transfer/tests/duplex_no_torn_or_stale_blocks.rs
#       (cargo test -p kvtier-transfer --test duplex_no_torn_or_stale_blocks --no-run; stripped),
#       run with --ignored: the random-interleaving model test on a CUDA device pool.
# Results go to $OUT (default /tmp/gpu_duplex); $PYTHON (default python3) runs kvtier.
set -uo pipefail
rc=0  # any failing test or bench run makes the script fail, after the rest ran
PY=${PYTHON:-python3}
OUT=${OUT:-/tmp/gpu_duplex}
mkdir -p "$OUT"
exec > >(tee "$OUT/log.txt") 2>&1  # one log beside the bench JSON files
export PYTHONPATH=$PWD/python PYTHONUNBUFFERED=1 KVTIER_GPU=1
if [ -z "${KVTIER_CUDART:-}" ]; then
    KVTIER_CUDART=$(ls /usr/local/cuda/lib64/libcudart.so* /opt/torch/.venv/lib/python3*/site-packages/nvidia/*/lib/libcudart.so* 2>/dev/null | head -1)
    [ -n "$KVTIER_CUDART" ] || KVTIER_CUDART=$(find /usr /opt -name 'libcudart.so*' 2>/dev/null | head -1)
    [ -z "$KVTIER_CUDART" ] || export KVTIER_CUDART
fi
{
    date -u
    echo "KVTIER_CUDART=$KVTIER_CUDART"
    nvidia-smi --query-gpu=name,driver_version,pcie.link.gen.max,pcie.link.width.max --format=csv
    nproc
    "$PY" -c "import numpy, sys; print(sys.version.split()[0], 'numpy', numpy.__version__)"
}
if [ -n "${1:-}" ]; then
    "$1" --ignored --test-threads 1 || rc=1
fi
"$PY" -m pytest -q -p no:cacheprovider tests/test_duplex_cuda.py || rc=1
# `kvtier bench transfer [--device cuda:0] --swap-blocks N --json`, called as a function: the CLI
# also imports the reference engine, whose model loader (gguf) a GPU image may lack.
bench() {  # $1: cuda device index or "None"; $2: swap blocks; $3: output JSON
    "$PY" -c "import json, sys; from kvtier.bench import transfer
r = transfer.run(swap_blocks=$2, show=False, cuda_device=$1)
json.dump(r.as_dict(), open(sys.argv[1], 'w'), indent=1)
print(sys.argv[1], {k: round(v, 3) if isinstance(v, float) else v for k, v in r.duplex.as_dict().items() if k.startswith(('duplex_r', 'duplex_l', 'batched', 'memcpy_g'))})
print(transfer.summary(r))" "$3" || rc=1
}
for blocks in 16 64; do
    for i in 1 2; do
        bench 0 "$blocks" "$OUT/bench_cuda_${blocks}_$i.json"
    done
done
bench None 16 "$OUT/bench_host.json"
exit $rc
