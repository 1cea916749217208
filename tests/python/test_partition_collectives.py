"""Tier 2: shard / all_gather / reduce_scatter_dim and the tensor-parallel example over
real processes (the `run_ranks` fixture). Each test spawns one world and loops over its
cases inside it: spawning costs more than the cases."""

import numpy as np
import pytest

from meshcoll.examples import tensor_parallel
from meshcoll.partition import ShardedArray, reduce_scatter_dim, shard

pytestmark = pytest.mark.timeout(120)

# (shape, dim): odd lengths along dims 0, 1 and -1, lengths below the world size
# (empty shards), and a zero-length dim.
CASES = [((7, 5, 3), 0), ((7, 5, 3), 1), ((7, 5, 3), -1), ((1, 9), 0), ((3, 2), -1),
         ((11,), 0), ((2, 13), 1), ((5, 3, 1), -2), ((0, 3), 0), ((4, 3), 1)]
DTYPES = [np.float64, np.float32, np.int32]


def _round_trip(pg):
    checked = 0
    for (shape, dim) in CASES:
        for dtype in DTYPES:
            x = (np.arange(int(np.prod(shape))) * 3 - 7).astype(dtype).reshape(shape)
            sh = shard(x, dim, group=pg)
            want = np.array_split(x, pg.size, axis=dim)[pg.rank]
            np.testing.assert_array_equal(sh.local, want)
            assert sh.local.dtype == x.dtype and sh.local.flags.c_contiguous
            assert not np.shares_memory(sh.local, x)  # a copy, even where a view would do
            assert (sh.global_shape, sh.dim, sh.parts, sh.index) == \
                   (shape, dim % len(shape), pg.size, pg.rank)
            assert sh.stop - sh.start == want.shape[dim]
            full = sh.all_gather()
            assert full.shape == shape and full.dtype == x.dtype and full.flags.c_contiguous
            np.testing.assert_array_equal(full, x)
            checked += 1
    # The world group is the default.
    x = np.arange(35.0).reshape(5, 7)
    np.testing.assert_array_equal(shard(x, -1).all_gather(), x)
    # A shard gathers over a group of its size and rank only.
    wrong = ShardedArray(np.zeros((1, 2)), (pg.size + 1, 2), 0, pg.rank, pg.rank + 1,
                         pg.size + 1, pg.rank)
    with pytest.raises(ValueError, match=f"cannot be gathered over a group of size {pg.size}"):
        wrong.all_gather(pg)
    with pytest.raises(ValueError, match="dim 2 is out of range"):
        shard(x, 2, group=pg)
    return checked


def _subgroups(pg):
    """Shards over a subgroup (the even or the odd ranks) gather within it."""
    sub = pg.split(color=pg.rank % 2)
    x = np.arange(9 * 4, dtype=np.float64).reshape(9, 4) + 100 * (pg.rank % 2)
    sh = shard(x, 0, group=sub)
    np.testing.assert_array_equal(sh.local, np.array_split(x, sub.size)[sub.rank])
    np.testing.assert_array_equal(sh.all_gather(), x)  # uses the shard's own group
    return sub.size


def _rank_data(rank, shape, dtype):
    rng = np.random.default_rng([2024, rank])
    if np.dtype(dtype).kind == "i":
        return rng.integers(-50, 51, shape).astype(dtype)
    return rng.standard_normal(shape).astype(dtype)


def _reduce_scatter(pg):
    ops = {"sum": lambda xs: np.sum(xs, axis=0), "max": lambda xs: np.max(xs, axis=0),
           "min": lambda xs: np.min(xs, axis=0), "avg": lambda xs: np.mean(xs, axis=0)}
    checked = 0
    for (shape, dim) in CASES:
        for dtype in (np.float64, np.int64):
            everyone = [_rank_data(r, shape, dtype) for r in range(pg.size)]
            for op, ref in ops.items():
                if op == "avg" and dtype == np.int64:
                    continue
                want_full = ref(np.stack(everyone)).astype(dtype)
                want = np.array_split(want_full, pg.size, axis=dim)[pg.rank]
                sh = reduce_scatter_dim(everyone[pg.rank].copy(), dim, op=op, group=pg)
                assert isinstance(sh, ShardedArray) and sh.local.dtype == dtype
                assert (sh.global_shape, sh.dim) == (shape, dim % len(shape))
                assert sh.local.shape == want.shape and sh.local.flags.c_contiguous
                full = sh.all_gather()
                if dtype == np.int64 or op in ("max", "min"):
                    np.testing.assert_array_equal(sh.local, want)
                    np.testing.assert_array_equal(full, want_full)
                else:  # float sums: the ring adds in another order than numpy
                    np.testing.assert_allclose(sh.local, want, rtol=1e-13, atol=1e-13)
                    np.testing.assert_allclose(full, want_full, rtol=1e-13, atol=1e-13)
                checked += 1
    # The input is left as it was (the reduction goes to a new array), also along dim 0
    # where it is sent without a copy.
    for dim in (0, 1):
        x = _rank_data(pg.rank, (6, 5), np.int64)
        before = x.copy()
        reduce_scatter_dim(x, dim)
        np.testing.assert_array_equal(x, before)
    return checked


def _all_cases(pg):
    return {"round trip": _round_trip(pg), "reduce_scatter_dim": _reduce_scatter(pg),
            "subgroup size": _subgroups(pg)}


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_round_trip_reduce_scatter_and_subgroups(run_ranks, world):
    """shard/all_gather round-trips, reduce_scatter_dim against numpy, and both over a
    subgroup: one spawned world for all of them."""
    results = run_ranks(world, _all_cases)
    n_rs = sum(4 if dtype == np.float64 else 3 for dtype in (np.float64, np.int64)) * len(CASES)
    for rank, r in enumerate(results):
        assert r == {"round trip": len(CASES) * len(DTYPES), "reduce_scatter_dim": n_rs,
                     "subgroup size": len(range(rank % 2, world, 2))}


def _tensor_parallel(pg, cases):
    return [tensor_parallel.run(pg, tp, ffn=ffn, dtype=dtype, verbose=False)
            for tp, ffn, dtype in cases]


# (tp size, ffn size, dtype); the default ffn 29 splits unevenly on every tp, and ffn 3
# leaves tp rank 3 an empty shard. tp 2 on 4 ranks goes through a (dp, tp) DeviceMesh.
TP_CASES = {2: [(2, 29, "float64"), (2, 29, "float32")],
            4: [(4, 29, "float64"), (4, 29, "float32"), (2, 29, "float64"), (4, 3, "float64")]}


@pytest.mark.parametrize("world", sorted(TP_CASES))
def test_tensor_parallel_example_matches_unsharded(run_ranks, world):
    for rank, errs in enumerate(run_ranks(world, _tensor_parallel, cases=TP_CASES[world])):
        for (tp, ffn, dtype), err in zip(TP_CASES[world], errs):
            assert err < tensor_parallel.TOLERANCE[dtype], (rank, tp, ffn, dtype, err)


def _torch_group(pg):
    """A CPU group that allocates torch tensors for torch inputs (CPU memory, the real CPU
    backend underneath, which reads torch tensors as it reads numpy arrays), as a GPU backend
    allocates in its input's framework: partition.py must handle them with what numpy and
    torch arrays share and allocate through ``_empty``. Results are compared by value."""
    import torch

    from meshcoll.backends import make_group
    from meshcoll.process_group import HostArrays

    class TorchArrays(HostArrays):
        @staticmethod
        def empty(shape, like, dtype=None):
            if isinstance(like, torch.Tensor):
                return torch.empty(tuple(shape), dtype=like.dtype)
            return HostArrays.empty(shape, like, dtype)

    # Collective, as _child is: every rank builds the group's backend under one new name.
    tg = make_group(pg._store, pg.ranks, pg.rank, "world.torch", timeout=pg._timeout,
                    bind_host=pg._bind_host, token=pg._token)
    tg.backend_name = "torch-cpu"
    tg._arrays = TorchArrays
    return tg


def _torch_arrays(pg):
    import torch

    tg = _torch_group(pg)
    try:
        for shape, dim in [((7, 5, 3), 1), ((7, 5, 3), -1), ((2, 13), 0), ((3, 2), 1)]:
            x = torch.arange(int(np.prod(shape)), dtype=torch.float64).reshape(shape)
            sh = shard(x, dim, group=tg)
            assert isinstance(sh.local, torch.Tensor) and sh.local.is_contiguous()
            assert sh.local.data_ptr() != x.data_ptr() or sh.local.numel() == 0
            np.testing.assert_array_equal(
                sh.local.numpy(), np.array_split(x.numpy(), pg.size, axis=dim)[pg.rank])
            np.testing.assert_array_equal(np.asarray(sh.all_gather()), x.numpy())
            y = x * (pg.rank + 1)
            rs = reduce_scatter_dim(y, dim, group=tg)
            want = np.array_split(x.numpy() * sum(range(1, pg.size + 1)), pg.size, axis=dim)
            np.testing.assert_array_equal(np.asarray(rs.local), want[pg.rank])
    finally:
        tg.destroy()
    return True


def test_non_numpy_arrays_go_through_the_group_hooks(run_ranks):
    pytest.importorskip("torch")
    assert run_ranks(1, _torch_arrays) == [True]  # one rank: torch imports are slow


def test_tensor_parallel_reference_backward_is_the_gradient():
    """The example checks its sharded run against ``reference``; check that reference's
    backward by central differences of L = sum(O * dO). No processes, but the example
    imports the compiled module, so it is not tier 1."""
    tp = tensor_parallel
    p = tp.make_problem(batch=3, hidden=4, ffn=5, dtype="float64", seed=1)
    grads = tp.reference(p)

    def loss(q):
        return float(np.sum(tp.reference(q)["O"] * q["dO"]))

    eps = 1e-6
    for name in ("X", "A", "B"):
        numeric = np.zeros_like(p[name])
        for i in np.ndindex(p[name].shape):
            q = {k: v.copy() for k, v in p.items()}
            q[name][i] += eps
            up = loss(q)
            q[name][i] -= 2 * eps
            numeric[i] = (up - loss(q)) / (2 * eps)
        np.testing.assert_allclose(grads["d" + name], numeric, rtol=1e-6, atol=1e-8)
