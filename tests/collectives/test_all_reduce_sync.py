"""Backend.all_reduce_sync, the METH_FASTCALL entry point behind a blocking
ProcessGroup.all_reduce (Note [all_reduce_sync] in bind_backend.cc): its
argument checks and its errors (through the same translators as every other binding); the
GIL released while it waits is tested in tests/python/test_gil_release.py."""

import numpy as np
import pytest

import meshcoll
from conftest import wrong_errors

pytestmark = pytest.mark.timeout(60)


def _args(pg, x, op="sum", algorithm="auto", timeout=None):
    cfg = pg.config
    return (x, op, timeout, None, algorithm, cfg.max_segment_bytes, cfg.tree_threshold_bytes,
            cfg.hd_threshold_bytes, cfg.arity_code, "auto", "auto")


def _bad_calls(pg):
    """(label, exception class, text) for each bad call; every rank makes the same ones."""
    sync = pg._backend.all_reduce_sync
    f = np.zeros(4, np.float32)
    ro = np.zeros(4, np.float32)
    ro.setflags(write=False)
    cases = [
        ("no arguments", lambda: sync(), TypeError, "11 positional"),
        ("keywords", lambda: sync(*_args(pg, f)[:10], global_algorithm="auto"), TypeError,
         "keyword"),
        ("list", lambda: sync(*_args(pg, [1.0])), TypeError, "numpy array"),
        ("op not str", lambda: sync(*_args(pg, f, op=3)), TypeError, "op"),
        ("negative size", lambda: sync(*_args(pg, f)[:5], -1, 1, 1, 0, "auto", "auto"), TypeError,
         "max_segment_bytes"),
        ("zero segment", lambda: sync(*_args(pg, f)[:5], 0, 1, 1, 0, "auto", "auto"), ValueError,
         "> 0"),
        ("bad op", lambda: sync(*_args(pg, f, op="bogus")), ValueError, "bogus"),
        ("bad algorithm", lambda: sync(*_args(pg, f, algorithm="zzz")), ValueError, "zzz"),
        ("bad timeout", lambda: sync(*_args(pg, f, timeout=-1.0)), ValueError, "timeout"),
        ("read-only", lambda: sync(*_args(pg, ro)), ValueError, "read-only"),
        ("strided", lambda: sync(*_args(pg, np.zeros(8, np.float32)[::2])), ValueError,
         "contiguous"),
        ("dtype", lambda: sync(*_args(pg, np.zeros(4, np.complex64))), TypeError, "complex64"),
        ("op for dtype", lambda: sync(*_args(pg, f, op="band")), TypeError, "band"),
    ]
    wrong = wrong_errors(cases)
    # The group still works, through both entry points.
    x = np.full(5, pg.rank + 1.0, np.float32)
    assert pg._backend.all_reduce_sync(*_args(pg, x)) is None
    y = np.full(5, pg.rank + 1.0, np.float32)
    assert pg.all_reduce(y) is y
    n = pg.size
    return wrong, x.tolist() == [n * (n + 1) / 2] * 5 and y.tolist() == x.tolist()


@pytest.mark.parametrize("world", [1, 2])
def test_bad_arguments_raise_and_leave_the_group_usable(run_ranks, world):
    for wrong, ok in run_ranks(world, _bad_calls):
        assert not wrong, wrong
        assert ok


def _mismatch(pg):
    # A collective error raised inside the C++ call comes back as its own Python class.
    x = np.ones(3 + pg.rank, np.float32)
    with pytest.raises(meshcoll.MismatchError, match="mismatch"):
        pg._backend.all_reduce_sync(*_args(pg, x, timeout=30))
    return True


def test_collective_errors_keep_their_class(run_ranks):
    assert run_ranks(2, _mismatch) == [True, True]
