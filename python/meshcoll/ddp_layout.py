"""How DataParallel lays out its buckets, and the array helpers it builds them with:
torch's bucket assignment (``assign_buckets``), the layout every rank must share
(``agree_layout``), streams as the reducer takes them (``stream_handle``), and the few facts
of an array (size, dtype, address, contiguity) read alike from numpy, PyTorch and CuPy.

Note [Agreed layout]
Ranks whose DataParallel holds other parameters (other names, order, shapes or dtypes) would
average gradients of different parameters together without any error: the bucket
all-reduces have the same sizes. So the constructor, and every rebuild, compares a
description of the layout across the group (its 64-bit digest through the group's store,
then the descriptions themselves where the digests differ) and raises MismatchError on every
rank, naming the first difference and the ranks.
"""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Mapping, Tuple

import numpy as np

from . import _C
from .arrays import dtype_name

if TYPE_CHECKING:
    from .process_group import ProcessGroup


def _numel(x: Any) -> int:
    numel = getattr(x, "numel", None)  # PyTorch: size is a method
    return int(numel()) if callable(numel) else int(x.size)


def _dtype_name(x: Any) -> str:
    return dtype_name(x.dtype)


def _operand(group: ProcessGroup, x: Any, what: str, read: bool = True) -> Any:
    """The array DataParallel computes with (Note [Arrays]): a numpy view on the CPU backend;
    on the NCCL backend the caller's own GPU array, detached from autograd so in-place writes
    are allowed. Validated by the backend, unless ``read`` is False and ``x`` is already such
    an array (a gradient: it is compared with its parameter instead)."""
    detach = getattr(x, "detach", None)
    x = detach() if callable(detach) else x
    if not read and (group.backend_name != "cpu" or type(x) is np.ndarray):
        return x
    view = group._as_array(x, what)  # TypeError for the wrong memory, an unsupported dtype, ...
    return view if group.backend_name == "cpu" else x


def _address(x: Any) -> int:
    """The address of an array's first element: PyTorch's ``data_ptr()``, CuPy's
    ``data.ptr``, numpy's array interface."""
    ptr = getattr(x, "data_ptr", None)
    if callable(ptr):
        return int(ptr())
    cupy_ptr = getattr(getattr(x, "data", None), "ptr", None)
    if cupy_ptr is not None:
        return int(cupy_ptr)
    return int(x.__array_interface__["data"][0])


def _contiguous(x: Any) -> bool:
    """C-contiguous: numpy's flag, PyTorch's is_contiguous(), CuPy's flag."""
    flags = getattr(x, "flags", None)
    if flags is not None and hasattr(flags, "c_contiguous"):
        return bool(flags.c_contiguous)
    is_contiguous = getattr(x, "is_contiguous", None)
    return bool(is_contiguous()) if callable(is_contiguous) else True


def stream_handle(s: Any) -> int:
    """A stream as the reducer takes it, a raw CUstream int: PyTorch's raw handle (an int)
    as is, ``.cuda_stream`` (torch.cuda.Stream), ``.ptr`` (CuPy); None: 0, the legacy default
    stream (and the CPU backend's "no stream")."""
    if s is None:
        return 0
    if isinstance(s, int):
        return s
    for attr in ("cuda_stream", "ptr"):
        v = getattr(s, attr, None)
        if isinstance(v, int):
            return v
    raise TypeError(f"not a CUDA stream: {s!r}")


def assign_buckets(order: List[str], params: Mapping[str, Any],
                   limits: List[float]) -> List[List[str]]:
    """Buckets as torch's DDP forms them (``compute_bucket_assignment_by_size``), so the same
    ``bucket_cap_mb`` gives the same all-reduces: gradients taken in ``order``, one open bucket
    per dtype, each closed once it holds at least its limit in bytes (``limits[k]`` for the
    k-th bucket of its dtype, the last limit for the rest); the buckets launch in the order of
    their first gradient in ``order``, each laid out in that order."""
    open_: Dict[str, Tuple[List[str], float, int]] = {}
    done: List[List[str]] = []
    for n in order:
        key = _dtype_name(params[n])
        names, size, k = open_.get(key, ([], 0.0, 0))
        names.append(n)
        size += params[n].nbytes
        if size >= limits[min(k, len(limits) - 1)]:
            done.append(names)
            open_[key] = ([], 0.0, k + 1)
        else:
            open_[key] = (names, size, k)
    done += [names for names, _, _ in open_.values() if names]
    position = {n: i for i, n in enumerate(order)}
    return sorted(done, key=lambda names: position[names[0]])


def agree_layout(group: ProcessGroup, lines: List[str], what: str) -> None:
    """Note [Agreed layout]: every rank of ``group`` passes the same ``lines`` (one per
    parameter), or every rank raises MismatchError naming the first line that differs and
    the ranks. Collective; through the group's store, so host and GPU groups alike."""
    if group.size == 1:
        return
    text = "\n".join(lines)
    digest = hashlib.blake2b(text.encode(), digest_size=8).hexdigest()
    n = group._next_agreement()
    key = f"layout/{n}"
    store = _C.PrefixStore(f"mc/{group.name}/{key}", group._store)
    store.set(f"text/{group.rank}", text)
    try:
        _C.agree_on_settings(store, group.rank, group.size,
                             [(f"{what} layout digest", f"{digest} ({len(lines)} parameters)")],
                             group._setup_timeout(None), group._ranks)
    except _C.MismatchError as e:
        texts = [bytes(store.get(f"text/{r}", timeout=10.0)).decode() for r in range(group.size)]
        other = next(r for r in range(group.size) if texts[r] != texts[0])
        a, b = texts[0].split("\n"), texts[other].split("\n")
        at = next((k for k in range(min(len(a), len(b))) if a[k] != b[k]), min(len(a), len(b)))
        def say(ls: List[str]) -> str:
            return repr(ls[at]) if at < len(ls) else f"nothing (it has {len(ls)} entries)"
        g0, go = group._ranks[0], group._ranks[other]
        raise _C.MismatchError(
            f"{what}: ranks hold different parameters (global rank {g0} and global rank {go} "
            f"differ first at entry {at}: {say(a)} against {say(b)}); every rank must wrap the "
            f"same model, with parameters in the same order, shapes and dtypes ({e})") from None


def _copier(like: Any) -> Callable[[Any, Any], None]:
    """``copy(dst, src)`` for arrays like ``like``, with their own operator: ``copy_`` where
    they have one (PyTorch: several times cheaper than ``dst[...] = src``, which parses an
    index), else ``dst[...] = src`` (numpy, CuPy)."""
    if callable(getattr(like, "copy_", None)):
        return lambda dst, src: dst.copy_(src)

    def assign(dst: Any, src: Any) -> None:
        dst[...] = src
    return assign
