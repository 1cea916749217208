// Bindings for csrc/common/config.h (Note [Configuration]) and for the host timers one of its
// settings turns on (common/host_timers.h). The module's init calls
// config_at_import before registering anything: it asks python/meshcoll/_settings.py (the one
// place that knows variable names) for the settings and installs them. A bad value fails the
// import of _C with an ImportError carrying _settings's message (pybind11 would otherwise say only
// "initialization failed"); nothing was registered yet, so a later import tries again.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>

#include "common/config.h"
#include "common/error.h"
#include "common/host_timers.h"

namespace py = pybind11;

namespace meshcoll::python {

namespace {

// From any object with the fields: _settings.CoreConfig or _C.Config.
Config from_python(py::handle c) {
  Config out;
  out.host_id = c.attr("host_id").cast<std::string>();
  out.cma = c.attr("cma").cast<bool>();
  out.shm_all_reduce = c.attr("shm_all_reduce").cast<std::string>();
  out.shm_single_copy_bytes = c.attr("shm_single_copy_bytes").cast<size_t>();
  out.shm_spin_us = c.attr("shm_spin_us").cast<long>();
  out.simd = c.attr("simd").cast<std::string>();
  out.nccl_trace = c.attr("nccl_trace").cast<bool>();
  out.nccl_library = c.attr("nccl_library").cast<std::string>();
  out.nccl_split = c.attr("nccl_split").cast<bool>();
  out.nccl_direct_bytes = c.attr("nccl_direct_bytes").cast<size_t>();
  out.abort_on_error = c.attr("abort_on_error").cast<bool>();
  out.host_timers = c.attr("host_timers").cast<bool>();
  out.fault = c.attr("fault").cast<std::string>();
  return out;
}

}  // namespace

void apply_env_config() {
  set_config(from_python(py::module_::import("meshcoll._settings").attr("core_config_from_env")()));
}

void config_at_import() {
  try {
    apply_env_config();
  } catch (py::error_already_set& e) {
    if (!e.matches(PyExc_ValueError)) throw;
    throw std::runtime_error(py::str(e.value()).cast<std::string>());  // becomes ImportError
  }
}

void bind_config(py::module_& m) {
  py::class_<Config>(m, "Config",
                     "The core's process-wide settings (Note [Configuration]); a new one holds "
                     "the defaults, those of an unset environment.")
      .def(py::init<>())
      .def_readwrite("host_id", &Config::host_id)
      .def_readwrite("cma", &Config::cma)
      .def_readwrite("shm_all_reduce", &Config::shm_all_reduce)
      .def_readwrite("shm_single_copy_bytes", &Config::shm_single_copy_bytes)
      .def_readwrite("shm_spin_us", &Config::shm_spin_us)
      .def_readwrite("simd", &Config::simd)
      .def_readwrite("nccl_trace", &Config::nccl_trace)
      .def_readwrite("nccl_library", &Config::nccl_library)
      .def_readwrite("nccl_split", &Config::nccl_split)
      .def_readwrite("nccl_direct_bytes", &Config::nccl_direct_bytes)
      .def_readwrite("abort_on_error", &Config::abort_on_error)
      .def_readwrite("host_timers", &Config::host_timers)
      .def_readwrite("fault", &Config::fault)
      .def("__repr__", [](const Config& c) {
        auto b = [](bool v) { return v ? "True" : "False"; };
        return str_cat("Config(host_id='", c.host_id, "', cma=", b(c.cma), ", shm_all_reduce='",
                       c.shm_all_reduce, "', shm_single_copy_bytes=", c.shm_single_copy_bytes,
                       ", shm_spin_us=", c.shm_spin_us, ", simd='", c.simd,
                       "', nccl_trace=", b(c.nccl_trace), ", nccl_library='", c.nccl_library,
                       "', nccl_split=", b(c.nccl_split), ", nccl_direct_bytes=",
                       c.nccl_direct_bytes, ", abort_on_error=",
                       b(c.abort_on_error), ", host_timers=", b(c.host_timers), ", fault='",
                       c.fault, "')");
      });
  m.def("config", &config, "A copy of the settings in force.");
  m.def("set_config", [](py::handle c) { set_config(from_python(c)); }, py::arg("config"),
        "Installs the settings of `config` (a Config or meshcoll._settings.CoreConfig); ValueError "
        "for a simd other than '', baseline, avx2 or avx512.");
  m.def(
      "host_timers",
      [](bool reset) {
        std::vector<std::tuple<std::string, uint64_t, double>> rows;
        for (const auto& r : host_timers::take(reset)) rows.emplace_back(r.step, r.calls, r.mean_us);
        return rows;
      },
      py::arg("reset") = true,
      "Note [Host timers] (MESHCOLL_HOST_TIMERS=1): [(step, calls, mean us)] of this process's "
      "synchronous fast-path calls since the last reset, each step the span that ends there; "
      "empty when the timers are off.");
  m.def("reload_config", &apply_env_config,
        "Reads the MESHCOLL_* variables of the core again (they are read once, when _C is "
        "imported); ValueError naming a variable with a bad value.");
}

}  // namespace meshcoll::python
