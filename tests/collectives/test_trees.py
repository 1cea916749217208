"""Trees of any arity (Note [Trees] in csrc/cpu/algo/tree.h) for reduce, broadcast and tree
all_reduce, over TCP and shared memory; reduce's and broadcast's algorithm argument; the
selection table (Note [Selection table] in csrc/cpu/algo/select.cc); and the agreement check on
the tree a call builds.

Results are compared with numpy on random data: integers, and floats holding small integers,
so every fold order gives the same bits. Segments and shared-memory rounds are shrunk
(max_segment_bytes, MESHCOLL_SHM_BYTES) so the longer vectors pipeline through several of
them. Each (world, transport) runs every case in one job; a rank returns the wrong cases.
"""

import os
import re

import numpy as np
import pytest

import meshcoll
from conftest import wrong_errors

ARITIES = ["binomial", 2, 3, 4, 8]
JOBS = [(2, "tcp"), (3, "shm"), (4, "tcp"), (5, "shm"), (6, "tcp"), (6, "shm")]
SHM_ENV = {"MESHCOLL_SHM_BYTES": str(16 * 1024)}  # 8 KiB areas: long vectors take many rounds
COUNTS = [1, 5000]  # one element; 20 KB: several segments of 4 KiB and several rounds
CALL_TIMEOUT = 30.0


def inputs(rank, count, dtype, salt):
    rng = np.random.default_rng([rank, count, salt])
    return rng.integers(-50, 51, count).astype(dtype)


def _exact_trees(pg):
    n, r = pg.size, pg.rank
    shm = pg.transport.startswith("shm")
    wrong = []
    # 4 KiB segments (tree and chain pipelining) on every rank alike.
    pg.config = meshcoll.CollectiveConfig(max_segment_bytes=4096)

    def check(label, got, want):
        if got.dtype != want.dtype or not np.array_equal(got, want):
            bad = np.flatnonzero(got != want)[:3]
            wrong.append(f"rank {r} {label}: {bad.size} wrong, first at {bad.tolist()}: "
                         f"{got[bad].tolist()} != {want[bad].tolist()}")

    salt = 0
    for arity in ARITIES:
        pg.config.tree_arity = arity
        for count in COUNTS:
            for dtype in (np.int32, np.float32):
                for root in range(n):
                    salt += 1
                    every = [inputs(k, count, dtype, salt) for k in range(n)]
                    for algo in ("tree", "direct", "auto"):
                        x = every[r].copy()
                        pg.reduce(x, root, algorithm=algo, timeout=CALL_TIMEOUT)
                        want = np.sum(every, axis=0, dtype=dtype) if r == root else every[r]
                        check(f"reduce {algo} arity={arity} root={root} {count} {dtype.__name__}",
                              x, want)
                    for algo in ("tree", "direct", "auto") + (() if shm else ("ring",)):
                        x = every[r].copy()
                        pg.broadcast(x, root, algorithm=algo, timeout=CALL_TIMEOUT)
                        check(f"broadcast {algo} arity={arity} root={root} {count} "
                              f"{dtype.__name__}", x, every[root])
                x = inputs(r, count, np.int64, salt)
                pg.all_reduce(x, "max", algorithm="tree", timeout=CALL_TIMEOUT)
                check(f"all_reduce tree max arity={arity} {count}", x,
                      np.max([inputs(k, count, np.int64, salt) for k in range(n)], axis=0))
                x = inputs(r, count, np.float32, salt)
                pg.all_reduce(x, "avg", algorithm="tree", timeout=CALL_TIMEOUT)
                want = (np.sum([inputs(k, count, np.float32, salt) for k in range(n)], axis=0,
                               dtype=np.float32) / np.float32(n)).astype(np.float32)
                check(f"all_reduce tree avg arity={arity} {count}", x, want)
    # async forms take the config's choice too
    pg.config.tree_arity = 3
    x = inputs(r, 777, np.int64, 99)
    pg.reduce(x, n - 1, async_op=True, algorithm="tree").wait()
    every = [inputs(k, 777, np.int64, 99) for k in range(n)]
    check("async reduce", x, np.sum(every, axis=0) if r == n - 1 else every[r])
    pg.broadcast(x, 0, async_op=True, algorithm="tree").wait()
    check("async broadcast", x, every[0])
    return wrong, pg.transport.split()[0]


@pytest.mark.timeout(150)
@pytest.mark.parametrize("world,transport", JOBS)
def test_trees_of_every_arity_and_root_give_numpy_results(run_ranks, world, transport):
    results = run_ranks(world, _exact_trees, transport=transport, timeout=140,
                        env=SHM_ENV if transport == "shm" else None)
    for wrong, ran in results:
        assert ran == transport
        assert not wrong, "\n".join(wrong)


def _bad_choices(pg):
    shm = pg.transport.startswith("shm")
    x = np.ones(4, np.float32)
    cases = [
        ("reduce ring", lambda: pg.reduce(x, 0, algorithm="ring"), ValueError,
         "not one of reduce's"),
        ("reduce shm", lambda: pg.reduce(x, 0, algorithm="halving_doubling"), ValueError,
         "halving_doubling"),
        ("broadcast bogus", lambda: pg.broadcast(x, 0, algorithm="bogus"), ValueError, "bogus"),
    ]
    if shm:
        cases.append(("broadcast ring on shm", lambda: pg.broadcast(x, 0, algorithm="ring"),
                      ValueError, "TCP groups"))
    wrong = wrong_errors(cases)
    y = np.full(3, pg.rank + 1.0, np.float32)
    pg.all_reduce(y)  # the group still works
    return wrong, y.tolist() == [pg.size * (pg.size + 1) / 2] * 3


@pytest.mark.timeout(60)
@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_bad_algorithms_raise_on_every_rank(run_ranks, transport):
    for wrong, ok in run_ranks(2, _bad_choices, transport=transport):
        assert not wrong, wrong
        assert ok


def test_config_validates_arity_and_algorithms():
    C = meshcoll.CollectiveConfig
    for bad in (1, 0, -3, "3", 2.0, True, 1 << 16):
        with pytest.raises(ValueError, match="tree_arity"):
            C(tree_arity=bad)
    with pytest.raises(ValueError, match="reduce_algorithm"):
        C(reduce_algorithm="ring")
    with pytest.raises(ValueError, match="broadcast_algorithm"):
        C(broadcast_algorithm="shm")
    cfg = C("tree", tree_arity=4, reduce_algorithm="direct", broadcast_algorithm="ring")
    assert C.from_dict(cfg.to_dict()).to_dict() == cfg.to_dict()
    assert cfg.select("all_reduce", 1 << 20, 64) == ("tree", 4)
    assert cfg.select("reduce", 100, 64) == ("direct", None)
    assert cfg.select("broadcast", 100, 64) == ("ring", None)
    assert C("centralized").select_all_reduce(1 << 30, 64) == "centralized"
    assert C.single_node().algorithm == "shm" and C.multi_node().algorithm == "auto"


def test_the_tuning_defaults_are_the_engines():
    # One definition (common/op_desc.h): Python's CollectiveConfig and the engine's own
    # selection (which reads its defaults when no config is given) agree at the boundaries.
    d = meshcoll._C.ALL_REDUCE_DEFAULTS
    cfg = meshcoll.CollectiveConfig()
    assert (cfg.max_segment_bytes, cfg.tree_threshold_bytes, cfg.hd_threshold_bytes) == \
        (d["max_segment_bytes"], d["tree_threshold_bytes"], d["hd_threshold_bytes"])
    for n in (d["tree_threshold_bytes"], d["tree_threshold_bytes"] + 1,
              d["hd_threshold_bytes"], d["hd_threshold_bytes"] + 1):
        assert cfg.select_all_reduce(n, 16) == meshcoll._C.select_all_reduce(
            n, 16, d["tree_threshold_bytes"], d["hd_threshold_bytes"]), n


def test_selection_table_is_what_auto_picks():
    cfg = meshcoll.CollectiveConfig()
    rows = cfg.selection_table()
    assert {r["collective"] for r in rows} == {"all_reduce", "reduce", "broadcast", "all_gather",
                                               "reduce_scatter"}
    assert all(r["source"] for r in rows)
    # Every (collective, family) ends with a row for any size and world.
    for coll in ("all_reduce", "reduce", "broadcast", "all_gather", "reduce_scatter"):
        for family in ("tcp", "shm"):
            last = [r for r in rows if r["collective"] == coll and r["family"] == family][-1]
            assert (last["max_ranks"], last["threshold"], last["pow2_only"]) == (0, "", False)
    # The choices the code made before the table, unchanged.
    assert cfg.select("all_reduce", 100, 4) == ("direct", None)
    assert cfg.select("all_reduce", 100, 16) == ("tree", "binomial")
    assert cfg.select("all_reduce", 1 << 20, 4) == ("halving_doubling", None)
    assert cfg.select("all_reduce", 1 << 20, 6) == ("ring", None)
    assert cfg.select("all_reduce", 1 << 20, 4, shm=True) == ("shm", None)
    assert cfg.select("broadcast", 1 << 20, 2) == ("tree", "binomial")
    assert cfg.select("broadcast", 1 << 10, 8) == ("tree", "binomial")
    assert cfg.select("broadcast", 1 << 20, 8) == ("ring", None)
    assert cfg.select("broadcast", 1 << 20, 8, shm=True) == ("direct", None)
    assert cfg.select("reduce", 1 << 20, 8) == ("tree", "binomial")
    assert cfg.select("reduce_scatter", 1 << 20, 8) == ("ring", None)
    # A config's thresholds move their rows.
    assert meshcoll.CollectiveConfig(tree_threshold_bytes=1 << 21).select(
        "all_reduce", 1 << 20, 16) == ("tree", "binomial")


# ---- agreement: the tree is part of the call's description ------------------------------

def _arity_mismatch(pg, collective):
    g = pg.new_group(list(range(pg.size)))  # a mismatch aborts it, not the world
    pg.barrier(timeout=CALL_TIMEOUT)
    odd = pg.size - 1
    g.config.tree_arity = 3 if g.rank == odd else "binomial"
    x = np.ones(1000, np.float32)
    err = None
    try:
        if collective == "all_reduce":
            g.all_reduce(x, algorithm="tree", timeout=CALL_TIMEOUT)
        elif collective == "reduce":
            g.reduce(x, 0, algorithm="tree", timeout=CALL_TIMEOUT)
        elif collective == "broadcast":
            g.broadcast(x, 0, algorithm="tree", timeout=CALL_TIMEOUT)
        else:  # the algorithm differs, the arity does not
            g.reduce(x, 0, algorithm="direct" if g.rank == odd else "tree",
                     timeout=CALL_TIMEOUT)
    except meshcoll.MeshcollError as e:
        err = e
    after = None
    try:
        g.all_reduce(np.ones(3, np.float32), timeout=CALL_TIMEOUT)
    except meshcoll.MeshcollError as e:
        after = e
    return (type(err).__name__ if err else None, str(err or ""),
            type(after).__name__ if after else None, str(after or ""))


@pytest.mark.timeout(120)
# A named all_reduce algorithm runs over TCP on every group, so its tree is tried on TCP only.
@pytest.mark.parametrize("collective, transport", [
    ("all_reduce", "tcp"), ("reduce", "tcp"), ("reduce", "shm"), ("broadcast", "tcp"),
    ("broadcast", "shm"), ("algorithm", "tcp"), ("algorithm", "shm")])
def test_ranks_building_different_trees_get_mismatch_error(run_ranks, collective, transport):
    results = run_ranks(4, _arity_mismatch, collective=collective, transport=transport,
                        timeout=110)
    for rank, (err, msg, after, after_msg) in enumerate(results):
        if err is None:
            # A rank whose part only sends (a reduce leaf, the broadcast root) may return
            # before the disagreement is found: its next call on the group raises it.
            assert after in ("MismatchError", "AbortedError") and "mismatch" in after_msg, \
                f"rank {rank}: nothing raised, then {after}: {after_msg}"
            continue
        assert err == "MismatchError", f"rank {rank}: {err}: {msg}"
        assert len(set(re.findall(r"rank (\d+)", msg))) >= 2, msg
        if collective != "algorithm":
            assert "arity 3" in msg, f"rank {rank}: the message does not show the trees: {msg}"


# ---- the hierarchy's levels, set apart ----------------------------------------------------

def _levels(pg, hosts):
    os.environ["MESHCOLL_HOST_ID"] = hosts[pg.rank]  # emulated hosts (test_hierarchy.py)
    meshcoll._C.reload_config()
    g = pg.new_group(list(range(pg.size)))
    assert g._hier is not None
    g.config = meshcoll.CollectiveConfig(global_all_reduce="ring", local_all_reduce="direct",
                                         global_broadcast="tree", local_broadcast="tree",
                                         tree_arity=3)
    n, r, wrong = g.size, g.rank, []
    for count in COUNTS:
        every = [inputs(k, count, np.int64, count) for k in range(n)]
        x = every[r].copy()
        g.all_reduce(x)
        if not np.array_equal(x, np.sum(every, axis=0)):
            wrong.append(f"all_reduce {count}")
        for root in range(n):
            x = every[r].copy()
            g.broadcast(x, root)
            if not np.array_equal(x, every[root]):
                wrong.append(f"broadcast {count} root={root}")
    leaders = g._hier.leaders.recent_calls() if g._hier.leaders.is_member else []
    return wrong, leaders, g._hier.local.recent_calls(), g.recent_calls()


@pytest.mark.timeout(90)
def test_hierarchy_levels_take_their_own_algorithms(run_ranks):
    hosts = ["h0", "h0", "h1", "h1", "h1"]
    for rank, (wrong, leaders, local, calls) in enumerate(run_ranks(5, _levels, hosts=hosts)):
        assert not wrong, f"rank {rank}: {wrong}"
        assert all("hierarchy" in c for c in calls if "all_reduce" in c or "broadcast" in c)
        # The children's ledgers name the route each step took (all_reduce's closing local
        # broadcast is its own step, auto).
        assert [c for c in local if "all_reduce" in c], local
        assert all("via direct" in c for c in local if "all_reduce" in c), local
        assert any("broadcast" in c and "via tree" in c for c in local), local
        assert all("via ring" in c for c in leaders if "all_reduce" in c), leaders
        assert all("via tree" in c for c in leaders if "broadcast" in c), leaders
        assert bool(leaders) == (rank in (0, 2)), leaders
