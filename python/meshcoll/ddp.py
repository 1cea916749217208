"""DataParallel: average gradients over a group while backward is still running.

    params = {"w1": w1, "b1": b1, "w2": w2, "b2": b2}      # name -> numpy array
    ddp = meshcoll.DataParallel(params, bucket_cap_mb=1)   # broadcasts params from rank 0
    for batch in shard:
        ...backward, last layer first:
        ddp.grad_ready("w2", gw2); ddp.grad_ready("b2", gb2)  # bucket full: all-reduce starts
        ddp.grad_ready("w1", gw1); ddp.grad_ready("b1", gb1)
        ddp.wait()                      # gw2, gb2, gw1, gb1 now hold the average over ranks
        ...optimizer step...; ddp.step()

The modes besides "sync" are ddp_modes.py's; bucket assignment and the layout every rank
must share (Note [Agreed layout]), ddp_layout.py's; a bucket's flight, ddp_flights.py's.

Note [Buckets]
Gradients are packed into flat buckets in reverse registration order (the order backward
produces them) by torch's DDP's rule (``assign_buckets``: one open bucket per dtype, closed
once it holds ``bucket_cap_mb``), so the same cap gives the same all-reduces as torch's;
``rebuild_buckets(order)`` lays them out again in the order a backward actually produced them
(the torch adapter does so after its first step, as torch's DDP does, with a first bucket of
1 MiB so communication starts early). The buckets, the slots and each step's bookkeeping
live in C++ (``_C.Reducer``, Note [Reducer] in csrc/reducer/reducer.h): a bucket's
all-reduce is queued the moment its last gradient arrives, strictly in bucket order (every
rank must issue the same collectives in the same order, whatever order its backward produced
gradients in), with its gradients copied in as one batch (one kernel on a GPU), and ``wait()``
copies the averages out (one kernel for all buckets on a GPU). Python runs only
``grad_ready``'s checks per gradient and nothing per bucket; a compression hook's buckets
are handed to the hook, in Python, as torch's Python comm hooks are.

Note [Stats]
Each queued all-reduce is handed to a C++ thread (``_C.CompletionStamps``, Note [Completion
stamps] in csrc/comm/stamps.h; the reducer's own for its buckets), which waits on it and
stamps the time it finished without taking the GIL (a GPU op is polled every 100 us, Note
[Quiet stamps]); what a compression hook returns that is not a meshcoll Work goes to a
Python completion thread instead, whose stamp waits for the GIL. Ops of one group complete in issue
order, so a bucket's communication time is counted from max(its launch, the previous bucket's
end) to its end: the time the worker spent on it, not its time queued behind our own
previous bucket. The part of that before ``wait()`` was called is "overlapped".

Note [Gradient buffers]
``gradient_buffer(name)`` hands out the gradient's place in its bucket, so a backward that
writes or accumulates there (torch: ``p.grad`` set to it; the adapter's
``gradient_as_bucket_view``) saves the two copies per gradient, into the bucket at
``grad_ready`` and out of it at ``wait()``. ``grad_ready`` knows such a gradient by its
address (names never handed out cost nothing more), and holds it to be the value, or under
``no_sync()`` the running sum: it is never copied or added to.

Note [Arrays]
On the CPU backend parameters and gradients are numpy arrays (or viewed as numpy through the
buffer protocol / DLPack). On the NCCL backend they are the caller's GPU arrays, PyTorch
tensors or CuPy arrays, one type for all, and DataParallel computes with their own operators
(flat buckets from the group's allocator, slice views, ``copy_`` or ``[...] =``, ``+=``,
``/=``; the reducer's copies are the backend's), so it never imports a framework. Stream
order, as torch's DDP: gradients are copied into a bucket on the caller's current stream, the bucket's all-reduce is queued after that
stream's work, and ``wait()`` makes the current stream wait for every all-reduce and queues
the write-back of the averages there, without blocking the host: the next step's work can be
queued while the last buckets are on the wire. Each bucket's end is stamped for Note [Stats]
by a thread that blocks until the device finished it; those flights are settled (counted,
and a failure raised) at the next ``wait()``, ``stats()`` or ``reset_stats()``, which block
until the device got there. A compression hook's Work is waited for on the host, as on the
CPU backend. Compression casts with the same operators.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
import weakref
from typing import (TYPE_CHECKING, Any, Callable, Dict, Iterator, List, Mapping, Optional,
                    Tuple, Union)

import numpy as np

from . import _C
from .ddp_flights import _complete, _Done, _Flight
from .ddp_layout import _address, _contiguous, _copier, _dtype_name, _numel, _operand
# Defined in ddp_modes.py and ddp_layout.py, and named here as before (meshcoll.ddp.*).
from .ddp_layout import agree_layout as agree_layout
from .ddp_layout import assign_buckets as assign_buckets
from .ddp_layout import stream_handle as stream_handle
from .ddp_modes import Asynchronous as Asynchronous
from .ddp_modes import BoundedStaleness as BoundedStaleness
from .ddp_modes import LocalSGD as LocalSGD
from .ddp_modes import _depth, _Mode
from .process_group import Work

if TYPE_CHECKING:
    from .process_group import ProcessGroup

# A compression hook: fn(group, bucket) -> a Work (anything with wait()) or None.
_Hook = Callable[["ProcessGroup", Any], Any]

_MB = 1 << 20
_FLOAT_DTYPES = {"float16": 2, "bfloat16": 2, "float32": 4, "float64": 8}  # name -> itemsize


class _Bucket:
    """A bucket as Python sees it: its names and flat array (the reducer keeps the step's
    bookkeeping), and for a hook's bucket its half-precision copy and flight."""
    __slots__ = ("names", "buf", "half", "flight")

    def __init__(self, names: List[str], buf: Any) -> None:
        self.names, self.buf = names, buf  # buf: flat array of the parameters' dtype
        self.half: Any = None  # a bf16/fp16 copy sent instead of buf (compression)
        self.flight: Optional[_Flight] = None


class DataParallel:
    """Average gradients of ``params`` (dict name -> array) over ``group``: numpy arrays on
    the CPU backend, PyTorch or CuPy GPU arrays on the NCCL backend (Note [Arrays]).

    - ``bucket_cap_mb``: bucket size limit in MiB (see Note [Buckets]); small caps mean more,
      earlier all-reduces.
    - ``buckets``: the layout itself, the names of each bucket in launch order (default:
      ``assign_buckets`` in reverse registration order with ``bucket_cap_mb``).
    - ``average``: divide the sum by the group size (else leave the sum).
    - ``broadcast_from``: group rank whose parameters every rank copies at construction
      (None: skip, the caller guarantees equal parameters).
    - ``compression``: None; ``"bf16"`` / ``"fp16"`` (send a half-precision copy of each float
      bucket and restore it; fp16 divides by the group size *before* the sum so it cannot
      overflow); or a hook ``fn(group, bucket) -> Work or None`` that replaces the all-reduce
      of one bucket. ``bucket`` is the flat array of this rank's gradients; the hook must leave
      there the *sum* over the group once its Work's ``wait()`` returns (or when it returns
      None, which counts as blocking communication, never overlapped). DataParallel divides by
      the group size afterwards when ``average``, calls ``wait()`` exactly once, from its
      completion thread, and counts ``bucket.nbytes`` as the bytes sent.
    - ``mode``: ``"sync"`` (average gradients every step) or ``LocalSGD(period)``.
    - ``symmetric``: on an NCCL group, True puts the buckets in symmetric memory (one
      ``group.empty(symmetric=True)`` arena per dtype, the buckets slices of it at the same
      offsets on every rank), so their all-reduces run NCCL's symmetric kernels where the
      group has windows (``group.symmetric_memory``); buckets that meshcoll's direct kernels
      take (256 KiB and less, on one host) run those, as ordinary ones do. A launch through
      NCCL's symmetric kernels waits on the host until every rank reaches it (the agreement
      before launch). It showed no consistent gain in ``bench/python/bench_ddp.py`` (numbers
      in docs/performance.md), so it is not the default.
    """

    def __init__(self, params: Mapping[str, object], *, group: Optional[ProcessGroup] = None,
                 bucket_cap_mb: float = 25, average: bool = True,
                 broadcast_from: Optional[int] = 0,
                 compression: Union[None, str, _Hook] = None,
                 mode: _Mode = "sync",
                 symmetric: bool = False,
                 buckets: Optional[List[List[str]]] = None) -> None:
        from .world import get_world_group
        self._group = group if group is not None else get_world_group()
        if not isinstance(params, Mapping) or not params:
            raise ValueError("DataParallel: params must be a non-empty dict name -> array")
        if not bucket_cap_mb > 0:
            raise ValueError(f"DataParallel: bucket_cap_mb must be > 0, got {bucket_cap_mb!r}")
        self._check_mode(mode, compression, symmetric)
        self._params = {str(n): _operand(self._group, p, f"DataParallel: parameter {n!r}")
                        for n, p in params.items()}
        for n, p in self._params.items():
            if isinstance(p, np.ndarray) and not p.flags.writeable:
                raise ValueError(f"DataParallel: parameter {n!r} is read-only; it is updated "
                                 "in place by the broadcast and by LocalSGD averaging")
            if _dtype_name(p) not in _FLOAT_DTYPES:
                raise TypeError(f"DataParallel: parameter {n!r} has dtype {_dtype_name(p)}; "
                                "gradients are averaged, so parameters must be floating point")
            if type(p) is not type(next(iter(self._params.values()))):
                raise TypeError(f"DataParallel: parameter {n!r} is a {type(p).__name__}, others "
                                f"are {type(next(iter(self._params.values()))).__name__}; use "
                                "one array type for all parameters")
        self._copy = _copier(next(iter(self._params.values())))
        self._mode = mode
        self._average = bool(average)
        self._half = self._compression_dtype(compression)
        self._hook: Optional[_Hook] = compression if callable(compression) else None
        self._symmetric = bool(symmetric) and self._group.backend_name == "nccl"
        self._cap = float(bucket_cap_mb) * _MB
        agree_layout(self._group, [f"{n} {tuple(p.shape)} {_dtype_name(p)}"
                                   for n, p in self._params.items()], "DataParallel")
        self._index = {n: i for i, n in enumerate(self._params)}
        if buckets is None:
            groups = assign_buckets(list(reversed(list(self._params))), self._params, [self._cap])
        else:
            groups = [[str(n) for n in names] for names in buckets]
            if sorted(n for names in groups for n in names) != sorted(self._params) or \
                    not all(groups):
                raise ValueError("DataParallel: buckets must name every parameter once, each "
                                 "bucket at least one")
        self._build_buckets(groups)

        self._given: List[Any] = []                # this step's gradient arrays, kept alive
        self._write_back: List[Tuple[Any, Any]] = []  # (gradient, slot) copied by Python
        self._stale_given: Dict[str, Any] = {}     # a stale mode's gradients of this step
        self._staleness: List[int] = []             # applied steps' ages (stale modes)
        self._step_no = 0
        # The gradient buffers handed out, by name and by address (Note [Gradient buffers])
        self._bound: set[str] = set()
        self._bound_at: Dict[int, str] = {}
        self._accumulated: set[str] = set()        # names whose slot holds a no_sync sum
        # GPU arrays: wait() orders the caller's stream instead of blocking (Note [Arrays]);
        # its flights are counted once done on the device.
        self._stream_ordered = self._group.backend_name != "cpu"
        self._unsettled: List[_Flight] = []
        self._prev_end = 0.0                       # end stamp of the last flight counted
        self._no_sync = False
        self._steps = 0
        self.reset_stats()
        # The completion thread starts with the first hook flight and ends with this object.
        self._queue: "queue.SimpleQueue[Optional[_Flight]]" = queue.SimpleQueue()
        self._thread: Optional[threading.Thread] = None
        self._finalizer = weakref.finalize(self, self._queue.put, None)
        self._stamps = _C.CompletionStamps()  # the ends of the hooks' meshcoll Works

        if broadcast_from is not None:
            self._broadcast_parameters(int(broadcast_from))

    # ---- construction ---------------------------------------------------------------
    @staticmethod
    def _check_mode(mode: Any, compression: Any, symmetric: bool) -> None:
        if not (mode == "sync" or isinstance(mode, (LocalSGD, BoundedStaleness, Asynchronous))):
            raise ValueError(f"DataParallel: mode must be 'sync', LocalSGD(period), "
                             f"BoundedStaleness(k) or Asynchronous(max_staleness), got {mode!r}")
        if isinstance(mode, LocalSGD) and compression is not None:
            raise ValueError("DataParallel: compression applies to gradients, which LocalSGD "
                             "mode never communicates (parameters are averaged in full precision)")
        if _depth(mode) > 1 and (compression is not None or symmetric):
            raise ValueError(f"DataParallel: {mode!r} keeps a set of buckets per step in flight; "
                             "it takes no compression and no symmetric buckets")

    @staticmethod
    def _compression_dtype(compression: Union[None, str, _Hook]) -> Optional[str]:
        if compression is None or callable(compression):
            return None
        if compression in ("fp16", "bf16"):
            return "float16" if compression == "fp16" else "bfloat16"
        raise ValueError(f"DataParallel: compression must be None, 'bf16', 'fp16' or a callable "
                         f"hook(group, bucket) -> Work, got {compression!r}")

    def _build_buckets(self, groups: List[List[str]]) -> None:
        # `groups`: the names of each bucket, in launch order, each in layout order (Note
        # [Buckets]). The reducer holds the buckets and each step's bookkeeping.
        self._buckets: List[_Bucket] = []
        self._slot: Dict[str, Tuple[int, Any]] = {}  # name -> (bucket index, view of its slot)
        totals = [sum(_numel(self._params[n]) for n in names) for names in groups]
        arenas = self._symmetric_arenas(groups, totals) if self._symmetric else {}
        slots: List[Tuple[int, int, int]] = [(0, 0, 0)] * len(self._params)
        for i, names in enumerate(groups):
            first = self._params[names[0]]
            total = totals[i]
            if arenas:
                arena, offsets = arenas[_dtype_name(first)]
                buf = arena[offsets[i]:offsets[i] + total]
            else:
                buf = self._group._empty(total, first)
            off = 0
            for n in names:
                p = self._params[n]
                self._slot[n] = (i, buf[off:off + _numel(p)].reshape(p.shape))
                slots[self._index[n]] = (i, off, _numel(p))
                off += _numel(p)
            b = _Bucket(names, buf)
            # Compress only buckets wider than the wire type (a bf16 bucket is sent as is).
            if self._half is not None and _FLOAT_DTYPES[_dtype_name(first)] > 2:
                b.half = self._group._empty(total, first, dtype=self._half)
            self._buckets.append(b)
        hooked = self._hook is not None or self._half is not None
        op = "avg" if self._average and not hooked else "sum"
        names_in_order = list(self._params)
        bufs = [b.buf for b in self._buckets]
        self._reducer = _C.Reducer(self._group._backend, bufs, slots, names_in_order, op,
                                   not hooked)
        self._avg_reducer: Optional[_C.Reducer] = None  # LocalSGD's, made on first use
        self._bucket_args = (bufs, slots, names_in_order)
        # The stale modes' ring: a reducer (buckets and all) per step that may be in flight;
        # views[k][name] is the slot of ring member k.
        self._ring = [self._reducer]
        self._ring_views = [{n: v for n, (_, v) in self._slot.items()}]
        for _ in range(_depth(self._mode) - 1):
            more = [self._group._empty(total, self._params[names[0]])
                    for names, total in zip(groups, totals)]
            self._ring.append(_C.Reducer(self._group._backend, more, slots, names_in_order, op,
                                         True))
            self._ring_views.append({n: more[b][o:o + c].reshape(self._params[n].shape)
                                     for n, (b, o, c) in zip(names_in_order, slots)})
        self._turn = 0  # the ring member of the step in progress
        self._inflight: List[Tuple[int, int]] = []  # (step, ring member), oldest first

    def rebuild_buckets(self, order: List[str], first_bucket_cap_mb: Optional[float] = 1.0) -> None:
        """Lay the buckets out again with the gradients in ``order`` (names, the order
        backward produces them), the first bucket cut at ``first_bucket_cap_mb`` (or the
        bucket cap, if smaller) so its
        all-reduce starts early (torch's DDP rebuilds its buckets so after its first step).
        Collective: every rank passes the same order (ranks that differ get MismatchError).
        Gradient buffers handed out before no longer belong to a bucket: ask for them again."""
        if self._given or self._accumulated:
            raise RuntimeError("rebuild_buckets: a step is in progress (gradients were given "
                               "without wait()); finish it first")
        if sorted(order) != sorted(self._params):
            raise ValueError("rebuild_buckets: order must name every parameter once")
        limits = [self._cap] if first_bucket_cap_mb is None else \
            [min(float(first_bucket_cap_mb) * _MB, self._cap), self._cap]
        self._drain()
        self._relayout(assign_buckets(list(order), self._params, limits),
                       "DataParallel.rebuild_buckets")

    @property
    def first_order(self) -> List[str]:
        """The order gradients arrived in during the first finished step (empty before)."""
        names = list(self._params)
        return [names[i] for i in self._reducer.first_order]

    _ALIGN = 512  # bytes between bucket starts in an arena (NCCL's kernels like alignment)

    def _symmetric_arenas(self, groups: List[List[str]],
                          totals: List[int]) -> Dict[str, Tuple[Any, Dict[int, int]]]:
        """dtype name -> (one symmetric array for every bucket of that dtype, bucket index ->
        offset in elements). The layout follows from the parameters alone, so it is the same
        on every rank, as symmetric kernels require."""
        layout: Dict[str, Tuple[int, Dict[int, int], Any]] = {}
        for i, names in enumerate(groups):
            first = self._params[names[0]]
            name = _dtype_name(first)
            step = max(1, self._ALIGN // _FLOAT_DTYPES[name])
            size, offsets, like = layout.get(name, (0, {}, first))
            offsets[i] = size
            layout[name] = (size + -(-totals[i] // step) * step, offsets, like)
        return {name: (self._group.empty(size, name, like=like, symmetric=True), offsets)
                for name, (size, offsets, like) in sorted(layout.items())}

    @property
    def symmetric(self) -> bool:
        """Whether the buckets live in symmetric memory (NCCL windows)."""
        return self._symmetric and all(self._group.is_symmetric(b.buf) for b in self._buckets)

    def _on_stream(self) -> Dict[str, Any]:
        """``stream=`` for the group's calls and waits: GPU arrays are ordered against the
        stream the caller computes on (Note [Arrays]); nothing on the CPU backend."""
        if not self._stream_ordered:
            return {}
        return {"stream": self._group._current_stream(self._buckets[0].buf)}

    def _stream(self) -> int:
        """The caller's current stream as the reducer takes it: a raw CUstream (0: the
        legacy default stream, and the CPU backend's "none")."""
        if not self._stream_ordered:
            return 0
        return stream_handle(self._group._current_stream(self._buckets[0].buf))

    def _broadcast_parameters(self, src: int) -> None:
        # Through the buckets: a few large broadcasts instead of one round trip per parameter.
        works = []
        on = self._on_stream()
        for b in self._buckets:
            if self._group.rank == src:
                for n in b.names:
                    self._copy(self._slot[n][1], self._params[n])
            works.append(self._group.broadcast(b.buf, src, async_op=True, **on))
        for b, w in zip(self._buckets, works):
            w.wait(**on)
            if self._group.rank != src:
                for n in b.names:
                    self._copy(self._params[n], self._slot[n][1])

    # ---- gradients ------------------------------------------------------------------
    def grad_ready(self, name: str, grad: Any) -> None:
        """Hand over the gradient of ``name``; starts its bucket's all-reduce once the bucket
        is complete. ``grad`` receives the averaged value at ``wait()``. Under ``no_sync()``
        it is added to this rank's running sum instead. A ``gradient_buffer(name)`` array is
        the gradient (or the running sum) in place: nothing is copied or added."""
        if name not in self._slot:
            known = ", ".join(list(self._slot)[:8]) + (", ..." if len(self._slot) > 8 else "")
            raise KeyError(f"grad_ready: unknown parameter {name!r} (registered: {known})")
        slot = self._ring_views[self._turn][name]
        # Given as its own buffer: already in the bucket, and the sum so far (Note [Gradient
        # buffers]); never copied or added. The very array gradient_buffer() handed out
        # needs no check; another view of it is known by its address below.
        own = grad is slot and name in self._bound
        g = grad if own else self._checked(name, grad)
        if isinstance(self._mode, LocalSGD):
            return  # gradients stay local: only validated
        if self._bound_at and not own:
            other = self._bound_at.get(_address(g))
            if other is not None and other != name:
                raise ValueError(f"grad_ready({name!r}): the gradient is the gradient_buffer "
                                 f"of {other!r}; pass each parameter its own buffer")
            own = other == name
        if self._no_sync:
            # Accumulate locally; no step bookkeeping, a name may come any number of times.
            if own:
                self._accumulated.add(name)
            elif name in self._accumulated:
                slot += g
            else:
                self._copy(slot, g)
                self._accumulated.add(name)
            return
        at = _address(slot)
        if own:
            src, out = at, 0
        elif isinstance(g, np.ndarray) and not g.flags.writeable:
            raise ValueError(f"grad_ready({name!r}): the gradient is read-only, but wait() "
                             "writes the averaged value into it")
        elif not _contiguous(g) or (isinstance(g, np.ndarray) and not g.dtype.isnative):
            # The reducer copies plain memory: a strided or byte-swapped gradient is copied
            # here, and its average back after the step.
            if name in self._accumulated:
                slot += g
            else:
                self._copy(slot, g)
            src, out = at, 0
            self._write_back.append((g, slot))
        elif name in self._accumulated:
            slot += g  # the sync step carries the no_sync sum plus this gradient
            src, out = at, _address(g)
        else:
            src = out = _address(g)
        if len(self._ring) > 1:  # a stale mode: the average comes back at a later wait()
            out = 0
            self._stale_given[name] = g
        self._ready(self._index[name], src, out, g)
        self._accumulated.discard(name)

    def _ready(self, i: int, src: int, out: int, keep: Any) -> int:
        """The reducer's ready(): gradient ``i``'s value at ``src``, its average to ``out``
        (0: stays in the bucket); ``keep`` is held until the step ends. Returns how many
        gradients are still to come. A hook's buckets are launched here, in Python."""
        stream = self._stream()
        left: int = self._reducer.ready(i, src, out, stream)
        self._given.append(keep)
        if self._hook is not None or self._half is not None:
            try:
                for k in self._reducer.take_complete(stream):
                    self._launch(self._buckets[k])
            except BaseException:
                self._abort_step()
                raise
        return left

    def _checked(self, name: str, grad: Any) -> Any:
        # The checks against the parameter (which the backend read) are the whole validation
        # of a GPU or numpy gradient: a second read costs the hot path microseconds.
        g = _operand(self._group, grad, f"grad_ready({name!r})", read=False)
        p = self._params[name]
        if type(g) is not type(p) or getattr(g, "device", None) != getattr(p, "device", None):
            raise TypeError(f"grad_ready({name!r}): the gradient is a {type(g).__name__} on "
                            f"{getattr(g, 'device', 'the host')}; the parameter is a "
                            f"{type(p).__name__} on {getattr(p, 'device', 'the host')}")
        if tuple(g.shape) != tuple(p.shape) or _dtype_name(g) != _dtype_name(p):
            raise ValueError(f"grad_ready({name!r}): gradient has shape {tuple(g.shape)} and "
                             f"dtype {_dtype_name(g)}; the parameter has shape "
                             f"{tuple(p.shape)} and dtype {_dtype_name(p)}")
        return g

    def gradient_buffer(self, name: str) -> Any:
        """The place of ``name``'s gradient in its bucket: an array of the parameter's shape
        and dtype, zeros at first (Note [Gradient buffers]). Compute or accumulate the
        gradient there and hand that array to ``grad_ready``: nothing is copied into the
        bucket, and ``wait()`` leaves the average there, copying nothing out (torch's DDP
        calls this ``gradient_as_bucket_view``). As with any gradient, do not write it
        between ``grad_ready`` and ``wait()``."""
        if name not in self._slot:
            raise KeyError(f"gradient_buffer: unknown parameter {name!r}")
        if len(self._ring) > 1:
            raise RuntimeError(f"gradient_buffer: {self._mode!r} keeps each step's gradients in "
                               "buckets of its own until a later step; hand them over as arrays")
        slot = self._slot[name][1]
        if name not in self._bound:
            slot[...] = 0  # buckets come from an allocator: uninitialised memory
            self._bound.add(name)
            if _numel(slot):  # an empty slot may share its address with the next one
                self._bound_at[_address(slot)] = name
        return slot

    def _abort_step(self) -> None:
        # A launch failed (e.g. a hook raised): let the launched buckets finish, since their
        # buffers are in use, and drop the step so the object stays usable.
        for b in self._buckets:
            if b.flight is not None:
                b.flight.finish(self._stamps)
            b.flight = None
        self._reducer.abandon()
        self._given.clear()
        self._write_back.clear()

    def _launch(self, b: _Bucket) -> None:
        """A hook's bucket (compression or a user hook), its gradients in: run the hook."""
        if not self._finalizer.alive:
            raise RuntimeError("DataParallel: used after close()")
        n = self._group.size
        t0 = time.perf_counter()
        on = self._on_stream()
        if self._hook is not None:
            work = self._hook(self._group, b.buf)
            if work is None:  # the hook communicated synchronously: time it, never overlapped
                b.flight = _Flight(None, t0, b.buf.nbytes, blocking=True)
                b.flight.t_end = time.perf_counter()  # finished: nothing to wait for
                return
            if not callable(getattr(work, "wait", None)):
                raise TypeError(f"DataParallel: the compression hook returned "
                                f"{type(work).__name__}; it must return a Work (an object "
                                "with wait()) or None once the bucket holds the sum")
            fl = _Flight(work, t0, b.buf.nbytes)
        elif b.half is not None:
            if self._half == "float16" and self._average:
                b.buf /= n  # before the sum: fp16 overflows at 65504 (buf is our own copy)
            self._copy(b.half, b.buf)
            fl = _Flight(self._group.all_reduce(b.half, op="sum", async_op=True, **on), t0,
                         b.half.nbytes)
        else:  # a bucket already in the wire type (bf16 parameters): sent as is
            fl = _Flight(self._group.all_reduce(b.buf, op="sum", async_op=True, **on), t0,
                         b.buf.nbytes)
        b.flight = fl
        work = fl.work
        if type(work) is Work and work._finish is None:  # a meshcoll Work: stamped in C++
            fl.ticket = self._stamps.add(work._work)
            return
        if self._thread is None:
            self._thread = threading.Thread(target=_complete, args=(self._queue,),
                                            name="meshcoll-ddp-completion", daemon=True)
            self._thread.start()
        fl.done = _Done()
        self._queue.put(fl)

    def wait(self) -> None:
        """Finish every bucket's all-reduce and write the averages into the gradient arrays
        given to ``grad_ready``. Under ``no_sync()`` and in LocalSGD mode nothing is sent:
        gradients stay this rank's own (LocalSGD's ``grad_ready`` only validates)."""
        if self._no_sync or isinstance(self._mode, LocalSGD):
            return
        if self._reducer.remaining:
            names = list(self._params)
            missing = [names[i] for i in self._reducer.missing()]
            more = f", ... ({len(missing)} in all)" if len(missing) > 10 else ""
            raise RuntimeError(f"wait: no gradient was given for {', '.join(missing[:10])}{more}; "
                               "call grad_ready for every parameter before wait() (the step "
                               "stays open: give them and call wait() again)")
        if len(self._ring) > 1:
            return self._wait_stale()
        if self._hook is not None or self._half is not None:
            self._finish_hooks(time.perf_counter())
        try:
            self._reducer.finish(self._stream())
            for g, slot in self._write_back:
                self._copy(g, slot)
        finally:
            self._given.clear()
            self._write_back.clear()

    def _wait_stale(self) -> None:
        """BoundedStaleness / Asynchronous: this step's all-reduces stay in flight; the given
        gradients receive an earlier step's average (or zeros), chosen by the mode."""
        t, stream = self._step_no, self._stream()
        self._inflight.append((t, self._turn))
        if isinstance(self._mode, BoundedStaleness):
            # Exactly k steps back, on every rank: finish() waits for it if it must.
            n_finish = 1 if self._inflight[0][0] == t - self._mode.staleness else 0
        else:
            # Ops of one group complete in issue order: the finished steps are the oldest.
            n_finish = 0
            while n_finish < len(self._inflight) and \
                    self._ring[self._inflight[n_finish][1]].done():
                n_finish += 1
            if len(self._inflight) == len(self._ring):  # the next step needs a free member
                n_finish = max(n_finish, 1)
        applied: Optional[Tuple[int, int]] = None
        error: Optional[BaseException] = None
        for step, k in self._inflight[:n_finish]:  # older ones are superseded and dropped
            try:
                self._ring[k].finish(stream)
                applied = (step, k)
            except BaseException as e:
                error = error or e
        del self._inflight[:n_finish]
        given, self._stale_given = self._stale_given, {}
        self._given.clear()
        busy = {m for _, m in self._inflight}
        self._turn = next(k for k in range(len(self._ring)) if k not in busy)
        self._reducer = self._ring[self._turn]
        self._step_no += 1
        if error is not None:
            raise error
        for name, g in given.items():
            if applied is None:
                g[...] = 0
            else:
                self._copy(g, self._ring_views[applied[1]][name])
        if applied is not None:
            self._staleness.append(t - applied[0])

    def set_sync_mode(self, mode: _Mode) -> None:
        """Change the mode between steps (every rank at the same step). Steps still in flight
        in a stale mode are finished and their averages dropped."""
        self._check_mode(mode, self._hook or self._half, self._symmetric)
        self._drain()
        self._mode = mode
        self._relayout(list(self.bucket_names), "DataParallel.set_sync_mode")

    def set_bucket_size(self, bucket_cap_mb: float) -> None:
        """Change ``bucket_cap_mb`` between steps (every rank at the same step): the buckets
        are formed again in their present order."""
        if not bucket_cap_mb > 0:
            raise ValueError(f"set_bucket_size: bucket_cap_mb must be > 0, got {bucket_cap_mb!r}")
        self._drain()
        order = [n for names in self.bucket_names for n in names]
        self._cap = float(bucket_cap_mb) * _MB
        self._relayout(assign_buckets(order, self._params, [self._cap]),
                       "DataParallel.set_bucket_size")

    def _drain(self) -> None:
        if self._given or self._accumulated:
            raise RuntimeError("a step is in progress (gradients were given without wait()); "
                               "finish it first")
        for _, k in self._inflight:
            self._ring[k].abandon()
        self._inflight.clear()

    def _relayout(self, groups: List[List[str]], what: str) -> None:
        """New buckets (and reducers) for ``groups``, between steps, once every rank agrees
        on them and on the mode; the statistics so far carry over."""
        agree_layout(self._group, [repr(self._mode), *map(repr, groups)], what)
        for r in (*self._ring, self._avg_reducer):  # the totals go on
            if r is not None:
                for key, v in r.stats().items():
                    self._stats[key] += v
        self._bound.clear()
        self._bound_at.clear()
        self._build_buckets(groups)

    def _finish_hooks(self, t_wait: float) -> None:
        # Every bucket was handed to the hook. Finish in order and leave each bucket's
        # average in it, for the reducer to copy out. GPU arrays: the current stream waits
        # for each all-reduce and the host goes on (Note [Arrays]).
        self._settle()
        n = self._group.size
        error: Optional[BaseException] = None
        on = self._on_stream()
        for b in self._buckets:
            fl = b.flight
            assert fl is not None  # every bucket was handed over
            b.flight = None
            fl.t_wait = t_wait
            if self._stream_ordered and fl.work is not None and self._hook is None:
                try:
                    fl.work.wait(**on)
                except BaseException as e:  # the group already failed
                    error = error or e
                self._unsettled.append(fl)
            else:
                fl.finish(self._stamps)
                self._count(fl)
                error = error or fl.error
            if error is not None:
                continue  # still drain the other flights: their buffers are in use
            if b.half is not None and self._hook is None:
                self._copy(b.buf, b.half)
                if self._half != "float16" and self._average:
                    b.buf /= n
            elif self._average:
                b.buf /= n
        if error is not None:
            self._reducer.abandon()
            self._given.clear()
            raise error

    def _count(self, fl: _Flight) -> None:
        # Note [Stats]: from max(launch, the previous flight's end) to this one's end.
        start = max(fl.t_launch, self._prev_end)
        self._prev_end = fl.t_end
        self._stats["calls"] += 1
        self._stats["bytes"] += fl.nbytes
        self._stats["comm_seconds"] += fl.t_end - start
        if not fl.blocking:
            self._stats["overlapped_seconds"] += max(0.0, min(fl.t_end, fl.t_wait) - start)

    def _settle(self) -> None:
        """Counts the hook flights whose wait() only ordered a stream, blocking until the
        device finished them; raises the first failure among them."""
        flights, self._unsettled = self._unsettled, []
        error: Optional[BaseException] = None
        for fl in flights:
            fl.finish(self._stamps)
            self._count(fl)
            error = error or fl.error
        if error is not None:
            raise error

    def sync_gradients(self, grads: Mapping[str, object]) -> Mapping[str, object]:
        """``grad_ready`` for every entry (in bucket order) then ``wait()``; returns ``grads``
        with the averaged values written in."""
        unknown = [n for n in grads if n not in self._slot]
        if unknown:
            raise KeyError(f"sync_gradients: unknown parameters {unknown}")
        for b in self._buckets:
            for n in b.names:
                if n in grads:
                    self.grad_ready(n, grads[n])
        self.wait()
        return grads

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Gradient accumulation: inside, ``grad_ready`` adds to this rank's running sum and
        nothing is sent. The next synchronised step sends (running sum + its own gradient),
        so ``wait()`` yields the group average of each rank's summed gradients."""
        if isinstance(self._mode, LocalSGD):
            raise RuntimeError("no_sync: LocalSGD mode never communicates gradients; "
                               "accumulate them yourself")
        if len(self._ring) > 1:
            raise RuntimeError(f"no_sync: {self._mode!r} averages every step; accumulate "
                               "gradients yourself before grad_ready")
        if self._given:
            raise RuntimeError("no_sync: a synchronised step is in progress (gradients were "
                               "given without wait()); finish it first")
        self._no_sync = True
        try:
            yield
        finally:
            self._no_sync = False

    # ---- parameters -----------------------------------------------------------------
    def step(self) -> None:
        """Call after each optimizer step. In LocalSGD mode every ``period``-th call replaces
        the parameters by their group average; in sync mode it only counts steps."""
        if isinstance(self._mode, LocalSGD):
            self._steps += 1
            if self._steps % self._mode.period == 0:
                self.average_parameters()

    def average_parameters(self) -> None:
        """Replace every parameter by its average over the group, through the buckets (a
        reducer of their own that averages: each parameter is its own gradient and result)."""
        if self._given:
            raise RuntimeError("average_parameters: gradients of an unfinished step are "
                               "in the buckets; call wait() first")
        if self._avg_reducer is None:
            bufs, slots, names = self._bucket_args
            self._avg_reducer = _C.Reducer(self._group._backend, bufs, slots, names, "avg", True)
        stream = self._stream()
        for b in self._buckets:  # copying bucket i+1 overlaps bucket i's all-reduce
            for n in b.names:
                at = _address(self._params[n])
                self._avg_reducer.ready(self._index[n], at, at, stream)
        self._avg_reducer.finish(stream)

    # ---- introspection --------------------------------------------------------------
    @property
    def group(self) -> ProcessGroup:
        return self._group

    @property
    def bucket_names(self) -> List[List[str]]:
        """Parameter names of each bucket, in launch order."""
        return [list(b.names) for b in self._buckets]

    def stats(self) -> Dict[str, float]:
        """Measured communication of the gradient (or LocalSGD parameter) all-reduces since
        construction or ``reset_stats()`` (see Note [Stats]): ``calls`` (bucket all-reduces),
        ``bytes`` (payload handed to them on this rank), ``comm_seconds``,
        ``overlapped_seconds`` (communication before ``wait()`` was called),
        ``overlap_fraction``, ``algbw_gbps`` (bytes / comm_seconds, in GB/s) and
        ``copied_bytes`` (gradients copied into and out of the buckets: on the CPU, large
        gradients given in place are averaged where they are, Note [In-place gradients] in
        csrc/reducer/reducer.h); in the
        stale modes ``steps_applied``, ``staleness_mean`` and ``staleness_max`` (how many steps
        old the averages handed back were). With GPU arrays it first waits until the device
        finished the all-reduces so far."""
        self._settle()
        s: Dict[str, float] = dict(self._stats)
        for r in (*self._ring, self._avg_reducer):
            if r is not None:
                for k, v in r.stats().items():
                    s[k] += v
        if len(self._ring) > 1:
            ages = self._staleness
            s["steps_applied"] = len(ages)
            s["staleness_mean"] = sum(ages) / len(ages) if ages else 0.0
            s["staleness_max"] = max(ages) if ages else 0
        t = s["comm_seconds"]
        s["overlap_fraction"] = s["overlapped_seconds"] / t if t > 0 else 0.0
        s["algbw_gbps"] = s["bytes"] / t / 1e9 if t > 0 else 0.0
        return s

    def reset_stats(self) -> None:
        if getattr(self, "_unsettled", None):
            self._settle()  # count nothing of before the reset later
        for r in (*getattr(self, "_ring", ()), getattr(self, "_avg_reducer", None)):
            if r is not None:
                r.reset_stats()
        self._staleness = []
        self._stats = {"calls": 0, "bytes": 0, "comm_seconds": 0.0, "overlapped_seconds": 0.0,
                       "copied_bytes": 0}

    def close(self) -> None:
        """Stop the completion thread (also done when the object is collected); the object
        cannot communicate afterwards."""
        self._finalizer()

    def __repr__(self) -> str:
        return (f"DataParallel({len(self._params)} parameters in {len(self._buckets)} buckets, "
                f"group={self._group.name!r}, mode={self._mode!r})")
