"""PyTorch adapter: ``meshcoll.torch.DistributedDataParallel(module, **kw)``.

    import meshcoll, meshcoll.torch
    meshcoll.init()
    model = meshcoll.torch.DistributedDataParallel(net)
    loss_fn(model(x), y).backward()      # gradients are averaged by the end of backward
    opt.step()

meshcoll does not depend on torch: only importing this module imports it. The wrapper takes
what torch's DDP takes and behaves as it does (Note [The adapter's step]); on the CPU backend
tensors are CPU tensors, on the NCCL backend (``meshcoll.init(backend="nccl")``) CUDA tensors.

Note [The adapter's step]
Each parameter's post-accumulate-grad hook hands its gradient to the C++ reducer (Note
[Reducer] in csrc/reducer/reducer.h) by index and address: one call of a few microseconds,
the hook's only work. The reducer launches each bucket's all-reduce the moment it is complete,
its gradients copied in by one kernel, and the last hook finishes the step: the stream waits
for the all-reduces and one kernel per bucket copies the averages back into ``p.grad`` (none
with ``gradient_as_bucket_view``, where ``p.grad`` is the bucket). No Python runs per bucket.
As torch's DDP:
- parameters in any dense layout (``channels_last``, permuted strides) are taken as their
  memory: the buckets hold that memory's bytes, and a bucket view has the parameter's strides;
- after the first step the buckets are laid out again in the order that step's gradients
  arrived (rank 0's order, for every rank), the first of them 1 MiB so communication starts
  early (``bucket_cap_mb`` 25 for the rest); as torch's, a ``bucket_cap_mb`` given explicitly
  caps the first bucket too;
- module buffers (BatchNorm's running statistics) are broadcast from rank 0 before each forward
  with gradients enabled (``broadcast_buffers=True``), and parameters and buffers at
  construction;
- ranks whose models differ (names, order, shapes, strides, dtypes) get MismatchError at
  construction, naming the first difference (Note [Agreed layout] in ddp_layout.py).
"""

from __future__ import annotations

import contextlib
import math
from typing import TYPE_CHECKING, Any, Callable, Dict, Iterator, List, Optional, Tuple

import numpy as np
import torch

from .ddp import DataParallel, LocalSGD, agree_layout, assign_buckets
from .torch_arrays import _operand, _tensor_of

if TYPE_CHECKING:
    from .process_group import ProcessGroup

_MB = 1 << 20


def _copy_all(dst: List[torch.Tensor], src: List[torch.Tensor]) -> None:
    """dst[k].copy_(src[k]) for every k: one launch where torch has _foreach_copy_ (2.2+)."""
    foreach = getattr(torch, "_foreach_copy_", None)
    if foreach is not None:
        foreach(dst, src)
    else:
        for d, s in zip(dst, src):
            d.copy_(s)


def fp16_compress_hook(state: Any, bucket: Any) -> Any:
    """``register_comm_hook(None, fp16_compress_hook)``: buckets travel as float16 (divided
    by the group size first, so the sum cannot overflow), as torch's hook of that name."""
    raise RuntimeError("fp16_compress_hook is applied by register_comm_hook, not called")


def bf16_compress_hook(state: Any, bucket: Any) -> Any:
    """``register_comm_hook(None, bf16_compress_hook)``: buckets travel as bfloat16."""
    raise RuntimeError("bf16_compress_hook is applied by register_comm_hook, not called")


def _first_bucket_bytes(bucket_cap_mb: Optional[float]) -> float:
    """The cap of the first bucket, as torch's DDP sets it: ``bucket_cap_mb`` itself when the
    caller gave one, else ``torch.distributed._DEFAULT_FIRST_BUCKET_BYTES`` (1 MiB, which
    users may set). On more than 2 ranks another first bucket moves every later bucket's
    elements, and their sums round in another order than torch's (Note [The first step's
    buckets])."""
    if bucket_cap_mb is not None:
        return float(bucket_cap_mb) * _MB
    dist = getattr(torch, "distributed", None)
    return float(getattr(dist, "_DEFAULT_FIRST_BUCKET_BYTES", _MB))


class DistributedDataParallel(torch.nn.Module):
    """Wrap ``module``: averages the gradients of its parameters (those with
    ``requires_grad``) over the group during backward (Note [The adapter's step]). Keyword
    arguments go to ``meshcoll.DataParallel`` (group, bucket_cap_mb, average, compression,
    mode, symmetric).

    - ``find_unused_parameters``: at the end of each backward the parameters this rank did
      not use count as zero gradients, so ``p.grad`` becomes the group's average (zero where
      no rank used it; torch would leave it None there). Without it, every parameter must get
      a gradient in each synchronised backward; if some do not, ``finish_gradient_sync()``
      names them.
    - ``gradient_as_bucket_view``: each ``p.grad`` is a view of its place in the buckets
      (torch's option of that name): autograd accumulates there and the averages stay there,
      saving the two copies per step. A gradient autograd made anew (after
      ``zero_grad(set_to_none=True)``) is averaged into its place (on the CPU straight from
      autograd's tensor, with no copy) and ``p.grad`` pointed back.
    - ``broadcast_buffers``: broadcast the module's buffers from rank 0 before each forward
      (with gradients enabled), as torch's DDP does.
    - ``static_graph``: accepted for torch's signature; every step already costs the same.
    - ``mode=LocalSGD(k)``: gradients stay local; call ``step()`` after each optimizer step,
      and every k-th call averages the parameters. ``mode=BoundedStaleness(k)`` /
      ``Asynchronous(max_staleness)``: ``p.grad`` after backward holds an earlier step's
      average (``meshcoll.DataParallel``'s modes of those names)."""

    def __init__(self, module: torch.nn.Module, *, find_unused_parameters: bool = False,
                 gradient_as_bucket_view: bool = False, broadcast_buffers: bool = True,
                 static_graph: bool = False, **kw: Any) -> None:
        super().__init__()
        self.module = module
        self._find_unused = bool(find_unused_parameters)
        self._as_views = bool(gradient_as_bucket_view)
        self._static_graph = bool(static_graph)
        self._params: Dict[str, torch.nn.Parameter] = {
            n: p for n, p in module.named_parameters() if p.requires_grad}
        self._names = list(self._params)
        if not self._params:
            raise ValueError("meshcoll.torch.DistributedDataParallel: the module has no "
                             "parameter that requires grad")
        from .world import get_world_group
        self._group: ProcessGroup = kw.get("group") or get_world_group()
        self._kw = kw
        self._local = isinstance(kw.get("mode"), LocalSGD)
        agree_layout(self._group,
                     [f"{n} {tuple(t.shape)} {t.stride()} {t.dtype}" for n, t in
                      [*self._params.items(), *module.named_buffers()]],
                     "meshcoll.torch.DistributedDataParallel")
        self.ddp = self._data_parallel(kw)
        self._buffers_sync = [(n, b) for n, b in module.named_buffers()] \
            if broadcast_buffers and self._group.size > 1 else []
        self._buffer_flats: Optional[List[Tuple[Any, List[torch.Tensor], List[torch.Tensor]]]] = None
        self._sync_buffers()  # torch's DDP syncs buffers with the parameters at construction
        self._sync = True
        self._joining = False     # inside join() (Note [Uneven inputs])
        self._join_steps = 0      # this rank's steps inside it
        self._fresh = True        # the next hook is the first of a backward
        self._stream = 0          # the backward's stream (raw CUstream), read at its first hook
        self._rebuilt = self._local  # buckets laid out in backward's order (after step 1)
        self._rebuild_due = False
        self._views: List[torch.Tensor] = []
        # Gradients autograd made anew, read by the reducer (Note [Fresh gradients with views])
        self._keep: Dict[int, torch.Tensor] = {}
        self._host = not next(iter(self._params.values())).is_cuda
        self._slots: List[int] = []
        self._bind()
        # Each parameter's hook registration, through Any: torch 2.x leaves the method
        # unannotated, and this checks the same with torch's stubs or without torch.
        registers: List[Any] = [p.register_post_accumulate_grad_hook
                                for p in self._params.values()]
        self._handles: List[Any] = [] if self._local else [
            register(self._hook(i, p)) for i, (register, p) in
            enumerate(zip(registers, self._params.values()))]

    def _data_parallel(self, kw: Dict[str, Any]) -> DataParallel:
        """The DataParallel over the parameters' memory, its buckets laid out as torch's DDP
        lays out its first ones (Note [The first step's buckets])."""
        flat = {n: _operand(p.data, self._group, f"parameter {n!r}")
                for n, p in self._params.items()}
        self._first_bucket = _first_bucket_bytes(kw.get("bucket_cap_mb"))
        cap = (25 if kw.get("bucket_cap_mb") is None else float(kw["bucket_cap_mb"])) * _MB
        kw = dict(kw, bucket_cap_mb=cap / _MB)
        if "buckets" not in kw:
            rebuilds = kw.get("mode", "sync") == "sync"
            one = rebuilds and (self._static_graph or not self._find_unused)
            groups = assign_buckets(list(flat), flat,
                                    [math.inf] if one else [min(self._first_bucket, cap), cap])
            kw = dict(kw, buckets=groups[::-1])
        return DataParallel(flat, **kw)

    # Note [The first step's buckets]
    # torch's DDP does not know the order gradients arrive in before the first backward, so
    # (without find_unused_parameters, or with static_graph) its first step reduces every
    # gradient in one bucket per dtype, in registration order, after the whole backward; the
    # buckets it rebuilds from the arrival order serve every later step. We do the same,
    # and not only for the timing of one step: on more than 2 ranks the bytes of a sum depend
    # on where an element falls in its bucket (NCCL's ring starts each chunk's sum at another
    # rank), so other first buckets give last-bit differences that training amplifies
    # (docs/performance.md, the training step on 4 GPUs). With find_unused_parameters, torch's first
    # buckets are formed in registration order, the first (of the first layers, the last to
    # launch) at most 1 MiB, launched last layer first; so are ours. A mode that never
    # rebuilds (LocalSGD, the stale modes) keeps those too. "1 MiB" is torch's default only:
    # a bucket_cap_mb given explicitly caps the first bucket too (_first_bucket_bytes): with
    # 1 MiB always, a job that passes bucket_cap_mb (the benchmark's 25) would sum a
    # ResNet-50's rebuilt buckets differently from torch's from the second step on.

    # ---- the step -------------------------------------------------------------------
    def _bind(self) -> None:
        """Reads the reducer's slots, and with bucket views points each ``p.grad`` at its
        slot, shaped and strided as the parameter (after construction and each rebuild)."""
        reducer = self.ddp._reducer
        # A compression hook's buckets are launched by DataParallel (Python, per bucket).
        self._hooked = self.ddp._hook is not None or self.ddp._half is not None
        # A stale mode hands each gradient over as an array (grad_ready): its average comes
        # back at a later step, into the gradient of that step.
        self._stale = len(self.ddp._ring) > 1
        if self._stale:
            self._rebuilt = True  # its steps stay in flight across steps: no rebuild between
            self._ready = self._stale_ready
        elif self._hooked:
            self._ready = lambda i, src, out, stream: self.ddp._ready(i, src, out, None)
        else:
            self._ready = reducer.ready
        self._slots = [reducer.slot_address(i) for i in range(len(self._params))]
        self._views = []
        self._keep.clear()  # between steps: nothing is read
        if not self._as_views or self._local:
            return
        for n, p in self._params.items():
            flat = _tensor_of(self.ddp.gradient_buffer(n))
            view = flat.as_strided(p.shape, p.stride())
            if p.grad is not None:
                view.copy_(p.grad)
            p.grad = view
            self._views.append(view)

    def _hook(self, i: int, param: torch.Tensor) -> Callable[[torch.Tensor], None]:
        stride, dtype = param.stride(), param.dtype

        def on_grad(p: torch.Tensor) -> None:
            # Under no_sync() torch itself accumulates into p.grad; the next synchronised
            # backward hands over that sum.
            if not self._sync:
                return
            if self._fresh:
                self._begin_backward(p)
            g = p.grad
            assert g is not None  # the hook runs after autograd accumulated into p.grad
            if g.stride() != stride or g.dtype != dtype:
                # Set by hand in another layout (autograd keeps the parameter's): copied
                # once into one the reducer can read as memory.
                g = p.grad = torch.empty_like(p).copy_(g)
            if self._views:
                src, out = g.data_ptr(), 0
                if src != self._slots[i]:
                    # Autograd made a new tensor (after zero_grad(set_to_none=True)): the
                    # reducer reads it, so it lives until then (Note [Fresh gradients with
                    # views]); this parameter's previous one is released here.
                    self._keep[i] = g
                    p.grad = self._views[i]
                else:
                    self._keep.pop(i, None)
            else:
                src = out = g.data_ptr()
            if self._ready(i, src, out, self._stream) == 0:
                self._end_step()
        return on_grad

    # Note [Fresh gradients with views]
    # With gradient_as_bucket_view, after zero_grad(set_to_none=True), autograd hands each
    # gradient over as a new tensor; the reducer averages it into the parameter's bucket slot
    # (on the CPU straight from that tensor, Note [In-place gradients] in
    # csrc/reducer/reducer.h) and p.grad becomes the slot's view. The tensor must live until
    # it was read. On a GPU it is released at the step's end (the copy kernels that read it
    # are queued by then). On the CPU it is released when the parameter's next gradient
    # arrives: released together at the step's end, glibc gave the gradients' memory (33.6 MB
    # for 8 x Linear(1024, 1024)) back to the system, and the next backward faulted every page
    # in again, about 6,000 faults and 8 ms a step on the 2-core VM (torch's DDP, which copies
    # each gradient into its bucket and drops it in the hook, reuses it at once). Released one
    # by one as the next ones arrive, each is mostly reused by the next gradient of its size
    # (0-990 faults a step measured, against 1,000-6,100; docs/performance.md). The cost:
    # between steps the last gradients stay allocated, as p.grad's do without bucket views.

    def _stale_ready(self, i: int, src: int, out: int, stream: int) -> int:
        name = self._names[i]
        g = self._params[name].grad
        assert g is not None
        self.ddp.grad_ready(name, _operand(g, self._group, f"gradient of {name!r}"))
        return int(self.ddp._reducer.remaining)

    def _begin_backward(self, p: torch.Tensor) -> None:
        self._fresh = False
        self._stream = torch._C._cuda_getCurrentRawStream(p.get_device()) \
            if p.is_cuda else 0
        if self._find_unused:
            # Runs once autograd finished this backward, hooks included (torch's DDP marks
            # unused parameters ready the same way).
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)

    def _end_of_backward(self) -> None:
        if self._fresh:
            return  # every parameter arrived: the last hook already finished the step
        reducer = self.ddp._reducer
        names = list(self._params)
        for i in reducer.missing():
            p = self._params[names[i]]
            if p.grad is None:  # an earlier no_sync backward may have left a sum there
                p.grad = self._views[i] if self._views else torch.zeros_like(p)
                if self._views:
                    p.grad.zero_()
            g = p.grad
            src, out = (self._slots[i], 0) if self._views else (g.data_ptr(), g.data_ptr())
            self._ready(i, src, out, self._stream)
        self._end_step()

    def _end_step(self) -> None:
        self._fresh = True
        try:
            if self._hooked or self._stale:
                self.ddp.wait()
            else:
                self.ddp._reducer.finish(self._stream)
        finally:
            if not self._host:  # read by queued kernels: released once queued after them
                self._keep.clear()
            if not self._rebuilt:
                self._rebuild_due = True

    def _rebuild(self) -> None:
        """Buckets in the order the first step's gradients arrived (rank 0's, for all)."""
        self._rebuilt, self._rebuild_due = True, False
        order = list(self.ddp._reducer.first_order)
        names = list(self._params)
        if len(order) != len(names):
            return  # the first step did not finish normally: keep the layout
        arr: Any = np.array(order, np.int64)
        if self._group.backend_name == "nccl":
            arr = torch.as_tensor(arr, device=next(iter(self._params.values())).device)
        self._group.broadcast(arr, 0)
        order = [int(i) for i in (arr.tolist() if isinstance(arr, torch.Tensor) else arr)]
        self.ddp.rebuild_buckets([names[i] for i in order],
                                 first_bucket_cap_mb=self._first_bucket / _MB)
        for p in self._params.values():
            if self._views:  # the old views belong to buckets that are gone
                p.grad = None if p.grad is None else p.grad.clone()
        self._bind()

    def _sync_buffers(self, root: int = 0) -> None:
        """Rank ``root``'s buffers to every rank: one broadcast per dtype, through a flat
        array."""
        if not self._buffers_sync:
            return
        if self._buffer_flats is None:
            by_dtype: Dict[torch.dtype, List[torch.Tensor]] = {}
            for _, b in self._buffers_sync:
                by_dtype.setdefault(b.dtype, []).append(b)
            self._buffer_flats = []
            for dt, bufs in by_dtype.items():
                flat = torch.empty(sum(b.numel() for b in bufs), dtype=dt, device=bufs[0].device)
                views, off = [], 0
                for b in bufs:
                    views.append(flat[off:off + b.numel()].view(b.shape))
                    off += b.numel()
                operand = flat if flat.is_cuda else (
                    flat.view(torch.int16).numpy() if dt == torch.bfloat16 else flat.numpy())
                self._buffer_flats.append((operand, bufs, views))
        mine = self._group.rank == root
        for operand, bufs, views in self._buffer_flats:
            with torch.no_grad():
                if mine:
                    _copy_all(views, bufs)
                self._group.broadcast(operand, root)
                if not mine:
                    _copy_all(bufs, views)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if torch.is_grad_enabled():
            if self._joining:
                self._count_active(1)  # Note [Uneven inputs]: this rank steps
                self._join_steps += 1
            self._before_step()
        return self.module(*args, **kwargs)

    def _before_step(self) -> None:
        """The collectives before a training step's forward, in this order on every rank."""
        if self._rebuild_due:
            self._rebuild()
        self._sync_buffers()

    # Note [Uneven inputs]
    # Ranks whose data runs out early stop calling the collectives of a step, and the others
    # would wait for them until their timeout. Inside ``with model.join():`` (torch's DDP has
    # the same context), every forward with gradients first all-reduces how many ranks still
    # step. A rank that left the block stays in the group's calls: it answers 0 to that count
    # and, while others still step, shadows their step (the rebuild and the buffer broadcast
    # if due, and each bucket's all-reduce with zero gradients), so the averages are the sum
    # of the stepping ranks' gradients divided by the whole group's size, as torch's default
    # (divide_by_initial_world_size) does. Once the count is 0 every rank has left, and the
    # rank that stepped most (the last to leave; the lowest such rank) sends its parameters
    # and buffers to the others, so every rank ends with the model of the most steps.
    def _count_active(self, me: int) -> int:
        device = next(iter(self._params.values())).device
        n = torch.tensor([me], dtype=torch.int64, device=device)
        self._group.all_reduce(n if device.type == "cuda" else n.numpy())
        return int(n.item())

    @contextlib.contextmanager
    def join(self) -> Iterator[None]:
        """Train on uneven inputs: every rank runs its own number of steps inside, and those
        that finish early shadow the others' steps until all have finished (Note [Uneven
        inputs]). Every rank of the group must enter it, and inside it make no collective
        call on the group besides the model's own (a rank that finished would pair it with
        its shadow steps; torch's Join asks the same)."""
        if self._local or self._stale or self._hooked:
            raise RuntimeError("join: takes the synchronous mode without compression hooks")
        self._joining = True
        self._join_steps = 0
        try:
            yield
        except BaseException:
            self._joining = False
            raise
        self._joining = False
        reducer = self.ddp._reducer
        while self._count_active(0):
            self._before_step()
            reducer = self.ddp._reducer  # a rebuild makes a new one
            for i in range(len(self._params)):
                at = reducer.slot_address(i)
                self.ddp._slot[self._names[i]][1][...] = 0
                reducer.ready(i, at, 0, self._stream)
            reducer.finish(self._stream)
        steps = self._group.all_gather(np.array([self._join_steps], np.int64)) \
            if self._group.backend_name != "nccl" else self._group.all_gather(
                torch.tensor([self._join_steps], device=next(iter(self._params.values())).device))
        counts = [int(c) for c in
                  (steps.cpu().reshape(-1).tolist() if isinstance(steps, torch.Tensor)
                   else np.asarray(steps).reshape(-1).tolist())]
        last = counts.index(max(counts))
        self.ddp._broadcast_parameters(last)
        self._sync_buffers(root=last)

    def finish_gradient_sync(self) -> None:
        """Wait for the bucket all-reduces and write the averages into ``p.grad``. Called by
        the last parameter's hook; call it yourself when some parameters got no gradient
        (it raises, naming them)."""
        self._fresh = True
        self.ddp.wait()

    # ---- torch's DDP interface ------------------------------------------------------
    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward inside accumulates into ``p.grad`` without communication; the next
        backward outside averages the accumulated gradients."""
        if self._local:
            raise RuntimeError("no_sync: LocalSGD mode never communicates gradients")
        self._sync = False
        try:
            yield
        finally:
            self._sync = True

    def register_comm_hook(self, state: Any, hook: Callable[..., Any]) -> None:
        """Replace each bucket's all-reduce: ``fp16_compress_hook`` / ``bf16_compress_hook``
        (this module's: buckets travel in half precision), or ``hook(state, bucket)`` that
        leaves the *sum* over the group in ``bucket`` once the Work it returns is waited for
        (or returns None once it is there), e.g. through ``meshcoll.all_reduce(bucket,
        async_op=True)``. Before the first backward, as torch's."""
        if self._local:
            raise RuntimeError("register_comm_hook: LocalSGD mode never communicates gradients")
        if self.ddp._reducer.remaining != len(self._params):
            raise RuntimeError("register_comm_hook: a step is in progress")
        compression: Any
        if hook is fp16_compress_hook:
            compression = "fp16"
        elif hook is bf16_compress_hook:
            compression = "bf16"
        else:
            def compression(group: Any, bucket: Any) -> Any:
                return hook(state, _tensor_of(bucket))
        kw = dict(self._kw, compression=compression, broadcast_from=None)
        self.ddp.close()
        self.ddp = self._data_parallel(kw)
        self._kw = kw
        self._bind()

    def step(self) -> None:
        """Call after each optimizer step (LocalSGD averages parameters every k-th call)."""
        self.ddp.step()

    def stats(self) -> Dict[str, float]:
        return self.ddp.stats()

    def close(self) -> None:
        """Remove the hooks and stop the completion thread."""
        for h in self._handles:
            h.remove()
        self._handles = []
        self._keep.clear()
        self.ddp.close()


from .torch_fsdp import (  # noqa: E402,F401
    MixedPrecisionPolicy, clip_grad_norm_, fully_shard, merge_sharded_state_dicts)
