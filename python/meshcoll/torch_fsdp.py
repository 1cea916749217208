"""``meshcoll.torch.fully_shard``: sharded data parallel for torch modules (ZeRO stages 1-3,
hybrid sharding on a 2-D DeviceMesh), in the call shape of torch's FSDP2::

    import meshcoll, meshcoll.torch as mt
    meshcoll.init()
    for block in model.blocks:
        mt.fully_shard(block)                 # one unit per block
    mt.fully_shard(model)                     # the root: whatever parameters are left
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)   # sees each unit's shard
    loss_fn(model(x), y).backward(); opt.step()

Each unit's parameters become one flat fp32 shard, registered on the unit's module as the
parameter ``flat_shard`` (Note [Flat shards] in sharded.py); the module's own parameters
leave ``named_parameters()`` and are set, as plain tensors, to views of the gathered flat
buffer while the unit runs (Note [The unit's step]). Any torch optimizer works on the shards
as long as its update is elementwise (SGD, Adam, AdamW, ...); gradient clipping by norm needs
the norm summed over ranks (``clip_grad_norm_`` here).

What differs from torch's FSDP2: parameters are flat shards (``flat_shard``), not DTensors,
so ``model.parameters()`` and ``state_dict()`` name those; ``full_state_dict()`` /
``sharded_state_dict()`` give the unwrapped model's names (Note [Sharded state dicts]);
``stage=`` picks ZeRO 1/2/3 (FSDP2 is stage 3, and stage 2 with ``reshard_after_forward=
False`` only between forward and backward); every rank starts from rank 0's parameters
(``broadcast_from=0``, as meshcoll's DataParallel; FSDP2 takes each rank's own);
``checkpoint=True`` recomputes the unit's forward in its backward.

Note [The unit's step]
Forward pre-hook: the unit's flat buffer is all-gathered (in ``param_dtype``) unless a
prefetch started it already, and passed through ``_Gather`` (an autograd Function whose
input is the shard and whose outputs are views of the flat buffer, one a parameter), which
the module's parameters are set to. Autograd calls ``_Gather.backward`` once the unit's
whole backward is done: it lays the parameters' gradients end to end (one flat gradient)
and starts its reduce-scatter (stage 1: all-reduce) asynchronously, in ``reduce_dtype``, and
returns nothing; one callback at the end of backward waits for them, all-reduces over the
replicate group on a hybrid mesh, divides by the data-parallel size and adds each result to
its shard's ``.grad`` (so gradient accumulation across backwards works as for any
parameter). Stage 3 frees the flat buffer after the unit's forward (``reshard_after_forward``;
the root unit keeps it, its backward comes first) and again after its backward. Freed after
forward, backward needs it back: the tensors autograd saves during the unit's forward that
are views of the flat buffer are packed as (offset, shape, strides) by saved-tensor hooks,
and unpacking them in backward gathers the buffer again. Prefetch: the unit's forward starts
the next unit's gather (forward order of the first step), and the first unpack of a unit in
backward starts the previous unit's, so gathers run while the unit computes.
Stages 1 and 2 keep the flat buffer, and gather it again at the next forward only when the
shard changed (its version counter: an optimizer steps it in place).
On GPUs gathers run on one side stream and reductions on another, each after the work queued
on the current stream so far (the tensors they use are recorded on it); waiting for one
orders the current stream after it, and nothing in the step blocks the host. They are
synchronous calls on the side stream (``_SideStreamCall``), not asynchronous ones: an
asynchronous call holds its arrays until the communicator's watchdog sees it complete (Note
[Owners] in csrc/python/array.h), which lags the host by milliseconds, and a whole forward's
gathered buffers stayed allocated (tests/gpu/test_fsdp_gpu.py's memory bound, 2.4x over).
record_stream is what keeps the memory safe, as in torch's FSDP2: the allocator reuses a
freed buffer only after the side stream has passed it.

Note [Sharded state dicts]
``full_state_dict()`` gathers every unit's fp32 shards and returns the unwrapped model's
state dict (its names, its shapes; buffers as they are), on every rank.
``sharded_state_dict()`` is this rank's part only: for each parameter, a ``ShardedParameter``
(its flat elements [start, stop) and shape), no communication; ``merge_sharded_state_dicts``
puts the ranks' dicts (of one replica) together into the full one, and
``load_sharded_state_dict`` / ``load_full_state_dict`` load into a model sharded the same way.

Note [Optimizer state dicts]
The optimizer steps the flat shards, so its own ``state_dict()`` is this rank's shards'
state. ``full_optim_state_dict(optimizer)`` is the unwrapped model's instead, keyed by
parameter name as torch.distributed.checkpoint's full optimizer state dict is: every state
tensor shaped like the shard (AdamW's moments, SGD's momentum) gathered and cut per parameter,
anything else (``step``) repeated per parameter, and the groups' hyperparameters with the
names of their parameters. ``load_full_optim_state_dict`` takes each rank's part back, so a
checkpoint saved on one world size loads on another.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from typing import TYPE_CHECKING, Any, Callable, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple

import torch

from .ddp import agree_layout
from .torch_arrays import _operand
from .sharded import FlatLayout, check_stage, finish_reduce, reduce_shard, shard_groups

if TYPE_CHECKING:
    from .device_mesh import DeviceMesh
    from .process_group import ProcessGroup

_ATTR = "_meshcoll_fsdp_unit"


@dataclasses.dataclass(frozen=True)
class MixedPrecisionPolicy:
    """As torch's of that name (either may be passed): ``param_dtype`` gathers parameters and
    runs forward and backward in that dtype (the shards stay fp32 masters); ``reduce_dtype``
    reduces gradients in it (default: ``param_dtype``); ``output_dtype`` casts the root's
    floating outputs; ``cast_forward_inputs`` casts the root's floating inputs to
    ``param_dtype``."""
    param_dtype: Optional[torch.dtype] = None
    reduce_dtype: Optional[torch.dtype] = None
    output_dtype: Optional[torch.dtype] = None
    cast_forward_inputs: bool = True


@dataclasses.dataclass
class ShardedParameter:
    """One rank's part of a parameter in ``sharded_state_dict()``: elements [start, stop) of
    the parameter flattened, of a parameter of ``shape``."""
    local: torch.Tensor
    start: int
    stop: int
    shape: Tuple[int, ...]


class _Context:
    """What the units of one root share over a step (made at the root's first forward)."""

    def __init__(self) -> None:
        self.order: List[_Unit] = []       # forward order, recorded in the first step
        self.recording = True
        self.pending: List[Tuple[_Unit, Any, Any]] = []  # started reductions: (unit, Work, out)
        self.callback_queued = False
        self.active: List[_Unit] = []      # units whose forward is running
        # CUDA: the streams gathers and reductions run on, two so that a prefetch in backward
        # need not queue behind the reductions before it (as FSDP2's).
        self.gather_stream: Any = None
        self.reduce_stream: Any = None

    def next_of(self, unit: "_Unit", step: int) -> Optional["_Unit"]:
        if self.recording or unit not in self.order:
            return None
        k = self.order.index(unit) + step
        return self.order[k] if 0 <= k < len(self.order) else None


class _Gather(torch.autograd.Function):
    """shard -> the unit's parameters, views of its flat buffer (gathered already); backward
    lays their gradients end to end, one copy each, and hands the flat gradient to the unit
    (Note [The unit's step]). One output per parameter: views of one output would each give
    autograd a gradient of the whole buffer to add up."""

    @staticmethod
    def forward(ctx: Any, shard: torch.Tensor, unit: "_Unit") -> Tuple[torch.Tensor, ...]:
        ctx.unit = unit
        ctx.set_materialize_grads(False)
        full = unit.full
        assert full is not None  # use() waited for the gather
        L = unit.layout  # the unit keeps (and frees) the buffer itself
        return tuple(full[o:o + n].view(s) for o, n, s in zip(L.offsets, L.numels, L.shapes))

    @staticmethod
    def backward(ctx: Any, *grads: Optional[torch.Tensor]) -> Tuple[None, None]:
        unit: _Unit = ctx.unit
        L = unit.layout
        like = next(g for g in grads if g is not None)  # backward runs for some gradient
        parts = [g.reshape(-1) if g is not None else like.new_zeros(n)
                 for g, n in zip(grads, L.numels)]
        if L.padded > L.total:
            parts.append(like.new_zeros(L.padded - L.total))
        unit.post_backward(torch.cat(parts))
        return None, None


def _pack(t: torch.Tensor) -> Any:
    """Saved-tensor pack hook during a resharded unit's forward: a view of an active unit's
    flat buffer is saved as where it lies, so the buffer can be freed (Note [The unit's
    step])."""
    ctx = _current
    if ctx is not None and ctx.active and t.layout == torch.strided and t.device.type != "meta":
        ptr = t.untyped_storage().data_ptr()
        for u in ctx.active:
            if u.full is not None and u.reshard and ptr == u.full.untyped_storage().data_ptr():
                return (u, t.storage_offset(), tuple(t.shape), t.stride())
    return t


def _unpack(x: Any) -> torch.Tensor:
    if isinstance(x, tuple):
        u, offset, shape, stride = x
        u.unshard_for_backward()
        full: torch.Tensor = u.full
        return full.as_strided(shape, stride, offset)
    out: torch.Tensor = x
    return out


_current: Optional[_Context] = None  # the context whose unit's forward is running


class _Unit:
    """One ``fully_shard`` call: its module, its flat shard and the hooks."""

    def __init__(self, module: torch.nn.Module, group: ProcessGroup,
                 replicate: Optional[ProcessGroup], stage: int, reshard: bool, mp: Any,
                 checkpoint: bool, broadcast_from: Optional[int]) -> None:
        self.module, self.group, self.replicate = module, group, replicate
        self.stage, self.checkpoint = stage, checkpoint
        self.reshard_after_forward = reshard and stage == 3
        self.reshard = self.reshard_after_forward
        self.mp = mp
        self.sync = True
        self.ctx: Optional[_Context] = None
        self.is_root = False
        # The parameters of the subtree that no inner unit owns: (module, name, fqn).
        self.entries: List[Tuple[torch.nn.Module, str, str]] = []
        seen: Dict[int, str] = {}
        params: List[torch.nn.Parameter] = []
        for fqn, mod in _modules_outside_units(module):
            for pname, p in list(mod._parameters.items()):
                if p is None or not p.requires_grad:
                    continue
                full = f"{fqn}.{pname}" if fqn else pname
                if id(p) in seen:
                    raise ValueError(f"fully_shard: parameter {full!r} is the same tensor as "
                                     f"{seen[id(p)]!r} (tied weights); meshcoll's flat shards "
                                     "hold each parameter once: untie them or keep the module "
                                     "unsharded")
                seen[id(p)] = full
                self.entries.append((mod, pname, full))
                params.append(p)
        if not params:
            raise ValueError(f"fully_shard: {type(module).__name__} has no parameter that "
                             "requires grad outside the units already made")
        dtypes = {p.dtype for p in params}
        devices = {p.device for p in params}
        if len(dtypes) != 1 or not next(iter(dtypes)).is_floating_point or len(devices) != 1:
            raise TypeError(f"fully_shard: a unit's parameters must share one floating dtype "
                            f"and device (one flat shard), got {sorted(map(str, dtypes))} on "
                            f"{sorted(map(str, devices))}")
        self.dtype = next(iter(dtypes))
        self.device = next(iter(devices))
        self.param_dtype = mp.param_dtype or self.dtype
        self.reduce_dtype = mp.reduce_dtype or self.param_dtype
        self.layout = FlatLayout([e[2] for e in self.entries], [p.shape for p in params],
                                 group.size)
        self.world = group.size * (replicate.size if replicate is not None else 1)
        what = f"meshcoll.torch.fully_shard({type(module).__name__})"
        extra = (f"stage {stage} reshard {self.reshard} param {self.param_dtype} reduce "
                 f"{self.reduce_dtype} replicas {self.world // group.size}")
        for g in (group, replicate):
            if g is not None:
                agree_layout(g, self.layout.lines(str(self.dtype), extra), what)
        with torch.no_grad():
            flat = torch.zeros(self.layout.padded, dtype=self.dtype, device=self.device)
            for p, off, n in zip(params, self.layout.offsets, self.layout.numels):
                flat[off:off + n].copy_(p.reshape(-1))
            if broadcast_from is not None:
                for g in (replicate, group):
                    if g is not None:
                        g.broadcast(self._arr(flat), int(broadcast_from) if g is group else 0)
            lo, hi = self.layout.shard_range(group.rank)
            self.shard = torch.nn.Parameter(flat[lo:hi].clone())
        for mod, pname, _ in self.entries:
            del mod._parameters[pname]
        module.register_parameter("flat_shard", self.shard)
        self.full: Optional[torch.Tensor] = None   # the gathered flat buffer (param_dtype)
        self.full_version = -1                     # the shard's version it was gathered at
        self.gathering: Optional[Tuple[Any, Any]] = None  # (Work, source) of a started gather
        self.acc: Optional[torch.Tensor] = None    # no_sync's running sum of flat gradients
        self._placeholders()
        module.register_forward_pre_hook(self._pre_forward, with_kwargs=True)
        module.register_forward_hook(self._post_forward)
        self._wrap_forward()

    # ---- arrays ------------------------------------------------------------------------
    def _arr(self, t: torch.Tensor) -> Any:
        return _operand(t, self.group, "fully_shard's flat buffer")

    def _placeholders(self) -> None:
        """Outside its forward a resharded unit's parameters are meta tensors of their shape:
        the memory is gone, and a use outside forward fails loudly."""
        for (mod, pname, _), shape in zip(self.entries, self.layout.shapes):
            mod.__dict__[pname] = torch.empty(shape, dtype=self.param_dtype, device="meta")

    # ---- gathering ---------------------------------------------------------------------
    def start_gather(self) -> None:
        """Starts the all-gather of the flat buffer unless it is current or under way."""
        if self.gathering is not None:
            return
        if self.full is not None and self.full_version == self.shard._version:
            return  # current (a stage-3 unit whose backward never ran keeps a stale one)
        src = self.shard.detach().to(self.param_dtype)
        if self.full is None or self.stage == 3:  # stages 1-2 gather into their own again
            self.full = torch.empty(self.layout.padded, dtype=self.param_dtype,
                                    device=self.device)
        self.full_version = self.shard._version
        out = self._arr(self.full).reshape(self.group.size, -1)
        ctx = self.ctx
        stream = ctx.gather_stream if ctx is not None else None
        if stream is not None:  # CUDA: gather on the gather stream
            stream.wait_stream(torch.cuda.current_stream())
            src.record_stream(stream)
            self.full.record_stream(stream)
            work = _SideStreamCall(stream, lambda: self.group.all_gather(
                self._arr(src), out=out, stream=stream))
        else:
            work = self.group.all_gather(self._arr(src), out=out, async_op=True)
        self.gathering = (work, src)

    def wait_gather(self) -> None:
        self.start_gather()
        if self.gathering is not None:
            work, _ = self.gathering
            self.gathering = None
            work.wait(stream=_compute_stream(self.ctx))  # CUDA: the host goes on

    def free(self) -> None:
        if self.stage == 3:
            if self.gathering is not None:  # a prefetch this step did not use: let it land
                self.gathering[0].wait(stream=_compute_stream(self.ctx))
                self.gathering = None
            self.full = None
            self._placeholders()

    def use(self) -> None:
        """Gathered flat buffer -> the module's parameters, through _Gather (autograd)."""
        self.wait_gather()
        views = _Gather.apply(self.shard, self)  # type: ignore[no-untyped-call, unused-ignore]
        for (mod, pname, _), view in zip(self.entries, views):
            mod.__dict__[pname] = view

    def unshard_for_backward(self) -> None:
        first = self.full is None or self.gathering is not None
        self.wait_gather()
        if first and self.ctx is not None:
            prev = self.ctx.next_of(self, -1)
            if prev is not None and prev.reshard:
                prev.start_gather()

    # ---- forward -----------------------------------------------------------------------
    def _pre_forward(self, module: torch.nn.Module, args: Tuple[Any, ...],
                     kwargs: Dict[str, Any]) -> Tuple[Tuple[Any, ...], Dict[str, Any]]:
        if self.ctx is None:
            self._become_root()
        ctx = self.ctx
        assert ctx is not None
        if self.is_root:
            if ctx.order:
                ctx.recording = False
            if self.mp.param_dtype is not None and self.mp.cast_forward_inputs:
                args, kwargs = _cast((args, kwargs), self.mp.param_dtype)
        if ctx.recording:
            ctx.order.append(self)
        self.start_gather()
        nxt = ctx.next_of(self, 1)
        if nxt is not None:
            nxt.start_gather()  # prefetch: runs while this unit computes
        if not self.checkpoint:
            self.use()
        return args, kwargs

    def _post_forward(self, module: torch.nn.Module, args: Any, output: Any) -> Any:
        if self.reshard:
            self.free()
        if self.is_root and self.mp.output_dtype is not None:
            output = _cast(output, self.mp.output_dtype)
        return output

    def _become_root(self) -> None:
        units = [getattr(m, _ATTR) for m in self.module.modules() if hasattr(m, _ATTR)]
        ctx = _Context()
        if self.device.type == "cuda":
            ctx.gather_stream = torch.cuda.Stream(self.device)  # type: ignore[no-untyped-call, unused-ignore]
            ctx.reduce_stream = torch.cuda.Stream(self.device)  # type: ignore[no-untyped-call, unused-ignore]
        for u in units:
            u.ctx = ctx
        self.is_root = True
        self.reshard = False  # its backward comes first: FSDP2 keeps the root's too

    def _wrap_forward(self) -> None:
        """The module's forward runs with the unit marked active and, when resharded, the
        saved-tensor hooks that let it free its parameters (Note [The unit's step]): context
        managers, so an error inside leaves no hook behind. ``checkpoint=True``: it runs under
        torch.utils.checkpoint (non-reentrant), its parameters set inside, so backward
        recomputes it from the inputs, gathering the parameters again."""
        from torch.utils.checkpoint import checkpoint
        inner = self.module.forward

        def run(*args: Any, **kwargs: Any) -> Any:
            self.use()
            return inner(*args, **kwargs)

        def forward(*args: Any, **kwargs: Any) -> Any:
            global _current
            ctx = self.ctx
            assert ctx is not None  # the pre-hook ran
            previous, _current = _current, ctx
            ctx.active.append(self)
            try:
                if not torch.is_grad_enabled():
                    return run(*args, **kwargs) if self.checkpoint else inner(*args, **kwargs)
                if self.checkpoint:
                    return checkpoint(run, *args, use_reentrant=False, **kwargs)
                if not self.reshard:
                    return inner(*args, **kwargs)
                with torch.autograd.graph.saved_tensors_hooks(_pack, _unpack):
                    return inner(*args, **kwargs)
            finally:
                ctx.active.remove(self)
                _current = previous
        self.module.forward = forward

    # ---- backward ----------------------------------------------------------------------
    def post_backward(self, grad: torch.Tensor) -> None:
        ctx = self.ctx
        assert ctx is not None
        g = grad.contiguous()
        if not ctx.callback_queued:
            ctx.callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)
        self.free()
        if not self.sync:  # no_sync: keep this rank's sum; the next synchronised step sends it
            g = g.to(self.dtype)
            self.acc = g.clone() if self.acc is None else self.acc.add_(g)
            return
        if self.acc is not None:
            g = self.acc.add_(g)
            self.acc = None
        g = g.to(self.reduce_dtype)
        lo, hi = self.layout.shard_range(self.group.rank)
        out = g[lo:hi] if self.stage == 1 else torch.empty(self.layout.shard_numel,
                                                            dtype=g.dtype, device=g.device)
        stream = ctx.reduce_stream
        if stream is not None:
            stream.wait_stream(torch.cuda.current_stream())
            g.record_stream(stream)
            out.record_stream(stream)
            with torch.cuda.stream(stream):
                work = _SideStreamCall(stream, lambda: reduce_shard(
                    self.group, self.stage, self._arr(g), self._arr(out), async_op=False))
        else:
            work = reduce_shard(self.group, self.stage, self._arr(g), self._arr(out))
        # Not g: the operation holds it until it completes (on a GPU, record_stream), so each
        # unit's full gradient is freed as its reduction ends, not at the end of backward.
        ctx.pending.append((self, work, out))

    def _finish_backward(self) -> None:
        ctx = self.ctx
        assert ctx is not None
        pending, ctx.pending = ctx.pending, []
        ctx.callback_queued = False
        error: Optional[BaseException] = None
        stream = _compute_stream(ctx)
        for unit, work, out in pending:
            try:
                if error is None:
                    finish_reduce(work, unit.replicate, unit._arr(out), stream)
            except BaseException as e:  # the group failed: every later wait fails too
                error = e
                continue
            g = out.to(unit.dtype).div_(unit.world)
            s = unit.shard
            if s.grad is None:
                s.grad = g if g.data_ptr() != out.data_ptr() or unit.stage > 1 else g.clone()
            else:
                s.grad.add_(g)
        if error is not None:
            raise error


def _modules_outside_units(module: torch.nn.Module) -> Iterator[Tuple[str, torch.nn.Module]]:
    """(qualified name, module) of ``module`` and its descendants, not entering units."""
    stack: List[Tuple[str, torch.nn.Module]] = [("", module)]
    while stack:
        fqn, m = stack.pop(0)
        yield fqn, m
        for name, child in m.named_children():
            if not hasattr(child, _ATTR):
                stack.append((f"{fqn}.{name}" if fqn else name, child))


class _SideStreamCall:
    """A synchronous call issued on side stream ``stream`` (Note [The unit's step]): ``wait``
    orders another stream after it, as a Work's ``wait(stream=)`` does, with no array held."""

    def __init__(self, stream: Any, call: Callable[[], Any]) -> None:
        call()
        self.done = torch.cuda.Event()  # type: ignore[no-untyped-call, unused-ignore]
        self.done.record(stream)

    def wait(self, stream: Any = None) -> None:
        if stream is None:
            self.done.synchronize()
        else:
            stream.wait_event(self.done)


def _compute_stream(ctx: Optional[_Context]) -> Any:
    """Where a Work issued on the communication stream is waited for: the current stream
    (CUDA; the host goes on), or None (CPU)."""
    return torch.cuda.current_stream() if ctx is not None and ctx.gather_stream is not None \
        else None


def _cast(x: Any, dtype: torch.dtype) -> Any:
    if isinstance(x, torch.Tensor):
        return x.to(dtype) if x.is_floating_point() else x
    if isinstance(x, (list, tuple)):
        return type(x)(_cast(v, dtype) for v in x)
    if isinstance(x, dict):
        return {k: _cast(v, dtype) for k, v in x.items()}
    return x


# ---- the module class -------------------------------------------------------------------
class ShardedModule:
    """Mixed into a module's class by ``fully_shard`` (as FSDP2's FSDPModule)."""

    def _units(self) -> List[_Unit]:
        return [getattr(m, _ATTR) for m in torch.nn.Module.modules(self)  # type: ignore[arg-type, unused-ignore]
                if hasattr(m, _ATTR)]

    def set_requires_gradient_sync(self, requires_gradient_sync: bool) -> None:
        """False: backward keeps this rank's gradients (summed over backwards) without any
        communication; the next backward with True reduces the sums (FSDP2's call)."""
        for u in self._units():
            u.sync = bool(requires_gradient_sync)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Gradient accumulation without communication inside (as DDP's ``no_sync``)."""
        self.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            self.set_requires_gradient_sync(True)

    def _fqns(self) -> Dict[int, str]:
        return {id(m): n for n, m in torch.nn.Module.named_modules(self)}  # type: ignore[arg-type, unused-ignore]

    def _per_parameter(self, u: _Unit, shard: torch.Tensor) -> List[torch.Tensor]:
        """A shard-shaped tensor of ``u`` (its parameters, or an optimizer state of them)
        gathered from every rank and cut per parameter, each shaped as the parameter
        (collective over the unit's group)."""
        flat = torch.empty(u.layout.padded, dtype=shard.dtype, device=shard.device)
        u.group.all_gather(u._arr(shard.detach()), out=u._arr(flat).reshape(u.group.size, -1))
        return [flat[off:off + n].view(shape).clone() for off, n, shape in
                zip(u.layout.offsets, u.layout.numels, u.layout.shapes)]

    def _names(self, u: _Unit, fqns: Dict[int, str]) -> List[str]:
        out = []
        for mod, pname, _ in u.entries:
            prefix = fqns[id(mod)]
            out.append(f"{prefix}.{pname}" if prefix else pname)
        return out

    def full_state_dict(self) -> Dict[str, torch.Tensor]:
        """The unwrapped model's state dict, on every rank (collective; Note [Sharded state
        dicts])."""
        fqns = self._fqns()
        sd: Dict[str, torch.Tensor] = {}
        for u in self._units():
            sd.update(zip(self._names(u, fqns), self._per_parameter(u, u.shard)))
        for name, b in torch.nn.Module.named_buffers(self):  # type: ignore[arg-type, unused-ignore]
            sd[name] = b.detach().clone()
        return sd

    def sharded_state_dict(self) -> Dict[str, Any]:
        """This rank's part: name -> ShardedParameter, buffers as tensors (no communication)."""
        fqns = self._fqns()
        sd: Dict[str, Any] = {}
        for u in self._units():
            names = self._names(u, fqns)
            shard = u.shard.detach()
            got = {k: (a, b, at) for k, a, b, at in u.layout.pieces(u.group.rank)}
            for k, name in enumerate(names):
                a, b, at = got.get(k, (0, 0, 0))
                sd[name] = ShardedParameter(shard[at:at + b - a].clone(), a, b,
                                            u.layout.shapes[k])
        for name, buf in torch.nn.Module.named_buffers(self):  # type: ignore[arg-type, unused-ignore]
            sd[name] = buf.detach().clone()
        return sd

    def load_full_state_dict(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        """Loads an unwrapped model's state dict: each rank takes its shard (no
        communication)."""
        fqns = self._fqns()
        with torch.no_grad():
            for u in self._units():
                names = self._names(u, fqns)
                missing = [n for n in names if n not in state_dict]
                if missing:
                    raise KeyError(f"load_full_state_dict: missing {missing[:10]}")
                wrong = [f"{n} {tuple(state_dict[n].shape)} (the model's {s})"
                         for n, s in zip(names, u.layout.shapes) if tuple(state_dict[n].shape) != s]
                if wrong:
                    raise ValueError(f"load_full_state_dict: shapes differ: {wrong[:10]}")
                for k, a, b, at in u.layout.pieces(u.group.rank):
                    src = state_dict[names[k]].detach().reshape(-1)[a:b]
                    u.shard[at:at + b - a].copy_(src)
            self._load_buffers(state_dict)

    def load_sharded_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Loads what ``sharded_state_dict()`` gave on this rank, into a model sharded the
        same way."""
        fqns = self._fqns()
        with torch.no_grad():
            for u in self._units():
                names = self._names(u, fqns)
                for k, a, b, at in u.layout.pieces(u.group.rank):
                    piece = state_dict[names[k]]
                    if (piece.start, piece.stop) != (a, b):
                        raise ValueError(f"load_sharded_state_dict: {names[k]!r} holds elements "
                                         f"[{piece.start}, {piece.stop}), this rank's shard "
                                         f"[{a}, {b}): the model is sharded another way; use "
                                         "merge_sharded_state_dicts and load_full_state_dict")
                    u.shard[at:at + b - a].copy_(piece.local)
            self._load_buffers(state_dict)

    def _unit_of_shard(self) -> Dict[int, _Unit]:
        return {id(u.shard): u for u in self._units()}

    def full_optim_state_dict(self, optimizer: torch.optim.Optimizer) -> Dict[str, Any]:
        """``optimizer``'s state as the unwrapped model's optimizer would hold it, keyed by
        parameter name, on every rank (collective; Note [Optimizer state dicts])."""
        units, fqns = self._unit_of_shard(), self._fqns()
        state: Dict[str, Dict[str, Any]] = {}
        groups = []
        for group in optimizer.param_groups:
            names: List[str] = []
            for p in group["params"]:
                u = units.get(id(p))
                if u is None:
                    raise ValueError("full_optim_state_dict: the optimizer holds a parameter "
                                     "that is no unit's flat shard of this model")
                unit_names = self._names(u, fqns)
                names += unit_names
                for key, value in sorted(optimizer.state.get(p, {}).items()):
                    per_name = self._split_state(u, value)
                    for name, v in zip(unit_names, per_name):
                        state.setdefault(name, {})[key] = v
            groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": names})
        return {"state": state, "param_groups": groups}

    def _split_state(self, u: _Unit, value: Any) -> List[Any]:
        """One shard-shaped state tensor gathered and cut per parameter; anything else (a
        step count) the same for each parameter."""
        n = len(u.layout.names)
        if not (isinstance(value, torch.Tensor) and value.dim() == 1
                and value.numel() == u.layout.shard_numel):
            return [value.detach().clone() if isinstance(value, torch.Tensor) else value] * n
        return self._per_parameter(u, value)

    def load_full_optim_state_dict(self, optimizer: torch.optim.Optimizer,
                                   state_dict: Mapping[str, Any]) -> None:
        """Loads what ``full_optim_state_dict`` gave (from this model sharded any way, or
        built from an unwrapped model's optimizer keyed by name) into ``optimizer`` over this
        model's shards: each rank takes its part (no communication)."""
        units, fqns = self._unit_of_shard(), self._fqns()
        saved = state_dict["state"]
        if len(state_dict["param_groups"]) != len(optimizer.param_groups):
            raise ValueError(f"load_full_optim_state_dict: {len(state_dict['param_groups'])} "
                             f"parameter groups saved, the optimizer has "
                             f"{len(optimizer.param_groups)}")
        for group, saved_group in zip(optimizer.param_groups, state_dict["param_groups"]):
            group.update({k: v for k, v in saved_group.items() if k != "params"})
            for p in group["params"]:
                u = units[id(p)]
                names = self._names(u, fqns)
                if not any(n in saved for n in names):
                    continue  # no state saved for this unit yet (as before a first step)
                missing = [n for n in names if n not in saved]
                if missing:
                    raise KeyError(f"load_full_optim_state_dict: no state for {missing[:10]}")
                st: Dict[str, Any] = {}
                for key, first in saved[names[0]].items():
                    values = [saved[n].get(key) for n in names]
                    shaped = any(u.layout.shapes) and all(
                        isinstance(v, torch.Tensor) and tuple(v.shape) == shape
                        for v, shape in zip(values, u.layout.shapes))
                    if not shaped:  # the same for each parameter (a step count)
                        st[key] = first.clone() if isinstance(first, torch.Tensor) else first
                        continue
                    shard = torch.zeros(u.layout.shard_numel, dtype=first.dtype, device=p.device)
                    for k, a, b, at in u.layout.pieces(u.group.rank):
                        shard[at:at + b - a].copy_(saved[names[k]][key].reshape(-1)[a:b])
                    st[key] = shard
                optimizer.state[p] = st

    def _load_buffers(self, state_dict: Mapping[str, Any]) -> None:
        for name, buf in torch.nn.Module.named_buffers(self):  # type: ignore[arg-type, unused-ignore]
            if name in state_dict:
                buf.copy_(state_dict[name])


def merge_sharded_state_dicts(dicts: Sequence[Mapping[str, Any]]) -> Dict[str, torch.Tensor]:
    """The full state dict from every shard's ``sharded_state_dict()`` (of one replica), for
    an unwrapped model's ``load_state_dict``."""
    out: Dict[str, torch.Tensor] = {}
    covered: Dict[str, int] = {}
    for d in dicts:
        for name, v in d.items():
            if not isinstance(v, ShardedParameter):
                out.setdefault(name, v)
                continue
            if name not in out:
                out[name] = torch.zeros(math.prod(v.shape), dtype=v.local.dtype)
                covered[name] = 0
            out[name][v.start:v.stop] = v.local
            covered[name] += v.stop - v.start
    for name, n in covered.items():
        shape = next(d[name].shape for d in dicts if name in d)
        if n < math.prod(shape):
            raise ValueError(f"merge_sharded_state_dicts: {name!r} has {n} of "
                             f"{math.prod(shape)} elements; pass every shard's dict")
        out[name] = out[name].view(shape)
    return out


def fully_shard(module: torch.nn.Module, *, mesh: Optional[DeviceMesh] = None,
                group: Optional[ProcessGroup] = None, stage: int = 3,
                reshard_after_forward: bool = True, mp_policy: Any = None,
                checkpoint: bool = False, broadcast_from: Optional[int] = 0) -> torch.nn.Module:
    """Shard ``module``'s parameters (those not in a unit made before: call it on each block,
    then on the root) over ``group`` or ``mesh`` (a 1-D mesh, or 2-D (replicate, shard) for
    hybrid sharding). Collective over the group: every rank calls it for the same modules in
    the same order; ranks whose units differ get MismatchError naming both ranks.
    ``stage``: 1, 2 or 3 (Note [Flat shards] in sharded.py); ``reshard_after_forward``
    (stage 3): free the gathered parameters after forward and gather them again for
    backward; ``mp_policy``: a MixedPrecisionPolicy (this module's or torch's);
    ``checkpoint``: recompute the unit's forward in its backward (activation checkpointing);
    ``broadcast_from``: the group rank whose parameters every rank starts from (None: each
    its own). Returns ``module``, its class extended by ``ShardedModule``'s methods."""
    if hasattr(module, _ATTR):
        raise ValueError(f"fully_shard: {type(module).__name__} is sharded already")
    stage = check_stage(stage, "fully_shard")
    shard_group, replicate = shard_groups(group, mesh, "fully_shard")
    mp = mp_policy if mp_policy is not None else MixedPrecisionPolicy()
    unit = _Unit(module, shard_group, replicate, stage, bool(reshard_after_forward), mp,
                 bool(checkpoint), broadcast_from)
    setattr(module, _ATTR, unit)
    cls = type(module)
    if not issubclass(cls, ShardedModule):
        if cls not in _CLASSES:
            _CLASSES[cls] = type(f"Sharded{cls.__name__}", (cls, ShardedModule), {})
        module.__class__ = _CLASSES[cls]
    return module


_CLASSES: Dict[type, type] = {}  # module class -> its sharded class (one each)


def clip_grad_norm_(module: torch.nn.Module, max_norm: float) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` (2-norm) over a sharded model: the squared norms of
    the shards' gradients summed over each unit's shard group (collective: every rank calls
    it), the gradients scaled by min(1, max_norm / (norm + 1e-6)) without waiting for the
    device. Returns the total norm (a 0-d float64 tensor on the shards' device)."""
    units = [getattr(m, _ATTR) for m in module.modules() if hasattr(m, _ATTR)]
    if not units:
        raise ValueError("clip_grad_norm_: the module holds no fully_shard unit")
    sums: Dict[int, Tuple[ProcessGroup, torch.Tensor]] = {}
    for u in units:
        group, acc = sums.get(id(u.group), (u.group, torch.zeros(
            1, dtype=torch.float64, device=u.device)))
        if u.shard.grad is not None:  # a missing gradient counts as zeros on this rank
            acc = acc + u.shard.grad.detach().double().pow(2).sum()
        sums[id(u.group)] = (group, acc)
    total = torch.zeros(1, dtype=torch.float64, device=units[0].device)
    for group, acc in sums.values():  # one all-reduce per shard group (hybrid: the shard dim)
        group.all_reduce(_operand(acc, group, "clip_grad_norm_'s sum"), op="sum")
        total = total + acc
    norm = total.sqrt().reshape(())
    coef = torch.clamp(float(max_norm) / (norm + 1e-6), max=1.0)
    for u in units:
        if u.shard.grad is not None:
            u.shard.grad.mul_(coef.to(u.shard.grad.dtype))
    return norm
