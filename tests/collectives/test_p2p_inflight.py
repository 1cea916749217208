"""Point-to-point transfers are posted, not run to completion, by the group's worker, so
irecv-then-isend on both sides of a pair (the MPI idiom) cannot deadlock."""

import numpy as np
import pytest

import meshcoll

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


def _recv_times_out(pg):
    if pg.rank == 0:
        with pytest.raises(meshcoll.TimeoutError, match="recv from rank 1"):
            pg.recv(np.empty(4), 1, timeout=0.5)
    else:
        import time
        time.sleep(1.5)
    return True


def test_recv_without_send_times_out(run_ranks):
    assert run_ranks(2, _recv_times_out) == [True, True]
