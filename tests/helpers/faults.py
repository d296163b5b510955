"""Real fault injection for tests: small file systems, read-only mounts, a private /dev/shm, rlimits
and dropped capabilities in child processes. Nothing here mocks the OS: the kernel returns the
real ENOSPC, EROFS, EACCES and EMFILE.

Mounts (root only; every one is torn down with ``umount -l`` even when the test fails)::

    from tests.helpers.faults import mounts            # noqa: F401  (pytest fixture)

    def test_x(mounts, tmp_path):
        small = mounts.tmpfs(tmp_path / "m", size="16m")          # real ENOSPC at 16 MiB
        ext4 = mounts.ext4(tmp_path / "e", size="8m", inodes=16)  # loop image; O_DIRECT alignment
        ro = mounts.readonly(tmp_path / "ro")                     # EROFS on every write

or the context managers :func:`tmpfs_mount`, :func:`ext4_image_mount`, :func:`readonly_mount`
directly. :func:`fill_inodes` and :func:`fill_space` use a file system up;
:func:`deleted_open_file` holds space in a deleted-but-open file.

Child processes: :func:`run_python` runs code in a fresh interpreter (the repository on its
PYTHONPATH) with rlimits (``rlimits={resource.RLIMIT_NOFILE: (24, 24)}``), capabilities dropped
(``drop_caps=("cap_dac_override",)``) and/or a private mount namespace with a small /dev/shm
(``private_shm="1m"``; the host's /dev/shm is untouched). The child reports back with ``emit(obj)``
or ``emit_error(exc)`` (both predefined in the child); :class:`ChildResult` carries the parsed
objects, and ``result.check()`` fails the test when the child died of a signal (SIGBUS, SIGXFSZ)
or exited non-zero. A child past its timeout is killed and the test fails: it can never hang.

A missing tool or a non-root user skips the test with the reason (:func:`require_root`,
:func:`require_tools`).
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Mapping

import pytest

__all__ = [
    "REPO_ROOT",
    "PYTHON",
    "is_root",
    "require_root",
    "require_tools",
    "tmpfs_mount",
    "ext4_image_mount",
    "readonly_mount",
    "Mounts",
    "mounts",
    "fill_inodes",
    "fill_space",
    "deleted_open_file",
    "ChildResult",
    "run_python",
    "CAPS",
    "cap_effective",
]

REPO_ROOT = Path(os.path.abspath(__file__)).parents[2]
PYTHON = sys.executable  # the real interpreter, not a wrapper script: rlimits must reach it

# Capability numbers from <linux/capability.h> for the ones fault tests drop.
CAPS = {
    "cap_chown": 0, "cap_dac_override": 1, "cap_dac_read_search": 2, "cap_fowner": 3,
    "cap_sys_admin": 21, "cap_sys_resource": 24,
}
_PR_CAPBSET_DROP = 24


# ------------------------------------------------------------------------------------------------
# Preconditions


def is_root() -> bool:
    return os.geteuid() == 0


def require_root(what: str = "this fault test") -> None:
    """Skip the calling test unless running as root (mounts, namespaces and losetup need it)."""
    if not is_root():
        pytest.skip(f"{what} needs root (mount/unshare/losetup); running as uid {os.geteuid()}")


def require_tools(*names: str) -> None:
    """Skip the calling test when a command-line tool is missing, naming it."""
    missing = [n for n in names if shutil.which(n) is None]
    if missing:
        pytest.skip(f"missing tool(s): {', '.join(missing)}")


def _run(argv: list[str], timeout: float = 60) -> subprocess.CompletedProcess:
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc


def _umount(directory: str | os.PathLike) -> None:
    # Lazy unmount: detaches at once even if a leaked fd still points into the file system, so a
    # failing test cannot leave a mount behind (the kernel frees it when the last fd closes).
    subprocess.run(["umount", "-l", os.fspath(directory)], capture_output=True, timeout=60)


# ------------------------------------------------------------------------------------------------
# Mounts


@contextlib.contextmanager
def tmpfs_mount(directory: str | os.PathLike, size: str | int = "16m", *, mode: str = "0755",
                readonly: bool = False, options: Iterable[str] = ()) -> Iterator[Path]:
    """Mount a tmpfs of ``size`` (bytes, or "16m") on ``directory`` (created if needed).

    Writes past ``size`` fail with a real ENOSPC. Skips the test when not root.
    """
    require_root("a tmpfs mount")
    require_tools("mount", "umount")
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    opts = [f"size={size}", f"mode={mode}", *(["ro"] if readonly else []), *options]
    _run(["mount", "-t", "tmpfs", "-o", ",".join(opts), "distckpt-test", str(d)])
    try:
        yield d
    finally:
        _umount(d)


@contextlib.contextmanager
def ext4_image_mount(directory: str | os.PathLike, size: str | int = "32m", *,
                     inodes: int | None = None, image_dir: str | os.PathLike | None = None,
                     readonly: bool = False) -> Iterator[Path]:
    """Mount a fresh ext4 file system from a sparse image through a loop device.

    Unlike tmpfs, ext4 enforces O_DIRECT alignment (512 bytes here) and has a fixed inode count:
    ``inodes=16`` (``mkfs.ext4 -N 16``) leaves about 5 free inodes for the test. The image lives in
    ``image_dir`` (default: next to ``directory``) and is removed with the loop device on exit.
    """
    require_root("a loop-mounted ext4 image")
    require_tools("mkfs.ext4", "losetup", "mount", "umount", "truncate")
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    img_dir = Path(image_dir) if image_dir is not None else d.parent
    img = img_dir / f".{d.name}-{uuid.uuid4().hex[:8]}.ext4"
    _run(["truncate", "-s", str(size), str(img)])
    loopdev = None
    mounted = False
    try:
        mkfs = ["mkfs.ext4", "-q", "-F", *(["-N", str(inodes)] if inodes else []), str(img)]
        _run(mkfs)
        loopdev = _run(["losetup", "-f", "--show", str(img)]).stdout.strip()
        _run(["mount", *(["-o", "ro"] if readonly else []), loopdev, str(d)])
        mounted = True
        yield d
    finally:
        if mounted:
            _umount(d)
        if loopdev:
            # After a lazy umount the kernel may still hold the device for a moment; retry.
            for _ in range(50):
                if subprocess.run(["losetup", "-d", loopdev], capture_output=True).returncode == 0:
                    break
                time.sleep(0.1)
        with contextlib.suppress(OSError):
            img.unlink()


@contextlib.contextmanager
def readonly_mount(directory: str | os.PathLike, *, size: str | int = "4m",
                   populate: Callable[[Path], None] | None = None) -> Iterator[Path]:
    """A read-only tmpfs on ``directory``: every create or write fails with EROFS (root included,
    which ignores permission bits but not a read-only mount). ``populate(path)`` runs while it is
    still writable, so a test can leave files to read."""
    with tmpfs_mount(directory, size) as d:
        if populate is not None:
            populate(d)
        _run(["mount", "-o", "remount,ro", str(d)])
        yield d


class Mounts:
    """Mount factory with one teardown for everything it mounted (see the ``mounts`` fixture)."""

    def __init__(self) -> None:
        self._stack = contextlib.ExitStack()

    def tmpfs(self, directory: str | os.PathLike, size: str | int = "16m", **kw: Any) -> Path:
        return self._stack.enter_context(tmpfs_mount(directory, size, **kw))

    def ext4(self, directory: str | os.PathLike, size: str | int = "32m", **kw: Any) -> Path:
        return self._stack.enter_context(ext4_image_mount(directory, size, **kw))

    def readonly(self, directory: str | os.PathLike, **kw: Any) -> Path:
        return self._stack.enter_context(readonly_mount(directory, **kw))

    def close(self) -> None:
        self._stack.close()


@pytest.fixture
def mounts() -> Iterator[Mounts]:
    """Mount real small file systems in a test; all are unmounted (and loop devices detached)
    at teardown, in reverse order, whatever the test's outcome."""
    m = Mounts()
    try:
        yield m
    finally:
        m.close()


# ------------------------------------------------------------------------------------------------
# Using a file system up


def fill_inodes(directory: str | os.PathLike, *, limit: int = 1_000_000) -> int:
    """Create empty files in ``directory`` until the file system has no inode left (ENOSPC).

    Returns how many files were created. Raises RuntimeError when ``limit`` files did not exhaust
    it (use it on a small file system such as ``ext4_image_mount(inodes=16)``).
    """
    d = Path(directory)
    for i in range(limit):
        try:
            fd = os.open(d / f"inode-{i:07d}", os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                return i
            raise
        os.close(fd)
    raise RuntimeError(f"{limit} files did not exhaust the inodes of {d}")


def fill_space(directory: str | os.PathLike, *, leave_bytes: int = 0, name: str = "filler") -> int:
    """Write a file in ``directory`` until at most ``leave_bytes`` are free (or ENOSPC).

    Returns the bytes written. The file stays (delete it to free the space again).
    """
    path = Path(directory) / name
    written = 0
    chunk = b"\xa5" * (1 << 20)
    with open(path, "wb", buffering=0) as f:
        while True:
            st = os.statvfs(directory)
            room = st.f_bavail * st.f_frsize - leave_bytes
            if room <= 0:
                break
            try:
                written += f.write(chunk[: min(len(chunk), room)])
            except OSError as exc:
                if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                    break
                raise
    return written


@contextlib.contextmanager
def deleted_open_file(directory: str | os.PathLike, nbytes: int) -> Iterator[tuple[int, str]]:
    """Hold ``nbytes`` of ``directory``'s file system in a deleted-but-open file.

    Yields (fd, former path); df counts the space as used, du does not, until the fd is closed on
    exit. This is what a leaked fd to a rotated checkpoint looks like.
    """
    path = os.path.join(os.fspath(directory), f"held-{uuid.uuid4().hex[:8]}.bin")
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        chunk = b"\x5a" * (1 << 20)
        left = nbytes
        while left > 0:
            left -= os.write(fd, chunk[: min(left, len(chunk))])
        os.fsync(fd)
        os.unlink(path)
        yield fd, path
    finally:
        os.close(fd)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


# ------------------------------------------------------------------------------------------------
# Child processes

_MARK = "@@FAULTS_JSON@@"

# Defined in every child before the test's code runs.
_PRELUDE = textwrap.dedent(f"""
    import json as _json, os as _os, sys as _sys

    def error_dict(exc):
        d = getattr(exc, "details", None)
        return {{
            "type": type(exc).__name__,
            "mro": [c.__name__ for c in type(exc).__mro__],
            "errno": getattr(exc, "errno", None),
            "path": getattr(exc, "path", None),
            "rank": getattr(exc, "rank", None),
            "remedy": getattr(exc, "remedy", None),
            "message": str(exc),
            "fields": d if isinstance(d, dict) else {{}},
        }}

    def emit(obj):
        print({_MARK!r} + _json.dumps(obj, default=str), flush=True)

    def emit_error(exc):
        emit({{"error": error_dict(exc)}})
""")


@dataclasses.dataclass
class ChildResult:
    """What a :func:`run_python` child did: exit status, output and the objects it emitted."""

    argv: list[str]
    returncode: int
    stdout: str
    stderr: str
    emitted: list[Any]

    @property
    def signal(self) -> str | None:
        """The name of the signal that killed the child (e.g. "SIGBUS"), or None."""
        return signal.Signals(-self.returncode).name if self.returncode < 0 else None

    @property
    def data(self) -> Any:
        """The last object the child emitted (None when it emitted nothing)."""
        return self.emitted[-1] if self.emitted else None

    def check(self) -> "ChildResult":
        """Fail (AssertionError with the child's stderr) unless it exited 0 without a signal."""
        if self.returncode != 0:
            how = f"was killed by {self.signal}" if self.signal else f"exited {self.returncode}"
            raise AssertionError(f"child {how}\n--- stdout ---\n{self.stdout}\n--- stderr ---\n"
                                 f"{self.stderr}")
        return self


def cap_effective(pid: int | str = "self") -> int:
    """The effective capability mask of a process (from /proc/PID/status)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("CapEff:"):
                return int(line.split()[1], 16)
    raise RuntimeError("no CapEff line in /proc/status")


def _preexec(rlimits: Mapping[int, tuple[int, int]], caps: list[int]) -> Callable[[], None] | None:
    if not rlimits and not caps:
        return None
    import resource
    libc = ctypes.CDLL(None, use_errno=True) if caps else None  # loaded before fork, not after

    def setup() -> None:  # runs in the child between fork and exec
        for cap in caps:
            # Dropping from the bounding set is what survives exec: root's new permitted and
            # effective sets are computed from it (capsh --drop does the same).
            if libc.prctl(_PR_CAPBSET_DROP, cap, 0, 0, 0) != 0:
                raise OSError(ctypes.get_errno(), f"prctl(PR_CAPBSET_DROP, {cap}) failed")
        for which, (soft, hard) in rlimits.items():
            resource.setrlimit(which, (soft, hard))
    return setup


def run_python(code: str, *, rlimits: Mapping[int, tuple[int, int]] | None = None,
               drop_caps: Iterable[str | int] = (), private_shm: str | None = None,
               env: Mapping[str, str] | None = None, timeout: float = 60,
               cwd: str | os.PathLike | None = None) -> ChildResult:
    """Run ``code`` in a fresh interpreter and collect what it ``emit()``-ed.

    Args:
        code: Python source; ``emit(obj)``, ``emit_error(exc)`` and ``error_dict(exc)`` are
            predefined. It runs with the repository first on PYTHONPATH.
        rlimits: {resource.RLIMIT_*: (soft, hard)} applied in the child before exec.
        drop_caps: capability names from :data:`CAPS` (or numbers) removed from the child's
            bounding set, so the exec'd interpreter never has them (root without
            cap_dac_override gets EACCES from permission bits).
        private_shm: a tmpfs size, with mount options after it ("1m", "1g,ro"): the child runs in its own mount namespace
            (``unshare -m --propagation private``) with a fresh /dev/shm of that size; the host's
            /dev/shm is not touched. Needs root and unshare.
        env: extra environment variables for the child.
        timeout: seconds before the child is killed and the test fails.

    Returns:
        ChildResult; call ``.check()`` to require a clean exit.
    """
    caps = [CAPS[c.lower()] if isinstance(c, str) else int(c) for c in drop_caps]
    if caps:
        require_root("dropping capabilities")
    argv = [PYTHON, "-c", _PRELUDE + textwrap.dedent(code)]
    if private_shm is not None:
        require_root("a private /dev/shm")
        require_tools("unshare", "mount")
        # $1 is the size; the rest is the interpreter's argv, exec'd so signals reach it directly.
        argv = ["unshare", "-m", "--propagation", "private", "sh", "-c",
                'mount -t tmpfs -o size="$1" distckpt-test-shm /dev/shm || exit 97; shift; exec "$@"',
                "sh", private_shm, *argv]
    child_env = dict(os.environ)
    child_env["PYTHONPATH"] = os.pathsep.join(
        [str(REPO_ROOT)] + ([child_env["PYTHONPATH"]] if child_env.get("PYTHONPATH") else []))
    child_env.update(env or {})
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=child_env,
                              cwd=os.fspath(cwd) if cwd is not None else str(REPO_ROOT),
                              preexec_fn=_preexec(dict(rlimits or {}), caps))
    except subprocess.TimeoutExpired as exc:  # subprocess.run has killed it already
        raise AssertionError(f"child did not finish within {timeout} s (hang?)\n"
                             f"stdout: {exc.stdout}\nstderr: {exc.stderr}") from None
    emitted = [json.loads(line[len(_MARK):]) for line in proc.stdout.splitlines()
               if line.startswith(_MARK)]
    return ChildResult(argv, proc.returncode, proc.stdout, proc.stderr, emitted)
