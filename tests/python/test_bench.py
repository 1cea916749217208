"""meshcoll-bench: the verification patterns against a numpy simulation of each
collective (no processes), and one real 2-rank run of the command line."""

import json
import os
import re
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest

from meshcoll import bench

# ---- tier 1: sizes, factors and patterns ---------------------------------------------


def test_parse_size():
    assert [bench.parse_size(s) for s in ("8", "4K", "4k", "16M", "1G", "2KiB", "3KB")] == \
        [8, 4096, 4096, 16 << 20, 1 << 30, 2048, 3072]
    with pytest.raises(Exception):
        bench.parse_size("12X")


def test_size_steps_like_nccl_tests():
    assert bench.size_steps(8, 64, 2, 0) == [8, 16, 32, 64]
    assert bench.size_steps(8, 100, 4, 0) == [8, 32]
    assert bench.size_steps(1024, 4096, 1, 1024) == [1024, 2048, 3072, 4096]


def test_bus_factors():
    n = 4
    assert bench.BUS_FACTORS["all_reduce"](n) == 2 * (n - 1) / n
    for op in ("all_gather", "reduce_scatter", "all_to_all"):
        assert bench.BUS_FACTORS[op](n) == (n - 1) / n
    for op in ("broadcast", "reduce"):
        assert bench.BUS_FACTORS[op](n) == 1.0
    assert set(bench.BUS_FACTORS) == set(bench.OPS)


def test_element_counts_split_evenly():
    assert bench.element_counts("all_reduce", 8, 4, 4) == 2
    assert bench.element_counts("all_gather", 8, 4, 4) == 4  # at least one per rank
    assert bench.element_counts("reduce_scatter", 100, 4, 3) == 24
    assert bench.element_counts("broadcast", 1, 4, 3) == 1


def _simulate(op, inputs, redop, root):
    """What each rank holds after ``op``, computed on the stacked int64 inputs."""
    n = len(inputs)
    st = np.stack(inputs)
    red = {"sum": st.sum(0), "prod": st.prod(0), "min": st.min(0), "max": st.max(0),
           "avg": st.sum(0) // n}[redop]
    blk = len(inputs[0]) // n
    if op == "all_reduce":
        return [red] * n
    if op == "reduce":
        return [red if r == root else inputs[r] for r in range(n)]
    if op == "reduce_scatter":
        return [red[r * blk:(r + 1) * blk] for r in range(n)]
    if op == "broadcast":
        return [inputs[root]] * n
    if op == "all_gather":
        return [np.concatenate(inputs)] * n
    return [np.concatenate([inputs[j][r * blk:(r + 1) * blk] for j in range(n)])
            for r in range(n)]


@pytest.mark.parametrize("op", bench.OPS)
@pytest.mark.parametrize("n", [1, 2, 3, 5])
@pytest.mark.parametrize("redop", bench.REDOPS)
@pytest.mark.parametrize("dtype", ["float32", "float16", "int8"])
def test_pattern_matches_simulation(op, n, redop, dtype):
    dt = np.dtype(dtype)
    count = bench.element_counts(op, 37 * dt.itemsize, dt.itemsize, n)
    root = n - 1
    cases = [bench.Case(SimpleNamespace(rank=r, size=n), bench.Series(op, None), count, dt,
                        redop, root) for r in range(n)]
    inputs = [c.x.astype(np.int64) for c in cases]
    want = _simulate(op, inputs, redop, root)
    for r, c in enumerate(cases):
        np.testing.assert_array_equal(c.expected().astype(np.int64), want[r])
    if op not in bench.REDUCING and n > 1:
        # movement patterns differ between ranks, so misplaced blocks are caught
        assert not np.array_equal(inputs[0], inputs[1])


# ---- tier 2: the command line, 2 ranks ------------------------------------------------

_ROW = re.compile(r"^\s+(\d+)\s+(\d+)\s+(\S+)\s+(\S+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+(\S+)$")
_LAUNCH_VARS = ("MESHCOLL_", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
                "OMPI_COMM_WORLD_", "PMI_", "SLURM_")


def _bench(tmp_path, *args):
    # Launcher variables would make meshcoll-bench join a job instead of starting one.
    env = {k: v for k, v in os.environ.items()
           if not any(k == p or (p.endswith("_") and k.startswith(p)) for p in _LAUNCH_VARS)}
    return subprocess.run([sys.executable, "-m", "meshcoll.bench", *map(str, args)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=90)


@pytest.mark.timeout(120)
def test_bench_all_reduce_table_and_json(tmp_path):
    out = tmp_path / "ar.jsonl"
    p = _bench(tmp_path, "-N", 2, "--op", "all_reduce", "-b", 8, "-e", "4K", "-f", 2,
               "-c", 1, "-n", 2, "-w", 1, "--repeats", 1, "--json", out)
    assert p.returncode == 0, p.stdout + p.stderr
    lines = p.stdout.splitlines()
    assert re.fullmatch(r"# meshcoll \S+  all_reduce  backend=cpu  ranks=2  iters=2 warmup=1"
                        r"(  .*)?", lines[0]), lines[0]
    cols = next(l for l in lines if "#wrong" in l)
    assert cols.split() == ["#", "size", "count", "type", "redop", "time", "algbw", "busbw",
                            "#wrong"]
    rows = [m.groups() for m in map(_ROW.match, lines) if m]
    assert [int(r[0]) for r in rows] == [8 << k for k in range(10)]  # 8 B .. 4 KiB
    for size, count, typ, redop, *_, wrong in rows:
        assert (int(count), typ, redop, wrong) == (int(size) // 4, "float", "sum", "0")
    assert re.fullmatch(r"# Avg bus bandwidth : [\d.e+-]+", lines[-1]), lines[-1]

    recs = [json.loads(l) for l in out.read_text().splitlines()]
    assert [r["size"] for r in recs] == [int(r[0]) for r in rows]
    for r in recs:
        assert r["op"] == "all_reduce" and r["ranks"] == 2 and r["wrong"] == 0
        assert r["time"] > 0 and r["busbw"] == pytest.approx(r["algbw"] * 2 * (2 - 1) / 2)
        assert r["algbw"] == pytest.approx(r["size"] / r["time"] / 1e3)


@pytest.mark.timeout(120)
def test_bench_every_collective_verifies(tmp_path):
    p = _bench(tmp_path, "-N", 2, "--op", "all", "-b", 8, "-e", "1K", "-f", 4,
               "-c", 1, "-n", 1, "-w", 0, "--repeats", 1, "-r", 1)
    assert p.returncode == 0, p.stdout + p.stderr
    headers = [l.split()[3] for l in p.stdout.splitlines() if l.startswith("# meshcoll ")]
    assert headers == list(bench.OPS)
    rows = [m.groups() for m in map(_ROW.match, p.stdout.splitlines()) if m]
    assert len(rows) == 6 * 4 and all(r[-1] == "0" for r in rows)


# ---- the NCCL backend's random inputs and host reference, on the CPU backend ----------


class _NumpyArrays:
    """bench.TorchArrays' methods on numpy arrays: DeviceCase runs on the CPU backend."""

    name = "numpy"

    def empty(self, count, dtype):
        return np.empty(count, np.dtype(dtype))

    def write(self, x, start, values):
        x[start:start + values.size] = values

    def fill(self, x, value):
        x[...] = value

    def read(self, x, start, stop, integer):
        return x[start:stop].astype(np.int64 if integer else np.float64)

    def synchronize(self):
        pass


def _device_cases(pg, counts, dtypes):
    arrays, fails = _NumpyArrays(), []
    for op in bench.OPS:
        for redop in bench.REDOPS if op in bench.REDUCING else ["sum"]:
            for name in dtypes:
                dt = bench.device_dtype(name)
                for nbytes in counts:
                    count = bench.element_counts(op, nbytes * dt.itemsize, dt.itemsize, pg.size)
                    c = bench.DeviceCase(pg, bench.Series(op, "auto" if op == "all_reduce" else None),
                                         count, dt, redop, pg.size - 1, arrays, seed=5,
                                         chunk=7)  # many chunks per buffer, ragged ends
                    w = c.check()
                    if w:
                        fails.append(f"{op}/{redop}/{name}/{count}: {w} wrong")
                    # a wrong element must be seen: corrupt the last one of the result
                    c.fill()
                    c.run()
                    res = c.result()
                    if op == "reduce" and pg.rank != c.root:
                        continue  # non-roots' result is their input, which run() keeps
                    res[-1] = 101
                    if c.verify() != 1:
                        fails.append(f"{op}/{redop}/{name}/{count}: corruption not seen")
    return fails


@pytest.mark.timeout(120)
def test_device_case_reference_matches_the_cpu_backend(run_ranks):
    """DeviceCase (the --backend nccl path) with numpy arrays on 3 CPU ranks: random inputs
    regenerated chunk by chunk, the host reference of every op and reduction, and the
    comparison that finds one wrong element."""
    results = run_ranks(3, _device_cases, counts=[1, 5, 23], dtypes=["float32", "int8", "float16"])
    fails = [f"rank {r}: {f}" for r, fs in enumerate(results) for f in fs]
    assert not fails, "\n".join(fails[:20])


def test_rank_values_are_chunk_independent():
    full = bench.rank_values(3, 1, 50, 0, 50, "move")
    assert full.dtype == np.uint8 and full.min() >= 0 and full.max() < 64
    parts = [bench.rank_values(3, 1, 50, a, min(a + 9, 50), "move") for a in range(0, 50, 9)]
    assert np.array_equal(np.concatenate(parts), full)
    assert not np.array_equal(full, bench.rank_values(3, 2, 50, 0, 50, "move"))


def test_reference_reduce_wraps_like_the_device():
    two = [np.full(3, 2, np.uint8)] * 8  # 2**8 = 256 wraps to 0 in int8 and uint8
    assert bench.reference_reduce(two, "prod", "int8").tolist() == [0, 0, 0]
    assert bench.reference_reduce(two, "prod", "float16").tolist() == [256.0] * 3
    assert bench.reference_reduce([np.array([1, 2], np.uint8)] * 2 + [np.array([0, 0], np.uint8)],
                                  "avg", "int32").tolist() == [0, 1]


def test_nccl_backend_without_gpu_says_why(tmp_path):
    from meshcoll.nccl import nccl_available
    ok, why = nccl_available()
    if ok:
        pytest.skip(f"NCCL is available here ({why})")
    p = _bench(tmp_path, "--backend", "nccl", "-N", 2, "-b", 8, "-e", 8)
    assert p.returncode != 0
    assert "--backend nccl: the NCCL backend is not available here: " + why in p.stderr, p.stderr
    assert "Traceback" not in p.stderr and p.stdout == ""


def test_nccl_backend_rejects_cpu_options():
    with pytest.raises(SystemExit):
        bench.parse_args(["--backend", "nccl", "--algo", "ring"])
    with pytest.raises(SystemExit):
        bench.parse_args(["--backend", "nccl", "--transport", "tcp"])
    with pytest.raises(SystemExit):
        bench.parse_args(["--array", "torch"])  # cpu backend
