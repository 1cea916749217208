#include "common/interrupt.h"

#include <atomic>

namespace meshcoll {

namespace {
std::atomic<InterruptHook> g_hook{nullptr};
}

void set_interrupt_hook(InterruptHook hook) { g_hook.store(hook); }

void check_interrupt(int rank, Clock::time_point waiting_since) {
  InterruptHook hook = g_hook.load(std::memory_order_relaxed);
  if (!hook) return;
  thread_local Clock::time_point next;
  auto now = Clock::now();
  if (now < next || now - waiting_since < kInterruptEvery) return;
  next = now + kInterruptEvery;
  std::string raised = hook();
  if (!raised.empty())
    throw Interrupted(str_cat("rank ", rank, " was interrupted (", raised, ")"));
}

}  // namespace meshcoll
