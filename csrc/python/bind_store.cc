#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cmath>

#include "python/fastcall.h"
#include "store/exchange.h"
#include "store/file_store.h"
#include "store/tcp_store.h"
#include "transport/tcp/tcp_transport.h"

namespace py = pybind11;

namespace meshcoll::python {

namespace {
store::Bytes to_bytes(const py::object& v) {
  std::string s = py::isinstance<py::str>(v) ? v.cast<std::string>()
                                             : std::string(v.cast<py::bytes>());
  return store::Bytes(s.begin(), s.end());
}
py::bytes from_bytes(const store::Bytes& b) {
  return py::bytes(reinterpret_cast<const char*>(b.data()), b.size());
}
Millis to_ms(const py::object& seconds, Millis dflt) {
  if (seconds.is_none()) return dflt;
  return seconds_arg(seconds_of(seconds, "timeout"), "timeout", true);  // 0: do not wait
}
}  // namespace

void bind_store(py::module_& m) {
  using store::Store;
  py::class_<Store, std::shared_ptr<Store>>(m, "Store",
                                            "Key-value store for rendezvous. Values are bytes.")
      .def("set", [](Store& s, const std::string& k, const py::object& v,
                     const py::object& timeout) {
             auto b = to_bytes(v);
             Millis t = to_ms(timeout, s.timeout());
             py::gil_scoped_release nogil;
             s.set(k, b, t);
           }, py::arg("key"), py::arg("value"), py::arg("timeout") = py::none(),
           "Sets key; TimeoutError if the store does not answer within timeout seconds "
           "(default: the store's).")
      .def("get", [](Store& s, const std::string& k, const py::object& timeout) {
             Millis t = to_ms(timeout, s.timeout());
             store::Bytes b;
             {
               py::gil_scoped_release nogil;
               b = s.get(k, t);
             }
             return from_bytes(b);
           }, py::arg("key"), py::arg("timeout") = py::none(),
           "Value of key, waiting until it is set (TimeoutError after timeout seconds).")
      .def("add", [](Store& s, const std::string& k, int64_t d) {
             py::gil_scoped_release nogil;
             return s.add(k, d);
           }, py::arg("key"), py::arg("delta"))
      .def("compare_set", [](Store& s, const std::string& k, const py::object& e, const py::object& d) {
             auto eb = to_bytes(e), db = to_bytes(d);
             store::Bytes out;
             {
               py::gil_scoped_release nogil;
               out = s.compare_set(k, eb, db);
             }
             return from_bytes(out);
           }, py::arg("key"), py::arg("expected"), py::arg("desired"))
      .def("wait", [](Store& s, const std::vector<std::string>& keys, const py::object& timeout) {
             Millis t = to_ms(timeout, s.timeout());
             py::gil_scoped_release nogil;
             s.wait(keys, t);
           }, py::arg("keys"), py::arg("timeout") = py::none())
      .def("check", [](Store& s, const std::vector<std::string>& keys,
                       const py::object& timeout) {
             Millis t = to_ms(timeout, s.timeout());
             py::gil_scoped_release nogil;
             return s.check(keys, t);
           }, py::arg("keys"), py::arg("timeout") = py::none(),
           "Whether every key is set, without waiting for them; TimeoutError if the store "
           "does not answer within timeout seconds (default: the store's).")
      .def("delete_key", [](Store& s, const std::string& k) {
             py::gil_scoped_release nogil;
             return s.delete_key(k);
           }, py::arg("key"))
      .def("num_keys", [](Store& s) {
             py::gil_scoped_release nogil;
             return s.num_keys();
           })
      .def_property_readonly("timeout", [](const Store& s) { return s.timeout().count() / 1000.0; });

  py::class_<store::TcpStore, Store, std::shared_ptr<store::TcpStore>>(
      m, "TCPStore", "TCP key-value store; is_server=True also hosts the server (port 0 picks one).")
      .def(py::init([](const std::string& host, int port, bool is_server, const py::object& timeout,
                       const py::object& token, uint32_t generation) {
             std::string tok = token.is_none() ? std::string() : token.cast<std::string>();
             Millis t = to_ms(timeout, kDefaultTimeout);
             py::gil_scoped_release nogil;
             return std::make_shared<store::TcpStore>(host, port, is_server, t, tok, generation);
           }),
           py::arg("host"), py::arg("port"), py::kw_only(), py::arg("is_server") = false,
           py::arg("timeout") = py::none(), py::arg("token") = py::none(),
           py::arg("generation") = 0,
           "generation: this process's meshcoll.init count, from 0 (Note [Generations]).")
      .def("close", [](store::TcpStore& s, const py::object& timeout) {
             Millis t = to_ms(timeout, s.timeout());
             py::gil_scoped_release nogil;
             return s.close(t);
           }, py::arg("timeout") = py::none(),
           "Says goodbye (Note [Store teardown]): closes this client's connection; a store "
           "that hosts the server first waits until every other client has closed its own "
           "(at most timeout seconds, default the store's), then stops serving. False if "
           "clients were still connected when the timeout passed.")
      .def_property_readonly("port", &store::TcpStore::port)
      .def_property_readonly("host", &store::TcpStore::host)
      .def_property_readonly("local_host", &store::TcpStore::local_host);

  py::class_<store::FileStore, Store, std::shared_ptr<store::FileStore>>(
      m, "FileStore",
      "Key-value store in one file that every process opens (local disk or a shared filesystem "
      "with POSIX locks, e.g. NFS with lockd). The last user to close it deletes the file; a "
      "file left by a crashed job is reused as is, so use a fresh path per job.")
      .def(py::init([](const py::object& path, const py::object& timeout) {
             std::string p = py::module_::import("os").attr("fspath")(path).cast<std::string>();
             Millis t = to_ms(timeout, kDefaultTimeout);
             py::gil_scoped_release nogil;
             return std::make_shared<store::FileStore>(std::move(p), t);
           }),
           py::arg("path"), py::arg("timeout") = kDefaultTimeout.count() / 1000.0)
      .def_property_readonly("path", &store::FileStore::path);

  py::class_<store::PrefixStore, Store, std::shared_ptr<store::PrefixStore>>(
      m, "PrefixStore", "Namespaces another store: every key gets 'prefix/'.")
      .def(py::init<std::string, std::shared_ptr<Store>>(), py::arg("prefix"), py::arg("store"))
      .def_property_readonly("prefix", &store::PrefixStore::prefix);

  m.def("agree_on_settings",
        [](Store& s, int rank, int size, const store::Settings& settings, double timeout,
           std::vector<int> ranks) {
          Deadline d(seconds_arg(timeout, "timeout"));
          py::gil_scoped_release nogil;
          store::agree_on_settings(s, rank, size, settings, d, nullptr,
                                   RankNames(std::move(ranks)));
        },
        py::arg("store"), py::arg("rank"), py::arg("size"), py::arg("settings"),
        py::arg("timeout"), py::arg("ranks"),
        "Note [Shared settings] (csrc/store/exchange.h): every rank of a group passes the "
        "(name, value) pairs its members must share; MismatchError on every rank naming each "
        "that differs, TimeoutError naming the ranks that never came. For groups whose "
        "backend does not compare them itself (NCCL).");
  m.def("withdraw_from_setup",
        [](Store& s, int rank, const std::string& why, double timeout) {
          Deadline d(seconds_arg(timeout, "timeout"));
          py::gil_scoped_release nogil;
          transport::TcpTransport::withdraw(s, rank, why, d);
        },
        py::arg("store"), py::arg("rank"), py::arg("why"), py::arg("timeout"),
        "Note [Withdrawn ranks] (csrc/transport/tcp/tcp_transport.h): tells the members of a "
        "CPU group being set up in `store` (its prefix) that group rank `rank` will not come, "
        "and why; they raise MismatchError(why) at once.");
}

}  // namespace meshcoll::python
