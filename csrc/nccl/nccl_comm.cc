#include "nccl/nccl_comm.h"

#include <chrono>
#include <cstdlib>
#include <cstring>

#include "common/check.h"
#include "common/error.h"

namespace meshcoll::nccl {

using namespace abi;  // NOLINT: the ABI names read best unqualified here

namespace {

constexpr const char* kUidKey = "nccl/unique_id";
constexpr const char* kSplitEnv = "MESHCOLL_NCCL_SPLIT";  // "0": subgroups via the store
constexpr auto kPollBusy = std::chrono::milliseconds(2);   // watchdog period with ops pending
constexpr auto kPollIdle = std::chrono::milliseconds(20);  // ... and without

// Makes `ctx` current on this thread for a scope. A thread that had another context gets it
// back; a thread that had none keeps ours (what the runtime API would have done lazily), so
// a loop of calls sets it once.
class CtxGuard {
 public:
  CtxGuard(const CudaApi& cu, CUcontext ctx) : cu_(cu) {
    cu_.ctx_get_current(&prev_);
    if (prev_ != ctx) {
      cu_.check(cu_.ctx_set_current(ctx), "cuCtxSetCurrent");
      restore_ = prev_ != nullptr;
    }
  }
  ~CtxGuard() {
    if (restore_) cu_.ctx_set_current(prev_);
  }
  CtxGuard(const CtxGuard&) = delete;
  CtxGuard& operator=(const CtxGuard&) = delete;

 private:
  const CudaApi& cu_;
  CUcontext prev_ = nullptr;
  bool restore_ = false;
};

// The primary context of one device, retained for a scope.
class PrimaryCtx {
 public:
  PrimaryCtx(const CudaApi& cu, int ordinal) : cu_(cu) {
    cu_.check(cu_.device_get(&dev_, ordinal), "cuDeviceGet");
    cu_.check(cu_.primary_ctx_retain(&ctx_, dev_), "cuDevicePrimaryCtxRetain");
  }
  ~PrimaryCtx() { cu_.primary_ctx_release(dev_); }
  CUcontext get() const { return ctx_; }

 private:
  const CudaApi& cu_;
  CUdevice dev_ = 0;
  CUcontext ctx_ = nullptr;
};

// Spin briefly (a small op completes in microseconds), then yield, then sleep.
void backoff(int& round) {
  ++round;
  if (round < 2000) return;
  if (round < 4000) {
    std::this_thread::yield();
    return;
  }
  std::this_thread::sleep_for(std::chrono::microseconds(50));
}

std::string message_of(const std::exception_ptr& e) {
  try {
    if (e) std::rethrow_exception(e);
  } catch (const std::exception& ex) {
    return ex.what();
  } catch (...) {
  }
  return "unknown error";
}

Clock::time_point deadline_at(Millis t) {
  return t.count() < 0 ? Clock::time_point::max() : Clock::now() + t;
}

bool all_equal(const std::vector<size_t>& v) {
  for (size_t x : v)
    if (x != v[0]) return false;
  return true;
}

// Polls a non-blocking communicator until it is ready, failed, or the deadline passed
// (returns ncclInProgress then). No side effects: the caller decides what to abort.
ncclResult_t poll_ready(const NcclApi& nc, ncclComm_t comm, const Deadline& d) {
  int round = 0;
  for (;;) {
    ncclResult_t st = ncclSuccess;
    ncclResult_t r = nc.comm_get_async_error(comm, &st);
    if (r != ncclSuccess) return r;
    if (st != ncclInProgress) return st;
    if (d.expired()) return ncclInProgress;
    backoff(round);
  }
}

std::exception_ptr nccl_failure(ncclResult_t st, const std::string& msg) {
  if (st == ncclRemoteError || st == ncclSystemError)
    return std::make_exception_ptr(
        PeerError(msg + " (a peer likely died or its connection broke)"));
  if (st == ncclTimeout) return std::make_exception_ptr(TimeoutError(msg));
  return std::make_exception_ptr(Error(msg));
}

}  // namespace

// ---- dtype / op tables -------------------------------------------------------------------

ncclDataType_t nccl_dtype(DType t, bool reduction, const NcclApi& api) {
  switch (t) {
    case DType::kBool:
      if (reduction)
        throw TypeMismatch("NCCL has no boolean reductions: use uint8 with max (logical or) "
                           "or min (logical and)");
      return ncclUint8;
    case DType::kInt8: return ncclInt8;
    case DType::kUint8: return ncclUint8;
    case DType::kInt32: return ncclInt32;
    case DType::kInt64: return ncclInt64;
    case DType::kFloat16: return ncclFloat16;
    case DType::kBFloat16:
      if (!api.has_bf16())
        throw TypeMismatch(str_cat("bfloat16 needs NCCL 2.10 or later; loaded ", api.describe()));
      return ncclBfloat16;
    case DType::kFloat32: return ncclFloat32;
    case DType::kFloat64: return ncclFloat64;
  }
  throw TypeMismatch(str_cat("dtype ", dtype_name(t), " is not supported by the NCCL backend"));
}

ncclRedOp_t nccl_redop(RedOp op, DType t, const NcclApi& api) {
  switch (op) {
    case RedOp::kSum: return ncclSum;
    case RedOp::kProd: return ncclProd;
    case RedOp::kMin: return ncclMin;
    case RedOp::kMax: return ncclMax;
    case RedOp::kAvg:
      if (!api.has_avg())
        throw TypeMismatch(str_cat("op avg needs NCCL 2.10 or later; loaded ", api.describe()));
      return ncclAvg;
    default: break;
  }
  throw TypeMismatch(str_cat("op ", redop_name(op), " on ", dtype_name(t),
                             " is not supported by NCCL (it has sum, prod, min, max, avg)"));
}

// ---- creation ----------------------------------------------------------------------------

ncclComm_t NcclComm::init_rank(const ncclUniqueId& id, int rank, int size, const Deadline& d,
                               const std::string& where) {
  const auto& nc = nccl();
  ncclComm_t comm = nullptr;
  if (!nc.comm_init_rank_config) {
    // NCCL < 2.14 has no non-blocking init: every rank already holds the id, so this
    // blocks only while a peer dies mid-init.
    ncclResult_t r = nc.comm_init_rank(&comm, size, id, rank);
    if (r != ncclSuccess)
      throw Error(str_cat("ncclCommInitRank failed on ", where, ": ", nc.error_text(r)));
    return comm;
  }
  // Non-blocking init: we poll, so a rank that never arrives becomes a TimeoutError.
  ncclConfig_t cfg = make_config();
  cfg.blocking = 0;
  ncclResult_t r = nc.comm_init_rank_config(&comm, size, id, rank, &cfg);
  if (r == ncclSuccess || r == ncclInProgress) r = poll_ready(nc, comm, d);
  if (r == ncclSuccess) return comm;
  std::string text = r == ncclInProgress ? "" : nc.error_text(r, comm);
  if (comm) nc.comm_abort(comm);
  if (r == ncclInProgress)
    throw TimeoutError(str_cat("NCCL init on ", where, " did not finish within ",
                               d.timeout().count(), " ms: a rank did not join (every rank "
                               "must call init with backend='nccl'), or a peer died"));
  std::rethrow_exception(
      nccl_failure(r, str_cat("ncclCommInitRankConfig failed on ", where, ": ", text)));
}
