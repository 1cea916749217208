// The NCCL communicator's lifecycle: unique id through the store, non-blocking init with a
// deadline, ncclCommSplit, teardown, abort and failure bookkeeping (Note [NCCL failure model]
// in nccl_comm.h). The op path is nccl_ops.cc; the op ring, the watchdog and Work op_ring.cc.
#include "nccl/nccl_comm.h"

#include <chrono>
#include <cstdlib>
#include <cstring>

#include "common/check.h"
#include "common/config.h"
#include "common/error.h"
#include "common/thread_name.h"
#include "nccl/nccl_internal.h"

namespace meshcoll::nccl {

using namespace abi;  // NOLINT: the ABI names read best unqualified here
using detail::backoff;
using detail::CtxGuard;
using detail::nccl_failure;
using detail::now_ns;

namespace {

constexpr const char* kUidKey = "nccl/unique_id";

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

// Runs `fn` on a helper thread and waits until the deadline; false if it has not returned
// by then. The thread is then left to finish (or stay blocked) on its own: `fn` must own
// everything it touches (capture shared_ptrs and values, never locals by reference).
template <class F>
bool run_bounded(F fn, const Deadline& d) {
  struct State {
    std::mutex mu;
    std::condition_variable cv;
    bool done = false;
  };
  auto st = std::make_shared<State>();
  // Unnamed: NCCL's init runs here, and its threads would take this one's name
  // (named_thread in common/thread_name.h).
  std::thread([st, fn = std::move(fn)]() mutable {
    fn();
    std::lock_guard<std::mutex> lock(st->mu);
    st->done = true;
    st->cv.notify_all();
  }).detach();
  std::unique_lock<std::mutex> lock(st->mu);
  auto done = [&] { return st->done; };
  if (d.poll_ms() < 0) {
    st->cv.wait(lock, done);
    return true;
  }
  return st->cv.wait_for(lock, Millis(d.poll_ms()), done);
}


}  // namespace

std::exception_ptr detail::nccl_failure(ncclResult_t st, const std::string& msg) {
  if (st == ncclRemoteError || st == ncclSystemError)
    return std::make_exception_ptr(
        PeerError(msg + " (a peer likely died or its connection broke)"));
  if (st == ncclTimeout) return std::make_exception_ptr(TimeoutError(msg));
  return std::make_exception_ptr(Error(msg));
}

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
    case DType::kFloat8E4M3:
    case DType::kFloat8E5M2:
      if (api.has_fp8()) return t == DType::kFloat8E4M3 ? ncclFloat8e4m3 : ncclFloat8e5m2;
      // Before 2.24 NCCL has no float8 types: moving the bytes is exact, reducing is not.
      if (!reduction) return ncclUint8;
      throw TypeMismatch(str_cat("reductions of ", dtype_name(t), " need NCCL 2.24 or later; "
                                 "loaded ", api.describe()));
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

// Note [Blocking communicators]
// NCCL's non-blocking mode (config.blocking = 0) would bound init by polling, but it launches
// every collective from a new thread (ncclGroupEnd returns ncclInProgress), which costs each
// call more than its enqueue (see docs/performance.md, "NCCL's non-blocking mode"). So
// communicators are blocking, and the blocking steps get deadlines
// another way: init runs on a helper thread we stop waiting for (after a store check-in,
// so a rank that never arrives is caught before NCCL starts); a collective or split that
// blocks inside NCCL (connection setup with a peer that never comes) is aborted from the
// watchdog thread, which NCCL supports for exactly this (see run()).
ncclComm_t NcclComm::init_rank(const ncclUniqueId& id, int rank, int size, CUcontext ctx,
                               const Deadline& d, const std::string& where) {
  const auto& nc = nccl();
  const auto& cu = cuda();
  struct Result {
    ncclResult_t r = ncclInternalError;
    ncclComm_t comm = nullptr;
  };
  auto res = std::make_shared<Result>();
  bool finished = run_bounded([res, id, rank, size, ctx, &nc, &cu] {
    cu.ctx_set_current(ctx);
    if (nc.comm_init_rank_config) {
      ncclConfig_t cfg = make_config();
      cfg.blocking = 1;
      res->r = nc.comm_init_rank_config(&res->comm, size, id, rank, &cfg);
    } else {
      res->r = nc.comm_init_rank(&res->comm, size, id, rank);
    }
  }, d);
  if (!finished)
    throw TimeoutError(str_cat("NCCL init on ", where, " did not finish within ",
                               d.timeout().count(), " ms: a peer died during init (every rank "
                               "had checked in); this process should exit"));
  if (res->r != ncclSuccess) {
    std::string text = nc.error_text(res->r, res->comm);
    if (res->comm) nc.comm_abort(res->comm);
    std::rethrow_exception(
        nccl_failure(res->r, str_cat("ncclCommInitRank failed on ", where, ": ", text)));
  }
  return res->comm;
}

std::shared_ptr<NcclComm> NcclComm::create(std::shared_ptr<store::Store> store, int rank,
                                           int size, int device, Millis timeout) {
  const auto& nc = nccl();
  const auto& cu = cuda();
  MC_ARG_CHECK(size >= 1 && rank >= 0 && rank < size, "NCCL backend: rank ", rank,
               " is out of range for a group of ", size);
  const int n = cuda_device_count();
  if (device < 0 || device >= n) {
    const char* vis = std::getenv("CUDA_VISIBLE_DEVICES");
    throw InvalidArgument(str_cat("NCCL backend: rank ", rank, " asked for CUDA device ", device,
                                  " but ", n, " device", n == 1 ? " is" : "s are",
                                  " visible (CUDA_VISIBLE_DEVICES=", vis ? vis : "unset",
                                  "); pass device= or set LOCAL_RANK"));
  }
  const std::string where = str_cat("rank ", rank, " of ", size, ", CUDA device ", device);
  PrimaryCtx pc(cu, device);
  CtxGuard guard(cu, pc.get());
  Deadline d(timeout);
  ncclUniqueId id;
  std::memset(&id, 0, sizeof(id));
  if (rank == 0) {
    ncclResult_t r = nc.get_unique_id(&id);
    if (r != ncclSuccess)
      throw Error(str_cat("ncclGetUniqueId failed on ", where, ": ", nc.error_text(r)));
    store->set(kUidKey, store::Bytes(id.internal, id.internal + sizeof(id.internal)));
  } else {
    store::Bytes b;
    try {
      b = store->get(kUidKey, timeout);
    } catch (const TimeoutError& e) {
      throw TimeoutError(str_cat("NCCL init on ", where, ": rank 0's unique id did not arrive "
                                 "within ", timeout.count(), " ms (did rank 0 call init with "
                                 "backend='nccl'?): ", e.what()));
    }
    MC_CHECK_EQ(b.size(), sizeof(id.internal), "NCCL unique id size in the store");
    std::memcpy(id.internal, b.data(), b.size());
  }
  // Check in: every rank is here and holds the id before anyone blocks inside NCCL.
  store->set(str_cat("nccl/arrived/", rank), store::Bytes{1});
  std::vector<std::string> keys;
  for (int r = 0; r < size; ++r) keys.push_back(str_cat("nccl/arrived/", r));
  try {
    store->wait(keys, timeout);
  } catch (const TimeoutError& e) {
    throw TimeoutError(str_cat("NCCL init on ", where, ": not every rank arrived within ",
                               timeout.count(), " ms (every rank must call init with "
                               "backend='nccl'): ", e.what()));
  }
  ncclComm_t comm = init_rank(id, rank, size, pc.get(), d, where);
  try {
    return std::shared_ptr<NcclComm>(new NcclComm(comm, rank, size, device, pc.get(), timeout));
  } catch (...) {
    nc.comm_abort(comm);
    throw;
  }
}

NcclComm::NcclComm(ncclComm_t comm, int rank, int size, int device, CUcontext ctx,
                   Millis timeout)
    : nc_(nccl()), cu_(cuda()), comm_(comm), rank_(rank), size_(size), device_(device),
      ctx_(ctx), timeout_(timeout), ring_(cu_) {
  // Our own reference on the primary context, released in the destructor.
  CUdevice dev = 0;
  cu_.check(cu_.device_get(&dev, device), "cuDeviceGet");
  CUcontext again = nullptr;
  cu_.check(cu_.primary_ctx_retain(&again, dev), "cuDevicePrimaryCtxRetain");
  CtxGuard guard(cu_, ctx_);
  try {
    // Note [The internal stream's priority]
    // Asynchronous ops run on internal_ while the caller's stream computes (data
    // parallelism's buckets during backward). When both streams have blocks waiting, the
    // GPU schedules the higher priority's first: at the greatest priority a bucket's
    // all-reduce starts when it is launched instead of queuing behind the backward's kernels.
    // Measured (4 x H200, bench/python/ddp_vs_torch.py, the 152M transformer with bucket
    // views, step time over torch DDP's, same call): 0.960 and 0.965 at the default
    // priority, 0.941 and 0.942 at the greatest. It changes when the sums run, not how:
    // parameters stay bitwise equal to torch's. torch has the same as an option
    // (ProcessGroupNCCL.Options.is_high_priority_stream, off by default).
    int least = 0, greatest = 0;
    cu_.check(cu_.ctx_get_stream_priority_range(&least, &greatest), "cuCtxGetStreamPriorityRange");
    cu_.check(cu_.stream_create_with_priority(&internal_, CU_STREAM_NON_BLOCKING, greatest),
              "cuStreamCreateWithPriority");
    cu_.check(cu_.stream_create(&meta_, CU_STREAM_NON_BLOCKING), "cuStreamCreate");
    cu_.check(cu_.event_create(&order_event_, CU_EVENT_DISABLE_TIMING), "cuEventCreate");
    cu_.check(cu_.mem_alloc(&barrier_buf_, 16), "cuMemAlloc (barrier word)");
  } catch (...) {
    if (internal_) cu_.stream_destroy(internal_);
    if (meta_) cu_.stream_destroy(meta_);
    if (order_event_) cu_.event_destroy(order_event_);
    cu_.primary_ctx_release(dev);
    throw;
  }
  watchdog_ = named_thread("mc-nccl-watch", [this] { watchdog(); });
}

bool NcclComm::split_supported() {
  if (!config().nccl_split) return false;  // MESHCOLL_NCCL_SPLIT=0: subgroups via the store
  return nccl().comm_split != nullptr;
}

std::shared_ptr<NcclComm> NcclComm::split(int color, int key, Millis timeout) {
  std::unique_lock<std::mutex> lock(mu_);
  usable_locked();
  if (!nc_.comm_split)
    throw Error(str_cat("ncclCommSplit needs NCCL 2.18 or later; loaded ", nc_.describe()));
  CtxGuard guard(cu_, ctx_);
  const Millis t = timeout.count() < 0 ? timeout_ : timeout;
  Deadline d(t);
  ncclConfig_t cfg = make_config();
  cfg.blocking = 1;
  ncclComm_t child = nullptr;
  // Blocks until every rank of this communicator calls it: the watchdog aborts us at t.
  ncclResult_t r = guarded_locked(d, "ncclCommSplit", [&] {
    return nc_.comm_split(comm_, color < 0 ? ncclSplitNoColor : color, key, &child, &cfg);
  });
  if (r != ncclSuccess) {
    if (child) nc_.comm_abort(child);
    check_nccl_locked(r, "ncclCommSplit", d);  // throws
  }
  if (!child) return nullptr;
  int crank = -1, csize = 0;
  nc_.comm_user_rank(child, &crank);
  nc_.comm_count(child, &csize);
  try {
    return std::shared_ptr<NcclComm>(new NcclComm(child, crank, csize, device_, ctx_, t));
  } catch (...) {
    nc_.comm_abort(child);
    throw;
  }
}

// ---- teardown ----------------------------------------------------------------------------

NcclComm::~NcclComm() {
  {
    std::lock_guard<std::mutex> wl(wd_mu_);
    wd_stop_ = true;
  }
  wd_cv_.notify_all();
  if (watchdog_.joinable()) watchdog_.join();
  std::lock_guard<std::mutex> lock(mu_);
  // No shutdown() was called (the process is exiting, or the object was dropped): do not
  // block in a destructor; abort instead, which never waits for peers.
  if (cu_.ctx_set_current(ctx_) != CUDA_SUCCESS) return;  // the driver is gone already
  abort_locked();
  close_windows_locked();
  ring_.destroy_events();
  if (order_event_) cu_.event_destroy(order_event_);
  if (internal_) cu_.stream_destroy(internal_);
  if (meta_) cu_.stream_destroy(meta_);
  if (barrier_buf_) cu_.mem_free(barrier_buf_);
  if (scratch_) cu_.mem_free(scratch_);
  CUdevice dev = 0;
  if (cu_.device_get(&dev, device_) == CUDA_SUCCESS) cu_.primary_ctx_release(dev);
}

void NcclComm::shutdown() {
  {
    std::lock_guard<std::mutex> wl(wd_mu_);
    wd_stop_ = true;
  }
  wd_cv_.notify_all();
  if (watchdog_.joinable()) watchdog_.join();
  std::unique_lock<std::mutex> lock(mu_);
  if (shut_down_) return;
  shut_down_ = true;
  if (!comm_) return close_failed_locked();
  CtxGuard guard(cu_, ctx_);
  // Let issued work finish (bounded by the group's timeout); work still running then is
  // aborted, which never waits for peers, and destroy() raises.
  Deadline d(timeout_);
  int round = 0;
  for (;;) {
    uint64_t at = 0;
    advance_completed_locked(&at);  // a failed query: the op stays pending until the deadline
    if (!ring_.pending()) break;
    if (d.expired()) {
      abort_locked();
      const uint64_t op = ring_.completed();
      throw TimeoutError(str_cat("destroy() on ", where(), ": ", ring_.slot(op).call.what,
                                 " (op ", op, ") and ", ring_.issued() - op - 1,
                                 " later op(s) did not complete within ", timeout_.count(),
                                 " ms; the communicator was aborted"));
    }
    lock.unlock();
    backoff(round);
    lock.lock();
  }
  check_direct_locked(true);  // a direct kernel's failure not read yet
  if (failure_.failed()) return close_failed_locked();
  close_direct_locked();
  close_windows_locked();
  // ncclCommDestroy tears down connections; bound it too, and leave it behind if a peer
  // vanished meanwhile (the process is shutting the group down anyway).
  ncclComm_t c = comm_;
  comm_ = nullptr;
  CUcontext ctx = ctx_;
  const NcclApi* nc = &nc_;
  const CudaApi* cu = &cu_;
  run_bounded([c, ctx, nc, cu] {
    cu->ctx_set_current(ctx);
    nc->comm_destroy(c);
  }, Deadline(timeout_));
}

void NcclComm::fail(std::exception_ptr error, uint64_t coll_seq) {
  std::unique_lock<std::mutex> lock(mu_, std::defer_lock);
  while (!lock.try_lock()) {
    // The issuing thread holds mu_. It may be blocked inside NCCL (an enqueue waiting for
    // room while kernels wait for the disagreeing peer): abort from here, as the watchdog
    // does for a stuck call (Note [Stuck calls]); that thread records `error`.
    if (stuck_.abort_for(error, coll_seq, nc_)) return;
    std::this_thread::sleep_for(std::chrono::microseconds(100));
  }
  if (!comm_ || failure_.failed()) return;
  CtxGuard guard(cu_, ctx_, false);
  if (!guard.ok()) {  // exiting: no device left to stop
    failure_.record(std::move(error));
    return;
  }
  fail_locked(std::move(error), ring_.first_op(coll_seq));
}

void NcclComm::abort(const std::string& why) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!comm_) return;
  auto error = std::make_exception_ptr(
      Aborted(str_cat("the NCCL communicator (", where(), ") was aborted: ", why)));
  CtxGuard guard(cu_, ctx_, false);
  if (!guard.ok()) {  // exiting: no device left to stop
    failure_.record(std::move(error));
    return;
  }
  fail_locked(std::move(error));
}

void NcclComm::close_failed_locked() {
  close_direct_locked();
  close_windows_locked();
  if (failure_.failed() && !failure_.reported())
    failure_.raise(str_cat("destroy() on ", where(), ": the group failed earlier, after the "
                           "last call that could raise it: "));
}

void NcclComm::abort_locked() {
  if (direct_) direct_->abort();  // direct kernels waiting for a peer end too
  if (!comm_) return;
  nc_.comm_abort(comm_);
  comm_ = nullptr;
}

// ---- failure bookkeeping -----------------------------------------------------------------

std::string NcclComm::where() const {
  return str_cat("rank ", names_(rank_), " of ", size_, ", CUDA device ", device_);
}

// Note [NCCL failure model]: a failure the watchdog or the agreement check found while no
// call was in Python is raised, with its own type, by the next call (here), wait() or
// synchronize(), or else by destroy() (shutdown).
void NcclComm::usable_locked() const {
  if (failure_.failed())
    failure_.raise(str_cat("the NCCL communicator (", where(), ") was aborted by an earlier "
                           "failure; rebuild the group: "));
  if (shut_down_ || !comm_)
    throw Aborted(str_cat("the NCCL communicator (", where(), ") was destroyed"));
}

void NcclComm::fail_locked(std::exception_ptr error, uint64_t voids_from) {
  if (failure_.failed()) return;
  // Ops that completed before the failure keep their success (but for those it voids).
  uint64_t at = 0;
  advance_completed_locked(&at);
  failed_from_ = std::min(ring_.completed(), voids_from);
  failure_.record(std::move(error));
  on_group_failure(failure_.error());
  abort_locked();  // the kernels exit, so every pending event completes
  ring_.release_all();  // nothing touches the arrays any more
}

void NcclComm::check_nccl_locked(ncclResult_t r, const char* what, const Deadline& d) {
  if (r == ncclSuccess) return;
  // The watchdog aborted this call (Note [Stuck calls]): guarded_locked reports it.
  if (stuck_.claimed())
    throw Aborted(str_cat(what, " was aborted by the watchdog"));
  if (r == ncclInProgress) {
    wait_ready_locked(comm_, d, what);
    return;
  }
  std::string msg = str_cat(what, " on ", where(), ": ", nc_.error_text(r, comm_));
  if (r == ncclInvalidArgument || r == ncclInvalidUsage) throw InvalidArgument(msg);
  fail_locked(nccl_failure(r, msg + "; the communicator was aborted"));
  failure_.rethrow();
}

void NcclComm::wait_ready_locked(ncclComm_t comm, const Deadline& d, const char* what) {
  ncclResult_t r = poll_ready(nc_, comm, d);
  if (r == ncclSuccess) return;
  if (r == ncclInProgress)
    fail_locked(std::make_exception_ptr(TimeoutError(str_cat(
        what, " on ", where(), " was still in progress after ", d.timeout().count(),
        " ms (connection setup with a peer that never arrived?); the communicator was "
        "aborted"))));
  else
    fail_locked(nccl_failure(r, str_cat(what, " on ", where(), ": ", nc_.error_text(r, comm),
                                        "; the communicator was aborted")));
  failure_.rethrow();
}

}  // namespace meshcoll::nccl
