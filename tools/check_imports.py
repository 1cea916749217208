#!/usr/bin/env python3
"""Draws the import graph of python/meshcoll and fails on a circle.

    python tools/check_imports.py              # the graph, then the circles; exit 1 on one
    python tools/check_imports.py --functions  # imports inside functions count too

Reads the sources (ast), imports nothing. Edges are imports of meshcoll's own modules:

- module level: a statement that runs when the module is imported, and one under
  ``if TYPE_CHECKING:`` (marked "type"): it never runs, but a type checker and a reader
  follow it, so two modules joined by it still cannot be read, checked or moved apart;
- inside functions (and methods): deferred imports, listed separately. Deferring an import
  is how a circle is usually hidden, not removed: they are drawn so one can see it, and
  ``--functions`` makes a circle through them an error too.

The package's ``__init__.py`` imports nothing at run time (Note [Lazy package]); its
``TYPE_CHECKING`` block only re-exports names for type checkers. A module that imports the
package (``from meshcoll import __version__``) does not depend on those names, so the
re-exports are drawn ("re-export") but close no circle.

Exit status: 0 without circles, 1 with one (each printed with one path through it).
"""

from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Set, Tuple

ROOT = Path(__file__).resolve().parents[1] / "python"
PACKAGE = "meshcoll"

# Edge kinds, in the order they are drawn.
RUN, TYPE, REEXPORT, FUNCTION = "run", "type", "re-export", "function"


def modules(root: Path) -> Dict[str, Path]:
    """Module name -> file, for every .py (and the extension's .pyi) under the package."""
    out: Dict[str, Path] = {}
    for path in sorted((root / PACKAGE).rglob("*.py*")):
        if path.suffix not in (".py", ".pyi") or "__pycache__" in path.parts:
            continue
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out.setdefault(".".join(parts), path)
    return out


def _is_type_checking(test: ast.expr) -> bool:
    """``TYPE_CHECKING`` or ``<module>.TYPE_CHECKING`` (``typing``, ``_typing``)."""
    if isinstance(test, ast.Name):
        return test.id == "TYPE_CHECKING"
    return isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"


def _imports(tree: ast.Module) -> Iterator[Tuple[ast.stmt, str, Optional[str]]]:
    """Every import statement with its context: RUN or TYPE at module level, FUNCTION with
    the enclosing function's name."""
    def walk(body: List[ast.stmt], kind: str, func: Optional[str]) -> Iterator[
            Tuple[ast.stmt, str, Optional[str]]]:
        for node in body:
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                yield node, kind, func
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                yield from walk(node.body, FUNCTION, node.name if func is None else func)
            elif isinstance(node, ast.If) and _is_type_checking(node.test):
                yield from walk(node.body, TYPE if kind == RUN else kind, func)
                yield from walk(node.orelse, kind, func)
            else:  # class bodies, try, with, if, for: run where they stand
                for field in ("body", "orelse", "finalbody", "handlers"):
                    children = getattr(node, field, None)
                    if isinstance(children, list):
                        stmts = [c for c in children if isinstance(c, ast.stmt)]
                        stmts += [s for h in children if isinstance(h, ast.ExceptHandler)
                                  for s in h.body]
                        yield from walk(stmts, kind, func)
    yield from walk(tree.body, RUN, None)


def _targets(node: ast.stmt, module: str, is_package: bool, known: Set[str]) -> List[str]:
    """The package's modules an import statement names."""
    def known_prefix(name: str) -> Optional[str]:
        while name and name not in known:
            name = name.rpartition(".")[0]
        return name or None

    if isinstance(node, ast.Import):
        found = [known_prefix(a.name) for a in node.names]
        return [t for t in found if t]
    assert isinstance(node, ast.ImportFrom)
    if node.level:
        base = module.split(".")
        base = base[:len(base) - node.level + (1 if is_package else 0)]
        source = ".".join(base + ([node.module] if node.module else []))
    else:
        source = node.module or ""
    out = []
    for alias in node.names:
        sub = f"{source}.{alias.name}"
        target = sub if sub in known else known_prefix(source)
        if target:
            out.append(target)
    return out


Edge = Tuple[str, str, str, Optional[str]]  # (from, to, kind, function)


def graph(root: Path = ROOT) -> Tuple[List[str], List[Edge]]:
    mods = modules(root)
    known = set(mods)
    edges: Dict[Tuple[str, str, str], Optional[str]] = {}
    for name, path in mods.items():
        if path.suffix == ".pyi":
            continue
        is_package = path.name == "__init__.py"
        tree = ast.parse(path.read_text(), str(path))
        for node, kind, func in _imports(tree):
            if kind == TYPE and is_package:
                kind = REEXPORT
            for target in _targets(node, name, is_package, known):
                if target != name:
                    edges.setdefault((name, target, kind), func)
    # A type-only import of a module also imported at run time adds nothing.
    drawn = [(a, b, k, f) for (a, b, k), f in sorted(edges.items())
             if not (k == TYPE and (a, b, RUN) in edges)]
    return sorted(mods), drawn


def cycles(nodes: List[str], edges: List[Edge],
           kinds: Set[str]) -> List[Tuple[List[str], List[str]]]:
    """Each strongly connected component of more than one module (Tarjan), with one path
    around it."""
    succ: Dict[str, List[str]] = {n: [] for n in nodes}
    for a, b, kind, _ in edges:
        if kind in kinds and b not in succ[a]:
            succ[a].append(b)
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on: Set[str] = set()
    found: List[Tuple[List[str], List[str]]] = []

    def strong(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in succ[v]:
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append((sorted(comp), _path(sorted(comp), succ)))

    sys.setrecursionlimit(10000)
    for n in nodes:
        if n not in index:
            strong(n)
    return found


def _path(comp: List[str], succ: Dict[str, List[str]]) -> List[str]:
    """A shortest circle from the component's first module back to it (breadth first)."""
    start, inside = comp[0], set(comp)
    prev: Dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in succ[v]:
                if w == start:
                    path = [v]
                    while path[-1] != start:
                        path.append(prev[path[-1]])
                    return path[::-1] + [start]
                if w in inside and w not in prev:
                    prev[w] = v
                    nxt.append(w)
        frontier = nxt
    return comp


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--functions", action="store_true",
                   help="count imports inside functions too: any circle fails")
    p.add_argument("--root", type=Path, default=ROOT, help="the folder holding meshcoll/")
    args = p.parse_args(argv)
    nodes, edges = graph(args.root)

    def short(m: str) -> str:
        return m[len(PACKAGE) + 1:] if m.startswith(PACKAGE + ".") else m

    print(f"import graph of {PACKAGE} ({len(nodes)} modules); module-level imports:")
    for n in nodes:
        out = [f"{short(b)}" + ("" if k == RUN else f" ({k})")
               for a, b, k, _ in edges if a == n and k != FUNCTION]
        print(f"  {short(n)} -> {', '.join(out) if out else '-'}")
    print("imports inside functions:")
    inner = [(a, b, f) for a, b, k, f in edges if k == FUNCTION]
    for a, b, f in inner:
        print(f"  {short(a)} -> {short(b)} (in {f})")
    if not inner:
        print("  none")

    failed = False
    for title, kinds, fatal in (
            ("circles among module-level imports", {RUN, TYPE}, True),
            ("circles through imports inside functions", {RUN, TYPE, FUNCTION}, args.functions)):
        found = cycles(nodes, edges, kinds)
        print(f"{title}: {len(found) or 'none'}" + ("" if fatal or not found else " (not an "
                                                    "error without --functions)"))
        for comp, path in found:
            print(f"  {{{', '.join(short(m) for m in comp)}}}: "
                  + " -> ".join(short(m) for m in path))
        failed |= fatal and bool(found)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
