"""meshcoll against NVIDIA's nccl-tests, in one run on the same GPUs.

    bash bench/gpu/build_nccl_tests.sh .nccl-tests /tmp/nt     # a checkout, never vendored
    python bench/python/vs_nccl_tests.py --nccl-tests /tmp/nt --nprocs 2 [--big]

Runs nccl-tests first (mpirun, one process per GPU), then meshcoll in processes that hold only
meshcoll's communicator (as a user's would: no torch.distributed, no CuPy NCCL), and prints,
per op, dtype and size, the time of one call and meshcoll's ratio to nccl-tests in four modes:

  eager        ordinary buffers, back-to-back calls     vs nccl-tests (default)
  symmetric    group.empty(symmetric=True) buffers      vs nccl-tests -R 2
  graph        ordinary, `iters` calls in a CUDA graph  vs nccl-tests -G
  sym+graph    symmetric, in a CUDA graph               vs nccl-tests -R 2 -G
  coalesced    ordinary, `--agg` calls per               vs nccl-tests -m AGG (its
               group.coalesced() block                      ncclGroupStart/End per AGG ops)
  eager-nccl   eager, with MESHCOLL_NCCL_DIRECT_BYTES=0  vs nccl-tests (NCCL's kernels for
               in meshcoll's processes                      every call: the direct kernels'
                                                            baseline, in the same run)

Timing follows nccl-tests: host wall time of `iters` back-to-back calls (or of
`--graph-launches` replays of a graph of `iters` calls, on its capture stream) until the
stream is idle, divided by the calls made; meshcoll reports the
slowest rank's median over `--repeats` runs. Sizes follow nccl-tests (all_gather: the gathered
output; reduce_scatter: the input). all_reduce is in place (nccl-tests' in-place column);
all_gather and reduce_scatter out of place (and in place with --big). Before timing, each
size is checked once on random data against the exact sum (#wrong).

--big compares busbw at 64 MiB - 1 GiB: all_reduce, all_gather and reduce_scatter (out of
place and in place) and broadcast, eager, ordinary buffers.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import statistics
import subprocess
import sys
import time
import traceback

from meshcoll.bench import BUS_FACTORS, format_size, parse_size, size_steps
from spawn_ranks import run_ranks

MODES = {"eager": [], "symmetric": ["-R", "2"], "graph": ["-G", "{graph}"],
         "sym+graph": ["-R", "2", "-G", "{graph}"], "coalesced": ["-m", "{agg}"],
         "eager-nccl": []}
NT_DTYPES = {"float32": "float", "bfloat16": "bfloat16"}


# ---- nccl-tests ----------------------------------------------------------------------------

def run_nccl_tests(args, op, dtype, mode, minb, maxb, factor, iters):
    """{size in bytes: (out-of-place us, in-place us)} from one nccl-tests run."""
    exe = os.path.join(args.nccl_tests, f"{op}_perf")
    extra = [a.format(graph=args.graph_launches, agg=args.agg) for a in MODES[mode]]
    cmd = ["mpirun", "--allow-run-as-root", "-np", str(args.nprocs), "--bind-to", "none",
           "-x", "NCCL_NVLS_ENABLE=0", "-x", "LD_LIBRARY_PATH", exe, "-b", str(minb), "-e",
           str(maxb), "-f", str(factor), "-g", "1", "-d", NT_DTYPES[dtype], "-n", str(iters),
           "-w", str(args.warmup)] + extra
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    rows = {}
    for line in p.stdout.splitlines():
        f = line.split()
        if len(f) >= 13 and re.fullmatch(r"\d+", f[0]) and f[0] != "0":
            rows[int(f[0])] = (float(f[5]), float(f[9]))
    if not rows:
        raise RuntimeError(f"nccl-tests gave no rows: {' '.join(cmd)}\n{p.stdout[-2000:]}\n"
                           f"{p.stderr[-2000:]}")
    return rows


# ---- meshcoll ------------------------------------------------------------------------------

def counts_for(op, nbytes, itemsize, world):
    """(elements of x, elements of out) for a call of nccl-tests size `nbytes`."""
    n = max(1, nbytes // itemsize)
    if op in ("all_gather", "reduce_scatter"):
        n = max(world, n - n % world)
        return (n // world, n) if op == "all_gather" else (n, n // world)
    return n, n


class Buffers:
    """x and out of each size as slices at offset 0 of two arenas, symmetric or not, so every
    rank passes the same offsets (symmetric kernels need it)."""

    def __init__(self, pg, torch, dtype, max_elems, symmetric):
        self.torch, self.dtype = torch, dtype
        make = (lambda n: pg.empty(n, dtype, symmetric=True)) if symmetric else \
            (lambda n: torch.empty(n, device="cuda", dtype=getattr(torch, dtype)))
        self.a, self.b = make(max_elems), make(max_elems)

    def get(self, op, nx, nout, rank, in_place):
        if in_place and op == "all_gather":
            return self.b[rank * nx:(rank + 1) * nx], self.b[:nout]
        if in_place and op == "reduce_scatter":
            return self.a[:nx], self.a[rank * nout:(rank + 1) * nout]
        return self.a[:nx], self.b[:nout]


def call_of(pg, op, x, out):
    if op == "all_reduce":
        return lambda: pg.all_reduce(x)
    if op == "all_gather":
        return lambda: pg.all_gather(x, out=out)
    if op == "reduce_scatter":
        return lambda: pg.reduce_scatter(x, out=out)
    if op == "broadcast":
        return lambda: pg.broadcast(x, src=0)
    raise ValueError(op)


def check(pg, torch, op, x, out, coalesced):
    """Elements of one call's result that differ from the exact answer (integer data); the
    call made in a block of its own in coalesced mode."""
    r, n = pg.rank, pg.size
    gen = torch.Generator(device="cuda")

    def data(rank, count):
        gen.manual_seed(1000 + rank)
        return torch.randint(-4, 5, (count,), device="cuda", generator=gen).to(x.dtype)

    x.copy_(data(r, x.numel()))
    with pg.coalesced() if coalesced else contextlib.nullcontext():
        call_of(pg, op, x, out)()
    torch.cuda.synchronize()
    if op == "all_reduce":
        want, got = sum(data(k, x.numel()).double() for k in range(n)), x
    elif op == "all_gather":
        want, got = torch.cat([data(k, x.numel()).double() for k in range(n)]), out
    elif op == "reduce_scatter":
        c = out.numel()
        want = sum(data(k, x.numel()).double() for k in range(n))[r * c:(r + 1) * c]
        got = out
    else:
        want, got = data(0, x.numel()).double(), x
    return int((got.double() != want).sum().item())


def time_call(pg, torch, f, iters, warmup, graph, launches):
    for _ in range(warmup):
        f()
    torch.cuda.synchronize()
    if graph:
        # As nccl-tests -G: `launches` back-to-back replays of a graph of `iters` calls, on
        # the stream it was captured on. Replays on the legacy default stream cost 1.1-2x as
        # much per op (it synchronizes with every other blocking stream): measured on 2 H100s.
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=s):
            for _ in range(iters):
                f()
        with torch.cuda.stream(s):
            g.replay()
        torch.cuda.synchronize()
        pg.barrier()
        t0 = time.perf_counter()
        with torch.cuda.stream(s):
            for _ in range(launches):
                g.replay()
        torch.cuda.synchronize()
        return (time.perf_counter() - t0) / (iters * launches) * 1e6
    pg.barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        f()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / iters * 1e6


def rank_main(rank, world, port, token, args, plan, conn):
    try:
        import torch
        import meshcoll
        torch.cuda.set_device(rank)
        os.environ["MESHCOLL_TOKEN"] = token
        pg = meshcoll.init(backend="nccl", rank=rank, world_size=world, master_addr="127.0.0.1",
                           master_port=port, timeout=300, device=rank)
        # --stream side: every call on a created (non-blocking) stream, as nccl-tests' own.
        side = torch.cuda.Stream() if args.stream == "side" else None
        with torch.cuda.stream(side):
            rows = time_plan(pg, torch, args, plan, rank, world)
        direct = pg.direct_kernels
        meshcoll.destroy()
        conn.send(("ok", (rows, direct)))
    except BaseException:  # noqa: BLE001 - reported to the parent
        conn.send(("error", traceback.format_exc()))


def time_plan(pg, torch, args, plan, rank, world):
    """Checks and times every (op, dtype, mode, placement, size) of the plan: the rows."""
    rows, arenas = [], {}
    for op, dtype, mode, in_place, sizes, iters in plan:
        sym = mode in ("symmetric", "sym+graph")
        key = (dtype, sym)
        itemsize = torch.empty(0, dtype=getattr(torch, dtype)).element_size()
        coalesced = mode == "coalesced"
        # A block's calls each on their own buffers: they may not use each other's results.
        per = args.agg if coalesced else 1
        for i in range(per):
            if key + (i,) not in arenas:
                arenas[key + (i,)] = Buffers(pg, torch, dtype, args.maxbytes // itemsize + world,
                                             sym)
        bufs = arenas[key + (0,)]
        for nbytes in sizes:
            nx, nout = counts_for(op, nbytes, itemsize, world)
            x, out = bufs.get(op, nx, nout, rank, in_place)
            wrong = check(pg, torch, op, x, out, coalesced)
            x.zero_()  # in-place sums stay finite
            f = call_of(pg, op, x, out)
            if coalesced:  # as nccl-tests -m: `agg` calls in each block, time per call
                calls = [f]
                for i in range(1, per):
                    xi, oi = arenas[key + (i,)].get(op, nx, nout, rank, in_place)
                    xi.zero_()
                    calls.append(call_of(pg, op, xi, oi))

                def f():
                    with pg.coalesced():
                        for call in calls:
                            call()
            ts = [time_call(pg, torch, f, iters, args.warmup, mode.endswith("graph"),
                            args.graph_launches) / per for _ in range(args.repeats)]
            med = torch.tensor([statistics.median(ts)], device="cuda")
            pg.all_reduce(med, op="max")
            w = torch.tensor([wrong], device="cuda", dtype=torch.int64)
            pg.all_reduce(w)
            rows.append((op, dtype, mode, in_place, nbytes, float(med.item()), int(w.item()),
                         pg.is_symmetric(x)))
    return rows


def run_meshcoll(args, plan):
    """Rank 0's rows and its group's direct-kernel status; the plan's eager-nccl items run in
    processes of their own, with the direct kernels off (Note [Direct kernels])."""
    rows, status = [], []
    for nccl_only in (False, True):
        part = [p for p in plan if (p[2] == "eager-nccl") == nccl_only]
        if not part:
            continue
        old = os.environ.get("MESHCOLL_NCCL_DIRECT_BYTES")
        if nccl_only:
            os.environ["MESHCOLL_NCCL_DIRECT_BYTES"] = "0"
        try:
            got, direct = run_ranks(rank_main, args.nprocs, args, part, timeout=args.timeout)[0]
        finally:
            if nccl_only:
                os.environ.pop("MESHCOLL_NCCL_DIRECT_BYTES", None)
                if old is not None:
                    os.environ["MESHCOLL_NCCL_DIRECT_BYTES"] = old
        rows += got
        status.append(f"{'eager-nccl' if nccl_only else 'other modes'}: {direct}")
    return rows, status


# ---- the report ----------------------------------------------------------------------------

def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nccl-tests", required=True, help="folder with all_reduce_perf etc.")
    ap.add_argument("--nprocs", type=int, default=2)
    ap.add_argument("--ops", default="all_reduce,all_gather,reduce_scatter")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--modes", default="eager,symmetric,graph,sym+graph")
    ap.add_argument("--minbytes", type=parse_size, default=8)
    ap.add_argument("--maxbytes", type=parse_size, default=4 << 20)
    ap.add_argument("--factor", type=int, default=4)
    ap.add_argument("--iters", type=int, default=100)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--graph-launches", type=int, default=20, help="nccl-tests -G")
    ap.add_argument("--agg", type=int, default=8, help="calls per block in coalesced mode "
                                                         "(nccl-tests -m)")
    ap.add_argument("--big", action="store_true", help="64 MiB - 1 GiB busbw, eager")
    ap.add_argument("--stream", choices=("default", "side"), default="default",
                    help="meshcoll's calls on torch's default (legacy) stream or on a created "
                         "one, as nccl-tests runs on")
    ap.add_argument("--timeout", type=float, default=1200)
    args = ap.parse_args(argv)
    ops, dtypes = args.ops.split(","), args.dtypes.split(",")
    modes = args.modes.split(",")
    n = args.nprocs
    if args.big:
        args.minbytes, args.maxbytes, args.factor, args.iters = 64 << 20, 1 << 30, 4, 20
        ops = ["all_reduce", "all_gather", "reduce_scatter", "broadcast"]
        dtypes, modes = ["float32"], ["eager"]
    plan, nt = [], {}
    for op in ops:
        minb = args.minbytes if op in ("all_reduce", "broadcast") else max(args.minbytes, 8 * n)
        sizes = [s for s in size_steps(minb, args.maxbytes, args.factor, 0)]
        for dtype in dtypes:
            for mode in modes:
                rows = run_nccl_tests(args, op, dtype, mode, minb, args.maxbytes, args.factor,
                                      args.iters)
                places = [False, True] if args.big and op in ("all_gather", "reduce_scatter") \
                    else [op in ("all_reduce", "broadcast")]
                for ip in places:
                    nt[(op, dtype, mode, ip)] = {s: t[1 if ip else 0] for s, t in rows.items()}
                    plan.append((op, dtype, mode, ip, sizes, args.iters))
    rows, status = run_meshcoll(args, plan)
    import torch
    print(f"# meshcoll vs nccl-tests, {n} x {torch.cuda.get_device_name(0)}, NCCL "
          f"{torch.cuda.nccl.version()} (torch's build; meshcoll loads the same wheel)")
    print(f"# meshcoll's direct kernels: {'; '.join(status)}")
    print(f"# iters {args.iters}, warmup {args.warmup}, repeats {args.repeats} (median, slowest "
          "rank); time per call in us; ratio = meshcoll / nccl-tests")
    last = None
    for op, dtype, mode, ip, nbytes, t, wrong, sym in rows:
        head = (op, dtype, mode, ip)
        if head != last:
            print(f"\n## {op} {dtype} {mode}{' in-place' if ip else ''}")
            print(f"{'size':>10} {'meshcoll':>10} {'nccl-tests':>10} {'ratio':>7} "
                  f"{'busbw m':>9} {'busbw nt':>9} {'#wrong':>6} {'sym':>4}")
            last = head
        ref = nt[head].get(nbytes)
        bw = lambda us: nbytes / us / 1e3 * BUS_FACTORS[op](n) if us else 0.0  # noqa: E731
        print(f"{format_size(nbytes):>10} {t:10.2f} {ref if ref else float('nan'):10.2f} "
              f"{t / ref if ref else float('nan'):7.3f} {bw(t):9.2f} {bw(ref):9.2f} {wrong:6d} "
              f"{'yes' if sym else 'no':>4}")
    sys.stdout.flush()
    return 1 if any(r[6] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
