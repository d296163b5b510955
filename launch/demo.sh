#!/usr/bin/env bash
# The main job: a 2-rank torchrun saves a sharded (DTensor) model + optimizer through
# CheckpointManager on the local disk, then a 1-rank torchrun restores it (resharding 2 -> 1) and
# checks every tensor bit for bit. Sets up ./.venv on first use (launch/env.sh).
# Usage: bash launch/demo.sh [CHECKPOINT_ROOT]   (default: a fresh directory under /tmp)
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
# shellcheck source=env.sh
source "$ROOT/launch/env.sh"
CKPT=${1:-$(mktemp -d /tmp/distckpt-demo.XXXXXX)}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
cd "$ROOT"
torchrun --standalone --nproc-per-node 2 launch/examples/demo.py save --root "$CKPT"
torchrun --standalone --nproc-per-node 1 launch/examples/demo.py restore --root "$CKPT"
"$VENV/bin/distckpt" ls "$CKPT"
echo "demo OK: checkpoints in $CKPT"
