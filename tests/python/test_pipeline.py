"""Tier 2: PipelineExecutor over real processes (the `run_ranks` fixture).

The model is a chain of affine stages with small integer weights, inputs and
a linear loss (loss = sum(y * target), so dloss/dy = target): every value is a
small integer, float64 holds it exactly, and the pipelined gradients must
equal the one-process, full-batch gradients bit for bit whatever order the
schedule accumulates microbatches in.
"""

import numpy as np
import pytest

from meshcoll.pipeline.executor import ArraySpec, PipelineExecutor
from meshcoll.pipeline.schedule import make_schedule

pytestmark = pytest.mark.timeout(120)

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


def _linear_loss(y, target):
    return float(np.sum(y * target)), target.copy()


class _Affine:
    """y = x @ w + b; implements backward and the split backward_input / backward_weight."""

    def __init__(self, w, b):
        self.w, self.b = w.copy(), b.copy()
        self.dw, self.db = np.zeros_like(w), np.zeros_like(b)
        self.saved, self.pending = {}, {}
        self.calls = []

    def forward(self, mb, x):
        self.calls.append(("F", mb))
        self.saved[mb] = np.array(x, copy=True)
        return x @ self.w + self.b

    def backward_input(self, mb, grad_y):
        self.calls.append(("I", mb))
        self.pending[mb] = np.array(grad_y, copy=True)
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


def _reference(num_stages, m):
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


def _train_body(pg, name, virtual_stages, microbatches, steps):
    num_stages = pg.size * virtual_stages
    schedule = make_schedule(name, num_stages, microbatches, virtual_stages)
    params = _params(num_stages)
    stages = {s: _Affine(*params[s]) for s in schedule.stages_of(pg.rank)}
    widths = _widths(num_stages)
    specs = [ArraySpec((ROWS, widths[s + 1]), np.float64) for s in range(num_stages - 1)]
    ex = PipelineExecutor(schedule, stages, pg, specs=specs, loss_fn=_linear_loss, timeout=60.0)
    xs, ts = _data(num_stages, microbatches)
    expected_grads, expected_losses = _reference(num_stages, microbatches)

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
            np.testing.assert_array_equal(st.dw, (step + 1) * expected_grads[s][0], err_msg=f"stage {s}")
            np.testing.assert_array_equal(st.db, (step + 1) * expected_grads[s][1], err_msg=f"stage {s}")
            assert not st.saved and not st.pending, f"stage {s} kept state for {sorted(st.saved)}"

    # Each stage ran exactly the compute the schedule lists for it, in order.
    for s, st in stages.items():
        listed = [(a.kind.value, a.microbatch) for a in schedule.compute_actions(pg.rank) if a.stage == s]
        assert st.calls == listed * steps


def _configs(world):
    """(schedule, virtual_stages, microbatches) run on `world` ranks; m odd where allowed."""
    yield from [("gpipe", 1, 5), ("1f1b", 1, 5), ("zero_bubble", 1, 5), ("1f1b", 1, 1),
                ("zero_bubble", 1, 2)]
    for v in (2, 3):
        yield "interleaved_1f1b", v, 2 * world  # Megatron's m % p == 0


def _all_schedules_body(pg):
    # One launch runs every configuration: spawning ranks costs more than the
    # pipelines themselves. Failures name the configuration.
    for name, v, m in _configs(pg.size):
        try:
            _train_body(pg, name, v, m, steps=2)
        except Exception as e:
            raise AssertionError(f"{name} virtual_stages={v} microbatches={m} on {pg.size} ranks: "
                                 f"{type(e).__name__}: {e}") from e


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_every_schedule_matches_full_batch(run_ranks, world):
    run_ranks(world, _all_schedules_body)


def _example_body(pg, schedule_name, virtual_stages):
    from meshcoll.examples.pipeline import TOLERANCE, run

    diff = run(pg, schedule_name, virtual_stages=virtual_stages, steps=3, microbatches=8, verbose=False)
    assert diff <= TOLERANCE


@pytest.mark.parametrize("schedule_name,virtual_stages", [("1f1b", 1), ("interleaved_1f1b", 2)])
def test_example_matches_one_process_training(run_ranks, schedule_name, virtual_stages):
    run_ranks(4, _example_body, schedule_name=schedule_name, virtual_stages=virtual_stages)


def _construction_errors_body(pg):
    sched = make_schedule("1f1b", 3, 2)
    with pytest.raises(ValueError, match="schedule has 3 ranks but the group has 2"):
        PipelineExecutor(sched, {pg.rank: _Affine(np.eye(2), np.zeros(2))}, pg)

    sched = make_schedule("interleaved_1f1b", 4, 2, virtual_stages=2)
    with pytest.raises(ValueError, match=rf"rank {pg.rank} owns stages \[{pg.rank}, {pg.rank + 2}\]"):
        PipelineExecutor(sched, {pg.rank: _Affine(np.eye(2), np.zeros(2))}, pg,
                         specs=ArraySpec((ROWS, 2), np.float64), loss_fn=_linear_loss)

    class Unsplit:
        def forward(self, mb, x):
            return x

        def backward(self, mb, g):
            return g

    with pytest.raises(TypeError, match="stage .* needs backward_input and backward_weight"):
        PipelineExecutor(make_schedule("zero_bubble", 2, 2), {pg.rank: Unsplit()}, pg,
                         specs=ArraySpec((ROWS, 2), np.float64), loss_fn=_linear_loss)

    with pytest.raises(ValueError, match="specs .* is required"):
        PipelineExecutor(make_schedule("1f1b", 2, 2), {pg.rank: Unsplit()}, pg, loss_fn=_linear_loss)


def test_construction_errors(run_ranks):
    run_ranks(2, _construction_errors_body)


class _NoCommGroup:
    """Rank 0 of 2; fails the test if the executor tries to communicate."""

    rank, size = 0, 2

    def isend(self, *a, **k):
        raise AssertionError("must not send an array that does not match its spec")

    def irecv(self, *a, **k):
        return self  # rank 0 posts the receive for 0B0 early; it is never waited on here

    def wait(self, timeout=None):
        raise AssertionError("the step must fail before waiting on anything")


def test_activation_not_matching_spec_is_named():
    # Checked before anything is sent, so no process is needed to see it.
    stage = _Affine(np.ones((2, 4)), np.zeros(4))  # produces (ROWS, 4); the spec says (ROWS, 3)
    ex = PipelineExecutor(make_schedule("1f1b", 2, 1), {0: stage}, _NoCommGroup(),
                          specs=ArraySpec((ROWS, 3), np.float64))
    with pytest.raises(ValueError, match=r"stage 0 microbatch 0 produced an activation of shape \(3, 4\) "
                                         r"float64; boundary 0 is declared \(3, 3\) float64"):
        ex.step(inputs=[np.zeros((ROWS, 2))])
