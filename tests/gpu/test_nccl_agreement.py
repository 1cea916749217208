"""NCCL groups never return wrong data silently (issue 16, items 1, 2 and 4): ranks that
disagree on a call get a MismatchError naming both calls (Note [Agreement on a side channel]
in csrc/comm/agreement.h), a failure found while no call was in Python is raised by the next
call, wait(), synchronize() or destroy(), a timeout names the ranks that never issued the
call, and a killed rank is a PeerError naming it on every survivor."""

from __future__ import annotations

import os
import signal
import time

import numpy as np
import pytest

import meshcoll
from conftest import meshcoll_threads
from test_nccl import destroy_failed, gpus, needs_torch, run_nccl, NGPU

pytestmark = [needs_torch, pytest.mark.timeout(240)]

WORLDS = [n for n in (2, 4) if n <= max(NGPU, 2)]

# (label, what rank 0 calls, what the others call): each pair disagrees in one way.
CASES = {
    "count": (lambda pg, t: pg.all_reduce(t.ones(1024, device="cuda")),
              lambda pg, t: pg.all_reduce(t.ones(2048, device="cuda")), "count=1024"),
    "dtype": (lambda pg, t: pg.all_reduce(t.ones(1024, device="cuda")),
              lambda pg, t: pg.all_reduce(t.ones(1024, device="cuda", dtype=t.float64)),
              "float64"),
    "op": (lambda pg, t: pg.all_reduce(t.ones(1024, device="cuda"), op="sum"),
           lambda pg, t: pg.all_reduce(t.ones(1024, device="cuda"), op="max"), "max"),
    "root": (lambda pg, t: pg.broadcast(t.ones(1024, device="cuda"), 0),
             lambda pg, t: pg.broadcast(t.ones(1024, device="cuda"), 1), "root"),
    "collective": (lambda pg, t: pg.all_reduce(t.ones(1024, device="cuda")),
                   lambda pg, t: pg.all_gather(t.ones(1024, device="cuda")), "all_gather"),
}


def _disagree(pg, strict):
    import torch
    out = {}
    for name, (first, others, text) in CASES.items():
        g = pg.new_group(list(range(pg.size)), check="strict" if strict else None)
        x = torch.ones(8, device="cuda")
        g.all_reduce(x)  # agreed: the group works
        torch.cuda.synchronize()
        t0 = time.monotonic()
        kind, msg, where = "no error", "", "call"
        try:
            (first if g.rank == 0 else others)(g, torch)
            where = "next call"
            # async: the next calls (each agreed) raise once the check found it.
            for _ in range(500):
                g.all_reduce(x)
                time.sleep(0.002)
            where = "never"
        except meshcoll.MeshcollError as e:
            kind, msg = type(e).__name__, str(e)
        out[name] = (kind, where, time.monotonic() - t0, text in msg, msg[:300])
        destroy_failed(g)
    return out


@gpus(2)
@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("strict", [False, True], ids=["async", "strict"])
def test_disagreeing_calls_raise_mismatch_on_every_rank(world, strict):
    res = run_nccl(world, _disagree, strict=strict, deadline=200)
    for rank, cases in enumerate(res):
        for name, (kind, where, took, named, msg) in cases.items():
            # The class is the witness: the group's 60 s deadline would be a TimeoutError.
            assert kind == "MismatchError", (rank, name, kind, msg)
            assert named, (rank, name, msg)
            if strict:  # raised by the disagreeing call itself, before launch
                assert where == "call", (rank, name, where)


def _strict_leaves_data_alone(pg):
    import torch
    g = pg.new_group(list(range(pg.size)), check="strict")
    x = torch.full((1000 + 24 * g.rank,), float(g.rank + 1), device="cuda")
    with pytest.raises(meshcoll.MismatchError):
        g.all_reduce(x)
    return bool((x == float(g.rank + 1)).all().item())


@gpus(2)
def test_strict_mode_raises_before_any_data_is_touched():
    assert run_nccl(2, _strict_leaves_data_alone) == [True, True]


def _world_check(pg, disagree):
    """The world group's check, as MESHCOLL_CHECK set it: whether a call (of sizes that
    differ across ranks if `disagree`) raised, whether its data was then left alone, and
    whether a checker thread runs (Note [Agreement on a side channel]: async mode's checker
    is the thread named mc-agreement). The threads are read first: once a peer has returned
    and destroyed the group, this rank's checker ends too (it leaves with its peers)."""
    import torch
    checker = "mc-agreement" in meshcoll_threads()
    x = torch.full((1000 + 24 * pg.rank * disagree,), float(pg.rank + 1), device="cuda")
    try:
        pg.all_reduce(x)
        torch.cuda.synchronize()
        raised = "no error"
    except meshcoll.MismatchError:
        raised = "MismatchError"
    untouched = bool((x == float(pg.rank + 1)).all().item()) if raised != "no error" else None
    return raised, untouched, checker


@gpus(2)
def test_meshcoll_check_in_the_environment_sets_the_world_groups_check():
    # The world group once ignored MESHCOLL_CHECK (it took the defaults): strict must raise
    # before launch, and off must run no checker; the default (async) runs one. (Only
    # strict is given calls that disagree: unchecked, they could hang NCCL.)
    assert run_nccl(2, _world_check, disagree=True, env={"MESHCOLL_CHECK": "strict"}) == \
        [("MismatchError", True, False)] * 2
    assert run_nccl(2, _world_check, disagree=False, env={"MESHCOLL_CHECK": "off"}) == \
        [("no error", None, False)] * 2
    assert run_nccl(2, _world_check, disagree=False) == [("no error", None, True)] * 2


def _check_disagrees(pg):
    try:
        pg.new_group(list(range(pg.size)), check="off" if pg.rank == 1 else "async")
        return "no error", ""
    except meshcoll.MismatchError as e:
        return "MismatchError", str(e)


@gpus(2)
def test_ranks_whose_check_differs_get_a_mismatch_error_before_nccl_starts():
    for kind, msg in run_nccl(2, _check_disagrees):
        assert kind == "MismatchError" and "check=" in msg and "'off' on rank 1" in msg, msg


def _subgroup_disagrees(pg):
    import torch
    # Ranks 0 and 1 make a subgroup; the others sit out of its ncclCommSplit. Each rank of
    # the parent compares the new group's members and check first, so all of them raise at
    # once, and the parent (not aborted by a split timeout) still computes the right sum.
    out = []
    for label, ranks, check in (("members", [0, 2] if pg.rank == pg.size - 1 else [0, 1], None),
                                ("check", [0, 1], "off" if pg.rank == 1 else None)):
        try:
            pg.new_group(ranks, check=check, timeout=30)
            out.append((label, "no error", ""))
        except meshcoll.MeshcollError as e:  # a split timeout would be a TimeoutError
            out.append((label, type(e).__name__, str(e)))
    rng = np.random.default_rng([7, pg.rank])
    x = torch.tensor(rng.standard_normal(4096), device="cuda")
    pg.all_reduce(x)
    want = sum(np.random.default_rng([7, r]).standard_normal(4096) for r in range(pg.size))
    out.append(("parent", "sum ok", bool(np.allclose(x.cpu().numpy(), want, atol=1e-12))))
    return out


@gpus(3)
def test_a_subgroups_disagreement_is_an_error_on_every_rank_of_the_parent():
    n = min(NGPU, 4)
    for rank, got in enumerate(run_nccl(n, _subgroup_disagrees)):
        (_, members, mmsg), (_, check, cmsg), parent = got
        assert members == "MismatchError" and f"[0, 2] on rank {n - 1}" in mmsg, (rank, mmsg)
        assert check == "MismatchError" and "'off' on rank 1" in cmsg, (rank, cmsg)
        assert parent == ("parent", "sum ok", True), (rank, parent)


def _raised_by_wait_and_destroy(pg):
    import torch
    # An async call whose partner disagrees: its Work raises even though the kernel ran;
    # a group on which nothing else is called raises at destroy().
    g = pg.new_group(list(range(pg.size)))
    x = torch.ones(4096 * (1 + g.rank), device="cuda")
    w = g.all_reduce(x, async_op=True)
    time.sleep(0.5)  # the check runs meanwhile
    try:
        w.synchronize(timeout=10)
        wait = "no error"
    except meshcoll.MismatchError:
        wait = "MismatchError"
    h = pg.new_group(list(range(pg.size)))
    h.all_reduce(torch.ones(16 + g.rank, device="cuda"))
    time.sleep(0.5)
    try:
        h.destroy()
        destroy = "no error"
    except meshcoll.MismatchError:
        destroy = "MismatchError"
    try:
        g.destroy()  # reported already: closes quietly
        again = "no error"
    except meshcoll.MeshcollError as e:
        again = type(e).__name__
    return wait, destroy, again


@gpus(2)
def test_failure_is_raised_by_wait_or_destroy():
    assert run_nccl(2, _raised_by_wait_and_destroy) == [("MismatchError", "MismatchError",
                                                         "no error")] * 2


def _late_peer(pg):
    import torch
    x = torch.ones(1 << 16, device="cuda")
    pg.all_reduce(x)
    torch.cuda.synchronize()
    if pg.rank == 1:
        time.sleep(8)  # never reaches the call below in time; its checker still answers
        try:  # by now rank 0 has failed the group and left
            pg.all_reduce(x)
            return "no error", 0.0
        except meshcoll.MeshcollError as e:
            return type(e).__name__, 0.0
    t0 = time.monotonic()
    try:
        pg.all_gather(x, timeout=2)
        torch.cuda.synchronize()
        pg.all_reduce(x)
        msg = "no error"
    except meshcoll.TimeoutError as e:
        msg = str(e)
    return msg, time.monotonic() - t0


@gpus(2)
def test_timeout_names_the_rank_that_never_issued_the_call():
    res = run_nccl(2, _late_peer, deadline=60)
    msg, took = res[0]
    assert "never issued by rank 1" in msg and "all_reduce" in msg, msg
    assert res[1][0] in ("PeerError", "TimeoutError"), res[1]


def _killed9(pg):
    import torch
    x = torch.ones(1 << 20, device="cuda")
    pg.all_reduce(x)
    torch.cuda.synchronize()
    if pg.rank == 1:
        time.sleep(0.3)
        os.kill(os.getpid(), signal.SIGKILL)
    t0 = time.monotonic()
    try:
        for _ in range(100000):
            pg.all_reduce(x, timeout=10)
            torch.cuda.synchronize()
        return "no error", "", 0.0
    except (meshcoll.PeerError, meshcoll.TimeoutError) as e:
        return type(e).__name__, str(e), time.monotonic() - t0


@gpus(2)
@pytest.mark.parametrize("world", WORLDS)
def test_kill9_is_an_error_naming_the_rank_on_every_survivor(world):
    res = run_nccl(world, _killed9, may_die=(1,), deadline=90)
    for rank, r in enumerate(res):
        if rank == 1:
            continue
        kind, msg, took = r
        assert kind in ("PeerError", "TimeoutError"), r
        assert "rank 1" in msg, msg


def _abort_on_error(pg):
    import torch
    pg.all_reduce(torch.ones(100 + pg.rank, device="cuda"))
    time.sleep(5)
    return "survived"


@gpus(2)
def test_on_error_abort_ends_every_rank():
    res = run_nccl(2, _abort_on_error, may_die=(0, 1), env={"MESHCOLL_ON_ERROR": "abort"})
    assert res == [None, None], res


def _relayed(pg):
    import torch
    g = pg.new_group(list(range(pg.size)))
    x = torch.ones(64, device="cuda")
    g.all_reduce(x)
    torch.cuda.synchronize()
    if g.rank == 0:
        g._backend.fail("rank 0 gave up on purpose")  # what ConcurrentCallError does
    try:  # a synchronous call is only enqueued: the failure may reach a later one
        for _ in range(100):
            g.all_reduce(x)
            torch.cuda.synchronize()
            time.sleep(0.05)
        return "no error"
    except meshcoll.MeshcollError as e:
        return f"{type(e).__name__}: {'gave up on purpose' in str(e)}"


@gpus(2)
def test_a_failed_group_is_failed_on_every_rank():
    # NCCL cannot tell peers that a rank failed its group; the side channel does.
    res = run_nccl(2, _relayed)
    assert res[0].endswith("True") and res[1] == "PeerError: True", res


def _rebuild_nccl(rank, world, port, token, late):
    """An NCCL world's MismatchError, then destroy() and init() in the same processes (issue 34
    item 13; Note [Generations] in csrc/store/tcp_store.h)."""
    os.environ.update(MESHCOLL_TOKEN=token, NCCL_NVLS_ENABLE="0")
    import torch
    torch.cuda.set_device(rank)
    kw = dict(rank=rank, world_size=world, master_addr="127.0.0.1", master_port=port,
              timeout=30, device=rank)
    pg = meshcoll.init("nccl", **kw)
    x = torch.ones(1 << 20, device="cuda")  # NCCL's path, not the direct kernels
    try:
        pg.all_reduce(x, op="sum" if rank == 0 else "max")
        torch.cuda.synchronize()
        pg.barrier()
        caught = "no error"
    except meshcoll.MismatchError:
        caught = "MismatchError"
    if rank == late:
        time.sleep(1.0)
    try:
        meshcoll.destroy()
    except meshcoll.MeshcollError:
        pass  # the failed world's error again
    t0 = time.monotonic()
    pg = meshcoll.init("nccl", **kw)
    took = time.monotonic() - t0
    y = torch.full((1 << 20,), float(rank + 1), device="cuda")
    pg.all_reduce(y)
    right = bool((y.cpu() == world * (world + 1) / 2).all())
    meshcoll.destroy()
    return caught, right, took


@gpus(2)
def test_destroy_then_init_after_a_mismatch_on_nccl():
    import secrets
    from conftest import free_port, spawn
    world = min(NGPU, 4)
    res = spawn(world, _rebuild_nccl, world, free_port(), secrets.token_hex(8), 0, timeout=150)
    for rank, (caught, right, took) in enumerate(res):
        assert right, (rank, caught, took)
        assert took < 20, (rank, took)  # NCCL's init, not a timeout
