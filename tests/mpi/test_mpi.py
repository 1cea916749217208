"""The MPI backend (csrc/mpi/, python/meshcoll/mpi.py) under a real ``mpirun -n 2``: every
collective against numpy on random data, a disagreement (MismatchError on both ranks), a
rank that never calls (a TimeoutError naming it, then the job ends by MPI_Abort: Note [MPI
failure model] in csrc/mpi/mpi_backend.h), subgroups through MPI_Comm_split, and
``mpi_available()`` saying why MPI cannot be built. Skipped only where no MPI is installed
(no mpicc or mpirun). Each rank of a job reports what it saw in a file; the test asserts on
those."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

MPIRUN = shutil.which("mpirun")
MPICC = shutil.which(os.environ.get("MPICC", "mpicc"))
pytestmark = pytest.mark.skipif(MPIRUN is None or MPICC is None,
                                reason="no MPI installed (mpicc and mpirun)")

HEADER = """
import json, os, sys, time
import numpy as np
import meshcoll
sys.path.insert(0, {tests!r})
from conftest import rand_array

def report(rank, value):
    # A file, not stdout: mpirun may drop a rank's last output when the job ends.
    with open(os.path.join({results!r}, f"result-{{rank}}.json.tmp"), "w") as f:
        json.dump(value, f)
    os.replace(f.name, f.name[:-4])
"""


def mpi_job(tmp_path: Path, body: str, *, n: int = 2, env: dict | None = None,
            timeout: float = 40.0) -> tuple[int, str, dict[int, object]]:
    """Runs ``body`` (after HEADER) under ``mpirun -n n``: (exit code, output, each rank's
    reported value)."""
    script = tmp_path / "job.py"
    script.write_text(HEADER.format(tests=str(Path(__file__).parents[1]), results=str(tmp_path))
                      + textwrap.dedent(body))
    cmd = [MPIRUN, "--oversubscribe", "-n", str(n)]
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        cmd.insert(1, "--allow-run-as-root")
    full_env = {**os.environ, "MESHCOLL_MPI_CACHE": str(tmp_path.parent / "mpi-cache"),
                "OMPI_MCA_btl": "self,vader,tcp", **(env or {})}
    for name in ("MESHCOLL_MASTER_ADDR", "MASTER_ADDR"):  # the store comes through MPI
        full_env.pop(name, None)
    r = subprocess.run(cmd + [sys.executable, str(script)], capture_output=True, text=True,
                       timeout=timeout, env=full_env)
    out = r.stdout + r.stderr
    results = {int(p.name[len("result-"):-len(".json")]): json.loads(p.read_text())
               for p in tmp_path.glob("result-*.json")}
    return r.returncode, out, results


@pytest.mark.timeout(60)
def test_collectives_match_numpy(tmp_path):
    """Every collective of the contract, a sample of dtypes and ops each, sync and async,
    against numpy on every rank's random data (each rank rebuilds its peers' inputs)."""
    code, out, res = mpi_job(tmp_path, """
        import ml_dtypes
        pg = meshcoll.init(backend="mpi", timeout=20)
        r, n = pg.rank, pg.size
        assert pg.transport.startswith("mpi") and pg.backend_name == "mpi", pg
        bad = []
        def data(rank, count, dtype, salt):
            return rand_array(np.random.default_rng(1000 * salt + rank), count, dtype)
        def check(label, got, want, tol=0.0):
            got = np.asarray(got).astype(np.float64) if np.asarray(got).dtype != np.bool_ else np.asarray(got)
            want = np.asarray(want).astype(got.dtype)
            if got.shape != want.shape or not np.allclose(got, want, rtol=tol, atol=tol):
                bad.append(f"{label}: got {got[:6]} want {want[:6]}")
        salt = 0
        reducers = {"sum": np.add.reduce, "prod": np.multiply.reduce, "min": np.minimum.reduce,
                    "max": np.maximum.reduce, "band": np.bitwise_and.reduce,
                    "bor": np.bitwise_or.reduce, "bxor": np.bitwise_xor.reduce}
        cases = [("float32", "sum", 1e-5), ("float64", "max", 0), ("int32", "min", 0),
                 ("int64", "prod", 0), ("uint8", "band", 0), ("int8", "bxor", 0),
                 ("bool", "bor", 0), ("float32", "avg", 1e-5), ("float16", "sum", 1e-2),
                 ("bfloat16", "sum", 5e-2), ("bfloat16", "max", 0)]
        for dt_name, op, tol in cases:
            salt += 1
            dt = ml_dtypes.bfloat16 if dt_name == "bfloat16" else np.dtype(dt_name)
            ins = [data(q, 1000, dt, salt) for q in range(n)]
            wide = [a.astype(np.float32) if dt_name in ("bfloat16", "float16") else a for a in ins]
            if op == "avg":
                want = np.add.reduce(wide) / n
            elif dt_name == "bool":
                want = np.logical_or.reduce(wide)
            else:
                want = reducers[op](wide)
            x = ins[r].copy()
            pg.all_reduce(x, op=op)
            check(f"all_reduce {dt_name} {op}", x, want, tol)
            out_ = pg.reduce(ins[r].copy(), dst=1, op=op)
            if r == 1:
                check(f"reduce {dt_name} {op}", out_, want, tol)
            x = ins[r].copy()
            pg.all_reduce(x, op=op, async_op=True).wait()
            check(f"async all_reduce {dt_name} {op}", x, want, tol)
        for dt in (np.float32, np.int64, ml_dtypes.bfloat16):
            salt += 1
            ins = [data(q, 600, dt, salt) for q in range(n)]
            x = ins[r].copy()
            pg.broadcast(x, src=1)
            check(f"broadcast {dt}", x, ins[1])
            check(f"all_gather {dt}", pg.all_gather(ins[r]), np.stack(ins))
            got = pg.reduce_scatter(ins[r]) if dt != ml_dtypes.bfloat16 else None
            if got is not None:
                full = np.add.reduce(ins)
                check(f"reduce_scatter {dt}", got, full[r * 300:(r + 1) * 300], 1e-5)
            got = pg.all_to_all(ins[r])
            check(f"all_to_all {dt}", got, np.concatenate([ins[q][r * 300:(r + 1) * 300] for q in range(n)]))
        salt += 1
        rows = [data(q, (q + 2) * 3, np.float32, salt).reshape(q + 2, 3) for q in range(n)]
        got, counts = pg.all_gather_v(rows[r])
        check("all_gather_v", got, np.concatenate(rows))
        g = pg.gather(rows[r][:2], dst=0)
        if r == 0:
            check("gather", g, np.stack([rows[q][:2] for q in range(n)]))
        table = np.stack([rows[1][q:q + 1] for q in range(n)])  # (n, 1, 3), known everywhere
        got = pg.scatter(table if r == 1 else None, src=1, out=np.empty((1, 3), np.float32))
        check("scatter", got, table[r])
        pg.barrier()
        # Point-to-point, both directions, blocking and posted.
        msg = [data(q, 257, np.float64, 99) for q in range(n)]
        peer = 1 - r
        if r == 0:
            pg.send(msg[0], peer)
            got = np.empty(257); pg.recv(got, peer)
        else:
            got = np.empty(257); pg.recv(got, peer)
            pg.send(msg[1], peer)
        check("send/recv", got, msg[peer])
        got = np.empty(257)
        works = [pg.isend(msg[r], peer, tag=5), pg.irecv(got, peer, tag=5)]
        for w in works:
            w.wait()
        check("isend/irecv", got, msg[peer])
        stats = pg.stats()
        report(r, {"bad": bad, "all_reduce_calls": stats["all_reduce"].calls})
        meshcoll.destroy()
    """)
    assert code == 0, out
    assert set(res) == {0, 1}, out
    for rank, value in res.items():
        assert value["bad"] == [], f"rank {rank}: {value['bad']}"
        assert value["all_reduce_calls"] > 0


@pytest.mark.timeout(60)
def test_disagreement_is_mismatch_on_both_ranks(tmp_path):
    """Strict check: ranks whose calls differ (count) both raise MismatchError before MPI is
    called, and the job goes on to a clean end. Async check (the default): the disagreement
    (same count, other op) fails the group as soon as the side channel compares it, and the
    next call raises MismatchError on both ranks."""
    code, out, res = mpi_job(tmp_path, """
        pg = meshcoll.init(backend="mpi", timeout=20)
        r = pg.rank
        seen = {}
        for check in ("strict", "async"):
            g = pg.new_group([0, 1], check=check)
            try:
                if check == "strict":
                    g.all_reduce(np.ones(4 if r == 0 else 8, np.float32))
                else:
                    g.all_reduce(np.ones(4, np.float32), op="sum" if r == 0 else "max")
                    time.sleep(1.0)  # the checker compares within a few ms
                    g.barrier()
                seen[check] = "no error"
            except meshcoll.MismatchError as e:
                seen[check] = "MismatchError: " + str(e)
            except Exception as e:
                seen[check] = f"{type(e).__name__}: {e}"
        report(r, seen)
        pg.barrier()  # the world is unharmed
        meshcoll.destroy()
    """)
    assert code == 0, out
    assert set(res) == {0, 1}, out
    for rank, seen in res.items():
        for check in ("strict", "async"):
            assert seen[check].startswith("MismatchError"), (rank, check, seen[check])
        assert "count=4" in seen["strict"] and "count=8" in seen["strict"], seen["strict"]
        assert "sum" in seen["async"] and "max" in seen["async"], seen["async"]


@pytest.mark.timeout(60)
def test_rank_that_never_calls_is_named_then_job_ends(tmp_path):
    """Rank 1 skips an all_reduce: rank 0's call raises TimeoutError at its deadline naming
    global rank 1, and destroy() ends the job by MPI_Abort (MPI cannot cancel the call), long
    before rank 1 would have gone on."""
    start = time.monotonic()
    code, out, res = mpi_job(tmp_path, """
        pg = meshcoll.init(backend="mpi", timeout=20)
        r = pg.rank
        pg.barrier()
        if r == 1:
            time.sleep(40)  # never issues the all_reduce; MPI_Abort ends this process
            report(r, "rank 1 went on")
        else:
            try:
                pg.all_reduce(np.ones(16, np.float32), timeout=2.0)
                report(r, "no error")
            except meshcoll.TimeoutError as e:
                report(r, "TimeoutError: " + str(e))
        meshcoll.destroy()
        report(r, "destroy returned")
    """, timeout=50)
    elapsed = time.monotonic() - start
    assert 0 in res, out
    assert res[0].startswith("TimeoutError"), res[0]
    assert "never issued by rank 1" in res[0], res[0]
    assert "MPI_Abort" in res[0], res[0]
    assert code != 0 and 1 not in res, out  # the job was ended, rank 1 never went on
    assert elapsed < 35, f"the job took {elapsed:.0f} s: MPI_Abort did not end it"


@pytest.mark.timeout(60)
def test_subgroups_through_comm_split(tmp_path):
    """new_group and split make MPI groups (MPI_Comm_split) whose results match numpy; a
    non-member of new_group gets a NonMemberGroup."""
    code, out, res = mpi_job(tmp_path, """
        pg = meshcoll.init(backend="mpi", timeout=20)
        r = pg.rank
        solo = pg.new_group([1])
        both = pg.split(0, key=-r)  # reversed order: group rank = 1 - world rank
        x = np.full(3, r + 1.0, np.float32)
        both.all_reduce(x)
        value = {"both_rank": both.rank, "both_backend": both.backend_name, "sum": x.tolist(),
                 "solo_member": solo.is_member}
        if solo.is_member:
            y = np.arange(4, dtype=np.int32)
            solo.all_reduce(y)
            value["solo"] = y.tolist()
        report(r, value)
        meshcoll.destroy()
    """)
    assert code == 0, out
    assert res[0] == {"both_rank": 1, "both_backend": "mpi", "sum": [3.0] * 3,
                      "solo_member": False}, res[0]
    assert res[1] == {"both_rank": 0, "both_backend": "mpi", "sum": [3.0] * 3,
                      "solo_member": True, "solo": [0, 1, 2, 3]}, res[1]


@pytest.mark.timeout(60)
def test_mpi_available_says_why_not(tmp_path):
    """No compiler (MPICC names nothing) and a compile that fails each give (False, why)."""
    code = textwrap.dedent("""
        import meshcoll
        print(repr(meshcoll.mpi_available()))
    """)
    def available(mpicc):
        env = {**os.environ, "MPICC": mpicc, "MESHCOLL_MPI_CACHE": str(tmp_path / mpicc.replace("/", "_"))}
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           timeout=30, env=env)
        assert r.returncode == 0, r.stderr
        return eval(r.stdout.strip())
    ok, why = available("/nonexistent")
    assert not ok and "/nonexistent" in why and "MPICC" in why, why
    ok, why = available(shutil.which("false") or "/bin/false")
    assert not ok and "compiling the MPI shim" in why and "failed" in why, why
    ok, why = available(MPICC)
    assert ok and "libmeshcoll_mpi.so" in why, why


@pytest.mark.timeout(60)
def test_cpu_group_beside_an_mpi_world(tmp_path):
    """A backend per group: an MPI world with a CPU group (new_group(backend="cpu"), over the
    job's store) for control data; all_reduce on both, against numpy on random data; a
    one-member CPU group leaves the other rank a NonMemberGroup."""
    code, out, res = mpi_job(tmp_path, """
        pg = meshcoll.init(backend="mpi", timeout=20)
        r, n = pg.rank, pg.size
        ctl = pg.new_group([0, 1], backend="cpu", name="control")
        solo = pg.new_group([1], backend="cpu")
        ins = [rand_array(np.random.default_rng([11, q]), 777, np.float32) for q in range(n)]
        want = np.add.reduce(ins)
        x, y = ins[r].copy(), ins[r].copy()
        pg.all_reduce(x)
        ctl.all_reduce(y, op="max")
        report(r, {"world": [pg.backend_name, bool(np.allclose(x, want, rtol=1e-5))],
                   "control": [ctl.backend_name, ctl.name, ctl.ranks,
                               bool(np.array_equal(y, np.maximum.reduce(ins)))],
                   "solo": solo.is_member and solo.backend_name})
        meshcoll.destroy()
    """)
    assert code == 0, out
    assert set(res) == {0, 1}, out
    for rank, value in res.items():
        assert value["world"] == ["mpi", True], (rank, value)
        assert value["control"] == ["cpu", "control", [0, 1], True], (rank, value)
    assert res[0]["solo"] is False and res[1]["solo"] == "cpu", res


@pytest.mark.timeout(60)
def test_ranks_asking_for_different_backends_get_mismatch(tmp_path):
    """Rank 0 asks for a CPU group, rank 1 for an MPI one: MismatchError on both, naming the
    backend each asked for; the world goes on (a later new_group and an all_reduce)."""
    code, out, res = mpi_job(tmp_path, """
        pg = meshcoll.init(backend="mpi", timeout=20)
        r = pg.rank
        try:
            pg.new_group([0, 1], backend="cpu" if r == 0 else "mpi")
            seen = "no error"
        except Exception as e:
            seen = f"{type(e).__name__}: {e}"
        g = pg.new_group([0, 1], backend="cpu")
        x = rand_array(np.random.default_rng([3, r]), 64, np.float64)
        g.all_reduce(x)
        want = sum(rand_array(np.random.default_rng([3, q]), 64, np.float64) for q in range(2))
        report(r, [seen, bool(np.allclose(x, want))])
        meshcoll.destroy()
    """)
    assert code == 0, out
    assert set(res) == {0, 1}, out
    for rank, (seen, ok) in res.items():
        assert seen.startswith("MismatchError"), (rank, seen)
        assert "backend" in seen and "'cpu' on rank 0" in seen and "'mpi' on rank 1" in seen, seen
        assert ok, rank


@pytest.mark.timeout(60)
def test_mpi_group_beside_a_cpu_world(tmp_path):
    """A CPU world under mpirun (a master address given) makes an MPI group by splitting MPI's
    world: all_reduce on both against numpy; a one-member MPI group too. Ranks that then ask
    for different backends each get a MismatchError naming both requests (Note [Agreeing on
    a new group's request] in process_group.py), both at once, well before their setup
    deadline (20 s here): the rank asking for MPI withdraws from the CPU group's setup (Note
    [Withdrawn ranks]), whether its CPU peer waits for its address (rank 0 asks for MPI) or
    for its connection (rank 1 does); and the world goes on."""
    from conftest import free_port
    port = free_port()
    code, out, res = mpi_job(tmp_path, """
        os.environ["MESHCOLL_MASTER_ADDR"] = "127.0.0.1"
        pg = meshcoll.init(backend="cpu", timeout=20)
        r, n = pg.rank, pg.size
        g = pg.new_group([0, 1], backend="mpi")
        solo = pg.new_group([0], backend="mpi")
        ins = [rand_array(np.random.default_rng([5, q]), 300, np.float64) for q in range(n)]
        x, y = ins[r].copy(), ins[r].copy()
        pg.all_reduce(x)
        g.all_reduce(y)
        seen = []
        for asker in (0, 1):
            start = time.monotonic()
            try:
                pg.new_group([0, 1], backend="mpi" if r == asker else "cpu", timeout=20)
                seen.append(("no error", 0.0))
            except Exception as e:
                seen.append((f"{type(e).__name__}: {e}", time.monotonic() - start))
        pg.all_reduce(x)
        report(r, [pg.backend_name, g.backend_name, bool(np.allclose(y, np.add.reduce(ins))),
                   bool(np.allclose(x, n * np.add.reduce(ins))), solo.is_member, seen])
        meshcoll.destroy()
    """, env={"MESHCOLL_MASTER_PORT": str(port), "MESHCOLL_TOKEN": "t" * 32})
    assert code == 0, out
    assert set(res) == {0, 1}, out
    for rank, value in res.items():
        assert value[:5] == ["cpu", "mpi", True, True, rank == 0], (rank, value)
        for asker, (seen, took) in enumerate(value[5]):
            assert seen.startswith(f"MismatchError: rank {rank}:"), (rank, asker, seen)
            other = 1 - asker
            assert "backend" in seen and f"'mpi' on rank {asker}" in seen \
                and f"'cpu' on rank {other}" in seen, seen
            assert took < 3, (rank, asker, took)


# Two emulated hosts of two ranks (Note [Hierarchy on MPI] in csrc/mpi/mpi_backend.h): the
# host identity is set from the launcher's rank before the world is made.
FAKE_HOSTS = """
        os.environ["MESHCOLL_HOST_ID"] = "AABB"[int(os.environ["OMPI_COMM_WORLD_RANK"])]
        meshcoll._C.reload_config()"""


@pytest.mark.timeout(60)
def test_hierarchy_across_emulated_hosts(tmp_path):
    """A world on MPI over two emulated hosts of two ranks: all_reduce, broadcast and
    all_gather run in shared memory inside each host and over MPI between the two leaders,
    as one call of the group (its ledger says "via hierarchy"); sync and async, against
    numpy on random data, every rank ending with the same bytes."""
    code, out, res = mpi_job(tmp_path, FAKE_HOSTS + """
        import hashlib, ml_dtypes
        pg = meshcoll.init(backend="mpi", timeout=20)
        r, n = pg.rank, pg.size
        h = pg._hier
        shape = None if h is None else [h.local.size, h.local.backend_name, h.local.transport,
                                        h.leaders.is_member and h.leaders.backend_name]
        bad, digest = [], hashlib.sha256()
        def data(rank, count, dt, salt):
            return rand_array(np.random.default_rng([salt, rank]), count, dt)
        cases = [("float32", "sum", 1e-5), ("int32", "avg", 0), ("int64", "max", 0),
                 ("bfloat16", "sum", 5e-2), ("float64", "prod", 1e-12)]
        for salt, (name, op, tol) in enumerate(cases):
            dt = ml_dtypes.bfloat16 if name == "bfloat16" else np.dtype(name)
            for count in (0, 1, 1031, 70_000):
                ins = [[data(q, count, dt, 100 * salt + k) for q in range(n)] for k in range(3)]
                if op == "prod":
                    ins = [[np.random.default_rng([salt, q, k]).uniform(0.9, 1.1, count)
                            for q in range(n)] for k in range(3)]
                xs = [a[r].copy() for a in ins]
                works = [pg.all_reduce(x, op=op, async_op=True) for x in xs[:2]]
                pg.all_reduce(xs[2], op=op)  # queued behind the async ones
                for w in works:
                    w.wait()
                for k, x in enumerate(xs):
                    wide = np.stack(ins[k]).astype(np.float64 if name != "int64" else np.int64)
                    if op == "avg":  # ints truncate toward zero, as the kernels do
                        s = np.stack(ins[k]).astype(np.int64).sum(0)
                        want = np.sign(s) * (np.abs(s) // n)
                    else:
                        want = {"sum": wide.sum(0), "max": wide.max(0), "prod": wide.prod(0)}[op]
                    if not np.allclose(x.astype(np.float64), want, rtol=tol, atol=tol):
                        bad.append(f"all_reduce {name} {op} count={count} call {k}")
                    digest.update(x.tobytes())
        for root in range(n):
            ins = [data(q, 5000, np.float32, 50 + root) for q in range(n)]
            x = ins[r].copy()
            if root % 2:
                pg.broadcast(x, root, async_op=True).wait()
            else:
                pg.broadcast(x, root)
            if not np.array_equal(x, ins[root]):
                bad.append(f"broadcast root={root}")
        for shape_ in [(0,), (7,), (300, 3)]:
            ins = [data(q, int(np.prod(shape_)), np.float64, 77).reshape(shape_) for q in range(n)]
            if not np.array_equal(pg.all_gather(ins[r]), np.stack(ins)):
                bad.append(f"all_gather {shape_}")
        last = pg.recent_calls(1)[0]
        stats = pg.stats()
        report(r, {"shape": shape, "bad": bad, "digest": digest.hexdigest(), "last": last,
                   "calls": stats["all_reduce"].calls})
        meshcoll.destroy()
    """, n=4)
    assert code == 0, out
    assert set(res) == {0, 1, 2, 3}, out
    for rank, value in res.items():
        assert value["bad"] == [], (rank, value["bad"])
        assert value["shape"] == [2, "cpu", "shm", "mpi" if rank in (0, 2) else False], value
        assert value["last"].startswith("all_gather") and "via hierarchy" in value["last"], value
        assert value["calls"] == 5 * 4 * 3, value
    assert len({v["digest"] for v in res.values()}) == 1, "ranks ended with different bytes"


@pytest.mark.timeout(60)
def test_hierarchy_disagreement_and_a_rank_that_never_calls(tmp_path):
    """Strict check on the hierarchy: ranks whose all_reduce counts differ (rank 3 on the
    other host) all raise MismatchError before anything runs, and the job goes on. The async
    check (the default): MismatchError on every rank too, whichever host found it. Then
    rank 3 never issues an all_reduce: the others raise TimeoutError at the call's deadline
    naming rank 3, and the job ends by MPI_Abort (the leaders' step is left inside MPI)."""
    code, out, res = mpi_job(tmp_path, FAKE_HOSTS + """
        pg = meshcoll.init(backend="mpi", timeout=20)
        r = pg.rank
        seen = {"hier": pg._hier is not None}
        g = pg.new_group([0, 1, 2, 3], check="strict")
        seen["sub hier"] = g._hier is not None
        try:
            g.all_reduce(np.ones(8 if r == 3 else 4, np.float32))
            seen["strict"] = "no error"
        except Exception as e:
            seen["strict"] = f"{type(e).__name__}: {e}"
        g = pg.new_group([0, 1, 2, 3])  # the async check (the default)
        try:
            g.all_reduce(np.ones(8 if r == 3 else 4, np.float32))
            time.sleep(1.0)  # found within a few ms; the barrier raises it if the call did not
            g.barrier()
            seen["async"] = "no error"
        except Exception as e:
            seen["async"] = f"{type(e).__name__}: {e}"
        x = np.full(4, r + 1.0)
        pg.all_reduce(x)
        seen["after"] = x.tolist()
        report(r, seen)
        if r == 3:
            time.sleep(40)  # never issues the all_reduce; MPI_Abort ends this process
            report(r, "rank 3 went on")
        else:
            try:
                pg.all_reduce(np.ones(16, np.float32), timeout=2.0)
                seen["never"] = "no error"
            except Exception as e:
                seen["never"] = f"{type(e).__name__}: {e}"
            report(r, seen)
            time.sleep(2)  # the other survivors report too before MPI_Abort ends the job
        meshcoll.destroy()
    """, n=4, timeout=50)
    assert set(res) == {0, 1, 2, 3}, out
    for rank, seen in res.items():
        assert seen["hier"] and seen["sub hier"], (rank, seen)
        assert seen["strict"].startswith("MismatchError"), (rank, seen["strict"])
        assert "count=4" in seen["strict"] and "count=8" in seen["strict"], seen["strict"]
        # Found on host B's shared memory; host A hears it through the leaders' side channel,
        # which relays it as the MismatchError it is.
        assert seen["async"].startswith("MismatchError"), (rank, seen["async"])
        assert "rank 3 called all_reduce(count=8" in seen["async"], (rank, seen["async"])
        assert seen["after"] == [10.0] * 4, (rank, seen)
        if rank != 3:
            assert seen["never"].startswith("TimeoutError"), (rank, seen["never"])
            assert "hierarchical all_reduce timed out" in seen["never"], (rank, seen["never"])
            assert "rank(s) 3 never reported in" in seen["never"], (rank, seen["never"])
    assert code != 0, out  # the job was ended: rank 3 never went on


@pytest.mark.timeout(60)
def test_auto_picks_cpu_on_one_host_and_mpi_across_hosts(tmp_path):
    """init(backend="auto") under mpirun: the CPU backend when every rank is on one host
    (shared memory), MPI when the ranks sit on two (emulated) hosts; each world's all_reduce
    against numpy on random data."""
    body = """
        pg = meshcoll.init(backend="auto", timeout=20)
        r, n = pg.rank, pg.size
        ins = [rand_array(np.random.default_rng([9, q]), 513, np.float64) for q in range(n)]
        x = ins[r].copy()
        pg.all_reduce(x)
        report(r, [pg.backend_name, bool(np.allclose(x, np.add.reduce(ins)))])
        meshcoll.destroy()
    """
    spans = """
        os.environ["MESHCOLL_HOST_ID"] = "host-" + os.environ["OMPI_COMM_WORLD_RANK"]
        meshcoll._C.reload_config()"""
    for prelude, want in (("", "cpu"), (spans, "mpi")):
        job = tmp_path / want
        job.mkdir()
        code, out, res = mpi_job(job, prelude + body)
        assert code == 0, out
        assert res == {0: [want, True], 1: [want, True]}, (want, res, out[-2000:])
