"""A process out of address space (RLIMIT_AS just above what it maps already): save, async save
and load raise HostMemoryError (a DistCkptError and a MemoryError, with the remedy for memory),
commit nothing and leave the previous checkpoint as it was. An outside trial got a bare
``OSError: [Errno 12]`` from an async save's staging mapping, a bare ``MemoryError`` from a load,
and a save's ``StorageError`` telling to check the file system. Each case runs in its own
process: the limit is the process's, real (no mock), and lifted before the checks."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

_SCRIPT = r"""
import json, os, resource, sys, torch, distckpt
from distckpt.errors import DistCkptError
op, extra, d = sys.argv[1], int(sys.argv[2]), sys.argv[3]
state = {"w": torch.rand(16 << 20)}
distckpt.save(state, f"{d}/prev")
into = {"w": torch.zeros(16 << 20)}
vm = int([l for l in open("/proc/self/status") if l.startswith("VmSize")][0].split()[1]) * 1024
resource.setrlimit(resource.RLIMIT_AS, (vm + (extra << 20), resource.RLIM_INFINITY))
out = {}
try:
    if op == "async":
        distckpt.async_save(state, f"{d}/new").result(timeout=60)
    elif op == "save":
        distckpt.save(state, f"{d}/new")
    else:
        distckpt.load(into, f"{d}/prev")
    out["raised"] = None
except Exception as exc:
    out["raised"] = type(exc).__name__
    out["typed"] = isinstance(exc, DistCkptError) and isinstance(exc, MemoryError)
    out["remedy"] = getattr(exc, "remedy", None)
resource.setrlimit(resource.RLIMIT_AS, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
out["left"] = sorted(os.listdir(d))
out["prev"] = bool(torch.equal(distckpt.read(f"{d}/prev")["w"], state["w"]))
print(json.dumps(out))
"""


@pytest.mark.parametrize("op, extra_mib", [("async", 40), ("save", 8), ("load", 8)])
def test_out_of_address_space_is_a_typed_host_memory_error(tmp_path, op, extra_mib):
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, PYTHONPATH=root, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-c", _SCRIPT, op, str(extra_mib), str(tmp_path)], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["raised"] == "HostMemoryError" and out["typed"], (out, proc.stderr[-2000:])
    assert "memory" in out["remedy"] and "file system" not in out["remedy"], out
    assert out["left"] == ["prev"] and out["prev"], out  # nothing committed, nothing left, prev intact
