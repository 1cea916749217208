"""all_reduce for groups that span hosts: shared memory inside each host, TCP between hosts.

Note [Hierarchy]
The transport is chosen per group: a group whose members sit on several hosts talks TCP
between all of them, so a flat all_reduce sends every byte over TCP even between ranks that
share a host. When such a group has a host with two or more members, it builds two children
at creation (collective, through ``split``): ``local``, the members on this host (shared
memory), and ``leaders``, the lowest group rank of each host (TCP). all_reduce then runs as

    local all_reduce (shm)  ->  leaders all_reduce (TCP)  ->  local broadcast from the leader

so TCP carries one copy per host instead of one per rank, and the ranks of a host finish
with the leader's bytes: every rank ends with bitwise the same result. ``avg`` reduces with
``sum`` and divides at the end with the same kernel as a flat avg (ints truncate).

Order. The three steps run on other communicators than the group's, so their order must be
the same on every rank: every hierarchical all_reduce, blocking or not, goes through one
FIFO per group, run by one thread (started with the first async op); a blocking call runs
on the caller's thread when that FIFO is empty and waits its turn otherwise. The group's
other collectives keep using the group's own communicator.

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
from typing import List, Optional

import numpy as np

from . import _C


class HierarchyWork:
    """Work of a hierarchical all_reduce queued behind others (see Note [Hierarchy])."""

    __slots__ = ("_done", "_error", "_result")

    def __init__(self, result):
        self._done = threading.Event()
        self._error: Optional[BaseException] = None
        self._result = result

    def wait(self, timeout: Optional[float] = None):
        if not self._done.wait(timeout):
            from . import TimeoutError as McTimeout
            raise McTimeout(f"hierarchical all_reduce: not done within {timeout} s")
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

    def __init__(self, group, local, leaders):
        self.group, self.local, self.leaders = group, local, leaders
        self._lock = threading.Lock()
        self._fifo: deque = deque()   # (work, array, op, deadline) not yet run
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
        return cls(group, local, leaders)

    def close(self) -> None:
        """Ends the FIFO's thread once the queued calls ran (the group is being destroyed)."""
        with self._lock:
            self._closed = True
            self._idle.notify_all()

    def all_reduce(self, x, a: np.ndarray, op: str, timeout: Optional[float], async_op: bool):
        """``a`` (the numpy view of ``x``) reduced in place; returns ``x`` or a Work."""
        t = self.group._timeout if timeout is None else float(timeout)
        deadline = time.monotonic() + t
        if not async_op:
            with self._lock:
                while self._busy or self._fifo:
                    self._idle.wait()
                self._busy = True
            try:
                self._run(a, op, deadline)
            finally:
                with self._lock:
                    self._busy = False
                    self._idle.notify_all()
            return x
        work = HierarchyWork(x)
        with self._lock:
            self._fifo.append((work, a, op, deadline))
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
                work, a, op, deadline = self._fifo.popleft()
                self._busy = True
            try:
                self._run(a, op, deadline)
            except BaseException as e:  # handed to the waiter
                work._error = e
            finally:
                with self._lock:
                    self._busy = False
                    self._idle.notify_all()
                work._done.set()

    def _run(self, a: np.ndarray, op: str, deadline: float) -> None:
        def left() -> float:
            return max(0.001, deadline - time.monotonic())

        red = "sum" if op == "avg" else op
        try:
            self.local.all_reduce(a, red, timeout=left())
            if self.leaders.is_member:
                self.leaders.all_reduce(a, red, timeout=left())
            self.local.broadcast(a, 0, timeout=left())
        except (ValueError, TypeError):
            raise  # bad arguments: nothing was sent
        except Exception as e:
            # The step that failed told its own peers; the ranks waiting in the other two
            # groups learn it from these (Note [Hierarchy], Failures).
            why = (f"rank {self.group.rank} of group {self.group.name!r}: hierarchical "
                   f"all_reduce failed: {e}")
            for g in (self.local, self.leaders, self.group):
                if g.is_member:
                    try:
                        g._comm.fail(why)
                    except Exception:  # noqa: S110 - a group that already failed or shut down
                        pass
            raise
        if op == "avg":
            _C._divide_by(a, a.dtype.name, self.group.size)
