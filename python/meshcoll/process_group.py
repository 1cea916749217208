"""ProcessGroup: rank, size, global ranks and the collective methods of one group.

A group wraps one C++ communicator (``meshcoll._C.Comm``). Ranks passed to a group's
methods (roots, peers) are ranks *within that group*; ``group.ranks`` maps them to global
ranks. Module-level functions in ``meshcoll`` call the same methods on the default (world)
group or on ``group=``.
"""

from __future__ import annotations

import hashlib
import math
import os
from typing import List, Optional, Sequence, Tuple

import numpy as np

from . import _C, _env
from .arrays import as_array, numpy_dtype, rows
from .hierarchy import Hierarchy, host_of_each_rank

_ALGO_ENV = "MESHCOLL_ALGO"


class CollectiveConfig:
    """Algorithm choice for all_reduce. ``algorithm="auto"`` picks by size and world size:
    on one host, shared memory; over TCP, direct up to 64 KiB (<= 8 ranks), tree at or below
    ``tree_threshold_bytes``, recursive halving-doubling at or below ``hd_threshold_bytes`` on
    power-of-two worlds, ring above (thresholds measured with
    bench/python/bench_algorithms.py; see README). ``MESHCOLL_ALGO`` overrides auto."""

    def __init__(self, algorithm: str = "auto", *, tree_threshold_bytes: int = 256 * 1024,
                 hd_threshold_bytes: int = 8 << 20, max_segment_bytes: int = 512 * 1024,
                 tree_arity: int = 2):
        self.algorithm = algorithm
        self.tree_threshold_bytes = tree_threshold_bytes
        self.hd_threshold_bytes = hd_threshold_bytes
        self.max_segment_bytes = max_segment_bytes
        self.tree_arity = tree_arity
        self.validate()

    def validate(self) -> "CollectiveConfig":
        if self.algorithm not in _C.algorithm_names():
            raise ValueError(f"CollectiveConfig: unknown algorithm {self.algorithm!r}; "
                             f"use one of {', '.join(_C.algorithm_names())}")
        if self.tree_arity != 2:
            raise ValueError("CollectiveConfig: tree_arity must be 2 (the binomial tree is the "
                             f"only tree implemented), got {self.tree_arity}")
        for name in ("tree_threshold_bytes", "hd_threshold_bytes", "max_segment_bytes"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 0 or (name == "max_segment_bytes" and v == 0):
                raise ValueError(f"CollectiveConfig: {name} must be a positive integer, got {v!r}")
        return self

    def select_all_reduce(self, nbytes: int, world_size: int) -> str:
        return _C.select_all_reduce(nbytes, world_size, self.tree_threshold_bytes,
                                    self.hd_threshold_bytes)


class Work:
    """Handle on an asynchronous operation. ``wait()`` returns the operation's result."""

    __slots__ = ("_work", "_result", "_keep", "_finish")

    def __init__(self, work, result, keep=(), finish=None):
        self._work = work
        self._result = result
        self._keep = keep  # arrays the C++ side reads or writes until completion
        self._finish = finish

    def wait(self, timeout: Optional[float] = None):
        self._work.wait(timeout)
        if self._finish is not None:
            self._result = self._finish()
            self._finish = None
        self._keep = ()
        return self._result

    def is_completed(self) -> bool:
        return self._work.is_completed()

    def exception(self):
        return self._work.exception()


def _done(work, result, keep, async_op, timeout, finish=None):
    if async_op:
        return Work(work, result, keep, finish)
    work.wait(None)  # what Work(...).wait() would do, without the object (host cost per call)
    return result if finish is None else finish()


def _comm_id(name: str, token: str) -> int:
    return int.from_bytes(hashlib.blake2b(f"{token}/{name}".encode(), digest_size=8).digest(), "little")


class ProcessGroup:
    """A group of ranks that communicate together. Create with ``meshcoll.init`` (the world)
    and ``meshcoll.new_group`` / ``group.split``; every member calls every collective in the
    same order."""

    is_member = True
    backend_name = "cpu"

    def __init__(self, store, ranks: Sequence[int], rank: int, name: str, *, timeout: float,
                 bind_host: str, token: str, parent: Optional["ProcessGroup"] = None):
        self._store = store
        self._ranks = list(ranks)
        self._name = name
        self._timeout = timeout
        self._bind_host = bind_host
        self._token = token
        self._children: List[object] = []
        self._next_child = 0
        self.config = CollectiveConfig(os.environ.get(_ALGO_ENV) or "auto")
        self._comm = self._make_comm(_C.PrefixStore(f"mc/{name}", store), rank, parent)
        # Every member is done with the store for this group before anyone returns: rank 0
        # may otherwise exit (closing the store) while a peer still rendezvouses through it.
        self.barrier()
        self._hier: Optional[Hierarchy] = None  # Note [Hierarchy] in hierarchy.py
        if (self._comm_transport().startswith("tcp") and len(self._ranks) > 1
                and _env.transport_from_env() == "auto"):
            hosts = host_of_each_rank(self)
            if len(set(hosts)) > 1:
                self._hier = Hierarchy.build(self, hosts) if _env.hierarchy_from_env() else None
            elif self._comm_transport().startswith("tcp (") and rank == 0:
                import warnings
                warnings.warn(f"meshcoll group {name!r}: {self._comm_transport()}; falling "
                              "back to TCP between same-host ranks", RuntimeWarning, stacklevel=3)

    # ---- backend hooks: a backend subclass (meshcoll.nccl) overrides these ----------
    def _make_comm(self, prefixed_store, rank: int, parent):
        """The C++ communicator for this group; collective over the members."""
        return _C.Comm(prefixed_store, rank, len(self._ranks), self._timeout, self._bind_host,
                       self._token, _comm_id(self._name, self._token),
                       _env.transport_from_env(), _env.shm_bytes_from_env())

    def _comm_transport(self) -> str:
        return self._comm.transport

    def _as_array(self, x, what: str, writable: bool = False):
        return as_array(x, what, writable=writable)

    def _empty(self, shape, like, dtype: Optional[str] = None):
        """A new array of ``shape`` with ``like``'s dtype (or the dtype named ``dtype``),
        where this backend works."""
        return np.empty(shape, like.dtype if dtype is None else numpy_dtype(dtype, self._name))

    def _current_stream(self, like):
        """The stream the caller computes on for arrays like ``like`` (the NCCL backend's
        ``stream=``); None on the CPU backend, which has no streams."""
        return None

    def _child(self, ranks, rank, name, timeout):
        return type(self)(self._store, ranks, rank, name, timeout=timeout or self._timeout,
                          bind_host=self._bind_host, token=self._token, parent=self)

    # ---- identity -------------------------------------------------------------------
    @property
    def rank(self) -> int:
        return self._comm.rank

    @property
    def size(self) -> int:
        return self._comm.size

    @property
    def ranks(self) -> List[int]:
        """Global rank of each member, in group-rank order."""
        return list(self._ranks)

    def global_rank(self, local: int) -> int:
        if not 0 <= local < self.size:
            raise ValueError(f"group rank {local} is out of range for a group of {self.size}")
        return self._ranks[local]

    @property
    def name(self) -> str:
        return self._name

    @property
    def transport(self) -> str:
        """"shm" when the members share memory on one host, else "tcp" (with the reason)."""
        return self._comm_transport()

    def __repr__(self) -> str:
        return f"ProcessGroup(name={self._name!r}, rank={self.rank}, size={self.size}, ranks={self._ranks})"

    # ---- collectives ----------------------------------------------------------------
    def all_reduce(self, x, op: str = "sum", *, async_op: bool = False,
                   timeout: Optional[float] = None, algorithm: Optional[str] = None):
        """Reduce ``x`` across the group, in place; returns ``x`` (or a Work)."""
        cfg = self.config
        if self._hier is not None and (algorithm or cfg.algorithm) == "auto":
            return self._hier.all_reduce(x, self._as_array(x, "all_reduce", writable=True), op,
                                         timeout, async_op)
        if not async_op and type(x) is np.ndarray:
            # The hot path: one C++ call that validates x (contiguity, writability, dtype) as
            # as_array would, runs and waits (Note [all_reduce_sync] in bind_comm.cc).
            self._comm.all_reduce_sync(x, op, cfg.algorithm if algorithm is None else algorithm,
                                       timeout, cfg.max_segment_bytes, cfg.tree_threshold_bytes,
                                       cfg.hd_threshold_bytes)
            return x
        a = self._as_array(x, "all_reduce", writable=True)
        # `blocking` positional: pybind11 matches keyword arguments by name, 0.5 us a call.
        w = self._comm.all_reduce(a, a, op, cfg.algorithm if algorithm is None else algorithm, timeout,
                                  cfg.max_segment_bytes, cfg.tree_threshold_bytes,
                                  cfg.hd_threshold_bytes, not async_op)
        if not async_op:
            w.wait()
            return x
        return Work(w, x, (a,))

    def reduce(self, x, dst: int = 0, op: str = "sum", *, async_op: bool = False,
               timeout: Optional[float] = None):
        """Reduce ``x`` onto group rank ``dst``, in place there; other ranks' ``x`` is unchanged."""
        a = self._as_array(x, "reduce", writable=True)
        w = self._comm.reduce(a, a, dst, op, timeout, not async_op)
        return _done(w, x, (a,), async_op, timeout)

    def broadcast(self, x, src: int = 0, *, async_op: bool = False, timeout: Optional[float] = None):
        """Copy ``x`` from group rank ``src`` into every rank's ``x``, in place."""
        a = self._as_array(x, "broadcast", writable=True)
        if self._hier is not None:
            if not 0 <= src < self.size:
                raise ValueError(f"broadcast: root {src} is out of range for a group of "
                                 f"{self.size} ranks (0..{self.size - 1})")
            return self._hier.broadcast(x, a, src, timeout, async_op)
        w = self._comm.broadcast(a, src, timeout, not async_op)
        return _done(w, x, (a,), async_op, timeout)

    def all_gather(self, x, out=None, *, async_op: bool = False, timeout: Optional[float] = None):
        """Every rank's ``x`` stacked along a new axis 0: shape ``(size, *x.shape)``."""
        a = self._as_array(x, "all_gather")
        out = self._empty((self.size,) + a.shape, a) if out is None else out
        o = self._as_array(out, "all_gather out", writable=True)
        if o.shape != (self.size,) + a.shape and o.size != self.size * a.size:
            raise ValueError(f"all_gather: out has shape {o.shape}, expected {(self.size,) + a.shape}")
        if self._hier is not None:
            return self._hier.all_gather(out, a, o, timeout, async_op)
        w = self._comm.all_gather(a, o, [a.size] * self.size, False, timeout,
                                  not async_op)
        return _done(w, out, (a, o), async_op, timeout)

    def all_gather_v(self, x, *, timeout: Optional[float] = None) -> Tuple[np.ndarray, List[int]]:
        """Concatenate each rank's ``x`` along axis 0, where ranks may hold different numbers
        of rows (same trailing shape). Returns ``(concatenation, rows per rank)``."""
        a = self._as_array(x, "all_gather_v")
        n = rows(a, "all_gather_v")
        row_elems = math.prod(a.shape[1:])
        meta = self.all_gather(np.array([n, row_elems], np.int64), timeout=timeout)
        counts = [int(c) for c in meta[:, 0]]
        if len(set(int(e) for e in meta[:, 1])) != 1:
            raise _C.MismatchError(
                f"all_gather_v: ranks' arrays differ in their trailing shape (elements per row "
                f"by rank: {[int(e) for e in meta[:, 1]]}); only axis 0 may differ")
        out = self._empty((sum(counts),) + a.shape[1:], a)
        self._comm.all_gather(a, out, [c * row_elems for c in counts], True, timeout, True).wait()
        return out, counts

    def reduce_scatter(self, x, out=None, op: str = "sum", *, async_op: bool = False,
                       timeout: Optional[float] = None):
        """Reduce ``x`` across ranks and keep this rank's slice of axis 0 (which must divide
        evenly by the group size): shape ``(x.shape[0] // size, *x.shape[1:])``."""
        a = self._as_array(x, "reduce_scatter")
        n = rows(a, "reduce_scatter")
        if n % self.size:
            raise ValueError(f"reduce_scatter: axis 0 has {n} rows, not divisible by the group "
                             f"size {self.size}; use reduce_scatter_v for uneven splits")
        shape = (n // self.size,) + a.shape[1:]
        out = self._empty(shape, a) if out is None else out
        o = self._as_array(out, "reduce_scatter out", writable=True)
        if o.size != math.prod(shape):
            raise ValueError(f"reduce_scatter: out has shape {o.shape}, expected {shape}")
        w = self._comm.reduce_scatter(a, o, [o.size] * self.size, op, False, timeout,
                                      not async_op)
        return _done(w, out, (a, o), async_op, timeout)

    def reduce_scatter_v(self, x, counts: Sequence[int], op: str = "sum", *,
                         timeout: Optional[float] = None) -> np.ndarray:
        """Reduce ``x`` across ranks and keep rows ``[sum(counts[:rank]), +counts[rank])``.
        ``counts`` (rows per rank) must be the same on every rank."""
        a = self._as_array(x, "reduce_scatter_v")
        n = rows(a, "reduce_scatter_v")
        counts = [int(c) for c in counts]
        if len(counts) != self.size or any(c < 0 for c in counts) or sum(counts) != n:
            raise ValueError(f"reduce_scatter_v: counts {counts} must have {self.size} "
                             f"non-negative entries summing to axis 0's length {n}")
        row_elems = math.prod(a.shape[1:])
        out = self._empty((counts[self.rank],) + a.shape[1:], a)
        self._comm.reduce_scatter(a, out, [c * row_elems for c in counts], op, True, timeout,
                                  True).wait()
        return out

    def all_to_all(self, x, out=None, *, async_op: bool = False, timeout: Optional[float] = None):
        """Block i of ``x``'s axis 0 goes to rank i; ``out``'s block j comes from rank j."""
        a = self._as_array(x, "all_to_all")
        n = rows(a, "all_to_all")
        if n % self.size:
            raise ValueError(f"all_to_all: axis 0 has {n} rows, not divisible by the group size "
                             f"{self.size}; use all_to_all_v for uneven splits")
        out = self._empty(a.shape, a) if out is None else out
        o = self._as_array(out, "all_to_all out", writable=True)
        if o.size != a.size or o is a:
            raise ValueError("all_to_all: out must be a separate array of x's size")
        blk = a.size // self.size
        w = self._comm.all_to_all(a, o, [blk] * self.size, [blk] * self.size, False, timeout,
                                  not async_op)
        return _done(w, out, (a, o), async_op, timeout)

    def all_to_all_v(self, x, send_counts: Sequence[int], *,
                     timeout: Optional[float] = None) -> Tuple[np.ndarray, List[int]]:
        """Rows ``send_counts[i]`` of ``x`` (in order) go to rank i. Returns ``(received rows
        concatenated in rank order, rows received from each rank)``."""
        a = self._as_array(x, "all_to_all_v")
        n = rows(a, "all_to_all_v")
        send_counts = [int(c) for c in send_counts]
        if len(send_counts) != self.size or any(c < 0 for c in send_counts) or sum(send_counts) != n:
            raise ValueError(f"all_to_all_v: send_counts {send_counts} must have {self.size} "
                             f"non-negative entries summing to axis 0's length {n}")
        row_elems = math.prod(a.shape[1:])
        recv_counts = self.all_to_all(np.array(send_counts, np.int64), timeout=timeout)
        recv_counts = [int(c) for c in recv_counts]
        out = self._empty((sum(recv_counts),) + a.shape[1:], a)
        self._comm.all_to_all(a, out, [c * row_elems for c in send_counts],
                              [c * row_elems for c in recv_counts], True, timeout, True).wait()
        return out, recv_counts

    def gather(self, x, dst: int = 0, *, timeout: Optional[float] = None) -> Optional[np.ndarray]:
        """On ``dst``: every rank's ``x`` stacked along a new axis 0; elsewhere None."""
        a = self._as_array(x, "gather")
        out = self._empty((self.size,) + a.shape, a) if self.rank == dst else self._empty(0, a)
        self._comm.gather(a, out, [a.size] * self.size, dst, timeout, True).wait()
        return out if self.rank == dst else None

    def scatter(self, x, src: int = 0, *, out=None, timeout: Optional[float] = None) -> np.ndarray:
        """Rank ``src`` passes ``x`` of shape ``(size, *s)``; every rank gets its block of
        shape ``s``. Other ranks pass ``out`` (shape ``s``), or an ``x`` of the full shape."""
        if self.rank == src or out is None:
            if x is None:
                raise ValueError("scatter: pass out= (this rank's block) when x is None")
            a = self._as_array(x, "scatter")
            if rows(a, "scatter") != self.size:
                raise ValueError(f"scatter: x must have shape (group size={self.size}, ...), "
                                 f"got {a.shape}")
            out = self._empty(a.shape[1:], a) if out is None else out
        o = self._as_array(out, "scatter out", writable=True)
        a = a if self.rank == src else self._empty(0, o)
        self._comm.scatter(a, o, [o.size] * self.size, src, timeout, True).wait()
        return out

    def send(self, x, peer: int, tag: int = 0, *, timeout: Optional[float] = None) -> None:
        self.isend(x, peer, tag, timeout=timeout).wait()

    def recv(self, x, peer: int, tag: int = 0, *, timeout: Optional[float] = None):
        """Receive into ``x`` (in place) from group rank ``peer``; returns ``x``."""
        return self.irecv(x, peer, tag, timeout=timeout).wait()

    def isend(self, x, peer: int, tag: int = 0, *, timeout: Optional[float] = None) -> Work:
        a = self._as_array(x, "send")
        return Work(self._comm.send(a, peer, _tag(tag), timeout), None, (a,))

    def irecv(self, x, peer: int, tag: int = 0, *, timeout: Optional[float] = None) -> Work:
        a = self._as_array(x, "recv", writable=True)
        return Work(self._comm.recv(a, peer, _tag(tag), timeout), x, (a,))

    def barrier(self, *, async_op: bool = False, timeout: Optional[float] = None):
        return _done(self._comm.barrier(timeout, blocking=not async_op), None, (), async_op, timeout)

    # ---- subgroups ------------------------------------------------------------------
    def new_group(self, ranks: Sequence[int], *, timeout: Optional[float] = None):
        """Collective over this group: every member calls it with the same global ``ranks``
        in the same order. Members get a ProcessGroup; others a NonMemberGroup."""
        ranks = [int(r) for r in ranks]
        if len(set(ranks)) != len(ranks) or not ranks:
            raise ValueError(f"new_group: ranks must be a non-empty list without duplicates, got {ranks}")
        unknown = [r for r in ranks if r not in self._ranks]
        if unknown:
            raise ValueError(f"new_group: ranks {unknown} are not members of the parent group "
                             f"(its global ranks: {self._ranks})")
        name = f"{self._name}.{self._next_child}"
        self._next_child += 1
        me = self._ranks[self.rank]
        if me not in ranks:
            child = NonMemberGroup(ranks, name)
        else:
            child = self._child(ranks, ranks.index(me), name, timeout)
        self._children.append(child)
        return child

    def split(self, color: Optional[int], key: int = 0, *, timeout: Optional[float] = None):
        """Collective: ranks with the same ``color`` form a group, ordered by (key, rank).
        ``color=None`` (or negative) joins no group and gets a NonMemberGroup."""
        c = -1 if color is None else int(color)
        table = self.all_gather(np.array([c, int(key), self._ranks[self.rank]], np.int64),
                                timeout=timeout)
        name = f"{self._name}.s{self._next_child}"
        self._next_child += 1
        if c < 0:
            child = NonMemberGroup([], name)
        else:
            members = sorted((int(k), int(g)) for cc, k, g in table if cc == c)
            ranks = [g for _, g in members]
            me = self._ranks[self.rank]
            child = self._child(ranks, ranks.index(me), f"{name}.c{c}", timeout)
        self._children.append(child)
        return child

    def destroy(self) -> None:
        """Finish queued work and close this group and every group created from it."""
        if self._hier is not None:
            self._hier.close()
        for child in self._children:
            child.destroy()
        self._children = []
        self._comm.shutdown()


class NonMemberGroup:
    """What ``new_group`` returns on ranks outside the group: it knows the members, and every
    collective raises."""

    is_member = False
    backend_name = "none"

    def __init__(self, ranks: Sequence[int], name: str):
        self.ranks = list(ranks)
        self.name = name
        self.rank = -1
        self.size = len(self.ranks)

    def __getattr__(self, attr):
        if attr.startswith("_"):
            raise AttributeError(attr)

        def not_a_member(*args, **kwargs):
            raise RuntimeError(f"{attr}: this rank is not a member of group {self.name} "
                               f"(members: global ranks {self.ranks})")
        return not_a_member

    def destroy(self) -> None:
        pass


def _tag(tag: int) -> int:
    if not 0 <= int(tag) < 2**32:
        raise ValueError(f"tag must be in [0, 2**32), got {tag}")
    return int(tag)


class _Default:
    """The process's world group and store: the one piece of module state, as in every
    collective library (``meshcoll.init`` sets it, ``meshcoll.destroy`` clears it)."""

    world: Optional[ProcessGroup] = None
    store = None


def init(backend: Optional[str] = None, *, rank: Optional[int] = None,
         world_size: Optional[int] = None, master_addr: Optional[str] = None,
         master_port: Optional[int] = None, timeout: Optional[float] = None,
         device=None, store=None, init_method: Optional[str] = None) -> ProcessGroup:
    """Join the job: rendezvous through rank 0's TCP store, connect to every rank, return
    the world group. With no arguments it reads meshcoll-run's, torchrun's, Slurm's or
    Open MPI's environment variables. ``backend``: "cpu" (the default), "nccl" (CUDA
    arrays; ``device`` defaults to the launcher's local rank), or "auto" (nccl when every
    rank has a GPU and NCCL loads, else cpu). ``store``: an existing store
    (``meshcoll.TCPStore``, client or server, or ``meshcoll.FileStore``) to rendezvous
    through instead of rank 0 hosting one; ``rank`` and ``world_size`` then come from the
    arguments or the environment as usual. ``init_method`` (else ``MESHCOLL_INIT_METHOD``),
    as torch spells it: ``"env://"`` (the default), ``"tcp://host:port"`` (the master
    address) or ``"file:///path"``: a ``FileStore`` at that path, for jobs with a shared
    filesystem and no known master address (use a path no earlier job left behind)."""
    if _Default.world is not None:
        raise RuntimeError("meshcoll.init was already called in this process; call "
                           "meshcoll.destroy() first to re-initialise")
    if backend not in (None, "auto", "cpu", "nccl"):
        raise ValueError(f"meshcoll.init: unknown backend {backend!r}; use 'cpu', 'nccl' or 'auto'")
    method = (_env.parse_init_method(init_method) if init_method is not None
              else _env.init_method_from_env())
    if method is not None and method.kind != "env" and store is not None:
        raise ValueError("meshcoll.init: pass store= or an init method naming a store, not both")
    if method is not None and method.kind == "tcp":
        for given, name, value in ((master_addr, "master_addr", method.host),
                                   (master_port, "master_port", method.port)):
            if given is not None and given != value:
                raise ValueError(f"meshcoll.init: {name}={given!r} contradicts the init "
                                 f"method's {value!r}; give one of them")
        master_addr, master_port = method.host, method.port
    file_path = method.path if method is not None and method.kind == "file" else None
    # A given store or a file needs no master address: the store is already where it is.
    rv = _env.rendezvous_from_env(rank=rank, world_size=world_size, master_addr=master_addr,
                                  master_port=master_port,
                                  need_master=store is None and file_path is None)
    timeout = float(timeout) if timeout is not None else _env.timeout_from_env()
    token = rv.token or ""
    if file_path is not None:
        store = _C.FileStore(file_path, timeout)
    elif store is None:
        store = _C.TCPStore(rv.master_addr, rv.master_port, is_server=rv.rank == 0,
                            timeout=timeout, token=token)
    bind_host = _bind_host(store)
    if backend in ("nccl", "auto"):
        from . import nccl
        if backend == "auto":
            backend = nccl.agree_on_backend(store, rv.rank, rv.world_size, timeout)
    if backend == "nccl":
        world = nccl.make_world(store, rv.rank, rv.world_size, timeout, bind_host, token,
                                device if device is not None else rv.local_rank)
    else:
        world = ProcessGroup(store, range(rv.world_size), rv.rank, "world", timeout=timeout,
                             bind_host=bind_host, token=token)
    _Default.world, _Default.store = world, store
    return world


def _bind_host(store) -> str:
    ifname = _env.socket_ifname_from_env()
    if ifname:
        import fcntl
        import socket
        import struct
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        try:
            packed = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", ifname[:15].encode()))
        except OSError as e:
            raise ValueError(f"MESHCOLL_SOCKET_IFNAME={ifname}: no IPv4 address on that "
                             f"interface ({e})") from None
        finally:
            s.close()
        return socket.inet_ntoa(packed[20:24])
    # The interface that reaches the master is the one peers can reach us on.
    local = getattr(store, "local_host", None)
    return local if local else _outbound_address()


def _outbound_address() -> str:
    """The address of the interface holding the default route (a store with no master, such
    as a file, says nothing about the network): connecting a UDP socket sends no packet. A
    host without a route gets the loopback address, enough for one host."""
    import socket
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        s.connect(("10.255.255.255", 1))
        return s.getsockname()[0]
    except OSError:
        return "127.0.0.1"
    finally:
        s.close()


def destroy() -> None:
    """Close every group and the store; init may be called again afterwards."""
    world, store = _Default.world, _Default.store
    _Default.world, _Default.store = None, None
    if world is not None:
        world.destroy()
    del store


def is_initialized() -> bool:
    return _Default.world is not None


def get_world_group() -> ProcessGroup:
    if _Default.world is None:
        raise RuntimeError("meshcoll is not initialised: call meshcoll.init() first")
    return _Default.world


def new_group(ranks: Sequence[int], *, group: Optional[ProcessGroup] = None,
              timeout: Optional[float] = None):
    return (group or get_world_group()).new_group(ranks, timeout=timeout)
