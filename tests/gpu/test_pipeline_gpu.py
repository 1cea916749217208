"""PipelineExecutor on the NCCL backend (Note [Channels on NCCL] in meshcoll/pipeline/executor.py):
every schedule, run on CUDA tensors, gives gradients and losses equal to one process's bit for
bit (the integer-valued model of tests/pipeline_common.py), on the world group and along pp
of a (dp, pp) mesh. That includes the V-shaped schedules (the turn of the V hands over on one
GPU, rank 0 holds the first and the last stage) and receives posted one compute ahead of their
consumer (Note [Receive lookahead] in meshcoll/pipeline/schedule.py). Skips without GPUs."""

from __future__ import annotations

import pytest

from test_nccl import NGPU, needs_torch, run_nccl

pytestmark = pytest.mark.timeout(240)

# (schedule, virtual stages, microbatches; None: 2 per rank, Megatron's m % p == 0)
CONFIGS = [("gpipe", 1, 4), ("1f1b", 1, 5), ("zero_bubble", 1, 4), ("interleaved_1f1b", 2, None),
           ("interleaved_zero_bubble", 2, None), ("zero_bubble_v", 2, 5), ("dualpipe_v", 2, None)]


def _body(pg, mesh):
    import torch
    import meshcoll
    from pipeline_common import train_body
    group = pg
    if mesh:  # channels inside a subgroup: global ranks differ from pipeline ranks
        group = meshcoll.init_device_mesh((2, pg.size // 2), ("dp", "pp")).get_group("pp")
    dev = torch.device("cuda", pg.device)
    for name, v, m in CONFIGS:
        try:
            train_body(group, name, v, m or 2 * group.size, steps=2, device=dev)
        except Exception as e:
            raise AssertionError(f"{name} virtual_stages={v} on {group.size} ranks "
                                 f"({group.ranks}): {type(e).__name__}: {e}") from e
    torch.cuda.synchronize()
    return len(CONFIGS)


@needs_torch
@pytest.mark.parametrize("world,mesh", [(2, False), (4, False), (4, True)])
def test_every_schedule_on_gpus(world, mesh):
    if NGPU < world:
        pytest.skip(f"needs {world} GPUs, {NGPU} visible")
    assert run_nccl(world, _body, mesh=mesh) == [len(CONFIGS)] * world
