"""Tier 1 stays pure: the schedule, mesh, partition and env modules import and compute with
no compiled extension anywhere in the package (Note [Lazy package] in meshcoll/__init__.py).

The package is copied without any ``*.so``, so an eager ``import _C`` put back into
``meshcoll/__init__.py`` or into one of these modules fails here, even on a machine where
the extension is built."""

import os
import shutil
import subprocess
import sys
import textwrap

import pytest

import meshcoll

pytestmark = pytest.mark.timeout(60)

_CHILD = textwrap.dedent("""
    import sys
    import meshcoll._env, meshcoll.device_mesh, meshcoll.partition, meshcoll.pipeline

    assert meshcoll.__file__.startswith(sys.argv[1]), meshcoll.__file__
    assert "meshcoll._C" not in sys.modules
    try:
        import meshcoll._C
    except ImportError:
        pass
    else:
        raise AssertionError("the copy has a _C: this test would prove nothing")

    from meshcoll import MeshLayout
    from meshcoll.partition import partition_range
    from meshcoll.pipeline import make_schedule, simulate

    # GPipe, 2 stages, 4 microbatches, t_f=1, t_b=2: (m+p-1)(t_f+t_b) and (p-1)/(m+p-1).
    result = simulate(make_schedule("gpipe", 2, 4))
    assert result.makespan == 15.0 and result.bubble_fraction == (0.2, 0.2), result
    layout = MeshLayout((2, 3), ("dp", "tp"))
    assert layout.groups("tp") == [[0, 1, 2], [3, 4, 5]]
    assert layout.groups("dp") == [[0, 3], [1, 4], [2, 5]]
    assert [partition_range(10, 3, i) for i in range(3)] == [(0, 4), (4, 7), (7, 10)]
    rdv = meshcoll._env.rendezvous_from_env(
        environ={"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "1"})
    assert (rdv.rank, rdv.world_size) == (1, 2), rdv
    assert "meshcoll._C" not in sys.modules
    print("ok")
""")


def test_pure_modules_import_without_the_extension(tmp_path):
    src = os.path.dirname(os.path.abspath(meshcoll.__file__))
    shutil.copytree(src, tmp_path / "meshcoll",
                    ignore=shutil.ignore_patterns("*.so", "*.pyd", "__pycache__"))
    env = dict(os.environ, PYTHONPATH=str(tmp_path), PYTHONDONTWRITEBYTECODE="1")
    run = subprocess.run([sys.executable, "-c", _CHILD, str(tmp_path)], env=env,
                         capture_output=True, text=True, timeout=50)
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stdout + run.stderr
