"""The C core's completion deadline: an O_DIRECT request that the kernel never completes fails as a
typed error within DISTCKPT_IO_TIMEOUT_S instead of hanging its rank for ever.

The storage that stops answering is real: a FUSE file system (tests/helpers/stallfs.py) whose
read() and write() handlers wait while a flag file exists, so the kernel's request stays in flight
as it would on a stuck device. Without the deadline every test here would wait until its watchdog
removed the flag (20 s) and then see the write or read succeed, and fail.
"""

from __future__ import annotations

import errno
import os
import shutil
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

from distckpt import _uring
from tests.helpers.io_helpers import REPO, open_paths

DEADLINE_MS = 700
GRACE_S = 2.0  # csrc/ring.h RING_CANCEL_GRACE_MS
WATCHDOG_S = 20.0  # far past deadline + grace: a test that reaches it has seen no deadline
# A save's stalled write may start seconds after the stall does (its set-up on a loaded machine),
# and the save's abort then waits for the stall's end (below): its stall outlasts its deadline and
# grace by this much. (Loads and verify return once their reader is wedged: their stalls last
# until the test releases them, or the watchdog does.)
STALL_MARGIN_S = 8.0


@pytest.fixture
def stallfs(tmp_path):
    """(mountpoint, stall): a FUSE mount whose reads and writes wait while ``stall`` is set.
    ``stall(True, only=TEXT)`` arms it for the files whose path contains TEXT (every file by
    default), with a watchdog that releases it after WATCHDOG_S; ``stall(False)`` releases it (and
    so does the teardown, before unmounting)."""
    if shutil.which("fusermount3") is None or not os.path.exists("/dev/fuse"):
        pytest.skip("needs FUSE (fusermount3, /dev/fuse)")
    pytest.importorskip("mfusepy")
    mnt, flag = tmp_path / "mnt", tmp_path / "stall.flag"
    mnt.mkdir()
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.Popen([sys.executable, "-m", "tests.helpers.stallfs", str(mnt), str(flag)], cwd=REPO,
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    timers: list[threading.Timer] = []

    def stall(on: bool, release_after: float = WATCHDOG_S, only: str = "") -> None:
        if on:
            tmp = flag.with_suffix(".tmp")
            tmp.write_text(only)
            tmp.rename(flag)
            t = threading.Timer(release_after, lambda: flag.unlink(missing_ok=True))
            t.daemon = True
            t.start()
            timers.append(t)
        else:
            flag.unlink(missing_ok=True)

    try:
        deadline = time.monotonic() + 30
        while not os.path.ismount(mnt):
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"the FUSE daemon did not mount: {proc.stderr.read().decode(errors='replace')}")
            time.sleep(0.05)
        yield str(mnt), stall
    finally:
        for t in timers:
            t.cancel()
        flag.unlink(missing_ok=True)
        time.sleep(0.2)  # the released requests reach the daemon and complete
        r = subprocess.run(["fusermount3", "-u", str(mnt)], capture_output=True)
        if r.returncode != 0:
            subprocess.run(["fusermount3", "-u", "-z", str(mnt)], capture_output=True)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _open_under(path: str) -> list[str]:
    return [p for p in open_paths() if p.startswith(path)]


@pytest.mark.parametrize("wait", ["ext_arg", "poll"])
def test_a_write_that_never_completes_fails_with_etimedout_and_the_writer_keeps_its_memory(stallfs, wait):
    """The write is stuck for good (its cancel cannot end a FUSE request in progress): the call
    fails with ETIMEDOUT after the deadline plus the cancel's grace, the writer is wedged (staging
    and ring kept for ever, the held source too), close() returns at once and closes the file."""
    mnt, stall = stallfs
    _uring._test_poll_wait(wait == "poll")
    try:
        path = os.path.join(mnt, "stuck.bin")
        w = _uring.Writer(path, block_size=1 << 20, queue_depth=4, timeout_ms=DEADLINE_MS)
        src = bytearray(b"x" * (4 << 20))
        stall(True)
        t0 = time.monotonic()
        with pytest.raises(OSError) as info:
            w.write(src)
            w.flush()
        took = time.monotonic() - t0
        assert info.value.errno == errno.ETIMEDOUT, info.value
        assert DEADLINE_MS / 1000 - 0.05 <= took < DEADLINE_MS / 1000 + GRACE_S + 3, took
        assert w.wedged
        t0 = time.monotonic()
        w.close()
        assert time.monotonic() - t0 < 1.0
        assert w.closed and w.fileno == -1 and not _open_under(path)
        stall(False)
    finally:
        _uring._test_poll_wait(False)


def test_a_write_that_completes_during_the_grace_leaves_nothing_behind(stallfs):
    """The device answers late, after the deadline but within the cancel's grace: the call still
    fails with ETIMEDOUT (the save is not trusted), but every request completed, so the writer is
    not wedged and close() releases all it holds; a new writer on the same mount works."""
    mnt, stall = stallfs
    # A deadline of 1.5 s and the stall released 1 s after it: a second of margin on either side
    # (before the deadline, the write would just succeed; after the grace, it would be wedged).
    w = _uring.Writer(os.path.join(mnt, "late.bin"), block_size=1 << 20, queue_depth=4, timeout_ms=1500)
    stall(True, release_after=2.5)
    with pytest.raises(OSError) as info:
        w.write(b"y" * (3 << 20))
        w.flush()
    assert info.value.errno == errno.ETIMEDOUT
    assert not w.wedged
    w.close()
    assert not _open_under(mnt)
    w = _uring.Writer(os.path.join(mnt, "after.bin"), block_size=1 << 20, queue_depth=4, timeout_ms=DEADLINE_MS)
    w.write(b"z" * (3 << 20))
    w.flush()
    w.close()
    with open(os.path.join(mnt, "after.bin"), "rb") as f:
        assert f.read() == b"z" * (3 << 20)


def test_a_read_that_never_completes_fails_with_etimedout_and_keeps_the_destination_exported(stallfs):
    """read_into straight into the caller's buffer (aligned, so O_DIRECT lands in it): the stuck
    read fails with ETIMEDOUT and the reader is wedged; the destination stays exported for ever (a
    bytearray with an export cannot be resized, so its memory cannot move or be freed under a read
    that may still land)."""
    mnt, stall = stallfs
    path = os.path.join(mnt, "data.bin")
    w = _uring.Writer(path, block_size=1 << 20, queue_depth=4, timeout_ms=DEADLINE_MS)
    w.write(b"d" * (2 << 20))
    w.flush()
    w.close()
    r = _uring.Reader(path, block_size=1 << 20, queue_depth=4, timeout_ms=DEADLINE_MS)
    staging = bytearray(2 << 20)  # unaligned: read through the reader's staging
    stall(True)
    t0 = time.monotonic()
    with pytest.raises(OSError) as info:
        r.read_into([(0, 2 << 20, staging)])
    assert info.value.errno == errno.ETIMEDOUT
    assert time.monotonic() - t0 < DEADLINE_MS / 1000 + GRACE_S + 3
    assert r.wedged
    # A wedged reader refuses new calls: the stuck read's completion may still come, and would be
    # taken for one of the new call's (its data copied into the new destination, no error).
    stall(False)
    time.sleep(0.3)
    again = bytearray(1 << 20)
    with pytest.raises(OSError) as info:
        r.read_into([(1 << 20, 1 << 20, again)])
    assert info.value.errno == errno.ETIMEDOUT
    assert again == bytearray(1 << 20)
    direct = bytearray(2 << 20)
    r.close()
    assert r.closed and not _open_under(path)
    r2 = _uring.Reader(path, block_size=1 << 20, queue_depth=4, timeout_ms=DEADLINE_MS)
    stall(True)
    with pytest.raises(OSError) as info:
        r2.read_into([(0, 2 << 20, direct)])
    assert info.value.errno == errno.ETIMEDOUT and r2.wedged
    with pytest.raises(BufferError):
        direct.extend(b"more")  # still exported by the wedged reader
    r2.close()
    stall(False)


def test_a_save_onto_storage_that_stops_answering_raises_storage_io_error_and_commits_nothing(stallfs, monkeypatch):
    """distckpt.save on the stalled mount: StorageIOError (ETIMEDOUT), the previous checkpoint
    intact and loadable, no half-written checkpoint that looks complete, no fd left open on the
    mount. The stall ends after STALL_S: without the deadline the save would then succeed. (The
    error reaches the caller only then: the save's abort unlinks the data file, and this FUSE
    daemon's path locks make an unlink wait for the file's stalled write; on a block device an
    unlink does not wait for the I/O in flight.)"""
    import distckpt
    from distckpt.errors import StorageIOError

    mnt, stall = stallfs
    monkeypatch.setenv("DISTCKPT_IO_TIMEOUT_S", str(DEADLINE_MS / 1000))
    state = {"w": torch.arange(6 << 20, dtype=torch.float32), "b": torch.ones(7)}
    distckpt.save(state, os.path.join(mnt, "step_1"))
    # The data files' writes stall (the C core's O_DIRECT io_uring writes, which have the
    # deadline); the save lock's and the MANIFEST's small buffered writes do not (docs/ERRORS.md:
    # synchronous calls block as long as the kernel blocks them).
    stall_s = DEADLINE_MS / 1000 + GRACE_S + STALL_MARGIN_S
    stall(True, release_after=stall_s, only="/rank")
    t0 = time.monotonic()
    with pytest.raises(StorageIOError) as info:
        distckpt.save({"w": state["w"] + 1, "b": state["b"]}, os.path.join(mnt, "step_2"))
    took = time.monotonic() - t0
    assert info.value.errno == errno.ETIMEDOUT and "DISTCKPT_IO_TIMEOUT_S" in str(info.value), info.value
    assert took < stall_s + 5, took
    assert not _open_under(mnt)
    assert not os.path.exists(os.path.join(mnt, "step_2", "MANIFEST"))
    out = {"w": torch.zeros(6 << 20), "b": torch.zeros(7)}
    distckpt.load(out, os.path.join(mnt, "step_1"))
    assert torch.equal(out["w"], state["w"]) and torch.equal(out["b"], state["b"])


@pytest.mark.parametrize("read_cache", ["direct", "auto"])
def test_a_load_from_storage_that_stops_answering_raises_storage_io_error(stallfs, monkeypatch, read_cache):
    """distckpt.load on the stalled mount, through the C read pipeline (O_DIRECT, "direct") or
    the default choice: StorageIOError (ETIMEDOUT), not a hang and not the BufferError of
    unmapping bounce slots that a wedged reader keeps exported; the checkpoint loads afterwards.
    Only the tensor bytes stall (the file's first 24 MiB): the index at its end is read with a
    plain pread, which has no deadline of distckpt's (docs/ERRORS.md, StorageIOError)."""
    import distckpt
    from distckpt.errors import StorageIOError

    mnt, stall = stallfs
    monkeypatch.setenv("DISTCKPT_IO_TIMEOUT_S", str(DEADLINE_MS / 1000))
    monkeypatch.setenv("DISTCKPT_READ_CACHE", read_cache)
    state = {"w": torch.arange(6 << 20, dtype=torch.float32), "b": torch.ones(7)}
    path = os.path.join(mnt, "step_1")
    distckpt.save(state, path)
    with open(os.path.join(path, "rank00000.bin"), "rb") as f:  # drop it from the page cache
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    stall(True, only=f"/rank@{24 << 20}")
    out = {"w": torch.zeros(6 << 20), "b": torch.zeros(7)}
    with pytest.raises(StorageIOError) as info:
        distckpt.load(out, path)
    assert info.value.errno == errno.ETIMEDOUT, info.value
    stall(False)
    time.sleep(0.3)
    distckpt.load(out, path)
    assert torch.equal(out["w"], state["w"]) and torch.equal(out["b"], state["b"])


def test_a_verify_whose_index_read_stops_answering_raises_storage_io_error(stallfs, monkeypatch):
    """distckpt.verify reads each data file's index (at its end) into a view it releases after:
    a reader wedged by that read keeps the view exported, and the release raised BufferError in
    place of the read's StorageIOError. The timeout is raised (the checkpoint could not be
    verified), not reported as damage of the file: a stalled device says nothing of its bytes. (DISTCKPT_READ_CACHE=direct: a small file is otherwise
    read through the page cache, a plain pread without distckpt's deadline.)"""
    import distckpt
    from distckpt.errors import StorageIOError
    from distckpt.verify import verify

    mnt, stall = stallfs
    monkeypatch.setenv("DISTCKPT_IO_TIMEOUT_S", str(DEADLINE_MS / 1000))
    monkeypatch.setenv("DISTCKPT_READ_CACHE", "direct")
    path = os.path.join(mnt, "step_1")
    distckpt.save({"w": torch.arange(6 << 20, dtype=torch.float32)}, path)
    with open(os.path.join(path, "rank00000.bin"), "rb") as f:
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    stall(True, only=f"/rank@>{24 << 20}")
    with pytest.raises(StorageIOError) as info:
        verify(path)
    assert info.value.errno == errno.ETIMEDOUT, info.value
    stall(False)
    time.sleep(0.3)
    assert verify(path).ok


class _Alarm(Exception):
    pass


@pytest.mark.parametrize("what", ["write", "read"])
def test_a_signal_handler_that_raises_ends_a_stalled_wait_long_before_the_deadline(stallfs, what):
    """Ctrl-C, or pytest-timeout's alarm, during a wait on a stalled request: the handler's
    exception ends the wait (after the cancel's grace) instead of waiting for the deadline (here
    60 s), and that exception is what the call raises, not an OSError. Before, the wait retried
    EINTR without going back to Python: the handler ran only once the deadline had passed."""
    mnt, stall = stallfs
    path = os.path.join(mnt, "sig.bin")
    if what == "read":
        w = _uring.Writer(path, block_size=1 << 20, queue_depth=4, timeout_ms=DEADLINE_MS)
        w.write(b"s" * (2 << 20))
        w.flush()
        w.close()
        obj = _uring.Reader(path, block_size=1 << 20, queue_depth=4, timeout_ms=60_000)
        call = lambda: obj.read_into([(0, 2 << 20, bytearray(2 << 20))])  # noqa: E731
    else:
        obj = _uring.Writer(path, block_size=1 << 20, queue_depth=4, timeout_ms=60_000)

        def call():
            obj.write(b"x" * (4 << 20))
            obj.flush()

    def alarm(signum, frame):
        raise _Alarm()

    old = signal.signal(signal.SIGALRM, alarm)
    stall(True)
    try:
        t0 = time.monotonic()
        signal.setitimer(signal.ITIMER_REAL, 0.5)
        with pytest.raises(_Alarm):
            call()
        took = time.monotonic() - t0
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
    assert took < 0.5 + GRACE_S + 3, took
    assert obj.wedged  # the stall outlasts the grace: the memory is kept, as after a deadline
    obj.close()
    stall(False)
