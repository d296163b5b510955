#!/usr/bin/env bash
# Kill-and-resume check for launch/examples/dlrm_train.py: an uninterrupted run vs a run SIGKILLed at step
# CRASH (between checkpoints) and restarted; every loss logged after the restart must equal the
# uninterrupted run's, bit for bit.
#   launch/examples/dlrm_resume_check.sh [NPROC=2] [STEPS=30] [EVERY=4] [CRASH=15]
set -euo pipefail
NPROC=${1:-2}; STEPS=${2:-30}; EVERY=${3:-4}; CRASH=${4:-15}
HERE=$(cd "$(dirname "$0")" && pwd)
PY=${PY:-"$HERE/../../.venv/bin/python"}
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
run() { "$PY" -m torch.distributed.run --standalone --nproc-per-node "$NPROC" "$HERE/dlrm_train.py" \
          --root "$1" --steps "$STEPS" --every "$EVERY" "${@:2}" >"$1.log" 2>&1; }
mkdir -p "$WORK/ref" "$WORK/crash"
run "$WORK/ref"
run "$WORK/crash" --crash-at-step "$CRASH" || echo "run 1 killed at step $CRASH (expected)"
run "$WORK/crash"
grep resumed "$WORK/crash.log" || true
"$PY" - "$WORK/ref/losses.txt" "$WORK/crash/losses.txt" <<'EOF'
import sys
def losses(p):
    out = {}
    for line in open(p):
        s, l = line.split()
        out[int(s)] = l          # the last line of a step wins (a resumed run re-logs steps)
    return out
ref, got = losses(sys.argv[1]), losses(sys.argv[2])
assert sorted(ref) == sorted(got), (sorted(ref), sorted(got))
bad = [s for s in ref if ref[s] != got[s]]
assert not bad, [(s, ref[s], got[s]) for s in bad]
print(f"OK: {len(ref)} steps, every loss after the resume identical to the uninterrupted run")
EOF
