"""Python's cyclic garbage collector paused for the length of a save or a load."""

from __future__ import annotations

import contextlib
import gc
from typing import Iterator

__all__ = ["gc_paused"]


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Keep Python's cyclic GC from running inside the block; its earlier state is restored on
    every exit. Planning a state dict of thousands of tensors allocates tens of thousands of small
    objects, which triggers full collections over the whole process heap (0.15-0.2 s each,
    measured, with torch loaded); nothing in a save or load creates reference cycles, so reference
    counting frees everything anyway. Raises nothing of its own."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
