"""The whole pre-flight: :func:`preflight` runs every check for a save to a path, in a fixed
order, and returns the :class:`~distckpt.checks.report.PreflightReport`."""

from __future__ import annotations

import os
import traceback
from typing import Any, Callable, Mapping

from ..storage import is_url
from . import environment, filesystem, memory, nccl, objectstore
from .report import WARNING, CheckResult, PreflightReport

__all__ = ["preflight"]


def _save_fds(ranks: int, object_store: bool) -> int:
    """The fds one rank's save opens: its own (the writer and its ring, the MANIFEST, directory
    fsyncs, probes, the save lock), distckpt's control group among ``ranks``, and on an object
    store the connections of its parts in flight. A rank opens its own data file only, so the
    world's file count is no part of it."""
    from .._dist import control_group_fds
    from ..storage.posix.guards import SAVE_FDS
    fds = SAVE_FDS + control_group_fds(ranks)
    if object_store:
        from ..errors import ConfigError
        from ..storage.object import settings as objsettings
        try:
            fds += objsettings.settings()["in_flight"] + 2  # + the MANIFEST's and a listing's
        except ConfigError:  # a bad DISTCKPT_OBJECT_* value (the distckpt_config row reports it):
            fds += 4 + 2       # the default parts in flight
    return fds


def preflight(
    path: str | os.PathLike,
    *,
    expected_bytes: int | None = None,
    world_size: int | None = None,
    backend: str | None = None,
    local_world_size: int | None = None,
    shm_bytes_needed: int | None = None,
    keep_last: int | None = None,
    raise_on_error: bool = False,
    env: Mapping[str, str] | None = None,
    fds_needed: int | None = None,
    storage_options: Mapping[str, Any] | None = None,
) -> PreflightReport:
    """Run every pre-flight check for a save to ``path`` and return the report.

    Safe to call before ``init_process_group``; it never writes anything but a removed probe file
    (a removed probe object on an object store). A check that crashes becomes a warning naming it,
    so one broken probe cannot hide the others. The checks, in order: distckpt_config, torchrun_env, socket_ifname,
    nccl_ib_hca, nccl_vars, backend_devices, shm; then for a local path disk, tmpdir,
    deleted_open_files, writable, or for an object-store URL (``s3://bucket/prefix``)
    object_credentials, object_endpoint, object_bucket, object_writable; then fd_limit,
    io_backend (local paths only), memlock and huge_pages.

    Args:
        path: The checkpoint directory (it need not exist yet), or an object-store URL.
        expected_bytes: Bytes the save writes to that file system (sum over ranks on a shared FS).
        world_size: Expected number of ranks (checked against WORLD_SIZE; sizes the inode need).
        backend: The torch.distributed backend ("nccl", "gloo", "cpu:gloo,cuda:nccl").
        local_world_size: Ranks on this node (default LOCAL_WORLD_SIZE); sizes the /dev/shm need.
        shm_bytes_needed: Extra /dev/shm bytes the job needs (DataLoader workers).
        keep_last: Rotation setting; the new checkpoint must fit next to the old ones.
        raise_on_error: Raise the first failing check's typed error instead of returning.
        env: Environment to check instead of os.environ.
        fds_needed: fds one rank's save opens; default: what a save opens itself (9), plus
            distckpt's control group among ``world_size`` ranks (6 + world_size), plus on an object
            store its upload parts in flight (DISTCKPT_OBJECT_PARTS_IN_FLIGHT) and 2.
        storage_options: fsspec options for an object-store URL (``s3://...``), as save() takes;
            without them the standard AWS variables are used.

    Raises:
        DistCkptError: only with ``raise_on_error=True``: the typed error of the first failing
            check (DistributedEnvError, SharedMemoryError, DiskFullError, ...).
    """
    path = os.fspath(path)
    if path.startswith("file://"):
        path = path[len("file://"):]
    env_map = environment.env_of(env)
    rank = environment.rank_of(env_map)
    ranks = world_size or environment.int_or_none(env_map.get("WORLD_SIZE")) or 1
    n_files = ranks + filesystem.FILES_BESIDES_DATA
    object_store = is_url(path)
    fds = fds_needed if fds_needed is not None else _save_fds(ranks, object_store)

    steps: list[tuple[str, Callable[[], CheckResult | list[CheckResult]]]] = [
        ("distckpt_config", lambda: environment.distckpt_config_check(env)),
        ("torchrun_env", lambda: environment.torchrun_env_check(env_map, world_size=world_size,
                                                                local_world_size=local_world_size)),
        ("socket_ifname", lambda: nccl.socket_ifname_check(env_map)),
        ("nccl_ib_hca", lambda: nccl.ib_hca_check(env_map)),
        ("nccl_vars", lambda: nccl.nccl_vars_check(env_map)),
        ("backend_devices", lambda: nccl.backend_devices_check(backend, env_map,
                                                               local_world_size=local_world_size)),
        ("shm", lambda: memory.shm_check(backend=backend, local_world_size=local_world_size,
                                         shm_bytes_needed=shm_bytes_needed, env=env_map)),
    ]
    if object_store:
        steps += [("object_store", lambda: objectstore.object_store_results(path, storage_options, rank))]
    else:
        steps += [
            ("disk", lambda: filesystem.disk_check(path, expected_bytes, keep_last=keep_last,
                                                   n_files=n_files, rank=rank)),
            ("tmpdir", lambda: filesystem.tmpdir_check(path, expected_bytes, env_map)),
            ("deleted_open_files", lambda: filesystem.deleted_open_files_check(path)),
            ("writable", lambda: filesystem.writable_check(path, rank=rank)),
        ]
    steps += [("fd_limit", lambda: filesystem.fd_limit_check(fds, rank=rank))]
    if not object_store:
        steps += [("io_backend", lambda: filesystem.io_backend_check(path))]
    steps += [("memlock", lambda: memory.memlock_check()),
              ("huge_pages", lambda: memory.huge_pages_check(env_map))]
    results: list[CheckResult] = []
    for name, run in steps:
        try:
            result = run()
            results.extend(result if isinstance(result, list) else [result])
        except Exception as exc:  # a broken probe must not hide the other checks
            results.append(CheckResult(name, WARNING, f"check could not run: {type(exc).__name__}: "
                                       f"{exc}", {"traceback": traceback.format_exc()}))
    report = PreflightReport(path, results)
    if raise_on_error:
        report.raise_first()
    return report
