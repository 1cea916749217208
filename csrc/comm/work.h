// Work: the handle every backend returns for an operation (the contract's result type). The
// CPU backend's is cpu/cpu_work.h, the NCCL backend's NcclWork.
#pragma once

#include <atomic>
#include <exception>
#include <memory>

#include "common/deadline.h"
#include "common/interrupt.h"

namespace meshcoll::comm {

// A CUDA stream as the contract passes it (CUstream; nullptr is the legacy default stream).
// The CPU backend has none.
using Stream = void*;

class Work {
 public:
  virtual ~Work() = default;
  // Waits for the operation (timeout < 0: until its own deadline, which always ends it) and
  // rethrows its failure. On a GPU backend the wait is on `stream` (given) or the stream
  // the operation was issued from: that stream waits for the operation, the host does not.
  virtual void wait(Millis timeout, bool has_stream = false, Stream stream = nullptr) = 0;
  // Blocks the host until the operation completed (timeout < 0: its own deadline).
  virtual void synchronize(Millis timeout) { wait(timeout); }
  virtual bool is_completed() = 0;
  virtual std::exception_ptr exception() = 0;
  // True for a GPU operation captured into a CUDA graph (it runs at each replay).
  virtual bool captured() const { return false; }
};
using WorkPtr = std::shared_ptr<Work>;

// Note [One issuing thread] (comm/backend.h): a group's Works that have not ended, and
// whether a thread issued on the group while another thread's were pending (an intrusion).
// One atomic word holds both, so each Work's end is ordered with the intrusion: a Work that
// ends after it raises it instead of returning a result that may be crossed. A backend
// whose Works end on the host counts them (the CPU one); the others count none.
class PendingWorks {
 public:
  // A Work was issued: before it can end.
  void issued() { state_.fetch_add(1, std::memory_order_relaxed); }
  // It ended: the intrusion's error, to raise instead of its result, if one came before.
  std::exception_ptr ended() {
    return state_.fetch_sub(1, std::memory_order_acq_rel) & kIntruded ? error_ : nullptr;
  }
  bool none() const { return (state_.load(std::memory_order_acquire) & ~kIntruded) == 0; }
  // By the thread that holds the group's Issue mark (one at a time): if a Work is pending,
  // marks the intrusion, whose error those Works raise (`error`), and returns true.
  bool intrude(const std::exception_ptr& error) {
    uint64_t v = state_.load(std::memory_order_acquire);
    do {
      if ((v & ~kIntruded) == 0) return false;
      if (v & kIntruded) return true;
      error_ = error;  // read only by Works that see kIntruded, set below
    } while (!state_.compare_exchange_weak(v, v | kIntruded, std::memory_order_acq_rel));
    return true;
  }

 private:
  static constexpr uint64_t kIntruded = uint64_t{1} << 63;
  std::atomic<uint64_t> state_{0};
  std::exception_ptr error_;
};

}  // namespace meshcoll::comm
