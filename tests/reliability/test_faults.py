"""A rank killed with SIGKILL mid-collective: every survivor raises PeerError or
TimeoutError naming a rank, within its timeout plus 2 s, and never hangs."""

import os
import signal
import time

import numpy as np
import pytest

import meshcoll
from conftest import kill_after_others

pytestmark = pytest.mark.timeout(90)

OP_TIMEOUT = 5.0


def _die_during(pg, victim, op):
    x = np.ones(1 << 16, np.float32)
    # A broadcast root only sends, so it may run ahead of a failure by what the peers buffer
    # (Note [Unexpected-message cap]); it learns of the failure once that backs up.
    for i in range(100000):
        if pg.rank == victim and i == 3:
            os.kill(os.getpid(), signal.SIGKILL)
        t0 = time.monotonic()
        try:
            if op == "all_reduce":
                pg.all_reduce(x, timeout=OP_TIMEOUT)
            elif op == "broadcast":
                pg.broadcast(x, src=0, timeout=OP_TIMEOUT)
            elif op == "all_gather":
                pg.all_gather(x[:1024], timeout=OP_TIMEOUT)
            elif op == "sendrecv":
                right, left = (pg.rank + 1) % pg.size, (pg.rank - 1) % pg.size
                w = pg.isend(x, right, timeout=OP_TIMEOUT)
                pg.recv(np.empty_like(x), left, timeout=OP_TIMEOUT)
                w.wait()
        except (meshcoll.PeerError, meshcoll.TimeoutError) as e:
            return type(e).__name__, str(e), time.monotonic() - t0
    return "no error", "", 0.0


@pytest.mark.parametrize("op", ["all_reduce", "broadcast", "all_gather", "sendrecv"])
def test_sigkill_one_rank(run_ranks, op):
    world, victim = 4, 2
    res = run_ranks(world, _die_during, may_die=(victim,), victim=victim, op=op, timeout=60)
    for rank, r in enumerate(res):
        if rank == victim:
            continue
        kind, msg, elapsed = r
        assert kind in ("PeerError", "TimeoutError"), (rank, r)
        assert "rank" in msg, msg
        # Never past the op's own deadline: a PeerError (the death seen) or the TimeoutError
        # that deadline gives, naming its length; a hang is the launcher's timeout.
        assert kind == "PeerError" or f"{int(OP_TIMEOUT * 1000)} ms" in msg, (rank, msg)


def _survivor_after_abort(pg):
    """After a peer died, further collectives on the group fail at once with AbortedError."""
    if pg.rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    x = np.ones(8, np.float32)
    with pytest.raises((meshcoll.PeerError, meshcoll.TimeoutError)):
        pg.all_reduce(x, timeout=OP_TIMEOUT)
    # AbortedError is the witness of "at once": waiting out the call's deadline would be a
    # TimeoutError (or a PeerError from the dead connection).
    with pytest.raises(meshcoll.AbortedError, match="aborted"):
        pg.all_reduce(x, timeout=OP_TIMEOUT)
    return True


def test_group_is_aborted_after_a_failure(run_ranks):
    res = run_ranks(3, _survivor_after_abort, may_die=(1,))
    assert res[0] is True and res[2] is True


def _unreported_failure(pg, hosts=None):
    """Note [Failure types]: a failure nobody has heard of yet (a receive from a peer that
    died, never waited for) reaches the next call with its own type; after that, calls are
    AbortedError; the failed receive's own Work still raises its failure. `hosts`: the same
    on a hierarchical group (one leader per emulated host, as test_hierarchy.py makes it)."""
    x = np.ones(4, np.float32)
    g = pg
    if hosts:
        os.environ["MESHCOLL_HOST_ID"] = hosts[pg.rank]
        meshcoll._C.reload_config()
        g = pg.new_group(list(range(pg.size)))
        assert g._hier is not None
    g.barrier()
    kill_after_others(pg, 1, "barrier")  # (a flake once: rank 3 still waited in the barrier)
    w = g.irecv(np.empty_like(x), 1, timeout=OP_TIMEOUT)
    deadline = time.monotonic() + 3 * OP_TIMEOUT
    while not w.is_completed() and time.monotonic() < deadline:
        time.sleep(0.01)  # is_completed() learns of the failure without raising it
    kinds = []
    for call in (lambda: g.all_reduce(x, timeout=OP_TIMEOUT),
                 lambda: g.all_reduce(x, timeout=OP_TIMEOUT), w.wait):
        try:
            call()
            kinds.append("no error")
        except meshcoll.MeshcollError as e:
            kinds.append((type(e).__name__, str(e)))
    return kinds


@pytest.mark.parametrize("world,transport,hosts", [
    (2, "tcp", None), (2, "shm", None), (4, "auto", ["a", "a", "b", "b"])],
    ids=["tcp", "shm", "hierarchy"])
def test_the_first_call_to_hear_of_a_failure_gets_its_type(run_ranks, world, transport, hosts):
    res = run_ranks(world, _unreported_failure, may_die=(1,), transport=transport, hosts=hosts)
    for rank, r in enumerate(res):
        if rank == 1:
            continue
        first, then, own = r
        assert first[0] == "PeerError" and "rank 1" in first[1], (rank, first)
        assert "not run: the group failed earlier" in first[1], (rank, first)
        assert then[0] == "AbortedError" and "rank 1" in then[1], (rank, then)
        assert own[0] == "PeerError" and "rank 1" in own[1], (rank, own)


def _late_rank(pg):
    return pg.rank


def _never_arrives(rank, port, token):
    os.environ["MESHCOLL_TOKEN"] = token
    try:
        meshcoll.init(rank=rank, world_size=3, master_addr="127.0.0.1", master_port=port, timeout=2)
    except (meshcoll.TimeoutError, meshcoll.PeerError) as e:
        return type(e).__name__ + ": " + str(e)
    return "no error"


def test_init_times_out_when_a_rank_never_arrives():
    import multiprocessing as mp
    from conftest import kill_after_others, free_port
    port = free_port()
    with mp.get_context("spawn").Pool(2) as pool:
        res = pool.starmap(_never_arrives, [(0, port, "t"), (1, port, "t")])
    for r in res:
        assert r.startswith("TimeoutError"), r
        assert "rank(s) 2" in r, r
        assert "within 2000 ms" in r, r  # init's own 2 s deadline ended it


def _mismatch_then_wait(pg):
    import numpy as np
    try:
        pg.all_reduce(np.ones(10 + pg.rank, np.float32), timeout=10)
    except meshcoll.MismatchError:
        return "raised"  # MESHCOLL_ON_ERROR=raise: the caller decides
    return "no error"


@pytest.mark.timeout(60)
@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_on_error_abort_ends_every_rank_with_the_diagnosis(run_ranks, transport):
    # MESHCOLL_ON_ERROR=abort: the failed group ends each process (exit code 1) instead of
    # raising; the default raises.
    assert run_ranks(2, _mismatch_then_wait, may_die=(0, 1), transport=transport,
                     env={"MESHCOLL_ON_ERROR": "abort"}) == [None, None]
    assert run_ranks(2, _mismatch_then_wait, transport=transport) == ["raised", "raised"]


def test_on_error_and_check_settings_are_validated():
    from meshcoll import _settings
    assert _settings.core_config_from_env({"MESHCOLL_ON_ERROR": "abort"}).abort_on_error
    assert not _settings.core_config_from_env({}).abort_on_error
    assert _settings.group_options_from_env({"MESHCOLL_CHECK": "strict"}).check == "strict"
    with pytest.raises(ValueError, match="MESHCOLL_ON_ERROR"):
        _settings.core_config_from_env({"MESHCOLL_ON_ERROR": "explode"})
    with pytest.raises(ValueError, match="MESHCOLL_CHECK"):
        _settings.group_options_from_env({"MESHCOLL_CHECK": "sometimes"})
