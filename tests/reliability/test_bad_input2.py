"""Bad input, part 2 (issue 9.3; tests/collectives/test_bad_input.py has the per-argument
checks): 0-d arrays, calls before init and after destroy, init twice, roots that are global
but not group ranks, shapes that differ across ranks, a master port already used by another
job, an unreachable master, and counts over 2**31 elements (marked ``large``, run with
MESHCOLL_LARGE_TESTS=1: ~20 s and ~9 GB peak per transport here).

The in-job cases share one 3-rank job (module fixture ``job``) with a TCP group and a
shared-memory group made in it (MESHCOLL_TRANSPORT is read when a group is created).
"""

import multiprocessing as mp
import os
import re
import time

import numpy as np
import pytest

import meshcoll
from conftest import free_port, group_on, launch

pytestmark = pytest.mark.timeout(60)

CALL = 30.0  # generous per-call timeout: errors must come from checks, not from timeouts


def _outcome(fn):
    t0 = time.monotonic()
    try:
        value = fn()
    except Exception as e:  # noqa: BLE001 - the class is what the test checks
        return type(e).__name__, str(e), time.monotonic() - t0, None
    return None, "", time.monotonic() - t0, value


def _zero_d(g, seed, wrong):
    """Every collective that takes a 0-d array, checked against numpy on random values."""
    n, r = g.size, g.rank
    rng = np.random.default_rng(seed)
    f = rng.standard_normal(n)
    i = rng.integers(-1000, 1000, n)
    tag = g.transport

    x = np.array(f[r])
    g.all_reduce(x, timeout=CALL)
    if x.shape != () or not np.isclose(x, f.sum()):
        wrong.append(f"{tag}: all_reduce 0-d gave {x!r}, expected {f.sum()}")
    y = np.array(i[r], np.int32)
    g.all_reduce(y, "max", timeout=CALL)
    if y.shape != () or int(y) != i.max():
        wrong.append(f"{tag}: all_reduce max 0-d gave {y!r}, expected {i.max()}")
    got = g.all_gather(np.array(i[r], np.int64), timeout=CALL)
    if got.shape != (n,) or got.tolist() != i.tolist():
        wrong.append(f"{tag}: all_gather 0-d gave {got!r} (shape {got.shape}), expected {i}")
    b = np.array(f[r], np.float32)
    g.broadcast(b, 1, timeout=CALL)
    if b.shape != () or b != np.float32(f[1]):
        wrong.append(f"{tag}: broadcast 0-d gave {b!r}, expected {np.float32(f[1])}")
    d = np.array(i[r], np.int64)
    g.reduce(d, n - 1, timeout=CALL)
    if int(d) != (i.sum() if r == n - 1 else i[r]):
        wrong.append(f"{tag}: reduce 0-d gave {d!r} on rank {r}")
    gat = g.gather(np.array(f[r]), 0, timeout=CALL)
    if r == 0 and (gat.shape != (n,) or not np.array_equal(gat, f)):
        wrong.append(f"{tag}: gather 0-d gave {gat!r}")
    sc = g.scatter(f if r == 0 else None, 0, out=None if r == 0 else np.empty(()), timeout=CALL)
    if sc.shape != () or sc != f[r]:
        wrong.append(f"{tag}: scatter to 0-d gave {sc!r}, expected {f[r]}")
    recv = np.empty((), np.int64)
    w = g.isend(np.array(i[r], np.int64), (r + 1) % n, timeout=CALL)
    g.recv(recv, (r - 1) % n, timeout=CALL)
    w.wait()
    if int(recv) != i[(r - 1) % n]:
        wrong.append(f"{tag}: send/recv 0-d gave {recv!r}")
    # all_gather_v has no axis 0 to concatenate along: ValueError on every rank, nothing sent.
    err = _outcome(lambda: g.all_gather_v(np.array(1.0), timeout=CALL))
    if err[0] != "ValueError" or "0-d" not in err[1]:
        wrong.append(f"{tag}: all_gather_v 0-d: {err[:2]}")


def _fresh_case(pg, call, transport):
    """Run ``call(g)`` on a fresh group (a mismatch aborts it); report what this rank saw."""
    g = group_on(pg, transport)
    pg.barrier(timeout=CALL)
    kind, msg, elapsed, value = _outcome(lambda: call(g))
    after = _outcome(lambda: g.all_reduce(np.ones(3), timeout=CALL))
    g.destroy()
    return {"error": kind, "message": msg, "elapsed": elapsed,
            "value": None if value is None else (value.shape, value.tolist()),
            "after": after[0]}


def _job(pg):
    rank, n = pg.rank, pg.size
    out = {"wrong": []}
    g_tcp, g_shm = group_on(pg, "tcp"), group_on(pg, "shm")
    out["transports"] = (g_tcp.transport, g_shm.transport)

    for k, g in enumerate((g_tcp, g_shm)):
        _zero_d(g, 1000 + k, out["wrong"])

    out["init twice"] = _outcome(lambda: meshcoll.init(rank=rank, world_size=n,
                                                       master_addr="127.0.0.1", master_port=1))[:2]

    # Ranks given to a group's methods are group ranks: global rank 2 is member 1 of [1, 2].
    sub = pg.new_group([1, 2])
    x = np.full(4, rank + 1.0)
    if rank == 0:
        out["non-member"] = _outcome(lambda: sub.reduce(x, 0))[:2]
    else:
        out["sub roots"] = {
            "reduce": _outcome(lambda: sub.reduce(x, 2))[:2],
            "gather": _outcome(lambda: sub.gather(x, 2))[:2],
            "scatter": _outcome(lambda: sub.scatter(np.zeros((2, 4)), 2))[:2],
            "broadcast": _outcome(lambda: sub.broadcast(x, -1))[:2],
        }
        sub.reduce(x, np.int64(1), timeout=CALL)  # a numpy integer root is fine
        out["sub reduce"] = x.tolist()
    pg.barrier(timeout=CALL)

    cases = {
        "rows": lambda g: g.all_gather(np.ones((2 + g.rank, 3), np.float32), timeout=CALL),
        "dtype": lambda g: g.all_gather(np.ones(6, np.int32 if g.rank == 1 else np.float32),
                                        timeout=CALL),
        "same count": lambda g: g.all_gather(
            np.arange(6, dtype=np.float32).reshape((2, 3) if g.rank == 0 else (3, 2)),
            timeout=CALL),
        "all_gather_v trailing": lambda g: g.all_gather_v(np.ones((2, 3 + g.rank)), timeout=CALL),
    }
    out["cases"] = {(name, t): _fresh_case(pg, call, t)
                    for name, call in cases.items() for t in ("tcp", "shm")}

    # After destroy: the module functions and the old group objects raise RuntimeError.
    pg.barrier(timeout=CALL)
    meshcoll.destroy()
    y = np.ones(3)
    out["after destroy"] = {
        "module all_reduce": _outcome(lambda: meshcoll.all_reduce(y))[:2],
        "get_rank": _outcome(meshcoll.get_rank)[:2],
        "world all_reduce": _outcome(lambda: pg.all_reduce(y))[:2],
        "world barrier": _outcome(lambda: pg.barrier())[:2],
        "subgroup broadcast": _outcome(lambda: g_tcp.broadcast(y, 0))[:2],
    }
    # ... and init works again (a one-rank world of its own).
    pg2 = meshcoll.init(rank=0, world_size=1, master_addr="127.0.0.1", master_port=0, timeout=10)
    z = np.full(5, 7.0)
    meshcoll.all_reduce(z)
    out["re-init"] = (pg2.size, z.tolist())
    meshcoll.destroy()
    return out


@pytest.fixture(scope="module")
def job():
    return launch(3, _job, timeout=50)


def test_zero_d_arrays(job):
    for rank, r in enumerate(job):
        assert r["transports"] == ("tcp", "shm"), r["transports"]
        assert not r["wrong"], (rank, r["wrong"])


def test_init_twice_after_destroy_and_reinit(job):
    for r in job:
        kind, msg = r["init twice"]
        assert kind == "RuntimeError" and "already" in msg and "destroy" in msg, (kind, msg)
        d = r["after destroy"]
        for what in ("module all_reduce", "get_rank"):
            assert d[what][0] == "RuntimeError" and "not initialised" in d[what][1], (what, d[what])
        for what in ("world all_reduce", "world barrier", "subgroup broadcast"):
            kind, msg = d[what]
            # AbortedError is a RuntimeError (MeshcollError derives from it).
            assert kind in ("AbortedError", "RuntimeError") and "destroyed" in msg, (what, d[what])
        assert r["re-init"] == (1, [7.0] * 5)


def test_root_out_of_range_in_a_subgroup(job):
    kind, msg = job[0]["non-member"]
    assert kind == "RuntimeError" and "not a member" in msg, (kind, msg)
    for rank in (1, 2):
        for what, (kind, msg) in job[rank]["sub roots"].items():
            assert kind == "ValueError", (rank, what, kind, msg)
            assert re.search(r"\b(2|-1)\b", msg) and "out of range" in msg, (what, msg)
    assert job[1]["sub reduce"] == [2.0] * 4      # rank 1 is member 0: unchanged
    assert job[2]["sub reduce"] == [5.0] * 4      # rank 2 is member 1, the root: 2 + 3


@pytest.mark.parametrize("transport", ["tcp", "shm"])
@pytest.mark.parametrize("case", ["rows", "dtype", "all_gather_v trailing"])
def test_all_gather_shapes_differ(job, case, transport):
    for rank, r in enumerate(job):
        c = r["cases"][(case, transport)]
        # The class is the witness of a prompt answer: waiting out the call's deadline would
        # be a TimeoutError.
        assert c["error"] == "MismatchError", (rank, c)
        if case == "all_gather_v trailing":
            # Found from the exchanged row sizes, the same on every rank: nothing is aborted.
            assert "[3, 4, 5]" in c["message"] and c["after"] is None, (rank, c)
        else:
            assert len(set(re.findall(r"rank (\d+)", c["message"]))) >= 2, c["message"]
            assert c["after"] in ("AbortedError", "MismatchError"), (rank, c)


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_all_gather_same_count_different_shape(job, transport):
    for rank, r in enumerate(job):
        assert r["cases"][("same count", transport)]["error"] == "MismatchError", (rank, r)


def _members_differ(pg):
    # Rank 0 leaves rank 2 out of the new group; ranks 1 and 2 put it in.
    ranks = [0, 1] if pg.rank == 0 else [0, 1, 2]
    kind, msg, _, _ = _outcome(lambda: pg.new_group(ranks, timeout=3))
    return kind, msg


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_ranks_that_pass_new_group_different_members_get_an_error_that_says_so(transport):
    # Each side sees only that the other sets up another group (the TCP handshake compares
    # the group's name and size before the members lists can meet): rank 0 waits for a rank 1
    # it refused, ranks 1 and 2 are refused at once. Every message says what must agree.
    res = launch(3, _members_differ, timeout=60, transport=transport)
    for rank, (kind, msg) in enumerate(res):
        assert kind in ("TimeoutError", "PeerError"), (rank, kind, msg)
        assert "new_group with the same ranks" in msg, (rank, msg)
    # The witnesses of no waiting beyond the group's own 3 s: rank 0's deadline is that one,
    # and the others are refused (a PeerError), not timed out.
    assert res[0][0] == "TimeoutError" and "another group" in res[0][1], res[0]
    assert "within 3000 ms" in res[0][1], res[0]
    assert res[1][0] == res[2][0] == "PeerError", res
    assert "rank 1: handshake with rank 0 was refused" in res[1][1], res[1]


def _stand_in(pg):
    # Lists of the same length: global rank 3 claims the place of rank 2, which every other
    # rank gives to rank 2. One of the two is refused at the handshake, whichever comes
    # second; if rank 3 got in, the members' lists (Note [Shared settings]) must catch it.
    ranks = [0, 1, 3] if pg.rank == 3 else [0, 1, 2]
    kind, msg, _, g = _outcome(lambda: pg.new_group(ranks, timeout=5))
    if kind is None:
        x = np.full(4, float(pg.rank))
        g.all_reduce(x)
        return None, ranks, float(x[0])
    return kind, msg, None


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_a_rank_cannot_stand_in_for_another_in_a_group(transport):
    res = launch(4, _stand_in, timeout=60, transport=transport)
    ok = {r: out for r, out in enumerate(res) if out[0] is None}
    for r, (_, ranks, total) in ok.items():
        # A group that formed has members that all agree on it, and sums over them.
        assert all(m in ok and ok[m][1] == ranks for m in ranks), res
        assert total == float(sum(ranks)), res
    assert 3 not in ok, res  # rank 3 is never in: the others gave its place to rank 2
    # Refused at the handshake, or after the others closed their listeners: told why, at once.
    assert res[3][0] in ("MismatchError", "PeerError"), res[3]
    assert "new_group with the same ranks" in res[3][1] or "[0, 1, 3]" in res[3][1], res[3]
    for r, out in enumerate(res):
        if out[0] is not None:
            assert out[0] in ("MismatchError", "PeerError", "TimeoutError"), (r, out)
            if out[0] == "MismatchError":  # named by who published each list
                assert "[0, 1, 2] on rank 0, 1 but [0, 1, 3] on rank 3" in out[1], (r, out)


def _skips_a_call(pg):
    # Rank 2, a non-member, skips new_group([0, 1]): its next group is named as the others'
    # previous one (Note [Calls out of step] in process_group.py).
    if pg.rank != 2:
        pg.new_group([0, 1])
    kind, msg, _, _ = _outcome(lambda: pg.new_group([0, 1, 2], timeout=3))
    rng = np.random.default_rng([5, pg.rank])
    x = rng.standard_normal(64)
    pg.all_reduce(x)  # the parent group is unharmed
    want = sum(np.random.default_rng([5, r]).standard_normal(64) for r in range(pg.size))
    return kind, msg, bool(np.allclose(x, want))


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_a_rank_that_skips_a_new_group_call_is_named_on_every_rank(transport):
    res = launch(3, _skips_a_call, timeout=60, transport=transport)
    for rank, (kind, msg, parent_ok) in enumerate(res):
        assert kind in ("TimeoutError", "PeerError"), (rank, kind, msg)
        assert "group calls may be out of step" in msg, (rank, msg)
        assert parent_ok, rank
    for rank in (0, 1):  # named: who is behind, and at which call
        assert ("global rank(s) 2 last called new_group([0, 1, 2]) (group 'world.0')"
                in res[rank][1]), res[rank]
    assert "this rank called new_group([0, 1, 2]) (group 'world.0')" in res[2][1], res[2]


def test_calls_before_init_raise_runtime_error():
    from meshcoll.monitor import monitored_barrier
    assert not meshcoll.is_initialized()
    x = np.ones(3)
    for call in (lambda: meshcoll.all_reduce(x), lambda: meshcoll.broadcast(x, 0),
                 meshcoll.barrier, meshcoll.get_rank, meshcoll.get_world_size,
                 lambda: meshcoll.new_group([0]), monitored_barrier):
        with pytest.raises(RuntimeError, match=r"not initialised: call meshcoll.init\(\) first"):
            call()
    meshcoll.destroy()  # destroy without init is a no-op, not an error
    assert x.tolist() == [1.0] * 3


# ---- rendezvous failures: each case in its own spawned process ------------------------------

def _init_outcome(rank, world, addr, port, token, timeout):
    os.environ["MESHCOLL_TOKEN"] = token
    t0 = time.monotonic()
    try:
        meshcoll.init(rank=rank, world_size=world, master_addr=addr, master_port=port,
                      timeout=timeout)
    except Exception as e:  # noqa: BLE001
        return type(e).__name__, str(e), time.monotonic() - t0, meshcoll.is_initialized()
    return None, "", time.monotonic() - t0, True


def test_port_in_use_and_unreachable_master():
    # Job A's rank 0 hosts its store on the port job B was also given.
    job_a = meshcoll.TCPStore("127.0.0.1", 0, is_server=True, timeout=10, token="job-a")
    job_a.set("mc/world/keep", b"job a's data")
    closed = free_port()  # nothing listens there
    cases = [
        (0, 2, "127.0.0.1", job_a.port, "job-b", 5.0),  # B's rank 0 cannot bind A's port
        (1, 2, "127.0.0.1", job_a.port, "job-b", 5.0),  # B's rank 1 reaches A's store
        (1, 2, "127.0.0.1", closed, "t", 1.5),           # the master is not there
        (0, 2, "192.0.2.1", free_port(), "t", 1.5),      # rank 0: not one of our addresses
    ]
    with mp.get_context("spawn").Pool(len(cases)) as pool:
        res = pool.starmap(_init_outcome, cases)
    (k0, m0, _, i0), (k1, m1, _, i1), (k2, m2, _, i2), (k3, m3, _, i3) = res
    # The classes and messages are the witnesses: a port in use, a rejected token and a
    # foreign address are answered at once (not TimeoutError); an absent master is retried
    # until init's own 1.5 s deadline, which its message names.
    assert k0 in ("MeshcollError", "PeerError") and re.search("in use|another process", m0), res[0]
    assert k1 == "PeerError" and "token" in m1, res[1]
    assert k2 == "TimeoutError" and f"127.0.0.1:{closed}" in m2, res[2]
    assert "within 1500 ms" in m2 and "refused" in m2, res[2]
    assert k3 not in (None, "TimeoutError") and "192.0.2.1" in m3, res[3]
    assert not any((i0, i1, i2, i3)), "a failed init left meshcoll initialised"
    # Job A did not notice: its store still answers, and B wrote nothing into it.
    assert job_a.get("mc/world/keep") == b"job a's data"
    assert job_a.num_keys() == 1


# ---- counts over 2**31 elements ----------------------------------------------------------

LARGE = os.environ.get("MESHCOLL_LARGE_TESTS") == "1"
N_LARGE = 2**31 + 7


def _large_body(pg):
    """An int8 all_reduce of 2**31 + 7 elements: every element is checked (in chunks, to
    keep the peak near the array's size); a few positions on both sides of 2**31 hold values
    of their own."""
    r = pg.rank
    x = np.full(N_LARGE, r + 1, np.int8)
    pos = np.array([0, 1, 12345, 2**30 + 3, 2**31 - 2, 2**31 - 1, 2**31, 2**31 + 1, N_LARGE - 1])
    special = np.random.default_rng(7).integers(-20, 20, (pg.size, len(pos))).astype(np.int8)
    x[pos] = special[r]
    t0 = time.monotonic()
    pg.all_reduce(x, timeout=240)
    elapsed = time.monotonic() - t0
    want = special.sum(axis=0, dtype=np.int64)
    got = x[pos].astype(np.int64)
    x[pos] = pg.size * (pg.size + 1) // 2  # so the bulk check below covers everything else
    other = 0
    for s in range(0, N_LARGE, 1 << 28):
        other += int(np.count_nonzero(x[s:s + (1 << 28)] != pg.size * (pg.size + 1) // 2))
    return pg.transport, got.tolist(), want.tolist(), other, elapsed


@pytest.mark.large
@pytest.mark.timeout(300)
@pytest.mark.skipif(not LARGE, reason="needs ~9 GB and ~20 s: set MESHCOLL_LARGE_TESTS=1")
@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_all_reduce_over_2_31_elements(run_ranks, transport):
    for transport_used, got, want, other, elapsed in run_ranks(
            2, _large_body, timeout=280, transport=transport):
        assert transport_used == transport
        assert got == want
        assert other == 0, f"{other} elements differ from the expected sum"
