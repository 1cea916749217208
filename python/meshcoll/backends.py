"""The backend factory: makes a group, its C++ backend (the CPU one, the NCCL one through
nccl.py, or the MPI one through mpi.py) and, for a group spanning hosts, its hierarchy (hierarchy.py).

A ProcessGroup gets its backend ready-made, and makes its subgroups through the factory
that made it (``make_group``, which every group holds): so process_group.py imports neither
this module nor hierarchy.py, and nccl.py knows no ProcessGroup. ``meshcoll.init`` makes the
world here (world.py); tools/check_imports.py draws the graph and fails on a circle.
"""

from __future__ import annotations

import contextlib
import hashlib
import warnings
from typing import Iterator, List, Optional, Sequence, Tuple, Union, cast

from . import _C, _settings, mpi, nccl
from ._types import AlgorithmName, BackendName
from .arrays import HostArrays
from .collectives import CollectiveConfig
from .hierarchy import Hierarchy, host_of_each_rank
from .process_group import ProcessGroup

__all__ = ["make_group"]


def _comm_id(name: str, token: str) -> int:
    return int.from_bytes(hashlib.blake2b(f"{token}/{name}".encode(), digest_size=8).digest(), "little")


def _shared(ranks: Sequence[int], label: Optional[str], opts: _settings.GroupOptions,
            backend: str) -> List[Tuple[str, str]]:
    """What every member must agree on before the group is set up (Note [Shared settings]
    in csrc/store/exchange.h): its members and name, then its backend's settings."""
    return [(_settings.MEMBERS, repr(list(ranks))), (_settings.NAME, repr(label)),
            *opts.shared(backend).items()]


def _agreement_channel(store: _C.Store, name: str, rank: int, ranks: List[int], timeout: float,
                       bind_host: str, token: str,
                       opts: _settings.GroupOptions) -> Optional[_C.CpuBackend]:
    """Note [Agreement on a side channel] (csrc/comm/agreement.h): an NCCL or MPI group's
    calls are compared on a CPU group of the same ranks (None: one rank, or the check off)."""
    if len(ranks) == 1 or opts.check == "off":
        return None
    return _C.CpuBackend(_C.PrefixStore(f"mc/{name}/agree", store), rank, len(ranks), timeout,
                         bind_host=bind_host, token=token,
                         comm_id=_comm_id(name + "/agree", token), transport="auto",
                         shm_bytes=64 << 10, debug=False, global_ranks=ranks)


@contextlib.contextmanager
def _naming_setup(name: str, ranks: List[int]) -> Iterator[None]:
    """A failure while the group is set up says which group (its name and members)."""
    try:
        yield
    except (_C.TimeoutError, _C.PeerError) as e:
        raise type(e)(f"{e} (during setup of group {name!r}, global ranks {ranks})") from None


def make_group(store: _C.Store, ranks: Sequence[int], rank: int, name: str, *,
               timeout: float, bind_host: str, token: str,
               parent: Optional[ProcessGroup] = None, backend: BackendName = "cpu",
               device: Optional[int] = None, color: int = 0,
               options: Optional[_settings.GroupOptions] = None,
               label: Optional[str] = None) -> ProcessGroup:
    """Collective over ``ranks`` (and, for an NCCL subgroup, over its parent): the group
    ``name``, this process being group rank ``rank``, with its backend set up, its members
    past a barrier and, spanning hosts, its hierarchy built. ``options``: the group
    settings (``init`` reads them from the MESHCOLL_* environment; None: the defaults).
    ``label``: the name new_group or split was given (Note [Group names])."""
    opts = options if options is not None else _settings.GroupOptions()
    ranks = list(ranks)
    prefixed = _C.PrefixStore(f"mc/{name}", store)
    channel = None
    be: Union[_C.CpuBackend, _C.NcclBackend, _C.MpiBackend]
    if backend == "mpi":
        device = None
        if len(ranks) > 1:  # before MPI's split, which has no deadline of its own
            with _naming_setup(name, ranks):
                _C.agree_on_settings(prefixed, rank, len(ranks),
                                     _shared(ranks, label, opts, "mpi"), timeout, ranks)
        # A subgroup: MPI_Comm_split of the parent, ordered by the key (this group rank), or
        # of MPI's world for a parent of another backend (Note [MPI groups of other parents]).
        if parent is None or parent.backend_name == "mpi":
            made = mpi.make_backend(timeout, parent._mpi_backend() if parent is not None
                                    else None, color, rank)
        else:
            made = mpi.split_world(timeout, color, rank)
        assert made is not None
        be = made
        channel = _agreement_channel(store, name, rank, ranks, timeout, bind_host, token, opts)
        config = CollectiveConfig("auto")  # MPI picks its own algorithms
    elif backend == "nccl":
        # nccl.world_device names the world's device, new_group's device= that of an NCCL
        # group of another backend's parent; an NCCL parent's children inherit its own.
        assert device is not None
        split_of = parent if parent is not None and parent.backend_name == "nccl" else None
        if len(ranks) > 1:  # before NCCL's init; the NCCL backend compares none
            _C.agree_on_settings(prefixed, rank, len(ranks), _shared(ranks, label, opts, "nccl"),
                                 timeout, ranks)
        be = nccl.make_backend(prefixed, rank, len(ranks), device, timeout,
                               split_of._nccl_backend() if split_of is not None else None,
                               color)
        channel = _agreement_channel(store, name, rank, ranks, timeout, bind_host, token, opts)
        config = CollectiveConfig("auto")  # NCCL picks its own algorithms
    else:
        device = None
        with _naming_setup(name, ranks):
            be = _C.CpuBackend(prefixed, rank, len(ranks), timeout, bind_host=bind_host,
                               token=token, comm_id=_comm_id(name, token),
                               transport=opts.transport, shm_bytes=opts.shm_bytes,
                               debug=opts.debug, global_ranks=ranks,
                               shared=_shared(ranks, label, opts, "cpu"))
        # MESHCOLL_ALGO's text; CollectiveConfig checks it against the core's names.
        config = CollectiveConfig(cast(AlgorithmName, opts.algorithm))
    be.set_identity(ranks, name if label is None else label)
    if isinstance(be, _C.MpiBackend) and channel is not None:
        be.set_agreement(channel, opts.check == "strict")
    if isinstance(be, _C.NcclBackend):
        if channel is not None:
            be.set_agreement(channel, opts.check == "strict")
        # Note [Direct kernels] (csrc/nccl/direct/direct.h): collective, like the group itself.
        be.setup_direct(timeout)
    group = ProcessGroup(store, ranks, name, be, kind=backend,
                         arrays=nccl.CudaArrays if backend == "nccl" else HostArrays,
                         device=device, config=config, timeout=timeout, bind_host=bind_host,
                         token=token, options=opts, make_group=make_group, label=label,
                         names=parent._names if parent is not None else None)
    # Every member is done with the store for this group before anyone returns: rank 0
    # may otherwise exit (closing the store) while a peer still rendezvouses through it.
    with _naming_setup(name, ranks):
        group.barrier()
    # Note [Hierarchy] in hierarchy.py: the children; the backend runs the steps.
    transport = be.transport
    if backend == "mpi" and len(ranks) > 1 and opts.hierarchy:
        hosts = host_of_each_rank(group)
        if len(set(hosts)) > 1:  # Note [Hierarchy on MPI] in csrc/mpi/mpi_backend.h
            def composer() -> _C.CpuBackend:
                # Its links carry no data: TCP, with no shared memory to map.
                runner = _C.CpuBackend(_C.PrefixStore(f"mc/{name}/hier", store), rank,
                                       len(ranks), timeout, bind_host=bind_host, token=token,
                                       comm_id=_comm_id(name + "/hier", token),
                                       transport="tcp", shm_bytes=opts.shm_bytes,
                                       debug=opts.debug, global_ranks=ranks)
                runner.set_identity(ranks, name if label is None else label)
                return runner
            with _naming_setup(name, ranks):
                group._hier = Hierarchy.build(group, hosts, composer)
    elif transport.startswith("tcp") and len(ranks) > 1 and opts.transport == "auto":
        hosts = host_of_each_rank(group)
        if len(set(hosts)) > 1:
            group._hier = Hierarchy.build(group, hosts) if opts.hierarchy else None
        elif transport.startswith("tcp (") and rank == 0:
            warnings.warn(f"meshcoll group {name!r}: {transport}; falling back to TCP "
                          "between same-host ranks", RuntimeWarning, stacklevel=3)
    return group
