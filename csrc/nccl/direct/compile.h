// The direct kernels' compilation (Note [Direct kernels] in direct.h): NVRTC compiles a kernel
// on its first use in the process, and a process-wide cache keeps what was loaded.
#pragma once

#include <string>

#include "nccl/nccl_abi.h"
#include "nccl/nccl_api.h"

namespace meshcoll::nccl {

// The kernels' CUDA source (direct_kernels.cu, embedded as a string at build time).
const char* direct_kernels_source();

// The kernel whose entry point is `entry` (one line that defines mc_kernel, appended to the
// source), loaded in `ctx`: compiled for `arch` ("sm_90") on the first call with that context
// and entry, then taken from the cache. Modules live as long as the process (a context's
// modules go with it).
abi::CUfunction load_direct_kernel(const CudaApi& cu, abi::CUcontext ctx, const std::string& arch,
                                   const std::string& entry);

}  // namespace meshcoll::nccl
