"""Sharded data parallel (ZeRO stages 1-3, hybrid sharding): the framework-agnostic core, and
``ShardedDataParallel`` over named arrays (numpy on the CPU backend; CuPy / torch CUDA arrays
on the NCCL backend), as ``DataParallel`` is for the unsharded case::

    sdp = meshcoll.ShardedDataParallel(params, stage=3)        # params: name -> array
    opt = meshcoll.sharded.Adam(lr=1e-3)
    for batch in shard:
        full = sdp.gather()                   # name -> full parameter (views of one buffer)
        grads = ...forward/backward with full...
        sdp.step(grads, opt)                  # reduce-scatter, then Adam on this rank's shard

The torch side (``meshcoll.torch.fully_shard``, torch_fsdp.py) is built on the same
``FlatLayout``, ``shard_groups`` and ``reduce_shard``.

Note [Flat shards]
A sharded unit's parameters are laid end to end in one flat buffer, padded with zeros to a
multiple of the shard group's size N; rank r owns elements [r*S, (r+1)*S) with S = padded/N
(its *shard*, the fp32 master copy the optimizer steps). An all-gather of the shards is the
flat buffer again, and a reduce-scatter of the flat gradient leaves each rank the sum of its
own slice: one collective per unit each way, of equal counts on every rank, whatever the
parameters' shapes. Elementwise optimizers (SGD, momentum, Adam, AdamW) step a slice exactly
as they step the whole; the padding's gradient is zero, so it stays zero. What an optimizer
computes across a whole tensor (a norm: LAMB, gradient clipping) needs a sum over the shards.
Stages: 1 all-reduces the full gradient and steps this rank's slice (optimizer state is
sharded); 2 reduce-scatters it (gradients sharded too); both keep the full parameters, and
re-gather them after a step. 3 keeps only the shard and gathers the full parameters when
they are used, freeing them afterwards.

Note [Hybrid sharding]
On a 2-D mesh (dims ("replicate", "shard"), as torch's HSDP) a unit is sharded over the
shard dim's group: its reduce-scatter runs there, then each rank all-reduces its shard's
gradient over the replicate dim's group (the ranks holding the same shard on other rows), so
the sum covers every rank. The gathers never leave the shard group. Each rank divides by the
whole data-parallel size, so the gradient is the average over every rank, as DDP's.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np

from .arrays import dtype_name

if TYPE_CHECKING:
    from .device_mesh import DeviceMesh
    from .process_group import ProcessGroup

STAGES = (1, 2, 3)


def check_stage(stage: Any, what: str) -> int:
    if isinstance(stage, bool) or stage not in STAGES:
        raise ValueError(f"{what}: stage must be 1 (optimizer state sharded), 2 (and gradients) "
                         f"or 3 (and parameters), got {stage!r}")
    return int(stage)


def shard_groups(group: Optional[ProcessGroup], mesh: Optional[DeviceMesh],
                 what: str) -> Tuple[ProcessGroup, Optional[ProcessGroup]]:
    """(shard group, replicate group or None) from ``group=`` or ``mesh=``: a 1-D mesh shards
    over its one dim; a 2-D mesh is (replicate, shard), its first dim replicating (Note
    [Hybrid sharding])."""
    if group is not None and mesh is not None:
        raise ValueError(f"{what}: pass group= or mesh=, not both")
    if mesh is None:
        from .world import get_world_group
        g = group if group is not None else get_world_group()
        if not g.is_member:
            raise ValueError(f"{what}: this rank is not a member of group {g.name!r}")
        return g, None
    if mesh.ndim == 1:
        return mesh.get_group(mesh.dim_names[0]), None
    if mesh.ndim != 2:
        raise ValueError(f"{what}: mesh must have 1 dim (shard) or 2 (replicate, shard), got "
                         f"{mesh.ndim} dims {mesh.dim_names}; slice it, e.g. mesh['dp', 'fsdp']")
    replicate = mesh.get_group(mesh.dim_names[0])
    return mesh.get_group(mesh.dim_names[1]), (replicate if replicate.size > 1 else None)


class FlatLayout:
    """Where each named parameter lies in a unit's padded flat buffer (Note [Flat shards])."""

    def __init__(self, names: Sequence[str], shapes: Sequence[Tuple[int, ...]], parts: int) -> None:
        self.names = list(names)
        self.shapes = [tuple(int(d) for d in s) for s in shapes]
        self.numels = [math.prod(s) for s in self.shapes]
        self.offsets = [sum(self.numels[:k]) for k in range(len(self.numels))]
        self.total = sum(self.numels)
        self.parts = int(parts)
        self.shard_numel = -(-self.total // self.parts) if self.total else 0
        self.padded = self.shard_numel * self.parts

    def shard_range(self, index: int) -> Tuple[int, int]:
        return index * self.shard_numel, (index + 1) * self.shard_numel

    def pieces(self, index: int) -> List[Tuple[int, int, int, int]]:
        """For shard ``index``: (parameter k, its first flat element in the shard, one past
        its last, where that lies in the shard) for each parameter the shard holds part of."""
        lo, hi = self.shard_range(index)
        out = []
        for k, (off, n) in enumerate(zip(self.offsets, self.numels)):
            a, b = max(lo, off), min(hi, off + n)
            if a < b:
                out.append((k, a - off, b - off, a - lo))
        return out

    def lines(self, dtype: str, extra: str) -> List[str]:
        """What ranks must agree on (Note [Agreed layout] in ddp.py): one line a parameter."""
        return [f"{n} {s} {dtype} {extra}" for n, s in zip(self.names, self.shapes)] + \
            [f"padded {self.padded} over {self.parts} shards"]


def reduce_shard(shard_group: ProcessGroup, stage: int, flat_grad: Any, out: Any,
                 async_op: bool = True) -> Any:
    """Starts the sum over every rank of ``flat_grad``'s slice that this rank owns, into
    ``out`` (stage 1: into ``flat_grad`` itself, whose slice is then the sum). Returns the
    Work of the shard group's part (``async_op``); the replicate group's all-reduce runs after
    it in ``finish_reduce`` (Note [Hybrid sharding])."""
    if stage == 1:
        return shard_group.all_reduce(flat_grad, op="sum", async_op=async_op)
    return shard_group.reduce_scatter(flat_grad, out=out, op="sum", async_op=async_op)


def finish_reduce(work: Any, replicate: Optional[ProcessGroup], shard: Any,
                  stream: Any = None) -> None:
    """Waits for ``reduce_shard``'s Work (on a GPU: orders ``stream`` after it); on a hybrid
    mesh all-reduces ``shard`` (this rank's summed slice) over the replicate group."""
    work.wait(stream=stream)
    if replicate is not None:
        replicate.all_reduce(shard, op="sum")


# ---- functional optimizers on a shard ---------------------------------------------------
class SGD:
    """``torch.optim.SGD``'s update (momentum, dampening 0, weight_decay added to the
    gradient), applied in place to a shard."""

    def __init__(self, lr: float, momentum: float = 0.0, weight_decay: float = 0.0) -> None:
        self.lr, self.momentum, self.weight_decay = float(lr), float(momentum), float(weight_decay)

    def init(self, param: Any) -> Dict[str, Any]:
        return {"momentum": None}

    def update(self, param: Any, grad: Any, state: Dict[str, Any]) -> None:
        g = grad + self.weight_decay * param if self.weight_decay else grad
        if self.momentum:
            buf = state["momentum"]
            if buf is None:
                buf = state["momentum"] = g.copy()
            else:
                buf *= self.momentum
                buf += g
            g = buf
        param -= param.dtype.type(self.lr) * g


class Adam:
    """``torch.optim.AdamW``'s update (``decoupled=True``, the default) or ``torch.optim.Adam``'s
    (weight decay added to the gradient), applied in place to a shard."""

    def __init__(self, lr: float = 1e-3, betas: Tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0, decoupled: bool = True) -> None:
        self.lr, self.betas, self.eps = float(lr), betas, float(eps)
        self.weight_decay, self.decoupled = float(weight_decay), bool(decoupled)

    def init(self, param: Any) -> Dict[str, Any]:
        return {"step": 0, "m": param * 0, "v": param * 0}

    def update(self, param: Any, grad: Any, state: Dict[str, Any]) -> None:
        b1, b2 = self.betas
        state["step"] += 1
        t = state["step"]
        if self.weight_decay and self.decoupled:
            param *= 1 - self.lr * self.weight_decay
        elif self.weight_decay:
            grad = grad + self.weight_decay * param
        m, v = state["m"], state["v"]
        m *= b1
        m += (1 - b1) * grad
        v *= b2
        v += (1 - b2) * grad * grad
        denom = (v ** 0.5) / math.sqrt(1 - b2 ** t) + self.eps
        param -= (self.lr / (1 - b1 ** t)) * m / denom


# ---- ShardedDataParallel --------------------------------------------------------------
class ShardedDataParallel:
    """Shard ``params`` (dict name -> array, one floating dtype) over ``group`` or ``mesh``
    (Note [Flat shards], Note [Hybrid sharding]). Every rank starts from ``broadcast_from``'s
    parameters (group rank; None: the caller guarantees equal ones).

    - ``gather()``: the full parameters, name -> array (views of one flat buffer). Stage 3
      all-gathers them at each call (drop them after use to free the memory); stages 1 and 2
      keep them, and re-gather after each ``step``.
    - ``step(grads, optimizer)``: averages ``grads`` (name -> array, this rank's gradients)
      over every rank into this rank's shard (stage 1 all-reduce, 2 and 3 reduce-scatter) and
      applies ``optimizer`` (``SGD``, ``Adam`` or anything with ``init(shard)`` and
      ``update(shard, grad, state)``) to the shard.
    - ``shard`` / ``shard_range``: this rank's flat slice and where it lies.
    - ``state_dict()``: the full parameters as a new dict (collective).

    Ranks whose layouts differ (names, shapes, dtype, stage, group sizes) get MismatchError
    at construction, naming both ranks."""

    def __init__(self, params: Mapping[str, Any], *, group: Optional[ProcessGroup] = None,
                 mesh: Optional[DeviceMesh] = None, stage: int = 3,
                 broadcast_from: Optional[int] = 0) -> None:
        from .ddp import agree_layout
        what = "ShardedDataParallel"
        self.stage = check_stage(stage, what)
        self._group, self._replicate = shard_groups(group, mesh, what)
        if not isinstance(params, Mapping) or not params:
            raise ValueError(f"{what}: params must be a non-empty dict name -> array")
        arrays = {str(n): p for n, p in params.items()}
        dtypes = {dtype_name(p.dtype) for p in arrays.values()}
        if len(dtypes) != 1 or next(iter(dtypes)) not in ("float32", "float64"):
            raise TypeError(f"{what}: parameters must share one dtype, float32 or float64 "
                            f"(the master copy), got {sorted(dtypes)}")
        self._like = next(iter(arrays.values()))
        self._dtype = self._like.dtype
        self.layout = FlatLayout(list(arrays), [tuple(p.shape) for p in arrays.values()],
                                 self._group.size)
        extra = f"stage {self.stage} replicas {self._world // self._group.size}"
        for g in (self._group, self._replicate):
            if g is not None:
                agree_layout(g, self.layout.lines(next(iter(dtypes)), extra), what)
        flat = self._empty(self.layout.padded)
        flat[self.layout.total:] = 0
        for k, p in enumerate(arrays.values()):
            off, n = self.layout.offsets[k], self.layout.numels[k]
            flat[off:off + n] = p.reshape(-1)
        if broadcast_from is not None:
            for g in (self._replicate, self._group):
                if g is not None:
                    g.broadcast(flat, int(broadcast_from) if g is self._group else 0)
        lo, hi = self.shard_range
        self.shard = flat[lo:hi].copy()
        self._full: Optional[Any] = flat if self.stage < 3 else None
        self._opt_state: Optional[Dict[str, Any]] = None
        self._opt: Any = None

    @property
    def _world(self) -> int:
        return self._group.size * (self._replicate.size if self._replicate is not None else 1)

    @property
    def group(self) -> ProcessGroup:
        return self._group

    @property
    def shard_range(self) -> Tuple[int, int]:
        return self.layout.shard_range(self._group.rank)

    def _empty(self, n: int) -> Any:
        return self._group._empty(n, self._like)  # the parameters' framework and dtype

    def _views(self, flat: Any) -> Dict[str, Any]:
        L = self.layout
        return {n: flat[o:o + c].reshape(s)
                for n, o, c, s in zip(L.names, L.offsets, L.numels, L.shapes)}

    def gather(self) -> Dict[str, Any]:
        """The full parameters (collective at stage 3: every rank calls it)."""
        if self._full is not None:
            return self._views(self._full)
        flat = self._empty(self.layout.padded)
        self._group.all_gather(self.shard, out=flat.reshape(self._group.size, -1))
        return self._views(flat)

    def reduce_gradients(self, grads: Mapping[str, Any]) -> Any:
        """This rank's shard of the gradient averaged over every rank (collective)."""
        L = self.layout
        missing = [n for n in L.names if n not in grads]
        unknown = [n for n in grads if n not in set(L.names)]
        if missing or unknown:
            raise KeyError(f"ShardedDataParallel: gradients must name every parameter once; "
                           f"missing {missing[:10]}, unknown {unknown[:10]}")
        flat = self._empty(L.padded)
        flat[L.total:] = 0
        for n, o, c, s in zip(L.names, L.offsets, L.numels, L.shapes):
            g = grads[n]
            if tuple(g.shape) != s:
                raise ValueError(f"ShardedDataParallel: gradient {n!r} has shape "
                                 f"{tuple(g.shape)}, its parameter {s}")
            flat[o:o + c] = g.reshape(-1)
        lo, hi = self.shard_range
        out = flat[lo:hi] if self.stage == 1 else self._empty(L.shard_numel)
        work = reduce_shard(self._group, self.stage, flat, out)
        finish_reduce(work, self._replicate, out)
        out /= self._dtype.type(self._world)
        return out

    def step(self, grads: Mapping[str, Any], optimizer: Any) -> None:
        """Average ``grads`` into this rank's shard and step it (collective)."""
        g = self.reduce_gradients(grads)
        if self._opt is not optimizer:
            self._opt, self._opt_state = optimizer, optimizer.init(self.shard)
        optimizer.update(self.shard, g, self._opt_state)
        if self._full is not None:  # stages 1-2 keep the full parameters current
            self._group.all_gather(self.shard, out=self._full.reshape(self._group.size, -1))

    def state_dict(self) -> Dict[str, Any]:
        """The full parameters, new arrays (collective at stage 3)."""
        return {n: v.copy() for n, v in self.gather().items()}

    def __repr__(self) -> str:
        hybrid = f", replicated x{self._replicate.size}" if self._replicate is not None else ""
        return (f"ShardedDataParallel(stage={self.stage}, {len(self.layout.names)} parameters, "
                f"{self.layout.total} elements in shards of {self.layout.shard_numel} over "
                f"group {self._group.name!r}{hybrid})")
