"""The module-level API of meshcoll over the world group: ``meshcoll.all_reduce(x)`` is
``meshcoll.get_world_group().all_reduce(x)``, or ``group.all_reduce(x)`` with ``group=``.

Note [One source of truth] (collectives.py): each function here has its ProcessGroup
method's signature plus ``group=`` and forwards to it; its docstring is the method's
(``_forwards``). tests/python/test_typing.py fails if a signature drifts. Importing this
module imports the C++ extension; ``meshcoll/__init__.py`` binds these names on first use."""

from __future__ import annotations

import os
from typing import (Any, Callable, ContextManager, List, Optional, Sequence, Tuple,
                    TypeVar)

from . import _C
from ._types import AlgorithmName, ReduceOpName
from .process_group import Array, ProcessGroup, Stream, Work
from .world import get_world_group

_F = TypeVar("_F", bound=Callable[..., Any])


def _forwards(fn: _F) -> _F:
    """``fn``'s docstring is its ProcessGroup method's, and says where it runs."""
    method = getattr(ProcessGroup, fn.__name__)
    fn.__doc__ = (method.__doc__ or "") + (
        "\n\nOn the world group (``meshcoll.init``'s), or on ``group=``; ranks given "
        "(``src``, ``dst``, ``peer``) are ranks within that group.")
    return fn


def _group(group: Optional[ProcessGroup]) -> ProcessGroup:
    return group if group is not None else get_world_group()


class TCPStore(_C.TCPStore):
    """TCP key-value store. ``is_server=True`` also hosts the server (port 0 picks a free
    one: read ``.port``). ``token`` defaults to ``$MESHCOLL_TOKEN``; a client whose token
    differs from the server's is refused. ``timeout`` (seconds) bounds every call.
    ``generation``: which ``meshcoll.init`` of its process this store serves (from 0; a
    client meets only a store of its own, Note [Generations] in csrc/store/tcp_store.h)."""

    def __init__(self, host: str, port: int, *, is_server: bool = False,
                 timeout: Optional[float] = None, token: Optional[str] = None,
                 generation: int = 0) -> None:
        if token is None:
            token = os.environ.get("MESHCOLL_TOKEN") or None
        super().__init__(host, port, is_server=is_server, timeout=timeout, token=token,
                         generation=generation)


TCPStore.__module__ = "meshcoll"


def get_rank() -> int:
    """This process's rank in the world group."""
    return get_world_group().rank


def get_world_size() -> int:
    """The number of ranks in the world group."""
    return get_world_group().size


@_forwards
def all_reduce(x: Array, op: ReduceOpName = "sum", *, async_op: bool = False,
               timeout: Optional[float] = None, algorithm: Optional[AlgorithmName] = None,
               stream: Stream = None, group: Optional[ProcessGroup] = None) -> Any:
    return _group(group).all_reduce(x, op, async_op=async_op, timeout=timeout,
                                    algorithm=algorithm, stream=stream)


@_forwards
def reduce(x: Array, dst: int = 0, op: ReduceOpName = "sum", *, async_op: bool = False,
           timeout: Optional[float] = None, algorithm: Optional[str] = None,
           stream: Stream = None, group: Optional[ProcessGroup] = None) -> Any:
    return _group(group).reduce(x, dst, op, async_op=async_op, timeout=timeout,
                                algorithm=algorithm, stream=stream)


@_forwards
def broadcast(x: Array, src: int = 0, *, async_op: bool = False,
              timeout: Optional[float] = None, algorithm: Optional[str] = None,
              stream: Stream = None, group: Optional[ProcessGroup] = None) -> Any:
    return _group(group).broadcast(x, src, async_op=async_op, timeout=timeout,
                                   algorithm=algorithm, stream=stream)


@_forwards
def all_gather(x: Array, out: Optional[Array] = None, *, async_op: bool = False,
               timeout: Optional[float] = None, stream: Stream = None,
               group: Optional[ProcessGroup] = None) -> Any:
    return _group(group).all_gather(x, out, async_op=async_op, timeout=timeout, stream=stream)


@_forwards
def all_gather_v(x: Array, *, timeout: Optional[float] = None, stream: Stream = None,
                 group: Optional[ProcessGroup] = None) -> Tuple[Any, List[int]]:
    return _group(group).all_gather_v(x, timeout=timeout, stream=stream)


@_forwards
def reduce_scatter(x: Array, out: Optional[Array] = None, op: ReduceOpName = "sum", *,
                   async_op: bool = False, timeout: Optional[float] = None,
                   stream: Stream = None, group: Optional[ProcessGroup] = None) -> Any:
    return _group(group).reduce_scatter(x, out, op, async_op=async_op, timeout=timeout,
                                        stream=stream)


@_forwards
def reduce_scatter_v(x: Array, counts: Sequence[int], op: ReduceOpName = "sum", *,
                     timeout: Optional[float] = None, stream: Stream = None,
                     group: Optional[ProcessGroup] = None) -> Any:
    return _group(group).reduce_scatter_v(x, counts, op, timeout=timeout, stream=stream)


@_forwards
def all_to_all(x: Array, out: Optional[Array] = None, *, async_op: bool = False,
               timeout: Optional[float] = None, stream: Stream = None,
               group: Optional[ProcessGroup] = None) -> Any:
    return _group(group).all_to_all(x, out, async_op=async_op, timeout=timeout, stream=stream)


@_forwards
def all_to_all_v(x: Array, send_counts: Sequence[int], *, timeout: Optional[float] = None,
                 stream: Stream = None,
                 group: Optional[ProcessGroup] = None) -> Tuple[Any, List[int]]:
    return _group(group).all_to_all_v(x, send_counts, timeout=timeout, stream=stream)


@_forwards
def gather(x: Array, dst: int = 0, *, timeout: Optional[float] = None, stream: Stream = None,
           group: Optional[ProcessGroup] = None) -> Optional[Any]:
    return _group(group).gather(x, dst, timeout=timeout, stream=stream)


@_forwards
def scatter(x: Optional[Array], src: int = 0, *, out: Optional[Array] = None,
            timeout: Optional[float] = None, stream: Stream = None,
            group: Optional[ProcessGroup] = None) -> Any:
    return _group(group).scatter(x, src, out=out, timeout=timeout, stream=stream)


@_forwards
def send(x: Array, peer: int, tag: int = 0, *, timeout: Optional[float] = None,
         stream: Stream = None, group: Optional[ProcessGroup] = None) -> None:
    _group(group).send(x, peer, tag, timeout=timeout, stream=stream)


@_forwards
def recv(x: Array, peer: int, tag: int = 0, *, timeout: Optional[float] = None,
         stream: Stream = None, group: Optional[ProcessGroup] = None) -> Any:
    return _group(group).recv(x, peer, tag, timeout=timeout, stream=stream)


@_forwards
def isend(x: Array, peer: int, tag: int = 0, *, timeout: Optional[float] = None,
          stream: Stream = None, group: Optional[ProcessGroup] = None) -> Work:
    return _group(group).isend(x, peer, tag, timeout=timeout, stream=stream)


@_forwards
def irecv(x: Array, peer: int, tag: int = 0, *, timeout: Optional[float] = None,
          stream: Stream = None, group: Optional[ProcessGroup] = None) -> Work:
    return _group(group).irecv(x, peer, tag, timeout=timeout, stream=stream)


@_forwards
def barrier(*, async_op: bool = False, timeout: Optional[float] = None, stream: Stream = None,
            group: Optional[ProcessGroup] = None) -> Optional[Work]:
    return _group(group).barrier(async_op=async_op, timeout=timeout, stream=stream)


@_forwards
def coalesced(*, timeout: Optional[float] = None,
              group: Optional[ProcessGroup] = None) -> ContextManager[ProcessGroup]:
    return _group(group).coalesced(timeout=timeout)


# The module functions that mirror ProcessGroup methods (test_typing.py checks each).
COLLECTIVES = ("all_reduce", "reduce", "broadcast", "all_gather", "all_gather_v",
               "reduce_scatter", "reduce_scatter_v", "all_to_all", "all_to_all_v", "gather",
               "scatter", "send", "recv", "isend", "irecv", "barrier", "coalesced")
