// Process-wide settings, read from the environment in one place.
//
// Note [Configuration]
// python/meshcoll/_settings.py reads the MESHCOLL_* variables (validating them, naming the
// variable in every error), and the compiled module installs the result with set_config
// once, first thing when _C is imported (csrc/python/bind_config.cc). Code below the Python
// boundary never reads the environment: it asks config(). The defaults below are the documented
// ones (an unset variable), so C++ programs that do not go through Python (bench/cpp) behave
// the same; a bench that honours a variable reads it in its main and calls set_config.
//
// When a field takes effect: host_id, cma, shm_all_reduce, shm_single_copy_bytes, shm_spin_us and fault when a communicator sets up shared memory,
// simd when the kernel table is first built (the first reduction), nccl_* when NCCL is
// loaded or split (nccl_direct_bytes: when a group is made), host_timers at once.
#pragma once

#include <cstddef>
#include <string>

namespace meshcoll {

struct Config {
  std::string host_id;       // MESHCOLL_HOST_ID: same-host identity override ("": derive it)
  bool cma = true;           // MESHCOLL_CMA: cross-memory attach on one host (Note [Cross-memory attach])
  // MESHCOLL_SHM_ALL_REDUCE: which shared-memory all_reduce path: "auto" (by the table in
  // algo/shm_collectives.cc), "flat" (every rank polls every peer) or "scalable".
  std::string shm_all_reduce = "auto";
  // MESHCOLL_SHM_SINGLE_COPY_BYTES: the smallest shared-memory all_reduce that goes single
  // copy where cross-memory attach works (Note [Single-copy all_reduce]); 0: by world size,
  // from the table in cpu/algo/shm_collectives.cc.
  size_t shm_single_copy_bytes = 0;
  // MESHCOLL_SHM_SPIN_US: how long a shared-memory wait for a peer spins before it sleeps on
  // a futex (Note [Spinning] in common/cores.h); -1: by the host (the default).
  long shm_spin_us = -1;
  std::string simd;          // MESHCOLL_SIMD: cap the reduction kernels: baseline, avx2, avx512 ("": no cap)
  bool nccl_trace = false;   // MESHCOLL_NCCL_TRACE: print each NCCL / CUDA loading step to stderr
  std::string nccl_library;  // MESHCOLL_NCCL_LIBRARY: libnccl.so.2 to try first ("": none)
  bool nccl_split = true;    // MESHCOLL_NCCL_SPLIT: subgroups through ncclCommSplit where available
  // MESHCOLL_NCCL_DIRECT_BYTES: the largest call meshcoll's direct kernels take on an NCCL
  // group of one host (Note [Direct kernels] in nccl/direct/direct.h); 0: never.
  size_t nccl_direct_bytes = size_t{256} << 10;
  bool abort_on_error = false;  // MESHCOLL_ON_ERROR=abort: a failed group ends the process
  bool host_timers = false;  // MESHCOLL_HOST_TIMERS: time each fast-path call's steps (Note [Host timers])
  // MESHCOLL_FAULT, for fault-injection tests: "kill@<point>" makes this process SIGKILL
  // itself when it reaches fault_point(<point>), "stop@<point>" SIGSTOP itself (a hung rank,
  // until SIGCONT) ("": never).
  std::string fault;
};

// A copy, taken under a lock: set_config may run while other threads read.
Config config();
// InvalidArgument for a value no field accepts (simd other than the three levels or "").
void set_config(const Config& c);

// Fault injection (Config::fault): the points are the steps of a group's setup, named by
// their store keys (store/exchange.h): "settings" (Note [Shared settings] in store/exchange.h),
// then "shm/host", "shm/created", "shm/mapped", "shm/cma" (Note [Shared-memory lifetime]),
// each reached right after this rank published its value for the step. A point added here
// goes into FAULT_POINTS in python/meshcoll/_settings.py, which refuses any other.
void fault_point(const std::string& point);

}  // namespace meshcoll
