"""meshcoll: collective communication for Python training loops.

    import meshcoll, numpy as np
    pg = meshcoll.init()                 # reads meshcoll-run / torchrun / Slurm / MPI env
    x = np.full(4, pg.rank, np.float32)
    meshcoll.all_reduce(x)               # in place: every rank now holds the sum
    meshcoll.destroy()
"""

__version__ = "0.1.0"

from . import _C
from ._C import (AbortedError, FileStore, MeshcollError, MismatchError, PeerError, PrefixStore,
                 Store, TimeoutError)
from .ddp import DataParallel, LocalSGD
from .device_mesh import DeviceMesh, MeshLayout, init_device_mesh
from .monitor import monitored_barrier
from .nccl import nccl_available
from .partition import ShardedArray, partition_range, reduce_scatter_dim, shard
from .process_group import (CollectiveConfig, NonMemberGroup, ProcessGroup, Work, destroy,
                            get_world_group, init, is_initialized, new_group)


class TCPStore(_C.TCPStore):
    """TCP key-value store. ``is_server=True`` also hosts the server (port 0 picks a free
    one: read ``.port``). ``token`` defaults to ``$MESHCOLL_TOKEN``; a client whose token
    differs from the server's is refused. ``timeout`` (seconds) bounds every call."""

    def __init__(self, host, port, *, is_server=False, timeout=None, token=None):
        import os
        if token is None:
            token = os.environ.get("MESHCOLL_TOKEN") or None
        super().__init__(host, port, is_server=is_server, timeout=timeout, token=token)


def get_rank() -> int:
    return get_world_group().rank


def get_world_size() -> int:
    return get_world_group().size


def _forward(name):
    method = getattr(ProcessGroup, name)

    def fn(*args, group=None, **kwargs):
        return getattr(group if group is not None else get_world_group(), name)(*args, **kwargs)

    fn.__name__ = fn.__qualname__ = name
    fn.__doc__ = (method.__doc__ or "") + "\n\nOn the world group unless ``group=`` is given."
    return fn


# Module functions mirror the group methods, on the world group or ``group=``.
for _name in ("all_reduce", "reduce", "broadcast", "all_gather", "all_gather_v",
              "reduce_scatter", "reduce_scatter_v", "all_to_all", "all_to_all_v", "gather",
              "scatter", "send", "recv", "isend", "irecv", "barrier"):
    globals()[_name] = _forward(_name)
del _name

__all__ = [
    "init", "destroy", "is_initialized", "get_rank", "get_world_size", "get_world_group",
    "new_group", "ProcessGroup", "NonMemberGroup", "Work", "CollectiveConfig", "TCPStore",
    "FileStore", "PrefixStore", "Store", "DataParallel", "LocalSGD", "MeshLayout", "DeviceMesh", "init_device_mesh",
    "monitored_barrier", "nccl_available", "ShardedArray", "partition_range", "reduce_scatter_dim", "shard",
    "MeshcollError", "TimeoutError", "PeerError", "MismatchError", "AbortedError",
    "all_reduce", "reduce", "broadcast", "all_gather", "all_gather_v", "reduce_scatter",
    "reduce_scatter_v", "all_to_all", "all_to_all_v", "gather", "scatter", "send", "recv",
    "isend", "irecv", "barrier",
]
