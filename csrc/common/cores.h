// How many threads can run at once: what decides whether a waiting thread may spin.
//
// Note [Spinning]
// A wait that sleeps at once (a futex, a blocking poll) costs a wake-up and a context switch
// when its event comes: tens of microseconds on a VM, more than a small operation. So waits
// spin briefly first, but only where the threads that must run can each have a core: on an
// oversubscribed host the thread we wait for may need the core we would spin on (see
// docs/performance.md, "Spinning", for both costs).
//  - The transports wait for a peer process: they spin when the group's ranks fit the host's
//    CPUs (host_cores), as they did before this rule had a name.
//  - A group's worker thread and its callers' waits (Note [Brief spin] in cpu/cpu_work.cc) spin
//    when two threads per rank fit the CPUs this process may run on (process_cores, its
//    affinity mask): a process bound to one core, or a container's cpuset, does not spin.
#pragma once

#include <chrono>

namespace meshcoll {

// How long a group's worker and a wait for a small operation yield-spin before they sleep
// (Note [Brief spin] in cpu/cpu_work.cc).
inline constexpr std::chrono::microseconds kBriefSpin{20};

unsigned host_cores();     // the host's online CPUs; 0 if unknown
unsigned process_cores();  // the CPUs in this process's affinity mask; 0 if unknown

// `threads` runnable threads each have one of `cores`.
inline bool threads_fit(unsigned threads, unsigned cores) {
  return cores != 0 && threads <= cores;
}

// Whether the calling thread is a group's worker: its waits run beside callers that may
// compute, where a caller's own wait holds back nothing of its own (Note [Shared-memory spin]
// in transport/shm/segment.cc). A worker marks itself once, as it starts.
void mark_worker_thread();
bool on_worker_thread();

}  // namespace meshcoll
