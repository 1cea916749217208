// Many device-to-device copies as one kernel launch: the reducer's copies of gradients into
// and out of its buckets (Note [Reducer] in reducer/reducer.h) on an NCCL group.
//
// Note [Span copies]
// A bucket of a 12-layer transformer holds tens of gradients. One cuMemcpyAsync (or one
// framework copy_) per gradient costs the host microseconds each (see docs/performance.md,
// "Span copies"), twice per step (into the bucket,
// back out), and a training step that is host-bound pays it in full. The kernel here copies
// up to kMaxSpans spans in one launch: the spans are cut into 16 KiB chunks, one thread block
// per chunk, and a block finds its span by a binary search over the chunks' prefix sums, all
// passed as the kernel's parameters (copied by the driver at launch, so nothing on the host
// must outlive the call). It is compiled by NVRTC on first use, as the direct kernels are; where
// NVRTC cannot be loaded each span is one cuMemcpyDtoDAsync instead.
#pragma once

#include <mutex>
#include <string>
#include <vector>

#include "comm/backend.h"
#include "nccl/nccl_abi.h"
#include "nccl/nccl_api.h"

namespace meshcoll::nccl {

class SpanCopier {
 public:
  static constexpr size_t kMaxSpans = 96;  // MC_SPANS: the parameters stay under 4 KiB

  SpanCopier(const CudaApi& cu, abi::CUcontext ctx, int device)
      : cu_(cu), ctx_(ctx), device_(device) {}
  // Queues the copies on `stream`.
  void copy(const std::vector<comm::CopySpan>& spans, abi::CUstream stream);
  // Why the kernel is not used ("" while it is, or before the first copy).
  std::string why_not() const;

 private:
  abi::CUfunction kernel();  // nullptr: NVRTC failed, copy span by span

  const CudaApi& cu_;
  abi::CUcontext ctx_;
  int device_;
  std::mutex mu_;
  bool loaded_ = false;
  abi::CUfunction fn_ = nullptr;
  std::string why_;
};

}  // namespace meshcoll::nccl
