"""meshcoll's direct kernels (Note [Direct kernels] in csrc/nccl/direct/direct.h): small
all_reduce, all_gather and reduce_scatter on an NCCL group of one host run meshcoll's own
one-shot kernels.
Results match numpy on random data at every size around the kernels' part boundaries, for
unaligned views, in place, across streams and back to back with NCCL's calls; the limit
sends bigger calls to NCCL; MESHCOLL_NCCL_DIRECT_BYTES=0 turns them off; ranks that disagree
get MismatchError on every rank and no rank's data changes; a rank that does not come is
named in a TimeoutError. (test_nccl.py's every-dtype-and-op test runs through them too.)"""

from __future__ import annotations

import time

import numpy as np
import pytest

import meshcoll
from test_nccl import needs_torch, run_nccl, NGPU

pytestmark = [needs_torch, pytest.mark.timeout(300)]
WORLD = min(max(NGPU, 2), 4)
LIMIT = 256 << 10  # the default MESHCOLL_NCCL_DIRECT_BYTES


def _data(seed, rank, n):
    return np.random.default_rng([seed, rank]).standard_normal(n).astype(np.float32)


def _sizes_and_layouts(pg):
    import torch
    r, w = pg.rank, pg.size
    fails = []

    def check(got, want, what):
        got, want = got.float().cpu().numpy().ravel(), want.ravel()
        if got.size != want.size:
            fails.append(f"{what}: {got.size} elements, want {want.size}")
        elif not np.allclose(got, want, rtol=1e-5, atol=1e-5):
            bad = np.flatnonzero(~np.isclose(got, want, rtol=1e-5, atol=1e-5))
            fails.append(f"{what}: {bad.size} wrong of {want.size}, first at {bad[:1]}: "
                         f"got {got[bad[0]]}, want {want[bad[0]]}")

    sizes = [1, 3, 4, 31, 32, 33, 1000, 2047, 2049, 8191, 65536 + 5, LIMIT // 4, LIMIT // 4 + 1]
    for n in sizes:
        ins = [_data(n, k, n) for k in range(w)]
        x = torch.from_numpy(ins[r]).cuda()
        pg.all_reduce(x)
        check(x, np.sum(ins, 0), f"all_reduce n={n}")
        # an unaligned view (4-byte aligned, not 16)
        buf = torch.from_numpy(np.concatenate([[0], ins[r]]).astype(np.float32)).cuda()
        g = pg.all_gather(buf[1:])
        check(g, np.stack(ins), f"all_gather unaligned n={n}")
        pg.all_reduce(buf[1:], op="max")
        check(buf[1:], np.max(ins, 0), f"all_reduce max unaligned n={n}")
        if n * w * 4 <= 4 * LIMIT:
            # in place: this rank's row of out is the input
            g2 = torch.empty(w, n, device="cuda")
            g2[r] = x
            pg.all_gather(g2[r], out=g2)
            check(g2, np.stack([np.sum(ins, 0)] * w), f"all_gather in place n={n}")
        big = [_data(n + 1, k, w * n) for k in range(w)]
        got = pg.reduce_scatter(torch.from_numpy(big[r]).cuda().reshape(w, n))
        check(got, np.sum(big, 0)[r * n:(r + 1) * n], f"reduce_scatter n={n}")
        # in place: out is this rank's row of the input
        inp = torch.from_numpy(big[r]).cuda().reshape(w, n)
        pg.reduce_scatter(inp, out=inp[r:r + 1], op="min")
        check(inp[r], np.min(big, 0)[r * n:(r + 1) * n], f"reduce_scatter in place n={n}")
    # bytes of one element: all_gather of uint8 at odd counts
    for n in (1, 5, 129):
        ins = [np.random.default_rng([n, k]).integers(0, 255, n).astype(np.uint8) for k in range(w)]
        g = pg.all_gather(torch.from_numpy(ins[r]).cuda())
        if not np.array_equal(g.cpu().numpy(), np.stack(ins)):
            fails.append(f"all_gather uint8 n={n}")
    torch.cuda.synchronize()
    return fails, pg.direct_kernels


@pytest.mark.skipif(NGPU < 2, reason="needs 2 GPUs")
def test_every_size_and_layout_matches_numpy():
    res = run_nccl(WORLD, _sizes_and_layouts, deadline=280)
    for r, (fails, status) in enumerate(res):
        assert status == f"on (calls up to {LIMIT} bytes)", (r, status)
        assert not fails, (r, fails)


def _streams_and_mixing(pg):
    """Back to back: direct calls alternate parities, mix with NCCL's calls (a broadcast, a
    call over the limit) and switch between the caller's stream, another stream and the
    internal one (async_op), each result checked."""
    import torch
    r, w = pg.rank, pg.size
    side = torch.cuda.Stream()
    xs, wants, works = [], [], []
    for i in range(60):
        n = 7 + i * 13
        ins = [_data(i, k, n) for k in range(w)]
        x = torch.from_numpy(ins[r]).cuda()
        if i % 3 == 0:
            works.append(pg.all_reduce(x, async_op=True))
        elif i % 3 == 1:
            with torch.cuda.stream(side):
                side.wait_stream(torch.cuda.current_stream())
                pg.all_reduce(x)
            torch.cuda.current_stream().wait_stream(side)
        else:
            pg.all_reduce(x)
        xs.append(x)
        wants.append(np.sum(ins, 0))
        if i % 10 == 5:
            b = torch.from_numpy(_data(100 + i, 0, 1000)).cuda()
            pg.broadcast(b, 0)  # NCCL's
            large = torch.ones(LIMIT // 4 + 1000, device="cuda") * (r + 1)
            pg.all_reduce(large)  # over the limit: NCCL's
            xs.append(large[:5])
            wants.append(np.full(5, w * (w + 1) / 2, np.float32))
    for wk in works:
        wk.wait()
    torch.cuda.synchronize()
    return [i for i, (x, want) in enumerate(zip(xs, wants))
            if not np.allclose(x.cpu().numpy(), want, rtol=1e-5, atol=1e-5)]


@pytest.mark.skipif(NGPU < 2, reason="needs 2 GPUs")
def test_back_to_back_across_streams_and_with_nccl_calls():
    res = run_nccl(WORLD, _streams_and_mixing, deadline=200)
    for r, bad in enumerate(res):
        assert not bad, f"rank {r}: wrong results at calls {bad}"


def _status_and_sum(pg):
    import torch
    x = torch.from_numpy(_data(1, pg.rank, 100)).cuda()
    pg.all_reduce(x)
    want = np.sum([_data(1, k, 100) for k in range(pg.size)], 0)
    return pg.direct_kernels, bool(np.allclose(x.cpu().numpy(), want, rtol=1e-5))


@pytest.mark.skipif(NGPU < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("env, want", [
    ({"MESHCOLL_NCCL_DIRECT_BYTES": "0"}, "off: rank 0: MESHCOLL_NCCL_DIRECT_BYTES=0"),
    ({"MESHCOLL_NCCL_DIRECT_BYTES": "4096"}, "on (calls up to 4096 bytes)"),
])
def test_the_limit_comes_from_the_environment(env, want):
    res = run_nccl(2, _status_and_sum, env=env, deadline=120)
    for r, (status, right) in enumerate(res):
        assert status == want, (r, status)
        assert right, r


def _disagree(pg):
    """Rank 0 reduces 8 elements, the others 16: every rank's direct kernel meets another
    fingerprint at the barrier and writes nothing."""
    import torch
    n = 8 if pg.rank == 0 else 16
    before = _data(3, pg.rank, n)
    x = torch.from_numpy(before).cuda()
    err = None
    try:
        pg.all_reduce(x)
        torch.cuda.synchronize()
        after = x.cpu().numpy()
        pg.barrier()
    except meshcoll.MeshcollError as e:
        err = e
        after = x.cpu().numpy()
    return type(err).__name__, str(err), bool(np.array_equal(after, before))


@pytest.mark.skipif(NGPU < 2, reason="needs 2 GPUs")
def test_a_disagreement_is_an_error_on_every_rank_and_changes_no_data():
    res = run_nccl(WORLD, _disagree, deadline=120)
    for r, (kind, msg, unchanged) in enumerate(res):
        assert kind == "MismatchError", (r, kind, msg)
        assert unchanged, f"rank {r}: the disagreeing all_reduce changed its data"


def _late(pg):
    """Rank 1 comes 4 s late to an all_reduce with a 1.5 s timeout: rank 0's kernel gives up
    and names it; rank 1 then hears of the failure."""
    import torch
    x = torch.ones(64, device="cuda")
    pg.all_reduce(x)
    torch.cuda.synchronize()
    if pg.rank == 1:
        time.sleep(4.0)
    t0 = time.monotonic()
    try:
        pg.all_reduce(x, timeout=1.5)
        torch.cuda.synchronize()
        pg.barrier(timeout=1.5)
        return "no error", "", time.monotonic() - t0
    except meshcoll.MeshcollError as e:
        return type(e).__name__, str(e), time.monotonic() - t0


@pytest.mark.skipif(NGPU < 2, reason="needs 2 GPUs")
def test_a_late_rank_is_named_and_nothing_hangs():
    res = run_nccl(2, _late, deadline=120)
    kind, msg, took = res[0]
    assert kind == "TimeoutError", (kind, msg)
    assert "rank 1" in msg, msg
    assert took < 20, took
    assert res[1][0] != "no error", res[1]


def _symmetric_without_agreement(pg):
    """On symmetric memory a direct kernel runs without the agreement before launch that
    NCCL's symmetric kernels need (Note [Agreement before launch]): with rank 1 issuing each
    call 1.5 s late, rank 0's host returns from a small call at once (the kernel waits on
    the device) but blocks in a call over the limit until rank 1 issued it."""
    import torch
    r, w = pg.rank, pg.size
    out = {}
    pg.all_reduce(torch.ones(8, device="cuda"))  # compiles the kernel (0.2-0.5 s) untimed
    for name, n in (("direct", 1000), ("nccl", LIMIT // 4 + 1)):
        ins = [_data(n, k, n) for k in range(w)]
        x = pg.empty(n, "float32", symmetric=True)
        x.copy_(torch.from_numpy(ins[r]).cuda())
        pg.barrier()
        if r == 1:
            time.sleep(1.5)
        t0 = time.monotonic()
        pg.all_reduce(x)
        host_s = time.monotonic() - t0
        torch.cuda.synchronize()
        ok = np.allclose(x.cpu().numpy(), np.sum(ins, 0), rtol=1e-5, atol=1e-5)
        out[name] = (host_s, bool(ok), pg.is_symmetric(x))
    return out, pg.symmetric_memory


@pytest.mark.skipif(NGPU < 2, reason="needs 2 GPUs")
def test_symmetric_calls_that_go_direct_skip_the_agreement_before_launch():
    res = run_nccl(2, _symmetric_without_agreement, deadline=120)
    out, memory = res[0]
    for rank, (o, _) in enumerate(res):
        for name, (_, ok, _) in o.items():
            assert ok, (rank, name)
    if not out["nccl"][2]:
        pytest.skip(f"no symmetric windows here: {memory}")
    assert out["direct"][0] < 0.5, out  # returned before rank 1 issued the call
    assert out["nccl"][0] > 1.0, out  # awaited rank 1's call


TWO_SHOT_LIMIT = 16 << 20


def _two_shot(pg):
    """All_reduces above the one-shot size (256 KiB) up to the limit run the two-shot kernel:
    sizes around its slice and part boundaries, every rank's result bit-identical and equal
    to numpy's (float32 sum in rank order; bf16, max, avg, int32), unaligned, in place, back
    to back with one-shot calls and NCCL's."""
    import torch
    r, w = pg.rank, pg.size
    fails = []

    def check(got, want, what, tol=1e-5):
        got = got.float().cpu().numpy().ravel()
        want = np.asarray(want, np.float64).ravel()
        if got.size != want.size or not np.allclose(got, want, rtol=tol, atol=tol):
            bad = np.flatnonzero(~np.isclose(got, want, rtol=tol, atol=tol)) \
                if got.size == want.size else [0]
            fails.append(f"{what}: {len(bad)} wrong, first at {bad[:1]}")
        digest = torch.tensor([float(got.astype(np.float64).sum())], dtype=torch.float64,
                              device="cuda")
        pg.all_reduce(digest, op="max")
        mine = float(got.astype(np.float64).sum())
        if digest.item() != mine:
            fails.append(f"{what}: ranks disagree bitwise")

    one = 256 << 10
    lines = 32  # float32 elements per 128-byte line
    sizes = [one // 4 + 1, one // 4 + lines * w - 1, one // 4 + 12345, (1 << 20) // 4 + 7,
             (3 << 20) // 4 + 3, (8 << 20) // 4, (16 << 20) // 4]
    for i, n in enumerate(sizes):
        ins = [_data(50 + i, k, n) for k in range(w)]
        x = torch.from_numpy(ins[r]).cuda()
        pg.all_reduce(x)
        check(x, np.sum(np.stack(ins).astype(np.float64), 0), f"two-shot sum n={n}")
        buf = torch.from_numpy(np.concatenate([[0], ins[r]]).astype(np.float32)).cuda()
        pg.all_reduce(buf[1:], op="max")
        check(buf[1:], np.max(ins, 0), f"two-shot max unaligned n={n}")
        small = torch.from_numpy(_data(90 + i, r, 1000)).cuda()
        pg.all_reduce(small)  # one-shot between two-shot calls
        check(small, np.sum([_data(90 + i, k, 1000) for k in range(w)], 0), f"one-shot after n={n}")
    n = (2 << 20) // 2 + 5
    ins = [_data(7, k, n) for k in range(w)]
    x = torch.from_numpy(ins[r]).cuda().to(torch.bfloat16)
    ref = np.sum([torch.from_numpy(v).to(torch.bfloat16).float().numpy() for v in ins], 0)
    pg.all_reduce(x, op="avg")
    check(x, ref / w, "two-shot bf16 avg", tol=6e-2)
    xi = torch.arange(n, dtype=torch.int32, device="cuda") * (r + 1)
    pg.all_reduce(xi)
    check(xi, np.arange(n) * (w * (w + 1) // 2), "two-shot int32 sum", tol=0)
    over = torch.ones(TWO_SHOT_LIMIT // 4 + 100, device="cuda") * (r + 1)
    pg.all_reduce(over)  # over the limit: NCCL's
    check(over[:7], np.full(7, w * (w + 1) / 2), "over the limit")
    torch.cuda.synchronize()
    return fails, pg.direct_kernels


@pytest.mark.skipif(NGPU < 2, reason="needs 2 GPUs")
def test_two_shot_all_reduce_matches_numpy_bit_identical_on_every_rank():
    res = run_nccl(WORLD, _two_shot, deadline=280,
                   env={"MESHCOLL_NCCL_DIRECT_BYTES": str(TWO_SHOT_LIMIT)})
    for r, (fails, status) in enumerate(res):
        assert status == f"on (calls up to {TWO_SHOT_LIMIT} bytes)", (r, status)
        assert not fails, (r, fails)


def _disagree_two_shot(pg):
    """Above the one-shot size: rank 0 reduces one more element than the others. The first
    barrier sees other fingerprints: MismatchError on every rank, no data changed."""
    import torch
    n = (1 << 20) // 4 + (1 if pg.rank == 0 else 0)
    before = _data(4, pg.rank, n)
    x = torch.from_numpy(before).cuda()
    err = None
    try:
        pg.all_reduce(x)
        torch.cuda.synchronize()
        pg.barrier()
    except meshcoll.MeshcollError as e:
        err = e
    return type(err).__name__, str(err), bool(np.array_equal(x.cpu().numpy(), before))


@pytest.mark.skipif(NGPU < 2, reason="needs 2 GPUs")
def test_a_two_shot_disagreement_is_an_error_on_every_rank_and_changes_no_data():
    res = run_nccl(WORLD, _disagree_two_shot, deadline=120,
                   env={"MESHCOLL_NCCL_DIRECT_BYTES": str(TWO_SHOT_LIMIT)})
    for r, (kind, msg, unchanged) in enumerate(res):
        assert kind == "MismatchError", (r, kind, msg)
        assert unchanged, f"rank {r}: the disagreeing all_reduce changed its data"
