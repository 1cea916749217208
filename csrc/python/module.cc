// Registers every binding file; nothing else lives here.
#include <pybind11/pybind11.h>

namespace py = pybind11;

namespace meshcoll::python {
void bind_errors(py::module_& m);
void bind_store(py::module_& m);
void bind_backend(py::module_& m);
void bind_comm(py::module_& m);
void bind_reduce(py::module_& m);
void bind_nccl(py::module_& m);
void bind_mpi(py::module_& m);
void bind_agreement(py::module_& m);
void bind_reducer(py::module_& m);
void config_at_import();
void bind_config(py::module_& m);
void install_interrupt_hook();
}  // namespace meshcoll::python

PYBIND11_MODULE(_C, m) {
  m.doc() = "meshcoll C++ core";
  meshcoll::python::config_at_import();  // first: a bad variable leaves nothing registered
  meshcoll::python::bind_errors(m);
  meshcoll::python::bind_store(m);
  meshcoll::python::bind_backend(m);
  meshcoll::python::bind_comm(m);
  meshcoll::python::bind_reduce(m);
  meshcoll::python::bind_nccl(m);
  meshcoll::python::bind_mpi(m);
  meshcoll::python::bind_agreement(m);
  meshcoll::python::bind_reducer(m);
  meshcoll::python::bind_config(m);
  meshcoll::python::install_interrupt_hook();
}
