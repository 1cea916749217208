"""Diagnosis (issue 9.2): a timeout names the collective (kind, sequence number, count) and the
rank that never arrived, over TCP and over shared memory; ``monitored_barrier`` names the ranks
that did not reach it, even on a group whose connections are aborted; ``MESHCOLL_DEBUG=1``
writes one stderr line per collective with its sequence number, algorithm, bytes and time.

Everything runs in ONE 3-rank job (module fixture ``job``) to keep the suite fast on small
machines: the job makes a TCP group and a shared-memory group over all ranks (the transport
is read from MESHCOLL_TRANSPORT when a group is created), and rank 2 "gets stuck elsewhere"
by skipping a call on one group and waiting in a barrier on the healthy world group instead.
Each rank's fd 2 goes to a file, so the C++ debug lines can be read back.
"""

import os
import re
import sys
import time

import numpy as np
import pytest

import meshcoll
from conftest import group_on, launch
from meshcoll.monitor import monitored_barrier

pytestmark = pytest.mark.timeout(60)

SLOW = 1.0      # timeout of the rank that must notice first (seconds)
PATIENT = 6.0   # timeout of the others: they learn of the failure through the ABORT frame
COUNT = 1031    # a count no other call in the job uses
WORLD_WAIT = 30.0

LINE = re.compile(r"meshcoll\[rank (\d+)/(\d+)\] (\w+)\((.*?)\) seq=(\d+) algo=(\S+) "
                  r"bytes=(\d+) time=(\d+)us")


def _timed(fn):
    t0 = time.monotonic()
    try:
        fn()
    except meshcoll.MeshcollError as e:
        return type(e).__name__, str(e), time.monotonic() - t0
    return None, "", time.monotonic() - t0


def _verified_ops(g, rng_seed, wrong):
    """A few collectives whose debug lines the test checks, each verified against numpy."""
    n, r = g.size, g.rank
    inputs = [np.random.default_rng(rng_seed + k).standard_normal(COUNT).astype(np.float32)
              for k in range(n)]
    x = inputs[r].copy()
    g.all_reduce(x, algorithm="ring" if g.transport == "tcp" else None, timeout=WORLD_WAIT)
    if not np.allclose(x, np.sum(inputs, axis=0, dtype=np.float64), rtol=1e-5, atol=1e-5):
        wrong.append(f"{g.transport} all_reduce wrong")
    b = np.random.default_rng(rng_seed + 100 + r).integers(-9, 9, 5)
    want = np.random.default_rng(rng_seed + 100 + 1).integers(-9, 9, 5)
    g.broadcast(b, 1, timeout=WORLD_WAIT)
    if not np.array_equal(b, want):
        wrong.append(f"{g.transport} broadcast wrong")
    got = g.all_gather(np.arange(7, dtype=np.float64) * (r + 1), timeout=WORLD_WAIT)
    if not np.array_equal(got, np.arange(7) * np.arange(1, n + 1)[:, None]):
        wrong.append(f"{g.transport} all_gather wrong")


def _job(pg, log_dir):
    rank = pg.rank
    log = open(os.path.join(log_dir, f"rank{rank}.log"), "w")
    saved = os.dup(2)
    os.dup2(log.fileno(), 2)
    out = {"wrong": []}
    try:
        g_tcp = group_on(pg, "tcp")
        g_shm = group_on(pg, "shm")
        g_tree = group_on(pg, "tcp")
        out["transports"] = (g_tcp.transport, g_shm.transport)

        # Debug lines: seq 1..3 on each group, all verified.
        _verified_ops(g_tcp, 10, out["wrong"])
        _verified_ops(g_shm, 20, out["wrong"])
        pg.barrier(timeout=WORLD_WAIT)

        # A timeout on each transport: rank 2 never calls seq 4; rank 0 notices first.
        for name, g in (("tcp", g_tcp), ("shm", g_shm)):
            if rank != 2:
                x = np.ones(COUNT, np.float32)
                out[f"timeout {name}"] = _timed(
                    lambda: g.all_reduce(x, timeout=SLOW if rank == 0 else PATIENT))
            pg.barrier(timeout=WORLD_WAIT)

        # Rank 1 times out first, waiting for rank 0 (which itself waits for rank 2): the
        # error should still lead to rank 2, the one that never arrived.
        if rank != 2:
            x = np.ones(COUNT, np.float32)
            out["timeout downstream"] = _timed(lambda: g_tree.all_reduce(
                x, algorithm="tree", timeout=SLOW if rank == 1 else PATIENT))
        pg.barrier(timeout=WORLD_WAIT)

        # monitored_barrier: rank 2 arrives late (after ranks 0 and 1 gave up), then all meet.
        if rank != 2:
            out["monitored late"] = _timed(lambda: monitored_barrier(timeout=SLOW))
        pg.barrier(timeout=WORLD_WAIT)
        if rank == 2:  # its call #0 finds the others' keys of call #0: it passes at once
            out["monitored catch-up"] = _timed(lambda: monitored_barrier(timeout=WORLD_WAIT))
        out["monitored again"] = _timed(lambda: monitored_barrier(timeout=WORLD_WAIT))
        # Two ranks missing, on a group whose connections are aborted.
        if rank == 0:
            out["monitored two missing"] = _timed(lambda: monitored_barrier(g_tree, timeout=0.5))
        pg.barrier(timeout=WORLD_WAIT)
        if rank != 0:
            out["monitored aborted catch-up"] = _timed(
                lambda: monitored_barrier(g_tree, timeout=WORLD_WAIT))
        out["monitored aborted"] = _timed(lambda: monitored_barrier(g_tcp, timeout=WORLD_WAIT))
        pg.barrier(timeout=WORLD_WAIT)
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)
        log.close()
    with open(os.path.join(log_dir, f"rank{rank}.log")) as f:
        out["log"] = f.read()
    return out


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    log_dir = str(tmp_path_factory.mktemp("diag"))
    return launch(3, _job, timeout=50, env={"MESHCOLL_DEBUG": "1"}, log_dir=log_dir)


def names_rank(msg, r):
    """The message says rank r had not arrived / was waited for ("rank 2", "rank(s) 2, ...")."""
    return re.search(rf"(from|to|rank\(s\)|rank) {r}\b(?! of )", msg) is not None


def test_values_and_transports(job):
    for rank, r in enumerate(job):
        assert r["transports"] == ("tcp", "shm"), r["transports"]
        assert not r["wrong"], (rank, r["wrong"])


def _debug_lines(log, failed=True):
    """Parsed MESHCOLL_DEBUG lines; failed=False leaves out the operations that FAILED."""
    return [LINE.search(line).groups() for line in log.splitlines()
            if LINE.search(line) and (failed or "FAILED" not in line)]


def _verified_seqs(log):
    """Sequence numbers of the verified all_reduce / broadcast / all_gather triples, in order
    (TCP group first, then shared memory). Group creation may itself run collectives (a
    barrier), so numbers are found, not assumed."""
    ops = [(kind, args, int(seq)) for _, _, kind, args, seq, _, _, _ in _debug_lines(log)]
    found = []
    for i in range(len(ops) - 2):
        (k0, a0, s0), (k1, a1, s1), (k2, a2, s2) = ops[i:i + 3]
        if (k0, a0, k1, a1, k2, a2) == ("all_reduce", f"count={COUNT}, float32, sum",
                                        "broadcast", "count=5, int64, root=1",
                                        "all_gather", "count=21, float64"):
            assert (s1, s2) == (s0 + 1, s0 + 2), ops[i:i + 3]
            found.append(s0)
    return found


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_timeout_names_collective_seq_and_missing_rank(job, transport):
    for rank in (0, 1):
        kind, msg, elapsed = job[rank][f"timeout {transport}"]
        assert kind == "TimeoutError", (rank, kind, msg)
        assert msg.startswith("all_reduce("), msg
        assert f"count={COUNT}, float32, sum" in msg, msg
        first = _verified_seqs(job[rank]["log"])
        assert len(first) == 2, job[rank]["log"]
        seq = first[0 if transport == "tcp" else 1] + 3  # the call after the verified three
        assert f"[seq {seq}]" in msg, (seq, msg)
        assert names_rank(msg, 2), f"rank {rank}: rank 2 not named: {msg}"
        # Rank 0 by its own 1 s timeout; rank 1 through rank 0's ABORT, not its own 6 s one:
        # both carry rank 0's deadline (the message, not the wall clock, is the witness).
        assert f"rank 0 timed out after {int(SLOW * 1000)} ms" in msg, (rank, msg)
        assert f"{int(PATIENT * 1000)} ms" not in msg, (rank, msg)


def test_timeout_downstream_still_names_missing_rank(job):
    for rank in (0, 1):
        kind, msg, _ = job[rank]["timeout downstream"]
        assert kind == "TimeoutError", (rank, kind, msg)
        # Rank 1's 1 s deadline reached rank 0 through the ABORT, not rank 0's own 6 s one
        # (the message, not the wall clock, is the witness).
        assert f"rank 1 timed out after {int(SLOW * 1000)} ms" in msg, (rank, msg)
        assert f"{int(PATIENT * 1000)} ms" not in msg, (rank, msg)
        assert names_rank(msg, 2), f"rank {rank}: rank 2 not named: {msg}"


def test_monitored_barrier_names_missing_ranks(job):
    for rank in (0, 1):
        kind, msg, _ = job[rank]["monitored late"]
        assert kind == "TimeoutError", (rank, kind, msg)
        assert "global rank 2 did not reach it" in msg and "'world'" in msg, msg
        assert f"within {SLOW:g} s" in msg, msg  # its own deadline ended the wait
    kind, msg, _ = job[0]["monitored two missing"]
    assert kind == "TimeoutError" and "global ranks 1, 2 did not reach" in msg, msg
    for rank, r in enumerate(job):
        # A late rank passes at once; the next call (counter 1) meets on every rank; the
        # barrier works on groups whose connections were aborted by the timeouts above.
        for step in ("monitored again", "monitored aborted"):
            assert r[step][0] is None, (rank, step, r[step])
        if rank:
            assert r["monitored aborted catch-up"][0] is None, (rank, r)
    assert job[2]["monitored catch-up"][0] is None and job[2]["monitored catch-up"][2] < 1, job[2]


def test_monitored_barrier_arguments():
    with pytest.raises(RuntimeError, match="not initialised"):
        monitored_barrier()
    from meshcoll.process_group import NonMemberGroup
    with pytest.raises(RuntimeError, match="not a member"):
        monitored_barrier(NonMemberGroup([1, 2], "world.0"))


def test_debug_logs_every_collective(job):
    for rank, r in enumerate(job):
        lines = _debug_lines(r["log"], failed=False)
        assert lines, f"rank {rank}: no MESHCOLL_DEBUG lines in:\n{r['log']}"
        for fields in lines:
            assert fields[0] == str(rank) and fields[1] == "3", fields
            assert int(fields[7]) >= 0 and fields[5], fields
        # The verified ops of each group: consecutive sequence numbers, the algorithm and
        # the bytes (all_reduce/broadcast: the buffer; all_gather: the output).
        assert len(_verified_seqs(r["log"])) == 2, r["log"]
        by = {}
        for _, _, kind, args, seq, algo, nbytes, _ in lines:
            by.setdefault((kind, args), []).append((int(seq), algo, int(nbytes)))
        ar = by[("all_reduce", f"count={COUNT}, float32, sum")]
        assert [(a, b) for _, a, b in ar] == [("ring", 4 * COUNT), (ar[1][1], 4 * COUNT)], ar
        assert ar[1][1] not in ("ring", "tcp"), ar  # the shared-memory group's algorithm
        assert [b for _, _, b in by[("broadcast", "count=5, int64, root=1")]] == [40, 40]
        assert [b for _, _, b in by[("all_gather", "count=21, float64")]] == [168, 168]
        # The world group's barriers between the phases: at least six, numbered in order.
        world = [int(seq) for _, _, kind, _, seq, _, _, _ in lines if kind == "barrier"]
        assert len(world) >= 6 and world[-1] >= 6, world


def test_debug_logs_the_failed_collective(job):
    for rank in (0, 1):
        first = _verified_seqs(job[rank]["log"])
        seqs = [(kind, int(seq)) for _, _, kind, _, seq, _, _, _ in _debug_lines(job[rank]["log"])]
        for s0 in first:  # the TCP and the shm timeouts
            assert ("all_reduce", s0 + 3) in seqs, seqs
