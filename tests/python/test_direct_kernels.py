"""The direct kernels' CUDA source (csrc/nccl/direct/direct_kernels.cu, Note [Direct kernels] in
csrc/nccl/direct/direct.h) compiles, with every entry point the NCCL backend may ask NVRTC for. The
source and the entry points are the ones embedded in the compiled module; nvcc stands in for
NVRTC (the same front end), so a broken kernel fails here on a machine without a GPU, not at
a user's first call. Skipped where nvcc is absent; the GPU tests compile through NVRTC.
Tier 2 (no processes, but the compiled module)."""

import shutil
import subprocess

import pytest

from meshcoll import _C

NVCC = shutil.which("nvcc")


def test_every_kind_dtype_and_op_has_an_entry_point():
    source, entries = _C.nccl_direct_kernels()
    assert "__device__ bool barrier(const Args& a, u64* const* flags, u64 token)" in source
    # all_gather, then all_reduce, reduce_scatter and the two-shot all_reduce for 8 dtypes x
    # 4 ops and avg on 4 floats
    assert len(entries) == 1 + 3 * (8 * 4 + 4), len(entries)
    assert any("all_reduce_two_shot<float, Sum>(a)" in e for e in entries)
    assert entries[0].endswith("{ all_gather(a); }")
    assert any("all_reduce<bf16, Avg>(a)" in e for e in entries)
    assert not any("Avg" in e and ("int" in e or "char" in e) for e in entries)


@pytest.mark.timeout(240)
@pytest.mark.skipif(NVCC is None, reason="nvcc is not installed")
def test_the_source_compiles_with_every_entry_point(tmp_path):
    source, entries = _C.nccl_direct_kernels()
    lines = [e.replace("mc_kernel", f"mc_kernel_{i}") for i, e in enumerate(entries)]
    cu = tmp_path / "direct.cu"
    cu.write_text(source + "\n" + "\n".join(lines) + "\n")
    r = subprocess.run([NVCC, "-arch=sm_80", "-std=c++14", "-cubin", "-o",
                        str(tmp_path / "direct.cubin"), str(cu)],
                       capture_output=True, text=True, timeout=220)
    assert r.returncode == 0, r.stderr[-4000:]
    assert (tmp_path / "direct.cubin").stat().st_size > 0
