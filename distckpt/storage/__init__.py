"""Storage back ends: the one seam between the commit protocol and where bytes live.

Two back ends implement :class:`Store`:

  * ``posix`` (:class:`distckpt.storage.posix.store.PosixStore`): local file systems. Data files go
    through per-rank O_DIRECT io_uring writers; the commit is made of directory operations (tmp
    dir, fsync, rename; :mod:`distckpt.storage.posix.commit`). ``file://`` URLs map here.
  * ``object`` (:class:`distckpt.storage.object.store.ObjectStore`): fsspec object stores (``s3://``
    through s3fs). Data objects are uploaded under a save-unique prefix, and MANIFEST is written
    last with a conditional create; nothing is ever renamed (docs/FORMAT.md, "Object stores").

:func:`open_store` picks one from a path; :class:`Store` (:mod:`distckpt.storage.base`) is the
interface every caller above storage/ uses, and its docstring states the call order and what every
back end guarantees. The path helpers here (:func:`is_url`, :func:`normalize_path`, :func:`join`,
:func:`basename`, :func:`dirname`) work for local paths and URLs alike.
"""

from __future__ import annotations

import os
from typing import Any, Mapping

from ..errors import ConfigError
from .base import ROOT_LOCK_NAME, Leftover, Ownership, Store

__all__ = ["Store", "Leftover", "Ownership", "ROOT_LOCK_NAME", "open_store", "is_url", "path_text", "normalize_path", "join", "basename",
           "dirname"]


def is_url(path: Any) -> bool:
    """True when ``path`` names an fsspec URL other than ``file://`` (which is a local path)."""
    if not isinstance(path, str):
        return False
    scheme, sep, _ = path.partition("://")
    return bool(sep) and scheme.lower() not in ("file", "local") and scheme.isidentifier()


def path_text(path: str | os.PathLike) -> str:
    """``path`` as a str (``os.fspath``, bytes decoded).

    Raises:
        ConfigError: not a str, bytes or os.PathLike, or it holds a NUL character.
    """
    try:
        path = os.fspath(path)
    except TypeError:
        raise ConfigError(f"checkpoint path {path!r} is a {type(path).__name__}, not a str or os.PathLike",
                          remedy="Pass the checkpoint's path as a str or pathlib.Path.") from None
    if isinstance(path, bytes):
        path = os.fsdecode(path)
    if "\0" in path:
        raise ConfigError(f"checkpoint path {path!r} holds a NUL character, which no file system name can",
                          remedy="Pass the checkpoint's path without NUL characters.")
    return path


def normalize_path(path: str | os.PathLike) -> str:
    """The canonical form of a checkpoint path: an absolute local path (``file://`` stripped),
    or a URL without trailing slashes. Raises ConfigError as :func:`path_text` does."""
    path = path_text(path)
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
    """The last component of a local path or a URL (trailing slashes ignored)."""
    return path.rstrip("/").rsplit("/", 1)[-1] if is_url(path) else os.path.basename(os.path.normpath(path))


def dirname(path: str) -> str:
    """The parent of a local path or a URL (trailing slashes ignored)."""
    return path.rstrip("/").rsplit("/", 1)[0] if is_url(path) else os.path.dirname(os.path.normpath(path))


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
