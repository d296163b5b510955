#!/usr/bin/env bash
# DeepSpeed + distckpt: train on NPROC ranks, save every 3 steps, SIGKILL rank 0 at step KILL (the
# job dies between checkpoints), then resume from `latest` on NEWPROC ranks (another data-parallel
# size: the ZeRO optimizer state is resharded on load, no conversion step) and finish.
#   launch/examples/deepspeed_resume.sh [NPROC=2] [NEWPROC=3] [STAGE=2] [KILL=8] [STEPS=12]
set -euo pipefail
NPROC=${1:-2}; NEWPROC=${2:-3}; STAGE=${3:-2}; KILL=${4:-8}; STEPS=${5:-12}
HERE=$(cd "$(dirname "$0")" && pwd)
PY=${PY:-"$HERE/../../.venv/bin/python"}
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
export DS_ACCELERATOR=cpu OMP_NUM_THREADS=1
# DeepSpeed JIT-compiles its CPU ops at start-up; build them once into this venv, with its ninja,
# not into the user-wide cache that every venv of the machine rebuilds with its own flags.
TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-$("$PY" -c 'import sys; print(sys.prefix)')/torch_extensions}
export TORCH_EXTENSIONS_DIR PATH="$(dirname "$PY"):$PATH"
run() { "$PY" -m torch.distributed.run --standalone --nproc-per-node "$1" "$HERE/deepspeed_train.py" \
          --ckpt "$WORK/ckpt" --steps "$STEPS" --save-every 3 --stage "$STAGE" "${@:2}" 2>&1 \
          | grep -E "^(step|saved|resumed|killing)"; }
echo "== $NPROC ranks, killed at step $KILL"
run "$NPROC" --kill-at "$KILL" || echo "(the job died, as intended)"
echo "latest: $(cat "$WORK/ckpt/latest")"; ls "$WORK/ckpt"
echo "== resumed on $NEWPROC ranks"
out=$(run "$NEWPROC")
echo "$out"
expected=$(( (KILL - 1) / 3 * 3 ))
grep -q "resumed from .*step$expected at step $expected (saved by $NPROC ranks, now $NEWPROC)" <<<"$out"
grep -q "^step $STEPS " <<<"$out"
echo "OK: resumed at step $expected on $NEWPROC ranks from a checkpoint saved by $NPROC, trained to step $STEPS"
