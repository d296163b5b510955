"""Tensors <-> raw bytes: the one place that turns a tensor into bytes and bytes into a tensor.

Invariants:
  * A tensor's bytes are its elements in C-contiguous (row-major) order, native little-endian, for
    every dtype torch has (bfloat16, float8, bool, complex included): we reinterpret memory, we never
    convert values, so a round trip is bit-exact (NaN payloads and -0.0 included).
  * The memoryview returned by :func:`host_bytes` stays valid only while the returned keep-alive
    object lives; callers hold it until the write that consumes the view has completed.
  * Device tensors are copied to host exactly once, into pinned memory when CUDA is available (a
    DMA). A sync save copies one piece at a time, right before writing it; async_save stages every
    piece up front with non-blocking copies into its own pinned arena (:mod:`distckpt.staging`).
"""

from __future__ import annotations

import ctypes
from typing import Any

import torch

from .errors import ManifestCorruptError

__all__ = ["EXACT_CASTS", "dtype_name", "dtype_from_name", "host_bytes", "writable_bytes"]

_DTYPES: dict[str, torch.dtype] = {}
for _name in dir(torch):
    _value = getattr(torch, _name, None)
    if isinstance(_value, torch.dtype) and _name == str(_value).removeprefix("torch."):
        _DTYPES[_name] = _value


def dtype_name(dtype: torch.dtype) -> str:
    """The manifest name of a torch dtype: ``torch.bfloat16`` -> ``"bfloat16"``."""
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str, *, path: str | None = None) -> torch.dtype:
    """The torch dtype for a manifest dtype name. Raises ManifestCorruptError for an unknown name
    (a manifest is data: a name is never looked up as an arbitrary attribute)."""
    try:
        return _DTYPES[name]
    except KeyError:
        raise ManifestCorruptError(f"unknown dtype {name!r} in MANIFEST", path=path) from None


def _view_of(ptr: int, nbytes: int) -> memoryview:
    if nbytes == 0:
        return memoryview(b"")
    if not ptr:
        # A wrapper tensor subclass without storage of its own: touching address 0 would crash
        # the process instead of raising.
        raise ValueError("tensor has elements but no storage (data_ptr() == 0): a wrapper subclass?")
    # ctypes gives a buffer-protocol object over raw memory with no copy and no numpy dependency
    # (numpy cannot represent bfloat16 or float8 anyway).
    return memoryview((ctypes.c_char * nbytes).from_address(ptr)).cast("B")


def host_bytes(tensor: torch.Tensor) -> tuple[memoryview, Any]:
    """A read-only byte view of ``tensor``'s elements in row-major order, on the host.

    Returns ``(view, keepalive)``: the view is valid while ``keepalive`` is referenced. A
    contiguous CPU tensor is viewed in place (zero copies); a non-contiguous one is made contiguous
    (one copy); a device tensor is copied to host once, into pinned memory when CUDA is available.
    """
    t = tensor.detach()
    if t.numel() == 0:
        return memoryview(b""), None  # no bytes, wherever it lives (an empty meta tensor has no data to copy)
    if t.device.type != "cpu":
        host = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=torch.cuda.is_available())
        host.copy_(t, non_blocking=False)
        t = host
    elif not t.is_contiguous():
        t = t.contiguous()
    if t.is_conj() or t.is_neg():
        t = t.resolve_conj().resolve_neg()
    return _view_of(t.data_ptr(), t.numel() * t.element_size()), t


def writable_bytes(tensor: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous CPU tensor's memory (the caller keeps the tensor alive)."""
    if tensor.device.type != "cpu" or not tensor.is_contiguous():
        raise ValueError("writable_bytes needs a contiguous CPU tensor")
    return _view_of(tensor.data_ptr(), tensor.numel() * tensor.element_size())


#: Saved dtype -> dtypes that hold every one of its values exactly: load converts these without
#: being asked (``cast="exact"``, the default). Anything else needs ``cast="allow"``.
EXACT_CASTS: dict[str, frozenset[str]] = {
    "float16": frozenset({"float32", "float64"}),
    "bfloat16": frozenset({"float32", "float64"}),
    "float32": frozenset({"float64"}),
    "float8_e4m3fn": frozenset({"float16", "bfloat16", "float32", "float64"}),
    "float8_e5m2": frozenset({"float16", "bfloat16", "float32", "float64"}),
    "complex64": frozenset({"complex128"}),
    "bool": frozenset({"uint8", "int8", "int16", "int32", "int64", "float16", "bfloat16", "float32", "float64"}),
    "uint8": frozenset({"int16", "int32", "int64", "uint16", "uint32", "uint64", "float16", "bfloat16",
                        "float32", "float64"}),
    "int8": frozenset({"int16", "int32", "int64", "float16", "bfloat16", "float32", "float64"}),
    "int16": frozenset({"int32", "int64", "float32", "float64"}),
    "uint16": frozenset({"int32", "int64", "uint32", "uint64", "float32", "float64"}),
    "int32": frozenset({"int64", "float64"}),
    "uint32": frozenset({"int64", "uint64", "float64"}),
}
