"""Security (issue 9.4): the store and the peer transports listen only on the given interface
(the kernel's own table, /proc/net/tcp, is the witness); a stray client without the job token
cannot join a running job's transport; the store server survives a bounded fuzz of its wire
protocol (csrc/store/wire.h) and keeps answering a proper client.

The job cases share one 3-rank job (module fixture ``job``): rank 0 creates a group with rank
1 and so listens for it, rank 1 holds back until rank 2 - a process that knows where rank 0
listens (the store) but plays a stray client - has inspected the listeners and tried to get
in with garbage and with bad handshakes.
"""

import os
import random
import resource
import secrets
import socket
import struct
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

import meshcoll
from meshcoll.backends import _comm_id

pytestmark = pytest.mark.timeout(60)

CALL = 30.0
HOLD = 5.0  # seconds the silent stray client keeps its connection open


# ---- the kernel's listening sockets ---------------------------------------------------------

def _addr(hex_addr):
    host, port = hex_addr.split(":")
    raw = bytes.fromhex(host)
    if len(raw) == 4:
        return socket.inet_ntop(socket.AF_INET, raw[::-1]), int(port, 16)
    words = b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4))  # four host-order words
    return socket.inet_ntop(socket.AF_INET6, words), int(port, 16)


def listeners(pid=None):
    """(address, port) of listening TCP sockets in this network namespace; only those owned
    by ``pid`` when given (matched by socket inode)."""
    inodes = None
    if pid is not None:
        inodes = set()
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if link.startswith("socket:["):
                inodes.add(link[8:-1])
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = open(table).read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            f = line.split()
            if f[3] == "0A" and (inodes is None or f[9] in inodes):  # 0A: TCP_LISTEN
                found.append(_addr(f[1]))
    return found


def test_store_binds_only_to_the_given_address():
    srv = meshcoll.TCPStore("127.0.0.1", 0, is_server=True, timeout=5, token="t")
    mine = [a for a in listeners(os.getpid()) if a[1] == srv.port]
    assert mine == [("127.0.0.1", srv.port)], mine
    del srv
    # The witness can tell: a server asked to listen everywhere shows as 0.0.0.0.
    srv = meshcoll.TCPStore("0.0.0.0", 0, is_server=True, timeout=5, token="t")
    assert [a for a in listeners(os.getpid()) if a[1] == srv.port] == [("0.0.0.0", srv.port)]
    del srv


# ---- one job: listeners of a real job, and stray clients at its transport ------------------

def _handshake(token, rank, size, comm_id, magic=0x5348434D, version=3, token_len=None,
               global_rank=None):
    """A transport handshake (csrc/transport/tcp/tcp_connect.cc); `global_rank` defaults to
    the group rank, as in a world group."""
    token = token.encode()
    n = len(token) if token_len is None else token_len
    g = rank if global_rank is None else global_rank
    return struct.pack("<IHHiiQi", magic, version, n, rank, size, comm_id, g) + token


def _stray(host, port, payload, hold=0.0):
    """What a stray client gets back: b"\\x00" (refused), b"" (closed) or "reset"."""
    with socket.create_connection((host, port), timeout=5) as s:
        s.sendall(payload)
        time.sleep(hold)
        try:
            return s.recv(16)
        except ConnectionResetError:
            return "reset"
        except socket.timeout:
            return "no answer"


def _job(pg):
    rank, store = pg.rank, pg._store
    token = os.environ["MESHCOLL_TOKEN"]
    out = {}
    if rank == 0:
        store.set("sec/pid0", str(os.getpid()))
    if rank == 1:  # hold back: rank 0 listens for us meanwhile
        store.get("sec/go", CALL)
        g = pg.new_group([0, 1])
        # The witness of no stall is the order, not the clock: the stray client was still
        # connected (rank 2 had not said it let go) when the join finished.
        out["joined while the stray held on"] = not store.check(["sec/released"])
    else:
        g = pg.new_group([0, 1])  # rank 2: not a member, returns at once
    if rank == 2:
        addr = store.get("mc/world.0/tcp/addr/0", CALL).decode()
        host, port = addr.rsplit(":", 1)
        port = int(port)
        pid0 = int(store.get("sec/pid0", CALL))
        out["addr"] = (host, port)
        out["listeners"] = listeners(pid0)
        out["store port"] = store.port
        cid = _comm_id("world.0", token)
        wrong = "x" * len(token)
        attempts = {
            "garbage": os.urandom(64),
            "wrong token": _handshake(wrong, 1, 2, cid),
            "no token": _handshake("", 1, 2, cid),
            "other group": _handshake(token, 1, 2, _comm_id("world.7", token)),
            "wrong size": _handshake(token, 1, 5, cid),
            "lower rank": _handshake(token, 0, 2, cid),
            "rank out of range": _handshake(token, 9, 2, cid),
            "huge token_len": _handshake(token, 1, 2, cid, token_len=60000),
            "bad version": _handshake(token, 1, 2, cid, version=2),
            # Everything right but who it is: global rank 2 claims the place of rank 1.
            "stand-in": _handshake(token, 1, 2, cid, global_rank=2),
        }
        out["stray"] = {k: _stray(host, port, v) for k, v in attempts.items()}
        # A client that connects and says nothing, while rank 1 comes to join.
        with socket.create_connection((host, port), timeout=5):
            store.set("sec/go", b"1")
            time.sleep(HOLD)
            store.set("sec/released", b"1")  # before the close: a join that waited sees it
    # The job keeps working: the new group and the world, on random data.
    rng = np.random.default_rng(99)
    data = rng.integers(-1000, 1000, (pg.size, 4099)).astype(np.int64)
    if rank in (0, 1):
        x = data[rank].copy()
        g.all_reduce(x, timeout=CALL)
        out["group ok"] = bool(np.array_equal(x, data[0] + data[1]))
        out["group transport"] = g.transport
    y = data[rank].astype(np.float64)
    pg.all_reduce(y, timeout=CALL)
    out["world ok"] = bool(np.array_equal(y, data.sum(axis=0)))
    pg.barrier(timeout=CALL)
    if rank == 0:
        out["listeners after"] = listeners(os.getpid())
    return out


@pytest.fixture(scope="module")
def job():
    from conftest import launch
    return launch(3, _job, timeout=50)


def test_job_listens_only_on_the_master_interface(job):
    r2 = job[2]
    host, port = r2["addr"]
    assert host == "127.0.0.1", r2["addr"]  # the interface that reaches the master
    # While rank 0 waited for rank 1: its transport listener (and the store's, when rank 0
    # hosts it), each on the master's interface only: nothing on 0.0.0.0 or ::.
    assert ("127.0.0.1", port) in r2["listeners"], r2["listeners"]
    assert {h for h, _ in r2["listeners"]} == {"127.0.0.1"}, r2["listeners"]
    assert {p for _, p in r2["listeners"]} <= {port, r2["store port"]}, r2["listeners"]
    # Afterwards the transport listener is closed (peers connect once, at creation).
    after = job[0]["listeners after"]
    assert {h for h, _ in after} <= {"127.0.0.1"} and ("127.0.0.1", port) not in after, after


def test_stray_clients_are_refused_and_the_job_keeps_working(job):
    for what, answer in job[2]["stray"].items():
        assert answer in (b"\x00", b"", "reset"), (what, answer)
    assert job[2]["stray"]["stand-in"] == b"\x00", job[2]["stray"]  # read, and refused
    for rank, r in enumerate(job):
        assert r["world ok"], rank
    assert job[0]["group ok"] and job[1]["group ok"]
    assert job[0]["group transport"] == "shm"  # same host: only the bootstrap was TCP


def test_silent_stray_client_does_not_stall_the_rendezvous(job):
    assert job[1]["joined while the stray held on"], job[1]


# ---- the store protocol, fuzzed --------------------------------------------------------------

TOKEN = "fuzz-" + secrets.token_hex(4)
MAGIC = 0x5453434D
SERVER = """
import sys, meshcoll
s = meshcoll.TCPStore("127.0.0.1", 0, is_server=True, timeout=10, token=sys.argv[1])
print(s.port, flush=True)
sys.stdin.read()
"""


def _start_server(max_files=None):
    def limit():
        if max_files:
            resource.setrlimit(resource.RLIMIT_NOFILE, (max_files, max_files))
    p = subprocess.Popen([sys.executable, "-c", SERVER, TOKEN], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, preexec_fn=limit)
    return p, int(p.stdout.readline())


def _proc_status(pid):
    d = dict(line.split(":", 1) for line in open(f"/proc/{pid}/status"))
    return {"rss_mb": int(d["VmRSS"].split()[0]) // 1024,
            "vm_mb": int(d["VmSize"].split()[0]) // 1024,
            "threads": int(d["Threads"]), "fds": len(os.listdir(f"/proc/{pid}/fd"))}


def _stop(p):
    p.kill()
    p.wait(5)


def _u32(n):
    return struct.pack("<I", n & 0xFFFFFFFF)


def _field(rng):
    data = rng.randbytes(rng.choice([0, 1, 8, 64, 300]))
    if rng.random() < 0.8:
        return _u32(len(data)) + data
    # A length the server must refuse (over kMaxKeyBytes / kMaxValueBytes) or that lies.
    return _u32(rng.choice([2**31, 2**32 - 1, 64 * 1024 + 1, 64 * 2**20 + 1, len(data) + 5])) + data


def _query(rng):
    t = rng.choice([1, 2, 3, 4, 5, 6, 7, 8, 0, 9, 255, rng.randrange(256)])
    b = bytes([t])
    # Waiting queries get short timeouts: a client that waits forever is not an attack.
    short = struct.pack("<q", rng.choice([0, 1, 10]))
    if t == 1:
        b += _field(rng) + _field(rng)
    elif t == 2:
        b += _field(rng) + short
    elif t == 3:
        key = rng.choice([b"k", b"n", rng.randbytes(4)])  # "k" also gets non-numeric values
        b += _u32(len(key)) + key + struct.pack("<q", rng.choice([1, -1, 2**62, -2**63]))
    elif t == 4:
        b += _field(rng) + _field(rng) + _field(rng)
    elif t in (5, 6):
        n = rng.choice([0, 1, 3, 2**16, 2**16 + 1, 2**32 - 1])
        b += _u32(n) + b"".join(_field(rng) for _ in range(min(n, 4)))
        if t == 5:
            b += short
    elif t == 7:
        b += _field(rng)
    if rng.random() < 0.2:
        b = b[:rng.randrange(len(b) + 1)]
    return b


def _payload(rng):
    if rng.random() < 0.15:
        return rng.randbytes(rng.randrange(2048))
    tok = TOKEN.encode() if rng.random() < 0.7 else rng.randbytes(rng.choice([0, 10, 1025]))
    version = 2 if rng.random() < 0.9 else rng.randrange(65536)
    tlen = len(tok) if rng.random() < 0.9 else rng.randrange(65536)
    magic = MAGIC if rng.random() < 0.95 else rng.getrandbits(32)
    generation = 0 if rng.random() < 0.9 else rng.getrandbits(32)
    b = struct.pack("<IHHI", magic, version, tlen, generation) + tok
    for _ in range(rng.randrange(6)):
        b += _query(rng)
    if rng.random() < 0.1:
        b = b[:rng.randrange(len(b) + 1)]
    return b


def _fuzz(port, seconds, threads=8, seed=None):
    seed = random.randrange(2**32) if seed is None else seed
    counts = {"connections": 0, "bytes": 0, "seed": seed}
    lock = threading.Lock()

    def worker(k, deadline):
        rng = random.Random(seed * 1000 + k)
        while time.monotonic() < deadline:
            p = _payload(rng)
            with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
                s.settimeout(0.02)
                try:
                    s.sendall(p)
                    s.recv(4096)
                except OSError:  # refused, reset or nothing to say: all fine
                    pass
            with lock:
                counts["connections"] += 1
                counts["bytes"] += len(p)

    deadline = time.monotonic() + seconds
    ts = [threading.Thread(target=worker, args=(k, deadline)) for k in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return counts


def _proper_client_works(port, timeout=5):
    c = meshcoll.TCPStore("127.0.0.1", port, timeout=timeout, token=TOKEN)
    c.set("proper/a", b"x" * 1000)
    assert c.get("proper/a") == b"x" * 1000
    assert c.add("proper/n", 5) == 5 and c.add("proper/n", -2) == 3
    c.wait(["proper/a", "proper/n"], 1)
    assert c.check(["proper/a"]) and not c.check(["proper/missing"])
    with pytest.raises(meshcoll.TimeoutError):
        c.get("proper/missing", 0.05)
    assert c.delete_key("proper/a")


@pytest.mark.timeout(30)
def test_store_survives_a_fuzz_of_its_protocol():
    p, port = _start_server()
    try:
        before = _proc_status(p.pid)
        counts = _fuzz(port, seconds=4.0)
        assert p.poll() is None, f"store server died (fuzz {counts})"
        _proper_client_works(port)
        after = _proc_status(p.pid)
        assert counts["connections"] > 100, counts
        # Bounded: a few hundred MB of growth would mean the server keeps what it refused.
        assert after["rss_mb"] - before["rss_mb"] < 300, (before, after, counts)
    finally:
        _stop(p)


@pytest.mark.timeout(30)
def test_store_closes_connections_it_rejects():
    p, port = _start_server(max_files=128)
    try:
        for k in range(200):
            with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
                s.sendall(b"GET / HTTP/1.0\r\n\r\n" if k % 2 else
                          struct.pack("<IHHI", MAGIC, 2, 5000, 0))
        time.sleep(0.2)
        fds = _proc_status(p.pid)["fds"]
        try:
            _proper_client_works(port, timeout=2)
            err = None
        except meshcoll.MeshcollError as e:
            err = f"{type(e).__name__}: {e}"
        assert fds < 50 and err is None, (fds, err)
    finally:
        _stop(p)


@pytest.mark.timeout(30)
def test_store_memory_is_bounded_after_many_connections():
    p, port = _start_server()
    try:
        hello = struct.pack("<IHHI", MAGIC, 2, len(TOKEN), 0) + TOKEN.encode()
        before = _proc_status(p.pid)
        for _ in range(500):
            with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
                s.sendall(hello)
                s.recv(3)  # HelloReply, then we leave
        time.sleep(0.2)
        after = _proc_status(p.pid)
        _proper_client_works(port)
        assert after["vm_mb"] - before["vm_mb"] < 512, (before, after)
    finally:
        _stop(p)


# ---- a connection flood (issue 16.17) -------------------------------------------------------

def _cpu_s(pid):
    """The process's user + system CPU time so far, in seconds."""
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _flood_then_proper_client(max_files, silent):
    """Host a store in a child limited to ``max_files`` descriptors, open ``silent``
    connections that never say hello, then time a proper client; return (seconds the proper
    client took, or its error; CPU seconds the server spent from the flood's start to the
    client's end)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < silent + 64:
        if hard != resource.RLIM_INFINITY and hard < silent + 64:
            pytest.skip(f"RLIMIT_NOFILE hard limit {hard} < {silent + 64}")
        resource.setrlimit(resource.RLIMIT_NOFILE, (silent + 64, hard))
    p, port = _start_server(max_files=max_files)
    socks = []
    try:
        cpu0 = _cpu_s(p.pid)
        for _ in range(silent):
            s = socket.socket()
            s.setblocking(False)
            s.connect_ex(("127.0.0.1", port))  # completes in the kernel's backlog
            socks.append(s)
        time.sleep(1.0)  # the server sees the flood before the proper client comes
        t0 = time.monotonic()
        try:
            _proper_client_works(port, timeout=5)
            took = time.monotonic() - t0
        except meshcoll.MeshcollError as e:
            took = f"{type(e).__name__}: {e}"
        cpu = _cpu_s(p.pid) - cpu0
        assert p.poll() is None, "the store server died in the flood"
        return took, cpu
    finally:
        for s in socks:
            s.close()
        _stop(p)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


@pytest.mark.timeout(40)
def test_store_admits_a_proper_client_during_a_flood_of_silent_connections():
    # 1,100 connections that never say hello, at the usual limit of 1,024 descriptors:
    # unauthenticated connections are capped and time out fast, so the server neither runs
    # out of descriptors for good nor spins on accept (EMFILE), and a proper client gets in.
    took, cpu = _flood_then_proper_client(max_files=1024, silent=1100)
    # Getting in within the client's own 5 s is the witness (before: locked out); the server's
    # CPU time (not wall time) shows accept does not spin (before: 2.6-3.9 s).
    assert isinstance(took, float) and cpu < 1.0, (took, f"server CPU {cpu:.2f} s")


@pytest.mark.timeout(40)
def test_store_does_not_spin_at_its_descriptor_limit():
    # Fewer descriptors than the cap on pending connections: accept meets EMFILE first.
    took, cpu = _flood_then_proper_client(max_files=40, silent=200)
    # Getting in within the client's own 5 s is the witness (before: locked out); the server's
    # CPU time (not wall time) shows accept does not spin (before: 2.6-3.9 s).
    assert isinstance(took, float) and cpu < 1.0, (took, f"server CPU {cpu:.2f} s")


@pytest.mark.timeout(60)
def test_store_admits_proper_clients_during_a_sustained_flood():
    # New silent connections keep coming, so each pushes out the oldest: a proper client's
    # connection may go before its hello is read, and the client connects again. (A guard
    # for the pushing out, which store servers before it did not do.)
    p, port = _start_server(max_files=1024)
    stop = threading.Event()
    flooded = []

    def flood():
        socks = []
        while not stop.is_set():
            s = socket.socket()
            s.setblocking(False)
            s.connect_ex(("127.0.0.1", port))
            socks.append(s)
            if len(socks) >= 600:  # stay far from this process's own descriptor limit
                for s in socks[:300]:
                    s.close()
                del socks[:300]
            flooded.append(1)
        for s in socks:
            s.close()

    t = threading.Thread(target=flood)
    t.start()
    took = []
    try:
        time.sleep(0.5)
        for k in range(8):
            t0 = time.monotonic()
            try:
                c = meshcoll.TCPStore("127.0.0.1", port, timeout=10, token=TOKEN)
                c.set(f"k{k}", b"v")
                took.append(round(time.monotonic() - t0, 3) if c.get(f"k{k}") == b"v" else "wrong")
            except meshcoll.MeshcollError as e:
                took.append(f"{type(e).__name__}: {e}")
    finally:
        stop.set()
        t.join()
        _stop(p)
    # Each got in within its own 10 s (a push-out without the client's reconnect was a
    # PeerError).
    assert all(isinstance(x, float) for x in took), (took, f"{len(flooded)} connections")


# ---- jobs started with no token (issue 16.16) -----------------------------------------------

def _launcher_free_environ(extra=None):
    """This process's environment without any launcher's variables, plus ``extra``."""
    for k in [k for k in os.environ
              if k.startswith(("MESHCOLL_", "OMPI_", "PMI_", "SLURM_", "TORCHELASTIC_"))
              or k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                       "MASTER_PORT")]:
        del os.environ[k]
    os.environ.update(extra or {})


def _refused(host, port):
    """What a stranger who knows the store's port, but not the token, gets."""
    try:
        meshcoll.TCPStore(host, port, timeout=5, token="").get("tok/secret", 1)
        return "admitted"
    except meshcoll.PeerError as e:
        return str(e)


def _launcher_env(launcher, rank, port):
    """What each launcher tells rank ``rank`` of 2; none of it is a secret."""
    master = {"MESHCOLL_MASTER_ADDR": "127.0.0.1", "MESHCOLL_MASTER_PORT": str(port)}
    return {
        "explicit": {},
        "torchrun": {"RANK": str(rank), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                     "MASTER_PORT": str(port), "TORCHELASTIC_RUN_ID": "none"},
        "srun": {"SLURM_PROCID": str(rank), "SLURM_NTASKS": "2", "SLURM_JOB_ID": "19710274",
                 "SLURM_STEP_ID": "0", **master},
        # Open MPI's transport key: random under mpirun, built from the job id under srun.
        "mpirun": {"OMPI_COMM_WORLD_RANK": str(rank), "OMPI_COMM_WORLD_SIZE": "2",
                   "OMPI_MCA_orte_precondition_transports": "012cc14200000000-012cc14200000000",
                   **master},
    }[launcher]


def _tokenless_job(rank, port, launcher):
    _launcher_free_environ(_launcher_env(launcher, rank, port))
    pg = (meshcoll.init(rank=rank, world_size=2, master_addr="127.0.0.1", master_port=port,
                        timeout=30) if launcher == "explicit" else meshcoll.init(timeout=30))
    if rank == 0:
        pg._store.set("tok/secret", b"rendezvous data")
    pg.barrier()
    stranger = _refused("127.0.0.1", port) if rank == 1 else None
    data = np.random.default_rng(16).standard_normal((2, 1001))
    x = data[rank].copy()
    pg.all_reduce(x)
    out = {"ok": bool(np.allclose(x, data.sum(axis=0))), "stranger": stranger}
    pg.barrier()
    meshcoll.destroy()
    return out


def _init_without_token(rank, ports, launcher):
    import warnings
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        jobs = [_tokenless_job(rank, port, launcher) for port in ports]
        _launcher_free_environ()
        solo = meshcoll.init(rank=0, world_size=1)  # a job of one makes its own token
        jobs.append({"token": solo._token})
        meshcoll.destroy()
    warned = [str(w.message) for w in seen if "MESHCOLL_TOKEN" in str(w.message)]
    return {"warned": warned, "jobs": jobs}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("launcher", ["explicit", "torchrun", "srun", "mpirun"])
def test_job_without_a_token_warns_once_on_rank_0(launcher):
    from conftest import free_port, spawn
    # The explicit case runs two jobs in the same processes: still one warning.
    ports = (free_port(), free_port()) if launcher == "explicit" else (free_port(),)
    r = spawn(2, _init_without_token, ports, launcher, timeout=50)
    assert all(job["ok"] for rank in r for job in rank["jobs"][:-1]), r
    assert len(r[0]["warned"]) == 1 and r[1]["warned"] == [], r
    assert "accept any process" in r[0]["warned"][0] and "export MESHCOLL_TOKEN=" in r[0]["warned"][0]
    assert r[1]["jobs"][0]["stranger"] == "admitted"  # what the warning says
    assert len(r[0]["jobs"][-1]["token"]) == 32 and r[0]["jobs"][-1]["token"] != r[1]["jobs"][-1]["token"]


RUN_SCRIPT = """
import os, numpy as np, meshcoll
pg = meshcoll.init()
if pg.rank == 0:
    pg._store.set("tok/secret", b"rendezvous data")
pg.barrier()
if pg.rank == 1:
    try:
        meshcoll.TCPStore(os.environ["MESHCOLL_MASTER_ADDR"], int(os.environ["MESHCOLL_MASTER_PORT"]),
                          timeout=5, token="").get("tok/secret", 1)
        print("stranger admitted")
    except meshcoll.PeerError as e:
        print("stranger refused:", e)
x = np.arange(5.0) * (pg.rank + 1)
pg.all_reduce(x)
print("sum", x.tolist())
meshcoll.destroy()
"""


@pytest.mark.timeout(60)
def test_meshcoll_run_job_has_a_token_strangers_lack(tmp_path):
    (tmp_path / "job.py").write_text(RUN_SCRIPT)
    env = {k: v for k, v in os.environ.items() if not k.startswith("MESHCOLL_")}
    r = subprocess.run([sys.executable, "-m", "meshcoll.run", "-n", "2", "job.py"], cwd=tmp_path,
                       env=env, capture_output=True, text=True, timeout=50)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "[rank 1] stranger refused:" in r.stdout and "job token rejected" in r.stdout, r.stdout
    assert r.stdout.count("sum [0.0, 3.0, 6.0, 9.0, 12.0]") == 2, r.stdout
    assert "MESHCOLL_TOKEN" not in r.stderr, r.stderr  # no warning: the launcher made a token
