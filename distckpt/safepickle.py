"""Python pickles of plain data and tensors, decoded without running code from them.

Some state that trainers hand to a checkpoint is already a pickle: torchtitan's dataloader stores
``pickle.dumps`` of its StatefulDataLoader state as bytes, and unpickles them in its own
``load_state_dict``. A checkpoint is data, so before such bytes reach an unpickler that can run
code, :func:`check` decodes them with one that can only build what a pickle of plain data needs:
dicts, lists, tuples, sets, numbers, strings, bytes, the ``collections`` containers (OrderedDict,
Counter, deque, defaultdict of a builtin type), ``datetime`` values, numpy scalars and arrays
(a RandomState's state), torch sizes, dtypes, tensors and Parameters (a tensor's storage
through ``torch.load(weights_only=True)``, torch's restricted unpickler, where a plain pickle
would call ``torch.load(weights_only=False)``). Each of these only builds a value. Any other
global it names is refused.

``torch.load(weights_only=True)`` cannot be used on the bytes themselves: it reads torch.save
archives and pickle protocol 2 only, and ``pickle.dumps`` writes protocol 5.
"""

from __future__ import annotations

import _compat_pickle
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
        raise _Refused(f"a global inside a tensor's storage ({first[:200]})") from None


def _allowed() -> dict[tuple[str, str], Any]:
    import datetime

    import torch
    allowed: dict[tuple[str, str], Any] = {
        ("_codecs", "encode"): codecs.encode,       # bytes, as protocols 0-2 pickle them
        ("torch._utils", "_rebuild_tensor_v2"): torch._utils._rebuild_tensor_v2,
        ("torch._utils", "_rebuild_parameter"): torch._utils._rebuild_parameter,
        ("torch.storage", "_load_from_bytes"): _storage_from_bytes,
        ("torch", "Size"): torch.Size,
    }
    allowed.update({("torch", name): value for name in dir(torch) if isinstance(value := getattr(torch, name, None),
                                                                                torch.dtype)})
    allowed.update({("collections", c.__name__): c for c in (collections.OrderedDict, collections.Counter,
                                                               collections.deque, collections.defaultdict)})
    allowed.update({("datetime", c.__name__): c for c in (datetime.datetime, datetime.date, datetime.time,
                                                            datetime.timedelta, datetime.timezone)})
    builtin = (set, frozenset, complex, bytearray, bytes, int, float, bool, str, list, dict, tuple, slice, range)
    allowed.update({("builtins", c.__name__): c for c in builtin})
    try:
        import numpy
        try:
            from numpy._core import multiarray, numeric       # numpy 2
        except ImportError:                                    # numpy 1
            from numpy.core import multiarray, numeric
        for package in ("numpy.core", "numpy._core"):
            allowed[(f"{package}.multiarray", "_reconstruct")] = multiarray._reconstruct
            allowed[(f"{package}.multiarray", "scalar")] = multiarray.scalar
            allowed[(f"{package}.numeric", "_frombuffer")] = numeric._frombuffer  # (protocol 5 arrays)
        allowed[("numpy", "ndarray")] = numpy.ndarray
        allowed[("numpy", "dtype")] = numpy.dtype
        for name in dir(getattr(numpy, "dtypes", None)):  # numpy 2 pickles a dtype by its class
            if name.endswith("DType"):
                allowed[("numpy.dtypes", name)] = getattr(numpy.dtypes, name)
    except ImportError:
        pass
    return allowed


class _Refused(pickle.UnpicklingError):
    """A global this unpickler does not build: ``args[0]`` is its name."""


class _Unpickler(pickle.Unpickler):
    def __init__(self, data: bytes) -> None:
        super().__init__(io.BytesIO(data))
        self._globals = _allowed()

    def find_class(self, module: str, name: str) -> Any:
        # Every callable a pickle can invoke comes through here (GLOBAL, STACK_GLOBAL, and the
        # extension registry's codes); nothing else on the stack is callable.
        # Protocols 0-2 write Python 2's names (__builtin__.long, xrange...): mapped as pickle's
        # own find_class maps them (no Python 3 module has those names).
        if (module, name) in _compat_pickle.NAME_MAPPING:
            module, name = _compat_pickle.NAME_MAPPING[(module, name)]
        elif module in _compat_pickle.IMPORT_MAPPING:
            module = _compat_pickle.IMPORT_MAPPING[module]
        try:
            return self._globals[(module, name)]
        except KeyError:
            raise _Refused(f"{module}.{name}") from None


def loads(data: bytes) -> Any:
    """The object pickled in ``data``, built only from plain data and tensors.

    Raises:
        pickle.UnpicklingError: ``data`` names any other global (``args[0]`` names it).
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
    except _Refused as exc:
        raise PickleNotAllowedError(
                f"{key!r} is a pickle that names {exc.args[0]}, which is not plain data: unpickling it could run "
                f"code from the checkpoint", path=path, keys=[key],
                remedy="Load it only if you trust the checkpoint (allow_pickle=True where the loader offers "
                       "it); otherwise leave this state out of the load.") from None
    except Exception as exc:  # noqa: BLE001 - whatever malformed bytes make the decoder raise
        raise CheckpointCorruptError(f"{key!r} is not a readable pickle: {type(exc).__name__}: {exc}",
                                     path=path, key=key) from None
