"""Turn what users pass (numpy arrays, buffer-protocol objects, DLPack tensors) into the
C-contiguous numpy arrays the C++ core takes, and validate them. The core reads and writes
the caller's memory in place: nothing here copies, except where a function says so."""

from __future__ import annotations

import numpy as np

_SUPPORTED = "bool, int8, uint8, int32, int64, float16, bfloat16 (ml_dtypes), float32, float64"


def as_array(x, what: str, *, writable: bool = False) -> np.ndarray:
    """A numpy view of ``x`` sharing its memory; TypeError for what cannot be viewed."""
    if type(x) is np.ndarray:  # the hot path; C++ checks the dtype (python/buffers.cc)
        f = x.flags
        if f.c_contiguous and (f.writeable or not writable) and x.dtype.hasobject is False:
            return x
    if isinstance(x, np.ndarray):
        a = x
    elif hasattr(x, "__dlpack__"):
        device = x.__dlpack_device__()[0] if hasattr(x, "__dlpack_device__") else 1
        if device != 1:  # kDLCPU
            raise TypeError(
                f"{what}: the array lives on a device (DLPack device type {device}); the CPU "
                "backend takes host memory: use meshcoll.init(backend='nccl') for GPU arrays")
        try:
            a = np.from_dlpack(x)
        except (BufferError, TypeError, RuntimeError) as e:
            raise TypeError(f"{what}: cannot view {type(x).__name__} through DLPack: {e}") from e
    else:
        try:
            a = np.asarray(memoryview(x))
        except TypeError:
            raise TypeError(
                f"{what}: expected a numpy array or an object with the buffer protocol or "
                f"__dlpack__, got {type(x).__name__}") from None
    if a.dtype == object:
        raise TypeError(f"{what}: object arrays cannot be communicated; use one of {_SUPPORTED}")
    if not a.flags.c_contiguous:
        raise ValueError(
            f"{what}: the array is not C-contiguous (strides {a.strides}); pass "
            "numpy.ascontiguousarray(x) and copy the result back")
    if writable and not a.flags.writeable:
        raise ValueError(f"{what}: the array is read-only but the result is written into it")
    return a


def dtype_name(dtype) -> str:
    """"float32" for np.float32, np.dtype("float32"), torch.float32 or a CuPy array's dtype."""
    if isinstance(dtype, np.dtype):
        return dtype.name
    text = str(dtype)
    return text[len("torch."):] if text.startswith("torch.") else np.dtype(dtype).name


def numpy_dtype(name: str, what: str) -> np.dtype:
    """The numpy dtype called ``name``; bfloat16 comes from ml_dtypes (an optional extra)."""
    if name != "bfloat16":
        return np.dtype(name)
    try:
        import ml_dtypes
    except ImportError:
        raise ImportError(f"{what}: bfloat16 on the host needs ml_dtypes "
                          "(pip install ml_dtypes, or meshcoll[bf16])") from None
    return np.dtype(ml_dtypes.bfloat16)


def rows(a: np.ndarray, what: str) -> int:
    """Length of axis 0; 0-d arrays have no rows to split or stack by."""
    if a.ndim == 0:
        raise ValueError(f"{what}: needs an array with at least one dimension, got a 0-d array")
    return a.shape[0]
