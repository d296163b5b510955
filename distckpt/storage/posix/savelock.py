"""Liveness of saves in flight: one advisory lock file per save, held by the committing process.

Why: a save's hidden ``.NAME.tmp-SAVEID`` directory looks the same whether its save is running or
crashed. Reclaiming must delete only the leftovers of dead saves, from any process (a second job,
``distckpt ls``, a monitoring script), so a live save must be recognisable from outside.

Protocol (rank 0, the one process that creates, publishes and deletes a save's directories):

  * ``acquire``: open-or-create the lock file, ``flock(LOCK_EX | LOCK_NB)``, check that the path still
    names the inode we locked (a reclaimer may have unlinked a stale one meanwhile: then retry), and
    write the owner record (host, pid, start time, save id, what is being saved) as JSON. Only then
    is the tmp directory created, so a tmp directory never exists without its lock being held while
    its save lives.
  * ``release``: unlink the lock file while still holding the lock, then close the fd (on every
    path: the fd is counted in the save's fd budget). The tmp directory is gone by then (renamed
    into place or deleted).
  * A process that dies (SIGKILL, OOM, power loss) drops its flock in the kernel: a free lock whose
    owner record names *this* host is a dead save.
  * ``probe`` only reads: it opens the file read-only and takes a shared lock for an instant.

Across hosts (a shared file system): flock is coherent across clients on NFSv4 (Linux maps it to
byte-range locks), Lustre mounted with ``-o flock``, GPFS, CephFS; it is *local only* on Lustre
``-o localflock`` and some FUSE file systems, where a save held on another host looks free. A free
lock whose owner record names another host is therefore reported as ``unknown`` and its leftovers
are left alone unless the caller says the file system's locks are coherent (``other_hosts=True``).
A file system without flock at all (NFSv3 ``nolock``: ENOLCK) makes every state ``unknown``: saves
still work, leftovers are reported, never deleted.
"""

from __future__ import annotations

import dataclasses
import errno
import fcntl
import json
import logging
import os
import socket
import stat
import time

from ...errors import SaveInProgressError, StorageError, from_os_error
from ..base import Ownership

__all__ = ["SaveLock", "LockState", "acquire", "probe", "remove_if_dead", "this_host"]

log = logging.getLogger("distckpt")

# How long acquire() retries a lock held by someone else before calling the save "in progress":
# probes and reclaimers hold a free lock only for microseconds.
_BUSY_RETRY_S = 1.0
_NO_FLOCK = (errno.ENOLCK, errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS)


def this_host() -> str:
    return socket.gethostname()


@dataclasses.dataclass(frozen=True)
class LockState:
    """What :func:`probe` found. ``state``: ``absent`` (no lock file), ``alive`` (held now),
    ``dead`` (free, and its owner ran on this host or never wrote its record), ``unknown`` (free but
    owned by another host, or the file system has no flock). ``owner``: the JSON owner record or None."""

    path: str
    state: str
    owner: dict | None = None

    @property
    def save_id(self) -> str | None:
        return self.owner.get("save_id") if self.owner else None


class SaveLock(Ownership):
    """A held lock. :meth:`release` unlinks the file and closes the fd; idempotent. Also a root's
    :class:`~distckpt.storage.base.Ownership` (PosixStore.take_ownership)."""

    def __init__(self, path: str, fd: int, owner: dict) -> None:
        self.path = path
        self.owner = owner
        self._fd: int | None = fd

    @property
    def record(self) -> dict:
        return self.owner

    def gone(self) -> bool:
        return self._fd is None or not _same_file(self._fd, self.path)

    def check(self, operation: str) -> None:
        """Raises SaveInProgressError when this lock was released, or its file is no longer the
        one at its path (removed or replaced by hand: another process may lock the new one)."""
        fd = self._fd
        if fd is None or not _same_file(fd, self.path):
            why = "was released" if fd is None else "was removed or replaced (by hand?)"
            raise SaveInProgressError(f"{operation}: the lock {self.path} this process held {why}", path=self.path,
                                      owner=_read_owner_at(self.path),
                                      remedy="Nothing more was changed; start the manager again.")

    def release(self) -> None:
        fd, self._fd = self._fd, None
        if fd is None:
            return
        try:
            if _same_file(fd, self.path):
                os.unlink(self.path)
        except OSError as exc:  # the lock is dropped by close() anyway; a stale file is reclaimable
            log.warning("distckpt: could not remove the save lock %s: %s", self.path, exc)
        finally:
            # Released after the outcome of a save is known (it may be committed): an error here
            # must not replace that outcome. The fd is gone whatever close() reports.
            try:
                os.close(fd)
            except OSError as exc:
                log.warning("distckpt: closing the save lock %s: %s", self.path, exc)


def _same_file(fd: int, path: str) -> bool:
    try:
        st = os.stat(path, follow_symlinks=False)
    except FileNotFoundError:
        return False
    mine = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (mine.st_dev, mine.st_ino)


def _read_owner(fd: int) -> dict | None:
    try:
        raw = os.pread(fd, 64 << 10, 0)
        owner = json.loads(raw.decode()) if raw else None
    except (OSError, ValueError, UnicodeDecodeError):
        return None
    return owner if isinstance(owner, dict) else None


def _in_the_way(path: str) -> str | None:
    """What stands at ``path`` itself when it is not a regular file ("a symbolic link", "a
    directory", "a FIFO", ...), else None (a regular file, or nothing)."""
    try:
        mode = os.lstat(path).st_mode
    except OSError:
        return None
    if stat.S_ISREG(mode):
        return None
    return ("a symbolic link" if stat.S_ISLNK(mode) else "a directory" if stat.S_ISDIR(mode) else
            "a FIFO" if stat.S_ISFIFO(mode) else "a socket" if stat.S_ISSOCK(mode) else "a device")


def _read_owner_at(path: str) -> dict | None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except OSError:
        return None
    try:
        return _read_owner(fd)
    finally:
        os.close(fd)


def acquire(path: str, *, save_id: str, what: str, extra: dict | None = None) -> SaveLock:
    """Take the lock at ``path`` for the save ``save_id`` of ``what`` (the final directory);
    ``extra`` fields join its owner record.

    Raises:
        SaveInProgressError: another live save holds it (its owner record is in the message).
        StorageError subclasses: the lock file cannot be created (permissions, disk full, ...).
    """
    owner = {**(extra or {}), "host": this_host(), "pid": os.getpid(), "started_unix": time.time(),
             "save_id": save_id, "what": what}
    deadline = time.monotonic() + _BUSY_RETRY_S
    while True:
        try:
            # A FIFO or a device planted at the lock's name is never opened (the open of a FIFO
            # for writing, or of a device, acts on what is behind it).
            planted = _in_the_way(path)
            if planted in ("a FIFO", "a socket", "a device"):
                raise OSError(errno.EINVAL, f"{path} is {planted}")
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o644)
        except OSError as exc:
            # ELOOP is also a symlink loop in a parent directory: name the lock only when lstat
            # says the lock itself is what is in the way
            in_the_way = _in_the_way(path) if exc.errno in (errno.ELOOP, errno.EISDIR, errno.EINVAL) else None
            if in_the_way is not None:
                # O_NOFOLLOW: a symlink planted at the lock's name is never followed (it could
                # point anywhere). Say what is in the way, not "check the file system's health".
                raise StorageError(
                    f"the save lock {path} is {in_the_way}, not the regular file distckpt creates there",
                    path=path, errno=exc.errno, operation="create save lock",
                    remedy=f"Remove {path} (no save is using it: distckpt's lock is a regular file it "
                           f"creates itself).") from exc
            raise from_os_error(exc, path=path, operation="create save lock") from exc
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                if time.monotonic() < deadline:
                    os.close(fd)
                    time.sleep(0.01)
                    continue
                other = _read_owner(fd) or {}
                raise SaveInProgressError(
                    f"another save is writing here now: {other.get('what', '?')} (host {other.get('host', '?')}, "
                    f"pid {other.get('pid', '?')}, save {other.get('save_id', '?')}, started "
                    f"{_fmt_time(other.get('started_unix'))}); this save was not started",
                    path=path, owner=other)
            except OSError as exc:
                if exc.errno not in _NO_FLOCK:
                    raise from_os_error(exc, path=path, operation="lock") from exc
                # No flock here: saves still work, but liveness cannot be told from outside, so
                # reclaim leaves every leftover alone (probe says "unknown") instead of guessing.
                log.warning("distckpt: %s does not support flock (%s): leftovers of crashed saves in this "
                            "directory will be reported, not reclaimed", os.path.dirname(path), exc)
            if not _same_file(fd, path):
                os.close(fd)  # a reclaimer unlinked the stale file we opened: take the new one
                continue
            data = json.dumps(owner).encode()
            try:
                os.ftruncate(fd, 0)
                os.pwrite(fd, data, 0)
            except OSError as exc:
                raise from_os_error(exc, path=path, operation="write save lock", needed=len(data)) from exc
            return SaveLock(path, fd, owner)
        except BaseException:
            try:
                os.close(fd)
            except OSError:
                pass
            raise


def _fmt_time(t) -> str:
    if not isinstance(t, (int, float)):
        return "?"
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(t))


def probe(path: str, *, other_hosts: bool = False) -> LockState:
    """Is the save owning the lock at ``path`` alive? Never writes (read-only open, an instant's
    shared lock). ``other_hosts``: trust a free lock of another host (coherent flock)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        return LockState(path, "absent")
    except OSError:
        return LockState(path, "unknown")
    try:
        owner = _read_owner(fd)
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return LockState(path, "alive", owner)
        except OSError:
            return LockState(path, "unknown", owner)
        owner = _read_owner(fd)  # re-read under the lock: the record of the last owner
        if owner is None or owner.get("host") == this_host() or other_hosts:
            return LockState(path, "dead", owner)
        return LockState(path, "unknown", owner)
    finally:
        os.close(fd)  # drops the shared lock


def remove_if_dead(path: str, save_id: str | None) -> bool:
    """Unlink a stale lock file whose owner record still names ``save_id`` and that nobody holds.
    Holds the lock exclusively while unlinking, so a new save that opened the same file finds it
    unlinked (acquire re-checks) and never loses its lock. Returns whether it was removed."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return False
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return False
        owner = _read_owner(fd)
        if (owner.get("save_id") if owner else None) != save_id or not _same_file(fd, path):
            return False
        os.unlink(path)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)
