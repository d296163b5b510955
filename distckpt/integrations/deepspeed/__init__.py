"""DeepSpeed integration. Import it explicitly; the core of distckpt never imports it or deepspeed.

    import distckpt.integrations.deepspeed as dsd
    engine, *_ = deepspeed.initialize(...)
    dsd.install(engine, keep_last=3)        # engine.save_checkpoint / load_checkpoint go through distckpt

:func:`install` lives in :mod:`.engine` (the drop-in checkpoint engine). Submodules import
deepspeed when first used, not when this package is imported.
"""

import importlib as _importlib

_LAZY = {"install": ".engine"}

__all__ = sorted(_LAZY)


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(_importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value
