#include "nccl/direct/compile.h"

#include <map>
#include <mutex>
#include <utility>

#include "nccl/direct/direct_kernels_source.h"  // kDirectKernelsSource, generated from direct_kernels.cu

namespace meshcoll::nccl {

using namespace abi;  // NOLINT: the ABI names read best unqualified here

namespace {
// Loaded kernels, by context and entry.
std::mutex& kernels_mu() {
  static std::mutex* m = new std::mutex();
  return *m;
}
std::map<std::pair<CUcontext, std::string>, CUfunction>& kernels() {
  static auto* k = new std::map<std::pair<CUcontext, std::string>, CUfunction>();
  return *k;
}
}  // namespace

const char* direct_kernels_source() { return kDirectKernelsSource; }

CUfunction load_direct_kernel(const CudaApi& cu, CUcontext ctx, const std::string& arch,
                              const std::string& entry) {
  std::lock_guard<std::mutex> lock(kernels_mu());
  auto key = std::make_pair(ctx, entry);
  auto it = kernels().find(key);
  if (it != kernels().end()) return it->second;
  const std::vector<char> cubin = nvrtc_compile(
      std::string(kDirectKernelsSource) + "\n" + entry + "\n", "meshcoll_direct.cu", arch);
  CUmodule mod = nullptr;
  cu.check(cu.module_load_data(&mod, cubin.data()), "cuModuleLoadData (direct kernel)");
  CUfunction fn = nullptr;
  cu.check(cu.module_get_function(&fn, mod, "mc_kernel"), "cuModuleGetFunction (direct kernel)");
  kernels()[key] = fn;
  return fn;
}

}  // namespace meshcoll::nccl
