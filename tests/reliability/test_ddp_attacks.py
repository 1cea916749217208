"""DataParallel under attack: a peer killed or stopped in the middle of a step ends the step
with an error naming it on every other rank (raised by wait(), whose all-reduces' ends the
C++ stamping thread observed: Note [Completion stamps]), within the group's timeout, and
leaves nothing hanging, over shared memory, TCP and a hierarchical group. Each job is a few real processes; a stopped rank is killed at the
end."""

import os
import re
import signal
import time

import numpy as np
import pytest

import meshcoll
from conftest import launch

pytestmark = pytest.mark.timeout(90)

NAMES = [f"w{i}" for i in range(8)]


def _step(ddp, rank, step, upto=None):
    """Hands over this step's gradients (the first ``upto`` of them) in backward order."""
    grads = {}
    for n in reversed(NAMES[-upto:] if upto else NAMES):
        grads[n] = np.random.default_rng([step, rank, int(n[1:])]).standard_normal(300)
        ddp.grad_ready(n, grads[n])
    return grads


def _attacked(pg, victim, how, hosts=None):
    from meshcoll.ddp import DataParallel
    pids = pg.all_gather(np.array([os.getpid()], np.int64)).ravel()
    if hosts:  # emulated hosts: the group is hierarchical (shared memory within, TCP across)
        os.environ["MESHCOLL_HOST_ID"] = hosts[pg.rank]
        meshcoll._C.reload_config()
    g = pg.new_group(list(range(pg.size)), timeout=3.0)  # over the job's transport
    if hosts and g._hier is None:
        return "not hierarchical"
    params = {n: np.zeros(300) for n in NAMES}
    ddp = DataParallel(params, group=g, bucket_cap_mb=600 * 8 / 2**20)  # 4 buckets
    grads = _step(ddp, pg.rank, 0)
    ddp.wait()  # one whole step: checked against numpy
    want = {n: sum(np.random.default_rng([0, r, int(n[1:])]).standard_normal(300)
                   for r in range(pg.size)) / pg.size for n in NAMES}
    if not all(np.allclose(grads[n], want[n], rtol=1e-12, atol=1e-12) for n in NAMES):
        return "wrong average"
    pg.barrier()
    if pg.rank == victim:
        _step(ddp, pg.rank, 1, upto=3)  # the first bucket's all-reduce is under way
        os.kill(os.getpid(), signal.SIGKILL if how == "kill" else signal.SIGSTOP)
    t0 = time.monotonic()
    try:
        _step(ddp, pg.rank, 1)
        ddp.wait()
        out = ("no error", "", time.monotonic() - t0)
    except (meshcoll.PeerError, meshcoll.TimeoutError) as e:
        out = (type(e).__name__, str(e), time.monotonic() - t0)
    finally:
        if pg.rank == 0 and how == "stop":
            os.kill(int(pids[victim]), signal.SIGKILL)
    t1 = time.monotonic()
    ddp.close()
    try:
        g.destroy()
    except meshcoll.MeshcollError:
        pass
    return out + (time.monotonic() - t1,)


@pytest.mark.parametrize("how", ["kill", "stop"])
@pytest.mark.parametrize("transport", ["shm", "tcp", "hierarchy"])
def test_a_peer_lost_mid_step_is_named_by_wait_on_every_rank(how, transport):
    hier = transport == "hierarchy"
    results = launch(3, _attacked, victim=2, how=how, transport="auto" if hier else transport,
                     hosts="ABA" if hier else None, may_die=(2,), timeout=60)
    for rank in (0, 1):
        assert results[rank] != "not hierarchical"
        kind, msg, took, teardown = results[rank]
        assert kind in ("PeerError", "TimeoutError"), (rank, kind, msg)
        assert took < 20, (rank, took)  # the group's 3 s timeout, not a hang
        assert teardown < 10, (rank, teardown)
        if hier and how == "stop" and rank == 1:
            # Rank 1 is alone on its host: it waits in the leaders' group for rank 0, which
            # waits on its host for the stopped rank 2, so its census names rank 0. A known
            # gap of the hierarchy's diagnosis (a stall on another host shows as its
            # leader's), not of DataParallel: rank 0's error names rank 2.
            continue
        assert re.search(r"rank(\(s\))? 2\b", msg), (rank, msg)
