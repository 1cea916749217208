// The MPI backend's constructor and subgroups, and MPI's loading (Note [Loading MPI] in
// csrc/mpi/mpi_api.h: python/meshcoll/mpi.py compiles the shim, these functions load it). Its
// collectives are the contract's, bound once in bind_backend.cc.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "common/error.h"
#include "mpi/mpi_api.h"
#include "mpi/mpi_backend.h"
#include "python/fastcall.h"

namespace py = pybind11;

namespace meshcoll::python {

void bind_mpi(py::module_& m) {
  m.def("mpi_shim_source", [] { return py::make_tuple(std::string(mpi::shim_source()), mpi::kShimAbi); },
        "(source, abi): the MPI shim's C source, which meshcoll.mpi compiles with mpicc.");
  m.def("mpi_load", [](const std::string& path) {
        mpi::MpiApi* a;
        {
          py::gil_scoped_release nogil;
          a = &mpi::load(path);
        }
        return py::make_tuple(a->rank, a->size, a->version, a->thread_level);
      }, py::arg("path"),
      "Loads the compiled shim and initializes MPI (once per process): (rank, size, version, "
      "thread level).");
  m.def("mpi_loaded", &mpi::loaded);
  m.def("mpi_bcast_bytes", [](const py::bytes& data, int root) {
        std::string s = data;
        {
          py::gil_scoped_release nogil;
          mpi::MpiApi& a = mpi::api();
          std::lock_guard<std::mutex> lock(mpi::mpi_lock());
          int n = static_cast<int>(s.size());
          int rc = a.bcast_bytes(&n, sizeof n, root, nullptr);
          if (!rc) {
            s.resize(static_cast<size_t>(n));
            rc = a.bcast_bytes(s.data(), n, root, nullptr);
          }
          if (rc) throw Error(str_cat("MPI rank ", a.rank, ": MPI_Bcast at setup failed: ",
                                      a.error_text(rc)));
        }
        return py::bytes(s);
      }, py::arg("data"), py::arg("root"),
      "Blocking, at setup: rank `root`'s bytes on every rank of MPI_COMM_WORLD.");
  m.def("mpi_finalize", [] {
        py::gil_scoped_release nogil;
        mpi::finalize();
      }, "At exit: MPI_Finalize (if meshcoll initialized MPI), or MPI_Abort when an operation "
         "is still inside MPI (Note [MPI failure model]).");

  py::class_<mpi::MpiBackend, comm::Backend, std::shared_ptr<mpi::MpiBackend>>(
      m, "MpiBackend", "The MPI backend of one group (host memory).")
      .def_static("world", [](double timeout_s) {
             Millis t = seconds_arg(timeout_s, "timeout");
             py::gil_scoped_release nogil;
             return mpi::MpiBackend::world(t);
           }, py::arg("timeout"), "A duplicate of MPI_COMM_WORLD (MPI loaded first).")
      .def("set_agreement",
           [](mpi::MpiBackend& b, std::shared_ptr<comm::Backend> channel, bool strict) {
             b.set_agreement(std::move(channel), strict ? comm::Agreement::Mode::kStrict
                                                        : comm::Agreement::Mode::kAsync);
           },
           py::arg("channel"), py::arg("strict"),
           "Turns on the agreement check over `channel` (a CpuBackend among the same ranks; "
           "Note [Agreement on a side channel]). Once, before the first collective.")
      .def("set_hierarchy",
           [](mpi::MpiBackend& b, std::shared_ptr<comm::Backend> composer) {
             b.set_hierarchy(std::move(composer));
           },
           py::arg("composer"),
           "Note [Hierarchy on MPI] (csrc/mpi/mpi_backend.h): all_reduce, broadcast and "
           "all_gather (equal counts) run on `composer`, a hierarchical CpuBackend of the same "
           "ranks. Once, before the first collective.")
      .def("split", [](mpi::MpiBackend& b, int color, int key, double timeout_s) {
             Millis t = seconds_arg(timeout_s, "timeout");
             py::gil_scoped_release nogil;
             return b.split(color, key, t);
           }, py::arg("color"), py::arg("key"), py::arg("timeout"),
           "MPI_Comm_split: collective over every rank; color < 0 joins none (returns None).");
}

}  // namespace meshcoll::python
