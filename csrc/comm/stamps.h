// CompletionStamps: when each of a sequence of operations completed, observed by a C++ thread
// (DataParallel's statistics: Note [Stats] in python/meshcoll/ddp.py).
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <memory>
#include <mutex>
#include <unordered_map>

#include "comm/work.h"
#include "common/error.h"

namespace meshcoll::comm {

// Seconds on CLOCK_MONOTONIC: the clock of the stamps, and of Python's time.perf_counter.
double monotonic_seconds();

// Note [Completion stamps]
// DataParallel stamps the time each bucket's all-reduce completed. A Python thread that
// blocks on each Work in turn costs the issuing thread a GIL handoff per bucket: every time
// the waiter wakes it needs the GIL, which the issuing thread gives up at its next call into
// C++ and must then wait to get back: a large share of a bucket's host time (see
// docs/performance.md, "Completion stamps"). Here one C++ thread, which never takes the GIL, waits
// on each Work in the order they were added and records its end (CLOCK_MONOTONIC, the clock
// of Python's time.perf_counter on Linux) and its failure; take() hands them over.
class CompletionStamps {
 public:
  struct Stamp {
    double end = 0;            // seconds, CLOCK_MONOTONIC
    std::exception_ptr error;  // the operation's failure, if any
  };

  CompletionStamps();
  // Does not wait for the thread: it ends once the Work it waits on completed (every Work
  // ends by its deadline).
  ~CompletionStamps();
  CompletionStamps(const CompletionStamps&) = delete;
  CompletionStamps& operator=(const CompletionStamps&) = delete;

  // Queues `w`; returns its ticket (consecutive from 0).
  // `quiet`: wait for it without hammering its backend (Note [Quiet stamps]): for GPU work.
  uint64_t add(WorkPtr w, bool quiet = false);
  // Blocks until ticket `t`'s Work completed and hands over its stamp (once per ticket).
  Stamp take(uint64_t t);

 private:
  // A wakeup is a system call (what add() costs when it wakes the thread: docs/performance.md,
  // "Completion stamps"), so each side is woken only when it sleeps: while the thread waits on
  // an earlier Work (a GPU op still running), add() makes none.
  struct State {
    std::mutex mu;
    std::condition_variable work_cv;  // the thread waits for work
    std::condition_variable done_cv;  // take() waits for a stamp
    std::deque<std::pair<WorkPtr, bool>> queue;  // added, not yet waited on; quiet
    uint64_t added = 0;               // tickets handed out
    std::unordered_map<uint64_t, Stamp> done;
    uint64_t finished = 0;            // tickets [0, finished) have their stamps
    bool idle = false;                // the thread sleeps on work_cv
    int takers = 0;                   // threads asleep in take()
    bool stop = false;
  };
  static void run(std::shared_ptr<State> s);
  // Note [Quiet stamps]
  // GPU work is waited for without hammering its backend. Work.synchronize on an NCCL op
  // spins on cuEventQuery (thousands of calls a millisecond, for the lowest latency), and a
  // driver call takes the context's locks, which the thread launching a training step's
  // kernels needs too (docs/performance.md, "Completion stamps", has what a spinning stamper
  // cost a DDP step). Stamps need no such latency:
  // is_completed() with a short spin, then every 100 us. CPU work is waited for with
  // Work.synchronize, which sleeps on its condition variable and wakes at its end.
  static void await_quietly(Work& w);
  std::shared_ptr<State> state_;
  bool started_ = false;
};

}  // namespace meshcoll::comm
