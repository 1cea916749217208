"""The flights of DataParallel's buckets: each queued all-reduce (or compression hook) and
the stamp of its end, from which ``DataParallel.stats()`` counts communication time.

How the stamps make the statistics: Note [Stats] in ddp.py.
"""

from __future__ import annotations

import _thread
import queue
import time
from typing import Any, Optional

from . import _C


class _Done:
    """Set once (by the completion thread), waited for any number of times: a bare lock, held
    until set. threading.Event costs a Condition per bucket, many times a bare lock's cost
    (docs/performance.md, "Python host costs")."""

    __slots__ = ("_lock",)

    def __init__(self) -> None:
        self._lock = _thread.allocate_lock()
        self._lock.acquire()

    def set(self) -> None:
        self._lock.release()

    def wait(self) -> None:
        with self._lock:
            pass


class _Flight:
    """One queued all-reduce (or hook) of one bucket. Its end is stamped by the C++ thread of
    a CompletionStamps (``ticket``: a meshcoll Work) or by the completion thread (``done``:
    anything else a hook returns); see Note [Stats] in ddp.py."""

    __slots__ = ("work", "t_launch", "t_end", "t_wait", "error", "done", "ticket", "blocking",
                 "nbytes")

    def __init__(self, work: Any, t_launch: float, nbytes: int, blocking: bool = False) -> None:
        # work: the group's Work, a hook's object with wait(), or None (done synchronously)
        self.work, self.t_launch, self.nbytes, self.blocking = work, t_launch, nbytes, blocking
        self.t_end = self.t_wait = t_launch
        self.error: Optional[BaseException] = None
        self.done: Optional[_Done] = None  # made only for the completion thread's flights
        self.ticket: Optional[int] = None

    def finish(self, stamps: _C.CompletionStamps) -> None:
        """Blocks until the operation completed; t_end and error are then set."""
        if self.ticket is not None:
            self.t_end, self.error = stamps.take(self.ticket)
            self.ticket = None
        elif self.done is not None:
            self.done.wait()


def _complete(q: "queue.SimpleQueue[Optional[_Flight]]") -> None:
    # A module-level function holding only the queue, so the thread never keeps its
    # DataParallel alive; a None from the finalizer ends it.
    while True:
        fl = q.get()
        if fl is None:
            return
        try:
            if fl.work is not None:
                # A GPU Work's wait() only orders a stream; synchronize() blocks until the
                # all-reduce is done on the device, which the end stamp and wait() rely on.
                getattr(fl.work, "synchronize", fl.work.wait)()
        except BaseException as e:  # handed to the main thread, which re-raises it
            fl.error = e
        fl.t_end = time.perf_counter()
        assert fl.done is not None  # made before the flight was queued
        fl.done.set()
