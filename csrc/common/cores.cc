#include "common/cores.h"

#include <sched.h>

#include <thread>

namespace meshcoll {

unsigned host_cores() { return std::thread::hardware_concurrency(); }

unsigned process_cores() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof(set), &set) != 0) return host_cores();
  return static_cast<unsigned>(CPU_COUNT(&set));
}

namespace {
thread_local bool t_worker = false;
}  // namespace

void mark_worker_thread() { t_worker = true; }
bool on_worker_thread() { return t_worker; }

}  // namespace meshcoll
