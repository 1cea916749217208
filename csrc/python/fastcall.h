// What the Python bindings share: call arguments every binding reads the same way (timeout,
// str, size), and plain METH_FASTCALL methods for the calls small-message latency is made of.
//
// Note [FASTCALL methods]
// pybind11's dispatcher and the Work object a method returns cost a sizeable share of a small
// synchronous all_reduce's time on the CPU backend, and of an NCCL enqueue's host cost (see
// docs/performance.md, "FASTCALL methods"): worth skipping on the synchronous in-place
// all_reduce. Those methods are
// plain CPython METH_FASTCALL functions with positional arguments: the body runs inside
// `fastcall`, which turns a C++ exception into the Python error the pybind11 translators
// (bind_errors.cc) would have raised.
#pragma once

#include <pybind11/pybind11.h>

#include <exception>
#include <string>

#include "common/deadline.h"
#include "common/host_timers.h"

namespace meshcoll::python {

// Every timeout the bindings take, in seconds -> milliseconds: finite, at most
// kMaxTimeoutSeconds (a deadline past that would overflow the clock, and no job waits that
// long on purpose) and > 0, or >= 0 where `zero_ok` (a store call that must not wait).
// ValueError naming `what` otherwise: never an endless or an immediate deadline by accident.
// `op`, where given, names the call in the error ("all_reduce: timeout must be ...").
inline constexpr double kMaxTimeoutSeconds = 1e7;  // about 116 days
Millis seconds_arg(double seconds, const char* what, bool zero_ok = false,
                   const char* op = nullptr);
// A Python number of seconds as a double: TypeError naming `what` (and `op`) for anything
// that is not a real number (a str "5" included).
double seconds_of(const pybind11::handle& seconds, const char* what, const char* op = nullptr);
// timeout= of a call of `op` (None: the group's default, returned as -1 ms): seconds_of, then
// seconds_arg. The one check of every timeout= (new_group, split and init reach it through
// _C.check_timeout).
Millis timeout_arg(const pybind11::handle& seconds, const char* op = nullptr);
std::string str_arg(PyObject* o, const char* what, const char* name);
size_t size_arg(PyObject* o, const char* what, const char* name);

// Note [Interrupts] (common/interrupt.h), the Python side: installs the hook that runs
// pending signal handlers from a blocking wait. Called once, at import.
void install_interrupt_hook();
// Raises (py::error_already_set) the exception a signal handler raised during this thread's
// last blocking call, if one did; else runs the pending handlers now, so that a Ctrl-C that
// came while the call failed for another reason (a peer's ABORT) is what the caller sees.
void raise_if_interrupted();

// Runs `call` with the GIL released; a Python exception raised by a signal handler while
// it waited is the call's outcome (Note [Interrupts]).
template <class F>
auto call_nogil(F&& call) -> decltype(call()) {
  try {
    pybind11::gil_scoped_release nogil;
    return call();
  } catch (...) {
    raise_if_interrupted();
    throw;
  }
}

// Sets the Python error for `e` through pybind11's registered exception translators.
void set_python_error(std::exception_ptr e);

// Runs `body` (which returns a new reference); a C++ exception becomes the Python error and
// nullptr, as CPython expects of a failed call.
template <class Body>
PyObject* fastcall(Body&& body) noexcept {
  host_timers::mark(host_timers::kEntry);  // Note [Host timers]: these calls are the timed ones
  try {
    return body();
  } catch (pybind11::error_already_set& e) {
    e.restore();
  } catch (...) {
    set_python_error(std::current_exception());
  }
  host_timers::abandon();  // a failed call's spans stop here
  return nullptr;
}

using FastcallFn = PyObject* (*)(PyObject* self, PyObject* const* args, Py_ssize_t nargs);

// Adds `fn` (METH_FASTCALL) to the pybind11 class `cls` as the method `name`.
void add_fastcall_method(const pybind11::handle& cls, const char* name, FastcallFn fn,
                         const char* doc);

}  // namespace meshcoll::python
