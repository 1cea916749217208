"""Issue 34, items 0, 3 and 14 on NCCL: in the default (async) agreement mode, no host
synchronization point of meshcoll returns success while an earlier call of the group is
unagreed (Note [Results at host synchronization points] in csrc/nccl/op_ring.cc); the
internal exchanges of composed calls never pair with a user's call; completed calls show as
done in the ledger and count in group.stats().

Ranks disagree on a call NCCL completes (rank 0 sums, the others take the max), so only
the side channel can tell: before, barrier(), Work.synchronize() and a read of the data all
succeeded on every rank with a void result, and the MismatchError came at destroy()."""

from __future__ import annotations

import numpy as np
import pytest

import meshcoll
from test_nccl import destroy_failed, gpus, needs_torch, run_nccl, NGPU

pytestmark = [needs_torch, pytest.mark.timeout(240)]

WORLDS = [n for n in (2, 4) if n <= max(NGPU, 2)]

# Each rank its own host, as a job across hosts runs: NCCL over its network transport, the
# side channel over TCP, no direct kernels.
HOSTS = {"MESHCOLL_HOST_ID": "host{rank}", "NCCL_HOSTID": "host{rank}",
         "NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "1"}

SYNC_POINTS = ("barrier", "synchronize", "wait_host", "is_completed", "numpy_all_gather")


def _sync_point(g, point, work):
    import torch
    if point == "barrier":
        g.barrier()
    elif point == "synchronize":
        work.synchronize()
    elif point == "wait_host":  # a barrier's Work blocks the host in wait()
        g.barrier(async_op=True).wait()
    elif point == "is_completed":
        while not work.is_completed():
            pass
        work.wait()
        torch.cuda.synchronize()
    else:
        g.all_gather(np.arange(3, dtype=np.int64) + g.rank)


def _disagree_then_sync(pg, n):
    import torch
    out = {}
    for point in SYNC_POINTS:
        g = pg.new_group(list(range(pg.size)))
        x = torch.rand(n, device="cuda")
        g.all_reduce(x)
        g.barrier()  # agreed: the group works
        x.fill_(1.0 + g.rank)
        try:
            w = g.all_reduce(x, op="sum" if g.rank == 0 else "max", async_op=True)
            torch.cuda.synchronize()  # NCCL completed it: only the check can tell
            _sync_point(g, point, w)
            out[point] = ("no error", float(x[0].item()))
        except meshcoll.MeshcollError as e:
            out[point] = (type(e).__name__, str(e)[:300])
        destroy_failed(g)
    return out


@gpus(2)
@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("hosts", [False, True], ids=["one_host", "emulated_hosts"])
def test_no_sync_point_returns_success_after_a_disagreement(world, hosts):
    # One host: 1M floats, above the direct kernels' sizes (they check the call themselves).
    n = 1024 if hosts else 1 << 20
    res = run_nccl(world, _disagree_then_sync, n=n, env=HOSTS if hosts else None, deadline=200)
    for rank, points in enumerate(res):
        for point, (kind, detail) in points.items():
            assert kind == "MismatchError", (rank, point, kind, detail)
            assert "max" in detail and "sum" in detail, (rank, point, detail)


def _agreed_calls_stay_right(pg, n):
    """The same sync points after calls that agree: results right, no error."""
    import torch
    wrong = []
    for point in SYNC_POINTS:
        for _ in range(20):
            x = torch.rand(n, device="cuda", generator=torch.Generator("cuda").manual_seed(7))
            x += pg.rank
            w = pg.all_reduce(x, async_op=True)
            _sync_point(pg, point, w)
            w.wait()
            base = torch.rand(n, device="cuda", generator=torch.Generator("cuda").manual_seed(7))
            want = base.double().cpu().numpy() * pg.size + sum(range(pg.size))
            if not np.allclose(x.double().cpu().numpy(), want, rtol=1e-5, atol=1e-5):
                wrong.append(point)
    return wrong


@gpus(2)
def test_sync_points_after_agreeing_calls_return_right_results():
    assert run_nccl(2, _agreed_calls_stay_right, n=1 << 16) == [[], []]


def _exchange_against_user_call(pg):
    """Rank 0's all_to_all_v exchanges its counts through a host all_gather; rank 1 calls a
    user's all_gather of a numpy array of the same size and dtype. Before, the two paired:
    rank 1 got rank 0's counts as its data."""
    import torch
    try:
        if pg.rank == 0:
            pg.all_to_all_v(torch.ones(6, device="cuda"), [3, 3])
        else:
            pg.all_gather(np.array([7, 9], dtype=np.int64))
        return "no error"
    except meshcoll.MismatchError as e:
        return "all_to_all_v" in str(e)


@gpus(2)
def test_internal_exchanges_never_pair_with_a_users_host_all_gather():
    assert run_nccl(2, _exchange_against_user_call) == [True, True]


def _stats(pg):
    import time
    import torch
    g = pg.new_group(list(range(pg.size)))
    for _ in range(3):
        g.all_reduce(torch.ones(100, device="cuda"))  # 400 bytes each
    g.all_gather(torch.ones(7, device="cuda", dtype=torch.float64))  # 2 x 7 float64: 112
    buf = torch.arange(5, device="cuda", dtype=torch.float32)  # 20 bytes a message
    if g.rank == 0:
        g.send(buf, 1)
        g.isend(buf, 1).wait()
    else:
        g.recv(buf, 0)
        g.irecv(buf, 0).wait()
    g.barrier()
    torch.cuda.synchronize()
    time.sleep(0.2)  # the watchdog sees them complete within a few milliseconds
    stats = {k: (s.calls, s.bytes, s.seconds) for k, s in g.stats().items()}
    pending = [c for c in g.recent_calls() if "pending" in c]
    g.destroy()
    return stats, pending


@gpus(2)
def test_completed_nccl_calls_are_done_in_the_ledger_and_counted_in_stats():
    for stats, pending in run_nccl(2, _stats):
        assert pending == [], pending
        assert stats["all_reduce"] == (3, 1200, 0.0), stats
        assert stats["all_gather"] == (1, 112, 0.0), stats
        assert stats["send/recv"] == (2, 40, 0.0), stats
