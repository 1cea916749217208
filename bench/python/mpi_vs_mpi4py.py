"""meshcoll's MPI backend against mpi4py on the same MPI, in the same processes: all_reduce
(float32 sum, in place) per size: mpi4py's blocking Allreduce, its nonblocking Iallreduce +
Wait, meshcoll's; times, busbw and meshcoll's speed ratios.

    python bench/python/mpi_vs_mpi4py.py              # mpirun -n 2, 8 B .. 16 MiB
    python bench/python/mpi_vs_mpi4py.py -N 4 --max 64M

A benchmark, not a test. Starts itself under ``mpirun`` (``--allow-run-as-root`` when run as
root, ``--oversubscribe``). Both libraries run in every rank: mpi4py's
``Allreduce(MPI.IN_PLACE, x)`` on MPI_COMM_WORLD (blocking), ``Iallreduce(...).Wait()``, and
meshcoll's ``all_reduce`` on its own duplicate of it (nonblocking sends and receives and a
progress loop under a deadline, Note [all_reduce over point-to-point] in
csrc/mpi/mpi_backend.cc, plus the agreement check's side channel: the cost of what meshcoll
adds). Per size: ``-w`` warm-up calls, then ``--repeats`` times, the three taking turns, a
barrier and ``-n`` calls, each rank timing its loop; a repeat's time is the largest per-rank
mean, the reported time the median over repeats.
busbw = 2 (N-1)/N x bytes / time, as nccl-tests. Needs ``pip install mpi4py`` built against
the same MPI as meshcoll's shim (its ``mpicc``).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import time


def _size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(text[:-1]) * units[text[-1].upper()] if text[-1].upper() in units else int(text)


def _args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("-N", type=int, default=2, help="ranks (mpirun -n)")
    p.add_argument("--min", default="8", help="smallest size in bytes (K/M suffixes)")
    p.add_argument("--max", default="16M", help="largest size in bytes")
    p.add_argument("-n", type=int, default=0, help="calls per repeat (0: by size)")
    p.add_argument("-w", type=int, default=10, help="warm-up calls per size")
    p.add_argument("--repeats", type=int, default=5)
    return p.parse_args()


def _rank_main(a: argparse.Namespace) -> None:
    import numpy as np
    from mpi4py import MPI

    import meshcoll
    comm = MPI.COMM_WORLD
    pg = meshcoll.init(backend="mpi", timeout=120)
    me, n = pg.rank, pg.size

    def timed(calls, iters: int) -> list:
        """Each call's median time over the repeats, the calls taking turns within each
        repeat (a burst of load on a shared machine then hits all of them alike)."""
        runs: list = [[] for _ in calls]
        for _ in range(a.repeats):
            for k, call in enumerate(calls):
                comm.Barrier()
                t0 = time.perf_counter()
                for _ in range(iters):
                    call()
                mine = (time.perf_counter() - t0) / iters
                runs[k].append(comm.allreduce(mine, op=MPI.MAX))
        return [statistics.median(r) for r in runs]

    size = _size(a.min)
    if me == 0:
        print(f"all_reduce float32 sum in place, {n} ranks, {MPI.Get_library_version().splitlines()[0]}")
        print(f"{'bytes':>10} {'Allreduce us':>12} {'Iallreduce us':>13} {'meshcoll us':>12} "
              f"{'Allreduce GB/s':>14} {'meshcoll GB/s':>14} {'vs All':>7} {'vs Iall':>7}")
    while size <= _size(a.max):
        x = np.ones(max(1, size // 4), np.float32)
        iters = a.n or max(5, min(2000, (64 << 20) // max(size, 1) // 8))
        for _ in range(a.w):
            comm.Allreduce(MPI.IN_PLACE, x)
            pg.all_reduce(x)
        t_ref, t_nb, t_mc = timed([lambda: comm.Allreduce(MPI.IN_PLACE, x),
                                   lambda: comm.Iallreduce(MPI.IN_PLACE, x).Wait(),
                                   lambda: pg.all_reduce(x)], iters)
        if me == 0:
            bus = 2 * (n - 1) / n * x.nbytes
            print(f"{x.nbytes:>10} {t_ref * 1e6:>12.1f} {t_nb * 1e6:>13.1f} {t_mc * 1e6:>12.1f} "
                  f"{bus / t_ref / 1e9:>14.2f} {bus / t_mc / 1e9:>14.2f} {t_ref / t_mc:>7.2f} "
                  f"{t_nb / t_mc:>7.2f}", flush=True)
        size *= 4
    meshcoll.destroy()


def main() -> None:
    a = _args()
    if "OMPI_COMM_WORLD_RANK" in os.environ or "PMI_RANK" in os.environ:
        _rank_main(a)
        return
    cmd = [shutil.which("mpirun") or "mpirun", "--oversubscribe", "-n", str(a.N)]
    if os.geteuid() == 0:
        cmd.insert(1, "--allow-run-as-root")
    sys.exit(subprocess.call(cmd + [sys.executable, os.path.abspath(__file__), *sys.argv[1:]]))


if __name__ == "__main__":
    main()
