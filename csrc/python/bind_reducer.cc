// The reducer (Note [Reducer] in reducer/reducer.h): what DataParallel and the torch adapter
// call. ready() is a METH_FASTCALL method (Note [FASTCALL methods]): it runs once per gradient
// per step, from a parameter's hook in the middle of backward.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "common/error.h"
#include "python/array.h"
#include "python/fastcall.h"
#include "reducer/reducer.h"

namespace py = pybind11;

namespace meshcoll::python {

namespace {

using reducer::Reducer;

comm::Stream stream_of(PyObject* o) {  // a CUstream as an int (0: the legacy default stream)
  return reinterpret_cast<comm::Stream>(PyLong_AsVoidPtr(o));
}

// ready(i, src, out, stream) -> gradients still to come this step. Addresses and the stream
// are ints (data_ptr(), torch.cuda.Stream.cuda_stream); src: where the gradient's value is,
// out: where its average goes (0: it stays in the bucket). Launches the buckets it completed.
PyObject* reducer_ready(PyObject* self, PyObject* const* args, Py_ssize_t nargs) {
  return fastcall([&]() -> PyObject* {
    if (nargs != 4)
      throw py::type_error(str_cat("ready takes 4 positional arguments (i, src, out, stream), "
                                   "got ", nargs));
    Reducer& r = py::cast<Reducer&>(py::handle(self));
    const size_t i = PyLong_AsSize_t(args[0]);
    const uintptr_t src = reinterpret_cast<uintptr_t>(PyLong_AsVoidPtr(args[1]));
    const uintptr_t out = reinterpret_cast<uintptr_t>(PyLong_AsVoidPtr(args[2]));
    const comm::Stream stream = stream_of(args[3]);
    if (PyErr_Occurred()) throw py::error_already_set();
    const bool launch = r.mark(i, src, out);
    if (launch || r.copies_early(i))
      call_nogil([&] {
        r.copy_in(i);
        if (launch) r.launch_ready(stream);
      });
    return PyLong_FromSize_t(r.remaining());
  });
}

comm::ArrayView bucket_view(const comm::Backend& b, const py::handle& x) {
  Want w;
  w.what = "Reducer";
  w.arg = "bucket";
  w.writable = true;
  w.device = b.device_memory();
  w.keep = true;
  return read_array(x, w).view;
}

}  // namespace

void bind_reducer(py::module_& m) {
  py::class_<Reducer> r(m, "Reducer", "Gradient buckets averaged over a group (Note [Reducer]).");
  r.def(py::init([](std::shared_ptr<comm::Backend> backend, const py::list& buckets,
                    std::vector<std::tuple<size_t, size_t, size_t>> slots,
                    std::vector<std::string> names, const std::string& op, bool launches) {
          std::vector<comm::ArrayView> views;
          for (const py::handle& x : buckets) views.push_back(bucket_view(*backend, x));
          std::vector<Reducer::Slot> s;
          for (const auto& [b, off, n] : slots) s.push_back({b, off, n});
          RedOp rop;
          if (!redop_from_name(op, &rop)) throw py::value_error(str_cat("Reducer: op '", op, "'"));
          return std::make_unique<Reducer>(std::move(backend), std::move(views), std::move(s),
                                           std::move(names), rop, launches);
        }),
        py::arg("backend"), py::arg("buckets"), py::arg("slots"), py::arg("names"),
        py::arg("op"), py::arg("launches"))
      .def_property_readonly("size", &Reducer::size)
      .def_property_readonly("num_buckets", &Reducer::num_buckets)
      .def_property_readonly("remaining", &Reducer::remaining)
      .def_property_readonly("first_order", &Reducer::first_order)
      .def("missing", &Reducer::missing)
      .def("slot_address", &Reducer::slot_address, py::arg("i"))
      .def("take_complete", [](Reducer& x, uintptr_t stream) {
             return call_nogil([&] { return x.take_complete(reinterpret_cast<comm::Stream>(stream)); });
           }, py::arg("stream"))
      .def("finish", [](Reducer& x, uintptr_t stream) {
             call_nogil([&] { x.finish(reinterpret_cast<comm::Stream>(stream)); });
           }, py::arg("stream"))
      .def("abandon", [](Reducer& x) { call_nogil([&] { x.abandon(); }); })
      .def("done", [](Reducer& x) { return call_nogil([&] { return x.done(); }); })
      .def("stats", [](Reducer& x) {
             Reducer::Stats s = call_nogil([&] { return x.stats(); });
             py::dict d;
             d["calls"] = s.calls;
             d["bytes"] = s.bytes;
             d["comm_seconds"] = s.comm_seconds;
             d["overlapped_seconds"] = s.overlapped_seconds;
             d["copied_bytes"] = s.copied_bytes;
             return d;
           })
      .def("reset_stats", [](Reducer& x) { call_nogil([&] { x.reset_stats(); }); });
  add_fastcall_method(r, "ready", &reducer_ready,
                      "ready(i, src, out, stream) -> gradients still to come this step");
}

}  // namespace meshcoll::python
