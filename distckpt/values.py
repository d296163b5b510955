"""Non-tensor values <-> typed plain data stored in the MANIFEST, without pickle.

A state dict's non-tensor leaves (step counters, hyper-parameters, RNG seeds, dataloader
positions, optimizer ``param_groups``) are stored inline in the manifest as msgpack. Plain scalars
keep the format-1 object kinds (``int``, ``float``, ``bool``, ``str``, ``bytes``, ``none``); any
other value that distckpt can rebuild exactly is stored as kind ``value``: a *value node*, plain
msgpack data in which every container is a map with a type tag ``"t"``:

    {"t": "list" | "tuple" | "set" | "frozenset", "v": [node, ...]}
    {"t": "dict", "k": [[node, node], ...]}                   keys are nodes too (int, str, tuple...)
    {"t": "int", "v": "<decimal>"}                            an int outside 64 bits
    {"t": "size", "v": [int, ...]}                            torch.Size
    {"t": "dtype", "v": "bfloat16"}                           torch.dtype (name without "torch.")
    {"t": "device", "v": "cuda:0"}                            torch.device
    {"t": "namedtuple", "c": "mod:Qual", "f": [name, ...], "v": [node, ...]}
    {"t": "enum", "c": "mod:Qual", "v": "MEMBER_NAME"}
    {"t": "dataclass", "c": "mod:Qual", "f": [[name, node], ...]}
    {"t": "numpy", "d": "<f4", "s": [int, ...] | None, "v": bytes}   numpy scalar (s None) or array

Scalars (None, bool, 64-bit int, float, str, bytes) are themselves. Set elements are written in
the order of their encoded bytes, so equal sets encode to equal bytes on every rank (Python's
string hashing differs per process); other containers keep their order.

Invariants:
  * Encoding never pickles; a value this module cannot rebuild exactly raises
    :class:`UnsupportedValueError` naming its fqn and type (unless the caller allows pickle).
  * Decoding never runs code from the checkpoint: classes named by ``"c"`` are looked up in the
    modules this process has already imported (nothing is imported) and used only if they really
    are a namedtuple / Enum / dataclass type; instances
    are rebuilt without calling the class's ``__init__``/``__new__`` (``tuple.__new__``,
    ``Enum[name]``, ``object.__new__`` + field assignment). numpy dtypes are numeric only.
  * :func:`check_node` validates a node's shape without importing torch, numpy or any class, so
    :mod:`distckpt.manifest` can reject damaged nodes on decode.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import inspect
import math
import pickle
import re
import sys
from typing import Any

import msgpack

from .errors import DistCkptError, ManifestCorruptError, UnsupportedValueError

__all__ = ["SCALAR_KINDS", "VALUE_KIND", "encode_value", "decode_value", "check_node", "holds_tensor",
           "value_digest", "describe"]

_I64_MIN, _I64_END, _U64 = -(1 << 63), 1 << 63, 1 << 64
_DECIMAL = re.compile(r"-?(0|[1-9][0-9]*)\Z")
#: Object kinds of format 1: the scalar itself is the stored value.
SCALAR_KINDS = ("none", "bool", "int", "float", "str", "bytes")
#: The object kind of a value node (format 2).
VALUE_KIND = "value"
#: Node tags and the keys each node has.
NODE_KEYS = {
    "list": {"t", "v"}, "tuple": {"t", "v"}, "set": {"t", "v"}, "frozenset": {"t", "v"},
    "dict": {"t", "k"}, "int": {"t", "v"}, "size": {"t", "v"}, "dtype": {"t", "v"}, "device": {"t", "v"},
    "namedtuple": {"t", "c", "f", "v"}, "enum": {"t", "c", "v"}, "dataclass": {"t", "c", "f"},
    "numpy": {"t", "d", "s", "v"},
}
#: The deepest nesting of a value node, and of the MANIFEST's tree (manifest.MAX_DEPTH).
MAX_DEPTH = 100


class _NeedsPickle(Exception):
    """Raised inside :func:`_node` for a value no node can describe (message: where and what)."""


def _qualname(cls: type) -> str:
    return f"{cls.__module__}:{cls.__qualname__}"


def _is_namedtuple(value: Any) -> bool:
    return isinstance(value, tuple) and isinstance(getattr(type(value), "_fields", None), tuple)


def holds_tensor(value: Any, _depth: int = 0) -> bool:
    """True when a list/tuple/set/dict ``value`` holds a torch.Tensor or a Stateful at any depth
    (such containers stay containers in the state dict tree; the others are one value)."""
    import torch
    if isinstance(value, torch.Tensor) or _is_stateful(value):
        return True
    if _depth > MAX_DEPTH:
        return False
    if isinstance(value, dict):
        return any(holds_tensor(v, _depth + 1) for v in value.values())
    if isinstance(value, (list, tuple, set, frozenset)):
        return any(holds_tensor(v, _depth + 1) for v in value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return any(holds_tensor(getattr(value, f.name, None), _depth + 1) for f in dataclasses.fields(value))
    return False


def _is_stateful(value: Any) -> bool:
    # torch.distributed.checkpoint.stateful.Stateful is a runtime-checkable Protocol with exactly
    # these two methods; duck-typed so this module needs no torch.distributed.
    import torch
    return (not isinstance(value, (torch.Tensor, dict, type))
            and callable(getattr(value, "state_dict", None)) and callable(getattr(value, "load_state_dict", None)))


def _node(value: Any, where: str, depth: int) -> Any:
    if depth > MAX_DEPTH:
        raise _NeedsPickle(f"{where}: nested deeper than {MAX_DEPTH} levels")
    t = type(value)
    if value is None or t in (bool, float, bytes):
        return value
    if t is str:
        try:
            if not value.isascii():
                value.encode("utf-8")  # what msgpack stores; it failed later, naming no key
        except UnicodeEncodeError as exc:
            raise _NeedsPickle(f"{where}: a str holding a character UTF-8 cannot encode "
                               f"({value[max(0, exc.start - 20):exc.end + 20]!r}: a lone surrogate, such as a file "
                               f"name decoded with surrogateescape); store it as bytes (os.fsencode)") from None
        return value
    if t is int:
        if _I64_MIN <= value < _U64:
            return value
        try:
            return {"t": "int", "v": str(value)}
        except ValueError:  # more digits than sys.get_int_max_str_digits() converts (4300 by default)
            raise _NeedsPickle(f"{where}: an int of {value.bit_length()} bits has more decimal digits than this "
                               f"interpreter converts (sys.get_int_max_str_digits() = "
                               f"{sys.get_int_max_str_digits()}), which a load could not read back") from None
    import torch
    if t is torch.Size:
        return {"t": "size", "v": [int(x) for x in value]}
    if t is torch.dtype:
        return {"t": "dtype", "v": str(value).removeprefix("torch.")}
    if t is torch.device:
        return {"t": "device", "v": str(value)}
    if isinstance(value, enum.Enum):
        if not isinstance(value.name, str) or t._member_map_.get(value.name) is not value:
            # A Flag's combination (Perm.R | Perm.W, named 'R|W') or unnamed value (Perm(0)) is no
            # member Enum[name] returns: a load could not rebuild it without calling the class.
            raise _NeedsPickle(f"{where}: {value!r} is not a named member of {t.__name__} (a combination or "
                               f"unnamed value of a Flag): store its int value ({t.__name__}(v) rebuilds it)")
        return {"t": "enum", "c": _qualname(t), "v": value.name}
    if t in (list, tuple):
        return {"t": t.__name__, "v": [_node(v, f"{where}[{i}]", depth + 1) for i, v in enumerate(value)]}
    if _is_namedtuple(value):
        return {"t": "namedtuple", "c": _qualname(t), "f": list(t._fields),
                "v": [_node(v, f"{where}.{f}", depth + 1) for f, v in zip(t._fields, value)]}
    if t in (set, frozenset):
        items = [_node(v, f"{where}{{}}", depth + 1) for v in value]
        items.sort(key=lambda n: msgpack.packb(n, use_bin_type=True))
        return {"t": t.__name__, "v": items}
    if t is dict:
        return {"t": "dict", "k": [[_node(k, f"{where} key", depth + 1), _node(v, f"{where}[{k!r}]", depth + 1)]
                                   for k, v in value.items()]}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = {f.name for f in dataclasses.fields(value)}
        # A functools.cached_property keeps its value in __dict__ too: a cache, rebuilt on first use.
        extra = sorted(k for k in getattr(value, "__dict__", {}) if k not in fields
                       and not isinstance(inspect.getattr_static(t, k, None), functools.cached_property))
        if extra:
            # A load rebuilds the instance from its fields without __init__/__post_init__: an
            # attribute that is no field (set in __post_init__ or later) would be gone, silently.
            raise _NeedsPickle(f"{where}: {t.__name__} instance has attributes that are not fields {extra}: a load "
                               f"rebuilds it from its fields only; declare them as fields "
                               f"(dataclasses.field(init=False)) to save them")
        return {"t": "dataclass", "c": _qualname(t),
                "f": [[f.name, _node(getattr(value, f.name), f"{where}.{f.name}", depth + 1)]
                      for f in dataclasses.fields(value)]}
    if t.__module__ == "numpy":
        import numpy as np
        if isinstance(value, (np.generic, np.ndarray)) and value.dtype.kind in "biufc":
            arr = np.asarray(value)
            le = arr.dtype.newbyteorder("<") if arr.dtype.byteorder not in "|" else arr.dtype
            return {"t": "numpy", "d": le.str, "s": None if isinstance(value, np.generic) else list(arr.shape),
                    "v": np.ascontiguousarray(arr, dtype=le).tobytes()}
    raise _NeedsPickle(f"{where} is a {t.__module__}.{t.__qualname__}")


def encode_value(fqn: str, value: Any, *, allow_pickle: bool) -> tuple[str, Any]:
    """(kind, stored value) for the non-tensor leaf ``value`` at ``fqn``.

    Raises:
        UnsupportedValueError: ``value`` (or something inside it, named in the message) can only be
            stored as a pickle and ``allow_pickle`` is False.
    """
    if value is None:
        return "none", None
    t = type(value)
    if t is bool:
        return "bool", value
    if t is int and _I64_MIN <= value < _U64:
        return "int", value
    if t in (float, bytes) or (t is str and value.isascii()):
        return t.__name__, value
    try:
        node = _node(value, fqn, 0)
        return (t.__name__, value) if t is str else (VALUE_KIND, node)
    except _NeedsPickle as exc:
        if not allow_pickle:
            raise UnsupportedValueError(
                f"state dict value at {fqn!r} cannot be stored without pickle: {exc}", key=fqn,
                remedy="Store it as a tensor or as plain values (int/float/bool/str/bytes/None, list/tuple/"
                       "dict/set, torch.dtype/device/Size, Enum, dataclass, namedtuple, numpy), give it "
                       "state_dict()/load_state_dict(), or pass allow_pickle=True.") from None
    return "pickle", pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)


def value_digest(kind: str, stored: Any) -> bytes:
    """Canonical bytes of an encoded value: equal values encode equal bytes on every rank."""
    return msgpack.packb([kind, stored], use_bin_type=True)


def _resolve(name: str, want: str, fqn: str, path: Any) -> type:
    """The class ``module:qualname`` from a module this process has already imported; refused
    unless it is a ``want`` type.

    Nothing is imported, and no attribute hook runs (``inspect.getattr_static``: no module
    ``__getattr__``, no descriptor): the name comes from the checkpoint, and importing a module it
    names runs that module's code (one shipped beside the checkpoint is importable when Python
    was started from its directory), which loading must never do. A process that loads a value
    of its own classes has imported them already."""
    module, _, qual = name.partition(":")
    obj: Any = sys.modules.get(module) if module and qual else None
    err = None if obj is not None else (
        f"module {module!r} is not imported in this process (distckpt imports nothing a checkpoint names)")
    for part in qual.split(".") if obj is not None else ():
        try:
            obj = inspect.getattr_static(obj, part)
        except AttributeError:
            obj, err = None, f"{module} has no attribute {qual!r}"
            break
    ok = isinstance(obj, type) and {
        "namedtuple": lambda c: issubclass(c, tuple) and isinstance(getattr(c, "_fields", None), tuple),
        "enum": lambda c: issubclass(c, enum.Enum),
        "dataclass": lambda c: dataclasses.is_dataclass(c),
    }[want](obj)
    if not ok:
        found = err or f"it is {obj!r}, not a {want} class"
        article = "an" if want == "enum" else "a"
        raise UnsupportedValueError(
            f"value at {fqn!r} was saved as {article} {want} of class {name}, which cannot be rebuilt here: {found}",
            key=fqn, path=path,
            remedy=f"Import {module} (with the same class) in this process before the load (on the command "
                   f"line: distckpt convert --import {module}), or read the value as plain data with "
                   f"distckpt.read_manifest(path).")
    return obj


def decode_value(kind: str, stored: Any, *, fqn: str = "", path: Any = None) -> Any:
    """The Python value of a (kind, stored) object entry, for every kind but ``pickle``.

    Raises:
        UnsupportedValueError: a namedtuple / Enum / dataclass class that is not imported here or is
            not of that sort, an Enum member or dataclass field it lacks.
    """
    if kind != VALUE_KIND:
        return stored
    return _value(stored, fqn, path)


def _value(node: Any, fqn: str, path: Any) -> Any:
    if not isinstance(node, dict):
        return node
    try:
        return _build(node, fqn, path)
    except DistCkptError:
        raise   # a typed error of its own (a class not imported here, a node within)
    except (TypeError, ValueError, RuntimeError, OverflowError) as exc:
        # A node that check_node's structural rules let through but no saver writes (a set of
        # lists, a device string torch cannot parse, numpy bytes that are not its shape): the
        # MANIFEST passed its checksum, so it was written so, not damaged in transit.
        raise ManifestCorruptError(f"value at {fqn!r}: a {node.get('t')!r} value node that no save writes: "
                                   f"{type(exc).__name__}: {exc}", key=fqn, path=path) from None


def _build(node: dict, fqn: str, path: Any) -> Any:
    t = node["t"]
    if t in ("list", "tuple", "set", "frozenset"):
        items = [_value(v, fqn, path) for v in node["v"]]
        out = {"list": list, "tuple": tuple, "set": set, "frozenset": frozenset}[t](items)
        if len(out) != len(items):
            raise ValueError(f"the {t} holds equal elements twice")
        return out
    if t == "dict":
        out = {_value(k, fqn, path): _value(v, fqn, path) for k, v in node["k"]}
        if len(out) != len(node["k"]):
            raise ValueError("the dict holds a key twice")
        return out
    if t == "int":
        return int(node["v"])
    import torch
    if t == "size":
        return torch.Size(node["v"])
    if t == "dtype":
        from .tensorbytes import dtype_from_name
        return dtype_from_name(node["v"], path=path)
    if t == "device":
        return _device(node["v"], fqn, path)
    if t == "namedtuple":
        cls = _resolve(node["c"], "namedtuple", fqn, path)
        if list(cls._fields) != list(node["f"]):
            raise UnsupportedValueError(
                f"value at {fqn!r}: namedtuple {node['c']} now has fields {list(cls._fields)}, the checkpoint "
                f"has {node['f']}", key=fqn, path=path,
                remedy="Load with the class definition the checkpoint was saved with.")
        return tuple.__new__(cls, [_value(v, fqn, path) for v in node["v"]])
    if t == "enum":
        cls = _resolve(node["c"], "enum", fqn, path)
        try:
            return cls[node["v"]]
        except KeyError:
            raise UnsupportedValueError(f"value at {fqn!r}: enum {node['c']} has no member {node['v']!r}",
                                        key=fqn, path=path) from None
    if t == "dataclass":
        cls = _resolve(node["c"], "dataclass", fqn, path)
        names = {f.name for f in dataclasses.fields(cls)}
        saved = [name for name, _ in node["f"]]
        if set(saved) != names:
            raise UnsupportedValueError(
                f"value at {fqn!r}: dataclass {node['c']} has fields {sorted(names)}, the checkpoint has "
                f"{sorted(saved)}", key=fqn, path=path,
                remedy="Load with the class definition the checkpoint was saved with.")
        obj = object.__new__(cls)
        for name, v in node["f"]:
            object.__setattr__(obj, name, _value(v, fqn, path))  # works for frozen dataclasses too
        return obj
    if t == "numpy":
        import numpy as np
        dt = np.dtype(node["d"])
        if dt.kind not in "biufc":
            raise UnsupportedValueError(f"value at {fqn!r}: numpy dtype {node['d']!r} is not numeric",
                                        key=fqn, path=path)
        if dt.byteorder == ">":
            raise ValueError(f"numpy dtype {node['d']!r} is big-endian; values are stored little-endian")
        count = 1 if node["s"] is None else math.prod(node["s"])
        if len(node["v"]) != count * dt.itemsize:
            raise ValueError(f"{len(node['v'])} bytes for {count} element(s) of {dt.itemsize} byte(s)")
        arr = np.frombuffer(node["v"], dtype=dt)
        if node["s"] is None:
            return arr[0]
        return arr.reshape(node["s"]).copy()
    raise UnsupportedValueError(f"value at {fqn!r}: unknown value node {t!r}", key=fqn, path=path)


_DEVICE_TEXT = re.compile(r"[a-z_][a-z0-9_]*(:(0|[1-9][0-9]*))?")


def _device(text: Any, fqn: str, path: Any) -> Any:
    """``torch.device(text)``. Text of the shape ``str(torch.device)`` writes whose type torch does
    not know here is a backend this process lacks (a PrivateUse1 backend such as ``npu`` exists
    only once its package renamed it): UnsupportedValueError with that remedy, not "damaged". Text
    of any other shape no save writes (ValueError, which :func:`_value` reports as corrupt)."""
    import torch

    if not isinstance(text, str) or not _DEVICE_TEXT.fullmatch(text):
        raise ValueError(f"{text!r} is not a device string")
    try:
        return torch.device(text)
    except RuntimeError as exc:
        raise UnsupportedValueError(
            f"value at {fqn!r} holds torch.device({text!r}), whose device type this process does not know: {exc}",
            key=fqn, path=path,
            remedy="Import the package of that backend first (a PrivateUse1 backend such as 'npu' is named by "
                   "its package, e.g. torch_npu), or read the value as plain data with "
                   "distckpt.read_manifest(path).") from None


def describe(node: Any, limit: int = 200) -> str:
    """Python-like text of a value node for display (``distckpt inspect``), without importing any
    class or module it names: ``(0.9, 0.95)``, ``Pair(lo=1, hi=2)``, ``torch.bfloat16``."""
    def text(n: Any, depth: int) -> str:
        if not isinstance(n, dict) or depth > 20:
            return repr(n) if not isinstance(n, dict) else "..."
        t = n["t"]
        if t in ("list", "tuple", "set", "frozenset"):
            parts = [text(v, depth + 1) for v in n["v"]]
            if t == "list":
                return "[" + ", ".join(parts) + "]"
            if t == "tuple":
                return "(" + ", ".join(parts) + ("," if len(parts) == 1 else "") + ")"
            if not parts:
                return f"{t}()"
            return "{" + ", ".join(parts) + "}" if t == "set" else "frozenset({" + ", ".join(parts) + "})"
        if t == "dict":
            return "{" + ", ".join(f"{text(k, depth + 1)}: {text(v, depth + 1)}" for k, v in n["k"]) + "}"
        if t == "int":
            return n["v"]
        if t == "size":
            return f"torch.Size({n['v']})"
        if t == "dtype":
            return f"torch.{n['v']}"
        if t == "device":
            return f"device({n['v']!r})"
        name = str(n.get("c", "")).rpartition(":")[2]
        if t == "namedtuple":
            return f"{name}(" + ", ".join(f"{f}={text(v, depth + 1)}" for f, v in zip(n["f"], n["v"])) + ")"
        if t == "enum":
            return f"{name}.{n['v']}"
        if t == "dataclass":
            return f"{name}(" + ", ".join(f"{f}={text(v, depth + 1)}" for f, v in n["f"]) + ")"
        if t == "numpy":
            return f"numpy {n['d']}{'' if n['s'] is None else list(n['s'])} ({len(n['v'])} bytes)"
        return f"<{t}>"
    out = text(node, 0)
    return out if len(out) <= limit else out[:limit - 3] + "..."


def check_node(node: Any, where: str) -> str | None:
    """Why ``node`` is not a well-formed value node (structure only), or None when it is."""
    stack = [(node, 0)]
    while stack:
        n, depth = stack.pop()
        if depth > MAX_DEPTH:
            return f"{where}: value nested deeper than {MAX_DEPTH} levels"
        if n is None or isinstance(n, (bool, float, str, bytes)):
            continue
        if type(n) is int:
            if not _I64_MIN <= n < _U64:
                return f"{where}: integer {n} does not fit in 64 bits"
            continue
        if not isinstance(n, dict) or not isinstance(n.get("t"), str):
            return f"{where}: expected a value node {{'t': ...}}, found {type(n).__name__}"
        t = n["t"]
        keys = NODE_KEYS.get(t)
        if keys is None:
            return f"{where}: unknown value node type {t!r} (known: {sorted(NODE_KEYS)})"
        if set(n) != keys:
            return f"{where}: a {t!r} value node has keys {sorted(n)}, expected {sorted(keys)}"
        v = n.get("v")
        if t in ("list", "tuple", "set", "frozenset", "namedtuple"):
            if not isinstance(v, list):
                return f"{where}: a {t!r} value node needs a list 'v'"
            stack.extend((x, depth + 1) for x in v)
        if t == "dict":
            if not isinstance(n["k"], list) or not all(isinstance(p, list) and len(p) == 2 for p in n["k"]):
                return f"{where}: a 'dict' value node needs 'k': a list of [key, value] pairs"
            stack.extend((x, depth + 1) for p in n["k"] for x in p)
        if t in ("int", "dtype", "device", "enum") and not isinstance(v, str):
            return f"{where}: a {t!r} value node needs a str 'v'"
        if t == "int":
            # Exactly what the encoder writes (str(int)): int() alone takes " 1_000 " too.
            if not _DECIMAL.fullmatch(v):
                return f"{where}: {v[:40]!r} is not a decimal integer"
            try:
                int(v)
            except ValueError:  # more digits than Python converts (sys.get_int_max_str_digits)
                return f"{where}: an integer of {len(v)} digits"
        # A torch.Size and a numpy shape hold int64 dimensions: 2**63 and above cannot be one (a
        # torch.Size of one loaded, then failed in repr() and everywhere it was used).
        if t == "size" and not (isinstance(v, list) and all(type(x) is int and 0 <= x < _I64_END for x in v)):
            return f"{where}: a 'size' value node needs a list of non-negative ints below 2**63"
        if t in ("namedtuple", "enum", "dataclass") and not (isinstance(n["c"], str) and ":" in n["c"]):
            return f"{where}: a {t!r} value node needs a class name 'module:qualname'"
        if t == "namedtuple" and not (isinstance(n["f"], list) and all(isinstance(x, str) for x in n["f"])
                                      and len(n["f"]) == len(v)):
            return f"{where}: a 'namedtuple' value node needs one str field name per value"
        if t == "dataclass":
            if not isinstance(n["f"], list) or not all(isinstance(p, list) and len(p) == 2 and isinstance(p[0], str)
                                                       for p in n["f"]):
                return f"{where}: a 'dataclass' value node needs 'f': a list of [name, value] pairs"
            stack.extend((p[1], depth + 1) for p in n["f"])
        if t == "numpy":
            if not isinstance(n["d"], str) or not isinstance(v, bytes):
                return f"{where}: a 'numpy' value node needs a str dtype 'd' and bytes 'v'"
            s = n["s"]
            if s is not None and not (isinstance(s, list) and all(type(x) is int and 0 <= x < _I64_END for x in s)):
                return f"{where}: a 'numpy' value node needs a shape 's' of non-negative ints below 2**63, or nil"
    return None
