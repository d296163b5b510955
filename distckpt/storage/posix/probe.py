"""Choosing the I/O backend: probe once per file system, report which one runs and why.

Backends, in order of preference:
  * ``uring``: O_DIRECT writes from aligned staging through io_uring, ``queue_depth`` in flight
    (distckpt._uring).
  * ``pwrite``: the same staging and O_DIRECT, one synchronous pwrite at a time; for kernels or
    sandboxes that refuse io_uring (kernel.io_uring_disabled, Docker's default seccomp profile).
  * ``buffered``: plain write() + fsync(); for file systems that refuse O_DIRECT.

Invariants:
  * The choice is made at most once per process per (file system, requested backend, read or
    write): the result is cached by ``st_dev``, logged once (at WARNING when ``auto`` fell back from io_uring, else INFO),
    and listed by :func:`last_choices`. Every choice carries the reason it was made.
  * Probes run the real code path: for a save, the O_DIRECT probe writes one block through the same
    C writer (io_uring or pwrite) that the save will use, into a temporary file that is always
    removed. For a load (``read_only=True``) nothing is written, ever: a committed checkpoint may
    sit on a read-only mount or belong to another user, and a load killed mid-probe must not leave
    a file behind in it. The alignment comes from statx(STATX_DIOALIGN) on a data file already
    there, and O_DIRECT is tried by reading that file through the same C reader the load uses.
  * No silent fallback: a backend forced with ``DISTCKPT_IO_BACKEND`` (or ``backend=``) that cannot
    run raises :class:`IOBackendUnavailableError`; only ``auto`` moves down the list, and says why.
  * A probe failure that is not about the backend (EACCES, ENOSPC, EMFILE...) is not hidden as a
    backend choice: it raises the typed storage error from :func:`errors.from_os_error`.
"""

from __future__ import annotations

import dataclasses
import errno
import logging
import os
import signal
import threading
import uuid

from ... import _uring
from ...config import get_config
from ...errors import IOBackendUnavailableError, from_os_error

__all__ = ["BackendChoice", "choose_backend", "choose_read_backend", "last_choices", "BACKEND_ORDER"]

log = logging.getLogger(__name__.rsplit(".", 1)[0])  # "distckpt.storage.posix"

BACKEND_ORDER = ("uring", "pwrite", "buffered")

# Callers align chunk starts to at least this many bytes, even where the file system would accept
# 512: a page-aligned offset lets a reader on any device (4 KiB sector disks included) read the
# chunk straight into page-aligned memory, and files stay portable between file systems.
MIN_ALIGNMENT = 4096

# errnos from io_uring_setup that mean "io_uring is not available to this process", as opposed to
# resource exhaustion that would break any backend.
_URING_REFUSED = {errno.EPERM, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP, errno.EACCES, errno.ENOMEM}
# errnos from an O_DIRECT open or aligned write that mean "this file system refuses O_DIRECT".
_DIRECT_REFUSED = {errno.EINVAL, errno.EOPNOTSUPP}


@dataclasses.dataclass(frozen=True)
class BackendChoice:
    """Which backend writes and reads files in ``directory``'s file system, and why.

    Attributes:
        name: "uring", "pwrite" or "buffered".
        reason: Why this backend was chosen (and why the better ones were not).
        mem_align: Memory alignment O_DIRECT needs there (statx STATX_DIOALIGN), in bytes.
        offset_align: File offset alignment O_DIRECT needs there, in bytes.
        directory: The directory the probe ran in.
        align_source: Where the alignments came from: "statx", "BLKSSZGET", "st_blksize", "default".
    """

    name: str
    reason: str
    mem_align: int
    offset_align: int
    directory: str
    align_source: str = "statx"

    @property
    def alignment(self) -> int:
        """The file offset alignment callers should align chunk starts to."""
        return max(self.offset_align, MIN_ALIGNMENT)

    def native_kwargs(self) -> dict:
        """The arguments the C Writer and Reader share for this choice (uring or pwrite)."""
        cfg = get_config()
        return {"block_size": max(cfg.block_size, self.offset_align), "queue_depth": cfg.queue_depth,
                "offset_align": self.offset_align, "mem_align": self.mem_align, "uring": self.name == "uring",
                "timeout_ms": io_timeout_ms()}


def io_timeout_ms() -> int:
    """DISTCKPT_IO_TIMEOUT_S in milliseconds: the C core's bound on the wait for any one request."""
    return max(1, round(get_config().io_timeout_s * 1000))


_lock = threading.Lock()
_cache: dict[tuple[int, str, bool], BackendChoice] = {}
_history: list[BackendChoice] = []
_sigxfsz_done = False


def ensure_sigxfsz_ignored() -> None:
    """Make EFBIG an error, not a death: set SIGXFSZ to SIG_IGN if it is SIG_DFL.

    A write past RLIMIT_FSIZE makes the kernel send SIGXFSZ, whose default action kills the whole
    process (io_uring workers included) before the write can return EFBIG. CPython already ignores
    SIGXFSZ at start-up, but an embedding application may have reset it. Only the main thread may
    change dispositions (signal.signal raises elsewhere), so this runs there, once, and leaves a
    handler the application installed on purpose alone.
    """
    global _sigxfsz_done
    if _sigxfsz_done or not hasattr(signal, "SIGXFSZ"):
        return
    if threading.current_thread() is not threading.main_thread():
        return
    if signal.getsignal(signal.SIGXFSZ) == signal.SIG_DFL:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    _sigxfsz_done = True


def last_choices() -> list[BackendChoice]:
    """Every backend choice this process made, oldest first (one per file system and request)."""
    with _lock:
        return list(_history)


def reset_choices() -> None:
    """Forget cached choices (tests; or after a file system was remounted under the same st_dev)."""
    with _lock:
        _cache.clear()
        _history.clear()


def _unavailable(requested: str, reason: str, directory: str, code: int | None) -> IOBackendUnavailableError:
    return IOBackendUnavailableError(
        f"io backend {requested!r} was forced (DISTCKPT_IO_BACKEND) but cannot run here: {reason}",
        path=directory,
        errno=code,
        backend=requested,
        reason=reason,
    )


def _probe_uring() -> tuple[str | None, int | None]:
    """(None, None) when io_uring_setup works, else (why not, errno)."""
    try:
        _uring.probe_uring()
    except OSError as exc:
        if exc.errno not in _URING_REFUSED:
            raise from_os_error(exc, operation="io_uring_setup") from exc
        name = errno.errorcode.get(exc.errno, str(exc.errno))
        hint = {
            errno.EPERM: "a seccomp filter (e.g. Docker's default profile) or kernel.io_uring_disabled",
            errno.ENOSYS: "a kernel without io_uring",
            errno.ENOMEM: "RLIMIT_MEMLOCK too small for the rings",
        }.get(exc.errno, "refused by the kernel")
        return f"io_uring_setup failed with {name} ({os.strerror(exc.errno)}): {hint}", exc.errno
    return None, None


_READ_ONLY = {errno.EROFS, errno.EACCES, errno.EPERM}


def _probe_alignment(directory: str) -> tuple[int, int, str, str | None]:
    """DIO alignment for regular files in ``directory`` (ext4 reports it only for regular files).

    Returns (mem_align, offset_align, source, sample): ``sample`` is None when the probe could
    create a file there; for a directory this process may only read (a committed checkpoint on a
    read-only mount, restore as another user) it is an existing regular file that was statx()ed
    instead, and the O_DIRECT probe then reads that file rather than writing a new one.
    """
    path = os.path.join(directory, f".distckpt-align-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        sample = _sample_file(directory) if exc.errno in _READ_ONLY else None
        if sample is None:
            raise from_os_error(exc, path=path, operation="probe") from exc
        try:
            mem, off, source = _uring.statx_dioalign(sample)
        except OSError as exc2:
            raise from_os_error(exc2, path=sample, operation="probe") from exc2
        return mem, off, source, sample
    try:
        os.close(fd)
        mem, off, source = _uring.statx_dioalign(path)
    except OSError as exc:
        raise from_os_error(exc, path=path, operation="probe") from exc
    finally:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
    return mem, off, source, None


def _sample_file(directory: str) -> str | None:
    """A regular file (never a symlink) in ``directory`` to probe by reading: a non-empty data file
    when there is one (what a load reads; a tiny file may be stored inline, without O_DIRECT),
    else any regular file (the MANIFEST)."""
    fallback = None
    try:
        with os.scandir(directory) as it:
            for entry in it:
                if not entry.is_file(follow_symlinks=False):
                    continue
                if entry.name.endswith(".bin") and entry.stat(follow_symlinks=False).st_size > 0:
                    return entry.path
                fallback = fallback or entry.path
    except OSError:
        return fallback
    return fallback


def _refused(op: str, how: str, err: int) -> tuple[str, int]:
    """The (reason, errno) of an O_DIRECT ``op`` the file system refused."""
    name = errno.errorcode.get(err, str(err))
    return f"an O_DIRECT {op} via {how} failed with {name} ({os.strerror(err)})", err


def _probe_direct_read(sample: str, use_uring: bool, mem_align: int, offset_align: int) -> tuple[str | None, int | None]:
    """Read one byte of ``sample`` through the real C reader (O_DIRECT): None if it works."""
    how = "io_uring" if use_uring else "pread"
    try:
        r = _uring.Reader(sample, block_size=max(offset_align, os.sysconf("SC_PAGESIZE"), 65536),
                          queue_depth=1, offset_align=offset_align, mem_align=mem_align, uring=use_uring,
                          timeout_ms=io_timeout_ms())
        try:
            if r.size() > 0:
                r.read_into([(0, 1, bytearray(1))])
        finally:
            r.close()
    except OSError as exc:
        if exc.errno in _DIRECT_REFUSED:
            return _refused("read", how, exc.errno)
        # A read of the checkpoint's own file, which the load would make next: EIO here is the
        # load's read error, reported as such.
        raise from_os_error(exc, path=sample, operation="read") from exc
    return None, None


def _probe_direct(directory: str, use_uring: bool, offset_align: int) -> tuple[str | None, int | None]:
    """Write one byte through the real C writer (O_DIRECT, padded, truncated): None if it works."""
    path = os.path.join(directory, f".distckpt-probe-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    how = "io_uring" if use_uring else "pwrite"
    try:
        w = _uring.Writer(path, block_size=max(offset_align, os.sysconf("SC_PAGESIZE"), 65536),
                          queue_depth=1, offset_align=offset_align, uring=use_uring, timeout_ms=io_timeout_ms())
        try:
            w.write(b"\0")
            w.flush()
        finally:
            w.close()
    except OSError as exc:
        if exc.errno in _DIRECT_REFUSED:
            return _refused("write", how, exc.errno)
        raise from_os_error(exc, path=path, operation="probe") from exc
    finally:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
    return None, None


def _decide(directory: str, requested: str, read_only: bool = False) -> BackendChoice:
    if requested == "buffered":
        return BackendChoice("buffered", "forced by DISTCKPT_IO_BACKEND=buffered", MIN_ALIGNMENT,
                             MIN_ALIGNMENT, directory, "default")
    if read_only:  # a load: never create anything; probe by reading a file already there
        sample = _sample_file(directory)
        if sample is None:
            raise from_os_error(FileNotFoundError(errno.ENOENT, "no regular file to probe by reading", directory),
                                path=directory, operation="probe")
        return choose_read_backend(sample, backend=requested)
    mem, off, source, sample = _probe_alignment(directory)

    def probe_direct(use_uring: bool) -> tuple[str | None, int | None]:
        if sample is not None:  # read-only here: probe the read path on an existing file
            return _probe_direct_read(sample, use_uring, mem, off)
        return _probe_direct(directory, use_uring, off)

    if sample is not None:
        source += f", read-only directory: probed by reading {os.path.basename(sample)}"
    page = os.sysconf("SC_PAGESIZE")
    direct_reason = None
    if mem == 0 or off == 0:
        direct_reason = "statx reports no O_DIRECT support on this file system (dio alignment 0)"
    elif mem > page or off > (1 << 20):
        direct_reason = f"O_DIRECT alignment (memory {mem}, offset {off}) exceeds what staging provides"
    if direct_reason is not None:
        if requested != "auto":
            raise _unavailable(requested, direct_reason, directory, errno.EINVAL)
        return BackendChoice("buffered", f"{direct_reason}; using buffered write + fsync",
                             MIN_ALIGNMENT, MIN_ALIGNMENT, directory, source)

    uring_reason = None
    if requested in ("auto", "uring"):
        uring_reason, code = _probe_uring()
        if uring_reason is None:
            uring_reason, code = probe_direct(True)
        if uring_reason is None:
            why = "forced by DISTCKPT_IO_BACKEND=uring" if requested == "uring" else "io_uring and O_DIRECT work here"
            return BackendChoice("uring", f"{why} (dio alignment {mem}/{off} from {source})", mem, off, directory, source)
        if requested == "uring":
            raise _unavailable("uring", uring_reason, directory, code)

    direct_reason, code = probe_direct(False)
    if direct_reason is None:
        why = "forced by DISTCKPT_IO_BACKEND=pwrite" if requested == "pwrite" else f"io_uring unavailable: {uring_reason}"
        return BackendChoice("pwrite", f"{why}; using synchronous O_DIRECT pwrite (dio alignment {mem}/{off} from {source})",
                             mem, off, directory, source)
    if requested == "pwrite":
        raise _unavailable("pwrite", direct_reason, directory, code)
    prefix = f"io_uring unavailable: {uring_reason}; " if uring_reason else ""
    return BackendChoice("buffered", f"{prefix}{direct_reason}; using buffered write + fsync",
                         MIN_ALIGNMENT, MIN_ALIGNMENT, directory, source)


def choose_backend(directory: str | os.PathLike, *, backend: str | None = None,
                   read_only: bool = False) -> BackendChoice:
    """Choose (once per process per file system) the backend for files in ``directory``.

    Args:
        directory: An existing directory on the target file system. Without ``read_only`` it must
            be writable: the probe creates and removes small temporary files there.
        backend: "auto", "uring", "pwrite" or "buffered"; default ``get_config().io_backend``
            (DISTCKPT_IO_BACKEND).
        read_only: Choose for reading the files already in ``directory`` (a load): nothing is
            created, written or removed there; :func:`choose_read_backend` on one of its files
            (a non-empty data file when there is one), cached per file system like the rest.

    Returns:
        The cached or new :class:`BackendChoice`; a new choice is logged with its reason: at WARNING when ``auto``
        fell back from io_uring, else at INFO.

    Raises:
        IOBackendUnavailableError: a forced backend cannot run on this kernel / file system.
        StorageError (a subclass per errno): the directory cannot be probed at all (missing,
            not writable, full, fd table full; with ``read_only``, no regular file in it: ENOENT).
    """
    directory = os.path.abspath(os.fspath(directory))
    requested = backend or get_config().io_backend
    if requested not in ("auto",) + BACKEND_ORDER:
        raise ValueError(f"backend must be auto, uring, pwrite or buffered, not {requested!r}")
    ensure_sigxfsz_ignored()
    try:
        dev = os.stat(directory).st_dev
    except OSError as exc:
        raise from_os_error(exc, path=directory, operation="stat") from exc
    key = (dev, requested, read_only)
    with _lock:
        cached = _cache.get(key)
        if cached is not None:
            return cached
        # Probing under the lock: two threads saving at once must not both probe (and log).
        choice = _decide(directory, requested, read_only)
        _cache[key] = choice
        _history.append(choice)
    # A fallback under "auto" is said at WARNING (once per file system and process): it is correct
    # but slower, and its cause (a seccomp profile, RLIMIT_MEMLOCK, a file system without
    # O_DIRECT) is the operator's to fix or accept. SaveResult.backend says it per save.
    level = logging.WARNING if requested == "auto" and choice.name != BACKEND_ORDER[0] else logging.INFO
    log.log(level, "distckpt io backend for %s (requested %s): %s; %s", directory, requested, choice.name,
            choice.reason)
    return choice



def choose_read_backend(sample: str | os.PathLike, *, backend: str | None = None) -> BackendChoice:
    """Choose how to read existing files like ``sample`` without creating anything next to it.

    For tools that must not write into a checkpoint (``distckpt verify``, a read-only mount):
    the O_DIRECT alignment comes from statx on ``sample`` itself and the O_DIRECT probe reads one
    byte of it through the real C reader. Not cached (one statx and one small read).

    Raises:
        IOBackendUnavailableError: a forced backend (``backend`` or DISTCKPT_IO_BACKEND) cannot read here.
        StorageError subclass: ``sample`` cannot be opened or examined.
    """
    sample = os.path.abspath(os.fspath(sample))
    directory = os.path.dirname(sample)
    requested = backend or get_config().io_backend
    if requested not in ("auto",) + BACKEND_ORDER:
        raise ValueError(f"backend must be auto, uring, pwrite or buffered, not {requested!r}")
    if requested == "buffered":
        return BackendChoice("buffered", "forced by DISTCKPT_IO_BACKEND=buffered", MIN_ALIGNMENT,
                             MIN_ALIGNMENT, directory, "default")
    try:
        mem, off, source = _uring.statx_dioalign(sample)
    except OSError as exc:
        raise from_os_error(exc, path=sample, operation="probe") from exc
    if mem == 0 or off == 0 or mem > os.sysconf("SC_PAGESIZE") or off > (1 << 20):
        reason = f"no usable O_DIRECT alignment for {os.path.basename(sample)} (memory {mem}, offset {off})"
        if requested != "auto":
            raise _unavailable(requested, reason, directory, errno.EINVAL)
        return BackendChoice("buffered", f"{reason}; using buffered reads", MIN_ALIGNMENT, MIN_ALIGNMENT,
                             directory, source)
    reason = None
    if requested in ("auto", "uring"):
        reason, code = _probe_uring()
        if reason is None:
            reason, code = _probe_direct_read(sample, True, mem, off)
        if reason is None:
            return BackendChoice("uring", f"O_DIRECT reads via io_uring (dio alignment {mem}/{off} from {source})",
                                 mem, off, directory, source)
        if requested == "uring":
            raise _unavailable("uring", reason, directory, code)
    direct_reason, code = _probe_direct_read(sample, False, mem, off)
    if direct_reason is None:
        prefix = f"io_uring unavailable: {reason}; " if reason else ""
        return BackendChoice("pwrite", f"{prefix}synchronous O_DIRECT pread (dio alignment {mem}/{off})",
                             mem, off, directory, source)
    if requested == "pwrite":
        raise _unavailable("pwrite", direct_reason, directory, code)
    return BackendChoice("buffered", f"{direct_reason}; using buffered reads", MIN_ALIGNMENT, MIN_ALIGNMENT,
                         directory, source)
