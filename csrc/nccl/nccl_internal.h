// What the NCCL wing's source files share: the context guard, the backoff, small helpers,
// an NCCL error as the type a user catches, and the communicator's guarded-call template
// (Note [Stuck calls]). Included by .cc files only (nccl/ and nccl/direct/), never by a header.
#pragma once

#include <chrono>
#include <thread>

#include "common/error.h"
#include "nccl/nccl_comm.h"

namespace meshcoll::nccl::detail {

using namespace abi;  // NOLINT: the ABI names read best unqualified here

// Makes `ctx` current on this thread for a scope. A thread that had another context gets it
// back; a thread that had none keeps ours (what the runtime API would have done lazily), so
// a loop of calls sets it once.
class CtxGuard {
 public:
  CtxGuard(const CudaApi& cu, CUcontext ctx) : CtxGuard(cu, ctx, true) {}
  // Not `strict`: never throws, and ok() says whether `ctx` is current. For paths that run on
  // our own threads (a peer's failure reported by the agreement thread), where the driver may
  // already be deinitialised because the process is exiting.
  CtxGuard(const CudaApi& cu, CUcontext ctx, bool strict) : cu_(cu) {
    cu_.ctx_get_current(&prev_);
    if (prev_ != ctx) {
      const CUresult r = cu_.ctx_set_current(ctx);
      if (strict) cu_.check(r, "cuCtxSetCurrent");
      ok_ = r == CUDA_SUCCESS;
      restore_ = ok_ && prev_ != nullptr;
    }
  }
  bool ok() const { return ok_; }
  ~CtxGuard() {
    if (restore_) cu_.ctx_set_current(prev_);
  }
  CtxGuard(const CtxGuard&) = delete;
  CtxGuard& operator=(const CtxGuard&) = delete;

 private:
  const CudaApi& cu_;
  CUcontext prev_ = nullptr;
  bool ok_ = true;
  bool restore_ = false;
};

// Spin briefly (a small op completes in microseconds), then yield, then sleep.
inline void backoff(int& round) {
  ++round;
  if (round < 2000) return;
  if (round < 4000) {
    std::this_thread::yield();
    return;
  }
  std::this_thread::sleep_for(std::chrono::microseconds(50));
}

inline bool all_equal(const std::vector<size_t>& v) {
  for (size_t x : v)
    if (x != v[0]) return false;
  return true;
}

inline int64_t ns_of(Clock::time_point t) {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(t.time_since_epoch()).count();
}
inline int64_t now_ns() { return ns_of(Clock::now()); }

// An NCCL error as the type a user catches: PeerError where a peer likely died
// (ncclRemoteError, ncclSystemError), TimeoutError for ncclTimeout, else Error.
std::exception_ptr nccl_failure(ncclResult_t st, const std::string& msg);

}  // namespace meshcoll::nccl::detail

namespace meshcoll::nccl {

using namespace abi;  // NOLINT

// Note [Stuck calls]
// A blocking NCCL call can wait on a peer (lazy connection setup, ncclCommSplit). While it
// runs, the communicator's StuckCallGuard holds its deadline; the watchdog claims an expired
// one (CAS to -1) and calls ncclCommAbort from its own thread, which makes the stuck call
// return. The caller then sees the claim, waits until the abort is done, and fails with
// TimeoutError (or with the failure fail() aborted it for).
template <class Call>
ncclResult_t NcclComm::guarded_locked(const Deadline& d, const char* what, Call&& call) {
  const int64_t dl = d.never() ? 0 : detail::ns_of(d.at());  // the call's own deadline
  stuck_.enter(comm_, dl);
  ncclResult_t r = ncclSuccess;
  std::exception_ptr thrown;
  try {
    r = call();
  } catch (...) {
    thrown = std::current_exception();
  }
  if (stuck_.leave(dl)) {
    if (thrown) std::rethrow_exception(thrown);
    return r;
  }
  // The watchdog or fail() claimed this call and aborted the communicator.
  comm_ = nullptr;  // already aborted
  if (!failure_.failed()) {
    const auto [ext, seq] = stuck_.external();
    // The agreement check aborted us (fail()), or the watchdog at the deadline.
    if (ext)
      fail_locked(ext, ring_.first_op(seq));
    else
      fail_locked(std::make_exception_ptr(TimeoutError(str_cat(
          "NCCL ", what, " on ", where(), " was still blocked inside NCCL after ",
          d.timeout().count(), " ms (a peer never made the matching call, or died); the "
          "communicator was aborted"))));
  }
  failure_.rethrow();
}

}  // namespace meshcoll::nccl
