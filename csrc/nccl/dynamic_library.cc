#include "nccl/dynamic_library.h"

#include <dlfcn.h>
#include <link.h>

#include "common/error.h"

namespace meshcoll::nccl {

namespace {
std::string loaded_path(void* handle, const std::string& fallback) {
  struct link_map* map = nullptr;
  if (dlinfo(handle, RTLD_DI_LINKMAP, &map) == 0 && map && map->l_name && map->l_name[0])
    return map->l_name;
  return fallback;
}
}  // namespace

DynamicLibrary DynamicLibrary::open(const std::string& what,
                                    const std::vector<std::string>& candidates) {
  std::string tried;
  for (const auto& c : candidates) {
    if (c.empty()) continue;
    dlerror();  // clear
    // RTLD_LOCAL keeps its symbols out of the global namespace (no clash with a framework
    // that links its own copy); RTLD_NOW surfaces missing dependencies here, not mid-call.
    void* h = dlopen(c.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (h) return DynamicLibrary(h, loaded_path(h, c));
    const char* err = dlerror();
    tried += str_cat("\n  ", c, ": ", err ? err : "unknown dlopen error");
  }
  throw Error(str_cat(what, " could not be loaded; tried, in order:", tried));
}

void* DynamicLibrary::find(const char* name) const {
  return handle_ ? dlsym(handle_, name) : nullptr;
}

void* DynamicLibrary::require(const char* name) const {
  void* p = find(name);
  if (!p) throw Error(str_cat(path_, " has no symbol ", name, " (too old a version?)"));
  return p;
}

}  // namespace meshcoll::nccl
