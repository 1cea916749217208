"""Ranks that disagree about a call raise MismatchError quickly, on every rank, instead of
hanging until the timeout (Note [Agreement check] in csrc/transport/transport.h, Note
[Shared-memory rounds] in csrc/cpu/algo/shm_collectives.cc, README "Errors").

Timeouts are generous on purpose (30 s at init and per call; 3 s for cases known to hang): a
call that waits for its deadline raises TimeoutError, so a MismatchError is the agreement
check's own, never a timeout in disguise. Tests assert on the class, not on wall time.

Each case runs on a fresh group (``new_group`` over every rank) because a mismatch aborts the
group. Spawning is the expensive part, so one job per (world, transport) runs every case
(``outcomes``) and the tests below each assert on their own cases; a known bug then fails
only its own test. Cases run over TCP and, where a collective has a shared-memory path
(all_reduce "auto"/"shm", broadcast, all_gather, barrier), over shared memory too.
"""

import re

import numpy as np
import pytest

import meshcoll
from conftest import launch
from meshcoll.bench import P2P_ALGORITHMS

CALL_TIMEOUT = 30.0
SHORT_TIMEOUT = 3.0  # for cases known to hang: they end as TimeoutError, never a pass
TRANSPORTS = ["tcp", "shm"]
ODD = {2: 1, 3: 2, 4: 0, 5: 3}  # the rank that disagrees, per world size
TCP_ALGOS = ["auto", *P2P_ALGORITHMS]
SHM_ALGOS = ["auto", "shm"]  # the named TCP algorithms run over TCP whatever the transport
# (world, per-rank algorithms, per-rank max_segment_bytes): the OpDesc agrees, the steps don't.
SETTINGS = {
    "ring+direct": (2, ["ring", "direct"], [512 * 1024]),
    "ring+tree": (3, ["ring", "tree"], [512 * 1024]),
    "segments/3": (3, ["ring"], [256, 512 * 1024]),
    "segments/4": (4, ["ring"], [256, 512 * 1024]),
    "ring+halving_doubling": (4, ["ring", "halving_doubling"], [512 * 1024]),
}


def run_case(pg, call):
    """Run ``call(g)`` on a fresh group of every rank; return what this rank saw: the error
    class and message (or None), and what a further collective on the same group raised."""
    g = pg.new_group(list(range(pg.size)))
    # Start together. The barrier runs on the parent: one on g itself could still be
    # finishing on a slow rank when a fast rank's abort of g lands.
    pg.barrier(timeout=CALL_TIMEOUT)
    err = None
    try:
        call(g)
    except meshcoll.MeshcollError as e:
        err = e
    after, after_message = None, ""
    try:
        g.all_reduce(np.ones(3, np.float32), timeout=CALL_TIMEOUT)
    except meshcoll.MeshcollError as e:
        after, after_message = type(e).__name__, str(e)
    g.destroy()
    return {"error": type(err).__name__ if err else None, "message": str(err) if err else "",
            "after": after, "after_message": after_message,
            "transport": g.transport}


# ---- the cases: each a function of the group, called on every rank --------------------------

def count_case(odd, algo):
    def call(g):
        count = 1030 if g.rank == odd else 1031
        g.all_reduce(np.ones(count, np.float32), algorithm=algo, timeout=CALL_TIMEOUT)
    return call


def dtype_case(g):  # same count and bytes, different dtype on the last rank
    g.all_reduce(np.ones(257, np.int32 if g.rank == g.size - 1 else np.float32),
                 timeout=CALL_TIMEOUT)


def op_case(g):  # same everything but the op
    g.all_reduce(np.ones(257, np.float32), "max" if g.rank == 0 else "sum", timeout=CALL_TIMEOUT)


def kind_case(g):  # broadcast from rank 0 there, all_reduce elsewhere
    if g.rank == 0:
        g.broadcast(np.ones(64, np.float32), 0, timeout=CALL_TIMEOUT)
    else:
        g.all_reduce(np.ones(64, np.float32), timeout=CALL_TIMEOUT)


def gather_size_case(g):  # all_gather with a different size on rank 0
    g.all_gather(np.ones(65 if g.rank == 0 else 64, np.float32), timeout=CALL_TIMEOUT)


def barrier_case(g):  # barrier on the last rank, all_gather elsewhere
    if g.rank == g.size - 1:
        g.barrier(timeout=CALL_TIMEOUT)
    else:
        g.all_gather(np.ones(4, np.float32), timeout=CALL_TIMEOUT)


def reduce_vs_broadcast_case(g):
    # broadcast from rank 0 there, reduce onto rank 0 elsewhere: every call only sends (the
    # root's broadcast, the leaves' reduce), so a rank may learn of it at its next call.
    x = np.ones(64, np.float32)
    if g.rank == 0:
        g.broadcast(x, 0, timeout=CALL_TIMEOUT)
    else:
        g.reduce(x, 0, timeout=CALL_TIMEOUT)


def root_case(g):  # broadcast from root 1 on rank 1, from root 0 elsewhere
    g.broadcast(np.full(64, g.rank, np.float32), 1 if g.rank == 1 else 0, timeout=CALL_TIMEOUT)


def settings_case(algos, segments):
    def call(g):
        g.config.max_segment_bytes = segments[g.rank % len(segments)]
        g.all_reduce(np.ones(1031, np.float32), algorithm=algos[g.rank % len(algos)],
                     timeout=SHORT_TIMEOUT)
    return call


def algo_split_case(odd):
    # Counts so different that "auto" picks different TCP algorithms on different ranks (tree
    # or direct for 10 elements, ring for 128 Ki).
    def call(g):
        g.all_reduce(np.ones(10 if g.rank == odd else 1 << 17, np.float32), timeout=SHORT_TIMEOUT)
    return call


def silent_kind_case(g):
    # all_reduce (tree) on rank 0, broadcast from rank 0 on the others: every rank starts by
    # receiving, so no data frame carries the disagreement.
    if g.rank == 0:
        g.all_reduce(np.ones(64, np.float32), algorithm="tree", timeout=SHORT_TIMEOUT)
    else:
        g.broadcast(np.ones(64, np.float32), 0, timeout=SHORT_TIMEOUT)


def p2p_case(kind):
    def call(g):
        if g.rank == 0:
            x = np.ones(4, np.int32 if kind == "dtype" else np.float32)
            g.send(x, 1, tag=1 if kind == "tag" else 0, timeout=CALL_TIMEOUT)
        elif g.rank == 1:
            buf = np.zeros(5 if kind == "size" else 4, np.float32)
            g.recv(buf, 0, tag=2 if kind == "tag" else 0, timeout=CALL_TIMEOUT)
    return call


def _all_cases_body(pg, cases_for):
    n = pg.size
    cases = {}
    for algo in TCP_ALGOS if cases_for == "tcp" else SHM_ALGOS:
        cases[f"count/{algo}"] = count_case(ODD[n], algo)
    if n <= 4:
        cases.update({"dtype": dtype_case, "op": op_case, "kind": kind_case,
                      "gather size": gather_size_case, "barrier": barrier_case,
                      "root": root_case})
    if n <= 3:
        cases["reduce vs broadcast"] = reduce_vs_broadcast_case
    if cases_for == "tcp":
        cases["algo split"] = algo_split_case(ODD[n])
        for name, (world, algos, segments) in SETTINGS.items():
            if world == n:
                cases[f"settings/{name}"] = settings_case(algos, segments)
        if n == 2:
            cases["silent kind"] = silent_kind_case
        if n <= 3:
            for kind in ("tag", "size", "dtype"):
                cases[f"p2p/{kind}"] = p2p_case(kind)
    return {name: run_case(pg, call) for name, call in cases.items()}


@pytest.fixture(scope="module")
def outcomes():
    """``outcomes(world, transport)[case]``: every rank's result of one case. Each (world,
    transport) job runs once per module, on first use; a failed job fails every test that
    asks for it, with the job's own report."""
    jobs = {}

    def get(world, transport):
        if (world, transport) not in jobs:
            try:
                jobs[world, transport] = launch(world, _all_cases_body, timeout=110,
                                                transport=transport, cases_for=transport)
            except AssertionError as e:
                jobs[world, transport] = e
        res = jobs[world, transport]
        if isinstance(res, AssertionError):
            raise res
        return lambda case: [r[case] for r in res]
    return get


# ---- checks -----------------------------------------------------------------------------------

def check_all_raised(results, cls="MismatchError", names=(), late_ok=False):
    """Every rank raised ``cls`` (not a timeout), with a message naming two different
    ranks and each of ``names``; afterwards the group refuses further collectives.

    ``late_ok``: a rank whose call only sends (a broadcast root, a reduce leaf) cannot learn of
    the disagreement before returning; it may instead raise from its next collective."""
    raised = []
    for rank, r in enumerate(results):
        if late_ok and r["error"] is None:
            assert r["after"] in ("MismatchError", "AbortedError"), \
                f"rank {rank} raised nothing, and its next collective raised {r['after']}"
            assert "mismatch" in r["after_message"], \
                f"rank {rank}: its next collective's error does not tell of the mismatch: " \
                f"{r['after_message']}"
            continue
        raised.append((rank, r))
    assert raised or late_ok, "no rank raised in the mismatched call"
    for rank, r in raised:
        # The class is the witness that the agreement check fired: a call that waited for its
        # deadline instead raises TimeoutError (no wall-clock bound: shared machines stall).
        assert r["error"] == cls, f"rank {rank} raised {r['error']}: {r['message']}"
        ranks = set(re.findall(r"rank (\d+)", r["message"]))
        assert len(ranks) >= 2, f"rank {rank}: message names fewer than two ranks: {r['message']}"
        for name in names:
            assert name in r["message"], f"rank {rank}: {name!r} not in: {r['message']}"
        assert r["after"] in ("AbortedError", cls), \
            f"rank {rank}: a collective after the mismatch raised {r['after']}"


def check_transport(results, transport):
    for rank, r in enumerate(results):
        assert r["transport"].startswith(transport), f"rank {rank} ran over {r['transport']}"


# ---- the tests --------------------------------------------------------------------------------

@pytest.mark.timeout(120)
@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("world", [2, 3, 4, 5])
def test_all_reduce_count_mismatch(outcomes, world, transport):
    case_of = outcomes(world, transport)
    odd = ODD[world]
    for algo in TCP_ALGOS if transport == "tcp" else SHM_ALGOS:
        per_rank = case_of(f"count/{algo}")
        try:
            check_transport(per_rank, transport)
            # The message shows both calls: both counts appear in it, and the odd rank.
            check_all_raised(per_rank, names=("count=1030", "count=1031"))
            for rank, r in enumerate(per_rank):
                assert str(odd) in re.findall(r"rank (\d+)", r["message"]), \
                    f"rank {rank}: message does not name rank {odd}: {r['message']}"
        except AssertionError as e:
            raise AssertionError(f"algorithm {algo!r}: {e}") from None


@pytest.mark.timeout(120)
@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("world", [2, 3, 4])
def test_dtype_op_and_kind_mismatch(outcomes, world, transport):
    case_of = outcomes(world, transport)
    expect_names = {"dtype": ("int32", "float32"), "op": ("max", "sum"),
                    "kind": ("broadcast", "all_reduce"), "gather size": ("count=",),
                    "barrier": ("barrier", "all_gather")}
    for case, names in expect_names.items():
        per_rank = case_of(case)
        try:
            check_transport(per_rank, transport)
            # kind: the broadcast root only sends, so it may learn of it one call later.
            check_all_raised(per_rank, names=names, late_ok=case == "kind")
        except AssertionError as e:
            raise AssertionError(f"case {case!r}: {e}") from None


@pytest.mark.timeout(120)
@pytest.mark.parametrize("transport", ["tcp", "shm"])
@pytest.mark.parametrize("world", [2, 3])
def test_reduce_vs_broadcast_mismatch(outcomes, world, transport):
    check_all_raised(outcomes(world, transport)("reduce vs broadcast"), late_ok=True)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("world", [2, 3, 4])
def test_broadcast_root_mismatch(outcomes, world, transport):
    check_all_raised(outcomes(world, transport)("root"), names=("root=0", "root=1"),
                     late_ok=True)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", [
    "ring+direct", "ring+tree", "segments/3", "segments/4", "ring+halving_doubling",
])
def test_all_reduce_settings_mismatch(outcomes, name):
    # The OpDesc agrees (same count, dtype, op) but the ranks run different algorithms or
    # segment sizes: the message sizes disagree, which the receiver must catch.
    world = SETTINGS[name][0]
    check_all_raised(outcomes(world, "tcp")(f"settings/{name}"))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", [2, 3, 4, 5])
def test_all_reduce_count_mismatch_across_algorithms(outcomes, world):
    check_all_raised(outcomes(world, "tcp")("algo split"), names=("count=10", "count=131072"))


@pytest.mark.timeout(120)
def test_mismatch_when_every_rank_receives_first(outcomes):
    check_all_raised(outcomes(2, "tcp")("silent kind"), names=("broadcast", "all_reduce"))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", [2, 3])
def test_send_recv_mismatch(outcomes, world):
    case_of = outcomes(world, "tcp")
    names = {"tag": ("tag=1", "tag=2"), "size": ("16 bytes", "20 bytes"),
             "dtype": ("int32", "float32")}
    for kind, want in names.items():
        sender, receiver = case_of(f"p2p/{kind}")[:2]
        r = receiver
        assert r["error"] == "MismatchError", \
            f"{kind}: receiver raised {r['error']}: {r['message']}"
        for s in ("rank 0", "rank 1") + want:
            assert s in r["message"], f"{kind}: {s!r} not in: {r['message']}"
        assert r["after"] in ("AbortedError", "MismatchError"), f"{kind}: then {r['after']}"
        # The sender's own send may complete; its group is aborted all the same.
        assert sender["after"] in ("AbortedError", "MismatchError"), \
            f"{kind}: sender's next collective raised {sender['after']}"
