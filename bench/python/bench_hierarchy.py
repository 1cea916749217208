"""Hierarchical against flat collectives on a group spanning (emulated) hosts, in one run.

    meshcoll-run -n 4 bench/python/bench_hierarchy.py --hosts 2      # ranks 0,1 | 2,3
    meshcoll-run -n 8 bench/python/bench_hierarchy.py --hosts 2 -b 1K -e 16M --ops all_gather

Each rank sets ``MESHCOLL_HOST_ID`` to its emulated host (rank // (world / hosts)) and builds
two groups over every rank: ``flat`` (hierarchy off, as ``MESHCOLL_HIERARCHY=0``: all of it
on TCP, as Gloo does) and ``hier`` (shared memory inside each host, TCP between leaders; Note [Hierarchy] in
meshcoll/hierarchy.py). On one machine the "network" is loopback, so TCP between hosts is
cheaper than a real network would make it: the gain here is a lower bound. Times are the
slowest rank's mean over ``-n`` calls, median over ``--repeats``; float32 (sum; broadcast
from rank 1, not a leader; all_gather's size is one rank's input).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import time

import numpy as np

import meshcoll
from meshcoll.bench import parse_size, size_steps


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hosts", type=int, default=2)
    p.add_argument("-b", "--minbytes", default="8")
    p.add_argument("-e", "--maxbytes", default="16M")
    p.add_argument("-f", "--stepfactor", type=int, default=8)
    p.add_argument("-n", "--iters", type=int, default=10)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--ops", default="all_reduce,broadcast,all_gather")
    args = p.parse_args()
    calls = {"all_reduce": lambda g, x: g.all_reduce(x), "broadcast": lambda g, x: g.broadcast(x, 1),
             "all_gather": lambda g, x: g.all_gather(x)}
    world = meshcoll.init()
    if world.size % args.hosts:
        raise SystemExit(f"--hosts {args.hosts} must divide the {world.size} ranks")
    os.environ["MESHCOLL_HOST_ID"] = f"host{world.rank // (world.size // args.hosts)}"
    meshcoll._C.reload_config()  # the core read the environment when _C was imported
    # MESHCOLL_HIERARCHY is read once, by init (GroupOptions): setting it here would change
    # nothing, so the flat group is made with the world's options with hierarchy off.
    opts = world._options
    world._options = dataclasses.replace(opts, hierarchy=False)
    flat = world.new_group(world.ranks)
    world._options = dataclasses.replace(opts, hierarchy=True)
    hier = world.new_group(world.ranks)
    world._options = opts
    assert hier._hier is not None and flat._hier is None

    def timed(call, g, x):
        runs = []
        for _ in range(args.repeats):
            world.barrier()
            t0 = time.perf_counter()
            for _ in range(args.iters):
                call(g, x)
            t = np.array([(time.perf_counter() - t0) / args.iters])
            runs.append(float(world.all_gather(t).max()))
        return statistics.median(runs)

    if world.rank == 0:
        print(f"# meshcoll {meshcoll.__version__}  float32  ranks={world.size}  "
              f"hosts={args.hosts} (emulated: MESHCOLL_HOST_ID)  iters={args.iters}  "
              f"median of {args.repeats}")
    for op in args.ops.split(","):
        call = calls[op.strip()]
        if world.rank == 0:
            print(f"# {op.strip()}")
            print(f"# {'size (B)':>10} {'flat (us)':>11} {'hier (us)':>11} {'flat/hier':>10}")
        for nbytes in size_steps(parse_size(args.minbytes), parse_size(args.maxbytes),
                                 args.stepfactor, 0):
            x = np.random.default_rng(world.rank).standard_normal(max(1, nbytes // 4)).astype(np.float32)
            for g in (flat, hier):  # warm-up
                call(g, x.copy())
            t_flat, t_hier = timed(call, flat, x.copy()), timed(call, hier, x.copy())
            if world.rank == 0:
                print(f"  {x.nbytes:>10} {t_flat * 1e6:>11.1f} {t_hier * 1e6:>11.1f} "
                      f"{t_flat / t_hier:>10.2f}")
    meshcoll.destroy()


if __name__ == "__main__":
    main()
