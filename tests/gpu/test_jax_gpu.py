"""JAX GPU arrays on the NCCL backend (issue 18 item 6): JAX arrays are read through DLPack
as inputs, results go into PyTorch tensors (out=), checked against numpy on random data.
The read-only rule itself (a JAX array is never written) is test_nccl.py's
test_jax_arrays_are_never_written; here the inputs are fresh results of JAX computations,
so the exchange must also order NCCL after JAX's own stream (the DLPack stream handshake)."""

from __future__ import annotations

import numpy as np
import pytest

from test_nccl import gpus, needs_torch, run_nccl

N = 4099  # odd: not a multiple of any vector width


def _jax_inputs(pg):
    import jax
    import jax.numpy as jnp
    import torch
    r, n = pg.rank, pg.size
    dev = next(d for d in jax.devices() if d.platform == "gpu"
               and jax.device_put(jnp.zeros(1), d).__dlpack_device__()[1] == pg.device)
    host = [np.random.default_rng([23, k]).standard_normal(N * n).astype(np.float32)
            for k in range(n)]
    # A JAX computation, not a copy: its result may still be in flight on JAX's stream.
    x = jax.jit(lambda a: a * 2.0 + 1.0)(jax.device_put(host[r], dev))
    want = [h * 2.0 + 1.0 for h in host]
    t = torch.device("cuda", pg.device)
    res = {}

    g = pg.all_gather(x, out=torch.empty((n, N * n), device=t))
    rs = pg.reduce_scatter(x, out=torch.empty(N, device=t))
    a2a = pg.all_to_all(x, out=torch.empty(N * n, device=t))
    w = pg.all_gather(x[:N], out=torch.empty((n, N), device=t), async_op=True)
    w.wait()
    if r == 0:
        pg.send(x, 1)
    got = pg.recv(torch.empty(N * n, device=t), 0) if r == 1 else None
    b = jnp.asarray(np.arange(33, dtype=np.float32) + r, dtype=jnp.bfloat16)
    b = jax.device_put(b, dev)
    gb = pg.all_gather(b, out=torch.empty((n, 33), dtype=torch.bfloat16, device=t))
    torch.cuda.synchronize(t)

    stacked = np.stack(want)
    res["all_gather"] = np.array_equal(g.cpu().numpy(), stacked)
    red = np.sum(stacked, axis=0, dtype=np.float64)[r * N:(r + 1) * N]
    res["reduce_scatter"] = bool(np.allclose(rs.cpu().numpy(), red, rtol=1e-5, atol=1e-4))
    res["all_to_all"] = np.array_equal(a2a.cpu().numpy(), np.concatenate(
        [want[k][r * N:(r + 1) * N] for k in range(n)]))
    res["all_gather async"] = np.array_equal(w.wait().cpu().numpy(), stacked[:, :N])
    res["send/recv"] = True if r != 1 else np.array_equal(got.cpu().numpy(), want[0])
    gbv = gb.float().cpu().numpy()
    ok = np.array_equal(gbv, np.stack([np.arange(33, dtype=np.float32) + k for k in range(n)]))
    res["bfloat16"] = True if ok else gbv[:, :6].tolist()  # what came, on a failure
    # Without out=, an NCCL group cannot make a JAX array for the result: it says so.
    try:
        pg.all_gather(x)
        res["no out="] = "no error"
    except TypeError as e:
        res["no out="] = "out=" in str(e) and "JAX" in str(e)
    # The results taken back into JAX without a copy.
    with torch.cuda.device(t):  # torch exports a tensor only from its own current device
        back = jax.numpy.from_dlpack(g)
    res["from_dlpack"] = np.array_equal(np.asarray(back), stacked)
    return res


@needs_torch
@gpus(2)
def test_jax_gpu_arrays_as_inputs_results_in_torch():
    pytest.importorskip("jax")
    for rank, res in enumerate(run_nccl(2, _jax_inputs,
                                        env={"XLA_PYTHON_CLIENT_PREALLOCATE": "false"})):
        assert res == {k: True for k in res}, (rank, res)
