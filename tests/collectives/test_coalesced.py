"""ProcessGroup.coalesced() on the CPU backend (Note [Coalesced blocks] in
csrc/comm/backend.h; the GPU tests run the same on NCCL, where the block is one launch).
Every collective of a block gives numpy's answer on random data once the block ends; what
waits for a result inside a block is refused on every rank with the group still right
afterwards; and ranks that form different blocks get MismatchError on every rank, not a
hang (the check compares descriptions, which carry the block's number)."""

from __future__ import annotations

import numpy as np
import pytest

import meshcoll
from conftest import launch

pytestmark = pytest.mark.timeout(120)
CALL_TIMEOUT = 30.0  # a mismatch must be the check's own error, never this deadline


def _data(seed, rank, n, dtype=np.float64):
    return np.random.default_rng([seed, rank]).standard_normal(n).astype(dtype)


def _block(pg):
    n, size, rank = 10, pg.size, pg.rank
    x = _data(1, rank, n)
    m = _data(2, rank, n, np.float32)
    g = np.empty((size, n))
    rs = np.empty(n)
    b = _data(4, rank, n)
    r = _data(5, rank, n)
    with pg.coalesced() as same:
        assert same is pg
        pg.all_reduce(x)
        pg.all_reduce(m, op="max")
        pg.all_gather(_data(3, rank, n), out=g)
        pg.reduce_scatter(_data(6, rank, n * size), out=rs)
        with pg.coalesced():  # nested: the outer end runs them
            pg.broadcast(b, 1)
            pg.reduce(r, 0)
        w = pg.all_reduce(_data(7, rank, n), async_op=True)
        rsv = pg.reduce_scatter_v(_data(8, rank, 3), [1, 2], timeout=CALL_TIMEOUT)
    a = w.wait()
    calls = pg.recent_calls(12)
    after = _data(9, rank, n)
    pg.all_reduce(after)  # outside a block again
    return x, m, g, rs, b, r, a, rsv, calls, after, pg.recent_calls(1)[0]


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_a_blocks_collectives_give_numpys_answer(transport):
    world, n = 2, 10
    total = lambda seed, m: sum(_data(seed, k, m) for k in range(world))
    for rank, res in enumerate(launch(world, _block, transport=transport)):
        x, m, g, rs, b, r, a, rsv, calls, after, last = res
        np.testing.assert_allclose(x, total(1, n), rtol=1e-12)
        np.testing.assert_array_equal(m, np.maximum(*[_data(2, k, n, np.float32)
                                                      for k in range(world)]))
        for k in range(world):
            np.testing.assert_array_equal(g[k], _data(3, k, n))
        np.testing.assert_allclose(rs, total(6, n * world)[rank * n:(rank + 1) * n], rtol=1e-12)
        np.testing.assert_array_equal(b, _data(4, 1, n))
        if rank == 0:
            np.testing.assert_allclose(r, total(5, n), rtol=1e-12)
        else:
            np.testing.assert_array_equal(r, _data(5, rank, n))
        np.testing.assert_allclose(a, total(7, n), rtol=1e-12)
        np.testing.assert_allclose(rsv, total(8, 3)[[0] if rank == 0 else [1, 2]], rtol=1e-12)
        np.testing.assert_allclose(after, total(9, n), rtol=1e-12)
        # The ledger shows the block: its calls carry its number, the next call none.
        assert sum("in coalesced block 1" in c for c in calls) == 8, calls
        assert "coalesced" not in last, last


def _refusals(pg):
    seen = {}
    x = _data(1, pg.rank, 4)
    for label, call in (
            ("barrier", lambda: pg.barrier()),
            ("all_gather_v", lambda: pg.all_gather_v(x)),
            ("all_to_all_v", lambda: pg.all_to_all_v(x, [2, 2]))):
        try:
            with pg.coalesced():
                call()
        except ValueError as e:
            seen[label] = str(e)
    # Calls of a block run together: one may not use another's result (read what another
    # writes, or write what another reads or writes). Reads of the same array are fine.
    for label, calls in (
            ("all_reduce twice", lambda: (pg.all_reduce(x), pg.all_reduce(x))),
            ("gather what was reduced", lambda: (pg.all_reduce(x),
                                                 pg.all_gather(x[:2], out=np.empty((2, 2))))),
            ("write what is read", lambda: (pg.all_gather(x[:2], out=np.empty((2, 2))),
                                            pg.broadcast(x, 0)))):
        try:
            with pg.coalesced():
                calls()
        except ValueError as e:
            seen[label] = str(e)
    with pg.coalesced():  # allowed: reads of one array, and temporaries (held to the end)
        g1, g2 = np.empty((pg.size, 4)), np.empty((pg.size, 4))
        pg.all_gather(x, out=g1)
        pg.all_gather(x, out=g2)
        for _ in range(3):
            pg.all_reduce(np.ones(4))
    # Inside a block, barrier(async_op=True) is allowed: its Work is waited on after.
    with pg.coalesced():
        w = pg.barrier(async_op=True)
    w.wait()
    try:  # an error raised inside the block ends it; the group goes on
        with pg.coalesced():
            raise KeyError("user error")
    except KeyError:
        pass
    try:
        pg._backend.end_coalesced()
    except ValueError as e:
        seen["end without begin"] = str(e)
    y = _data(2, pg.rank, 4)
    pg.all_reduce(y, timeout=CALL_TIMEOUT)
    return seen, y, pg._backend.coalescing, g1, g2


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_what_waits_inside_a_block_is_refused_on_every_rank(transport):
    world = 2
    for seen, y, open_after, g1, g2 in launch(world, _refusals, transport=transport):
        assert set(seen) == {"barrier", "all_gather_v", "all_to_all_v", "end without begin",
                             "all_reduce twice", "gather what was reduced",
                             "write what is read"}, seen
        assert "writes memory that an earlier all_reduce of the block writes" in \
            seen["all_reduce twice"], seen["all_reduce twice"]
        assert "all_gather in a coalesced block reads memory that an earlier all_reduce" in \
            seen["gather what was reduced"], seen["gather what was reduced"]
        assert "broadcast in a coalesced block writes memory that an earlier all_gather of " \
            "the block reads" in seen["write what is read"], seen["write what is read"]
        x = _data(1, 0, 4)  # what each rank's x held before the refused calls' blocks ran
        np.testing.assert_array_equal(g1, g2)
        assert "synchronous barrier" in seen["barrier"] and "after the block" in seen["barrier"]
        for what in ("all_gather_v", "all_to_all_v"):
            assert seen[what].startswith(what) and "outside the block" in seen[what]
        assert "without an open coalesced block" in seen["end without begin"]
        np.testing.assert_allclose(y, sum(_data(2, k, 4) for k in range(world)), rtol=1e-12)
        assert open_after is False


def _mismatched(pg, odd):
    """Rank `odd` puts the second all_reduce in a block of its own; the others put both in
    one block."""
    g = pg.new_group(list(range(pg.size)))
    x, y = _data(1, pg.rank, 6), _data(2, pg.rank, 6)
    err = None
    try:
        if pg.rank == odd:
            with g.coalesced():
                g.all_reduce(x, timeout=CALL_TIMEOUT)
            with g.coalesced():
                g.all_reduce(y, timeout=CALL_TIMEOUT)
        else:
            with g.coalesced():
                g.all_reduce(x, timeout=CALL_TIMEOUT)
                g.all_reduce(y, timeout=CALL_TIMEOUT)
    except meshcoll.MeshcollError as e:
        err = e
    return type(err).__name__ if err else None, str(err) if err else ""


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_ranks_that_form_different_blocks_get_a_mismatch_on_every_rank(transport):
    world, odd = 3, 1
    for rank, (kind, message) in enumerate(launch(world, _mismatched, transport=transport,
                                                  odd=odd)):
        assert kind == "MismatchError", (rank, kind, message)
        assert "coalesced block" in message, message


def _killed_in_block(pg, victim):
    """`victim` is killed (SIGKILL) inside its block, after its first call."""
    import os
    import signal
    import time
    x, y = _data(1, pg.rank, 1 << 12), _data(2, pg.rank, 1 << 12)
    t0 = time.monotonic()
    try:
        with pg.coalesced():
            pg.all_reduce(x, timeout=CALL_TIMEOUT)
            if pg.rank == victim:
                os.kill(os.getpid(), signal.SIGKILL)
            pg.all_reduce(y, timeout=CALL_TIMEOUT)
            pg.all_gather(y[:8], timeout=CALL_TIMEOUT)
        for _ in range(100):
            pg.all_reduce(x, timeout=CALL_TIMEOUT)
    except (meshcoll.PeerError, meshcoll.TimeoutError) as e:
        return type(e).__name__, str(e), time.monotonic() - t0
    return "no error", "", time.monotonic() - t0


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_a_rank_killed_inside_a_block_is_named_on_every_survivor(transport):
    world, victim = 3, 1
    res = launch(world, _killed_in_block, transport=transport, may_die=(victim,), victim=victim)
    for rank, r in enumerate(res):
        if rank == victim:
            assert r is None, r
            continue
        kind, msg, took = r
        # A PeerError naming the dead rank, well before the calls' 30 s deadline.
        assert kind == "PeerError", (rank, r)
        assert f"rank {victim}" in msg, msg
        assert took < CALL_TIMEOUT, (rank, took)


def _destroyed_in_block(pg):
    """destroy() inside an open block: the block's calls were issued, so they run first; the
    group is then destroyed cleanly and later calls say so."""
    g = pg.new_group(list(range(pg.size)))
    x = _data(1, pg.rank, 16)
    with g.coalesced():
        g.all_reduce(x, timeout=CALL_TIMEOUT)
        g.destroy()
    try:
        g.all_reduce(x)
        after = "no error"
    except meshcoll.MeshcollError as e:
        after = type(e).__name__
    return x, after


def test_destroy_inside_a_block_runs_its_calls_then_closes_the_group():
    world = 2
    for x, after in launch(world, _destroyed_in_block):
        np.testing.assert_allclose(x, sum(_data(1, k, 16) for k in range(world)), rtol=1e-12)
        assert after == "AbortedError", after


def _fused(pg):
    """Note [Fused all_reduces]: a block's small synchronous all_reduces run together at its
    end (or before the group's next other call), consecutive ones of one dtype and op fused
    into one call."""
    sizes = [1, 7, 2, 300, 5, 64, 3, 1000, 9, 4]
    xs = [_data(30 + i, pg.rank, n, np.float32) for i, n in enumerate(sizes)]
    ms = [_data(50 + i, pg.rank, n) for i, n in enumerate((3, 11))]
    b = _data(60, pg.rank, 5)
    before = pg.recent_calls(64)
    with pg.coalesced():
        for x in xs[:6]:
            pg.all_reduce(x)
        early = xs[0].copy()  # staged, not run yet: still this rank's own values
        for m in ms:
            pg.all_reduce(m, op="max")
        pg.broadcast(b, 0)  # runs the staged calls first, then itself
        for x in xs[6:]:
            pg.all_reduce(x)
    calls = pg.recent_calls(64)[len(before):]
    return xs, ms, b, early, calls


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_a_blocks_small_all_reduces_are_fused_and_give_numpys_answer(transport):
    world = 2
    sizes = [1, 7, 2, 300, 5, 64, 3, 1000, 9, 4]
    for rank, (xs, ms, b, early, calls) in enumerate(launch(world, _fused, transport=transport)):
        for i, (x, n) in enumerate(zip(xs, sizes)):
            want = sum(_data(30 + i, k, n, np.float32) for k in range(world))
            np.testing.assert_allclose(x, want, rtol=1e-6, err_msg=str(i))
        for i, (m, n) in enumerate(zip(ms, (3, 11))):
            np.testing.assert_array_equal(m, np.maximum(*[_data(50 + i, k, n)
                                                          for k in range(world)]))
        np.testing.assert_array_equal(b, _data(60, 0, 5))
        np.testing.assert_array_equal(early, _data(30, rank, 1, np.float32))
        # Twelve all_reduces and a broadcast made four calls: the six float32 sums, the two
        # float64 maxes, the broadcast, the last four float32 sums.
        assert len(calls) == 4, calls
        assert calls[0].startswith(f"all_reduce(count={sum(sizes[:6])}, float32, sum"), calls
        assert calls[1].startswith("all_reduce(count=14, float64, max"), calls
        assert calls[2].startswith("broadcast("), calls
        assert calls[3].startswith(f"all_reduce(count={sum(sizes[6:])}, float32, sum"), calls


def _permuted(pg):
    """The same total count, split differently: rank 0 reduces 2 then 3 elements, the others 3
    then 2. Fused, the totals agree: the layout in the description must not."""
    g = pg.new_group(list(range(pg.size)))
    first, second = (2, 3) if g.rank == 0 else (3, 2)
    a, b = _data(1, g.rank, first), _data(2, g.rank, second)
    try:
        with g.coalesced():
            g.all_reduce(a, timeout=CALL_TIMEOUT)
            g.all_reduce(b, timeout=CALL_TIMEOUT)
    except meshcoll.MeshcollError as e:
        return type(e).__name__, str(e)
    return "no error", ""


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_calls_fused_differently_across_ranks_are_a_mismatch_on_every_rank(transport):
    for rank, (kind, msg) in enumerate(launch(3, _permuted, transport=transport)):
        assert kind == "MismatchError", (rank, kind, msg)
        assert "count=5" in msg, msg
