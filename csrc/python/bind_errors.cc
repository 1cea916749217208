// C++ exception types -> Python classes, 1:1. The Python classes also derive from the
// builtin a user would catch (TimeoutError, ConnectionError, ValueError).
#include <pybind11/pybind11.h>

#include "common/error.h"

namespace py = pybind11;

namespace meshcoll::python {

namespace {
PyObject* make_exception(py::module_& m, const char* name, std::initializer_list<PyObject*> bases,
                         const char* doc) {
  py::tuple b(bases.size());
  size_t i = 0;
  for (PyObject* base : bases) b[i++] = py::reinterpret_borrow<py::object>(base);
  std::string full = std::string("meshcoll.") + name;
  PyObject* cls = PyErr_NewExceptionWithDoc(full.c_str(), doc, b.ptr(), nullptr);
  if (!cls) throw py::error_already_set();
  m.add_object(name, py::reinterpret_steal<py::object>(cls));
  return cls;
}
}  // namespace

void bind_errors(py::module_& m) {
  static PyObject* base = make_exception(m, "MeshcollError", {PyExc_RuntimeError},
                                         "Base class of every meshcoll error.");
  static PyObject* timeout = make_exception(
      m, "TimeoutError", {base, PyExc_TimeoutError},
      "A blocking call passed its deadline; the group is aborted and must be rebuilt.");
  static PyObject* peer = make_exception(
      m, "PeerError", {base, PyExc_ConnectionError},
      "A peer closed its connection or died; the group is aborted and must be rebuilt.");
  static PyObject* mismatch = make_exception(
      m, "MismatchError", {base},
      "Ranks called different collectives, or the same one with different arguments.");
  static PyObject* aborted = make_exception(
      m, "AbortedError", {base}, "The group was aborted by an earlier error.");
  static PyObject* concurrent = make_exception(
      m, "ConcurrentCallError", {base},
      "Two threads issued calls on one group at the same time; the group is failed on every "
      "rank. Use one group per thread (new_group).");
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const TimeoutError& e) {
      PyErr_SetString(timeout, e.what());
    } catch (const PeerError& e) {
      PyErr_SetString(peer, e.what());
    } catch (const MismatchError& e) {
      PyErr_SetString(mismatch, e.what());
    } catch (const Aborted& e) {
      PyErr_SetString(aborted, e.what());
    } catch (const ConcurrentCall& e) {
      PyErr_SetString(concurrent, e.what());
    } catch (const InvalidArgument& e) {
      PyErr_SetString(PyExc_ValueError, e.what());
    } catch (const TypeMismatch& e) {
      PyErr_SetString(PyExc_TypeError, e.what());
    } catch (const Error& e) {
      PyErr_SetString(base, e.what());
    }
  });
}

}  // namespace meshcoll::python
