"""The collective methods every ProcessGroup has, and what they share: the arrays they take,
``Work`` (an asynchronous call), ``CollectiveConfig`` (all_reduce's algorithm choice).

``Collectives`` is ProcessGroup's base class (process_group.py): it holds the calls on the
group's backend; ProcessGroup adds the group's identity, memory, subgroups and lifecycle.
"""

from __future__ import annotations

import inspect
import math
from typing import (Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple, Type,
                    TypeVar, Union)

import numpy as np

from . import _C
from ._types import AlgorithmName, ReduceOpName
from .arrays import HostArrays, dtype_name, host_view, rows
from .nccl import CudaArrays

# Arrays: numpy, anything with the buffer protocol or __dlpack__ (host memory) on a CPU group;
# torch tensors, CuPy arrays, DLPack or __cuda_array_interface__ objects on an NCCL group.
# JAX arrays are read, never written (Note [Immutable arrays] in csrc/python/array.cc).
Array = Any
# NCCL groups: None (the caller's current stream), an int handle, or an object with
# .cuda_stream (torch) or .ptr (CuPy).
Stream = Any

# Note [One source of truth]: each collective is documented once, on its method here;
# the module functions of meshcoll (meshcoll/api.py) forward to these methods with the same
# signature plus ``group=``, and take their docstrings from here
# (tests/python/test_typing.py checks both). What every collective shares is appended below.
_SHARED_DOC = """
Arrays: numpy arrays, or anything with the buffer protocol or ``__dlpack__`` in host memory
(CPU groups); torch, CuPy, DLPack or ``__cuda_array_interface__`` arrays (NCCL groups). Each
is checked once, before anything is sent: C-contiguous, writable where written (JAX arrays
never are: pass a writable copy), native byte order, ``out=`` exactly the size written.
Dtypes: bool, int8, uint8, int32, int64, float16, bfloat16 (``ml_dtypes.bfloat16``),
float32, float64; float16/bfloat16 are reduced in float32 and rounded at each step. Ops:
"sum", "prod", "min", "max", "avg", and "band", "bor", "bxor" for integers and bool.

``async_op=True`` returns a ``Work`` at once (``wait(timeout)`` returns the result); the
operation holds its arrays until it completes. ``timeout``: seconds, > 0 and at most 1e7
(default: the group's, from ``meshcoll.init``). ``stream`` (NCCL groups): the CUDA stream
to run on (default: the caller's current stream).

Raises ValueError or TypeError for bad arguments, on this rank, before anything is sent;
``meshcoll.MismatchError`` when ranks disagree on the call (collective, count, dtype, op,
root, shapes); ``meshcoll.TimeoutError`` past the deadline (naming the ranks waited for);
``meshcoll.PeerError`` when a peer died or closed; ``meshcoll.AbortedError`` when the group
failed earlier; ``meshcoll.ConcurrentCallError`` when another thread calls on the group at
the same time. After any of these the group is dead: destroy it and build a new one."""

_F = TypeVar("_F", bound=Callable[..., Any])
_T = TypeVar("_T")


def _collective(fn: _F) -> _F:
    """Appends what every collective shares to ``fn``'s docstring (Note [One source of
    truth])."""
    fn.__doc__ = inspect.cleandoc(fn.__doc__ or "") + "\n" + _SHARED_DOC
    return fn


# The names reduce and broadcast take (all_reduce takes every AlgorithmName): the group's
# transport picks the family (shared memory or TCP), the name the shape within it.
REDUCE_ALGORITHMS = ("auto", "tree", "direct")
BROADCAST_ALGORITHMS = ("auto", "tree", "direct", "ring")


# The all_reduce tuning's defaults, defined once in C++ (common/op_desc.h).
_DEFAULTS: Dict[str, int] = dict(_C.ALL_REDUCE_DEFAULTS)


class CollectiveConfig:
    """Algorithm choices of a CPU group (NCCL groups pick their own).

    ``algorithm`` (all_reduce): ``"auto"`` picks by size and world size: on one host, shared
    memory; over TCP, direct up to 64 KiB (<= 8 ranks), tree at or below
    ``tree_threshold_bytes``, recursive halving-doubling at or below ``hd_threshold_bytes`` on
    power-of-two worlds, ring above. ``"centralized"`` (reduce to a root, then broadcast) is
    another name of ``"direct"``. ``MESHCOLL_ALGO`` overrides auto. ``reduce_algorithm`` (auto,
    tree, direct) and ``broadcast_algorithm`` (those and ring: the pipelined chain, TCP
    groups only) pick the shape within the group's family: shared memory on one host, else
    TCP. ``tree_arity``: the tree an explicit ``"tree"`` builds, ``"binomial"`` (the
    default) or ``k >= 2`` for a k-ary tree (Note [Trees] in csrc/cpu/algo/tree.h); ``"auto"``
    takes the arity of the row it picks. What auto picks is one table, with where each
    threshold came from: ``selection_table()`` (Note [Selection table] in
    csrc/cpu/algo/select.cc); ``meshcoll-bench --algo all`` measures every choice side by side.
    ``max_segment_bytes``: the pipelining segment of ring, tree and chain algorithms.
    ``local_*`` and ``global_*``: the algorithm of a hierarchical all_reduce's or broadcast's
    step inside each host (shared memory) and between the hosts' leaders (TCP), on groups
    that span hosts (Note [Hierarchy] in hierarchy.py; the call's own algorithm is then
    auto: a named one runs flat)."""

    def __init__(self, algorithm: AlgorithmName = "auto", *,
                 tree_threshold_bytes: int = _DEFAULTS["tree_threshold_bytes"],
                 hd_threshold_bytes: int = _DEFAULTS["hd_threshold_bytes"],
                 max_segment_bytes: int = _DEFAULTS["max_segment_bytes"],
                 tree_arity: Union[int, str] = "binomial", reduce_algorithm: str = "auto",
                 broadcast_algorithm: str = "auto", local_all_reduce: str = "auto",
                 global_all_reduce: str = "auto", local_broadcast: str = "auto",
                 global_broadcast: str = "auto") -> None:
        self.algorithm = algorithm
        self.tree_threshold_bytes = tree_threshold_bytes
        self.hd_threshold_bytes = hd_threshold_bytes
        self.max_segment_bytes = max_segment_bytes
        self.tree_arity = tree_arity
        self.reduce_algorithm = reduce_algorithm
        self.broadcast_algorithm = broadcast_algorithm
        self.local_all_reduce = local_all_reduce
        self.global_all_reduce = global_all_reduce
        self.local_broadcast = local_broadcast
        self.global_broadcast = global_broadcast
        self.validate()

    @classmethod
    def single_node(cls) -> "CollectiveConfig":
        """Every rank on one host: all_reduce in shared memory (an error at the first call
        if the group has none, instead of a silent fall back to TCP), reduce and broadcast
        as the table picks for shared memory."""
        return cls("shm")

    @classmethod
    def multi_node(cls) -> "CollectiveConfig":
        """Ranks on several hosts: the automatic choices, which run hierarchically on groups
        that span hosts (shared memory inside each host, TCP between leaders) and by the TCP
        rows of the table otherwise. The same as ``CollectiveConfig()``, named for intent."""
        return cls("auto")

    def validate(self) -> "CollectiveConfig":
        names = _C.algorithm_names()
        if self.algorithm not in names:
            raise ValueError(f"CollectiveConfig: unknown algorithm {self.algorithm!r}; "
                             f"use one of {', '.join(names)}")
        for name, allowed in (("reduce_algorithm", REDUCE_ALGORITHMS),
                              ("broadcast_algorithm", BROADCAST_ALGORITHMS),
                              ("local_all_reduce", names), ("global_all_reduce", names),
                              ("local_broadcast", BROADCAST_ALGORITHMS[:3]),
                              ("global_broadcast", BROADCAST_ALGORITHMS)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"CollectiveConfig: {name} must be one of {', '.join(allowed)}, "
                                 f"got {getattr(self, name)!r}")
        a = self.tree_arity
        if a != "binomial" and (type(a) is not int or not 2 <= a <= 0xffff):
            raise ValueError("CollectiveConfig: tree_arity must be 'binomial' or an integer "
                             f"from 2 to 65535 (a k-ary tree), got {a!r}")
        for name in ("tree_threshold_bytes", "hd_threshold_bytes", "max_segment_bytes"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 0 or (name == "max_segment_bytes" and v == 0):
                raise ValueError(f"CollectiveConfig: {name} must be a positive integer, got {v!r}")
        return self

    @property
    def arity_code(self) -> int:
        """tree_arity as the core takes it: 0 for the binomial tree, else k."""
        return 0 if self.tree_arity == "binomial" else int(self.tree_arity)

    def select(self, collective: str, nbytes: int, world_size: int,
               shm: bool = False) -> Tuple[str, Union[int, str, None]]:
        """``(algorithm, tree_arity)`` that ``collective`` (all_reduce, reduce, broadcast,
        all_gather, reduce_scatter) runs for ``nbytes`` on ``world_size`` ranks, over shared
        memory (``shm``) or TCP: the configured algorithm, or with ``"auto"`` the table's row.
        The arity is ``"binomial"``, k, or None when the choice is no tree."""
        given = {"all_reduce": self.algorithm, "reduce": self.reduce_algorithm,
                 "broadcast": self.broadcast_algorithm}.get(collective, "auto")
        if given != "auto":
            return given, (self.tree_arity if given == "tree" else None)
        algo, arity = _C.select_algorithm(collective, shm, nbytes, world_size,
                                          self.tree_threshold_bytes, self.hd_threshold_bytes)
        return algo, (("binomial" if arity == 0 else arity) if algo == "tree" else None)

    def select_all_reduce(self, nbytes: int, world_size: int) -> str:
        """The algorithm an all_reduce of ``nbytes`` on ``world_size`` ranks over TCP runs:
        the configured one, or with ``"auto"`` the choice by size described above."""
        return self.select("all_reduce", nbytes, world_size)[0]

    @staticmethod
    def selection_table() -> List[Dict[str, Any]]:
        """The rows auto picks from, first match wins: collective, family (shm, tcp),
        max_ranks (0: any), threshold (a config field; "": any size), pow2_only, algorithm,
        arity and source (where the row came from)."""
        return list(_C.selection_table())

    def to_dict(self) -> Dict[str, Any]:
        """The settings as plain values (``from_dict`` makes the same config back)."""
        return {name: getattr(self, name) for name in _CONFIG_FIELDS}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "CollectiveConfig":
        """A config from ``to_dict``'s keys (all optional); an unknown key is a ValueError."""
        unknown = sorted(set(d) - set(_CONFIG_FIELDS))
        if unknown:
            raise ValueError(f"CollectiveConfig.from_dict: unknown keys {unknown}; "
                             f"known: {', '.join(_CONFIG_FIELDS)}")
        kw = dict(d)
        return cls(kw.pop("algorithm", "auto"), **kw)

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={v!r}" for k, v in self.to_dict().items())
        return f"CollectiveConfig({fields})"


_CONFIG_FIELDS = ("algorithm", "tree_threshold_bytes", "hd_threshold_bytes", "max_segment_bytes",
                  "tree_arity", "reduce_algorithm", "broadcast_algorithm", "local_all_reduce",
                  "global_all_reduce", "local_broadcast", "global_broadcast")


class Work:
    """Handle on an asynchronous operation. ``wait()`` returns the operation's result. The
    operation itself holds the arrays it reads and writes until it completes (Note [Owners]
    in csrc/python/array.h): dropping the Work and the arrays is safe."""

    __slots__ = ("_work", "_result", "_finish")

    def __init__(self, work: _C.Work, result: Any,
                 finish: Optional[Callable[[], Any]] = None) -> None:
        self._work = work
        self._result = result
        self._finish = finish

    def wait(self, timeout: Optional[float] = None, stream: Stream = None) -> Any:
        """Waits for the operation and raises its failure; returns its result. On a GPU
        group, orders ``stream`` (default: the stream the op was issued from) after the op
        instead of blocking the host (a barrier blocks the host)."""
        self._work.wait(timeout, stream)
        if self._finish is not None:
            self._result = self._finish()
            self._finish = None
        return self._result

    def synchronize(self, timeout: Optional[float] = None) -> Any:
        """Blocks the host until the operation completed; returns its result."""
        self._work.synchronize(timeout)
        return self.wait()

    def is_completed(self) -> bool:
        return self._work.is_completed()

    def exception(self) -> Optional[BaseException]:
        return self._work.exception()


def _result(w: Optional[_C.Work], result: _T, async_op: bool) -> Union[Work, _T]:
    if not async_op:
        return result
    assert w is not None  # the backend returns a Work for every async_op call
    return Work(w, result)


class Collectives:
    """The collectives of a group, each documented here once (Note [One source of truth]).
    What they work on is set up by ProcessGroup: the group's backend, how it allocates
    outputs (``_arrays``), its CUDA device (None on the CPU) and its ``config``."""

    _backend: Union[_C.CpuBackend, _C.NcclBackend, _C.MpiBackend]
    _arrays: Union[Type[HostArrays], Type[CudaArrays]]
    _device: Optional[int]
    config: CollectiveConfig

    def _nccl_backend(self) -> _C.NcclBackend:
        """The backend, for calls only an NCCL group makes (its callers check first)."""
        assert isinstance(self._backend, _C.NcclBackend)
        return self._backend

    def _mpi_backend(self) -> _C.MpiBackend:
        """The backend, for calls only an MPI group makes (its callers check first)."""
        assert isinstance(self._backend, _C.MpiBackend)
        return self._backend

    def _cpu_backend(self) -> _C.CpuBackend:
        """The backend, for calls only a CPU group makes (its callers check first)."""
        assert isinstance(self._backend, _C.CpuBackend)
        return self._backend

    # ---- identity: what every collective needs -----------------------------------------
    @property
    def rank(self) -> int:
        return self._backend.rank

    @property
    def size(self) -> int:
        return self._backend.size

    # ---- arrays ---------------------------------------------------------------------
    def _view(self, x: Array, what: str, writable: bool = False,
              stream: Stream = None) -> _C.Array:
        """``x`` as this group's backend reads it (every check, once): a ``_C.Array`` with
        shape, dtype and size, which the collectives take in place of ``x``."""
        return self._backend.view(x, what, writable, stream)

    def _look(self, x: Array, what: str, stream: Stream = None) -> Union[np.ndarray, _C.Array]:
        """What a method needs to know of ``x`` (shape, size, dtype) before the call: a numpy
        array as it is (the backend reads and checks it in the call itself: no second read
        on the hot path), anything else read once through ``_view``."""
        return x if type(x) is np.ndarray else self._view(x, what, stream=stream)

    def _as_array(self, x: Array, what: str, writable: bool = False) -> Array:
        """``x`` checked by the backend; on the CPU backend, a numpy view of it (for code
        that reshapes, as the partition and DDP helpers do)."""
        v = self._backend.view(x, what, writable)
        return v if self._arrays.device_memory else host_view(x)

    def _empty(self, shape: Union[int, Sequence[int]], like: Array,
               dtype: Optional[str] = None) -> Array:
        """A new array of ``shape`` where this backend works, like ``like`` (an array or the
        ``_C.Array`` of one): its dtype unless ``dtype`` is named, its framework and device."""
        if isinstance(like, _C.Array):
            # A buffer-protocol object (bytearray, memoryview, array.array) has no dtype of its
            # own: the backend's reading of it has (its format), and the result is numpy.
            if dtype is None and not hasattr(like.obj, "dtype"):
                dtype = like.dtype
            like = like.obj
        return self._arrays.empty(shape, like, dtype)

    def _fast(self, x: Array) -> bool:
        """Whether ``x`` takes the one-call synchronous path (Note [Synchronous gathers]): a
        numpy array on a CPU group, a framework array with a shape on a GPU group (the backend
        reads and checks it in the call; the output is made like it, by the group's arrays)."""
        if type(x) is np.ndarray:
            return not self._arrays.device_memory
        return self._arrays.device_memory and hasattr(x, "shape")

    # ---- collectives ----------------------------------------------------------------
    @_collective
    def all_reduce(self, x: Array, op: ReduceOpName = "sum", *, async_op: bool = False,
                   timeout: Optional[float] = None, algorithm: Optional[AlgorithmName] = None,
                   stream: Stream = None) -> Any:
        """Reduce ``x`` across the group, in place: every rank ends with ``op`` over every
        rank's ``x`` (same shape and dtype on every rank). Returns ``x``, or a Work.
        ``algorithm`` (CPU groups): "auto" (default: the group's ``config``), "ring",
        "tree" (of ``config.tree_arity``), "halving_doubling", "direct" (or "centralized")
        or "shm" (shared-memory groups only)."""
        cfg = self.config
        algo = cfg.algorithm if algorithm is None else algorithm
        if not async_op:
            # The hot path: one C++ call that reads x, runs and returns (Note
            # [all_reduce_sync] in bind_backend.cc), which reads tree_arity itself.
            self._backend.all_reduce_sync(x, op, timeout, stream, algo, cfg.max_segment_bytes,
                                          cfg.tree_threshold_bytes, cfg.hd_threshold_bytes,
                                          cfg.tree_arity, cfg.local_all_reduce,
                                          cfg.global_all_reduce)
            return x
        w = self._backend.all_reduce(x, x, op, timeout, stream, True, algo,
                                     cfg.max_segment_bytes, cfg.tree_threshold_bytes,
                                     cfg.hd_threshold_bytes, cfg.arity_code,
                                     cfg.local_all_reduce, cfg.global_all_reduce)
        return _result(w, x, True)

    @_collective
    def reduce(self, x: Array, dst: int = 0, op: ReduceOpName = "sum", *, async_op: bool = False,
               timeout: Optional[float] = None, algorithm: Optional[str] = None,
               stream: Stream = None) -> Any:
        """Reduce ``x`` onto group rank ``dst``, in place there; other ranks' ``x`` is
        unchanged. Returns ``x``, or a Work. ``algorithm`` (CPU groups): "auto" (default:
        the group's ``config.reduce_algorithm``), "tree" (of ``config.tree_arity``) or
        "direct" (every rank to ``dst``), over the group's shared memory or TCP."""
        cfg = self.config
        algo = cfg.reduce_algorithm if algorithm is None else algorithm
        if not async_op:  # one C++ call (Note [Rooted in-place calls] in bind_backend.cc)
            self._backend.reduce_sync(x, dst, op, timeout, stream, algo, cfg.tree_arity,
                                      cfg.max_segment_bytes)
            return x
        return _result(self._backend.reduce(x, x, dst, op, timeout, stream, async_op, algo,
                                            cfg.arity_code, cfg.max_segment_bytes), x, async_op)

    @_collective
    def broadcast(self, x: Array, src: int = 0, *, async_op: bool = False,
                  timeout: Optional[float] = None, algorithm: Optional[str] = None,
                  stream: Stream = None) -> Any:
        """Copy ``x`` from group rank ``src`` into every rank's ``x``, in place. Returns
        ``x``, or a Work. ``algorithm`` (CPU groups): "auto" (default: the group's
        ``config.broadcast_algorithm``), "tree" (of ``config.tree_arity``), "direct" (``src``
        to every rank) or "ring" (a pipelined chain; TCP groups only)."""
        cfg = self.config
        algo = cfg.broadcast_algorithm if algorithm is None else algorithm
        if not async_op:  # one C++ call (Note [Rooted in-place calls] in bind_backend.cc)
            self._backend.broadcast_sync(x, src, timeout, stream, algo, cfg.tree_arity,
                                         cfg.max_segment_bytes, cfg.local_broadcast,
                                         cfg.global_broadcast)
            return x
        return _result(self._backend.broadcast(x, src, timeout, stream, async_op, algo,
                                               cfg.arity_code, cfg.max_segment_bytes,
                                               cfg.local_broadcast, cfg.global_broadcast),
                       x, async_op)

    @_collective
    def all_gather(self, x: Array, out: Optional[Array] = None, *, async_op: bool = False,
                   timeout: Optional[float] = None, stream: Stream = None) -> Any:
        """Every rank's ``x`` stacked along a new axis 0: shape ``(size, *x.shape)``,
        written into ``out`` (or a new array of ``x``'s framework). Returns it, or a Work.
        ``x`` may be this rank's block of ``out`` (in place). On an NCCL group, a numpy
        array (small metadata) is exchanged through the communicator and returned as numpy
        (blocking)."""
        if not async_op and out is not None and self._device is not None \
                and type(x) is not np.ndarray:
            return self._backend.all_gather_sync(x, out, timeout, stream)  # a GPU's hot path
        if self._arrays.device_memory and isinstance(x, np.ndarray):
            if out is not None or async_op:
                raise ValueError("all_gather of a host (numpy) array takes no out= or async_op")
            return self._host_all_gather(x, timeout)
        if not async_op and self._fast(x):
            # Note [Synchronous gathers] in bind_backend.cc: one C++ call, which makes a CPU
            # group's out.
            if out is None and self._arrays.device_memory:
                out = self._arrays.empty((self.size,) + tuple(x.shape), x)
            return self._backend.all_gather_sync(x, out, timeout, stream)
        v = self._look(x, "all_gather: x", stream)
        shape = (self.size,) + tuple(v.shape)
        out = self._empty(shape, v) if out is None else out
        w = self._backend.all_gather(v, out, [v.size] * self.size, False, timeout, stream,
                                     async_op)
        return _result(w, out, async_op)

    @_collective
    def all_gather_v(self, x: Array, *, timeout: Optional[float] = None,
                     stream: Stream = None) -> Tuple[Any, List[int]]:
        """Concatenate each rank's ``x`` along axis 0, where ranks may hold different numbers
        of rows (same trailing shape). Returns ``(concatenation, rows per rank)``. Blocks."""
        self._refuse_in_block("all_gather_v")
        # Checked in full before the metadata exchange: a bad array must raise before
        # anything is sent (the backend would check it only after the exchange).
        v = self._view(x, "all_gather_v: x", stream=stream)
        n = rows(v, "all_gather_v")
        row_elems = math.prod(v.shape[1:])
        meta = self._exchange(np.array([n, row_elems], np.int64), "all_gather_v", timeout)
        counts = [int(c) for c in meta[:, 0]]
        if len(set(int(e) for e in meta[:, 1])) != 1:
            raise _C.MismatchError(
                f"all_gather_v: ranks' arrays differ in their trailing shape (elements per row "
                f"by rank: {[int(e) for e in meta[:, 1]]}); only axis 0 may differ")
        out = self._empty((sum(counts),) + tuple(v.shape[1:]), v)
        self._backend.all_gather(v, out, [c * row_elems for c in counts], True, timeout, stream,
                                 False)
        return out, counts

    @_collective
    def reduce_scatter(self, x: Array, out: Optional[Array] = None, op: ReduceOpName = "sum", *,
                       async_op: bool = False, timeout: Optional[float] = None,
                       stream: Stream = None) -> Any:
        """Reduce ``x`` across ranks and keep this rank's slice of axis 0 (which must divide
        evenly by the group size): shape ``(x.shape[0] // size, *x.shape[1:])``, written into
        ``out`` (or a new array; ``out`` may be this rank's block of ``x``). Returns it, or a
        Work."""
        if not async_op and out is not None and self._device is not None:
            return self._backend.reduce_scatter_sync(x, out, op, timeout, stream)  # hot path
        if not async_op and self._fast(x):
            # Note [Synchronous gathers] in bind_backend.cc: one C++ call, which checks x's
            # rows and makes a CPU group's out.
            if out is None and self._arrays.device_memory:
                shape = tuple(x.shape)
                if shape and shape[0] % self.size == 0:  # else the call raises, naming them
                    out = self._arrays.empty((shape[0] // self.size,) + shape[1:], x)
            return self._backend.reduce_scatter_sync(x, out, op, timeout, stream)
        v = self._look(x, "reduce_scatter: x", stream)
        n = rows(v, "reduce_scatter")
        if n % self.size:
            raise ValueError(f"reduce_scatter: axis 0 has {n} rows, not divisible by the group "
                             f"size {self.size}; use reduce_scatter_v for uneven splits")
        shape = (n // self.size,) + tuple(v.shape[1:])
        out = self._empty(shape, v) if out is None else out
        w = self._backend.reduce_scatter(v, out, [v.size // self.size] * self.size, op, False,
                                         timeout, stream, async_op)
        return _result(w, out, async_op)

    @_collective
    def reduce_scatter_v(self, x: Array, counts: Sequence[int], op: ReduceOpName = "sum", *,
                         timeout: Optional[float] = None, stream: Stream = None) -> Any:
        """Reduce ``x`` across ranks and keep rows ``[sum(counts[:rank]), +counts[rank])``.
        ``counts`` (rows per rank) must be the same on every rank: ranks that pass different
        counts get MismatchError. Returns this rank's rows (a new array). Blocks."""
        v = self._look(x, "reduce_scatter_v: x", stream)
        n = rows(v, "reduce_scatter_v")
        counts = [int(c) for c in counts]
        if len(counts) != self.size or any(c < 0 for c in counts) or sum(counts) != n:
            raise ValueError(f"reduce_scatter_v: counts {counts} must have {self.size} "
                             f"non-negative entries summing to axis 0's length {n}")
        row_elems = math.prod(v.shape[1:])
        out = self._empty((counts[self.rank],) + tuple(v.shape[1:]), v)
        self._backend.reduce_scatter(v, out, [c * row_elems for c in counts], op, True, timeout,
                                     stream, False)
        return out

    @_collective
    def all_to_all(self, x: Array, out: Optional[Array] = None, *, async_op: bool = False,
                   timeout: Optional[float] = None, stream: Stream = None) -> Any:
        """Block i of ``x``'s axis 0 goes to rank i; ``out``'s block j comes from rank j
        (``out``: a new array of ``x``'s shape unless given; it may share no memory with
        ``x``).
        Returns ``out``, or a Work. On an NCCL group, a numpy array (small metadata) is
        exchanged through the communicator and returned as numpy (blocking)."""
        if self._arrays.device_memory and isinstance(x, np.ndarray):
            if out is not None or async_op:
                raise ValueError("all_to_all of a host (numpy) array takes no out= or async_op")
            return self._host_all_to_all(x, timeout)
        v = self._look(x, "all_to_all: x", stream)
        n = rows(v, "all_to_all")
        if n % self.size:
            raise ValueError(f"all_to_all: axis 0 has {n} rows, not divisible by the group size "
                             f"{self.size}; use all_to_all_v for uneven splits")
        out = self._empty(tuple(v.shape), v) if out is None else out
        blk = v.size // self.size
        w = self._backend.all_to_all(v, out, [blk] * self.size, [blk] * self.size, False, timeout,
                                     stream, async_op)
        return _result(w, out, async_op)

    @_collective
    def all_to_all_v(self, x: Array, send_counts: Sequence[int], *,
                     timeout: Optional[float] = None,
                     stream: Stream = None) -> Tuple[Any, List[int]]:
        """Rows ``send_counts[i]`` of ``x`` (in order) go to rank i. Returns ``(received rows
        concatenated in rank order, rows received from each rank)``. Blocks."""
        self._refuse_in_block("all_to_all_v")
        # Checked in full before the metadata exchange: a bad array must raise before
        # anything is sent (the backend would check it only after the exchange).
        v = self._view(x, "all_to_all_v: x", stream=stream)
        n = rows(v, "all_to_all_v")
        send_counts = [int(c) for c in send_counts]
        if len(send_counts) != self.size or any(c < 0 for c in send_counts) or sum(send_counts) != n:
            raise ValueError(f"all_to_all_v: send_counts {send_counts} must have {self.size} "
                             f"non-negative entries summing to axis 0's length {n}")
        row_elems = math.prod(v.shape[1:])
        recv_counts = [int(c) for c in self._exchange(np.array(send_counts, np.int64),
                                                      "all_to_all_v", timeout)]
        out = self._empty((sum(recv_counts),) + tuple(v.shape[1:]), v)
        self._backend.all_to_all(v, out, [c * row_elems for c in send_counts],
                                 [c * row_elems for c in recv_counts], True, timeout, stream,
                                 False)
        return out, recv_counts

    @_collective
    def gather(self, x: Array, dst: int = 0, *, timeout: Optional[float] = None,
               stream: Stream = None) -> Optional[Any]:
        """On ``dst``: every rank's ``x`` stacked along a new axis 0 (a new array); elsewhere
        None. Blocks."""
        v = self._look(x, "gather: x", stream)
        me = self.rank == dst
        out = self._empty((self.size,) + tuple(v.shape) if me else 0, v)
        self._backend.gather(v, out, [v.size] * self.size, dst, timeout, stream, False)
        return out if me else None

    @_collective
    def scatter(self, x: Optional[Array], src: int = 0, *, out: Optional[Array] = None,
                timeout: Optional[float] = None, stream: Stream = None) -> Any:
        """Rank ``src`` passes ``x`` of shape ``(size, *s)``; every rank gets its block of
        shape ``s`` (in ``out``, or a new array; on ``src``, ``out`` may be ``x[src]``, in
        place). Other ranks pass ``out`` (shape ``s``) and ``x=None``, or an ``x`` of the full
        shape. Returns the block. Blocks."""
        v = None
        if x is not None:
            # Read, not looked at: off the root x never reaches the backend, yet must be sound.
            v = self._view(x, "scatter: x", stream=stream)
            if rows(v, "scatter") != self.size:
                raise ValueError(f"scatter: x must have shape (group size={self.size}, ...), "
                                 f"got {tuple(v.shape)}")
        elif self.rank == src or out is None:
            raise ValueError("scatter: pass x (the root) or out= (this rank's block)")
        if out is None:
            assert v is not None  # without x, out= is required (raised above)
            out = self._empty(tuple(v.shape[1:]), v)
        o = self._look(out, "scatter: out", stream)
        # The block is x's row where x is given (the root), else out.
        block = v.size // self.size if v is not None else o.size
        x = v if self.rank == src else self._empty(0, o)
        self._backend.scatter(x, o, [block] * self.size, src, timeout, stream, False)
        return out

    @_collective
    def send(self, x: Array, peer: int, tag: int = 0, *, timeout: Optional[float] = None,
             stream: Stream = None) -> None:
        """Send ``x`` to group rank ``peer``; returns once sent (CPU) or enqueued (GPU).
        Sends and receives between a pair of ranks match in order; ``tag`` in [0, 2**32)
        must match the receiver's. Point to point always goes over TCP on CPU groups."""
        # One C++ call (Note [Synchronous point-to-point] in bind_backend.cc).
        self._backend.send_sync(x, peer, _tag(tag), timeout, stream)

    @_collective
    def recv(self, x: Array, peer: int, tag: int = 0, *, timeout: Optional[float] = None,
             stream: Stream = None) -> Any:
        """Receive into ``x`` (in place, writable) from group rank ``peer``; returns ``x``."""
        self._backend.recv_sync(x, peer, _tag(tag), timeout, stream)
        return x

    @_collective
    def isend(self, x: Array, peer: int, tag: int = 0, *, timeout: Optional[float] = None,
              stream: Stream = None) -> Work:
        """``send`` without waiting: returns a Work whose ``wait()`` returns None."""
        return Work(self._backend.send(x, peer, _tag(tag), timeout, stream), None)

    @_collective
    def irecv(self, x: Array, peer: int, tag: int = 0, *, timeout: Optional[float] = None,
              stream: Stream = None) -> Work:
        """``recv`` without waiting: returns a Work whose ``wait()`` returns ``x``."""
        return Work(self._backend.recv(x, peer, _tag(tag), timeout, stream), x)

    @_collective
    def barrier(self, *, async_op: bool = False, timeout: Optional[float] = None,
                stream: Stream = None) -> Optional[Work]:
        """Every member arrives before any returns (on GPUs too: the host blocks). Returns
        None, or a Work."""
        return _result(self._backend.barrier(timeout, stream, async_op), None, async_op)

    def _refuse_in_block(self, what: str) -> None:
        """Calls that exchange counts before the data wait for a result: not in a block."""
        if self._backend.coalescing:
            raise ValueError(f"{what}: exchanges its counts and waits for them before the "
                             f"data moves, and a coalesced block's ops run when the block "
                             f"ends: call it outside the block")

    def _exchange(self, x: np.ndarray, of: str, timeout: Optional[float]) -> np.ndarray:
        """The metadata round of ``of`` ("all_gather_v", "all_to_all_v", "split"): every
        rank's int64 ``x`` stacked (all_to_all_v: block i of ``x`` to rank i). On a CPU group
        it is described as its own kind, which pairs with no user call (Note [Internal
        exchanges] in csrc/comm/ledger.h)."""
        if self._arrays.device_memory:  # NCCL: host arrays travel through the communicator
            return (self._host_all_to_all(x, timeout, of) if of == "all_to_all_v"
                    else self._host_all_gather(x, timeout, of))
        out = np.empty(x.shape if of == "all_to_all_v" else (self.size,) + x.shape, x.dtype)
        self._backend.exchange(x, out, of, timeout)
        return out

    # ---- metadata of NCCL groups: host arrays through the communicator ---------------
    def _host_all_gather(self, x: np.ndarray, timeout: Optional[float],
                         of: str = "all_gather") -> np.ndarray:
        """``of``: the call it serves, as agreement describes it (a user's all_gather or
        all_to_all, or an internal exchange: Note [Internal exchanges] in
        csrc/common/op_desc.h)."""
        x = np.ascontiguousarray(x)
        raw = self._nccl_backend().host_all_gather(x.tobytes(), dtype_name(x.dtype),
                                                   list(x.shape), of, timeout)
        return np.frombuffer(raw, x.dtype).reshape((self.size,) + x.shape).copy()

    def _host_all_to_all(self, x: np.ndarray, timeout: Optional[float],
                         of: str = "all_to_all") -> np.ndarray:
        x = np.ascontiguousarray(x)
        if x.ndim == 0 or x.shape[0] % self.size:
            raise ValueError(f"all_to_all: axis 0 must divide by the group size {self.size}")
        blk = x.shape[0] // self.size
        table = self._host_all_gather(x, timeout, of)  # (size, size*blk, ...)
        return np.ascontiguousarray(table[:, self.rank * blk:(self.rank + 1) * blk]
                                    .reshape(x.shape))


def _tag(tag: int) -> int:
    if not 0 <= int(tag) < 2**32:
        raise ValueError(f"tag must be in [0, 2**32), got {tag}")
    return int(tag)
