"""torch tensors as collective arguments on the CPU backend (the GPU tests do the same on
NCCL): torch.Tensor, nn.Parameter and subclasses are read through DLPack's C exchange API
where torch offers it (Note [The DLPack C exchange API] in csrc/python/array.cc), else
through torch's methods; they must give numpy's answer on random data, and refuse what they
cannot read right, on every rank, before anything is sent."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import launch

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.timeout(120)


class Sub(torch.Tensor):  # a user's subclass, with torch's own __torch_function__
    pass


def _data(seed, rank, n):
    return np.random.default_rng([seed, rank]).standard_normal(n)


def _kinds(pg):
    from meshcoll import _C
    out = {}
    for label, make in (("tensor", lambda a: torch.from_numpy(a)),
                        ("parameter", lambda a: torch.nn.Parameter(torch.from_numpy(a))),
                        ("subclass", lambda a: torch.from_numpy(a).as_subclass(Sub))):
        n, size = 12, pg.size
        x = make(_data(1, pg.rank, n).astype(np.float32))
        reader = _C._array_reader(x)
        with torch.no_grad():
            pg.all_reduce(x)
            g = torch.empty(size, n, dtype=torch.float32)
            pg.all_gather(make(_data(2, pg.rank, n).astype(np.float32)), out=g)
            rs_in = make(_data(3, pg.rank, n * size).astype(np.float32))
            rs = torch.empty(n, dtype=torch.float32)
            pg.reduce_scatter(rs_in, out=rs)
            b = make(_data(4, pg.rank, n).astype(np.float32))
            pg.broadcast(b, 1)
            # A slice: the view starts past the start of its storage.
            big = torch.from_numpy(_data(5, pg.rank, 3 * n).astype(np.float32))
            pg.all_reduce(big[n:2 * n])
            w = pg.all_reduce(make(_data(6, pg.rank, n).astype(np.float32)), async_op=True)
            a = w.wait()
        out[label] = (reader, x.detach().numpy().copy(), g.numpy().copy(), rs.numpy().copy(),
                      b.detach().numpy().copy(), big.numpy().copy(),
                      np.asarray(a.detach()).copy())
    bf = torch.from_numpy(_data(7, pg.rank, 8).astype(np.float32)).to(torch.bfloat16)
    pg.all_reduce(bf)
    out["bfloat16"] = bf.float().numpy()
    i64 = torch.from_numpy(np.random.default_rng([8, pg.rank]).integers(-50, 50, 8))
    pg.all_reduce(i64, op="max")
    out["int64 max"] = i64.numpy()
    return out


def test_torch_tensors_give_numpys_answer_on_every_rank():
    world, n = 2, 12
    for rank, res in enumerate(launch(world, _kinds)):
        total = lambda seed, m: sum(_data(seed, r, m).astype(np.float32) for r in range(world))
        fast = hasattr(torch.Tensor, "__dlpack_c_exchange_api__")
        for label in ("tensor", "parameter", "subclass"):
            got_reader, x, g, rs, b, big, a = res[label]
            assert got_reader == ("dlpack exchange" if fast else "torch"), (label, got_reader)
            np.testing.assert_allclose(x, total(1, n), rtol=1e-6, err_msg=label)
            for r in range(world):
                np.testing.assert_array_equal(g[r], _data(2, r, n).astype(np.float32))
            want = total(3, n * world)[rank * n:(rank + 1) * n]
            np.testing.assert_allclose(rs, want, rtol=1e-6, err_msg=label)
            np.testing.assert_array_equal(b, _data(4, 1, n).astype(np.float32))
            mine = _data(5, rank, 3 * n).astype(np.float32)
            np.testing.assert_array_equal(big[:n], mine[:n])  # untouched around the slice
            np.testing.assert_array_equal(big[2 * n:], mine[2 * n:])
            np.testing.assert_allclose(big[n:2 * n], total(5, 3 * n)[n:2 * n], rtol=1e-6)
            np.testing.assert_allclose(a, total(6, n), rtol=1e-6, err_msg=label)
        bf = sum(torch.from_numpy(_data(7, r, 8).astype(np.float32)).to(torch.bfloat16).float()
                 for r in range(world)).numpy()
        np.testing.assert_allclose(res["bfloat16"], bf, rtol=1e-2)
        ints = np.maximum(*[np.random.default_rng([8, r]).integers(-50, 50, 8) for r in range(2)])
        np.testing.assert_array_equal(res["int64 max"], ints)


def _refusals(pg):
    out = {}
    cases = {
        "not contiguous": lambda: torch.ones(4, 4)[:, 1],
        # Its memory holds 1.0 where it reads -1.0: a collective would get the sign wrong.
        "negative view": lambda: torch._neg_view(torch.ones(4)),
        "complex": lambda: torch.ones(4, dtype=torch.complex64),
        "int16": lambda: torch.ones(4, dtype=torch.int16),
        "sparse": lambda: torch.ones(4).to_sparse(),
        "subclass negative view": lambda: torch._neg_view(torch.ones(4)).as_subclass(Sub),
    }
    for label, make in cases.items():
        x = make()
        try:
            pg.all_reduce(x)
            out[label] = ("no error", "")
        except Exception as e:  # noqa: BLE001 - the class is what the test checks
            out[label] = (type(e).__name__, str(e))
    # Nothing was sent: the group still gives the right sum.
    y = torch.from_numpy(_data(9, pg.rank, 16))
    pg.all_reduce(y)
    out["after"] = y.numpy()
    return out


def test_tensors_that_cannot_be_read_right_are_refused_on_every_rank():
    want = {"not contiguous": ("ValueError", "not C-contiguous"),
            "negative view": ("ValueError", "resolve_neg()"),
            "subclass negative view": ("ValueError", "resolve_neg()"),
            "complex": ("TypeError", "dtype complex64 is not supported"),
            "int16": ("TypeError", "dtype int16 is not supported"),
            "sparse": ("TypeError", "all_reduce: the tensor cannot be read")}
    for rank, res in enumerate(launch(2, _refusals)):
        for label, (cls, text) in want.items():
            kind, msg = res[label]
            if label == "sparse" and not hasattr(torch.Tensor, "__dlpack_c_exchange_api__"):
                continue  # torch's own methods raise their own error
            assert kind == cls and text in msg, (rank, label, kind, msg)
        np.testing.assert_allclose(res["after"], _data(9, 0, 16) + _data(9, 1, 16))
