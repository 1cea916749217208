"""Tier 3: float8 on the NCCL backend (NCCL 2.24+; reductions on sm_90+): all_reduce,
all_gather and broadcast against float32 arithmetic on the same float8 values, and both float8
dtypes through torch's fast path and DLPack. Launched as in test_nccl.py."""

from __future__ import annotations

import numpy as np
import pytest

from meshcoll import _C
from test_nccl import HAVE_TORCH_CUDA, OK, gpus, run_nccl

if HAVE_TORCH_CUDA:
    import torch

FP8 = ("float8_e4m3fn", "float8_e5m2")
HAVE_FP8_TORCH = HAVE_TORCH_CUDA and all(hasattr(torch, name) for name in FP8)
NCCL_VERSION = int(_C.nccl_version()) if OK else 0
needs_fp8 = pytest.mark.skipif(
    not HAVE_FP8_TORCH or NCCL_VERSION < 22400,
    reason=("needs PyTorch with float8 dtypes" if not HAVE_FP8_TORCH else
            f"float8 needs NCCL 2.24 or later, loaded {NCCL_VERSION}"))


def _fp8_order(t):
    """Each float8 value's position on the number line (sign-magnitude code -> integer):
    neighbours differ by 1 and +0 == -0, so |a - b| counts ulps between two values."""
    c = t.contiguous().view(torch.uint8).to(torch.int32)
    mag = c & 0x7F
    return torch.where(c >= 0x80, -mag, mag)


def _fp8_inputs(seed, rank, n, name):
    """Rank ``rank``'s float8 input (on the host), reproducible on every rank."""
    import torch
    x = np.random.default_rng([seed, rank]).standard_normal(n) * 3
    return torch.tensor(x, dtype=torch.float32).to(getattr(torch, name))


def _fp8_collectives(pg, n, seed):
    import torch
    fails, r, w = [], pg.rank, pg.size
    for name in FP8:
        ins = [_fp8_inputs(seed, k, n, name) for k in range(w)]
        exact = torch.stack([t.float() for t in ins])  # the fp8 values, exactly, in fp32
        for op, ulps in (("sum", 1), ("max", 0)):
            ref = (exact.sum(0) if op == "sum" else exact.max(0).values).to(ins[0].dtype)
            x = ins[r].cuda()
            pg.all_reduce(x, op=op)
            got = x.cpu()
            diff = (_fp8_order(got) - _fp8_order(ref)).abs()
            if got.float().isnan().any() or int(diff.max()) > ulps:
                i = int(diff.argmax())
                fails.append(f"all_reduce[{op}] {name}: {int((diff > ulps).sum())} beyond "
                             f"{ulps} ulp, first at {i}: got {float(got[i])}, want {float(ref[i])}")
        got = pg.all_gather(ins[r].cuda()).cpu()
        if not torch.equal(got.view(torch.uint8), torch.stack([t.view(torch.uint8) for t in ins])):
            fails.append(f"all_gather {name}: not bit-exact")
        x = ins[r].cuda()
        pg.broadcast(x, src=w - 1)
        if not torch.equal(x.cpu().view(torch.uint8), ins[w - 1].view(torch.uint8)):
            fails.append(f"broadcast {name}: not bit-exact")
    torch.cuda.synchronize()
    return fails


@needs_fp8
@gpus(2)
def test_float8_all_reduce_and_all_gather():
    """all_reduce sum / max of float8 against float32 arithmetic on the same float8 values,
    rounded to float8 (sum within 1 ulp: NCCL may accumulate differently; max exact);
    all_gather and broadcast bit for bit."""
    if torch.cuda.get_device_capability(0) < (9, 0):
        pytest.skip("NCCL builds float8 reduction kernels for sm_90 and later only")
    results = run_nccl(2, _fp8_collectives, n=4099, seed=11)
    fails = [f"rank {r}: {f}" for r, fs in enumerate(results) for f in fs]
    assert not fails, "\n".join(fails)


@needs_fp8
def test_float8_device_arrays():
    """Both float8 dtypes reach the boundary through torch's fast path and through DLPack."""
    for name in FP8:
        t = torch.zeros(8, dtype=getattr(torch, name), device="cuda")
        assert _C.read_array(t, "test", True, True).dtype == name
        try:
            t.__dlpack__()
        except Exception as e:  # an older torch without float8 in DLPack
            pytest.skip(f"torch {torch.__version__} cannot export {name} through DLPack: {e}")

        class OnlyDLPack:
            def __dlpack__(self, stream=None):
                return t.__dlpack__(stream=stream)

            def __dlpack_device__(self):
                return t.__dlpack_device__()

        a = _C.read_array(OnlyDLPack(), "test", True, True)
        assert (a.dtype, a.size, a.ptr) == (name, 8, t.data_ptr())
