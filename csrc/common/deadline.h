// A point in time after which a blocking call gives up. Every blocking call takes one.
#pragma once

#include <chrono>
#include <cstdint>

namespace meshcoll {

using Clock = std::chrono::steady_clock;
using Millis = std::chrono::milliseconds;

// A group's and a store's timeout when none is given; Python reads it as _C.DEFAULT_TIMEOUT_S.
inline constexpr Millis kDefaultTimeout{300000};

class Deadline {
 public:
  Deadline() : at_(Clock::time_point::max()) {}  // never
  explicit Deadline(Millis timeout) : Deadline(timeout, Clock::now()) {}
  // From a clock reading the caller already took (a hot path reads the clock once per call).
  Deadline(Millis timeout, Clock::time_point now)
      : at_(timeout.count() < 0 ? Clock::time_point::max() : now + timeout), timeout_(timeout) {}
  static Deadline after_ms(int64_t ms) { return Deadline(Millis(ms)); }
  // Ends at `at`; `timeout` is the span it stands for, for messages.
  static Deadline until(Clock::time_point at, Millis timeout) {
    Deadline d;
    d.at_ = at;
    d.timeout_ = timeout;
    return d;
  }

  bool expired() const { return Clock::now() >= at_; }
  // Milliseconds left, clamped to [0, INT32_MAX] for poll(); -1 means forever.
  int poll_ms() const {
    if (at_ == Clock::time_point::max()) return -1;
    auto left = std::chrono::duration_cast<Millis>(at_ - Clock::now()).count();
    if (left <= 0) return 0;
    return left > INT32_MAX ? INT32_MAX : static_cast<int>(left);
  }
  Millis timeout() const { return timeout_; }  // the span it was made with, for messages
  bool never() const { return at_ == Clock::time_point::max(); }
  Clock::time_point at() const { return at_; }

 private:
  Clock::time_point at_;
  Millis timeout_{-1};
};

}  // namespace meshcoll
