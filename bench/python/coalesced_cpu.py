"""Small all_reduces on a CPU group, one by one against ``group.coalesced()`` blocks (Note
[Fused all_reduces] in csrc/cpu/cpu_backend.cc: a block's small synchronous all_reduces run
fused at its end).

    python bench/python/coalesced_cpu.py --nprocs 2 --transport tcp --blocks 8,32

Prints, per transport and block size, the microseconds per call (median of --repeats, rank
0) of `--bytes`-byte float32 all_reduces made one by one and in blocks, and their ratio.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import traceback

from spawn_ranks import run_ranks

# One BLAS thread per rank, as meshcoll-run sets: idle BLAS threads spinning would take cores
# from the ranks on a small host.
os.environ.setdefault("OMP_NUM_THREADS", "1")


def rank_main(rank, world, port, token, args, conn):
    try:
        import numpy as np
        import meshcoll
        os.environ["MESHCOLL_TOKEN"] = token
        os.environ["MESHCOLL_TRANSPORT"] = args.transport
        pg = meshcoll.init(backend="cpu", rank=rank, world_size=world, master_addr="127.0.0.1",
                           master_port=port, timeout=60)
        rows = []
        for k in (int(b) for b in args.blocks.split(",")):
            # A block's calls are independent: each on its own array.
            xs = [np.full(max(1, args.bytes // 4), i + 1.0, np.float32) for i in range(k)]

            def one_by_one():
                for x in xs:
                    pg.all_reduce(x)

            def block():
                with pg.coalesced():
                    for x in xs:
                        pg.all_reduce(x)

            times = []
            for f in (one_by_one, block):
                for _ in range(20):
                    f()
                ts = []
                for _ in range(args.repeats):
                    pg.barrier()
                    t0 = time.perf_counter()
                    for _ in range(args.rounds):
                        f()
                    ts.append((time.perf_counter() - t0) / (args.rounds * k) * 1e6)
                times.append(statistics.median(ts))
            rows.append((k, *times))
        meshcoll.destroy()
        conn.send(("ok", (rows, args.transport)))
    except BaseException:  # noqa: BLE001 - reported to the parent
        conn.send(("error", traceback.format_exc()))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nprocs", type=int, default=2)
    ap.add_argument("--transport", choices=("tcp", "shm"), default="tcp")
    ap.add_argument("--blocks", default="8,32", help="calls per block")
    ap.add_argument("--bytes", type=int, default=8, help="bytes per call")
    ap.add_argument("--rounds", type=int, default=100, help="blocks (or runs of calls) timed")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args(argv)
    rows, transport = run_ranks(rank_main, args.nprocs, args, timeout=600)[0]
    print(f"# {args.bytes}-byte float32 all_reduce, {args.nprocs} ranks over {transport}, us per "
          f"call, median of {args.repeats}, rank 0")
    print(f"{'per block':>10} {'one by one':>11} {'coalesced':>10} {'ratio':>6}")
    for k, eager, block in rows:
        print(f"{k:>10} {eager:11.2f} {block:10.2f} {eager / block:6.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
