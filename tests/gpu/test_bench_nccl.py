"""Tier 3: ``meshcoll-bench --backend nccl`` on 2 GPUs: every row of the table verifies
(#wrong 0 in the --json records). Skips with the reason ``nccl_available()`` gives, or when
fewer than 2 GPUs are visible, or when neither PyTorch nor CuPy is installed."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from meshcoll import _C, bench
from meshcoll.nccl import nccl_available

OK, WHY = nccl_available()
NGPU = int(_C.cuda_device_count()) if OK else 0
ARRAYS = [lib for lib in bench.ARRAY_LIBS if importlib.util.find_spec(lib) is not None]

pytestmark = [
    pytest.mark.skipif(not OK, reason=f"NCCL backend unavailable: {WHY}"),
    pytest.mark.skipif(NGPU < 2, reason=f"needs 2 GPUs, {NGPU} visible ({WHY})"),
    pytest.mark.skipif(not ARRAYS, reason="needs PyTorch or CuPy for device buffers"),
]

_LAUNCH_VARS = ("MESHCOLL_", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
                "OMPI_COMM_WORLD_", "PMI_", "SLURM_")


def _bench(tmp_path, *args, timeout=240):
    # Launcher variables would make meshcoll-bench join a job instead of starting one.
    env = {k: v for k, v in os.environ.items()
           if not any(k == p or (p.endswith("_") and k.startswith(p)) for p in _LAUNCH_VARS)}
    env["NCCL_NVLS_ENABLE"] = "0"
    return subprocess.run([sys.executable, "-m", "meshcoll.bench", "--backend", "nccl",
                           *map(str, args)], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=timeout)


def _records(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.timeout(300)
def test_every_collective_verifies_on_two_gpus(tmp_path):
    out = tmp_path / "all.jsonl"
    p = _bench(tmp_path, "-N", 2, "--op", "all", "-b", 8, "-e", "4M", "-f", 16, "-c", 1,
               "-n", 3, "-w", 1, "--repeats", 1, "-r", 1, "--json", out)
    assert p.returncode == 0, p.stdout + p.stderr
    recs = _records(out)
    sizes = bench.size_steps(8, 4 << 20, 16, 0)
    assert sorted({r["op"] for r in recs}) == sorted(bench.OPS)
    for op in bench.OPS:  # float32 on 2 ranks: every size splits evenly
        for in_place in bench.PLACEMENTS[op]:  # out of place and in place where it has both
            assert [r["size"] for r in recs if r["op"] == op and r["in_place"] == in_place] \
                == sizes, (op, in_place)
        assert {r["in_place"] for r in recs if r["op"] == op} == set(bench.PLACEMENTS[op])
    for r in recs:
        assert r["backend"] == "nccl" and r["ranks"] == 2 and r["transport"] == "nccl"
        assert r["wrong"] == 0, r
        assert r["time"] > 0 and r["busbw"] > 0
    assert "backend=nccl  ranks=2" in p.stdout and "nccl=" in p.stdout


@pytest.mark.timeout(300)
@pytest.mark.parametrize("dtype,redop", [("bfloat16", "avg"), ("float16", "prod"), ("int8", "max")])
def test_dtypes_and_reductions_verify(tmp_path, dtype, redop):
    if dtype == "bfloat16" and "torch" not in ARRAYS:
        pytest.skip("bfloat16 buffers need PyTorch (CuPy has no bfloat16)")
    out = tmp_path / "r.jsonl"
    p = _bench(tmp_path, "-N", 2, "--op", "all_reduce,reduce_scatter,reduce", "-d", dtype,
               "--redop", redop, "-b", 8, "-e", "1M", "-f", 32, "-c", 1, "-n", 2, "-w", 0,
               "--repeats", 1, "--json", out)
    assert p.returncode == 0, p.stdout + p.stderr
    recs = _records(out)
    assert recs and all(r["wrong"] == 0 and r["redop"] == redop for r in recs), recs


@pytest.mark.timeout(120)
def test_more_ranks_than_gpus_is_refused(tmp_path):
    p = _bench(tmp_path, "-N", NGPU + 1, "-b", 8, "-e", 8)
    assert p.returncode != 0 and f"but {NGPU} GPUs are visible" in p.stderr, p.stderr
