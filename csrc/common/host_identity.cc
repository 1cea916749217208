#include "common/host_identity.h"

#include <unistd.h>

#include <fstream>

#include "common/config.h"
#include "common/error.h"

namespace meshcoll {

namespace {
std::string read_first_line(const char* path) {
  std::ifstream f(path);
  std::string s;
  std::getline(f, s);
  return s;
}

std::string link_target(const char* path) {
  char buf[256];
  ssize_t n = ::readlink(path, buf, sizeof(buf) - 1);
  return n > 0 ? std::string(buf, n) : std::string();
}
}  // namespace

std::string host_identity() {
  // MESHCOLL_HOST_ID overrides (tests that emulate several hosts on one machine).
  if (std::string forced = config().host_id; !forced.empty()) return forced;
  char host[256] = {0};
  gethostname(host, sizeof(host) - 1);
  // Same boot and same IPC namespace: two containers on one host may not share /dev/shm.
  return str_cat(host, "|", read_first_line("/proc/sys/kernel/random/boot_id"), "|",
                 link_target("/proc/self/ns/ipc"));
}

}  // namespace meshcoll
