#!/usr/bin/env bash
# The duplex swap engine on a real GPU (docs/transfer.md section 6): its correctness tests and
# `kvtier bench transfer --device cuda:0`. Run from the repository root on a machine with an NVIDIA
# GPU, numpy, pyyaml, pytest and hypothesis, with kvtier's extension built elsewhere and carried
# (python/kvtier/_core.abi3.so; it links no CUDA library and loads libcudart at run time).
#   $1: the Rust test binary of crates/kvtier-transfer/tests/duplex_no_torn_or_stale_blocks.rs
#       (cargo test -p kvtier-transfer --test duplex_no_torn_or_stale_blocks --no-run; stripped),
#       run with --ignored: the random-interleaving model test on a CUDA device pool.
# Results go to $OUT (default /tmp/gpu_duplex); $PYTHON (default python3) runs kvtier.
set -u
PY=${PYTHON:-python3}
OUT=${OUT:-/tmp/gpu_duplex}
mkdir -p "$OUT"
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
} 2>&1 | tee "$OUT/machine.txt"
if [ -n "${1:-}" ]; then
    "$1" --ignored --test-threads 1 2>&1 | tee "$OUT/rust_gpu_tests.txt"
fi
"$PY" -m pytest -q -p no:cacheprovider tests/test_duplex_cuda.py 2>&1 | tee "$OUT/pytest_gpu.txt"
for blocks in 16 64; do
    for i in 1 2; do
        "$PY" -m kvtier.cli bench transfer --device cuda:0 --swap-blocks "$blocks" --json \
            > "$OUT/bench_cuda_${blocks}_$i.json" 2> "$OUT/bench_cuda_${blocks}_$i.err"
        "$PY" -c "import json,sys; d=json.load(open(sys.argv[1])); print(sys.argv[1], {k: round(d[k], 3) for k in ('duplex_ratio_to_serial','duplex_limit_ratio','duplex_ratio_to_limit','batched_speedup_vs_per_segment','batched_ratio_to_memcpy','memcpy_gib_per_s','batched_swap_out_gib_per_s')})" \
            "$OUT/bench_cuda_${blocks}_$i.json" 2>/dev/null || tail -3 "$OUT/bench_cuda_${blocks}_$i.err"
    done
done
"$PY" -m kvtier.cli bench transfer --json > "$OUT/bench_host.json" 2> "$OUT/bench_host.err" \
    && "$PY" -c "import json; d=json.load(open('$OUT/bench_host.json')); print('host', {k: round(d[k], 3) for k in ('duplex_ratio_to_serial','duplex_limit_ratio','batched_speedup_vs_per_segment')})"
