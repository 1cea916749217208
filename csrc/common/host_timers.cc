#include "common/host_timers.h"

#include <chrono>

namespace meshcoll::host_timers {

std::atomic<bool> enabled{false};

namespace {

using Clock = std::chrono::steady_clock;

constexpr const char* kNames[kSteps] = {
    "",
    "read arguments and arrays",
    "shared checks (Backend)",
    "window tag, ledger, agreement note",
    "lock",
    "context, capture query",
    "slot (waits while the ring of slots is full)",
    "NCCL call",
    "completion event",
    "to the return",
};

std::atomic<uint64_t> g_ns[kSteps];
std::atomic<uint64_t> g_calls[kSteps];
std::atomic<uint64_t> g_wait_ns{0};
std::atomic<uint64_t> g_waits{0};

thread_local Clock::time_point t_last;
thread_local bool t_in_call = false;
thread_local unsigned t_seen = 0;  // steps this call reached (a nested call's are not counted)

}  // namespace

void mark_slow(Step s) {
  const auto now = Clock::now();
  if (s == kEntry) {
    t_in_call = true;
    t_seen = 0;
    t_last = now;
    return;
  }
  // Outside a fast-path call, or a step again (a call nested in this one: the agreement's
  // channel): its time stays in the span of the outer call's next step.
  if (!t_in_call || (t_seen & (1u << s))) return;
  t_seen |= 1u << s;
  const auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(now - t_last).count();
  g_ns[s].fetch_add(static_cast<uint64_t>(ns), std::memory_order_relaxed);
  g_calls[s].fetch_add(1, std::memory_order_relaxed);
  if (s == kReturned) t_in_call = false;
  t_last = Clock::now();  // this bookkeeping is not charged to the next span
}

void abandon() { t_in_call = false; }

void add_slot_wait(uint64_t ns) {
  if (!enabled.load(std::memory_order_relaxed)) return;
  g_wait_ns.fetch_add(ns, std::memory_order_relaxed);
  g_waits.fetch_add(1, std::memory_order_relaxed);
}

std::vector<Row> take(bool reset) {
  std::vector<Row> rows;
  for (int s = kRead; s < kSteps; ++s) {
    const uint64_t n = reset ? g_calls[s].exchange(0) : g_calls[s].load();
    const uint64_t ns = reset ? g_ns[s].exchange(0) : g_ns[s].load();
    if (n) rows.push_back(Row{kNames[s], n, static_cast<double>(ns) / static_cast<double>(n) / 1000.0});
  }
  const uint64_t n = reset ? g_waits.exchange(0) : g_waits.load();
  const uint64_t ns = reset ? g_wait_ns.exchange(0) : g_wait_ns.load();
  if (n)
    rows.push_back(Row{"of the slot step: waits for a free slot", n,
                       static_cast<double>(ns) / static_cast<double>(n) / 1000.0});
  return rows;
}

}  // namespace meshcoll::host_timers
