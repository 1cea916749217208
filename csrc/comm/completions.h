// Completions: when each of a series of operations completed, stamped without Python.
//
// Note [Completion stamps]
// DataParallel's stats (Note [Stats] in meshcoll/ddp.py) need the moment each bucket's
// all-reduce completed. A Python thread that waits on each Work pays two GIL handoffs per
// bucket, which measured 65-70 us per bucket on a 2-core host: more than a small all-reduce.
// Completions waits in C++ instead: one thread per object, started by the first add(), waits
// for the operations in add() order (a group's operations complete in issue order, so none
// waits behind a later one) and stamps each end on the steady clock (CLOCK_MONOTONIC, which
// is Python's time.monotonic()). wait(ticket) returns that stamp or rethrows the failure.
// An operation always ends (by its own deadline if stuck), so the thread does too; close()
// or the destructor stops it after the operation it is waiting for, without blocking.
#pragma once

#include <cstdint>
#include <memory>

#include "comm/work.h"

namespace meshcoll::comm {

class Completions {
 public:
  explicit Completions(int rank);  // `rank` (global) names this process in interrupt errors
  ~Completions();
  Completions(const Completions&) = delete;
  Completions& operator=(const Completions&) = delete;

  // Queues `w`; its ticket for wait(). After close(): Aborted.
  uint64_t add(WorkPtr w);
  // Blocks until the operation of `ticket` completed; its end in seconds on the steady clock,
  // or its failure rethrown. Each ticket is collected once (InvalidArgument otherwise).
  // Interruptible (Note [Interrupts]).
  double wait(uint64_t ticket);
  // Stops the thread once the operation it waits for ends; uncollected tickets are dropped.
  void close();

 private:
  struct State;
  std::shared_ptr<State> s_;
};

}  // namespace meshcoll::comm
