#include "python/fastcall.h"

#include <cmath>

#include "common/error.h"
#include "common/interrupt.h"

namespace py = pybind11;

namespace meshcoll::python {

namespace {
std::string op_prefix(const char* op) { return op ? str_cat(op, ": ") : std::string(); }
}  // namespace

Millis seconds_arg(double s, const char* what, bool zero_ok, const char* op) {
  if (!(zero_ok ? s >= 0 : s > 0) || !(s <= kMaxTimeoutSeconds))
    throw py::value_error(str_cat(op_prefix(op), what, " must be a number of seconds ",
                                  zero_ok ? ">= 0" : "> 0", " and at most ", kMaxTimeoutSeconds,
                                  " (about 116 days), got ", s,
                                  "; pass None for the group's default"));
  // Round up: 0.0004 s is a short deadline, not none at all.
  return Millis(static_cast<int64_t>(std::ceil(s * 1000.0)));
}

double seconds_of(const py::handle& seconds, const char* what, const char* op) {
  // A real number only (int, float, numpy scalar: __float__ or __index__). pybind11's
  // cast<double> said just "Unable to cast" (a RuntimeError), and Python's float() would
  // take the str "5".
  const double s = PyFloat_AsDouble(seconds.ptr());
  if (s == -1.0 && PyErr_Occurred()) {
    PyErr_Clear();
    throw py::type_error(str_cat(op_prefix(op), what, " must be a number of seconds, got ",
                                 Py_TYPE(seconds.ptr())->tp_name, " ",
                                 py::repr(seconds).cast<std::string>(),
                                 "; pass an int or a float, or None for the group's default"));
  }
  return s;
}

Millis timeout_arg(const py::handle& seconds, const char* op) {
  if (seconds.is_none()) return Millis(-1);
  return seconds_arg(seconds_of(seconds, "timeout", op), "timeout", false, op);
}

std::string str_arg(PyObject* o, const char* what, const char* name) {
  Py_ssize_t n;
  const char* s = PyUnicode_Check(o) ? PyUnicode_AsUTF8AndSize(o, &n) : nullptr;
  if (!s) {
    PyErr_Clear();
    throw py::type_error(str_cat(what, ": ", name, " must be a str"));
  }
  return std::string(s, static_cast<size_t>(n));
}

size_t size_arg(PyObject* o, const char* what, const char* name) {
  size_t v = PyLong_Check(o) ? PyLong_AsSize_t(o) : static_cast<size_t>(-1);
  if (v == static_cast<size_t>(-1)) {
    PyErr_Clear();
    throw py::type_error(str_cat(what, ": ", name, " must be an int >= 0"));
  }
  return v;
}

namespace {
unsigned long g_main_thread = 0;  // Python runs signal handlers on this thread only
// The exception a signal handler raised in the hook, kept until the call returns to Python.
PyObject *g_raised_type = nullptr, *g_raised_value = nullptr, *g_raised_tb = nullptr;

bool finalizing() {
#if PY_VERSION_HEX >= 0x030D0000
  return Py_IsFinalizing();
#else
  return _Py_IsFinalizing();
#endif
}

std::string run_signal_handlers() {
  if (PyThread_get_thread_ident() != g_main_thread || finalizing()) return "";
  PyGILState_STATE gil = PyGILState_Ensure();
  std::string raised;
  if (PyErr_CheckSignals() != 0) {
    Py_CLEAR(g_raised_type);
    Py_CLEAR(g_raised_value);
    Py_CLEAR(g_raised_tb);
    PyErr_Fetch(&g_raised_type, &g_raised_value, &g_raised_tb);
    raised = reinterpret_cast<PyTypeObject*>(g_raised_type)->tp_name;
  }
  PyGILState_Release(gil);
  return raised;
}
}  // namespace

void install_interrupt_hook() {
  g_main_thread = py::module_::import("threading").attr("main_thread")().attr("ident")
                      .cast<unsigned long>();
  set_interrupt_hook(&run_signal_handlers);
}

void raise_if_interrupted() {
  if (PyThread_get_thread_ident() != g_main_thread) return;
  if (g_raised_type) {
    PyErr_Restore(g_raised_type, g_raised_value, g_raised_tb);  // steals the references
    g_raised_type = g_raised_value = g_raised_tb = nullptr;
    throw py::error_already_set();
  }
  if (PyErr_CheckSignals() != 0) throw py::error_already_set();
}

void set_python_error(std::exception_ptr e) {
  static thread_local std::exception_ptr pending;
  // A pybind11 function that rethrows `pending`: calling it runs the registered translators.
  // Never destroyed: a py::object must not be released after the interpreter has finalized.
  static const auto* rethrow =
      new py::object(py::cpp_function([] { std::rethrow_exception(pending); }));
  pending = e;
  try {
    (*rethrow)();
  } catch (py::error_already_set& err) {
    pending = nullptr;
    err.restore();
  }
}

void add_fastcall_method(const py::handle& cls, const char* name, FastcallFn fn,
                         const char* doc) {
  // The descriptor points at its PyMethodDef for as long as the type lives: never freed.
  auto* def = new PyMethodDef{name, reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(fn)),
                              METH_FASTCALL, doc};
  PyObject* m = PyDescr_NewMethod(reinterpret_cast<PyTypeObject*>(cls.ptr()), def);
  if (!m) throw py::error_already_set();
  cls.attr(name) = py::reinterpret_steal<py::object>(m);
}

}  // namespace meshcoll::python
