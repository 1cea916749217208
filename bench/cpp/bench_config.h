// The C++ perf tools have no Python to read the environment for them (Note [Configuration]
// in csrc/common/config.h), so their mains read the core's MESHCOLL_* variables here, with
// python/meshcoll/_settings.py's rules (flags are 0 or 1, an empty value is unset), and install
// them before any rank starts. run_gpu.sh passes MESHCOLL_NCCL_LIBRARY to nccl_perf this way.
#pragma once

#include <cstdio>
#include <cstdlib>
#include <exception>
#include <string>

#include "common/config.h"

namespace meshcoll::bench {

inline void config_from_env(const char* tool) {
  auto text = [](const char* name) {
    const char* v = std::getenv(name);
    return std::string(v ? v : "");
  };
  auto bad = [tool](const char* name, const std::string& v, const char* want) {
    std::fprintf(stderr, "%s: %s='%s': %s\n", tool, name, v.c_str(), want);
    std::exit(2);
  };
  auto flag = [&](const char* name, bool dflt) {
    const std::string v = text(name);
    if (v.empty()) return dflt;
    if (v != "0" && v != "1") bad(name, v, "use 0 or 1 (or unset it)");
    return v == "1";
  };
  Config c;
  c.host_id = text("MESHCOLL_HOST_ID");
  c.cma = flag("MESHCOLL_CMA", c.cma);
  c.simd = text("MESHCOLL_SIMD");
  c.nccl_trace = flag("MESHCOLL_NCCL_TRACE", c.nccl_trace);
  c.nccl_library = text("MESHCOLL_NCCL_LIBRARY");
  c.nccl_split = flag("MESHCOLL_NCCL_SPLIT", c.nccl_split);
  try {
    set_config(c);
  } catch (const std::exception& e) {
    bad("MESHCOLL_SIMD", c.simd, e.what());
  }
}

}  // namespace meshcoll::bench
