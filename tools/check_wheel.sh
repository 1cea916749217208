#!/usr/bin/env bash
# Checks a built wheel as a user gets it: a fresh venv, no compiler on PATH, the wheel and the
# test extras from binaries only; then that it runs the best reduction kernels this CPU has
# (simd_level() against /proc/cpuinfo) and reduces as fast as a source build (within 10%), the
# README's main job and the CPU tests, run from outside the source tree so that
# `import meshcoll` is the installed wheel.
#
#   bash tools/check_wheel.sh wheelhouse/meshcoll-*-cp311-*.whl [pytest args]
#
# PYTHON picks the interpreter (default python3; it must match the wheel's tag). SOURCE_PYTHON
# is an interpreter whose meshcoll is built from source, to time the wheel against; without it
# the script first builds this tree into the temporary folder (with the compiler, reusing
# build/'s objects). Without pytest args it runs the CPU tests of every folder but gpu/ (about
# 4 minutes on 2 cores); paths given as pytest args must be absolute (the tests run from a
# temporary folder). The temporary folder (~700 MB) is removed at exit.
set -euo pipefail
whl=$(realpath "$1"); shift
src=$(cd "$(dirname "$0")/.." && pwd)
work=$(mktemp -d /tmp/meshcoll-check-XXXXXX)
trap 'rm -rf "$work"' EXIT
"${PYTHON:-python3}" -m venv "$work/venv"
if [ -n "${SOURCE_PYTHON:-}" ]; then
  source_python=$(command -v "$SOURCE_PYTHON")
else
  echo "building $src from source, to time the wheel against"
  "${PYTHON:-python3}" -m venv "$work/source"
  "$work/source/bin/python" -m pip install -q "$src"
  source_python=$work/source/bin/python
fi

# PATH: the venv, and /usr/bin and /bin less every compiler, assembler, linker and build tool.
mkdir "$work/bin"
for f in /usr/local/bin/* /usr/bin/* /bin/*; do
  case $(basename "$f") in
    *gcc* | *g++* | cc | c++ | *-cc | *-c++ | cpp* | *clang* | ld | ld.* | *-ld | *-ld.* | as | *-as | \
      cmake* | ctest | cpack | ninja | make | zig | nvcc | python* | pip*) ;;
    *) [ -e "$work/bin/$(basename "$f")" ] || ln -s "$f" "$work/bin/" ;;
  esac
done
export PATH=$work/venv/bin:$work/bin
for tool in gcc g++ cc c++ clang clang++ cmake ninja zig ld; do
  if command -v "$tool" >/dev/null; then echo "$tool is on PATH: $(command -v "$tool")" >&2; exit 1; fi
done
echo "no compiler on PATH; python: $(command -v python) ($(python --version))"

cd "$work"
python -m pip install -q --only-binary :all: "$whl[test]"
python -c "import meshcoll, meshcoll._C as c; print('meshcoll', meshcoll.__version__, 'from', meshcoll.__file__)"

# The kernels: the level the CPU allows (this test fails, never skips, when the module detects
# less), the source build's level, and no more than 10% slower than the source build.
python -m pytest -q -p no:cacheprovider \
  "$src/tests/reduce/test_kernels.py::test_simd_level_is_the_best_the_cpu_has"
for round in $(seq 10); do   # alternated, best of each: other work on the machine comes and goes
  python "$src/tools/time_reduce.py" 0.3 >>"$work/wheel.jsonl"
  "$source_python" "$src/tools/time_reduce.py" 0.3 >>"$work/source.jsonl"
done
python "$src/tools/time_reduce.py" compare "$work/wheel.jsonl" "$work/source.jsonl"

meshcoll-run -n 4 -m meshcoll.examples.train_ddp --check
if [ $# -eq 0 ]; then
  set -- "$src/tests" --ignore="$src/tests/gpu"
fi
python -m pytest -q -p no:cacheprovider "$@"
