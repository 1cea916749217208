"""Time every all-reduce algorithm at every size and world size; propose auto's thresholds.

    python bench/python/bench_algorithms.py                     # worlds 2,3,4,8; 8 B..16 MiB
    python bench/python/bench_algorithms.py --worlds 2,4 -e 1M --repeats 7 --json algos.jsonl

For each world size this runs ``meshcoll-bench --op all_reduce --algo ring,tree,
halving_doubling,direct --transport tcp`` (the four algorithms interleaved within each repeat, so a noisy
moment of the machine hits all of them), then prints one table per world size with the
median time per call of each algorithm, the winner, and what ``algorithm="auto"`` picks
today, followed by the crossover points (sizes where the winner changes) and, steadier
under noise, the size from which one algorithm stays faster than another. The transport is
forced to TCP: the thresholds choose among these algorithms only where shared memory is not
available (ranks on several hosts, or MESHCOLL_TRANSPORT=tcp).

The proposal searches the thresholds of the current selection rule (the real one,
``CollectiveConfig.select_all_reduce``: direct for world <= 2 and tree otherwise up to
``tree_threshold_bytes``; halving-doubling on power-of-two worlds up to
``hd_threshold_bytes``; ring above) for the pair that minimises the geometric-mean
slowdown of auto's pick against the fastest algorithm, over every measured (world, size);
among pairs within 1% of the best it takes the smallest thresholds (ties go to ring).
Timings are only as good as the machine: on a shared 2-core box, rerun and compare.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import os
import subprocess
import sys
import tempfile
from typing import Dict, List, Tuple

import meshcoll
from meshcoll.bench import P2P_ALGORITHMS as ALGORITHMS, format_size, parse_size

# ALGORITHMS: the point-to-point algorithms that auto chooses between by size, over TCP. (On
# one host auto takes the shared-memory algorithm "shm" instead; these thresholds then do
# not apply.)

Table = Dict[int, Dict[str, float]]  # size -> algorithm -> median us


def sweeps(args: argparse.Namespace) -> List[Tuple[int, int, int]]:
    """(min, max, iters): small sizes get more calls per timed loop, so that a loop lasts
    long enough that one scheduler hiccup does not decide it."""
    lo, hi, split = parse_size(args.minbytes), parse_size(args.maxbytes), parse_size(args.split)
    out = []
    if lo <= split:
        out.append((lo, min(hi, split), args.small_iters))
    big = max(lo, split * 2)
    if big <= hi:
        out.append((big, hi, args.iters))
    return out


def run_world(world: int, args: argparse.Namespace) -> List[dict]:
    records = []
    with tempfile.TemporaryDirectory() as d:
        for lo, hi, iters in sweeps(args):
            out = os.path.join(d, f"algos_{lo}.jsonl")
            cmd = [sys.executable, "-m", "meshcoll.bench", "-N", str(world), "--op",
                   "all_reduce", "--algo", ",".join(ALGORITHMS), "-b", str(lo), "-e", str(hi),
                   "-f", "2", "-n", str(iters), "-w", str(args.warmup), "-c", "1",
                   "-d", args.dtype, "--repeats", str(args.repeats), "--transport", "tcp",
                   "--json", out]
            env = {k: v for k, v in os.environ.items() if not k.startswith("MESHCOLL_")}
            p = subprocess.run(cmd, env=env, capture_output=True, text=True)
            if p.returncode != 0:
                raise SystemExit(f"bench_algorithms: world {world} failed (exit "
                                 f"{p.returncode}):\n{p.stdout}\n{p.stderr}")
            with open(out) as f:
                records += [json.loads(line) for line in f]
    return records


def to_table(records: List[dict]) -> Table:
    """size -> algorithm -> time; the median where several runs measured the same point."""
    times: Dict[int, Dict[str, List[float]]] = {}
    for r in records:
        times.setdefault(r["size"], {}).setdefault(r["algo"], []).append(r["time"])
    return {s: {a: statistics.median(v) for a, v in row.items()} for s, row in times.items()}


def winner(row: Dict[str, float]) -> str:
    return min(row, key=row.get)


def select(cfg_tree: int, cfg_hd: int, nbytes: int, world: int) -> str:
    cfg = meshcoll.CollectiveConfig(tree_threshold_bytes=cfg_tree, hd_threshold_bytes=cfg_hd)
    return cfg.select_all_reduce(nbytes, world)


def print_table(world: int, table: Table, args: argparse.Namespace, recs: List[dict]) -> None:
    cur = meshcoll.CollectiveConfig()
    wrong = sum(r["wrong"] or 0 for r in recs)
    iters = "/".join(str(i) for i in sorted({r["iters"] for r in recs}, reverse=True))
    print(f"# all_reduce {recs[0]['type']} {recs[0]['redop']}  ranks={world}  iters={iters} "
          f"(small/large sizes)  warmup={recs[0]['warmup']}  median of {args.repeats} "
          f"repeats  time per call (us)"
          f"{'' if not wrong else f'  WRONG ELEMENTS: {wrong}'}")
    names = {"halving_doubling": "hd"}
    print("#" + f"{'size':>11}" + "".join(f"{names.get(a, a):>11}" for a in ALGORITHMS)
          + f"{'winner':>8}{'auto now':>10}{'auto/best':>10}")
    for size in sorted(table):
        row = table[size]
        best = winner(row)
        auto = select(cur.tree_threshold_bytes, cur.hd_threshold_bytes, size, world)
        print(f"{size:12d}" + "".join(f"{row[a]:11.1f}" for a in ALGORITHMS)
              + f"{names.get(best, best):>8}{names.get(auto, auto):>10}"
              f"{row[auto] / row[best]:10.2f}")


def crossovers(table: Table) -> List[Tuple[int, str, str]]:
    """(first size of the new winner, old winner, new winner) wherever the winner changes."""
    out, prev = [], None
    for size in sorted(table):
        w = winner(table[size])
        if prev is not None and w != prev:
            out.append((size, prev, w))
        prev = w
    return out


def stays_ahead(table: Table, a: str, b: str):
    """Smallest size from which ``a`` is faster than ``b`` at every larger measured size
    (None if ``a`` is not ahead at the largest). Robust to the noise that makes single
    winner changes flap."""
    first = None
    for size in sorted(table, reverse=True):
        if table[size][a] < table[size][b]:
            first = size
        else:
            break
    return first


_PAIRS = (("ring", "tree"), ("ring", "direct"), ("ring", "halving_doubling"),
          ("halving_doubling", "tree"), ("tree", "direct"))


def score(tables: Dict[int, Table], tree: int, hd: int) -> float:
    """Geometric-mean slowdown of auto's pick against the fastest, over all (world, size)."""
    logs = [math.log(row[select(tree, hd, size, world)] / min(row.values()))
            for world, table in tables.items() for size, row in table.items()]
    return math.exp(sum(logs) / len(logs))


def propose(tables: Dict[int, Table], margin: float = 0.01) -> Tuple[int, int, float]:
    """The thresholds whose score is within ``margin`` of the best pair's, preferring the
    smallest hd threshold and then the smallest tree threshold: where timings tie within
    the noise, ring (segmented, pipelined, bandwidth-optimal) is the safer pick."""
    sizes = sorted({s for t in tables.values() for s in t})
    cands = [0] + sizes
    scored = [(score(tables, tree, hd), tree, hd) for tree in cands for hd in cands if hd >= tree]
    best = min(s for s, _, _ in scored)
    s, tree, hd = min(((s, tree, hd) for s, tree, hd in scored if s <= best * (1 + margin)),
                      key=lambda c: (c[2], c[1]))
    return tree, hd, s


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--worlds", default="2,3,4,8", help="comma-separated world sizes")
    p.add_argument("-b", "--minbytes", default="8")
    p.add_argument("-e", "--maxbytes", default="16M")
    p.add_argument("-n", "--iters", type=int, default=10, help="calls per timed loop above --split")
    p.add_argument("--small-iters", type=int, default=100, help="calls per loop up to --split")
    p.add_argument("--split", default="64K")
    p.add_argument("-w", "--warmup", type=int, default=3)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("-d", "--dtype", default="float32")
    p.add_argument("--json", default=None, help="write every record (JSON lines) here")
    p.add_argument("--load", nargs="+", metavar="JSONL", default=None,
                   help="measure nothing: analyse the records of earlier --json runs (several "
                        "runs: the median per world, size and algorithm)")
    args = p.parse_args()

    loaded: Dict[int, List[dict]] = {}
    if args.load:
        for path in args.load:
            with open(path) as f:
                for line in f:
                    r = json.loads(line)
                    loaded.setdefault(r["ranks"], []).append(r)
        args.worlds = ",".join(str(w) for w in sorted(loaded))
        args.repeats = f"{len(args.load)} run(s) x {loaded[min(loaded)][0]['repeats']}"
    tables: Dict[int, Table] = {}
    records: List[dict] = []
    for world in (int(w) for w in args.worlds.split(",")):
        recs = loaded[world] if args.load else run_world(world, args)
        records += recs
        tables[world] = to_table(recs)
        print_table(world, tables[world], args, recs)
        print("# crossovers: " + ("; ".join(
            f"{old}->{new} at {format_size(s)}" for s, old, new in crossovers(tables[world]))
            or "none"))
        ahead = []
        for a, b in _PAIRS:
            s = stays_ahead(tables[world], a, b)
            ahead.append(f"{a}<{b} from {format_size(s) if s is not None else 'never'}")
        print("# stays faster from there on: " + "; ".join(ahead))
        print(flush=True)

    cur = meshcoll.CollectiveConfig()
    tree, hd, s = propose(tables)
    print(f"# current  tree_threshold_bytes={cur.tree_threshold_bytes} "
          f"hd_threshold_bytes={cur.hd_threshold_bytes}: auto is "
          f"{score(tables, cur.tree_threshold_bytes, cur.hd_threshold_bytes):.3f}x the best "
          f"(geometric mean over worlds {args.worlds} and sizes)")
    print(f"# proposed tree_threshold_bytes={tree} hd_threshold_bytes={hd}: {s:.3f}x"
          + ("  (hd <= tree: no halving-doubling window)" if hd <= tree else ""))
    for world, table in tables.items():
        print(f"#   ranks={world}: current {score({world: table}, cur.tree_threshold_bytes, cur.hd_threshold_bytes):.3f}x"
              f", proposed {score({world: table}, tree, hd):.3f}x")
    if args.json:
        with open(args.json, "w") as f:
            for r in records:
                f.write(json.dumps(r) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
