// Note [Span copies] in span_copy.h.
#include "nccl/span_copy.h"

#include <map>

#include "common/error.h"
#include "nccl/nccl_internal.h"

namespace meshcoll::nccl {

using namespace abi;  // NOLINT: the ABI names read best unqualified here

namespace {

// No #include: NVRTC finds no headers. Matches SpanArgs below, field for field.
constexpr const char* kSpanCopySource = R"(
typedef unsigned long long u64;
typedef unsigned int u32;
typedef unsigned char u8;
#define MC_SPANS 96
#define MC_CHUNK 16384
struct SpanArgs {
  u64 n;                   // spans
  u64 first[MC_SPANS + 1]; // the first chunk of each span; first[n]: the grid's size
  const u8* src[MC_SPANS];
  u8* dst[MC_SPANS];
  u64 bytes[MC_SPANS];
};
struct __align__(16) V16 { u32 x, y, z, w; };
// 256 threads a block (the launch's): a whole chunk is 1024 16-byte words, four a thread.
extern "C" __global__ void __launch_bounds__(256) mc_copy_spans(SpanArgs a) {
  const u64 c = blockIdx.x;
  int lo = 0, hi = (int)a.n - 1;  // the last span whose first chunk is at most c
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (a.first[mid] <= c) lo = mid; else hi = mid - 1;
  }
  const u8* src = a.src[lo];
  u8* dst = a.dst[lo];
  const u64 begin = (c - a.first[lo]) * MC_CHUNK;
  const u64 end = begin + MC_CHUNK < a.bytes[lo] ? begin + MC_CHUNK : a.bytes[lo];
  u64 i = begin;
  if ((((u64)src | (u64)dst) & 15) == 0) {  // chunks start at multiples of 16 bytes
    const V16* s = (const V16*)(src + begin);
    V16* d = (V16*)(dst + begin);
    const u32 n16 = (u32)((end - begin) / 16);
    const u32 t = threadIdx.x;
    if (n16 == MC_CHUNK / 16) {  // a whole chunk: four loads in flight per thread
      const V16 a0 = s[t], a1 = s[t + 256], a2 = s[t + 512], a3 = s[t + 768];
      d[t] = a0; d[t + 256] = a1; d[t + 512] = a2; d[t + 768] = a3;
    } else {
      for (u32 k = t; k < n16; k += 256) d[k] = s[k];
    }
    i = begin + (u64)n16 * 16;
  } else if ((((u64)src | (u64)dst) & 3) == 0) {
    const u64 vend = begin + ((end - begin) & ~3ull);
    for (u64 j = begin + threadIdx.x * 4; j < vend; j += blockDim.x * 4)
      *(u32*)(dst + j) = *(const u32*)(src + j);
    i = vend;
  }
  for (u64 j = i + threadIdx.x; j < end; j += blockDim.x) dst[j] = src[j];
}
)";

constexpr size_t kChunk = 16384;  // MC_CHUNK

struct SpanArgs {
  uint64_t n;
  uint64_t first[SpanCopier::kMaxSpans + 1];
  const void* src[SpanCopier::kMaxSpans];
  void* dst[SpanCopier::kMaxSpans];
  uint64_t bytes[SpanCopier::kMaxSpans];
};
static_assert(sizeof(SpanArgs) <= 4096, "kernel parameters are limited to 4 KiB");

// Loaded kernels by context: modules live as long as the process (a context's go with it).
std::mutex& span_kernels_mu() {
  static std::mutex* m = new std::mutex();
  return *m;
}
std::map<CUcontext, CUfunction>& span_kernels() {
  static auto* k = new std::map<CUcontext, CUfunction>();
  return *k;
}

}  // namespace

CUfunction SpanCopier::kernel() {
  std::lock_guard<std::mutex> lock(mu_);
  if (loaded_) return fn_;
  loaded_ = true;
  try {
    std::lock_guard<std::mutex> cache(span_kernels_mu());
    auto it = span_kernels().find(ctx_);
    if (it != span_kernels().end()) return fn_ = it->second;
    const auto [major, minor] = compute_capability(cu_, device_);
    const std::vector<char> cubin =
        nvrtc_compile(kSpanCopySource, "meshcoll_span_copy.cu", str_cat("sm_", major, minor));
    CUmodule mod = nullptr;
    cu_.check(cu_.module_load_data(&mod, cubin.data()), "cuModuleLoadData (span copy)");
    cu_.check(cu_.module_get_function(&fn_, mod, "mc_copy_spans"),
              "cuModuleGetFunction (span copy)");
    span_kernels()[ctx_] = fn_;
  } catch (const std::exception& e) {
    fn_ = nullptr;
    why_ = e.what();
  }
  return fn_;
}

std::string SpanCopier::why_not() const { return why_; }

void SpanCopier::copy(const std::vector<comm::CopySpan>& spans, CUstream stream) {
  if (spans.empty()) return;
  detail::CtxGuard guard(cu_, ctx_);
  CUfunction fn = kernel();
  if (!fn) {
    for (const comm::CopySpan& s : spans)
      cu_.check(cu_.memcpy_dtod_async(reinterpret_cast<CUdeviceptr>(s.dst),
                                      reinterpret_cast<CUdeviceptr>(s.src), s.bytes, stream),
                "cuMemcpyDtoDAsync (reducer copy)");
    return;
  }
  SpanArgs a{};
  auto launch = [&] {
    if (a.n == 0) return;
    void* params[] = {&a};
    cu_.check(cu_.launch_kernel(fn, static_cast<unsigned>(a.first[a.n]), 1, 1, 256, 1, 1, 0,
                                stream, params, nullptr),
              "cuLaunchKernel (span copy)");
    a.n = 0;
  };
  for (const comm::CopySpan& s : spans) {
    if (s.bytes == 0) continue;
    if (a.n == kMaxSpans) launch();
    if (a.n == 0) a.first[0] = 0;
    a.src[a.n] = s.src;
    a.dst[a.n] = s.dst;
    a.bytes[a.n] = s.bytes;
    a.first[a.n + 1] = a.first[a.n] + (s.bytes + kChunk - 1) / kChunk;
    ++a.n;
  }
  launch();
}

}  // namespace meshcoll::nccl
