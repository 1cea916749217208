"""Tier 2: PipelineExecutor over real processes (the `run_ranks` fixture).

The model (tests/pipeline_common.py) is a chain of affine stages with small
integer values, so the pipelined gradients must equal the one-process,
full-batch gradients bit for bit whatever order the schedule accumulates
microbatches in.
"""

import numpy as np
import pytest

from meshcoll.pipeline.executor import ArraySpec, PipelineExecutor
from meshcoll.pipeline.schedule import make_schedule
from pipeline_common import ROWS, Affine as _Affine, linear_loss as _linear_loss, train_body as _train_body

pytestmark = pytest.mark.timeout(120)

def _configs(world):
    """(schedule, virtual_stages, microbatches) run on `world` ranks; m odd where allowed."""
    yield from [("gpipe", 1, 5), ("1f1b", 1, 5), ("zero_bubble", 1, 5), ("1f1b", 1, 1),
                ("zero_bubble", 1, 2)]
    for v in (2, 3):
        yield "interleaved_1f1b", v, 2 * world  # Megatron's m % p == 0
        yield "interleaved_zero_bubble", v, 2 * world
    yield "interleaved_zero_bubble", 2, 3 if 3 % max(1, 3 // world) == 0 else 2 * world
    # The V schedules: two stages per rank, the first and the last on rank 0.
    yield from [("zero_bubble_v", 2, 5), ("zero_bubble_v", 2, 1), ("dualpipe_v", 2, 2 * world + 1)]


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


@pytest.mark.parametrize("schedule_name,virtual_stages", [("1f1b", 1), ("interleaved_1f1b", 2),
                                                          ("dualpipe_v", 2)])
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


def _checkpoint_body(pg, name, checkpoint):
    """The affine chain with every stage checkpointed: the same gradients and losses, each
    stage's forward run twice per microbatch, and at most one microbatch's state kept."""
    from pipeline_common import _data, _params, _widths, reference
    m, num_stages = 4, pg.size
    schedule = make_schedule(name, num_stages, m)
    params = _params(num_stages)
    stages = {s: _Affine(*params[s]) for s in schedule.stages_of(pg.rank)}
    specs = [ArraySpec((ROWS, _widths(num_stages)[s + 1]), np.float64)
             for s in range(num_stages - 1)]
    ex = PipelineExecutor(schedule, stages, pg, specs=specs, loss_fn=_linear_loss, timeout=60.0,
                          checkpoint=checkpoint)
    xs, ts = _data(num_stages, m)
    losses = ex.step(inputs=xs, targets=ts)
    grads, want_losses = reference(num_stages, m)
    for s, st in stages.items():
        np.testing.assert_array_equal(st.dw, grads[s][0])
        np.testing.assert_array_equal(st.db, grads[s][1])
    if losses is not None:
        assert losses == want_losses
    return {s: (st.peak_saved, sum(c[0] == "F" for c in st.calls)) for s, st in stages.items()}


@pytest.mark.parametrize("name", ["1f1b", "zero_bubble"])
def test_checkpointed_stages_recompute_their_forward_and_keep_one_microbatch(run_ranks, name):
    for res in run_ranks(2, _checkpoint_body, name=name, checkpoint=True):
        for s, (peak, forwards) in res.items():
            assert forwards == 2 * 4, (s, forwards)
            # Zero bubble's deferred W needs the state from its I on: only 1F1B's is one.
            assert peak == 1 or name == "zero_bubble", (s, peak)
    # Without it the first stage of 1F1B keeps the state of 2 microbatches in flight.
    res = run_ranks(2, _checkpoint_body, name="1f1b", checkpoint=False)
    assert res[0][0] == (2, 4), res


def test_checkpoint_needs_drop():
    class NoDrop:
        def forward(self, mb, x):
            return x

        def backward(self, mb, g):
            return g
    with pytest.raises(TypeError, match=r"checkpoint: stage 0 needs drop\(mb\)"):
        PipelineExecutor(make_schedule("1f1b", 2, 1), {0: NoDrop()}, _NoCommGroup(),
                         specs=ArraySpec((ROWS, 3), np.float64), checkpoint=True)
