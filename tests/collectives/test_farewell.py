"""A call whose part on a rank only sends (a broadcast root, a reduce leaf, a p2p sender)
returns over TCP before its peers looked at what it sent; when they disagree, or nobody
receives, that rank learns it at its next call or, when none follows, at ``destroy()``, which
raises MismatchError naming the ranks and the calls (Note [Farewell] in
csrc/transport/transport.h; issue 34 item 8). Matched calls still destroy cleanly.

One job of real processes over loopback TCP runs every case, each on a fresh TCP group.
"""

import numpy as np
import pytest

import meshcoll
from conftest import launch

CALL_TIMEOUT = 20.0


def _outcome(call):
    try:
        call()
        return None, ""
    except meshcoll.MeshcollError as e:
        return type(e).__name__, str(e)


def _matched(g, rng, checks):
    """Send-only roles whose peers agree: the values arrive and destroy() is quiet."""
    want = [rng.standard_normal(64).astype(np.float32) for _ in range(g.size)]
    x = want[0].copy() if g.rank == 0 else np.zeros(64, np.float32)
    g.broadcast(x, 0, timeout=CALL_TIMEOUT)
    checks.append(np.array_equal(x, want[0]))
    y = want[g.rank].copy()
    g.reduce(y, 0, timeout=CALL_TIMEOUT)
    if g.rank == 0:
        checks.append(np.allclose(y, sum(want), rtol=1e-5, atol=1e-5))
    if g.rank == 0:
        g.send(want[0], 1, tag=7, timeout=CALL_TIMEOUT)
    elif g.rank == 1:
        buf = np.zeros(64, np.float32)
        g.recv(buf, 0, tag=7, timeout=CALL_TIMEOUT)
        checks.append(np.array_equal(buf, want[0]))


def _root_vs_all_reduce(g, rng, checks):
    # The root only sends; rank 1 finds the disagreement and aborts after the root returned.
    x = rng.standard_normal(64).astype(np.float32)
    if g.rank == 0:
        g.broadcast(x, 0, timeout=CALL_TIMEOUT)
    else:
        g.all_reduce(x, timeout=CALL_TIMEOUT)


def _broadcast_vs_reduce(g, rng, checks):
    # Both parts only send: nobody receives, both calls return.
    x = rng.standard_normal(64).astype(np.float32)
    if g.rank == 0:
        g.broadcast(x, 0, timeout=CALL_TIMEOUT)
    else:
        g.reduce(x, 0, timeout=CALL_TIMEOUT)


def _both_send(g, rng, checks):
    # Two sends, no recv: both complete into the kernel's buffers.
    g.send(rng.standard_normal(16).astype(np.float32), 1 - g.rank, tag=3, timeout=CALL_TIMEOUT)


def _extra_broadcast(g, rng, checks):
    # Rank 0 makes one more call (a broadcast root) than rank 1.
    if g.rank == 0:
        g.broadcast(rng.standard_normal(64).astype(np.float32), 0, timeout=CALL_TIMEOUT)


CASES = {"matched": _matched, "root vs all_reduce": _root_vs_all_reduce,
         "broadcast vs reduce": _broadcast_vs_reduce, "both send": _both_send,
         "extra broadcast": _extra_broadcast}


def _cases_body(pg):
    rng = np.random.default_rng(1234)
    out = {}
    for name, case in CASES.items():
        g = pg.new_group([0, 1], transport="tcp", timeout=CALL_TIMEOUT)
        pg.barrier(timeout=CALL_TIMEOUT)
        checks = []
        call = _outcome(lambda: case(g, rng, checks))
        destroy = _outcome(g.destroy)
        out[name] = {"call": call, "destroy": destroy, "checks": checks}
    return out


@pytest.fixture(scope="module")
def outcomes():
    return launch(2, _cases_body, timeout=110)


def _raised(r):
    """The MismatchError this rank raised, from its call or else from destroy(); None if none."""
    for error, message in (r["call"], r["destroy"]):
        if error is not None:
            assert error == "MismatchError", f"{error}: {message}"
            return message
    return None


@pytest.mark.timeout(120)
def test_matched_send_only_roles_destroy_cleanly(outcomes):
    for rank, res in enumerate(outcomes):
        r = res["matched"]
        assert r["call"] == (None, "") and r["destroy"] == (None, ""), (rank, r)
        assert r["checks"] and all(r["checks"]), (rank, r["checks"])


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case,names", [
    ("root vs all_reduce", ("broadcast", "all_reduce")),
    ("broadcast vs reduce", ("broadcast", "reduce")),
    ("extra broadcast", ("broadcast",)),
])
def test_a_send_only_role_hears_of_a_disagreement_by_destroy(outcomes, case, names):
    for rank, res in enumerate(outcomes):
        r = res[case]
        message = _raised(r)
        assert message is not None, f"rank {rank} raised nothing, not even at destroy(): {r}"
        assert "rank 0" in message and "rank 1" in message, (rank, message)
        for name in names:
            assert name in message, (rank, name, message)


@pytest.mark.timeout(120)
def test_sends_nobody_received_are_an_error_at_destroy(outcomes):
    for rank, res in enumerate(outcomes):
        r = res["both send"]
        assert r["call"] == (None, ""), (rank, r)  # the send itself completes
        error, message = r["destroy"]
        assert error == "MismatchError", (rank, r)
        assert f"rank {1 - rank} sent 1 message(s) (tag 3) to rank {rank}" in message, message
        assert f"rank {rank} sent 1 message(s) to rank {1 - rank}" in message, message
