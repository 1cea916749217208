"""meshcoll.torch.DistributedDataParallel: N-rank training of a torch module equals
one-process full-batch training, with and without no_sync; find_unused_parameters averages
gradients of parameters some ranks did not use; skipped without torch."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
import torch_ddp_common as common  # noqa: E402  (needs torch)

pytestmark = pytest.mark.timeout(120)

BATCH, STEPS, LR = 26, 4, 0.2  # 26 = 9+9+8 over 3 ranks: uneven shards


@pytest.fixture(autouse=True)
def _one_blas_thread(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # inherited by the spawned ranks


def _train(pg, accum, **kw):
    torch.set_num_threads(1)
    return common.train(pg, accum, batch=BATCH, steps=STEPS, lr=LR, **kw)


def _local_sgd(pg, period):
    import meshcoll.torch as mt
    from meshcoll.ddp import LocalSGD
    model = mt.DistributedDataParallel(common.model(0), group=pg, mode=LocalSGD(period))
    x, y = common.data(BATCH * period)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    snapshots = []
    for s in range(period):
        opt.zero_grad()
        shard = torch.as_tensor(np.array_split(np.arange(s * BATCH, (s + 1) * BATCH),
                                               pg.size)[pg.rank])
        torch.nn.functional.cross_entropy(model(x[shard]), y[shard]).backward()
        opt.step()
        model.step()  # the period-th call averages the parameters
        snapshots.append(np.concatenate([p.detach().numpy().ravel() for p in model.parameters()]))
    model.close()
    return snapshots


def _cases(pg):
    out = {"plain": _train(pg, 1), "accum": _train(pg, 3), "local": _local_sgd(pg, 2)}
    # p.grad as views of the buckets: kept when zero_grad zeroes in place, pointed back at
    # them when it drops the gradients.
    for accum in (1, 3):
        for to_none in (False, True):
            out[("views", accum, to_none)] = _train(pg, accum, set_to_none=to_none,
                                                    gradient_as_bucket_view=True)
    # Missing gradients: a parameter outside the graph never fires its hook.
    import meshcoll.torch as mt
    net = torch.nn.ModuleDict({"used": torch.nn.Linear(2, 2), "unused": torch.nn.Linear(2, 2)})
    model = mt.DistributedDataParallel(net, group=pg)
    model.module["used"](torch.ones(1, 2)).sum().backward()
    with pytest.raises(RuntimeError, match="no gradient was given for unused.weight, unused.bias"):
        model.finish_gradient_sync()
    model.close()
    return out


class _Branchy(torch.nn.Module):
    """y = a*x on every rank, + b*x on rank 0 only; c is in no graph at all."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Parameter(torch.ones(5))
        self.b = torch.nn.Parameter(torch.ones(5))
        self.c = torch.nn.Parameter(torch.ones(5))

    def forward(self, x, rank):
        return self.a * x + (self.b * x if rank == 0 else 0)


def _unused(pg):
    import meshcoll.torch as mt
    model = mt.DistributedDataParallel(_Branchy(), group=pg, find_unused_parameters=True)
    grads = []
    for step in range(2):  # the second step checks the state was reset
        model.zero_grad()
        x = torch.as_tensor(np.random.default_rng([step, pg.rank]).standard_normal(5))
        model(x.float(), pg.rank).sum().backward()  # no explicit sync call: backward ends it
        grads.append({n: p.grad.numpy().copy() for n, p in model.module.named_parameters()})
    model.close()
    return grads


def test_find_unused_parameters(run_ranks):
    world = 3
    for grads in run_ranks(world, _unused):
        for step, g in enumerate(grads):
            xs = [np.random.default_rng([step, r]).standard_normal(5).astype(np.float32)
                  for r in range(world)]
            np.testing.assert_allclose(g["a"], sum(xs) / world, rtol=1e-6)
            np.testing.assert_allclose(g["b"], xs[0] / world, rtol=1e-6)  # rank 0 only
            np.testing.assert_array_equal(g["c"], np.zeros(5, np.float32))


@pytest.mark.parametrize("world", [3])
def test_torch_ddp_matches_one_process(run_ranks, world):
    # Three ranks importing torch at once on a loaded 2-core box: give the rendezvous time.
    results = run_ranks(world, _cases, timeout=110, init_timeout=90)
    ref = common.reference(1, batch=BATCH, steps=STEPS, lr=LR)
    ref_accum = common.reference(3, batch=BATCH, steps=STEPS, lr=LR)
    for r in results:
        params, stats, buckets, in_buckets = r["plain"]
        assert len(buckets) >= 3, buckets
        assert common.max_rel(params, ref) < 1e-5
        assert common.max_rel(r["accum"][0], ref_accum) < 1e-5
        assert not in_buckets
        for accum, to_none in ((1, False), (1, True), (3, False), (3, True)):
            got = r[("views", accum, to_none)]
            want = r["plain" if accum == 1 else "accum"][0]
            for n in want:  # the same arithmetic: bit for bit
                np.testing.assert_array_equal(got[0][n], want[n], err_msg=str((n, accum, to_none)))
            assert got[3], (accum, to_none)  # p.grad is the bucket view at the end
        nbytes = sum(v.nbytes for v in ref.values())
        # The first step runs the buckets of construction, the others those rebuilt in the
        # order its gradients arrived.
        calls = stats["first_step_buckets"] + len(buckets) * (STEPS - 1)
        assert stats["calls"] == calls and stats["bytes"] == nbytes * STEPS
        assert stats["comm_seconds"] > 0
    # LocalSGD: ranks drift apart on their own shards, then agree after the average.
    first, second = [r["local"][0] for r in results], [r["local"][1] for r in results]
    assert not np.allclose(first[0], first[1])
    for s in second[1:]:
        np.testing.assert_allclose(s, second[0], rtol=1e-6)


class _Mixed(torch.nn.Module):
    """What torch's DDP takes: a channels_last conv with BatchNorm (buffers), an embedding tied
    to the head, a frozen layer, and a float64 layer beside the float32 ones."""

    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 8, 3)
        self.bn = torch.nn.BatchNorm2d(8)
        self.emb = torch.nn.Embedding(10, 8)
        self.head = torch.nn.Linear(8, 10, bias=False)
        self.head.weight = self.emb.weight
        self.frozen = torch.nn.Linear(8, 8).requires_grad_(False)
        self.wide = torch.nn.Linear(8, 8).double()

    def forward(self, x, idx):
        h = self.bn(self.conv(x)).mean((2, 3)) + self.emb(idx)
        h = self.frozen(h)
        return self.head(h + self.wide(h.double()).float())


def _like_torch(pg, views):
    """meshcoll's adapter and torch's DDP on Gloo, in the same processes, over copies of one
    _Mixed model, the same data per rank: parameters and buffers after 4 steps."""
    import copy
    import torch.distributed as dist
    import meshcoll.torch as mt
    from meshcoll.run import pick_free_port
    port = np.array([pick_free_port("127.0.0.1") if pg.rank == 0 else 0], np.int64)
    pg.broadcast(port, 0)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{int(port[0])}",
                           rank=pg.rank, world_size=pg.size)
    torch.manual_seed(0)
    base = _Mixed().to(memory_format=torch.channels_last)
    assert not base.conv.weight.is_contiguous()  # really channels_last
    mc = mt.DistributedDataParallel(copy.deepcopy(base), group=pg, gradient_as_bucket_view=views,
                                    bucket_cap_mb=2e-4)
    th = torch.nn.parallel.DistributedDataParallel(copy.deepcopy(base),
                                                   gradient_as_bucket_view=views,
                                                   bucket_cap_mb=2e-4)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (mc, th)]
    sizes = {n: p.numel() * p.element_size() for n, p in base.named_parameters()}

    def bucket_bytes():  # torch's DDP logs them as "a, b, c" (bytes)
        return ", ".join(str(sum(sizes[n] for n in names)) for names in mc.ddp.bucket_names)
    layouts = []
    for step in range(4):
        g = torch.Generator().manual_seed(100 * step + pg.rank)
        x = torch.randn(4, 3, 6, 6, generator=g).to(memory_format=torch.channels_last)
        idx = torch.randint(0, 10, (4,), generator=g)
        for m, opt in zip((mc, th), opts):
            opt.zero_grad()
            torch.nn.functional.cross_entropy(m(x, idx), idx).backward()
            opt.step()
        if step < 2:  # the first step's buckets, then those rebuilt after it
            logged = th._get_ddp_logging_data()
            layouts.append((bucket_bytes() if step == 0 else None, logged.get("bucket_sizes"),
                            logged.get("rebuilt_bucket_sizes")))
    state = [{k: v.detach().numpy().copy() for k, v in m.module.state_dict().items()}
             for m in (mc, th)]
    layouts.append((bucket_bytes(), None, th._get_ddp_logging_data()["rebuilt_bucket_sizes"]))
    mc.close()
    dist.destroy_process_group()
    return state, layouts


@pytest.mark.parametrize("views", [False, True])
def test_every_parameter_torch_ddp_takes_trains_as_torch_ddp(run_ranks, views):
    for (mc, th), layouts in run_ranks(2, _like_torch, views=views, timeout=110, init_timeout=90):
        # Buckets as torch's (Note [The first step's buckets] in meshcoll/torch.py): one per
        # dtype in the first step, then those rebuilt in the order gradients arrived (the
        # same buckets; torch lists a dtype's last, unfilled bucket after the filled ones).
        (first, first_torch, _), _, (rebuilt, _, rebuilt_torch) = layouts
        assert first == first_torch and len(first.split(", ")) == 2, (first, first_torch)
        assert sorted(rebuilt.split(", ")) == sorted(rebuilt_torch.split(", ")), \
            (rebuilt, rebuilt_torch)
        assert mc.keys() == th.keys()
        for k in th:  # two ranks add in one order only: bit for bit
            np.testing.assert_array_equal(mc[k], th[k], err_msg=k)


def _rebuilt_like_torch(pg, caps):
    """Per bucket_cap_mb in ``caps`` (None: torch's default), meshcoll's and torch's DDP
    buckets after the rebuild, as torch logs them (bytes, in order)."""
    import copy
    import torch.distributed as dist
    import meshcoll.torch as mt
    from meshcoll.run import pick_free_port
    port = np.array([pick_free_port("127.0.0.1") if pg.rank == 0 else 0], np.int64)
    pg.broadcast(port, 0)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{int(port[0])}",
                           rank=pg.rank, world_size=pg.size)
    out = {}
    for cap in caps:
        torch.manual_seed(0)  # 0.5 MiB weights: the first bucket's cap decides where cuts fall
        base = torch.nn.Sequential(*[torch.nn.Linear(362, 362) for _ in range(6)])
        kw = {} if cap is None else {"bucket_cap_mb": cap}
        mc = mt.DistributedDataParallel(copy.deepcopy(base), group=pg, **kw)
        th = torch.nn.parallel.DistributedDataParallel(copy.deepcopy(base), **kw)
        sizes = {n: p.numel() * p.element_size() for n, p in base.named_parameters()}
        x = torch.randn(2, 362)
        for _ in range(4):  # torch logs the rebuilt buckets a few steps after the rebuild
            for m in (mc, th):
                m.zero_grad()
                m(x).sum().backward()
        ours = [sum(sizes[n] for n in names) for names in mc.ddp.bucket_names]
        theirs = [int(b) for b in th._get_ddp_logging_data()["rebuilt_bucket_sizes"].split(", ")]
        out[cap] = (ours, theirs)
        mc.close()
    dist.destroy_process_group()
    return out


def test_rebuilt_buckets_follow_torchs_first_bucket_rule(run_ranks):
    # torch's first rebuilt bucket is 1 MiB only by default: an explicit bucket_cap_mb caps
    # it too. The first cut moves every later one, and on more than 2 ranks the sums with it.
    for out in run_ranks(2, _rebuilt_like_torch, caps=[None, 1.5, 25], timeout=90,
                         init_timeout=60):
        for cap, (ours, theirs) in out.items():
            assert sorted(ours) == sorted(theirs), (cap, ours, theirs)
        assert out[None][1] != out[1.5][1]  # the case tells the two rules apart


def _different_models(pg):
    import meshcoll
    import meshcoll.torch as mt
    width = 8 if pg.rank == 0 else 9
    net = torch.nn.Sequential(torch.nn.Linear(4, width), torch.nn.Linear(width, 2))
    try:
        mt.DistributedDataParallel(net, group=pg)
    except meshcoll.MismatchError as e:
        return str(e)
    return "no error"


def test_ranks_with_different_models_get_a_mismatch_naming_the_first_difference(run_ranks):
    for msg in run_ranks(2, _different_models):
        assert "different parameters" in msg and "'0.weight (8, 4)" in msg \
            and "'0.weight (9, 4)" in msg, msg


def _adapter_stale(pg):
    import meshcoll.torch as mt
    from meshcoll import BoundedStaleness
    torch.manual_seed(0)
    model = mt.DistributedDataParallel(torch.nn.Linear(4, 3), group=pg, mode=BoundedStaleness(1))
    out = []
    for t in range(3):
        model.zero_grad()
        x = torch.as_tensor(np.random.default_rng([t, pg.rank]).standard_normal((2, 4)),
                            dtype=torch.float32)
        model(x).sum().backward()
        out.append({n: p.grad.numpy().copy() for n, p in model.module.named_parameters()})
    model.close()
    return out


def test_bounded_staleness_through_the_adapter(run_ranks):
    world = 2
    def local(r, t):  # d/dW and d/db of Linear(4, 3)(x).sum()
        x = np.random.default_rng([t, r]).standard_normal((2, 4)).astype(np.float32)
        return {"weight": np.tile(x.sum(0), (3, 1)), "bias": np.full(3, 2.0, np.float32)}
    for out in run_ranks(world, _adapter_stale):
        assert not out[0]["weight"].any() and not out[0]["bias"].any()  # nothing a step old yet
        for t in (1, 2):
            for n in ("weight", "bias"):
                want = sum(local(r, t - 1)[n] for r in range(world)) / world
                np.testing.assert_allclose(out[t][n], want, rtol=1e-6)


def _uneven(pg, lr):
    import meshcoll.torch as mt
    torch.manual_seed(0)
    model = mt.DistributedDataParallel(torch.nn.Linear(4, 3), group=pg)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    with model.join():
        for s in range(2 + pg.rank):  # rank r has 2 + r batches
            opt.zero_grad()
            x = torch.as_tensor(np.random.default_rng([s, pg.rank]).standard_normal((2, 4)),
                                dtype=torch.float32)
            model(x).pow(2).sum().backward()
            opt.step()
    state = {n: p.detach().numpy().copy() for n, p in model.module.named_parameters()}
    model.close()
    return state


def test_join_trains_on_uneven_inputs_as_torch_ddp_does(run_ranks):
    world, lr = 3, 0.05
    ref = common.join_reference(world, lr)
    for state in run_ranks(world, _uneven, lr=lr):  # every rank ends with the last's model
        for n, p in ref.named_parameters():
            np.testing.assert_allclose(state[n], p.detach().numpy(), rtol=1e-5, atol=1e-6)
