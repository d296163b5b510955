#!/usr/bin/env bash
# Runs the whole test suite. Creates ./.venv and installs everything on first use (launch/env.sh),
# plus the system tools the fault-injection tests need (e2fsprogs for loop ext4 images, util-linux for
# mount/unshare, strace, libcap2-bin for capsh, fuse3 for the power-cut file system) when they are missing.
# Usage: bash tests/run.sh [pytest args...]
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
# shellcheck source=../launch/env.sh
source "$ROOT/launch/env.sh"

missing=()
for tool in mkfs.ext4:e2fsprogs unshare:util-linux losetup:mount strace:strace capsh:libcap2-bin fusermount3:fuse3; do
    command -v "${tool%%:*}" >/dev/null 2>&1 || missing+=("${tool##*:}")
done
if [ ${#missing[@]} -gt 0 ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "[distckpt tests] installing ${missing[*]}"
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
fi

cd "$ROOT"
# One line per test file with a running count ([ 120/450]) instead of a screen of dots, the 15
# slowest tests at the end, and a summary line for every failure, error and skip (with its reason).
exec "$VENV/bin/python" -m pytest -p no:cacheprovider -o console_output_style=count --durations=15 -rfEs \
    "${@:-tests}"
