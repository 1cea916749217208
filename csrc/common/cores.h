// Whether a waiting thread may spin: the one rule every wait that spins before sleeping uses.
//
// Note [Spinning]
// A wait that sleeps at once (a futex, a blocking poll) costs a wake-up and a context switch
// when its event comes: tens of microseconds on a VM (a condition-variable round trip between
// two threads measured 35-40 us on the 2-core CI VM), more than a small operation. So waits
// spin briefly first, but only where every thread that must run can have a core: on an
// oversubscribed host the thread we wait for may need the core we would spin on (on the
// 2-core VM, yield-spinning workers made 2-rank DataParallel steps 3x slower). The
// transports count one thread per rank (the peer publishing); a group's worker thread and
// its caller count two per rank (Note [Brief spin] in comm/work.cc).
#pragma once

namespace meshcoll {

// The CPUs this process may run on (its affinity mask), 0 if unknown.
unsigned usable_cores();

// `threads` runnable threads each have a core.
inline bool threads_fit_cores(unsigned threads) {
  const unsigned cores = usable_cores();
  return cores != 0 && threads <= cores;
}

}  // namespace meshcoll
