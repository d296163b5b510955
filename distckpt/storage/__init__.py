"""Storage back ends: the one seam between the commit protocol and where bytes live.

Two back ends implement :class:`Store`:

  * ``posix`` (:class:`distckpt.storage.posix.store.PosixStore`): local file systems. Data files go
    through per-rank O_DIRECT io_uring writers; the commit is made of directory operations (tmp
    dir, fsync, rename; :mod:`distckpt.storage.posix.commit`). ``file://`` URLs map here.
  * ``object`` (:class:`distckpt.storage.object.store.ObjectStore`): fsspec object stores (``s3://``
    through s3fs). Data objects are uploaded under a save-unique prefix, and MANIFEST is written
    last with a conditional create; nothing is ever renamed (docs/FORMAT.md, "Object stores").

:func:`open_store` picks one from a path. The coordinator (:mod:`distckpt.coordinator`) speaks to
the interface only: ``prepare`` (a save area, the save's liveness lock), ``write_rank`` (one rank's
data), ``publish`` (MANIFEST, durably: the commit point), ``abort`` / ``discard`` (delete), and the
read side ``manifest_bytes`` / ``data_readers``; the manager adds ``list_steps``,
``replace_pointer``, ``remove_checkpoint`` and ``reclaim``.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Mapping

__all__ = ["Store", "open_store", "is_url", "normalize_path", "join"]


def is_url(path: Any) -> bool:
    """True when ``path`` names an fsspec URL other than ``file://`` (which is a local path)."""
    if not isinstance(path, str):
        return False
    scheme, sep, _ = path.partition("://")
    return bool(sep) and scheme.lower() not in ("file", "local") and scheme.isidentifier()


def normalize_path(path: str | os.PathLike) -> str:
    """The canonical form of a checkpoint path: an absolute local path (``file://`` stripped),
    or a URL without trailing slashes."""
    path = os.fspath(path)
    if isinstance(path, bytes):
        path = os.fsdecode(path)
    scheme, sep, rest = path.partition("://")
    if sep and scheme.lower() in ("file", "local"):
        return os.path.abspath(rest if rest.startswith("/") else "/" + rest)
    if is_url(path):
        scheme, _, rest = path.partition("://")
        return f"{scheme.lower()}://{rest.strip('/')}"
    return os.path.abspath(path)


def join(base: str, *names: str) -> str:
    """``base/name...`` for a local path or a URL."""
    if is_url(base):
        return "/".join([base.rstrip("/"), *names])
    return os.path.join(base, *names)


def basename(path: str) -> str:
    return path.rstrip("/").rsplit("/", 1)[-1] if is_url(path) else os.path.basename(os.path.normpath(path))


def dirname(path: str) -> str:
    return path.rstrip("/").rsplit("/", 1)[0] if is_url(path) else os.path.dirname(os.path.normpath(path))


class Store:
    """What the commit protocol, loads and the manager need from a back end.

    Save side (the coordinator's phases; every method raises typed DistCkptError subclasses):
      ``prepare(final, save_id, overwrite, needed, rank, lock_path) -> (area, lock)`` (rank 0):
          reclaim dead leftovers of ``final``, take the save's liveness lock, refuse a committed
          ``final`` unless ``overwrite``, create the save area (a str every rank can use).
      ``write_rank(area, rank, pieces, checksum_block) -> (records, size, backend, reason)``:
          one rank's data, durable when it returns.
      ``publish(area, final, manifest, overwrite) -> replaced``: the commit point; afterwards a
          reader of ``final`` finds the new checkpoint, complete. ``replaced`` (or None) is what
          ``discard`` deletes afterwards (an overwritten checkpoint's data).
      ``abort(area, world)``: delete an unpublished save area.
      ``committed_save_id(final) -> str | None``: the save id of the MANIFEST at ``final``.
    Read side: ``is_committed(path)``, ``manifest_bytes(path)``, ``data_readers(path, manifest,
    file_indexes) -> (paths, open_reader, align)`` (what :func:`distckpt.fill.fill` takes).
    Manager: ``list_steps(root)``, ``replace_pointer(path, data)``, ``read_pointer(path)``,
    ``remove_checkpoint(path)``, ``reclaim(parent, name, other_hosts)``.
    """

    kind = "abstract"

    def prepare(self, final: str, save_id: str, overwrite: bool, needed: int, rank: int,
                lock_path: str | None) -> tuple[str, Any]:
        raise NotImplementedError

    def write_rank(self, area: str, rank: int, pieces: list, checksum_block: int) -> tuple:
        raise NotImplementedError

    def publish(self, area: str, final: str, manifest: bytes, overwrite: bool) -> str | None:
        raise NotImplementedError

    def discard(self, replaced: str) -> None:
        raise NotImplementedError

    def abort(self, area: str, world: int) -> None:
        raise NotImplementedError

    def committed_save_id(self, final: str) -> str | None:
        raise NotImplementedError

    def is_committed(self, path: str) -> bool:
        raise NotImplementedError

    def manifest_bytes(self, path: str) -> bytes:
        raise NotImplementedError

    def read_index(self, path: str, header: Any, i: int) -> bytes:
        """The index bytes of data file ``i`` of the checkpoint at ``path`` (format version 3), after
        checking the file's size against ``header``. Raises DataFileMissingError,
        DataFileTruncatedError, CheckpointCorruptError, StorageError."""
        raise NotImplementedError

    def load_manifest(self, path: str) -> Any:
        """The decoded, validated Manifest of the committed checkpoint at ``path``, chunks included
        (read from the data files' indexes for format version 3). Raises what
        :meth:`manifest_bytes`, :meth:`read_index` and :func:`distckpt.manifest.decode` raise."""
        from .. import manifest as mf
        return mf.decode(self.manifest_bytes(path), path=join(path, mf.MANIFEST_NAME),
                         read_index=lambda header, i: self.read_index(path, header, i))

    def data_readers(self, path: str, manifest: Any,
                     file_indexes: list[int]) -> tuple[Mapping[int, str], Callable[[str], Any], int, str]:
        raise NotImplementedError


def open_store(path: str | os.PathLike, storage_options: Mapping[str, Any] | None = None) -> Store:
    """The back end for ``path``: :class:`~distckpt.storage.posix.store.PosixStore` for a local
    path or a ``file://`` URL, :class:`~distckpt.storage.object.store.ObjectStore` for any other
    fsspec URL (``s3://bucket/prefix``). ``storage_options`` go to fsspec unchanged (for s3fs:
    ``key``, ``secret``, ``endpoint_url``, ``client_kwargs``...); with none, s3fs reads the standard
    AWS variables (AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_REGION).

    Raises:
        ConfigError: ``storage_options`` given for a local path, or a URL scheme fsspec does not know.
    """
    path = normalize_path(path)
    if is_url(path):
        from .object.store import ObjectStore
        return ObjectStore.for_url(path, storage_options)
    if storage_options:
        from ..errors import ConfigError
        raise ConfigError(f"storage_options={dict(storage_options)!r} given for the local path {path}",
                          remedy="storage_options apply to fsspec URLs (s3://...); drop them for a local path.")
    from .posix.store import PosixStore
    return PosixStore()
