// The NCCL communicator's op ring (Note [NCCL streams and Works] in op_ring.h): OpRing (the
// slot each op takes, completion by bisection over each stream's events, deadlines, the
// coalesced block's staged slots), then the communicator's side: waiting for a slot, the
// watchdog that polls the ring, and NcclWork's questions about an op. The op path that fills
// the slots is nccl_ops.cc; the communicator's lifecycle nccl_comm.cc.
#include "nccl/nccl_comm.h"

#include <chrono>

#include "common/error.h"
#include "common/host_timers.h"
#include "nccl/nccl_internal.h"

namespace meshcoll::nccl {

using namespace abi;  // NOLINT: the ABI names read best unqualified here
using detail::backoff;
using detail::CtxGuard;
using detail::nccl_failure;
using detail::now_ns;

namespace {
constexpr auto kPollBusy = std::chrono::milliseconds(2);   // watchdog period with ops pending
constexpr auto kPollIdle = std::chrono::milliseconds(20);  // ... and without
}  // namespace

// ---- OpRing ------------------------------------------------------------------------------

void OpRing::destroy_events() {
  for (auto& s : slots_)
    if (s.event) cu_.event_destroy(s.event);
}

uint64_t OpRing::issue(CUstream exec, const Call& call, Clock::time_point deadline,
                       int64_t timeout_ms, uint32_t direct_epoch, const Keep* keep) {
  Slot& s = slots_[issued_ % kSlots];
  if (!s.event) cu_.check(cu_.event_create(&s.event, CU_EVENT_DISABLE_TIMING), "cuEventCreate");
  cu_.check(cu_.event_record(s.event, exec), "cuEventRecord (op completion)");
  host_timers::mark(host_timers::kRecorded);
  s.done = s.event;
  s.stream = exec;
  s.deadline = deadline;
  s.timeout_ms = timeout_ms;
  s.call = call;
  s.direct_epoch = direct_epoch;
  if (keep) s.keep = *keep;
  return issued_++;
}

uint64_t OpRing::first_op(uint64_t coll_seq) const {
  uint64_t from = UINT64_MAX;
  const uint64_t oldest = issued_ > kSlots ? issued_ - kSlots : 0;
  for (uint64_t k = issued_; coll_seq && k-- > oldest;) {
    const uint64_t s = slots_[k % kSlots].call.coll_seq;
    if (s && s < coll_seq) break;
    if (s) from = k;
  }
  return from;
}

uint64_t OpRing::op_of_epoch(uint32_t epoch) const {
  for (uint64_t k = issued_ > kSlots ? issued_ - kSlots : 0; k < issued_; ++k)
    if (slots_[k % kSlots].direct_epoch == epoch) return k;
  return completed_;
}

void OpRing::release_all() {
  for (auto& s : slots_) s.keep.clear();
}

uint64_t OpRing::stage(Staged op, bool captured, const Call& call, int64_t timeout_ms,
                       const Keep* keep) {
  block_captured_ = captured;
  uint64_t seq = 0;
  if (!captured) {
    seq = issued_ + staged_.size();
    Slot& s = slots_[seq % kSlots];
    s.done = nullptr;  // set by issue_block
    s.stream = nullptr;
    s.timeout_ms = timeout_ms;
    s.call = call;
    if (keep) s.keep = *keep;  // to its completion; the block holds every array to its end
  }
  staged_.push_back(std::move(op));
  return seq;
}

void OpRing::issue_block(CUstream last_exec) {
  if (!block_captured_) {
    const size_t n = staged_.size();
    Slot& last = slots_[(issued_ + n - 1) % kSlots];
    if (!last.event)
      cu_.check(cu_.event_create(&last.event, CU_EVENT_DISABLE_TIMING), "cuEventCreate");
    cu_.check(cu_.event_record(last.event, last_exec), "cuEventRecord (block completion)");
    const auto now = Clock::now();
    for (size_t i = 0; i < n; ++i) {
      Slot& s = slots_[(issued_ + i) % kSlots];
      s.done = last.event;
      s.stream = last_exec;
      s.deadline = now + Millis(s.timeout_ms);
    }
    issued_ += n;
  }
  // Closed, not dropped: drop_block() would let go of the arrays of the slots after the
  // issued ones, which belong to older ops, still in flight when the ring is nearly full.
  staged_.clear();
  block_open_ = false;
}

void OpRing::drop_block() {
  for (size_t i = 0; i < staged_.size() && !block_captured_; ++i)
    slots_[(issued_ + i) % kSlots].keep.clear();
  staged_.clear();
  block_open_ = false;
}

// Note [Completion by bisection]
// Ops recorded on one stream complete in order, so over each run of consecutive ops on one
// stream, completed() moves by bisection on their events: the oldest op is queried first (a
// poll that finds it pending costs one query), then the newest, then halves. Querying every
// op's event once, under the lock, would hold it during the watchdog's poll for one query
// per op completed since, and back-to-back callers would wait for it (see
// docs/performance.md, "Completion by bisection").
// A run is told by the stream's handle. A stream destroyed with ops pending whose handle
// is at once reused by a new stream could let an op on the new one mark an older op of the
// old one complete; only that op's deadline check is lost (an op on a caller's stream holds
// no arrays: keep is for the internal stream's).
CUresult OpRing::advance(uint64_t* at, const OnDone* on_done) {
  auto query = [&](uint64_t k) { return cu_.event_query(slots_[k % kSlots].done); };
  // The arrays of ops completed below `end` may be freed now; their records end.
  auto complete_to = [&](uint64_t end) {
    for (; completed_ < end; ++completed_) {
      Slot& s = slots_[completed_ % kSlots];
      s.keep.clear();
      if (on_done) (*on_done)(s.call.coll_seq, s.call.p2p, s.call.desc);
    }
  };
  while (completed_ < issued_) {
    const CUstream stream = slots_[completed_ % kSlots].stream;
    uint64_t end = completed_ + 1;
    while (end < issued_ && slots_[end % kSlots].stream == stream) ++end;
    // Ops before lo completed; op hi is pending (or hi == end).
    uint64_t lo = completed_, hi = end;
    bool newest_asked = false;
    while (lo < hi) {
      const uint64_t k = lo == completed_ ? lo : !newest_asked ? hi - 1 : lo + (hi - lo) / 2;
      newest_asked = newest_asked || k == hi - 1;
      const CUresult q = query(k);
      if (q == CUDA_SUCCESS) {
        lo = k + 1;
      } else if (q == CUDA_ERROR_NOT_READY) {
        hi = k;
      } else {
        *at = k;
        complete_to(lo);
        return q;
      }
    }
    complete_to(lo);
    if (lo < end) break;
  }
  return CUDA_SUCCESS;
}

uint64_t OpRing::overdue(Clock::time_point now) const {
  // Ops may sit on different streams and finish out of order: every pending deadline.
  for (uint64_t k = completed_; k < issued_; ++k) {
    const Slot& s = slots_[k % kSlots];
    if (now < s.deadline || cu_.event_query(s.done) == CUDA_SUCCESS) continue;
    return k;
  }
  return UINT64_MAX;
}

// ---- the communicator's side -------------------------------------------------------------

void NcclComm::claim_slot_locked(std::unique_lock<std::mutex>& lock, const Deadline& d,
                                 size_t staged) {
  if (ring_.has_room(staged)) return;
  // The ring is full: kSlots ops are in flight. Wait for the oldest (rare; bounded by d).
  struct Timed {  // the host timers count the wait apart (add_slot_wait)
    Clock::time_point t0 = Clock::now();
    ~Timed() {
      host_timers::add_slot_wait(static_cast<uint64_t>(
          std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - t0).count()));
    }
  } timed;
  int round = 0;
  for (;;) {
    poll_locked();
    usable_locked();
    if (ring_.has_room(staged)) return;
    if (d.expired())
      throw TimeoutError(str_cat("NCCL: ", OpRing::kSlots, " ops are in flight on ", where(),
                                 " and none completed within ", d.timeout().count(), " ms"));
    lock.unlock();
    backoff(round);
    lock.lock();
  }
}

CUresult NcclComm::advance_completed_locked(uint64_t* at) {
  // Not after a failure, which voids the ops' records: its abort completes every pending event.
  return ring_.advance(at, on_done_ && !failure_.failed() ? &on_done_ : nullptr);
}

void NcclComm::poll_locked() {
  if (failure_.failed() || !comm_) return;
  ncclResult_t st = ncclSuccess;
  ncclResult_t r = nc_.comm_get_async_error(comm_, &st);
  if (r != ncclSuccess) st = r;
  if (st != ncclSuccess && st != ncclInProgress) {
    fail_locked(nccl_failure(st, str_cat("NCCL reported an asynchronous error on ", where(), ": ",
                                         nc_.error_text(st, comm_),
                                         "; the communicator was aborted")));
    return;
  }
  uint64_t at = 0;
  if (CUresult q = advance_completed_locked(&at); q != CUDA_SUCCESS) {
    fail_locked(std::make_exception_ptr(Error(str_cat(
        "CUDA error while waiting for NCCL op ", ring_.slot(at).call.what, " on ", where(), ": ",
        cu_.error_text(q), "; the communicator was aborted"))));
    return;
  }
  check_direct_locked();  // ops just counted complete may be failed direct kernels
  if (failure_.failed()) return;
  const uint64_t k = ring_.overdue(Clock::now());
  if (k == UINT64_MAX) return;
  const OpRing::Slot& s = ring_.slot(k);
  const uint64_t seq = s.call.coll_seq;
  const std::string who = seq && check_.census ? check_.census(seq) : "";
  fail_locked(std::make_exception_ptr(TimeoutError(str_cat(
      "NCCL ", s.call.what, seq ? str_cat(" [seq ", seq, "]") : std::string(), " (op ", k,
      ") on ", where(), " did not complete within ", s.timeout_ms,
      " ms; the communicator was aborted", who,
      who.empty() ? ". A peer may have died, or not called the same collectives in the "
                    "same order" : "",
      "; rebuild the group"))));
}

void NcclComm::watchdog() {
  // Relaxed capture mode: our event queries must never invalidate a CUDA graph that
  // another thread is capturing.
  int mode = CU_STREAM_CAPTURE_MODE_RELAXED;
  cu_.thread_exchange_capture_mode(&mode);
  cu_.ctx_set_current(ctx_);
  for (;;) {
    bool pending = true;
    // A call stuck inside NCCL past its deadline (Note [Stuck calls]) is aborted from here.
    if (stuck_.abort_if_expired(now_ns(), nc_)) return;
    std::unique_lock<std::mutex> lock(mu_, std::try_to_lock);  // a caller may be in NCCL
    if (lock.owns_lock()) {
      poll_locked();
      pending = !failure_.failed() && ring_.pending();
      lock.unlock();
    }
    std::unique_lock<std::mutex> wl(wd_mu_);
    if (wd_cv_.wait_for(wl, pending ? kPollBusy : kPollIdle, [this] { return wd_stop_; })) return;
  }
}

// ---- Work --------------------------------------------------------------------------------

bool NcclComm::op_done_locked(uint64_t seq, std::exception_ptr* error) {
  if (failure_.failed() && seq >= failed_from_) {
    *error = failure_.error();
    failure_.mark_reported();
    return true;
  }
  if (seq >= direct_grace_op_ && !shut_down_) return false;  // awaiting the agreement check
  if (seq < ring_.completed() || shut_down_) return true;
  if (seq >= ring_.issued()) return false;  // staged in the open block
  CUresult q = ring_.query(seq);
  if (q == CUDA_SUCCESS) {
    // A direct kernel that completed may have failed (Note [Direct kernels]).
    if (direct_) check_direct_locked();
    if (failure_.failed() && seq >= failed_from_) {
      *error = failure_.error();
      failure_.mark_reported();
      return true;
    }
    return seq < direct_grace_op_;  // else: awaiting the agreement check's verdict
  }
  if (q == CUDA_ERROR_NOT_READY) return false;
  *error = std::make_exception_ptr(
      Error(str_cat("CUDA error on NCCL op ", seq, " on ", where(), ": ", cu_.error_text(q))));
  return true;
}

void NcclComm::staged_error(uint64_t seq) const {
  throw InvalidArgument(str_cat(ring_.slot(seq).call.what, " (op ", seq, ") on ", where(),
                                " is in the coalesced block still open: it runs when the block "
                                "ends, so wait for its Work after the block"));
}

// Note [Waiting off the lock]
// A thread that blocks on an op (Work.synchronize; DataParallel's completion thread does it
// for every bucket) polls the op's event without mu_, which it takes only to confirm: polling
// under mu_ made the issuing thread queue behind it for every enqueue. The event read under
// the lock stays this op's until the op has completed (a slot is reused only then), so
// "ready" means done, and "not ready" may be a newer op in the reused slot: the periodic
// check under the lock (the ring's completed count, failures) settles that.
void NcclComm::op_synchronize(uint64_t seq, Millis timeout) {
  Deadline own(timeout);
  CUevent event = nullptr;
  for (int round = 0;; backoff(round)) {
    if (!event || round % 64 == 0 || cu_.event_query(event) != CUDA_ERROR_NOT_READY) {
      std::lock_guard<std::mutex> lock(mu_);
      std::exception_ptr e;
      if (op_done_locked(seq, &e)) {
        if (e) std::rethrow_exception(e);
        return;
      }
      if (seq >= ring_.issued()) staged_error(seq);
      event = ring_.slot(seq).done;
    }
    if (own.expired())
      throw TimeoutError(str_cat("NCCL op ", seq, " on ", where(), " did not complete within ",
                                 timeout.count(), " ms (Work.synchronize timeout); it keeps "
                                 "running and fails by its own deadline if it is stuck"));
  }
}

// Note [Results at host synchronization points]
// In async mode (Note [Agreement on a side channel]) a call is compared after its launch, and
// NCCL completes calls that disagree on anything but their sizes (sum on one rank, max on
// another): their results are void, and the check's verdict may come after the ranks have
// read them. So every point where meshcoll hands the host a finished result waits for the
// verdict on every call issued before it: Work.synchronize(), a wait() that blocks the host
// (a barrier's, a call on host arrays), a blocking barrier(), and is_completed() (false
// until then). A rank's peers have issued those calls (they completed), so the wait is one
// round on the side channel, run on this thread: a few microseconds on one host. A disagreement
// raises its MismatchError there, on every rank. Work.wait() on a stream blocks nothing, so
// it waits for nothing: a result read after torch.cuda.synchronize() alone may be void
// until the next synchronization point of the group raises.
void NcclComm::settle(uint64_t coll_seq, Millis timeout) {
  if (coll_seq == 0 || !check_.settle) return;
  if (check_.agreed(coll_seq)) return;
  try {
    check_.settle(coll_seq, timeout);
  } catch (...) {
    mark_reported();  // raised to the caller here: destroy() need not raise it again
    throw;
  }
}

void NcclComm::op_stream_wait(uint64_t seq, CUstream stream) {
  std::lock_guard<std::mutex> lock(mu_);
  if (failure_.failed() && seq >= failed_from_) failure_.rethrow();
  if (seq < ring_.completed() || shut_down_) return;
  if (seq >= ring_.issued()) staged_error(seq);
  CtxGuard guard(cu_, ctx_);
  cu_.check(cu_.stream_wait_event(stream, ring_.slot(seq).done, 0),
            "cuStreamWaitEvent (Work.wait)");
}

void NcclWork::wait(Millis timeout, bool has_stream, comm::Stream raw) {
  CUstream stream = reinterpret_cast<CUstream>(raw);
  if (captured_) {
    if (has_stream && stream != issue_stream_)
      throw InvalidArgument("Work.wait(stream=...): this op was captured into a CUDA graph on "
                            "another stream; order streams inside the capture instead");
    return;
  }
  if (host_blocking_) {
    synchronize(timeout);
    return;
  }
  CUstream target = has_stream ? stream : issue_stream_;
  if (!async_ && target == issue_stream_) {
    // Already ordered on that stream: only report a known failure.
    std::lock_guard<std::mutex> lock(comm_->mu_);
    if (comm_->failure_.failed() && seq_ >= comm_->failed_from_)
      comm_->failure_.rethrow();
    return;
  }
  comm_->op_stream_wait(seq_, target);
}

void NcclWork::synchronize(Millis timeout) {
  if (captured_)
    throw InvalidArgument("Work.synchronize: this op was captured into a CUDA graph; it runs "
                          "when the graph is replayed: synchronize the replay's stream");
  const Deadline d(timeout);
  comm_->op_synchronize(seq_, timeout);
  comm_->settle(coll_seq_, d.never() ? timeout : Millis(d.poll_ms()));
}

bool NcclWork::is_completed() {
  if (captured_)
    throw InvalidArgument("Work.is_completed: this op was captured into a CUDA graph; it runs "
                          "when the graph is replayed");
  {
    std::lock_guard<std::mutex> lock(comm_->mu_);
    std::exception_ptr e;
    if (!comm_->op_done_locked(seq_, &e)) return false;
    if (e) return true;
  }
  // Complete once its call and every earlier one agreed too (Note [Results at host
  // synchronization points]); the checker's next round says so.
  return coll_seq_ == 0 || !comm_->check_.agreed || comm_->check_.agreed(coll_seq_);
}

std::exception_ptr NcclWork::exception() {
  if (captured_) return nullptr;
  std::lock_guard<std::mutex> lock(comm_->mu_);
  std::exception_ptr e;
  comm_->op_done_locked(seq_, &e);
  return e;
}

}  // namespace meshcoll::nccl
