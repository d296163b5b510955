"""What the crash suites save, and the one check they run on a checkpoint root after a crash.

Shared by the kill-at-every-syscall suite (tests/helpers/syscall_kill.py) and the power-cut suite
(tests/helpers/powercut.py). The check uses only the public API and the on-disk layout of docs/FORMAT.md,
so it holds whatever the manager's rotation / ``latest`` policy or the exact error classes become:

  I1  what a restarting job loads (``CheckpointManager.load``) is the newest acknowledged step or the
      step in flight, bit-exact, never a mix; so is every directory that looks committed.
  I2  no step committed before the crash is missing unless the step in flight committed (rotation
      runs only after the new checkpoint is durable); nothing committed is damaged.
  I3  a step whose save() returned (acknowledged) survives, even when the in-flight one does not.
  I6  the next save (a fresh manager, as after a restart) leaves no tmp/del leftovers, commits, and
      the root then loads that new step.
"""

from __future__ import annotations

import functools
import os
import re

import torch

KEEP = 2
# Hidden leftovers of a crashed save, rotation or ``latest`` replacement (docs/FORMAT.md).
LEFTOVER_RE = re.compile(r"^\.(?P<name>.+)\.(?P<what>tmp|del)-[0-9a-f]{32}$")
STEP_RE = re.compile(r"^step_(\d{8,})$")


@functools.lru_cache(maxsize=16)
def expected_state(step: int) -> dict:
    """The state saved as ``step`` (cached: callers must not modify it): several tensors, so that
    with 2 ranks both write a data file (replicas are spread over owners), bfloat16 included, an
    optimizer-like nest, plain values. About 1.5 MB."""
    g = torch.Generator().manual_seed(1000 + step)
    return {
        "model": {"w1": torch.randn(96, 1024, generator=g),
                  "w2": torch.randn(80, 1024, generator=g),
                  "b": torch.full((1000,), float(step), dtype=torch.bfloat16)},
        "optim": {"state": {0: {"exp_avg": torch.randn(64, 1000, generator=g)}}, "lr": 0.5 / (step + 1)},
        "step": step,
    }


def blank_state() -> dict:
    """A state dict of the same structure to load into (every tensor zeroed, step -1)."""
    s = expected_state(0)
    def zero(x):
        if isinstance(x, torch.Tensor):
            return torch.zeros_like(x)
        if isinstance(x, dict):
            return {k: zero(v) for k, v in x.items()}
        return x
    s = zero(s)
    s["step"] = -1
    return s


def same(a, b) -> bool:
    """Bit-exact equality of nested states (dtype included; NaN payloads compared as bytes)."""
    if isinstance(a, torch.Tensor):
        return (isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
                and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    return a == b


def committed_steps(root: str) -> list[int]:
    """Steps whose directory looks committed (``step_N`` with a MANIFEST), read without any side effect."""
    out = []
    for name in os.listdir(root):
        m = STEP_RE.match(name)
        if m and os.path.isfile(os.path.join(root, name, "MANIFEST")):
            out.append(int(m.group(1)))
    return sorted(out)


def leftovers(root: str) -> list[str]:
    return sorted(n for n in os.listdir(root) if LEFTOVER_RE.match(n))


def name_pattern(name: str) -> str:
    """A name with its ids and numbers blanked: ``.step_00000003.tmp-<uuid>`` -> ``.step_*.tmp-*``."""
    return re.sub(r"[0-9a-f]{8,}|\d+", "*", name)


def tree_fingerprint(root: str) -> str:
    """What a crash left under ``root``, ids blanked: names, sizes and contents. Two states with
    the same fingerprint give the same check result, so it is run once per fingerprint."""
    import hashlib
    import zlib
    h = hashlib.sha1()
    for dirpath, dirnames, filenames in sorted(os.walk(root)):
        dirnames.sort()
        rel = os.path.relpath(dirpath, root)
        h.update(f"D{_UUID_RE.sub('*', rel)}\0".encode())
        for name in sorted(filenames, key=lambda n: _UUID_RE.sub("*", n)):
            with open(os.path.join(dirpath, name), "rb") as f:
                data = f.read()
            # The check reads data files and ``latest``: their bytes count. A MANIFEST holds its
            # save's id and time, a lock file its owner, different in every run; a MANIFEST is
            # written in one write(), so its size tells its state (absent, empty, complete).
            digest = zlib.crc32(data) if re.match(r"rank\d+\.bin$", name) or "latest" in name else 0
            h.update(f"F{_UUID_RE.sub('*', name)}\0{len(data)}\0{digest}\0".encode())
    return h.hexdigest()


_UUID_RE = re.compile(r"[0-9a-f]{32}")


def _check_steps_load(root: str, steps: list[int], what: str) -> list[str]:
    import distckpt
    bad = []
    for s in steps:
        path = os.path.join(root, f"step_{s:08d}")
        try:
            got = distckpt.read(path)
        except Exception as exc:  # noqa: BLE001 - any failure to load a committed-looking dir is the finding
            bad.append(f"I1 {what}: {os.path.basename(path)} looks committed but does not load: "
                       f"{type(exc).__name__}: {exc}")
            continue
        if not same(got, expected_state(s)):
            bad.append(f"I1 {what}: {os.path.basename(path)} loads but is not bit-exact step {s} (a mix?)")
    return bad


def check_after_crash(root: str, *, before: list[int], acked: int | None, in_flight: int | None,
                      resume: bool = True, usual_names: set[str] | None = None) -> dict:
    """Check ``root`` after a crash (nothing running on it). Returns ``{"violations": [...], ...}``.

    Args:
        before: the steps committed before the save that crashed (all acknowledged).
        acked: the newest step whose save() returned (acknowledged) before the crash.
        in_flight: the step being saved when the crash came (None: nothing was in flight).
        resume: then restart as a job would: a fresh manager loads the newest step and saves the
            next one, which must reclaim the leftovers (I6).
        usual_names: patterns (:func:`name_pattern`) of the hidden names a root keeps after
            crash-free saves; any other hidden name still there after the next save is garbage
            nothing will ever reclaim (I6).

    The result also says what the crash left: ``committed`` (steps), ``leftovers`` (hidden names),
    ``loaded`` (the step CheckpointManager.load restored), ``new_committed`` (in_flight committed).
    """
    import distckpt
    v: list[str] = []
    if not os.path.isdir(root):
        return {"violations": [f"I2: the root {root} itself is gone"], "committed": [], "leftovers": []}
    committed = committed_steps(root)
    left = leftovers(root)
    visible = sorted(n for n in os.listdir(root) if not n.startswith("."))
    allowed_newest = {s for s in (acked, in_flight) if s is not None}
    newest = committed[-1] if committed else None
    if acked is not None or committed:
        if newest not in allowed_newest:
            v.append(f"I1/I3: newest committed step is {newest}; must be the acknowledged {acked} "
                     f"or the one in flight {in_flight}")
    if acked is not None and acked not in committed and in_flight not in committed:
        v.append(f"I3: acknowledged step {acked} is gone and the step in flight {in_flight} did not commit")
    unknown = [s for s in committed if s not in set(before) | allowed_newest]
    if unknown:
        v.append(f"I1: steps {unknown} look committed but were never saved")
    if in_flight not in committed:
        lost = [s for s in before if s not in committed]
        if lost:
            v.append(f"I2: steps {lost} committed earlier are gone though the new step {in_flight} did not commit")
    odd = [n for n in visible if n != "latest" and not STEP_RE.match(n)]
    if odd:
        v.append(f"I1: visible names that are neither a step nor latest: {odd}")
    half = [n for n in visible if STEP_RE.match(n) and int(STEP_RE.match(n).group(1)) not in committed]
    if half:
        v.append(f"I1: step directories visible without a MANIFEST: {half}")
    if "latest" in visible:
        try:
            with open(os.path.join(root, "latest")) as f:
                target = f.read().strip()
        except OSError as exc:
            target = f"<unreadable: {exc}>"
        m = STEP_RE.match(target)
        if not m or int(m.group(1)) not in committed:
            v.append(f"I1: latest names {target!r}, which is not a committed step ({committed})")
    v += _check_steps_load(root, committed, "after the crash")
    out = {"violations": v, "committed": committed, "leftovers": left,
           "new_committed": in_flight in committed}
    if not resume or v:
        return out

    # Restart: a fresh manager (rank 0 reclaims at start), load what it offers, save the next step.
    mgr = distckpt.CheckpointManager(root, keep_last=KEEP)
    loaded = None
    if committed:
        state = blank_state()
        try:
            mgr.load(state)
        except Exception as exc:  # noqa: BLE001
            v.append(f"I1: CheckpointManager.load after the crash failed: {type(exc).__name__}: {exc}")
            return out
        loaded = state["step"]
        if loaded not in allowed_newest:
            v.append(f"I1: CheckpointManager.load restored step {loaded}; must be {sorted(allowed_newest)}")
        elif not same(state, expected_state(loaded)):
            v.append(f"I1: CheckpointManager.load restored step {loaded} but not bit-exact (a mix?)")
    out["loaded"] = loaded
    nxt = (loaded if loaded is not None else 0) + 1
    try:
        mgr.save(nxt, expected_state(nxt))
    except Exception as exc:  # noqa: BLE001
        v.append(f"I6: the next save (step {nxt}) after the crash failed: {type(exc).__name__}: {exc}")
        return out
    after = committed_steps(root)
    _check_reclaimed(v, root, usual_names)
    if not after or after[-1] != nxt:
        v.append(f"I6: after the next save the newest step is {after[-1] if after else None}, not {nxt}")
    if len(after) > KEEP:
        v.append(f"I6: {len(after)} steps {after} remain with keep_last={KEEP}")
    v += _check_steps_load(root, after, "after the next save")
    state = blank_state()
    mgr.load(state)
    if state["step"] != nxt or not same(state, expected_state(nxt)):
        v.append(f"I1: after the next save CheckpointManager.load restored step {state['step']}, not {nxt}")
    return out


# Deliberately broken commit protocols, applied inside a saving child only: the suites must catch
# each of them (tests/crash/test_crash_syscalls.py, tests/crash/test_power_loss.py), which shows that they can
# fail at all.
def _copy_publish(tmp_dir: str, final_dir: str, *, overwrite: bool) -> None:
    """Publish by copying file by file (MANIFEST first) instead of one rename: not atomic."""
    import shutil
    os.mkdir(final_dir)
    for name in sorted(os.listdir(tmp_dir)):
        shutil.copyfile(os.path.join(tmp_dir, name), os.path.join(final_dir, name))
    shutil.rmtree(tmp_dir)
    return None


def apply_mutation(name: str | None) -> None:
    if not name:
        return
    from distckpt.storage.posix import writer
    from distckpt.storage.posix import commit as local
    if name == "copy-publish":
        local.publish_dir = _copy_publish
    elif name == "no-tmpdir-fsync":
        real = local.fsync_path
        local.fsync_path = lambda path: None if LEFTOVER_RE.match(os.path.basename(path)) else real(path)
    elif name == "no-data-fsync":
        real_init = writer.Writer.__init__
        def init(self, path, choice, durable, size_hint=None):
            real_init(self, path, choice, False, size_hint)
        writer.Writer.__init__ = init
    else:
        raise ValueError(f"unknown mutation {name!r}")


def check_overwrite_after_crash(path: str, *, old: int, new: int, acked: bool,
                                usual_names: set[str] | None = None) -> dict:
    """Check a checkpoint replaced in place (``save(..., overwrite=True)``) after a crash: ``path``
    holds the old or the new step, complete and bit-exact, never nothing and never a mix (the
    swap is one RENAME_EXCHANGE); the new one when its save returned; the next overwrite then
    succeeds and leaves no leftover beside it (I1, I3, I6)."""
    import distckpt
    v: list[str] = []
    parent = os.path.dirname(path)
    try:
        got = distckpt.read(path)
    except Exception as exc:  # noqa: BLE001
        return {"violations": [f"I1: {path} does not load after the crash: {type(exc).__name__}: {exc}"]}
    which = new if same(got, expected_state(new)) else old if same(got, expected_state(old)) else None
    if which is None:
        v.append(f"I1: {path} loads but is neither step {old} nor step {new}, bit-exact (a mix?)")
    elif acked and which != new:
        v.append(f"I3: the overwrite returned, yet {path} holds the old step {old}")
    out = {"violations": v, "new_committed": which == new, "leftovers": leftovers(parent)}
    if v:
        return out
    try:
        distckpt.save(expected_state(new + 1), path, overwrite=True)
    except Exception as exc:  # noqa: BLE001
        v.append(f"I6: the next overwrite failed: {type(exc).__name__}: {exc}")
        return out
    if not same(distckpt.read(path), expected_state(new + 1)):
        v.append("I1: after the next overwrite the checkpoint is not that step")
    _check_reclaimed(v, parent, usual_names)
    return out


def _check_reclaimed(v: list, directory: str, usual_names) -> None:
    """I6 after the next save: no tmp/del leftover, and (when ``usual_names`` is known) no hidden
    name that a crash-free save never leaves behind."""
    if leftovers(directory):
        v.append(f"I6: leftovers not reclaimed by the next save: {leftovers(directory)}")
    if usual_names is not None:
        odd = sorted(n for n in os.listdir(directory) if n.startswith(".") and name_pattern(n) not in usual_names)
        if odd:
            v.append(f"I6: hidden names no crash-free save leaves, still there after the next save: {odd}")
