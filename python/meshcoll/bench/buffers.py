"""meshcoll-bench's buffers: the dtypes a table can name, and the libraries that allocate
device buffers for ``--backend nccl`` (host buffers are numpy arrays, made by the cases)."""

from __future__ import annotations

import importlib.util
from typing import Any, Union
from dataclasses import dataclass

import numpy as np

from meshcoll import arrays

ARRAY_LIBS = ("torch", "cupy")

# numpy name -> (the name nccl-tests prints in the type column, bytes per element).
_DTYPES = {"float32": ("float", 4), "float64": ("double", 8), "float16": ("half", 2),
           "bfloat16": ("bfloat16", 2), "int8": ("int8", 1), "uint8": ("uint8", 1),
           "int32": ("int32", 4), "int64": ("int64", 8)}
TYPE_NAMES = {name: type_name for name, (type_name, _) in _DTYPES.items()}
INTS = ("int8", "uint8", "int32", "int64")
_DTYPE_ALIASES = {"float": "float32", "f32": "float32", "double": "float64",
                  "f64": "float64", "half": "float16", "f16": "float16", "bf16": "bfloat16"}


def _dtype_name(name: str) -> str:
    """The numpy name of a ``--dtype`` (aliases resolved); SystemExit for an unknown one."""
    name = _DTYPE_ALIASES.get(name, name)
    if name not in _DTYPES:
        raise SystemExit(f"meshcoll-bench: unknown --dtype {name!r}; use one of "
                         f"{', '.join(_DTYPES)}")
    return name


def numpy_dtype(name: str) -> np.dtype:
    name = _dtype_name(name)
    try:
        return arrays.numpy_dtype(name, "meshcoll-bench: --dtype bfloat16")
    except ImportError as e:
        raise SystemExit(str(e)) from None


@dataclass(frozen=True)
class DeviceDType:
    """What the table needs of a dtype that may have no numpy counterpart (bfloat16
    without ml_dtypes): the numpy-style name and the element size."""
    name: str
    itemsize: int


def device_dtype(name: str) -> DeviceDType:
    name = _dtype_name(name)
    return DeviceDType(name, _DTYPES[name][1])


class TorchArrays:
    """Device buffers as PyTorch CUDA tensors (ops run on torch's current stream)."""

    name = "torch"

    def __init__(self, device: int):
        import torch
        self.torch = torch
        torch.cuda.set_device(device)
        self.device = torch.device("cuda", device)

    def empty(self, count: int, dtype: str) -> Any:
        return self.torch.empty(count, dtype=getattr(self.torch, dtype), device=self.device)

    def write(self, x: Any, start: int, values: np.ndarray) -> None:
        x[start:start + values.size].copy_(self.torch.from_numpy(values).to(self.device))

    def fill(self, x: Any, value: float) -> None:
        x.fill_(value)

    def read(self, x: Any, start: int, stop: int, integer: bool) -> np.ndarray:
        t = x[start:stop].to(self.torch.int64 if integer else self.torch.float64)
        out: np.ndarray = t.cpu().numpy()
        return out

    def synchronize(self) -> None:
        self.torch.cuda.synchronize(self.device)


class CupyArrays:
    """Device buffers as CuPy arrays (no bfloat16: CuPy has none)."""

    name = "cupy"

    def __init__(self, device: int):
        import cupy
        self.cupy = cupy
        self.dev = cupy.cuda.Device(device)
        self.dev.use()

    def empty(self, count: int, dtype: str) -> Any:
        if dtype == "bfloat16":
            raise SystemExit("meshcoll-bench: CuPy has no bfloat16; use --array torch")
        with self.dev:
            return self.cupy.empty(count, dtype=np.dtype(dtype))

    def write(self, x: Any, start: int, values: np.ndarray) -> None:
        with self.dev:
            x[start:start + values.size] = self.cupy.asarray(values).astype(x.dtype)

    def fill(self, x: Any, value: float) -> None:
        x.fill(value)

    def read(self, x: Any, start: int, stop: int, integer: bool) -> np.ndarray:
        out: np.ndarray = self.cupy.asnumpy(x[start:stop]).astype(np.int64 if integer else np.float64)
        return out

    def synchronize(self) -> None:
        self.dev.synchronize()


def array_library(choice: str) -> str:
    """"torch" or "cupy": ``choice``, or for "auto" the first importable one. Raises
    SystemExit naming both when neither is installed."""
    libs = ARRAY_LIBS if choice == "auto" else (choice,)
    for lib in libs:
        if importlib.util.find_spec(lib) is not None:
            return lib
    raise SystemExit(f"meshcoll-bench: --backend nccl allocates device buffers with "
                     f"{' or '.join(libs)}, and {'neither is' if len(libs) > 1 else 'it is not'} "
                     f"installed (pip install torch, or cupy-cuda12x / cupy-cuda13x)")


def make_arrays(choice: str, device: int) -> Union[TorchArrays, CupyArrays]:
    if array_library(choice) == "torch":
        return TorchArrays(device)
    return CupyArrays(device)


