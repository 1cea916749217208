#!/usr/bin/env bash
# The one script sent to a lent GPU machine (issue 5): builds meshcoll there, runs the GPU
# tests and the NCCL comparison, and leaves every log under $OUT. Prints a short summary last.
#
#   OUT=/tmp/out bash bench/gpu/run_gpu.sh          # build + tests + benchmark
#   STEPS="build tests" bash bench/gpu/run_gpu.sh   # a subset
#   STEPS="perf" bash bench/gpu/run_gpu.sh          # meshcoll-bench --backend nccl + nccl_perf
#
# NVLink multicast stays off everywhere (NCCL_NVLS_ENABLE=0): it can take shared GPUs out of
# service. Variables: PYTHON (python3), NPROCS (all GPUs), MAXBYTES (1G), PYTEST_ARGS,
# BENCH_ARGS (more compare_nccl.py options), TESTS_TIMEOUT, BENCH_TIMEOUT (seconds);
# perf: PERF_MAXBYTES (MAXBYTES), PERF_ITERS (20), PERF_CHECK (1), PERF_ARGS (more
# meshcoll-bench options), PERF_TIMEOUT (300), CPP_PERF_TIMEOUT (150).
# The build step also builds the C++ tools (all_reduce_perf, nccl_perf) into build/bench when
# cmake is on PATH; the perf step runs nccl_perf when it was built.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/meshcoll-gpu}
PY=${PYTHON:-python3}
STEPS=${STEPS:-"build tests bench"}
mkdir -p "$OUT"
cd "$(dirname "$0")/../.."
# The image sets CXX=/opt/gcc/bin/g++; a _C module built with that toolchain crashes (a call
# to address 0 inside std::ostream's number formatting, i.e. any str_cat of a number) when
# Python loads it. The distribution's g++ links the system libstdc++ and works.
if [[ -x /usr/bin/g++ ]]; then export CXX=/usr/bin/g++ CC=/usr/bin/gcc; fi

{
  date -u
  nvidia-smi
  nvidia-smi topo -m
  $PY - <<'PY'
import sys, torch
print(sys.version)
print("torch", torch.__version__, "cuda", torch.version.cuda, "devices", torch.cuda.device_count(),
      "nccl", torch.cuda.nccl.version())
for i in range(torch.cuda.device_count()):
    print(i, torch.cuda.get_device_name(i))
PY
  $PY -m pip list 2>/dev/null | grep -i -E "nccl|cupy|pytest|ml.dtypes|pybind11|scikit"
} > "$OUT/env.txt" 2>&1
grep -E "NVIDIA H|GPU [0-9]|torch " "$OUT/env.txt" | head -8

rc=0
if [[ " $STEPS " == *" build "* ]]; then
  t0=$SECONDS
  rm -rf build  # a CMake cache from another compiler would be reused
  if ! $PY -m pip install --no-build-isolation --no-deps -v . > "$OUT/build.log" 2>&1; then
    echo "BUILD FAILED"; tail -60 "$OUT/build.log"; exit 1
  fi
  echo "build: ok in $((SECONDS - t0)) s"
  (cd /tmp && $PY -c "import meshcoll.nccl as n; print('nccl_available:', n.nccl_available())") 2>&1 | tee "$OUT/available.txt"
  if command -v cmake > /dev/null; then
    t0=$SECONDS
    gen=(); command -v ninja > /dev/null && gen=(-G Ninja)
    if cmake -S . -B build/bench ${gen[@]+"${gen[@]}"} -DMESHCOLL_BUILD_BENCH=ON -DCMAKE_BUILD_TYPE=Release > "$OUT/build_bench.log" 2>&1 &&
       cmake --build build/bench --target nccl_perf all_reduce_perf -j "$(nproc)" >> "$OUT/build_bench.log" 2>&1; then
      echo "build C++ tools: ok in $((SECONDS - t0)) s (build/bench/bench/cpp/nccl_perf)"
    else
      echo "build C++ tools: FAILED (see build_bench.log)"; tail -30 "$OUT/build_bench.log"
    fi
  else
    echo "build C++ tools: skipped (no cmake on PATH)"
  fi
fi

if [[ " $STEPS " == *" tests "* ]]; then
  t0=$SECONDS
  timeout ${TESTS_TIMEOUT:-280} $PY -m pytest -v -p no:cacheprovider tests/gpu ${PYTEST_ARGS:-} > "$OUT/tests.log" 2>&1
  trc=$?
  echo "tests: rc=$trc in $((SECONDS - t0)) s"
  grep -E "PASSED|FAILED|ERROR|SKIPPED|passed|failed" "$OUT/tests.log" | tail -30
  [[ $trc -ne 0 ]] && { rc=1; grep -E "^E |Error|error" "$OUT/tests.log" | head -60; }
fi

if [[ " $STEPS " == *" bench "* ]]; then
  t0=$SECONDS
  timeout ${BENCH_TIMEOUT:-200} $PY bench/python/compare_nccl.py ${NPROCS:+--nprocs $NPROCS} --maxbytes "${MAXBYTES:-1G}" \
    --json "$OUT/compare_nccl.jsonl" ${BENCH_ARGS:-} > "$OUT/compare_nccl.txt" 2> "$OUT/compare_nccl.err"
  brc=$?
  echo "bench: rc=$brc in $((SECONDS - t0)) s"
  [[ $brc -ne 0 ]] && { rc=1; tail -40 "$OUT/compare_nccl.err"; }
  # the summary lines and the 8-byte latency table
  grep -E "^# (GPU|meshcoll|all_|reduce_|broadcast|8-byte|host)|>= 64 MiB|^ +(meshcoll|torch|nccl)" \
    "$OUT/compare_nccl.txt"
fi
if [[ " $STEPS " == *" perf "* ]]; then
  # meshcoll-bench --backend nccl: the NCCL backend through Python, nccl-tests' table.
  t0=$SECONDS
  (timeout ${PERF_TIMEOUT:-300} $PY -m meshcoll.bench --backend nccl ${NPROCS:+-N $NPROCS} \
    --op all_reduce,all_gather,reduce_scatter -b 8 -e "${PERF_MAXBYTES:-${MAXBYTES:-1G}}" -f 2 \
    -n "${PERF_ITERS:-20}" -w 5 -c "${PERF_CHECK:-1}" --repeats 1 --json "$OUT/perf_bench.jsonl" \
    ${PERF_ARGS:-}) > "$OUT/perf_bench.txt" 2> "$OUT/perf_bench.err"
  prc=$?
  echo "perf meshcoll-bench: rc=$prc in $((SECONDS - t0)) s"
  [[ $prc -ne 0 ]] && { rc=1; tail -40 "$OUT/perf_bench.err"; }
  grep -E "^# (meshcoll|Avg|Errors)" "$OUT/perf_bench.txt"
  grep -E "^ +(8|1048576|134217728|1073741824) " "$OUT/perf_bench.txt"

  # nccl_perf: NCCL itself, from C++ (the same columns), when the build step built it.
  tool=build/bench/bench/cpp/nccl_perf
  if [[ -x $tool ]]; then
    t0=$SECONDS
    # The tool loads libnccl.so.2 like meshcoll does but has no Python to find the wheel's.
    lib=$($PY -c "import meshcoll.nccl as n; c = n._wheel_library_candidates(); print(c[0] if c else '')" 2>/dev/null)
    MESHCOLL_NCCL_LIBRARY=${MESHCOLL_NCCL_LIBRARY:-$lib} timeout ${CPP_PERF_TIMEOUT:-150} $tool ${NPROCS:+-N $NPROCS} \
      -p all_reduce,all_gather,reduce_scatter -b 8 -e "${PERF_MAXBYTES:-${MAXBYTES:-1G}}" -f 2 \
      -n "${PERF_ITERS:-20}" -w 5 -c "${PERF_CHECK:-1}" -j "$OUT/perf_cpp.jsonl" \
      > "$OUT/perf_cpp.txt" 2> "$OUT/perf_cpp.err"
    crc=$?
    echo "perf nccl_perf: rc=$crc in $((SECONDS - t0)) s"
    [[ $crc -ne 0 ]] && { rc=1; tail -40 "$OUT/perf_cpp.err"; }
    grep -E "^# (meshcoll|Avg|Errors)" "$OUT/perf_cpp.txt"
    grep -E "^ +(8|1048576|134217728|1073741824) " "$OUT/perf_cpp.txt"
  else
    echo "perf nccl_perf: not built ($tool missing; the build step builds it when cmake is there)"
  fi
fi
exit $rc
