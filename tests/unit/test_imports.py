"""The import graph of python/meshcoll has no circle (tools/check_imports.py): none among
module-level imports (type-only ones included), and none closed by an import deferred into a
function either. The tool reads the sources; nothing here imports the package."""

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(60)

TOOL = Path(__file__).resolve().parents[2] / "tools" / "check_imports.py"


def _run(*args):
    return subprocess.run([sys.executable, str(TOOL), *map(str, args)], capture_output=True,
                          text=True, timeout=50)


@pytest.mark.parametrize("flags", [(), ("--functions",)], ids=["module-level", "functions"])
def test_no_import_circles(flags):
    p = _run(*flags)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "  process_group -> " in p.stdout  # the graph is drawn
    assert "circles among module-level imports: none" in p.stdout, p.stdout


def test_the_tool_finds_a_circle(tmp_path):
    """A circle through a TYPE_CHECKING import fails; one through a deferred import fails
    only with --functions; a module importing the lazy package is no circle."""
    pkg = tmp_path / "meshcoll"
    (pkg / "sub").mkdir(parents=True)
    files = {
        "__init__.py": """
            import typing
            __version__ = "0"
            if typing.TYPE_CHECKING:
                from .a import A
            """,
        "a.py": """
            from typing import TYPE_CHECKING
            from . import __version__
            if TYPE_CHECKING:
                from .b import B
            A = 1
            """,
        "b.py": "from .a import A\n",
        "sub/__init__.py": "",
        "sub/c.py": "def f():\n    from . import d\n",
        "sub/d.py": "from meshcoll.sub import c\n",
    }
    for name, text in files.items():
        (pkg / name).write_text(textwrap.dedent(text))
    p = _run("--root", tmp_path)
    assert p.returncode == 1, p.stdout
    assert "circles among module-level imports: 1\n  {a, b}: a -> b -> a" in p.stdout
    assert "sub.c -> sub.d (in f)" in p.stdout
    (pkg / "b.py").write_text("B = 1\n")
    p = _run("--root", tmp_path)
    assert p.returncode == 0, p.stdout
    assert "{sub.c, sub.d}: sub.c -> sub.d -> sub.c" in p.stdout
    assert _run("--root", tmp_path, "--functions").returncode == 1
