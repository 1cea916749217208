"""The guarantees that live above every backend (Note [Guarantees above the backends] in
csrc/comm/backend.h), tried on the CPU backend over TCP and shared memory:

- an asynchronous operation keeps its arrays alive until it completes, whatever the caller
  drops (Note [Owners] in csrc/python/array.h): no write into freed memory;
- calls on different groups may run on different threads at once (re-entrancy);
- arrays are checked once, before anything is sent: byte order, out= sizes;
- the _v collectives' per-rank counts and row shapes are part of the call description, so
  ranks that disagree get MismatchError on shared memory as on TCP;
- every call is in the ledger (recent_calls), and a timeout names this rank's last calls.
"""

import gc
import threading
import time

import numpy as np
import pytest

import meshcoll
from conftest import wrong_errors

pytestmark = pytest.mark.timeout(120)

TRANSPORTS = ["tcp", "shm"]
N = 8192  # float64: 64 KiB, below malloc's mmap threshold, so freed blocks are reused at once


# ---- dropped async Work and arrays ----------------------------------------------------------

def _dropped_async(pg, rounds):
    """Rank 0 issues async collectives and receives, drops the Work and the array at once,
    and fills freshly allocated canaries of the same size; rank 1 joins late. Without the
    owners the peer's result lands in a freed block a canary now holds."""
    rng = np.random.default_rng(pg.rank)
    late = 0.3
    damaged = []
    for r in range(rounds):
        if pg.rank == 0:
            pg.all_reduce(rng.standard_normal(N), async_op=True)  # Work and array dropped
            pg.irecv(np.empty(N), 1, tag=r)
            gc.collect()
            canaries = [np.full(N, 7.0) for _ in range(8)]
            pg.barrier(timeout=30)  # rank 1 finished: its data has landed somewhere
            damaged += [i for i, c in enumerate(canaries) if not (c == 7.0).all()]
        else:
            time.sleep(late)
            pg.all_reduce(rng.standard_normal(N))
            pg.send(np.full(N, float(r)), 0, tag=r)
            pg.barrier(timeout=30)
    # The group still works, with the right values.
    x = np.full(5, pg.rank + 1.0)
    pg.all_reduce(x)
    return damaged, x.tolist()


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_dropped_async_work_and_array_write_no_freed_memory(run_ranks, transport):
    results = run_ranks(2, _dropped_async, transport=transport, rounds=3,
                        env={"MALLOC_PERTURB_": "165"})
    for damaged, x in results:
        assert not damaged, f"canaries overwritten: {damaged}"
        assert x == [3.0] * 5


def _released_off_main_thread(pg, rounds):
    """The arrays of finished async ops are released while the main thread is blocked in
    C for good (joining the thread that trains): any later collective drops them."""
    import weakref
    alive = []

    def train():
        refs = []
        for _ in range(rounds):
            x = np.ones(1 << 14)
            refs.append(weakref.ref(x))
            pg.all_reduce(x, async_op=True)  # Work and array dropped
            del x
        pg.barrier(timeout=30)  # every async op above has completed: owners let go
        pg.all_reduce(np.ones(1), timeout=30)  # entering a collective drops them
        alive.append(sum(r() is not None for r in refs))

    t = threading.Thread(target=train)
    t.start()
    t.join()  # the main thread stays in C until the thread ends
    return alive[0]


def test_dropped_arrays_are_released_while_main_thread_waits(run_ranks):
    assert run_ranks(2, _released_off_main_thread, transport="tcp", rounds=50) == [0, 0]


# ---- two threads, two groups -------------------------------------------------------------

def _threads(pg, iters):
    g1 = pg.new_group(list(range(pg.size)))
    g2 = pg.new_group(list(range(pg.size)))
    errors = []

    def reduce_loop():
        rng = np.random.default_rng(100 + pg.rank)
        peers = [np.random.default_rng(100 + r) for r in range(pg.size)]
        for _ in range(iters):
            x = rng.standard_normal(1031)
            want = sum(p.standard_normal(1031) for p in peers)
            g1.all_reduce(x, timeout=30)
            if not np.allclose(x, want):
                errors.append("all_reduce on g1 wrong")

    def gather_loop():
        for i in range(iters):
            x = np.arange(257, dtype=np.int64) * (pg.rank + 1) + i
            out = g2.all_gather(x, timeout=30)
            want = np.stack([np.arange(257, dtype=np.int64) * (r + 1) + i for r in range(pg.size)])
            if not (out == want).all():
                errors.append("all_gather on g2 wrong")
            w = g2.broadcast(np.full(9, float(pg.rank + i)), src=i % pg.size, async_op=True)
            if not (w.wait() == float(i % pg.size + i)).all():
                errors.append("async broadcast on g2 wrong")

    threads = [threading.Thread(target=f) for f in (reduce_loop, gather_loop)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return errors


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_two_threads_on_two_groups(run_ranks, transport):
    for errors in run_ranks(2, _threads, transport=transport, iters=40):
        assert not errors, errors


# ---- checks before anything is sent ------------------------------------------------------

def _bad_arrays(pg):
    n = pg.size
    x = np.arange(4.0 * n)
    cases = [
        ("big-endian", lambda: pg.all_reduce(np.ones(4, ">f4")), TypeError, "big-endian"),
        ("big-endian buffer", lambda: pg.broadcast(memoryview(np.ones(4, ">f4"))), TypeError,
         "big-endian"),
        ("all_gather out too big", lambda: pg.all_gather(x, out=np.empty(n * x.size + 1)),
         ValueError, "out has"),
        ("all_gather out dtype", lambda: pg.all_gather(x, out=np.empty(n * x.size, np.float32)),
         TypeError, "dtype"),
        ("reduce_scatter out too small", lambda: pg.reduce_scatter(x, out=np.empty(1)),
         ValueError, "out has"),
        ("scatter out larger than the block", lambda: pg.scatter(np.ones((n, 3)), 0,
                                                                 out=np.empty(4)),
         ValueError, "out has"),
        ("all_to_all out too small", lambda: pg.all_to_all(x, out=np.empty(2)), ValueError,
         "out has"),
        ("out is x", lambda: pg.all_to_all(x, out=x), ValueError, "separate"),
        ("object dtype", lambda: pg.all_reduce(np.array([None, 1])), TypeError, "object"),
        ("stream on CPU", lambda: pg.all_reduce(np.ones(3), stream=1), ValueError, "stream"),
        ("bad transport", lambda: pg.new_group([0, 1], transport="udp"), ValueError, "udp"),
    ]
    wrong = wrong_errors(cases)
    ro = np.zeros(n * x.size)
    ro.setflags(write=False)
    try:
        pg.all_gather(x, out=ro)
        wrong.append("read-only out: no error")
    except ValueError as e:
        if "read-only" not in str(e):
            wrong.append(f"read-only out: {e}")
    # Nothing was sent: the group works, with the right values.
    y = np.full(4, pg.rank + 1.0)
    pg.all_reduce(y, timeout=30)
    return wrong, y.tolist() == [n * (n + 1) / 2] * 4


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_bad_arrays_raise_before_sending(run_ranks, transport):
    for wrong, ok in run_ranks(2, _bad_arrays, transport=transport):
        assert not wrong, "\n".join(wrong)
        assert ok


# ---- timeouts --------------------------------------------------------------------------------

BAD_TIMEOUTS = [-1, 0, float("nan"), float("inf"), 1e10]


def _bad_timeouts(pg):
    """Every call that takes a timeout, group creation included, refuses one that would mean
    no deadline or an immediate (or overflowed) one, on every rank, before anything is sent."""
    x = np.ones(4)
    cases = []
    for t in BAD_TIMEOUTS:
        for name, call in (
                ("all_reduce", lambda t=t: pg.all_reduce(x, timeout=t)),
                ("all_reduce async", lambda t=t: pg.all_reduce(x, timeout=t, async_op=True)),
                ("broadcast", lambda t=t: pg.broadcast(x, 0, timeout=t)),
                ("all_gather", lambda t=t: pg.all_gather(x, timeout=t)),
                ("barrier", lambda t=t: pg.barrier(timeout=t)),
                ("recv", lambda t=t: pg.recv(x, 1 - pg.rank, timeout=t)),
                ("new_group", lambda t=t: pg.new_group([0, 1], timeout=t)),
                ("split", lambda t=t: pg.split(0, timeout=t)),
                ("store get", lambda t=t: pg._store.get("absent", timeout=t)),
        ):
            if not (name == "store get" and t == 0):  # a store call may decline to wait
                cases.append((f"{name} timeout={t}", call, ValueError, "timeout"))
    cases.append(("store get timeout=0", lambda: pg._store.get("absent", timeout=0),
                  meshcoll.TimeoutError, "absent"))
    wrong = wrong_errors(cases)
    # The longest allowed is a real deadline, not an overflowed one: the call completes.
    y = np.full(3, pg.rank + 1.0)
    pg.all_reduce(y, timeout=1e7)
    g = pg.new_group([0, 1], timeout=1e7)
    g.all_reduce(y, timeout=30)
    return wrong, y.tolist()


def test_bad_timeouts_raise_everywhere(run_ranks):
    for wrong, y in run_ranks(2, _bad_timeouts, transport="tcp"):
        assert not wrong, "\n".join(wrong)
        assert y == [6.0] * 3


# ---- _v disagreements ---------------------------------------------------------------------

def _v_mismatch(pg, which):
    g = pg.new_group(list(range(pg.size)))
    pg.barrier(timeout=30)
    try:
        if which == "gather":
            # The same count, other shapes: the root would stack (2, 3) and (3, 2) blocks.
            g.gather(np.ones((2, 3)) if pg.rank == 0 else np.ones((3, 2)), 0, timeout=30)
        elif which == "scatter":
            # The root splits (2, 2, 3) into (2, 3) blocks; rank 1 expects a (3, 2) one.
            out = np.empty((2, 3) if pg.rank == 0 else (3, 2))
            g.scatter(np.ones((2, 2, 3)) if pg.rank == 0 else None, 0, out=out, timeout=30)
        elif which == "reduce_scatter_v":
            # Both splits sum to 6 rows; the ranks disagree on where they fall.
            counts = [2, 4] if pg.rank == 0 else [4, 2]
            g.reduce_scatter_v(np.ones((6, 3)), counts, timeout=30)
        else:
            # Rows of 4 on rank 0, rows of 2 on rank 1: the same bytes per rank, other rows.
            x = np.ones((4, 4)) if pg.rank == 0 else np.ones((8, 2))
            g.all_to_all_v(x, [len(x) // 2] * 2, timeout=30)
        # A rank that only sent (gather's non-root) learns of the mismatch by its next call.
        g.barrier(timeout=30)
    except meshcoll.MeshcollError as e:
        return type(e).__name__, str(e)
    return None, ""


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("which", ["reduce_scatter_v", "all_to_all_v", "gather", "scatter"])
def test_v_disagreements_raise_mismatch(run_ranks, transport, which):
    for kind, msg in run_ranks(2, _v_mismatch, transport=transport, which=which):
        assert kind == "MismatchError", (kind, msg)  # the check's, not the 30 s timeout's
        assert which.split("_v")[0] in msg, msg


# ---- the ledger ---------------------------------------------------------------------------

def _ledger(pg):
    pg.all_reduce(np.ones(3, np.float32))
    pg.broadcast(np.ones(2), src=0)
    pg.all_gather(np.ones(2, np.int64))
    calls = pg.recent_calls(3)
    # A timeout names this rank's last calls: rank 1 never joins rank 0's all_reduce.
    g = pg.new_group([0, 1])
    message = ""
    if pg.rank == 0:
        try:
            g.all_reduce(np.ones(4), timeout=1.0)
        except meshcoll.TimeoutError as e:
            message = str(e)
    pg.barrier(timeout=30)
    return calls, message


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_ledger_lists_calls_and_timeouts_name_them(run_ranks, transport):
    (calls, message), (calls1, _) = run_ranks(2, _ledger, transport=transport)
    assert calls == calls1
    assert [c.split("(")[0] for c in calls] == ["all_reduce", "broadcast", "all_gather"]
    assert all("done via " in c and "[seq " in c for c in calls), calls
    # How each was carried: all_reduce and broadcast name the algorithm they chose, the
    # others the transport.
    assert calls[2].endswith(f"via {transport}"), calls
    assert "last calls on this group" in message and "all_reduce(count=4, float64" in message
