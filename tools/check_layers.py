#!/usr/bin/env python3
"""Checks that csrc/ is a stack of floors (docs/architecture.md, "Floors").

Reads every ``#include "..."`` under csrc/, maps each file and each included path to its
folder (the first component under csrc/: ``cpu/algo/ring.cc`` is in ``cpu``), prints the
floor graph, and exits 1 when

- a file includes a folder on its own floor or above (an upward or sideways include),
- the folders' include graph has a cycle,
- a folder includes one its README's "May include:" line does not name, or that line names
  a folder that is not below it (so the READMEs and this table agree), or
- a file sits in, or includes, a folder this table does not know.

    python tools/check_layers.py            # the repository's csrc/
    python tools/check_layers.py --root DIR # another tree laid out like csrc/

Pure Python, no compiled module: tests/unit/test_layers.py runs it.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections import defaultdict
from pathlib import Path

# Lowest first. Folders on one floor stand side by side and include none of each other.
FLOORS: list[tuple[str, ...]] = [
    ("common",),
    ("store",),
    ("reduce",),
    ("transport",),
    ("comm",),
    ("cpu", "nccl", "mpi", "reducer"),
    ("python",),
]
FLOOR_OF = {folder: i for i, names in enumerate(FLOORS) for folder in names}
SOURCE_SUFFIXES = (".h", ".cc", ".cu", ".h.in")
INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.MULTILINE)
MAY_INCLUDE = re.compile(r"^May include:(.*?)(?:\n\n|\Z)", re.MULTILINE | re.DOTALL)


def folder_of(relative: str) -> str:
    return relative.split("/", 1)[0]


def read_includes(root: Path) -> dict[tuple[str, str], list[str]]:
    """(folder, included folder) -> the 'file: include' lines that make the edge."""
    edges: dict[tuple[str, str], list[str]] = defaultdict(list)
    for path in sorted(root.rglob("*")):
        if not path.is_file() or not path.name.endswith(SOURCE_SUFFIXES):
            continue
        rel = path.relative_to(root).as_posix()
        if "/" not in rel:
            continue  # csrc/ itself holds only the build file
        for target in INCLUDE.findall(path.read_text(encoding="utf-8", errors="replace")):
            edges[(folder_of(rel), folder_of(target))].append(f"{rel}: #include \"{target}\"")
    return edges


def may_include(root: Path, folder: str) -> set[str] | None:
    """The folders a folder's README allows; None when it allows every other one."""
    readme = root / folder / "README.md"
    if not readme.is_file():
        return set()
    m = MAY_INCLUDE.search(readme.read_text(encoding="utf-8"))
    if not m:
        return set()
    text = m.group(1)
    if "every other folder" in text:
        return None
    return set(re.findall(r"`([a-z_]+)/`", text))


def find_cycle(graph: dict[str, set[str]]) -> list[str]:
    """One cycle of the folder graph (as a path that ends where it starts), or []."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str]:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        path.pop()
        state[node] = 2
        return []

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return []


def check(root: Path, out=sys.stdout) -> list[str]:
    """Prints the floor graph of `root`; returns the problems found."""
    edges = read_includes(root)
    # Folders that hold something git tracks (an emptied folder is no folder of the tree).
    folders = sorted(p.name for p in root.iterdir() if p.is_dir() and any(
        f.is_file() for f in p.rglob("*")))
    problems: list[str] = []
    for folder in folders:
        if folder not in FLOOR_OF:
            problems.append(f"{folder}/: a folder on no floor (add it to FLOORS in "
                            f"tools/check_layers.py and to docs/architecture.md)")
    graph: dict[str, set[str]] = defaultdict(set)
    for (src, dst), lines in sorted(edges.items()):
        if src == dst:
            continue
        graph[src].add(dst)
        if dst not in FLOOR_OF or src not in FLOOR_OF:
            if dst not in FLOOR_OF:
                problems.append(f"{lines[0]}: includes {dst}/, a folder on no floor")
            continue
        if FLOOR_OF[dst] >= FLOOR_OF[src]:
            how = "up a floor" if FLOOR_OF[dst] > FLOOR_OF[src] else "sideways, on its own floor"
            for line in lines:
                problems.append(f"{line}: {src}/ includes {dst}/ {how}")
        allowed = may_include(root, src)
        if allowed is not None and dst not in allowed:
            problems.append(f"{lines[0]}: {src}/README.md's \"May include:\" does not name {dst}/")
    for folder in folders:
        allowed = may_include(root, folder)
        for dst in sorted((allowed or set()) - {folder}):
            if folder in FLOOR_OF and FLOOR_OF.get(dst, len(FLOORS)) >= FLOOR_OF[folder]:
                problems.append(f"{folder}/README.md: \"May include:\" names {dst}/, which is "
                                f"not below {folder}/")
    cycle = find_cycle(graph)
    if cycle:
        problems.append("a cycle between folders: " + " -> ".join(f"{c}/" for c in cycle))

    print("Floors of csrc/ (lowest first; a folder includes only folders below it):", file=out)
    for i, names in enumerate(FLOORS):
        for folder in names:
            if folder not in folders:
                continue
            below = ", ".join(f"{d}/ ({len(edges[(folder, d)])})" for d in sorted(graph[folder]))
            print(f"  {i}  {folder + '/':<11} includes {below or 'nothing of meshcoll'}", file=out)
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", type=Path,
                        default=Path(__file__).resolve().parent.parent / "csrc",
                        help="the tree to check (default: this repository's csrc/)")
    args = parser.parse_args(argv)
    problems = check(args.root)
    if problems:
        print(f"\n{len(problems)} problem(s):", file=sys.stdout)
        for p in problems:
            print(f"  {p}", file=sys.stdout)
        return 1
    print("\nNo include goes up or sideways, and no folders form a cycle.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
