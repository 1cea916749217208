// Threads with names, as `top -H`, `ps -L`, gdb and py-spy show them: a user who sees a busy
// or stuck thread can tell whose it is (NCCL and PyTorch name theirs too).
#pragma once

#include <pthread.h>

#include <thread>
#include <utility>

namespace meshcoll {

// A thread running `body`, named `name` ("mc-" and its role, at most 15 characters: Linux
// keeps no more; a string literal). On Linux it is named before this returns, so anyone who
// looks after the call sees the name. A thread starts with the name of the thread that made
// it: a thread that calls into a library which starts its own (NCCL's init) is left unnamed,
// lest those carry meshcoll's name.
template <class F>
std::thread named_thread(const char* name, F&& body) {
#if defined(__APPLE__)  // names only the calling thread
  return std::thread([name, body = std::forward<F>(body)]() mutable {
    pthread_setname_np(name);
    body();
  });
#else
  std::thread t(std::forward<F>(body));
#if defined(__linux__)
  pthread_setname_np(t.native_handle(), name);
#endif
  return t;
#endif
}

}  // namespace meshcoll
