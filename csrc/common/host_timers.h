// Host time of a call, step by step: where a small call's microseconds go.
//
// Note [Host timers]
// A small collective is bound by the host (an 8-byte NCCL all_reduce: NCCL's own enqueue is
// most of it, and meshcoll's steps around it the rest). MESHCOLL_HOST_TIMERS=1 times each
// synchronous fast-path call (the METH_FASTCALL methods of python/fastcall.h: all_reduce,
// all_gather, reduce_scatter, broadcast, reduce) between fixed steps, on the steady clock,
// per thread, and sums the spans process-wide; _C.host_timers() reads them
// (bench/python/nccl_host_cost.py --steps prints them). A span is attributed to the step that
// ends it, and only within one call (the entry starts it, the return or a failure ends it; a
// call nested in it, the agreement's channel round, adds its time to the outer call's next
// step). Off (the default), each step costs one predictable branch.
#pragma once

#include <atomic>
#include <cstdint>
#include <string>
#include <vector>

namespace meshcoll::host_timers {

enum Step : int {
  kEntry,     // the binding was entered: starts the call's spans
  kRead,      // arguments and arrays read
  kIssued,    // the shared checks (Backend) done: the backend's own part begins
  kNoted,     // NCCL: window tag, ledger record, agreement note (and its wait, if symmetric)
  kLocked,    // NCCL: the communicator's lock taken
  kCaptured,  // NCCL: context set, capture queried
  kPrepared,  // NCCL: deadline, slot claimed (a wait while kSlots ops are in flight)
  kLaunched,  // NCCL: the NCCL call returned
  kRecorded,  // NCCL: completion event recorded
  kReturned,  // back in the binding, about to return
  kSteps
};

// Config::host_timers, as set_config last set it (a relaxed load on the hot path).
extern std::atomic<bool> enabled;

void mark_slow(Step s);
inline void mark(Step s) {
  if (enabled.load(std::memory_order_relaxed)) mark_slow(s);
}
// This thread's call failed before its return: nothing more of it is timed.
void abandon();
// A wait inside the slot step (NCCL: every slot of the ring holds an op in flight), counted
// apart: take() adds a row for the waits when any happened. Off, nothing is counted.
void add_slot_wait(uint64_t ns);

struct Row {
  std::string step;  // what the span ending at this step covers
  uint64_t calls;
  double mean_us;
};
// The spans so far (steps never reached are left out); `reset` starts new sums.
std::vector<Row> take(bool reset);

}  // namespace meshcoll::host_timers
