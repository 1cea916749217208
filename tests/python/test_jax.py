"""JAX CPU arrays into the CPU backend, through DLPack (issue 18 item 6), on real processes
over TCP and shared memory, values checked against numpy on random data.

JAX arrays are immutable (Note [Immutable arrays] in csrc/python/array.cc): they go in as
inputs like any other array, and results go into framework arrays (numpy here): ``out=``, or
the arrays the group allocates. An op that would write into a JAX array raises, on every
rank, before anything is sent, and the array keeps its values. Skips where jax is not
installed (the [test] extra installs it)."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("jax")

pytestmark = pytest.mark.timeout(120)

N = 1031  # odd on purpose


def _body(pg):
    import jax
    import jax.numpy as jnp
    jax.config.update("jax_platforms", "cpu")
    r, n = pg.rank, pg.size
    inputs = [np.random.default_rng([11, k]).standard_normal(N * n).astype(np.float32)
              for k in range(n)]
    x = jnp.asarray(inputs[r])
    assert x.__dlpack_device__()[0] == 1  # kDLCPU: the CPU backend's memory
    out = {}

    g = pg.all_gather(x)  # allocated by the group: numpy
    out["all_gather"] = (type(g).__module__, np.array_equal(g, np.stack(inputs)))
    w = pg.all_gather(x, async_op=True)
    out["all_gather async"] = np.array_equal(w.wait(timeout=30), np.stack(inputs))

    rs = pg.reduce_scatter(x, out=np.empty(N, np.float32))
    want = np.sum(np.stack(inputs), axis=0, dtype=np.float32)[r * N:(r + 1) * N]
    out["reduce_scatter"] = bool(np.allclose(rs, want, rtol=1e-5, atol=1e-5))

    a2a = pg.all_to_all(x, out=np.empty(N * n, np.float32))
    out["all_to_all"] = np.array_equal(a2a, np.concatenate([inputs[k][r * N:(r + 1) * N]
                                                            for k in range(n)]))

    v, counts = pg.all_gather_v(x[: N + r])  # a slice of a JAX array is a JAX array
    out["all_gather_v"] = (counts == [N + k for k in range(n)] and np.array_equal(
        v, np.concatenate([inputs[k][: N + k] for k in range(n)])))

    got = pg.gather(x, dst=0)
    out["gather"] = np.array_equal(got, np.stack(inputs)) if r == 0 else got is None

    if r == 0:
        pg.send(x, 1, tag=3)
    elif r == 1:
        buf = pg.recv(np.empty(N * n, np.float32), 0, tag=3)
        out["send/recv"] = np.array_equal(buf, inputs[0])

    b = jnp.asarray(np.arange(17, dtype=np.float32) + r).astype(jnp.bfloat16)
    gb = pg.all_gather(b)
    out["all_gather bfloat16"] = (str(gb.dtype) == "bfloat16" and np.array_equal(
        gb.astype(np.float32), np.stack([np.arange(17, dtype=np.float32) + k
                                         for k in range(n)])))

    # The way to reduce JAX data: a writable numpy copy, and back into JAX.
    y = np.array(x)
    pg.all_reduce(y)
    back = jnp.asarray(y)
    out["all_reduce of a copy"] = bool(np.allclose(
        np.asarray(back), np.sum(np.stack(inputs), axis=0, dtype=np.float32),
        rtol=1e-5, atol=1e-5))

    before = np.asarray(x).copy()
    said = {}
    for label, call in (("all_reduce", lambda: pg.all_reduce(x)),
                        ("all_reduce async", lambda: pg.all_reduce(x, async_op=True)),
                        ("broadcast", lambda: pg.broadcast(x, 0)),
                        ("reduce", lambda: pg.reduce(x, 0)),
                        ("recv", lambda: pg.recv(x, (r + 1) % n)),
                        ("all_gather out=", lambda: pg.all_gather(x, out=jnp.zeros((n, N * n))))):
        try:
            call()
            said[label] = "no error"
        except ValueError as e:
            said[label] = "immutable" in str(e)
    out["never written"] = said
    out["unchanged"] = bool(np.array_equal(np.asarray(x), before))
    # The group is still usable: the refusals happened before anything was sent.
    z = np.full(5, r + 1.0)
    pg.all_reduce(z)
    out["after"] = z.tolist() == [n * (n + 1) / 2] * 5
    return out


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_jax_cpu_arrays(run_ranks, transport):
    for rank, res in enumerate(run_ranks(2, _body, transport=transport,
                                         env={"JAX_PLATFORMS": "cpu"})):
        said = res.pop("never written")
        assert said == {k: True for k in said}, (rank, said)
        assert res.pop("all_gather") == ("numpy", True)
        assert res == {k: True for k in res}, (rank, res)


def _deleted(pg):
    import jax
    import jax.numpy as jnp
    jax.config.update("jax_platforms", "cpu")
    n = pg.size
    gone = jnp.ones(4 * n, jnp.float32)
    gone.delete()
    donated = jnp.ones(4 * n, jnp.float32)
    jax.jit(lambda a: a * 2, donate_argnums=0)(donated)
    said = {}
    for kind, x in (("deleted", gone), ("donated", donated)):
        if not x.is_deleted():  # a JAX that keeps donated CPU buffers: nothing to test
            continue
        for name, call in (("all_gather", lambda: pg.all_gather(x)),
                           ("all_gather_v", lambda: pg.all_gather_v(x)),
                           ("reduce_scatter", lambda: pg.reduce_scatter(x)),
                           ("all_to_all", lambda: pg.all_to_all(x)),
                           ("gather", lambda: pg.gather(x, 0)),
                           ("send", lambda: pg.send(x, (pg.rank + 1) % n))):
            try:
                call()
                said[f"{kind} {name}"] = "no error"
            except ValueError as e:
                ok = f"{name}: x: the JAX array was deleted" in str(e)
                said[f"{kind} {name}"] = True if ok else str(e)
            except Exception as e:  # noqa: BLE001 - the class is what is checked
                said[f"{kind} {name}"] = f"{type(e).__name__}: {e}"
    z = np.full(3, pg.rank + 1.0)  # nothing was sent: the group works
    pg.all_reduce(z)
    said["after"] = z.tolist() == [n * (n + 1) / 2] * 3
    return said


def test_a_deleted_or_donated_jax_array_is_a_value_error_that_says_so(run_ranks):
    for rank, said in enumerate(run_ranks(2, _deleted, transport="tcp",
                                          env={"JAX_PLATFORMS": "cpu"})):
        assert "deleted all_gather" in said, said
        assert said == {k: True for k in said}, (rank, said)
