#include "cpu/cpu_work.h"

#include <thread>

#include "cpu/engine.h"
#include "common/cores.h"
#include "common/error.h"
#include "common/interrupt.h"

namespace meshcoll::cpu {

// Waits in naps of kInterruptEvery (Note [Interrupts]). An interrupt here also stops the
// operation, which fails the group.
void CpuWork::wait(Millis timeout, bool, comm::Stream) {
  const Deadline d(timeout);
  const auto since = Clock::now();
  // Note [Brief spin]: a small asynchronous operation finishes within microseconds on the
  // group's worker, and a sleep on the condition variable costs the caller a futex wake-up
  // and a context switch; so does handing the worker its next operation. Where the caller and
  // the worker of every rank can each have a core (Note [Spinning] in common/cores.h), both
  // yield-spin for kBriefSpin first: the worker after each operation (Comm::worker_loop),
  // the caller here (see docs/performance.md, "2026-11-26 (95bef94): the worker and wait()
  // spin before they sleep").
  while (spin_ && !finished_.load(std::memory_order_acquire) && Clock::now() - since < kBriefSpin)
    std::this_thread::yield();
  std::unique_lock<std::mutex> lock(mu_);
  while (!done_) {
    if (d.expired())
      throw TimeoutError(str_cat(what(), " did not complete within ", timeout.count(),
                                 " ms (Work.wait timeout); it keeps running and fails by its "
                                 "own deadline if a peer never arrives"));
    cv_.wait_for(lock, kInterruptEvery);
    if (!done_) {
      lock.unlock();
      try {
        check_interrupt(rank_, since);
      } catch (const Interrupted& e) {
        stop_->request(e.what());
        throw;
      }
      lock.lock();
    }
  }
  if (error_) {
    failure_->mark_reported();
    std::rethrow_exception(error_);
  }
}

std::string CpuWork::what() const { return str_cat("rank ", rank_, " ", describe_op(op_)); }

bool CpuWork::is_completed() {
  std::lock_guard<std::mutex> lock(mu_);
  return done_;
}

std::exception_ptr CpuWork::exception() {
  std::lock_guard<std::mutex> lock(mu_);
  if (error_) failure_->mark_reported();
  return error_;
}

void CpuWork::finish(std::exception_ptr error) {
  // Counted out before a waiter can return: a thread that issues once this Work's wait has
  // returned (a pool's next task) must find it ended.
  if (std::exception_ptr intrusion = pending_->ended(); intrusion && !error) error = intrusion;
  std::vector<std::shared_ptr<void>> owners;
  {
    std::lock_guard<std::mutex> lock(mu_);
    done_ = true;
    error_ = error;
    owners.swap(keep_);
    finished_.store(true, std::memory_order_release);
  }
  cv_.notify_all();
  // `owners` goes out of scope here, off the lock: the memory may be freed now.
}

}  // namespace meshcoll::cpu
