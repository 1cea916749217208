"""Internal exchanges never pair with a user's call (Note [Internal exchanges] in
csrc/common/op_desc.h): the count exchange of all_to_all_v and all_gather_v, and split's exchange
of colors, are described as their own kinds, so a rank making one of them while a peer makes a
user's all_to_all or all_gather of a small int64 array (the same count and dtype) gets a
MismatchError naming both calls, on every rank, instead of handing its counts to the peer as
data. Over shared memory and TCP; 2 ranks.
"""

import numpy as np
import pytest

import meshcoll
from conftest import launch

pytestmark = pytest.mark.timeout(120)

CALL_TIMEOUT = 30.0


def _internal(g, name):
    """Rank 0's call: one whose first round is an internal exchange of two int64 per rank,
    or (split) three."""
    if name == "all_to_all_v":
        return g.all_to_all_v(np.arange(4, dtype=np.float32), [2, 2], timeout=CALL_TIMEOUT)
    if name == "all_gather_v":
        return g.all_gather_v(np.arange(3, dtype=np.float32), timeout=CALL_TIMEOUT)
    return g.split(0, key=g.rank, timeout=CALL_TIMEOUT)


def _user(g, name):
    """Rank 1's call: the user's collective that looks like rank 0's exchange."""
    if name == "all_to_all_v":
        return g.all_to_all(np.array([7, 9], np.int64), timeout=CALL_TIMEOUT)
    if name == "all_gather_v":
        return g.all_gather(np.array([7, 9], np.int64), timeout=CALL_TIMEOUT)
    return g.all_gather(np.array([7, 9, 11], np.int64), timeout=CALL_TIMEOUT)


def _body(pg, names):
    out = {}
    for name in names:
        g = pg.new_group(list(range(pg.size)))
        pg.barrier(timeout=CALL_TIMEOUT)
        try:
            got = _internal(g, name) if g.rank == 0 else _user(g, name)
            out[name] = ("no error", repr(got))
        except meshcoll.MeshcollError as e:
            out[name] = (type(e).__name__, str(e))
        g.destroy()
    # The exchanges still pair with themselves: the calls work when every rank makes them.
    g = pg.new_group(list(range(pg.size)))
    got, counts = g.all_to_all_v(np.arange(4, dtype=np.float32) + 10 * g.rank,
                                 [1, 3] if g.rank == 0 else [2, 2], timeout=CALL_TIMEOUT)
    out["all_to_all_v ok"] = (counts, got.tolist())
    got, counts = g.all_gather_v(np.full(g.rank + 1, g.rank, np.float32), timeout=CALL_TIMEOUT)
    out["all_gather_v ok"] = (counts, got.tolist())
    child = g.split(g.rank % 2, key=-g.rank, timeout=CALL_TIMEOUT)
    out["split ok"] = (child.size, child.rank)
    return out


NAMES = ["all_to_all_v", "all_gather_v", "split"]


@pytest.fixture(scope="module")
def outcomes():
    jobs = {}

    def get(transport):
        if transport not in jobs:
            jobs[transport] = launch(2, _body, timeout=110, transport=transport, names=NAMES)
        return jobs[transport]
    return get


@pytest.mark.parametrize("transport", ["shm", "tcp"])
@pytest.mark.parametrize("name", NAMES)
def test_an_internal_exchange_against_a_user_call_is_a_mismatch_on_every_rank(
        outcomes, transport, name):
    results = outcomes(transport)
    user = "all_to_all" if name == "all_to_all_v" else "all_gather"
    for rank, r in enumerate(results):
        kind, message = r[name]
        assert kind == "MismatchError", (rank, kind, message)
        # The message names both ranks and both calls: the exchange and the user's call.
        assert "rank 0" in message and "rank 1" in message, (rank, message)
        assert f"{user}(count=" in message, (rank, message)
        assert "split's exchange" in message if name == "split" \
            else f"{name}'s count exchange" in message, (rank, message)


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_the_exchanges_still_pair_with_themselves(outcomes, transport):
    r0, r1 = outcomes(transport)
    assert r0["all_to_all_v ok"] == ([1, 2], [0.0, 10.0, 11.0]), r0
    assert r1["all_to_all_v ok"] == ([3, 2], [1.0, 2.0, 3.0, 12.0, 13.0]), r1
    for r in (r0, r1):
        assert r["all_gather_v ok"] == ([1, 2], [0.0, 1.0, 1.0]), r
    assert r0["split ok"] == (1, 0) and r1["split ok"] == (1, 0), (r0, r1)
