#include "comm/stamps.h"

#include <time.h>

#include <chrono>
#include <thread>

namespace meshcoll::comm {

double monotonic_seconds() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<double>(ts.tv_sec) + static_cast<double>(ts.tv_nsec) * 1e-9;
}

void CompletionStamps::await_quietly(Work& w) {
  // Note [Quiet stamps]: a short spin, then every 100 us: the end is stamped that late at
  // most, against GPU bucket all-reduces of milliseconds.
  for (int round = 0; !w.is_completed(); ++round) {
    if (round < 64)
      std::this_thread::yield();
    else
      std::this_thread::sleep_for(std::chrono::microseconds(100));
  }
}

CompletionStamps::CompletionStamps() : state_(std::make_shared<State>()) {}

CompletionStamps::~CompletionStamps() {
  {
    std::lock_guard<std::mutex> lock(state_->mu);
    state_->stop = true;
  }
  state_->work_cv.notify_one();
}

uint64_t CompletionStamps::add(WorkPtr w, bool quiet) {
  uint64_t t;
  bool wake;
  {
    std::lock_guard<std::mutex> lock(state_->mu);
    state_->queue.emplace_back(std::move(w), quiet);
    t = state_->added++;
    wake = state_->idle;
  }
  if (!started_) {
    std::thread(run, state_).detach();  // holds the state, not this object
    started_ = true;
  } else if (wake) {
    state_->work_cv.notify_one();
  }
  return t;
}

CompletionStamps::Stamp CompletionStamps::take(uint64_t t) {
  std::unique_lock<std::mutex> lock(state_->mu);
  if (t >= state_->added) throw InvalidArgument("CompletionStamps.take: no such ticket");
  if (state_->finished <= t) {
    ++state_->takers;
    state_->done_cv.wait(lock, [&] { return state_->finished > t; });
    --state_->takers;
  }
  auto it = state_->done.find(t);
  if (it == state_->done.end())
    throw InvalidArgument("CompletionStamps.take: this ticket's stamp was taken already");
  Stamp s = std::move(it->second);
  state_->done.erase(it);
  return s;
}

void CompletionStamps::run(std::shared_ptr<State> s) {
  for (;;) {
    WorkPtr w;
    bool quiet = false;
    {
      std::unique_lock<std::mutex> lock(s->mu);
      s->idle = true;
      s->work_cv.wait(lock, [&] { return s->stop || !s->queue.empty(); });
      s->idle = false;
      if (s->queue.empty()) return;  // stopped, nothing left
      w = std::move(s->queue.front().first);
      quiet = s->queue.front().second;
      s->queue.pop_front();
    }
    Stamp stamp;
    try {
      if (quiet) await_quietly(*w);
      w->synchronize(Millis(-1));  // completed: raises its failure, if any
    } catch (...) {
      stamp.error = std::current_exception();
    }
    stamp.end = monotonic_seconds();
    w.reset();  // the operation's arrays go with their last owner, outside the lock
    bool wake;
    {
      std::lock_guard<std::mutex> lock(s->mu);
      s->done.emplace(s->finished++, std::move(stamp));
      wake = s->takers > 0;
    }
    if (wake) s->done_cv.notify_all();
  }
}

}  // namespace meshcoll::comm
