"""Where rank, world size and the master address come from: every launcher's variables.

meshcoll's own (set by ``meshcoll-run``), torchrun's, Slurm's, Open MPI's and PMI's, and the
init method (``env://``, ``tcp://``, ``file://``). The MESHCOLL_* settings are
_settings.py's. Pure Python with no import of the C++ extension, so the launcher and the
unit tests can use it anywhere.

Every function takes ``environ=`` (a mapping) so tests pass plain dicts; it defaults to
``os.environ``. An empty value counts as unset, because ``export MESHCOLL_RANK=`` is how
shells and job scripts usually "clear" one.
"""

from __future__ import annotations

import operator
import os
import re
from dataclasses import dataclass
from typing import Dict, Mapping, Optional, Tuple

from ._settings import TIMEOUT, WHO as _WHO, parse_int as _parse_int, value_of as _get

# The names meshcoll-run sets and meshcoll reads.
RANK = "MESHCOLL_RANK"
WORLD_SIZE = "MESHCOLL_WORLD_SIZE"
LOCAL_RANK = "MESHCOLL_LOCAL_RANK"
LOCAL_WORLD_SIZE = "MESHCOLL_LOCAL_WORLD_SIZE"
NODE_RANK = "MESHCOLL_NODE_RANK"
MASTER_ADDR = "MESHCOLL_MASTER_ADDR"
MASTER_PORT = "MESHCOLL_MASTER_PORT"
TOKEN = "MESHCOLL_TOKEN"
INIT_METHOD = "MESHCOLL_INIT_METHOD"
# Set by meshcoll-run: a directory where each rank notes when it began to leave the job
# (Note [The first rank to fail] in run.py).
RUN_NOTES = "MESHCOLL_RUN_NOTES"

# torchrun's names for the master; the fallback after ours for every scheme.
_TORCH_MASTER_ADDR = "MASTER_ADDR"
_TORCH_MASTER_PORT = "MASTER_PORT"
# torchrun's agent hosts torch's own store on MASTER_PORT when it sets this to "True".
_TORCH_AGENT_STORE = "TORCHELASTIC_USE_AGENT_STORE"

# Slurm describes tasks per node as e.g. "2(x3),1": three nodes with 2, one with 1.
_SLURM_TASKS_PER_NODE = ("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE")
_SLURM_NODEID = "SLURM_NODEID"
_SLURM_NODELIST = ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST")
_SLURM_JOB_ID = "SLURM_JOB_ID"
_SLURM_STEP_ID = "SLURM_STEP_ID"


@dataclass(frozen=True)
class Rendezvous:
    """Who this process is and where rank 0's store listens.

    ``local_rank`` / ``local_world_size`` are None when the launcher did not
    say (we do not guess them from the global rank: a wrong guess would put
    two ranks on one GPU). ``master_port`` 0 means "pick a free port" and only
    occurs with ``world_size == 1``.
    """

    rank: int
    world_size: int
    local_rank: Optional[int]
    local_world_size: Optional[int]
    master_addr: str  # "" when no master is needed (the store is given or a file)
    master_port: int
    token: Optional[str]
    # "arguments", "meshcoll", "torchrun", "slurm", "openmpi", "pmi", or "default": no
    # launcher variables and no arguments, a world of one.
    source: str


@dataclass(frozen=True)
class _Scheme:
    source: str
    owner: str  # for messages: "Slurm's SLURM_PROCID/SLURM_NTASKS"
    rank: str
    world_size: str
    local_rank: Optional[str]
    local_world_size: Optional[str]


# Order matters. The MPI launchers come before Slurm because `mpirun` inside an
# sbatch allocation passes the batch step's SLURM_PROCID=0 on to every rank,
# while OMPI_* / PMI_* are set per process by the launcher right above us.
_SCHEMES = (
    _Scheme("meshcoll", "meshcoll's", RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE),
    _Scheme("torchrun", "torchrun's", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"),
    _Scheme("openmpi", "Open MPI's", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE",
            "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE"),
    # MPICH / Intel MPI (Hydra) put the node-local numbers in MPI_LOCAL*.
    _Scheme("pmi", "PMI's", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"),
    # Slurm has no single local-size variable; see _slurm_local_world_size.
    _Scheme("slurm", "Slurm's", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", None),
)


def _arg_int(value: object, name: str) -> int:
    # operator.index accepts int and numpy integers but not bool, float or str,
    # so rank=1.0 or rank="1" is reported instead of silently truncated.
    if isinstance(value, bool):
        raise ValueError(f"{_WHO}: {name}={value!r} is not an integer")
    try:
        return operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise ValueError(f"{_WHO}: {name}={value!r} is not an integer") from None


def _env_int(env: Mapping[str, str], name: Optional[str]) -> Optional[int]:
    if name is None:
        return None
    text = _get(env, name)
    return None if text is None else _parse_int(text, name)


def _find_scheme(env: Mapping[str, str]) -> Optional[_Scheme]:
    for scheme in _SCHEMES:
        if _get(env, scheme.rank) is not None or _get(env, scheme.world_size) is not None:
            return scheme
    return None


def _nothing_found(rank: object, world_size: object) -> ValueError:
    """Only one of rank= and world_size= was given, and no launcher says the other (with
    neither given, no launcher means a world of one)."""
    others = ", ".join(f"{s.owner} {s.rank}/{s.world_size}" for s in _SCHEMES[1:])
    if rank is None:
        what, fix = f"{RANK} is", "pass rank="
    else:
        what, fix = f"{WORLD_SIZE} is", "pass world_size="
    return ValueError(
        f"{_WHO}: {what} not set (nor {others}); start the job with meshcoll-run, "
        f"torchrun, srun or mpirun, or {fix}")


def _slurm_local_world_size(env: Mapping[str, str]) -> Optional[int]:
    """Tasks on this node, from "2(x3),1"-style lists indexed by SLURM_NODEID."""
    node = _env_int(env, _SLURM_NODEID)
    for name in _SLURM_TASKS_PER_NODE:
        text = _get(env, name)
        if text is None or node is None:
            continue
        counts = []
        for part in text.split(","):
            m = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
            if m is None:
                return None  # a format we do not know: say nothing rather than guess
            counts += [int(m.group(1))] * int(m.group(2) or 1)
        return counts[node] if 0 <= node < len(counts) else None
    return None


def rendezvous_from_env(
    rank: Optional[int] = None,
    world_size: Optional[int] = None,
    master_addr: Optional[str] = None,
    master_port: Optional[int] = None,
    environ: Optional[Mapping[str, str]] = None,
    need_master: bool = True,
) -> Rendezvous:
    """Work out this process's rank, world size and master address.

    Explicit arguments win. Otherwise rank and world size come from the first
    scheme that has either variable set: MESHCOLL_*, torchrun, Open MPI, PMI,
    Slurm; with none of them set and neither argument given, this process is a
    world of one (rank 0 of 1, source "default"). The master address and port
    come from the arguments, else MESHCOLL_MASTER_ADDR/PORT, else torchrun's
    MASTER_ADDR/PORT, for every
    scheme (srun and mpirun do not provide one). A single process
    (world_size 1) needs no master: it gets 127.0.0.1 and port 0. With
    ``need_master=False`` (a given store, a file store) no master is looked up:
    master_addr is "" and master_port 0.

    Raises ValueError naming the missing or malformed variable and the fix.
    """
    env = os.environ if environ is None else environ

    scheme = None
    source = "arguments"
    if rank is None or world_size is None:
        scheme = _find_scheme(env)
        if scheme is not None:
            source = scheme.source
        elif rank is None and world_size is None:
            # No launcher and no arguments: ``python script.py`` is a world of one, as with
            # mpi4py and Horovod (init logs it once). Half of the pair given is still an error.
            rank, world_size, source = 0, 1, "default"
        else:
            raise _nothing_found(rank, world_size)

    # Resolve rank and world size, remembering where each came from for messages.
    values = {}
    for field, arg in (("rank", rank), ("world_size", world_size)):
        if arg is not None:
            values[field] = (_arg_int(arg, field), f"{field}=")
            continue
        assert scheme is not None
        name = getattr(scheme, field)
        value = _env_int(env, name)
        if value is None:
            other = scheme.world_size if field == "rank" else scheme.rank
            raise ValueError(
                f"{_WHO}: {name} is not set but {other} is; {scheme.owner} variables "
                f"come as a pair: set both, or pass {field}=")
        values[field] = (value, name)
    (rank_v, rank_from), (world_v, world_from) = values["rank"], values["world_size"]

    if world_v < 1:
        raise ValueError(f"{_WHO}: world size {world_v} (from {world_from}) must be >= 1")
    if not 0 <= rank_v < world_v:
        raise ValueError(
            f"{_WHO}: rank {rank_v} (from {rank_from}) is out of range for world size "
            f"{world_v} (from {world_from}); ranks are 0..{world_v - 1}")

    local_rank, local_world = _local_ranks(env, scheme, world_v)

    if source == "default":
        came_from = "no launcher variables are set: a world of one"
    elif scheme is None:
        came_from = "rank and world size were passed as arguments"
    elif rank is None and world_size is None:
        came_from = f"rank and world size came from {scheme.owner} {rank_from}/{world_from}"
    else:
        came_from = f"rank came from {rank_from}, world size from {world_from}"
    slurm = scheme is not None and scheme.source == "slurm"
    addr, port = (_master(env, master_addr, master_port, world_v, came_from, slurm)
                  if need_master else ("", 0))

    return Rendezvous(
        rank=rank_v, world_size=world_v, local_rank=local_rank,
        local_world_size=local_world, master_addr=addr, master_port=port,
        token=_get(env, TOKEN), source=source)


def _local_ranks(env: Mapping[str, str], scheme: Optional[_Scheme],
                 world: int) -> Tuple[Optional[int], Optional[int]]:
    if world == 1:
        return 0, 1  # the only case where the answer is certain without being told
    if scheme is None:
        return None, None
    local_rank = _env_int(env, scheme.local_rank)
    if scheme.source == "slurm":
        local_world = _slurm_local_world_size(env)
    else:
        local_world = _env_int(env, scheme.local_world_size)
    if local_world is not None and not 1 <= local_world <= world:
        raise ValueError(
            f"{_WHO}: local world size {local_world} (from {scheme.owner} variables) "
            f"must be in 1..{world}")
    if local_rank is not None:
        upper = local_world if local_world is not None else world
        if not 0 <= local_rank < upper:
            raise ValueError(
                f"{_WHO}: local rank {local_rank} (from {scheme.local_rank}) must be "
                f"in 0..{upper - 1}")
    return local_rank, local_world


def _first_slurm_host(nodelist: str) -> Optional[str]:
    """The first host of a Slurm hostlist ("gpu[003-005,9],cpu1" -> "gpu003"), or None for a
    form this does not read (several bracket groups in one name)."""
    m = re.match(r"([^,\[\]]+)(?:\[([^\]]+)\]([^,\[\]]*))?(?:,|$)", nodelist.strip())
    if not m:
        return None
    prefix, ranges, suffix = m.groups()
    if ranges is None:
        return prefix
    return prefix + re.split(r"[,-]", ranges)[0] + suffix


def _slurm_master(env: Mapping[str, str]) -> Tuple[Optional[str], Optional[int]]:
    """Under srun with no master given: the step's first node, and a port every rank derives
    from the job and step ids (20000 + (job + step) mod 20000), as (addr, port, where from)."""
    addr = port = None
    for name in _SLURM_NODELIST:
        text = _get(env, name)
        if text is not None:
            addr = _first_slurm_host(text)
            break
    job = _get(env, _SLURM_JOB_ID)
    if job is not None and job.isdigit():
        step = _get(env, _SLURM_STEP_ID) or "0"
        port = 20000 + (int(job) + (int(step) if step.isdigit() else 0)) % 20000
    return addr, port


def master_from_env(environ: Optional[Mapping[str, str]] = None) -> bool:
    """Whether the environment names a master address (MESHCOLL_MASTER_ADDR or MASTER_ADDR):
    init(backend="mpi") then rendezvouses there rather than through MPI."""
    env = os.environ if environ is None else environ
    return bool(_get(env, MASTER_ADDR) or _get(env, _TORCH_MASTER_ADDR))


def _master(env: Mapping[str, str], addr_arg: Optional[str], port_arg: Optional[int],
            world: int, came_from: str, slurm: bool = False) -> Tuple[str, int]:
    if addr_arg is not None:
        if not str(addr_arg).strip():
            raise ValueError(f"{_WHO}: master_addr is empty")
        addr: Optional[str] = str(addr_arg).strip()
    else:
        addr = _get(env, MASTER_ADDR) or _get(env, _TORCH_MASTER_ADDR)

    port_from = "master_port="
    if port_arg is not None:
        port: Optional[int] = _arg_int(port_arg, "master_port")
    else:
        port = None
        for name in (MASTER_PORT, _TORCH_MASTER_PORT):
            text = _get(env, name)
            if text is not None:
                port, port_from = _parse_int(text, name), name
                break
        if port_from == _TORCH_MASTER_PORT and _get(env, _TORCH_AGENT_STORE) == "True" \
                and port is not None and 0 < port < 65535:
            # torchrun's store already listens there: take the next port (rank 0 of torchrun
            # runs on the master node, so every rank agrees on it).
            port, port_from = port + 1, f"{_TORCH_MASTER_PORT} + 1 (torchrun's store holds {port})"

    if slurm and world > 1 and (addr is None or port is None):
        slurm_addr, slurm_port = _slurm_master(env)
        addr = addr if addr is not None else slurm_addr
        if port is None and slurm_port is not None:
            port, port_from = slurm_port, _SLURM_JOB_ID

    if world == 1:
        # One process hosts and joins its own store: any local address and a
        # free port (0) will do.
        addr = addr or "127.0.0.1"
        port = 0 if port is None else port
    missing = [n for n, v in ((MASTER_ADDR, addr), (MASTER_PORT, port)) if v is None]
    if missing:
        args = " and ".join(n.lower().replace("meshcoll_", "") + "=" for n in missing)
        names = " and ".join(missing)
        verb = "is" if len(missing) == 1 else "are"
        raise ValueError(
            f"{_WHO}: {names} {verb} not set ({came_from}); pass {args} or set {names}")
    assert addr is not None and port is not None

    if port == 0 and world > 1:
        raise ValueError(
            f"{_WHO}: master port 0 (from {port_from}) means 'pick a free port', which "
            f"only works for world size 1: the other {world - 1} ranks could not learn "
            f"it; use a fixed port")
    if not 0 <= port <= 65535:
        raise ValueError(f"{_WHO}: master port {port} (from {port_from}) is out of "
                         f"range; ports are 1..65535")
    return addr, port


@dataclass(frozen=True)
class InitMethod:
    """Where the store lives, as torch spells it: ``env://`` (the variables above),
    ``tcp://host:port`` (rank 0 hosts a TCP store there) or ``file:///path`` (a store in a
    file every rank can open, e.g. on a shared filesystem)."""

    kind: str  # "env", "tcp" or "file"
    host: Optional[str] = None
    port: Optional[int] = None
    path: Optional[str] = None


def parse_init_method(text: str, source: str = "init_method=") -> InitMethod:
    """Parses an init method; ValueError names ``source`` and the accepted forms."""
    from urllib.parse import urlsplit
    forms = "use env://, tcp://HOST:PORT or file:///ABSOLUTE/PATH"
    value = str(text).strip()
    try:
        url = urlsplit(value)
        port = url.port
    except ValueError as e:
        raise ValueError(f"{_WHO}: {source}{value!r} is malformed ({e}); {forms}") from None
    if url.scheme == "env" and not (url.netloc or url.path):
        return InitMethod("env")
    if url.scheme == "tcp" and url.hostname and port is not None and url.path in ("", "/"):
        return InitMethod("tcp", host=url.hostname, port=port)
    if url.scheme == "file" and url.netloc in ("", "localhost") and url.path.startswith("/") \
            and not url.path.endswith("/"):
        return InitMethod("file", path=url.path)
    raise ValueError(f"{_WHO}: {source}{value!r} is not an init method meshcoll knows; {forms}")


def init_method_from_env(environ: Optional[Mapping[str, str]] = None) -> Optional[InitMethod]:
    """``MESHCOLL_INIT_METHOD``, parsed, or None when unset."""
    env = os.environ if environ is None else environ
    text = _get(env, INIT_METHOD)
    return None if text is None else parse_init_method(text, f"{INIT_METHOD}=")

def launcher_env(*, rank: int, world_size: int, local_rank: int, local_world_size: int,
                 node_rank: int, master_addr: str, master_port: int, token: str,
                 timeout: Optional[float] = None) -> Dict[str, str]:
    """The variables meshcoll-run sets for one child; read back by rendezvous_from_env."""
    env = {
        RANK: str(rank),
        WORLD_SIZE: str(world_size),
        LOCAL_RANK: str(local_rank),
        LOCAL_WORLD_SIZE: str(local_world_size),
        NODE_RANK: str(node_rank),
        MASTER_ADDR: master_addr,
        MASTER_PORT: str(master_port),
        TOKEN: token,
    }
    if timeout is not None:
        env[TIMEOUT] = repr(float(timeout))
    return env
