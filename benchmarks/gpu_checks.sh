#!/usr/bin/env bash
# The GPU checks in one run, for a machine with a CUDA device: the GPU tests, then the FIRE and throughput
# benchmarks on the GPU. Each step has its own time limit and the next runs whatever the last printed, so one
# short session on a lent GPU yields every figure it can.
#
#     bash benchmarks/gpu_checks.sh [OUT_DIR]        # default outputs/gpu_checks; ~5 min on an H100
#
# Needs torch with CUDA, lightning, hydra-core and pytest (the package itself is read from src/).
set -u -o pipefail
out=${1:-outputs/gpu_checks}
mkdir -p "$out"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
step() {  # step NAME SECONDS COMMAND...: run it, keep its output in OUT_DIR/NAME.txt, report its exit status
    local name=$1 limit=$2; shift 2
    echo "== $name: $*"
    timeout "$limit" "$@" 2>&1 | tee "$out/$name.txt"
    echo "== $name: exit ${PIPESTATUS[0]}"
}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/gpu.txt"
python -c "import torch, lightning; print('torch', torch.__version__, 'lightning', lightning.__version__)"
step tests 150 python -m pytest tests/test_cuda.py tests/test_fire_batch.py tests/test_subspace.py -q -rs
step fire 180 python benchmarks/fire.py --device cuda --sizes 256,1024,4096
step throughput 240 python benchmarks/throughput.py --device cuda --batch 32 --rounds 3
