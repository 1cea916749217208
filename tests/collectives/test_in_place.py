"""In-place forms (Note [Overlapping buffers] in csrc/comm/backend.cc), the one-call rooted
paths (Note [Rooted in-place calls] in bind_backend.cc) and ProcessGroup.empty/zeros on the
CPU backend. Values against numpy on random data; every rank makes the same calls."""

import os
import re
import time

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
    # scatter with out = x[root's block] on the root, and gather with x = out[root's block]
    # (through the backend: ProcessGroup.gather makes its own out): every rank gets its rows.
    root = n - 1
    table = np.stack(blocks)
    x = table.copy() if r == root else None
    mine = pg.scatter(x, root, out=x[root] if r == root else np.empty((rows, 7), np.float32))
    assert np.array_equal(mine, blocks[r])
    out = np.full((n, rows, 7), np.nan, np.float32)
    out[r] = blocks[r]
    pg._backend.gather(out[r] if r == root else blocks[r], out if r == root else out[:0],
                       [rows * 7] * n, root, 30, None, False)
    assert r != root or np.array_equal(out, table)
    # Every other overlap raises before anything is sent, naming the operation and this rank
    # (on every rank: all pass one). all_to_all has no in-place form: any overlap is refused.
    errors = []
    big = np.zeros(n * 8, np.float32)
    blk = [2] * n
    for label, call in [
        ("all_gather, wrong block", lambda: pg.all_gather(big[1:5], out=big[:n * 4])),
        ("reduce_scatter, shifted out", lambda: pg.reduce_scatter(big, out=big[1:9])),
        ("all_reduce through an overlapping out",
         lambda: pg._backend.all_reduce(big[:8], big[4:12], "sum", 30, None, False, "auto",
                                        pg.config.max_segment_bytes,
                                        pg.config.tree_threshold_bytes,
                                        pg.config.hd_threshold_bytes, 0, "auto", "auto")),
        ("all_to_all, shifted out", lambda: pg.all_to_all(big[:2 * n], out=big[n:3 * n])),
        ("all_to_all, same array", lambda: pg.all_to_all(big[:2 * n], out=big[:2 * n])),
        ("all_to_all async, out inside x",
         lambda: pg.all_to_all(big[:4 * n], out=big[2 * n:6 * n], async_op=True).wait()),
        ("all_to_all_v, shifted out",
         lambda: pg._backend.all_to_all(big[:2 * n], big[1:2 * n + 1], blk, blk, True, 30,
                                        None, False)),
    ]:
        try:
            call()
            errors.append(f"{label}: no error")
        except ValueError as e:
            op = label.split(",")[0].split(" ")[0]
            if ("in-place form" not in str(e) or f"{op}:" not in str(e)
                    or f"rank {pg.global_rank(r)} " not in str(e)):
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


def _root_overlaps(pg, give_up):
    """Only the root's arrays overlap: the root refuses before anything is sent; the other
    ranks, which made the call, wait for it as for any refused argument. Then the root either
    retries with separate arrays (its retry pairs with their one call: every rank gets the
    right rows) or makes no further call (they time out, naming it; their out untouched)."""
    n, r, k = pg.size, pg.rank, 4
    table = np.arange(n * k, dtype=np.float32).reshape(n, k) + 1
    timeout = 2.0 if give_up else 30.0
    res = {}
    if r == 0:
        buf = np.zeros(n * k + k, np.float32)
        x = buf[:n * k].reshape(n, k)
        x[:] = table
        for op, call in [
            ("scatter", lambda: pg.scatter(x, 0, out=buf[k // 2:k // 2 + k], timeout=timeout)),
            ("gather", lambda: pg._backend.gather(x[1], x, [k] * n, 0, timeout, None, False)),
        ]:
            try:
                call()
                res[op] = "no error"
            except ValueError as e:
                res[op] = str(e)
        res["x intact"] = bool(np.array_equal(x, table))
        if give_up:
            time.sleep(timeout + 2)  # alive, in no call: the peers must not wait for ever
            return res
        res["scatter rows"] = pg.scatter(table, 0, timeout=timeout).tolist()
        res["gather rows"] = pg.gather(table[0], 0, timeout=timeout).tolist()
        return res
    got = np.full(k, -7.0, np.float32)
    t0 = time.monotonic()
    try:
        pg.scatter(None, 0, out=got, timeout=timeout)
        res["scatter rows"] = got.tolist()
    except meshcoll.MeshcollError as e:
        res["scatter"] = (type(e).__name__, str(e), time.monotonic() - t0, got.tolist())
        res["names root"] = bool(re.search(r"rank\(s\) 0\b", str(e)))
        return res
    pg.gather(table[r], 0, timeout=timeout)
    return res


@pytest.mark.parametrize("transport", ["shm", "tcp"])
@pytest.mark.parametrize("give_up", [False, True], ids=["root retries", "root gives up"])
def test_an_overlap_on_the_root_alone_is_refused_before_anything_is_sent(run_ranks, transport,
                                                                          give_up):
    n = 3
    table = (np.arange(n * 4, dtype=np.float32).reshape(n, 4) + 1).tolist()
    res = run_ranks(n, _root_overlaps, transport=transport, give_up=give_up)
    root = res[0]
    for op in ("scatter", "gather"):
        assert f"{op}:" in root[op] and "rank 0 " in root[op], root
        assert "not the in-place form" in root[op], root
    assert root["x intact"], root
    for r in range(1, n):
        if give_up:  # an error within the call's 2 s naming the root; nothing written
            kind, msg, elapsed, got = res[r]["scatter"]
            assert kind == "TimeoutError" and res[r]["names root"], res[r]
            assert elapsed < 2.0 + 3.0 and got == [-7.0] * 4, res[r]
        else:
            assert res[r]["scatter rows"] == table[r], res[r]
    if not give_up:
        assert root["scatter rows"] == table[0] and root["gather rows"] == table, root


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
