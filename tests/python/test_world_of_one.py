"""``python script.py`` with ``meshcoll.init()`` and no launcher: a world of one (issue 18
item 5), as mpi4py and Horovod give. Run as a real script in a clean environment: the
collectives work (values checked against numpy), and the fact is logged once, at info
level, however often the script calls init."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.timeout(60)

# Every launcher's variables (meshcoll._rendezvous._SCHEMES), and the masters.
LAUNCHER_PREFIXES = ("MESHCOLL_", "MASTER_", "RANK", "WORLD_SIZE", "LOCAL_RANK",
                     "LOCAL_WORLD_SIZE", "OMPI_", "PMI_", "MPI_LOCAL", "SLURM_",
                     "TORCHELASTIC_")

SCRIPT = textwrap.dedent("""
    import json, logging, sys
    import numpy as np
    import meshcoll
    if sys.argv[1] == "info":
        logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    results = []
    for round in range(2):  # init, destroy, init again: logged once
        pg = meshcoll.init()
        x = np.random.default_rng([5, round]).standard_normal(257)
        want = x.copy()
        meshcoll.all_reduce(x)
        parts = meshcoll.all_gather(x.astype(np.float32))
        results.append({"rank": pg.rank, "size": pg.size, "get": [meshcoll.get_rank(),
                        meshcoll.get_world_size()], "sum_ok": bool((x == want).all()),
                        "gather_shape": list(parts.shape),
                        "gather_ok": bool((parts[0] == want.astype(np.float32)).all())})
        meshcoll.destroy()
    print(json.dumps(results))
""")


def _run(tmp_path, level):
    env = {k: v for k, v in os.environ.items() if not k.startswith(LAUNCHER_PREFIXES)}
    path = tmp_path / "script.py"
    path.write_text(SCRIPT)
    return subprocess.run([sys.executable, str(path), level], env=env, capture_output=True,
                          text=True, timeout=50)


def test_plain_script_is_a_world_of_one_logged_once(tmp_path):
    r = _run(tmp_path, "info")
    assert r.returncode == 0, r.stderr
    for res in json.loads(r.stdout):
        assert res == {"rank": 0, "size": 1, "get": [0, 1], "sum_ok": True,
                       "gather_shape": [1, 257], "gather_ok": True}
    logged = [line for line in r.stderr.splitlines() if "world of one" in line]
    assert len(logged) == 1, r.stderr
    assert logged[0].startswith("INFO meshcoll: meshcoll.init: no launcher variables are set")
    assert "meshcoll-run -n N" in logged[0]
    # Nothing else was said: no token warning (a job of one makes its own token).
    assert r.stderr.strip() == logged[0], r.stderr


def test_world_of_one_is_quiet_at_the_default_log_level(tmp_path):
    r = _run(tmp_path, "default")
    assert r.returncode == 0, r.stderr
    assert [res["size"] for res in json.loads(r.stdout)] == [1, 1]
    assert r.stderr == ""
