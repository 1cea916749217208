"""DataParallel and meshcoll.torch.DistributedDataParallel with GPU arrays on the NCCL backend
(issue 7): N-rank training of CUDA modules equals one-process full-batch training (CPU
reference), with and without no_sync, with fp16 compression; CuPy arrays straight through
DataParallel on a non-blocking stream; wait() orders the stream without blocking the host;
clear errors for arrays of the wrong kind. Skips without GPUs.
"""

from __future__ import annotations

import numpy as np
import pytest

from test_nccl import NGPU, gpus, needs_torch, run_nccl

pytestmark = pytest.mark.timeout(240)

BATCH, STEPS, LR = 24, 3, 0.2


def _train(pg, accum, compression=None, **kw):
    import torch_ddp_common as common
    return common.train(pg, accum, batch=BATCH, steps=STEPS, lr=LR,
                        device=f"cuda:{pg.device}", compression=compression, **kw)


def _cupy(pg):
    """DataParallel on CuPy arrays: broadcast, averaged gradients, no_sync accumulation."""
    try:
        import cupy
    except ImportError:
        return None
    import meshcoll
    shapes = {"a": (5, 7), "b": (7,), "c": (3, 2, 4)}
    rng = lambda *k: np.random.default_rng([pg.rank, *k])  # noqa: E731
    # A non-blocking stream: wait() must order this stream, not the legacy default one.
    with cupy.cuda.Device(pg.device), cupy.cuda.Stream(non_blocking=True):
        params = {n: cupy.asarray(rng(i).standard_normal(s)) for i, (n, s) in enumerate(shapes.items())}
        ddp = meshcoll.DataParallel(params, group=pg, bucket_cap_mb=200 / 2**20)  # [c b] [a]
        acc = {n: rng(10, i).standard_normal(s) for i, (n, s) in enumerate(shapes.items())}
        with ddp.no_sync():
            for n in reversed(list(shapes)):
                ddp.grad_ready(n, cupy.asarray(acc[n]))
        grads = {n: cupy.asarray(rng(20, i).standard_normal(s)) for i, (n, s) in enumerate(shapes.items())}
        ddp.sync_gradients(grads)
        out = ({n: cupy.asnumpy(p) for n, p in params.items()},
               {n: cupy.asnumpy(g) for n, g in grads.items()}, ddp.bucket_names)
        ddp.close()
    return out


def _errors(pg):
    import torch
    import meshcoll
    import meshcoll.torch as mt
    msgs = []
    for make in (lambda: meshcoll.DataParallel({"w": np.ones(3, np.float32)}, group=pg),
                 lambda: mt.DistributedDataParallel(torch.nn.Linear(2, 2), group=pg)):
        try:
            make()
        except TypeError as e:
            msgs.append(str(e))
    dev = torch.device("cuda", pg.device)
    ddp = meshcoll.DataParallel({"w": torch.ones(3, device=dev)}, group=pg)
    for bad in (torch.ones(3), torch.ones(4, device=dev), torch.ones(3, device=dev, dtype=torch.float64)):
        try:
            ddp.grad_ready("w", bad)
        except (TypeError, ValueError) as e:
            msgs.append(str(e))
    ddp.close()
    return msgs


def _no_host_block(pg):
    """wait() queues the averaging behind the all-reduces on the current stream and returns
    while the device is still busy (a 0.1 s sleep kernel ahead of them); the values are there
    once the stream is synchronized, and stats() counts the step then."""
    import torch
    import meshcoll
    dev = torch.device("cuda", pg.device)
    params = {"a": torch.zeros(1 << 18, device=dev), "b": torch.zeros(1 << 18, device=dev)}
    ddp = meshcoll.DataParallel(params, group=pg, bucket_cap_mb=1)
    grads = {n: torch.full_like(p, float(pg.rank + 1 + i)) for i, (n, p) in enumerate(params.items())}
    torch.cuda.synchronize()
    torch.cuda._sleep(int(2e8))  # 2e8 GPU cycles: about 0.1 s
    ddp.sync_gradients(grads)
    busy = not torch.cuda.current_stream().query()
    torch.cuda.synchronize()
    got = {n: g.cpu().numpy() for n, g in grads.items()}
    stats = ddp.stats()
    ddp.close()
    return busy, got, stats["calls"]


def _cases(pg):
    return {"plain": _train(pg, 1), "accum": _train(pg, 3), "fp16": _train(pg, 1, "fp16"),
            "views": _train(pg, 3, set_to_none=False, gradient_as_bucket_view=True),
            "views fp16": _train(pg, 1, "fp16", gradient_as_bucket_view=True),
            "cupy": _cupy(pg), "errors": _errors(pg), "no_host_block": _no_host_block(pg)}


@needs_torch
@pytest.mark.parametrize("world", [2, 4])
def test_gpu_data_parallel_matches_one_process(world):
    if NGPU < world:
        pytest.skip(f"needs {world} GPUs, {NGPU} visible")
    results = run_nccl(world, _cases)
    import torch_ddp_common as common
    ref = common.reference(1, batch=BATCH, steps=STEPS, lr=LR)
    ref_accum = common.reference(3, batch=BATCH, steps=STEPS, lr=LR)
    nbytes = sum(v.nbytes for v in ref.values())
    for r, res in enumerate(results):
        params, stats, buckets, _ = res["plain"]
        assert len(buckets) >= 3, buckets
        # p.grad as views of the buckets: the same arithmetic, so the same values.
        for n in params:
            np.testing.assert_array_equal(res["views"][0][n], res["accum"][0][n])
            np.testing.assert_array_equal(res["views fp16"][0][n], res["fp16"][0][n])
        assert res["views"][3] and res["views fp16"][3]
        # GPU and CPU float32 matmuls round differently: 1e-4 relative, not bit equality.
        assert common.max_rel(params, ref) < 1e-4, (r, common.max_rel(params, ref))
        assert common.max_rel(res["accum"][0], ref_accum) < 1e-4
        assert common.max_rel(res["fp16"][0], ref) < 1e-2  # gradients rounded to fp16 on the wire
        # The first step runs the buckets of construction, the others those rebuilt in the
        # order its gradients arrived.
        calls = stats["first_step_buckets"] + len(buckets) * (STEPS - 1)
        assert stats["calls"] == calls and stats["bytes"] == nbytes * STEPS
        assert stats["comm_seconds"] > 0
        msgs = res["errors"]
        assert len(msgs) == 5, msgs
        assert "host memory" in msgs[0] or "numpy" in msgs[0] or "CUDA" in msgs[0], msgs[0]
        assert "takes cuda tensors" in msgs[1], msgs[1]
        # A gradient is checked against its parameter (not read again by the backend).
        assert "a Tensor on cpu" in msgs[2] and "on cuda:" in msgs[2], msgs[2]
        assert "shape (4,)" in msgs[3] and "float64" in msgs[4], msgs
        busy, got, calls = res["no_host_block"]
        assert busy, "wait() blocked the host until the device was idle"
        for i, n in enumerate(("a", "b")):
            np.testing.assert_array_equal(got[n], np.full(1 << 18, (world + 1) / 2 + i, np.float32))
        assert calls == 2
    cp = [res["cupy"] for res in results]
    if cp[0] is None:
        return  # no CuPy in this image
    shapes = {"a": (5, 7), "b": (7,), "c": (3, 2, 4)}
    for params, grads, buckets in cp:
        assert len(buckets) >= 2, buckets
        for i, (n, s) in enumerate(shapes.items()):
            np.testing.assert_array_equal(params[n], np.random.default_rng([0, i]).standard_normal(s))
            want = np.mean([np.random.default_rng([k, 10, i]).standard_normal(s)
                            + np.random.default_rng([k, 20, i]).standard_normal(s)
                            for k in range(world)], axis=0)
            np.testing.assert_allclose(grads[n], want, rtol=1e-12, atol=1e-12)


def _peer_lost(pg, how):
    """The torch adapter on GPUs, a peer killed (or stopped) after forward of step 2: the
    survivors' step ends in an error naming it (raised by the reducer's next call or its
    statistics, which wait for the device), within the group's timeout."""
    import os
    import signal
    import time
    import torch
    import meshcoll
    import meshcoll.torch as mt
    pids = [int(p) for p in pg.all_gather(torch.tensor([os.getpid()], device="cuda")).cpu()]
    g = pg  # its timeout: 10 s
    torch.manual_seed(0)
    net = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(6)]).cuda()
    model = mt.DistributedDataParallel(net, group=g, bucket_cap_mb=0.5)
    x = torch.randn(32, 256, device="cuda")
    model(x).sum().backward()
    torch.cuda.synchronize()
    g.barrier()
    victim = pg.size - 1
    loss = model(x).sum()
    if pg.rank == victim:
        os.kill(os.getpid(), signal.SIGKILL if how == "kill" else signal.SIGSTOP)
    t0 = time.monotonic()
    try:
        for _ in range(5):  # the first step's all-reduces hang on the lost peer
            loss.backward()
            torch.cuda.synchronize()
            model.stats()
            loss = model(x).sum()
        out = ("no error", "", time.monotonic() - t0)
    except (meshcoll.PeerError, meshcoll.TimeoutError) as e:
        out = (type(e).__name__, str(e), time.monotonic() - t0)
    finally:
        if pg.rank == 0 and how == "stop":
            os.kill(pids[victim], signal.SIGKILL)
    model.close()
    return out


@needs_torch
@pytest.mark.parametrize("how", ["kill", "stop"])
def test_a_peer_lost_mid_step_is_named_on_every_gpu_rank(how):
    world = min(NGPU, 3)
    if world < 2:
        pytest.skip(f"needs 2 GPUs, {NGPU} visible")
    results = run_nccl(world, _peer_lost, how=how, may_die=(world - 1,), deadline=120,
                       timeout=10.0)  # the group's timeout too
    for rank in range(world - 1):
        kind, msg, took = results[rank]
        assert kind in ("PeerError", "TimeoutError"), (rank, kind, msg)
        assert f"rank {world - 1}" in msg, (rank, msg)
        assert took < 40, (rank, took)  # the group's 10 s timeout, not a hang


def _odd_spans(pg):
    """DataParallel over CUDA tensors whose slots start at odd byte offsets (float16 of odd
    sizes: the span kernel's byte path), at 4-byte offsets (its word path) and whole
    chunks (a 1 MiB gradient: 16-byte words, many blocks), copied in and out."""
    import torch
    import meshcoll
    shapes = {"h1": (3,), "h2": (5, 7), "f1": (11,), "f2": (513, 511), "h3": (1 << 19,)}
    dtypes = {"h": torch.float16, "f": torch.float32}
    rng = np.random.default_rng([pg.rank, 7])
    params = {n: torch.zeros(s, dtype=dtypes[n[0]], device="cuda") for n, s in shapes.items()}
    ddp = meshcoll.DataParallel(params, group=pg, bucket_cap_mb=0.75)
    got = {}
    for step in range(2):
        grads = {n: torch.as_tensor(np.random.default_rng([pg.rank, step, i]).standard_normal(s),
                                    dtype=dtypes[n[0]], device="cuda")
                 for i, (n, s) in enumerate(shapes.items())}
        ddp.sync_gradients(grads)
        got[step] = {n: g.float().cpu().numpy() for n, g in grads.items()}
    ddp.close()
    del rng
    return got, ddp.bucket_names


@needs_torch
def test_gradients_at_any_offset_are_copied_exactly():
    if NGPU < 2:
        pytest.skip(f"needs 2 GPUs, {NGPU} visible")
    res = run_nccl(2, _odd_spans)
    shapes = {"h1": (3,), "h2": (5, 7), "f1": (11,), "f2": (513, 511), "h3": (1 << 19,)}
    for got, buckets in res:
        assert len(buckets) >= 2, buckets
        for step in range(2):
            for i, (n, s) in enumerate(shapes.items()):
                dt = np.float16 if n[0] == "h" else np.float32
                parts = [np.random.default_rng([r, step, i]).standard_normal(s).astype(dt)
                         for r in range(2)]
                want = ((parts[0].astype(np.float32) + parts[1].astype(np.float32)) / 2).astype(dt)
                np.testing.assert_allclose(got[step][n], want.astype(np.float32),
                                           rtol=2e-3 if n[0] == "h" else 1e-6, atol=1e-3)


def _uneven_gpu(pg, lr):
    """join() and BoundedStaleness on GPUs: the CPU tests' semantics (test_torch_adapter.py)."""
    import torch
    import meshcoll.torch as mt
    from meshcoll import BoundedStaleness
    torch.manual_seed(0)
    model = mt.DistributedDataParallel(torch.nn.Linear(4, 3).cuda(), group=pg)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    with model.join():
        for s in range(2 + pg.rank):
            opt.zero_grad()
            x = torch.as_tensor(np.random.default_rng([s, pg.rank]).standard_normal((2, 4)),
                                dtype=torch.float32, device="cuda")
            model(x).pow(2).sum().backward()
            opt.step()
    joined = {n: p.detach().cpu().numpy() for n, p in model.module.named_parameters()}
    model.close()
    stale = mt.DistributedDataParallel(torch.nn.Linear(4, 3).cuda(), group=pg,
                                       mode=BoundedStaleness(1))
    grads = []
    for t in range(3):
        stale.zero_grad()
        x = torch.as_tensor(np.random.default_rng([t, pg.rank]).standard_normal((2, 4)),
                            dtype=torch.float32, device="cuda")
        stale(x).sum().backward()
        grads.append(stale.module.weight.grad.cpu().numpy().copy())
    stale.close()
    return joined, grads


@needs_torch
def test_join_and_bounded_staleness_on_gpus():
    world, lr = min(NGPU, 3), 0.05
    if world < 2:
        pytest.skip(f"needs 2 GPUs, {NGPU} visible")
    results = run_nccl(world, _uneven_gpu, lr=lr)
    import torch_ddp_common as common
    ref = common.join_reference(world, lr)
    for joined, grads in results:
        for n, p in ref.named_parameters():
            np.testing.assert_allclose(joined[n], p.detach().numpy(), rtol=1e-5, atol=1e-6)
        assert not grads[0].any()
        for t in (1, 2):
            xs = [np.random.default_rng([t - 1, r]).standard_normal((2, 4)).astype(np.float32)
                  for r in range(world)]
            want = np.tile(sum(x.sum(0) for x in xs) / world, (3, 1))
            np.testing.assert_allclose(grads[t], want, rtol=1e-5)
