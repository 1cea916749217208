"""Split an array along one dim across a group, and put it back.

    sh = meshcoll.shard(x, dim=1, group=tp)          # this rank's columns, a copy
    full = sh.all_gather()                           # x again, on every rank
    part = meshcoll.reduce_scatter_dim(y, dim=0)     # sum over ranks, keep my rows

Every split is the balanced one ``numpy.array_split`` makes: ``length`` items over
``parts`` ranks give the first ``length % parts`` ranks one item more. Ranks may hold
zero items (``length < parts``); the collectives below handle empty shards.

The communication goes through the group's uneven collectives, which work on axis 0:
the split dim is swapped to the front, made contiguous, sent, and swapped back.
``swapaxes`` rather than ``moveaxis`` because numpy, CuPy and torch arrays all have
the method, and a swap is its own inverse. Copies of numpy arrays are numpy; copies of
other arrays come from the group's ``_empty`` hook (filled with ``out[...] = view``), so
the NCCL backend allocates them in the input's own framework (torch ``new_empty``, CuPy
``empty``) and the copy runs on that framework's current stream. Tested: numpy on the CPU
backend, and torch CPU tensors through a group whose hooks hand them out. Not tested:
CUDA arrays on the NCCL backend.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, List, Optional, Tuple, Union

import numpy as np

from ._types import ReduceOpName

if TYPE_CHECKING:
    from .process_group import NonMemberGroup, ProcessGroup

# A group argument: None (the world), a ProcessGroup, or what new_group gives a non-member
# (rejected with a ValueError that names the group).
_Group = Optional[Union["ProcessGroup", "NonMemberGroup"]]


def partition_range(length: int, parts: int, index: int) -> Tuple[int, int]:
    """``(start, stop)`` of part ``index`` when ``length`` items are split into ``parts``
    as ``numpy.array_split`` does: the first ``length % parts`` parts get one more."""
    length, parts, index = (operator.index(v) for v in (length, parts, index))
    if length < 0:
        raise ValueError(f"partition_range: length must be >= 0, got {length}")
    if parts < 1:
        raise ValueError(f"partition_range: parts must be >= 1, got {parts}")
    if not 0 <= index < parts:
        raise ValueError(f"partition_range: index {index} is outside [0, {parts})")
    base, extra = divmod(length, parts)
    start = index * base + min(index, extra)
    return start, start + base + (1 if index < extra else 0)


def partition_sizes(length: int, parts: int) -> List[int]:
    """Items in each part of ``partition_range``'s split."""
    return [stop - start for start, stop in
            (partition_range(length, parts, i) for i in range(parts))]


@dataclass(eq=False)  # eq would compare arrays elementwise: ambiguous, so identity
class ShardedArray:
    """One rank's shard of an array split along ``dim`` (non-negative) into ``parts``.

    ``local`` is items ``[start, stop)`` of ``dim``; ``global_shape`` is the whole
    array's shape. ``group`` (not part of the repr) is the group the shard was made
    over; ``all_gather`` uses it unless given another of the same size and rank.
    """

    local: Any
    global_shape: Tuple[int, ...]
    dim: int
    start: int
    stop: int
    parts: int
    index: int
    group: _Group = field(default=None, repr=False)

    def __post_init__(self) -> None:
        self.global_shape = tuple(int(s) for s in self.global_shape)
        self.dim = _normalize_dim(self.dim, len(self.global_shape), "ShardedArray")
        expected = partition_range(self.global_shape[self.dim], self.parts, self.index)
        if (self.start, self.stop) != expected:
            raise ValueError(f"ShardedArray: range [{self.start}, {self.stop}) is not part "
                             f"{self.index} of {self.parts} of length "
                             f"{self.global_shape[self.dim]} (expected {list(expected)})")
        if tuple(self.local.shape) != self.local_shape:
            raise ValueError(f"ShardedArray: local has shape {tuple(self.local.shape)}, "
                             f"expected {self.local_shape}")

    @property
    def local_shape(self) -> Tuple[int, ...]:
        s = list(self.global_shape)
        s[self.dim] = self.stop - self.start
        return tuple(s)

    @property
    def sizes(self) -> List[int]:
        """Length of ``dim`` on every rank, in rank order."""
        return partition_sizes(self.global_shape[self.dim], self.parts)

    def all_gather(self, group: _Group = None) -> Any:
        """Collective: the whole array, on every rank of the group (uneven shards too)."""
        group = self._check_group(group)
        moved = _contiguous(group, _swap(self.local, self.dim))
        gathered, counts = group.all_gather_v(moved)
        if counts != self.sizes:
            raise ValueError(f"ShardedArray.all_gather: ranks hold {counts} items of dim "
                             f"{self.dim}, but the split of {self.global_shape[self.dim]} "
                             f"over {self.parts} is {self.sizes}")
        return _contiguous(group, _swap(gathered, self.dim))

    def _check_group(self, group: _Group) -> ProcessGroup:
        group = _resolve(group if group is not None else self.group)
        if (group.size, group.rank) != (self.parts, self.index):
            raise ValueError(f"ShardedArray: shard {self.index} of {self.parts} cannot be "
                             f"gathered over a group of size {group.size} as rank {group.rank}")
        return group


def shard(x: Any, dim: int, group: _Group = None) -> ShardedArray:
    """This rank's part of ``x`` along ``dim`` (negative counts from the end), as a
    contiguous copy. No communication: every rank passes the whole ``x``."""
    group = _resolve(group)
    x = _host_array(group, x, "shard")
    d = _normalize_dim(dim, x.ndim, "shard")
    start, stop = partition_range(x.shape[d], group.size, group.rank)
    index = (slice(None),) * d + (slice(start, stop),)
    return ShardedArray(_copy(group, x[index]), tuple(x.shape), d, start, stop,
                        group.size, group.rank, group)


def reduce_scatter_dim(x: Any, dim: int, op: ReduceOpName = "sum",
                       group: _Group = None) -> ShardedArray:
    """Collective: reduce ``x`` (same shape on every rank) with ``op`` over the group and
    return this rank's part of the result along ``dim``, split as ``shard`` splits it."""
    group = _resolve(group)
    x = _host_array(group, x, "reduce_scatter_dim")
    d = _normalize_dim(dim, x.ndim, "reduce_scatter_dim")
    start, stop = partition_range(x.shape[d], group.size, group.rank)
    counts = partition_sizes(x.shape[d], group.size)
    mine = group.reduce_scatter_v(_contiguous(group, _swap(x, d)), counts, op)
    return ShardedArray(_contiguous(group, _swap(mine, d)), tuple(x.shape), d, start, stop,
                        group.size, group.rank, group)


# ---- helpers ----------------------------------------------------------------------------

def _resolve(group: _Group) -> ProcessGroup:
    if group is None:
        from . import world  # at call time, as device_mesh does
        group = world.get_world_group()
    if not getattr(group, "is_member", True):
        raise ValueError(f"this rank is not a member of group {group.name} "
                         f"(members: global ranks {group.ranks})")
    from .process_group import NonMemberGroup
    assert not isinstance(group, NonMemberGroup)  # its is_member is False: raised above
    return group


def _normalize_dim(dim: int, ndim: int, what: str) -> int:
    dim = operator.index(dim)
    if ndim == 0:
        raise ValueError(f"{what}: a 0-d array has no dim to split")
    if not -ndim <= dim < ndim:
        raise ValueError(f"{what}: dim {dim} is out of range for an array with {ndim} dims")
    return dim % ndim


def _host_array(group: ProcessGroup, x: Any, what: str) -> Any:
    """On the CPU backend, anything the group takes (DLPack, buffer protocol) becomes a
    numpy view; other backends get their arrays through unchanged."""
    if isinstance(x, np.ndarray) or group.backend_name != "cpu":
        return x
    return group._as_array(x, what)


def _swap(a: Any, d: int) -> Any:
    return a if d == 0 else a.swapaxes(0, d)


def _copy(group: ProcessGroup, view: Any) -> Any:
    """A C-contiguous copy in ``view``'s framework."""
    if isinstance(view, np.ndarray):
        return view.copy(order="C")
    out = group._empty(tuple(view.shape), view)
    out[...] = view
    return out


def _contiguous(group: ProcessGroup, a: Any) -> Any:
    if isinstance(a, np.ndarray):
        return np.ascontiguousarray(a)
    return a if _is_contiguous(a) else _copy(group, a)


def _is_contiguous(a: Any) -> bool:
    # torch: is_contiguous(); CuPy: flags.c_contiguous. Unknown kinds are copied.
    if hasattr(a, "is_contiguous"):
        return bool(a.is_contiguous())
    flags = getattr(a, "flags", None)
    return bool(getattr(flags, "c_contiguous", False))
