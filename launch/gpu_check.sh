#!/usr/bin/env bash
# The checks that need a CUDA GPU, in one run (a GPU machine's own Python with torch; no network):
# build the C core in place, tests/gpu, then the first-async-save and CUDA-path benchmarks.
# Usage: bash launch/gpu_check.sh [OUTDIR [STAGE...]]   (logs go to OUTDIR, default ./gpu-check)
# STAGE: build, tests, first (bench_first_save), cuda (bench_cuda); default all four in order.
# Their time limits add up to more than 10 minutes: where one command may run at most that long,
# run it in two calls, `bash launch/gpu_check.sh OUT build tests first` then
# `bash launch/gpu_check.sh OUT build cuda` (the build is a no-op when nothing changed).
set -uo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
OUT_DIR=${1:-$ROOT/gpu-check}
shift || true
STAGES=" ${*:-build tests first cuda} "
for s in $STAGES; do
    case $s in build|tests|first|cuda) ;; *) echo "unknown stage: $s (build, tests, first, cuda)" >&2; exit 2;; esac
done
want() { [[ $STAGES == *" $1 "* ]]; }
PY=${PYTHON:-python3}
WORK=${GPU_CHECK_DIR:-/tmp/distckpt-gpu-check}
mkdir -p "$OUT_DIR" "$WORK"
cd "$ROOT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
{
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
    nproc; uptime
    "$PY" -c 'import torch, sys; print("python", sys.version.split()[0], "torch", torch.__version__)'
} 2>&1 | tee "$OUT_DIR/machine.txt"
if want build; then
    echo "== build"
    "$PY" setup.py -q build_ext --inplace > "$OUT_DIR/build.log" 2>&1 || { tail -30 "$OUT_DIR/build.log"; exit 1; }
fi
if want tests; then
    echo "== tests/gpu"
    timeout 240 "$PY" -m pytest -p no:cacheprovider -q -rfEs tests/gpu 2>&1 | tee "$OUT_DIR/tests_gpu.log" | tail -25
fi
if want first; then
    echo "== bench_first_save (cuda, 2 GiB)"
    timeout 300 "$PY" launch/bench/bench_first_save.py "$WORK/first" --device cuda --size 2G --repeat 2 --train 2 \
        --fwd 0.5 2>&1 | tee "$OUT_DIR/bench_first_save.txt"
fi
if want cuda; then
    echo "== bench_cuda (2 GiB, 1 repeat)"
    timeout 240 "$PY" launch/bench/bench_cuda.py "$WORK/cuda" --size 2G --repeat 1 2>&1 | tee "$OUT_DIR/bench_cuda.txt" | tail -40
fi
rm -rf "$WORK"
