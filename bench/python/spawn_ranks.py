"""One process per rank for the GPU benchmarks: each rank runs
``target(rank, world, port, token, *args, conn)`` in a spawned process and sends
``("ok", result)`` or ``("error", traceback)`` on ``conn``; the parent collects every rank's
result in rank order.

    from spawn_ranks import run_ranks     # a benchmark script in bench/python
    results = run_ranks(rank_main, 2, args)
"""

from __future__ import annotations

import multiprocessing as mp
import secrets
from typing import Any, Callable, List

from meshcoll.run import pick_free_port


def run_ranks(target: Callable[..., None], world: int, *args: Any,
              timeout: float = 600.0) -> List[Any]:
    """Each rank's result; RuntimeError with the failing rank's traceback, or naming a rank
    that sent nothing within ``timeout`` seconds."""
    port, token = pick_free_port("127.0.0.1"), secrets.token_hex(8)
    ctx = mp.get_context("spawn")
    pipes, procs = [], []
    for r in range(world):
        a, b = ctx.Pipe(False)
        p = ctx.Process(target=target, args=(r, world, port, token, *args, b))
        p.start()
        pipes.append(a)
        procs.append(p)
    try:
        results = []
        for r, a in enumerate(pipes):
            if not a.poll(timeout):
                raise RuntimeError(f"rank {r} sent no result within {timeout:g} s")
            status, body = a.recv()
            if status != "ok":
                raise RuntimeError(f"rank {r} failed:\n{body}")
            results.append(body)
        return results
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
