"""Host cost of the NCCL agreement check (Note [Agreement on a side channel],
csrc/comm/agreement.h): microseconds per synchronous 8-byte all_reduce, enqueue only and
enqueue + synchronize, on groups with MESHCOLL_CHECK off, async and strict, side by side in
one job (interleaved rounds, medians), and the CPU the checker threads (mc-agreement) spend
per enqueued call meanwhile (async's checker; the world group's idle one adds a little to
every mode); and the cost of a host synchronization point, which in async mode waits for the
agreement of every call before it (Note [Results at host synchronization points] in
csrc/nccl/nccl_ops.cc): an async 8-byte all_reduce then Work.synchronize(), and a barrier().
One process per GPU. ``--hosts`` makes each rank its own host (per-rank NCCL_HOSTID and
MESHCOLL_HOST_ID, NVLink P2P and shared memory off): NCCL's network path and a TCP side
channel, as in a job across hosts.

    NCCL_NVLS_ENABLE=0 python bench/python/nccl_check_cost.py --nprocs 2 [--hosts]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

from agreement_cpu import checker_cpu_seconds
from spawn_ranks import run_ranks

MODES = ("off", "async", "strict")


def rank_main(rank, world, port, token, args, conn):
    try:
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
        if args.hosts:
            os.environ.update({"MESHCOLL_HOST_ID": f"host{rank}", "NCCL_HOSTID": f"host{rank}",
                               "NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "1"})
        import torch
        import meshcoll
        torch.cuda.set_device(rank)
        store = meshcoll.TCPStore("127.0.0.1", port, is_server=rank == 0, timeout=60, token=token)
        pg = meshcoll.init("nccl", rank=rank, world_size=world, store=store, device=rank)
        groups = {m: pg.new_group(list(range(world)), check=m) for m in MODES}
        x = torch.rand(2, device="cuda")
        enq = {m: [] for m in MODES}
        full = {m: [] for m in MODES}
        cpu = {m: [] for m in MODES}
        sync = {m: [] for m in MODES}
        bar = {m: [] for m in MODES}
        for g in groups.values():
            for _ in range(200):
                g.all_reduce(x)
        torch.cuda.synchronize()
        for _ in range(args.rounds):
            for m, g in groups.items():
                pg.barrier()
                torch.cuda.synchronize()
                c0, t0 = checker_cpu_seconds(), time.perf_counter()
                for _ in range(args.calls):
                    g.all_reduce(x)
                enq[m].append((time.perf_counter() - t0) / args.calls * 1e6)
                torch.cuda.synchronize()
                time.sleep(0.02)  # the checker compares the last calls (Note [Paced rounds])
                cpu[m].append((checker_cpu_seconds() - c0) / args.calls * 1e6)
                t0 = time.perf_counter()
                for _ in range(args.calls // 10):
                    g.all_reduce(x)
                    torch.cuda.synchronize()
                full[m].append((time.perf_counter() - t0) / (args.calls // 10) * 1e6)
                t0 = time.perf_counter()
                for _ in range(args.calls // 10):
                    g.all_reduce(x, async_op=True).synchronize()
                sync[m].append((time.perf_counter() - t0) / (args.calls // 10) * 1e6)
                t0 = time.perf_counter()
                for _ in range(args.calls // 10):
                    g.barrier()
                bar[m].append((time.perf_counter() - t0) / (args.calls // 10) * 1e6)
        conn.send(("ok", {m: (statistics.median(enq[m]), statistics.median(full[m]),
                              statistics.median(cpu[m]), statistics.median(sync[m]),
                              statistics.median(bar[m])) for m in MODES}))
        meshcoll.destroy()
    except BaseException:  # noqa: BLE001 - reported to the parent
        import traceback
        conn.send(("error", traceback.format_exc()))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nprocs", type=int, default=2)
    ap.add_argument("--calls", type=int, default=1000)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--hosts", action="store_true", help="each rank its own (emulated) host")
    args = ap.parse_args(argv)
    try:
        res = run_ranks(rank_main, args.nprocs, args)
    except RuntimeError as e:
        print(e, file=sys.stderr)
        return 1
    import torch
    print(f"# {args.nprocs} x {torch.cuda.get_device_name(0)}"
          f"{', each rank its own host' if args.hosts else ''}, {args.rounds} rounds x "
          f"{args.calls} calls; medians over rounds, worst rank")
    print(f"{'check':8} {'enqueue us':>11} {'vs off':>8} {'+sync us':>9} {'vs off':>8} "
          f"{'checker CPU us':>15} {'Work.sync us':>13} {'vs off':>8} {'barrier us':>11} "
          f"{'vs off':>8}")
    base = [max(r["off"][k] for r in res) for k in range(5)]
    for m in MODES:
        e, f, c, s, b = (max(r[m][k] for r in res) for k in range(5))
        print(f"{m:8} {e:11.2f} {e - base[0]:+8.2f} {f:9.2f} {f - base[1]:+8.2f} {c:15.2f} "
              f"{s:13.2f} {s - base[3]:+8.2f} {b:11.2f} {b - base[4]:+8.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
