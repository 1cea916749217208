#include "common/interrupt.h"

#include <atomic>

namespace meshcoll {

namespace {
std::atomic<InterruptHook> g_hook{nullptr};
thread_local WaitWatch* t_watch = nullptr;
}

void set_interrupt_hook(InterruptHook hook) { g_hook.store(hook); }

WaitWatch::WaitWatch(std::function<void()> check) : check_(std::move(check)), outer_(t_watch) {
  t_watch = this;
}

WaitWatch::~WaitWatch() { t_watch = outer_; }

void check_interrupt(int rank, Clock::time_point waiting_since) {
  InterruptHook hook = g_hook.load(std::memory_order_relaxed);
  if (!hook && !t_watch) return;
  auto now = Clock::now();
  if (t_watch) {  // Note [Steps watch their call's group]
    thread_local Clock::time_point next_watch;
    if (now >= next_watch && now - waiting_since >= kWatchEvery) {
      next_watch = now + kWatchEvery;
      WaitWatch* w = t_watch;
      t_watch = nullptr;  // the check's own waits, if any, do not run it again
      try {
        w->check_();
      } catch (...) {
        t_watch = w;
        throw;
      }
      t_watch = w;
    }
  }
  if (!hook) return;
  thread_local Clock::time_point next;
  if (now < next || now - waiting_since < kInterruptEvery) return;
  next = now + kInterruptEvery;
  std::string raised = hook();
  if (!raised.empty())
    throw Interrupted(str_cat("rank ", rank, " was interrupted (", raised, ")"));
}

}  // namespace meshcoll
