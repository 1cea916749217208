"""Point-to-point transfers are posted, not run to completion, by the group's worker, so
irecv-then-isend on both sides of a pair (the MPI idiom) cannot deadlock. A send or recv the
caller waits for runs on the caller's thread when the group is idle, and behind the posted
transfers otherwise (Note [Synchronous point-to-point] in csrc/python/bind_backend.cc)."""

import numpy as np
import pytest

import meshcoll
from conftest import kill_after_others

pytestmark = pytest.mark.timeout(60)


def _exchange(pg, count):
    peer = 1 - pg.rank
    got = np.empty(count, np.float64)
    r = pg.irecv(got, peer, tag=7)
    mine = np.random.default_rng(pg.rank).standard_normal(count)
    s = pg.isend(mine, peer, tag=7)
    r.wait()
    s.wait()
    np.testing.assert_array_equal(got, np.random.default_rng(peer).standard_normal(count))
    # A collective issued while transfers are still posted keeps both moving.
    r = pg.irecv(got, peer, tag=8)
    x = np.full(3, pg.rank + 1.0)
    pg.all_reduce(x)
    s = pg.isend(mine * 2, peer, tag=8)
    s.wait()
    r.wait()
    np.testing.assert_array_equal(got, 2 * np.random.default_rng(peer).standard_normal(count))
    assert x.tolist() == [3.0, 3.0, 3.0]
    return True


@pytest.mark.parametrize("count", [1, 1 << 20])
def test_irecv_before_isend_on_both_ranks(run_ranks, count):
    assert run_ranks(2, _exchange, count=count) == [True, True]


def _recv_times_out(pg, posted):
    if pg.rank == 0:
        with pytest.raises(meshcoll.TimeoutError, match="recv from rank 1") as e:
            if posted:  # on the worker (Note [Point-to-point in flight])
                pg.irecv(np.empty(4), 1, timeout=0.5).wait()
            else:  # on this thread (Note [Synchronous point-to-point])
                pg.recv(np.empty(4), 1, timeout=0.5)
        assert str(e.value).count("recv from rank 1") == 1, str(e.value)  # named once
        assert "timed out after 500 ms" in str(e.value), str(e.value)
    else:
        import time
        time.sleep(1.5)
    return True


@pytest.mark.parametrize("posted", [False, True], ids=["recv", "irecv"])
def test_recv_without_send_times_out(run_ranks, posted):
    assert run_ranks(2, _recv_times_out, posted=posted) == [True, True]


def _blocking_pairs(pg, count):
    peer = 1 - pg.rank
    rng = np.random.default_rng(pg.rank)
    mine = [rng.standard_normal(count) for _ in range(3)]
    theirs = np.random.default_rng(peer)
    want = [theirs.standard_normal(count) for _ in range(3)]
    got = [np.empty(count) for _ in range(3)]
    # Idle group: each send and recv runs on this thread, rank 0 first to send.
    for i in range(2):
        if pg.rank == 0:
            pg.send(mine[i], peer, tag=i)
            pg.recv(got[i], peer, tag=i)
        else:
            pg.recv(got[i], peer, tag=i)
            pg.send(mine[i], peer, tag=i)
    # A posted irecv: the blocking send queues behind it, and the order still matches.
    r = pg.irecv(got[2], peer, tag=2)
    pg.send(mine[2], peer, tag=2)
    r.wait()
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)
    return True


@pytest.mark.parametrize("transport", ["tcp", "shm"])  # the group's; transfers go over TCP
@pytest.mark.parametrize("count", [3, 1 << 20])
def test_blocking_send_recv_inline_and_behind_posted_transfers(run_ranks, count, transport):
    assert run_ranks(2, _blocking_pairs, count=count, transport=transport) == [True, True]


def _recv_from_the_dead(pg):
    kill_after_others(pg, 1, "about to recv")  # rank 1 dies about as rank 0's recv starts
    with pytest.raises(meshcoll.PeerError, match="recv from rank 1.*rank 1"):
        pg.recv(np.empty(4), 1, timeout=20)
    return True


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_blocking_recv_from_a_killed_peer_is_a_peer_error(run_ranks, transport):
    assert run_ranks(2, _recv_from_the_dead, may_die=(1,), transport=transport)[0] is True
