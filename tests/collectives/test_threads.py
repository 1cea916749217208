"""Threads and groups (Note [One issuing thread] in csrc/comm/backend.h): the calls on one
group are made by one thread at a time. Two threads that issue on one group at once would
pair one thread's call on one rank with the other thread's on another rank (each rank orders
them as they come): the thread that finds the group taken raises ConcurrentCallError and
fails the group, so every rank raises, and the thread that held it raises too instead of
returning a result that may be crossed. An async call is being made until its Work
completes: another thread's call meanwhile is caught the same way, and the pending Work's
wait raises. Serialised calls made from different threads (a thread pool) and waits from
other threads stay legitimate.

What no rank can see is not caught: threads that take turns without ever issuing at the same
time on a rank (one computes, with the GIL let go, while the other calls) look, on every
rank, like one thread's calls in some order, so their calls pair in whatever order each
rank made them until they first overlap. The attack below therefore checks that every rank
raises, and the exact scenario checks that no call that overlapped another returns.
"""

import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

import meshcoll
from conftest import meshcoll_threads

pytestmark = pytest.mark.timeout(120)

TRANSPORTS = ["tcp", "shm"]
COUNT = 1031
RULE = "one thread at a time"  # in the error of every rank and every thread


def _data(thread, rank, size):
    """Thread `thread`'s stream of inputs on `rank` and the sums every rank expects of it."""
    mine = np.random.default_rng([thread, rank])
    peers = [np.random.default_rng([thread, r]) for r in range(size)]
    while True:
        yield mine.standard_normal(COUNT), sum(p.standard_normal(COUNT) for p in peers)


def _two_threads_one_group(pg, iters, async_op=False):
    """Two threads each all_reduce random data `iters` times on one group (the attack that
    crossed 300 of 300 pairs; with `async_op`, all_reduce(x, async_op=True).wait(), the one
    that gave 22-50% wrong results and no error): each thread's results and how it ended."""
    g = pg.new_group(list(range(pg.size)))
    outcome = {}
    start = threading.Barrier(2)

    def loop(t):
        done, crossed, error = 0, 0, None
        data = _data(t, pg.rank, pg.size)
        start.wait()
        try:
            for _ in range(iters):
                x, want = next(data)
                if async_op:
                    g.all_reduce(x, async_op=True, timeout=30).wait()
                else:
                    g.all_reduce(x, timeout=30)
                done += 1
                crossed += not np.allclose(x, want)
        except meshcoll.MeshcollError as e:
            error = f"{type(e).__name__}: {e}"
        outcome[t] = (done, crossed, error)

    # The attack needs the threads' calls to overlap at least once (see above). Python hands
    # the GIL over every 5 ms by default, between calls more often than inside one on a
    # loaded machine; a short switch interval makes the threads contend as real ones do.
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)
    try:
        threads = [threading.Thread(target=loop, args=(t,)) for t in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    finally:
        sys.setswitchinterval(interval)
    return outcome


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_two_threads_on_one_group_raise_on_every_rank(run_ranks, transport):
    for rank, outcome in enumerate(run_ranks(2, _two_threads_one_group, transport=transport,
                                             iters=300)):
        for t, (done, crossed, error) in outcome.items():
            # Results crossed before the threads first overlapped (see above) are the
            # limit of what any rank can see; the group must not go on after that.
            assert error is not None, (f"rank {rank} thread {t}: {done} calls ({crossed} "
                                       "crossed) and no error")
            assert RULE in error, f"rank {rank} thread {t}: {error}"


def _peer_of_the_caught(pg, g, x, want, out):
    """Rank 1's side of the two scenes below: once rank 0's main thread has been caught, its
    first call (legitimate for all it could see) returns a right result or raises, and its
    next one raises."""
    pg.barrier()  # rank 0's main thread has been caught
    try:
        g.all_reduce(x, timeout=30)
        out["right"] = bool(np.allclose(x, want))
        g.all_reduce(x, timeout=30)
    except meshcoll.MeshcollError as e:
        out["error"] = f"{type(e).__name__}: {e}"
    return out


def _caught_in_the_act(pg):
    """Rank 0's thread X waits in an all_reduce for rank 1 (which has not called yet) when
    rank 0's main thread calls on the same group: the main thread raises at once, X raises
    instead of returning once rank 1's call pairs with it, and rank 1, whose only call so far
    was legitimate for all it could see, raises at that call (the failure arrived before it
    ended) or at its next one."""
    g = pg.new_group(list(range(pg.size)))
    x = np.random.default_rng(pg.rank).standard_normal(COUNT)
    want = np.random.default_rng(0).standard_normal(COUNT) + np.random.default_rng(1).standard_normal(COUNT)
    out = {}
    if pg.rank == 1:
        return _peer_of_the_caught(pg, g, x, want, out)

    def holder():
        try:
            g.all_reduce(x, timeout=30)
            out["holder"] = "returned"
        except meshcoll.MeshcollError as e:
            out["holder"] = f"{type(e).__name__}: {e}"

    t = threading.Thread(target=holder)
    t.start()
    while not any("all_reduce" in c and "pending" in c for c in g.recent_calls()):
        time.sleep(0.001)  # until X's call is issued: X holds the group
    try:
        g.all_reduce(np.ones(COUNT), timeout=30)
    except meshcoll.MeshcollError as e:
        out["intruder"] = f"{type(e).__name__}: {e}"
    pg.barrier()
    t.join(60)
    out["ids"] = (t.ident, threading.get_ident())
    return out


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_intruder_holder_and_peer_all_raise(run_ranks, transport):
    r0, r1 = run_ranks(2, _caught_in_the_act, transport=transport)
    holder_id, main_id = r0["ids"]
    assert r0.get("intruder", "").startswith("ConcurrentCallError: rank 0 (global) of group"), r0
    assert f"another thread (id {holder_id}) issued all_reduce" in r0["intruder"], r0
    assert r0["holder"].startswith("ConcurrentCallError"), r0
    assert f"another thread (id {main_id}) issued all_reduce" in r0["holder"], r0
    assert r1.get("right", True), "rank 1's call paired with rank 0's only issued one: right"
    assert RULE in r1.get("error", ""), r1


def _caught_while_pending(pg):
    """Rank 0's thread X issues an async all_reduce, which stays pending (rank 1 has not
    called yet); then rank 0's main thread calls on the same group: it raises at once, X's
    wait raises instead of returning once rank 1's call pairs with X, and rank 1, whose first
    call was legitimate for all it could see, raises at that call or its next one."""
    g = pg.new_group(list(range(pg.size)))
    x = np.random.default_rng(pg.rank).standard_normal(COUNT)
    want = np.random.default_rng(0).standard_normal(COUNT) + np.random.default_rng(1).standard_normal(COUNT)
    out = {}
    if pg.rank == 1:
        return _peer_of_the_caught(pg, g, x, want, out)

    issued, caught = threading.Event(), threading.Event()

    def holder():
        w = g.all_reduce(x, async_op=True, timeout=30)
        issued.set()
        caught.wait(60)
        try:
            w.wait()
            out["holder"] = "returned"
        except meshcoll.MeshcollError as e:
            out["holder"] = f"{type(e).__name__}: {e}"

    t = threading.Thread(target=holder)
    t.start()
    issued.wait(60)
    try:
        g.all_reduce(np.ones(COUNT), timeout=5)  # before the fix: queued behind X, a hang
    except meshcoll.MeshcollError as e:
        out["intruder"] = f"{type(e).__name__}: {e}"
    caught.set()
    pg.barrier()
    t.join(60)
    out["ids"] = (t.ident, threading.get_ident())
    return out


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_call_while_another_threads_async_call_is_pending_raises(run_ranks, transport):
    r0, r1 = run_ranks(2, _caught_while_pending, transport=transport)
    holder_id, main_id = r0["ids"]
    assert r0.get("intruder", "").startswith("ConcurrentCallError: rank 0 (global) of group"), r0
    assert (f"another thread (id {holder_id}) issued all_reduce on this group and it had not "
            "completed") in r0["intruder"], r0
    assert r0["holder"].startswith("ConcurrentCallError"), r0
    assert f"another thread (id {main_id}) issued all_reduce" in r0["holder"], r0
    assert r1.get("right", True), "rank 1's call paired with rank 0's only issued one: right"
    assert RULE in r1.get("error", ""), r1


def _pool(pg, iters):
    """Calls made one after another from the workers of a pool (each waited for before the
    next is submitted), and async Works waited for on another worker: all legitimate."""
    wrong = []
    rng = np.random.default_rng(7)  # the same stream on every rank: rank r adds r
    with ThreadPoolExecutor(max_workers=4) as pool:
        def run(f, *args, **kwargs):
            return pool.submit(f, *args, **kwargs).result()

        for i in range(iters):
            base = rng.standard_normal(COUNT)
            x = base + pg.rank
            run(pg.all_reduce, x, timeout=30)
            if not np.allclose(x, 2 * base + 1):
                wrong.append(f"all_reduce {i}")
            b = run(pg.broadcast, np.full(5, float(pg.rank + i)), src=i % 2, timeout=30)
            if not (b == float(i % 2 + i)).all():
                wrong.append(f"broadcast {i}")
            y = base * (pg.rank + 1)
            w = run(pg.all_reduce, y, async_op=True, timeout=30)
            run(w.wait)  # a Work waited for on another worker than the one that issued it
            if not np.allclose(y, 3 * base):
                wrong.append(f"async all_reduce {i}")
            out = run(pg.all_gather, np.arange(3) + 10 * pg.rank, timeout=30)
            if not (out == np.arange(3) + np.array([[0], [10]])).all():
                wrong.append(f"all_gather {i}")
    return wrong


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_thread_pool_with_serialised_calls(run_ranks, transport):
    assert run_ranks(2, _pool, transport=transport, iters=25) == [[], []]



def _thread_names(pg):
    pg.all_reduce(np.ones(3))
    return sorted(meshcoll_threads())


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/task")
def test_meshcolls_threads_are_named_for_top_and_debuggers(run_ranks):
    # A user who sees a busy or stuck thread in top -H, ps -L or gdb can tell it is
    # meshcoll's and which one: each group's worker, and a store server's threads.
    assert run_ranks(2, _thread_names) == [["mc-worker"], ["mc-worker"]]
    server = meshcoll.TCPStore("127.0.0.1", 0, is_server=True, timeout=10)
    client = meshcoll.TCPStore("127.0.0.1", server.port, timeout=10)
    client.set("k", b"v")
    assert {"mc-store-accept", "mc-store-serve"} <= meshcoll_threads()


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_two_threads_async_on_one_group_raise_on_every_rank(run_ranks, transport):
    # An async call is outstanding until its Work completes: the other thread's issue
    # meanwhile is caught (Note [One issuing thread]), though the two issues never overlap.
    # A result crossed on a rank that saw no overlap is followed by an error in that thread:
    # no thread on any rank goes on as if nothing happened.
    for rank, outcome in enumerate(run_ranks(2, _two_threads_one_group, transport=transport,
                                             iters=1000, async_op=True)):
        for t, (done, crossed, error) in outcome.items():
            assert error is not None, (f"rank {rank} thread {t}: {done} calls ({crossed} "
                                       "crossed) and no error")
            assert RULE in error, f"rank {rank} thread {t}: {error}"
            assert error.split(":")[0] in ("ConcurrentCallError", "PeerError", "AbortedError"), error
