"""NCCL backend: the ProcessGroup collectives on CUDA arrays.

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
an asynchronous error; unfinished ops then raise TimeoutError / PeerError, and later calls
AbortedError. Rebuild the group (``destroy()`` and ``init()``) after that.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from typing import List, Optional, Sequence, Tuple

import numpy as np

from . import _C
from .arrays import numpy_dtype
from .process_group import ProcessGroup, Work

__all__ = ["nccl_available", "NcclProcessGroup", "NcclWork", "make_world", "agree_on_backend"]


def _wheel_library_candidates() -> List[str]:
    """``nvidia/nccl/lib/libnccl.so.2`` of an installed nvidia-nccl-cu13 / -cu12 wheel, for
    each location of the ``nvidia`` namespace package (then each sys.path entry)."""
    roots: List[str] = []
    try:
        spec = importlib.util.find_spec("nvidia")
    except (ImportError, ValueError):
        spec = None
    if spec is not None and spec.submodule_search_locations:
        roots.extend(spec.submodule_search_locations)
    roots.extend(os.path.join(p, "nvidia") for p in sys.path if p)
    seen, out = set(), []
    for root in roots:
        path = os.path.join(root, "nccl", "lib", "libnccl.so.2")
        if path not in seen and os.path.exists(path):
            seen.add(path)
            out.append(path)
    return out


class _Loader:
    """Passes the wheel candidates to C++ once, before the first load."""

    done = False

    @classmethod
    def ensure(cls) -> None:
        if not cls.done:
            _C.nccl_set_library_candidates(_wheel_library_candidates())
            cls.done = True


def nccl_available() -> Tuple[bool, str]:
    """``(True, "NCCL 2.28.9 (/path), CUDA driver 13.0 (...), 2 devices")`` when NCCL and the
    CUDA driver load and a GPU is visible; otherwise ``(False, what is missing and where it
    was looked for)``. Search order for libnccl.so.2: ``$MESHCOLL_NCCL_LIBRARY``, the
    nvidia-nccl-cu13/-cu12 wheel, the system."""
    _Loader.ensure()
    ok, why = _C.nccl_available()
    return bool(ok), str(why)


def _stream_handle(stream) -> Optional[int]:
    if stream is None or isinstance(stream, int):
        return stream
    for attr in ("cuda_stream", "ptr"):
        v = getattr(stream, attr, None)
        if v is not None:
            return int(v)
    raise TypeError("stream must be an int handle or an object with .cuda_stream (torch) or "
                    f".ptr (CuPy), got {type(stream).__name__}")


class NcclWork(Work):
    """Work of an NCCL op: ``wait(stream=None)`` orders a stream after the op (no host block;
    a barrier's wait blocks the host); ``synchronize(timeout)`` blocks the host."""

    __slots__ = ()

    def wait(self, timeout: Optional[float] = None, stream=None):
        self._work.wait(timeout, _stream_handle(stream))
        if self._finish is not None:
            self._result = self._finish()
            self._finish = None
        return self._result  # keeps _keep: the arrays stay referenced until the Work goes

    def synchronize(self, timeout: Optional[float] = None):
        self._work.synchronize(timeout)
        return self.wait()


def _as_nccl_work(w, async_op: bool):
    if not async_op or not isinstance(w, Work):
        return w
    return NcclWork(w._work, w._result, w._keep, w._finish)


class NcclProcessGroup(ProcessGroup):
    """A ProcessGroup whose communicator is NCCL's. Every collective takes CUDA arrays and
    ``stream=``; see the module docstring for streams, outputs and failures."""

    backend_name = "nccl"

    def __init__(self, store, ranks: Sequence[int], rank: int, name: str, *, timeout: float,
                 bind_host: str, token: str, parent: Optional["NcclProcessGroup"] = None,
                 device: Optional[int] = None):
        self._device = parent._device if parent is not None else int(device)
        # Call options of the collective in progress, read by _as_array (the inherited
        # methods convert their arrays through it before calling the communicator).
        self._call_stream = None
        self._call_async = False
        self._split_color = 0
        super().__init__(store, ranks, rank, name, timeout=timeout, bind_host=bind_host,
                         token=token, parent=parent)

    @property
    def device(self) -> int:
        return self._device

    # ---- backend hooks --------------------------------------------------------------
    def _make_comm(self, prefixed_store, rank: int, parent):
        _Loader.ensure()
        if parent is not None and _C.nccl_split_supported():
            # ncclCommSplit: every parent rank calls it (non-members with color -1, see
            # new_group/split below); the key orders ranks as this group does.
            return parent._comm.split(parent._split_color, rank, self._timeout)
        return _C.NcclComm(prefixed_store, rank, len(self._ranks), self._device, self._timeout)

    def _comm_transport(self) -> str:
        return "nccl"

    def _as_array(self, x, what: str, writable: bool = False):
        return _C.nccl_array(x, what, writable, self._call_stream, self._call_async)

    def _empty(self, shape, like, dtype: Optional[str] = None):
        x = like.obj if isinstance(like, _C.DeviceArray) else like
        shape = (int(shape),) if isinstance(shape, (int, np.integer)) else tuple(int(s) for s in shape)
        new_empty = getattr(x, "new_empty", None)
        mod = sys.modules.get(type(x).__module__.split(".")[0])
        if callable(new_empty):  # PyTorch: x's device, x's dtype unless one is named
            return new_empty(shape) if dtype is None else new_empty(shape, dtype=getattr(mod, dtype))
        empty = getattr(mod, "empty", None)
        device = getattr(x, "device", None)
        if callable(empty) and hasattr(device, "__enter__"):  # CuPy: empty() on x's device
            with device:
                return empty(shape, dtype=x.dtype if dtype is None else numpy_dtype(dtype, "CuPy"))
        raise TypeError(f"the NCCL backend cannot allocate an output like a "
                        f"{type(x).__module__}.{type(x).__name__}; pass out= (or use PyTorch "
                        "or CuPy arrays)")

    def _current_stream(self, like):
        """The framework's current stream on ``like``'s device, found through the array's
        own module as _empty finds its allocator: ``torch.cuda.current_stream(device)``,
        ``cupy.cuda.get_current_stream()``; None (the backend's default) for other arrays."""
        mod = sys.modules.get(type(like).__module__.split(".")[0])
        cuda = getattr(mod, "cuda", None)
        if callable(getattr(like, "new_empty", None)) and hasattr(cuda, "current_stream"):
            return cuda.current_stream(like.device)
        get = getattr(cuda, "get_current_stream", None)
        return get() if callable(get) else None

    def _child(self, ranks, rank, name, timeout):
        return type(self)(self._store, ranks, rank, name, timeout=timeout or self._timeout,
                          bind_host=self._bind_host, token=self._token, parent=self)

    def _call(self, stream, async_op: bool = False) -> None:
        self._call_stream = stream
        self._call_async = async_op

    # ---- metadata through the communicator ------------------------------------------
    def _host_all_gather(self, x: np.ndarray, timeout) -> np.ndarray:
        x = np.ascontiguousarray(x)
        raw = self._comm.host_all_gather(x.tobytes(), timeout)
        return np.frombuffer(raw, x.dtype).reshape((self.size,) + x.shape).copy()

    # ---- collectives: the inherited methods, plus stream= ---------------------------
    def all_reduce(self, x, op: str = "sum", *, async_op: bool = False,
                   timeout: Optional[float] = None, algorithm: Optional[str] = None,
                   stream=None):
        """Reduce ``x`` across the group, in place (on the caller's stream)."""
        if algorithm not in (None, "auto"):
            raise ValueError(f"all_reduce: algorithm={algorithm!r} is a CPU-backend choice; "
                             "NCCL picks its own (set NCCL_ALGO to force one)")
        # The latency-critical op calls the communicator directly (one Python frame; the
        # synchronous one through a FASTCALL method that makes no Work).
        if not async_op:
            self._comm.all_reduce_sync(x, op, timeout, stream)
            return x
        w = self._comm.all_reduce(x, x, op, "auto", timeout, None, None, None, stream, True)
        return NcclWork(w, x, (x,))

    def reduce(self, x, dst: int = 0, op: str = "sum", *, async_op: bool = False,
               timeout: Optional[float] = None, stream=None):
        self._call(stream, async_op)
        return _as_nccl_work(super().reduce(x, dst, op, async_op=async_op, timeout=timeout), async_op)

    def broadcast(self, x, src: int = 0, *, async_op: bool = False,
                  timeout: Optional[float] = None, stream=None):
        self._call(stream, async_op)
        return _as_nccl_work(super().broadcast(x, src, async_op=async_op, timeout=timeout), async_op)

    def all_gather(self, x, out=None, *, async_op: bool = False,
                   timeout: Optional[float] = None, stream=None):
        """CUDA arrays: every rank's ``x`` stacked along a new axis 0. A numpy array (small
        metadata) is exchanged through the communicator and returned as numpy (blocking)."""
        if isinstance(x, np.ndarray):
            if out is not None or async_op:
                raise ValueError("all_gather of a host (numpy) array takes no out= or async_op")
            return self._host_all_gather(x, timeout)
        self._call(stream, async_op)
        return _as_nccl_work(super().all_gather(x, out, async_op=async_op, timeout=timeout), async_op)

    def all_gather_v(self, x, *, timeout: Optional[float] = None, stream=None):
        self._call(stream)
        return super().all_gather_v(x, timeout=timeout)

    def reduce_scatter(self, x, out=None, op: str = "sum", *, async_op: bool = False,
                       timeout: Optional[float] = None, stream=None):
        self._call(stream, async_op)
        return _as_nccl_work(super().reduce_scatter(x, out, op, async_op=async_op, timeout=timeout),
                             async_op)

    def reduce_scatter_v(self, x, counts: Sequence[int], op: str = "sum", *,
                         timeout: Optional[float] = None, stream=None):
        self._call(stream)
        return super().reduce_scatter_v(x, counts, op, timeout=timeout)

    def all_to_all(self, x, out=None, *, async_op: bool = False,
                   timeout: Optional[float] = None, stream=None):
        """CUDA arrays: block i of axis 0 goes to rank i. A numpy array (small metadata) is
        exchanged through the communicator and returned as numpy (blocking)."""
        if isinstance(x, np.ndarray):
            if out is not None or async_op:
                raise ValueError("all_to_all of a host (numpy) array takes no out= or async_op")
            x = np.ascontiguousarray(x)
            if x.ndim == 0 or x.shape[0] % self.size:
                raise ValueError(f"all_to_all: axis 0 must divide by the group size {self.size}")
            blk = x.shape[0] // self.size
            table = self._host_all_gather(x, timeout)  # (size, size*blk, ...)
            return np.ascontiguousarray(table[:, self.rank * blk:(self.rank + 1) * blk]
                                        .reshape(x.shape))
        self._call(stream, async_op)
        return _as_nccl_work(super().all_to_all(x, out, async_op=async_op, timeout=timeout), async_op)

    def all_to_all_v(self, x, send_counts: Sequence[int], *, timeout: Optional[float] = None,
                     stream=None):
        self._call(stream)
        return super().all_to_all_v(x, send_counts, timeout=timeout)

    def gather(self, x, dst: int = 0, *, timeout: Optional[float] = None, stream=None):
        self._call(stream)
        return super().gather(x, dst, timeout=timeout)

    def scatter(self, x, src: int = 0, *, out=None, timeout: Optional[float] = None, stream=None):
        self._call(stream)
        return super().scatter(x, src, out=out, timeout=timeout)

    def send(self, x, peer: int, tag: int = 0, *, timeout: Optional[float] = None, stream=None):
        """Enqueue a send of ``x`` to group rank ``peer`` on the caller's stream."""
        self.isend(x, peer, tag, timeout=timeout, stream=stream).wait()

    def recv(self, x, peer: int, tag: int = 0, *, timeout: Optional[float] = None, stream=None):
        """Enqueue a receive into ``x`` (in place) on the caller's stream; returns ``x``."""
        return self.irecv(x, peer, tag, timeout=timeout, stream=stream).wait()

    def isend(self, x, peer: int, tag: int = 0, *, timeout: Optional[float] = None, stream=None):
        self._call(stream)
        return _as_nccl_work(super().isend(x, peer, tag, timeout=timeout), True)

    def irecv(self, x, peer: int, tag: int = 0, *, timeout: Optional[float] = None, stream=None):
        self._call(stream)
        return _as_nccl_work(super().irecv(x, peer, tag, timeout=timeout), True)

    def barrier(self, *, async_op: bool = False, timeout: Optional[float] = None, stream=None):
        """All ranks arrive: a one-element all_reduce whose wait() blocks the host."""
        w = self._comm.barrier(timeout, stream)
        return NcclWork(w, None, ()) if async_op else w.wait(timeout)

    # ---- subgroups: ncclCommSplit is collective over the whole parent ---------------
    def new_group(self, ranks: Sequence[int], *, timeout: Optional[float] = None):
        self._split_color = 0
        child = super().new_group(ranks, timeout=timeout)
        if not child.is_member and _C.nccl_split_supported():
            self._comm.split(-1, 0, timeout)
        return child

    def split(self, color: Optional[int], key: int = 0, *, timeout: Optional[float] = None):
        c = -1 if color is None else int(color)
        if c >= 2**31:
            raise ValueError(f"split: color {c} must be below 2**31 on the NCCL backend")
        self._split_color = c
        child = super().split(color, key, timeout=timeout)
        if c < 0 and _C.nccl_split_supported():
            self._comm.split(-1, 0, timeout)
        return child

    def __repr__(self) -> str:
        return (f"NcclProcessGroup(name={self._name!r}, rank={self.rank}, size={self.size}, "
                f"ranks={self._ranks}, device={self._device})")


def _device_count() -> int:
    _Loader.ensure()
    return int(_C.cuda_device_count())


def make_world(store, rank: int, world_size: int, timeout: float, bind_host: str, token: str,
               device=None) -> NcclProcessGroup:
    """The world group on NCCL (what ``init(backend="nccl")`` calls). ``device``: an int (or
    an object with ``.index``, e.g. torch.device); None picks device 0 when that is the only
    choice (one rank, or one visible GPU per process), and otherwise raises: pass
    ``device=`` or launch with LOCAL_RANK."""
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
    return NcclProcessGroup(store, range(world_size), rank, "world", timeout=timeout,
                            bind_host=bind_host, token=token, device=int(device))


def agree_on_backend(store, rank: int, world_size: int, timeout: float) -> str:
    """``init(backend="auto")``: "nccl" when every rank has a GPU and NCCL loads, else
    "cpu" — decided together through the store, so all ranks pick the same."""
    ok, _ = nccl_available()
    store.set(f"mc/backend_ok/{rank}", b"1" if ok else b"0")
    votes = [store.get(f"mc/backend_ok/{r}", timeout) for r in range(world_size)]
    return "nccl" if all(v == b"1" for v in votes) else "cpu"
