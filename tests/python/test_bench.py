"""meshcoll-bench: the verification patterns against a numpy simulation of each
collective (no processes), and one real 2-rank run of the command line."""

import json
import os
import re
import subprocess
import sys
import timeit
from types import SimpleNamespace

import numpy as np
import pytest

import meshcoll
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
           "avg": st.sum(0) // n, "band": np.bitwise_and.reduce(st, 0),
           "bor": np.bitwise_or.reduce(st, 0), "bxor": np.bitwise_xor.reduce(st, 0)}[redop]
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
@pytest.mark.parametrize("redop,dtype", [(r, d) for r in bench.REDOPS
                                         for d in ("float32", "float16", "int8")
                                         if d == "int8" or r not in bench.BITWISE])
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
    if n > 1 and (op not in bench.REDUCING or redop in bench.BITWISE):
        # movement and bitwise patterns differ between ranks, so misplaced blocks or a
        # rank's missing bits are caught
        assert not np.array_equal(inputs[0], inputs[1])


def test_case_run_adds_under_a_microsecond_to_the_call():
    # A small all_reduce takes about 2.5 us on 2 ranks: Python work per call in Case.run
    # (resolving "tree:k", a typing cast) once doubled what meshcoll-bench reported for it.
    # The fake group's calls do nothing, so what is left is the harness's own cost.
    class Group:
        rank, size = 0, 2
        config = SimpleNamespace(tree_arity="binomial")

        def all_reduce(self, x, op, algorithm=None):
            pass

        reduce = broadcast = lambda self, x, root, *a, algorithm=None: None

    pg, dt, n = Group(), np.dtype("float32"), 2000
    for op, algo in (("all_reduce", "auto"), ("all_reduce", "tree:4"), ("broadcast", "tree")):
        c = bench.Case(pg, bench.Series(op, algo), 2, dt, "sum", 0)
        call = (lambda: pg.all_reduce(c.x, "sum", algorithm="auto")) if op == "all_reduce" \
            else (lambda: pg.broadcast(c.x, 0, algorithm="tree"))
        own = min(timeit.timeit(c.run, number=n) - timeit.timeit(call, number=n)
                  for _ in range(7)) / n
        assert own < 1e-6, f"Case.run ({op}, {algo}) adds {own * 1e6:.2f} us per call"
    assert pg.config.tree_arity == "binomial"  # the last series' tree: the binomial one


def test_redops_are_the_apis():
    assert bench.REDOPS == ("sum", "prod", "min", "max", "avg", "band", "bor", "bxor")


# ---- tier 2: the command line, 2 ranks ------------------------------------------------

# size count type redop, then out-of-place and in-place: time algbw busbw #wrong (or N/A)
_GROUP = r"\s+([\d.]+|N/A)\s+([\d.]+|N/A)\s+([\d.]+|N/A)\s+(\S+)"
_ROW = re.compile(r"^\s+(\d+)\s+(\d+)\s+(\S+)\s+(\S+)" + _GROUP * 2 + "$")
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
    assert lines[lines.index(cols) - 1].split() == ["#", "out-of-place", "in-place"]
    assert cols.split() == ["#", "size", "count", "type", "redop"] + \
        ["time", "algbw", "busbw", "#wrong"] * 2
    rows = [m.groups() for m in map(_ROW.match, lines) if m]
    assert [int(r[0]) for r in rows] == [8 << k for k in range(10)]  # 8 B .. 4 KiB
    for size, count, typ, redop, *out_of_place, t, algbw, busbw, wrong in rows:
        # meshcoll's all_reduce works in place (it has no out=): no out-of-place form
        assert out_of_place == ["N/A"] * 4
        assert (int(count), typ, redop, wrong) == (int(size) // 4, "float", "sum", "0")
    assert re.fullmatch(r"# Avg bus bandwidth : [\d.e+-]+", lines[-1]), lines[-1]

    recs = [json.loads(l) for l in out.read_text().splitlines()]
    assert [r["size"] for r in recs] == [int(r[0]) for r in rows]
    for r in recs:
        assert r["op"] == "all_reduce" and r["ranks"] == 2 and r["wrong"] == 0
        assert r["in_place"] is True
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
    assert len(rows) == 6 * 4
    # Each op's forms (bench.PLACEMENTS) verified; the others N/A.
    for op, table in zip(bench.OPS, (rows[i:i + 4] for i in range(0, 24, 4))):
        for r in table:
            out_of_place, in_place = r[7], r[11]  # #wrong of each form
            assert out_of_place == ("0" if False in bench.PLACEMENTS[op] else "N/A"), (op, r)
            assert in_place == ("0" if True in bench.PLACEMENTS[op] else "N/A"), (op, r)


@pytest.mark.timeout(120)
def test_bench_algo_all_over_tcp_runs_what_tcp_has_and_writes_csv(tmp_path):
    """Issue 18: ``--algo all --transport tcp`` crashed on the shm algorithm. It now runs
    every algorithm tcp has, verified; the CSV holds the JSON's records."""
    js, cs = tmp_path / "r.jsonl", tmp_path / "r.csv"
    p = _bench(tmp_path, "-N", 3, "--op", "all_reduce,all_gather", "--algo", "all",
               "--transport", "tcp", "-b", 64, "-e", "4K", "-f", 8, "-n", 1, "-w", 0,
               "--repeats", 1, "--json", js, "--csv", cs)
    assert p.returncode == 0, p.stdout + p.stderr
    assert p.stderr == "", p.stderr
    algos = [m.group(1) for m in re.finditer(r"transport=tcp  algo=(\S+)", p.stdout)]
    assert algos == list(bench.algorithms_for("tcp")) and "shm" not in algos
    recs = [json.loads(l) for l in js.read_text().splitlines()]
    assert all(r["wrong"] == 0 and r["transport"] == "tcp" for r in recs)
    assert {(r["series"], r["in_place"]) for r in recs} == \
        {(f"all_reduce/{a}", True) for a in bench.algorithms_for("tcp")} | \
        {("all_gather", False), ("all_gather", True)}
    import csv
    with open(cs, newline="") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == len(recs)
    for row, rec in zip(rows, recs):
        assert (row["series"], row["in_place"], int(row["size"]), int(row["wrong"])) == \
            (rec["series"], str(rec["in_place"]), rec["size"], rec["wrong"])
        assert float(row["time"]) == pytest.approx(rec["time"])
        assert [float(t) for t in row["times"].split()] == \
            pytest.approx(rec["times"], rel=1e-6, abs=1e-3)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_bench_algo_all_compares_every_algorithm_of_reduce_and_broadcast(tmp_path, transport):
    """Issue 35 item 4: --algo all runs every algorithm reduce and broadcast take (trees of
    several arities too), verified, and ends each with one row per size, one column per
    algorithm, the fastest and auto's pick marked."""
    js = tmp_path / "r.jsonl"
    p = _bench(tmp_path, "-N", 3, "--op", "broadcast,reduce,all_gather", "--algo", "all",
               "--transport", transport, "-b", 1024, "-e", "16K", "-f", 16, "-n", 1, "-w", 0,
               "--repeats", 1, "--json", js)
    assert p.returncode == 0, p.stdout + p.stderr
    recs = [json.loads(l) for l in js.read_text().splitlines()]
    assert all(r["wrong"] == 0 and r["transport"] == transport for r in recs)
    for op in ("broadcast", "reduce"):
        want = list(bench.algorithms_for(transport, op))
        assert "tree:4" in want and ("ring" in want) == (op == "broadcast" and transport == "tcp")
        assert list(dict.fromkeys(r["algo"] for r in recs if r["op"] == op)) == want
        lines = p.stdout.split(f"# {op}: time (us) per algorithm, 3 ranks over {transport}")[1]
        head, *rows = lines.strip("\n").splitlines()[1:4]
        assert head.split()[2:] == want, head
        for row in rows[:2]:
            cells = row.split()
            assert cells[0] in ("1024", "16384") and len(cells) == 1 + len(want), row
            assert sum("*" in c for c in cells) == 1 and sum("a" in c for c in cells) == 1, row
    assert [r["algo"] for r in recs if r["op"] == "all_gather"] == [None, None, None, None]
    assert "# all_gather: time" not in p.stdout


def test_bench_shm_algorithm_over_tcp_is_refused_up_front(tmp_path):
    p = _bench(tmp_path, "-N", 2, "--algo", "ring,shm", "--transport", "tcp")
    assert p.returncode == 2 and p.stdout == ""
    assert "--algo shm needs shared memory, and --transport tcp has none" in p.stderr
    assert "Traceback" not in p.stderr
    # A group that fell back to tcp finds it after init, where the transport is known.
    assert bench.resolve_algorithms(["all"], "tcp") == list(bench.algorithms_for("tcp"))
    assert bench.resolve_algorithms(["all"], "shm") == list(bench.algorithms_for("shm"))
    with pytest.raises(SystemExit, match="--algo shm: not available for all_reduce on this "
                                         "group's transport \\(tcp\\)"):
        bench.resolve_algorithms(["ring", "shm"], "tcp")


def test_bench_plot_without_matplotlib_fails_before_running(tmp_path):
    # A matplotlib that does not import, first on the path, stands for one not installed.
    fake = tmp_path / "fake" / "matplotlib"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ImportError('No module named matplotlib')\n")
    env = {k: v for k, v in os.environ.items()
           if not any(k == p or (p.endswith("_") and k.startswith(p)) for p in _LAUNCH_VARS)}
    env["PYTHONPATH"] = os.pathsep.join([str(fake.parent)] + sys.path)
    p = subprocess.run([sys.executable, "-m", "meshcoll.bench", "-N", "2", "--plot",
                        str(tmp_path / "x.png"), "-e", "8"], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 1 and p.stdout == "", p
    assert p.stderr.startswith("meshcoll-bench: --plot needs matplotlib"), p.stderr
    assert "nothing was run" in p.stderr and "[rank" not in p.stderr
    assert not (tmp_path / "x.png").exists()


@pytest.mark.parametrize("op", ["all_gather", "reduce_scatter"])
@pytest.mark.parametrize("n", [1, 3])
def test_in_place_buffers_alias_as_nccl_tests(op, n):
    """In place, all_gather's input is this rank's block of its output and reduce_scatter's
    output this rank's block of its input; fill() leaves the input's pattern intact."""
    dt = np.dtype("float32")
    count = bench.element_counts(op, 48, 4, n)
    for r in range(n):
        pg = SimpleNamespace(rank=r, size=n)
        c = bench.Case(pg, bench.Series(op, None), count, dt, "sum", 0, in_place=True)
        ref = bench.Case(pg, bench.Series(op, None), count, dt, "sum", 0, in_place=False)
        blk = count // n
        np.testing.assert_array_equal(c.x, ref.x)  # the same input pattern
        if op == "all_gather":
            assert np.shares_memory(c.x, c.out) and c.out.size == count
            np.testing.assert_array_equal(c.out[r * blk:(r + 1) * blk], c.x)
        else:
            assert np.shares_memory(c.x, c.out) and c.out.size == blk
            assert c.out.__array_interface__["data"][0] == \
                c.x.__array_interface__["data"][0] + r * blk * dt.itemsize
        np.testing.assert_array_equal(c.expected(), ref.expected())
    with pytest.raises(ValueError, match="all_to_all has no in-place form"):
        bench.Case(SimpleNamespace(rank=0, size=2), bench.Series("all_to_all", None), 4, dt,
                   "sum", 0, in_place=True)


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
        # NCCL has no bitwise reductions (parse_args refuses them with --backend nccl).
        nccl_redops = [r for r in bench.REDOPS if r not in bench.BITWISE]
        for redop in nccl_redops if op in bench.REDUCING else ["sum"]:
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


def test_options_as_the_other_commands_spell_them(capsys):
    """--version as meshcoll-run's; hyphens (nccl-tests' --warmup_iters still works);
    band, bor and bxor for integers on the CPU backend."""
    with pytest.raises(SystemExit) as e:
        bench.parse_args(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out.strip() == f"meshcoll-bench {meshcoll.__version__}"
    assert bench.parse_args([]).warmup_iters == 5
    assert bench.parse_args(["--warmup-iters", "2"]).warmup_iters == 2
    assert bench.parse_args(["--warmup_iters", "3"]).warmup_iters == 3
    assert bench.parse_args(["-w", "4"]).warmup_iters == 4
    assert "--warmup_iters" not in capsys.readouterr().out
    with pytest.raises(SystemExit):
        bench.parse_args(["--help"])
    usage = capsys.readouterr().out
    assert "--warmup-iters" in usage and "--warmup_iters" not in usage
    assert bench.parse_args(["--redop", "bxor", "-d", "int32"]).redop == "bxor"
    for argv, why in ((["--redop", "band"], "--redop band takes an integer --dtype (int8, uint8, "
                                            "int32, int64), got float32"),
                      (["--redop", "bor", "-d", "int8", "--backend", "nccl"],
                       "--redop bor: NCCL has no bitwise reductions")):
        with pytest.raises(SystemExit):
            bench.parse_args(argv)
        assert why in capsys.readouterr().err


@pytest.mark.timeout(120)
def test_bench_bitwise_reductions_verify(tmp_path):
    p = _bench(tmp_path, "-N", 3, "--op", "all_reduce,reduce_scatter,reduce", "--redop", "bxor",
               "-d", "uint8", "--algo", "all", "-b", 3, "-e", "3K", "-f", 32, "-n", 1, "-w", 0,
               "--repeats", 1)
    assert p.returncode == 0, p.stdout + p.stderr
    series = [l for l in p.stdout.splitlines() if l.startswith("# meshcoll ")]
    rows = [m.groups() for m in map(_ROW.match, p.stdout.splitlines()) if m]
    assert len(series) >= 2 + 4 and len(rows) == 3 * len(series)  # 3 sizes; every algorithm
    for r in rows:
        assert (r[2], r[3]) == ("uint8", "bxor") and "0" in (r[7], r[11]), r
        assert {r[7], r[11]} <= {"0", "N/A"}, r


# ---- bench/python/spawn_ranks.py: the GPU benchmarks' process launcher ---------------------

_SPAWN_SCRIPT = """
import os, sys, traceback
sys.path.insert(0, {bench!r})
import numpy as np
from spawn_ranks import run_ranks


def rank_main(rank, world, port, token, fail, conn):
    try:
        import meshcoll
        os.environ["MESHCOLL_TOKEN"] = token
        pg = meshcoll.init(backend="cpu", rank=rank, world_size=world,
                           master_addr="127.0.0.1", master_port=port, timeout=30)
        x = np.random.default_rng(rank).standard_normal(5)
        pg.all_reduce(x)
        if fail and rank == 1:
            raise ValueError("rank 1 fails on purpose")
        meshcoll.destroy()
        conn.send(("ok", x.tolist()))
    except BaseException:
        conn.send(("error", traceback.format_exc()))


if __name__ == "__main__":
    res = run_ranks(rank_main, 2, False, timeout=60)
    want = sum(np.random.default_rng(r).standard_normal(5) for r in range(2))
    print("values", all(np.allclose(r, want) for r in res) and len(res) == 2)
    try:
        run_ranks(rank_main, 2, True, timeout=60)
        print("no error")
    except RuntimeError as e:
        print("error", "rank 1 failed" in str(e) and "fails on purpose" in str(e))
"""


@pytest.mark.timeout(120)
def test_spawn_ranks_runs_every_rank_and_names_a_failing_one(tmp_path):
    bench_dir = os.path.join(os.path.dirname(__file__), "..", "..", "bench", "python")
    script = tmp_path / "spawn_check.py"
    script.write_text(_SPAWN_SCRIPT.format(bench=os.path.abspath(bench_dir)))
    p = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                       timeout=100)
    assert p.returncode == 0, p.stderr
    assert "values True" in p.stdout and "error True" in p.stdout, (p.stdout, p.stderr)
