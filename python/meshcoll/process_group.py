"""ProcessGroup: a group of ranks, its identity (rank, size, global ranks, name), memory,
subgroups and lifecycle; its collective methods are collectives.py's (its base class).

A group wraps one C++ backend (``meshcoll._C.CpuBackend`` or ``NcclBackend``), made by the
backend factory (backends.py), which also makes the group's subgroups. Ranks passed to a
group's methods (roots, peers) are ranks *within that group*; ``group.ranks`` maps them to
global ranks. Module-level functions in ``meshcoll`` call the same methods on the default
(world) group or on ``group=``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from typing import (Any, Callable, ContextManager, Dict, Iterator, List, Literal, Optional,
                    Sequence, Tuple, Type, Union)

import numpy as np

from . import _C, _settings, mpi, nccl
from ._types import BackendName
from .arrays import HostArrays, dtype_name, numpy_dtype
from .collectives import Array, CollectiveConfig, Collectives, Stream, Work, _collective

# With the names collectives.py and arrays.py now define, imported from here as before.
__all__ = ["Array", "CallStats", "CollectiveConfig", "HostArrays", "NonMemberGroup",
           "ProcessGroup", "Stream", "Work"]

# How a group makes its subgroups: backends.make_group, handed to every group it makes.
MakeGroup = Callable[..., "ProcessGroup"]
@dataclasses.dataclass
class NamedGroups:
    """What one name stands for in a job (Note [Group names])."""
    ranks: Tuple[Tuple[int, ...], ...]  # the global ranks of each group made under it
    # The first group made under it that this rank is in (DeviceMesh.get_group); None: none.
    mine: Optional["ProcessGroup"] = None


# Note [Group names]: name -> what it stands for.
GroupNames = Dict[str, NamedGroups]


def _device_index(device: Any) -> int:
    """A CUDA device as an int: an int, or an object with ``.index`` (torch.device)."""
    index = device if isinstance(device, (int, np.integer)) else getattr(device, "index", None)
    if index is None:
        raise ValueError(f"device must be an int or an object with .index (torch.device), got "
                         f"{device!r}")
    return int(index)


@dataclasses.dataclass(frozen=True)
class CallStats:
    """One collective kind's totals in ``ProcessGroup.stats()``."""
    calls: int
    bytes: int
    seconds: float  # time this rank spent running the calls

    @property
    def bandwidth(self) -> float:
        """Bytes per second over the calls' time (0.0 if no time was measured)."""
        return self.bytes / self.seconds if self.seconds > 0 else 0.0


class ProcessGroup(Collectives):
    """A group of ranks that communicate together. Create with ``meshcoll.init`` (the world)
    and ``meshcoll.new_group`` / ``group.split``; every member calls every collective in the
    same order.

    Threads: the calls on one group are made by one thread at a time (ranks pair calls by
    their order alone). Any thread may make them, one after another (a thread pool whose
    calls follow one another is fine; ``Work.wait`` may run on any thread); for concurrent
    streams of calls, use one group per thread (``new_group``). A call made while another
    thread is issuing one on the same group, or on a CPU group while another thread's async
    call has not completed, raises ``ConcurrentCallError``, naming both threads
    (``threading.get_ident()``), and fails the group on every rank. Threads that take turns
    without ever overlapping cannot be told apart from one thread calling in some order:
    their calls pair in whatever order each rank made them.

    A group holds one backend (``meshcoll._C.CpuBackend`` or ``NcclBackend``, the one C++
    contract of csrc/comm/backend.h): every collective (collectives.py) goes straight to it,
    whatever the backend. Ranks passed to methods (roots, peers) are ranks *within this
    group*. ``stream=`` (NCCL groups only): the CUDA stream the op runs on; see
    meshcoll.nccl."""

    # Literal: ``if g.is_member:`` narrows what new_group and split return to a ProcessGroup.
    is_member: Literal[True] = True
    _monitored_calls = 0  # calls of monitored_barrier on this group (monitor.py)

    def __init__(self, store: _C.Store, ranks: Sequence[int], name: str,
                 backend: Union[_C.CpuBackend, _C.NcclBackend, _C.MpiBackend], *,
                 kind: BackendName,
                 arrays: Union[Type[HostArrays], Type[nccl.CudaArrays]], device: Optional[int],
                 config: CollectiveConfig, timeout: float, bind_host: str, token: str,
                 options: _settings.GroupOptions, make_group: MakeGroup,
                 label: Optional[str] = None, names: Optional[GroupNames] = None) -> None:
        """Made by backends.make_group (``meshcoll.init``, ``new_group``, ``split``), which
        made ``backend`` and finishes the group's setup. ``name`` keys the group in the
        store; ``label`` is what ``group.name`` says (new_group's name=, else ``name``)."""
        self._store = store
        self._label = name if label is None else label
        # Note [Group names]: the job's named groups, one table for all its groups.
        self._names: GroupNames = {} if names is None else names
        self._agreements = 0  # layout agreements so far (ddp.agree_layout)
        self._options = options
        self._ranks = list(ranks)
        self._name = name
        self._timeout = timeout
        self._bind_host = bind_host
        self._token = token
        self._children: List[Union[ProcessGroup, NonMemberGroup]] = []
        self._next_child = 0
        self._make_group = make_group
        self.backend_name = kind
        self._backend = backend
        self._arrays = arrays
        self._device = device
        self.config = config
        # Note [Hierarchy] in hierarchy.py: a multi-host group's children, set by the factory.
        self._hier: Optional[Any] = None

    # ---- memory ---------------------------------------------------------------------
    def empty(self, shape: Union[int, Sequence[int]], dtype: Any = None, *, like: Array = None,
              symmetric: bool = False, timeout: Optional[float] = None) -> Array:
        """A new array of ``shape`` where this group communicates: numpy on a CPU group; on an
        NCCL group, a PyTorch tensor or CuPy array (``like``'s framework; PyTorch when
        ``like`` is None) on the group's device. ``dtype``: a name ("float32", "bfloat16"), a
        numpy or framework dtype; default ``like``'s, else float32.

        ``symmetric=True`` on an NCCL group is collective: every rank calls it with the same
        shape and dtype, in the same order as its other calls (ranks that disagree get
        MismatchError). The memory comes from ncclMemAlloc and is registered as a symmetric
        window of this group (NCCL 2.27+), so collectives on it run NCCL's symmetric kernels
        (lower latency, less GPU time). The rule: every rank passes the same offsets into
        these arrays (the same slices of the same allocation); ranks that pass different ones,
        or ordinary memory where a peer passes a window, get MismatchError from the agreement
        check, before any kernel starts: a call on symmetric memory waits on the host until
        every rank makes it (NCCL's symmetric kernels do not end at an abort).
        ``symmetric_memory`` says whether windows are available here; where they are not, the
        array is ordinary memory, and ``is_symmetric(x)`` says which an array is. Allocate
        once and reuse: ncclMemAlloc rounds up to its granularity (MiBs), and dropped arrays
        are freed, after a device synchronize as cudaFree does, at the group's next symmetric
        allocation, at ``destroy()``, or at its next call once they add up to 1 GiB.
        ``destroy()`` deregisters the windows; arrays still held stay valid memory."""
        return self._new(shape, dtype, like, symmetric, timeout, zero=False)

    def zeros(self, shape: Union[int, Sequence[int]], dtype: Any = None, *, like: Array = None,
              symmetric: bool = False, timeout: Optional[float] = None) -> Array:
        """``empty`` filled with zeros."""
        return self._new(shape, dtype, like, symmetric, timeout, zero=True)

    def _new(self, shape: Union[int, Sequence[int]], dtype: Any, like: Array, symmetric: bool,
             timeout: Optional[float], zero: bool) -> Array:
        shape = (int(shape),) if isinstance(shape, (int, np.integer)) else tuple(int(s) for s in shape)
        if dtype is None:
            dtype = like.dtype if like is not None else "float32"
        name = dtype if isinstance(dtype, str) else dtype_name(dtype)
        if not self._arrays.device_memory:
            return (np.zeros if zero else np.empty)(shape, numpy_dtype(name, "empty"))
        # Device memory: an NCCL group, whose _arrays are CudaArrays and _device is set.
        backend = self._nccl_backend()
        assert self._device is not None
        if symmetric and not backend.symmetric_unavailable():
            buf = backend.alloc_symmetric(list(shape), name, zero, timeout)
            return nccl.CudaArrays.framework(like).from_dlpack(buf)
        return nccl.CudaArrays.new(shape, name, like, self._device, zero)

    @property
    def symmetric_memory(self) -> str:
        """What ``empty(symmetric=True)`` gives on this group: "nccl windows" (ncclMemAlloc
        memory registered as symmetric windows), or "unavailable: <why>" (ordinary memory)."""
        if not self._arrays.device_memory:
            return ("unavailable: symmetric windows are an NCCL feature; the CPU backend reads "
                    "peers' memory through shared memory already")
        why = self._nccl_backend().symmetric_unavailable()
        return f"unavailable: {why}" if why else "nccl windows"

    @property
    def direct_kernels(self) -> str:
        """Whether small all_reduce, all_gather and reduce_scatter calls of this group run
        meshcoll's direct kernels instead of NCCL's: "on (calls up to N bytes)", or
        "off: <why>" (Note [Direct kernels] in csrc/nccl/direct/direct.h).
        MESHCOLL_NCCL_DIRECT_BYTES sets the size limit (0: off)."""
        if not self._arrays.device_memory:
            return "off: direct kernels serve NCCL groups"
        backend = self._nccl_backend()
        why = backend.direct_unavailable()
        return f"off: {why}" if why else f"on (calls up to {backend.direct_bytes()} bytes)"

    def is_symmetric(self, x: Array) -> bool:
        """Whether ``x`` lies in one symmetric window of this group (``empty(symmetric=True)``
        memory, or a slice of it)."""
        if not self._arrays.device_memory:
            return False
        v = self._backend.view(x, "is_symmetric: x")
        return bool(self._nccl_backend().in_window(v.ptr, v.nbytes))

    def _next_agreement(self) -> int:
        """The number of this group's next layout agreement (``ddp.agree_layout``): every
        rank counts its own alike, so one agreement meets under one store key."""
        self._agreements += 1
        return self._agreements

    def _current_stream(self, like: Array) -> Stream:
        """The stream the caller computes on for arrays like ``like`` (None on the CPU)."""
        return self._arrays.current_stream(like)

    # Note [Agreeing on a new group's request]
    # Ranks that call new_group with different backends must all get a MismatchError naming
    # each rank's request. An NCCL or MPI parent compares it on every rank before the split
    # (_agree_before_split). A CPU parent's members set a CPU group up among themselves,
    # and a blocking comparison first would change what they do before their links are up
    # (who listens when, how a dead rank is named): so there each member publishes its
    # request at once, without waiting (mc/<group>/request/<global rank>), and
    #  - a member asking for another backend than the parent's compares the members'
    #    requests before it starts anything (an MPI or NCCL split waits without a deadline
    #    of its own): one that differs is a MismatchError at once;
    #  - a member whose CPU setup then fails (its peer never came: it went to another
    #    backend) reads the requests, and raises the MismatchError they show instead.
    # The rank that asked for another backend fails at once, and before it raises it
    # withdraws from the CPU group's setup (Note [Withdrawn ranks] in
    # csrc/transport/tcp/tcp_transport.h), so its CPU peers, waiting for its address or its
    # connection, fail at once too. A rank that skips the call publishes nothing and is found
    # as before (Note [Calls out of step]).
    def _publish_request(self, name: str, ranks: List[int], kind: BackendName,
                         timeout: Optional[float]) -> None:
        me = self._ranks[self.rank]
        if self.backend_name != "cpu" or len(ranks) < 2 or me not in ranks:
            return
        self._store.set(f"mc/{name}/request/{me}", repr(kind),
                        timeout=self._setup_timeout(timeout))
        if kind != "cpu":
            limit = self._setup_timeout(timeout)
            end = time.monotonic() + limit
            while True:
                why, missing = self._request_mismatch(name, ranks, kind)
                if why:
                    # The members that asked for a CPU group wait for this rank in its TCP
                    # setup: tell them, so that they fail now too (Note [Withdrawn ranks]).
                    _C.withdraw_from_setup(_C.PrefixStore(f"mc/{name}", self._store),
                                           ranks.index(me), why.split(": ", 1)[1], limit)
                    raise _C.MismatchError(why)
                if not missing:
                    return
                if time.monotonic() > end:
                    raise _C.TimeoutError(
                        f"rank {me}: setting up this group timed out after {limit:g} s: "
                        f"rank(s) {', '.join(map(str, missing))} never called new_group"
                        f"({ranks}); they are stuck, or did not create this group")
                time.sleep(0.01)

    def _request_mismatch(self, name: str, ranks: List[int],
                          kind: BackendName) -> Tuple[str, List[int]]:
        """The MismatchError's text when a member of new group ``name`` asked for another
        backend than ``kind`` ("" when none did, so far), and the members not heard yet."""
        asked: Dict[str, List[int]] = {}
        missing = []
        for g in ranks:
            key = f"mc/{name}/request/{g}"
            if g == self._ranks[self.rank]:
                theirs = repr(kind)
            elif self._store.check([key], timeout=1.0):
                theirs = bytes(self._store.get(key, timeout=1.0)).decode()
            else:
                missing.append(g)
                continue
            asked.setdefault(theirs, []).append(g)
        if len(asked) < 2:
            return "", missing
        held = " but ".join(f"{k} on rank {', '.join(map(str, gs))}"
                            for k, gs in sorted(asked.items(), key=lambda kv: kv[1][0]))
        return (f"rank {self._ranks[self.rank]}: new_group({ranks}): the ranks asked for "
                f"different backends: {_settings.BACKEND} is {held}. Every rank of a group "
                f"must pass the same backend= (None: the parent's)"), missing

    def _agree_before_split(self, name: str, ranks: List[int], opts: _settings.GroupOptions,
                            kind: BackendName, timeout: Optional[float],
                            label: Optional[str]) -> None:
        """Every rank of an NCCL or MPI parent takes part in the split that makes a subgroup, members
        or not (and every rank of any parent in the split of MPI's world that makes an MPI
        group): so all of them compare the new group's members, backend and check setting
        first (Note [Shared settings] in csrc/store/exchange.h). Ranks that differ get a
        MismatchError together, and the parent stays usable; compared among the members
        alone, the others would wait in ncclCommSplit until its timeout, which aborts the
        parent. A group of another backend than this one's compares its backend's settings
        among its members as it is set up (backends.make_group); here they would only add
        noise to a message about the backend itself (lists are compared entry by entry)."""
        same = kind == self.backend_name
        settings = [(_settings.MEMBERS, repr(ranks)), (_settings.NAME, repr(label)),
                    (_settings.BACKEND, repr(kind)), *(opts.shared(kind).items() if same else ())]
        _C.agree_on_settings(_C.PrefixStore(f"mc/{name}/split", self._store), self.rank,
                             self.size, settings,
                             self._setup_timeout(timeout), self._ranks)

    def _setup_timeout(self, timeout: Optional[float], call: str = "new_group") -> float:
        """A new group's setup deadline: new_group's or split's timeout= (checked as every
        call's is), else this group's."""
        return self._timeout if timeout is None else _C.check_timeout(timeout, call)

    def _child_options(self, transport: Optional[str],
                       check: Optional[str]) -> _settings.GroupOptions:
        """This group's options with new_group's overrides."""
        opts = self._options
        if transport is not None:
            if transport not in _settings.TRANSPORTS:
                raise ValueError(f"transport={transport!r}: use one of {', '.join(_settings.TRANSPORTS)}")
            opts = dataclasses.replace(opts, transport=transport)
        if check is not None:
            if check not in _settings.CHECK_MODES:
                raise ValueError(f"check={check!r}: use one of {', '.join(_settings.CHECK_MODES)}")
            opts = dataclasses.replace(opts, check=check)
        return opts

    def _child_backend(self, backend: Optional[str], device: Any,
                       ranks: List[int]) -> Tuple[BackendName, Optional[int]]:
        """new_group's backend= and device=: the new group's backend and CUDA device, checked
        on this rank before the call counts (ValueError saying what is missing)."""
        me = self._ranks[self.rank]
        call = f"new_group({ranks}, backend={backend!r})"
        if backend not in (None, "cpu", "nccl", "mpi"):
            raise ValueError(f"{call} on global rank {me}: use backend='cpu', 'nccl', 'mpi' "
                             f"or None (this group's, {self.backend_name!r})")
        kind: BackendName = backend or self.backend_name  # type: ignore[assignment]
        if kind != "nccl" or self.backend_name == "nccl":  # the device, if any, is the parent's
            if device is not None and (kind != "nccl" or _device_index(device) != self._device):
                raise ValueError(f"{call} on global rank {me}: device= is for an NCCL group of "
                                 f"a CPU or MPI group (an NCCL group's subgroups are on its own "
                                 f"device); leave it out")
            dev = self._device if kind == "nccl" else None
        else:
            ok, why = nccl.nccl_available()
            if not ok:
                raise ValueError(f"{call} on global rank {me}: NCCL is unavailable: {why}")
            if device is None:
                raise ValueError(f"{call} on global rank {me}: a {self.backend_name} group has "
                                 f"no CUDA device to give its NCCL subgroup: pass device= "
                                 f"(this rank's GPU, as to init)")
            dev = _device_index(device)
        if kind == "mpi" and self.backend_name != "mpi":
            mpi.check_startable(me, call)  # MPI itself starts once the ranks agreed
        # A CPU group needs nothing more: it runs over the job's store, which every world has.
        return kind, dev

    def _child(self, ranks: Sequence[int], rank: int, name: str, timeout: Optional[float],
               color: int = 0, options: Optional[_settings.GroupOptions] = None,
               label: Optional[str] = None, kind: Optional[BackendName] = None,
               device: Optional[int] = None) -> "ProcessGroup":
        # timeout None: the parent's; anything else is checked where the backend is made.
        # kind None: this group's backend (and device).
        opts = self._options if options is None else options
        return self._make_group(self._store, ranks, rank, name,
                                timeout=self._setup_timeout(timeout),
                                bind_host=self._bind_host, token=self._token, parent=self,
                                backend=kind or self.backend_name,
                                device=device if kind else self._device, color=color,
                                options=opts, label=label)

    # ---- identity -------------------------------------------------------------------
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
        """The name given to ``new_group`` or ``split`` (``name=``), else the one meshcoll
        made ("world", "world.0", ...)."""
        return self._label

    @property
    def device(self) -> Optional[int]:
        """The CUDA device of an NCCL group; None on the CPU backend."""
        return self._device

    @property
    def transport(self) -> str:
        """"shm" when the members share memory on one host, "tcp" (with the reason when
        shared memory was not usable), or "nccl"."""
        return self._backend.transport

    def recent_calls(self, n: int = 64) -> List[str]:
        """This rank's last ``n`` calls on this group, oldest first (the call ledger)."""
        return self._backend.recent_calls(n)

    def stats(self) -> Dict[str, "CallStats"]:
        """This rank's communication totals on this group, per collective kind (``"send/recv"``
        for point-to-point), from the call ledger: the calls that completed without error,
        their bytes (the call's count times its item size, as ranks agree on it: an all_gather
        counts the whole gathered result) and the time this
        rank spent running them. Kinds with no completed call are absent. On an NCCL group the
        calls and bytes are counted once the GPU completed them (as the group next looks:
        its watchdog does every few milliseconds), and no time (``seconds`` 0: kernels end on
        the GPU, where no host thread times them)."""
        return {kind: CallStats(calls, nbytes, ns / 1e9)
                for kind, (calls, nbytes, ns) in self._backend.stats().items()}

    def __repr__(self) -> str:
        dev = f", device={self._device}" if self._device is not None else ""
        return (f"ProcessGroup(name={self._label!r}, backend={self.backend_name!r}, "
                f"rank={self.rank}, size={self.size}, ranks={self._ranks}{dev})")

    # ---- blocks of collectives ------------------------------------------------------
    @_collective
    def coalesced(self, *, timeout: Optional[float] = None) -> ContextManager[ProcessGroup]:
        """A block of collectives that run together: on an NCCL group, every collective
        issued inside is enqueued at the block's end in one NCCL group launch, so N small
        calls cost about one launch instead of N; on a CPU group, small synchronous
        all_reduces are fused into one call at the block's end, the rest run at their call.
        Either way, a result is ready (on its stream, for GPU arrays) once the block ends,
        and Works of the block are waited on after it::

            with group.coalesced():
                for g in small_grads:
                    group.all_reduce(g)
            # every g is reduced here

        A block's calls are independent (NCCL runs them as one group, in no set order): a
        call that reads what an earlier call of the block writes, or writes what one reads
        or writes, raises ValueError. Every rank forms the same blocks (the same calls in
        each, in the same order): a difference is a MismatchError, as for any other. Calls
        that wait for a result inside the block are refused (ValueError): a synchronous
        barrier, all_gather_v, all_to_all_v, and numpy metadata exchanges on NCCL groups.
        Blocks nest; the outermost runs them.
        ``timeout`` bounds an NCCL block's enqueue at its end (default: the group's); each
        op's own timeout counts from there (a CPU block's fused all_reduce takes the shortest
        its calls gave). Arrays passed inside are held until the block ends (an async op's
        until it completes), so a temporary is safe."""
        return _Block(self, timeout)

    # ---- subgroups ------------------------------------------------------------------
    def new_group(self, ranks: Sequence[int], *, name: Optional[str] = None,
                  timeout: Optional[float] = None, transport: Optional[str] = None,
                  check: Optional[str] = None, backend: Optional[str] = None,
                  device: Any = None) -> Union["ProcessGroup", "NonMemberGroup"]:
        """Collective over this group: each of its ranks, in the new group or not, calls it
        with the same global ``ranks``, and makes its new_group and split calls in the same
        order as the others (Note [Calls out of step]). The new group's members get a
        ProcessGroup; the others a NonMemberGroup.
        ``name``: what ``group.name`` (and errors) call the group; one name stands for one
        set of ranks in a job (Note [Group names]): a name given before with other ranks is
        a ValueError on every rank.
        ``transport`` ("auto", "shm", "tcp"; CPU groups) overrides the job's for this group;
        ``check`` ("async", "strict"; NCCL groups) its agreement check (MESHCOLL_CHECK).
        ``backend`` ("cpu", "nccl", "mpi"; None: this group's): the new group's, with all of
        that backend's guarantees; ranks that ask for different ones get MismatchError. A CPU
        group runs over the job's store; an MPI group of a CPU or NCCL group needs MPI (Note
        [MPI groups of other parents] in mpi.py); an NCCL group of a CPU or MPI group needs
        ``device`` (this rank's GPU: an int or torch.device), as ``init`` does."""
        ranks = [int(r) for r in ranks]
        if len(set(ranks)) != len(ranks) or not ranks:
            raise ValueError(f"new_group: ranks must be a non-empty list without duplicates, got {ranks}")
        unknown = [r for r in ranks if r not in self._ranks]
        if unknown:
            raise ValueError(f"new_group: ranks {unknown} are not members of the parent group "
                             f"(its global ranks: {self._ranks})")
        self._setup_timeout(timeout, "new_group")  # a bad one raises before the call counts
        opts = self._child_options(transport, check)
        kind, dev = self._child_backend(backend, device, ranks)
        named = None if name is None else \
            self._claim_name(name, [ranks], f"new_group({ranks}, name={name!r})")
        key = f"{self._name}.{self._next_child}"
        self._next_child += 1
        me = self._ranks[self.rank]
        child: Union[ProcessGroup, NonMemberGroup]
        # Another backend than this group's is in the call's record, so that a setup that
        # fails waiting for ranks that asked for another one names them (Note [Calls out of
        # step]).
        call = f"new_group({ranks})" if kind == self.backend_name else \
            f"new_group({ranks}, backend={kind!r})"
        with self._group_call(key, call, timeout):
            self._publish_request(key, ranks, kind, timeout)
            if self.size > 1 and (self.backend_name in ("nccl", "mpi") or kind == "mpi"):
                self._agree_before_split(key, ranks, opts, kind, timeout, name)
            if kind == "mpi" and self.backend_name != "mpi":
                mpi.require_world(self._ranks, me, call)
            if me not in ranks:
                child = NonMemberGroup(ranks, key if name is None else name)
                self._sit_out(kind, timeout)
            else:
                try:
                    child = self._child(ranks, ranks.index(me), key, timeout, options=opts,
                                        label=name, kind=kind, device=dev)
                except (_C.TimeoutError, _C.PeerError):
                    why = self._request_mismatch(key, ranks, kind)[0] \
                        if self.backend_name == "cpu" else ""
                    if why:  # the peer that never came asked for another backend
                        raise _C.MismatchError(why) from None
                    raise
        return self._adopt(child, named)

    def split(self, color: Optional[int], key: int = 0, *, name: Optional[str] = None,
              timeout: Optional[float] = None) -> Union["ProcessGroup", "NonMemberGroup"]:
        """Collective: ranks with the same ``color`` form a group, ordered by (key, rank).
        ``color=None`` (or negative) joins no group and gets a NonMemberGroup. ``name``: the
        name of every group the split makes (as a mesh dim names its groups), held to the
        same rule as new_group's (Note [Group names])."""
        return self._split(color, key, name, timeout)

    def _split(self, color: Optional[int], key: int, name: Optional[str],
               timeout: Optional[float],
               kind: Optional[BackendName] = None) -> Union["ProcessGroup", "NonMemberGroup"]:
        """split; ``kind``: the new groups' backend (None: this group's). The hierarchy makes
        CPU groups per host of an MPI group this way (Note [Hierarchy on MPI] in
        csrc/mpi/mpi_backend.h); every rank passes the same kind."""
        c = -1 if color is None else int(color)
        if c >= 2**31:
            raise ValueError(f"split: color {c} must be below 2**31")
        self._setup_timeout(timeout, "split")  # a bad one raises before the call counts
        store_key = f"{self._name}.s{self._next_child}"
        self._next_child += 1
        child: Union[ProcessGroup, NonMemberGroup]
        named: Optional[NamedGroups] = None
        with self._group_call(store_key, "split()", timeout):
            table = self._exchange(np.array([c, int(key), self._ranks[self.rank]], np.int64),
                                   "split", timeout)
            groups: Dict[int, List[int]] = {}  # color -> global ranks, in group-rank order
            for cc, _, g in sorted((int(cc), int(k), int(g)) for cc, k, g in table if cc >= 0):
                groups.setdefault(cc, []).append(g)
            if name is not None:  # every rank holds the same table: all raise, or none
                named = self._claim_name(name, list(groups.values()), f"split(name={name!r})")
            if c < 0:
                child = NonMemberGroup([], store_key if name is None else name)
                self._sit_out(kind or self.backend_name, timeout)
            else:
                ranks = groups[c]
                me = self._ranks[self.rank]
                child = self._child(ranks, ranks.index(me), f"{store_key}.c{c}", timeout,
                                    color=c, label=name, kind=kind)
        return self._adopt(child, named)

    def _adopt(self, child: Union["ProcessGroup", "NonMemberGroup"],
               named: Optional[NamedGroups]) -> Union["ProcessGroup", "NonMemberGroup"]:
        """A new group of this one's, and of its name's entry when it has one."""
        self._children.append(child)
        if named is not None and named.mine is None and isinstance(child, ProcessGroup):
            named.mine = child
        return child

    # Note [Group names]
    # new_group and split take a name= that group.name (and C++ errors) then say; the store
    # keys stay the counted ones (Note [Calls out of step]), so a name never decides where
    # ranks meet. One name stands for one set of groups in a job: the ranks of new_group's
    # group, or of every group a split makes. The table of names is the world's, handed to
    # every group made from it; every rank makes the same calls with the same arguments, so
    # each rank's table is the same and a name reused for other ranks raises ValueError on
    # every rank, before anything is sent. The name also joins the settings the members
    # compare at setup (Note [Shared settings]): ranks that name one group differently get
    # MismatchError. The table also keeps, for each name, the first group made under it that
    # this rank is in: DeviceMesh.get_group(name) finds it (a name given again with the same
    # ranks makes another communicator; the name still finds the first). DeviceMesh's groups
    # are named by their dims within the mesh, not here.
    def _claim_name(self, name: str, groups: Sequence[Sequence[int]], call: str) -> NamedGroups:
        if not isinstance(name, str) or not name:
            raise ValueError(f"{call}: name must be a non-empty string, got {name!r}")
        mine = tuple(sorted(tuple(g) for g in groups))
        theirs = self._names.setdefault(name, NamedGroups(mine))
        if theirs.ranks != mine:
            raise ValueError(
                f"{call} on global rank {self._ranks[self.rank]}: the name {name!r} already "
                f"names the group(s) of global ranks {[list(g) for g in theirs.ranks]}; a "
                f"name stands for one set of ranks in a job: pick another name, or pass the "
                f"same ranks")
        return theirs

    @contextlib.contextmanager
    def _group_call(self, name: str, call: str, timeout: Optional[float]) -> Iterator[None]:
        """One new_group or split call on this group, which every rank makes, member of the
        new group or not. Each rank leaves in the store which call it is at; a setup that
        fails for want of a peer says which peers are at another call (Note [Calls out of
        step])."""
        me = self._ranks[self.rank]
        mine = f"{name}\t{call}"
        try:  # within the call's own timeout, as the setup that follows
            self._store.set(f"mc/at/{me}", mine, timeout=self._setup_timeout(timeout, call))
        except (_C.TimeoutError, _C.PeerError) as e:
            raise type(e)(f"{e} (during setup of group {name!r}: {call} on global rank "
                          f"{me})") from None
        try:
            yield
        except (_C.TimeoutError, _C.PeerError) as e:
            raise type(e)(f"{e}{self._out_of_step(mine)}") from None

    # Note [Calls out of step]
    # Groups are named by their parent's name and a count of its new_group and split calls,
    # and found in the store by that name. A rank that skips a call (a non-member that does
    # not call new_group, say), or makes its calls in another order, sets up each later group
    # under another name than its peers: its peers wait for it in vain, and it finds their
    # listeners of an older group closed. Neither side can tell that from the wire: it looks
    # like a rank that died or never started. So each rank records its latest call under
    # mc/at/<global rank>, and a setup that failed reads its parent's ranks' records and
    # names those at another call, and what that call was.
    def _out_of_step(self, mine: str) -> str:
        at: Dict[str, List[int]] = {}
        end = time.monotonic() + 2.0  # an error path: a slow store must not hold it up
        try:
            for g in self._ranks:
                if time.monotonic() > end:
                    break
                key = f"mc/at/{g}"
                if g == self._ranks[self.rank] or not self._store.check([key], timeout=1.0):
                    continue
                theirs = bytes(self._store.get(key, timeout=1.0)).decode()
                if theirs != mine:
                    at.setdefault(theirs, []).append(g)
        except _C.MeshcollError:  # the store is gone too: nothing more to tell
            return ""
        if not at:
            return ""
        def say(record: str) -> str:
            name, call = record.split("\t", 1)
            return f"{call} (group {name!r})"
        others = "; ".join(f"global rank(s) {', '.join(map(str, gs))} last called {say(r)}"
                           for r, gs in list(at.items())[:4])
        return (f". The ranks' group calls may be out of step (or those ranks are late): "
                f"this rank called {say(mine)}, but {others}. Every rank of a group calls its "
                f"new_group (members or not) and split, with the same arguments and in the "
                f"same order")

    def _sit_out(self, kind: BackendName, timeout: Optional[float]) -> None:
        """A rank outside a new subgroup on ``kind``: ncclCommSplit is collective over the
        whole parent, so an NCCL parent's non-members of an NCCL subgroup take part with no
        color; MPI_Comm_split too (of MPI's world, for a parent of another backend)."""
        if kind == "nccl" and self.backend_name == "nccl":
            nccl.sit_out(self._nccl_backend(), timeout)
        elif kind == "mpi" and self.backend_name == "mpi":
            mpi.make_backend(self._setup_timeout(timeout), self._mpi_backend(), -1)
        elif kind == "mpi":
            mpi.split_world(self._setup_timeout(timeout), -1, 0)

    def destroy(self) -> None:
        """Finish queued work and close this group and every group created from it."""
        # This group's queued calls first: a hierarchical one runs on the children. A failure
        # (an NCCL group's failure no call raised yet) is raised once every group is closed.
        try:
            self._backend.shutdown()
        finally:
            children, self._children = self._children, []
            for child in children:
                child.destroy()


class _Block:
    """``ProcessGroup.coalesced()``'s context manager: a class, as a generator-based one
    costs a noticeable part of a small call (docs/performance.md, "Python host costs")."""

    __slots__ = ("_group", "_timeout")

    def __init__(self, group: ProcessGroup, timeout: Optional[float]) -> None:
        self._group, self._timeout = group, timeout

    def __enter__(self) -> ProcessGroup:
        self._group._backend.begin_coalesced()
        return self._group

    def __exit__(self, *exc: object) -> None:
        self._group._backend.end_coalesced(self._timeout)


class NonMemberGroup:
    """What ``new_group`` returns on ranks outside the group: it knows the members, and every
    collective raises."""

    is_member: Literal[False] = False
    backend_name = "none"

    def __init__(self, ranks: Sequence[int], name: str):
        self.ranks = list(ranks)
        self.name = name
        self.rank = -1
        self.size = len(self.ranks)

    def __getattr__(self, attr: str) -> Callable[..., Any]:
        if attr.startswith("_"):
            raise AttributeError(attr)

        def not_a_member(*args: Any, **kwargs: Any) -> Any:
            raise RuntimeError(f"{attr}: this rank is not a member of group {self.name} "
                               f"(members: global ranks {self.ranks})")
        return not_a_member

    def destroy(self) -> None:
        pass
