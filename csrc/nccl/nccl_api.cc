#include "nccl/nccl_api.h"

#include <atomic>
#include <cstdio>
#include <memory>
#include <mutex>

#include "common/config.h"
#include "common/error.h"
#include "nccl/dynamic_library.h"

namespace meshcoll::nccl {

namespace {

// MESHCOLL_NCCL_TRACE=1 prints each loading step to stderr (for a crash inside a library).
void trace(const std::string& what) {
  if (config().nccl_trace) std::fprintf(stderr, "[meshcoll nccl] %s\n", what.c_str());
}

// Loading state. Loads happen once per process (under mu); readers on the hot path only
// touch the atomics, which are set after the table is complete.
struct Loader {
  std::mutex mu;
  std::vector<std::string> wheel_candidates;
  std::unique_ptr<NcclApi> nccl;
  std::unique_ptr<CudaApi> cuda;
  std::atomic<const NcclApi*> nccl_ready{nullptr};
  std::atomic<const CudaApi*> cuda_ready{nullptr};
  std::vector<std::string> nvrtc_candidates;
  std::unique_ptr<NvrtcApi> nvrtc;
};

Loader& loader() {
  static Loader* l = new Loader();  // never destroyed: other threads may use it at exit
  return *l;
}

template <class F>
void bind(const DynamicLibrary& lib, F& slot, const char* name) {
  slot = reinterpret_cast<F>(lib.require(name));
}
template <class F>
void bind_optional(const DynamicLibrary& lib, F& slot, const char* name) {
  slot = reinterpret_cast<F>(lib.find(name));
}

// A loaded library's handle must outlive every call through it: kept for the process's life.
void keep_for_process(std::unique_ptr<DynamicLibrary> lib) {
  static auto* keep = new std::vector<std::unique_ptr<DynamicLibrary>>();
  keep->push_back(std::move(lib));
}

std::string version_string(int code) {
  // 2.9 and later: X*10000 + Y*100 + Z; older: X*1000 + Y*100 + Z.
  if (code >= 20900) return str_cat(code / 10000, ".", (code / 100) % 100, ".", code % 100);
  return str_cat(code / 1000, ".", (code / 100) % 10, ".", code % 100);
}

std::unique_ptr<CudaApi> load_cuda() {
  trace("dlopen libcuda.so.1");
  auto lib = DynamicLibrary::open("the CUDA driver (libcuda.so.1)", {"libcuda.so.1"});
  auto api = std::make_unique<CudaApi>();
  api->path = lib.path();
  trace("loaded " + api->path);
  bind(lib, api->init, "cuInit");
  bind(lib, api->driver_get_version, "cuDriverGetVersion");
  bind(lib, api->device_get_count, "cuDeviceGetCount");
  bind(lib, api->device_get, "cuDeviceGet");
  bind(lib, api->primary_ctx_retain, "cuDevicePrimaryCtxRetain");
  // cuda.h maps these names to their _v2 entry points; dlsym needs the real symbol.
  bind(lib, api->primary_ctx_release, "cuDevicePrimaryCtxRelease_v2");
  bind(lib, api->ctx_get_current, "cuCtxGetCurrent");
  bind(lib, api->ctx_set_current, "cuCtxSetCurrent");
  bind(lib, api->stream_create, "cuStreamCreate");
  bind(lib, api->stream_create_with_priority, "cuStreamCreateWithPriority");
  bind(lib, api->ctx_get_stream_priority_range, "cuCtxGetStreamPriorityRange");
  bind(lib, api->stream_destroy, "cuStreamDestroy_v2");
  bind(lib, api->stream_wait_event, "cuStreamWaitEvent");
  bind(lib, api->stream_is_capturing, "cuStreamIsCapturing");
  bind(lib, api->thread_exchange_capture_mode, "cuThreadExchangeStreamCaptureMode");
  bind(lib, api->event_create, "cuEventCreate");
  bind(lib, api->event_destroy, "cuEventDestroy_v2");
  bind(lib, api->event_record, "cuEventRecord");
  bind(lib, api->event_query, "cuEventQuery");
  bind(lib, api->event_synchronize, "cuEventSynchronize");
  bind(lib, api->get_error_string, "cuGetErrorString");
  bind(lib, api->get_error_name, "cuGetErrorName");
  bind(lib, api->mem_alloc, "cuMemAlloc_v2");
  bind(lib, api->mem_free, "cuMemFree_v2");
  bind(lib, api->memcpy_htod_async, "cuMemcpyHtoDAsync_v2");
  bind(lib, api->memcpy_dtoh_async, "cuMemcpyDtoHAsync_v2");
  bind(lib, api->memcpy_dtod_async, "cuMemcpyDtoDAsync_v2");
  bind(lib, api->ctx_synchronize, "cuCtxSynchronize");
  bind(lib, api->memset_d8_async, "cuMemsetD8Async");
  bind(lib, api->module_load_data, "cuModuleLoadData");
  bind(lib, api->module_unload, "cuModuleUnload");
  bind(lib, api->module_get_function, "cuModuleGetFunction");
  bind(lib, api->launch_kernel, "cuLaunchKernel");
  bind(lib, api->ipc_get_mem_handle, "cuIpcGetMemHandle");
  bind(lib, api->ipc_open_mem_handle, "cuIpcOpenMemHandle_v2");
  bind(lib, api->ipc_close_mem_handle, "cuIpcCloseMemHandle");
  bind(lib, api->mem_host_alloc, "cuMemHostAlloc");
  bind(lib, api->mem_free_host, "cuMemFreeHost");
  bind(lib, api->mem_host_get_device_pointer, "cuMemHostGetDevicePointer_v2");
  bind(lib, api->device_get_attribute, "cuDeviceGetAttribute");
  bind(lib, api->stream_synchronize, "cuStreamSynchronize");
  trace("cuInit");
  abi::CUresult r = api->init(0);
  trace(str_cat("cuInit returned ", r));
  if (r != abi::CUDA_SUCCESS)
    throw Error(str_cat("cuInit failed in ", api->path, ": ", api->error_text(r),
                        r == abi::CUDA_ERROR_NO_DEVICE ? " (no CUDA device is visible: check "
                                                         "CUDA_VISIBLE_DEVICES and the driver)"
                                                       : ""));
  api->driver_get_version(&api->driver_version);
  return api;
}

std::unique_ptr<NcclApi> load_nccl(const std::vector<std::string>& wheel_candidates) {
  std::vector<std::string> candidates;
  const std::string from_env = config().nccl_library;  // MESHCOLL_NCCL_LIBRARY
  if (!from_env.empty()) candidates.push_back(from_env);
  for (const auto& c : wheel_candidates) candidates.push_back(c);
  candidates.push_back("libnccl.so.2");
  std::string note = !from_env.empty()
                         ? ""
                         : " (set MESHCOLL_NCCL_LIBRARY to a libnccl.so.2, or pip install "
                           "'meshcoll[cuda13]' or 'meshcoll[cuda12]')";
  std::unique_ptr<DynamicLibrary> lib;
  for (const auto& c : candidates) trace("NCCL candidate " + c);
  try {
    lib = std::make_unique<DynamicLibrary>(DynamicLibrary::open("NCCL (libnccl.so.2)", candidates));
  } catch (const Error& e) {
    throw Error(str_cat(e.what(), note));
  }
  auto api = std::make_unique<NcclApi>();
  api->path = lib->path();
  trace("loaded " + api->path);
  bind(*lib, api->get_version, "ncclGetVersion");
  bind(*lib, api->get_unique_id, "ncclGetUniqueId");
  bind(*lib, api->comm_init_rank, "ncclCommInitRank");
  bind(*lib, api->comm_destroy, "ncclCommDestroy");
  bind(*lib, api->comm_abort, "ncclCommAbort");
  bind(*lib, api->comm_get_async_error, "ncclCommGetAsyncError");
  bind(*lib, api->comm_count, "ncclCommCount");
  bind(*lib, api->comm_user_rank, "ncclCommUserRank");
  bind(*lib, api->get_error_string, "ncclGetErrorString");
  bind(*lib, api->all_reduce, "ncclAllReduce");
  bind(*lib, api->reduce, "ncclReduce");
  bind(*lib, api->broadcast, "ncclBroadcast");
  bind(*lib, api->all_gather, "ncclAllGather");
  bind(*lib, api->reduce_scatter, "ncclReduceScatter");
  bind(*lib, api->send, "ncclSend");
  bind(*lib, api->recv, "ncclRecv");
  bind(*lib, api->group_start, "ncclGroupStart");
  bind(*lib, api->group_end, "ncclGroupEnd");
  bind_optional(*lib, api->comm_init_rank_config, "ncclCommInitRankConfig");
  bind_optional(*lib, api->comm_finalize, "ncclCommFinalize");
  bind_optional(*lib, api->comm_split, "ncclCommSplit");
  bind_optional(*lib, api->get_last_error, "ncclGetLastError");
  bind_optional(*lib, api->mem_alloc, "ncclMemAlloc");
  bind_optional(*lib, api->mem_free, "ncclMemFree");
  bind_optional(*lib, api->window_register, "ncclCommWindowRegister");
  bind_optional(*lib, api->window_deregister, "ncclCommWindowDeregister");
  trace("ncclGetVersion");
  abi::ncclResult_t r = api->get_version(&api->version);
  trace(str_cat("ncclGetVersion returned ", static_cast<int>(r), ", version ", api->version));
  if (r != abi::ncclSuccess)
    throw Error(str_cat("ncclGetVersion failed in ", api->path, ": ", api->error_text(r)));
  if (api->version < abi::nccl_version_code(2, 7, 0))
    throw Error(str_cat(api->describe(), " is too old: meshcoll needs NCCL 2.7 or later "
                                         "(point-to-point send/recv)"));
  keep_for_process(std::move(lib));
  return api;
}

}  // namespace

std::string NcclApi::describe() const {
  return str_cat("NCCL ", version_string(version), " (", path, ")");
}

std::string NcclApi::error_text(abi::ncclResult_t r, abi::ncclComm_t comm) const {
  std::string s = str_cat(get_error_string ? get_error_string(r) : "NCCL error", " (ncclResult ",
                          static_cast<int>(r), ")");
  if (get_last_error) {
    const char* last = get_last_error(comm);
    if (last && *last) s += str_cat(": ", last);
  }
  return s;
}

std::string CudaApi::error_text(abi::CUresult r) const {
  const char* name = nullptr;
  const char* text = nullptr;
  if (get_error_name) get_error_name(r, &name);
  if (get_error_string) get_error_string(r, &text);
  return str_cat(name ? name : "CUDA error", " ", r, " (", text ? text : "no description", ")");
}

void CudaApi::check(abi::CUresult r, const char* what) const {
  if (r != abi::CUDA_SUCCESS) throw Error(str_cat(what, ": ", error_text(r)));
}

static std::unique_ptr<NvrtcApi> load_nvrtc(const std::vector<std::string>& wheel_candidates) {
  std::vector<std::string> candidates = wheel_candidates;
  for (const char* c : {"libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so"}) candidates.push_back(c);
  for (const auto& c : candidates) trace("NVRTC candidate " + c);
  auto lib = std::make_unique<DynamicLibrary>(DynamicLibrary::open("NVRTC (libnvrtc.so)", candidates));
  auto api = std::make_unique<NvrtcApi>();
  api->path = lib->path();
  trace("loaded " + api->path);
  bind(*lib, api->version, "nvrtcVersion");
  bind(*lib, api->create_program, "nvrtcCreateProgram");
  bind(*lib, api->destroy_program, "nvrtcDestroyProgram");
  bind(*lib, api->compile_program, "nvrtcCompileProgram");
  bind(*lib, api->get_program_log_size, "nvrtcGetProgramLogSize");
  bind(*lib, api->get_program_log, "nvrtcGetProgramLog");
  bind(*lib, api->get_cubin_size, "nvrtcGetCUBINSize");
  bind(*lib, api->get_cubin, "nvrtcGetCUBIN");
  bind(*lib, api->get_error_string, "nvrtcGetErrorString");
  api->version(&api->major, &api->minor);
  keep_for_process(std::move(lib));
  return api;
}

void set_nccl_candidates(std::vector<std::string> paths) {
  auto& l = loader();
  std::lock_guard<std::mutex> lock(l.mu);
  l.wheel_candidates = std::move(paths);
}

const CudaApi& cuda() {
  auto& l = loader();
  if (const CudaApi* p = l.cuda_ready.load(std::memory_order_acquire)) return *p;
  std::lock_guard<std::mutex> lock(l.mu);
  if (!l.cuda) l.cuda = load_cuda();
  l.cuda_ready.store(l.cuda.get(), std::memory_order_release);
  return *l.cuda;
}

const NcclApi& nccl() {
  auto& l = loader();
  if (const NcclApi* p = l.nccl_ready.load(std::memory_order_acquire)) return *p;
  std::lock_guard<std::mutex> lock(l.mu);
  if (!l.nccl) l.nccl = load_nccl(l.wheel_candidates);
  l.nccl_ready.store(l.nccl.get(), std::memory_order_release);
  return *l.nccl;
}

int cuda_device_count() {
  const auto& cu = cuda();
  int n = 0;
  cu.check(cu.device_get_count(&n), "cuDeviceGetCount");
  return n;
}

bool nccl_available(std::string* why) {
  std::string text;
  bool ok = false;
  try {
    const auto& cu = cuda();
    trace("cuDeviceGetCount");
    int n = cuda_device_count();
    trace(str_cat(n, " devices"));
    const auto& nc = nccl();
    if (n < 1) {
      text = str_cat("no CUDA device is visible (cuDeviceGetCount returned 0; driver ",
                     cu.path, ")");
    } else {
      ok = true;
      text = str_cat(nc.describe(), ", CUDA driver ", cu.driver_version / 1000, ".",
                     (cu.driver_version % 1000) / 10, " (", cu.path, "), ", n, " device",
                     n == 1 ? "" : "s");
    }
  } catch (const std::exception& e) {
    text = e.what();
  }
  if (why) *why = text;
  return ok;
}

void set_nvrtc_candidates(std::vector<std::string> paths) {
  auto& l = loader();
  std::lock_guard<std::mutex> lock(l.mu);
  l.nvrtc_candidates = std::move(paths);
}

const NvrtcApi& nvrtc() {
  auto& l = loader();
  std::lock_guard<std::mutex> lock(l.mu);
  if (!l.nvrtc) l.nvrtc = load_nvrtc(l.nvrtc_candidates);
  return *l.nvrtc;
}

std::pair<int, int> compute_capability(const CudaApi& cu, int device) {
  abi::CUdevice dev = 0;
  cu.check(cu.device_get(&dev, device), "cuDeviceGet");
  int major = 0, minor = 0;
  cu.check(cu.device_get_attribute(&major, abi::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, dev),
           "cuDeviceGetAttribute");
  cu.check(cu.device_get_attribute(&minor, abi::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, dev),
           "cuDeviceGetAttribute");
  return {major, minor};
}

std::vector<char> nvrtc_compile(const std::string& source, const char* name,
                                const std::string& arch) {
  const NvrtcApi& rt = nvrtc();
  abi::nvrtcProgram prog = nullptr;
  if (abi::nvrtcResult r = rt.create_program(&prog, source.c_str(), name, 0, nullptr, nullptr);
      r != 0)
    throw Error(str_cat("nvrtcCreateProgram: ", rt.get_error_string(r)));
  struct Drop {
    const NvrtcApi& rt;
    abi::nvrtcProgram* p;
    ~Drop() { rt.destroy_program(p); }
  } drop{rt, &prog};
  const std::string gpu = "--gpu-architecture=" + arch;
  const char* opts[] = {gpu.c_str(), "--std=c++14"};
  const abi::nvrtcResult r = rt.compile_program(prog, 2, opts);
  if (r != 0) {
    size_t n = 0;
    rt.get_program_log_size(prog, &n);
    std::string log(n, '\0');
    if (n) rt.get_program_log(prog, log.data());
    throw Error(str_cat("NVRTC ", rt.major, ".", rt.minor, " (", rt.path, ") could not compile ",
                        name, " for ", arch, ": ", rt.get_error_string(r), "\n", log));
  }
  size_t n = 0;
  rt.get_cubin_size(prog, &n);
  std::vector<char> cubin(n);
  rt.get_cubin(prog, cubin.data());
  return cubin;
}

}  // namespace meshcoll::nccl
