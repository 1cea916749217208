// Interrupts (Ctrl-C) while a call blocks with the GIL released.
//
// Note [Interrupts]
// Python runs signal handlers only when the main thread executes bytecode, and a blocking
// collective keeps it in C++ until the call returns: a Ctrl-C waited for the call's
// deadline. So every blocking wait (TCP polls, shared-memory naps, Work.wait) calls
// check_interrupt() at least every kInterruptEvery. Only waits that already lasted that long
// run the hook: a loop of short calls never takes the GIL here (Python checks for signals
// between them anyway), so a thread holding the GIL cannot slow it. The bindings install a
// hook that takes the GIL and runs the pending Python signal handlers (on the main thread
// only, where Python runs them); when a handler raises (KeyboardInterrupt for SIGINT), the hook keeps
// that Python exception for the binding to raise as the call's result and check_interrupt
// throws Interrupted. Interrupted is a PeerError: the operation fails the group as any
// failure does, and the peers raise PeerError naming the interrupted rank at once.
// A handler that does not raise (a user's own SIGINT handler) lets the call go on.
// Work.wait() waits for an operation that runs on the group's worker thread: an interrupt
// there also asks that operation to stop (StopRequest), so the group fails as it would had
// the call been synchronous, instead of the operation running on to its deadline.
#pragma once

#include <atomic>
#include <mutex>
#include <string>

#include "common/deadline.h"
#include "common/error.h"

namespace meshcoll {

class Interrupted : public PeerError {
 public:
  using PeerError::PeerError;
};

inline constexpr Millis kInterruptEvery{100};

// A request, from a thread waiting on a group's Work, that the group's running operation
// stop: set from any thread, checked by the group's waits, which throw Interrupted.
class StopRequest {
 public:
  void request(const std::string& why) {
    std::lock_guard<std::mutex> lock(mu_);
    if (!requested_.load()) why_ = why;
    requested_.store(true);
  }
  // Throws Interrupted if a stop was requested.
  void check() const {
    if (!requested_.load(std::memory_order_relaxed)) return;
    std::lock_guard<std::mutex> lock(mu_);
    throw Interrupted(why_);
  }

 private:
  std::atomic<bool> requested_{false};
  mutable std::mutex mu_;
  std::string why_;
};

// The hook returns the name of the exception a signal handler raised ("KeyboardInterrupt"),
// or "" when the call should go on. nullptr: no hook (C++ users, tests of the core).
using InterruptHook = std::string (*)();
void set_interrupt_hook(InterruptHook hook);

// Runs the hook when the wait began at least kInterruptEvery ago and this thread last ran it
// at least that long ago; throws Interrupted ("rank <rank> was interrupted (<exception>)")
// when a signal handler raised.
void check_interrupt(int rank, Clock::time_point waiting_since);

}  // namespace meshcoll
