// The one binding of the backend contract (comm/backend.h): Work, Backend (every collective,
// for the CPU and the NCCL backend alike) and Array (an array as a backend read it). Arrays
// are read by python/array.cc with the GIL held; the GIL is released around calls that
// block (a synchronous CPU call, a synchronous barrier) and held around calls that only queue
// (asynchronous CPU calls, point-to-point posts) or enqueue on a GPU: those never block and
// cost less than a release (run()).
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <climits>
#include <cstddef>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "cpu/algo/collectives.h"
#include "comm/backend.h"
#include "comm/stamps.h"
#include "common/error.h"
#include "common/host_timers.h"
#include "python/array.h"
#include "python/fastcall.h"

namespace py = pybind11;

namespace meshcoll::python {

namespace {
using comm::Backend;
using comm::CallOptions;
using comm::Work;
using comm::WorkPtr;

// An array a ProcessGroup has looked at (shape, dtype) and may pass to a collective, so the
// array is read once per call.
struct Array {
  Read read;
  py::object obj;
  std::vector<int64_t> dims;
  bool writable = false;
};

Array make_array(const py::handle& x, const char* what, bool writable, bool device,
                 const py::handle& stream) {
  Want w;
  w.what = what;
  w.writable = writable;
  w.device = device;
  uintptr_t s = kLegacyStream;
  if (stream_arg(stream, &s)) {
    w.has_stream = true;
    w.stream = s;
  }
  Array out;
  out.read = read_array(x, w, &out.dims);
  out.obj = py::reinterpret_borrow<py::object>(x);
  out.writable = writable;
  return out;
}

RedOp redop_arg(const std::string& name, const char* what) {
  RedOp op;
  if (!redop_from_name(name, &op))
    throw InvalidArgument(str_cat(what, ": unknown reduction op '", name,
                                  "'; use sum, prod, min, max, avg, band, bor or bxor"));
  return op;
}

uint8_t algorithm_arg(const std::string& name, const char* what) {
  Algorithm a;
  if (!algorithm_from_name(name, &a))
    throw InvalidArgument(str_cat(what, ": unknown algorithm '", name,
                                  "'; use auto, ring, tree, halving_doubling, direct "
                                  "(or centralized) or shm"));
  return static_cast<uint8_t>(a);
}

// Whether x is an Array (below): the bound type, looked up once (pybind11's isinstance
// looks it up by typeid at every call).
bool is_array(const py::handle& x) {
  static PyTypeObject* type = reinterpret_cast<PyTypeObject*>(py::type::of<Array>().ptr());
  return PyObject_TypeCheck(x.ptr(), type);
}

// One call's options and how its arrays are read: the first array read decides the stream
// of a device op (stream= if given, else that array's own), later arrays are read on it.
// `keep`: the arrays' owners ride with the operation (async calls, point-to-point).
class CallReader {
 public:
  CallReader(const Backend& b, const char* what, const py::handle& timeout,
             const py::handle& stream, bool async, bool keep)
      : what_(what) {
    release_owners();
    opts.timeout = timeout_arg(timeout, what);
    opts.async = async;
    want_.device = b.device_memory();
    // In a coalesced block an op may run after the call returns: its arrays' owners ride
    // with it (Note [Coalesced blocks] in csrc/comm/backend.h).
    want_.keep = keep || b.coalescing();
    uintptr_t s = kLegacyStream;
    if (stream_arg(stream, &s)) {
      if (!want_.device)
        throw InvalidArgument(str_cat(what, ": stream= is for the NCCL backend; the CPU backend "
                                            "has no streams"));
      want_.has_stream = true;
      want_.stream = s;
      opts.stream = to_cu_stream(s);
    }
  }
  CallReader(const Backend& b, const char* what, const py::handle& timeout,
             const py::handle& stream, bool async)
      : CallReader(b, what, timeout, stream, async, async) {}
  // x or out: a raw array, or an Array the ProcessGroup made of one. `dims`, if given,
  // receives its shape.
  comm::ArrayView operator()(const py::handle& x, const char* name, bool writable,
                             std::vector<int64_t>* dims = nullptr) {
    Want w = want_;
    w.what = what_;
    w.arg = name;
    w.writable = writable;
    Read r;
    if (is_array(x)) {
      const Array& a = x.cast<const Array&>();
      if ((writable && !a.writable) || (w.device && want_.has_stream && a.read.stream != w.stream))
        r = read_array(a.obj, w);  // read again: another check or another stream
      else
        r = a.read;
      if (w.keep && !r.view.owner) r.view.owner = owner_of(a.obj);
      if (dims) *dims = a.dims;
    } else {
      r = read_array(x, w, dims);
    }
    if (w.device && !want_.has_stream) {  // the first array sets the op's stream
      want_.has_stream = true;
      want_.stream = r.stream;
      opts.stream = to_cu_stream(r.stream);
    }
    if (r.order_after && !opts.wait_for) opts.wait_for = to_cu_stream(r.order_after);
    return r.view;
  }
  const char* what() const { return what_; }
  // A synchronous call on a CPU group waits for its operation (run()'s `blocks`).
  bool blocks() const { return !opts.async && !want_.device; }
  CallOptions opts;

 private:
  const char* what_;
  Want want_;
};

// Runs `call`, with the GIL released where it `blocks` (Note [Interrupts]: a Ctrl-C meanwhile
// is the call's outcome); returns the Work (async) or None. A call that only queues its
// operation (async, point-to-point) or enqueues it on a GPU keeps the GIL: releasing it hands
// it to any Python thread waiting for it (DataParallel's completion thread), and taking it
// back then costs a thread switch per call. Note [One issuing thread]: the Issue opens before
// the GIL is let go and ends once it is back, so Python threads that take turns on the GIL
// cannot slip calls in between.
template <class F>
py::object run(Backend& b, const char* what, bool blocks, F&& call) {
  host_timers::mark(host_timers::kRead);
  Backend::Issue issue(b, what);
  WorkPtr w = blocks ? call_nogil(call) : call();
  issue.check();
  host_timers::mark(host_timers::kReturned);
  return w ? py::cast(std::move(w)) : py::none();
}

std::vector<size_t> counts_arg(const py::handle& h) { return h.cast<std::vector<size_t>>(); }

// The algorithm choice of all_reduce, reduce and broadcast (`what`), the same for each one's
// entry points (the backend's check_options says which names the collective takes).
// `levels`: a hierarchical call's local and global step algorithms (AllReduceTuning).
comm::AllReduceTuning tuning_arg(const char* what, const std::string& algorithm,
                                 size_t tree_arity, size_t max_segment_bytes,
                                 std::pair<std::string, std::string> levels = {"auto", "auto"},
                                 size_t tree_threshold_bytes = kDefaultTreeThresholdBytes,
                                 size_t hd_threshold_bytes = kDefaultHdThresholdBytes) {
  comm::AllReduceTuning t;
  t.algorithm = algorithm_arg(algorithm, what);
  t.local_algorithm = algorithm_arg(levels.first, what);
  t.global_algorithm = algorithm_arg(levels.second, what);
  if (tree_arity > 0xffff)
    throw InvalidArgument(str_cat(what, ": tree_arity ", tree_arity, " is more than 65535"));
  t.tree_arity = static_cast<uint16_t>(tree_arity);
  t.max_segment_bytes = max_segment_bytes;
  t.tree_threshold_bytes = tree_threshold_bytes;
  t.hd_threshold_bytes = hd_threshold_bytes;
  return t;
}

// tree_arity of the METH_FASTCALL entry points: CollectiveConfig.tree_arity itself, "binomial"
// (0) or k, so that the hot path reads a plain attribute instead of the arity_code property.
size_t arity_arg(PyObject* o, const char* what) {
  if (PyUnicode_Check(o)) {
    Py_ssize_t n;
    const char* s = PyUnicode_AsUTF8AndSize(o, &n);
    if (s && std::string_view(s, static_cast<size_t>(n)) == "binomial") return 0;
    PyErr_Clear();
    throw py::type_error(str_cat(what, ": tree_arity must be 'binomial' or an int >= 0"));
  }
  return size_arg(o, what, "tree_arity");
}

// The backend a METH_FASTCALL method was called on, once its positional arguments are
// counted: "<name> takes <n> positional arguments (<args>), got <k>" otherwise.
Backend& fast_backend(PyObject* self, Py_ssize_t nargs, const char* name, Py_ssize_t want,
                      const char* args) {
  if (nargs != want)
    throw py::type_error(str_cat(name, " takes ", want, " positional arguments (", args,
                                 "), got ", nargs));
  // pybind11's cast looks the type up by typeid at every call (about 50 ns of a 0.6 us call).
  // An instance of simple layout holds a pointer to its value (a CpuBackend, an NcclBackend,
  // ...), and the Backend within it lies at an offset fixed by the Python type: learnt at the
  // type's first cast, then added. The types are held, so that an address stays their own.
  struct Seen {
    PyTypeObject* type;
    std::ptrdiff_t offset;
  };
  static Seen seen[4] = {};  // the GIL guards it
  auto* inst = reinterpret_cast<py::detail::instance*>(self);
  char* value = inst->simple_layout ? static_cast<char*>(inst->simple_value_holder[0]) : nullptr;
  if (value)
    for (const Seen& k : seen)
      if (k.type == Py_TYPE(self)) return *reinterpret_cast<Backend*>(value + k.offset);
  Backend& b = py::cast<Backend&>(py::handle(self));
  if (value)
    for (Seen& k : seen)
      if (!k.type) {
        Py_INCREF(Py_TYPE(self));
        k = {Py_TYPE(self), reinterpret_cast<char*>(&b) - value};
        break;
      }
  return b;
}

// Note [Tuning memo]
// all_reduce_sync takes its seven tuning arguments on every call, and a program passes the
// same objects each time (its config's attributes). Reading them (str and int conversions,
// three algorithm names looked up) cost about a tenth of a small call's host path, so the
// last call's objects and what they were read as are kept: the same objects (by identity)
// read the same. The memo holds references, so an object it compares against is never freed
// and its address reused by another value; str and int values never change. The GIL guards it.
const comm::AllReduceTuning& all_reduce_tuning(PyObject* const* a, const char* what) {
  constexpr int kArgs = 7;
  static PyObject* seen[kArgs] = {};
  static comm::AllReduceTuning tuning;
  if (std::equal(a, a + kArgs, seen)) return tuning;
  // (algorithm, max_segment_bytes, tree_threshold_bytes, hd_threshold_bytes, tree_arity,
  // local_algorithm, global_algorithm), checked as every call's: may throw, memo unchanged.
  const comm::AllReduceTuning t =
      tuning_arg(what, str_arg(a[0], what, "algorithm"), arity_arg(a[4], what),
                 size_arg(a[1], what, "max_segment_bytes"),
                 {str_arg(a[5], what, "local_algorithm"), str_arg(a[6], what, "global_algorithm")},
                 size_arg(a[2], what, "tree_threshold_bytes"),
                 size_arg(a[3], what, "hd_threshold_bytes"));
  for (int i = 0; i < kArgs; ++i) {
    Py_INCREF(a[i]);
    Py_XDECREF(seen[i]);
    seen[i] = a[i];
  }
  tuning = t;
  return tuning;
}

// Note [all_reduce_sync]
// The synchronous in-place all_reduce, ProcessGroup.all_reduce's hot path on every backend:
// one METH_FASTCALL call (Note [FASTCALL methods]), no Work, no owner reference. Arguments
// are positional: (x, op, timeout, stream, algorithm, max_segment_bytes,
// tree_threshold_bytes, hd_threshold_bytes, tree_arity, local_algorithm, global_algorithm).
PyObject* all_reduce_sync(PyObject* self, PyObject* const* args, Py_ssize_t nargs) {
  return fastcall([&]() -> PyObject* {
    constexpr const char* what = "all_reduce";
    Backend& b = fast_backend(self, nargs, "all_reduce_sync", 11,
                              "x, op, timeout, stream, algorithm, max_segment_bytes, "
                              "tree_threshold_bytes, hd_threshold_bytes, tree_arity, "
                              "local_algorithm, global_algorithm");
    CallReader read(b, what, py::handle(args[2]), py::handle(args[3]), false);
    comm::ArrayView x = read(py::handle(args[0]), "", true);
    RedOp op = redop_arg(str_arg(args[1], what, "op"), what);
    read.opts.tuning = all_reduce_tuning(args + 4, what);  // Note [Tuning memo]
    run(b, read.what(), read.blocks(), [&] { return b.all_reduce(x, x, op, read.opts); });
    Py_RETURN_NONE;
  });
}

// Note [Synchronous gathers]
// all_gather and reduce_scatter with equal blocks, synchronous: one METH_FASTCALL call each,
// as all_reduce_sync. The blocks follow from x (all_gather: x's count from every rank;
// reduce_scatter: an equal share of x's rows, checked here), so no list of counts crosses
// the boundary; the contract checks out's size against them. out=None: on a CPU group, a
// numpy x gets a new numpy out made here (a third of a small call's host time when Python
// made it); a GPU group's ProcessGroup makes it with the array's framework. Returns out.
// Arguments: all_gather_sync(x, out, timeout, stream), reduce_scatter_sync(x, out, op,
// timeout, stream).

// A numpy array of x's dtype and `shape` for an out=None on a CPU group.
py::object new_host_out(const Backend& b, const py::handle& x, const char* what,
                        std::vector<py::ssize_t> shape) {
  if (b.device_memory() || !py::isinstance<py::array>(x))
    throw py::type_error(str_cat(what, ": out=None is for a numpy x on a CPU group; pass out="));
  return py::array(py::reinterpret_borrow<py::array>(x).dtype(), std::move(shape));
}

PyObject* all_gather_sync(PyObject* self, PyObject* const* args, Py_ssize_t nargs) {
  return fastcall([&]() -> PyObject* {
    constexpr const char* what = "all_gather";
    Backend& b = fast_backend(self, nargs, "all_gather_sync", 4, "x, out, timeout, stream");
    CallReader read(b, what, py::handle(args[2]), py::handle(args[3]), false);
    std::vector<int64_t> dims;
    comm::ArrayView in = read(py::handle(args[0]), "x", false, &dims);
    py::object out_obj = py::reinterpret_borrow<py::object>(args[1]);
    if (out_obj.is_none()) {
      std::vector<py::ssize_t> shape{b.size()};
      shape.insert(shape.end(), dims.begin(), dims.end());
      out_obj = new_host_out(b, py::handle(args[0]), what, std::move(shape));
    }
    comm::ArrayView out = read(out_obj, "out", true);
    const std::vector<size_t> counts(b.size(), in.count);
    run(b, read.what(), read.blocks(),
        [&] { return b.all_gather(in, out, counts, false, read.opts); });
    return out_obj.release().ptr();
  });
}

PyObject* reduce_scatter_sync(PyObject* self, PyObject* const* args, Py_ssize_t nargs) {
  return fastcall([&]() -> PyObject* {
    constexpr const char* what = "reduce_scatter";
    Backend& b = fast_backend(self, nargs, "reduce_scatter_sync", 5,
                              "x, out, op, timeout, stream");
    CallReader read(b, what, py::handle(args[3]), py::handle(args[4]), false);
    std::vector<int64_t> dims;
    comm::ArrayView in = read(py::handle(args[0]), "x", false, &dims);
    if (dims.empty())
      throw InvalidArgument(str_cat(what, ": needs an array with at least one dimension, got a "
                                          "0-d array"));
    if (dims[0] % b.size())
      throw InvalidArgument(str_cat(what, ": axis 0 has ", dims[0], " rows, not divisible by the "
                                          "group size ", b.size(), "; use reduce_scatter_v for "
                                          "uneven splits"));
    py::object out_obj = py::reinterpret_borrow<py::object>(args[1]);
    if (out_obj.is_none()) {
      std::vector<py::ssize_t> shape(dims.begin(), dims.end());
      shape[0] /= b.size();
      out_obj = new_host_out(b, py::handle(args[0]), what, std::move(shape));
    }
    comm::ArrayView out = read(out_obj, "out", true);
    RedOp op = redop_arg(str_arg(args[2], what, "op"), what);
    const std::vector<size_t> counts(b.size(), in.count / b.size());
    run(b, read.what(), read.blocks(),
        [&] { return b.reduce_scatter(in, out, counts, op, false, read.opts); });
    return out_obj.release().ptr();
  });
}

// A rank argument (an int or anything with __index__); the backend checks its range.
int rank_arg(PyObject* o) {
  py::object i = py::reinterpret_steal<py::object>(PyNumber_Index(o));
  if (!i) throw py::error_already_set();
  const long long v = PyLong_AsLongLong(i.ptr());
  if (v == -1 && PyErr_Occurred()) PyErr_Clear();
  return v < INT_MIN ? INT_MIN : v > INT_MAX ? INT_MAX : static_cast<int>(v);
}

// Note [Rooted in-place calls]
// broadcast and reduce, synchronous and in place (x is read once, as writable, and is both
// the input and the output): one METH_FASTCALL call each, as all_reduce_sync. Arguments:
// broadcast_sync(x, root, timeout, stream, algorithm, tree_arity, max_segment_bytes,
// local_algorithm, global_algorithm),
// reduce_sync(x, root, op, timeout, stream, algorithm, tree_arity, max_segment_bytes).
PyObject* broadcast_sync(PyObject* self, PyObject* const* args, Py_ssize_t nargs) {
  return fastcall([&]() -> PyObject* {
    constexpr const char* what = "broadcast";
    Backend& b = fast_backend(self, nargs, "broadcast_sync", 9,
                              "x, root, timeout, stream, algorithm, tree_arity, "
                              "max_segment_bytes, local_algorithm, global_algorithm");
    CallReader read(b, what, py::handle(args[2]), py::handle(args[3]), false);
    comm::ArrayView x = read(py::handle(args[0]), "x", true);
    const int root = rank_arg(args[1]);
    read.opts.tuning = tuning_arg(what, str_arg(args[4], what, "algorithm"),
                                  arity_arg(args[5], what),
                                  size_arg(args[6], what, "max_segment_bytes"),
                                  {str_arg(args[7], what, "local_algorithm"),
                                   str_arg(args[8], what, "global_algorithm")});
    run(b, what, read.blocks(), [&] { return b.broadcast(x, root, read.opts); });
    Py_RETURN_NONE;
  });
}

PyObject* reduce_sync(PyObject* self, PyObject* const* args, Py_ssize_t nargs) {
  return fastcall([&]() -> PyObject* {
    constexpr const char* what = "reduce";
    Backend& b = fast_backend(self, nargs, "reduce_sync", 8,
                              "x, root, op, timeout, stream, algorithm, tree_arity, "
                              "max_segment_bytes");
    CallReader read(b, what, py::handle(args[3]), py::handle(args[4]), false);
    comm::ArrayView x = read(py::handle(args[0]), "x", true);
    const int root = rank_arg(args[1]);
    RedOp op = redop_arg(str_arg(args[2], what, "op"), what);
    read.opts.tuning = tuning_arg(what, str_arg(args[5], what, "algorithm"),
                                  arity_arg(args[6], what),
                                  size_arg(args[7], what, "max_segment_bytes"));
    run(b, what, read.blocks(), [&] { return b.reduce(x, x, op, root, read.opts); });
    Py_RETURN_NONE;
  });
}

// Note [Synchronous point-to-point]
// ProcessGroup.send/recv in one call: the transfer and its wait (p2p with `wait`). The
// backend may finish it itself and return no Work: the CPU backend runs it on the calling
// thread when the group is idle (Note [Inline execution]) instead of two thread hand-offs
// each way; the NCCL backend enqueues it on the caller's stream, which orders every later use
// of the buffer, as a synchronous collective (no Work, and the array is not held). A Work it
// does return (the CPU backend, queued behind posted work) is waited for here.
//
// send (is_send) or recv of `a`. Posted (isend/irecv): returns the Work, which holds `a`.
// Waited for (`wait`, Note [Synchronous point-to-point]): returns None.
py::object p2p(Backend& b, bool is_send, const py::handle& a, int peer, uint32_t tag,
               const py::handle& timeout, const py::handle& stream, bool wait) {
  // Only a posted transfer's Work holds the array: a waited-for one is done (CPU) or ordered
  // by the caller's stream (GPU) when the call returns.
  CallReader read(b, is_send ? "send" : "recv", timeout, stream, false, !wait);
  read.opts.wait = wait;
  auto buf = read(a, "x", !is_send);
  py::object w = run(b, read.what(), wait && read.blocks(), [&] {
    return is_send ? b.send(buf, peer, tag, read.opts) : b.recv(buf, peer, tag, read.opts);
  });
  if (!wait || w.is_none()) return w;
  Work& work = w.cast<Work&>();
  call_nogil([&] { work.wait(Millis(-1), false, to_cu_stream(kLegacyStream)); });
  return py::none();
}

// The Python exception object of a failure (None for none), as raising it would make: the
// failure is rethrown through a bound function, so every registered translator applies
// (meshcoll's error classes; pybind11's detail::translate_exception knows only std's).
py::object exception_object(const std::exception_ptr& e) {
  if (!e) return py::none();
  py::cpp_function rethrow([e]() { std::rethrow_exception(e); });
  try {
    rethrow();
  } catch (py::error_already_set& err) {
    return err.value();
  }
  return py::none();  // not reached: rethrow always raises
}

py::object work_exception(Work& w) { return exception_object(w.exception()); }
}  // namespace

void bind_backend(py::module_& m) {
  py::class_<Work, std::shared_ptr<Work>>(m, "Work", "Handle on one asynchronous operation.")
      .def("wait", [](Work& w, const py::handle& timeout, const py::handle& stream) {
             uintptr_t s = kLegacyStream;
             bool has = stream_arg(stream, &s);
             Millis t = timeout_arg(timeout, "Work.wait");
             call_nogil([&] { w.wait(t, has, to_cu_stream(s)); });
           }, py::arg("timeout") = py::none(), py::arg("stream") = py::none(),
           "Waits for the operation and raises its failure. GPU: orders `stream` (default: "
           "the stream the op was issued from) after the op, without blocking the host.")
      .def("synchronize", [](Work& w, const py::handle& timeout) {
             Millis t = timeout_arg(timeout, "Work.synchronize");
             call_nogil([&] { w.synchronize(t); });
           }, py::arg("timeout") = py::none(), "Blocks the host until the operation completed.")
      .def("is_completed", &Work::is_completed)
      .def_property_readonly("captured", &Work::captured)
      .def("exception", &work_exception);

  using comm::CompletionStamps;
  py::class_<CompletionStamps>(m, "CompletionStamps",
                               "When each added Work completed, observed by a C++ thread that "
                               "never takes the GIL (Note [Completion stamps] in comm/stamps.h).")
      .def(py::init<>())
      .def("add", &CompletionStamps::add, py::arg("work"), py::arg("quiet") = false,
           "Queues a Work; returns its ticket. quiet: a GPU op, polled every 100 us.")
      .def("take", [](CompletionStamps& s, uint64_t ticket) {
             CompletionStamps::Stamp st = call_nogil([&] { return s.take(ticket); });
             return py::make_tuple(st.end, exception_object(st.error));
           }, py::arg("ticket"),
           "Blocks until the ticket's Work completed; returns (its end in time.perf_counter "
           "seconds, its failure or None), once per ticket.");

  py::class_<Array>(m, "Array", "An array as a backend read it: dtype, shape, device, stream.")
      .def_property_readonly("obj", [](const Array& a) { return a.obj; })
      .def_property_readonly("shape", [](const Array& a) {
        py::tuple t(a.dims.size());
        for (size_t i = 0; i < a.dims.size(); ++i) t[i] = py::int_(a.dims[i]);
        return t;
      })
      .def_property_readonly("ndim", [](const Array& a) { return a.dims.size(); })
      .def_property_readonly("size", [](const Array& a) { return a.read.view.count; })
      .def_property_readonly("nbytes", [](const Array& a) {
        return a.read.view.count * dtype_size(a.read.view.dtype);
      })
      .def_property_readonly("dtype", [](const Array& a) { return std::string(dtype_name(a.read.view.dtype)); })
      .def_property_readonly("device", [](const Array& a) { return a.read.view.device; })
      .def_property_readonly("stream", [](const Array& a) { return a.read.stream; })
      .def_property_readonly("ptr", [](const Array& a) {
        return reinterpret_cast<uintptr_t>(a.read.view.data);
      })
      .def("__repr__", [](const Array& a) {
        return str_cat("Array(dtype=", dtype_name(a.read.view.dtype), ", size=", a.read.view.count,
                       ", device=", a.read.view.device, ")");
      });

  m.def("check_timeout", [](const py::handle& timeout, const char* op) {
          const double s = seconds_of(timeout, "timeout", op);
          seconds_arg(s, "timeout", false, op);  // the range every call's timeout= has
          return s;
        }, py::arg("timeout"), py::arg("op"),
        "timeout= of `op` checked as every call's is (TypeError, ValueError naming it); returns "
        "it in seconds. For the calls that take it in Python first (new_group, split, init).");
  m.def("_array_reader", &array_reader, py::arg("x"),
        "Which protocol reads x (csrc/python/array.h): for tests and diagnosis.");
  m.def("read_array", &make_array, py::arg("x"), py::arg("what"), py::arg("writable") = false,
        py::arg("device") = false, py::arg("stream") = py::none(),
        "Reads x as a backend would (host memory, or CUDA memory with device=True): the one "
        "place every array is checked (csrc/python/array.cc).");

  py::class_<Backend, std::shared_ptr<Backend>> b(m, "Backend",
      "One group's communicator (CPU or NCCL): the backend contract of csrc/comm/backend.h.");
  add_fastcall_method(b, "all_reduce_sync", &all_reduce_sync,
                      "all_reduce_sync(x, op, timeout, stream, algorithm, max_segment_bytes, "
                      "tree_threshold_bytes, hd_threshold_bytes, tree_arity, local_algorithm, "
                      "global_algorithm): all_reduce x in place and "
                      "return when done (CPU) or enqueued (GPU) (Note [all_reduce_sync]).");
  add_fastcall_method(b, "all_gather_sync", &all_gather_sync,
                      "all_gather_sync(x, out, timeout, stream): every rank's x, in rank order, "
                      "into out (None: a new numpy array, CPU groups); returns out (Note "
                      "[Synchronous gathers]).");
  add_fastcall_method(b, "reduce_scatter_sync", &reduce_scatter_sync,
                      "reduce_scatter_sync(x, out, op, timeout, stream): this rank's equal share "
                      "of the reduction of x's rows into out (None: a new numpy array, CPU "
                      "groups); returns out (Note [Synchronous gathers]).");
  add_fastcall_method(b, "broadcast_sync", &broadcast_sync,
                      "broadcast_sync(x, root, timeout, stream, algorithm, tree_arity, "
                      "max_segment_bytes, local_algorithm, global_algorithm): x of rank root "
                      "into every rank's x (Note [Rooted "
                      "in-place calls]).");
  add_fastcall_method(b, "reduce_sync", &reduce_sync,
                      "reduce_sync(x, root, op, timeout, stream, algorithm, tree_arity, "
                      "max_segment_bytes): the reduction of x into root's x (Note [Rooted "
                      "in-place calls]).");
  b.def_property_readonly("rank", &Backend::rank)
      .def_property_readonly("size", &Backend::size)
      .def_property_readonly("name", [](const Backend& x) { return std::string(x.name()); })
      .def_property_readonly("transport", &Backend::transport)
      .def_property_readonly("device_memory", &Backend::device_memory)
      .def_property_readonly("device", &Backend::device)
      .def("view", [](Backend& x, const py::handle& a, const char* what, bool writable,
                      const py::handle& stream) {
             return make_array(a, what, writable, x.device_memory(), stream);
           }, py::arg("x"), py::arg("what"), py::arg("writable") = false,
           py::arg("stream") = py::none(),
           "Reads x as this backend's collectives would (every check), once.")
      .def("set_identity", &Backend::set_identity, py::arg("global_ranks"), py::arg("group"),
           "Names this rank (global number) and the group in the errors raised above the "
           "backends; set once, before the first call.")
      .def("recent_calls", [](Backend& x, size_t n) {
             std::vector<std::string> out;
             for (const auto& r : x.ledger().recent(n)) out.push_back(r.describe());
             return out;
           }, py::arg("n") = comm::Ledger::kKeep, "The group's last calls, oldest first.")
      .def("stats", [](Backend& x) {
             // Note [Call totals] in comm/ledger.h: {kind: (calls, bytes, nanoseconds)}.
             py::dict out;
             for (const auto& t : x.ledger().totals())
               out[coll_name(t.kind)] = py::make_tuple(t.calls, t.bytes, t.nanoseconds);
             return out;
           }, "Per collective kind ('send/recv' for point-to-point), this rank's calls that "
              "completed: (calls, bytes, nanoseconds).")
      .def("fail", [](Backend& x, const std::string& message) {
             py::gil_scoped_release nogil;
             x.fail(message);
           }, py::arg("message"),
           "Fails the group (every member raises PeerError with `message`), after pending ops.")
      .def("shutdown", [](Backend& x) {
        py::gil_scoped_release nogil;
        x.shutdown();
      })
      .def("begin_coalesced", &Backend::begin_coalesced,
           "Opens a coalesced block (Note [Coalesced blocks] in csrc/comm/backend.h).")
      .def("end_coalesced", [](Backend& x, const py::handle& timeout) {
             const Millis t = timeout_arg(timeout, "coalesced");
             if (x.device_memory()) return x.end_coalesced(t);  // an enqueue: GIL held
             // A CPU block's end runs its staged all_reduces: the GIL goes, as for any
             // blocking call, inside the Issue (Note [One issuing thread]).
             Backend::Issue issue(x, "end of a coalesced block");
             call_nogil([&] { x.end_coalesced(t); });
             issue.check();
           }, py::arg("timeout") = py::none(),
           "Ends the innermost block; the outermost runs its ops (NCCL: enqueues them, with "
           "the GIL held, as every NCCL enqueue; CPU: runs its staged all_reduces).")
      .def_property_readonly("coalescing", &Backend::coalescing,
                             "Whether a coalesced block is open.")
      .def("all_reduce", [](Backend& x, const py::handle& a, const py::handle& out,
                            const std::string& op, const py::handle& timeout,
                            const py::handle& stream, bool async, const std::string& algorithm,
                            size_t max_segment_bytes, size_t tree, size_t hd, size_t arity,
                            const std::string& local, const std::string& global) {
             const char* what = "all_reduce";
             CallReader read(x, what, timeout, stream, async);
             auto in = read(a, "x", false);
             auto o = out.is(a) ? read(out, "x", true) : read(out, "out", true);
             read.opts.tuning = tuning_arg(what, algorithm, arity, max_segment_bytes,
                                           {local, global}, tree, hd);
             RedOp rop = redop_arg(op, what);
             return run(x, read.what(), read.blocks(), [&] { return x.all_reduce(in, o, rop, read.opts); });
           })
      .def("reduce", [](Backend& x, const py::handle& a, const py::handle& out, int root,
                        const std::string& op, const py::handle& timeout, const py::handle& stream,
                        bool async, const std::string& algorithm, size_t arity,
                        size_t max_segment_bytes) {
             CallReader read(x, "reduce", timeout, stream, async);
             auto in = read(a, "x", false);
             auto o = read(out, "out", true);
             RedOp rop = redop_arg(op, "reduce");
             read.opts.tuning = tuning_arg("reduce", algorithm, arity, max_segment_bytes);
             return run(x, read.what(), read.blocks(), [&] { return x.reduce(in, o, rop, root, read.opts); });
           })
      .def("broadcast", [](Backend& x, const py::handle& a, int root, const py::handle& timeout,
                           const py::handle& stream, bool async, const std::string& algorithm,
                           size_t arity, size_t max_segment_bytes, const std::string& local,
                           const std::string& global) {
             CallReader read(x, "broadcast", timeout, stream, async);
             auto buf = read(a, "x", true);
             read.opts.tuning = tuning_arg("broadcast", algorithm, arity, max_segment_bytes,
                                           {local, global});
             return run(x, read.what(), read.blocks(), [&] { return x.broadcast(buf, root, read.opts); });
           })
      .def("all_gather", [](Backend& x, const py::handle& a, const py::handle& out,
                            const py::handle& counts, bool uneven, const py::handle& timeout,
                            const py::handle& stream, bool async) {
             CallReader read(x, uneven ? "all_gather_v" : "all_gather", timeout, stream, async);
             auto in = read(a, "x", false);
             auto o = read(out, "out", true);
             auto c = counts_arg(counts);
             return run(x, read.what(), read.blocks(), [&] { return x.all_gather(in, o, c, uneven, read.opts); });
           })
      .def("exchange", [](Backend& x, const py::handle& a, const py::handle& out,
                          const std::string& of, const py::handle& timeout) {
             // Note [Internal exchanges] in common/op_desc.h: the metadata round of `of`, under
             // its own kind, so it never pairs with a user's all_gather or all_to_all.
             CollKind kind;
             if (!exchange_kind(of, &kind))
               throw py::value_error(str_cat("exchange: no internal exchange of '", of, "'"));
             CallReader read(x, coll_name(kind), timeout, py::none(), false);
             auto in = read(a, "x", false);
             auto o = read(out, "out", true);
             read.opts.exchange = kind;
             const size_t n = static_cast<size_t>(x.size());
             if (kind == CollKind::kAllToAllVCounts) {  // block r of x goes to rank r
               const std::vector<size_t> blocks(n, in.count / n);
               return run(x, read.what(), read.blocks(), [&] {
                 return x.all_to_all(in, o, blocks, blocks, false, read.opts);
               });
             }
             const std::vector<size_t> counts(n, in.count);  // every rank's x, in rank order
             return run(x, read.what(), read.blocks(), [&] {
               return x.all_gather(in, o, counts, false, read.opts);
             });
           }, py::arg("x"), py::arg("out"), py::arg("of"), py::arg("timeout") = py::none(),
           "The internal metadata exchange of `of` (all_gather_v, all_to_all_v, split): an "
           "all_gather (all_to_all for all_to_all_v) under its own kind, which pairs with no "
           "user call (Note [Internal exchanges] in csrc/common/op_desc.h). Blocks.")
      .def("reduce_scatter", [](Backend& x, const py::handle& a, const py::handle& out,
                                const py::handle& counts, const std::string& op, bool uneven,
                                const py::handle& timeout, const py::handle& stream, bool async) {
             const char* what = uneven ? "reduce_scatter_v" : "reduce_scatter";
             CallReader read(x, what, timeout, stream, async);
             auto in = read(a, "x", false);
             auto o = read(out, "out", true);
             auto c = counts_arg(counts);
             RedOp rop = redop_arg(op, what);
             return run(x, read.what(), read.blocks(), [&] { return x.reduce_scatter(in, o, c, rop, uneven, read.opts); });
           })
      .def("all_to_all", [](Backend& x, const py::handle& a, const py::handle& out,
                            const py::handle& send_counts, const py::handle& recv_counts,
                            bool uneven, const py::handle& timeout, const py::handle& stream,
                            bool async) {
             CallReader read(x, uneven ? "all_to_all_v" : "all_to_all", timeout, stream, async);
             auto in = read(a, "x", false);
             auto o = read(out, "out", true);
             auto sc = counts_arg(send_counts), rc = counts_arg(recv_counts);
             return run(x, read.what(), read.blocks(), [&] { return x.all_to_all(in, o, sc, rc, uneven, read.opts); });
           })
      .def("gather", [](Backend& x, const py::handle& a, const py::handle& out,
                        const py::handle& counts, int root, const py::handle& timeout,
                        const py::handle& stream, bool async) {
             CallReader read(x, "gather", timeout, stream, async);
             auto in = read(a, "x", false);
             auto o = read(out, "out", true);
             auto c = counts_arg(counts);
             return run(x, read.what(), read.blocks(), [&] { return x.gather(in, o, c, root, read.opts); });
           })
      .def("scatter", [](Backend& x, const py::handle& a, const py::handle& out,
                         const py::handle& counts, int root, const py::handle& timeout,
                         const py::handle& stream, bool async) {
             CallReader read(x, "scatter", timeout, stream, async);
             auto o = read(out, "out", true);  // the output decides the stream: non-roots
             auto in = read(a, "x", false);    // pass an empty x
             auto c = counts_arg(counts);
             return run(x, read.what(), read.blocks(), [&] { return x.scatter(in, o, c, root, read.opts); });
           })
      .def("barrier", [](Backend& x, const py::handle& timeout, const py::handle& stream,
                         bool async) {
             CallReader read(x, "barrier", timeout, stream, async);
             return run(x, read.what(), !async, [&] { return x.barrier(read.opts); });
           })
      .def("send", [](Backend& x, const py::handle& a, int peer, uint32_t tag,
                      const py::handle& timeout, const py::handle& stream) {
             return p2p(x, true, a, peer, tag, timeout, stream, false);
           })
      .def("recv", [](Backend& x, const py::handle& a, int peer, uint32_t tag,
                      const py::handle& timeout, const py::handle& stream) {
             return p2p(x, false, a, peer, tag, timeout, stream, false);
           })
      .def("send_sync", [](Backend& x, const py::handle& a, int peer, uint32_t tag,
                           const py::handle& timeout, const py::handle& stream) {
             p2p(x, true, a, peer, tag, timeout, stream, true);
           }, "send, waited for (Note [Synchronous point-to-point]).")
      .def("recv_sync", [](Backend& x, const py::handle& a, int peer, uint32_t tag,
                           const py::handle& timeout, const py::handle& stream) {
             p2p(x, false, a, peer, tag, timeout, stream, true);
           }, "recv, waited for (Note [Synchronous point-to-point]).");
}

}  // namespace meshcoll::python
