// A handle on one queued operation: wait(timeout), is_completed(), exception().
#pragma once

#include <condition_variable>
#include <exception>
#include <mutex>
#include <string>

#include "common/deadline.h"

namespace meshcoll::comm {

class Work {
 public:
  explicit Work(std::string what) : what_(std::move(what)) {}
  // Blocks until done (timeout < 0: until the operation's own deadline has passed, which
  // always ends it). Rethrows the operation's exception. TimeoutError if `timeout` passes
  // first; the operation itself goes on and fails by its own deadline if it is stuck.
  void wait(Millis timeout);
  bool is_completed();
  std::exception_ptr exception();
  const std::string& what() const { return what_; }

  void finish(std::exception_ptr error);  // worker side

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  bool done_ = false;
  std::exception_ptr error_;
  std::string what_;
};

}  // namespace meshcoll::comm
