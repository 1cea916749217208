"""bench/python/ddp_vs_torch.py on the NCCL backend, tiny models, 2 GPUs (and 4 where there
are): meshcoll's adapter and torch's DDP, bf16 autocast, alternating steps in the same
processes, end with the same parameters, for a transformer and a channels_last convnet with
BatchNorm (buffers broadcast by both), with and without bucket views. Skips without GPUs."""

import json
import os
import subprocess
import sys

import pytest

from test_nccl import NGPU, needs_torch

BENCH = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", "bench", "python",
                                     "ddp_vs_torch.py"))
_LAUNCH_VARS = ("MESHCOLL_", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
                "MASTER_ADDR", "MASTER_PORT")


@needs_torch
@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [2, 4])
def test_adapter_matches_torch_ddp_on_gpus(tmp_path, world):
    if NGPU < world:
        pytest.skip(f"needs {world} GPUs, {NGPU} visible")
    env = {k: v for k, v in os.environ.items()
           if not any(k == p or (p.endswith("_") and k.startswith(p)) for p in _LAUNCH_VARS)}
    env["NCCL_NVLS_ENABLE"] = "0"
    out = tmp_path / "rows.jsonl"
    p = subprocess.run([sys.executable, "-m", "meshcoll.run", "-n", str(world), BENCH,
                        "--backend", "nccl", "--model", "both", "--layers", "2", "--width", "64",
                        "--heads", "4", "--seq", "16", "--image-size", "32", "--batch", "4",
                        "--views", "both", "--steps", "5", "--warmup", "1", "--json", str(out)],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=280)
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
    recs = [json.loads(l) for l in out.read_text().splitlines()]
    assert [(r["model"], r["views"]) for r in recs] == [
        ("transformer", "off"), ("transformer", "on"), ("convnet", "off"), ("convnet", "on")]
    for r in recs:
        assert "refused" not in r and r["max_param_rel_diff"] < 1e-5, r
