#!/usr/bin/env bash
# The training step on a lent GPU machine (issue 32): builds meshcoll, runs the DDP GPU tests,
# then bench/python/ddp_vs_torch.py on 2 GPUs and on all of them. Logs under $OUT.
#   OUT=/tmp/out bash bench/gpu/ddp_gpu.sh            # build, tests, bench
#   STEPS="build bench" BENCH_ARGS="--model transformer" bash bench/gpu/ddp_gpu.sh
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/meshcoll-ddp}
STEPS=${STEPS:-"build tests bench"}
mkdir -p "$OUT"
cd "$(dirname "$0")/../.."
# The image's CXX (/opt/gcc) builds a _C that crashes on load (bench/gpu/run_gpu.sh says why).
if [[ -x /usr/bin/g++ ]]; then export CXX=/usr/bin/g++ CC=/usr/bin/gcc; fi
N=$(nvidia-smi -L | wc -l)
{ date -u; nvidia-smi -L; nproc; python3 -c "import torch; print('torch', torch.__version__, 'nccl', torch.cuda.nccl.version())"; } > "$OUT/env.txt" 2>&1
head -3 "$OUT/env.txt"
if [[ " $STEPS " == *" build "* ]]; then
  rm -rf build
  python3 -m pip install --no-build-isolation --no-deps . > "$OUT/build.log" 2>&1 || { tail -40 "$OUT/build.log"; exit 1; }
  echo "build ok"
fi
if [[ " $STEPS " == *" tests "* ]]; then
  timeout "${TESTS_TIMEOUT:-330}" python3 -m pytest -q -p no:cacheprovider ${TESTS:-tests/gpu/test_ddp_gpu.py tests/gpu/test_ddp_vs_torch_gpu.py tests/gpu/test_nccl_direct.py} > "$OUT/tests.log" 2>&1
  echo "tests rc=$?"; grep -E "passed|failed|FAILED|Error" "$OUT/tests.log" | tail -12
fi
if [[ " $STEPS " == *" bench "* ]]; then
  for n in ${NS:-2 $N}; do
    timeout "${BENCH_TIMEOUT:-200}" meshcoll-run -n "$n" bench/python/ddp_vs_torch.py --model both --views both --profile --json "$OUT/ddp_$n.jsonl" ${BENCH_ARGS:-} > "$OUT/bench_$n.log" 2>&1
    echo "bench n=$n rc=$?"; grep -E "^\[rank 0\] ( |# (model|machine|profile|  ))" "$OUT/bench_$n.log" | grep -v "^\[rank 0\] #       [0-9]  " | sed 's/^\[rank 0\] //' | head -40
  done
fi
