#include "comm/work.h"

#include "comm/comm.h"
#include "common/error.h"
#include "common/interrupt.h"

namespace meshcoll::comm {

// Waits in naps of kInterruptEvery (Note [Interrupts]). An interrupt here also stops the
// operation, which fails the group.
void CpuWork::wait(Millis timeout, bool, Stream) {
  const Deadline d(timeout);
  const auto since = Clock::now();
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
    reported_->store(true);
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
  if (error_) reported_->store(true);
  return error_;
}

void CpuWork::finish(std::exception_ptr error) {
  std::vector<std::shared_ptr<void>> owners;
  {
    std::lock_guard<std::mutex> lock(mu_);
    done_ = true;
    error_ = error;
    owners.swap(keep_);
  }
  cv_.notify_all();
  // `owners` goes out of scope here, off the lock: the memory may be freed now.
}

}  // namespace meshcoll::comm
