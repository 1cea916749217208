"""meshcoll: collective communication for Python training loops.

    import meshcoll, numpy as np
    pg = meshcoll.init()                 # reads meshcoll-run / torchrun / Slurm / MPI env
    x = np.full(4, pg.rank, np.float32)
    meshcoll.all_reduce(x)               # in place: every rank now holds the sum
    meshcoll.destroy()
"""

__version__ = "0.1.0"

import importlib as _importlib

# Note [Lazy package]
# The pure tiers (pipeline schedules and simulator, MeshLayout mesh math, partition math,
# _env) must import without the compiled extension, and importing any of them runs this
# file first. So this file imports nothing at import time: every public name is bound on
# first use (PEP 562 __getattr__) and from then on is a plain module global, so the hot
# path (meshcoll.all_reduce) never comes back here. tests/unit/test_pure_import.py fails
# if an eager import of _C comes back.

# Public name -> the submodule that defines it.
_HOME = {
    **dict.fromkeys(("AbortedError", "ConcurrentCallError", "FileStore", "MeshcollError",
                     "MismatchError", "PeerError", "PrefixStore", "Store", "TimeoutError"), "_C"),
    **dict.fromkeys(("DataParallel", "LocalSGD"), "ddp"),
    **dict.fromkeys(("DeviceMesh", "MeshLayout", "init_device_mesh"), "device_mesh"),
    "monitored_barrier": "monitor",
    "nccl_available": "nccl",
    **dict.fromkeys(("ShardedArray", "partition_range", "reduce_scatter_dim", "shard"),
                    "partition"),
    **dict.fromkeys(("CollectiveConfig", "NonMemberGroup", "ProcessGroup", "Work"),
                    "process_group"),
    **dict.fromkeys(("destroy", "get_world_group", "init", "is_initialized", "new_group"),
                    "world"),
}

# Module functions mirror the group methods, on the world group or ``group=``.
_COLLECTIVES = ("all_reduce", "reduce", "broadcast", "all_gather", "all_gather_v",
                "reduce_scatter", "reduce_scatter_v", "all_to_all", "all_to_all_v", "gather",
                "scatter", "send", "recv", "isend", "irecv", "barrier")

# Names defined in this file over the world group; made together by _world_api().
_WORLD_API = ("TCPStore", "get_rank", "get_world_size") + _COLLECTIVES

# Submodules that were attributes of the package after a plain ``import meshcoll``.
_SUBMODULES = ("_C", "_env", "arrays", "ddp", "device_mesh", "hierarchy", "monitor", "nccl",
               "partition", "process_group", "world")


def _world_api() -> dict:
    """TCPStore, get_rank, get_world_size and the module-level collectives; they need _C."""
    from . import _C
    from .process_group import ProcessGroup
    from .world import get_world_group

    class TCPStore(_C.TCPStore):
        """TCP key-value store. ``is_server=True`` also hosts the server (port 0 picks a
        free one: read ``.port``). ``token`` defaults to ``$MESHCOLL_TOKEN``; a client whose
        token differs from the server's is refused. ``timeout`` (seconds) bounds every call."""

        def __init__(self, host, port, *, is_server=False, timeout=None, token=None):
            import os
            if token is None:
                token = os.environ.get("MESHCOLL_TOKEN") or None
            super().__init__(host, port, is_server=is_server, timeout=timeout, token=token)

    TCPStore.__qualname__ = "TCPStore"  # as if defined at module level, as it was

    def get_rank() -> int:
        return get_world_group().rank

    def get_world_size() -> int:
        return get_world_group().size

    def forward(name):
        method = getattr(ProcessGroup, name)

        def fn(*args, group=None, **kwargs):
            return getattr(group if group is not None else get_world_group(), name)(
                *args, **kwargs)

        fn.__name__ = fn.__qualname__ = name
        fn.__doc__ = (method.__doc__ or "") + "\n\nOn the world group unless ``group=`` is given."
        return fn

    get_rank.__qualname__, get_world_size.__qualname__ = "get_rank", "get_world_size"
    api = {"TCPStore": TCPStore, "get_rank": get_rank, "get_world_size": get_world_size}
    api.update((name, forward(name)) for name in _COLLECTIVES)
    return api


def __getattr__(name):
    if name in _HOME:
        value = getattr(_importlib.import_module(f".{_HOME[name]}", __name__), name)
        globals()[name] = value
    elif name in _WORLD_API:
        globals().update(_world_api())
        value = globals()[name]
    elif name in _SUBMODULES:
        value = _importlib.import_module(f".{name}", __name__)  # binds the attribute itself
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))


__all__ = [
    "init", "destroy", "is_initialized", "get_rank", "get_world_size", "get_world_group",
    "new_group", "ProcessGroup", "NonMemberGroup", "Work", "CollectiveConfig", "TCPStore",
    "FileStore", "PrefixStore", "Store", "DataParallel", "LocalSGD", "MeshLayout", "DeviceMesh", "init_device_mesh",
    "monitored_barrier", "nccl_available", "ShardedArray", "partition_range", "reduce_scatter_dim", "shard",
    "MeshcollError", "TimeoutError", "PeerError", "MismatchError", "AbortedError",
    "ConcurrentCallError",
    "all_reduce", "reduce", "broadcast", "all_gather", "all_gather_v", "reduce_scatter",
    "reduce_scatter_v", "all_to_all", "all_to_all_v", "gather", "scatter", "send", "recv",
    "isend", "irecv", "barrier",
]
