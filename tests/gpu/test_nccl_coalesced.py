"""ProcessGroup.coalesced() on NCCL (Note [Coalesced blocks on NCCL] in csrc/nccl/nccl_ops.cc):
a block's collectives are enqueued at its end in one NCCL group launch. Every op of a block
gives numpy's answer on random data; a tensor dropped inside the block is held until its op
ran (a canary allocated after it is not written); a Work cannot be waited on before its
block ends; another group's calls inside the block run at once; a block captured into a CUDA
graph replays right; ranks that form different blocks get MismatchError on every rank; and a
block that fills the op ring leaves the arrays of the ops before it held."""

from __future__ import annotations

import time

import numpy as np
import pytest

import meshcoll
from test_nccl import destroy_failed, gpus, needs_torch, run_nccl, NGPU

pytestmark = [needs_torch, pytest.mark.timeout(240)]
WORLD = min(max(NGPU, 2), 4)


def _data(seed, rank, n):
    return np.random.default_rng([seed, rank]).standard_normal(n).astype(np.float32)


def _block(pg):
    import torch
    cuda = lambda a: torch.from_numpy(a).cuda()
    n, size, rank = 1000, pg.size, pg.rank
    other = pg.new_group(list(range(size)))  # another communicator over the same ranks
    x = cuda(_data(1, rank, n))
    bf = cuda(_data(2, rank, n)).to(torch.bfloat16)
    i64 = torch.from_numpy(np.random.default_rng([3, rank]).integers(-99, 99, n)).cuda()
    g = torch.empty(size, n, device="cuda")
    rs = torch.empty(n, device="cuda")
    b = cuda(_data(5, rank, n))
    r = cuda(_data(6, rank, n))
    sent, got = cuda(_data(7, rank, n)), torch.empty(n, device="cuda")
    z = cuda(_data(9, rank, n))
    refused = {}
    with pg.coalesced():
        pg.all_reduce(x)
        pg.all_reduce(bf)
        pg.all_reduce(i64, op="max")
        pg.all_gather(cuda(_data(4, rank, n)), out=g)  # a temporary: held until it ran
        pg.reduce_scatter(cuda(_data(8, rank, n * size)), out=rs)
        pg.broadcast(b, 1)
        pg.reduce(r, 0)
        # A ring of sends and receives: blocking one by one, fine in one group.
        pg.send(sent, (rank + 1) % size)
        pg.recv(got, (rank - 1) % size)
        w = pg.all_reduce(cuda(_data(10, rank, n)), async_op=True)
        pg.all_reduce(cuda(_data(11, rank, n)))  # a temporary the block's kernel writes
        # The temporaries' memory is free for torch's allocator only after the block ran:
        # canaries of their size made now must stay intact.
        canary = [torch.full((n,), 7.0, device="cuda") for _ in range(3)]
        try:
            w.wait()
        except ValueError as e:
            refused["wait"] = str(e)
        try:
            pg.all_gather(np.arange(3))  # host metadata: waits for its result
        except ValueError as e:
            refused["host all_gather"] = str(e)
        try:
            pg.broadcast(x, 0)  # would use the block's all_reduce of x: refused, not staged
        except ValueError as e:
            refused["dependent"] = str(e)
        other.all_reduce(z)  # another group: runs now, not at the block's end
        torch.cuda.synchronize()
        z_inside = z.cpu().numpy().copy()
        x_inside = x.cpu().numpy().copy()  # not reduced yet: the block has not run
    a = w.wait()
    torch.cuda.synchronize()
    out = {k: v.float().cpu().numpy() for k, v in
           dict(x=x, bf=bf, i64=i64, g=g, rs=rs, b=b, r=r, got=got, a=a,
                canary=torch.stack(canary)).items()}
    out["i64"] = i64.cpu().numpy()
    return out, z_inside, x_inside, refused


@gpus(2)
def test_a_blocks_collectives_give_numpys_answer_and_hold_their_arrays():
    n = 1000
    total = lambda seed, m: sum(_data(seed, k, m) for k in range(WORLD))
    for rank, (out, z_inside, x_inside, refused) in enumerate(run_nccl(WORLD, _block)):
        np.testing.assert_allclose(out["x"], total(1, n), rtol=1e-5, atol=1e-5)
        bf_want = sum(np.asarray(__import__("torch").from_numpy(_data(2, k, n))
                                 .to(__import__("torch").bfloat16).float())
                      for k in range(WORLD))
        np.testing.assert_allclose(out["bf"], bf_want, rtol=5e-2, atol=5e-2)
        i64_want = np.max([np.random.default_rng([3, k]).integers(-99, 99, n)
                           for k in range(WORLD)], axis=0)
        np.testing.assert_array_equal(out["i64"], i64_want)
        for k in range(WORLD):
            np.testing.assert_array_equal(out["g"][k], _data(4, k, n))
        np.testing.assert_allclose(out["rs"], total(8, n * WORLD)[rank * n:(rank + 1) * n],
                                   rtol=1e-5, atol=1e-5)
        np.testing.assert_array_equal(out["b"], _data(5, 1, n))
        want_r = total(6, n) if rank == 0 else _data(6, rank, n)
        np.testing.assert_allclose(out["r"], want_r, rtol=1e-5, atol=1e-5)
        np.testing.assert_array_equal(out["got"], _data(7, (rank - 1) % WORLD, n))
        np.testing.assert_allclose(out["a"], total(10, n), rtol=1e-5, atol=1e-5)
        assert (out["canary"] == 7.0).all(), "a dropped tensor's memory was written"
        np.testing.assert_allclose(z_inside, total(9, n), rtol=1e-5, atol=1e-5)
        np.testing.assert_array_equal(x_inside, _data(1, rank, n))
        assert "coalesced block still open" in refused["wait"], refused
        assert "outside the block" in refused["host all_gather"], refused
        assert "broadcast in a coalesced block writes memory that an earlier all_reduce" in \
            refused["dependent"], refused


def _captured(pg):
    import torch
    xs = [torch.zeros(256, device="cuda") for _ in range(3)]
    for x in xs:
        pg.all_reduce(x)  # warm up outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        with pg.coalesced():
            for x in xs:
                pg.all_reduce(x)
    ok = []
    for i in range(3):
        for j, x in enumerate(xs):
            x.fill_(pg.rank + i + j)
        graph.replay()
        torch.cuda.synchronize()
        ok.append([bool((x == sum(k + i + j for k in range(pg.size))).all())
                   for j, x in enumerate(xs)])
    return ok


@gpus(2)
def test_a_block_captured_in_a_cuda_graph_replays_right():
    for ok in run_nccl(2, _captured):
        assert all(all(row) for row in ok), ok


def _mismatched(pg):
    """Rank 0 puts two all_reduces in one block; the others run them one by one."""
    import torch
    g = pg.new_group(list(range(pg.size)))
    x, y = torch.ones(64, device="cuda"), torch.ones(64, device="cuda")
    t0 = time.monotonic()
    kind, msg = "no error", ""
    try:
        if g.rank == 0:
            with g.coalesced():
                g.all_reduce(x)
                g.all_reduce(y)
        else:
            g.all_reduce(x)
            g.all_reduce(y)
        for _ in range(500):  # async check: a later call raises once it found it
            g.all_reduce(x)
            time.sleep(0.002)
    except meshcoll.MeshcollError as e:
        kind, msg = type(e).__name__, str(e)
    destroy_failed(g)
    return kind, msg[:400], time.monotonic() - t0


@gpus(2)
def test_ranks_that_form_different_blocks_get_a_mismatch_on_every_rank():
    for rank, (kind, msg, took) in enumerate(run_nccl(WORLD, _mismatched)):
        # The class is the witness: the group's deadline would be a TimeoutError.
        assert kind == "MismatchError", (rank, kind, msg)
        assert "coalesced block" in msg, msg


def _killed_in_block(pg):
    """Rank 1 dies inside its block, before the block is enqueued: its peers' blocks wait for
    it, and must end in an error naming it, not a hang."""
    import os
    import torch
    x, y = torch.ones(256, device="cuda"), torch.ones(256, device="cuda")
    pg.all_reduce(x)
    torch.cuda.synchronize()
    kind, msg = "no error", ""
    t0 = time.monotonic()
    try:
        with pg.coalesced():
            pg.all_reduce(x)
            if pg.rank == 1:
                os._exit(3)  # dies without a word, its block never enqueued
            pg.all_reduce(y)
        for _ in range(200):  # a later call raises once the failure is known
            pg.all_reduce(x)
            torch.cuda.synchronize()
            time.sleep(0.05)
    except meshcoll.MeshcollError as e:
        kind, msg = type(e).__name__, str(e)
    return kind, msg[:400], time.monotonic() - t0


@gpus(2)
def test_a_rank_killed_inside_its_block_is_named_on_every_survivor():
    for rank, r in enumerate(run_nccl(WORLD, _killed_in_block, may_die=(1,), deadline=120)):
        if rank == 1:
            assert r is None, r
            continue
        kind, msg, took = r
        assert kind in ("PeerError", "TimeoutError"), r
        assert "rank 1" in msg, msg


def _symmetric_block(pg, disagree):
    """Four all_reduces on slices of one symmetric arena in one block: the block agrees on
    them once, before it is enqueued (their kernels do not end at an abort). With `disagree`,
    rank 0 passes another offset for the third: MismatchError on every rank, from the block's
    end, and no rank's data touched."""
    import torch
    g = pg.new_group(list(range(pg.size)))
    n = 1024
    arena = g.zeros(8 * n, "float32", symmetric=True)
    src = [torch.from_numpy(_data(20 + i, g.rank, n)).cuda() for i in range(4)]
    for i in range(4):
        arena[i * n:(i + 1) * n].copy_(src[i])
    torch.cuda.synchronize()
    kind, msg = "no error", ""
    try:
        with g.coalesced():
            for i in range(4):
                at = 5 if (disagree and i == 2 and g.rank == 0) else i
                g.all_reduce(arena[at * n:(at + 1) * n])
        torch.cuda.synchronize()
    except meshcoll.MeshcollError as e:
        kind, msg = type(e).__name__, str(e)
    got = arena[:4 * n].cpu().numpy().reshape(4, n).copy()
    destroy_failed(g)
    return g.symmetric_memory, kind, msg[:400], got


@gpus(2)
@pytest.mark.parametrize("disagree", [False, True], ids=["agree", "disagree"])
def test_symmetric_calls_in_a_block_agree_once_before_launch(disagree):
    n = 1024
    for rank, (memory, kind, msg, got) in enumerate(run_nccl(WORLD, _symmetric_block,
                                                             disagree=disagree)):
        if disagree:
            assert kind == "MismatchError", (rank, kind, msg)
            for i in range(4):  # nothing ran: every slice as this rank wrote it
                np.testing.assert_array_equal(got[i], _data(20 + i, rank, n))
            continue
        assert kind == "no error", (rank, kind, msg)
        for i in range(4):
            np.testing.assert_allclose(got[i], sum(_data(20 + i, k, n) for k in range(WORLD)),
                                       rtol=1e-5, atol=1e-5)


def _full_ring(pg):
    """Rank 0 fills its op ring (OpRing::kSlots, 1024 slots) while rank 1 is late: async
    all_reduces of tensors it drops at once (each held by its op until it completes), then a
    block whose ops take the last slots. Canaries of the tensors' size made after the block
    must stay intact: a block that ran once let go of the arrays in the slots after its own,
    which hold the oldest ops of a full ring, still pending."""
    import torch
    slots, block, n = 1024, 4, 1 << 14
    pg.barrier(timeout=30)
    torch.cuda.synchronize()
    if pg.rank != 0:
        time.sleep(1.0)
    for _ in range(slots - block):
        pg.all_reduce(torch.ones(n, device="cuda"), async_op=True)
    xs = [torch.full((n,), pg.rank + 1.0, device="cuda") for _ in range(block)]
    with pg.coalesced():
        for x in xs:
            pg.all_reduce(x)
    # More canaries than fit in the memory left free beside the held tensors: the blocks of
    # tensors freed too early would be reused.
    canaries = [torch.full((n,), 7.0, device="cuda") for _ in range(4 * block)]
    pg.barrier(timeout=60)
    torch.cuda.synchronize()
    return sum(int((c != 7.0).sum()) for c in canaries), [float(x[0]) for x in xs]


@gpus(2)
def test_a_block_that_fills_the_ring_holds_the_arrays_of_the_ops_before_it():
    for damaged, xs in run_nccl(2, _full_ring):
        assert damaged == 0, f"{damaged} canary elements overwritten"
        assert xs == [3.0] * 4
