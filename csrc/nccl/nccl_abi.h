// The few NCCL and CUDA driver types and signatures meshcoll calls, declared here so that
// building needs neither the CUDA toolkit nor NCCL's headers. Both libraries
// are loaded at run time (nccl_api.cc); nothing here is linked.
//
// Every value below is part of a stable C ABI: enum values and struct layouts are the ones
// NCCL (nccl.h, 2.7 and later) and the CUDA driver (cuda.h, 11.x and later) publish, and they
// never change between versions. Where a struct grew over versions (ncclConfig_t) we declare
// an older prefix and say so in its `size`/`version` fields, which NCCL reads first.
#pragma once

#include <climits>
#include <cstddef>
#include <cstdint>

namespace meshcoll::nccl::abi {

// ---- NCCL -----------------------------------------------------------------------------
typedef struct ncclComm* ncclComm_t;
typedef struct CUstream_st* cudaStream_t;  // NCCL takes the runtime's stream type: same handle

inline constexpr size_t kUniqueIdBytes = 128;
struct ncclUniqueId {
  char internal[kUniqueIdBytes];
};

typedef enum {
  ncclSuccess = 0,
  ncclUnhandledCudaError = 1,
  ncclSystemError = 2,
  ncclInternalError = 3,
  ncclInvalidArgument = 4,
  ncclInvalidUsage = 5,
  ncclRemoteError = 6,  // 2.13
  ncclInProgress = 7,   // 2.14: non-blocking communicators
  ncclTimeout = 8,      // 2.28
} ncclResult_t;

typedef enum {
  ncclInt8 = 0,
  ncclUint8 = 1,
  ncclInt32 = 2,
  ncclUint32 = 3,
  ncclInt64 = 4,
  ncclUint64 = 5,
  ncclFloat16 = 6,
  ncclFloat32 = 7,
  ncclFloat64 = 8,
  ncclBfloat16 = 9,     // 2.10 (with CUDA 11)
  ncclFloat8e4m3 = 10,  // 2.24 (reductions need sm_90+)
  ncclFloat8e5m2 = 11,  // 2.24
} ncclDataType_t;

typedef enum {
  ncclSum = 0,
  ncclProd = 1,
  ncclMax = 2,
  ncclMin = 3,
  ncclAvg = 4,  // 2.10
} ncclRedOp_t;

inline constexpr int ncclSplitNoColor = -1;          // NCCL_SPLIT_NOCOLOR
inline constexpr unsigned int ncclConfigMagic = 0xcafebeef;  // NCCL_API_MAGIC
inline constexpr int ncclConfigUndefInt = INT_MIN;     // NCCL_CONFIG_UNDEF_INT

constexpr int nccl_version_code(int major, int minor, int patch) {  // NCCL_VERSION(X,Y,Z)
  return (major <= 2 && minor <= 8) ? major * 1000 + minor * 100 + patch
                                    : major * 10000 + minor * 100 + patch;
}

// Note [ncclConfig_t prefix]
// ncclConfig_t is append-only: NCCL reads `size` first, copies at most that many bytes over
// its own defaults (every field "undefined"), and uses `version` for fields whose meaning
// changed. We declare the 2.18 prefix (the first version with ncclCommSplit) and set
// size = sizeof(this prefix), version = 2.18.0. Newer NCCLs keep their defaults for the
// fields we do not send; 2.14-2.17 read only the fields they know (size is clamped).
struct ncclConfig_v21800 {
  size_t size;
  unsigned int magic;
  unsigned int version;
  int blocking;
  int cgaClusterSize;
  int minCTAs;
  int maxCTAs;
  const char* netName;
  int splitShare;
};
inline ncclConfig_v21800 make_config() {
  ncclConfig_v21800 c;
  c.size = sizeof(c);
  c.magic = ncclConfigMagic;
  c.version = static_cast<unsigned int>(nccl_version_code(2, 18, 0));
  c.blocking = ncclConfigUndefInt;
  c.cgaClusterSize = ncclConfigUndefInt;
  c.minCTAs = ncclConfigUndefInt;
  c.maxCTAs = ncclConfigUndefInt;
  c.netName = nullptr;
  c.splitShare = ncclConfigUndefInt;
  return c;
}
using ncclConfig_t = ncclConfig_v21800;

using ncclGetVersion_t = ncclResult_t (*)(int* version);
using ncclGetUniqueId_t = ncclResult_t (*)(ncclUniqueId* id);
using ncclCommInitRank_t = ncclResult_t (*)(ncclComm_t* comm, int nranks, ncclUniqueId id, int rank);
using ncclCommInitRankConfig_t = ncclResult_t (*)(ncclComm_t* comm, int nranks, ncclUniqueId id,
                                                  int rank, ncclConfig_t* config);
using ncclCommSplit_t = ncclResult_t (*)(ncclComm_t comm, int color, int key, ncclComm_t* newcomm,
                                         ncclConfig_t* config);
using ncclCommFinalize_t = ncclResult_t (*)(ncclComm_t comm);
using ncclCommDestroy_t = ncclResult_t (*)(ncclComm_t comm);
using ncclCommAbort_t = ncclResult_t (*)(ncclComm_t comm);
using ncclCommGetAsyncError_t = ncclResult_t (*)(ncclComm_t comm, ncclResult_t* async_error);
using ncclCommCount_t = ncclResult_t (*)(ncclComm_t comm, int* count);
using ncclCommUserRank_t = ncclResult_t (*)(ncclComm_t comm, int* rank);
using ncclGetErrorString_t = const char* (*)(ncclResult_t result);
using ncclGetLastError_t = const char* (*)(ncclComm_t comm);
using ncclAllReduce_t = ncclResult_t (*)(const void* sendbuff, void* recvbuff, size_t count,
                                         ncclDataType_t dt, ncclRedOp_t op, ncclComm_t comm,
                                         cudaStream_t stream);
using ncclReduce_t = ncclResult_t (*)(const void* sendbuff, void* recvbuff, size_t count,
                                      ncclDataType_t dt, ncclRedOp_t op, int root, ncclComm_t comm,
                                      cudaStream_t stream);
using ncclBroadcast_t = ncclResult_t (*)(const void* sendbuff, void* recvbuff, size_t count,
                                         ncclDataType_t dt, int root, ncclComm_t comm,
                                         cudaStream_t stream);
using ncclAllGather_t = ncclResult_t (*)(const void* sendbuff, void* recvbuff, size_t sendcount,
                                         ncclDataType_t dt, ncclComm_t comm, cudaStream_t stream);
using ncclReduceScatter_t = ncclResult_t (*)(const void* sendbuff, void* recvbuff, size_t recvcount,
                                             ncclDataType_t dt, ncclRedOp_t op, ncclComm_t comm,
                                             cudaStream_t stream);
using ncclSend_t = ncclResult_t (*)(const void* sendbuff, size_t count, ncclDataType_t dt, int peer,
                                    ncclComm_t comm, cudaStream_t stream);
using ncclRecv_t = ncclResult_t (*)(void* recvbuff, size_t count, ncclDataType_t dt, int peer,
                                    ncclComm_t comm, cudaStream_t stream);
// Symmetric memory (2.27): memory from ncclMemAlloc (2.19) registered collectively as a window
// of a communicator; ncclWindow_t is opaque. NCCL_WIN_COLL_SYMMETRIC promises that every
// rank passes the same offset into its window, which lets NCCL run its symmetric kernels.
typedef struct ncclWindow_vidmem* ncclWindow_t;
inline constexpr int NCCL_WIN_COLL_SYMMETRIC = 0x01;
using ncclMemAlloc_t = ncclResult_t (*)(void** ptr, size_t size);
using ncclMemFree_t = ncclResult_t (*)(void* ptr);
using ncclCommWindowRegister_t = ncclResult_t (*)(ncclComm_t comm, void* buff, size_t size,
                                                  ncclWindow_t* win, int winFlags);
using ncclCommWindowDeregister_t = ncclResult_t (*)(ncclComm_t comm, ncclWindow_t win);
using ncclGroupStart_t = ncclResult_t (*)();
using ncclGroupEnd_t = ncclResult_t (*)();

// ---- CUDA driver API ----------------------------------------------------------------------
typedef int CUresult;
typedef int CUdevice;
typedef struct CUctx_st* CUcontext;
typedef struct CUstream_st* CUstream;
typedef struct CUevent_st* CUevent;
typedef unsigned long long CUdeviceptr;

inline constexpr CUresult CUDA_SUCCESS = 0;
inline constexpr CUresult CUDA_ERROR_DEINITIALIZED = 4;
inline constexpr CUresult CUDA_ERROR_NO_DEVICE = 100;
inline constexpr CUresult CUDA_ERROR_NOT_READY = 600;
// Special stream handles (cuda.h CU_STREAM_LEGACY / CU_STREAM_PER_THREAD).
inline CUstream cu_stream_legacy() { return reinterpret_cast<CUstream>(uintptr_t{1}); }
inline constexpr unsigned int CU_STREAM_NON_BLOCKING = 0x1;
inline constexpr unsigned int CU_EVENT_DISABLE_TIMING = 0x2;
// CUstreamCaptureStatus / CUstreamCaptureMode
inline constexpr int CU_STREAM_CAPTURE_STATUS_NONE = 0;
inline constexpr int CU_STREAM_CAPTURE_STATUS_ACTIVE = 1;
inline constexpr int CU_STREAM_CAPTURE_MODE_RELAXED = 2;

using cuInit_t = CUresult (*)(unsigned int flags);
using cuDriverGetVersion_t = CUresult (*)(int* version);
using cuDeviceGetCount_t = CUresult (*)(int* count);
using cuDeviceGet_t = CUresult (*)(CUdevice* dev, int ordinal);
using cuDevicePrimaryCtxRetain_t = CUresult (*)(CUcontext* ctx, CUdevice dev);
using cuDevicePrimaryCtxRelease_t = CUresult (*)(CUdevice dev);
using cuCtxGetCurrent_t = CUresult (*)(CUcontext* ctx);
using cuCtxSetCurrent_t = CUresult (*)(CUcontext ctx);
using cuStreamCreate_t = CUresult (*)(CUstream* stream, unsigned int flags);
using cuStreamCreateWithPriority_t = CUresult (*)(CUstream* stream, unsigned int flags, int priority);
using cuCtxGetStreamPriorityRange_t = CUresult (*)(int* least, int* greatest);
using cuStreamDestroy_t = CUresult (*)(CUstream stream);
using cuStreamWaitEvent_t = CUresult (*)(CUstream stream, CUevent event, unsigned int flags);
using cuStreamIsCapturing_t = CUresult (*)(CUstream stream, int* status);
using cuThreadExchangeStreamCaptureMode_t = CUresult (*)(int* mode);
using cuEventCreate_t = CUresult (*)(CUevent* event, unsigned int flags);
using cuEventDestroy_t = CUresult (*)(CUevent event);
using cuEventRecord_t = CUresult (*)(CUevent event, CUstream stream);
using cuEventQuery_t = CUresult (*)(CUevent event);
using cuEventSynchronize_t = CUresult (*)(CUevent event);
using cuGetErrorString_t = CUresult (*)(CUresult error, const char** str);
using cuGetErrorName_t = CUresult (*)(CUresult error, const char** str);
using cuMemAlloc_t = CUresult (*)(CUdeviceptr* dptr, size_t bytes);
using cuMemFree_t = CUresult (*)(CUdeviceptr dptr);
using cuMemcpyHtoDAsync_t = CUresult (*)(CUdeviceptr dst, const void* src, size_t bytes, CUstream s);
using cuMemcpyDtoDAsync_t = CUresult (*)(CUdeviceptr dst, CUdeviceptr src, size_t bytes, CUstream s);
using cuCtxSynchronize_t = CUresult (*)();
using cuMemsetD8Async_t = CUresult (*)(CUdeviceptr dst, unsigned char value, size_t n, CUstream s);
using cuMemcpyDtoHAsync_t = CUresult (*)(void* dst, CUdeviceptr src, size_t bytes, CUstream s);

// Direct kernels (Note [Direct kernels] in direct/direct.h): modules, launches, IPC, mapped
// memory.
typedef struct CUmod_st* CUmodule;
typedef struct CUfunc_st* CUfunction;
struct CUipcMemHandle {
  char reserved[64];  // CU_IPC_HANDLE_SIZE
};
inline constexpr unsigned int CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS = 0x1;
inline constexpr unsigned int CU_MEMHOSTALLOC_PORTABLE = 0x1;
inline constexpr unsigned int CU_MEMHOSTALLOC_DEVICEMAP = 0x2;
inline constexpr int CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR = 75;
inline constexpr int CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR = 76;
using cuModuleLoadData_t = CUresult (*)(CUmodule* module, const void* image);
using cuModuleUnload_t = CUresult (*)(CUmodule module);
using cuModuleGetFunction_t = CUresult (*)(CUfunction* fn, CUmodule module, const char* name);
using cuLaunchKernel_t = CUresult (*)(CUfunction f, unsigned int gx, unsigned int gy,
                                      unsigned int gz, unsigned int bx, unsigned int by,
                                      unsigned int bz, unsigned int shared_bytes, CUstream s,
                                      void** params, void** extra);
using cuIpcGetMemHandle_t = CUresult (*)(CUipcMemHandle* handle, CUdeviceptr dptr);
using cuIpcOpenMemHandle_t = CUresult (*)(CUdeviceptr* dptr, CUipcMemHandle handle,
                                          unsigned int flags);
using cuIpcCloseMemHandle_t = CUresult (*)(CUdeviceptr dptr);
using cuMemHostAlloc_t = CUresult (*)(void** p, size_t bytes, unsigned int flags);
using cuMemFreeHost_t = CUresult (*)(void* p);
using cuMemHostGetDevicePointer_t = CUresult (*)(CUdeviceptr* dptr, void* p, unsigned int flags);
using cuDeviceGetAttribute_t = CUresult (*)(int* value, int attribute, CUdevice dev);
using cuStreamSynchronize_t = CUresult (*)(CUstream stream);

// ---- NVRTC (the run-time compiler of the direct kernels) -----------------------------------
typedef struct _nvrtcProgram* nvrtcProgram;
typedef int nvrtcResult;  // 0: NVRTC_SUCCESS
using nvrtcVersion_t = nvrtcResult (*)(int* major, int* minor);
using nvrtcCreateProgram_t = nvrtcResult (*)(nvrtcProgram* prog, const char* src,
                                             const char* name, int num_headers,
                                             const char* const* headers,
                                             const char* const* include_names);
using nvrtcDestroyProgram_t = nvrtcResult (*)(nvrtcProgram* prog);
using nvrtcCompileProgram_t = nvrtcResult (*)(nvrtcProgram prog, int num_options,
                                              const char* const* options);
using nvrtcGetProgramLogSize_t = nvrtcResult (*)(nvrtcProgram prog, size_t* size);
using nvrtcGetProgramLog_t = nvrtcResult (*)(nvrtcProgram prog, char* log);
using nvrtcGetCUBINSize_t = nvrtcResult (*)(nvrtcProgram prog, size_t* size);
using nvrtcGetCUBIN_t = nvrtcResult (*)(nvrtcProgram prog, char* cubin);
using nvrtcGetErrorString_t = const char* (*)(nvrtcResult r);

}  // namespace meshcoll::nccl::abi
