#!/usr/bin/env bash
# The GPU check, as one short script: the decode-step benchmark first (the figures that matter most), then the
# gpu-marked tests, every cache against none at batch 1 and the kernel benchmark, each bounded in time; every log
# is written under $OUT (or ./gpu-out) as it goes, so a run cut short still returns what it measured. From the
# repository root on a CUDA machine:
#
#     bash benchmarks/gpu_check.sh [FASTDLLM_DIR]     # FASTDLLM_DIR: a Fast-dLLM checkout (optional)
#     QUICK=1 bash benchmarks/gpu_check.sh ...        # batch 1 and 16, no/dual cache, two modes: a short lease
#     PARTS="step tests" bash benchmarks/gpu_check.sh # some parts only (step extra tests caches kernels; default all)
#
# The parts take at most 300 + 180 + 100 + 120 + 100 seconds: where one command may run 600 seconds, run
# PARTS="step" and then PARTS="extra tests caches kernels".
# The figures go into docs/performance.md with the card, the command and the date.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
FASTDLLM=${1:-}
PARTS=${PARTS:-step extra tests caches kernels}
log() { echo "== $* ($(date -u +%H:%M:%S))"; }
want() { [[ " $PARTS " == *" $1 "* ]]; }

log env
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/env.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/env.txt"

if want step; then
    log bench_step
    extra=()
    [ -n "$FASTDLLM" ] && extra=(--fastdllm "$FASTDLLM")
    if [ "${QUICK:-0}" = "1" ]; then
        extra+=(--batch 1 16 --modes base graph --caches none dual)  # prefix: in the whole generations (--e2e)
    fi
    timeout 300 python3 benchmarks/bench_step.py --e2e "${extra[@]}" --json "$OUT/step.json" 2>&1 \
        | grep --line-buffered -v USDT | tee "$OUT/bench_step.log"
fi

if want extra; then
    log bench_step packing and breakdown
    timeout 120 python3 benchmarks/bench_step.py --modes graph --caches dual --batch 1 --packing --breakdown \
        --json "$OUT/step_extra.json" 2>&1 | grep --line-buffered -v USDT | tee "$OUT/bench_step_extra.log"
    log bench_graph_keys
    timeout 60 python3 benchmarks/bench_graph_keys.py --calls 4 --batch 1 4 --configs llada:dual llada:dkv-decode \
        --json "$OUT/graph_keys.json" 2>&1 | grep --line-buffered -v USDT | tee "$OUT/bench_graph_keys.log"
fi

if want tests; then
    log gpu tests
    timeout 100 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_graphs.py tests/test_fast_layer.py \
        tests/test_kernels.py 2>&1 | tail -40 | tee "$OUT/gpu_tests.log"
fi

if want caches; then
    log bench_caches
    timeout 120 python3 benchmarks/bench_caches.py --batch 1 --json "$OUT/caches.json" 2>&1 \
        | grep --line-buffered -v USDT | tee "$OUT/bench_caches.log"
fi

if want kernels; then
    log bench_kernels
    timeout 100 python3 benchmarks/bench_kernels.py --json "$OUT/kernels.json" 2>&1 | tee "$OUT/bench_kernels.log"
fi

log done
