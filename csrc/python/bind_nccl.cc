// The NCCL backend's constructor, subgroups and metadata exchange, and whether NCCL loads
// here. Its collectives are the contract's, bound once in bind_backend.cc; its arrays are
// read by array.cc (its DLPack and __cuda_array_interface__ readers). Nothing here imports a
// framework.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "common/error.h"
#include "nccl/direct/compile.h"
#include "nccl/nccl_api.h"
#include "nccl/nccl_backend.h"
#include "python/array.h"
#include "python/fastcall.h"

namespace py = pybind11;

namespace meshcoll::python {

namespace {
// Memory of one symmetric allocation as an array protocol object: a framework makes its own
// array of it with from_dlpack (each __dlpack__ call exports a new capsule that holds the
// block), so the memory lives until the last array over it is gone.
struct SymmetricBuffer {
  std::shared_ptr<nccl::SymmetricBlock> block;
  std::vector<int64_t> shape;
  DType dtype;
};

}  // namespace

void bind_nccl(py::module_& m) {
  py::class_<SymmetricBuffer>(m, "SymmetricBuffer",
      "Memory of NcclBackend.alloc_symmetric: pass to torch.from_dlpack / cupy.from_dlpack.")
      .def("__dlpack__", [](const SymmetricBuffer& s, const py::args&, const py::kwargs&) {
             // Fresh memory (zeroed or not) with no pending work: no stream to order after.
             return device_capsule(s.block, s.block->data(), s.block->device(), s.dtype, s.shape);
           })
      .def("__dlpack_device__", [](const SymmetricBuffer& s) {
             return py::make_tuple(2 /* kDLCUDA */, s.block->device());
           })
      .def_property_readonly("windowed", [](const SymmetricBuffer& s) { return s.block->windowed(); })
      .def_property_readonly("nbytes", [](const SymmetricBuffer& s) { return s.block->bytes(); })
      .def_property_readonly("ptr", [](const SymmetricBuffer& s) {
        return reinterpret_cast<uintptr_t>(s.block->data());
      });

  m.def("nccl_direct_kernels", [] {
        return py::make_tuple(std::string(nccl::direct_kernels_source()),
                              nccl::DirectPath::entries());
      }, "(source, entry points): what NVRTC compiles for the direct kernels (Note [Direct "
         "kernels] in csrc/nccl/direct/direct.h), for tests that compile them without a GPU.");
  m.def("nccl_set_nvrtc_candidates", &nccl::set_nvrtc_candidates, py::arg("paths"),
        "NVRTC libraries (the direct kernels' compiler) to try before the system's.");
  m.def("nccl_set_library_candidates", &nccl::set_nccl_candidates, py::arg("paths"),
        "Wheel paths of libnccl.so.2 to try after $MESHCOLL_NCCL_LIBRARY, before the system.");
  m.def("nccl_available", [] {
        std::string why;
        bool ok;
        {
          py::gil_scoped_release nogil;
          ok = nccl::nccl_available(&why);
        }
        return py::make_tuple(ok, why);
      }, "(ok, reason): whether NCCL and the CUDA driver load and a device is visible.");
  m.def("nccl_version", [] { return nccl::nccl().version; });
  m.def("nccl_library_path", [] { return nccl::nccl().path; });
  m.def("nccl_split_supported", &nccl::NcclComm::split_supported);
  m.def("cuda_device_count", &nccl::cuda_device_count);

  py::class_<nccl::NcclBackend, comm::Backend, std::shared_ptr<nccl::NcclBackend>>(
      m, "NcclBackend", "The NCCL backend of one group, on one CUDA device.")
      .def(py::init([](std::shared_ptr<store::Store> store, int rank, int size, int device,
                       double timeout_s) {
             Millis t = seconds_arg(timeout_s, "timeout");
             py::gil_scoped_release nogil;
             return nccl::NcclBackend::create(std::move(store), rank, size, device, t);
           }),
           py::arg("store"), py::arg("rank"), py::arg("size"), py::arg("device"), py::arg("timeout"))
      .def("set_agreement",
           [](nccl::NcclBackend& b, std::shared_ptr<comm::Backend> channel, bool strict) {
             b.set_agreement(std::move(channel), strict ? comm::Agreement::Mode::kStrict
                                                        : comm::Agreement::Mode::kAsync);
           },
           py::arg("channel"), py::arg("strict"),
           "Turns on the agreement check over `channel` (a CpuBackend among the same ranks; "
           "Note [Agreement on a side channel]). Once, before the first collective.")
      .def("split", [](nccl::NcclBackend& b, int color, int key, const py::handle& timeout) {
             Millis t = timeout_arg(timeout);
             py::gil_scoped_release nogil;
             return b.split(color, key, t);
           }, py::arg("color"), py::arg("key"), py::arg("timeout") = py::none(),
           "ncclCommSplit: collective over every rank; color < 0 joins none (returns None).")
      .def("alloc_symmetric", [](nccl::NcclBackend& b, const std::vector<int64_t>& shape,
                                 const std::string& dtype, bool zero, const py::handle& timeout) {
             DType dt;
             if (!dtype_from_name(dtype, &dt))
               throw TypeMismatch(str_cat("empty(symmetric=True): unknown dtype '", dtype, "'"));
             size_t n = 1;
             for (int64_t d : shape) {
               if (d < 0) throw InvalidArgument(str_cat("empty: negative dimension ", d));
               n *= static_cast<size_t>(d);
             }
             Millis t = timeout_arg(timeout);
             comm::Backend::Issue issue(b, "empty(symmetric=True)");
             auto block = call_nogil([&] { return b.alloc_symmetric(n * dtype_size(dt), zero, t); });
             issue.check();
             return SymmetricBuffer{std::move(block), shape, dt};
           }, py::arg("shape"), py::arg("dtype"), py::arg("zero") = false,
           py::arg("timeout") = py::none(),
           "Collective: an array's memory on every rank, registered as a symmetric window of "
           "this communicator where NCCL can (Note [Symmetric memory]).")
      .def("setup_direct", [](nccl::NcclBackend& b, const py::handle& timeout) {
             Millis t = timeout_arg(timeout);
             py::gil_scoped_release nogil;
             b.comm().setup_direct(t);
           }, py::arg("timeout") = py::none(),
           "Collective, once, when the group is made: sets up meshcoll's direct kernels "
           "(Note [Direct kernels] in csrc/nccl/direct/direct.h) where every rank can use them.")
      .def("direct_unavailable", [](nccl::NcclBackend& b) { return b.comm().direct_unavailable(); },
           "'' when direct kernels are on, else why not.")
      .def("direct_bytes", [](nccl::NcclBackend& b) { return b.comm().direct_bytes(); },
           "The largest call the direct kernels take (0: off).")
      .def("symmetric_unavailable", [](nccl::NcclBackend& b) {
             return b.comm().symmetric_unavailable();
           }, "'' when symmetric windows can be registered here, else why not.")
      .def("in_window", [](nccl::NcclBackend& b, uintptr_t ptr, size_t bytes) {
             return b.comm().windows().contains(reinterpret_cast<const void*>(ptr), bytes);
           }, py::arg("ptr"), py::arg("nbytes"),
           "Whether [ptr, ptr + nbytes) lies in one symmetric window of this communicator.")
      .def("abort", [](nccl::NcclBackend& b, const std::string& why) {
        py::gil_scoped_release nogil;
        b.comm().abort(why);
      }, py::arg("why"))
      .def("host_all_gather", [](nccl::NcclBackend& b, const py::bytes& data,
                                 const std::string& dtype, const std::vector<size_t>& shape,
                                 const std::string& of, const py::handle& timeout) {
             // Described as any call (Note [Internal exchanges] in common/op_desc.h): a user's
             // all_gather or all_to_all of a host array, or a composed call's exchange.
             CollKind kind;
             if (of == "all_gather") kind = CollKind::kAllGather;
             else if (of == "all_to_all") kind = CollKind::kAllToAll;
             else if (!exchange_kind(of, &kind))
               throw py::value_error(str_cat("host_all_gather: no exchange of '", of, "'"));
             DType dt;
             if (!dtype_from_name(dtype, &dt))
               throw py::value_error(str_cat("host_all_gather: unsupported dtype ", dtype));
             std::string s = data;
             ShapeHash h;
             size_t count = 1;
             for (size_t n : shape) {
               h.mix(n);
               count *= n;
             }
             auto d = make_desc(kind, dt, count * static_cast<size_t>(b.size()));
             d.shape = h.value();
             Millis t = timeout_arg(timeout);
             std::vector<uint8_t> out;
             {
               py::gil_scoped_release nogil;
               out = b.host_all_gather(s.data(), s.size(), d, t);
             }
             return py::bytes(reinterpret_cast<const char*>(out.data()), out.size());
           }, py::arg("data"), py::arg("dtype"), py::arg("shape"), py::arg("of"),
           py::arg("timeout") = py::none(),
           "Every rank's bytes (all the same length), concatenated in rank order, as the "
           "call `of` describes them (agreed before it returns). Blocks.");
}

}  // namespace meshcoll::python
