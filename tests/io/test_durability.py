"""Durable acknowledgement (I3), checked on the real system calls of real saves.

A child saves three steps through CheckpointManager(keep_last=1) under ``strace -f -y`` (every fd
printed with its path). The trace must show, for every step: each data file fsynced before MANIFEST
is created; MANIFEST fsynced, then the tmp directory fsynced, before the rename that makes the step
visible; the parent fsynced after that rename and before save() returns; ``latest`` replaced by
tmp + fsync + rename + directory fsync; rotation renaming the old step aside only after all that.
A newly created root directory has its parent fsynced too. (Losing unsynced data on power failure
is then survivable: nothing visible depends on a write that was not made durable first.)
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

import pytest

CHILD = r"""
import sys, torch, distckpt
mgr = distckpt.CheckpointManager(sys.argv[1], keep_last=1)
for step in (1, 2, 3):
    mgr.save(step, {"a": torch.randn(1 << 20), "b": torch.arange(10), "step": step})
    print("returned", step, flush=True)
"""

_LINE = re.compile(r"^\d+\s+(?P<call>\w+)\((?P<args>.*)\)\s+=\s+(?P<ret>-?\d+)")


def _events(trace: str, root: str) -> list[tuple[str, str, str]]:
    """(call, first path, second path) for the calls under ``root`` that succeeded, in order."""
    out = []
    for line in trace.splitlines():
        m = _LINE.match(line)
        if not m or int(m.group("ret")) < 0 or root not in m.group("args"):
            continue
        call, args = m.group("call"), m.group("args")
        if call in ("fsync", "fdatasync"):
            path = re.search(r"<([^>]*)>", args).group(1)
            out.append((call, path, ""))
        elif call in ("rename", "renameat2"):
            paths = re.findall(r'"([^"]*)"', args)
            out.append(("rename", paths[0], paths[1]))
        elif call == "openat":
            path = re.findall(r'"([^"]*)"', args)[0]
            if "O_CREAT" in args:
                out.append(("create", path, ""))
        elif call == "mkdir":
            out.append(("mkdir", re.findall(r'"([^"]*)"', args)[0], ""))
    return out


def _index(events, pred, start=0, what=""):
    for i in range(start, len(events)):
        if pred(events[i]):
            return i
    raise AssertionError(f"not found after event {start}: {what}\n" + "\n".join(map(str, events)))


@pytest.mark.skipif(shutil.which("strace") is None, reason="needs strace")
def test_every_visible_name_depends_only_on_synced_data(tmp_path):
    root = str(tmp_path / "new" / "root")  # two directories the manager must create
    out = subprocess.run(["strace", "-f", "--seccomp-bpf", "-y", "-qq", "-e",
                          "trace=openat,fsync,fdatasync,rename,renameat2,mkdir",
                          "-o", str(tmp_path / "trace"), sys.executable, "-c", CHILD, root],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["returned", "1", "returned", "2", "returned", "3"]
    ev = _events((tmp_path / "trace").read_text(), str(tmp_path))

    # New directories: each one's entry is fsynced in its parent.
    for d in (str(tmp_path / "new"), root):
        i = _index(ev, lambda e: e[0] == "mkdir" and e[1] == d, what=f"mkdir {d}")
        _index(ev, lambda e: e[0] == "fsync" and e[1] == os.path.dirname(d), i, f"fsync parent of {d}")

    pos = 0
    for step in (1, 2, 3):
        name = f"step_{step:08d}"
        final = os.path.join(root, name)
        tmp_re = re.compile(re.escape(os.path.join(root, f".{name}.tmp-")) + r"[0-9a-f]{32}$")
        mk = _index(ev, lambda e: e[0] == "mkdir" and tmp_re.match(e[1]), pos, f"mkdir tmp of {name}")
        tmp = ev[mk][1]
        data = os.path.join(tmp, "rank00000.bin")
        manifest = os.path.join(tmp, "MANIFEST")
        c_data = _index(ev, lambda e: e[:2] == ("create", data), mk, "create data file")
        s_data = _index(ev, lambda e: e[0] == "fsync" and e[1] == data, c_data, "fsync data file")
        c_man = _index(ev, lambda e: e[:2] == ("create", manifest), mk, "create MANIFEST")
        assert s_data < c_man, "MANIFEST created before the data it names was durable"
        s_man = _index(ev, lambda e: e[0] == "fsync" and e[1] == manifest, c_man, "fsync MANIFEST")
        s_tmp = _index(ev, lambda e: e[0] == "fsync" and e[1] == tmp, s_man, "fsync tmp dir")
        ren = _index(ev, lambda e: e == ("rename", tmp, final), mk, "publish rename")
        assert s_tmp < ren, "the step became visible before its directory entries were durable"
        s_root = _index(ev, lambda e: e[0] == "fsync" and e[1] == root, ren, "fsync root after publish")
        # latest: tmp file, fsync, rename over latest, fsync root; all after the publish fsync
        c_lat = _index(ev, lambda e: e[0] == "create" and os.path.basename(e[1]).startswith(".latest.tmp-"),
                       s_root, "create latest tmp")
        lat_tmp = ev[c_lat][1]
        s_lat = _index(ev, lambda e: e[0] == "fsync" and e[1] == lat_tmp, c_lat, "fsync latest tmp")
        r_lat = _index(ev, lambda e: e == ("rename", lat_tmp, os.path.join(root, "latest")), s_lat, "rename latest")
        s_root2 = _index(ev, lambda e: e[0] == "fsync" and e[1] == root, r_lat, "fsync root after latest")
        if step > 1:  # rotation (keep_last=1): the previous step is renamed aside only now
            prev = os.path.join(root, f"step_{step - 1:08d}")
            rot = _index(ev, lambda e: e[0] == "rename" and e[1] == prev, 0, "rotation rename")
            assert rot > s_root2, "an old step was removed before the new one was durable"
            assert re.search(r"/\.step_\d{8}\.del-[0-9a-f]{32}$", ev[rot][2])
        pos = s_root2
    assert sorted(os.listdir(root)) == ["latest", "step_00000003"]
