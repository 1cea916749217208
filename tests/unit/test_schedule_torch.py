"""Tier 1: meshcoll's schedules against torch.distributed.pipelining, order for order.

torch computes every rank's order when a schedule object is built, so one process
with torch's in-process "fake" process group (no communication) yields them all.
Runs when torch is installed (the ``[torch]`` extra), skips otherwise.

Where the two differ by construction it is said here: DualPipeV's OVERLAP_F_B is
one torch action holding a forward and a full backward of different chunks;
meshcoll has no intra-stage overlap and runs the two halves in torch's order, F
then B, so it is compared flattened.
"""

import pytest

from meshcoll.pipeline.schedule import make_schedule

pytestmark = pytest.mark.timeout(120)

torch = pytest.importorskip("torch")
pipelining = pytest.importorskip("torch.distributed.pipelining")
fake_pg = pytest.importorskip("torch.testing._internal.distributed.fake_pg")

# meshcoll name -> (torch schedule class name, whether torch's stages sit in a V).
# Not 1f1b: in torch 2.13 Schedule1F1B.pipeline_order (a description; its runtime
# does not read it) numbers the last rank's forwards from 1 ("1F1 1B0 1F2 1B1" for
# two ranks), so there is no order to compare with.
TORCH_NAMES = {
    "gpipe": ("GPipe", False),
    "interleaved_1f1b": ("Interleaved1F1B", False),
    "interleaved_zero_bubble": ("InterleavedZeroBubble", False),
    "zero_bubble_v": ("ZBVZeroBubble", True),
    "dualpipe_v": ("DualPipeV", True),
}
_COMPUTE = {"F", "B", "I", "W"}  # torch's _ComputationType values that are compute


def _flatten(action):
    subs = getattr(action, "sub_actions", None)
    return list(subs) if subs else [action]


def torch_orders(name, p, v, m):
    """Per rank, torch's compute actions as meshcoll strings ("3I1")."""
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.schedules import get_schedule_class

    cls_name, v_shape = TORCH_NAMES[name]
    S = p * v
    dist.init_process_group("fake", rank=0, world_size=p, store=fake_pg.FakeStore())
    try:
        # Rank 0's stages; every rank's order is computed anyway.
        stage_ids = [0, S - 1] if v_shape else [k * p for k in range(v)]
        stages = [PipelineStage(torch.nn.Linear(2, 2), i, S, torch.device("cpu")) for i in stage_ids]
        sched = get_schedule_class(cls_name)(stages[0] if v == 1 and not v_shape else stages, m,
                                             loss_fn=lambda y, t: y.sum())
        out = []
        for r in range(p):
            acts = [x for a in sched.pipeline_order[r] if a is not None for x in _flatten(a)]
            out.append([f"{a.stage_index}{a.computation_type.value}{a.microbatch_index}"
                        for a in acts if a.computation_type.value in _COMPUTE])
        return out
    finally:
        dist.destroy_process_group()


def _configs():
    for p in (1, 2, 3, 4):
        for m in (1, 2, 3, 4, 5, 8):
            yield "gpipe", p, 1, m
        for m in (p, 2 * p):
            for v in (2, 3):
                yield "interleaved_1f1b", p, v, m
        for m in (2, 3, 4, 6, 8):
            for v in (2, 3):
                if m % max(1, m // p) == 0:
                    yield "interleaved_zero_bubble", p, v, m
        for m in (1, 2, 3, 5, 8):
            yield "zero_bubble_v", p, 2, m
        for m in (2 * p, 2 * p + 1, 3 * p):
            yield "dualpipe_v", p, 2, m


@pytest.mark.parametrize("name", list(TORCH_NAMES))
def test_compute_orders_match_torch(name):
    checked, differ = 0, []
    for cfg_name, p, v, m in _configs():
        if cfg_name != name:
            continue
        ours = make_schedule(name, p * v, m, virtual_stages=v)
        mine = [[str(a) for a in ours.compute_actions(r)] for r in range(p)]
        theirs = torch_orders(name, p, v, m)
        differ += [f"p={p} v={v} m={m} rank {r}:\n  meshcoll {' '.join(mine[r])}\n  torch    "
                   f"{' '.join(theirs[r])}" for r in range(p) if mine[r] != theirs[r]]
        checked += 1
    assert checked > 0
    assert not differ, f"{name} differs from torch in {len(differ)} rank orders:\n" + "\n".join(differ)


def test_v_placement_matches_torch():
    from torch.distributed.pipelining._utils import generate_stage_to_rank_mapping

    for p in (1, 2, 3, 4, 5):
        s = make_schedule("zero_bubble_v", 2 * p, 2 * p, virtual_stages=2)
        assert generate_stage_to_rank_mapping(p, 2 * p, style="v") == {
            i: s.stage_rank(i) for i in range(2 * p)}
