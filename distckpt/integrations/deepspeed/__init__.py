"""DeepSpeed: reshardable ZeRO checkpoints (and the drop-in checkpoint engine).

Import explicitly (``from distckpt.integrations import deepspeed as dds``); ``import distckpt``
never imports deepspeed.

    dds.save(engine, "/ckpt/step_100", client_state={"epoch": 3})   # collective, any ZeRO stage
    out = dds.load(engine, "/ckpt/step_100")                        # at any data-parallel size
    fp32 = distckpt.read("/ckpt/step_100", keys=["model"])["model"]  # consolidated, one process
"""

from .zero import FORMAT, ZeroLoadResult, load, save, state_dict

__all__ = ["save", "load", "state_dict", "ZeroLoadResult", "FORMAT"]
