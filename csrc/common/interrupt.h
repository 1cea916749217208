// Interrupts (Ctrl-C) while a call blocks with the GIL released.
//
// Note [Interrupts]
// Python runs signal handlers only when the main thread executes bytecode, and a blocking
// collective keeps it in C++ until the call returns: a Ctrl-C waited for the call's
// deadline. So every blocking wait (TCP polls, shared-memory naps, Work.wait) calls
// check_interrupt() at least every kInterruptEvery. Only waits that already lasted that long
// run the hook: a loop of short calls never takes the GIL here (Python checks for signals
// between them anyway), so a thread holding the GIL cannot slow it. The bindings install a
// hook that takes
// the GIL and runs the pending Python signal handlers (on the main thread only, where
// Python runs them); when a handler raises (KeyboardInterrupt for SIGINT), the hook keeps
// that Python exception for the binding to raise as the call's result and check_interrupt
// throws Interrupted. Interrupted is a PeerError: the operation fails the group as any
// failure does, and the peers raise PeerError naming the interrupted rank at once.
// A handler that does not raise (a user's own SIGINT handler) lets the call go on.
#pragma once

#include <string>

#include "common/deadline.h"
#include "common/error.h"

namespace meshcoll {

class Interrupted : public PeerError {
 public:
  using PeerError::PeerError;
};

inline constexpr Millis kInterruptEvery{100};

// The hook returns the name of the exception a signal handler raised ("KeyboardInterrupt"),
// or "" when the call should go on. nullptr: no hook (C++ users, tests of the core).
using InterruptHook = std::string (*)();
void set_interrupt_hook(InterruptHook hook);

// Runs the hook when the wait began at least kInterruptEvery ago and this thread last ran it
// at least that long ago; throws Interrupted ("rank <rank> was interrupted (<exception>)")
// when a signal handler raised.
void check_interrupt(int rank, Clock::time_point waiting_since);

}  // namespace meshcoll
