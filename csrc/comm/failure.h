// A group's first failure, and whether it reached the caller: the part of the failure model
// every backend shares (docs/architecture.md, "The failure model").
//
// Note [Failure types]
// A group is dead after its first failure. The caller learns of it with the failure's own
// type (PeerError, TimeoutError, MismatchError, ...) the first time: from the call or Work
// that failed, or, when that was an asynchronous operation nobody waited for yet (an isend
// whose peer died, an NCCL op the watchdog failed), from the next call, which is then the
// first to hear of it; or else from destroy(). Operations already queued when the group
// failed report that type too. Once the failure has reached the caller (a Work raised or
// handed it out, or a blocking call raised it), later calls raise AbortedError naming it on
// the CPU backend: an `except PeerError` handler runs once per failure, and "aborted" is the
// witness that the call failed at once rather than at its deadline. The NCCL backend keeps
// the failure's own type for later calls too (python/meshcoll/nccl.py documents it; Note
// [NCCL failure model]): it passes own_type to for_call().
//
// Both backends keep the failure in a Failure: record() keeps the first one only,
// mark_reported() says it reached the caller, for_call() builds what a call that finds the
// group failed raises. The owner orders record() with its readers (the CPU engine: the
// thread that runs operations; NCCL: the communicator's lock); reported() is atomic because
// Works on other threads mark it.
#pragma once

#include <atomic>
#include <exception>
#include <string>

#include "common/error.h"

namespace meshcoll::comm {

class Failure {
 public:
  // Keeps `error` as the group's failure if it is the first; true if it was. The caller
  // then tells its peers and calls on_group_failure (MESHCOLL_ON_ERROR=abort) in its own
  // order: the peers first, so they hear the failure's type before this process may end.
  bool record(std::exception_ptr error) {
    if (error_) return false;
    error_ = std::move(error);
    return true;
  }
  bool failed() const { return error_ != nullptr; }
  const std::exception_ptr& error() const { return error_; }

  // The failure reached the caller: a call, wait or synchronize raised it, or a Work handed
  // it out.
  void mark_reported() { reported_.store(true, std::memory_order_release); }
  bool reported() const { return reported_.load(std::memory_order_acquire); }

  // What a call that finds the group failed raises, with message `msg` (which names the
  // failure): its own type until it reached the caller, or when `own_type` (an operation
  // queued before the failure; NCCL's later calls); AbortedError after.
  std::exception_ptr for_call(const std::string& msg, bool own_type = false) const {
    return own_type || !reported() ? same_type(error_, msg)
                                   : std::make_exception_ptr(Aborted(msg));
  }
  // Raises the failure as it was recorded; it reached the caller. Every path that hands the
  // failure to a caller goes through here or raise(), so destroy() never raises it again.
  [[noreturn]] void rethrow() {
    mark_reported();
    std::rethrow_exception(error_);
  }
  // Raises the failure with its own type, `context` before its message; it reached the
  // caller.
  [[noreturn]] void raise(const std::string& context) {
    mark_reported();
    std::rethrow_exception(same_type(error_, context + message_of(error_)));
  }

 private:
  std::exception_ptr error_;
  std::atomic<bool> reported_{false};
};

}  // namespace meshcoll::comm
