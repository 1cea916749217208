"""meshcoll: collective communication for Python training loops.

    import meshcoll, numpy as np
    pg = meshcoll.init()                 # reads meshcoll-run / torchrun / Slurm / MPI env
    x = np.full(4, pg.rank, np.float32)
    meshcoll.all_reduce(x)               # in place: every rank now holds the sum
    meshcoll.destroy()
"""

__version__ = "0.1.0"

import importlib as _importlib
import typing as _typing

# Note [Lazy package]
# The pure tiers (pipeline schedules and simulator, MeshLayout mesh math, partition math,
# _rendezvous, _settings) must import without the compiled extension, and importing any of
# them runs this file first. So this file imports nothing at import time: every public name
# is bound on first use (PEP 562 __getattr__) and from then on is a plain module global, so
# the hot path (meshcoll.all_reduce) never comes back here. tests/unit/test_pure_import.py fails
# if an eager import of _C comes back.

# Public name -> the submodule that defines it.
_HOME = {
    **dict.fromkeys(("AbortedError", "ConcurrentCallError", "FileStore", "MeshcollError",
                     "MismatchError", "PeerError", "PrefixStore", "Store", "TimeoutError"), "_C"),
    **dict.fromkeys(("DataParallel", "LocalSGD", "BoundedStaleness", "Asynchronous"), "ddp"),
    **dict.fromkeys(("DeviceMesh", "MeshLayout", "init_device_mesh"), "device_mesh"),
    "monitored_barrier": "monitor",
    "ShardedDataParallel": "sharded",
    **dict.fromkeys(("AlgorithmName", "BackendName", "ReduceOpName"), "_types"),
    "nccl_available": "nccl",
    "mpi_available": "mpi",
    **dict.fromkeys(("ShardedArray", "partition_range", "reduce_scatter_dim", "shard"),
                    "partition"),
    **dict.fromkeys(("CallStats", "CollectiveConfig", "NonMemberGroup", "ProcessGroup", "Work"),
                    "process_group"),
    **dict.fromkeys(("destroy", "get_world_group", "init", "is_initialized", "new_group"),
                    "world"),
    # The module functions over the world group (Note [One source of truth]).
    **dict.fromkeys(("TCPStore", "get_rank", "get_world_size", "all_reduce", "reduce",
                     "broadcast", "all_gather", "all_gather_v", "reduce_scatter",
                     "reduce_scatter_v", "all_to_all", "all_to_all_v", "gather", "scatter",
                     "send", "recv", "isend", "irecv", "barrier", "coalesced"), "api"),
}

# Submodules a user reaches as ``meshcoll.<name>`` without importing them (on first use).
_SUBMODULES = ("_C", "_rendezvous", "_settings", "api", "arrays", "ddp", "device_mesh",
               "hierarchy", "monitor", "mpi", "nccl", "partition", "process_group", "sharded", "world")

if _typing.TYPE_CHECKING:  # what __getattr__ binds, as type checkers and IDEs see it
    from ._C import (AbortedError, ConcurrentCallError, FileStore, MeshcollError,
                     MismatchError, PeerError, PrefixStore, Store, TimeoutError)
    from ._types import AlgorithmName, BackendName, ReduceOpName
    from .api import (TCPStore, all_gather, all_gather_v, all_reduce, all_to_all, all_to_all_v,
                      barrier, broadcast, coalesced, gather, get_rank, get_world_size, irecv,
                      isend, recv, reduce, reduce_scatter, reduce_scatter_v, scatter, send)
    from .ddp import Asynchronous, BoundedStaleness, DataParallel, LocalSGD
    from .device_mesh import DeviceMesh, MeshLayout, init_device_mesh
    from .monitor import monitored_barrier
    from .mpi import mpi_available
    from .nccl import nccl_available
    from .partition import ShardedArray, partition_range, reduce_scatter_dim, shard
    from .process_group import CallStats, CollectiveConfig, NonMemberGroup, ProcessGroup, Work
    from .sharded import ShardedDataParallel
    from .world import destroy, get_world_group, init, is_initialized, new_group


if not _typing.TYPE_CHECKING:  # hidden from type checkers: a misspelt name stays an error
    def __getattr__(name: str) -> object:
        if name in _HOME:
            value = getattr(_importlib.import_module(f".{_HOME[name]}", __name__), name)
            globals()[name] = value
        elif name in _SUBMODULES:
            value = _importlib.import_module(f".{name}", __name__)  # binds the attribute
        else:
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
        return value


def __dir__() -> "list[str]":
    return sorted(set(globals()) | set(__all__))


__all__ = [
    "init", "destroy", "is_initialized", "get_rank", "get_world_size", "get_world_group",
    "new_group", "ProcessGroup", "NonMemberGroup", "Work", "CollectiveConfig", "CallStats", "TCPStore",
    "FileStore", "PrefixStore", "Store", "DataParallel", "LocalSGD", "BoundedStaleness",
    "Asynchronous", "ShardedDataParallel", "MeshLayout", "DeviceMesh", "init_device_mesh",
    "monitored_barrier", "mpi_available", "nccl_available", "ShardedArray", "partition_range", "reduce_scatter_dim", "shard",
    "MeshcollError", "TimeoutError", "PeerError", "MismatchError", "AbortedError",
    "ConcurrentCallError",
    "all_reduce", "reduce", "broadcast", "all_gather", "all_gather_v", "reduce_scatter",
    "reduce_scatter_v", "all_to_all", "all_to_all_v", "gather", "scatter", "send", "recv",
    "isend", "irecv", "barrier", "coalesced",
    "ReduceOpName", "AlgorithmName", "BackendName",
]
