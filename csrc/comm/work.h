// A handle on one queued operation: wait(timeout), is_completed(), exception().
#pragma once

#include <condition_variable>
#include <exception>
#include <mutex>
#include <string>

#include "common/deadline.h"
#include "transport/transport.h"

namespace meshcoll::comm {

class Work {
 public:
  // The description is formatted only when an error needs it: this is on every call's path.
  Work(int rank, const transport::OpDesc& op) : rank_(rank), op_(op) {}
  // Blocks until done (timeout < 0: until the operation's own deadline has passed, which
  // always ends it). Rethrows the operation's exception. TimeoutError if `timeout` passes
  // first; the operation itself goes on and fails by its own deadline if it is stuck.
  void wait(Millis timeout);
  bool is_completed();
  std::exception_ptr exception();
  std::string what() const;

  void finish(std::exception_ptr error);  // worker side

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  bool done_ = false;
  std::exception_ptr error_;
  int rank_;
  transport::OpDesc op_;
};

}  // namespace meshcoll::comm
