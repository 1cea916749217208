"""The core's settings at the Python boundary (Note [Configuration] in csrc/common/config.h):
installed from meshcoll._settings when _C is imported, a bad value failing that import (ImportError)
with the variable named, and C++ defaults equal to an unset environment's (C++ programs that do not
go through Python rely on it)."""

import dataclasses
import os
import subprocess
import sys
import textwrap

import pytest

from meshcoll import _C
from meshcoll._settings import CoreConfig

FIELDS = [f.name for f in dataclasses.fields(CoreConfig)]


def _as_tuple(c):
    return tuple(getattr(c, f) for f in FIELDS)


def test_cpp_defaults_equal_unset_environment():
    assert _as_tuple(_C.Config()) == _as_tuple(CoreConfig())


def test_set_reload_and_core_validation(monkeypatch):
    try:
        _C.set_config(CoreConfig(host_id="h1", cma=False, nccl_library="/x/libnccl.so.2"))
        assert _as_tuple(_C.config()) == ("h1", False, "auto", 0, -1, "", False, "/x/libnccl.so.2",
                                          True, 256 << 10, False, False, "")
        assert _C.host_identity() == "h1"
        bad = _C.Config()
        bad.simd = "sse9"
        with pytest.raises(ValueError, match="simd='sse9' is not a SIMD level"):
            _C.set_config(bad)
        bad = _C.Config()
        bad.shm_all_reduce = "fast"
        with pytest.raises(ValueError, match="shm_all_reduce='fast' is not a path"):
            _C.set_config(bad)
        assert _C.config().host_id == "h1", "a rejected config changes nothing"
        monkeypatch.setenv("MESHCOLL_HOST_ID", "h2")
        _C.reload_config()
        assert _C.host_identity() == "h2"
        monkeypatch.setenv("MESHCOLL_CMA", "maybe")
        with pytest.raises(ValueError, match="MESHCOLL_CMA='maybe'"):
            _C.reload_config()
    finally:
        monkeypatch.undo()
        _C.reload_config()  # back to this process's environment


_CHILD = textwrap.dedent("""
    import os
    import meshcoll  # the package itself needs no _C (Note [Lazy package])
    try:
        from meshcoll import _C
    except ImportError as e:
        print("ImportError:", e)
    else:
        raise SystemExit("_C imported with a bad MESHCOLL_SIMD")
    os.environ["MESHCOLL_SIMD"] = "baseline"
    from meshcoll import _C  # nothing was registered by the failed import: this one works
    print(_C.config().simd, _C.simd_level())
""")


def test_bad_simd_fails_the_import_naming_the_variable():
    pkg_root = os.path.dirname(os.path.dirname(os.path.abspath(_C.__file__)))
    path = os.pathsep.join(p for p in [pkg_root, os.environ.get("PYTHONPATH")] if p)
    env = dict(os.environ, MESHCOLL_SIMD="sse9", PYTHONPATH=path)
    r = subprocess.run([sys.executable, "-c", _CHILD], env=env, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    first, second = r.stdout.strip().splitlines()
    assert first == ("ImportError: meshcoll: MESHCOLL_SIMD='sse9' is not a SIMD level; use "
                     "baseline, avx2, avx512 (or unset it)"), r.stdout
    assert second == "baseline baseline", r.stdout


def _host_timers(pg, calls):
    import numpy as np
    from meshcoll import _C
    x = np.ones(4, np.float32)
    out = np.empty((pg.size, 4), np.float32)
    _C.host_timers(reset=True)  # what setup made
    try:
        pg.all_reduce(x[::2])  # a failed fast-path call: its spans stop there
    except ValueError:
        pass
    pg.all_reduce(x, async_op=True).wait()  # not timed, even right after a failed call
    for _ in range(calls):
        pg.all_reduce(x)
        pg.all_gather(x, out=out)
        pg.all_reduce(x, async_op=True).wait()  # not a fast-path call: not timed
    return _C.host_timers(reset=True), _C.host_timers()


@pytest.mark.timeout(60)
def test_host_timers_time_each_fast_path_call_step_by_step(run_ranks):
    # Note [Host timers]: with MESHCOLL_HOST_TIMERS=1 every synchronous fast-path call is
    # timed once per step (the CPU backend has no NCCL steps); off, nothing is.
    for on in (True, False):
        env = {"MESHCOLL_HOST_TIMERS": "1"} if on else {}
        for rows, after_reset in run_ranks(2, _host_timers, calls=50, env=env):
            assert after_reset == []
            if not on:
                assert rows == [], rows
                continue
            steps = {step: (n, us) for step, n, us in rows}
            assert list(steps) == ["read arguments and arrays", "shared checks (Backend)",
                                   "to the return"], rows
            assert all(n == 100 and us > 0 for n, us in steps.values()), rows
