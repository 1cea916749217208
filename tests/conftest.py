"""Shared fixtures: ``run_ranks`` spawns real processes that rendezvous on a loopback
TCPStore and run a test body, with a deadline, every rank's traceback reported, and
stragglers killed."""

from __future__ import annotations

import multiprocessing as mp
import os
import secrets
import socket
import time
import traceback

import numpy as np
import pytest


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(fn, rank, world, port, token, init_timeout, env, conn, kwargs, backend):
    import faulthandler
    faulthandler.enable()  # a crash prints every thread's stack to the test's stderr
    os.environ["MESHCOLL_TOKEN"] = token
    os.environ.update(env)
    try:
        import meshcoll
        store = meshcoll.TCPStore("127.0.0.1", port, timeout=init_timeout)
        device = None
        if backend == "nccl":  # rank r on GPU r
            import torch
            torch.cuda.set_device(rank)
            device = rank
        pg = meshcoll.init(backend, rank=rank, world_size=world, store=store,
                           timeout=init_timeout, device=device)
        try:
            result = fn(pg, **kwargs)
        finally:
            meshcoll.destroy()
        conn.send(("ok", result))
    except BaseException:  # report everything, including SystemExit / KeyboardInterrupt
        conn.send(("error", traceback.format_exc()))
    finally:
        conn.close()


class RankFailure(AssertionError):
    pass


def launch(world, fn, *, timeout=60.0, init_timeout=30.0, env=None, may_die=(), backend=None,
           **kwargs):
    """Run ``fn(pg, **kwargs)`` on ``world`` fresh processes; return each rank's result.
    Raises RankFailure listing every rank that failed or did not finish by ``timeout``.
    Ranks in ``may_die`` (fault tests kill them) get the result None if they die.
    ``backend="nccl"`` puts rank r on GPU r (tests/gpu)."""
    import meshcoll
    ctx = mp.get_context("spawn")
    token = secrets.token_hex(8)
    # The parent hosts the store on a port the kernel picks: no free-port race between
    # concurrent test runs.
    server = meshcoll.TCPStore("127.0.0.1", 0, is_server=True, timeout=init_timeout, token=token)
    port = server.port
    procs, conns = [], []
    for rank in range(world):
        parent_end, child_end = ctx.Pipe(duplex=False)
        p = ctx.Process(target=_rank_main, args=(fn, rank, world, port, token, init_timeout,
                                                 env or {}, child_end, kwargs, backend),
                        daemon=True)
        p.start()
        child_end.close()
        procs.append(p)
        conns.append(parent_end)
    deadline = time.monotonic() + timeout
    results, failures = [None] * world, {}
    pending = set(range(world))
    while pending and time.monotonic() < deadline:
        for rank in list(pending):
            c = conns[rank]
            if c.poll(0.02):
                try:
                    status, value = c.recv()
                except EOFError:
                    status, value = "error", f"exited with code {procs[rank].exitcode} without a result"
                pending.discard(rank)
                if status == "ok":
                    results[rank] = value
                else:
                    failures[rank] = value
            elif not procs[rank].is_alive() and not c.poll(0):
                pending.discard(rank)
                failures[rank] = f"exited with code {procs[rank].exitcode} without a result"
    for rank in pending:
        failures[rank] = f"did not finish within {timeout} s (killed)"
    for rank in may_die:
        if rank in failures and "without a result" in failures[rank]:
            del failures[rank]
    for p in procs:
        if p.is_alive():
            p.kill()
        p.join(5)
    del server
    if failures:
        text = "\n".join(f"--- rank {r} ---\n{failures[r]}" for r in sorted(failures))
        raise RankFailure(f"{len(failures)} of {world} ranks failed:\n{text}")
    return results


@pytest.fixture
def run_ranks():
    return launch


def rand_array(rng: np.random.Generator, count: int, dtype) -> np.ndarray:
    """Random non-zero test data that reduces exactly or with a small known error."""
    dtype = np.dtype(dtype)
    if dtype == np.bool_:
        return rng.random(count) < 0.5
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        lo, hi = max(info.min, -50), min(info.max, 50)
        return rng.integers(lo, hi + 1, count).astype(dtype)
    return (rng.standard_normal(count) + 0.5).astype(dtype)
