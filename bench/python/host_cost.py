"""Per-call host cost of small synchronous collectives on the CPU backend: the time of one
8-byte (one float64, or two float32) call, back to back, at world 1 (in process) and world 2
(two processes, shared memory and TCP), of an async all_reduce with its wait (the hand-off
to the group's worker thread and back), and at world 2 of a point-to-point round trip (one
"call": rank 0 sends and then receives 8 bytes, rank 1 the reverse; over TCP whatever the
group's transport), blocking and posted. It measures the road from Python to the wire, which
is what a refactor of that road must not slow down.

    PYTHONPATH=/tmp/newsite python bench/python/host_cost.py --label after
    PYTHONPATH=/tmp/oldsite python bench/python/host_cost.py --label before

Each case runs ``--calls`` calls ``--repeats`` times; the table shows the median of the
per-repeat means (us per call) and the spread (min-max over repeats). A benchmark, not a
test. For a before/after, install both builds with ``pip install --target`` into folders whose
paths have the same length and run them alternately: the size of the environment moves the
initial stack, and on the 2-core VM one extra variable (``FOO=1``) took the world-of-1
all_reduce from 0.49 to 1.0 us for either build (4K aliasing), which swamps what is measured.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import time

import numpy as np

OPS = ("all_reduce", "broadcast", "all_gather", "reduce_scatter", "all_reduce async",
       "send+recv", "isend+irecv")
P2P = ("send+recv", "isend+irecv")  # world 2 only: one round trip per "call"


def _call(pg, op, x):
    if op == "all_reduce":
        pg.all_reduce(x)
    elif op == "broadcast":
        pg.broadcast(x, 0)
    elif op == "all_gather":
        pg.all_gather(x)
    elif op == "all_reduce async":  # the worker's hand-off and the wait (Note [Brief spin])
        pg.all_reduce(x, async_op=True).wait()
    elif op in P2P:  # rank 0 sends first; blocking (Note [Synchronous point-to-point]) or posted
        peer, posted = 1 - pg.rank, op == "isend+irecv"
        for sending in ((True, False) if pg.rank == 0 else (False, True)):
            if posted:
                (pg.isend if sending else pg.irecv)(x, peer).wait()
            else:
                (pg.send if sending else pg.recv)(x, peer)
    else:
        pg.reduce_scatter(x)


def _measure(pg, calls, repeats):
    out = {}
    for op in OPS:
        if op in P2P and pg.size != 2:
            continue
        x = np.ones(pg.size if op == "reduce_scatter" else 1, np.float64)
        for _ in range(200):
            _call(pg, op, x)
        means = []
        for _ in range(repeats):
            pg.barrier()
            t0 = time.perf_counter()
            for _ in range(calls):
                _call(pg, op, x)
            means.append((time.perf_counter() - t0) / calls * 1e6)
        out[op] = means
    return out


def _rank(rank, world, port, transport, calls, repeats, q):
    os.environ["MESHCOLL_TRANSPORT"] = transport
    os.environ["MESHCOLL_TOKEN"] = f"host-cost-{port}"  # a job of ours: no stranger warning
    import meshcoll
    pg = meshcoll.init(rank=rank, world_size=world, master_addr="127.0.0.1", master_port=port)
    res = _measure(pg, calls, repeats)
    meshcoll.destroy()
    if rank == 0:
        q.put(res)


def _free_port():
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(world, transport, calls, repeats):
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_rank, args=(r, world, port, transport, calls, repeats, q))
             for r in range(world)]
    for p in procs:
        p.start()
    res = q.get(timeout=300)
    for p in procs:
        p.join(60)
    return res


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=5000)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--label", default="")
    args = ap.parse_args()
    import meshcoll
    print(f"# meshcoll {meshcoll.__file__} {args.label}  calls={args.calls} repeats={args.repeats}")
    print(f"# {'world':>5} {'transport':>9} {'op':>16} {'us/call':>9} {'min':>8} {'max':>8}")
    for world, transport in ((1, "auto"), (2, "shm"), (2, "tcp")):
        res = run(world, transport, args.calls if world == 1 else args.calls // 5, args.repeats)
        for op, means in res.items():
            print(f"  {world:>5} {transport:>9} {op:>16} {statistics.median(means):9.3f} "
                  f"{min(means):8.3f} {max(means):8.3f}", flush=True)


if __name__ == "__main__":
    main()
