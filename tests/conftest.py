"""Shared fixtures: ``run_ranks`` (``launch``) spawns real processes that rendezvous on a
loopback TCPStore and run a test body over the transport the test names, with a deadline,
every rank's traceback reported, and stragglers killed. ``spawn`` is the same without a
group, for the layers below it (stores).

Test tiers, as pytest markers (registered in pyproject.toml; ``pytest -m tier1``), given
by folder: tier1 is tests/unit (pure Python: no compiled module, no processes), tier3
tests/gpu (GPUs), tier2 every other folder (the compiled module, real processes on one
machine)."""

from __future__ import annotations

import multiprocessing as mp
import os
import secrets
import signal
import time
import traceback
from pathlib import Path

import numpy as np
import pytest

_TIER_OF_FOLDER = {"unit": "tier1", "gpu": "tier3"}


def pytest_collection_modifyitems(config, items):
    here = Path(__file__).parent
    for item in items:
        folder = Path(str(item.fspath)).relative_to(here).parts[0]
        item.add_marker(_TIER_OF_FOLDER.get(folder, "tier2"))


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    # The skips (GPU tests without GPUs, optional packages not installed) are counted on
    # the last line; their reasons, about a hundred lines, only on request.
    skipped = len(terminalreporter.stats.get("skipped", ()))
    if skipped and not set(config.getoption("reportchars")) & set("saA"):
        terminalreporter.write_line(f"{skipped} skipped: pytest -rs lists why")


def free_port() -> int:
    """A loopback port that nothing listens on right now."""
    from meshcoll.run import pick_free_port
    return pick_free_port("127.0.0.1")


def _child(target, rank, conn, args):
    import faulthandler
    faulthandler.enable()  # a crash prints every thread's stack to the test's stderr
    try:
        conn.send(("ok", target(rank, *args)))
    except BaseException:  # report everything, including SystemExit / KeyboardInterrupt
        conn.send(("error", traceback.format_exc()))
    finally:
        conn.close()


class RankFailure(AssertionError):
    pass


def spawn(n, target, *args, timeout=60.0, may_die=()):
    """Run ``target(rank, *args)`` for rank 0..n-1 in fresh (spawned) processes; return each
    rank's result. Raises RankFailure listing every rank that raised, died or did not finish
    by ``timeout`` (those are killed). Ranks in ``may_die`` get the result None if they die.
    ``target`` must be a module-level function: spawn pickles it by name."""
    ctx = mp.get_context("spawn")
    procs, conns = [], []
    for rank in range(n):
        parent_end, child_end = ctx.Pipe(duplex=False)
        p = ctx.Process(target=_child, args=(target, rank, child_end, args), daemon=True)
        p.start()
        child_end.close()
        procs.append(p)
        conns.append(parent_end)
    deadline = time.monotonic() + timeout
    results, failures = [None] * n, {}
    pending = set(range(n))
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
    if failures:
        text = "\n".join(f"--- rank {r} ---\n{failures[r]}" for r in sorted(failures))
        raise RankFailure(f"{len(failures)} of {n} ranks failed:\n{text}")
    return results


def _rank_main(rank, fn, world, port, token, init_timeout, env, kwargs, backend):
    os.environ["MESHCOLL_TOKEN"] = token
    os.environ.update({k: v.replace("{rank}", str(rank)) for k, v in env.items()})
    import meshcoll
    meshcoll._C.reload_config()  # the module may be imported already (the test's own import)
    store = meshcoll.TCPStore("127.0.0.1", port, timeout=init_timeout)
    device = None
    if backend == "nccl":  # rank r on GPU r
        import torch
        torch.cuda.set_device(rank)
        device = rank
    pg = meshcoll.init(backend, rank=rank, world_size=world, store=store,
                       timeout=init_timeout, device=device)
    try:
        return fn(pg, **kwargs)
    finally:
        meshcoll.destroy()


def launch(world, fn, *, timeout=60.0, init_timeout=30.0, transport="auto", env=None,
           may_die=(), backend=None, **kwargs):
    """Run ``fn(pg, **kwargs)`` on ``world`` fresh processes; return each rank's result.
    Raises RankFailure listing every rank that failed or did not finish by ``timeout``.
    Ranks in ``may_die`` (fault tests kill them) get the result None if they die.
    ``transport`` ("auto", "tcp" or "shm") is what every group of the job runs over; ``env``
    is any other variable the ranks need ("{rank}" in a value becomes the rank's number).
    ``backend="nccl"`` puts rank r on GPU r
    (tests/gpu)."""
    import meshcoll
    from meshcoll import _settings
    env = dict(env or {})
    if _settings.TRANSPORT in env:
        raise ValueError(f"launch: pass transport=, not {_settings.TRANSPORT} in env")
    env[_settings.TRANSPORT] = transport
    _settings.transport_from_env(env)  # a bad name fails here, not in every rank
    token = secrets.token_hex(8)
    # The parent hosts the store on a port the kernel picks: no free-port race between
    # concurrent test runs.
    server = meshcoll.TCPStore("127.0.0.1", 0, is_server=True, timeout=init_timeout, token=token)
    try:
        return spawn(world, _rank_main, fn, world, server.port, token, init_timeout, env,
                     kwargs, backend, timeout=timeout, may_die=may_die)
    finally:
        del server  # a failure's traceback keeps this frame: close the store now


def meshcoll_threads():
    """The names of this process's meshcoll threads (named mc-...; Linux, /proc/self/task)."""
    import glob
    names = set()
    for path in glob.glob("/proc/self/task/*/comm"):
        try:
            with open(path) as f:
                names.add(f.read().strip())
        except OSError:  # the thread ended meanwhile
            pass
    return {n for n in names if n.startswith("mc-")}


def kill_after_others(pg, victim, step):
    """Rank ``victim`` is killed (SIGKILL) once every other rank has said, through the store,
    that it is past ``step``. A rank killed while a peer still waits for its last message of
    an operation rightly fails that peer in that operation, which is not what a test of the
    calls after a death means to test."""
    if pg.rank == victim:
        pg._store.wait([f"{step}/{r}" for r in range(pg.size) if r != victim], timeout=30)
        os.kill(os.getpid(), signal.SIGKILL)
    pg._store.set(f"{step}/{pg.rank}", b"1")


def group_on(pg, transport, ranks=None):
    """A new group of ``pg`` over ``transport``, for jobs that need groups of both kinds."""
    return pg.new_group(list(range(pg.size)) if ranks is None else ranks, transport=transport)


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


def wrong_errors(cases):
    """Runs each ``(label, call, exception class, text)`` case; returns what went wrong (no
    error, another class, a message without ``text``), one line per bad case."""
    wrong = []
    for label, call, cls, text in cases:
        try:
            call()
        except cls as e:
            if text not in str(e):
                wrong.append(f"{label}: message lacks {text!r}: {e}")
        except Exception as e:  # noqa: BLE001 - report the wrong class
            wrong.append(f"{label}: {type(e).__name__} instead of {cls.__name__}: {e}")
        else:
            wrong.append(f"{label}: no error")
    return wrong
