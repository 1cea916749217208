"""PyTorch adapter: ``meshcoll.torch.DistributedDataParallel(module, **kw)``.

    import meshcoll, meshcoll.torch
    meshcoll.init()
    model = meshcoll.torch.DistributedDataParallel(net, bucket_cap_mb=1)
    loss_fn(model(x), y).backward()      # gradients are averaged by the end of backward
    opt.step()

meshcoll does not depend on torch: only importing this module imports it. CPU tensors (CPU
backend) are handed to ``meshcoll.DataParallel`` as numpy views of their own memory
(``Tensor.numpy()``, zero-copy); CUDA tensors (NCCL backend, ``meshcoll.init(backend="nccl")``)
as the tensors themselves, detached. Either way the construction broadcast writes the module's
parameters and ``wait()`` writes the averages into ``p.grad`` directly. A post-accumulate-grad
hook on every parameter feeds ``grad_ready`` the moment autograd has its final gradient, so
bucket all-reduces start during backward; the hook of the last parameter finishes the sync.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any, Callable, Dict, Iterator

import numpy as np
import torch

from .ddp import DataParallel, LocalSGD

if TYPE_CHECKING:
    from .process_group import ProcessGroup


def _operand(t: torch.Tensor, group: ProcessGroup, what: str) -> Any:
    """What DataParallel gets for ``t``: a numpy array sharing a CPU tensor's memory on the
    CPU backend, the detached CUDA tensor itself on NCCL."""
    want = "cuda" if group.backend_name == "nccl" else "cpu"
    if t.device.type != want:
        raise TypeError(f"meshcoll.torch: {what} is on {t.device}, but group {group.name!r} "
                        f"(backend {group.backend_name}) takes {want} tensors; move the module "
                        "(module.to(...)) or init the matching backend")
    if not t.is_contiguous():
        raise ValueError(f"meshcoll.torch: {what} is not contiguous; DataParallel would not "
                         "write into the tensor's own memory")
    t = t.detach()
    if want == "cuda":
        return t
    if t.dtype == torch.bfloat16:  # numpy has no bf16: view the bits as ml_dtypes.bfloat16
        import ml_dtypes
        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return t.numpy()


def _tensor_of(a: np.ndarray) -> torch.Tensor:
    """A CPU tensor sharing the memory of DataParallel's numpy array (bfloat16 through its
    bits, as _operand views it)."""
    if a.dtype.name == "bfloat16":
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(a)


class DistributedDataParallel(torch.nn.Module):
    """Wrap ``module``: averages the gradients of its parameters (those with
    ``requires_grad``) over the group during backward. Keyword arguments go to
    ``meshcoll.DataParallel`` (group, bucket_cap_mb, average, broadcast_from, compression,
    mode). Every such parameter must get a gradient in each synchronised backward; if some
    do not, call ``finish_gradient_sync()``, which names them. Or pass
    ``find_unused_parameters=True`` (as torch's DDP takes it): at the end of each backward the
    parameters this rank did not use count as zero gradients, so ``p.grad`` becomes the
    group's average (zero where no rank used it; torch would leave it None there).

    With ``mode=LocalSGD(k)`` gradients stay local: call ``step()`` after each optimizer
    step, and every k-th call averages the parameters.

    ``gradient_as_bucket_view=True`` (torch's DDP has the same option) makes each ``p.grad``
    a view of its place in DataParallel's buckets (``DataParallel.gradient_buffer``, Note
    [Gradient buffers]): autograd accumulates there and the averages stay there, saving two
    copies per gradient and step. A gradient autograd made anew (after
    ``zero_grad(set_to_none=True)``, torch's default) is copied in once and ``p.grad``
    pointed back at the view; ``zero_grad(set_to_none=False)`` keeps the views."""

    def __init__(self, module: torch.nn.Module, *, find_unused_parameters: bool = False,
                 gradient_as_bucket_view: bool = False, **kw: Any) -> None:
        super().__init__()
        self.module = module
        self._find_unused = bool(find_unused_parameters)
        self._params: Dict[str, torch.nn.Parameter] = {
            n: p for n, p in module.named_parameters() if p.requires_grad}
        if not self._params:
            raise ValueError("meshcoll.torch.DistributedDataParallel: the module has no "
                             "parameter that requires grad")
        from .world import get_world_group
        group = kw.get("group") or get_world_group()
        self.ddp = DataParallel({n: _operand(p.data, group, f"parameter {n!r}")
                                 for n, p in self._params.items()}, **kw)
        # name -> (p.grad's view of the bucket, DataParallel's array of the same memory)
        self._views: Dict[str, Any] = {}
        if gradient_as_bucket_view and not isinstance(kw.get("mode"), LocalSGD):
            for n, p in self._params.items():
                own = self.ddp.gradient_buffer(n)
                view = own if isinstance(own, torch.Tensor) else _tensor_of(own)
                if p.grad is not None:
                    view.copy_(p.grad)
                p.grad = view
                self._views[n] = (view, own)
        self._sync = True
        self._arrived: set[str] = set()  # names whose gradient this backward handed over
        self._local = isinstance(kw.get("mode"), LocalSGD)
        # Each parameter's hook registration, through Any: torch 2.x leaves the method
        # unannotated, and this checks the same with torch's stubs or without torch.
        registers: Dict[str, Any] = {n: p.register_post_accumulate_grad_hook
                                     for n, p in self._params.items()}
        self._handles: list[Any] = [] if self._local else [
            register(self._hook(n)) for n, register in registers.items()]

    def _hook(self, name: str) -> Callable[[torch.Tensor], None]:
        def on_grad(p: torch.Tensor) -> None:
            # Under no_sync() torch itself accumulates into p.grad; the next synchronised
            # backward hands over that sum, so DataParallel must not accumulate again.
            if not self._sync:
                return
            if not self._arrived and self._find_unused:
                # Runs once autograd finished this backward, hooks included (torch's DDP
                # marks unused parameters ready the same way).
                torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
            # The hook runs after autograd accumulated into p.grad: it is set.
            assert p.grad is not None
            self.ddp.grad_ready(name, self._gradient(name, p))
            self._arrived.add(name)
            if len(self._arrived) == len(self._params):
                self.finish_gradient_sync()
        return on_grad

    def _end_of_backward(self) -> None:
        if not self._arrived:
            return  # every parameter arrived: the last hook already finished the sync
        for name, p in self._params.items():
            if name not in self._arrived:
                if p.grad is None:  # an earlier no_sync backward may have left a sum there
                    p.grad = torch.zeros_like(p)
                self.ddp.grad_ready(name, self._gradient(name, p))
        self.finish_gradient_sync()

    def _gradient(self, name: str, p: torch.Tensor) -> Any:
        """What grad_ready gets for ``p.grad``; with bucket views, the view, ``p.grad``
        pointed back at it first if autograd made a new tensor."""
        g = p.grad
        assert g is not None  # set by autograd, or by _end_of_backward
        if name not in self._views:
            return _operand(g, self.ddp.group, f"gradient of {name!r}")
        view, own = self._views[name]
        if g is not view:
            if g.data_ptr() != view.data_ptr():
                view.copy_(g)
            p.grad = view
        return own

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    def finish_gradient_sync(self) -> None:
        """Wait for the bucket all-reduces and write the averages into ``p.grad``. Called by
        the last parameter's hook; call it yourself when some parameters got no gradient
        (it raises, naming them)."""
        self._arrived = set()
        self.ddp.wait()

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
        self.ddp.close()
