// The CPU backend's Work (the contract's handle, comm/work.h): finished by the engine's thread
// that ran the operation.
#pragma once

#include <atomic>
#include <condition_variable>
#include <exception>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "comm/failure.h"
#include "comm/work.h"
#include "common/deadline.h"
#include "common/interrupt.h"
#include "transport/transport.h"

namespace meshcoll::cpu {

// The CPU backend's Work: finished by the thread that ran the operation. It holds the
// owners of the operation's arrays until then (Note [Owners] in python/array.cc).
class CpuWork : public comm::Work {
 public:
  // The description is formatted only when an error needs it: this is on every call's path.
  // `failure`: the group's (Note [Failure types] in comm/failure.h), marked reported when
  // this Work raises or hands out its failure.
  // `spin`: wait() spins briefly before it sleeps (Note [Brief spin] in cpu_work.cc).
  // `pending`: the group's count, which counted this Work in (issued()) and outlives its end.
  CpuWork(int rank, const OpDesc& op, std::shared_ptr<StopRequest> stop,
          std::shared_ptr<comm::Failure> failure, bool spin, comm::PendingWorks* pending)
      : rank_(rank), op_(op), stop_(std::move(stop)), failure_(std::move(failure)),
        spin_(spin), pending_(pending) {}
  // TimeoutError if `timeout` passes first; the operation itself goes on and fails by its
  // own deadline if it is stuck.
  void wait(Millis timeout, bool has_stream = false, comm::Stream stream = nullptr) override;
  bool is_completed() override;
  std::exception_ptr exception() override;
  std::string what() const;

  void keep(std::shared_ptr<void> owner) { keep_.push_back(std::move(owner)); }
  void finish(std::exception_ptr error);  // worker side; drops the owners

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  bool done_ = false;
  std::atomic<bool> finished_{false};  // done_, readable without mu_ (the brief spin in wait)
  std::exception_ptr error_;
  int rank_;
  OpDesc op_;
  std::shared_ptr<StopRequest> stop_;  // the group's: an interrupted wait stops the operation
  std::shared_ptr<comm::Failure> failure_;
  const bool spin_;
  comm::PendingWorks* pending_;
  std::vector<std::shared_ptr<void>> keep_;
};

}  // namespace meshcoll::cpu
