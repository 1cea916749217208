"""Same-host shared memory: chosen automatically, nothing left in /dev/shm after a normal
exit or kill -9, and a clear fallback or error when /dev/shm is too small."""

import glob
import hashlib
import os
import signal
import time

import numpy as np
import pytest

import meshcoll

pytestmark = pytest.mark.timeout(90)


def _ours():
    return set(glob.glob("/dev/shm/meshcoll-*"))


def _transport_and_sum(pg):
    x = np.full(1000, pg.rank + 1.0)
    pg.all_reduce(x)
    return pg.transport, float(x[0])


def test_auto_picks_shm_and_leaves_nothing(run_ranks):
    before = _ours()
    res = run_ranks(3, _transport_and_sum)
    assert res == [("shm", 6.0)] * 3
    assert _ours() - before == set()


def test_tcp_can_be_forced(run_ranks):
    res = run_ranks(2, _transport_and_sum, transport="tcp")
    assert res == [("tcp", 3.0)] * 2


# The single-copy all_reduce from 16 KiB, whatever the world size (the table in
# cpu/algo/shm_collectives.cc starts it at 4-8 MiB from 3 ranks up): these tests reach it
# with small arrays.
SINGLE_COPY = {"MESHCOLL_SHM_SINGLE_COPY_BYTES": str(16 << 10)}


def _die_in_shm_all_reduce(pg):
    x = np.ones(1 << 18, np.float32)
    for i in range(100000):
        if pg.rank == 1 and i == 5:
            os.kill(os.getpid(), signal.SIGKILL)
        try:
            pg.all_reduce(x, timeout=5)
        except (meshcoll.PeerError, meshcoll.TimeoutError) as e:
            return type(e).__name__, str(e)
    return "no error", ""


# 1 MiB reads and writes peers' memory (Note [Single-copy all_reduce]); MESHCOLL_CMA=0 sends
# it through the data area.
@pytest.mark.parametrize("cma", ["1", "0"])
def test_kill9_in_shm_collective_fails_fast_and_leaves_nothing(run_ranks, cma):
    before = _ours()
    res = run_ranks(3, _die_in_shm_all_reduce, may_die=(1,), env={"MESHCOLL_CMA": cma,
                                                                  **SINGLE_COPY})
    for rank in (0, 2):
        kind, msg = res[rank]
        assert kind in ("PeerError", "TimeoutError"), res[rank]
        assert "rank 1" in msg, msg
        # Never past the op's own deadline: the death seen (PeerError), or the TimeoutError
        # that 5 s deadline gives, naming its length; a hang is the launcher's timeout.
        assert kind == "PeerError" or "5000 ms" in msg, msg
    assert _ours() - before == set()


def test_small_dev_shm_falls_back_to_tcp_with_the_reason(run_ranks):
    huge = str(1 << 50)  # no /dev/shm has room for this
    res = run_ranks(2, _transport_and_sum, env={"MESHCOLL_SHM_BYTES": huge})
    for transport, total in res:
        assert transport.startswith("tcp (") and "no room" in transport, transport
        assert total == 3.0


def _forced_shm(pg):
    return pg.transport


def test_small_dev_shm_with_shm_forced_is_an_error_naming_the_size(run_ranks):
    with pytest.raises(AssertionError, match=r"no room for \d+ bytes"):
        run_ranks(2, _forced_shm, transport="shm",
                  env={"MESHCOLL_SHM_BYTES": str(1 << 50)})


def _mismatch_in_shm(pg, base=10):
    x = np.ones(base + pg.rank, np.float32)
    with pytest.raises(meshcoll.MismatchError) as e:
        pg.all_reduce(x, timeout=30)
    return str(e.value)


def test_mismatch_detected_in_shared_memory(run_ranks):
    res = run_ranks(3, _mismatch_in_shm)
    # MismatchError is the witness of a prompt answer: the 30 s deadline would give a
    # TimeoutError.
    for msg in res:
        assert "count=10" in msg and ("count=11" in msg or "count=12" in msg), msg


def test_mismatch_detected_across_all_reduce_paths(run_ranks):
    # 245 + rank floats: rank 0 (980 bytes) in the slots, ranks 1 and 2 (984, 988 bytes) on
    # each side of the slot limit. Then 4095 + rank floats: 16 KiB - 4 through the data area,
    # 16 KiB and + 4 single-copy. Every path agrees on the call before it moves data.
    for base in (245, 4095):
        res = run_ranks(3, _mismatch_in_shm, base=base, env=SINGLE_COPY)
        for msg in res:  # MismatchError, not the 30 s deadline's TimeoutError
            assert "mismatch" in msg and f"count={base}" in msg, msg


# Byte sizes around every switch of shm_all_reduce: the slot payload (968 bytes), the
# single-copy threshold (16 KiB), and, with MESHCOLL_CMA=0, the fold-all limit (64 KiB read
# per rank) and several data-area rounds (4 MiB area: 2 MiB halves). 5 MiB + 8 also takes
# several single-copy pieces, the last one short.
PATH_BYTES = [0, 4, 960, 968, 976, 8 << 10, (16 << 10) - 8, 16 << 10, 32 << 10, 96 << 10,
              (2 << 20) + 8, (5 << 20) + 8]


def _all_reduce_paths(pg):
    n, rank = pg.size, pg.rank
    failures, digests = [], []
    for nbytes in PATH_BYTES:
        for dtype in (np.float32, np.float64):
            count = nbytes // np.dtype(dtype).itemsize
            # Exact: small integers sum exactly in any order.
            x = ((np.arange(count) % 7) + rank).astype(dtype)
            pg.all_reduce(x)
            want = (np.arange(count) % 7) * n + n * (n - 1) // 2
            if not np.array_equal(x, want.astype(dtype)):
                failures.append(f"{nbytes} bytes {np.dtype(dtype).name}: wrong sum")
            # Random values: every rank must end with the same bits.
            y = np.random.default_rng(nbytes + rank).standard_normal(count).astype(dtype)
            ref = sum(np.random.default_rng(nbytes + r).standard_normal(count).astype(np.float64)
                      for r in range(n))
            pg.all_reduce(y)
            if count and not np.allclose(y, ref, rtol=1e-5, atol=1e-5):
                failures.append(f"{nbytes} bytes {np.dtype(dtype).name}: random sum off")
            digests.append(hashlib.sha1(y.tobytes()).hexdigest())
    return {"failures": failures, "digests": digests, "transport": pg.transport}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("cma", ["1", "0"])
@pytest.mark.parametrize("world", [2, 3])
def test_all_reduce_on_every_shared_memory_path(run_ranks, world, cma):
    # MESHCOLL_CMA=0: large vectors take the data-area path instead of the single-copy one.
    res = run_ranks(world, _all_reduce_paths, timeout=100, env={"MESHCOLL_CMA": cma,
                                                                **SINGLE_COPY})
    for r in res:
        assert r["transport"] == "shm"
        assert not r["failures"], r["failures"]
        assert r["digests"] == res[0]["digests"]


def _blocking_behind_async(pg):
    # A blocking all_reduce issued while async ones are queued cannot run inline: it waits
    # its turn, and every result is right and in issue order.
    n = pg.size
    big = [np.full(1 << 20, float(pg.rank + k), np.float32) for k in range(3)]
    works = [pg.all_reduce(b, async_op=True) for b in big]
    small = np.full(3, float(pg.rank), np.float32)
    pg.all_reduce(small)
    for w in works:
        w.wait()
    tri = n * (n - 1) / 2
    return (all(float(b[0]) == tri + n * k and float(b[-1]) == tri + n * k
                for k, b in enumerate(big)) and small.tolist() == [tri] * 3)


def test_blocking_all_reduce_behind_async_ones(run_ranks):
    assert run_ranks(2, _blocking_behind_async) == [True, True]


def _reduce_scatter_rounds(pg, counts):
    # Every rank's input from its own seed; the reference folds all of them in float64.
    data = [np.random.default_rng(100 + r).standard_normal((sum(counts), 3)) for r in range(pg.size)]
    total = np.sum(data, axis=0)
    out = pg.reduce_scatter_v(data[pg.rank], counts)
    start = sum(counts[:pg.rank])
    np.testing.assert_allclose(out, total[start:start + counts[pg.rank]], rtol=1e-12)
    even = pg.reduce_scatter(data[pg.rank][: 6 * pg.size], op="max")
    ref = np.max([d[: 6 * pg.size] for d in data], axis=0)[6 * pg.rank: 6 * pg.rank + 6]
    np.testing.assert_array_equal(even, ref)
    return pg.transport


@pytest.mark.parametrize("world", [2, 3])
def test_reduce_scatter_in_many_shared_memory_rounds(run_ranks, world):
    # A 4 KiB area: every block takes several rounds; block sizes differ, one is empty.
    counts = [700, 0, 333][:world] if world == 3 else [700, 333]
    res = run_ranks(world, _reduce_scatter_rounds, counts=counts,
                    env={"MESHCOLL_SHM_BYTES": "4096"})
    assert res == ["shm"] * world


def _all_to_all_rounds(pg):
    data = [np.random.default_rng(200 + r).standard_normal((pg.size * 300, 2)) for r in range(pg.size)]
    out = pg.all_to_all(data[pg.rank])
    ref = np.concatenate([d[300 * pg.rank: 300 * (pg.rank + 1)] for d in data])
    np.testing.assert_array_equal(out, ref)
    return pg.transport


@pytest.mark.parametrize("world", [2, 3])
def test_all_to_all_in_many_shared_memory_rounds(run_ranks, world):
    res = run_ranks(world, _all_to_all_rounds, env={"MESHCOLL_SHM_BYTES": "4096"})
    assert res == ["shm"] * world


def test_setup_sweeps_segments_left_by_dead_jobs(run_ranks):
    import subprocess
    import sys
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True).stdout.strip()
    stale = f"/dev/shm/meshcoll-{dead}-1-0"  # what a rank killed mid-setup leaves
    with open(stale, "wb") as f:
        f.write(b"x" * 64)
    run_ranks(2, _transport_and_sum)
    assert not os.path.exists(stale)


def _stopped_peer_resumes_after_a_timeout(pg):
    # Rank 1 stops itself mid all_reduce (a thread sends SIGSTOP while the call runs without
    # the GIL); rank 0 times out, returns, and refills its array with a sentinel; then it
    # resumes rank 1. Nothing may land in rank 0's array after its call returned (Note
    # [Cross-memory attach]), and rank 1 must fail rather than return what it read.
    import threading
    pids = pg.all_gather(np.array([os.getpid()], np.int64)).ravel()
    x = np.random.default_rng(pg.rank).standard_normal(32 << 20).astype(np.float32)
    pg.barrier()
    if pg.rank == 1:
        threading.Timer(0.01, os.kill, (os.getpid(), signal.SIGSTOP)).start()
    try:
        pg.all_reduce(x, timeout=2)
        outcome = "returned"
    except meshcoll.MeshcollError as e:
        outcome = type(e).__name__
    if pg.rank == 1:
        return outcome, 0
    x.fill(7.0)
    os.kill(int(pids[1]), signal.SIGCONT)
    written = 0
    end = time.monotonic() + 2
    while time.monotonic() < end:
        written = max(written, int(np.count_nonzero(x != 7.0)))
        time.sleep(0.01)
    return outcome, written


def test_a_stopped_peer_never_writes_into_a_returned_call(run_ranks):
    # 128 MiB per rank: the stop, 10 ms in, lands inside the call (a try whose call finished
    # first proves nothing, and is run again).
    for _ in range(3):
        res = run_ranks(2, _stopped_peer_resumes_after_a_timeout, timeout=60)
        if res[0][0] != "returned":
            break
    assert res[0] == ("TimeoutError", 0), res
    assert res[1][0] != "returned", res
