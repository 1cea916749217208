"""What the PyTorch DataParallel tests share (CPU: tests/python/test_torch_adapter.py, GPU:
tests/gpu/test_ddp_gpu.py): a small MLP, a fixed synthetic data set, one-process full-batch
training as the reference, and the same training as N ranks through
meshcoll.torch.DistributedDataParallel. torch is imported by the callers' modules."""

from __future__ import annotations

import contextlib

import numpy as np
import torch


def model(seed):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Linear(16, 16),
                               torch.nn.ReLU(), torch.nn.Linear(16, 3))


def data(n):
    g = torch.Generator().manual_seed(1)
    return torch.randn(n, 6, generator=g), torch.randint(0, 3, (n,), generator=g)


def reference(accum, *, batch, steps, lr):
    """One process on the CPU, the whole (accumulated) batch of each step."""
    net = model(0)
    x, y = data(batch * steps * accum)
    opt = torch.optim.SGD(net.parameters(), lr=lr)
    for s in range(steps):
        idx = slice(s * batch * accum, (s + 1) * batch * accum)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(net(x[idx]), y[idx]).backward()
        opt.step()
    return {n: p.detach().numpy().copy() for n, p in net.named_parameters()}


def train(pg, accum, *, batch, steps, lr, device="cpu", set_to_none=True, **ddp_kw):
    """The same training over ``pg``: each rank takes its numpy.array_split shard of every
    microbatch, ``accum`` microbatches per step (all but the last under no_sync()). Every
    rank starts from other weights, so the construction broadcast must equalise them.
    ``set_to_none``: the optimizer's zero_grad drops the gradients (torch's default) or
    zeroes them in place. Returns (parameters as numpy, stats, bucket names, whether every
    p.grad lies in DataParallel's buckets at the end)."""
    import meshcoll.torch as mt
    net = mt.DistributedDataParallel(model(pg.rank).to(device), group=pg,
                                     bucket_cap_mb=250 / 2**20, **ddp_kw)  # 3 buckets
    x, y = data(batch * steps * accum)
    x, y = x.to(device), y.to(device)
    opt = torch.optim.SGD(net.parameters(), lr=lr)
    first_buckets = 0
    for s in range(steps):
        if s == 1:  # the adapter lays its buckets out again after the first step
            first_buckets = len(net.ddp.bucket_names)
        opt.zero_grad(set_to_none=set_to_none)
        idx = np.arange(s * batch * accum, (s + 1) * batch * accum)
        for m, micro in enumerate(np.array_split(idx, accum)):
            shard = torch.as_tensor(np.array_split(micro, pg.size)[pg.rank], device=device)
            ctx = net.no_sync() if m < accum - 1 else contextlib.nullcontext()
            with ctx:
                # Scaled so the group average is the mean over the whole accumulated batch.
                loss = torch.nn.functional.cross_entropy(net(x[shard]), y[shard], reduction="sum")
                (loss * pg.size / len(idx)).backward()
        opt.step()
    stats, buckets = dict(net.stats(), first_step_buckets=first_buckets), net.ddp.bucket_names
    in_buckets = all(_shares(p.grad, net.ddp.gradient_buffer(n))
                     for n, p in net.module.named_parameters())
    net.close()
    return ({n: p.detach().cpu().numpy() for n, p in net.module.named_parameters()},
            stats, buckets, in_buckets)


def _shares(t, buf):
    ptr = buf.data_ptr() if isinstance(buf, torch.Tensor) else buf.__array_interface__["data"][0]
    return t.data_ptr() == ptr


def max_rel(a, b):
    return max(float(np.abs(a[n] - b[n]).max() / np.abs(b[n]).max()) for n in b)


def join_reference(world, lr):
    """What join() trains (Note [Uneven inputs]): rank r has 2 + r batches of
    Linear(4, 3)(x).pow(2).sum(); each step applies the stepping ranks' gradients summed over
    the whole group's size. Returns the model."""
    torch.manual_seed(0)
    ref = torch.nn.Linear(4, 3)
    for s in range(2 + world - 1):
        total = [torch.zeros_like(p) for p in ref.parameters()]
        for r in range(world):
            if s < 2 + r:
                ref.zero_grad()
                x = torch.as_tensor(np.random.default_rng([s, r]).standard_normal((2, 4)),
                                    dtype=torch.float32)
                ref(x).pow(2).sum().backward()
                total = [g + p.grad for g, p in zip(total, ref.parameters())]
        with torch.no_grad():
            for p, g in zip(ref.parameters(), total):
                p -= lr * g / world
    return ref
