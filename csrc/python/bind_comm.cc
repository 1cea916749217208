// The CPU communicator and its Work handles. Arrays are validated (contiguity, writability,
// dtype) with the GIL held; the GIL is released only around the enqueue, which may block
// briefly, around Work.wait, and around all_reduce_sync's run-and-wait.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cmath>

#include "algo/collectives.h"
#include "comm/comm.h"
#include "common/error.h"
#include "python/buffers.h"
#include "python/fastcall.h"
#include "reduce/kernels.h"
#include "transport/shm/segment.h"

namespace py = pybind11;

namespace meshcoll::python {

namespace {
using comm::Comm;
using comm::CollKind;
using comm::Work;

RedOp redop_arg(const std::string& name, DType dtype, const char* what) {
  RedOp op;
  if (!redop_from_name(name, &op))
    throw py::value_error(str_cat(what, ": unknown reduction op '", name,
                                  "'; use sum, prod, min, max, avg, band, bor or bxor"));
  reduce::lookup(dtype, op);  // throws TypeMismatch naming both when unsupported
  return op;
}

transport::OpDesc desc(CollKind k, DType dt, size_t count, RedOp op = RedOp::kSum, int root = -1) {
  transport::OpDesc d;
  d.coll = static_cast<uint8_t>(k);
  d.dtype = static_cast<uint8_t>(dt);
  d.redop = static_cast<uint8_t>(op);
  d.root = root;
  d.count = count;
  return d;
}

// FNV-1a over the dimensions: a cheap fingerprint for the agreement check.
uint32_t shape_hash(const py::array& a) {
  uint32_t h = 2166136261u;
  auto mix = [&h](uint64_t v) {
    for (int i = 0; i < 8; ++i) {
      h ^= static_cast<uint8_t>(v >> (8 * i));
      h *= 16777619u;
    }
  };
  mix(static_cast<uint64_t>(a.ndim()));
  for (py::ssize_t i = 0; i < a.ndim(); ++i) mix(static_cast<uint64_t>(a.shape(i)));
  return h | 1u;  // never 0, which means "not checked"
}

void check_root(const Comm& c, int root, const char* what) {
  if (root < 0 || root >= c.size())
    throw py::value_error(str_cat(what, ": root ", root, " is out of range for a group of ",
                                  c.size(), " ranks (0..", c.size() - 1, ")"));
}

void check_same(const ArrayView& a, const ArrayView& b, const char* what) {
  if (a.dtype != b.dtype)
    throw py::type_error(str_cat(what, ": out has dtype ", dtype_name(b.dtype), " but x has ",
                                 dtype_name(a.dtype)));
}

std::vector<size_t> to_bytes(const std::vector<size_t>& counts, DType dt) {
  std::vector<size_t> out(counts.size());
  for (size_t i = 0; i < counts.size(); ++i) out[i] = counts[i] * dtype_size(dt);
  return out;
}

// all_reduce's arguments, validated with the GIL held.
algo::AllreduceArgs allreduce_args(Comm& c, const ArrayView& in, const ArrayView& o,
                                   const std::string& op, const std::string& algorithm,
                                   size_t max_segment_bytes, size_t tree_threshold,
                                   size_t hd_threshold) {
  const char* what = "all_reduce";
  check_same(in, o, what);
  if (in.count != o.count) throw py::value_error("all_reduce: out must have x's size");
  algo::AllreduceArgs a;
  a.in = in.cbytes();
  a.out = o.mbytes();
  a.count = in.count;
  a.dtype = in.dtype;
  a.op = redop_arg(op, in.dtype, what);
  if (!algo::algorithm_from_name(algorithm, &a.algorithm))
    throw py::value_error(str_cat("all_reduce: unknown algorithm '", algorithm,
                                  "'; use auto, ring, tree, halving_doubling or direct"));
  if (a.algorithm == algo::Algorithm::kShm && !c.shm() && c.size() > 1)
    throw py::value_error(str_cat("all_reduce: algorithm 'shm' needs every rank on one "
                                  "host with shared memory; this group uses ", c.shm_status()));
  if (max_segment_bytes == 0) throw py::value_error("max_segment_bytes must be > 0");
  a.max_segment_bytes = max_segment_bytes;
  a.select.tree_threshold_bytes = tree_threshold;
  a.select.hd_threshold_bytes = hd_threshold;
  return a;
}

// Note [all_reduce_sync]
// The synchronous in-place all_reduce, ProcessGroup.all_reduce's hot path: one call, one GIL
// release, no Work object, a METH_FASTCALL method (Note [FASTCALL methods]): pybind11's
// dispatcher took 0.15 us of the 0.3 us a world-of-1 call cost with these seven arguments.
// Arguments are positional:
// (x, op, algorithm, timeout, max_segment_bytes, tree_threshold_bytes, hd_threshold_bytes).
PyObject* all_reduce_sync(PyObject* self, PyObject* const* args, Py_ssize_t nargs) {
  return fastcall([&]() -> PyObject* {
    constexpr const char* what = "all_reduce_sync";
    if (nargs != 7)
      throw py::type_error(str_cat("all_reduce_sync takes 7 positional arguments (x, op, "
                                   "algorithm, timeout, max_segment_bytes, "
                                   "tree_threshold_bytes, hd_threshold_bytes), got ", nargs));
    Comm& c = py::cast<Comm&>(py::handle(self));
    py::handle x(args[0]);
    if (!py::isinstance<py::array>(x))
      throw py::type_error("all_reduce_sync: x must be a numpy array");
    auto v = view_of(py::reinterpret_borrow<py::array>(x), true, "all_reduce");
    auto a = allreduce_args(c, v, v, str_arg(args[1], what, "op"),
                            str_arg(args[2], what, "algorithm"),
                            size_arg(args[4], what, "max_segment_bytes"),
                            size_arg(args[5], what, "tree_threshold_bytes"),
                            size_arg(args[6], what, "hd_threshold_bytes"));
    Millis t = timeout_arg(py::handle(args[3]));
    {
      py::gil_scoped_release nogil;
      c.run_blocking(desc(CollKind::kAllReduce, v.dtype, v.count, a.op), t,
                     [&a](Comm& cm) { algo::all_reduce(cm, a); });
    }
    Py_RETURN_NONE;
  });
}

// `blocking`: the caller waits right away (async_op=False), so the operation may run on the
// calling thread when the group is idle (Note [Inline execution]).
template <class F>
std::shared_ptr<Work> enqueue(Comm& c, const transport::OpDesc& d, Millis t, F&& run,
                              bool blocking) {
  py::gil_scoped_release nogil;
  return c.enqueue(d, t, std::forward<F>(run), blocking);
}
}  // namespace

void bind_comm(py::module_& m) {
  py::class_<Work, std::shared_ptr<Work>>(m, "Work", "Handle on one queued operation.")
      .def("wait", [](Work& w, const py::object& timeout) {
             Millis t = timeout_arg(timeout);
             py::gil_scoped_release nogil;
             w.wait(t);
           }, py::arg("timeout") = py::none())
      .def("is_completed", &Work::is_completed)
      .def("exception", [](Work& w) -> py::object {
             auto e = w.exception();
             if (!e) return py::none();
             try {
               std::rethrow_exception(e);
             } catch (...) {
               // Let the registered translator build the Python exception, then hand it back.
               try {
                 throw;
               } catch (const std::exception&) {
                 py::detail::translate_exception(std::current_exception());
               }
               py::error_already_set err;
               return err.value();
             }
           });

  m.def("host_identity", &transport::ShmGroup::host_identity,
        "What decides that two ranks share a host (and shared memory): hostname, boot id and "
        "IPC namespace, or $MESHCOLL_HOST_ID.");
  m.def("algorithm_names", [] {
    return std::vector<std::string>{"auto", "ring", "tree", "halving_doubling", "direct", "shm"};
  });
  m.def("select_all_reduce", [](size_t nbytes, int world, size_t tree_threshold, size_t hd_threshold) {
        algo::SelectConfig cfg;
        cfg.tree_threshold_bytes = tree_threshold;
        cfg.hd_threshold_bytes = hd_threshold;
        return std::string(algo::algorithm_name(algo::select_all_reduce(nbytes, world, cfg)));
      }, py::arg("nbytes"), py::arg("world_size"), py::arg("tree_threshold_bytes"),
      py::arg("hd_threshold_bytes"));

  py::class_<Comm, std::shared_ptr<Comm>> comm(m, "Comm", "CPU communicator of one group.");
  add_fastcall_method(comm, "all_reduce_sync", &all_reduce_sync,
                      "all_reduce_sync(x, op, algorithm, timeout, max_segment_bytes, "
                      "tree_threshold_bytes, hd_threshold_bytes): all_reduce x in place and "
                      "wait (Note [all_reduce_sync]).");
  comm
      .def(py::init([](std::shared_ptr<store::Store> store, int rank, int size, double timeout_s,
                       const std::string& bind_host, const std::string& token, uint64_t comm_id,
                       const std::string& transport, size_t shm_bytes) {
             if (transport != "auto" && transport != "shm" && transport != "tcp")
               throw py::value_error(str_cat("MESHCOLL_TRANSPORT must be auto, shm or tcp, got '",
                                             transport, "'"));
             comm::CommOptions o;
             o.transport = transport;
             o.shm_bytes = shm_bytes;
             o.timeout = Millis(static_cast<int64_t>(timeout_s * 1000.0));
             o.bind_host = bind_host;
             o.token = token;
             py::gil_scoped_release nogil;
             return std::make_shared<Comm>(store, rank, size, o, comm_id);
           }),
           py::arg("store"), py::arg("rank"), py::arg("size"), py::arg("timeout"),
           py::arg("bind_host"), py::arg("token"), py::arg("comm_id"), py::arg("transport") = "auto",
           py::arg("shm_bytes") = size_t(4) << 20)
      .def_property_readonly("rank", &Comm::rank)
      .def_property_readonly("transport", &Comm::shm_status)
      .def_property_readonly("size", &Comm::size)
      .def("fail", &Comm::fail, py::arg("message"),
           "Fails the group (peers raise PeerError with `message`), after pending operations.")
      .def("shutdown", [](Comm& c) {
        py::gil_scoped_release nogil;
        c.shutdown();
      })
      .def("all_reduce", [](Comm& c, const py::array& x, const py::array& out, const std::string& op,
                            const std::string& algorithm, const py::object& timeout,
                            size_t max_segment_bytes, size_t tree_threshold, size_t hd_threshold,
                            bool blocking) {
             auto in = view_of(x, false, "all_reduce");
             auto o = view_of(out, true, "all_reduce");
             auto a = allreduce_args(c, in, o, op, algorithm, max_segment_bytes, tree_threshold,
                                     hd_threshold);
             return enqueue(c, desc(CollKind::kAllReduce, in.dtype, in.count, a.op), timeout_arg(timeout),
                            [a](Comm& cm) { algo::all_reduce(cm, a); }, blocking);
           }, py::arg("x"), py::arg("out"), py::arg("op"), py::arg("algorithm"), py::arg("timeout"),
           py::arg("max_segment_bytes"), py::arg("tree_threshold_bytes"), py::arg("hd_threshold_bytes"), py::arg("blocking") = false)
      .def("broadcast", [](Comm& c, const py::array& x, int root, const py::object& timeout, bool blocking) {
             auto v = view_of(x, true, "broadcast");
             check_root(c, root, "broadcast");
             algo::BroadcastArgs a{v.mbytes(), root};
             return enqueue(c, desc(CollKind::kBroadcast, v.dtype, v.count, RedOp::kSum, root),
                            timeout_arg(timeout), [a](Comm& cm) { algo::broadcast(cm, a); }, blocking);
           }, py::arg("x"), py::arg("root"), py::arg("timeout"), py::arg("blocking") = false)
      .def("reduce", [](Comm& c, const py::array& x, const py::array& out, int root,
                        const std::string& op, const py::object& timeout, bool blocking) {
             auto in = view_of(x, false, "reduce");
             auto o = view_of(out, true, "reduce");
             check_same(in, o, "reduce");
             check_root(c, root, "reduce");
             algo::ReduceArgs a{in.cbytes(), o.mbytes(), in.count, in.dtype,
                                redop_arg(op, in.dtype, "reduce"), root};
             return enqueue(c, desc(CollKind::kReduce, in.dtype, in.count, a.op, root),
                            timeout_arg(timeout), [a](Comm& cm) { algo::reduce(cm, a); }, blocking);
           }, py::arg("x"), py::arg("out"), py::arg("root"), py::arg("op"), py::arg("timeout"), py::arg("blocking") = false)
      .def("all_gather", [](Comm& c, const py::array& x, const py::array& out,
                            const std::vector<size_t>& counts, bool uneven, const py::object& timeout, bool blocking) {
             auto in = view_of(x, false, "all_gather");
             auto o = view_of(out, true, "all_gather");
             check_same(in, o, "all_gather");
             size_t total = 0;
             for (auto n : counts) total += n;
             algo::AllGatherArgs a{in.cbytes(), o.mbytes(), to_bytes(counts, in.dtype)};
             auto d = desc(uneven ? CollKind::kAllGatherV : CollKind::kAllGather, in.dtype, total);
             // The result is stacked by shape: (2, 3) on one rank and (3, 2) on another is a
             // mismatch even with equal counts. (The _v form checks shapes in Python.)
             if (!uneven) d.shape = shape_hash(x);
             return enqueue(c, d,
                            timeout_arg(timeout), [a](Comm& cm) { algo::all_gather(cm, a); }, blocking);
           }, py::arg("x"), py::arg("out"), py::arg("counts"), py::arg("uneven"), py::arg("timeout"), py::arg("blocking") = false)
      .def("reduce_scatter", [](Comm& c, const py::array& x, const py::array& out,
                                const std::vector<size_t>& counts, const std::string& op, bool uneven,
                                const py::object& timeout, bool blocking) {
             auto in = view_of(x, false, "reduce_scatter");
             auto o = view_of(out, true, "reduce_scatter");
             check_same(in, o, "reduce_scatter");
             size_t total = 0;
             for (auto n : counts) total += n;
             algo::ReduceScatterArgs a{in.cbytes(), o.mbytes(), counts, in.dtype,
                                       redop_arg(op, in.dtype, "reduce_scatter")};
             return enqueue(c, desc(uneven ? CollKind::kReduceScatterV : CollKind::kReduceScatter,
                                    in.dtype, total, a.op),
                            timeout_arg(timeout), [a](Comm& cm) { algo::reduce_scatter(cm, a); }, blocking);
           }, py::arg("x"), py::arg("out"), py::arg("counts"), py::arg("op"), py::arg("uneven"),
           py::arg("timeout"), py::arg("blocking") = false)
      .def("all_to_all", [](Comm& c, const py::array& x, const py::array& out,
                            const std::vector<size_t>& send_counts, const std::vector<size_t>& recv_counts,
                            bool uneven, const py::object& timeout, bool blocking) {
             auto in = view_of(x, false, "all_to_all");
             auto o = view_of(out, true, "all_to_all");
             check_same(in, o, "all_to_all");
             algo::AllToAllArgs a{in.cbytes(), o.mbytes(), to_bytes(send_counts, in.dtype),
                                  to_bytes(recv_counts, in.dtype)};
             // Uneven: per-rank totals differ, so only the message sizes are checked.
             return enqueue(c, desc(uneven ? CollKind::kAllToAllV : CollKind::kAllToAll, in.dtype,
                                    uneven ? 0 : in.count),
                            timeout_arg(timeout), [a](Comm& cm) { algo::all_to_all(cm, a); }, blocking);
           }, py::arg("x"), py::arg("out"), py::arg("send_counts"), py::arg("recv_counts"),
           py::arg("uneven"), py::arg("timeout"), py::arg("blocking") = false)
      .def("gather", [](Comm& c, const py::array& x, const py::array& out, const std::vector<size_t>& counts,
                        int root, const py::object& timeout, bool blocking) {
             check_root(c, root, "gather");
             auto in = view_of(x, false, "gather");
             auto o = view_of(out, true, "gather");
             check_same(in, o, "gather");
             algo::GatherArgs a{in.cbytes(), o.mbytes(), to_bytes(counts, in.dtype), root};
             return enqueue(c, desc(CollKind::kGather, in.dtype, in.count, RedOp::kSum, root),
                            timeout_arg(timeout), [a](Comm& cm) { algo::gather(cm, a); }, blocking);
           }, py::arg("x"), py::arg("out"), py::arg("counts"), py::arg("root"), py::arg("timeout"), py::arg("blocking") = false)
      .def("scatter", [](Comm& c, const py::array& x, const py::array& out, const std::vector<size_t>& counts,
                         int root, const py::object& timeout, bool blocking) {
             check_root(c, root, "scatter");
             auto in = view_of(x, false, "scatter");
             auto o = view_of(out, true, "scatter");
             check_same(in, o, "scatter");
             algo::GatherArgs a{in.cbytes(), o.mbytes(), to_bytes(counts, in.dtype), root};
             return enqueue(c, desc(CollKind::kScatter, in.dtype, o.count, RedOp::kSum, root),
                            timeout_arg(timeout), [a](Comm& cm) { algo::scatter(cm, a); }, blocking);
           }, py::arg("x"), py::arg("out"), py::arg("counts"), py::arg("root"), py::arg("timeout"), py::arg("blocking") = false)
      .def("barrier", [](Comm& c, const py::object& timeout, bool blocking) {
             return enqueue(c, desc(CollKind::kBarrier, DType::kUint8, 0), timeout_arg(timeout),
                            [](Comm& cm) { algo::barrier(cm); }, blocking);
           }, py::arg("timeout"), py::arg("blocking") = false)
      .def("send", [](Comm& c, const py::array& x, int peer, uint32_t tag, const py::object& timeout) {
             auto v = view_of(x, false, "send");
             Millis t = timeout_arg(timeout);  // reads a Python object: before the release
             py::gil_scoped_release nogil;
             return c.enqueue_p2p(true, peer, tag, v.cbytes(), MutBytes(),
                                  desc(CollKind::kSendRecv, v.dtype, v.count), t);
           }, py::arg("x"), py::arg("peer"), py::arg("tag"), py::arg("timeout"))
      .def("recv", [](Comm& c, const py::array& x, int peer, uint32_t tag, const py::object& timeout) {
             auto v = view_of(x, true, "recv");
             Millis t = timeout_arg(timeout);
             py::gil_scoped_release nogil;
             return c.enqueue_p2p(false, peer, tag, ConstBytes(), v.mbytes(),
                                  desc(CollKind::kSendRecv, v.dtype, v.count), t);
           }, py::arg("x"), py::arg("peer"), py::arg("tag"), py::arg("timeout"));
}

}  // namespace meshcoll::python
