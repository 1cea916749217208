"""CPU the agreement check's checker thread spends per call (Note [Agreement on a side
channel] and Note [Paced rounds], csrc/comm/agreement.h), on the host alone: each rank notes
calls into the real check (``_C._AgreementProbe``) over a CPU channel at its own pace, as an
NCCL group's calls would, and reads the CPU time of the thread named mc-agreement.

    python bench/python/agreement_cpu.py --nprocs 2 --pace-us 15        # every rank alike
    python bench/python/agreement_cpu.py --nprocs 2 --pace-us 5,15      # rank 0 runs ahead

Prints, per rank, the checker's CPU microseconds per call (median of --repeats; the kernel
counts thread CPU in ticks of 1/CLK_TCK s, so --calls sets the resolution) and the time per
call including the final agreement.
"""

from __future__ import annotations

import argparse
import glob
import os
import statistics
import sys
import time
import traceback

from spawn_ranks import run_ranks


def checker_cpu_seconds() -> float:
    """CPU time of this process's threads named mc-agreement."""
    ticks = 0
    for task in glob.glob("/proc/self/task/*"):
        try:
            with open(task + "/comm") as f:
                if f.read().strip() != "mc-agreement":
                    continue
            with open(task + "/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:  # the thread ended meanwhile
            continue
        ticks += int(fields[11]) + int(fields[12])  # utime, stime
    return ticks / os.sysconf("SC_CLK_TCK")


def rank_main(rank, world, port, token, args, conn):
    try:
        import meshcoll
        from meshcoll import _C
        os.environ["MESHCOLL_TOKEN"] = token
        pg = meshcoll.init(backend="cpu", rank=rank, world_size=world, master_addr="127.0.0.1",
                           master_port=port, timeout=60)
        paces = [float(p) for p in args.pace_us.split(",")]
        pace = paces[rank % len(paces)] * 1e-6
        rows = []
        for _ in range(args.repeats):
            channel = pg.new_group(list(range(world)))
            pg.barrier()
            probe = _C._AgreementProbe(channel._backend, False, 60.0)
            c0, t0 = checker_cpu_seconds(), time.perf_counter()
            for _ in range(args.calls):
                probe.note("all_reduce", 8)
                until = time.perf_counter() + pace
                while time.perf_counter() < until:  # the call's own host time
                    pass
            probe.await_(probe.note("barrier", 0), 60.0)  # every call compared
            wall, cpu = time.perf_counter() - t0, checker_cpu_seconds() - c0
            probe.raise_failure()
            probe.stop()
            channel.destroy()
            rows.append((cpu / args.calls * 1e6, wall / args.calls * 1e6))
        meshcoll.destroy()
        conn.send(("ok", (statistics.median(r[0] for r in rows),
                          statistics.median(r[1] for r in rows))))
    except BaseException:  # noqa: BLE001 - reported to the parent
        conn.send(("error", traceback.format_exc()))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nprocs", type=int, default=2)
    ap.add_argument("--calls", type=int, default=20000)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--pace-us", default="15", help="host time per call, per rank (a,b,...)")
    args = ap.parse_args(argv)
    res = run_ranks(rank_main, args.nprocs, args, timeout=600)
    print(f"# agreement checker, {args.nprocs} ranks, {args.calls} calls, pace {args.pace_us} us, "
          f"median of {args.repeats}")
    print(f"{'rank':>5} {'checker CPU us/call':>20} {'us/call':>8}")
    for r, (cpu, wall) in enumerate(res):
        print(f"{r:>5} {cpu:20.2f} {wall:8.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
