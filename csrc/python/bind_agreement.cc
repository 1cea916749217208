// The agreement check (comm/agreement.h) on its own, over a CPU group among the same ranks.
// It guards NCCL groups, whose tests need GPUs; this hook lets the CPU tests (and CI, which
// has none) drive the real check: note calls as a checked backend does, await some as a call
// on symmetric memory does, and read the failure its sink received.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <mutex>

#include "comm/agreement.h"
#include "comm/ledger.h"
#include "common/error.h"
#include "python/fastcall.h"

namespace py = pybind11;

namespace meshcoll::python {
namespace {

CollKind kind_named(const std::string& name) {
  for (int k = static_cast<int>(CollKind::kAllReduce);
       k <= static_cast<int>(CollKind::kLast); ++k)
    if (name == coll_name(static_cast<CollKind>(k)))
      return static_cast<CollKind>(k);
  throw py::value_error(str_cat("unknown collective '", name, "'"));
}

class AgreementProbe {
 public:
  AgreementProbe(std::shared_ptr<comm::Backend> channel, bool strict, Millis timeout)
      : sink_(std::make_shared<Sink>()) {
    RankNames names = channel->names();
    agreement_ = comm::Agreement::create(
        std::move(channel), strict ? comm::Agreement::Mode::kStrict : comm::Agreement::Mode::kAsync,
        timeout, ledger_,
        [sink = sink_](std::exception_ptr error, uint64_t seq) {
          std::lock_guard<std::mutex> lock(sink->mu);
          if (!sink->error) sink->error = error, sink->seq = seq;
        },
        std::move(names));
  }
  ~AgreementProbe() { agreement_->stop(true); }

  uint64_t note(const std::string& kind, size_t count) {
    const auto d = make_desc(kind_named(kind), DType::kFloat32, count);
    const uint64_t seq = ledger_.open_collective(d);
    agreement_->note(seq, d);
    return seq;
  }
  void await(uint64_t seq, Millis timeout) { agreement_->await(seq, timeout); }
  // Raises the failure the sink received, if any.
  void raise_failure() {
    std::exception_ptr e;
    {
      std::lock_guard<std::mutex> lock(sink_->mu);
      e = sink_->error;
    }
    if (e) std::rethrow_exception(e);
  }
  // The seq the failure voids from (0 when none failed, or none in particular).
  uint64_t failed_seq() {
    std::lock_guard<std::mutex> lock(sink_->mu);
    return sink_->error ? sink_->seq : 0;
  }
  std::string census(uint64_t seq) const { return agreement_->census(seq); }
  void stop(bool abandon) { agreement_->stop(abandon); }

 private:
  struct Sink {
    std::mutex mu;
    std::exception_ptr error;
    uint64_t seq = 0;
  };
  comm::Ledger ledger_;
  std::shared_ptr<Sink> sink_;
  std::shared_ptr<comm::Agreement> agreement_;
};

}  // namespace

void bind_agreement(py::module_& m) {
  py::class_<AgreementProbe>(m, "_AgreementProbe",
                             "Test hook: the agreement check of NCCL groups over a CPU group "
                             "(`channel`, a CpuBackend used by nothing else).")
      .def(py::init([](std::shared_ptr<comm::Backend> channel, bool strict, double timeout_s) {
             return std::make_unique<AgreementProbe>(std::move(channel), strict,
                                                     seconds_arg(timeout_s, "timeout"));
           }),
           py::arg("channel"), py::arg("strict"), py::arg("timeout"))
      .def("note", &AgreementProbe::note, py::arg("kind"), py::arg("count"),
           py::call_guard<py::gil_scoped_release>(),
           "Issues the next call (a float32 `kind` of `count` elements); returns its seq. "
           "Strict: raises a disagreement before returning.")
      .def("await_", [](AgreementProbe& p, uint64_t seq, double timeout_s) {
             Millis t = seconds_arg(timeout_s, "timeout");
             py::gil_scoped_release nogil;
             p.await(seq, t);
           }, py::arg("seq"), py::arg("timeout"),
           "Blocks until every rank issued call `seq` and it agreed (as a symmetric call does).")
      .def("raise_failure", &AgreementProbe::raise_failure,
           "Raises what the check's sink received (what the NCCL group would raise), if any.")
      .def("failed_seq", &AgreementProbe::failed_seq,
           "The first call the failure voids (0: none, or none in particular).")
      .def("census", &AgreementProbe::census, py::arg("seq"))
      .def("stop", &AgreementProbe::stop, py::arg("abandon") = false,
           py::call_guard<py::gil_scoped_release>());
}

}  // namespace meshcoll::python
