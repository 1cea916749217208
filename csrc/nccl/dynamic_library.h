// A shared library opened at run time (dlopen), from the first of several candidate paths
// that loads. Symbols are looked up by name; a missing required symbol is an error naming
// the library's path, so "which NCCL did we load" is always answerable.
#pragma once

#include <string>
#include <vector>

namespace meshcoll::nccl {

class DynamicLibrary {
 public:
  // Tries each candidate in order (a path, or a bare soname for the system search).
  // Throws meshcoll::Error listing every candidate with its dlerror() when none loads.
  // `what` names the library in messages ("NCCL").
  static DynamicLibrary open(const std::string& what, const std::vector<std::string>& candidates);

  DynamicLibrary(DynamicLibrary&& o) noexcept : handle_(o.handle_), path_(std::move(o.path_)) {
    o.handle_ = nullptr;
  }
  DynamicLibrary(const DynamicLibrary&) = delete;
  DynamicLibrary& operator=(const DynamicLibrary&) = delete;
  // The handle is never closed: libraries that start threads (NCCL, the driver) must stay
  // mapped until the process exits.
  ~DynamicLibrary() = default;

  // nullptr when absent (for symbols that only newer versions have).
  void* find(const char* name) const;
  // Throws meshcoll::Error naming the symbol and the library when absent.
  void* require(const char* name) const;

  // The file actually loaded (resolved through dlinfo where possible).
  const std::string& path() const { return path_; }

 private:
  DynamicLibrary(void* handle, std::string path) : handle_(handle), path_(std::move(path)) {}
  void* handle_ = nullptr;
  std::string path_;
};

}  // namespace meshcoll::nccl
