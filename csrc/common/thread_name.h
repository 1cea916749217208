// Names for meshcoll's threads, as `top -H`, `ps -L`, gdb and py-spy show them: a user who
// sees a busy or stuck thread can tell whose it is (NCCL and PyTorch name theirs too).
#pragma once

#include <pthread.h>

namespace meshcoll {

// `name`: "mc-" and the thread's role, at most 15 characters (Linux keeps no more). A thread
// starts with the name of the thread that made it: a thread that calls into a library which
// starts its own (NCCL's init) stays unnamed, lest those carry meshcoll's name.
inline void name_this_thread(const char* name) {
#if defined(__linux__)
  pthread_setname_np(pthread_self(), name);
#elif defined(__APPLE__)
  pthread_setname_np(name);
#endif
}

}  // namespace meshcoll
