"""Power cuts at every operation of two saves, on the FUSE file system of tests/helpers/powercut_fs.py
(or, ``--scenario overwrite``, of one ``save(..., overwrite=True)`` replacing a checkpoint in place).

This process is a fork server (torch and distckpt imported once) and drives one daemon:

1. Seed: a real directory holding ``ckpt/`` with steps 1 and 2 (CheckpointManager, keep_last=2,
   saved here on the real disk) becomes the image every run starts from.
2. Count run: mount the seed, fork a saver that saves step 3 then step 4 through a
   CheckpointManager on the mount (each commit points ``latest`` at the new step and rotates the
   oldest away), writing each acknowledged step to a pipe as save() returns; unmount. The daemon
   lists the operations it saw: the cut points (every create, mkdir, write, truncate, fallocate,
   fsync, fsyncdir, rename, unlink, rmdir), counted from the trace itself, so the list follows the
   code when it changes.
3. For every cut point N (0 = before the first operation, up to after the last one): mount the
   seed with ``cut_after=N``, run the saver again; the daemon freezes on operation N+1 (every
   later operation fails with EIO, nothing more becomes durable) and the saver is SIGKILLed: the
   power is off. The daemon derives the three images a restart may find (strict, meta, all; see
   tests/helpers/powercut_fs.py). Each image not seen before (by content fingerprint) is mounted as a
   fresh file system ("remount after the restart") and checked with
   :func:`tests.helpers.crash_state.check_after_crash`: the newest committed step is the last
   acknowledged one or the one in flight, bit-exact, nothing earlier lost, and an acknowledged
   step always survives (I3); then a fresh manager loads and saves the next step, which must
   reclaim every leftover (I6).

Data go through the backend of ``--backend`` (DISTCKPT_IO_BACKEND; default ``uring``, which
``auto`` picks on this FUSE mount: the kernel passes O_DIRECT writes to the daemon uncached;
``buffered`` is the write + fsync fallback). Run by tests/crash/test_power_loss.py, or
``python -m tests.helpers.powercut --backend buffered`` (prints a JSON summary).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import time

from tests.helpers.syscall_kill import CRASH_ENV

STEPS = (3, 4)          # saved in order on top of the seed's steps 1 and 2
EVENT_TIMEOUT_S = 60.0


def _before(in_flight: int | None) -> list[int]:
    """Steps that must still be there when the save in flight did not commit."""
    if in_flight is None:
        return [STEPS[-1] - 1, STEPS[-1]]
    return [in_flight - 2, in_flight - 1]


class Daemon:
    """The FUSE daemon process and its line protocol."""

    def __init__(self, mountpoint: str) -> None:
        self.mountpoint = mountpoint
        os.makedirs(mountpoint, exist_ok=True)
        env = dict(os.environ)
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.helpers.powercut_fs", mountpoint],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env,
                                     cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
        self.mounted = False

    def send(self, **cmd) -> None:
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()

    def event(self, timeout: float = EVENT_TIMEOUT_S) -> dict:
        if not select.select([self.proc.stdout], [], [], timeout)[0]:
            raise TimeoutError(f"the FUSE daemon said nothing for {timeout} s")
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the FUSE daemon exited ({self.proc.wait()})")
        return json.loads(line)

    def expect(self, name: str) -> dict:
        ev = self.event()
        if ev.get("event") != name:
            raise RuntimeError(f"expected {name} from the FUSE daemon, got {ev}")
        return ev

    def mount(self, image: str, cut_after: int | None = None, tag: str = "img") -> None:
        self.send(cmd="mount", image=image, cut_after=cut_after, tag=tag)
        self.expect("mounted")
        self.mounted = True

    def unmount(self) -> dict:
        """Unmount (normally: nothing of ours may still be open there) and return the daemon's
        account of the mount: its operations and the images of a cut (or of the end)."""
        r = subprocess.run(["fusermount3", "-u", self.mountpoint], capture_output=True, text=True)
        if r.returncode != 0:
            subprocess.run(["fusermount3", "-u", "-z", self.mountpoint], capture_output=True)
        self.mounted = False
        ev = self.event()
        while ev.get("event") == "cut":  # a cut reported while the saver was being killed
            ev = self.event()
        if ev.get("event") != "unmounted":
            raise RuntimeError(f"expected unmounted, got {ev}")
        if r.returncode != 0:
            ev["unmount_error"] = r.stderr.strip()
        return ev

    def close(self) -> None:
        if self.mounted:
            subprocess.run(["fusermount3", "-u", "-z", self.mountpoint], capture_output=True)
        with contextlib.suppress(Exception):
            self.send(cmd="quit")
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


class PowerCutHarness:
    def __init__(self, workdir: str, mutation: str | None = None, scenario: str = "manager") -> None:
        import torch
        torch.set_num_threads(1)
        import distckpt
        from tests.helpers.crash_state import KEEP, expected_state
        self.workdir = workdir
        self.mutation = mutation
        self.scenario = scenario
        seed = os.path.join(workdir, "seed")
        if scenario == "manager":
            mgr = distckpt.CheckpointManager(os.path.join(seed, "ckpt"), keep_last=KEEP)
            for s in (1, 2):
                mgr.save(s, expected_state(s))
        else:  # "overwrite": one checkpoint holding step 2, replaced in place by step 3
            distckpt.save(expected_state(2), os.path.join(seed, "ckpt", "x"))
        for s in range(1, STEPS[-1] + 3):
            expected_state(s)
        from tests.helpers.crash_state import name_pattern
        self.usual_names = {name_pattern(n) for n in os.listdir(os.path.join(seed, "ckpt")) if n.startswith(".")}
        self.daemon = Daemon(os.path.join(workdir, "mnt"))
        self.daemon.send(cmd="seed", dir=seed, image="seed")
        self.daemon.expect("seeded")
        self.checked: dict[str, dict] = {}   # image fingerprint -> check result
        self.backend = None

    @property
    def root(self) -> str:
        return os.path.join(self.daemon.mountpoint, "ckpt")

    def _saver(self, ack_w: int) -> None:
        try:
            import logging

            import distckpt
            from distckpt.storage.posix import reset_choices
            from tests.helpers.crash_state import KEEP, apply_mutation, expected_state
            apply_mutation(self.mutation)
            logging.disable(logging.CRITICAL)  # after the cut every operation fails: expected noise
            reset_choices()  # probe the backend in every run, so every run does the same operations
            if self.scenario == "overwrite":
                res = distckpt.save(expected_state(3), os.path.join(self.root, "x"), overwrite=True)
                os.write(ack_w, f"3 {res.backend}\n".encode())
                return
            mgr = distckpt.CheckpointManager(self.root, keep_last=KEEP)
            for step in STEPS:
                res = mgr.save(step, expected_state(step))
                os.write(ack_w, f"{step} {res.backend}\n".encode())
        except BaseException:  # noqa: BLE001 - the cut makes the file system fail: that is the point
            pass
        finally:
            os._exit(0)

    def run_saves(self, cut_after: int | None, tag: str) -> dict:
        """Mount the seed with a cut after operation ``cut_after``, run the saver until it finishes
        or the power goes, unmount. Returns the daemon's account plus the acknowledged steps."""
        self.daemon.mount("seed", cut_after=cut_after, tag=tag)
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(r)
            self._saver(w)
        os.close(w)
        cut = None
        deadline = time.monotonic() + 120
        while True:
            done, _ = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            if select.select([self.daemon.proc.stdout], [], [], 0.005)[0]:
                cut = self.daemon.event()
                if cut.get("event") == "cut":
                    os.kill(pid, signal.SIGKILL)  # the power is off: the saver stops here
                    os.waitpid(pid, 0)
                    break
            if time.monotonic() > deadline:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                raise TimeoutError("the saver hung on the FUSE mount")
        acks = []
        with os.fdopen(r) as f:
            for line in f.read().split("\n"):
                if line:
                    step, backend = line.split()
                    acks.append(int(step))
                    self.backend = backend
        account = self.daemon.unmount()
        account["acked"] = acks
        return account

    def check(self, image: str, fp: str, acked: int | None, in_flight: int | None) -> dict:
        key = f"{fp}/{acked}/{in_flight}"
        if key in self.checked:
            return {**self.checked[key], "cached": True}
        from tests.helpers.crash_state import check_after_crash, check_overwrite_after_crash
        self.daemon.mount(image, tag="after")
        try:
            if self.scenario == "overwrite":
                out = check_overwrite_after_crash(os.path.join(self.root, "x"), old=2, new=3, acked=acked == 3,
                                                  usual_names=self.usual_names)
            else:
                out = check_after_crash(self.root, before=_before(in_flight), acked=acked, in_flight=in_flight,
                                        usual_names=self.usual_names)
        except BaseException as exc:  # noqa: BLE001
            out = {"violations": [f"the check itself failed: {type(exc).__name__}: {exc}"]}
        finally:
            account = self.daemon.unmount()
        if account.get("unmount_error"):
            out["violations"].append(f"I5: the remounted file system was still busy after the check: "
                                     f"{account['unmount_error']}")
        self.checked[key] = out
        return out

    def close(self) -> None:
        self.daemon.close()


def run_campaign(workdir: str, *, last_only: bool = False, mutation: str | None = None,
                 scenario: str = "manager") -> dict:
    """Cut after every operation (``last_only``: only after the last one, i.e. once every save
    returned); ``mutation`` breaks the commit protocol in the saver (tests/helpers/crash_state.py);
    ``scenario``: "manager" (steps 3 and 4 through CheckpointManager) or "overwrite" (one
    checkpoint replaced in place: ``save(..., overwrite=True)``, a RENAME_EXCHANGE)."""
    t0 = time.monotonic()
    h = PowerCutHarness(workdir, mutation, scenario)
    try:
        count = h.run_saves(None, "count")
        if count["acked"] != ([3] if scenario == "overwrite" else list(STEPS)):
            raise RuntimeError(f"the uncut run did not acknowledge {STEPS}: {count}")
        ops = count["ops"]
        kinds = collections.Counter(k for k, _ in ops)
        results = []
        for n in ([len(ops)] if last_only else range(len(ops) + 1)):
            run = h.run_saves(n, "cut")
            acked_steps = run["acked"]
            acked = acked_steps[-1] if acked_steps else 2
            last = 3 if scenario == "overwrite" else STEPS[-1]
            in_flight = acked + 1 if acked < last else None
            drift = [i for i, (a, b) in enumerate(zip(run["ops"], ops)) if a[0] != b[0]]
            at = ops[n] if n < len(ops) else ("end", "")
            for model, img in run["images"].items():
                out = h.check(img["name"], img["fp"], acked, in_flight)
                results.append({"cut_after": n, "next_op": f"{at[0]} {at[1]}", "model": model,
                                "acked": acked, "in_flight": in_flight, "cut": run["cut"],
                                "cached": out.get("cached", False), "violations": out["violations"],
                                "new_committed": out.get("new_committed"), "drift": drift[:1]})
            h.daemon.send(cmd="drop", prefix="cut-")
            h.daemon.expect("dropped")
        per_model = collections.Counter(r["model"] for r in results if not r["cached"])
        return {
            "scenario": scenario,
            "backend": h.backend,
            "ops_per_run": len(ops),
            "op_kinds": dict(kinds),
            "cut_points": 1 if last_only else len(ops) + 1,
            "images_checked": sum(not r["cached"] for r in results),
            "images_checked_per_model": dict(per_model),
            "cuts_with_new_step_committed": sum(bool(r["new_committed"]) for r in results),
            "acked_at_cut": dict(collections.Counter(r["acked"] for r in results if r["model"] == "strict")),
            "drifted_runs": sorted({r["cut_after"] for r in results if r["drift"]}),
            "violations": [(f"cut after op {r['cut_after']} (next: {r['next_op']}) model {r['model']}", r["violations"])
                           for r in results if r["violations"]],
            "seconds": round(time.monotonic() - t0, 1),
        }
    finally:
        h.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", choices=("auto", "uring", "pwrite", "buffered"), default="uring")
    ap.add_argument("--workdir", help="default: a temporary directory, removed at the end")
    ap.add_argument("--last-only", action="store_true", help="one cut, after the last operation")
    ap.add_argument("--scenario", choices=("manager", "overwrite"), default="manager")
    ap.add_argument("--mutation", help="break the commit protocol on purpose (see tests/helpers/crash_state.py)")
    args = ap.parse_args(argv)
    os.environ.update(CRASH_ENV)
    os.environ["DISTCKPT_IO_BACKEND"] = args.backend
    with contextlib.ExitStack() as stack:
        workdir = args.workdir or stack.enter_context(tempfile.TemporaryDirectory(prefix="distckpt-powercut-"))
        summary = run_campaign(workdir, last_only=args.last_only, mutation=args.mutation, scenario=args.scenario)
    json.dump(summary, sys.stdout, indent=1)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
