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


# Bucket views with torch's zero_grad(set_to_none=True): autograd hands each step's gradient
# over as a fresh tensor, and its average must land in the bucket slot (p.grad then becomes
# the slot's view). A large one is all-reduced straight from that tensor into its slot, with
# no copy into the slot first (Note [In-place gradients]).
WIDTH, LAYERS, BATCH = 256, 3, 8  # weights of 256 KiB: large; biases of 1 KiB: small


def _views_step(pg, cma):
    import torch
    import meshcoll.torch as mt
    torch.set_num_threads(1)
    torch.manual_seed(0)
    net = torch.nn.Sequential(*[m for _ in range(LAYERS)
                                for m in (torch.nn.Linear(WIDTH, WIDTH), torch.nn.Tanh())])
    ref = [p.detach().clone() for p in net.parameters()]  # the same model, without meshcoll
    ref_opt = torch.optim.SGD(ref, lr=0.1)
    model = mt.DistributedDataParallel(net, group=pg, gradient_as_bucket_view=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    failures = []

    def batch(rank, step):
        rng = np.random.default_rng([rank, step])
        return (torch.from_numpy(rng.standard_normal((BATCH, WIDTH)).astype(np.float32)),
                torch.from_numpy(rng.standard_normal((BATCH, WIDTH)).astype(np.float32)))

    def loss(params, x, y):  # net's forward and loss, on other parameters
        for k in range(LAYERS):
            x = torch.tanh(torch.nn.functional.linear(x, params[2 * k], params[2 * k + 1]))
        return torch.nn.functional.mse_loss(x, y)

    for step in range(STEPS):
        opt.zero_grad()  # set_to_none=True: the next backward makes fresh gradients
        x, y = batch(pg.rank, step)
        torch.nn.functional.mse_loss(model(x), y).backward()
        # Reference: each rank's gradient by plain autograd, averaged in numpy.
        grads = []
        for r in range(pg.size):
            leaves = [p.clone().requires_grad_() for p in ref]
            grads.append([g.numpy() for g in torch.autograd.grad(loss(leaves, *batch(r, step)),
                                                                 leaves)])
        for k, (name, p) in enumerate(model.module.named_parameters()):
            want = (grads[0][k] + grads[1][k]) / np.float32(2)  # exact in float32 on 2 ranks
            if not np.array_equal(p.grad.numpy(), want):
                failures.append(f"step {step} {name}: max diff "
                                f"{np.abs(p.grad.numpy() - want).max()}")
            if p.grad.data_ptr() != model.ddp._reducer.slot_address(k):
                failures.append(f"step {step} {name}: p.grad is not its bucket view")
            ref[k].grad = torch.from_numpy(want)
        opt.step()
        ref_opt.step()
    for (name, p), q in zip(model.module.named_parameters(), ref):
        if not torch.equal(p.detach(), q):
            failures.append(f"{name}: parameters differ from the reference after {STEPS} steps")
    stats = model.stats()
    model.close()
    return failures, stats


@pytest.mark.parametrize("cma", ["1", "0"])  # single copy; through the data areas
def test_fresh_gradients_are_averaged_into_their_bucket_views_without_copies(run_ranks, cma):
    pytest.importorskip("torch")
    small_bytes = LAYERS * WIDTH * 4  # the biases
    for failures, stats in run_ranks(2, _views_step, transport="shm", cma=cma, timeout=110,
                                     init_timeout=90, env={"MESHCOLL_CMA": cma,
                                                           "OMP_NUM_THREADS": "1"}):
        assert not failures, failures
        # Only the small gradients go through a buffer: copied in and out, every step.
        assert stats["copied_bytes"] == 2 * small_bytes * STEPS, stats


def _lifetimes(pg):
    """Whether the fresh gradient autograd made for the first layer's weight in step 2 is
    alive after that step, and after the next one's backward (with their next one's)."""
    import weakref
    import torch
    import meshcoll.torch as mt
    torch.set_num_threads(1)
    torch.manual_seed(0)
    net = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)])
    seen = []
    # Registered before the wrapper's hook, so it runs first and sees autograd's own tensor.
    net[0].weight.register_post_accumulate_grad_hook(lambda p: seen.append(weakref.ref(p.grad)))
    model = mt.DistributedDataParallel(net, group=pg, gradient_as_bucket_view=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(BATCH, WIDTH)
    alive = []
    for step in range(4):  # steps 0 and 1 set up and rebuild the buckets
        opt.zero_grad()  # set_to_none=True: a fresh gradient in every backward
        model(x).square().mean().backward()
        if step >= 2:
            alive.append([r() is not None for r in seen[2:]])
        opt.step()
    model.close()
    return alive


def test_fresh_gradients_live_until_their_parameters_next_one(run_ranks):
    # Note [Fresh gradients with views] in python/meshcoll/torch.py: on the CPU each is
    # released when the next one arrives (then reused for it), not with all the others at the
    # step's end (the memory went back to the system, and the next backward faulted it in).
    pytest.importorskip("torch")
    for alive in run_ranks(2, _lifetimes, transport="shm", timeout=110, init_timeout=90,
                           env={"OMP_NUM_THREADS": "1"}):
        assert alive == [[True], [False, True]], alive
