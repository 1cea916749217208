"""Hierarchical all_reduce, broadcast and all_gather (Note [Hierarchy] in meshcoll/hierarchy.py):
a group whose ranks sit on several hosts works in shared memory inside each host and over TCP
between one leader per host. Hosts are emulated with MESHCOLL_HOST_ID, set per rank before the group is made.

Values are checked against a numpy reference built from every rank's seeded input; every rank
must end with the same bytes. Blocking and async calls are mixed, so the group's issue order,
which keeps the three steps of each call in the same order on every rank, is exercised.
"""

import hashlib
import os
import time

import ml_dtypes
import numpy as np
import pytest

import meshcoll
from conftest import kill_after_others, rand_array

pytestmark = pytest.mark.timeout(120)

LAYOUTS = {"2+2": "AABB", "interleaved": "ABAB", "3+1": "AAAB"}
CASES = [("int32", "sum"), ("int32", "avg"), ("int64", "max"), ("float32", "sum"),
         ("float32", "avg"), ("float64", "prod"), ("bfloat16", "sum"), ("float32", "min")]
COUNTS = [0, 1, 1031, 70_000]  # 70_000 float32: several shm rounds, TCP ring segments
RTOL = {"float64": 1e-12, "float32": 1e-5, "bfloat16": 4e-2}


def _dtype(name):
    return np.dtype(ml_dtypes.bfloat16) if name == "bfloat16" else np.dtype(name)


def _input(rank, dtype, op, count, seed):
    rng = np.random.default_rng([seed, rank])
    if op == "prod":  # near 1: no overflow, no underflow
        return rng.uniform(0.9, 1.1, count).astype(dtype)
    return rand_array(rng, count, dtype)


def _expected(world, dtype, op, count, seed):
    xs = np.stack([_input(r, dtype, op, count, seed) for r in range(world)])
    if dtype.kind in "iu":
        if op in ("min", "max"):
            return getattr(np, op)(xs, axis=0)
        s = np.sum(xs, axis=0, dtype=dtype).astype(np.int64)  # wraps as the kernels do
        return s if op == "sum" else (np.sign(s) * (np.abs(s) // world)).astype(dtype)
    xs = xs.astype(np.float64)
    return {"sum": xs.sum(0), "avg": xs.mean(0), "prod": xs.prod(0), "min": xs.min(0),
            "max": xs.max(0)}[op]


def _wrong(got, want, name):
    if name in RTOL:
        bad = ~np.isclose(got.astype(np.float64), want, rtol=RTOL[name], atol=RTOL[name])
    else:
        bad = got.astype(np.int64) != want.astype(np.int64)
    return int(bad.sum())


def _emulate_host(name):
    """Puts this rank on emulated host `name`. The core read the environment when _C was
    imported, so it reads it again (Note [Configuration])."""
    os.environ["MESHCOLL_HOST_ID"] = name
    meshcoll._C.reload_config()


def _body(pg, hosts):
    _emulate_host(hosts[pg.rank])
    g = pg.new_group(list(range(pg.size)))
    h = g._hier
    assert h is not None, "a group over two hosts with a shared host builds a hierarchy"
    shape = (h.local.size, h.local.transport, h.leaders.is_member)
    fails, digest = [], hashlib.sha256()
    for seed, (name, op) in enumerate(CASES):
        dtype = _dtype(name)
        for count in COUNTS:
            # Three async calls queued, then a blocking one that must wait its turn.
            xs = [_input(g.rank, dtype, op, count, seed * 10 + k) for k in range(4)]
            works = [g.all_reduce(x, op=op, async_op=True) for x in xs[:3]]
            g.all_reduce(xs[3], op=op)
            for w in works:
                w.wait()
            for k, x in enumerate(xs):
                n = _wrong(x, _expected(g.size, dtype, op, count, seed * 10 + k), name)
                if n:
                    fails.append(f"{name} {op} count={count} call {k}: {n} wrong")
                digest.update(x.tobytes())
    return shape, fails, digest.hexdigest()


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_hierarchical_all_reduce(run_ranks, layout):
    hosts = LAYOUTS[layout]
    results = run_ranks(len(hosts), _body, hosts=hosts)
    for r, (shape, fails, _) in enumerate(results):
        assert not fails, f"rank {r}: {fails}"
        local, transport, leader = shape
        assert local == hosts.count(hosts[r]), shape
        assert transport == "shm" or local == 1, shape  # a group of one needs no transport
        assert leader == (hosts.index(hosts[r]) == r), shape  # lowest rank of its host
    assert len({d for _, _, d in results}) == 1, "ranks ended with different bytes"


def _bcast_gather_body(pg, hosts):
    """Hierarchical broadcast from every root and all_gather of several shapes, blocking and
    async, interleaved with all_reduces through the same FIFO; values against numpy."""
    _emulate_host(hosts[pg.rank])
    g = pg.new_group(list(range(pg.size)))
    assert g._hier is not None
    fails, n = [], g.size
    for seed, name in enumerate(["float32", "int64", "bfloat16", "uint8"]):
        dtype = _dtype(name)
        for count in (0, 1, 1031, 70_000):
            for root in range(n):
                k = (seed * 7 + root) * 100 + count % 97
                x = _input(g.rank, dtype, "sum", count, k)
                w = g.broadcast(x, root, async_op=True) if root % 2 else g.broadcast(x, root)
                y = _input(g.rank, dtype, "sum", count, k + 1)
                g.all_reduce(y)  # queued behind an async broadcast: the issue order keeps it
                if root % 2:
                    w.wait()
                if not np.array_equal(x, _input(root, dtype, "sum", count, k)):
                    fails.append(f"broadcast {name} count={count} root={root}")
    for shape in [(), (0,), (5,), (3, 4), (1000, 7)]:
        x = _input(g.rank, np.dtype("float64"), "sum", int(np.prod(shape)), 99).reshape(shape)
        want = np.stack([_input(r, np.dtype("float64"), "sum", int(np.prod(shape)), 99)
                         .reshape(shape) for r in range(n)])
        got = g.all_gather(x)
        out = np.empty((n,) + shape)
        w = g.all_gather(x, out=out, async_op=True)
        if w.wait() is not out or not np.array_equal(got, want) or not np.array_equal(out, want):
            fails.append(f"all_gather shape={shape}")
    with pytest.raises(ValueError, match="root 9 is out of range"):
        g.broadcast(np.zeros(3), 9)
    # One operation per call on the group's own queue (its ledger), not on a second scheduler.
    assert isinstance(w._work, meshcoll._C.Work), type(w._work)
    last = g.recent_calls(1)[0]
    assert last.startswith("all_gather") and last.endswith("done via hierarchy"), last
    return fails


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_hierarchical_broadcast_and_all_gather(run_ranks, layout):
    hosts = LAYOUTS[layout]
    for r, fails in enumerate(run_ranks(len(hosts), _bcast_gather_body, hosts=hosts)):
        assert not fails, f"rank {r}: {fails}"


def _one_host_body(pg):
    g = pg.new_group(list(range(pg.size)))
    return g._hier is None and g.transport == "shm"


def test_one_host_has_no_hierarchy(run_ranks):
    assert run_ranks(2, _one_host_body) == [True, True]


def _die_body(pg, victim):
    _emulate_host("AABB"[pg.rank])
    g = pg.new_group(list(range(pg.size)))
    x = np.ones(4096, np.float32)
    g.all_reduce(x)
    kill_after_others(pg, victim, "all_reduce")
    t0 = time.monotonic()
    try:
        for _ in range(1000):
            g.all_reduce(x, timeout=30.0)
    except (meshcoll.PeerError, meshcoll.TimeoutError) as e:
        return type(e).__name__, str(e), time.monotonic() - t0
    return "no error", "", 0.0


@pytest.mark.parametrize("victim", [1, 3])  # a non-leader of host A, of host B
def test_dead_rank_fails_every_host_fast(run_ranks, victim):
    # The failure reaches the ranks of the other host through the leaders' group (Comm.fail),
    # or through the group's own links, which the steps watch while they wait (the victim's
    # connection closing, or its leader's ABORT: Note [Steps watch their call's group]).
    # Without that they would wait out the 30 s timeout and raise TimeoutError, so the error
    # kind shows the propagation with no clock in the test.
    res = run_ranks(4, _die_body, may_die=(victim,), victim=victim, timeout=60)
    for rank, r in enumerate(res):
        if rank == victim:
            continue
        kind, msg, _ = r
        assert kind == "PeerError", (rank, r)
        assert f"rank {victim} closed" in msg or f"rank {victim} exited" in msg, (rank, msg)


def _dropped_async_body(pg):
    """A hierarchical async all_reduce whose Work and array rank 0 drops at once, while the
    other host joins late: the operation holds the array (Note [Owners]), so the canaries
    allocated into the freed blocks' place stay untouched (as test_contract checks on TCP and
    shared memory)."""
    _emulate_host("AABB"[pg.rank])
    g = pg.new_group(list(range(pg.size)))
    assert g._hier is not None
    damaged = []
    for _ in range(3):
        if pg.rank == 0:
            g.all_reduce(np.random.default_rng(0).standard_normal(8192), async_op=True)
            canaries = [np.full(8192, 7.0) for _ in range(8)]
        elif pg.rank >= 2:
            time.sleep(0.3)
        if pg.rank != 0:
            g.all_reduce(np.ones(8192))
        g.barrier(timeout=30)
        if pg.rank == 0:
            damaged += [i for i, c in enumerate(canaries) if not (c == 7.0).all()]
    return damaged


def test_dropped_async_array_survives_the_hierarchy(run_ranks):
    for rank, damaged in enumerate(run_ranks(4, _dropped_async_body,
                                             env={"MALLOC_PERTURB_": "165"})):
        assert not damaged, (rank, damaged)


def _shape_mismatch_body(pg):
    """Hosts A and B (two ranks each) gather blocks of one count but other shapes into an
    out= of one shape everywhere: within a host the shapes agree, so only the leaders' step
    can see it (a flat group compares the blocks' shapes: so must the hierarchy)."""
    _emulate_host("AB"[pg.rank % 2])
    g = pg.new_group(list(range(pg.size)))
    assert g._hier is not None
    shape = (2, 3) if pg.rank % 2 == 0 else (3, 2)
    try:
        g.all_gather(np.ones(shape), out=np.empty((g.size, 6)), timeout=20)
        g.barrier(timeout=20)
        return "no error"
    except meshcoll.MeshcollError as e:
        return type(e).__name__


def test_hierarchical_all_gather_compares_shapes_across_hosts(run_ranks):
    assert run_ranks(4, _shape_mismatch_body) == ["MismatchError"] * 4


def _coalesced_body(pg, hosts):
    """A coalesced block on a hierarchical group: its small all_reduces are fused into one
    hierarchical call (Note [Fused all_reduces]); values against numpy."""
    _emulate_host(hosts[pg.rank])
    g = pg.new_group(list(range(pg.size)))
    assert g._hier is not None
    counts = [1, 5, 300, 2]
    xs = [_input(g.rank, np.dtype("float32"), "sum", n, 90 + k) for k, n in enumerate(counts)]
    before = len(g.recent_calls(64))
    with g.coalesced():
        for x in xs:
            g.all_reduce(x)
    calls = g.recent_calls(64)[before:]
    fails = [f"call {k}: {n} wrong" for k, x in enumerate(xs)
             if (n := _wrong(x, _expected(g.size, np.dtype("float32"), "sum", len(x), 90 + k),
                             "float32"))]
    return fails, calls


def test_a_coalesced_block_on_a_hierarchical_group_fuses_and_sums_right(run_ranks):
    hosts = LAYOUTS["2+2"]
    for r, (fails, calls) in enumerate(run_ranks(len(hosts), _coalesced_body, hosts=hosts)):
        assert not fails, f"rank {r}: {fails}"
        assert any(c.startswith("all_reduce(count=308, float32, sum") for c in calls), calls


def _permuted_body(pg, hosts):
    """On a hierarchical group, ranks that split one total differently in a block (rank 0
    reduces 2 then 3 elements, the others 3 then 2): the fused call's layout must be compared
    by the steps that run it, as a flat group's transport compares it."""
    _emulate_host(hosts[pg.rank])
    g = pg.new_group(list(range(pg.size)))
    assert g._hier is not None
    first, second = (2, 3) if g.rank == 0 else (3, 2)
    a = _input(g.rank, np.dtype("float32"), "sum", first, 1)
    b = _input(g.rank, np.dtype("float32"), "sum", second, 2)
    try:
        with g.coalesced():
            g.all_reduce(a, timeout=30)
            g.all_reduce(b, timeout=30)
    except meshcoll.MeshcollError as e:
        return type(e).__name__, str(e)
    return "no error", ""


def test_a_block_split_differently_on_a_hierarchical_group_is_a_mismatch(run_ranks):
    hosts = LAYOUTS["2+2"]
    for r, (kind, msg) in enumerate(run_ranks(len(hosts), _permuted_body, hosts=hosts)):
        assert kind == "MismatchError", (r, kind, msg)


def _root_mismatch_body(pg, hosts, kind, odd, roots):
    """On a hierarchical group, rank `odd` passes root roots[1] to `kind`, every other rank
    roots[0]. Returns what this rank's call raised, then what a barrier after it raised."""
    _emulate_host(hosts[pg.rank])
    g = pg.new_group(list(range(pg.size)))
    assert g._hier is not None
    pg.barrier(timeout=30)  # start together, on the parent (Note in test_mismatch.run_case)
    root = roots[1] if g.rank == odd else roots[0]
    x = np.full(8, float(g.rank + 1), np.float32)
    calls = {
        "broadcast": lambda: g.broadcast(x, root, timeout=30),
        "reduce": lambda: g.reduce(x, root, timeout=30),
        "gather": lambda: g.gather(x, root, timeout=30),
        "scatter": lambda: g.scatter(np.ones((g.size, 8), np.float32), root,
                                     out=np.empty(8, np.float32), timeout=30),
    }
    outcome = []
    for call in (calls[kind], lambda: g.barrier(timeout=30)):
        try:
            call()
            outcome.append((None, ""))
        except meshcoll.MeshcollError as e:
            outcome.append((type(e).__name__, str(e)))
    return outcome


# (layout, rank that disagrees, (others' root, its root)). On "AABB": rank 3 names a root on
# the root's host (its steps alone looked like its host peers'), rank 2 names itself, rank 1
# names itself on the root's host; "AAABBB": 6 ranks, a rank of the second host names rank 1.
ROOT_CASES = [("AABB", 3, (0, 1)), ("AABB", 2, (0, 2)), ("AABB", 1, (0, 1)),
              ("AAABBB", 4, (0, 1))]


@pytest.mark.parametrize("kind", ["broadcast", "reduce", "gather", "scatter"])
@pytest.mark.parametrize("hosts,odd,roots", ROOT_CASES,
                         ids=[f"{h}-rank{o}-root{r[1]}" for h, o, r in ROOT_CASES])
def test_a_root_disagreement_on_a_hierarchical_group_is_a_mismatch_on_every_rank(
        run_ranks, kind, hosts, odd, roots):
    """Note [Steps carry their call] in comm/backend.cc: the steps of a hierarchical call
    carry the whole call, root included. The rank that disagrees raises in its broadcast; a
    rank whose part was done before any step disagreed (a host whose steps all agreed) learns
    it at its next call, as a flat group's send-only roles do (reduce, gather and scatter run
    flat over TCP, where a send-only role may learn it only then: issue 34 item 8)."""
    results = run_ranks(len(hosts), _root_mismatch_body, hosts=hosts, kind=kind, odd=odd,
                        roots=roots)
    if kind == "broadcast":  # hierarchical; the others run flat, over TCP
        (call_error, call_message), _ = results[odd]
        assert call_error == "MismatchError", (odd, call_error, call_message)
        assert "carry the whole call" in call_message or "root=" in call_message, call_message
    for r, ((error, message), (after, after_message)) in enumerate(results):
        if error is None:
            assert after in ("MismatchError", "AbortedError") and "mismatch" in after_message, \
                (r, after, after_message)
        else:
            assert error == "MismatchError", (r, error, message)


def _exchange_body(pg, hosts):
    """On a hierarchical group: split and all_gather_v work (their exchanges run as
    hierarchical all_gathers); then rank 3 calls all_gather of three int64 while the others
    split, whose exchange of colors looks the same but is its own kind (Note [Internal
    exchanges] in csrc/comm/ledger.h)."""
    _emulate_host(hosts[pg.rank])
    g = pg.new_group(list(range(pg.size)))
    assert g._hier is not None
    child = g.split(g.rank % 2, key=g.rank, timeout=30)
    rows, counts = g.all_gather_v(np.full((g.rank + 1, 2), g.rank, np.float32), timeout=30)
    works = (child.size, child.rank, counts, rows[:, 0].tolist())
    pg.barrier(timeout=30)  # every rank done with those before any disagrees
    outcome = []
    for call in (lambda: (g.all_gather(np.array([7, 9, 11], np.int64), timeout=30)
                          if g.rank == 3 else g.split(0, timeout=30)),
                 lambda: g.barrier(timeout=30)):
        try:
            call()
            outcome.append((None, ""))
        except meshcoll.MeshcollError as e:
            outcome.append((type(e).__name__, str(e)))
    return works, outcome


def test_a_split_against_a_user_all_gather_on_a_hierarchical_group_is_a_mismatch(run_ranks):
    hosts = LAYOUTS["2+2"]
    for r, (works, ((error, message), (after, after_message))) in enumerate(
            run_ranks(len(hosts), _exchange_body, hosts=hosts)):
        assert works == (2, r // 2, [1, 2, 3, 4], [0, 1, 1, 2, 2, 2, 3, 3, 3, 3]), (r, works)
        if error is None:
            assert after in ("MismatchError", "AbortedError") and "mismatch" in after_message, \
                (r, after, after_message)
        else:
            assert error == "MismatchError", (r, error, message)


def _flat_against_hier_body(pg, hosts, odd, case):
    """On a hierarchical group, rank `odd` makes a call that runs flat (over the group's own
    TCP links) while the others make one that runs hierarchically (steps on the children),
    or the other way round. A rank whose call returns makes a barrier next, as a job goes on.
    Returns which of the two raised ("call" or "next"), what and how long after the call
    began."""
    _emulate_host(hosts[pg.rank])
    g = pg.new_group(list(range(pg.size)))
    assert g._hier is not None
    pg.barrier(timeout=30)  # start together, on the parent
    x = np.full(1000, float(g.rank + 1), np.float32)
    hier = {"root": lambda: g.broadcast(x, odd, timeout=20)}.get(
        case, lambda: g.all_reduce(x, timeout=20))
    flat = {
        "barrier": lambda: g.barrier(timeout=20),
        "reduce": lambda: g.reduce(x, odd, timeout=20),  # the odd rank is the root: it waits
        # A tree: the others wait for the leaf `odd` first, and probe it (Note [Probes]).
        "root": lambda: g.all_reduce(x, algorithm="tree", timeout=20),
    }.get(case, lambda: g.all_reduce(x, algorithm="ring", timeout=20))
    # "barrier", "root": the odd rank's call is the hierarchical one.
    call = flat if (g.rank == odd) != (case in ("barrier", "root")) else hier
    t0 = time.monotonic()
    for which, f in (("call", call), ("next", lambda: g.barrier(timeout=20))):
        try:
            f()
        except meshcoll.MeshcollError as e:
            return which, type(e).__name__, str(e), time.monotonic() - t0
    return None, None, "", time.monotonic() - t0


# (layout, the rank that disagrees, what it or the others call flat): a non-leader and a
# leader, on hosts of two and of one rank; "root": the odd rank, alone on its host, is the
# root of a hierarchical broadcast, whose part only sends: it returns, and the others' flat
# all_reduce probes it in its next call (fault soak seed 35, --faults hier, episode 52).
FLAT_CASES = [("AABB", 1, "ring"), ("AABB", 2, "reduce"), ("AAAB", 3, "ring"),
              ("ABAB", 1, "barrier"), ("AAB", 2, "root")]


@pytest.mark.parametrize("hosts,odd,case", FLAT_CASES,
                         ids=[f"{h}-rank{o}-{c}" for h, o, c in FLAT_CASES])
def test_a_flat_call_against_a_hierarchical_one_is_a_prompt_mismatch_on_every_rank(
        run_ranks, hosts, odd, case):
    """Note [Steps watch their call's group] in common/interrupt.h: the hierarchical call's
    steps run on the children, the flat call on the group's own links, so neither met the
    other's frames and every rank waited to its 20 s timeout (issue 34, fault soak seed 35
    episode 155). Now every rank raises MismatchError naming both calls well before it; a
    rank whose part only sent, at its next call (Note [Late raise points] in
    bench/python/fault_soak.py)."""
    results = run_ranks(len(hosts), _flat_against_hier_body, hosts=hosts, odd=odd, case=case,
                        timeout=90)
    flat_name = {"barrier": "barrier(", "reduce": "reduce(", "root": "tree"}.get(case, "ring")
    for r, (which, error, message, took) in enumerate(results):
        assert which == "call" or (case == "root" and r == odd and which == "next"), \
            (r, which, error, message)
        assert error == "MismatchError", (r, error, message)
        assert took < 8, (r, took, message)
        assert "hierarchy" in message and flat_name in message, (r, message)
