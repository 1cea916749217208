#include "comm/completions.h"

#include <condition_variable>
#include <deque>
#include <mutex>
#include <thread>
#include <unordered_map>
#include <utility>

#include "common/error.h"
#include "common/interrupt.h"

namespace meshcoll::comm {

struct Completions::State {
  struct Done {
    double end = 0;
    std::exception_ptr error;
  };
  std::mutex mu;
  std::condition_variable queued, done_cv;
  std::deque<std::pair<uint64_t, WorkPtr>> pending;
  std::unordered_map<uint64_t, Done> done;
  uint64_t next = 0;      // tickets issued
  uint64_t finished = 0;  // tickets the thread finished (in add() order): in `done` or collected
  bool started = false, stop = false;
  int rank = 0;

  static double now_s() {
    return std::chrono::duration<double>(Clock::now().time_since_epoch()).count();
  }

  // The thread holds the state, not the object: a closed object's thread finishes its
  // operation and exits on its own.
  static void run(std::shared_ptr<State> s) {
    std::unique_lock<std::mutex> lock(s->mu);
    for (;;) {
      s->queued.wait(lock, [&] { return s->stop || !s->pending.empty(); });
      if (s->stop) return;
      auto [ticket, w] = std::move(s->pending.front());
      s->pending.pop_front();
      lock.unlock();
      Done d;
      try {
        w->synchronize(Millis(-1));  // the operation's own deadline bounds it
      } catch (...) {
        d.error = std::current_exception();
      }
      d.end = now_s();
      w.reset();  // off the lock: releasing a Work may release its arrays' owners
      lock.lock();
      s->done.emplace(ticket, std::move(d));
      ++s->finished;
      s->done_cv.notify_all();
    }
  }
};

Completions::Completions(int rank) : s_(std::make_shared<State>()) { s_->rank = rank; }

Completions::~Completions() { close(); }

uint64_t Completions::add(WorkPtr w) {
  MC_ARG_CHECK(w != nullptr, "Completions.add: no operation (a synchronous call has no Work)");
  std::lock_guard<std::mutex> lock(s_->mu);
  if (s_->stop) throw Aborted("Completions.add: closed");
  if (!s_->started) {
    std::thread(&State::run, s_).detach();
    s_->started = true;
  }
  const uint64_t ticket = s_->next++;
  s_->pending.emplace_back(ticket, std::move(w));
  s_->queued.notify_one();
  return ticket;
}

double Completions::wait(uint64_t ticket) {
  const auto since = Clock::now();
  std::unique_lock<std::mutex> lock(s_->mu);
  MC_ARG_CHECK(ticket < s_->next, "Completions.wait: ticket ", ticket, " was never issued");
  for (;;) {
    auto it = s_->done.find(ticket);
    if (it != s_->done.end()) {
      State::Done d = std::move(it->second);
      s_->done.erase(it);
      if (d.error) std::rethrow_exception(d.error);
      return d.end;
    }
    MC_ARG_CHECK(ticket >= s_->finished, "Completions.wait: ticket ", ticket,
                 " was collected already");
    if (s_->stop) throw Aborted("Completions.wait: closed before the operation completed");
    s_->done_cv.wait_for(lock, kInterruptEvery);
    lock.unlock();
    check_interrupt(s_->rank, since);  // Note [Interrupts]
    lock.lock();
  }
}

void Completions::close() {
  {
    std::lock_guard<std::mutex> lock(s_->mu);
    s_->stop = true;
    s_->pending.clear();
  }
  s_->queued.notify_all();
  s_->done_cv.notify_all();
}

}  // namespace meshcoll::comm
