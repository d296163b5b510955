"""distckpt.storage.posix: the storage backends every data file goes through.

Public surface (the rest of distckpt uses only these names):
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
