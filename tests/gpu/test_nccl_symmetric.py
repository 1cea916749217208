"""Symmetric memory on NCCL groups (Note [Symmetric memory] in csrc/nccl/symmetric.h), the
in-place gathers, and collectives captured in CUDA graphs: values against numpy on random
data; ranks that disagree on where their buffers lie get MismatchError on every rank; memory
is given back."""

from __future__ import annotations

import os
import signal
import time

import numpy as np
import pytest

import meshcoll
from test_nccl import destroy_failed, gpus, needs_torch, run_nccl

pytestmark = [needs_torch, pytest.mark.timeout(240)]


def _rand(seed, n, dtype="float32"):
    import torch
    g = np.random.default_rng(seed)
    return torch.tensor(g.integers(-8, 9, n).astype(np.float32) + 0.5,
                        device="cuda").to(getattr(torch, dtype))


def _values(pg):
    import torch
    n, r = pg.size, pg.rank
    out = {"memory": pg.symmetric_memory}
    for dtype in ("float32", "bfloat16"):
        for count in (2, 1000, 1 << 20):
            x = pg.empty(count, dtype, symmetric=True)
            x.copy_(_rand(100 * count + r, count, dtype))
            want = sum(_rand(100 * count + k, count, dtype).double() for k in range(n))
            pg.all_reduce(x)
            out[(dtype, count, "all_reduce")] = bool(torch.equal(x.double(), want))
            out[(dtype, count, "symmetric")] = pg.is_symmetric(x)
    # all_gather / reduce_scatter between slices of one arena, in place and not.
    arena = pg.zeros(n * 4096 + 8192, "float32", symmetric=True)
    mine = _rand(7 + r, 4096)
    full = arena[:n * 4096].view(n, 4096)
    full[r].copy_(mine)
    pg.all_gather(full[r], out=full)  # in place
    out["all_gather in place"] = all(bool(torch.equal(full[k], _rand(7 + k, 4096)))
                                     for k in range(n))
    src = arena[:n * 4096]
    src.copy_(_rand(30 + r, n * 4096))
    pg.reduce_scatter(src, out=src[r * 4096:(r + 1) * 4096])  # in place
    want = sum(_rand(30 + k, n * 4096).double() for k in range(n))[r * 4096:(r + 1) * 4096]
    out["reduce_scatter in place"] = bool(torch.equal(src[r * 4096:(r + 1) * 4096].double(), want))
    # Broadcast and reduce take the one-call path on symmetric and ordinary memory alike.
    b = arena[n * 4096:n * 4096 + 100]
    b.copy_(_rand(60 + r, 100))
    pg.broadcast(b, src=n - 1)
    out["broadcast"] = bool(torch.equal(b, _rand(60 + n - 1, 100)))
    torch.cuda.synchronize()
    return out


@gpus(2)
def test_symmetric_arrays_give_exact_results():
    for rank, res in enumerate(run_nccl(2, _values)):
        assert res.pop("memory") == "nccl windows", rank
        bad = {k: v for k, v in res.items() if v is not True}
        assert not bad, (rank, bad)


def _overlaps(pg):
    """x and out that overlap other than in the in-place forms: ValueError before anything is
    sent (Note [Overlapping buffers]), so the group still works, on ordinary and symmetric
    memory alike."""
    import torch
    n, r = pg.size, pg.rank
    out = {}
    for label, make in (("ordinary", lambda c: torch.zeros(c, device="cuda")),
                        ("symmetric", lambda c: pg.zeros(c, "float32", symmetric=True))):
        a = make(8 * n * 32)
        cases = {
            "all_gather shifted": lambda: pg.all_gather(a[1:17], out=a[:n * 16].view(n, 16)),
            "reduce_scatter shifted": lambda: pg.reduce_scatter(a[:n * 16], out=a[8:24]),
            "all_gather out inside x": lambda: pg.all_gather(a[:n * 32], out=a[16:16 + n * n * 32]
                                                             .view(n, n * 32)),
        }
        for name, call in cases.items():
            try:
                call()
                out[(label, name)] = "no error"
            except ValueError as e:
                out[(label, name)] = "ValueError" if "overlap" in str(e) else str(e)[:200]
        x = _rand(5 + r, 64)
        pg.all_reduce(x)
        want = sum(_rand(5 + k, 64).double() for k in range(n))
        out[(label, "group works after")] = bool(torch.equal(x.double(), want))
    torch.cuda.synchronize()
    return out


@gpus(2)
def test_overlapping_buffers_raise_value_error_and_leave_the_group_working():
    for rank, res in enumerate(run_nccl(2, _overlaps)):
        for (label, name), v in res.items():
            assert v is True if name == "group works after" else v == "ValueError", (rank, res)


# (label, what rank 0 passes, what rank 1 passes): NCCL would pick different kernels.
def _disagree(pg, check):
    import torch
    out = {}
    # 1024 elements: meshcoll's direct kernels run the call, which see the disagreement at
    # their barrier. 1 << 17 (512 KiB, over their limit): NCCL's symmetric kernels, which do
    # not end at ncclCommAbort, so in either mode the call is agreed before launch (Note
    # [Agreement before launch]).
    cases = {}
    for n in (1024, 1 << 17):
        cases[f"ordinary vs symmetric, {n}"] = lambda g, a, n=n: a[:n] if g.rank == 0 else \
            torch.zeros(n, device="cuda")
        cases[f"offsets, {n}"] = lambda g, a, n=n: a[:n] if g.rank == 0 else a[256:256 + n]
    for name, pick in cases.items():
        g = pg.new_group([0, 1], timeout=20, check=check)
        arena = g.zeros(1 << 18, "float32", symmetric=True)
        g.all_reduce(arena[:8])  # agreed: the group works
        kind, msg = "no error", ""
        try:
            g.all_reduce(pick(g, arena))
            for _ in range(500):
                g.all_reduce(arena[:8])
                time.sleep(0.002)
        except meshcoll.MeshcollError as e:
            kind, msg = type(e).__name__, str(e)
        out[name] = (kind, "symmetric buffers" in msg, msg[:300])
        destroy_failed(g)
    # Sizes that differ: raised by empty() itself, before NCCL is asked.
    g = pg.new_group([0, 1], timeout=20)
    try:
        g.empty(1000 + 24 * g.rank, "float32", symmetric=True)
        out["sizes"] = ("no error", False, "")
    except meshcoll.MeshcollError as e:
        out["sizes"] = (type(e).__name__, "symmetric=True" in str(e), str(e)[:300])
    destroy_failed(g)
    return out


@gpus(2)
@pytest.mark.parametrize("check", ["async", "strict"])
def test_ranks_that_disagree_on_symmetric_buffers_get_mismatch(check):
    for rank, res in enumerate(run_nccl(2, _disagree, deadline=200, check=check)):
        for name, (kind, named, msg) in res.items():
            assert kind == "MismatchError", (rank, name, kind, msg)
            assert named, (rank, name, msg)


def _killed_in_symmetric_kernels(pg):
    """Rank 1 dies while rank 0 loops on symmetric all-reduces: rank 0's kernels wait on a
    peer that is gone, and NCCL's abort does not end them (Note [Bounded device
    synchronize])."""
    x = pg.zeros(1 << 20, "float32", symmetric=True)
    pg.all_reduce(x, async_op=True).synchronize()
    if pg.rank == 1:
        time.sleep(0.3)
        os.kill(os.getpid(), signal.SIGKILL)
    kind, msg = "no error", ""
    try:
        for _ in range(100000):
            pg.all_reduce(x, async_op=True, timeout=10).synchronize()
    except (meshcoll.PeerError, meshcoll.TimeoutError, meshcoll.AbortedError) as e:
        kind, msg = type(e).__name__, str(e)
    del x  # its memory is kept, not freed under a stuck kernel
    t0 = time.monotonic()
    destroy_failed(pg)
    return kind, msg[:400], time.monotonic() - t0


@gpus(2)
def test_a_peer_killed_inside_symmetric_kernels_is_an_error_and_destroy_returns():
    res = run_nccl(2, _killed_in_symmetric_kernels, may_die=(1,), deadline=120)
    kind, msg, destroy_s = res[0]
    assert kind in ("PeerError", "TimeoutError", "AbortedError"), res[0]
    assert "rank 1" in msg, msg
    assert destroy_s < 30, res[0]  # bounded: not the stuck kernel's forever


def _lifetime(pg):
    import torch
    free0 = torch.cuda.mem_get_info()[0]
    for i in range(12):  # 12 x 256 MiB; each allocation frees the block dropped before it
        x = pg.empty(64 << 20, "float32", symmetric=True)
        x.fill_(1.0)
        pg.all_reduce(x[:1024])
        del x
    pg.all_reduce(torch.ones(4, device="cuda"))
    torch.cuda.synchronize()
    grown = (free0 - torch.cuda.mem_get_info()[0]) / 2**20
    # Blocks dropped together past kDrainBytes (1 GiB) are freed at the next call.
    blocks = [pg.empty(64 << 20, "float32", symmetric=True) for _ in range(5)]
    pg.all_reduce(blocks[0][:1024])
    del blocks
    pg.all_reduce(torch.ones(4, device="cuda"))
    torch.cuda.synchronize()
    grown = max(grown, (free0 - torch.cuda.mem_get_info()[0]) / 2**20)
    # An array that outlives its group stays valid memory; dropping it later is safe.
    g = pg.new_group([0, 1])
    kept = g.zeros(1000, "float32", symmetric=True)
    kept.fill_(float(g.rank + 1))
    g.all_reduce(kept)
    g.destroy()
    after_destroy = float(kept.sum().item())
    try:
        g.all_reduce(kept)
        dead = "no error"
    except meshcoll.MeshcollError as e:
        dead = type(e).__name__
    del kept
    return grown, after_destroy, dead


@gpus(2)
def test_symmetric_memory_is_freed_and_outlives_its_group_safely():
    for grown, after_destroy, dead in run_nccl(2, _lifetime):
        assert grown < 600, grown  # MiB: at most a couple of blocks in flight
        assert after_destroy == 3000.0
        # A destroyed group's call raises AbortedError (Backend::shutdown): never a hang or
        # a silent write.
        assert dead == "AbortedError", dead


def _graph(pg):
    import torch
    n, r = pg.size, pg.rank
    res = {}
    for label, make in (("ordinary", lambda c: torch.zeros(c, device="cuda")),
                        ("symmetric", lambda c: pg.zeros(c, "float32", symmetric=True))):
        x = make(4096)
        ag = make(n * 256)
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            pg.all_reduce(x)  # warm-up outside the capture
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            pg.all_reduce(x)
            pg.all_gather(ag[r * 256:(r + 1) * 256], out=ag.view(n, 256))
        ok = True
        for step in range(5):
            x.copy_(_rand(1000 * step + r, 4096))
            ag[r * 256:(r + 1) * 256].copy_(_rand(77 * step + r, 256))
            graph.replay()
            torch.cuda.synchronize()
            want = sum(_rand(1000 * step + k, 4096).double() for k in range(n))
            ok &= bool(torch.equal(x.double(), want))
            ok &= all(bool(torch.equal(ag[k * 256:(k + 1) * 256], _rand(77 * step + k, 256)))
                      for k in range(n))
        res[label] = ok
    return res


@gpus(2)
def test_collectives_replay_in_cuda_graphs():
    for res in run_nccl(2, _graph):
        assert res == {"ordinary": True, "symmetric": True}, res


def _ddp(pg):
    import torch
    params = {f"p{i}": torch.zeros(1000 + 37 * i, device="cuda") for i in range(6)}
    out = {}
    for sym in (False, True, "default"):  # the default: ordinary buckets
        kw = {} if sym == "default" else {"symmetric": sym}
        ddp = meshcoll.DataParallel(params, bucket_cap_mb=0.01, **kw)
        grads = {k: _rand(11 * i + pg.rank, v.numel()).view_as(v)
                 for i, (k, v) in enumerate(params.items())}
        ddp.sync_gradients(grads)
        torch.cuda.synchronize()
        want = {k: sum(_rand(11 * i + q, v.numel()).double() for q in range(pg.size)) / pg.size
                for i, (k, v) in enumerate(params.items())}
        out[sym] = (ddp.symmetric, all(bool(torch.equal(grads[k].double(), want[k]))
                                       for k in params))
        ddp.close()
    return out


@gpus(2)
def test_data_parallel_buckets_in_symmetric_memory():
    for res in run_nccl(2, _ddp):
        assert res == {False: (False, True), True: (True, True), "default": (False, True)}, res
