"""meshcoll.init(init_method=...): file:///path (a FileStore every rank opens, no master
address), tcp://host:port and MESHCOLL_INIT_METHOD, and plain init() under torchrun, with
real processes; the world then all-reduces random data checked against numpy. Bad
combinations fail before any rendezvous."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from conftest import free_port

pytestmark = pytest.mark.timeout(90)

RANK_SCRIPT = textwrap.dedent("""
    import json, sys
    import numpy as np
    import meshcoll
    rank, world, method, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    kw = {} if method == "-" else {"init_method": method}
    pg = meshcoll.init(rank=rank, world_size=world, timeout=30, **kw)
    x = np.random.default_rng([7, rank]).standard_normal(1000)
    pg.all_reduce(x)
    sub = pg.new_group([0, world - 1])
    y = np.full(3, float(rank + 1))
    if sub.is_member:
        sub.all_reduce(y)
    meshcoll.destroy()
    json.dump({"x": x.tolist(), "y": y.tolist()}, open(out, "w"))
""")


def _clean_env():
    return {k: v for k, v in os.environ.items() if not k.startswith(("MESHCOLL_", "MASTER_"))}


def _run(tmp_path, world, method, env=None):
    script = tmp_path / "rank.py"
    script.write_text(RANK_SCRIPT)
    procs = [subprocess.Popen([sys.executable, str(script), str(r), str(world), method,
                               str(tmp_path / f"out{r}.json")],
                              env={**_clean_env(), **(env or {})}, stderr=subprocess.PIPE, text=True)
             for r in range(world)]
    errs = [p.communicate(timeout=60)[1] for p in procs]
    assert all(p.returncode == 0 for p in procs), "\n".join(errs)
    _check(tmp_path, world)


def _check(tmp_path, world):
    got = [json.load(open(tmp_path / f"out{r}.json")) for r in range(world)]
    want = sum(np.random.default_rng([7, r]).standard_normal(1000) for r in range(world))
    for r, g in enumerate(got):
        np.testing.assert_allclose(g["x"], want, rtol=1e-12, atol=1e-12)
        sub_sum = 1.0 + world  # ranks 0 and world-1 hold 1 and world
        assert g["y"] == ([sub_sum] * 3 if r in (0, world - 1) else [float(r + 1)] * 3)


def test_file_init_method(tmp_path):
    path = tmp_path / "rendezvous" / "store"
    path.parent.mkdir()
    _run(tmp_path, 3, f"file://{path}")
    assert not path.exists(), "the last rank to close the store removes its file"


def test_file_init_method_from_env(tmp_path):
    _run(tmp_path, 2, "-", env={"MESHCOLL_INIT_METHOD": f"file://{tmp_path}/store"})


def test_tcp_init_method(tmp_path):
    _run(tmp_path, 2, f"tcp://127.0.0.1:{free_port()}")


def _port_pair() -> int:
    """A port p with p and p + 1 free, below the ephemeral range (as torchrun's default
    29500 is), so no client socket of the run itself takes p + 1 meanwhile."""
    import random
    import socket
    for _ in range(200):
        p = random.randrange(20000, 30000)
        try:
            with socket.socket() as a, socket.socket() as b:
                a.bind(("127.0.0.1", p))
                b.bind(("127.0.0.1", p + 1))
            return p
        except OSError:
            continue
    pytest.skip("no two adjacent free ports in 20000-30000")


def test_torchrun_works_unchanged(tmp_path):
    # torchrun's agent store holds MASTER_PORT; meshcoll's takes the next port by itself.
    pytest.importorskip("torch")
    script = tmp_path / "rank.py"
    script.write_text(RANK_SCRIPT.replace("rank, world, method, out = int(sys.argv[1]), "
                                          "int(sys.argv[2]), sys.argv[3], sys.argv[4]",
                                          "import os; rank, world = int(os.environ['RANK']), "
                                          "int(os.environ['WORLD_SIZE']); method = '-'; "
                                          "out = sys.argv[1] + f'/out{rank}.json'"))
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                        "--master-port", str(_port_pair()), str(script), str(tmp_path)],
                       env=_clean_env(), capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr[-3000:]
    _check(tmp_path, 2)


def test_bad_combinations_fail_before_rendezvous(tmp_path):
    import meshcoll
    with pytest.raises(ValueError, match="not both"):
        meshcoll.init(rank=0, world_size=2, init_method=f"file://{tmp_path}/s",
                      store=meshcoll.TCPStore("127.0.0.1", 0, is_server=True))
    with pytest.raises(ValueError, match="contradicts"):
        meshcoll.init(rank=0, world_size=2, init_method="tcp://127.0.0.1:29511",
                      master_port=29512)
    with pytest.raises(ValueError, match="file:///ABSOLUTE/PATH"):
        meshcoll.init(rank=0, world_size=2, init_method="file://relative/path")
    with pytest.raises(Exception, match=str(tmp_path / "missing")):
        meshcoll.init(rank=0, world_size=2, timeout=5,
                      init_method=f"file://{tmp_path}/missing/dir/store")


# Issue 34 item 11: a bad setting on every rank, ranks started by a launcher other than
# meshcoll-run (torchrun's variables). It was found after the store: rank 0 failed at once
# and closed its store, and the others waited their whole init timeout (300 s by default)
# for it, then blamed the store. Each rank must now fail at once, naming the variable.
@pytest.mark.parametrize("name,value", [
    ("MESHCOLL_TRANSPORT", "udp"),
    ("MESHCOLL_SHM_BYTES", "1e20"),
    ("MESHCOLL_SHM_BYTES", str(10 ** 20)),  # was pybind11's list of constructor signatures
    ("MESHCOLL_HIERARCHY", "2"),
    ("MESHCOLL_CHECK", "sometimes"),
    ("MESHCOLL_SOCKET_IFNAME", "mc-nosuch0"),
    ("MESHCOLL_ALGO", "fastest"),
])
def test_a_bad_setting_fails_every_rank_at_once_naming_it(tmp_path, name, value):
    import time
    world, init_timeout, within = 3, 30, 10.0
    script = tmp_path / "rank.py"
    script.write_text("import meshcoll\nmeshcoll.init()\n")
    env = {**_clean_env(), "WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(free_port()), "MESHCOLL_TIMEOUT": str(init_timeout), name: value}
    start = time.monotonic()
    procs = [subprocess.Popen([sys.executable, str(script)], env={**env, "RANK": str(r)},
                              stderr=subprocess.PIPE, text=True) for r in range(world)]
    errs = []
    try:
        for r, p in enumerate(procs):
            try:
                errs.append(p.communicate(timeout=max(0.1, start + within - time.monotonic()))[1])
            except subprocess.TimeoutExpired:
                pytest.fail(f"rank {r} still running {within:g} s after the start (init "
                            f"timeout {init_timeout} s): it waited for the store")
    finally:
        for p in procs:
            p.kill()
            p.wait()
    for r, (p, err) in enumerate(zip(procs, errs)):
        last = err.strip().splitlines()[-1]
        assert p.returncode != 0, err
        assert last.startswith(f"ValueError: meshcoll.init on rank {r} of {world}: "
                               f"{name}={value!r}"), err
