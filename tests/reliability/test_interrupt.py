"""Ctrl-C while ranks wait in a collective (issue 16, item 15; Note [Interrupts] in
csrc/common/interrupt.h): every rank raises KeyboardInterrupt within 1 s, as it would in
plain Python, and exits with nothing on stderr but that traceback; a rank interrupted alone
fails the group, so a peer waiting in the same call raises PeerError naming it at once.

Real processes started as a terminal would (one process group, SIGINT to all of it), and
through meshcoll-run, which forwards the SIGINT it gets. Ranks 0 and 1 wait in an
all_reduce that the last rank never calls (it sleeps in Python), or in a recv from it."""

import os
import re
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from conftest import free_port

pytestmark = pytest.mark.timeout(60)

WORLD = 3
RANK_SCRIPT = """
import os, sys, time
import numpy as np
import meshcoll

pg = meshcoll.init()
rank = pg.rank
rng = np.random.default_rng(rank)
x = rng.standard_normal(1000).astype(np.float32)
want = sum(np.random.default_rng(r).standard_normal(1000).astype(np.float32)
           for r in range(pg.size))
pg.all_reduce(x)  # every rank meets once, the result checked
assert np.allclose(x, want, rtol=1e-5, atol=1e-5)
pg.barrier()
open(os.path.join(sys.argv[1], str(rank)), "w").close()  # ready: waiting from now on
try:
    if rank == pg.size - 1:
        time.sleep(30)  # never calls the all_reduce
    elif sys.argv[2] == "async":
        pg.all_reduce(x, timeout=30, async_op=True).wait()
    elif sys.argv[2] == "recv":  # driven on this thread (Note [Synchronous point-to-point])
        pg.recv(x, pg.size - 1, timeout=30)
    else:
        pg.all_reduce(x, timeout=30)
except KeyboardInterrupt:
    print(f"KeyboardInterrupt at {time.monotonic():.3f}", file=sys.stderr, flush=True)
    raise
except meshcoll.PeerError as e:
    print(f"PeerError at {time.monotonic():.3f}: {e}", file=sys.stderr, flush=True)
"""


def _clean_env():
    env = {k: v for k, v in os.environ.items() if not k.startswith("MESHCOLL_")}
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _wait_ready(ready, procs, n=WORLD):
    deadline = time.monotonic() + 40
    while len(os.listdir(ready)) < n:
        assert time.monotonic() < deadline, "the ranks never got ready"
        assert all(p.poll() is None for p in procs), [p.communicate() for p in procs]
        time.sleep(0.05)
    time.sleep(0.3)  # the waiting ranks are inside the all_reduce now


def _rank_env(rank, world, port):
    """A rank's environment, as a launcher sets it (30 s setup deadline)."""
    from meshcoll import _rendezvous
    env = _clean_env()
    env.update(_rendezvous.launcher_env(rank=rank, world_size=world, local_rank=rank,
                                 local_world_size=world, node_rank=0, master_addr="127.0.0.1",
                                 master_port=port, token="interrupt-test", timeout=30))
    return env


def _start_ranks(tmp_path, transport="auto", call="sync"):
    """WORLD ranks in one new process group, as a shell starts a job's processes."""
    script = tmp_path / "rank.py"
    script.write_text(textwrap.dedent(RANK_SCRIPT))
    ready = tmp_path / "ready"
    ready.mkdir()
    port, procs = free_port(), []
    for rank in range(WORLD):
        env = _rank_env(rank, WORLD, port)
        env["MESHCOLL_TRANSPORT"] = transport
        procs.append(subprocess.Popen(
            [sys.executable, str(script), str(ready), call], env=env, stderr=subprocess.PIPE,
            stdout=subprocess.PIPE, text=True,
            process_group=procs[0].pid if procs else 0))
    return procs, ready


def _interrupted_at(text):
    return [float(t) for t in re.findall(r"KeyboardInterrupt at ([\d.]+)", text)]


def _assert_clean(rank, err):
    """Only the KeyboardInterrupt traceback: no teardown noise after it."""
    for noise in ("lost sys.stderr", "Exception ignored", "PeerError", "TimeoutError",
                  "AbortedError", "Fatal Python error", "object at 0x"):
        assert noise not in err, f"rank {rank}: {noise!r} in stderr:\n{err}"
    assert err.count("Traceback (most recent call last)") == 1, f"rank {rank}:\n{err}"
    assert err.rstrip().endswith("KeyboardInterrupt"), f"rank {rank}:\n{err}"


@pytest.mark.parametrize("transport, call", [("shm", "sync"), ("tcp", "sync"), ("tcp", "recv")])
def test_ctrl_c_interrupts_every_rank(tmp_path, transport, call):
    procs, ready = _start_ranks(tmp_path, transport, call)
    try:
        _wait_ready(ready, procs)
        os.killpg(procs[0].pid, signal.SIGINT)
        outs = [p.communicate(timeout=15)[1] for p in procs]
    finally:
        for p in procs:
            p.kill()
            p.wait()
    for rank, (p, err) in enumerate(zip(procs, outs)):
        at = _interrupted_at(err)
        # The class is the witness: the call's own 30 s deadline would be a TimeoutError.
        assert len(at) == 1, f"rank {rank} did not raise KeyboardInterrupt:\n{err}"
        assert p.returncode == -signal.SIGINT, (rank, p.returncode, err)
        _assert_clean(rank, err)


@pytest.mark.parametrize("transport, call", [("tcp", "sync"), ("shm", "async")])
def test_interrupted_rank_fails_the_group(tmp_path, transport, call):
    """SIGINT to rank 1 alone: rank 0, waiting in the same all_reduce, raises PeerError that
    names rank 1 and the interrupt; also when rank 1 waits in Work.wait() for an
    async all_reduce, which runs on the group's worker thread."""
    procs, ready = _start_ranks(tmp_path, transport, call)
    try:
        _wait_ready(ready, procs)
        procs[1].send_signal(signal.SIGINT)
        err0 = procs[0].communicate(timeout=15)[1]
        err1 = procs[1].communicate(timeout=15)[1]
    finally:
        for p in procs:
            p.kill()
            p.wait()
    m = re.search(r"PeerError at ([\d.]+): (.*)", err0)
    assert m, f"rank 0 raised no PeerError:\n{err0}"
    assert "rank 1 was interrupted (KeyboardInterrupt)" in m.group(2), m.group(2)
    assert _interrupted_at(err1), err1
    _assert_clean(1, err1)


def test_ctrl_c_through_meshcoll_run(tmp_path):
    script = tmp_path / "rank.py"
    script.write_text(textwrap.dedent(RANK_SCRIPT))
    ready = tmp_path / "ready"
    ready.mkdir()
    launcher = subprocess.Popen(
        [sys.executable, "-m", "meshcoll.run", "-n", str(WORLD), "--timeout", "30",
         str(script), str(ready), "sync"], env=_clean_env(), stderr=subprocess.PIPE,
        stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        _wait_ready(ready, [launcher])
        launcher.send_signal(signal.SIGINT)
        err = launcher.communicate(timeout=20)[1]
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
        launcher.wait()
    assert launcher.returncode == 128 + signal.SIGINT, (launcher.returncode, err)
    for rank in range(WORLD):
        mine = "\n".join(line[len(f"[rank {rank}] "):] for line in err.splitlines()
                         if line.startswith(f"[rank {rank}] "))
        at = _interrupted_at(mine)
        assert len(at) == 1, f"rank {rank} did not raise KeyboardInterrupt:\n{err}"
        _assert_clean(rank, mine)


SETUP_SCRIPT = """
import os, sys, time
import meshcoll

open(os.path.join(sys.argv[1], os.environ["MESHCOLL_RANK"]), "w").close()
try:
    meshcoll.init()
except KeyboardInterrupt:
    print(f"KeyboardInterrupt at {time.monotonic():.3f}", file=sys.stderr, flush=True)
    raise
"""


def _setup_ranks(tmp_path, ranks, world=2, extra=None):
    """Ranks ``ranks`` of a ``world``-rank job, each a process in meshcoll.init() with a 30 s
    setup deadline (``extra``: more environment, by rank); the folder they mark ready in."""
    extra = extra or {}
    script = tmp_path / "setup.py"
    script.write_text(textwrap.dedent(SETUP_SCRIPT))
    ready = tmp_path / "ready"
    ready.mkdir()
    port = free_port()
    procs = []
    for rank in ranks:
        env = _rank_env(rank, world, port)
        env.update(extra.get(rank, {}))
        procs.append(subprocess.Popen([sys.executable, str(script), str(ready)], env=env,
                                      stderr=subprocess.PIPE, stdout=subprocess.PIPE, text=True))
    return procs, ready


def _interrupt_rank_0(procs):
    """SIGINT to rank 0; its stderr."""
    procs[0].send_signal(signal.SIGINT)
    return procs[0].communicate(timeout=15)[1]


def _kill(procs):
    for p in procs:
        p.kill()
        p.wait()


def test_ctrl_c_while_waiting_for_ranks_to_come(tmp_path):
    procs, ready = _setup_ranks(tmp_path, [0])  # rank 1 never comes
    try:
        _wait_ready(ready, procs, n=1)
        time.sleep(0.7)  # past the store and the listening socket: waiting for rank 1
        err = _interrupt_rank_0(procs)
    finally:
        _kill(procs)
    at = _interrupted_at(err)
    assert at, err  # KeyboardInterrupt, not the 30 s setup deadline's TimeoutError
    _assert_clean(0, err)


def test_ctrl_c_while_a_stopped_rank_holds_up_the_setup(tmp_path):
    # Rank 1 connects, publishes its settings and stops (MESHCOLL_FAULT=stop@settings): its
    # links stay open, so nothing tells rank 0 it is gone, and rank 0 waits in the store
    # exchange of the next setup step (shared memory's). A Ctrl-C must end that wait, not
    # the 30 s setup deadline (Note [Interrupts]).
    shm = {"MESHCOLL_TRANSPORT": "shm"}
    procs, ready = _setup_ranks(tmp_path, [0, 1],
                                extra={0: shm, 1: {**shm, "MESHCOLL_FAULT": "stop@settings"}})
    try:
        _wait_ready(ready, procs[:1], n=2)
        deadline = time.monotonic() + 20
        while not _stopped(procs[1].pid):
            assert time.monotonic() < deadline, "rank 1 never stopped at its fault point"
            time.sleep(0.05)
        time.sleep(0.5)  # rank 0 is past the settings, waiting in the shared-memory step
        err = _interrupt_rank_0(procs)
    finally:
        _kill(procs)
    assert _interrupted_at(err), err  # KeyboardInterrupt, not the setup deadline's TimeoutError
    _assert_clean(0, err)


def _stopped(pid):
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] == "T"
