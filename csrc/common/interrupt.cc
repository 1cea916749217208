#include "common/interrupt.h"

#include <atomic>

namespace meshcoll {

namespace {
std::atomic<InterruptHook> g_hook{nullptr};
}

void set_interrupt_hook(InterruptHook hook) { g_hook.store(hook); }

void check_interrupt(int rank) {
  InterruptHook hook = g_hook.load(std::memory_order_relaxed);
  if (!hook) return;
  thread_local Clock::time_point next;
  auto now = Clock::now();
  if (now < next) return;
  next = now + kInterruptEvery;
  std::string raised = hook();
  if (!raised.empty())
    throw Interrupted(str_cat("rank ", rank, " was interrupted (", raised, ")"));
}

}  // namespace meshcoll
