"""torch tensors as meshcoll operands, for the torch adapters (``meshcoll.torch``'s
DistributedDataParallel and ``fully_shard``): a dense tensor's memory as the array a group
takes (numpy on the CPU backend, the CUDA tensor on NCCL), and back."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import torch

if TYPE_CHECKING:
    from .process_group import ProcessGroup


def _dense(t: torch.Tensor) -> bool:
    """Non-overlapping and dense: its elements fill ``numel`` consecutive places of memory in
    some order (contiguous, channels_last, any permutation), so the memory is one span."""
    if t.is_contiguous():
        return True
    dims = sorted((st, sz) for st, sz in zip(t.stride(), t.shape) if sz != 1)
    expect = 1
    for st, sz in dims:
        if st != expect:
            return False
        expect *= sz
    return True


def _memory(t: torch.Tensor) -> torch.Tensor:
    """A 1-D view of a dense tensor's memory, in memory order."""
    return t if t.is_contiguous() and t.dim() == 1 else t.as_strided((t.numel(),), (1,))


def _operand(t: torch.Tensor, group: ProcessGroup, what: str) -> Any:
    """What DataParallel gets for ``t``: its memory (Note [The adapter's step]), as a numpy
    array on the CPU backend, the detached CUDA tensor itself on NCCL."""
    want = "cuda" if group.backend_name == "nccl" else "cpu"
    if t.device.type != want:
        raise TypeError(f"meshcoll.torch: {what} is on {t.device}, but group {group.name!r} "
                        f"(backend {group.backend_name}) takes {want} tensors; move the module "
                        "(module.to(...)) or init the matching backend")
    if not _dense(t):
        raise ValueError(f"meshcoll.torch: {what} overlaps itself or has gaps (strides "
                         f"{t.stride()} for shape {tuple(t.shape)}); DataParallel averages a "
                         "tensor's memory, so it must be dense (any order of dimensions)")
    t = _memory(t.detach())
    if want == "cuda":
        return t
    if t.dtype == torch.bfloat16:  # numpy has no bf16: view the bits as ml_dtypes.bfloat16
        import ml_dtypes
        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return t.numpy()


def _tensor_of(a: Any) -> torch.Tensor:
    """A tensor sharing the memory of DataParallel's array: a CUDA tensor as is, a numpy
    array (bfloat16 through its bits, as _operand views it) as a CPU tensor."""
    if isinstance(a, torch.Tensor):
        return a
    if a.dtype.name == "bfloat16":
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(a)
