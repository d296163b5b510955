"""Python pickles of plain data and tensors, decoded without running code from them.

Some state that trainers hand to a checkpoint is already a pickle: torchtitan's dataloader stores
``pickle.dumps`` of its StatefulDataLoader state as bytes, and unpickles them in its own
``load_state_dict``. A checkpoint is data, so before such bytes reach an unpickler that can run
code, :func:`check` decodes them with one that can only build what a pickle of plain data needs:
dicts, lists, tuples, sets, numbers, strings, bytes, ``OrderedDict`` and CPU tensors (a tensor's
storage through ``torch.load(weights_only=True)``, torch's restricted unpickler, where a plain
pickle would call ``torch.load(weights_only=False)``). Any other global it names is refused.

``torch.load(weights_only=True)`` cannot be used on the bytes themselves: it reads torch.save
archives and pickle protocol 2 only, and ``pickle.dumps`` writes protocol 5.
"""

from __future__ import annotations

import codecs
import collections
import io
import pickle
from typing import Any

__all__ = ["check", "loads"]


def _storage_from_bytes(data: bytes) -> Any:
    import torch
    try:
        return torch.load(io.BytesIO(data), weights_only=True)
    except pickle.UnpicklingError as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise pickle.UnpicklingError(f"global refused inside a tensor's storage ({first[:200]}) is not plain "
                                     f"data") from None


def _allowed() -> dict[tuple[str, str], Any]:
    import torch
    allowed: dict[tuple[str, str], Any] = {
        ("collections", "OrderedDict"): collections.OrderedDict,
        ("_codecs", "encode"): codecs.encode,       # bytes, as protocols 0-2 pickle them
        ("torch._utils", "_rebuild_tensor_v2"): torch._utils._rebuild_tensor_v2,
        ("torch.storage", "_load_from_bytes"): _storage_from_bytes,
    }
    for module in ("builtins", "__builtin__"):      # (protocols 0-2 name the Python 2 module)
        allowed.update({(module, "set"): set, (module, "frozenset"): frozenset, (module, "complex"): complex})
    return allowed


class _Unpickler(pickle.Unpickler):
    def __init__(self, data: bytes) -> None:
        super().__init__(io.BytesIO(data))
        self._globals = _allowed()

    def find_class(self, module: str, name: str) -> Any:
        # Every callable a pickle can invoke comes through here (GLOBAL, STACK_GLOBAL, and the
        # extension registry's codes); nothing else on the stack is callable.
        try:
            return self._globals[(module, name)]
        except KeyError:
            raise pickle.UnpicklingError(f"global {module}.{name} is not plain data") from None


def loads(data: bytes) -> Any:
    """The object pickled in ``data``, built only from plain data and tensors.

    Raises:
        pickle.UnpicklingError: ``data`` names any other global (the one named in the message).
        Exception: what decoding malformed bytes raises (``pickle.UnpicklingError``, ``EOFError``,
            ``ValueError``...): not a pickle.
    """
    return _Unpickler(bytes(data)).load()


def check(data: bytes, *, key: str, path: str | None) -> None:
    """Decode ``data`` as :func:`loads` does, for a caller about to hand it to an unrestricted
    unpickler.

    Raises:
        PickleNotAllowedError: it names a global that is not plain data (``keys``: ``[key]``).
        CheckpointCorruptError: it is not a pickle.
    """
    from .errors import CheckpointCorruptError, PickleNotAllowedError
    try:
        loads(data)
    except pickle.UnpicklingError as exc:
        if "is not plain data" in str(exc):
            raise PickleNotAllowedError(
                f"{key!r} is a pickle that names {str(exc).removeprefix('global ')}: unpickling it could run code "
                f"from the checkpoint", path=path, keys=[key],
                remedy="Load it only if you trust the checkpoint (allow_pickle=True where the loader offers "
                       "it); otherwise leave this state out of the load.") from None
        raise CheckpointCorruptError(f"{key!r} is not a readable pickle: {exc}", path=path, key=key) from None
    except Exception as exc:  # noqa: BLE001 - whatever malformed bytes make the decoder raise
        raise CheckpointCorruptError(f"{key!r} is not a readable pickle: {type(exc).__name__}: {exc}",
                                     path=path, key=key) from None
