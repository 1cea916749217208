#include "mpi/mpi_api.h"

#include <dlfcn.h>

#include <atomic>
#include <memory>

#include "common/dtype.h"
#include "common/error.h"
#include "mpi/shim_source.h"  // kShimSource, generated from shim.c
#include "reduce/kernels.h"

namespace meshcoll::mpi {

namespace {
std::mutex g_load_mu;
std::unique_ptr<MpiApi> g_api;  // set once, never freed: MPI stays up until the process ends

// MPI's user-defined reduction for the types it has no standard one of (bool, float16,
// bfloat16): meshcoll's own kernels. The backend checked the pair (check_reduction).
void reduce_with_kernels(int dtype, int op, void* dst, const void* src, size_t n) {
  reduce::lookup(static_cast<DType>(dtype), static_cast<RedOp>(op))(dst, src, n);
}

template <class F>
void bind(void* h, const std::string& path, const char* name, F*& fn) {
  fn = reinterpret_cast<F*>(dlsym(h, name));
  if (!fn)
    throw Error(str_cat("the MPI shim ", path, " has no symbol ", name, "; delete it so that "
                        "meshcoll rebuilds it"));
}
}  // namespace

const char* shim_source() { return kShimSource; }

std::string MpiApi::error_text(int rc) const {
  char buf[512];
  error_string(rc, buf, sizeof buf);
  return str_cat("MPI error ", rc, ": ", buf);
}

MpiApi& load(const std::string& path) {
  std::lock_guard<std::mutex> lock(g_load_mu);
  if (g_api) {
    if (g_api->path != path)
      throw Error(str_cat("MPI is already loaded from ", g_api->path, "; cannot load ", path,
                          " too (one MPI per process)"));
    return *g_api;
  }
  dlerror();
  // RTLD_GLOBAL: Open MPI's plugins (dlopened by libmpi) look up libmpi's symbols globally.
  void* h = dlopen(path.c_str(), RTLD_NOW | RTLD_GLOBAL);
  if (!h) {
    const char* err = dlerror();
    throw Error(str_cat("the MPI shim ", path, " would not load: ", err ? err : "dlopen failed"));
  }
  auto a = std::make_unique<MpiApi>();
  a->path = path;
  bind(h, path, "mc_abi", a->abi);
  if (a->abi() != kShimAbi)
    throw Error(str_cat("the MPI shim ", path, " has ABI ", a->abi(), ", this meshcoll needs ",
                        kShimAbi, "; delete it so that meshcoll rebuilds it"));
  bind(h, path, "mc_thread_multiple", a->thread_multiple);
  bind(h, path, "mc_init", a->init);
  bind(h, path, "mc_finalize", a->finalize);
  bind(h, path, "mc_abort", a->abort);
  bind(h, path, "mc_error_string", a->error_string);
  bind(h, path, "mc_library_version", a->library_version);
  bind(h, path, "mc_comm_world", a->comm_world);
  bind(h, path, "mc_comm_split", a->comm_split);
  bind(h, path, "mc_comm_info", a->comm_info);
  bind(h, path, "mc_comm_free", a->comm_free);
  bind(h, path, "mc_bcast_bytes", a->bcast_bytes);
  bind(h, path, "mc_iallreduce", a->iallreduce);
  bind(h, path, "mc_ireduce", a->ireduce);
  bind(h, path, "mc_ibcast", a->ibcast);
  bind(h, path, "mc_iallgatherv", a->iallgatherv);
  bind(h, path, "mc_ireduce_scatter", a->ireduce_scatter);
  bind(h, path, "mc_ialltoallv", a->ialltoallv);
  bind(h, path, "mc_igatherv", a->igatherv);
  bind(h, path, "mc_iscatterv", a->iscatterv);
  bind(h, path, "mc_ibarrier", a->ibarrier);
  bind(h, path, "mc_isend", a->isend);
  bind(h, path, "mc_irecv", a->irecv);
  bind(h, path, "mc_isendrecv", a->isendrecv);
  bind(h, path, "mc_test", a->test);
  int ours = 0;
  if (int rc = a->init(reduce_with_kernels, &a->rank, &a->size, &a->thread_level, &ours))
    throw Error(str_cat("MPI_Init_thread failed: ", a->error_text(rc)));
  a->ours = ours != 0;
  a->multiple = a->thread_level == a->thread_multiple();
  char version[512];
  a->library_version(version, sizeof version);
  a->version = version;
  if (auto nl = a->version.find('\n'); nl != std::string::npos) a->version.resize(nl);
  g_api = std::move(a);
  return *g_api;
}

MpiApi& api() {
  if (!g_api) throw Error("MPI is not loaded: meshcoll.init(backend='mpi') loads it");
  return *g_api;
}

bool loaded() { return g_api != nullptr; }

std::mutex& mpi_lock() {
  static std::mutex mu;
  return mu;
}

std::atomic<int>& inside_mpi() {
  static std::atomic<int> n{0};
  return n;
}

void abort_job() {
  std::lock_guard<std::mutex> lock(mpi_lock());
  g_api->abort(1);
}

void finalize() {
  if (!g_api) return;
  if (inside_mpi().load() > 0) abort_job();
  std::lock_guard<std::mutex> lock(mpi_lock());
  if (g_api->ours) g_api->finalize();
}

}  // namespace meshcoll::mpi
