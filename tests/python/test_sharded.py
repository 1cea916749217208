"""``meshcoll.ShardedDataParallel`` (issue 36) on numpy arrays: stages 1-3 and hybrid sharding
on a 2x2 mesh train the README's model to DataParallel's parameters, SGD with momentum and
AdamW stepping each rank's shard. No torch: each test spawns one world and loops over its
cases inside it."""

from __future__ import annotations

import numpy as np
import pytest

from meshcoll.examples.train_ddp import forward_backward, init_params, make_dataset

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(autouse=True)
def _one_thread(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")


SIZES, BATCH, NP_STEPS, LR = (8, 16, 16, 4), 26, 8, 0.2


def _nptrain(pg, make, opt_factory):
    """The README's model; each rank its array_split share of each global batch."""
    x, y = make_dataset(BATCH * NP_STEPS, dim=SIZES[0], classes=SIZES[-1], seed=1)
    params = init_params(SIZES, seed=pg.rank)  # differs per rank: construction broadcasts
    return make(params, x, y, opt_factory)


def _np_sharded(pg, stage, opt_factory, mesh=None):
    import meshcoll

    def make(params, x, y, opt_factory):
        sdp = meshcoll.ShardedDataParallel(params, group=None if mesh else pg, mesh=mesh,
                                           stage=stage)
        opt = opt_factory()
        for s in range(NP_STEPS):
            idx = np.array_split(np.arange(s * BATCH, (s + 1) * BATCH), pg.size)[pg.rank]
            grads = {}
            forward_backward(sdp.gather(), x[idx], y[idx], pg.size / BATCH, grads.__setitem__)
            sdp.step(grads, opt)
        return sdp.state_dict()
    return _nptrain(pg, make, opt_factory)


def _np_data_parallel(pg, opt_factory):
    from meshcoll.ddp import DataParallel

    def make(params, x, y, opt_factory):
        ddp = DataParallel(params, group=pg)
        opt = opt_factory()
        flat_state = {n: opt.init(p) for n, p in params.items()}
        for s in range(NP_STEPS):
            idx = np.array_split(np.arange(s * BATCH, (s + 1) * BATCH), pg.size)[pg.rank]
            grads = {}
            forward_backward(params, x[idx], y[idx], pg.size / BATCH, grads.__setitem__)
            ddp.sync_gradients(grads)
            for n, p in params.items():
                opt.update(p, grads[n], flat_state[n])
        ddp.close()
        return params
    return _nptrain(pg, make, opt_factory)


def _numpy_cases(pg):
    import meshcoll
    from meshcoll.sharded import SGD, Adam
    out = {}
    for name, factory in (("sgd", lambda: SGD(LR, momentum=0.5)),
                          ("adam", lambda: Adam(1e-2, weight_decay=0.01))):
        ref = _np_data_parallel(pg, factory)
        for stage in (1, 2, 3):
            got = _np_sharded(pg, stage, factory)
            out[(name, stage)] = max(float(np.abs(got[n] - ref[n]).max() / np.abs(ref[n]).max())
                                     for n in ref)
    if pg.size == 4:
        mesh = meshcoll.init_device_mesh((2, 2), ("replicate", "shard"))
        ref = _np_data_parallel(pg, lambda: SGD(LR))
        for stage in (1, 2, 3):
            got = _np_sharded(pg, stage, lambda: SGD(LR), mesh=mesh)
            out[("sgd", "hybrid", stage)] = max(
                float(np.abs(got[n] - ref[n]).max() / np.abs(ref[n]).max()) for n in ref)
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_sharded_data_parallel_on_numpy_trains_as_data_parallel(run_ranks, world):
    for res in run_ranks(world, _numpy_cases, timeout=120):
        if world == 4:
            assert ("sgd", "hybrid", 3) in res
        for case, rel in res.items():
            assert rel < 1e-5, (case, rel)
