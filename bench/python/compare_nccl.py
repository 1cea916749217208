"""meshcoll's NCCL backend vs torch.distributed's NCCL, in one run on the same GPUs.

    python bench/python/compare_nccl.py --nprocs 2 [--maxbytes 1G] [--json out.jsonl]

One process per GPU; every process joins both a meshcoll NCCL group and a torch.distributed
NCCL group (and, where CuPy has NCCL bindings, a bare NCCL communicator through
cupy.cuda.nccl: the "NCCL's own" per-call cost with the least Python around it). For
all_reduce, all_gather, reduce_scatter and broadcast it prints an nccl-tests-style table per
library over 8 B .. maxbytes (device-timed with CUDA events around `iters` back-to-back
calls, the slowest rank's time), busbw and the meshcoll/torch ratios; then the host-timed
8-byte all_reduce latency with a synchronize after each call, and the host cost of one
enqueue. Sizes follow nccl-tests: all_gather's size is the gathered output, reduce_scatter's
the input. busbw = algbw x 2(n-1)/n (all_reduce), (n-1)/n (all_gather, reduce_scatter), 1
(broadcast).

Data is random (never zeros); all_reduce (in place, sum) is refilled before every timed run
and the iteration count is capped so the repeated sums stay finite. #wrong counts the
elements that differ from the exact expected result of one call on integer-valued data.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import os
import secrets
import statistics
import sys
import time
import traceback

from meshcoll.bench import BUS_FACTORS, parse_size, size_steps
from meshcoll.run import pick_free_port


def cupy_comm(pg, rank, world, device):
    """A bare NCCL communicator through CuPy among `pg`'s ranks (rank 0's unique id through
    pg's store), or None where CuPy has no NCCL."""
    try:
        import cupy
        from cupy.cuda import nccl
        if not getattr(nccl, "available", True):
            return None
    except Exception:
        return None
    store = pg._store
    if rank == 0:
        uid = nccl.get_unique_id()  # bytes (CuPy >= 13) or a tuple of ints
        store.set("bench/cupy_uid", uid if isinstance(uid, bytes) else
                  json.dumps(list(uid)).encode())
    raw = store.get("bench/cupy_uid")
    uid = raw if len(raw) == 128 and not raw.startswith(b"[") else tuple(json.loads(raw))
    try:
        with cupy.cuda.Device(device):
            return nccl.NcclCommunicator(world, uid, rank)
    except Exception as e:
        print(f"rank {rank}: no cupy NCCL baseline: {e}", file=sys.stderr)
        return None


class Libs:
    """The communicators under test on this rank, as callables per op."""

    def __init__(self, rank, world, port, torch_port, token, device):
        import torch
        import torch.distributed as dist
        import meshcoll
        self.torch, self.dist = torch, dist
        os.environ["MESHCOLL_TOKEN"] = token
        self.pg = meshcoll.init(backend="nccl", rank=rank, world_size=world,
                                master_addr="127.0.0.1", master_port=port, timeout=300,
                                device=device)
        dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{torch_port}", rank=rank,
                                world_size=world, device_id=torch.device("cuda", device))
        self.rank, self.world = rank, world
        self.cupy_comm = self._cupy_comm()
        self.names = ["meshcoll", "torch"] + (["nccl(cupy)"] if self.cupy_comm else [])

    def _cupy_comm(self):
        return cupy_comm(self.pg, self.rank, self.world, self.torch.cuda.current_device())

    def op(self, lib, name, inp, out):
        """A no-argument callable running one `name` of `lib` on torch's current stream."""
        torch, dist, pg, n = self.torch, self.dist, self.pg, self.world
        if lib == "meshcoll":
            return {"all_reduce": lambda: pg.all_reduce(inp),
                    "broadcast": lambda: pg.broadcast(inp, 0),
                    "all_gather": lambda: pg.all_gather(inp, out=out),
                    "reduce_scatter": lambda: pg.reduce_scatter(inp, out=out)}[name]
        if lib == "torch":
            return {"all_reduce": lambda: dist.all_reduce(inp),
                    "broadcast": lambda: dist.broadcast(inp, 0),
                    "all_gather": lambda: dist.all_gather_into_tensor(out, inp),
                    "reduce_scatter": lambda: dist.reduce_scatter_tensor(out, inp)}[name]
        from cupy.cuda import nccl
        c = self.cupy_comm
        dt = {torch.float32: nccl.NCCL_FLOAT32}[inp.dtype]

        def s():
            return torch.cuda.current_stream().cuda_stream
        return {"all_reduce": lambda: c.allReduce(inp.data_ptr(), inp.data_ptr(), inp.numel(), dt,
                                                  nccl.NCCL_SUM, s()),
                "broadcast": lambda: c.broadcast(inp.data_ptr(), inp.data_ptr(), inp.numel(), dt, 0, s()),
                "all_gather": lambda: c.allGather(inp.data_ptr(), out.data_ptr(), inp.numel(), dt, s()),
                "reduce_scatter": lambda: c.reduceScatter(inp.data_ptr(), out.data_ptr(), out.numel(),
                                                          dt, nccl.NCCL_SUM, s())}[name]


def buffers(torch, name, nbytes, world, big_in, big_out):
    count = nbytes // 4
    if name in ("all_reduce", "broadcast"):
        return count, big_in[:count], None
    c = count // world
    if c == 0:
        return 0, None, None
    if name == "all_gather":
        return count, big_in[:c], big_out[:c * world].view(world, c)
    return count, big_in[:c * world].view(world, c), big_out[:c]


def wrong(torch, libs, lib, name, inp, out):
    """Elements that differ from the exact result of one call on integer-valued data."""
    r, n = libs.rank, libs.world
    if name == "all_reduce":
        inp.fill_(r + 1)
        libs.op(lib, name, inp, out)()
        got, want = inp, n * (n + 1) / 2
    elif name == "broadcast":
        inp.fill_(7 if r == 0 else r + 100)
        libs.op(lib, name, inp, out)()
        got, want = inp, 7
    elif name == "all_gather":
        inp.fill_(r)
        out.fill_(-1)
        libs.op(lib, name, inp, out)()
        got, want = out, torch.arange(n, device=out.device, dtype=out.dtype).view(n, 1)
    else:
        inp.copy_(torch.arange(n, device=inp.device, dtype=inp.dtype).view(n, 1) + r)
        out.fill_(-1)
        libs.op(lib, name, inp, out)()
        got, want = out, n * r + n * (n - 1) / 2
    return int((got != want).sum().item())


def time_op(torch, libs, lib, name, inp, out, iters, warmup):
    if name == "all_reduce":  # in place: fresh random data, bounded growth (see docstring)
        inp.uniform_(-1, 1)
    f = libs.op(lib, name, inp, out)
    for _ in range(warmup):
        f()
    torch.cuda.synchronize()
    libs.dist.barrier()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        f()
    end.record()
    end.synchronize()
    us = start.elapsed_time(end) * 1000.0 / iters
    t = torch.tensor([us], device="cuda")
    libs.dist.all_reduce(t, op=libs.dist.ReduceOp.MAX)  # the slowest rank
    return float(t.item())


def host_latency(torch, libs, rounds, per_round):
    """Median host time of one 8-byte all_reduce + synchronize, per library, interleaved."""
    x = torch.rand(2, device="cuda")
    fs = {lib: libs.op(lib, "all_reduce", x, None) for lib in libs.names}
    samples = {lib: [] for lib in libs.names}
    enqueue = {lib: [] for lib in libs.names}
    for lib, f in fs.items():
        for _ in range(200):
            f()
        torch.cuda.synchronize()
    for _ in range(rounds):
        for lib, f in fs.items():
            libs.dist.barrier()
            torch.cuda.synchronize()
            ts = samples[lib]
            for _ in range(per_round):
                t0 = time.perf_counter()
                f()
                torch.cuda.synchronize()
                ts.append(time.perf_counter() - t0)
            # host cost of enqueueing alone (the GPU queue absorbs 100 calls)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(100):
                f()
            enqueue[lib].append((time.perf_counter() - t0) / 100)
            torch.cuda.synchronize()
            x.uniform_(-1, 1)
    out = {}
    for lib in libs.names:
        ts = sorted(samples[lib])
        out[lib] = dict(median_us=statistics.median(ts) * 1e6, p10_us=ts[len(ts) // 10] * 1e6,
                        p90_us=ts[9 * len(ts) // 10] * 1e6, mean_us=statistics.fmean(ts) * 1e6,
                        enqueue_us=statistics.median(enqueue[lib]) * 1e6, calls=len(ts))
    return out


def boundary_costs(torch, rank):
    """Host microseconds of reading one tensor at the array boundary, for the notes."""
    from meshcoll import _C
    x = torch.rand(2, device="cuda")
    res = {}
    for name, f in (("read_array(torch tensor)", lambda: _C.read_array(x, "b", True, True)),
                    ("x.__dlpack__(stream=1)", lambda: x.__dlpack__(stream=1)),
                    ("x.__cuda_array_interface__", lambda: x.__cuda_array_interface__)):
        for _ in range(100):
            f()
        t0 = time.perf_counter()
        for _ in range(2000):
            f()
        res[name] = (time.perf_counter() - t0) / 2000 * 1e6
    return res


def rank_main(rank, world, port, torch_port, token, args, conn):
    try:
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
        import torch
        torch.cuda.set_device(rank)
        libs = Libs(rank, world, port, torch_port, token, rank)
        maxb = args.maxbytes
        big_in = torch.empty(maxb // 4, device="cuda")
        big_out = torch.empty(maxb // 4, device="cuda")
        big_in.uniform_(-1, 1)
        rows = []
        sizes = size_steps(args.minbytes, maxb, args.factor, 0)
        cap = max(2, int(120 / max(1.0, math.log2(world))) - args.warmup)  # finite sums
        for name in args.ops:
            for nbytes in sizes:
                count, inp, out = buffers(torch, name, nbytes, world, big_in, big_out)
                if count == 0:
                    continue
                iters = args.iters
                if name == "all_reduce":
                    iters = min(iters, cap)
                rec = dict(op=name, size=nbytes, count=count, type="float", redop="sum",
                           ranks=world)
                times = {lib: [] for lib in libs.names}
                for lib in libs.names:
                    if name == "all_gather":
                        big_in[:count // world].uniform_(-1, 1)
                    bad = wrong(torch, libs, lib, name, inp, out)
                    bad_t = torch.tensor([bad], device="cuda")
                    libs.dist.all_reduce(bad_t)
                    rec[lib] = dict(wrong=int(bad_t.item()))
                # The libraries take turns, each repeat starting one further along, so none is
                # always the first timed after a change of size or op (a cold start).
                for rep in range(args.repeats):
                    k = rep % len(libs.names)
                    for lib in libs.names[k:] + libs.names[:k]:
                        times[lib].append(time_op(torch, libs, lib, name, inp, out, iters,
                                                  args.warmup))
                for lib in libs.names:
                    us = statistics.median(times[lib])
                    algbw = nbytes / us / 1e3
                    rec[lib].update(time_us=us, algbw=algbw, busbw=algbw * BUS_FACTORS[name](world))
                rows.append(rec)
        lat = host_latency(torch, libs, args.lat_rounds, args.lat_calls)
        lat_t = torch.tensor([lat[lib]["median_us"] for lib in libs.names], device="cuda")
        libs.dist.all_reduce(lat_t, op=libs.dist.ReduceOp.MAX)
        for i, lib in enumerate(libs.names):
            lat[lib]["median_us_slowest_rank"] = float(lat_t[i].item())
        info = dict(gpu=torch.cuda.get_device_name(rank), torch=torch.__version__,
                    nccl=".".join(map(str, torch.cuda.nccl.version())),
                    meshcoll_nccl=__import__("meshcoll")._C.nccl_library_path(),
                    libs=libs.names, boundary=boundary_costs(torch, rank))
        libs.dist.barrier()
        libs.dist.destroy_process_group()
        import meshcoll
        meshcoll.destroy()
        conn.send(("ok", (rows, lat, info) if rank == 0 else None))
    except BaseException:
        conn.send(("error", traceback.format_exc()))
    finally:
        conn.close()


def print_report(rows, lat, info, world, args, out=sys.stdout):
    import meshcoll
    libs = info["libs"]
    p = lambda *a: print(*a, file=out)  # noqa: E731
    p(f"# meshcoll {meshcoll.__version__} vs torch {info['torch']} (torch's NCCL "
      f"{info['nccl']}; meshcoll loaded {info['meshcoll_nccl']})")
    p(f"# GPU: {world} x {info['gpu']}   ranks={world}   NCCL_NVLS_ENABLE="
      f"{os.environ.get('NCCL_NVLS_ENABLE', 'unset')}   warmup={args.warmup}   "
      f"median of {args.repeats} runs, libraries in rotating order")
    for name in args.ops:
        p("")
        p(f"# {name}  (time: slowest rank, us per call; bandwidth GB/s)")
        head = f"#{'size':>11} {'count':>10} {'type':>6} {'redop':>5}"
        for lib in libs:
            head += f" | {lib[:10]:>10} {'algbw':>7} {'busbw':>7} {'#wrong':>6}"
        head += " | busbw mc/torch"
        p(head)
        for r in (r for r in rows if r["op"] == name):
            line = f" {r['size']:>11} {r['count']:>10} {r['type']:>6} {r['redop']:>5}"
            for lib in libs:
                d = r[lib]
                line += f" | {d['time_us']:>10.2f} {d['algbw']:>7.2f} {d['busbw']:>7.2f} {d['wrong']:>6}"
            line += f" | {r['torch']['time_us'] / r['meshcoll']['time_us']:>6.3f}"
            p(line)
        big = [r for r in rows if r["op"] == name and r["size"] >= (64 << 20)]
        if big:
            ratios = [r["torch"]["time_us"] / r["meshcoll"]["time_us"] for r in big]  # = busbw ratio
            p(f"# {name} >= 64 MiB: meshcoll/torch busbw min {min(ratios):.3f}, "
              f"mean {statistics.fmean(ratios):.3f}; avg busbw meshcoll "
              f"{statistics.fmean(r['meshcoll']['busbw'] for r in big):.1f}, torch "
              f"{statistics.fmean(r['torch']['busbw'] for r in big):.1f} GB/s")
    p("")
    p("# 8-byte all_reduce, host-timed, torch.cuda.synchronize() after each call (us)")
    p(f"#{'library':>11} {'median':>8} {'p10':>8} {'p90':>8} {'mean':>8} {'slowest':>8} "
      f"{'enqueue':>8} {'calls':>6}")
    for lib in libs:
        d = lat[lib]
        p(f" {lib:>11} {d['median_us']:>8.2f} {d['p10_us']:>8.2f} {d['p90_us']:>8.2f} "
          f"{d['mean_us']:>8.2f} {d['median_us_slowest_rank']:>8.2f} {d['enqueue_us']:>8.2f} "
          f"{d['calls']:>6}")
    p(f"# meshcoll/torch median: {lat['meshcoll']['median_us'] / lat['torch']['median_us']:.3f}"
      + (f"   meshcoll/nccl(cupy): {lat['meshcoll']['median_us'] / lat['nccl(cupy)']['median_us']:.3f}"
         if "nccl(cupy)" in lat else ""))
    p("# host cost of reading one tensor at the boundary (us): " +
      ", ".join(f"{k} {v:.2f}" for k, v in info["boundary"].items()))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nprocs", type=int, default=None, help="ranks (default: all GPUs)")
    ap.add_argument("--minbytes", type=parse_size, default=8)
    ap.add_argument("--maxbytes", type=parse_size, default=1 << 30)
    ap.add_argument("--factor", type=int, default=2)
    ap.add_argument("--iters", type=int, default=50,
                    help="timed calls per run at every size; the first call's host launch cost "
                         "is spread over them (at 5 iters it moved 64 MiB ratios by 1%%)")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=3,
                    help="timed runs per size and library, libraries in rotating order; median")
    ap.add_argument("--ops", default="all_reduce,all_gather,reduce_scatter,broadcast")
    ap.add_argument("--lat-rounds", type=int, default=4)
    ap.add_argument("--lat-calls", type=int, default=500)
    ap.add_argument("--json", default=None, help="write one JSON record per line here")
    ap.add_argument("--timeout", type=float, default=900)
    args = ap.parse_args(argv)
    args.ops = [o.strip() for o in args.ops.split(",") if o.strip()]
    if args.nprocs is None:
        import torch
        args.nprocs = torch.cuda.device_count()
    world = args.nprocs
    ctx = mp.get_context("spawn")
    port, torch_port = pick_free_port("127.0.0.1"), pick_free_port("127.0.0.1")
    token = secrets.token_hex(8)
    procs, conns = [], []
    for r in range(world):
        a, b = ctx.Pipe(duplex=False)
        p = ctx.Process(target=rank_main, args=(r, world, port, torch_port, token, args, b))
        p.start()
        b.close()
        procs.append(p)
        conns.append(a)
    results, failed = [None] * world, False
    deadline = time.monotonic() + args.timeout
    for r, c in enumerate(conns):
        left = max(0.0, deadline - time.monotonic())
        if not c.poll(left):
            print(f"rank {r}: no result within {args.timeout} s", file=sys.stderr)
            failed = True
            continue
        try:
            status, value = c.recv()
        except EOFError:
            status, value = "error", f"exited with code {procs[r].exitcode}"
        if status != "ok":
            print(f"--- rank {r} ---\n{value}", file=sys.stderr)
            failed = True
        results[r] = value
    for p in procs:
        p.join(10)
        if p.is_alive():
            p.kill()
    if failed:
        return 1
    rows, lat, info = results[0]
    print_report(rows, lat, info, world, args)
    if args.json:
        with open(args.json, "w") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
            f.write(json.dumps({"latency_8B": lat, "info": info}) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
