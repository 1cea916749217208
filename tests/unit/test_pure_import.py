"""Tier 1 stays pure: the schedule, mesh, partition and env modules import and compute with
no compiled extension anywhere in the package (Note [Lazy package] in meshcoll/__init__.py),
and so do the tier-1 test files themselves.

The package is copied without any ``*.so``, so an eager ``import _C`` put back into
``meshcoll/__init__.py`` or into one of these modules fails here, even on a machine where
the extension is built."""

import ast
import os
import re
import shutil
import subprocess
import sys
import textwrap

import pytest

import meshcoll

pytestmark = pytest.mark.timeout(60)

_CHILD = textwrap.dedent("""
    import sys
    import meshcoll._rendezvous, meshcoll._settings, meshcoll.device_mesh, meshcoll.partition, meshcoll.pipeline

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
    rdv = meshcoll._rendezvous.rendezvous_from_env(
        environ={"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "1"})
    assert (rdv.rank, rdv.world_size) == (1, 2), rdv
    assert "meshcoll._C" not in sys.modules
    print("ok")
""")


def _copy_without_extension(tmp_path):
    """The environment of a child that imports a copy of meshcoll with no compiled module."""
    src = os.path.dirname(os.path.abspath(meshcoll.__file__))
    shutil.copytree(src, tmp_path / "meshcoll",
                    ignore=shutil.ignore_patterns("*.so", "*.pyd", "__pycache__"))
    return dict(os.environ, PYTHONPATH=str(tmp_path), PYTHONDONTWRITEBYTECODE="1")


def test_pure_modules_import_without_the_extension(tmp_path):
    env = _copy_without_extension(tmp_path)
    run = subprocess.run([sys.executable, "-c", _CHILD, str(tmp_path)], env=env,
                         capture_output=True, text=True, timeout=50)
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stdout + run.stderr


@pytest.mark.timeout(120)  # collecting imports torch and numpy: slow on a loaded machine
def test_tier1_test_files_import_without_the_extension(tmp_path):
    # Tier 1 (this folder) runs where nothing is compiled: a test file that imports _C,
    # or an example (they import it), belongs to tests/python. Collecting is enough to
    # catch an import at the top of a file, and takes seconds. `-m tier1` must select
    # every test here (tests/conftest.py marks the tiers).
    env = _copy_without_extension(tmp_path)
    here = os.path.dirname(os.path.abspath(__file__))
    run = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", "tier1",
                          "-p", "no:cacheprovider", here], env=env, cwd=tmp_path,
                         capture_output=True, text=True, timeout=110)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert re.search(r"^\d+ tests collected", run.stdout, re.M), run.stdout[-3000:]


def test_the_public_names_agree_in_their_three_forms():
    # __init__.py states each public name in the three forms its readers need: _HOME for the
    # lazy loader, the TYPE_CHECKING imports for type checkers, and __all__ as a literal list
    # (the only form mypy reads for `from meshcoll import *`). They must say the same.
    tree = ast.parse(open(meshcoll.__file__).read())
    values, typed = {}, {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name):
            if node.targets[0].id in ("_HOME", "__all__"):
                values[node.targets[0].id] = eval(compile(ast.Expression(node.value), "", "eval"))
        if isinstance(node, ast.If) and ast.unparse(node.test) == "_typing.TYPE_CHECKING":
            for imp in node.body:
                assert isinstance(imp, ast.ImportFrom) and imp.level == 1, ast.unparse(imp)
                typed.update({a.name: imp.module for a in imp.names})
    home, names = values["_HOME"], values["__all__"]
    assert len(names) == len(set(names)), "a name twice in __all__"
    assert set(names) == set(home), set(names) ^ set(home)
    assert typed == home, {n: (home.get(n), typed.get(n)) for n in set(home) | set(typed)
                           if home.get(n) != typed.get(n)}
