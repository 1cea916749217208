"""group.stats(): per collective kind, this rank's completed calls, their bytes and time, from
the call ledger (Note [Call totals] in csrc/comm/ledger.h); and a finished point-to-point
transfer shows as done in recent_calls() and has its MESHCOLL_DEBUG line."""

import os
import tempfile

import numpy as np
import pytest

import meshcoll
from conftest import group_on

pytestmark = pytest.mark.timeout(120)

CALL = 20.0


def _calls(g):
    """Known calls on `g` (2 ranks): their totals are exact."""
    peer = 1 - g.rank
    for _ in range(3):
        g.all_reduce(np.ones(100, np.float32), timeout=CALL)  # 400 bytes each
    for _ in range(2):
        g.broadcast(np.zeros(10, np.int64), 0, timeout=CALL)  # 80 bytes each
    g.all_gather(np.ones(7), timeout=CALL)  # the gathered result: 2 x 7 float64, 112 bytes
    g.all_reduce(np.ones(4), async_op=True).wait()  # 32 bytes
    buf = np.arange(5, dtype=np.float32)  # 20 bytes a message
    if g.rank == 0:  # blocking, then posted
        g.send(buf, peer, timeout=CALL)
        g.isend(buf, peer, tag=1).wait()
    else:
        g.recv(buf, peer, timeout=CALL)
        g.irecv(buf, peer, tag=1).wait()
    g.barrier(timeout=CALL)


def _logged(fn):
    """fn()'s MESHCOLL_DEBUG lines (the job sets it): this process's stderr, caught."""
    with tempfile.TemporaryFile() as f:
        saved = os.dup(2)
        os.dup2(f.fileno(), 2)
        try:
            fn()
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        f.seek(0)
        return f.read().decode()


def _run(pg):
    out = {}
    for transport in ("shm", "tcp"):
        g = group_on(pg, transport)
        assert g.transport == transport
        before = g.stats()
        log = _logged(lambda: _calls(g))
        stats = {k: (s.calls, s.bytes, s.seconds, s.bandwidth) for k, s in g.stats().items()}
        p2p = [c for c in g.recent_calls() if c.startswith("send/recv")]
        out[transport] = (before, stats, p2p, log)
        g.destroy()
    return out


def _p2p_only(pg):
    """A blocking send/recv, then a posted one: the ledger and the log, nothing else."""
    out = {}
    for transport in ("shm", "tcp"):
        g = group_on(pg, transport)
        buf = np.arange(5, dtype=np.float32)
        if g.rank == 0:
            log = _logged(lambda: (g.send(buf, 1, timeout=CALL), g.isend(buf, 1, tag=1).wait()))
        else:
            log = _logged(lambda: (g.recv(buf, 0, timeout=CALL), g.irecv(buf, 0, tag=1).wait()))
        out[transport] = ([c for c in g.recent_calls() if c.startswith("send/recv")], log)
        g.destroy()
    return out


def _check_p2p(rank, where, p2p, log):
    # Both transfers, blocking and posted, finished: done, not pending.
    assert len(p2p) == 2 and all(" done" in c for c in p2p), (where, p2p)
    # One debug line per transfer, naming it, as collectives have.
    verb = "send to rank 1" if rank == 0 else "recv from rank 0"
    lines = [ln for ln in log.splitlines() if verb in ln]
    assert len(lines) == 2, (where, log)
    assert all("bytes=20 " in ln and "FAILED" not in ln for ln in lines), lines


def test_finished_send_recv_is_done_in_the_ledger_and_logged(run_ranks):
    for rank, out in enumerate(run_ranks(2, _p2p_only, env={"MESHCOLL_DEBUG": "1"}, timeout=100)):
        for transport, (p2p, log) in out.items():
            _check_p2p(rank, (rank, transport), p2p, log)


def test_stats_count_every_completed_call_and_p2p_completes(run_ranks):
    results = run_ranks(2, _run, env={"MESHCOLL_DEBUG": "1"}, timeout=100)
    want = {"all_reduce": (4, 3 * 400 + 32), "broadcast": (2, 160), "all_gather": (1, 112),
            "send/recv": (2, 40), "barrier": (2, 0)}
    for rank, out in enumerate(results):
        for transport, (before, stats, p2p, log) in out.items():
            where = (rank, transport)
            # Setting the group up ran one barrier.
            assert {k: (s.calls, s.bytes) for k, s in before.items()} == {"barrier": (1, 0)}
            assert {k: v[:2] for k, v in stats.items()} == want, (where, stats)
            for kind, (_, nbytes, seconds, bandwidth) in stats.items():
                assert seconds > 0, (where, kind)
                assert bandwidth == pytest.approx(nbytes / seconds), (where, kind)
            _check_p2p(rank, where, p2p, log)
            assert "all_reduce(count=100" in log, (where, log)


def test_stats_types():
    s = meshcoll.CallStats(calls=2, bytes=100, seconds=0.5)
    assert s.bandwidth == 200.0
    assert meshcoll.CallStats(0, 0, 0.0).bandwidth == 0.0
