"""Host cost of a small NCCL call from Python: meshcoll against the same NCCL called through
CuPy's thin binding (the floor for any Python library), in the same processes.

    NCCL_NVLS_ENABLE=0 python bench/python/nccl_host_cost.py --nprocs 2

Per op, microseconds per call of `--calls` back-to-back calls on 8-byte buffers (then one
synchronize), median of `--repeats`, rank 0: meshcoll's method, meshcoll's C++ entry point
called directly (the Python layer's share is the difference), bare NCCL through CuPy, and a
torch `add_` for the cost of one kernel launch from Python. send+recv is one round trip
between pairs of ranks (rank 0 sends to rank 1, then receives from it). Such calls are bound
by the host: nccl-tests' C loop (`all_reduce_perf -b 8 -e 8`) is the other anchor. One
process per GPU.

--block N adds N all_reduces per ``group.coalesced()`` block (one NCCL group launch) against
N CuPy calls between ncclGroupStart/End, time per call.

--steps also prints where meshcoll's call spends its time, step by step (Note [Host timers]
in csrc/common/host_timers.h: MESHCOLL_HOST_TIMERS=1, which adds its own few tenths of a
microsecond to every call timed in that run).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import traceback

from compare_nccl import cupy_comm
from spawn_ranks import run_ranks


def rank_main(rank, world, port, token, args, conn):
    try:
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
        import torch
        import meshcoll
        from cupy.cuda import nccl
        from meshcoll import _C
        torch.cuda.set_device(rank)
        if args.stream == "side":  # every call, meshcoll's and CuPy's, on a created stream
            torch.cuda.set_stream(torch.cuda.Stream())
        os.environ["MESHCOLL_TOKEN"] = token
        pg = meshcoll.init(backend="nccl", rank=rank, world_size=world, master_addr="127.0.0.1",
                           master_port=port, timeout=120, device=rank)

        issue = []  # the host's time to issue the calls, before the closing synchronize

        def timed(f):
            for _ in range(10):
                f()
            torch.cuda.synchronize()
            pg.barrier()
            t0 = time.perf_counter()
            for _ in range(args.calls):
                f()
            issue.append((time.perf_counter() - t0) / args.calls * 1e6)
            torch.cuda.synchronize()
            return (time.perf_counter() - t0) / args.calls * 1e6

        cc = cupy_comm(pg, rank, world, rank)  # CuPy's communicator over the same ranks
        if cc is None:
            raise RuntimeError("nccl_host_cost needs CuPy with NCCL (cupy.cuda.nccl)")
        sp = torch.cuda.current_stream().cuda_stream
        be, cfg, n = pg._backend, pg.config, 2
        x = torch.randn(n, device="cuda")
        ag = torch.empty(world * n, device="cuda")
        agv = ag.view(world, n)
        xs = torch.randn(world * n, device="cuda")
        o = torch.empty(n, device="cuda")
        xp, agp, xsp, op_ = x.data_ptr(), ag.data_ptr(), xs.data_ptr(), o.data_ptr()
        F32, SUM = nccl.NCCL_FLOAT32, nccl.NCCL_SUM
        cases = {
            "all_reduce": (
                lambda: pg.all_reduce(x),
                lambda: be.all_reduce_sync(x, "sum", None, None, "auto", cfg.max_segment_bytes,
                                           cfg.tree_threshold_bytes, cfg.hd_threshold_bytes,
                                           0, "auto", "auto"),
                lambda: cc.allReduce(xp, xp, n, F32, SUM, sp)),
            "all_gather": (
                lambda: pg.all_gather(x, out=agv),
                lambda: be.all_gather_sync(x, agv, None, None),
                lambda: cc.allGather(xp, agp, n, F32, sp)),
            "reduce_scatter": (
                lambda: pg.reduce_scatter(xs, out=o),
                lambda: be.reduce_scatter_sync(xs, o, "sum", None, None),
                lambda: cc.reduceScatter(xsp, op_, n, F32, SUM, sp)),
            "broadcast": (
                lambda: pg.broadcast(x, src=0),
                lambda: be.broadcast_sync(x, 0, None, None, "auto", 0, 512 << 10, "auto", "auto"),
                lambda: cc.bcast(xp, n, F32, 0, sp)),
        }
        # A round trip between pairs of ranks (0 and 1, 2 and 3, ...): the even rank sends
        # then receives, the odd one the reverse; an unpaired last rank sits it out.
        peer = rank ^ 1
        if peer < world:
            first = rank % 2 == 0
            def pair(send, recv):
                return (lambda: (send(), recv())) if first else (lambda: (recv(), send()))
            cases["send+recv"] = (
                pair(lambda: pg.send(x, peer), lambda: pg.recv(x, peer)),
                pair(lambda: be.send_sync(x, peer, 0, None, None),
                     lambda: be.recv_sync(x, peer, 0, None, None)),
                pair(lambda: cc.send(xp, n, F32, peer, sp), lambda: cc.recv(xp, n, F32, peer, sp)))
        else:
            idle = (lambda: None,) * 3
            cases["send+recv"] = idle
        if args.block:
            # --block N: N all_reduces per group.coalesced() block (one NCCL group launch),
            # against N CuPy calls between ncclGroupStart/End; per call.
            # Each call of a block on its own tensor: a block's calls may not use each
            # other's results (Note [Calls of a block are independent]).
            k = args.block
            xk = [torch.randn(n, device="cuda") for _ in range(k)]
            pk = [t.data_ptr() for t in xk]

            def block(call):
                def f():
                    with pg.coalesced():
                        for t in xk:
                            call(t)
                return f

            def cupy_block():
                nccl.groupStart()
                for p in pk:
                    cc.allReduce(p, p, n, F32, SUM, sp)
                nccl.groupEnd()
            cases[f"all_reduce x{k} block"] = (
                block(lambda t: pg.all_reduce(t)),
                block(lambda t: be.all_reduce_sync(t, "sum", None, None, "auto",
                                                   cfg.max_segment_bytes,
                                                   cfg.tree_threshold_bytes,
                                                   cfg.hd_threshold_bytes, 0, "auto",
                                                   "auto")),
                cupy_block)
        rows, steps = [], {}
        for name, fs in cases.items():
            if args.ops and name.split(" ")[0] not in args.ops.split(","):
                continue
            _C.host_timers(reset=True)
            per = args.block if name.endswith(" block") else 1  # time per call
            times = []
            for f in fs:
                issue.clear()
                times.append(statistics.median(timed(f) for _ in range(args.repeats)) / per)
                times.append(statistics.median(issue) / per)
            steps[name] = _C.host_timers(reset=True)  # [] unless --steps
            rows.append((name, *times))
        launch = statistics.median(timed(lambda: x.add_(0.0)) for _ in range(args.repeats))
        meshcoll.destroy()
        conn.send(("ok", (rows, launch, steps)))
    except BaseException:  # noqa: BLE001 - reported to the parent
        conn.send(("error", traceback.format_exc()))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nprocs", type=int, default=2)
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--steps", action="store_true", help="also time each step (host timers)")
    ap.add_argument("--ops", default="", help="only these ops (comma-separated; default all)")
    ap.add_argument("--block", type=int, default=0,
                    help="also N all_reduces per coalesced block, against CuPy's "
                         "ncclGroupStart/End around N calls (time per call)")
    ap.add_argument("--stream", choices=("default", "side"), default="default",
                    help="torch's default (legacy) stream or a created one (nccl-tests' kind)")
    args = ap.parse_args(argv)
    if args.steps:
        os.environ["MESHCOLL_HOST_TIMERS"] = "1"  # read by each rank's import of meshcoll._C
    results = run_ranks(rank_main, args.nprocs, args, timeout=300)
    rows, launch, steps = results[0]
    import torch
    print(f"# host cost per 8-byte call, {args.nprocs} x {torch.cuda.get_device_name(0)}, "
          f"{args.calls} back-to-back calls on the {args.stream} stream, median of "
          f"{args.repeats}, rank 0, us; issue: the host's time to issue them (before the "
          f"closing synchronize), rank 0 and the slowest rank")
    print(f"{'op':>20} {'meshcoll':>9} {'_C entry':>9} {'cupy nccl':>10} {'ratio':>6}"
          f" {'issue m':>8} {'max':>6} {'issue c':>8} {'max':>6}")
    for i, (name, mesh, mesh_i, entry, _, bare, bare_i) in enumerate(rows):
        worst = lambda k: max(r[0][i][k] for r in results)  # noqa: E731
        print(f"{name:>20} {mesh:9.2f} {entry:9.2f} {bare:10.2f} {mesh / bare:6.2f}"
              f" {mesh_i:8.2f} {worst(2):6.2f} {bare_i:8.2f} {worst(6):6.2f}")
    print(f"# one torch kernel launch (x.add_): {launch:.2f} us")
    for name, table in steps.items():
        if table:
            print(f"\n## {name}: meshcoll's call (method and _C entry) step by step, mean us")
            for step, calls, us in table:
                print(f"{step:>40} {us:8.2f}   ({calls} calls)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
