"""DeepSpeed: distckpt as DeepSpeed's checkpoint engine, and reshardable ZeRO checkpoints.

Import explicitly (``from distckpt.integrations import deepspeed as dds``); ``import distckpt``
never imports deepspeed.

    dds.install(engine, keep_last=3)      # one line: engine.save_checkpoint/load_checkpoint go through distckpt
    dds.save(engine, "/ckpt/step_100", client_state={"epoch": 3})   # collective, any ZeRO stage
    out = dds.load(engine, "/ckpt/step_100")                        # at any data-parallel size
    fp32 = dds.consolidated("/ckpt/step_100")     # as zero_to_fp32 gives it (tied names too), one process

:func:`install` (module :mod:`.engine`, which imports deepspeed) is imported on first use.
"""

import importlib as _importlib

from .zero import FORMAT, ZeroLoadResult, consolidated, load, save, state_dict

__all__ = ["install", "save", "load", "state_dict", "consolidated", "ZeroLoadResult", "FORMAT"]


def __getattr__(name: str):
    if name == "install":  # imports deepspeed: only when asked for
        value = _importlib.import_module(".engine", __name__).install
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
