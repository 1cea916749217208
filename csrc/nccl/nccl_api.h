// Typed function tables for NCCL and the CUDA driver, filled by dlopen at first use (the
// wheel builds without CUDA). This is the only place that knows library names, search order
// and version differences; nccl_comm.cc asks the tables, never dlsym.
//
// Search order for libnccl.so.2:
//   1. $MESHCOLL_NCCL_LIBRARY (a path; config().nccl_library, Note [Configuration]);
//   2. the paths set by set_nccl_candidates: python/meshcoll/nccl.py passes the
//      nvidia-nccl-cu13 / nvidia-nccl-cu12 wheels' nvidia/nccl/lib/libnccl.so.2;
//   3. the system: dlopen("libnccl.so.2") (LD_LIBRARY_PATH, ld.so.cache).
// libcuda.so.1 comes from the system (it ships with the driver).
#pragma once

#include <string>
#include <utility>
#include <vector>

#include "nccl/nccl_abi.h"

namespace meshcoll::nccl {

struct NcclApi {
  std::string path;  // the file loaded
  int version = 0;   // NCCL_VERSION_CODE, e.g. 22809
  abi::ncclGetVersion_t get_version = nullptr;
  abi::ncclGetUniqueId_t get_unique_id = nullptr;
  abi::ncclCommInitRank_t comm_init_rank = nullptr;
  abi::ncclCommDestroy_t comm_destroy = nullptr;
  abi::ncclCommAbort_t comm_abort = nullptr;
  abi::ncclCommGetAsyncError_t comm_get_async_error = nullptr;
  abi::ncclCommCount_t comm_count = nullptr;
  abi::ncclCommUserRank_t comm_user_rank = nullptr;
  abi::ncclGetErrorString_t get_error_string = nullptr;
  abi::ncclAllReduce_t all_reduce = nullptr;
  abi::ncclReduce_t reduce = nullptr;
  abi::ncclBroadcast_t broadcast = nullptr;
  abi::ncclAllGather_t all_gather = nullptr;
  abi::ncclReduceScatter_t reduce_scatter = nullptr;
  abi::ncclSend_t send = nullptr;
  abi::ncclRecv_t recv = nullptr;
  abi::ncclGroupStart_t group_start = nullptr;
  abi::ncclGroupEnd_t group_end = nullptr;
  // nullptr when the loaded NCCL is older than the version in brackets.
  abi::ncclCommInitRankConfig_t comm_init_rank_config = nullptr;  // [2.14] init with a deadline
  abi::ncclCommFinalize_t comm_finalize = nullptr;                // [2.14]
  abi::ncclCommSplit_t comm_split = nullptr;                      // [2.18]
  abi::ncclGetLastError_t get_last_error = nullptr;               // [2.13]
  abi::ncclMemAlloc_t mem_alloc = nullptr;                        // [2.19]
  abi::ncclMemFree_t mem_free = nullptr;                          // [2.19]
  abi::ncclCommWindowRegister_t window_register = nullptr;        // [2.27]
  abi::ncclCommWindowDeregister_t window_deregister = nullptr;    // [2.27]

  bool has_bf16() const { return version >= abi::nccl_version_code(2, 10, 0); }
  bool has_avg() const { return version >= abi::nccl_version_code(2, 10, 0); }
  // Symmetric windows (Note [Symmetric memory] in symmetric.h): NCCL 2.27 or later.
  bool has_windows() const {
    return mem_alloc && mem_free && window_register && window_deregister &&
           version >= abi::nccl_version_code(2, 27, 0);
  }
  bool has_fp8() const { return version >= abi::nccl_version_code(2, 24, 0); }
  // "NCCL 2.28.9 (/path/libnccl.so.2)"
  std::string describe() const;
  // ncclGetErrorString plus, where available, the comm's last error message.
  std::string error_text(abi::ncclResult_t r, abi::ncclComm_t comm = nullptr) const;
};

struct CudaApi {
  std::string path;
  int driver_version = 0;
  abi::cuInit_t init = nullptr;
  abi::cuDriverGetVersion_t driver_get_version = nullptr;
  abi::cuDeviceGetCount_t device_get_count = nullptr;
  abi::cuDeviceGet_t device_get = nullptr;
  abi::cuDevicePrimaryCtxRetain_t primary_ctx_retain = nullptr;
  abi::cuDevicePrimaryCtxRelease_t primary_ctx_release = nullptr;
  abi::cuCtxGetCurrent_t ctx_get_current = nullptr;
  abi::cuCtxSetCurrent_t ctx_set_current = nullptr;
  abi::cuStreamCreate_t stream_create = nullptr;
  abi::cuStreamCreateWithPriority_t stream_create_with_priority = nullptr;
  abi::cuCtxGetStreamPriorityRange_t ctx_get_stream_priority_range = nullptr;
  abi::cuStreamDestroy_t stream_destroy = nullptr;
  abi::cuStreamWaitEvent_t stream_wait_event = nullptr;
  abi::cuStreamIsCapturing_t stream_is_capturing = nullptr;
  abi::cuThreadExchangeStreamCaptureMode_t thread_exchange_capture_mode = nullptr;
  abi::cuEventCreate_t event_create = nullptr;
  abi::cuEventDestroy_t event_destroy = nullptr;
  abi::cuEventRecord_t event_record = nullptr;
  abi::cuEventQuery_t event_query = nullptr;
  abi::cuEventSynchronize_t event_synchronize = nullptr;
  abi::cuGetErrorString_t get_error_string = nullptr;
  abi::cuGetErrorName_t get_error_name = nullptr;
  abi::cuMemAlloc_t mem_alloc = nullptr;
  abi::cuMemFree_t mem_free = nullptr;
  abi::cuMemcpyHtoDAsync_t memcpy_htod_async = nullptr;
  abi::cuMemcpyDtoHAsync_t memcpy_dtoh_async = nullptr;
  abi::cuMemcpyDtoDAsync_t memcpy_dtod_async = nullptr;
  abi::cuCtxSynchronize_t ctx_synchronize = nullptr;
  abi::cuMemsetD8Async_t memset_d8_async = nullptr;
  // Direct kernels (Note [Direct kernels] in direct/direct.h).
  abi::cuModuleLoadData_t module_load_data = nullptr;
  abi::cuModuleUnload_t module_unload = nullptr;
  abi::cuModuleGetFunction_t module_get_function = nullptr;
  abi::cuLaunchKernel_t launch_kernel = nullptr;
  abi::cuIpcGetMemHandle_t ipc_get_mem_handle = nullptr;
  abi::cuIpcOpenMemHandle_t ipc_open_mem_handle = nullptr;
  abi::cuIpcCloseMemHandle_t ipc_close_mem_handle = nullptr;
  abi::cuMemHostAlloc_t mem_host_alloc = nullptr;
  abi::cuMemFreeHost_t mem_free_host = nullptr;
  abi::cuMemHostGetDevicePointer_t mem_host_get_device_pointer = nullptr;
  abi::cuDeviceGetAttribute_t device_get_attribute = nullptr;
  abi::cuStreamSynchronize_t stream_synchronize = nullptr;

  // "CUDA_ERROR_INVALID_VALUE (invalid argument)"
  std::string error_text(abi::CUresult r) const;
  // Throws meshcoll::Error "<what>: <error_text>" unless r is CUDA_SUCCESS.
  void check(abi::CUresult r, const char* what) const;
};

// Wheel locations to try after $MESHCOLL_NCCL_LIBRARY and before the system. Has an effect
// only before the first successful load.
void set_nccl_candidates(std::vector<std::string> paths);

// NVRTC, the run-time compiler of the direct kernels (Note [Direct kernels] in direct/direct.h).
// Search order: the paths set by set_nvrtc_candidates (python/meshcoll/nccl.py passes the
// nvidia-cuda-nvrtc wheels' libraries), then the system's libnvrtc.so.13, .12, libnvrtc.so.
struct NvrtcApi {
  std::string path;
  int major = 0, minor = 0;
  abi::nvrtcVersion_t version = nullptr;
  abi::nvrtcCreateProgram_t create_program = nullptr;
  abi::nvrtcDestroyProgram_t destroy_program = nullptr;
  abi::nvrtcCompileProgram_t compile_program = nullptr;
  abi::nvrtcGetProgramLogSize_t get_program_log_size = nullptr;
  abi::nvrtcGetProgramLog_t get_program_log = nullptr;
  abi::nvrtcGetCUBINSize_t get_cubin_size = nullptr;
  abi::nvrtcGetCUBIN_t get_cubin = nullptr;
  abi::nvrtcGetErrorString_t get_error_string = nullptr;
};
void set_nvrtc_candidates(std::vector<std::string> paths);
// Loaded on first use (thread-safe); throws meshcoll::Error naming every path tried.
const NvrtcApi& nvrtc();
// The compute capability of CUDA device `device`: {major, minor}.
std::pair<int, int> compute_capability(const CudaApi& cu, int device);
// Compiles CUDA C++ `source` (no #include: NVRTC finds no headers) to a cubin for `arch`
// ("sm_90"); `name` is the file name its log shows. Throws meshcoll::Error with NVRTC's log.
std::vector<char> nvrtc_compile(const std::string& source, const char* name,
                                const std::string& arch);

// Load on first use (thread-safe); throw meshcoll::Error saying which library was tried where.
// A failed load is retried on the next call (the environment may have been fixed).
const NcclApi& nccl();
const CudaApi& cuda();  // also calls cuInit(0)

// Number of visible CUDA devices; throws like cuda().
int cuda_device_count();

// Both libraries load, cuInit succeeds and at least one device is visible. On false,
// *why says what is missing and where it was looked for; on true, it describes what loaded.
bool nccl_available(std::string* why);

}  // namespace meshcoll::nccl
