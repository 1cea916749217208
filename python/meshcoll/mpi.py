"""MPI backend: the ProcessGroup collectives on host arrays over the site's MPI, for jobs started
by ``mpirun`` or ``srun`` (one ProcessGroup class for every backend; this module builds and
loads MPI and makes the C++ MpiBackend).

    # mpirun -n 4 python train.py
    pg = meshcoll.init(backend="mpi")     # rank and size from MPI itself
    meshcoll.all_reduce(x)                # nonblocking MPI, under the group's deadline

MPI is not linked into the wheel (Open MPI, MPICH, Intel MPI and Cray MPICH differ in ABI): a
small C shim (csrc/mpi/shim.c, carried in the wheel as text) is compiled on first use with the
site's ``mpicc`` (``$MPICC`` overrides) and cached under ``$XDG_CACHE_HOME/meshcoll/mpi`` (else
``~/.cache/meshcoll/mpi``; ``MESHCOLL_MPI_CACHE`` overrides), keyed by the shim's source and by
what ``mpicc -show`` says it runs (Note [Loading MPI] in csrc/mpi/mpi_api.h).
``mpi_available()`` says whether that works here and, if not, why.

The store (the agreement check's side channel and group setup) needs no MASTER_ADDR: rank 0
hosts it on a free port and MPI broadcasts where, with a job token (MESHCOLL_TOKEN, or a new
one). Failures: Note [MPI failure model] in csrc/mpi/mpi_backend.h (README, MPI).
"""

from __future__ import annotations

import atexit
import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
from typing import List, Optional, Tuple

from . import _C

__all__ = ["mpi_available"]

MPICC = "MPICC"
CACHE = "MESHCOLL_MPI_CACHE"


class MpiUnavailable(RuntimeError):
    """MPI cannot be built or loaded here; the message says what is missing."""


class _State:
    path: Optional[str] = None   # the compiled shim
    world: Optional[Tuple[int, int]] = None  # (rank, size) once MPI is up


def _cache_dir() -> str:
    given = os.environ.get(CACHE)
    if given:
        return given
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "meshcoll", "mpi")


def _wrapper_config(mpicc: str) -> str:
    """What the wrapper runs (compiler, include and library paths): Open MPI answers
    --showme, MPICH, Intel MPI and Cray -show."""
    for flag in ("--showme", "-show"):
        try:
            r = subprocess.run([mpicc, flag], capture_output=True, text=True, timeout=60)
        except OSError:
            break
        if r.returncode == 0 and r.stdout.strip():
            return r.stdout.strip()
    return ""


def _build() -> str:
    """The compiled shim's path, building it on first use; MpiUnavailable saying why not."""
    if _State.path is not None:
        return _State.path
    given = os.environ.get(MPICC)
    mpicc = shutil.which(given or "mpicc")
    if mpicc is None:
        raise MpiUnavailable(
            f"${MPICC}={given!r} is not an executable" if given else
            "no mpicc on PATH: load your MPI (e.g. `module load openmpi`, or "
            "`apt-get install openmpi-bin libopenmpi-dev`), or set $MPICC to its C wrapper")
    source, abi = _C.mpi_shim_source()
    config = _wrapper_config(mpicc)
    key = hashlib.sha256(f"{abi}\0{source}\0{mpicc}\0{config}".encode()).hexdigest()[:16]
    folder = os.path.join(_cache_dir(), key)
    path = os.path.join(folder, "libmeshcoll_mpi.so")
    if not os.path.exists(path):
        try:
            os.makedirs(folder, exist_ok=True)
        except OSError as e:
            raise MpiUnavailable(f"cannot make the MPI shim's cache folder {folder} ({e}); set "
                                 f"${CACHE} to a writable folder") from None
        # Ranks of a job on one host may build at once: each in its own temporary name, then
        # renamed into place (atomic; the last one wins with the same bytes).
        fd, tmp = tempfile.mkstemp(dir=folder, suffix=".so")
        os.close(fd)
        src = tmp[:-3] + ".c"
        with open(src, "w") as f:
            f.write(source)
        try:
            r = subprocess.run([mpicc, "-O2", "-shared", "-fPIC", "-o", tmp, src],
                               capture_output=True, text=True, timeout=300)
            if r.returncode != 0:
                tail = (r.stderr or r.stdout).strip()[-1500:]
                raise MpiUnavailable(f"compiling the MPI shim with {mpicc} failed "
                                     f"(exit {r.returncode}):\n{tail}")
            os.replace(tmp, path)
        finally:
            for leftover in (tmp, src):
                if os.path.exists(leftover):
                    os.unlink(leftover)
    _State.path = path
    return path


def mpi_available() -> Tuple[bool, str]:
    """``(True, "Open MPI v4.1.4, ... (/path/libmeshcoll_mpi.so)")`` when the MPI shim builds
    with the site's mpicc and loads; otherwise ``(False, what is missing)``: no mpicc, the
    compile's error, or why the library would not load. MPI itself is not initialized."""
    try:
        path = _build()
    except MpiUnavailable as e:
        return False, str(e)
    try:
        lib = ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
    except OSError as e:
        return False, f"the MPI shim {path} would not load: {e}"
    buf = ctypes.create_string_buffer(512)
    lib.mc_library_version(buf, len(buf))
    version = buf.value.decode(errors="replace").strip().splitlines()
    return True, f"{version[0] if version else 'MPI'} ({path})"


def load() -> Tuple[int, int]:
    """Builds and loads MPI, and initializes it unless the process already did (mpi4py):
    (rank, size) in MPI_COMM_WORLD. MpiUnavailable saying why not."""
    if _State.world is None:
        rank, size, _, _ = _C.mpi_load(_build())
        _State.world = (int(rank), int(size))
        # MPI_Finalize (or MPI_Abort, Note [MPI failure model]) before the interpreter ends.
        atexit.register(_C.mpi_finalize)
    return _State.world


def bootstrap_store(rank: int, host: str, timeout: float, token: Optional[str],
                    generation: int) -> Tuple[_C.TCPStore, str]:
    """The job's store without a master address: rank 0 hosts it on a free port at ``host``
    and MPI broadcasts where, and the job token (``token``, else a new one). Collective over
    MPI_COMM_WORLD. Returns (store, token)."""
    import secrets
    server: Optional[_C.TCPStore] = None
    if rank == 0:
        token = token or secrets.token_hex(16)
        server = _C.TCPStore(host, 0, is_server=True, timeout=timeout, token=token,
                             generation=generation)
        where = f"{host}\t{server.port}\t{token}"
    else:
        where = ""
    host, port, token = bytes(_C.mpi_bcast_bytes(where.encode(), 0)).decode().split("\t")
    if server is not None:
        return server, token
    return _C.TCPStore(host, int(port), is_server=False, timeout=timeout, token=token,
                       generation=generation), token


# Note [MPI groups of other parents]
# new_group(backend="mpi") on a CPU or NCCL group splits MPI's world (MPI_Comm_split of a
# duplicate of MPI_COMM_WORLD, collective over every MPI rank), so that group must be MPI's
# world: its global ranks are MPI's ranks, in order. MPI must be up, or this process started
# by an MPI launcher (mpirun, srun) that lets it start; started anywhere else, MPI would make
# a world of one rank, which no peer shares. MPI_Init waits, with no deadline, for every rank
# of the job: so MPI starts only once every rank of the parent agreed on the new group under
# the setup's deadline (a rank that asked for another backend is a MismatchError there on an
# MPI or NCCL parent; on a CPU parent, whose new_group compares nothing across non-members,
# a TimeoutError naming the ranks at another call, Note [Calls out of step]).
LAUNCHER_VARS = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK")


def check_startable(me: int, call: str) -> None:
    """ValueError unless MPI is up or can start here (Note [MPI groups of other parents]);
    this process being global rank ``me``."""
    if _State.world is None and not any(os.environ.get(v) for v in LAUNCHER_VARS):
        raise ValueError(f"{call} on global rank {me}: MPI is not initialized in this process "
                         f"and it was not started by an MPI launcher (none of "
                         f"{', '.join(LAUNCHER_VARS)} is set): start the job with mpirun or "
                         f"srun (meshcoll.init(backend='mpi') makes an MPI world), or pick "
                         f"backend='cpu'")


def require_world(ranks: List[int], me: int, call: str) -> None:
    """Starts MPI for an MPI group of a CPU or NCCL group of global ``ranks``, which must be
    MPI's world; ValueError saying what is missing (Note [MPI groups of other parents])."""
    try:
        rank, size = load()
    except MpiUnavailable as e:
        raise ValueError(f"{call} on global rank {me}: MPI is unavailable: {e}") from None
    if ranks != list(range(size)) or rank != me:
        raise ValueError(f"{call} on global rank {me}: an MPI group made from a group of "
                         f"another backend splits MPI's world, so that group must be MPI's "
                         f"world (global ranks 0..{size - 1} being MPI ranks 0..{size - 1}); "
                         f"it has global ranks {ranks} and this is MPI rank {rank}: call it "
                         f"on the world group")


def split_world(timeout: float, color: int, key: int) -> Optional[_C.MpiBackend]:
    """MPI_Comm_split of MPI's world (Note [MPI groups of other parents]): collective over
    every MPI rank; a negative color joins none (None)."""
    world = _C.MpiBackend.world(timeout)
    try:
        return world.split(color, key, timeout)
    finally:
        world.shutdown()


def make_backend(timeout: float, parent: Optional[_C.MpiBackend] = None,
                 color: int = 0, key: int = 0) -> Optional[_C.MpiBackend]:
    """The world's backend, or (``parent`` given) MPI_Comm_split of the parent: collective
    over every rank of the parent; a negative color joins none (None)."""
    if parent is None:
        return _C.MpiBackend.world(timeout)
    return parent.split(color, key, timeout)
