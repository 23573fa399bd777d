#!/usr/bin/env bash
# The GPU check, as one short script: the decode-step benchmark first (the figures that matter most), then the
# kernel benchmark, the gpu-marked tests, every cache against none at batch 1, the step's extra figures and the
# serving engine's continuous batching, each bounded in time; every log is written under $OUT (or ./gpu-out) as it goes, so a run cut short still returns what
# it measured, and the issue's goals are judged at the end (benchmarks/gpu_goals.py). From the repository root on a
# CUDA machine:
#
#     bash benchmarks/gpu_check.sh [FASTDLLM_DIR]     # FASTDLLM_DIR: a Fast-dLLM checkout (optional)
#     QUICK=1 bash benchmarks/gpu_check.sh ...        # batch 1 and 16, no/dual cache, two modes: a short lease
#     PARTS="step tests" bash benchmarks/gpu_check.sh # some parts only (step kernels tests caches elastic extra
#                                                     # samplers serve; default all)
#     GPU_TESTS_K="confidence or compile" ...         # some of the gpu tests only (pytest -k)
#
# The parts run in the order of what the issue's goals still need (step, caches, tests, kernels, elastic: Elastic-
# Cache's step at 8 layers, extra, samplers: the step graphs of Dream's, CreditDecoding's, KLASS's and Prophet's
# steps, serve: the serving engine and generate's continuous batching) and take at most 300 + 180 + 200 + 100 + 120 +
# 180 + 4 x 60 + 120 + 90 seconds. On an H200
# (2026-11-27, the third check) with QUICK=1 and no Fast-dLLM
# (it takes about 30 s more): step about 150 s, caches about 90 s, the gpu tests over 200 s on a fresh machine (34 of
# 37 in 200 s; their kernels compile first), kernels about 55 s. So run PARTS="step kernels" and then PARTS="caches
# tests extra" (each call's goals table judges that call's files; unpack both calls' gpu-check.tgz into one folder
# and run `python benchmarks/gpu_goals.py FOLDER` for the whole table), or name the tests a lease needs with
# GPU_TESTS_K.
# DEADLINE=S (seconds) bounds the whole call: each part runs for at most what is left of S after a margin for the
# goals table and the archive, and a part with under 20 seconds left is skipped, saying so (set it a little under the
# call's own time limit, or under the device time a lease has left, so the call always returns its files).
# At the end every file is packed into $OUT/gpu-check.tgz, beside the goals table $OUT/goals.md.
# The figures go into docs/performance.md with the card, the command and the date.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
FASTDLLM=${1:-}
PARTS=${PARTS:-step kernels tests caches elastic extra samplers serve}
log() { echo "== $* ($(date -u +%H:%M:%S))"; }
DEADLINE=${DEADLINE:-0}
# want PART CAP: whether PART was asked for and has time left; sets LIMIT, its time limit in seconds
want() {
    [[ " $PARTS " == *" $1 "* ]] || return 1
    LIMIT=$2
    if [ "$DEADLINE" -gt 0 ]; then
        local left=$((DEADLINE - SECONDS - 15))
        [ "$left" -lt "$LIMIT" ] && LIMIT=$left
        if [ "$LIMIT" -lt 20 ]; then
            log "$1 skipped: ${left}s left of DEADLINE=$DEADLINE"
            return 1
        fi
    fi
}

log env
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>/dev/null || echo "no nvidia-smi: no GPU"; } \
    | tee "$OUT/env.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/env.txt"

if want step 300; then
    log bench_step
    extra=()
    [ -n "$FASTDLLM" ] && extra=(--fastdllm "$FASTDLLM")
    if [ "${QUICK:-0}" = "1" ]; then
        # the graph path with the next forward launched before the step's synchronisation and after it (the
        # published layer's eager figures, mode base, are in docs/performance.md); prefix: in the whole generations
        extra+=(--batch 1 16 --modes graph graph-late --caches none dual)
    fi
    timeout "$LIMIT" python3 benchmarks/bench_step.py --e2e --e2e-profile --host-profile "${extra[@]}" \
        --json "$OUT/step.json" 2>&1 \
        | grep --line-buffered -v USDT | tee "$OUT/bench_step.log"
fi

if want caches 180; then
    log bench_caches
    # LLaDA-8B's layer (d 4096, 32 heads, MLP 12,288, its vocabulary) at 8 layers, prompt 512, gen 256, batch 1; no
    # cache first (the baseline), then the dual cache (the goal's ratio), then the caches a cut run measured least;
    # last, Elastic-Cache with a drift test that never fails (its machinery's cost apart from random weights' drift)
    timeout "$LIMIT" python3 benchmarks/bench_caches.py --layers 8 --width 4096 --heads 32 --mlp 12288 --vocab 126464 \
        --batch 1 --caches dual elastic dkv-decode freecache prefix dkv-greedy elastic:gamma=0 \
        --json "$OUT/caches.json" 2>&1 \
        | grep --line-buffered -v USDT | tee "$OUT/bench_caches.log"
fi

if want tests 200; then
    log gpu tests
    # GPU_TESTS_K: a pytest -k expression choosing some of them (a short lease)
    timeout "$LIMIT" python3 -m pytest -v -m gpu -p no:cacheprovider ${GPU_TESTS_K:+-k "$GPU_TESTS_K"} \
        tests/test_graphs.py tests/test_step_graph.py tests/test_fast_layer.py tests/test_kernels.py 2>&1 | grep --line-buffered -v USDT \
        | tee "$OUT/gpu_tests.log" | tail -60
fi

if want kernels 100; then
    log bench_kernels
    timeout "$LIMIT" python3 benchmarks/bench_kernels.py --json "$OUT/kernels.json" 2>&1 | tee "$OUT/bench_kernels.log"
fi

if want elastic 120; then
    log bench_step elastic
    # Elastic-Cache's cached step at 8 layers against no cache and the dual cache: the step, device busy time, kernels
    # and host gap of its graph path (its parts, planned and launched ahead), the host's own work per step and its
    # hottest functions (at 8 layers the dual cache's step took 4.40 ms for 1.67 ms of device time); the graph path
    # also with the sampler's work eager (graph-eager-sampler): what the step graphs save where the host bounds a step
    timeout "$LIMIT" python3 benchmarks/bench_step.py --layers 8 --batch 1 --caches none dual elastic \
        --modes graph graph-eager-sampler --host-profile --json "$OUT/step_elastic.json" 2>&1 | grep --line-buffered -v USDT | tee "$OUT/bench_step_elastic.log"
fi

if want extra 120; then
    log bench_step packing, spread and breakdown
    timeout "$LIMIT" python3 benchmarks/bench_step.py --modes graph --caches dual --batch 1 --packing --spread --breakdown \
        --json "$OUT/step_extra.json" 2>&1 | grep --line-buffered -v USDT | tee "$OUT/bench_step_extra.log"
fi
if want extra 60; then
    log bench_graph_keys
    timeout "$LIMIT" python3 benchmarks/bench_graph_keys.py --calls 4 --batch 1 4 --configs llada:dual llada:dkv-decode \
        --json "$OUT/graph_keys.json" 2>&1 | grep --line-buffered -v USDT | tee "$OUT/bench_graph_keys.log"
fi

for smp in dream credit klass prophet; do
    if want samplers 60; then
        log bench_step sampler "$smp"
        # the step graphs of Dream's baseline, CreditDecoding (its tables in the bank), KLASS (its kept steps) and
        # Prophet (its window to the canvas end) at 8 layers: what they save against the sampler's work run eagerly
        timeout "$LIMIT" python3 benchmarks/bench_step.py --layers 8 --batch 1 --caches dual --sampler "$smp" \
            --modes graph graph-eager-sampler --json "$OUT/step_sampler_$smp.json" 2>&1 | grep --line-buffered -v USDT \
            | tee "$OUT/bench_step_sampler_$smp.log"
    fi
done

if want serve 120; then
    log bench_serve
    # the serving engine on the GPU with the bundled model: continuous batching against static batches and one request
    # at a time at 1, 4 and 16 clients (its goal: at 16 clients 3x one at a time, p99 within 2x the longest solo)
    timeout "$LIMIT" python3 benchmarks/bench_serve.py --device cuda --concurrency 1 4 16 --requests 8 \
        --json "$OUT/serve.json" 2>&1 | grep --line-buffered -v USDT | tee "$OUT/bench_serve.log"
fi

if want serve 90; then
    log bench_continuous
    # offline continuous batching (generate's max_rows) against static batches of the same prompts, the bundled model
    timeout "$LIMIT" python3 benchmarks/bench_continuous.py --device cuda --prompts 64 --batch 4 16 \
        --json "$OUT/continuous.json" 2>&1 | grep --line-buffered -v USDT | tee "$OUT/bench_continuous.log"
fi

log goals
python3 benchmarks/gpu_goals.py "$OUT" --json "$OUT/goals.json" | tee "$OUT/goals.md"
# every file in one archive beside the goals table (the device tool returns at most 8 files from $OUT)
(cd "$OUT" && tar -czf gpu-check.tgz --exclude=gpu-check.tgz --exclude=goals.md -- * \
    && find . -maxdepth 1 -type f ! -name gpu-check.tgz ! -name goals.md -delete)
log done
