"""Shared helpers for the tests/io/test_io_*.py files: backend choice, child processes, mounts."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BACKENDS = ("uring", "pwrite", "buffered")


def run_child(code: str, *, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    """Run ``code`` in the real interpreter (not a shell wrapper: rlimits and seccomp must apply to
    Python itself), with the repository importable. Returns the completed process."""
    full_env = dict(os.environ)
    full_env["PYTHONPATH"] = REPO + os.pathsep + full_env.get("PYTHONPATH", "")
    full_env.update(env or {})
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=REPO, env=full_env,
                          capture_output=True, text=True, timeout=timeout)


def need_root_and(*tools: str) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root to mount a small file system")
    for tool in tools:
        if shutil.which(tool) is None:
            pytest.skip(f"needs {tool}")


def mount(args: list[str], target: str) -> None:
    os.makedirs(target, exist_ok=True)
    r = subprocess.run(["mount", *args, target], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"mount {' '.join(args)} failed (no privilege in this container?): {r.stderr.strip()}")


def umount(target: str) -> None:
    subprocess.run(["umount", "-l", target], check=False, capture_output=True)


def open_paths() -> list[str]:
    """What each of this process's open fds points to (a path, or "pipe:[...]" and the like)."""
    out = []
    for name in os.listdir("/proc/self/fd"):
        try:
            out.append(os.readlink(f"/proc/self/fd/{name}"))
        except OSError:  # closed between the listing and the readlink (the listing's own fd)
            pass
    return out
