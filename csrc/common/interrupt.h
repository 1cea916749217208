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
// only, where Python runs them); when a handler raises (KeyboardInterrupt for SIGINT), the hook
// keeps that Python exception for the binding to raise as the call's result and check_interrupt
// throws Interrupted. Interrupted is a PeerError: the operation fails the group as any
// failure does, and the peers raise PeerError naming the interrupted rank at once.
// A handler that does not raise (a user's own SIGINT handler) lets the call go on.
// Work.wait() waits for an operation that runs on the group's worker thread: an interrupt
// there also asks that operation to stop (StopRequest), so the group fails as it would had
// the call been synchronous, instead of the operation running on to its deadline.
#pragma once

#include <atomic>
#include <functional>
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
// when a signal handler raised. Runs this thread's WaitWatch too.
void check_interrupt(int rank, Clock::time_point waiting_since);

// Note [Steps watch their call's group]
// A composed call (the hierarchy's, Note [Hierarchy] in python/meshcoll/hierarchy.py) is one
// operation of its group whose steps run, and wait, on other groups' links. A rank that made
// another call at that sequence number, one that runs flat on the group's own links, sends
// its frames and its probes (Note [Probes] in tcp_transport.cc) where nobody reads while the
// steps wait: the two calls never met, and every rank would wait to its timeout. So while a
// thread runs a composed call's steps it installs a WaitWatch, and every wait of that thread
// (check_interrupt) also runs it, at most every kWatchEvery once the wait has lasted that long:
// it reads the group's own links, where a frame or probe of another call at the call's sequence
// number is a MismatchError naming both calls, and a peer's ABORT is that peer's failure, at
// once. Thread-local because the watched links belong to the thread that runs the composed call
// (the only one whose waits run it). Only waits need it: a composed call cannot complete while
// a rank runs another call, since its steps need every rank (a rank whose part only sends may
// finish, and meets the stray frames at its next call, as on a flat group).
inline constexpr Millis kWatchEvery{10};

class WaitWatch {
 public:
  // For this thread's waits until destroyed (nested watches: the innermost runs).
  explicit WaitWatch(std::function<void()> check);
  ~WaitWatch();
  WaitWatch(const WaitWatch&) = delete;
  WaitWatch& operator=(const WaitWatch&) = delete;

 private:
  friend void check_interrupt(int, Clock::time_point);
  std::function<void()> check_;
  WaitWatch* outer_;
};

}  // namespace meshcoll
