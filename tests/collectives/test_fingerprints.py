"""Layouts that differ across ranks are a MismatchError on every rank, however they differ.

A call's description carries a fingerprint of what the ranks must agree on beyond its count
(the calls' counts fused in a coalesced block, a `reduce_scatter_v` split, an array's shape).
It was 31 bits once, and layouts that collided were found in seconds; the two below collided
and mixed calls' data with no error (issue 34). Each job also runs the agreeing calls and
checks them against numpy, so the fingerprint still lets equal layouts through."""

from __future__ import annotations

import numpy as np
import pytest

import meshcoll
from conftest import launch

pytestmark = pytest.mark.timeout(120)
CALL_TIMEOUT = 30.0  # a mismatch must be the check's own error, never this deadline

# One total split into the same number of calls (or blocks) two ways, which the old 31-bit
# fingerprint could not tell apart.
BLOCK_SPLITS = ((42623, 27594, 49783), (20515, 53831, 45654))
RSV_SPLITS = ([31011, 1017565], [41956, 1006620])


def _data(seed, rank, n, dtype):
    rng = np.random.default_rng([seed, rank])
    if np.dtype(dtype).kind in "iu":
        return rng.integers(0, 100, n).astype(dtype)
    return rng.standard_normal(n).astype(dtype)


def _outcome(call):
    try:
        call()
    except meshcoll.MeshcollError as e:
        return type(e).__name__, str(e)
    return "no error", ""


def _block(g, split, seed):
    """Small uint8 all_reduces in one coalesced block: fused into one call of the same total
    count on every rank (Note [Fused all_reduces]); only the layout tells the splits apart."""
    xs = [_data(seed + i, g.rank, n, np.uint8) for i, n in enumerate(split)]
    with g.coalesced():
        for x in xs:
            g.all_reduce(x, timeout=CALL_TIMEOUT)
    return xs


def _blocks(pg):
    agreed = _block(pg, BLOCK_SPLITS[0], 10)
    calls = pg.recent_calls(1)
    g = pg.new_group(list(range(pg.size)))  # a mismatch aborts its group
    mismatch = _outcome(lambda: _block(g, BLOCK_SPLITS[pg.rank % 2], 20))
    return agreed, calls, mismatch


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_blocks_split_differently_are_a_mismatch_on_every_rank(transport):
    world = 2
    for rank, (agreed, calls, (kind, msg)) in enumerate(launch(world, _blocks,
                                                               transport=transport)):
        for i, (x, n) in enumerate(zip(agreed, BLOCK_SPLITS[0])):
            want = sum(_data(10 + i, k, n, np.uint8) for k in range(world)).astype(np.uint8)
            np.testing.assert_array_equal(x, want, err_msg=str(i))
        assert calls[0].startswith(f"all_reduce(count={sum(BLOCK_SPLITS[0])}, uint8"), calls
        assert kind == "MismatchError", (rank, kind, msg)
        assert f"count={sum(BLOCK_SPLITS[0])}" in msg and "layout #" in msg, msg


def _rsv(pg):
    world = pg.size
    total = sum(RSV_SPLITS[0])
    agreed = pg.reduce_scatter_v(_data(1, pg.rank, total, np.float32), RSV_SPLITS[0],
                                 timeout=CALL_TIMEOUT)
    g = pg.new_group(list(range(world)))  # a mismatch aborts its group
    split = RSV_SPLITS[pg.rank % 2]
    mismatch = _outcome(lambda: g.reduce_scatter_v(_data(2, g.rank, total, np.float32), split,
                                                   timeout=CALL_TIMEOUT))
    return agreed, mismatch


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_reduce_scatter_v_split_differently_is_a_mismatch_on_every_rank(transport):
    world = 2
    total = sum(RSV_SPLITS[0])
    want = sum(_data(1, k, total, np.float32).astype(np.float64) for k in range(world))
    bounds = np.cumsum([0] + RSV_SPLITS[0])
    for rank, (agreed, (kind, msg)) in enumerate(launch(world, _rsv, transport=transport)):
        np.testing.assert_allclose(agreed, want[bounds[rank]:bounds[rank + 1]], rtol=1e-5,
                                   atol=1e-5)
        assert kind == "MismatchError", (rank, kind, msg)
        assert "reduce_scatter_v" in msg, msg
