"""Named-dimension device meshes: the rank math, and the process groups built on it.

``MeshLayout`` is pure arithmetic over ranks ``0..n-1`` laid out row-major (last dim
fastest). ``DeviceMesh`` maps that layout onto the members of a parent process group
and creates one group per row of every dimension, collectively, at construction.

The process-group module is imported at call time, never at import time, so the
layout math (and its tests) work without the C++ extension.
"""

from __future__ import annotations

import math
import operator
import os
import platform
import socket
import struct
from typing import TYPE_CHECKING, Dict, List, Mapping, Optional, Sequence, Tuple, TypedDict, Union

import numpy as np

if TYPE_CHECKING:  # for annotations only: imported at call time (see above)
    from .process_group import NonMemberGroup, ProcessGroup

Dims = Union[str, Sequence[str]]


class MeshLayout:
    """Shape and dim names of a mesh; every rank <-> coordinate and group question."""

    def __init__(self, shape: Sequence[int], dim_names: Sequence[str]):
        # operator.index rejects 2.5 and "2" instead of silently truncating them.
        shape = tuple(operator.index(s) for s in shape)
        dim_names = tuple(dim_names)
        if len(shape) == 0:
            raise ValueError("mesh needs at least one dim")
        if len(shape) != len(dim_names):
            raise ValueError(f"shape {shape} has {len(shape)} dims but dim_names "
                             f"{dim_names} has {len(dim_names)}")
        for name in dim_names:
            if not isinstance(name, str) or not name:
                raise ValueError(f"dim names must be non-empty strings, got {name!r}")
        dupes = sorted({n for n in dim_names if dim_names.count(n) > 1})
        if dupes:
            raise ValueError(f"duplicate dim names {dupes} in {dim_names}")
        for name, size in zip(dim_names, shape):
            if size < 1:
                raise ValueError(f"dim {name!r} has size {size}; every dim needs size >= 1")
        self._shape = shape
        self._names = dim_names
        # The whole rank array: small (one int per rank) and it makes every group
        # question a reshape, which is the definition the tests check against.
        self._mesh = np.arange(math.prod(shape)).reshape(shape)

    @classmethod
    def from_order(cls, world_size: int, *, order: str = "tp-dp-pp",
                   **sizes: int) -> "MeshLayout":
        """Megatron-style layout: ``order`` lists dims fastest-varying first.

        ``from_order(8, tp=2, pp=2, order="tp-dp-pp")`` gives dims ``(pp, dp, tp)``
        with shape ``(2, 2, 2)``. At most one dim of ``order`` may be left out of
        ``sizes``; it is inferred from the world size (usually dp).
        """
        tokens = tuple(order.split("-"))
        if any(not t for t in tokens):
            raise ValueError(f"order {order!r} has an empty dim name")
        dupes = sorted({t for t in tokens if tokens.count(t) > 1})
        if dupes:
            raise ValueError(f"duplicate dim names {dupes} in order {order!r}")
        unknown = sorted(set(sizes) - set(tokens))
        if unknown:
            raise ValueError(f"unknown dim names {unknown}: not in order {order!r}")
        for name, size in sizes.items():
            if size < 1:
                raise ValueError(f"dim {name!r} has size {size}; every dim needs size >= 1")
        missing = [t for t in tokens if t not in sizes]
        if len(missing) > 1:
            raise ValueError(f"cannot infer more than one dim size; give sizes for "
                             f"all but one of {missing}")
        given = math.prod(sizes.values())
        full = dict(sizes)
        if missing:
            if world_size % given:
                product = "*".join(f"{t}" for t in tokens if t in sizes) or "1"
                raise ValueError(f"{product} = {given} does not divide world size "
                                 f"{world_size}")
            full[missing[0]] = world_size // given
        layout = cls([full[t] for t in reversed(tokens)], tuple(reversed(tokens)))
        layout.check_world_size(world_size)
        return layout

    # -- shape -------------------------------------------------------------------

    @property
    def shape(self) -> Tuple[int, ...]:
        return self._shape

    @property
    def dim_names(self) -> Tuple[str, ...]:
        return self._names

    @property
    def ndim(self) -> int:
        return len(self._shape)

    @property
    def world_size(self) -> int:
        return int(self._mesh.size)

    def __repr__(self) -> str:
        dims = ", ".join(f"{n}={s}" for n, s in zip(self._names, self._shape))
        return f"({dims})"

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, MeshLayout) and self._shape == other._shape
                and self._names == other._names)

    def check_world_size(self, world_size: int) -> None:
        if self.world_size != world_size:
            raise ValueError(f"mesh {self!r} needs {self.world_size} ranks, "
                             f"got {world_size}")

    def index(self, dim: str) -> int:
        """Position of a dim name in the shape."""
        try:
            return self._names.index(dim)
        except ValueError:
            raise ValueError(f"unknown dim {dim!r}; mesh dims are {self._names}") from None

    def indices(self, dims: Dims) -> Tuple[int, ...]:
        """Positions of one or more dim names, which must be distinct and in mesh order.

        Mesh order is required (as in torch's DeviceMesh slicing) so a flattened local
        rank is always row-major over the mesh, never a silent transpose of it.
        """
        names = (dims,) if isinstance(dims, str) else tuple(dims)
        if not names:
            raise ValueError("need at least one dim name")
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"duplicate dim names {dupes} in {names}")
        idx = tuple(self.index(n) for n in names)
        if list(idx) != sorted(idx):
            raise ValueError(f"dims {names} must appear in mesh order {self._names}")
        return idx

    def size(self, dim: Optional[Dims] = None) -> int:
        """Size of one dim, product of several, or the world size when dim is None."""
        if dim is None:
            return self.world_size
        return math.prod(self._shape[i] for i in self.indices(dim))

    # -- ranks and coordinates ---------------------------------------------------

    def coordinate(self, rank: int) -> Tuple[int, ...]:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside mesh {self!r} of "
                             f"{self.world_size} ranks")
        return tuple(int(c) for c in np.unravel_index(rank, self._shape))

    def rank(self, coord: Union[Sequence[int], Mapping[str, int]]) -> int:
        if isinstance(coord, Mapping):
            unknown = sorted(set(coord) - set(self._names))
            missing = [n for n in self._names if n not in coord]
            if unknown or missing:
                raise ValueError(f"coordinate {dict(coord)} must name exactly the dims "
                                 f"{self._names}")
            coord = tuple(coord[n] for n in self._names)
        coord = tuple(int(c) for c in coord)
        if len(coord) != self.ndim:
            raise ValueError(f"coordinate {coord} has {len(coord)} entries; mesh "
                             f"{self!r} has {self.ndim} dims")
        for name, c, s in zip(self._names, coord, self._shape):
            if not 0 <= c < s:
                raise ValueError(f"coordinate {c} for dim {name!r} is outside [0, {s})")
        return int(np.ravel_multi_index(coord, self._shape))

    # -- groups ------------------------------------------------------------------

    def group_array(self, dims: Dims) -> np.ndarray:
        """All groups along ``dims`` as rows: ``moveaxis(mesh, dims, last).reshape(-1, k)``.

        Rows come in row-major order of the remaining dims; ranks within a row are
        row-major over ``dims`` (so the last named dim varies fastest).
        """
        idx = self.indices(dims)
        k = len(idx)
        moved = np.moveaxis(self._mesh, idx, tuple(range(-k, 0)))
        return moved.reshape(-1, self.size(dims))

    def groups(self, dims: Dims) -> List[List[int]]:
        groups: List[List[int]] = self.group_array(dims).tolist()
        return groups

    def group_of(self, rank: int, dims: Dims) -> List[int]:
        """The one group along ``dims`` that contains ``rank``."""
        rows = self.group_array(dims)
        hit = np.nonzero((rows == rank).any(axis=1))[0]
        if len(hit) != 1:
            raise ValueError(f"rank {rank} is outside mesh {self!r}")
        group: List[int] = rows[hit[0]].tolist()
        return group

    def sub_layout(self, dims: Dims) -> "MeshLayout":
        idx = self.indices(dims)
        return MeshLayout([self._shape[i] for i in idx], [self._names[i] for i in idx])


# -- devices ----------------------------------------------------------------------

# One fixed-size record per rank, so a single all_gather of equal-length bytes moves
# every rank's device description: kind, host, name, index, memory bytes and compute units
# (-1: unknown).
_DEVICE_RECORD = struct.Struct("<16s64s96sqqq")


class DeviceInfo:
    """One rank's device. ``compute_units``: what it computes with, as the device counts
    them: on a CPU the cores this rank may run on (its affinity), on a GPU its streaming
    multiprocessors; None when unknown."""

    __slots__ = ("kind", "index", "name", "host", "memory", "compute_units")

    def __init__(self, kind: str, index: int, name: str, host: str,
                 memory: Optional[int], compute_units: Optional[int] = None):
        self.kind, self.index, self.name = kind, index, name
        self.host, self.memory, self.compute_units = host, memory, compute_units

    def __repr__(self) -> str:
        return (f"DeviceInfo(kind={self.kind!r}, index={self.index}, name={self.name!r},"
                f" host={self.host!r}, memory={self.memory},"
                f" compute_units={self.compute_units})")

    def encode(self) -> np.ndarray:
        raw = _DEVICE_RECORD.pack(self.kind.encode(), self.host.encode(),
                                  self.name.encode(), self.index,
                                  -1 if self.memory is None else self.memory,
                                  -1 if self.compute_units is None else self.compute_units)
        return np.frombuffer(raw, dtype=np.uint8).copy()

    @classmethod
    def decode(cls, record: np.ndarray) -> "DeviceInfo":
        kind, host, name, index, memory, units = _DEVICE_RECORD.unpack(
            np.ascontiguousarray(record, dtype=np.uint8).tobytes())

        def text(b: bytes) -> str:
            # struct truncates long fields, possibly mid-character: drop the cut character.
            return b.rstrip(b"\0").decode("utf-8", errors="ignore")

        return cls(text(kind), int(index), text(name), text(host),
                   None if memory < 0 else int(memory), None if units < 0 else int(units))


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or socket.gethostname()


def _total_ram() -> Optional[int]:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def _usable_cores() -> Optional[int]:
    """The cores this process may run on (its CPU affinity), else the machine's count."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # no sched_getaffinity (macOS)
        return os.cpu_count()


def _local_device(group: ProcessGroup) -> DeviceInfo:
    host = socket.gethostname()
    if group.backend_name == "cpu":
        return DeviceInfo("cpu", 0, _cpu_name(), host, _total_ram(), _usable_cores())
    # GPU backends: name, memory and SM count come from torch when it is installed (the C++
    # core exposes no device properties); otherwise they are reported as unknown rather than
    # guessed.
    try:
        import torch

        index = torch.cuda.current_device()
        props = torch.cuda.get_device_properties(index)
        return DeviceInfo("cuda", index, props.name, host, int(props.total_memory),
                          int(props.multi_processor_count))
    except Exception:
        return DeviceInfo("cuda", -1, "unknown", host, None)


# -- DeviceMesh ---------------------------------------------------------------------


class _MeshState:
    """What a mesh and all its views/flattenings share: one per init_device_mesh."""

    def __init__(self, parent: ProcessGroup, layout: MeshLayout) -> None:
        self.parent = parent
        self.layout = layout                   # the root layout, positions 0..n-1
        self.global_ranks = np.asarray(parent.ranks)  # mesh position -> global rank
        self.group_count = 0                   # new_group calls, same on every rank
        self.flattened: Dict[str, "DeviceMesh"] = {}
        self.devices: List[DeviceInfo] = []

    def create_groups(self, dims: Dims) -> ProcessGroup:
        """Create every group along ``dims`` (collective); return the one we are in."""
        from . import world

        mine: Optional[ProcessGroup] = None
        for row in self.layout.group_array(dims):
            g = world.new_group(self.global_ranks[row].tolist(), group=self.parent)
            self.group_count += 1
            if g.is_member:
                mine = g
        assert mine is not None, "every mesh rank is in exactly one group per dim"
        return mine


class DeviceMesh:
    """A mesh of ranks with a process group per named dim.

    Construction is collective over ``group`` (default: world): every rank creates
    every group of every dim, dim by dim, in the same order, then gathers each
    rank's device record once. Afterwards nothing but ``flatten`` communicates, so
    ``describe()`` may be called on one rank alone.
    """

    def __init__(self, layout: MeshLayout,
                 group: Optional[Union[ProcessGroup, NonMemberGroup]] = None) -> None:
        from . import world

        parent = world.get_world_group() if group is None else group
        if not parent.is_member:
            raise ValueError("cannot build a DeviceMesh over a group this rank is not in")
        layout.check_world_size(parent.size)
        state = _MeshState(parent, layout)
        groups = {dim: state.create_groups(dim) for dim in layout.dim_names}
        records = parent.all_gather(_local_device(parent).encode())
        state.devices = [DeviceInfo.decode(r) for r in records]
        self._init_view(state, layout, state.global_ranks.reshape(layout.shape), groups)

    @classmethod
    def _view(cls, state: _MeshState, layout: MeshLayout, ranks: np.ndarray,
              groups: Dict[str, ProcessGroup]) -> "DeviceMesh":
        mesh = cls.__new__(cls)
        mesh._init_view(state, layout, ranks, groups)
        return mesh

    def _init_view(self, state: _MeshState, layout: MeshLayout, ranks: np.ndarray,
                   groups: Dict[str, ProcessGroup]) -> None:
        self._state = state
        self._layout = layout
        self._ranks = ranks                  # global ranks, shaped like layout.shape
        self._groups = groups
        me = state.parent.global_rank(state.parent.rank)
        self._coord = tuple(int(c) for c in np.argwhere(ranks == me)[0])

    # -- shape and coordinates ---------------------------------------------------

    @property
    def layout(self) -> MeshLayout:
        """The rank math of this mesh (shape, dim names, coordinates), without groups."""
        return self._layout

    @property
    def shape(self) -> Tuple[int, ...]:
        """Ranks along each dim, e.g. ``(2, 4)`` for dims ``("dp", "tp")``."""
        return self._layout.shape

    @property
    def dim_names(self) -> Tuple[str, ...]:
        """The dims' names, in mesh order (the last dim varies fastest over ranks)."""
        return self._layout.dim_names

    @property
    def ndim(self) -> int:
        """The number of dims."""
        return self._layout.ndim

    @property
    def ranks(self) -> np.ndarray:
        """Global ranks of this mesh, shaped like ``shape`` (a copy)."""
        return self._ranks.copy()

    @property
    def size(self) -> int:
        """Ranks in this mesh, as ``ProcessGroup.size``; along some dims:
        ``mesh["tp"].size``, ``mesh["dp", "tp"].size``."""
        return self._layout.world_size

    def get_coordinate(self) -> Tuple[int, ...]:
        """This rank's coordinate in the mesh, one index per dim in mesh order."""
        return self._coord

    def get_local_rank(self, dim: str) -> int:
        """This rank's index along ``dim``: its rank in ``get_group(dim)``."""
        return self._coord[self._layout.index(dim)]

    def get_group(self, dim: Optional[str] = None) -> ProcessGroup:
        """The process group of the ranks that share this rank's coordinates on every dim
        but ``dim`` (a mesh dim or a flattened one); ``dim`` may be left out on a 1-D mesh.
        Any other name ``group_names()`` lists (``new_group(..., name=)``, ``split(...,
        name=)``) gives this rank's group of that name; a ValueError where it is in none.
        No communication: the groups were made when the mesh was, or by those calls."""
        if dim is None:
            if self.ndim != 1:
                raise ValueError(f"mesh {self._layout!r} has {self.ndim} dims; name one")
            dim = self.dim_names[0]
        if dim in self._groups:
            return self._groups[dim]
        if dim in self._state.flattened:
            return self._state.flattened[dim].get_group()
        named = self._state.parent._names.get(dim)
        if named is None:
            raise ValueError(f"unknown dim {dim!r}; mesh dims are {self.dim_names}"
                             f"{self._flat_hint()}, nor does a group go by that name "
                             f"(group_names(): {self.group_names()})")
        if named.mine is None:
            me = self._state.parent.global_rank(self._state.parent.rank)
            raise ValueError(f"get_group({dim!r}) on global rank {me}: this rank is in none "
                             f"of the groups named {dim!r} (global ranks "
                             f"{[list(g) for g in named.ranks]}); ask on one of their ranks")
        return named.mine

    def group_names(self) -> List[str]:
        """The names groups go by here, without communication: this mesh's dims (one group
        per row of each, ``get_group(dim)``), the dims flattened so far (``flatten``), then
        the job's groups named with ``new_group(..., name=)`` or ``split(..., name=)`` (Note
        [Group names] in process_group.py)."""
        own = [*self.dim_names, *self._state.flattened]
        return own + [n for n in self._state.parent._names if n not in own]

    def _flat_hint(self) -> str:
        flat = tuple(self._state.flattened)
        return f", flattened dims are {flat}" if flat else ""

    # -- slicing and flattening ----------------------------------------------------

    def __getitem__(self, dims: Dims) -> "DeviceMesh":
        """Sub-mesh over ``dims`` through this rank; shares the parent's groups."""
        names = (dims,) if isinstance(dims, str) else tuple(dims)
        if len(names) == 1 and names[0] in self._state.flattened \
                and names[0] not in self.dim_names:
            return self._state.flattened[names[0]]
        idx = self._layout.indices(names)
        if names == self.dim_names:
            return self
        # Fix this rank's coordinate along the dims not kept.
        sel = tuple(slice(None) if i in idx else c for i, c in enumerate(self._coord))
        return DeviceMesh._view(self._state, self._layout.sub_layout(names),
                                self._ranks[sel], {n: self._groups[n] for n in names})

    def flatten(self, *dims: str) -> "DeviceMesh":
        """Collective: a 1-D mesh named ``"a_b"`` over dims a, b (default: all dims).

        Every rank must call it with the same dims in the same order, since it creates
        one new group per row. Flattening the same dims again returns the cached mesh.
        """
        names = tuple(dims) or self.dim_names
        self._layout.indices(names)  # validates names and their order
        name = "_".join(names)
        cached = self._state.flattened.get(name)
        if cached is not None:
            return cached
        if len(names) == 1:
            raise ValueError(f"flattening one dim {name!r} is just mesh[{name!r}]")
        # The groups span the whole root mesh, not just this view: every rank takes
        # part whichever slice it called from.
        group = self._state.create_groups(names)
        layout = MeshLayout([len(group.ranks)], [name])
        flat = DeviceMesh._view(self._state, layout, np.asarray(group.ranks), {name: group})
        self._state.flattened[name] = flat
        return flat

    # -- devices and reports ---------------------------------------------------------

    def devices(self, kind: Optional[str] = None) -> List[DeviceInfo]:
        """Device of every rank of this mesh, in row-major mesh order (no communication);
        with ``kind`` ("cpu", "cuda"), only the ranks on devices of that kind."""
        devs = [self._device(int(r)) for r in self._ranks.flat]
        return devs if kind is None else [d for d in devs if d.kind == kind]

    def reshape(self, shape: Sequence[int], dim_names: Sequence[str]) -> "DeviceMesh":
        """Collective: a new mesh of ``shape`` over the same ranks, in the same row-major
        order (``mesh.ranks.flat``), with its own groups. Only a whole mesh (not a slice or a
        flattening of one) can be reshaped: its ranks are the parent group's."""
        if self._ranks.size != self._state.global_ranks.size or \
                not np.array_equal(self._ranks.reshape(-1), self._state.global_ranks):
            raise ValueError(f"reshape: {self!r} is a slice or flattening of a larger mesh; "
                             "reshape the whole mesh it came from")
        return DeviceMesh(MeshLayout(shape, dim_names), group=self._state.parent)

    def _device(self, global_rank: int) -> DeviceInfo:
        pos = int(np.nonzero(self._state.global_ranks == global_rank)[0][0])
        return self._state.devices[pos]

    def stats(self) -> MeshStats:
        """Totals over distinct physical devices: ranks sharing one host's CPU count once,
        its compute units as the most cores any of them may run on (``DeviceInfo``)."""
        devs = self.devices()
        distinct = {(d.host, d.kind, d.index): d for d in devs}
        known = [d.memory for d in distinct.values() if d.memory is not None]
        units: Dict[Tuple[str, str, int], int] = {}
        for d in devs:
            if d.compute_units is not None:
                key = (d.host, d.kind, d.index)
                units[key] = max(units.get(key, 0), d.compute_units)
        by_kind: Dict[str, int] = {}
        for d in distinct.values():
            by_kind[d.kind] = by_kind.get(d.kind, 0) + 1
        ranks_by_kind: Dict[str, int] = {}
        for d in devs:
            ranks_by_kind[d.kind] = ranks_by_kind.get(d.kind, 0) + 1
        return {
            "world_size": self.size,
            "shape": dict(zip(self.dim_names, self.shape)),
            "hosts": len({d.host for d in devs}),
            "devices_by_kind": by_kind,
            "ranks_by_kind": ranks_by_kind,
            "total_memory": sum(known) if known else None,
            "memory_unknown": len(distinct) - len(known),
            "compute_units": sum(units.values()) if units else None,
            "compute_units_unknown": len(distinct) - len(units),
            "group_count": self._state.group_count,
        }

    def describe(self) -> str:
        """A table for people: a line of totals (``stats()``), then one line per rank with
        its coordinates, host, device and memory. No communication: any rank may call it."""
        st = self.stats()
        mem = st["total_memory"]
        units = st["compute_units"]
        lines = [f"DeviceMesh {self._layout!r}: {st['world_size']} ranks on "
                 f"{st['hosts']} host(s), {st['group_count']} groups, memory "
                 f"{_fmt_bytes(mem)}, {'?' if units is None else units} compute units"]
        header = ["rank", *self.dim_names, "host", "device", "memory"]
        rows = []
        for coord in np.ndindex(*self.shape):
            r = int(self._ranks[coord])
            d = self._device(r)
            rows.append([str(r), *map(str, coord), d.host, f"{d.kind}:{d.index} {d.name}",
                         _fmt_bytes(d.memory)])
        widths = [max(len(x) for x in col) for col in zip(header, *rows)]
        for row in [header, *rows]:
            lines.append("  ".join(x.ljust(w) for x, w in zip(row, widths)).rstrip())
        return "\n".join(lines)

    def __repr__(self) -> str:
        return f"DeviceMesh{self._layout!r}"


class MeshStats(TypedDict):
    """What ``DeviceMesh.stats()`` returns (a dict)."""

    world_size: int
    shape: Dict[str, int]
    hosts: int
    devices_by_kind: Dict[str, int]
    ranks_by_kind: Dict[str, int]
    total_memory: Optional[int]  # bytes; None when no device's memory is known
    memory_unknown: int
    compute_units: Optional[int]  # CPU cores and GPU SMs; None when no device's is known
    compute_units_unknown: int
    group_count: int


def _fmt_bytes(n: Optional[int]) -> str:
    return "?" if n is None else f"{n / 2**30:.1f} GiB"


def grid_shape(n: int) -> Tuple[int, int]:
    """The most nearly square 2-D grid of ``n`` ranks, rows <= columns: (2, 4) for 8, (3, 4)
    for 12, (1, 7) for 7."""
    if n < 1:
        raise ValueError(f"grid_shape: need at least one rank, got {n}")
    rows = max(d for d in range(1, math.isqrt(n) + 1) if n % d == 0)
    return rows, n // rows


def init_device_mesh(shape: Optional[Sequence[int]] = None,
                     dim_names: Optional[Sequence[str]] = None, *,
                     group: Optional[Union[ProcessGroup, NonMemberGroup]] = None) -> DeviceMesh:
    """Collective over ``group`` (default world): build a mesh and all its groups. Without a
    ``shape``, a 2-D grid of the group's ranks (``grid_shape``) named ``("dp", "tp")`` unless
    ``dim_names`` says otherwise; ``tp`` is the longer dim, its groups consecutive ranks."""
    if shape is None:
        from . import world

        parent = world.get_world_group() if group is None else group
        shape = grid_shape(parent.size if parent.is_member else 1)  # a non-member: refused below
        dim_names = ("dp", "tp") if dim_names is None else dim_names
    if dim_names is None:
        raise ValueError("init_device_mesh: a shape needs its dim_names")
    return DeviceMesh(MeshLayout(shape, dim_names), group=group)
