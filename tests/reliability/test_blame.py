"""Diagnosis names the right rank, in global numbers (issue 16, item 14): the timeout census
names only a stopped rank, never a healthy one (Note [Timeout census] in csrc/comm/comm.cc);
a bad user buffer is this rank's own error, not a dead peer; errors of a subgroup and of a
hierarchical group name global ranks; a rank that dies during setup is named as such.

Each job is a few real processes over loopback TCP; a stopped rank is killed at the end."""

import os
import re
import signal
import threading
import time

import numpy as np
import pytest

import meshcoll
from conftest import launch

pytestmark = pytest.mark.timeout(60)


def _never_reported(msg):
    """The ranks a census says never reported in, or None when the message has no census."""
    m = re.search(r"rank\(s\) ([\d, ]+) never reported in", msg)
    return None if m is None else [int(r) for r in m.group(1).split(",")]


def _stopped_in_reduce(pg, victim):
    """The victim stops itself just before a tree reduce to rank 0. Ranks whose part needs
    nothing from it finish the reduce and wait in the next all_reduce; rank 0 waits for it
    in the reduce and times out first: the survivors fail at different operations."""
    pids = pg.all_gather(np.array([os.getpid()], np.int64)).ravel()
    rng = np.random.default_rng(pg.rank)
    x = rng.standard_normal(257).astype(np.float32)
    want = sum(np.random.default_rng(r).standard_normal(257).astype(np.float32)
               for r in range(pg.size))
    pg.all_reduce(x, algorithm="ring")  # every rank meets once, the result checked
    if not np.allclose(x, want, rtol=1e-5, atol=1e-5):
        return "wrong all_reduce result"
    if pg.rank == victim:
        os.kill(os.getpid(), signal.SIGSTOP)
    try:
        pg.reduce(x, 0, timeout=1.0 if pg.rank == 0 else 20.0)
        pg.all_reduce(x, timeout=20.0)
        return "no error"
    except meshcoll.TimeoutError as e:
        return str(e)
    finally:
        if pg.rank == 0:
            os.kill(int(pids[victim]), signal.SIGKILL)


def test_census_names_only_the_stopped_rank_across_operations():
    results = launch(4, _stopped_in_reduce, transport="tcp", victim=2, may_die=(2,), timeout=40)
    for rank in (0, 1, 3):
        msg = results[rank]
        assert _never_reported(msg) == [2], f"rank {rank}: {msg}"


def _stopped_mid_all_reduce(pg, victim):
    """Rank 0 stops the victim while every rank runs all_reduces in a loop."""
    pids = pg.all_gather(np.array([os.getpid()], np.int64)).ravel()
    x = np.ones(200_000, np.float32)
    if pg.rank == 0:
        threading.Timer(0.3, os.kill, (int(pids[victim]), signal.SIGSTOP)).start()
    try:
        for _ in range(100_000):
            pg.all_reduce(x, timeout=2.0)
        return "no error"
    except meshcoll.TimeoutError as e:
        return str(e)
    finally:
        if pg.rank == 0:
            os.kill(int(pids[victim]), signal.SIGKILL)


def test_census_names_only_a_rank_stopped_mid_all_reduce():
    results = launch(4, _stopped_mid_all_reduce, transport="tcp", victim=1, may_die=(1,),
                     timeout=40)
    for rank in (0, 2, 3):
        msg = results[rank]
        assert _never_reported(msg) == [1], f"rank {rank}: {msg}"
