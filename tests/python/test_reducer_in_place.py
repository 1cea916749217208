"""The reducer on shared memory averages large gradients where they were given (Note [In-place
gradients] in csrc/reducer/reducer.h): no copies into and out of the buckets, the same
averages as a numpy reference, and a clear error on every rank for gradients that share
memory across buckets."""

from __future__ import annotations

import numpy as np
import pytest

pytestmark = pytest.mark.timeout(120)

# name -> elements. w* are at least 256 KiB (averaged in place), b* smaller (copied).
SIZES = {"w1": 70_000, "b1": 16, "b1x": 24, "w2": 100_000, "b2": 8, "w3": 65_536}
SMALL = ("b1", "b1x", "b2")
CAP_MB = 0.3  # a bucket closes once it holds 0.3 MiB: [w3 b2 w2] [b1x b1 w1]
STEPS = 3


def _grad(rank, step, name):
    rng = np.random.default_rng([rank, step, len(name), SIZES[name]])
    return (rng.standard_normal(SIZES[name]) + 0.5).astype(np.float32)


def _steps(pg, buffers=False):
    """``buffers``: each gradient written into its gradient_buffer (the bucket's own memory)
    and handed over as that buffer, where its average must end."""
    from meshcoll.ddp import DataParallel
    params = {n: np.zeros(c, np.float32) for n, c in SIZES.items()}
    ddp = DataParallel(params, group=pg, bucket_cap_mb=CAP_MB)
    buckets = ddp.bucket_names
    got = []
    for step in range(STEPS):
        grads = {n: _grad(pg.rank, step, n) for n in SIZES}
        if buffers:
            for n in SIZES:
                ddp.gradient_buffer(n)[...] = grads[n]
                grads[n] = ddp.gradient_buffer(n)
        for b in buckets:
            for n in b:
                ddp.grad_ready(n, grads[n])
        ddp.wait()
        got.append({n: np.array(g) for n, g in grads.items()})
    stats = ddp.stats()
    ddp.close()
    return got, stats, buckets


@pytest.mark.parametrize("transport,buffers", [("shm", False), ("shm", True), ("tcp", False)])
def test_large_gradients_are_averaged_in_place(run_ranks, transport, buffers):
    world = 2
    results = run_ranks(world, _steps, transport=transport, buffers=buffers)
    # Over TCP buckets stay one call each, every gradient copied in and out. On shared
    # memory the small ones are averaged together, copied into one buffer and back (also
    # from and to their gradient buffers); the large ones in place, or in their buffers.
    small_bytes = sum(4 * SIZES[n] for n in (SMALL if transport == "shm" else SIZES))
    for got, stats, buckets in results:
        assert len(buckets) > 1, buckets
        for step, grads in enumerate(got):
            for n in SIZES:
                # Two ranks: (a + b) / 2 in float32 is exact to the bit either way.
                want = (_grad(0, step, n) + _grad(1, step, n)) / np.float32(2)
                np.testing.assert_array_equal(grads[n], want, err_msg=f"{n} step {step}")
        # Only the small gradients went through the buckets (shm): in and out, every step.
        assert stats["copied_bytes"] == 2 * small_bytes * STEPS, stats
        assert stats["calls"] == len(buckets) * STEPS, stats


def _shared(pg):
    from meshcoll.ddp import DataParallel
    params = {n: np.zeros(c, np.float32) for n, c in (("a", 70_000), ("b", 70_000))}
    ddp = DataParallel(params, group=pg, bucket_cap_mb=0.1)  # one bucket each
    assert len(ddp.bucket_names) == 2, ddp.bucket_names
    first, second = ddp.bucket_names[0][0], ddp.bucket_names[1][0]
    g = np.ones(70_000, np.float32)
    try:
        ddp.grad_ready(first, g)   # its bucket is launched, g averaged in place
        ddp.grad_ready(second, g)  # the same memory, read after it changed
        ddp.wait()
    except Exception as e:  # noqa: BLE001 - the test looks at the message
        return f"{type(e).__name__}: {e}"
    return "no error"


def test_gradients_sharing_memory_across_buckets_fail_every_rank(run_ranks):
    for r, msg in enumerate(run_ranks(2, _shared)):
        assert "shares memory with the gradient of" in msg, (r, msg)
