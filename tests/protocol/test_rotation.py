"""Rotation (I5, I6): 200 saves with keep_last=3 on a real small tmpfs. The directory holds 3
checkpoints, no fd points at a deleted file, and the file system's used space stops growing after
the third save (the DeepSpeed FastFileWriter failure: df full, du small)."""

from __future__ import annotations

import os

import pytest
import torch

from ..conftest import open_fds
from ..helpers.faults import require_root, tmpfs_mount


def _used(path: str) -> int:
    st = os.statvfs(path)
    return (st.f_blocks - st.f_bfree) * st.f_frsize


@pytest.mark.parametrize("backend", ["uring", "pwrite", "buffered"])
def test_200_saves_keep_last_3(backend, monkeypatch, tmp_path):
    import distckpt
    require_root("mounting a tmpfs")
    monkeypatch.setenv("DISTCKPT_IO_BACKEND", backend)
    root = str(tmp_path / "mnt")
    os.mkdir(root)
    with tmpfs_mount(root, size="48m"):
        before = open_fds()
        mgr = distckpt.CheckpointManager(root, keep_last=3)
        payload = torch.randn(1 << 20)  # 4 MiB per checkpoint: 200 of them would need 800 MiB
        plateau = None
        for step in range(1, 201):
            payload[0] = step
            mgr.save(step, {"w": payload, "step": step})
            if step == 3:
                plateau = _used(root)
            elif step > 3:
                assert _used(root) <= plateau + (64 << 10), f"used space grew at step {step}"
        assert mgr.steps() == [198, 199, 200]
        assert sorted(os.listdir(root)) == ["latest", "step_00000198", "step_00000199", "step_00000200"]
        assert open(os.path.join(root, "latest")).read() == "step_00000200\n"
        leaked = {fd: t for fd, t in open_fds().items() if fd not in before}
        assert not leaked, leaked
        assert not [t for t in open_fds().values() if t.startswith(root) and t.endswith("(deleted)")]
        t = {"w": torch.empty(1 << 20), "step": 0}
        mgr.load(t)
        assert t["step"] == 200 and t["w"][0].item() == 200
