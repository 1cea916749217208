"""Several hosts on one machine (issue 9.5): two network namespaces joined by a veth pair, two
ranks in each. Each namespace gets its own MESHCOLL_HOST_ID, so the ranks of one namespace
share memory while the world group, which spans both, runs over TCP between the namespaces'
addresses. Every collective is checked against numpy on the world, on the shared-memory
group of each namespace (``split``) and on a TCP group with one rank per namespace.

Needs root (``ip netns add``); skipped with the reason otherwise. Only addresses inside the
namespaces made here (10.250.1.0/24) are used; the namespaces are deleted afterwards.
"""

import json
import os
import secrets
import shutil
import subprocess
import sys
import textwrap
import time

import pytest

pytestmark = pytest.mark.timeout(90)

SUBNET = "10.250.1"
PORT = 29500  # the namespaces are new: nothing else listens in them
RUN_TIMEOUT = 60.0

RANK_SCRIPT = textwrap.dedent(r'''
    import json, os, socket, sys
    import numpy as np
    import meshcoll

    def listeners():
        out = []
        for table in ("/proc/net/tcp", "/proc/net/tcp6"):
            for line in open(table).read().splitlines()[1:]:
                f = line.split()
                if f[3] == "0A":
                    host, port = f[1].split(":")
                    raw = bytes.fromhex(host)
                    if len(raw) == 4:
                        out.append((socket.inet_ntoa(raw[::-1]), int(port, 16)))
                    else:
                        out.append(("::" if raw == bytes(16) else raw.hex(), int(port, 16)))
        return out

    def inputs(g, seed, shape, dtype):
        """Every member's input, so each rank can compute the reference for any collective."""
        rngs = [np.random.default_rng([seed, r]) for r in range(g.size)]
        if np.dtype(dtype).kind == "f":
            return [rg.integers(-50, 50, shape).astype(dtype) for rg in rngs]
        return [rg.integers(-1000, 1000, shape).astype(dtype) for rg in rngs]

    def check(g, seed):
        n, r, wrong = g.size, g.rank, []

        def expect(label, got, want):
            if np.shape(got) != np.shape(want) or not np.array_equal(got, want):
                wrong.append(f"{label}: got {np.ravel(got)[:4]} want {np.ravel(want)[:4]}")

        # (count, dtype, algorithm): every algorithm over TCP; shared memory takes auto.
        for k, (count, dtype, algo) in enumerate([
                (1, np.float32, "auto"), (1031, np.int32, "tree"), (300001, np.float32, "ring"),
                (65537, np.float64, "halving_doubling"), (4099, np.int64, "direct"),
                (200003, np.float32, "auto")]):
            algo = "auto" if g.transport == "shm" else algo
            xs = inputs(g, seed + k, count, dtype)
            x = xs[r].copy()
            g.all_reduce(x, algorithm=algo)
            expect(f"all_reduce {count} {algo}", x, np.sum(xs, axis=0, dtype=dtype))
            y = xs[r].copy()
            g.all_reduce(y, "max")
            expect(f"all_reduce max {count}", y, np.max(xs, axis=0))
        xs = inputs(g, seed + 10, (3, 257), np.float64)
        x = xs[r].copy()
        g.reduce(x, n - 1)
        expect("reduce", x, np.sum(xs, axis=0) if r == n - 1 else xs[r])
        x = xs[r].copy()
        g.broadcast(x, n - 1)
        expect("broadcast", x, xs[n - 1])
        expect("all_gather", g.all_gather(xs[r]), np.stack(xs))
        rows = [(seed + i) % 3 + 1 for i in range(n)]
        vs = [xs[i][:rows[i]] for i in range(n)]
        got, counts = g.all_gather_v(vs[r])
        expect("all_gather_v", got, np.concatenate(vs))
        expect("all_gather_v counts", counts, rows)
        zs = inputs(g, seed + 11, (2 * n, 129), np.int32)
        expect("reduce_scatter", g.reduce_scatter(zs[r]), np.sum(zs, axis=0)[2 * r:2 * r + 2])
        cnt = [1 + (i % 3) for i in range(n)]
        ws = inputs(g, seed + 12, (sum(cnt), 5), np.int64)
        off = sum(cnt[:r])
        expect("reduce_scatter_v", g.reduce_scatter_v(ws[r], cnt),
               np.sum(ws, axis=0)[off:off + cnt[r]])
        expect("all_to_all", g.all_to_all(zs[r]),
               np.concatenate([zs[i][2 * r:2 * r + 2] for i in range(n)]))
        sends = [[(j + i) % 3 for j in range(n)] for i in range(n)]  # rank i -> rank j rows
        src = [np.random.default_rng([seed + 13, i]).standard_normal((sum(sends[i]), 7))
               for i in range(n)]
        got, recv_counts = g.all_to_all_v(src[r], sends[r])
        parts = [src[i][sum(sends[i][:r]):sum(sends[i][:r + 1])] for i in range(n)]
        expect("all_to_all_v", got, np.concatenate(parts))
        expect("all_to_all_v counts", recv_counts, [sends[i][r] for i in range(n)])
        gat = g.gather(xs[r], 0)
        if r == 0:
            expect("gather", gat, np.stack(xs))
        sc = g.scatter(np.stack(xs) if r == 1 else None, 1,
                       out=None if r == 1 else np.empty((3, 257)))
        expect("scatter", sc, xs[r])
        buf = np.empty(100003, np.float32)
        big = inputs(g, seed + 14, 100003, np.float32)
        w = g.isend(big[r], (r + 1) % n)
        g.recv(buf, (r - 1) % n); w.wait()
        expect("send/recv", buf, big[(r - 1) % n])
        g.barrier()
        return wrong

    ns = int(os.environ["NETNS_INDEX"])
    pg = meshcoll.init(timeout=30)
    r = pg.rank
    mine = pg._store.get(f"mc/world/tcp/addr/{r}").decode().rsplit(":", 1)[0]
    local = pg.split(ns, key=r)            # the two ranks of this namespace
    cross = pg.new_group([1, 2])           # one rank per namespace
    out = {"rank": r, "ns": ns, "addr": mine,
           "transports": {"world": pg.transport, "local": local.transport,
                          "cross": cross.transport if cross.is_member else None},
           "wrong": {"world": check(pg, 100), "local": check(local, 200 + 10 * ns)}}
    if cross.is_member:
        out["wrong"]["cross"] = check(cross, 300)
    if r == 0:
        out["listeners"] = listeners()
    pg.barrier()
    meshcoll.destroy()
    print("RESULT " + json.dumps(out), flush=True)
''')


def _ip(*args, ns=None, check=True):
    cmd = ["ip"] + (["netns", "exec", ns, "ip"] if ns else []) + list(args)
    return subprocess.run(cmd, capture_output=True, text=True, timeout=20, check=check)


@pytest.fixture
def two_hosts(request):
    if os.geteuid() != 0:
        pytest.skip("creating network namespaces needs root")
    if shutil.which("ip") is None:
        pytest.skip("iproute2's `ip` is not installed")
    tag = f"{os.getpid() % 100000}"
    names = [f"mcA{tag}", f"mcB{tag}"]
    veths = [f"mcva{tag}", f"mcvb{tag}"]
    made = []

    def cleanup():
        for ns in made:
            _ip("netns", "del", ns, check=False)  # takes its end of the veth pair with it
        for v in veths:  # in case a veth never moved into its namespace
            _ip("link", "del", v, check=False)
    request.addfinalizer(cleanup)

    r = _ip("netns", "add", names[0], check=False)
    if r.returncode != 0:
        pytest.skip(f"`ip netns add` is not permitted here: {r.stderr.strip()}")
    made.append(names[0])
    _ip("netns", "add", names[1])
    made.append(names[1])
    _ip("link", "add", veths[0], "type", "veth", "peer", "name", veths[1])
    hosts = []
    for k, (ns, v) in enumerate(zip(names, veths)):
        addr = f"{SUBNET}.{k + 1}"
        _ip("link", "set", v, "netns", ns)
        _ip("addr", "add", f"{addr}/24", "dev", v, ns=ns)
        _ip("link", "set", v, "up", ns=ns)
        _ip("link", "set", "lo", "up", ns=ns)
        hosts.append((ns, v, addr))
    return hosts


def test_collectives_across_two_namespaces(two_hosts, tmp_path):
    script = tmp_path / "rank.py"
    script.write_text(RANK_SCRIPT)
    token = secrets.token_hex(8)
    master = two_hosts[0][2]
    procs = []
    try:
        for rank in range(4):
            ns, veth, _ = two_hosts[rank // 2]
            env = dict(os.environ, MESHCOLL_RANK=str(rank), MESHCOLL_WORLD_SIZE="4",
                       MESHCOLL_LOCAL_RANK=str(rank % 2), MESHCOLL_LOCAL_WORLD_SIZE="2",
                       MESHCOLL_MASTER_ADDR=master, MESHCOLL_MASTER_PORT=str(PORT),
                       MESHCOLL_TOKEN=token, MESHCOLL_HOST_ID=f"emulated-host-{ns}",
                       NETNS_INDEX=str(rank // 2), OMP_NUM_THREADS="1")
            env.pop("MESHCOLL_TRANSPORT", None)
            if rank // 2 == 1:
                env["MESHCOLL_SOCKET_IFNAME"] = veth  # the explicit way to pick the interface
            procs.append(subprocess.Popen(
                ["ip", "netns", "exec", ns, sys.executable, str(script)], env=env,
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
        deadline = time.monotonic() + RUN_TIMEOUT
        outputs = []
        for p in procs:
            try:
                outputs.append(p.communicate(timeout=max(1.0, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                outputs.append(("", f"did not finish within {RUN_TIMEOUT} s"))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(5)
    results = []
    for rank, (p, (out, err)) in enumerate(zip(procs, outputs)):
        lines = [ln for ln in out.splitlines() if ln.startswith("RESULT ")]
        assert p.returncode == 0 and lines, \
            f"rank {rank} failed (rc {p.returncode}):\n{err[-3000:]}"
        results.append(json.loads(lines[-1][len("RESULT "):]))

    for rank, r in enumerate(results):
        ns_addr = two_hosts[rank // 2][2]
        assert r["addr"] == ns_addr, (rank, r["addr"])  # peers listen on their namespace's address
        t = r["transports"]
        assert t["world"].startswith("tcp"), (rank, t)
        assert t["local"] == "shm", (rank, t)
        if rank in (1, 2):
            assert t["cross"].startswith("tcp"), (rank, t)
        for group, wrong in r["wrong"].items():
            assert not wrong, (rank, group, wrong)
    # Rank 0 hosts the store on the master address, not on every interface.
    store = [a for a in results[0]["listeners"] if a[1] == PORT]
    assert store == [[master, PORT]], results[0]["listeners"]
    assert not [a for a in results[0]["listeners"] if a[0] in ("0.0.0.0", "::")], results[0]
