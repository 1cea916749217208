#!/usr/bin/env bash
# Builds NVIDIA's nccl-tests from a folder the user names, with MPI (one process per GPU, as
# meshcoll runs), against the NCCL that meshcoll loads, for the GPUs of this machine.
#
#   bash bench/gpu/build_nccl_tests.sh SRC [BUILD]
#
# SRC is a checkout of https://github.com/NVIDIA/nccl-tests (we never vendor its code: keep it
# in a git-ignored folder, e.g. `.nccl-tests/`). BUILD (default SRC/build) receives
# all_reduce_perf, all_gather_perf, reduce_scatter_perf, broadcast_perf. Prints BUILD.
#
# Finds: NCCL from $NCCL_HOME, else the nvidia-nccl-cu13/cu12 wheel of `python3` (headers
# and libnccl.so.2; the wheel has no libnccl.so, so a link is made beside the build); CUDA
# from $CUDA_HOME or nvcc on PATH; Open MPI's folders from `mpicc --showme:incdirs/libdirs`.
# The architecture defaults to the first GPU's (nvidia-smi), e.g. sm_90 on H100/H200.
set -euo pipefail
SRC=${1:?usage: build_nccl_tests.sh SRC [BUILD]}
SRC=$(cd "$SRC" && pwd)
BUILD=${2:-$SRC/build}
PY=${PYTHON:-python3}
mkdir -p "$BUILD"
BUILD=$(cd "$BUILD" && pwd)

if [[ -z "${NCCL_HOME:-}" ]]; then
  NCCL_HOME=$($PY -c 'import nvidia.nccl, os; print(os.path.dirname(nvidia.nccl.__file__) if nvidia.nccl.__file__ else list(nvidia.nccl.__path__)[0])')
fi
[[ -f "$NCCL_HOME/include/nccl.h" ]] || { echo "no nccl.h under $NCCL_HOME/include (set NCCL_HOME)" >&2; exit 1; }
LINKS="$BUILD/.links"
mkdir -p "$LINKS/nccl/lib" "$LINKS/mpi"
ln -sfn "$NCCL_HOME/include" "$LINKS/nccl/include"
for f in "$NCCL_HOME"/lib/libnccl.so*; do ln -sf "$f" "$LINKS/nccl/lib/"; done
[[ -e "$LINKS/nccl/lib/libnccl.so" ]] || ln -sf "$NCCL_HOME/lib/libnccl.so.2" "$LINKS/nccl/lib/libnccl.so"

CUDA_HOME=${CUDA_HOME:-$(dirname "$(dirname "$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)")")}
MPI_INC=$(mpicc --showme:incdirs | awk '{print $1}')
MPI_LIB=$(mpicc --showme:libdirs | awk '{print $1}')
ln -sfn "$MPI_INC" "$LINKS/mpi/include"
ln -sfn "$MPI_LIB" "$LINKS/mpi/lib"

if [[ -z "${NVCC_GENCODE:-}" ]]; then
  cc=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader | head -1 | tr -d '.')
  NVCC_GENCODE="-gencode=arch=compute_${cc},code=sm_${cc}"
fi
make -C "$SRC" -j"$(nproc)" MPI=1 MPI_HOME="$LINKS/mpi" NCCL_HOME="$LINKS/nccl" \
  CUDA_HOME="$CUDA_HOME" NVCC_GENCODE="$NVCC_GENCODE" BUILDDIR="$BUILD" src.build >&2
echo "$BUILD"
