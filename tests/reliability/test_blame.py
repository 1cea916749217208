"""Diagnosis names the right rank, in global numbers (issue 16, item 14): the timeout census
names only a stopped rank, never a healthy one (Note [Timeout census] in csrc/cpu/engine.cc);
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
from conftest import kill_after_others, launch

pytestmark = pytest.mark.timeout(60)


def _never_reported(msg):
    """The ranks a census says never reported in (before: "never reached"), or None when
    the message has no census."""
    m = re.search(r"rank\(s\) ([\d, ]+) never (?:reported in|reached)", msg)
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


def _subgroup_timeout(pg):
    """Group ranks 0, 1, 2 of the subgroup are global ranks 1, 2, 3; global rank 3 never
    calls the all_reduce."""
    g = pg.new_group([1, 2, 3], transport="tcp")
    out = None
    if pg.rank in (1, 2):
        try:
            g.all_reduce(np.ones(100, np.float32), timeout=1.0 if pg.rank == 1 else 10.0)
            out = "no error"
        except meshcoll.TimeoutError as e:
            out = str(e)
    pg.barrier(timeout=30)
    return out


def test_subgroup_errors_name_global_ranks():
    results = launch(4, _subgroup_timeout)
    for rank in (1, 2):
        msg = results[rank]
        assert _never_reported(msg) == [3], f"rank {rank}: {msg}"
        assert f"on rank {rank} (group rank {rank - 1}) of 3" in msg, f"rank {rank}: {msg}"


def _hier_death(pg, victim):
    """Emulated hosts A, B, A, B: host B's shared-memory group is global ranks 1 and 3 (its
    group ranks 0 and 1), the leaders' group global ranks 0 and 1."""
    os.environ["MESHCOLL_HOST_ID"] = "ABAB"[pg.rank]
    meshcoll._C.reload_config()
    g = pg.new_group(list(range(pg.size)))
    assert g._hier is not None
    x = np.ones(4096, np.float32)
    g.all_reduce(x)
    kill_after_others(pg, victim, "all_reduce")
    try:
        for _ in range(1000):
            g.all_reduce(x, timeout=30.0)
        return "no error"
    except meshcoll.PeerError as e:
        return str(e)


def test_hierarchical_errors_name_global_ranks():
    results = launch(4, _hier_death, victim=3, may_die=(3,), timeout=50)
    for rank in (0, 1, 2):
        msg = results[rank]
        blamed = set(re.findall(r"rank (\d+) (?:exited|closed|died)", msg))
        assert blamed == {"3"}, f"rank {rank} blames {blamed}: {msg}"


def _send_unmapped(pg):
    """Rank 0 broadcasts an array whose memory was unmapped (a freed buffer)."""
    import ctypes
    import mmap
    n = 16384
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                          ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    if pg.rank == 0:
        addr = libc.mmap(None, n * 4, mmap.PROT_READ | mmap.PROT_WRITE,
                         mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0)
        x = np.ctypeslib.as_array((ctypes.c_float * n).from_address(addr))
        libc.munmap(addr, n * 4)
    else:
        x = np.zeros(n, np.float32)
    try:
        # Rank 1 may still be finishing init's own exchange when rank 0's ABORT comes: a
        # barrier inside the try makes the place where it hears of it one we look at.
        pg.barrier(timeout=10)
        pg.broadcast(x, 0, timeout=10)
        return "no error"
    except meshcoll.MeshcollError as e:
        return type(e).__name__, str(e)
    except ValueError as e:
        return "ValueError", str(e)


def test_bad_buffer_is_this_ranks_error_not_a_dead_peer():
    (kind0, msg0), (kind1, msg1) = launch(2, _send_unmapped, transport="tcp")
    # Refused when the array is read, before anything is sent (issue 34 item 7, Note
    # [Unmapped memory] in csrc/python/array_memory.cc), as any refused argument is.
    assert kind0 == "ValueError" and "is not mapped" in msg0 and "broadcast" in msg0, msg0
    assert "exited" not in msg0 and "crashed" not in msg0, msg0
    # The peer waits for rank 0's call, as for any argument refused on one rank, until rank 0
    # leaves (here: its function returned) or the call's timeout: either way naming rank 0.
    assert kind1 in ("PeerError", "TimeoutError") and re.search(r"rank(\(s\))? 0\b", msg1), \
        (kind1, msg1)


def _setup_death(rank, port, token, phase):
    """Global rank 2 (world) or 3 (subgroup [1, 2, 3]) dies before the group is set up."""
    os.environ["MESHCOLL_TOKEN"] = token
    if phase == "world" and rank == 2:
        os._exit(0)
    store = meshcoll.TCPStore("127.0.0.1", port, timeout=10)
    try:
        pg = meshcoll.init("cpu", rank=rank, world_size=4, store=store, timeout=3)
        if phase == "subgroup":
            if rank == 3:
                os._exit(0)
            pg.new_group([1, 2, 3])
        return "no error"
    except (meshcoll.TimeoutError, meshcoll.PeerError) as e:
        return str(e)


@pytest.mark.parametrize("phase, dead, group, survivors",
                         [("world", 2, "world", (0, 1, 3)),
                          ("subgroup", 3, "world.0", (1, 2))])
def test_death_during_setup_is_named(phase, dead, group, survivors):
    from conftest import spawn
    token = "setup-death"
    server = meshcoll.TCPStore("127.0.0.1", 0, is_server=True, timeout=10, token=token)
    try:
        results = spawn(4, _setup_death, server.port, token, phase, may_die=(dead,),
                        timeout=40)
    finally:
        del server
    for rank in survivors:
        msg = results[rank]
        assert re.search(rf"rank(\(s\))? {dead} died or never came during setup", msg), msg
        assert f"group {group!r}" in msg, msg


def _late_rank(pg):
    """Rank 2 comes to the all_reduce a second after the others' 1.5 s deadline: it reaches
    the operation while the census runs, so it reports in, but as having waited nothing."""
    x = np.random.default_rng(pg.rank).standard_normal(64)
    pg.all_reduce(x)
    if pg.rank == 2:
        time.sleep(2.5)
    try:
        pg.all_reduce(x, timeout=1.5)
        return "no error"
    except meshcoll.MeshcollError as e:
        return str(e)


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_census_names_a_late_rank(transport):
    res = launch(3, _late_rank, transport=transport, timeout=40)
    for rank in (0, 1):
        msg = res[rank]
        named = re.search(r"rank\(s\) 2 (\(it had waited \d+ ms\) reached this operation only as "
                          r"it failed|never reported in)", msg)
        assert named, f"rank {rank}: {msg}"
        assert _never_reported(msg) in (None, [2]), f"rank {rank}: {msg}"


def _release(pg, pids, victim, resume):
    """Rank 0 resumes the stopped victim (``resume``); the others wait until it is past its
    call, so no rank destroys the group under it."""
    if resume and pg.rank == 0:
        time.sleep(0.5)
        os.kill(int(pids[victim]), signal.SIGCONT)
    if pg.rank == victim:
        pg._store.set("victim/done", b"1")
    else:
        pg._store.wait(["victim/done"], timeout=30)


def _resumed_after_stop(pg, victim, where, hosts=None):
    """The victim is stopped (SIGSTOP) past a 2 s timeout, ``where`` "before" its call or
    "inside" it, and resumed (SIGCONT) once the others failed; every rank returns its error.
    The others wait for the victim's error before leaving, so it finds them failed, not gone.
    ``hosts``: emulated hosts, one letter per rank (a hierarchical group)."""
    if hosts:
        os.environ["MESHCOLL_HOST_ID"] = hosts[pg.rank]
        meshcoll._C.reload_config()
    g = pg.new_group(list(range(pg.size)))
    assert (g._hier is not None) == bool(hosts)
    pids = pg.all_gather(np.array([os.getpid()], np.int64)).ravel()
    rng = np.random.default_rng(pg.rank)
    x = rng.standard_normal(1000).astype(np.float32)
    want = sum(np.random.default_rng(r).standard_normal(1000).astype(np.float32)
               for r in range(pg.size))
    g.all_reduce(x, timeout=10)  # every rank meets once, the result checked
    if not np.allclose(x, want, rtol=1e-5, atol=1e-5):
        return "wrong all_reduce result"
    pg.barrier(timeout=10)
    if where == "before" and pg.rank == victim:
        os.kill(os.getpid(), signal.SIGSTOP)
    if where == "inside" and pg.rank == 0:
        threading.Timer(0.3, os.kill, (int(pids[victim]), signal.SIGSTOP)).start()
    try:
        for _ in range(100_000):
            g.all_reduce(x, timeout=2.0)
        out = "no error"
    except meshcoll.TimeoutError as e:
        out = str(e)
    _release(pg, pids, victim, resume=True)
    return out


@pytest.mark.parametrize("where", ["before", "inside"])
def test_a_rank_resumed_after_a_stop_says_it_fell_behind(where):
    """Note [Falling behind] in csrc/cpu/engine.cc: the resumed rank blames no healthy peer."""
    victim = 2
    results = launch(3, _resumed_after_stop, transport="tcp", victim=victim, where=where,
                     timeout=50)
    for rank in (0, 1):
        assert _never_reported(results[rank]) == [victim], f"rank {rank}: {results[rank]}"
    msg = results[victim]
    assert f"rank {victim} fell behind" in msg, msg
    assert _never_reported(msg) is None and "came late" not in msg, msg
    assert "still in an earlier operation" not in msg, msg


def test_a_stopped_rank_is_named_on_every_host_of_a_hierarchical_group():
    """Hosts A A B B; rank 3 (host B, not its leader) is stopped: the census is the whole
    group's (Comm::set_serves_steps), so host A names rank 3, not host B's leader (rank 2) or
    its own leader (rank 0), and rank 3, resumed, says it fell behind."""
    results = launch(4, _resumed_after_stop, victim=3, where="before", hosts="AABB", timeout=50)
    for rank in (0, 1, 2):
        assert _never_reported(results[rank]) == [3], f"rank {rank}: {results[rank]}"
    assert "rank 3 fell behind" in results[3], results[3]
    assert _never_reported(results[3]) is None, results[3]


def _shm_mapped():
    """The shared-memory files this process maps."""
    with open("/proc/self/maps") as f:
        return {line.split(None, 5)[5].strip().removesuffix(" (deleted)")
                for line in f if "/dev/shm/" in line}


def _late_in_hierarchical_all_reduce(pg, victim, hosts, how):
    """On emulated hosts, the victim (not its host's leader) is stopped (SIGSTOP from rank 0,
    0.3 s into a stream of hierarchical all_reduces with a 2 s timeout) and resumed once the
    others failed, or comes late (sleeps 3.5 s before its calls). Every rank returns its
    error and how long it took, then destroys the group and returns the shared memory it
    still maps or that is still in /dev/shm."""
    os.environ["MESHCOLL_HOST_ID"] = hosts[pg.rank]
    meshcoll._C.reload_config()
    before = _shm_mapped()
    g = pg.new_group(list(range(pg.size)))
    assert g._hier is not None
    segments = _shm_mapped() - before
    pids = pg.all_gather(np.array([os.getpid()], np.int64)).ravel()
    x = np.random.default_rng(pg.rank).standard_normal(1000).astype(np.float32)
    want = sum(np.random.default_rng(r).standard_normal(1000).astype(np.float32)
               for r in range(pg.size))
    g.all_reduce(x, timeout=10)  # every rank meets once, the result checked
    assert np.allclose(x, want, rtol=1e-5, atol=1e-5)
    pg.barrier(timeout=10)
    if how == "stop" and pg.rank == 0:
        threading.Timer(0.3, os.kill, (int(pids[victim]), signal.SIGSTOP)).start()
    if how == "late" and pg.rank == victim:
        time.sleep(3.5)
    t0 = time.monotonic()
    try:
        for _ in range(100_000):
            g.all_reduce(x, timeout=2.0)
        out = ("no error", "")
    except meshcoll.MeshcollError as e:
        out = (type(e).__name__, str(e))
    took = time.monotonic() - t0
    _release(pg, pids, victim, resume=how == "stop")
    g.destroy()
    left = sorted(s for s in segments if os.path.exists(s)) + sorted(_shm_mapped() - before)
    return out, took, left


def _blamed(msg):
    """The ranks a message blames, in the order it names them: ranks that never came, never
    reported in or came late, that a wait was waiting for, or that died."""
    found = []
    for m in re.finditer(r"rank\(s\) ([\d, ]+) (?:had not arrived|never reported in|never "
                         r"reached|\(it had waited \d+ ms\) reached this operation only as)|"
                         r"waiting for: (?:receive from|send to) rank (\d+)|"
                         r"rank (\d+) (?:exited|closed|died)", msg):
        for r in re.findall(r"\d+", next(g for g in m.groups() if g)):
            found.append(int(r))
    return found


@pytest.mark.parametrize("how,victim", [("stop", 3), ("late", 1)])
def test_a_late_rank_of_a_hierarchical_group_is_blamed_first_not_its_leader(how, victim):
    """Hosts A A B B (leaders 0 and 2). The step that times out first waits for the healthy
    leader on many ranks (host A's non-leader for its leader, a leader for the other host's
    leader); its message blamed that leader before the group's census named the victim (fault
    soak seed 35 episode 207). The step's timeout leaves blame to the census: the first rank
    every other rank's error blames is the victim, and no healthy rank is blamed. Nothing of
    the group is left behind on any rank."""
    results = launch(4, _late_in_hierarchical_all_reduce, victim=victim, hosts="AABB", how=how,
                     timeout=60)
    for rank, ((error, msg), took, left) in enumerate(results):
        assert left == [], (rank, left)
        if rank == victim:
            assert error != "no error", msg
            continue
        assert error == "TimeoutError", (rank, error, msg)
        assert took < 7, (rank, took, msg)
        blamed = _blamed(msg)
        assert blamed and blamed[0] == victim and set(blamed) == {victim}, (rank, blamed, msg)
