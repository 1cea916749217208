"""The agreement check that guards NCCL groups (Note [Agreement on a side channel] and Note
[Agreement before launch] in csrc/comm/agreement.h), run on CPU groups through its test hook
``_C._AgreementProbe``: the real check over a real channel among real processes, without
the GPU work it guards. Ranks issue calls as an NCCL group does, await some as a call on
symmetric memory does (a host-side barrier that must agree before launch), and the tests
assert what every rank raises: nothing when the calls agree, MismatchError when they differ,
TimeoutError naming the late rank, PeerError naming a dead one."""

import random
import time

import pytest

import meshcoll
from conftest import kill_after_others
from meshcoll import _C

TIMEOUT = 30.0


def _probe(pg, strict=False, timeout=TIMEOUT):
    g = pg.new_group(list(range(pg.size)))  # the channel: used by the probe alone
    pg.barrier(timeout=TIMEOUT)
    return _C._AgreementProbe(g._backend, strict, timeout)


def _outcome(call):
    """(error class name or None, message)."""
    try:
        call()
    except meshcoll.MeshcollError as e:
        return type(e).__name__, str(e)
    return None, ""


# ---- agreeing calls ------------------------------------------------------------------------

def _agreeing_stream(pg, calls, seed):
    # The same calls on every rank; each rank's own pauses between them, so ranks drift
    # apart and the checker's rounds and the callers' awaits interleave in every order.
    plan = random.Random(seed)
    mine = random.Random(seed * 1000 + pg.rank)
    p = _probe(pg)
    awaited = 0
    for _ in range(calls):
        kind = plan.choice(["all_reduce", "all_gather", "broadcast", "reduce_scatter"])
        seq = p.note(kind, plan.randint(1, 1 << 20))
        if plan.random() < 0.3:  # a call on symmetric memory: agree before launch
            p.await_(seq, TIMEOUT)
            awaited += 1
        if mine.random() < 0.2:
            time.sleep(mine.random() * 0.002)
    # The last call agreed on every rank once an await of it returns.
    p.await_(p.note("barrier", 0), TIMEOUT)
    p.raise_failure()
    p.stop()
    return awaited


@pytest.mark.timeout(120)
@pytest.mark.parametrize("transport", ["tcp", "shm"])
@pytest.mark.parametrize("world", [2, 3])
def test_agreeing_calls_pass_with_awaits_interleaved(run_ranks, world, transport):
    res = run_ranks(world, _agreeing_stream, transport=transport, calls=600, seed=world)
    assert len(set(res)) == 1 and res[0] > 100, res


def _late_peer(pg, delay):
    p = _probe(pg)
    p.note("all_reduce", 8)
    if pg.rank == 1:
        time.sleep(delay)
    seq = p.note("all_reduce", 16)
    t0 = time.monotonic()
    p.await_(seq, TIMEOUT)
    waited = time.monotonic() - t0
    p.raise_failure()
    p.stop()
    return waited


@pytest.mark.timeout(60)
def test_await_waits_for_a_late_peer(run_ranks):
    # The host-side barrier: rank 0's await returns only once rank 1 issued the call.
    waited = run_ranks(2, _late_peer, delay=0.5)
    assert waited[0] >= 0.4, waited


# ---- disagreements -------------------------------------------------------------------------

def _disagree(pg, at, awaited, strict):
    p = _probe(pg, strict=strict)
    seen = []
    for i in range(1, at + 5):
        count = 100 + i + (1 if i == at and pg.rank == 1 else 0)
        err = _outcome(lambda: p.note("all_reduce", count))
        if err[0]:
            seen.append(("note", i) + err)
            break
        if awaited and i >= at - 1:
            err = _outcome(lambda: p.await_(i, TIMEOUT))
            if err[0]:
                seen.append(("await", i) + err)
                break
    deadline = time.monotonic() + TIMEOUT
    while not seen and time.monotonic() < deadline:  # async: the checker finds it
        err = _outcome(p.raise_failure)
        if err[0]:
            seen.append(("checker", 0) + err)
        time.sleep(0.01)
    failed_seq = p.failed_seq()
    p.stop(abandon=True)
    return seen, failed_seq


@pytest.mark.timeout(90)
@pytest.mark.parametrize("transport", ["tcp", "shm"])  # the channel's
@pytest.mark.parametrize("mode", ["async", "awaited", "strict"])
def test_disagreement_is_a_mismatch_on_every_rank(run_ranks, mode, transport):
    at = 7
    res = run_ranks(2, _disagree, at=at, awaited=mode == "awaited", strict=mode == "strict",
                    transport=transport)
    for rank, (seen, failed_seq) in enumerate(res):
        assert len(seen) == 1, (rank, seen)
        where, i, cls, msg = seen[0]
        assert cls == "MismatchError", (rank, seen)
        assert "all_reduce(count=107" in msg and "all_reduce(count=108" in msg, msg
        assert f"[seq {at}]" in msg, msg
        assert failed_seq == at, (rank, failed_seq)
        if mode == "awaited":  # raised before the call could launch
            assert (where, i) == ("await", at), (rank, seen)
        if mode == "strict":
            assert (where, i) == ("note", at), (rank, seen)


# ---- a peer that stops issuing, or dies ------------------------------------------------------

def _peer_stops(pg):
    p = _probe(pg, timeout=2.0)
    for _ in range(3):
        p.note("all_gather", 64)
    if pg.rank == 1:  # issues nothing more until rank 0 gave up
        time.sleep(4.0)
        p.stop(abandon=True)
        return None
    seq = p.note("all_gather", 64)
    t0 = time.monotonic()
    err = _outcome(lambda: p.await_(seq, 1.0))
    p.stop(abandon=True)
    return err + (time.monotonic() - t0,)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_await_of_a_call_a_peer_never_makes_names_that_peer(run_ranks, transport):
    cls, msg, took = run_ranks(2, _peer_stops, transport=transport)[0]
    assert cls == "TimeoutError", msg
    assert "never issued by rank 1" in msg and "all_gather(count=64" in msg, msg
    assert took < 2.5, took  # its own timeout (1 s), not the group's or rank 1's pause


def _peer_dies(pg):
    p = _probe(pg)
    p.await_(p.note("all_reduce", 4), TIMEOUT)
    kill_after_others(pg, 1, "await")
    err = _outcome(lambda: p.await_(p.note("all_reduce", 4), TIMEOUT))
    p.stop(abandon=True)
    return err


@pytest.mark.timeout(60)
@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_a_dead_peer_ends_an_await_with_peer_error(run_ranks, transport):
    res = run_ranks(2, _peer_dies, may_die=(1,), transport=transport)
    cls, msg = res[0]
    assert cls == "PeerError", msg
    assert "rank 1" in msg, msg
