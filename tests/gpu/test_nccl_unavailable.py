"""The NCCL backend where it cannot run: the errors a machine without a GPU or without NCCL
gets (these run everywhere, CI included; test_nccl.py has the GPU tests)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

from meshcoll.nccl import nccl_available

OK, _ = nccl_available()

def _python(code, env):
    full = {**os.environ, "NCCL_NVLS_ENABLE": "0", **env}
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=full,
                          capture_output=True, text=True, timeout=120)


def test_nccl_available_returns_a_reason():
    ok, why = nccl_available()
    assert isinstance(ok, bool) and why


def test_missing_nccl_says_where_it_looked():
    r = _python("""
        import meshcoll, meshcoll.nccl as n
        from meshcoll import _C
        n._Loader.done = True                  # no wheel candidates
        _C.nccl_set_library_candidates([])
        ok, why = n.nccl_available()
        print("OK" if ok else "MISSING"); print(why)
        if ok:  # a system libnccl.so.2 was found after the path we gave
            raise SystemExit(0)
        try:
            meshcoll.init(backend="nccl", rank=0, world_size=1)
            print("INIT-OK")
        except meshcoll.MeshcollError as e:
            print("INIT-ERROR", e)
    """, {"MESHCOLL_NCCL_LIBRARY": "/nonexistent/libnccl.so.2", "LD_LIBRARY_PATH": ""})
    assert r.returncode == 0, r.stderr
    out = r.stdout
    if out.startswith("OK"):  # a system libnccl.so.2 exists: it was found after ours
        assert "/nonexistent" not in out.splitlines()[1]
        return
    assert "INIT-ERROR" in out
    # either the driver is missing (no GPU machine) or NCCL is, with the path we gave
    assert "libcuda.so.1" in out or "/nonexistent/libnccl.so.2" in out, out


def test_rank_without_gpu_gets_a_clear_error():
    r = _python("""
        import meshcoll
        try:
            meshcoll.init(backend="nccl", rank=0, world_size=1)
            print("INIT-OK")
        except meshcoll.MeshcollError as e:
            print("INIT-ERROR", e)
    """, {"CUDA_VISIBLE_DEVICES": ""})
    assert r.returncode == 0, r.stderr
    assert "INIT-ERROR" in r.stdout and ("device" in r.stdout or "libcuda" in r.stdout), r.stdout


def test_auto_backend_agrees_across_ranks():
    r = _python("""
        import meshcoll
        pg = meshcoll.init(backend="auto", rank=0, world_size=1)
        print(pg.backend_name)
        meshcoll.destroy()
    """, {})
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == ("nccl" if OK else "cpu")
