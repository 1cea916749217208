"""Small facts about arrays that the Python layer needs: numpy views of host objects the
backend has already checked, dtype names, and the row count of axis 0. Every check of an
array a collective takes (contiguity, writability, dtype, byte order, host or device
memory, sizes) lives in one place, csrc/python/array.cc, reached through
``ProcessGroup._view``. ``HostArrays``: how a CPU group allocates its outputs (an NCCL
group's ``CudaArrays`` are nccl.py's)."""

from __future__ import annotations

from typing import Any, Dict, Optional, Sequence, Union

import numpy as np


def host_view(x: Any) -> np.ndarray:
    """A numpy view sharing ``x``'s memory, for host objects the backend accepted (numpy,
    DLPack on the CPU, the buffer protocol)."""
    if isinstance(x, np.ndarray):
        return x
    if hasattr(x, "__dlpack__"):
        return np.from_dlpack(x)
    return np.asarray(memoryview(x))


# dtype object -> name: numpy's dtype.name is slow on a hot path (docs/performance.md,
# "Python host costs").
_DTYPE_NAMES: Dict[Any, str] = {}


def dtype_name(dtype: Any) -> str:
    """"float32" for np.float32, np.dtype("float32"), torch.float32 or a CuPy array's dtype."""
    try:
        return _DTYPE_NAMES[dtype]
    except (KeyError, TypeError):  # not seen yet, or unhashable
        pass
    if isinstance(dtype, np.dtype):
        name = dtype.name
    else:
        text = str(dtype)
        name = text[len("torch."):] if text.startswith("torch.") else np.dtype(dtype).name
    try:
        _DTYPE_NAMES[dtype] = name
    except TypeError:
        pass
    return name


def numpy_dtype(name: str, what: str) -> "np.dtype[Any]":
    """The numpy dtype called ``name``; bfloat16 comes from ml_dtypes (an optional extra)."""
    if name != "bfloat16":
        return np.dtype(name)
    try:
        import ml_dtypes
    except ImportError:
        raise ImportError(f"{what}: bfloat16 on the host needs ml_dtypes "
                          "(pip install ml_dtypes)") from None
    bf16: "np.dtype[Any]" = np.dtype(ml_dtypes.bfloat16)  # ml_dtypes is untyped here
    return bf16


def rows(a: Any, what: str) -> int:
    """Length of axis 0 of an array (or the ``_C.Array`` of one); 0-d arrays have no rows to
    split or stack by."""
    shape = tuple(a.shape)
    if not shape:
        raise ValueError(f"{what}: needs an array with at least one dimension, got a 0-d array")
    return int(shape[0])


class HostArrays:
    """How a CPU group allocates the outputs it returns: numpy arrays."""

    device_memory = False

    @staticmethod
    def empty(shape: Union[int, Sequence[int]], like: Any,
              dtype: Optional[str] = None) -> np.ndarray:
        """A new array of ``shape`` with ``like``'s dtype (or the dtype named ``dtype``)."""
        if dtype is None:
            dtype = like.dtype
        return np.empty(shape, numpy_dtype(dtype, "meshcoll") if isinstance(dtype, str) else dtype)

    @staticmethod
    def current_stream(like: Any) -> Any:
        return None
