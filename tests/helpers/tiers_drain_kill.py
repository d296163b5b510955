"""Kill a drain (distckpt.tiers.drain.drain_step, 1 rank) at system calls of its local part, or at
random times, and check the remote step after each kill: committed complete or invisible, never
partial; then a fresh drain completes it, bit-exact, and no multipart upload stays open.

The same method as tests/helpers/syscall_kill.py (its docstring has the details), for a drain:

* This process is a fork server: it imports torch, distckpt and s3fs once and saves the step
  (``distckpt.save``, one rank) to a local directory: the template every trial drains. It never
  opens an S3 client itself (a client's event-loop thread does not survive a fork): every trial and
  every check runs in a forked child that opens its own.
* Each trial drains the template's step to a remote root of its own (``URL/tNNN/step_00000001``),
  so trials never share a lease, an area or a listing.
* Count run: a child opens its remote store (event loop, connection, credentials warmed by one
  request), blocks on a pipe; ``strace -qq -y -p PID`` (no ``-f``: only the main thread, which runs
  the drain's local part: the MANIFEST and index reads, the data file's reads, handing each piece to
  the upload, and waiting for the loop thread's requests) attaches; the child is released and its
  main thread's calls traced in full. Each call is a kill point ``(name, K)``: the K-th call of
  that name by the main thread (strace counts per thread, and only the main thread is traced, so
  the loop thread never consumes an injection).
* Kill points: every call of the drain's local part (:func:`is_local`: it names the local step,
  a path or an fd on it, thanks to ``-y``; or it is an io_uring_enter, which carries the data
  file's reads), and of the other calls every mutating one (MUTATING of syscall_kill) and every
  ``stride``-th, at most ``--others`` of them by an even sample (``selection`` in the summary says
  what was taken of how many). ``--full``: every call. The calls on the step's directory
  itself (listings and stats of HOLDINGS and of the reads' guard) are sampled too
  (``--dir-calls``); every call on a file of the step is taken (:func:`select`).
* Trial: ``strace -p PID -e inject=NAME:signal=KILL:when=K``; the kernel delivers SIGKILL on entry
  to that call. The trial's trace says which call was really hit (``landed``).
* Timed kills (``--timed N``): N trials killed by SIGKILL after a random delay between 5% and 70%
  of the quicker of two untraced drains' times (seeded; the delays are in the summary).
* A trial's checks run in a child beside the next trial (most of a check is waiting for the dead
  drain's lease to lapse).
* Check after each kill (a forked child): the remote step is committed with the template's save id
  and reads bit-exact, or it has no MANIFEST and ``CheckpointManager(trial root).steps()`` lacks
  it; never a MANIFEST naming a missing or short data object. Then a fresh ``drain_step`` (retried
  while the dead drain's lease lapses: DISTCKPT_OBJECT_LEASE_S=2) commits it, or finds it
  ``already_remote``; the step reads bit-exact; ``steps() == [1]``; the trial root holds exactly the
  MANIFEST and the data object; no multipart upload is open under it.

Prints a JSON summary on stdout. Run by tests/crash/test_tiers_drain_crash.py.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time

from tests.helpers.syscall_kill import MUTATING, _ENTRY, _KILLED, _label, _read_all

ENV = {"DISTCKPT_OBJECT_PART_SIZE": "5M", "DISTCKPT_OBJECT_LEASE_S": "2", "DISTCKPT_OBJECT_REQUEST_TIMEOUT_S": "10",
       "DISTCKPT_ARRIVAL_TIMEOUT_S": "0", "OMP_NUM_THREADS": "1"}
STEP_DIR = "step_00000001"


def expected_state() -> dict:
    """A small step: one 12 MiB tensor (three 5 MiB parts, two 8 MiB read pieces), a small one,
    a value."""
    import torch
    g = torch.Generator().manual_seed(25)
    return {"w": torch.randn(3 << 20, generator=g), "b": torch.arange(1000, dtype=torch.bfloat16), "step": 7}


def _equal(got: dict, want: dict) -> bool:
    import torch
    if sorted(got) != sorted(want):
        return False
    for k, v in want.items():
        if isinstance(v, torch.Tensor):
            if not (isinstance(got[k], torch.Tensor) and got[k].dtype == v.dtype and torch.equal(got[k], v)):
                return False
        elif got[k] != v:
            return False
    return True


def _bucket_and_key(url: str) -> tuple[str, str]:
    rest = url.removeprefix("s3://")
    bucket, _, key = rest.partition("/")
    return bucket, key


class Server:
    def __init__(self, workdir: str, url: str, options: dict, mutation: str | None = None) -> None:
        # One intra-op thread from OMP_NUM_THREADS (ENV), never torch.set_num_threads here: that
        # creates torch's pthreadpool, which a forked child cannot use ("Invalid thread pool!"
        # from the first torch op on a new thread of the child).
        import torch  # noqa: F401
        import distckpt
        import s3fs  # noqa: F401 - imported once here, for every fork
        from distckpt.tiers.drain import drain_step  # noqa: F401
        self.workdir, self.url, self.options, self.mutation = workdir, url.rstrip("/"), options, mutation
        self.local = os.path.join(workdir, "local", STEP_DIR)
        res = distckpt.save(expected_state(), self.local)
        self.save_id = res.save_id
        self.want = expected_state()
        self.trial_no = 0

    # -- forked children -------------------------------------------------------------------------
    def _child(self, fn, *args) -> tuple[int, int]:
        """Fork ``fn(result_w, *args)``; returns (pid, the read end of its result pipe)."""
        res_r, res_w = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(res_r)
            code = 0
            try:
                fn(res_w, *args)
            except BaseException as exc:  # noqa: BLE001
                try:
                    os.write(res_w, (json.dumps({"child_error": f"{type(exc).__name__}: {exc}"[:1500]}) + "\n")
                             .encode())
                except OSError:
                    pass
                code = 1
            finally:
                os._exit(code)
        os.close(res_w)
        return pid, res_r

    def _evict_template(self) -> None:
        """Drop the template's pages from the page cache, so that every trial reads it as the count
        run did: cold, its data file's reads carried by io_uring_enter calls. (A trial after a warm
        one would copy cached pages instead and make fewer io_uring_enter calls than counted.)"""
        for name in os.listdir(self.local):
            fd = os.open(os.path.join(self.local, name), os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)

    def _drainer(self, res_w: int, remote: str, ready_w: int, go_r: int) -> None:
        from distckpt._dist import control_group
        from distckpt.storage import open_store
        from distckpt.tiers.drain import drain_step
        store = open_store(remote, self.options)
        store.committed_save_id(remote)  # the loop thread, a connection, the credentials: warm
        if self.mutation == "manifest-first":
            # The canary: a drain that writes the MANIFEST before the data (no commit protocol).
            import distckpt.tiers.drain as drain_mod
            copy, manifest = drain_mod._copy_file, open(os.path.join(self.local, "MANIFEST"), "rb").read()

            def manifest_first(*args, **kwargs):
                store.fs.pipe_file(f"{remote}/MANIFEST", manifest)
                return copy(*args, **kwargs)

            drain_mod._copy_file = manifest_first
            store.publish = lambda *args, **kwargs: None  # already "published"
        os.write(ready_w, b"r")
        os.read(go_r, 1)
        t0 = time.monotonic()
        try:
            r = drain_step(control_group(), local_path=self.local, remote_path=remote, remote_store=store)
            msg = {"outcome": "ok", "already_remote": r.already_remote}
        except Exception as exc:  # noqa: BLE001 - reported by class and text
            msg = {"outcome": f"{type(exc).__name__}: {exc}"[:800]}
        msg["seconds"] = time.monotonic() - t0
        os.write(res_w, (json.dumps(msg) + "\n").encode())

    def _checker(self, res_w: int, trial_root: str, acked: bool) -> None:
        """The checks after a kill (see the module docstring); writes {"violations": [...], ...}."""
        import distckpt
        from distckpt._dist import control_group
        from distckpt.errors import SaveInProgressError
        from distckpt.storage import open_store
        from distckpt.tiers.drain import drain_step
        remote = f"{trial_root}/{STEP_DIR}"
        store = open_store(remote, self.options)
        violations = []
        there = store.committed_save_id(remote)
        keys = sorted(store.objects(trial_root))
        steps = distckpt.CheckpointManager(trial_root, storage_options=self.options).steps()
        if there is not None:
            if there != self.save_id:
                violations.append(f"the remote MANIFEST names save {there}, the local step is {self.save_id}")
            try:
                if not _equal(distckpt.read(remote, storage_options=self.options), self.want):
                    violations.append("the committed remote step does not read bit-exact")
            except Exception as exc:  # noqa: BLE001 - a committed step that does not load: partial
                violations.append(f"the committed remote step does not load: {type(exc).__name__}: {exc}")
            if 1 not in steps:
                violations.append(f"committed, yet CheckpointManager.steps() = {steps}")
        else:
            if any(k.endswith("MANIFEST") for k in keys):
                violations.append(f"a MANIFEST without a committed step: {keys}")
            if steps:
                violations.append(f"nothing committed, yet CheckpointManager.steps() = {steps}")
            if acked:
                violations.append("the drain returned, yet the remote step is not committed")
        after_kill = {"committed": there is not None, "objects": keys}
        # A fresh drain completes it (the dead drain's lease lapses within DISTCKPT_OBJECT_LEASE_S).
        again = None
        for _ in range(40):
            try:
                again = drain_step(control_group(), local_path=self.local, remote_path=remote, remote_store=store)
                break
            except SaveInProgressError:
                time.sleep(0.25)
        if again is None:
            violations.append("the lease of the killed drain never lapsed")
        elif again.already_remote != (there is not None):
            violations.append(f"the fresh drain says already_remote={again.already_remote}, committed={there}")
        try:
            if not _equal(distckpt.read(remote, storage_options=self.options), self.want):
                violations.append("after the fresh drain the step does not read bit-exact")
        except Exception as exc:  # noqa: BLE001
            violations.append(f"after the fresh drain the step does not load: {type(exc).__name__}: {exc}")
        steps = distckpt.CheckpointManager(trial_root, storage_options=self.options).steps()
        if steps != [1]:
            violations.append(f"after the fresh drain steps() = {steps}")
        rel = trial_root.removeprefix(self.url).strip("/")
        final = sorted(store.objects(trial_root))
        want = sorted([f"{STEP_DIR}/MANIFEST", f"{STEP_DIR}/{self.save_id}/rank00000.bin"])
        # What else may stay: a dead drain's lease object beside a step the fresh drain found
        # already committed (it takes no lease then), and the probe object of a pre-flight killed
        # between its create and its delete. Neither is a step nor listed as one; they are reported.
        leftovers = [k for k in final if k not in want]
        unexpected = [k for k in leftovers if k != f"{STEP_DIR}/.lock" and not k.startswith(".distckpt-probe-")]
        if unexpected or any(k not in final for k in want):
            violations.append(f"after the fresh drain {rel} holds {final}, expected {want}")
        bucket, key = _bucket_and_key(trial_root)
        uploads = store.fs.call_s3("list_multipart_uploads", Bucket=bucket, Prefix=key + "/").get("Uploads", [])
        if uploads:
            violations.append(f"multipart uploads left open: {[u['Key'] for u in uploads]}")
        os.write(res_w, (json.dumps({"violations": violations, "after_kill": after_kill, "leftovers": leftovers})
                         + "\n").encode())

    # -- one trial -------------------------------------------------------------------------------
    def trial(self, *, strace_args: list[str] | None, trace_path: str | None, kill_after: float | None) -> dict:
        """Fork a drain to a fresh trial root; trace it with ``strace_args`` (None: no strace) or
        kill it ``kill_after`` seconds after its release. Returns what happened."""
        self.trial_no += 1
        trial_root = f"{self.url}/t{self.trial_no:03d}"
        self._evict_template()
        ready_r, ready_w = os.pipe()
        go_r, go_w = os.pipe()
        pid, res_r = self._child(self._drainer, f"{trial_root}/{STEP_DIR}", ready_w, go_r)
        os.close(ready_w)
        os.close(go_r)
        tracer = None
        try:
            if os.read(ready_r, 1) != b"r":
                raise RuntimeError(f"the drainer died during set-up: {_read_all(res_r).decode()}")
            if strace_args is not None:
                tracer = subprocess.Popen(["strace", "-qq", "-y", "-o", trace_path, "-p", str(pid)] + strace_args,
                                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
                while True:  # attached when the main thread has a tracer
                    with open(f"/proc/{pid}/status") as f:
                        if any(line.startswith("TracerPid:") and int(line.split()[1]) != 0 for line in f):
                            break
                    if tracer.poll() is not None:
                        raise RuntimeError(f"strace exited: {tracer.stderr.read().decode()!r}")
                    time.sleep(0.002)
            os.write(go_w, b"g")
            if kill_after is not None:
                time.sleep(kill_after)
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            deadline = time.monotonic() + 120
            while True:
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    break
                if time.monotonic() > deadline:
                    os.kill(pid, signal.SIGKILL)
                    status = os.waitpid(pid, 0)[1]
                    break
                time.sleep(0.005)
            if tracer is not None:
                tracer.wait(timeout=60)
            lines = _read_all(res_r).decode().splitlines()
            outcome = json.loads(lines[-1]) if lines else None
        finally:
            for fd in (ready_r, go_w, res_r):
                os.close(fd)
            if tracer is not None and tracer.poll() is None:
                tracer.kill()
                tracer.wait()
        killed = os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
        return {"pid": pid, "root": trial_root, "killed": killed, "outcome": outcome}

    def check(self, trial_root: str, acked: bool) -> tuple[int, int]:
        """Start the checks of a killed trial in a child; :meth:`collect` waits for them (so the
        next trial runs meanwhile: most of a check is waiting for the dead drain's lease to lapse)."""
        return self._child(self._checker, trial_root, acked)

    def collect(self, pending: tuple[int, int]) -> dict:
        pid, res_r = pending
        try:
            _, status = os.waitpid(pid, 0)
            lines = _read_all(res_r).decode().splitlines()
        finally:
            os.close(res_r)
        got = json.loads(lines[-1]) if lines else {"child_error": f"the check died ({status})"}
        if "child_error" in got:
            return {"violations": [f"the check failed: {got['child_error']}"], "after_kill": None, "leftovers": []}
        return got

    # -- the campaign ----------------------------------------------------------------------------
    def _labels(self, trace_path: str, pid: int) -> list[tuple[str, int, str]]:
        counts: collections.Counter = collections.Counter()
        out = []
        with open(trace_path) as f:
            for line in f:
                m = _ENTRY.match(line)
                if not m or int(m.group("tid")) != pid:
                    continue
                name = m.group("name")
                counts[name] += 1
                out.append((name, counts[name], _label(name, m.group("args"), self.local)))
        return out

    def count(self) -> tuple[list[tuple[str, int, str]], float]:
        trace = os.path.join(self.workdir, "count.trace")
        run = self.trial(strace_args=[], trace_path=trace, kill_after=None)
        if not run["outcome"] or run["outcome"].get("outcome") != "ok":
            raise RuntimeError(f"the count run's drain failed: {run}")
        # ``strace -o FILE -p PID`` without -f prefixes no tid: add the main thread's.
        with open(trace) as f:
            text = f.read()
        if not _ENTRY.match(text.splitlines()[0] if text else ""):
            text = "".join(f"{run['pid']} {line}\n" for line in text.splitlines())
            with open(trace, "w") as f:
                f.write(text)
        calls = self._labels(trace, run["pid"])
        return calls, run["outcome"]["seconds"]

    def kill_at(self, name: str, k: int, label: str) -> dict:
        trace = os.path.join(self.workdir, "kill.trace")
        run = self.trial(strace_args=["-e", f"trace={name}", "-e", f"inject={name}:signal=KILL:when={k}"],
                         trace_path=trace, kill_after=None)
        landed = landed_at = None
        with open(trace) as f:
            lines = f.read().splitlines()
        last, made = None, 0
        for line in lines:
            if not _ENTRY.match(line) and not _KILLED.match(line):
                line = f"{run['pid']} {line}"
            m = _ENTRY.match(line)
            if m:
                last = _label(m.group("name"), m.group("args"), self.local)
                made += m.group("name") == name
            if _KILLED.match(line) and landed is None:
                landed, landed_at = last, made
        acked = bool(run["outcome"]) and run["outcome"].get("outcome") == "ok"
        # Landed on the counted call: the same label, or (strace could not name the fd of a call
        # the kill interrupted: its -y path is missing, "read()" for "read(ROOT/MANIFEST)") the
        # same name at the same ordinal K (the trial traces that name alone, so K is its count).
        as_counted = landed == label or (landed == f"{name}()" and landed_at == k)
        # ``made``: how many calls of that name the trial made (said beside a point not killed).
        return {"point": f"{name}#{k} {label}", "made": made, "local": is_local(name, label), "killed": run["killed"],
                "landed": landed, "landed_as_counted": as_counted, "acked": acked,
                "pending": self.check(run["root"], acked)}

    def timed(self, delay: float) -> dict:
        run = self.trial(strace_args=None, trace_path=None, kill_after=delay)
        acked = bool(run["outcome"]) and run["outcome"].get("outcome") == "ok"
        return {"delay": round(delay, 4), "killed": run["killed"], "acked": acked,
                "pending": self.check(run["root"], acked)}

    def finish(self, r: dict) -> dict:
        """``r`` with its checks' results (waits for them), and those of the earlier tries of its
        kill point (:meth:`campaign`)."""
        checked = self.collect(r.pop("pending"))
        return {**r, "committed": (checked["after_kill"] or {}).get("committed"),
                "violations": r.pop("earlier_violations", []) + checked["violations"],
                "leftovers": checked["leftovers"]}

    def campaign(self, plan: list, stop_at_first: bool = False, tries: int = 3) -> list[dict]:
        """Run ``plan`` (callables returning a trial's dict with its pending checks), at most one
        check running beside a trial; ``stop_at_first``: stop once a trial's checks found a violation.

        A kill at the K-th io_uring_enter whose trial made fewer than K of them is tried again
        (``tries`` in all): how many waits the ring's completions take depends on how fast they
        arrive (a busy machine, a cached page), so that call's ordinal is not fixed as a file
        call's is. The earlier tries' checks still run and their violations count."""
        done, in_flight = [], []
        for run in plan:
            t0 = time.monotonic()
            earlier: list = []
            for attempt in range(tries):
                r = run()
                name, _, rest = r.get("point", "").partition("#")
                k = int(rest.split(" ", 1)[0]) if rest[:1].isdigit() else 0
                if attempt + 1 < tries and name == "io_uring_enter" and not r["killed"] and r["made"] < k:
                    earlier += self.finish(r)["violations"]
                    continue
                break
            r["earlier_violations"] = earlier
            in_flight.append(r)
            print(f"trial {self.trial_no}: {time.monotonic() - t0:.1f} s {in_flight[-1].get('point', '')}",
                  file=sys.stderr, flush=True)
            if len(in_flight) > 1:
                done.append(self.finish(in_flight.pop(0)))
                if stop_at_first and done[-1]["violations"]:
                    break
        return done + [self.finish(r) for r in in_flight]


def is_local(name: str, label: str) -> bool:
    """A call of the drain's local part: it names the local step (a path, or an fd on it), or it
    is an io_uring_enter (the local store's reads of the data file are io_uring requests)."""
    return "ROOT" in label or name == "io_uring_enter"


def _even(items: list, n: int) -> list:
    """At most ``n`` of ``items``, evenly spread (the first and the last kept)."""
    if len(items) <= n:
        return list(items)
    if n <= 1:
        return items[:n]
    return [items[round(j * (len(items) - 1) / (n - 1))] for j in range(n)]


def select(calls: list[tuple[str, int, str]], full: bool, stride: int, dir_calls: int,
           others: int) -> list[tuple[str, int, str]]:
    """Every call (``full``); else every call of the local part on a file of the step (its
    MANIFEST, index and data file: opens, stats, reads, closes; the io_uring_enter calls that
    read it), at most ``dir_calls`` of the calls on the step's directory itself (listings and stats,
    evenly sampled), and of the other calls every mutating one and every ``stride``-th, at most
    ``others`` (evenly sampled); in trace order."""
    if full:
        return list(calls)
    on_files = [i for i, c in enumerate(calls) if is_local(c[0], c[2]) and ("ROOT/" in c[2] or c[0] == "io_uring_enter")]
    on_dir = [i for i, c in enumerate(calls) if is_local(c[0], c[2]) and i not in on_files]
    rest = [i for i, c in enumerate(calls) if not is_local(c[0], c[2]) and (c[0] in MUTATING or i % stride == 0)]
    take = set(on_files) | set(_even(on_dir, dir_calls)) | set(_even(rest, others))
    return [calls[i] for i in sorted(take)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workdir", required=True)
    ap.add_argument("--url", required=True, help="the remote root (s3://bucket/prefix); one prefix per trial below it")
    ap.add_argument("--options", required=True, help="storage_options, JSON")
    ap.add_argument("--full", action="store_true", help="every call of the drain's main thread")
    ap.add_argument("--stride", type=int, default=8)
    ap.add_argument("--others", type=int, default=4, help="at most this many kill points outside the local part")
    ap.add_argument("--dir-calls", type=int, default=4, help="at most this many kill points on the step directory")
    ap.add_argument("--timed", type=int, default=0, help="kills at random times")
    ap.add_argument("--seed", type=int, default=25)
    ap.add_argument("--no-syscalls", action="store_true")
    ap.add_argument("--mutation", choices=("manifest-first",), help="break the drain on purpose (the canary)")
    ap.add_argument("--stop-at-first", action="store_true", help="stop at the first kill point with a violation")
    args = ap.parse_args(argv)
    os.environ.update(ENV)
    t0 = time.monotonic()
    srv = Server(args.workdir, args.url, json.loads(args.options), args.mutation)
    calls, traced_s = srv.count()
    points = [] if args.no_syscalls else select(calls, args.full, args.stride, args.dir_calls, args.others)
    # The timed kills fall within an untraced drain's time (strace slows the traced one).
    drain_s = traced_s
    for _ in range(2 if args.timed else 0):  # the quicker of two untraced drains
        untraced = srv.trial(strace_args=None, trace_path=None, kill_after=None)
        drain_s = min(drain_s, untraced["outcome"]["seconds"])
        srv.finish({"pending": srv.check(untraced["root"], True)})
    rng = random.Random(args.seed)
    delays = [rng.uniform(0.05, 0.7) * drain_s for _ in range(args.timed)]
    results = srv.campaign([lambda c=c: srv.kill_at(*c) for c in points], args.stop_at_first)
    timed = srv.campaign([lambda d=d: srv.timed(d) for d in delays])
    summary = {
        "save_id": srv.save_id,
        "drain_seconds": drain_s,
        "traced_drain_seconds": traced_s,
        "calls": len(calls),
        "local_calls": sum(is_local(c[0], c[2]) for c in calls),
        "selection": "every call" if args.full else
                     f"every call of the local part on a file of the step (or io_uring_enter); at most "
                     f"{args.dir_calls} on the step's directory; of the others, every mutating one and every "
                     f"{args.stride}-th, at most {args.others} (evenly sampled)",
        "kill_points": len(results),
        "local_kill_points": sum(r["local"] for r in results),
        "file_calls": sum(is_local(c[0], c[2]) and ("ROOT/" in c[2] or c[0] == "io_uring_enter") for c in calls),
        "file_kill_points": sum(r["local"] and ("ROOT/" in r["point"] or "io_uring_enter" in r["point"])
                                for r in results),
        "killed": sum(r["killed"] for r in results),
        "landed_as_counted": sum(r["landed_as_counted"] for r in results),
        "local_not_landed": [(r["point"], r["landed"]) for r in results if r["local"] and not r["landed_as_counted"]],
        "committed_after_kill": sum(bool(r["committed"]) for r in results if r["killed"]),
        "violations": [(r["point"], r["violations"]) for r in results if r["violations"]],
        "not_killed": [r["point"] for r in results if not r["killed"]],
        "local_not_killed": [f"{r['point']} (the trial made {r['made']})" for r in results
                             if not r["killed"] and r["local"]],
        "leftovers": sorted({k.split("/")[-1][:16] for r in results + timed for k in r["leftovers"]}),
        "points": [(r["point"], r["landed_as_counted"], r["committed"]) for r in results],
        "timed": timed,
        "seconds": round(time.monotonic() - t0, 1),
    }
    json.dump(summary, sys.stdout, indent=1)
    print()
    shutil.rmtree(os.path.join(args.workdir, "local"), ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
