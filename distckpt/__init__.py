"""distckpt: distributed sharded checkpoints for PyTorch.

Every rank writes its own data file in parallel through an O_DIRECT io_uring writer; rank 0
commits an atomic msgpack MANIFEST once every rank has reported success; a restore reads only the
byte ranges each rank needs, onto any world size or sharding. Failures are typed (distckpt.errors).

    import distckpt
    distckpt.save(state_dict, "/ckpt/step_100")            # collective under torchrun
    h = distckpt.async_save(state_dict, "/ckpt/step_200")  # returns once staged; h.result()
    distckpt.load(state_dict, "/ckpt/step_100")            # fills tensors in place, reshards
    full = distckpt.read("/ckpt/step_100")                 # one process, full tensors
    mgr = distckpt.CheckpointManager("/ckpt", keep_last=3) # numbered steps + rotation

Every path may also be an fsspec URL (``s3://bucket/run7/step_100``, with ``storage_options=`` or
the AWS_* variables): data objects are uploaded in parallel and MANIFEST is written last with a
conditional create (docs/FORMAT.md, "Object stores").
"""

__version__ = "0.1.0"

import importlib as _importlib

from .errors import DistCkptError  # noqa: E402  (torch-free)
from .checks import preflight  # noqa: E402  (torch-free)

# The names below pull in torch. They are imported on first use (PEP 562), so that the command
# line's --help and --version, and `import distckpt.errors` in a monitoring script, do not pay
# for importing torch. `from distckpt import save` works as before.
_LAZY = {
    "save": ".save_sync", "SaveResult": ".commit",
    "load": ".restore", "read": ".restore", "read_manifest": ".restore", "LoadResult": ".restore",
    "CheckpointManager": ".manager",
    "async_save": ".save_async", "AsyncSaveHandle": ".save_async",
    "release_staging_memory": ".staging.pool",
    # staging.pool's, reached through save_async: a job that reserves staging memory ahead also
    # loads the save path's modules then, not on its first async_save's blocked time.
    "reserve_staging_memory": ".save_async",
}


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'distckpt' has no attribute {name!r}")
    value = getattr(_importlib.import_module(module, __name__), name)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))




__all__ = [
    "save",
    "async_save",
    "AsyncSaveHandle",
    "load",
    "read",
    "read_manifest",
    "CheckpointManager",
    "release_staging_memory",
    "reserve_staging_memory",
    "SaveResult",
    "LoadResult",
    "DistCkptError",
    "preflight",
    "__version__",
]
