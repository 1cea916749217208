"""bench/python/ddp_vs_torch.py on the CPU backend, 2 ranks under meshcoll-run, tiny models
and 2 steps: it prints its table, and meshcoll's and torch's wrappers end with the same
parameters (bitwise for the MLP). Skipped without torch."""

import json
import os
import re
import subprocess
import sys

import pytest

pytest.importorskip("torch")

BENCH = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", "bench", "python",
                                     "ddp_vs_torch.py"))
_LAUNCH_VARS = ("MESHCOLL_", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
                "MASTER_ADDR", "MASTER_PORT", "OMPI_COMM_WORLD_", "PMI_", "SLURM_")
_NUM = r"[\d.]+(?:e[+-]\d+)?"


def _run(tmp_path, *args):
    # Launcher variables would make the ranks join another job.
    env = {k: v for k, v in os.environ.items()
           if not any(k == p or (p.endswith("_") and k.startswith(p)) for p in _LAUNCH_VARS)}
    env["OMP_NUM_THREADS"] = "1"
    out = tmp_path / "rows.jsonl"
    p = subprocess.run([sys.executable, "-m", "meshcoll.run", "-n", "2", BENCH, "--backend", "cpu",
                        "--steps", "2", "--warmup", "1", "--json", str(out), *map(str, args)],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=100)
    assert p.returncode == 0, p.stdout + p.stderr
    lines = [l[len("[rank 0] "):] for l in p.stdout.splitlines() if l.startswith("[rank 0] ")]
    assert not [l for l in p.stdout.splitlines() if l.startswith("[rank 1] ")], p.stdout
    recs = [json.loads(l) for l in out.read_text().splitlines()]
    return lines, recs


@pytest.mark.timeout(120)
def test_ddp_vs_torch_bench_cpu_tiny(tmp_path):
    lines, recs = _run(tmp_path, "--model", "mlp", "--layers", "2", "--width", "32",
                       "--views", "both")
    assert lines[0].startswith("# meshcoll ") and "backend=cpu (torch: gloo)  ranks=2" in lines[0]
    assert lines[1].startswith("# machine: ")
    head = next(i for i, l in enumerate(lines) if "meshcoll" in l and "torch" in l and "ratio" in l)
    assert lines[head].split()[1:4] == ["model", "views", "ranks"]
    row = re.compile(rf"^  mlp 2x32\s+(off|on)\s+2\s+({_NUM})\s+({_NUM})\s+({_NUM})\s+"
                     rf"({_NUM})/({_NUM})\s+({_NUM})\s+({_NUM})$")
    rows = [m.groups() for m in map(row.match, lines) if m]
    assert [r[0] for r in rows] == ["off", "on"], lines
    for r in rows:
        assert float(r[1]) > 0 and float(r[2]) > 0 and float(r[7]) == 0.0, r
    assert lines.count("# mlp 2x32 views=off: parameters bitwise equal: yes") == 1, lines
    assert lines.count("# mlp 2x32 views=on: parameters bitwise equal: yes") == 1, lines
    assert [(r["model"], r["views"], r["ranks"], r["bitwise_equal"]) for r in recs] == \
        [("mlp", "off", 2, True), ("mlp", "on", 2, True)]
    for r in recs:
        assert r["max_param_rel_diff"] == 0.0 and len(r["meshcoll_times_ms"]) == 2
        assert r["ratio"] == pytest.approx(r["meshcoll_ms"] / r["torch_ms"])
        assert 0.0 <= r["overlap_fraction"] <= 1.0

    # transformer and a channels_last convnet with BatchNorm (buffers broadcast by both):
    # parameters agree.
    lines, recs = _run(tmp_path, "--model", "both", "--layers", "1", "--width", "32",
                       "--heads", "4", "--seq", "8", "--image-size", "32", "--batch", "4")
    assert [(r["model"], r["views"]) for r in recs] == [("transformer", "off"), ("convnet", "off")]
    assert "refused" not in recs[0] and recs[0]["max_param_rel_diff"] < 1e-5, recs[0]
    conv = recs[1]
    assert "refused" not in conv and conv["max_param_rel_diff"] < 1e-5, conv
