"""bench/python/fsdp_vs_torch.py on the CPU backend, 2 ranks under meshcoll-run, a tiny model
and a few steps: it prints its line, and meshcoll's fully_shard ends with torch DDP's
parameters. Skipped without torch."""

import json
import os
import re
import subprocess
import sys

import pytest

pytest.importorskip("torch")

BENCH = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", "bench", "python",
                                     "fsdp_vs_torch.py"))
_LAUNCH_VARS = ("MESHCOLL_", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
                "MASTER_ADDR", "MASTER_PORT", "OMPI_COMM_WORLD_", "PMI_", "SLURM_")


@pytest.mark.timeout(120)
def test_fsdp_vs_torch_bench_cpu_tiny(tmp_path):
    # Launcher variables would make the ranks join another job.
    env = {k: v for k, v in os.environ.items()
           if not any(k == p or (p.endswith("_") and k.startswith(p)) for p in _LAUNCH_VARS)}
    env["OMP_NUM_THREADS"] = "1"
    out = tmp_path / "rows.jsonl"
    p = subprocess.run([sys.executable, "-m", "meshcoll.run", "-n", "2", BENCH, "--backend", "cpu",
                        "--width", "32", "--seq", "4", "--steps", "2", "--warmup", "1",
                        "--json", str(out)],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=100)
    assert p.returncode == 0, p.stdout + p.stderr
    lines = [l[len("[rank 0] "):] for l in p.stdout.splitlines() if l.startswith("[rank 0] ")]
    assert lines[0].startswith("# meshcoll ") and "DDP (gloo): backend=cpu ranks=2" in lines[0]
    assert re.match(r"^  meshcoll ms [\d.]+  torch ms [\d.]+  ratio [\d.]+  max rel diff ",
                    lines[2]), lines
    (rec,) = [json.loads(l) for l in out.read_text().splitlines()]
    assert rec["max_param_rel_diff"] < 1e-6 and rec["stage"] == 3 and rec["ranks"] == 2
    assert rec["ratio"] == pytest.approx(rec["meshcoll_ms"] / rec["torch_ms"])
