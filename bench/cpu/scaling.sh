#!/usr/bin/env bash
# Shared-memory all_reduce at scale: meshcoll's scalable path and its flat path (forced with
# MESHCOLL_SHM_ALL_REDUCE; Note [Shared-memory all_reduce paths] in
# csrc/algo/shm_collectives.cc) against Open MPI (mpi4py), float32 and bfloat16 sums from
# 4 KiB to 64 MiB, on 8, 16 and 32 ranks (and 64 where the host has 64 CPUs or more). The
# numbers set the provisional rows of kShmPaths.
#
#   bash bench/cpu/scaling.sh LOGDIR [EXTRA compare_cpu.py ARGS...]
#
# Builds nothing: meshcoll must be installed (pip install .) and mpi4py with Open MPI
# (apt-get install openmpi-bin libopenmpi-dev; pip install mpi4py) for the MPI columns
# (without them compare_cpu.py skips MPI with a note). One log per world size and dtype,
# LOGDIR/all_reduce-N<ranks>-<dtype>.log (the tables) and .jsonl (every record), and
# LOGDIR/summary.txt. Short timing loops (-n 10 -w 3, 3 repeats) keep the whole sweep
# under 8 minutes on a 32-64 core host; extra arguments go to every compare_cpu.py run and
# win over these (e.g. "-n 20 --repeats 5" for quieter numbers, "-e 1M" for a quick look).
set -euo pipefail

if [[ $# -lt 1 || "$1" == -* ]]; then
  echo "usage: $0 LOGDIR [extra compare_cpu.py args]" >&2
  exit 2
fi
logdir=$1
shift
here=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
python=${PYTHON:-python3}
mkdir -p "$logdir"

# WORLDS="4 8" overrides the world sizes (a quick check of the script on a small machine).
if [[ -n "${WORLDS:-}" ]]; then
  read -r -a worlds <<< "$WORLDS"
else
  worlds=(8 16 32)
  if (( $(nproc) >= 64 )); then worlds+=(64); fi
fi

start=$(date +%s)
summary="$logdir/summary.txt"
{
  echo "# bench/cpu/scaling.sh on $(hostname), $(nproc) CPUs, $(date -u '+%Y-%m-%d %H:%M UTC')"
  echo "# meshcoll $("$python" -c 'import meshcoll; print(meshcoll.__version__)' 2>/dev/null || echo '?')"
} > "$summary"
for n in "${worlds[@]}"; do
  for dtype in float32 bfloat16; do
    name="all_reduce-N$n-$dtype"
    echo "== $name" | tee -a "$summary"
    t0=$(date +%s)
    #: the memcpy bandwidth a rank gets while all N copy at once (cpyN).
    "$python" "$here/bench/python/compare_cpu.py" -N "$n" --ops all_reduce --dtype "$dtype" \
      --libs meshcoll-scalable,meshcoll-flat,mpi -b 4K -e 64M -n 10 -w 3 --repeats 3 \
      --stage-timeout 240 --json "$logdir/$name.jsonl" "$@" \
      > "$logdir/$name.log" 2>&1 || echo "   FAILED (see $logdir/$name.log)" | tee -a "$summary"
    grep -v '^# machine' "$logdir/$name.log" | sed 's/^/   /' >> "$summary" || true
    echo "   $(( $(date +%s) - t0 )) s" | tee -a "$summary"
  done
done
echo "# total $(( $(date +%s) - start )) s; tables in $summary" | tee -a "$summary"
