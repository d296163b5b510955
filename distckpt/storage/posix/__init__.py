"""distckpt.storage.posix: the local file-system back end.

:class:`~distckpt.storage.posix.store.PosixStore` (store.py) is its :class:`distckpt.storage.Store`;
the modules behind it are the save (saving.py, commit.py, savelock.py), the leftovers of saves and
their reclaim (leftovers.py), the read side (loading.py, manifests.py, locate.py) and the save-time
guards (guards.py, mounts.py). Above storage/, code reaches them through the Store, except for what
only a local directory has (an incremental chain's links, what a local path is when it is not a
checkpoint) and the pre-flight report, which shows the guards' numbers.

The I/O backends every data file goes through, exported here:
  * :func:`choose_backend` / :class:`BackendChoice` / :func:`last_choices`: which backend runs on a
    file system (io_uring -> O_DIRECT pwrite -> buffered+fsync), chosen once per process per file
    system, logged with its reason on the ``distckpt.storage.posix`` logger; never a silent fallback.
  * :func:`open_writer` -> :class:`Writer`: append-only, aligned-staging O_DIRECT writer.
  * :func:`open_reader` -> :class:`Reader`: ranged reads, many in flight;
    :func:`choose_read_backend` picks a backend for existing files without writing a probe file.
  * :func:`exchange_paths`, :func:`fsync_path`: atomic directory swap and durability of names.

Invariants shared by all of them: every OSError leaves as the typed class from
:func:`distckpt.errors.from_os_error` (errno kept), and only after the fds involved are closed;
nothing here leaves an fd open after a call returns or raises (except the open Writer/Reader
itself, until its close()).
"""

from .paths import exchange_paths, fsync_path
from .probe import BACKEND_ORDER, BackendChoice, choose_backend, choose_read_backend, last_choices, reset_choices
from .reader import Reader, open_reader
from .writer import Writer, open_writer

__all__ = [
    "BACKEND_ORDER",
    "BackendChoice",
    "choose_backend",
    "choose_read_backend",
    "last_choices",
    "reset_choices",
    "open_writer",
    "Writer",
    "open_reader",
    "Reader",
    "exchange_paths",
    "fsync_path",
]
