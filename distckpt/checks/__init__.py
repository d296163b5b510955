"""Pre-flight checks: find a broken environment before a save writes its first byte.

Every check is a small function that returns a :class:`CheckResult` and can run on its own, before
``torch.distributed.init_process_group`` (none of them needs a process group, and the ones that look
at ``torch`` import it lazily). :func:`preflight` runs them all and returns a
:class:`PreflightReport`; ``raise_on_error=True`` raises the typed error of the first failing check.
From the shell: ``distckpt preflight PATH`` or ``python -m distckpt.checks PATH``.

The checks, in the order :func:`preflight` runs them, and the module of each:

=====================  ==========================================================================
distckpt_config        every DISTCKPT_* value parses (object-store knobs too, from this process's
(environment)          environment); an unknown DISTCKPT_* name is a typo (warning). -> ConfigError
torchrun_env           RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT:
(environment)          all present when any is, integers, in range, MASTER_ADDR resolvable.
                       -> DistributedEnvError(variable=...)
socket_ifname (nccl)   NCCL_SOCKET_IFNAME (``^`` exclude, ``=`` exact, else prefix) and
                       GLOO_SOCKET_IFNAME (exact names) match interfaces that exist.
nccl_ib_hca (nccl)     NCCL_IB_HCA names InfiniBand devices (and ports) that exist.
nccl_vars (nccl)       Boolean NCCL variables hold 0/1, integer ones integers; unknown NCCL_*
                       names are flagged with the closest known name (warning).
backend_devices        backend "nccl" needs CUDA, and no more local ranks than visible GPUs.
(nccl)
shm (memory)           /dev/shm holds NCCL's shared-memory transport buffers plus
                       ``shm_bytes_needed``. -> SharedMemoryError
disk (filesystem)      free bytes and inodes on the checkpoint file system vs ``expected_bytes``
                       (old checkpoints still exist while the new one is written). -> DiskFullError
tmpdir (filesystem)    the same for TMPDIR (warning only).
deleted_open_files     space held on that file system by deleted-but-open files (warning).
(filesystem)
writable (filesystem)  a probe file can be created, written, fsynced and removed.
                       -> StoragePermissionError / DiskFullError (via errors.from_os_error)
fd_limit (filesystem)  RLIMIT_NOFILE leaves room for the fds a save opens. -> TooManyOpenFilesError
io_backend             which POSIX I/O backend (io_uring / O_DIRECT / buffered) will run and why.
(filesystem)           -> IOBackendUnavailableError
memlock (memory)       RLIMIT_MEMLOCK when pinned memory will be used (warning).
=====================  ==========================================================================

For an object-store URL (``s3://bucket/prefix``) the file-system checks (disk, tmpdir,
deleted_open_files, writable, io_backend) are replaced by those of
:mod:`distckpt.storage.object.check` (reported by :mod:`.objectstore`): object_credentials
(credentials resolve), object_endpoint (the endpoint answers), object_bucket (the bucket exists and
may be listed) and object_writable (a probe object is created and deleted; whether the server
honours conditional creates is reported).

A save does not run this package: each store runs its own cheap guards before it writes (the POSIX
ones are :mod:`distckpt.storage.posix.guards`: space, pseudo file systems, the fd limit; the object
store's are its pre-flight in PREPARE), and the checks here report the same numbers.

Invariants: a check never raises (an unexpected exception inside a check becomes a warning that
names it, so one broken probe cannot hide the others); a check never leaves a file or an fd behind;
nothing here blocks for long (name resolution is bounded by a timeout).
"""

from .report import CheckResult, PreflightReport
from .run import preflight

__all__ = ["preflight", "PreflightReport", "CheckResult"]
