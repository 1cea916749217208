// An array's memory beyond its view: the owners a finished operation gives back (Note
// [Owners] in array.h) and the probe of host memory before a call (Note [Unmapped memory]).
#include <pybind11/numpy.h>
#include <pthread.h>
#include <sys/mman.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <mutex>
#include <vector>

#include "common/error.h"
#include "python/array.h"

namespace py = pybind11;

namespace meshcoll::python {

namespace {

// ---- owners ----------------------------------------------------------------------------------
struct Released {
  std::mutex mu;
  std::vector<PyObject*> objects;
  bool scheduled = false;
  std::atomic<bool> any{false};
};
Released& released() {
  static Released* r = new Released();  // used until the process ends
  return *r;
}

int drain_released(void*) {
  auto& r = released();
  std::vector<PyObject*> objects;
  {
    std::lock_guard<std::mutex> lock(r.mu);
    objects.swap(r.objects);
    r.scheduled = false;
    r.any.store(false, std::memory_order_relaxed);
  }
  for (PyObject* o : objects) Py_DECREF(o);
  return 0;
}

void release(PyObject* o) {
  if (!Py_IsInitialized()) return;  // the interpreter is gone: nothing to give back
  if (PyGILState_Check()) {
    Py_DECREF(o);
    return;
  }
  auto& r = released();
  std::lock_guard<std::mutex> lock(r.mu);
  r.objects.push_back(o);
  r.any.store(true, std::memory_order_relaxed);
  if (!r.scheduled) r.scheduled = Py_AddPendingCall(&drain_released, nullptr) == 0;
}

// Note [Unmapped memory]
// A host array whose memory was unmapped (an mmap closed under a numpy view, a ctypes buffer
// munmap'ed) or is not accessible as the call needs would kill the rank with SIGSEGV in the
// middle of a collective, on whichever thread first touches it, after its peers began. So
// its memory is probed here, once per array per call, before anything is sent:
// - mincore() over the whole range: ENOMEM if any page of it is not mapped. One syscall per
//   16 MiB that walks page tables and touches no data; it does not fault pages in.
// - process_vm_readv (process_vm_writev for an array the call writes) on this process of the
//   first and last byte: EFAULT if the mapping cannot be read (PROT_NONE) or written (a
//   read-only mapping numpy was told is writable).
// Both cost little next to copying the array once (mincore is skipped for two pages or
// fewer); probing each page instead (process_vm_readv of one byte per page, or a write() of
// one byte per page to a pipe) costs a syscall's page walk per page, more than the copy.
// See docs/performance.md, "Unmapped memory probe".
// Protection is checked at the two ends only (one mapping in practice): a range
// mprotect'ed in the middle of an array still faults.
// A sandbox that refuses process_vm_* (seccomp: ENOSYS / EPERM) keeps the mincore check.
// getpid() is a syscall (glibc stopped caching it): cached, and renewed in a forked child.
std::atomic<pid_t> g_pid{0};
pid_t own_pid() {
  static const bool once = [] {
    g_pid = ::getpid();
    ::pthread_atfork(nullptr, nullptr, [] { g_pid = ::getpid(); });
    return true;
  }();
  (void)once;
  return g_pid.load(std::memory_order_relaxed);
}

// Whether any page of [lo, hi) is not mapped (mincore: ENOMEM).
bool unmapped(uintptr_t lo, uintptr_t hi, uintptr_t page) {
  unsigned char vec[4096];  // mincore's one byte per page: 16 MiB of 4 KiB pages per call
  for (uintptr_t a = lo & ~(page - 1); a < hi;) {
    const size_t len = std::min<uintptr_t>(hi - a, sizeof(vec) * page);
    if (::mincore(reinterpret_cast<void*>(a), len, vec) != 0 && errno == ENOMEM) return true;
    a += len;
  }
  return false;
}

}  // namespace

// Note [Memory numpy owns]
// The probe of Note [Unmapped memory] is a syscall, and on a small call it is the largest
// single cost of the host path: about as much as the rest of the call (docs/performance.md,
// "Memory numpy owns"). It guards memory that can go away or lose its access under a live
// array: a mapping (mmap, a ctypes or foreign buffer) that its owner closes, unmaps or
// mprotects.
// Memory that numpy allocated for an array (the OWNDATA flag: np.ones, np.empty, copies,
// arithmetic results) is not such memory: numpy frees it only when that array is
// deallocated, and this call holds the array; it is mapped readable and writable from
// allocation on. So an array that owns its data, or a view whose chain of bases ends at one
// (a slice, a reshape), is not probed. Every other array (np.frombuffer over a buffer, a
// memmap, an array over foreign memory, a torch tensor, a buffer-protocol object) is.
bool owns_its_memory(PyObject* a) {
  const auto& api = py::detail::npy_api::get();
  for (int depth = 0; depth < 32 && a && api.PyArray_Check_(a); ++depth) {
    const auto* p = py::detail::array_proxy(a);
    if (p->flags & py::detail::npy_api::NPY_ARRAY_OWNDATA_) return true;
    a = p->base;
  }
  return false;
}

void check_memory(const comm::ArrayView& v, const Want& w) {
  if (w.device || v.count == 0) return;
  static const uintptr_t page = static_cast<uintptr_t>(::sysconf(_SC_PAGESIZE));
  const uintptr_t lo = reinterpret_cast<uintptr_t>(v.data);
  const uintptr_t hi = lo + v.count * dtype_size(v.dtype);  // one past the last byte
  const char* const kUnmapped =
      "is not mapped (freed or unmapped); pass an array whose memory is still mapped";
  const char* why = nullptr;
  // An array on at most two pages is covered by the probe of its two ends: no mincore
  // unless that probe fails (then it tells unmapped from inaccessible).
  if (hi - (lo & ~(page - 1)) > 2 * page && unmapped(lo, hi, page)) why = kUnmapped;
  if (!why) {
    // The two end bytes, read; a writable array's are copied onto themselves instead
    // (process_vm_writev reads the local side as this process does and writes the remote side
    // as a debugger would, refusing a read-only mapping): one syscall either way, and no byte
    // changes unless another thread writes it at that instant (a race the call itself has:
    // it writes there). A short count is a fault on the second end; -1 with another errno is
    // a sandbox that refuses the syscall (nothing learnt).
    iovec ends[2] = {{reinterpret_cast<void*>(lo), 1}, {reinterpret_cast<void*>(hi - 1), 1}};
    unsigned char copy[2];
    iovec local{copy, 2};
    auto faults = [](ssize_t n) { return n >= 0 ? n != 2 : errno == EFAULT; };
    const pid_t self = own_pid();
    if (faults(w.writable ? ::process_vm_writev(self, ends, 2, ends, 2, 0)
                          : ::process_vm_readv(self, &local, 1, ends, 2, 0))) {
      if (unmapped(lo, hi, page))
        why = kUnmapped;
      else if (!w.writable || faults(::process_vm_readv(self, &local, 1, ends, 2, 0)))
        why = "is not readable (mapped without read access); pass an array in readable memory";
      else
        why = "is not writable (mapped read-only) but this operation writes its result into "
              "it; pass an array in writable memory";
    }
  }
  if (why)
    throw InvalidArgument(str_cat(label(w), ": the array's memory (", hi - lo, " bytes at ",
                                  v.data, ") ", why));
}

void release_owners() {
  if (released().any.load(std::memory_order_relaxed)) drain_released(nullptr);
}

std::shared_ptr<void> owner_of(const py::handle& x) {
  PyObject* o = x.ptr();
  Py_INCREF(o);
  return std::shared_ptr<void>(o, [](void* p) { release(static_cast<PyObject*>(p)); });
}

}  // namespace meshcoll::python
