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
"""

__version__ = "0.1.0"

from .errors import DistCkptError  # noqa: E402
from .manager import CheckpointManager  # noqa: E402
from .restore import LoadResult, load, read, read_manifest  # noqa: E402
from .save import SaveResult, save  # noqa: E402
from .async_save import AsyncSaveHandle, async_save, release_staging_memory  # noqa: E402
from .preflight import preflight  # noqa: E402  (binds the function over the submodule's name)


__all__ = [
    "save",
    "async_save",
    "AsyncSaveHandle",
    "load",
    "read",
    "read_manifest",
    "CheckpointManager",
    "release_staging_memory",
    "SaveResult",
    "LoadResult",
    "DistCkptError",
    "preflight",
    "__version__",
]
