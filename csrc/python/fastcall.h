// What the Python bindings share: call arguments every binding reads the same way (timeout,
// str, size), and plain METH_FASTCALL methods for the calls small-message latency is made of.
//
// Note [FASTCALL methods]
// pybind11's dispatcher costs about 0.15 us per call plus the Work object a method returns;
// against a 0.3 us all_reduce on the CPU backend (and about 1 us of the host cost of an NCCL
// enqueue) that is worth skipping on the synchronous in-place all_reduce. Those methods are
// plain CPython METH_FASTCALL functions with positional arguments: the body runs inside
// `fastcall`, which turns a C++ exception into the Python error the pybind11 translators
// (bind_errors.cc) would have raised.
#pragma once

#include <pybind11/pybind11.h>

#include <exception>
#include <string>

#include "common/deadline.h"

namespace meshcoll::python {

// Every timeout the bindings take, in seconds -> milliseconds: finite, at most
// kMaxTimeoutSeconds (a deadline past that would overflow the clock, and no job waits that
// long on purpose) and > 0, or >= 0 where `zero_ok` (a store call that must not wait).
// ValueError naming `what` otherwise: never an endless or an immediate deadline by accident.
inline constexpr double kMaxTimeoutSeconds = 1e7;  // about 116 days
Millis seconds_arg(double seconds, const char* what, bool zero_ok = false);
// timeout= of a call (None: the group's default, returned as -1 ms).
Millis timeout_arg(const pybind11::handle& seconds);
std::string str_arg(PyObject* o, const char* what, const char* name);
size_t size_arg(PyObject* o, const char* what, const char* name);

// Sets the Python error for `e` through pybind11's registered exception translators.
void set_python_error(std::exception_ptr e);

// Runs `body` (which returns a new reference); a C++ exception becomes the Python error and
// nullptr, as CPython expects of a failed call.
template <class Body>
PyObject* fastcall(Body&& body) noexcept {
  try {
    return body();
  } catch (pybind11::error_already_set& e) {
    e.restore();
  } catch (...) {
    set_python_error(std::current_exception());
  }
  return nullptr;
}

using FastcallFn = PyObject* (*)(PyObject* self, PyObject* const* args, Py_ssize_t nargs);

// Adds `fn` (METH_FASTCALL) to the pybind11 class `cls` as the method `name`.
void add_fastcall_method(const pybind11::handle& cls, const char* name, FastcallFn fn,
                         const char* doc);

}  // namespace meshcoll::python
