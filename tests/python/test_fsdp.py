"""Sharded data parallel (issue 36): ``meshcoll.torch.fully_shard`` stages 1-3 and hybrid
sharding train as torch's DDP on Gloo in the same processes (20 steps, SGD and AdamW, an MLP
and a small transformer), mixed precision, no_sync accumulation, state dicts that load into
an unwrapped model, activation checkpointing, the errors (differing layouts, a rank killed
mid-step). Each test spawns one world and loops over its cases inside it
(tests/python/test_sharded.py: ``meshcoll.ShardedDataParallel`` on numpy)."""

from __future__ import annotations

import os
import signal
import time

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from fsdp_common import (MODELS, base, batch, ddp_reference, fsdp2_reference,  # noqa: E402
                         max_rel, optimizer, sharded, torch_group, train)

pytestmark = pytest.mark.timeout(150)


@pytest.fixture(autouse=True)
def _one_thread(monkeypatch):
    # 2-4 ranks on 2 cores: one BLAS / intra-op thread each.
    monkeypatch.setenv("OMP_NUM_THREADS", "1")


# ---- stages 1-3 against torch's DDP --------------------------------------------------------
def _stages(pg):
    torch_group(pg)
    out = {}
    for kind in MODELS:
        for opt_name in ("sgd", "adamw"):
            ref = ddp_reference(pg, kind, opt_name)
            for stage in (1, 2, 3):
                net = sharded(kind, group=pg, stage=stage)
                got = train(net, kind, opt_name, pg.rank)
                if stage == 3:  # after a forward, only the root's parameters stay gathered
                    net(batch(kind, 0, pg.rank)[0])
                    held = [getattr(m, name).device.type for b in net.blocks
                            for m, name, _ in b._meshcoll_fsdp_unit.entries]
                    assert held and set(held) == {"meta"}, held
                    assert net.head.weight.device.type == "cpu"
                # The optimizer sees shards only: a 1/N slice of every unit, padded.
                numel = sum(p.numel() for p in net.parameters())
                total = sum(p.numel() for p in base(kind).parameters())
                out[(kind, opt_name, stage)] = (max_rel(got, ref), numel, total)
    return out


def test_stages_1_2_3_train_as_torch_ddp(run_ranks):
    for res in run_ranks(2, _stages, timeout=140, init_timeout=90):
        for case, (rel, numel, total) in res.items():
            assert rel < 1e-5, (case, rel)
            assert numel <= total // 2 + 3 * 2, (case, numel, total)  # 3 units, pad < 2 each


# ---- hybrid sharding on a 2x2 mesh --------------------------------------------------------
def _hybrid(pg):
    import meshcoll
    torch_group(pg)
    mesh = meshcoll.init_device_mesh((2, 2), ("replicate", "shard"))
    out = {}
    for opt_name in ("sgd", "adamw"):
        ref = ddp_reference(pg, "mlp", opt_name)
        for stage in ((1, 2, 3) if opt_name == "sgd" else (3,)):
            net = sharded("mlp", mesh=mesh, stage=stage)
            out[(opt_name, stage)] = max_rel(train(net, "mlp", opt_name, pg.rank), ref)
    return out


def test_hybrid_sharding_on_a_2x2_mesh_trains_as_torch_ddp(run_ranks):
    for res in run_ranks(4, _hybrid, timeout=140, init_timeout=90):
        for case, rel in res.items():
            assert rel < 1e-5, (case, rel)


# ---- mixed precision, no_sync, state dicts, checkpointing -----------------------------------
def _options(pg):
    import meshcoll.torch as mt
    torch_group(pg)
    out = {}
    # no_sync: 3 micro-batches, the first two without communication.
    ref = ddp_reference(pg, "transformer", "adamw", accum=3)
    net = sharded("transformer", group=pg)
    out["no_sync"] = max_rel(train(net, "transformer", "adamw", pg.rank, accum=3), ref)

    # Activation checkpointing: the same training, each block recomputed in backward.
    ref = ddp_reference(pg, "transformer", "sgd")
    net = sharded("transformer", group=pg, checkpoint=True)
    out["checkpoint"] = max_rel(train(net, "transformer", "sgd", pg.rank), ref)

    # State dicts: the full one loads into the unwrapped model; the sharded ones, merged,
    # give the same; loading back into a sharded model restores its shards.
    full = net.full_state_dict()
    plain = MODELS["transformer"]()
    plain.load_state_dict(full)
    out["full_loads"] = max_rel({n: p.detach().numpy() for n, p in plain.state_dict().items()},
                                 {n: v.numpy() for n, v in full.items()})
    mine = net.sharded_state_dict()
    every = [None] * pg.size
    for r in range(pg.size):  # the ranks' dicts, through the group (pickled)
        every[r] = _exchange(pg, mine, r)
    merged = mt.merge_sharded_state_dicts(every)
    plain2 = MODELS["transformer"]()
    plain2.load_state_dict(merged)
    out["sharded_merged"] = max_rel({n: v.numpy() for n, v in merged.items()},
                                     {n: v.numpy() for n, v in full.items()})
    fresh = sharded("transformer", group=pg)
    fresh.load_sharded_state_dict(mine)
    out["sharded_loads"] = max_rel({n: v.numpy() for n, v in fresh.full_state_dict().items()},
                                    {n: v.numpy() for n, v in full.items()})
    fresh2 = sharded("transformer", group=pg)
    fresh2.load_full_state_dict(full)
    out["full_loads_sharded"] = max_rel(
        {n: v.numpy() for n, v in fresh2.full_state_dict().items()},
        {n: v.numpy() for n, v in full.items()})

    # clip_grad_norm_: the norm over every rank's shards and the clipped step, as torch's
    # clip_grad_norm_ on DDP's full gradients.
    ddp = torch.nn.parallel.DistributedDataParallel(base("transformer"))
    net = sharded("transformer", group=pg)
    x, y = batch("transformer", 0, pg.rank)
    got_norms = []
    for m, clip in ((ddp, torch.nn.utils.clip_grad_norm_), (net, mt.clip_grad_norm_)):
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        torch.nn.functional.cross_entropy(m(x), y).backward()
        got_norms.append(float(clip(m.parameters() if m is ddp else m, 0.05)))
        opt.step()
    out["clip_norm"] = abs(got_norms[1] - got_norms[0]) / got_norms[0]
    assert got_norms[0] > 0.05  # the clipping acted
    out["clip_step"] = max_rel({n: v.numpy() for n, v in net.full_state_dict().items()},
                               {n: p.detach().numpy() for n, p in ddp.module.named_parameters()})

    # Mixed precision: bf16 forward/backward, fp32 shards, reduce in fp32 and in bf16,
    # against torch's fully_shard with the same policy (on Gloo, in the same processes).
    for reduce in (torch.float32, torch.bfloat16):
        policy = mt.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=reduce)
        ref = fsdp2_reference(pg, "transformer", "sgd", policy)
        net = sharded("transformer", group=pg, mp_policy=policy)
        got = train(net, "transformer", "sgd", pg.rank, dtype=torch.bfloat16)
        assert all(p.dtype == torch.float32 for p in net.parameters())
        out[f"bf16 reduce {reduce}"] = max_rel(got, ref)
    return out


def _exchange(pg, obj, root):
    import pickle
    data = np.frombuffer(pickle.dumps(obj), np.uint8).copy() if pg.rank == root else None
    n = np.array([0 if data is None else data.size], np.int64)
    pg.broadcast(n, root)
    buf = data if data is not None else np.empty(int(n[0]), np.uint8)
    pg.broadcast(buf, root)
    return pickle.loads(buf.tobytes())


def test_no_sync_checkpointing_state_dicts_and_mixed_precision(run_ranks):
    for res in run_ranks(2, _options, timeout=140, init_timeout=90):
        for case in ("no_sync", "checkpoint", "clip_norm", "clip_step"):
            assert res[case] < 1e-5, (case, res[case])
        for case in ("full_loads", "sharded_merged", "sharded_loads", "full_loads_sharded"):
            assert res[case] == 0.0, (case, res[case])
        for case, rel in res.items():
            if case.startswith("bf16"):
                assert rel < 1e-5, (case, rel)


# ---- optimizer state dicts ---------------------------------------------------------------
def _steps(net, opt, steps, rank, first=0):
    for s in range(first, first + steps):
        opt.zero_grad()
        x, y = batch("mlp", s, rank)
        torch.nn.functional.cross_entropy(net(x), y).backward()
        opt.step()


def _optim_state(pg):
    import meshcoll.torch as mt
    torch_group(pg)
    ddp = torch.nn.parallel.DistributedDataParallel(base("mlp"))
    ddp_opt = optimizer("adamw", ddp.parameters())
    _steps(ddp, ddp_opt, 5, pg.rank)
    names = [n for n, _ in ddp.module.named_parameters()]
    want = {names[i]: st for i, st in ddp_opt.state_dict()["state"].items()}
    net = sharded("mlp", group=pg)
    opt = optimizer("adamw", net.parameters())
    _steps(net, opt, 5, pg.rank)
    full = net.full_optim_state_dict(opt)
    out = {"names": sorted(full["state"]) == sorted(names),
           "groups": full["param_groups"][0]["lr"] == ddp_opt.param_groups[0]["lr"]}
    out["moments"] = max(float((full["state"][n][k] - want[n][k]).abs().max() /
                               want[n][k].abs().max())
                         for n in names for k in ("exp_avg", "exp_avg_sq"))
    out["step"] = {float(full["state"][n]["step"]) for n in names} == {5.0}
    # Resume: a fresh sharded model and optimizer loaded from the full dicts step on as the
    # original does, bit for bit.
    params = net.full_state_dict()
    again = sharded("mlp", group=pg)
    again.load_full_state_dict(params)
    again_opt = optimizer("adamw", again.parameters())
    again.load_full_optim_state_dict(again_opt, full)
    _steps(net, opt, 3, pg.rank, first=5)
    _steps(again, again_opt, 3, pg.rank, first=5)
    out["resumed"] = max_rel({n: v.numpy() for n, v in again.full_state_dict().items()},
                             {n: v.numpy() for n, v in net.full_state_dict().items()})
    return out


def test_optimizer_state_dicts_are_torch_ddps_and_resume_exactly(run_ranks):
    for res in run_ranks(2, _optim_state, timeout=100, init_timeout=60):
        assert res["names"] and res["groups"] and res["step"], res
        assert res["moments"] < 1e-5, res
        assert res["resumed"] == 0.0, res


# ---- errors ----------------------------------------------------------------------------
def _different_layouts(pg):
    import meshcoll
    import meshcoll.torch as mt
    net = torch.nn.Sequential(torch.nn.Linear(4, 8 if pg.rank == 0 else 9), torch.nn.Linear(
        8 if pg.rank == 0 else 9, 2))
    try:
        mt.fully_shard(net, group=pg)
    except meshcoll.MismatchError as e:
        return str(e)
    return "no error"


def test_ranks_with_different_shard_layouts_get_a_mismatch_naming_both(run_ranks):
    for msg in run_ranks(2, _different_layouts):
        assert "global rank 0 and global rank 1" in msg, msg
        assert "fully_shard" in msg and "0.weight" in msg, msg


def _killed(pg, victim):
    import meshcoll
    g = pg.new_group(list(range(pg.size)), timeout=3.0)
    net = sharded("mlp", group=g)
    opt = optimizer("sgd", net.parameters())
    x, y = batch("mlp", 0, pg.rank)
    torch.nn.functional.cross_entropy(net(x), y).backward()  # one whole step
    opt.step()
    pg.barrier()
    if pg.rank == victim:
        net(x)  # the forward's gathers with every rank, then death before backward
        os.kill(os.getpid(), signal.SIGKILL)
    t0 = time.monotonic()
    try:
        torch.nn.functional.cross_entropy(net(x), y).backward()
        opt.step()
        net(x)
        out = ("no error", "", time.monotonic() - t0)
    except (meshcoll.PeerError, meshcoll.TimeoutError) as e:
        out = (type(e).__name__, str(e), time.monotonic() - t0)
    try:
        g.destroy()
    except meshcoll.MeshcollError:
        pass
    return out + (time.monotonic() - t0,)


def test_a_rank_killed_mid_step_is_a_peer_error_on_every_survivor(run_ranks):
    results = run_ranks(3, _killed, victim=2, may_die=(2,), timeout=90, init_timeout=60)
    for rank in (0, 1):
        kind, msg, took, with_teardown = results[rank]
        assert kind == "PeerError", (rank, kind, msg)
        assert took < 20 and with_teardown < 30, (rank, took, with_teardown)
        assert "rank 2" in msg or "rank(s) 2" in msg, (rank, msg)
