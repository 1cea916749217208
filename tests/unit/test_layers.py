"""tools/check_layers.py: csrc/ is a stack of floors (docs/architecture.md, "Floors"): no
include goes up or sideways, no folders form a cycle, and each folder's README names what it
includes. Pure Python: reads the source tree, runs no compiled code."""

import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(60)

REPO = Path(__file__).resolve().parents[2]
TOOL = REPO / "tools" / "check_layers.py"
CSRC = REPO / "csrc"


def _tool():
    spec = importlib.util.spec_from_file_location("check_layers", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_tree_keeps_its_floors():
    run = subprocess.run([sys.executable, str(TOOL)], capture_output=True, text=True,
                         timeout=50)
    assert run.returncode == 0, run.stdout + run.stderr
    # The graph is printed, one line per folder.
    for folder in ("common/", "comm/", "cpu/", "nccl/", "python/"):
        assert f" {folder}" in run.stdout


def test_every_folder_is_on_a_floor():
    floors = _tool().FLOOR_OF
    for d in CSRC.iterdir():
        if d.is_dir() and any(f.is_file() for f in d.rglob("*")):
            assert d.name in floors, d


@pytest.fixture
def tree(tmp_path):
    root = tmp_path / "csrc"
    shutil.copytree(CSRC, root, ignore=shutil.ignore_patterns("*.txt"))
    return root


def test_an_upward_include_is_caught(tree):
    (tree / "comm" / "planted.h").write_text('#pragma once\n#include "cpu/cpu_backend.h"\n')
    problems = _tool().check(tree, out=open("/dev/null", "w"))
    assert any("comm/planted.h" in p and "up a floor" in p for p in problems), problems


def test_a_sideways_include_and_its_cycle_are_caught(tree):
    (tree / "cpu" / "planted.h").write_text('#pragma once\n#include "nccl/nccl_backend.h"\n')
    (tree / "nccl" / "planted.h").write_text('#pragma once\n#include "cpu/cpu_backend.h"\n')
    problems = _tool().check(tree, out=open("/dev/null", "w"))
    assert any("cpu/planted.h" in p and "sideways" in p for p in problems), problems
    assert any(p.startswith("a cycle between folders") for p in problems), problems


def test_an_include_the_readme_does_not_allow_is_caught(tree):
    # reduce/ is below cpu/, but cpu's README decides what cpu/ may include; reducer's says
    # comm/ and common/ only.
    (tree / "reducer" / "planted.h").write_text('#pragma once\n#include "reduce/kernels.h"\n')
    problems = _tool().check(tree, out=open("/dev/null", "w"))
    assert any("reducer/planted.h" in p and "May include" in p for p in problems), problems
