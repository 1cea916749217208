"""meshcoll against torch.distributed (Gloo) and mpi4py (Open MPI) on one host, in one run.

    python bench/python/compare_cpu.py                      # 4 ranks, all_reduce, 1K..64M
    python bench/python/compare_cpu.py -N 2 --ops all_reduce,all_gather --plot cpu.png
    python bench/python/compare_cpu.py -N 16 --dtype bfloat16 -b 4K      # bf16 sums

A benchmark, not a test (CI does not run it). Each library runs as its own set of
processes, one library after the other: ``meshcoll-bench`` for meshcoll (once as it
comes, shared memory on one host, and once forced onto TCP as ``meshcoll-tcp``), plain
subprocesses with a TCP rendezvous for Gloo (``GLOO_SOCKET_IFNAME=lo``), ``mpirun`` for
mpi4py. Each writes JSON lines; this parent merges them with two memcpy rooflines and
prints one table per collective: ``memcpy``, one thread copying ``size`` bytes
(``numpy.copyto``) with the machine otherwise idle, and ``allcpy``, every rank copying its
own ``size`` bytes at the same time, as separate processes (the same ranks, started by
``meshcoll-run``; ``--worker copy``), per rank: what the memory system gives each rank when
all of them stream at once, the bound a collective on one host shares.

Every library is timed the same way as ``meshcoll-bench``: per size, ``-w`` warm-up
calls, then ``--repeats`` times a barrier and ``-n`` back-to-back calls, each rank timing
its own loop; a repeat's time is the largest per-rank mean, the reported time the median
over repeats. When several collectives are measured they take turns within each repeat.
Sizes and busbw follow nccl-tests (see ``meshcoll.bench``): all_reduce in place,
all_gather with ``size`` = the output bytes. The ratios are meshcoll's busbw over the
other's (> 1: meshcoll is faster; at small sizes it is the inverse ratio of the times),
``mc/cpy`` meshcoll's busbw over the one-thread memcpy bandwidth, and ``mc/mem`` meshcoll's
share of the memory roofline. Its model: on one host an all_reduce or all_gather of ``size``
bytes must at least read every byte of every rank's inputs once and write every byte of
every rank's output once, 2 x size x ranks bytes through memory in all, which is exactly
what every rank copying ``size`` bytes at once moves; so ``mc/mem`` = the all-ranks copy's
time over meshcoll's (meshcoll's algbw over ``allcpy``; 1.0 would be a collective as cheap
as one copy of its output). Real algorithms move more (the single-copy all_reduce reads
about 2 x size and writes about 1 x size per rank), so well-made ones sit below 1.

``--dtype bfloat16`` (or float16) sums 2-byte floats: meshcoll and Gloo natively; MPI has no
such type, so mpi4py sums the same bytes as int16 (``MPI.SHORT``), the cheapest reduction of
that size: a floor for what an Open MPI user op would cost.

Needs: ``pip install torch`` (CPU wheel is enough) and, for MPI, Debian's
``libopenmpi-dev openmpi-bin`` then ``pip install mpi4py``. A missing library is skipped
with a note. As root, mpirun needs ``--allow-run-as-root`` (added when running as root);
``--oversubscribe`` lets it start more ranks than cores.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Callable, Dict, List, Optional

import numpy as np

from meshcoll.bench import BUS_FACTORS, element_counts, parse_size, plot_records, size_steps
from meshcoll.run import pick_free_port

LIBS = ("meshcoll", "meshcoll-tcp", "gloo", "mpi", "meshcoll-scalable", "meshcoll-flat")
# meshcoll-scalable / -flat: shared memory with MESHCOLL_SHM_ALL_REDUCE forced (Note
# [Shared-memory all_reduce paths]); not run unless named in --libs.
DEFAULT_LIBS = LIBS[:4]
_MESHCOLL_ENV = {"meshcoll-tcp": {}, "meshcoll": {},
                 "meshcoll-scalable": {"MESHCOLL_SHM_ALL_REDUCE": "scalable"},
                 "meshcoll-flat": {"MESHCOLL_SHM_ALL_REDUCE": "flat"}}
COPY = "allcpy"  # the all-ranks copy: a roofline, measured like a library
_SHORT = {"meshcoll-tcp": "mc-tcp", "meshcoll-scalable": "mc-scal", "meshcoll-flat": "mc-flat"}
OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast")
_LAUNCH_PREFIXES = ("MESHCOLL_", "OMPI_", "PMI_", "PMIX_", "SLURM_")
_LAUNCH_NAMES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                 "MASTER_PORT")


# ---- the timing every worker shares ---------------------------------------------------

def sweep(args) -> List[int]:
    return size_steps(parse_size(args.minbytes), parse_size(args.maxbytes), args.stepfactor, 0)


# --dtype: bytes an element.
DTYPES = {"float32": 4, "bfloat16": 2, "float16": 2}


def run_worker(args, rank: int, world: int, library: str,
               make: Callable[[str, int], Callable[[], None]],
               barrier: Callable[[], None], allmax: Callable[[float], float]) -> None:
    """meshcoll-bench's loop for another library; rank 0 writes the records to args.out."""
    records = []
    for nbytes in sweep(args):
        esz = DTYPES[args.dtype]
        cases = [(op, element_counts(op, nbytes, esz, world)) for op in args.ops]
        runs = [make(op, count) for op, count in cases]
        for run in runs:
            for _ in range(args.warmup):
                run()
        times: List[List[float]] = [[] for _ in runs]
        for _ in range(args.repeats):
            for k, run in enumerate(runs):
                barrier()
                t0 = time.perf_counter()
                for _ in range(args.iters):
                    run()
                times[k].append(allmax((time.perf_counter() - t0) / args.iters))
        for (op, count), ts in zip(cases, times):
            t = statistics.median(ts)
            size = count * esz
            algbw = size / t / 1e9
            records.append({"library": library, "op": op, "size": size, "count": count,
                            "type": args.dtype, "redop": "sum" if op in ("all_reduce", "reduce_scatter") else "none",
                            "time": t * 1e6, "algbw": algbw,
                            "busbw": algbw * BUS_FACTORS[op](world),
                            "times": [x * 1e6 for x in ts], "ranks": world,
                            "iters": args.iters, "warmup": args.warmup,
                            "repeats": args.repeats})
        del runs
    if rank == 0:
        with open(args.out, "w") as f:
            for r in records:
                f.write(json.dumps(r) + "\n")


def worker_gloo(args) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{args.port}",
                            rank=args.rank, world_size=args.world)
    n = args.world
    dt = getattr(torch, args.dtype)

    def make(op: str, count: int):
        if op == "all_reduce":
            x = torch.ones(count, dtype=dt)
            return lambda: dist.all_reduce(x)
        if op == "broadcast":
            x = torch.ones(count, dtype=dt)
            return lambda: dist.broadcast(x, 0)
        if op == "reduce_scatter":  # Gloo has no reduce_scatter_tensor: its list form
            xs = [torch.ones(count // n, dtype=dt) for _ in range(n)]
            y = torch.empty(count // n, dtype=dt)
            return lambda: dist.reduce_scatter(y, xs)
        x = torch.ones(count // n, dtype=dt)
        out = torch.empty(count, dtype=dt)
        return lambda: dist.all_gather_into_tensor(out, x)

    def allmax(v: float) -> float:
        t = torch.tensor([v], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t.item())

    run_worker(args, args.rank, n, "gloo", make, dist.barrier, allmax)
    dist.destroy_process_group()


def worker_copy(args) -> None:
    """Every rank copies its own ``size`` bytes (numpy.copyto) at the same time, timed as a
    collective is (barrier, -n copies, the slowest rank's mean); a record per size."""
    import meshcoll

    pg = meshcoll.init()
    records = []
    for nbytes in sweep(args):
        src = np.ones(max(nbytes // 4, 1), np.float32)
        dst = np.empty_like(src)
        for _ in range(args.warmup):
            np.copyto(dst, src)
        ts = []
        for _ in range(args.repeats):
            pg.barrier()
            t0 = time.perf_counter()
            for _ in range(args.iters):
                np.copyto(dst, src)
            t = np.array([(time.perf_counter() - t0) / args.iters])
            pg.all_reduce(t, "max")
            ts.append(float(t[0]))
        t = statistics.median(ts)
        records.append({"library": COPY, "op": COPY, "size": src.nbytes, "time": t * 1e6,
                        "algbw": src.nbytes / t / 1e9, "busbw": src.nbytes / t / 1e9,
                        "times": [x * 1e6 for x in ts], "ranks": pg.size})
    if pg.rank == 0:
        with open(args.out, "w") as f:
            for r in records:
                f.write(json.dumps(r) + "\n")
    meshcoll.destroy()


def worker_mpi(args) -> None:
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    n = comm.Get_size()
    dt = np.float32 if args.dtype == "float32" else np.int16  # see the docstring

    def make(op: str, count: int):
        if op == "all_reduce":
            x = np.ones(count, dt)
            return lambda: comm.Allreduce(MPI.IN_PLACE, x, op=MPI.SUM)
        if op == "broadcast":
            x = np.ones(count, dt)
            return lambda: comm.Bcast(x, root=0)
        if op == "reduce_scatter":
            x = np.ones(count, dt)
            y = np.empty(count // n, dt)
            return lambda: comm.Reduce_scatter_block(x, y, op=MPI.SUM)
        x = np.ones(count // n, dt)
        out = np.empty(count, dt)
        return lambda: comm.Allgather(x, out)

    run_worker(args, comm.Get_rank(), n, "mpi", make, comm.Barrier,
               lambda v: comm.allreduce(v, op=MPI.MAX))


# ---- the parent: one library after the other ------------------------------------------

def _clean_env(**extra) -> Dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(_LAUNCH_PREFIXES) and k not in _LAUNCH_NAMES}
    env.update(extra)
    return env


def _common(args) -> List[str]:
    return ["-b", args.minbytes, "-e", args.maxbytes, "-f", str(args.stepfactor),
            "-n", str(args.iters), "-w", str(args.warmup), "--repeats", str(args.repeats)]


def _worker_args(args, out: str) -> List[str]:
    return _common(args) + ["--ops", ",".join(args.ops), "--dtype", args.dtype, "--out", out]


def available(lib: str) -> Optional[str]:
    """None if ``lib`` can run here, else why not."""
    if lib == "gloo" and importlib.util.find_spec("torch") is None:
        return "torch is not installed (pip install torch)"
    if lib == "mpi":
        if importlib.util.find_spec("mpi4py") is None:
            return "mpi4py is not installed (pip install mpi4py)"
        if shutil.which("mpirun") is None:
            return "mpirun is not on PATH (apt-get install openmpi-bin libopenmpi-dev)"
    return None


def run_lib(lib: str, args, tmp: str) -> List[dict]:
    out = os.path.join(tmp, f"{lib}.jsonl")
    me = os.path.abspath(__file__)
    if lib == COPY:
        cmd = [sys.executable, "-m", "meshcoll.run", "-n", str(args.nproc), me, "--worker",
               "copy"] + _worker_args(args, out)
        procs = [subprocess.run(cmd, env=_clean_env(), capture_output=True, text=True,
                                timeout=args.stage_timeout)]
    elif lib.startswith("meshcoll"):
        cmd = [sys.executable, "-m", "meshcoll.bench", "-N", str(args.nproc), "--op",
               ",".join(args.ops), "-d", args.dtype, "-c", "1", "--json", out] + _common(args)
        if lib == "meshcoll-tcp":
            cmd += ["--transport", "tcp"]
        p = subprocess.run(cmd, env=_clean_env(**_MESHCOLL_ENV[lib]), capture_output=True,
                           text=True, timeout=args.stage_timeout)
        procs = [p]
    elif lib == "gloo":
        # Plain processes, as torchrun would start them; the first to fail stops the rest.
        port = pick_free_port("127.0.0.1")
        env = _clean_env(GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1")
        logs = [open(os.path.join(tmp, f"gloo_{r}.log"), "w+") for r in range(args.nproc)]
        popen = [subprocess.Popen([sys.executable, me, "--worker", "gloo", "--rank", str(r),
                                   "--world", str(args.nproc), "--port", str(port)]
                                  + _worker_args(args, out),
                                  env=env, stdout=logs[r], stderr=subprocess.STDOUT)
                 for r in range(args.nproc)]
        deadline = time.monotonic() + args.stage_timeout
        try:
            while any(q.poll() is None for q in popen):
                if any(q.returncode not in (None, 0) for q in popen):
                    break
                if time.monotonic() > deadline:
                    raise RuntimeError(f"gloo did not finish within {args.stage_timeout:g} s")
                time.sleep(0.1)
        finally:
            for q in popen:
                if q.poll() is None:
                    q.kill()
                    q.wait()
        procs = []
        for q, log in zip(popen, logs):
            log.seek(0)
            procs.append(subprocess.CompletedProcess(q.args, q.returncode, log.read(), ""))
            log.close()
    else:
        mpirun = ["mpirun", "--oversubscribe", "--bind-to", "none", "-np", str(args.nproc)]
        if os.geteuid() == 0:
            mpirun.insert(1, "--allow-run-as-root")
        if shutil.which("ssh") is None and shutil.which("rsh") is None:
            # One host needs no remote agent, but Open MPI 4 refuses to start when its
            # default one (ssh : rsh) is missing, as in most containers.
            mpirun[1:1] = ["--mca", "plm_rsh_agent", "false"]
        cmd = mpirun + [sys.executable, me, "--worker", "mpi"] + _worker_args(args, out)
        procs = [subprocess.run(cmd, env=_clean_env(OMP_NUM_THREADS="1"), capture_output=True,
                                text=True, timeout=args.stage_timeout)]
    # a rank that failed on its own (exit code > 0) explains more than one we killed
    failed = sorted((p for p in procs if p.returncode != 0), key=lambda p: p.returncode < 0)
    if failed:
        p = failed[0]
        raise RuntimeError(f"{lib} exited with {p.returncode}:\n{p.stdout}\n{p.stderr}")
    with open(out) as f:
        recs = [json.loads(line) for line in f]
    for r in recs:
        r["library"] = lib
        if r.get("wrong"):
            raise RuntimeError(f"meshcoll gave {r['wrong']} wrong elements at {r['size']} B")
    return recs


def memcpy_roofline(args) -> List[dict]:
    """Bytes copied per second by one thread (numpy.copyto), per size."""
    recs = []
    for nbytes in sweep(args):
        src = np.ones(nbytes // 4, np.float32)
        dst = np.empty_like(src)
        for _ in range(args.warmup):
            np.copyto(dst, src)
        ts = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            for _ in range(args.iters):
                np.copyto(dst, src)
            ts.append((time.perf_counter() - t0) / args.iters)
        t = statistics.median(ts)
        recs.append({"library": "memcpy", "op": "memcpy", "size": src.nbytes, "time": t * 1e6,
                     "algbw": src.nbytes / t / 1e9, "busbw": src.nbytes / t / 1e9,
                     "times": [x * 1e6 for x in ts]})
    return recs


def machine() -> str:
    model = platform.processor() or "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            model = next(l.split(":", 1)[1].strip() for l in f if l.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"{os.cpu_count()} CPUs ({model}), {platform.system()} {platform.release()}"


def _fmt(v: Optional[float], spec: str, width: int) -> str:
    return f"{'-':>{width}}" if v is None else f"{v:{width}{spec}}"


def _width(title: str) -> int:
    return max(9, len(title) + 2)


def print_table(op: str, records: List[dict], libs: List[str], args) -> None:
    by = {(r["library"], r["size"]): r for r in records if r["op"] == op}

    def roofline(lib: str, size: int) -> Optional[dict]:
        # Measured at the sweep's sizes; all_gather's are rounded to whole rows per rank.
        rs = [r for r in records if r["library"] == lib]
        return min(rs, key=lambda r: abs(r["size"] - size)) if rs else None

    sizes = sorted({r["size"] for r in records if r["op"] == op})
    others = [l for l in libs if l in ("gloo", "mpi")]
    # ratios for each shared-memory meshcoll run against each other library
    mcs = [l for l in libs if l.startswith("meshcoll") and l != "meshcoll-tcp"]
    # each against gloo and mpi, the one-thread memcpy (cpy), and its share of the memory
    # roofline (mem: its algbw over the all-ranks copy's; the model is printed under the table)
    ratios = [f"{_SHORT.get(m, 'mc')}/{l}" for m in mcs for l in others + ["cpy", "mem"]]
    transports = sorted({f"{r['library']}={r['transport']}" for r in records
                         if r["op"] == op and "transport" in r})
    print(f"# compare_cpu  {op}  {args.dtype}{' sum' if op in ('all_reduce', 'reduce_scatter') else ''}  "
          f"ranks={args.nproc}  iters={args.iters} warmup={args.warmup}  median of "
          f"{args.repeats} repeats  {' '.join(transports)}")
    names = [_SHORT.get(l, l) for l in libs]
    print("#" + f"{'size':>11}" + "".join(f"{l:>10}" for l in names)
          + "".join(f"{l:>10}" for l in names) + f"{'memcpy':>10}{COPY:>10}"
          + "".join(f"{t:>{_width(t)}}" for t in ratios))
    print("#" + f"{'(B)':>11}" + f"{'time (us)':>{10 * len(libs)}}"
          + f"{'busbw (GB/s)':>{10 * len(libs)}}" + f"{'(GB/s)':>20}"
          + f"{'ratio':>{sum(_width(t) for t in ratios)}}")
    for size in sizes:
        rs = {l: by.get((l, size)) for l in libs}
        # memcpy of the bytes each rank holds: the output for all_gather, the buffer else
        cp = roofline("memcpy", size)
        allcp = roofline(COPY, size)  # per rank, every rank copying at once
        line = f"{size:12d}"
        line += "".join(_fmt(rs[l] and rs[l]["time"], ".1f", 10) for l in libs)
        line += "".join(_fmt(rs[l] and rs[l]["busbw"], ".3f", 10) for l in libs)
        line += _fmt(cp and cp["busbw"], ".2f", 10) + _fmt(allcp and allcp["algbw"], ".2f", 10)
        titles = iter(ratios)
        for m in mcs:
            mc = rs.get(m)
            for l in others:
                line += _fmt(mc["busbw"] / rs[l]["busbw"] if mc and rs[l] else None, ".2f",
                             _width(next(titles)))
            line += _fmt(mc["busbw"] / cp["busbw"] if mc and cp else None, ".2f",
                         _width(next(titles)))
            # The model in the module docstring: the least traffic is every rank copying
            # `size` bytes once, so the share is meshcoll's algbw over the all-ranks copy's.
            line += _fmt(mc["algbw"] / allcp["algbw"] if mc and allcp else None, ".2f",
                         _width(next(titles)))
        print(line)
    print(f"# allcpy: GB/s per rank with all {args.nproc} ranks copying size bytes at once; "
          "mc/mem: meshcoll's algbw over it, its share of the least memory traffic (read "
          "every input byte once, write every output byte once: 2 x size x ranks bytes)")
    print()


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("-N", "--nproc", type=int, default=4, help="ranks (default 4)")
    p.add_argument("--ops", default="all_reduce",
                   help="comma-separated: all_reduce, all_gather (default all_reduce)")
    p.add_argument("--libs", default=",".join(DEFAULT_LIBS),
                   help="comma-separated: meshcoll (its default transport: shared memory on "
                        "one host), meshcoll-tcp (MESHCOLL_TRANSPORT=tcp), gloo, mpi (the "
                        "default), and meshcoll-scalable / meshcoll-flat (shared memory, "
                        "MESHCOLL_SHM_ALL_REDUCE forced)")
    p.add_argument("--dtype", default="float32", choices=sorted(DTYPES),
                   help="element type (default float32; MPI sums 2-byte types as int16)")
    p.add_argument("-b", "--minbytes", default="1K")
    p.add_argument("-e", "--maxbytes", default="64M")
    p.add_argument("-f", "--stepfactor", type=int, default=2)
    p.add_argument("-n", "--iters", type=int, default=20)
    p.add_argument("-w", "--warmup", type=int, default=5)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--stage-timeout", type=float, default=1800.0,
                   help="seconds allowed for each library's run")
    p.add_argument("--json", default=None, help="write every record (JSON lines) here")
    p.add_argument("--plot", default=None, help="busbw against size, every library (PNG)")
    # internal: a worker rank of one library
    p.add_argument("--worker", choices=["gloo", "mpi", "copy"], help=argparse.SUPPRESS)
    p.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    p.add_argument("--world", type=int, help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    a.ops = [o for o in a.ops.split(",") if o]
    a.libs = [l for l in a.libs.split(",") if l]
    if set(a.ops) - set(OPS) or set(a.libs) - set(LIBS):
        p.error(f"--ops takes {', '.join(OPS)}; --libs takes {', '.join(LIBS)}")
    return a


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker == "gloo":
        worker_gloo(args)
        return 0
    if args.worker == "mpi":
        worker_mpi(args)
        return 0
    if args.worker == "copy":
        worker_copy(args)
        return 0

    print(f"# machine: {machine()}; shared with other work, so expect noise")
    records: List[dict] = []
    libs: List[str] = []
    t_start = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        for lib in args.libs:
            why = available(lib)
            if why:
                print(f"# skipping {lib}: {why}")
                continue
            t0 = time.monotonic()
            records += run_lib(lib, args, tmp)
            libs.append(lib)
            print(f"# {lib}: {time.monotonic() - t0:.0f} s", flush=True)
        t0 = time.monotonic()
        records += run_lib(COPY, args, tmp)  # the same ranks, after every library
        print(f"# {COPY}: {time.monotonic() - t0:.0f} s", flush=True)
    records += memcpy_roofline(args)
    print(f"# total {time.monotonic() - t_start:.0f} s\n")
    for op in args.ops:
        print_table(op, records, libs, args)
    if args.json:
        with open(args.json, "w") as f:
            for r in records:
                f.write(json.dumps(r) + "\n")
    if args.plot:
        for r in records:
            r["series"] = r["library"] if r["op"] == "memcpy" else f"{r['library']} {r['op']}"
        plot_records(records, args.plot, title=f"CPU collectives, {args.nproc} ranks, {args.dtype}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
