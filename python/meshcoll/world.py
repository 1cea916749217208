"""The job's world: ``init`` (rendezvous from any launcher's environment, the world group),
``destroy``, and the one piece of module state every collective library has, the default
group. Groups themselves are in process_group.py, made by backends.py."""

from __future__ import annotations

import hashlib
import logging
import os
import re
import secrets
import warnings
from typing import Any, Literal, Optional, Sequence, Tuple, Union

from . import _C, _rendezvous, _settings, mpi, nccl, run
from ._types import BackendName
from .backends import make_group
from .process_group import NonMemberGroup, ProcessGroup


class _Default:
    """The process's world group and store: the one piece of module state, as in every
    collective library (``meshcoll.init`` sets it, ``meshcoll.destroy`` clears it)."""

    world: Optional[ProcessGroup] = None
    store: Any = None  # a meshcoll store (TCPStore, FileStore or the caller's)
    warned_no_token = False
    logged_world_of_one = False
    owns_store = False  # init made the TCP store (rather than being given one)
    stores_made = 0     # TCP stores init made: its generation (Note [Generations], tcp_store.h)


NO_TOKEN_WARNING = (
    "meshcoll.init: no job token (MESHCOLL_TOKEN is not set): the job's TCP store and "
    "listeners accept any process that can reach their ports, which can then read and write "
    "the job's rendezvous keys. Set MESHCOLL_TOKEN to the same secret on every rank, "
    "e.g. export MESHCOLL_TOKEN=$(python -c 'import secrets; print(secrets.token_hex(16))') "
    "before torchrun, srun or mpirun -x MESHCOLL_TOKEN, or start the job with meshcoll-run, "
    "which makes one.")


WORLD_OF_ONE = (
    "meshcoll.init: no launcher variables are set (meshcoll-run, torchrun, Slurm, Open MPI), "
    "so this process is a world of one (rank 0 of 1); start it with meshcoll-run -n N (or "
    "another launcher) for more ranks")


def init(backend: Optional[Union[BackendName, Literal["auto"]]] = None, *,
         rank: Optional[int] = None, world_size: Optional[int] = None,
         master_addr: Optional[str] = None, master_port: Optional[int] = None,
         timeout: Optional[float] = None, device: Any = None,
         store: Optional[_C.Store] = None, init_method: Optional[str] = None) -> ProcessGroup:
    """Join the job: rendezvous through rank 0's TCP store, connect to every rank, return
    the world group. With no arguments it reads meshcoll-run's, torchrun's, Slurm's or
    Open MPI's environment variables; when none is set (``python script.py``) the process
    is a world of one, rank 0 of 1 (logged once, at info level, on the "meshcoll" logger).
    ``backend``: "cpu" (the default), "nccl" (CUDA
    arrays; ``device`` defaults to the launcher's local rank), "mpi" (host arrays over the
    site's MPI, under mpirun or srun: rank and size come from MPI, and with no master
    address MPI also tells the ranks where rank 0's store is; meshcoll.mpi), or "auto" (nccl
    when every rank has a GPU and NCCL loads; else, under mpirun or srun, mpi when MPI loads
    on every rank and the job spans hosts, where the site's MPI reaches the network, cpu on
    one host, where shared memory is faster; a RuntimeError naming the ranks when MPI loads
    on some only; else cpu). ``store``: an existing store
    (``meshcoll.TCPStore``, client or server, or ``meshcoll.FileStore``) to rendezvous
    through instead of rank 0 hosting one; ``rank`` and ``world_size`` then come from the
    arguments or the environment as usual. ``init_method`` (else ``MESHCOLL_INIT_METHOD``),
    as torch spells it: ``"env://"`` (the default), ``"tcp://host:port"`` (the master
    address) or ``"file:///path"``: a ``FileStore`` at that path, for jobs with a shared
    filesystem and no known master address (use a path no earlier job left behind).
    Every store and peer connection presents the job token (``MESHCOLL_TOKEN``; meshcoll-run
    sets one, a job of one process makes its own): without one, rank 0 warns once that the
    job accepts any process that can reach its ports (README, Security)."""
    if _Default.world is not None:
        raise RuntimeError("meshcoll.init was already called in this process; call "
                           "meshcoll.destroy() first to re-initialise")
    if backend not in (None, "auto", "cpu", "nccl", "mpi"):
        raise ValueError(f"meshcoll.init: unknown backend {backend!r}; use 'cpu', 'nccl', 'mpi' "
                         f"or 'auto'")
    # Under meshcoll-run: tell it when this rank begins to leave, so that it names the rank
    # that failed first, not a peer that failed because of it (Note [The first rank to fail]).
    run.watch_exit()
    method = (_rendezvous.parse_init_method(init_method) if init_method is not None
              else _rendezvous.init_method_from_env())
    if method is not None and method.kind != "env" and store is not None:
        raise ValueError("meshcoll.init: pass store= or an init method naming a store, not both")
    if method is not None and method.kind == "tcp":
        for given, name, value in ((master_addr, "master_addr", method.host),
                                   (master_port, "master_port", method.port)):
            if given is not None and given != value:
                raise ValueError(f"meshcoll.init: {name}={given!r} contradicts the init "
                                 f"method's {value!r}; give one of them")
        master_addr, master_port = method.host, method.port
    file_path = method.path if method is not None and method.kind == "file" else None
    # MPI's ranks are the job's: MPI itself says which this process is (and, with no master
    # address, where the store is: mpi.bootstrap_store).
    needs_mpi_store = store is None and file_path is None and master_addr is None and \
        not _rendezvous.master_from_env()
    mpi_why = _mpi_why_not() if backend == "auto" else None
    if backend == "auto" and mpi_why and needs_mpi_store:  # Note [MPI on some ranks only]
        raise RuntimeError(
            f"meshcoll.init(backend='auto') on {_launcher_rank()}: MPI does not load here "
            f"({mpi_why}), and with no master address the job's store comes through MPI: "
            f"the ranks where MPI loads wait in MPI's start until this process fails (mpirun "
            f"or srun then end the job). Fix MPI here, or set MESHCOLL_MASTER_ADDR and "
            f"MESHCOLL_MASTER_PORT (the ranks then agree on a backend), or pick backend='cpu'")
    via_mpi = needs_mpi_store and (backend == "mpi" or mpi_why == "")
    if backend == "mpi" or via_mpi:
        rank, world_size = _mpi_world(rank, world_size)
    # A given store or a file needs no master address: the store is already where it is.
    rv = _rendezvous.rendezvous_from_env(rank=rank, world_size=world_size, master_addr=master_addr,
                                  master_port=master_port,
                                  need_master=store is None and file_path is None and not via_mpi)
    if rv.source == "default" and not _Default.logged_world_of_one:
        _Default.logged_world_of_one = True
        logging.getLogger("meshcoll").info(WORLD_OF_ONE)
    timeout = (_C.check_timeout(timeout, "meshcoll.init") if timeout is not None
               else _settings.timeout_from_env(_C.DEFAULT_TIMEOUT_S))
    # Every setting is read and checked here, before the store is contacted. A bad value is
    # usually set on every rank alike; found only after rank 0's store was up, it would fail
    # rank 0, which closes its store, and leave the other ranks waiting their whole timeout
    # for a store that is gone, blaming the store. Found here, it fails each rank at once,
    # naming the variable.
    options, ifname_host = _group_settings(rv)
    # A job of one process has no one to share a token with: it makes its own.
    token = rv.token or (secrets.token_hex(16) if rv.world_size == 1 else "")
    if not token and rv.rank == 0 and not _Default.warned_no_token and not via_mpi:
        # Rank 0 hosts the store: one warning for the job, once per process.
        _Default.warned_no_token = True
        warnings.warn(NO_TOKEN_WARNING, UserWarning, stacklevel=2)
    owned: Optional[_C.TCPStore] = None  # the store init makes, and closes on failure
    # Every rank counts the stores its inits made alike, so a rank that comes back from
    # destroy() early never reads the world before's keys (Note [Generations] in
    # tcp_store.h): a TCP store of another generation does not answer it, and in a shared
    # file, which outlives a generation while any rank holds it, its keys live apart.
    generation = _Default.stores_made
    if file_path is not None:
        _Default.stores_made += 1
        store = _C.FileStore(file_path, timeout)
    elif via_mpi:  # rank 0 hosts it on a free port; MPI tells the others where (and the token)
        _Default.stores_made += 1
        store, token = mpi.bootstrap_store(rv.rank, _outbound_address(), timeout, token or None,
                                           generation)
        owned = store
    elif store is None:
        _Default.stores_made += 1
        store = owned = _C.TCPStore(rv.master_addr, rv.master_port, is_server=rv.rank == 0,
                                    timeout=timeout, token=token, generation=generation)
    owns_store = owned is not None
    keys = _C.PrefixStore(f"g{generation}", store) \
        if generation and (file_path is not None or owns_store) else store
    try:
        world = _world(backend, keys, rv, timeout, token, device, options,
                       _bind_host(store, ifname_host), mpi_why)
    except Exception:
        # A failed rendezvous on rank 0 must not take the store from ranks still in it: each
        # of them then fails with its own error (Note [Store teardown]).
        if owned is not None:
            owned.close()
        raise
    _Default.world, _Default.store, _Default.owns_store = world, store, owns_store
    return world


# Note [MPI on some ranks only]
# init(backend="auto") under an MPI launcher asks each rank whether MPI builds and loads
# there (mpi_available(): the shim compiled and opened, MPI not started), and starts MPI
# only once every rank knows the answer of every other: MPI_Init waits, with no deadline,
# for every rank of the job, so a rank that started it while a peer could not waited there
# forever (and the peer, whose store rank 0 never came to host, timed out blaming the
# store). With a master address the ranks vote through the store: MPI loading on some ranks
# only is a RuntimeError on every rank naming those where it does not, and why; on none, the
# CPU backend as before. With none, the store itself comes through MPI: a rank where MPI
# does not load can reach no peer, so it raises at once, saying so, and its peers wait in
# MPI's start until it fails (its error uncaught: mpirun and srun end a job whose process
# exits with an error; Open MPI's mpirun ignores a process that never started MPI and
# exits cleanly, and the peers then wait on).
def _mpi_why_not() -> Optional[str]:
    """init(backend="auto"): None when no MPI launcher started this process; "" when MPI
    builds and loads here (not started); else why not (Note [MPI on some ranks only])."""
    if not any(os.environ.get(v) for v in mpi.LAUNCHER_VARS):
        return None
    ok, why = mpi.mpi_available()
    return "" if ok else (why.strip().splitlines() or ["unknown"])[0]


def _launcher_rank() -> str:
    """This process as its MPI launcher names it, for messages before the rendezvous."""
    for var in ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK", "SLURM_PROCID"):
        if os.environ.get(var):
            return f"rank {os.environ[var]}"
    return "this rank"


def _agree_on_backend(store: _C.Store, rank: int, world_size: int, timeout: float,
                      mpi_why: Optional[str]) -> BackendName:
    """init(backend="auto"), decided together through the store so that all ranks pick the
    same: "nccl" when every rank has a GPU and NCCL loads; else "mpi" when MPI loads on every
    rank (``mpi_why`` "": under mpirun or srun) and the ranks sit on several hosts (the site's
    MPI reaches their network; on one host the CPU backend's shared memory is faster); else
    "cpu". MPI loading on some ranks only is a RuntimeError on every rank (Note [MPI on some
    ranks only]). A host is what ``_C.host_identity()`` names (MESHCOLL_HOST_ID overrides)."""
    gpu, _ = nccl.nccl_available()
    host = hashlib.blake2b(_C.host_identity().encode(), digest_size=8).hexdigest()
    if mpi_why:
        store.set(f"mc/mpi_why/{rank}", mpi_why.encode())
    store.set(f"mc/backend_ok/{rank}", f"{int(gpu)}{int(mpi_why == '')}{host}".encode())
    votes = [bytes(store.get(f"mc/backend_ok/{r}", timeout)).decode() for r in range(world_size)]
    if all(v[0] == "1" for v in votes):
        return "nccl"
    without = [r for r, v in enumerate(votes) if v[1] == "0"]
    if without and len(without) < world_size:
        whys = "; ".join(f"rank {r}: {bytes(store.get(f'mc/mpi_why/{r}', timeout)).decode()}"
                         for r in without[:3])
        raise RuntimeError(
            f"meshcoll.init(backend='auto') on rank {rank}: MPI loads on some ranks but not "
            f"on rank(s) {without} ({whys}); MPI starts on every rank of a job or on none: fix "
            f"MPI there (meshcoll.mpi_available() says why), or pick backend='cpu'")
    if not without and len({v[2:] for v in votes}) > 1:
        return "mpi"
    return "cpu"


def _mpi_world(rank: Optional[int], world_size: Optional[int]) -> Tuple[int, int]:
    """init(backend="mpi"): MPI's rank and size (MPI loaded and initialized); given ones must
    match them."""
    try:
        mine, size = mpi.load()
    except mpi.MpiUnavailable as e:
        raise RuntimeError(f"meshcoll.init(backend='mpi'): {e}") from None
    for name, given, value in (("rank", rank, mine), ("world_size", world_size, size)):
        if given is not None and int(given) != value:
            raise ValueError(f"meshcoll.init(backend='mpi') on MPI rank {mine}: {name}={given} "
                             f"contradicts MPI's {value}; leave it out (MPI says which)")
    return mine, size


def _group_settings(
        rv: _rendezvous.Rendezvous) -> Tuple[_settings.GroupOptions, Optional[str]]:
    """The MESHCOLL_* group settings and the address of MESHCOLL_SOCKET_IFNAME's interface
    (None when unset), checked; ValueError naming this rank, the variable and its value."""
    try:
        # For the world of either backend (its subgroups inherit them): an NCCL world once
        # took the defaults, so MESHCOLL_CHECK=strict or off went unheard.
        options = _settings.group_options_from_env()
        if options.algorithm not in _C.algorithm_names():
            raise ValueError(f"{_settings.ALGO}={options.algorithm!r}: use one of "
                             f"{', '.join(_C.algorithm_names())} (or unset it)")
        return options, _interface_address(_settings.socket_ifname_from_env())
    except ValueError as e:
        # The readers' own prefixes ("meshcoll: ", "meshcoll.init: ") give way to the rank's.
        why = re.sub(r"^meshcoll(\.init)?: ", "", str(e))
        raise ValueError(f"meshcoll.init on rank {rv.rank} of {rv.world_size}: {why} (checked "
                         f"before contacting the store: every rank with this environment "
                         f"stops here at once)") from None


def _world(backend: Optional[str], store: _C.Store, rv: _rendezvous.Rendezvous, timeout: float,
           token: str, device: Any, options: _settings.GroupOptions,
           bind_host: str, mpi_why: Optional[str]) -> ProcessGroup:
    if backend == "auto":
        backend = _agree_on_backend(store, rv.rank, rv.world_size, timeout, mpi_why)
        if backend == "mpi":  # every rank loads MPI: each starts it now (if not already)
            _mpi_world(rv.rank, rv.world_size)
    if backend == "mpi":
        return make_group(store, range(rv.world_size), rv.rank, "world", timeout=timeout,
                          bind_host=bind_host, token=token, backend="mpi", options=options)
    if backend == "nccl":
        dev = nccl.world_device(rv.rank, rv.world_size,
                                device if device is not None else rv.local_rank)
        return make_group(store, range(rv.world_size), rv.rank, "world", timeout=timeout,
                          bind_host=bind_host, token=token, backend="nccl", device=dev,
                          options=options)
    return make_group(store, range(rv.world_size), rv.rank, "world", timeout=timeout,
                      bind_host=bind_host, token=token, options=options)


def _interface_address(ifname: Optional[str]) -> Optional[str]:
    """The IPv4 address of the interface ``ifname`` (MESHCOLL_SOCKET_IFNAME), or None."""
    if not ifname:
        return None
    import fcntl
    import socket
    import struct
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        packed = fcntl.ioctl(s.fileno(), 0x8915,  # SIOCGIFADDR
                             struct.pack("256s", ifname[:15].encode()))
    except OSError as e:
        raise ValueError(f"{_settings.SOCKET_IFNAME}={ifname!r}: no IPv4 address on that interface "
                         f"({e}); name one that `ip -4 addr` lists, or unset it") from None
    finally:
        s.close()
    return socket.inet_ntoa(packed[20:24])


def _bind_host(store: _C.Store, ifname_host: Optional[str]) -> str:
    """Where this rank listens: MESHCOLL_SOCKET_IFNAME's address, else the interface that
    reaches the master (the one peers can reach us on)."""
    if ifname_host:
        return ifname_host
    local = getattr(store, "local_host", None)
    return local if local else _outbound_address()


def _outbound_address() -> str:
    """The address of the interface holding the default route (a store with no master, such
    as a file, says nothing about the network): connecting a UDP socket sends no packet. A
    host without a route gets the loopback address, enough for one host."""
    import socket
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        s.connect(("10.255.255.255", 1))
        return str(s.getsockname()[0])
    except OSError:
        return "127.0.0.1"
    finally:
        s.close()


def destroy() -> None:
    """Close every group and the store; init may be called again afterwards. Needs no
    barrier before it: rank 0, which hosts the store init made, keeps it serving until every
    rank has closed it (destroyed or exited), at most the init timeout (Note [Store teardown]
    in csrc/store/tcp_store.h); a store passed to init is the caller's to close."""
    world, store, owns = _Default.world, _Default.store, _Default.owns_store
    if world is not None:
        # Before the peers can learn of it (`finally: meshcoll.destroy()` in a failing rank).
        run.note_leaving(exiting=False)
    _Default.world, _Default.store, _Default.owns_store = None, None, False
    try:
        if world is not None:
            world.destroy()  # may raise a failure no call raised yet (an NCCL group's)
    finally:
        if owns and not store.close():
            warnings.warn(f"meshcoll.destroy: the store stopped serving after waiting "
                          f"{store.timeout:g} s for ranks still connected to it; they fail at "
                          f"their next store use (creating a group)", RuntimeWarning,
                          stacklevel=2)


def is_initialized() -> bool:
    return _Default.world is not None


def get_world_group() -> ProcessGroup:
    if _Default.world is None:
        raise RuntimeError("meshcoll is not initialised: call meshcoll.init() first")
    return _Default.world


def new_group(ranks: Sequence[int], *, group: Optional[ProcessGroup] = None,
              name: Optional[str] = None, timeout: Optional[float] = None,
              transport: Optional[str] = None, check: Optional[str] = None,
              backend: Optional[BackendName] = None,
              device: Any = None) -> Union[ProcessGroup, NonMemberGroup]:
    """``ProcessGroup.new_group`` on ``group`` (default: the world)."""
    return (group or get_world_group()).new_group(ranks, name=name, timeout=timeout,
                                                   transport=transport, check=check,
                                                   backend=backend, device=device)
