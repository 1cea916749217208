"""Collectives for groups that span hosts: shared memory inside each host, TCP between hosts.

Note [Hierarchy]
The transport is chosen per group: a group whose members sit on several hosts talks TCP
between all of them, so a flat all_reduce sends every byte over TCP even between ranks that
share a host. When such a group has a host with two or more members, it builds two children
at creation (collective, through ``split``): ``local``, the members on this host (shared
memory), and ``leaders``, the lowest group rank of each host (TCP). all_reduce then runs as

    local all_reduce (shm)  ->  leaders all_reduce (TCP)  ->  local broadcast from the leader

so TCP carries one copy per host instead of one per rank, and the ranks of a host finish
with the leader's bytes: every rank ends with bitwise the same result. ``avg`` reduces with
``sum`` and divides at the end with the same kernel as a flat avg (ints truncate). In the
same way:

    broadcast:   on the root's host, local broadcast from the root; leaders broadcast from
                 that host's leader; on the other hosts, local broadcast from the leader
    all_gather:  local gather to the leader; leaders all_gather_v of the host blocks (hosts
                 may differ in size), put in group-rank order; local broadcast of the result

Order. The steps run on other communicators than the group's, so their order must be the
same on every rank: every hierarchical call, blocking or not, goes through one FIFO per
group, run by one thread (started with the first async op); a blocking call runs on the
caller's thread when that FIFO is empty and waits its turn otherwise. The group's other
collectives keep using the group's own communicator.

Failures. Each step gets what is left of the call's timeout; an error in any step is the
call's error. The failed step's group tells its own ranks (as any collective does), and the
rank then fails its other two groups and the parent (``Comm.fail``), so the ranks waiting
there raise PeerError at once instead of at their timeout, and the whole group is dead, as
after any failed collective.
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections import deque
from typing import Callable, List, Optional

import numpy as np

from . import _C


class HierarchyWork:
    """Work of a hierarchical collective queued behind others (see Note [Hierarchy])."""

    __slots__ = ("_done", "_error", "_result", "_what")

    def __init__(self, result, what: str):
        self._done = threading.Event()
        self._error: Optional[BaseException] = None
        self._result = result
        self._what = what

    def wait(self, timeout: Optional[float] = None):
        if not self._done.wait(timeout):
            from . import TimeoutError as McTimeout
            raise McTimeout(f"hierarchical {self._what}: not done within {timeout} s")
        if self._error is not None:
            raise self._error
        return self._result

    def is_completed(self) -> bool:
        return self._done.is_set()

    def exception(self):
        return self._error if self._done.is_set() else None


def host_of_each_rank(group) -> List[int]:
    """Collective over ``group``: for each group rank, the index of its host (hosts numbered
    in order of their first rank). A host is what ``_C.host_identity()`` names."""
    me = hashlib.blake2b(_C.host_identity().encode(), digest_size=8).digest()
    ids = [int(i) for i in group.all_gather(np.frombuffer(me, np.int64).copy()).ravel()]
    order = list(dict.fromkeys(ids))
    return [order.index(i) for i in ids]


class Hierarchy:
    """The ``local`` and ``leaders`` children of a multi-host group and their FIFO."""

    def __init__(self, group, local, leaders, hosts: List[int]):
        self.group, self.local, self.leaders = group, local, leaders
        self.hosts = hosts  # host index of each group rank; leader i is host i's
        # Group ranks in the order leaders' all_gather_v lays out host blocks.
        self._by_host = sorted(range(len(hosts)), key=lambda g: (hosts[g], g))
        self._in_place = self._by_host == list(range(len(hosts)))  # each host's ranks contiguous
        self._host_size = [hosts.count(h) for h in range(max(hosts) + 1)]
        self._local_rank = [hosts[:g].count(hosts[g]) for g in range(len(hosts))]
        self._lock = threading.Lock()
        self._fifo: deque = deque()   # (work, what, steps, deadline) not yet run
        self._busy = False            # a caller or the thread is running steps
        self._idle = threading.Condition(self._lock)
        self._thread: Optional[threading.Thread] = None
        self._closed = False

    @classmethod
    def build(cls, group, hosts: List[int]) -> Optional["Hierarchy"]:
        """Collective over ``group`` (``hosts`` from host_of_each_rank): the hierarchy, or
        None when no host holds two members."""
        if max(hosts.count(h) for h in set(hosts)) < 2:
            return None
        local = group.split(hosts[group.rank], key=group.rank)
        leaders = group.split(0 if local.rank == 0 else None, key=group.rank)
        return cls(group, local, leaders, hosts)

    def close(self) -> None:
        """Ends the FIFO's thread once the queued calls ran (the group is being destroyed)."""
        with self._lock:
            self._closed = True
            self._idle.notify_all()

    # ---- the collectives: their steps, run through the FIFO ------------------------
    def all_reduce(self, x, a: np.ndarray, op: str, timeout: Optional[float], async_op: bool):
        """``a`` (the numpy view of ``x``) reduced in place; returns ``x`` or a Work."""
        red = "sum" if op == "avg" else op

        def steps(left: Callable[[], float]) -> None:
            self.local.all_reduce(a, red, timeout=left())
            if self.leaders.is_member:
                self.leaders.all_reduce(a, red, timeout=left())
            self.local.broadcast(a, 0, timeout=left())
            if op == "avg":
                _C._divide_by(a, a.dtype.name, self.group.size)
        return self._submit("all_reduce", steps, x, timeout, async_op)

    def broadcast(self, x, a: np.ndarray, src: int, timeout: Optional[float], async_op: bool):
        """Group rank ``src``'s ``a`` into every rank's ``a``; returns ``x`` or a Work."""
        src_host, src_local = self.hosts[src], self._local_rank[src]

        def steps(left: Callable[[], float]) -> None:
            if self.hosts[self.group.rank] == src_host:
                self.local.broadcast(a, src_local, timeout=left())
                if self.leaders.is_member:
                    self.leaders.broadcast(a, src_host, timeout=left())
            else:
                if self.leaders.is_member:
                    self.leaders.broadcast(a, src_host, timeout=left())
                self.local.broadcast(a, 0, timeout=left())
        return self._submit("broadcast", steps, x, timeout, async_op)

    def all_gather(self, out, a: np.ndarray, o: np.ndarray, timeout: Optional[float],
                   async_op: bool):
        """Every rank's ``a`` into ``o`` (``out``'s view, shape ``(size, *a.shape)``)."""
        size = self.group.size
        flat = o.reshape(size, -1)  # o is contiguous: a view

        def steps(left: Callable[[], float]) -> None:
            block = self.local.gather(a.reshape(1, -1), 0, timeout=left())
            if self.leaders.is_member:
                # Host h's block holds its ranks' arrays; the sizes are known, so the leaders
                # need no all_gather_v round for them. Contiguous hosts land in place.
                counts = [n * a.size for n in self._host_size]
                rows = flat if self._in_place else np.empty_like(flat)
                self.leaders._backend.all_gather(block.reshape(-1), rows.reshape(-1), counts,
                                                 True, left(), None, False)
                if not self._in_place:
                    flat[self._by_host] = rows  # host blocks -> group-rank order
            self.local.broadcast(o, 0, timeout=left())
        return self._submit("all_gather", steps, out, timeout, async_op)

    # ---- the FIFO -------------------------------------------------------------------
    def _submit(self, what: str, steps, result, timeout: Optional[float], async_op: bool):
        """Runs ``steps(left)`` in FIFO order (Note [Hierarchy]); ``left()`` is what remains
        of the call's timeout. Returns ``result`` (blocking) or a HierarchyWork."""
        t = self.group._timeout if timeout is None else float(timeout)
        deadline = time.monotonic() + t
        if not async_op:
            with self._lock:
                while self._busy or self._fifo:
                    self._idle.wait()
                self._busy = True
            try:
                self._run(what, steps, deadline)
            finally:
                with self._lock:
                    self._busy = False
                    self._idle.notify_all()
            return result
        work = HierarchyWork(result, what)
        with self._lock:
            self._fifo.append((work, what, steps, deadline))
            if self._thread is None:
                self._thread = threading.Thread(target=self._drain, daemon=True,
                                                name=f"meshcoll-hierarchy-{self.group.name}")
                self._thread.start()
            self._idle.notify_all()
        return work

    def _drain(self) -> None:
        while True:
            with self._lock:
                while self._busy or not self._fifo:
                    if self._closed and not self._fifo:
                        return
                    self._idle.wait()
                work, what, steps, deadline = self._fifo.popleft()
                self._busy = True
            try:
                self._run(what, steps, deadline)
            except BaseException as e:  # handed to the waiter
                work._error = e
            finally:
                with self._lock:
                    self._busy = False
                    self._idle.notify_all()
                work._done.set()

    def _run(self, what: str, steps, deadline: float) -> None:
        def left() -> float:
            return max(0.001, deadline - time.monotonic())

        try:
            steps(left)
        except (ValueError, TypeError):
            raise  # bad arguments: nothing was sent
        except Exception as e:
            # The step that failed told its own peers; the ranks waiting in the other two
            # groups learn it from these (Note [Hierarchy], Failures).
            why = (f"rank {self.group.rank} of group {self.group.name!r}: hierarchical "
                   f"{what} failed: {e}")
            for g in (self.local, self.leaders, self.group):
                if g.is_member:
                    try:
                        g._backend.fail(why)
                    except Exception:  # noqa: S110 - a group that already failed or shut down
                        pass
            raise
