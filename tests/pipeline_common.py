"""The pipeline tests' model, shared by the CPU (tests/python/test_pipeline.py) and GPU
(tests/gpu/test_pipeline_gpu.py) runs: a chain of affine stages with small integer weights,
inputs and a linear loss (loss = sum(y * target), so dloss/dy = target): every value is a
small integer, float64 holds it exactly, and the pipelined gradients must equal the
one-process, full-batch gradients bit for bit whatever order the schedule accumulates
microbatches in. The stage works on numpy arrays and torch tensors alike."""

import numpy as np

from meshcoll.pipeline.executor import ArraySpec, PipelineExecutor
from meshcoll.pipeline.schedule import make_schedule

ROWS = 3  # rows per microbatch; odd on purpose


def _widths(num_stages):
    return [2 + (s % 3) for s in range(num_stages + 1)]  # uneven boundaries: 2, 3, 4, 2, ...


def _params(num_stages):
    rng = np.random.default_rng(7)
    w = _widths(num_stages)
    return [(rng.integers(-1, 2, (w[s], w[s + 1])).astype(np.float64),
             rng.integers(-1, 2, w[s + 1]).astype(np.float64)) for s in range(num_stages)]


def _data(num_stages, m):
    rng = np.random.default_rng(11)
    w = _widths(num_stages)
    xs = [rng.integers(-2, 3, (ROWS, w[0])).astype(np.float64) for _ in range(m)]
    ts = [rng.integers(-2, 3, (ROWS, w[-1])).astype(np.float64) for _ in range(m)]
    return xs, ts


def linear_loss(y, target):
    return float((y * target).sum()), target + 0  # + 0: a copy in numpy and torch


class Affine:
    """y = x @ w + b; implements backward and the split backward_input / backward_weight."""

    def __init__(self, w, b):
        self.w, self.b = w + 0, b + 0  # copies; numpy or torch alike
        self.dw, self.db = w * 0, b * 0
        self.saved, self.pending = {}, {}
        self.calls = []

    def forward(self, mb, x):
        self.calls.append(("F", mb))
        self.saved[mb] = x + 0
        self.peak_saved = max(getattr(self, "peak_saved", 0), len(self.saved))
        return x @ self.w + self.b

    def drop(self, mb):
        """Activation checkpointing: forget what forward kept for mb."""
        del self.saved[mb]

    def backward_input(self, mb, grad_y):
        self.calls.append(("I", mb))
        self.pending[mb] = grad_y + 0
        return grad_y @ self.w.T

    def backward_weight(self, mb):
        self.calls.append(("W", mb))
        x, g = self.saved.pop(mb), self.pending.pop(mb)
        self.dw += x.T @ g
        self.db += g.sum(axis=0)

    def backward(self, mb, grad_y):
        grad_x = self.backward_input(mb, grad_y)
        self.backward_weight(mb)
        self.calls[-2:] = [("B", mb)]
        return grad_x


def reference(num_stages, m):
    """Full-batch gradients and per-microbatch losses, one process."""
    params = _params(num_stages)
    xs, ts = _data(num_stages, m)
    acts = [np.concatenate(xs)]
    for w, b in params:
        acts.append(acts[-1] @ w + b)
    target = np.concatenate(ts)
    losses = [float(np.sum(y * t)) for y, t in zip(np.split(acts[-1], m), ts)]
    g, grads = target, []
    for s in reversed(range(num_stages)):
        w, _ = params[s]
        grads.append((acts[s].T @ g, g.sum(axis=0)))
        g = g @ w.T
    return grads[::-1], losses


def _host(a):
    return a.cpu().numpy() if hasattr(a, "cpu") else a


def train_body(pg, name, virtual_stages, microbatches, steps, device=None):
    """Train ``steps`` steps of the affine chain through a PipelineExecutor over ``pg`` and
    check gradients, losses and the calls each stage got against one process. ``device``
    (a torch device) runs it on GPU tensors instead of numpy arrays."""
    num_stages = pg.size * virtual_stages
    schedule = make_schedule(name, num_stages, microbatches, virtual_stages)
    to, dtype, empty = lambda a: a, np.float64, None
    if device is not None:
        import torch
        to, dtype = (lambda a: torch.from_numpy(a).to(device)), torch.float64
        empty = lambda shape, dt: torch.empty(shape, dtype=dt, device=device)  # noqa: E731
    params = _params(num_stages)
    stages = {s: Affine(to(params[s][0]), to(params[s][1])) for s in schedule.stages_of(pg.rank)}
    widths = _widths(num_stages)
    specs = [ArraySpec((ROWS, widths[s + 1]), dtype) for s in range(num_stages - 1)]
    ex = PipelineExecutor(schedule, stages, pg, specs=specs, loss_fn=linear_loss, timeout=60.0,
                          empty=empty)
    xs, ts = _data(num_stages, microbatches)
    xs, ts = [to(x) for x in xs], [to(t) for t in ts]
    expected_grads, expected_losses = reference(num_stages, microbatches)

    for step in range(steps):
        # Only the first and the last stage's ranks need inputs / targets.
        losses = ex.step(inputs=xs if 0 in stages else None,
                         targets=ts if num_stages - 1 in stages else None)
        if num_stages - 1 in stages:
            assert losses == expected_losses
        else:
            assert losses is None
        for s, st in stages.items():
            # Gradients accumulate across steps until the caller zeroes them.
            np.testing.assert_array_equal(_host(st.dw), (step + 1) * expected_grads[s][0], err_msg=f"stage {s}")
            np.testing.assert_array_equal(_host(st.db), (step + 1) * expected_grads[s][1], err_msg=f"stage {s}")
            assert not st.saved and not st.pending, f"stage {s} kept state for {sorted(st.saved)}"

    # Each stage ran exactly the compute the schedule lists for it, in order.
    for s, st in stages.items():
        listed = [(a.kind.value, a.microbatch) for a in schedule.compute_actions(pg.rank) if a.stage == s]
        assert st.calls == listed * steps


