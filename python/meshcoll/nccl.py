"""NCCL backend: the ProcessGroup collectives on CUDA arrays (one ProcessGroup class for
every backend; this module loads NCCL, makes the C++ NcclBackend and allocates outputs).

    pg = meshcoll.init(backend="nccl")          # device from LOCAL_RANK, or device=
    x = torch.ones(1024, device="cuda")         # or a CuPy array, or any __dlpack__ /
    pg.all_reduce(x)                            # __cuda_array_interface__ CUDA array
    w = pg.all_reduce(x, async_op=True)         # runs on the group's internal stream
    w.wait()                                    # caller's stream waits: no host block
    w.synchronize()                             # host blocks (with a timeout)

NCCL and the CUDA driver are loaded at run time (csrc/nccl/nccl_api.h): the wheel needs no
CUDA toolkit. ``nccl_available()`` says whether they load here and why not.

Streams. An op runs on the caller's stream: ``stream=`` (an int handle, or an object with
``.cuda_stream`` (torch) or ``.ptr`` (CuPy)); else, for a PyTorch tensor, torch's current
stream; else the stream of the array (the DLPack handshake ``x.__dlpack__(stream=S)``
orders the producer's work before S = the legacy default stream; a
``__cuda_array_interface__`` "stream" entry is used as S). A synchronous call returns once
the op is enqueued on that stream (as torch.distributed does); the result is ready for
later work on the same stream. ``async_op=True`` runs the op on the group's internal
stream, after the caller's stream's pending work, and returns a Work: ``wait(stream=None)``
orders the caller's stream (or ``stream``) after the op, ``synchronize(timeout)`` blocks the
host. Keep arrays alive and unmodified until then (the Work holds references). Ops issued
while their stream is captured into a CUDA graph are captured (they run at each replay).

Outputs that a method allocates (all_gather, all_gather_v, gather, ...) come from the
input's own framework, found by duck typing: ``x.new_empty(shape)`` (PyTorch), else
``<module of type(x)>.empty(shape, dtype=x.dtype)`` on ``x.device`` (CuPy). Other array
types must pass ``out=`` where a method takes one.

Metadata. all_gather_v, all_to_all_v and split exchange a few integers per rank; the NCCL
group does this itself: ``all_gather`` / ``all_to_all`` of a numpy (host) array go through a
small device buffer on a private stream and come back as numpy (blocking). No CPU
communicator is built alongside.

Point-to-point. NCCL matches messages between two ranks in posting order and has no tags:
``send``/``recv`` take ``tag=0`` only.

Failures. A watchdog aborts the communicator when an op passes its deadline or NCCL reports
an asynchronous error; unfinished ops then raise TimeoutError / PeerError, and so does every
later call (with the same type: Note [NCCL failure model] in csrc/nccl/nccl_comm.h). Rebuild
the group (``destroy()`` and ``init()``) after that.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from typing import Any, List, Optional, Sequence, Tuple, Union

import numpy as np

from . import _C
from .arrays import numpy_dtype

__all__ = ["nccl_available"]


def _wheel_library_candidates(*names: str) -> List[str]:
    """Each of ``names`` (a path under ``nvidia/``: ``nccl/lib/libnccl.so.2`` of the
    nvidia-nccl-cu13 / -cu12 wheels by default) that exists, for each location of the
    ``nvidia`` namespace package (then each sys.path entry)."""
    names = names or ("nccl/lib/libnccl.so.2",)
    roots: List[str] = []
    try:
        spec = importlib.util.find_spec("nvidia")
    except (ImportError, ValueError):
        spec = None
    if spec is not None and spec.submodule_search_locations:
        roots.extend(spec.submodule_search_locations)
    roots.extend(os.path.join(p, "nvidia") for p in sys.path if p)
    seen, out = set(), []
    for name in names:
        for root in roots:
            path = os.path.join(root, *name.split("/"))
            if path not in seen and os.path.exists(path):
                seen.add(path)
                out.append(path)
    return out


# NVRTC compiles the direct kernels (Note [Direct kernels] in csrc/nccl/direct/direct.h): the
# CUDA 13 and CUDA 12 wheels' libraries (torch, CuPy and JAX depend on them), then the system's.
_NVRTC_WHEEL_PATHS = ("cu13/lib/libnvrtc.so.13", "cuda_nvrtc/lib/libnvrtc.so.12",
                      "cuda_nvrtc/lib/libnvrtc.so.13")


class _Loader:
    """Passes the wheel candidates to C++ once, before the first load."""

    done = False

    @classmethod
    def ensure(cls) -> None:
        if not cls.done:
            _C.nccl_set_library_candidates(_wheel_library_candidates())
            _C.nccl_set_nvrtc_candidates(_wheel_library_candidates(*_NVRTC_WHEEL_PATHS))
            cls.done = True


def nccl_available() -> Tuple[bool, str]:
    """``(True, "NCCL 2.28.9 (/path), CUDA driver 13.0 (...), 2 devices")`` when NCCL and the
    CUDA driver load and a GPU is visible; otherwise ``(False, what is missing and where it
    was looked for)``. Search order for libnccl.so.2: ``$MESHCOLL_NCCL_LIBRARY``, the
    nvidia-nccl-cu13/-cu12 wheel, the system."""
    _Loader.ensure()
    ok, why = _C.nccl_available()
    return bool(ok), str(why)


class CudaArrays:
    """How an NCCL group allocates the outputs it returns: in the input's own framework, on
    its device, found by duck typing (no framework is imported)."""

    device_memory = True

    @staticmethod
    def empty(shape: Union[int, Sequence[int]], like: Any, dtype: Optional[str] = None) -> Any:
        shape = (int(shape),) if isinstance(shape, (int, np.integer)) else tuple(int(s) for s in shape)
        new_empty = getattr(like, "new_empty", None)
        mod = sys.modules.get(type(like).__module__.split(".")[0])
        if callable(new_empty):  # PyTorch: like's device, like's dtype unless one is named
            return new_empty(shape) if dtype is None else new_empty(shape, dtype=getattr(mod, dtype))
        empty = getattr(mod, "empty", None)
        device: Any = getattr(like, "device", None)  # a framework's device object, if any
        if callable(empty) and hasattr(device, "__enter__"):  # CuPy: empty() on like's device
            with device:
                return empty(shape, dtype=like.dtype if dtype is None else numpy_dtype(dtype, "CuPy"))
        if type(like).__module__.startswith("jax"):
            raise TypeError("the NCCL backend cannot make a JAX array for the result (JAX arrays "
                            "are immutable: nothing may write into one); pass out= a PyTorch or "
                            "CuPy array and take the result back with jax.numpy.from_dlpack")
        raise TypeError(f"the NCCL backend cannot allocate an output like a "
                        f"{type(like).__module__}.{type(like).__name__}; pass out= (or use "
                        "PyTorch or CuPy arrays)")

    @staticmethod
    def framework(like: Any) -> Any:
        """The module that makes arrays like ``like``: torch or cupy (torch, else cupy, when
        ``like`` is None)."""
        if like is not None:
            mod = sys.modules.get(type(like).__module__.split(".")[0])
            if mod is not None and hasattr(mod, "from_dlpack") and mod.__name__ in ("torch", "cupy"):
                return mod
            raise TypeError(f"empty(like=...): a {type(like).__module__}.{type(like).__name__} "
                            "names no framework the NCCL backend allocates in; pass a PyTorch "
                            "tensor or a CuPy array")
        for name in ("torch", "cupy"):
            try:
                return importlib.import_module(name)
            except ImportError:
                continue
        raise ImportError("empty() on an NCCL group makes PyTorch or CuPy arrays; install one "
                          "or pass like=")

    @staticmethod
    def new(shape: Tuple[int, ...], dtype: str, like: Any, device: int, zero: bool) -> Any:
        """A new ``dtype`` array of ``shape`` on CUDA ``device``, in ``like``'s framework."""
        mod = CudaArrays.framework(like)
        make = mod.zeros if zero else mod.empty
        if mod.__name__ == "torch":
            return make(shape, dtype=getattr(mod, dtype), device=f"cuda:{device}")
        with mod.cuda.Device(device):
            return make(shape, dtype=numpy_dtype(dtype, "CuPy"))

    @staticmethod
    def current_stream(like: Any) -> Any:
        """The framework's current stream on ``like``'s device, found through the array's own
        module, as ``stream=`` takes it: PyTorch's raw handle (an int), else
        ``torch.cuda.current_stream(device)``, ``cupy.cuda.get_current_stream()``; None (the
        backend's default) for other arrays."""
        mod = sys.modules.get(type(like).__module__.split(".")[0])
        cuda: Any = getattr(mod, "cuda", None)  # torch.cuda or cupy.cuda, if any
        if callable(getattr(like, "new_empty", None)) and hasattr(cuda, "current_stream"):
            # The raw handle, as the backend reads a tensor's stream (csrc/python/array.cc):
            # no Stream object per call (DataParallel asks at every bucket).
            raw = getattr(getattr(mod, "_C", None), "_cuda_getCurrentRawStream", None)
            if callable(raw):
                return raw(like.get_device())
            return cuda.current_stream(like.device)
        get = getattr(cuda, "get_current_stream", None)
        return get() if callable(get) else None


def make_backend(prefixed_store: _C.Store, rank: int, size: int, device: int, timeout: float,
                 parent: Optional[_C.NcclBackend], color: int) -> _C.NcclBackend:
    """The NCCL backend of a new group: ncclCommSplit of the parent group's backend (every
    parent rank calls it, non-members through ``sit_out``; the key orders ranks as the group
    does), or a new communicator through the store."""
    _Loader.ensure()
    if parent is not None and _C.nccl_split_supported():
        backend = parent.split(color, rank, timeout)
        assert backend is not None  # None only for color -1 (sit_out), never for a member
        return backend
    return _C.NcclBackend(prefixed_store, rank, size, device, timeout)


def sit_out(parent: _C.NcclBackend, timeout: Optional[float]) -> None:
    """A parent rank outside the new subgroup takes part in ncclCommSplit with no color."""
    if _C.nccl_split_supported():
        parent.split(-1, 0, timeout)


def _device_count() -> int:
    _Loader.ensure()
    return int(_C.cuda_device_count())


def world_device(rank: int, world_size: int, device: Any = None) -> int:
    """The CUDA device of this rank's NCCL world (what ``init(backend="nccl")`` builds it
    on; its subgroups inherit it). ``device``: an int (or an object with ``.index``, e.g.
    torch.device); None picks device 0 when that is the only choice (one rank, or one visible
    GPU per process), and otherwise raises: pass ``device=`` or launch with LOCAL_RANK."""
    ok, why = nccl_available()
    if not ok:
        raise _C.MeshcollError(f"meshcoll.init(backend='nccl') on rank {rank}: {why}")
    if device is not None and not isinstance(device, (int, np.integer)):
        device = getattr(device, "index", None)
        if device is None:
            raise ValueError("device must be an int or an object with .index (torch.device)")
    if device is None:
        n = _device_count()
        if world_size == 1 or n == 1:
            device = 0
        else:
            raise ValueError(f"meshcoll.init(backend='nccl') on rank {rank}: {n} GPUs are visible "
                             "and the launcher did not say which is this rank's; pass device= "
                             "or set LOCAL_RANK")
    return int(device)
