// The CPU backend's constructor and the facts Python asks of its algorithms. Its collectives
// are the contract's, bound once in bind_backend.cc.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "cpu/algo/collectives.h"
#include "common/deadline.h"
#include "common/error.h"
#include "common/host_identity.h"
#include "cpu/cpu_backend.h"
#include "python/fastcall.h"

namespace py = pybind11;

namespace meshcoll::python {

void bind_comm(py::module_& m) {
  m.def("host_identity", &host_identity,
        "What decides that two ranks share a host (and shared memory): hostname, boot id and "
        "IPC namespace, or $MESHCOLL_HOST_ID.");
  py::dict defaults;
  defaults["max_segment_bytes"] = kDefaultMaxSegmentBytes;
  defaults["tree_threshold_bytes"] = kDefaultTreeThresholdBytes;
  defaults["hd_threshold_bytes"] = kDefaultHdThresholdBytes;
  m.attr("ALL_REDUCE_DEFAULTS") = defaults;
  m.attr("DEFAULT_TIMEOUT_S") = std::chrono::duration<double>(kDefaultTimeout).count();
  m.def("algorithm_names", [] {
    std::vector<std::string> names;
    for (int a = 0; a <= static_cast<int>(Algorithm::kShm); ++a)
      names.push_back(algorithm_name(static_cast<Algorithm>(a)));
    names.push_back("centralized");  // another name of direct (algorithm_from_name)
    return names;
  });
  m.def("select_all_reduce", [](size_t nbytes, int world, size_t tree_threshold, size_t hd_threshold) {
        algo::SelectConfig cfg;
        cfg.tree_threshold_bytes = tree_threshold;
        cfg.hd_threshold_bytes = hd_threshold;
        return std::string(algorithm_name(algo::select_all_reduce(nbytes, world, cfg)));
      }, py::arg("nbytes"), py::arg("world_size"), py::arg("tree_threshold_bytes"),
      py::arg("hd_threshold_bytes"));
  auto selects = [](const std::string& name) {
    for (auto c : {algo::Selects::kAllReduce, algo::Selects::kReduce, algo::Selects::kBroadcast,
                   algo::Selects::kAllGather, algo::Selects::kReduceScatter})
      if (name == algo::selects_name(c)) return c;
    throw InvalidArgument(str_cat("unknown collective '", name, "'; use all_reduce, reduce, "
                                  "broadcast, all_gather or reduce_scatter"));
  };
  m.def("select_algorithm", [selects](const std::string& collective, bool shm, size_t nbytes,
                                      int world, size_t tree_threshold, size_t hd_threshold) {
        algo::SelectConfig cfg;
        cfg.tree_threshold_bytes = tree_threshold;
        cfg.hd_threshold_bytes = hd_threshold;
        const algo::Choice c = algo::select_algorithm(selects(collective), shm, nbytes, world, cfg);
        return py::make_tuple(std::string(algorithm_name(c.algorithm)), c.arity);
      }, py::arg("collective"), py::arg("shm"), py::arg("nbytes"), py::arg("world_size"),
      py::arg("tree_threshold_bytes"), py::arg("hd_threshold_bytes"),
      "(algorithm, arity) that auto runs (Note [Selection table] in csrc/cpu/algo/select.cc).");
  m.def("selection_table", [] {
        py::list rows;
        for (const auto& r : algo::selection_table()) {
          py::dict d;
          d["collective"] = algo::selects_name(r.coll);
          d["family"] = r.shm ? "shm" : "tcp";
          d["max_ranks"] = r.max_ranks;
          d["threshold"] = r.threshold;
          d["pow2_only"] = r.pow2_only;
          d["algorithm"] = algorithm_name(r.choice.algorithm);
          d["arity"] = r.choice.arity;
          d["source"] = r.source;
          rows.append(d);
        }
        return rows;
      }, "The rows of Note [Selection table] (csrc/cpu/algo/select.cc), first match wins.");

  py::class_<cpu::CpuBackend, comm::Backend, std::shared_ptr<cpu::CpuBackend>>(
      m, "CpuBackend", "The CPU backend of one group: TCP between hosts, shared memory within one.")
      .def(py::init([](std::shared_ptr<store::Store> store, int rank, int size, double timeout_s,
                       const std::string& bind_host, const std::string& token, uint64_t comm_id,
                       const std::string& transport, size_t shm_bytes, bool debug,
                       std::vector<int> global_ranks,
                       std::vector<std::pair<std::string, std::string>> shared) {
             if (transport != "auto" && transport != "shm" && transport != "tcp")
               throw py::value_error(str_cat("MESHCOLL_TRANSPORT must be auto, shm or tcp, got '",
                                             transport, "'"));
             cpu::CommOptions o;
             o.transport = transport;
             o.shm_bytes = shm_bytes;
             o.timeout = seconds_arg(timeout_s, "timeout");
             o.bind_host = bind_host;
             o.token = token;
             o.debug = debug;
             o.global = RankNames(std::move(global_ranks));
             o.shared = std::move(shared);
             return call_nogil(  // Note [Interrupts]: Ctrl-C while waiting for the ranks
                 [&] { return std::make_shared<cpu::CpuBackend>(store, rank, size, o, comm_id); });
           }),
           py::arg("store"), py::arg("rank"), py::arg("size"), py::arg("timeout"),
           py::arg("bind_host"), py::arg("token"), py::arg("comm_id"), py::arg("transport") = "auto",
           py::arg("shm_bytes") = size_t(4) << 20, py::arg("debug") = false,
           py::arg("global_ranks") = std::vector<int>(),
           py::arg("shared") = store::Settings(),
           "`shared`: (name, value) of each setting every rank must share (Note [Shared "
           "settings] in csrc/store/exchange.h)")
      .def("set_hierarchy", [](cpu::CpuBackend& b, std::shared_ptr<cpu::CpuBackend> local,
                               std::shared_ptr<comm::Backend> leaders, std::vector<int> hosts) {
             b.set_hierarchy(cpu::Hierarchy::make(std::move(local), std::move(leaders),
                                                  std::move(hosts), b.rank()));
           },
           py::arg("local"), py::arg("leaders").none(true), py::arg("hosts"),
           "Makes all_reduce (algorithm auto), broadcast and all_gather hierarchical (Note "
           "[Hierarchy] in meshcoll/hierarchy.py): `local` is this rank's host's group, "
           "`leaders` the group of each host's lowest rank (None off the leaders; a CpuBackend, or "
           "an MpiBackend: Note [Hierarchy on MPI]), `hosts` the "
           "host of each group rank. Call once, before the group's first collective.");
}

}  // namespace meshcoll::python
