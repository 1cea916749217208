"""In-place forms (Note [Overlapping buffers] in csrc/comm/backend.cc), the one-call rooted
paths (Note [Rooted in-place calls] in bind_backend.cc) and ProcessGroup.empty/zeros on the
CPU backend. Values against numpy on random data; every rank makes the same calls."""

import os

import numpy as np
import pytest

import meshcoll
from conftest import rand_array

pytestmark = pytest.mark.timeout(90)


def _in_place(pg, hosts=None):
    if hosts:  # a hierarchical group: one leader per emulated host (test_hierarchy.py)
        os.environ["MESHCOLL_HOST_ID"] = hosts[pg.rank]
        meshcoll._C.reload_config()
        pg = pg.new_group(list(range(pg.size)))
        assert pg._hier is not None
    n, r = pg.size, pg.rank
    rows = 5
    blocks = [rand_array(np.random.default_rng(10 + k), rows * 7, np.float32).reshape(rows, 7)
              for k in range(n)]
    # all_gather with x = out[rank]: out holds every rank's block after the call.
    out = np.full((n, rows, 7), np.nan, np.float32)
    out[r] = blocks[r]
    got = pg.all_gather(out[r], out=out)
    assert got is out and np.array_equal(out, np.stack(blocks))
    # reduce_scatter with out = x[rank block]: this rank's rows of the sum.
    xs = [rand_array(np.random.default_rng(50 + k), n * rows * 3, np.float32).reshape(n * rows, 3)
          for k in range(n)]
    x = xs[r].copy()
    mine = x[r * rows:(r + 1) * rows]
    pg.reduce_scatter(x, out=mine)
    want = np.sum(np.stack(xs), axis=0, dtype=np.float64)[r * rows:(r + 1) * rows]
    assert np.allclose(mine, want, rtol=1e-5, atol=1e-5), np.abs(mine - want).max()
    # Every other overlap raises before anything is sent (on every rank: all pass one).
    errors = []
    big = np.zeros(n * 8, np.float32)
    for label, call in [
        ("all_gather, wrong block", lambda: pg.all_gather(big[1:5], out=big[:n * 4])),
        ("reduce_scatter, shifted out", lambda: pg.reduce_scatter(big, out=big[1:9])),
        ("all_reduce through an overlapping out",
         lambda: pg._backend.all_reduce(big[:8], big[4:12], "sum", 30, None, False, "auto",
                                        pg.config.max_segment_bytes,
                                        pg.config.tree_threshold_bytes,
                                        pg.config.hd_threshold_bytes)),
    ]:
        try:
            call()
            errors.append(f"{label}: no error")
        except ValueError as e:
            if "in-place form" not in str(e):
                errors.append(f"{label}: {e}")
    # The group is still usable afterwards.
    y = np.full(3, r + 1.0, np.float32)
    pg.all_reduce(y)
    assert y.tolist() == [n * (n + 1) / 2] * 3
    return errors


@pytest.mark.parametrize("world,transport", [(2, "shm"), (3, "tcp"), (4, "shm")])
def test_in_place_gathers_and_overlap_errors(run_ranks, world, transport):
    for errors in run_ranks(world, _in_place, transport=transport):
        assert not errors, errors


def test_in_place_gathers_and_overlap_errors_on_a_hierarchy(run_ranks):
    for errors in run_ranks(4, _in_place, hosts=["a", "a", "b", "b"]):
        assert not errors, errors


def _rooted(pg):
    n, r = pg.size, pg.rank
    data = [rand_array(np.random.default_rng(90 + k), 33, np.float64) for k in range(n)]
    x = data[r].copy()
    assert pg.broadcast(x, src=np.int64(n - 1)) is x  # numpy ints name ranks too
    assert np.array_equal(x, data[n - 1])
    x = data[r].copy()
    assert pg.reduce(x, dst=0, op="max") is x
    want = np.max(np.stack(data), axis=0) if r == 0 else data[r]
    assert np.array_equal(x, want)
    for bad in (n, -1):
        with pytest.raises(ValueError, match="root"):
            pg.broadcast(x, src=bad)
    with pytest.raises(TypeError):
        pg.reduce(x, dst="0")
    with pytest.raises(ValueError, match="read-only"):
        ro = np.zeros(3)
        ro.setflags(write=False)
        pg.broadcast(ro)
    w = pg.broadcast(x, src=0, async_op=True)
    w.wait()
    return True


@pytest.mark.parametrize("world", [1, 3])
def test_broadcast_and_reduce_one_call_path(run_ranks, world):
    assert all(run_ranks(world, _rooted))


def _memory(pg):
    a = pg.empty((3, 4), "float32")
    z = pg.zeros(5, np.int64, symmetric=True)  # a CPU group: ordinary memory
    b = pg.empty(2, like=np.zeros(1, np.float16))
    assert isinstance(a, np.ndarray) and a.shape == (3, 4) and a.dtype == np.float32
    assert z.tolist() == [0] * 5 and z.dtype == np.int64
    assert b.dtype == np.float16
    assert pg.symmetric_memory.startswith("unavailable") and not pg.is_symmetric(z)
    return True


def test_empty_and_zeros_on_the_cpu_backend(run_ranks):
    assert all(run_ranks(2, _memory))
