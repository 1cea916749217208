#include "common/config.h"

#include <signal.h>
#include <unistd.h>

#include <mutex>

#include "common/check.h"
#include "common/host_timers.h"

namespace meshcoll {

namespace {

std::mutex& config_mu() {
  static std::mutex* mu = new std::mutex();  // never destroyed: threads may read at exit
  return *mu;
}

Config& current() {
  static Config* c = new Config();
  return *c;
}

}  // namespace

Config config() {
  std::lock_guard<std::mutex> lock(config_mu());
  return current();
}

void set_config(const Config& c) {
  MC_ARG_CHECK(c.simd.empty() || c.simd == "baseline" || c.simd == "avx2" || c.simd == "avx512",
               "simd='", c.simd, "' is not a SIMD level; use baseline, avx2 or avx512 (or '' "
               "for no cap)");
  MC_ARG_CHECK(c.shm_all_reduce == "auto" || c.shm_all_reduce == "flat" ||
                   c.shm_all_reduce == "scalable",
               "shm_all_reduce='", c.shm_all_reduce, "' is not a path; use auto, flat or scalable");
  std::lock_guard<std::mutex> lock(config_mu());
  current() = c;
  host_timers::enabled.store(c.host_timers, std::memory_order_relaxed);
}

void fault_point(const std::string& point) {
  const std::string fault = config().fault;
  if (fault == "kill@" + point) ::kill(::getpid(), SIGKILL);
  if (fault == "stop@" + point) ::kill(::getpid(), SIGSTOP);
}

}  // namespace meshcoll
