// The NCCL backend's Python boundary: device arrays (DLPack / __cuda_array_interface__ /
// PyTorch CUDA tensors), the NCCL communicator with the CPU Comm's method signatures, and
// its Work handles. Nothing here imports a framework.
//
// Note [Device arrays at the boundary]
// Arrays are described in C++ (no ctypes): an object with __dlpack__ is read through its
// DLPack capsule after the stream handshake x.__dlpack__(stream=S), where S is the op's
// stream; the capsule is not consumed (its destructor frees the DLManagedTensor, the data
// stays owned by x). Objects with only __cuda_array_interface__ are read from the dict;
// a "stream" entry there is the array's stream, used as S unless stream= was given (then S
// is ordered after it). PyTorch CUDA tensors take a fast path (data_ptr, dtype, shape,
// is_contiguous, get_device: about 1 us instead of 3-6 us for torch's Python-level
// __dlpack__), and S defaults to torch's current stream, which is what the handshake would
// have ordered S after. The GIL is held throughout: enqueueing is non-blocking and tiny.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cmath>
#include <cstring>
#include <unordered_map>

#include "common/error.h"
#include "nccl/nccl_api.h"
#include "nccl/nccl_comm.h"
#include "python/fastcall.h"

namespace py = pybind11;

namespace meshcoll::python {

namespace {
using nccl::NcclComm;
using nccl::NcclWork;
namespace abi = nccl::abi;

// ---- DLPack ABI (dlpack.h v0.8 / v1.0 / v1.1; plain C structs) ---------------------------
struct DLDevice {
  int32_t device_type;
  int32_t device_id;
};
struct DLDataType {
  uint8_t code;
  uint8_t bits;
  uint16_t lanes;
};
struct DLTensor {
  void* data;
  DLDevice device;
  int32_t ndim;
  DLDataType dtype;
  int64_t* shape;
  int64_t* strides;
  uint64_t byte_offset;
};
struct DLManagedTensor {
  DLTensor dl_tensor;
  void* manager_ctx;
  void (*deleter)(DLManagedTensor*);
};
struct DLManagedTensorVersioned {
  uint32_t major, minor;
  void* manager_ctx;
  void (*deleter)(DLManagedTensorVersioned*);
  uint64_t flags;
  DLTensor dl_tensor;
};
constexpr int32_t kDLCPU = 1, kDLCUDA = 2, kDLCUDAHost = 3, kDLCUDAManaged = 13;
constexpr uint8_t kDLInt = 0, kDLUInt = 1, kDLFloat = 2, kDLBfloat = 4, kDLBool = 6;
constexpr uint8_t kDLFloat8_e4m3fn = 10, kDLFloat8_e5m2 = 12;  // DLPack 1.1 (torch >= 2.7)
constexpr uint64_t kDLReadOnly = 1;

// Stream handles as the array protocols spell them: 1 legacy default, 2 per-thread default.
constexpr uintptr_t kLegacy = 1, kPerThread = 2;

struct DeviceArray {
  py::object obj;        // the caller's array: keeps the memory alive; _empty reads it
  uintptr_t ptr = 0;
  size_t count = 0;
  DType dtype = DType::kFloat32;
  py::tuple shape;
  int device = -1;       // -1: not known (__cuda_array_interface__ does not say)
  uintptr_t stream = kLegacy;     // the op's stream (protocol spelling)
  uintptr_t order_after = 0;      // a stream S must wait for first (0: none)
  bool readonly = false;
  bool async_op = false;
};

abi::CUstream to_cu(uintptr_t s) {
  if (s == kLegacy || s == 0) return nullptr;  // driver and NCCL: 0 is the legacy stream
  return reinterpret_cast<abi::CUstream>(s);   // CU_STREAM_PER_THREAD is 0x2, as in DLPack
}

// stream=: None, an int handle, or an object with .cuda_stream (torch) or .ptr (CuPy).
// Returns false for None. 0 (torch's and CuPy's spelling of the default stream) -> legacy.
bool stream_arg(const py::handle& s, uintptr_t* out) {
  if (s.is_none()) return false;
  py::object v;
  if (PyLong_Check(s.ptr())) v = py::reinterpret_borrow<py::object>(s);
  else if (py::hasattr(s, "cuda_stream")) v = s.attr("cuda_stream");
  else if (py::hasattr(s, "ptr")) v = s.attr("ptr");
  else
    throw py::type_error("stream must be an int handle or an object with .cuda_stream (torch) "
                         "or .ptr (CuPy)");
  uintptr_t h = v.cast<uintptr_t>();
  *out = h == 0 ? kLegacy : h;
  return true;
}

DType dtype_from_dl(DLDataType t, const char* what) {
  if (t.lanes == 1) {
    if (t.code == kDLInt && t.bits == 8) return DType::kInt8;
    if (t.code == kDLInt && t.bits == 32) return DType::kInt32;
    if (t.code == kDLInt && t.bits == 64) return DType::kInt64;
    if (t.code == kDLUInt && t.bits == 8) return DType::kUint8;
    if (t.code == kDLFloat && t.bits == 16) return DType::kFloat16;
    if (t.code == kDLFloat && t.bits == 32) return DType::kFloat32;
    if (t.code == kDLFloat && t.bits == 64) return DType::kFloat64;
    if (t.code == kDLBfloat && t.bits == 16) return DType::kBFloat16;
    if (t.code == kDLBool && t.bits == 8) return DType::kBool;
    if (t.code == kDLFloat8_e4m3fn && t.bits == 8) return DType::kFloat8E4M3;
    if (t.code == kDLFloat8_e5m2 && t.bits == 8) return DType::kFloat8E5M2;
  }
  throw TypeMismatch(str_cat(what, ": DLPack dtype (code ", int(t.code), ", bits ", int(t.bits),
                             ", lanes ", t.lanes, ") is not supported; use int8, uint8, int32, "
                             "int64, float16, bfloat16, float32, float64, bool, float8_e4m3fn "
                             "or float8_e5m2"));
}

DType dtype_from_typestr(const std::string& ts, const char* what) {
  if (ts.size() >= 3 && ts[0] != '>') {
    const char kind = ts[1];
    const std::string n = ts.substr(2);
    if (kind == 'i' && n == "1") return DType::kInt8;
    if (kind == 'i' && n == "4") return DType::kInt32;
    if (kind == 'i' && n == "8") return DType::kInt64;
    if (kind == 'u' && n == "1") return DType::kUint8;
    if (kind == 'f' && n == "2") return DType::kFloat16;
    if (kind == 'f' && n == "4") return DType::kFloat32;
    if (kind == 'f' && n == "8") return DType::kFloat64;
    if (kind == 'b' && n == "1") return DType::kBool;
  }
  throw TypeMismatch(str_cat(what, ": __cuda_array_interface__ typestr '", ts, "' is not "
                             "supported; use int8, uint8, int32, int64, float16, float32, "
                             "float64 or bool (bfloat16 and float8 through DLPack: the "
                             "interface has no typestr for them)"));
}

void check_compact(const std::vector<int64_t>& shape, const int64_t* strides, size_t unit,
                   const char* what) {
  // strides in `unit`s (elements for DLPack, bytes for the array interface)
  if (!strides) return;
  int64_t expect = static_cast<int64_t>(unit);
  for (size_t i = shape.size(); i-- > 0;) {
    if (shape[i] != 1 && strides[i] != expect)
      throw InvalidArgument(str_cat(what, ": the array is not C-contiguous; pass a contiguous "
                                    "copy (x.contiguous() / cupy.ascontiguousarray(x))"));
    expect *= shape[i];
  }
}

py::tuple to_tuple(const std::vector<int64_t>& shape) {
  py::tuple t(shape.size());
  for (size_t i = 0; i < shape.size(); ++i) t[i] = py::int_(shape[i]);
  return t;
}

size_t product(const std::vector<int64_t>& shape, const char* what) {
  size_t n = 1;
  for (int64_t d : shape) {
    if (d < 0) throw InvalidArgument(str_cat(what, ": negative dimension in the array's shape"));
    n *= static_cast<size_t>(d);
  }
  return n;
}

// Per-process caches of what a type is and of torch's dtype objects. Types and dtypes are
// immortal in practice; we hold references so an address is never reused under us.
enum class Kind { kUnknown, kTorch, kDLPack, kCAI, kHost };
struct Caches {
  std::unordered_map<PyTypeObject*, std::pair<py::object, Kind>> kinds;
  std::unordered_map<PyObject*, std::pair<py::object, DType>> torch_dtypes;
  py::object torch_current_stream;  // torch._C._cuda_getCurrentRawStream, or None
  bool torch_looked_up = false;
};
Caches& caches() {
  static Caches* c = new Caches();  // never destroyed: holds Python objects past finalization
  return *c;
}

Kind kind_of(const py::handle& x) {
  auto& c = caches();
  PyTypeObject* t = Py_TYPE(x.ptr());
  auto it = c.kinds.find(t);
  if (it != c.kinds.end()) return it->second.second;
  Kind k = Kind::kUnknown;
  std::string mod = py::str(py::handle(reinterpret_cast<PyObject*>(t)).attr("__module__"));
  if (mod.rfind("numpy", 0) == 0) k = Kind::kHost;
  else if (mod.rfind("torch", 0) == 0 && py::hasattr(x, "data_ptr") && py::hasattr(x, "get_device"))
    k = Kind::kTorch;
  else if (py::hasattr(x, "__dlpack__")) k = Kind::kDLPack;
  else if (py::hasattr(x, "__cuda_array_interface__")) k = Kind::kCAI;
  c.kinds.emplace(t, std::make_pair(py::reinterpret_borrow<py::object>(
                                        reinterpret_cast<PyObject*>(t)), k));
  return k;
}

DType torch_dtype(const py::handle& dt, const char* what) {
  auto& c = caches();
  auto it = c.torch_dtypes.find(dt.ptr());
  if (it != c.torch_dtypes.end()) return it->second.second;
  static const std::pair<const char*, DType> names[] = {
      {"torch.int8", DType::kInt8},       {"torch.uint8", DType::kUint8},
      {"torch.int32", DType::kInt32},     {"torch.int64", DType::kInt64},
      {"torch.float16", DType::kFloat16}, {"torch.bfloat16", DType::kBFloat16},
      {"torch.float32", DType::kFloat32}, {"torch.float64", DType::kFloat64},
      {"torch.bool", DType::kBool},       {"torch.float8_e4m3fn", DType::kFloat8E4M3},
      {"torch.float8_e5m2", DType::kFloat8E5M2}};
  std::string s = py::str(dt);
  for (const auto& [n, d] : names)
    if (s == n) {
      c.torch_dtypes.emplace(dt.ptr(), std::make_pair(py::reinterpret_borrow<py::object>(dt), d));
      return d;
    }
  throw TypeMismatch(str_cat(what, ": dtype ", s, " is not supported by the NCCL backend; use "
                             "int8, uint8, int32, int64, float16, bfloat16, float32, float64, "
                             "bool, float8_e4m3fn or float8_e5m2"));
}

uintptr_t torch_stream(int device) {
  auto& c = caches();
  if (!c.torch_looked_up) {
    c.torch_looked_up = true;
    c.torch_current_stream = py::none();
    py::object mods = py::module_::import("sys").attr("modules");
    if (mods.contains("torch")) {
      py::object tc = mods["torch"].attr("_C");
      if (py::hasattr(tc, "_cuda_getCurrentRawStream"))
        c.torch_current_stream = tc.attr("_cuda_getCurrentRawStream");
    }
  }
  if (c.torch_current_stream.is_none()) return kLegacy;
  py::object dev = py::reinterpret_steal<py::object>(PyLong_FromLong(device));
  if (!dev) throw py::error_already_set();
  auto r = py::reinterpret_steal<py::object>(
      PyObject_CallOneArg(c.torch_current_stream.ptr(), dev.ptr()));
  if (!r) throw py::error_already_set();
  uintptr_t s = r.cast<uintptr_t>();
  return s == 0 ? kLegacy : s;
}

// x.<name>(): interned name, no bound method object (a torch tensor is read on every call).
py::object call_method(const py::handle& x, const char* name) {
  static std::unordered_map<const char*, PyObject*>* names = new std::unordered_map<const char*, PyObject*>();
  PyObject*& n = (*names)[name];
  if (!n && !(n = PyUnicode_InternFromString(name))) throw py::error_already_set();
  auto r = py::reinterpret_steal<py::object>(PyObject_CallMethodNoArgs(x.ptr(), n));
  if (!r) throw py::error_already_set();
  return r;
}

void from_torch(DeviceArray& a, const py::handle& x, bool has_stream, uintptr_t stream,
                const char* what) {
  a.device = call_method(x, "get_device").cast<int>();
  if (a.device < 0)
    throw py::type_error(str_cat(what, ": a CPU tensor: the NCCL backend takes CUDA tensors "
                                       "(or use meshcoll.init(backend='cpu'))"));
  if (!call_method(x, "is_contiguous").cast<bool>())
    throw InvalidArgument(str_cat(what, ": the tensor is not contiguous; pass x.contiguous() "
                                        "(and copy the result back)"));
  a.dtype = torch_dtype(x.attr("dtype"), what);
  py::object size = x.attr("shape");  // torch.Size, a tuple of ints
  if (!PyTuple_Check(size.ptr())) throw py::type_error(str_cat(what, ": tensor.shape is not a tuple"));
  a.shape = py::reinterpret_borrow<py::tuple>(size);
  a.count = 1;
  for (const py::handle d : a.shape) a.count *= d.cast<size_t>();  // torch sizes are >= 0
  a.ptr = call_method(x, "data_ptr").cast<uintptr_t>();
  a.stream = has_stream ? stream : torch_stream(a.device);
}

void from_dlpack(DeviceArray& a, const py::handle& x, bool has_stream, uintptr_t stream,
                 const char* what) {
  if (py::hasattr(x, "__dlpack_device__")) {
    py::tuple dev = x.attr("__dlpack_device__")();
    int type = dev[0].cast<int>();
    if (type == kDLCPU || type == kDLCUDAHost)
      throw py::type_error(str_cat(what, ": the array is in host memory (DLPack device type ",
                                   type, "); the NCCL backend takes CUDA arrays"));
  }
  // Handshake: the producer orders its pending work before S.
  a.stream = has_stream ? stream : kLegacy;
  py::object cap = x.attr("__dlpack__")(py::arg("stream") = py::int_(a.stream));
  const char* name = PyCapsule_GetName(cap.ptr());
  const DLTensor* t = nullptr;
  if (name && std::strcmp(name, "dltensor") == 0) {
    t = &static_cast<DLManagedTensor*>(PyCapsule_GetPointer(cap.ptr(), name))->dl_tensor;
  } else if (name && std::strcmp(name, "dltensor_versioned") == 0) {
    auto* m = static_cast<DLManagedTensorVersioned*>(PyCapsule_GetPointer(cap.ptr(), name));
    if (m->major != 1)
      throw py::type_error(str_cat(what, ": DLPack major version ", m->major, " is not supported"));
    a.readonly = (m->flags & kDLReadOnly) != 0;
    t = &m->dl_tensor;
  } else {
    throw py::type_error(str_cat(what, ": __dlpack__ returned an unexpected capsule (",
                                 name ? name : "unnamed", ")"));
  }
  if (!t) throw py::error_already_set();
  if (t->device.device_type != kDLCUDA && t->device.device_type != kDLCUDAManaged)
    throw py::type_error(str_cat(what, ": DLPack device type ", t->device.device_type,
                                 " is not CUDA memory; the NCCL backend takes CUDA arrays"));
  a.device = t->device.device_id;
  a.dtype = dtype_from_dl(t->dtype, what);
  std::vector<int64_t> dims(t->shape, t->shape + t->ndim);
  check_compact(dims, t->strides, 1, what);
  a.count = product(dims, what);
  a.shape = to_tuple(dims);
  a.ptr = reinterpret_cast<uintptr_t>(t->data) + t->byte_offset;
}

void from_cai(DeviceArray& a, const py::handle& x, bool has_stream, uintptr_t stream,
              const char* what) {
  py::dict d = x.attr("__cuda_array_interface__");
  py::tuple data = d["data"];
  a.ptr = data[0].is_none() ? 0 : data[0].cast<uintptr_t>();
  a.readonly = data[1].cast<bool>();
  a.dtype = dtype_from_typestr(d["typestr"].cast<std::string>(), what);
  py::tuple shape = d["shape"];
  std::vector<int64_t> dims(shape.size());
  for (size_t i = 0; i < dims.size(); ++i) dims[i] = shape[i].cast<int64_t>();
  if (d.contains("strides") && !d["strides"].is_none()) {
    py::tuple st = d["strides"];
    std::vector<int64_t> strides(st.size());
    for (size_t i = 0; i < strides.size(); ++i) strides[i] = st[i].cast<int64_t>();
    check_compact(dims, strides.data(), dtype_size(a.dtype), what);
  }
  a.count = product(dims, what);
  a.shape = to_tuple(dims);
  uintptr_t own = 0;
  if (d.contains("stream") && !d["stream"].is_none()) own = d["stream"].cast<uintptr_t>();
  if (has_stream) {
    a.stream = stream;
    if (own && own != stream) a.order_after = own;
  } else {
    a.stream = own ? own : kLegacy;
  }
}

DeviceArray make_array(const py::handle& x, const char* what, bool writable,
                       const py::handle& stream, bool async_op) {
  uintptr_t s = kLegacy;
  const bool has_stream = stream_arg(stream, &s);
  DeviceArray a;
  a.obj = py::reinterpret_borrow<py::object>(x);
  a.async_op = async_op;
  switch (kind_of(x)) {
    case Kind::kTorch: from_torch(a, x, has_stream, s, what); break;
    case Kind::kDLPack: from_dlpack(a, x, has_stream, s, what); break;
    case Kind::kCAI: from_cai(a, x, has_stream, s, what); break;
    case Kind::kHost:
      throw py::type_error(str_cat(what, ": a numpy array is host memory; the NCCL backend takes "
                                   "CUDA arrays (PyTorch, CuPy, JAX, or any __dlpack__ / "
                                   "__cuda_array_interface__ object)"));
    case Kind::kUnknown:
      throw py::type_error(str_cat(what, ": expected a CUDA array (with __dlpack__ or "
                                   "__cuda_array_interface__), got ",
                                   std::string(py::str(py::type::handle_of(x).attr("__name__")))));
  }
  if (a.count && !a.ptr) throw InvalidArgument(str_cat(what, ": the array has a null data pointer"));
  if (writable && a.readonly)
    throw InvalidArgument(str_cat(what, ": the array is read-only but the result is written into it"));
  return a;
}

// An adapter argument: a DeviceArray made by ProcessGroup._as_array, or a raw array (the
// output ProcessGroup._empty allocated), converted on the op's stream.
DeviceArray arg(const py::handle& x, const char* what, bool writable, const DeviceArray* first) {
  if (py::isinstance<DeviceArray>(x)) {
    DeviceArray a = x.cast<DeviceArray>();
    if (writable && a.readonly)
      throw InvalidArgument(str_cat(what, ": the array is read-only but the result is written into it"));
    return a;
  }
  if (first) return make_array(x, what, writable, py::int_(first->stream), first->async_op);
  return make_array(x, what, writable, py::none(), false);
}

RedOp redop_arg(const std::string& name, const char* what) {
  RedOp op;
  if (!redop_from_name(name, &op))
    throw py::value_error(str_cat(what, ": unknown reduction op '", name,
                                  "'; the NCCL backend has sum, prod, min, max and avg"));
  return op;
}

void* vptr(const DeviceArray& a) { return reinterpret_cast<void*>(a.ptr); }

// Checks shared by every op, then the call options: the op runs on `a`'s stream.
nccl::CallOpts call(NcclComm& c, const DeviceArray& a, const py::handle& timeout,
                    const char* what) {
  if (a.device >= 0 && a.device != c.device())
    throw InvalidArgument(str_cat(what, ": the array is on CUDA device ", a.device,
                                  " but this group's communicator uses device ", c.device()));
  nccl::CallOpts o;
  o.stream = to_cu(a.stream);
  o.async = a.async_op;
  o.timeout = timeout_arg(timeout);
  if (a.order_after) c.order_streams(to_cu(a.order_after), o.stream);
  return o;
}

void same_dtype(const DeviceArray& a, const DeviceArray& b, const char* what) {
  if (a.dtype != b.dtype)
    throw py::type_error(str_cat(what, ": out has dtype ", dtype_name(b.dtype), " but x has ",
                                 dtype_name(a.dtype)));
}

void check_root(const NcclComm& c, int root, const char* what) {
  if (root < 0 || root >= c.size())
    throw py::value_error(str_cat(what, ": root ", root, " is out of range for a group of ",
                                  c.size(), " ranks (0..", c.size() - 1, ")"));
}

size_t total(const std::vector<size_t>& v) {
  size_t n = 0;
  for (size_t x : v) n += x;
  return n;
}

void check_counts(const NcclComm& c, const std::vector<size_t>& counts, const char* what) {
  if (counts.size() != static_cast<size_t>(c.size()))
    throw py::value_error(str_cat(what, ": ", counts.size(), " counts for a group of ", c.size()));
}

void check_peer(const NcclComm& c, int peer, uint32_t tag, const char* what) {
  if (peer < 0 || peer >= c.size() || peer == c.rank())
    throw py::value_error(str_cat(what, ": peer ", peer, " must be another rank of the group "
                                  "(0..", c.size() - 1, ", not ", c.rank(), ")"));
  if (tag != 0)
    throw py::value_error(str_cat(what, ": tag ", tag, ": NCCL matches point-to-point messages "
                                  "between two ranks in posting order and has no tags; pass "
                                  "tag=0 and post sends and receives in the same order"));
}

std::shared_ptr<NcclWork> enqueue_all_reduce(NcclComm& c, const py::handle& x, const py::handle& out,
                                             const std::string& op, const py::handle& timeout,
                                             const py::handle& stream, const py::handle& async_op) {
  const char* what = "all_reduce";
  DeviceArray a = py::isinstance<DeviceArray>(x)
                      ? x.cast<DeviceArray>()
                      : make_array(x, what, true, stream, !async_op.is_none() && async_op.cast<bool>());
  DeviceArray o = out.is(x) ? a : arg(out, what, true, &a);
  if (a.readonly && out.is(x)) throw InvalidArgument("all_reduce: the array is read-only");
  same_dtype(a, o, what);
  if (a.count != o.count) throw py::value_error("all_reduce: out must have x's size");
  auto opts = call(c, a, timeout, what);
  return c.all_reduce(opts, vptr(a), vptr(o), a.count, a.dtype, redop_arg(op, what));
}

// NcclProcessGroup.all_reduce's synchronous path, (x, op, timeout, stream): enqueue on the
// caller's stream and return None, no Work (Note [FASTCALL methods]).
PyObject* all_reduce_sync(PyObject* self, PyObject* const* args, Py_ssize_t nargs) {
  return fastcall([&]() -> PyObject* {
    if (nargs != 4)
      throw py::type_error(str_cat("all_reduce_sync takes 4 positional arguments (x, op, "
                                   "timeout, stream), got ", nargs));
    NcclComm& c = py::cast<NcclComm&>(py::handle(self));
    py::handle x(args[0]);
    enqueue_all_reduce(c, x, x, str_arg(args[1], "all_reduce", "op"), py::handle(args[2]),
                       py::handle(args[3]), py::handle(Py_False));
    Py_RETURN_NONE;
  });
}

}  // namespace

void bind_nccl(py::module_& m) {
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
  m.def("nccl_split_supported", &NcclComm::split_supported);
  m.def("cuda_device_count", &nccl::cuda_device_count);

  py::class_<DeviceArray>(m, "DeviceArray",
                          "A CUDA array as the NCCL backend sees it: pointer, dtype, shape, "
                          "device, and the stream its op runs on.")
      .def_property_readonly("obj", [](const DeviceArray& a) { return a.obj; })
      .def_property_readonly("ptr", [](const DeviceArray& a) { return a.ptr; })
      .def_property_readonly("size", [](const DeviceArray& a) { return a.count; })
      .def_property_readonly("shape", [](const DeviceArray& a) { return a.shape; })
      .def_property_readonly("ndim", [](const DeviceArray& a) { return a.shape.size(); })
      .def_property_readonly("dtype", [](const DeviceArray& a) { return std::string(dtype_name(a.dtype)); })
      .def_property_readonly("device", [](const DeviceArray& a) { return a.device; })
      .def_property_readonly("stream", [](const DeviceArray& a) { return a.stream; })
      .def_property_readonly("async_op", [](const DeviceArray& a) { return a.async_op; })
      .def("__repr__", [](const DeviceArray& a) {
        return str_cat("DeviceArray(ptr=0x", std::hex, a.ptr, std::dec, ", dtype=",
                       dtype_name(a.dtype), ", size=", a.count, ", device=", a.device,
                       ", stream=", a.stream, ")");
      });
  m.def("nccl_array", [](const py::handle& x, const char* what, bool writable,
                         const py::handle& stream, bool async_op) {
        return make_array(x, what, writable, stream, async_op);
      }, py::arg("x"), py::arg("what"), py::arg("writable"), py::arg("stream") = py::none(),
      py::arg("async_op") = false);

  py::class_<NcclWork, std::shared_ptr<NcclWork>>(m, "NcclWork", "Handle on one NCCL op.")
      .def("wait", [](NcclWork& w, const py::handle& timeout, const py::handle& stream) {
             uintptr_t s = kLegacy;
             bool has = stream_arg(stream, &s);
             Millis t = timeout_arg(timeout);
             py::gil_scoped_release nogil;  // a barrier's wait blocks the host
             w.wait(has, to_cu(s), t);
           }, py::arg("timeout") = py::none(), py::arg("stream") = py::none(),
           "Orders `stream` (default: the caller's stream of the op) after the op; no host "
           "block, except for a barrier.")
      .def("synchronize", [](NcclWork& w, const py::handle& timeout) {
             Millis t = timeout_arg(timeout);
             py::gil_scoped_release nogil;
             w.synchronize(t);
           }, py::arg("timeout") = py::none(), "Blocks the host until the op completed.")
      .def("is_completed", &NcclWork::is_completed)
      .def_property_readonly("captured", &NcclWork::captured)
      .def("exception", [](NcclWork& w) -> py::object {
        auto e = w.exception();
        if (!e) return py::none();
        try {
          std::rethrow_exception(e);
        } catch (...) {
          py::detail::translate_exception(std::current_exception());
          py::error_already_set err;
          return err.value();
        }
      });

  py::class_<NcclComm, std::shared_ptr<NcclComm>> comm(
      m, "NcclComm", "NCCL communicator of one group; methods mirror the CPU Comm's.");
  add_fastcall_method(comm, "all_reduce_sync", &all_reduce_sync,
                      "all_reduce_sync(x, op, timeout, stream): enqueue an in-place all_reduce "
                      "of x on the caller's stream (Note [FASTCALL methods]).");
  comm
      .def(py::init([](std::shared_ptr<store::Store> store, int rank, int size, int device,
                       double timeout_s) {
             Millis t(static_cast<int64_t>(timeout_s * 1000.0));
             py::gil_scoped_release nogil;
             return NcclComm::create(std::move(store), rank, size, device, t);
           }),
           py::arg("store"), py::arg("rank"), py::arg("size"), py::arg("device"), py::arg("timeout"))
      .def_property_readonly("rank", &NcclComm::rank)
      .def_property_readonly("size", &NcclComm::size)
      .def_property_readonly("device", &NcclComm::device)
      .def("split", [](NcclComm& c, int color, int key, const py::handle& timeout) {
             Millis t = timeout_arg(timeout);
             py::gil_scoped_release nogil;
             return c.split(color, key, t);
           }, py::arg("color"), py::arg("key"), py::arg("timeout") = py::none())
      .def("shutdown", [](NcclComm& c) {
        py::gil_scoped_release nogil;
        c.shutdown();
      })
      .def("abort", [](NcclComm& c, const std::string& why) {
        py::gil_scoped_release nogil;
        c.abort(why);
      }, py::arg("why"))
      .def("host_all_gather", [](NcclComm& c, const py::bytes& data, const py::handle& timeout) {
             std::string s = data;
             Millis t = timeout_arg(timeout);
             std::vector<uint8_t> out;
             {
               py::gil_scoped_release nogil;
               out = c.host_all_gather(s.data(), s.size(), t);
             }
             return py::bytes(reinterpret_cast<const char*>(out.data()), out.size());
           }, py::arg("data"), py::arg("timeout") = py::none(),
           "Every rank's bytes (all the same length), concatenated in rank order. Blocks.")
      .def("all_reduce", [](NcclComm& c, const py::handle& x, const py::handle& out,
                            const std::string& op, const py::handle& /*algorithm*/,
                            const py::handle& timeout, const py::handle&, const py::handle&,
                            const py::handle&, const py::handle& stream, const py::handle& async_op,
                            bool /*blocking*/) {
             return enqueue_all_reduce(c, x, out, op, timeout, stream, async_op);
           }, py::arg("x"), py::arg("out"), py::arg("op"), py::arg("algorithm") = "auto",
           py::arg("timeout") = py::none(), py::arg("max_segment_bytes") = py::none(),
           py::arg("tree_threshold_bytes") = py::none(), py::arg("hd_threshold_bytes") = py::none(),
           py::arg("stream") = py::none(), py::arg("async_op") = py::none(),
           py::arg("blocking") = false,
           "The CPU Comm's signature. NCCL picks its own algorithm (NCCL_ALGO), so the "
           "algorithm and threshold arguments are not used; `blocking` (the CPU backend's hint "
           "to run inline) neither: an NCCL op is always enqueued on its stream.")
      .def("broadcast", [](NcclComm& c, const py::handle& x, int root, const py::handle& timeout,
                           bool /*blocking*/) {
             auto a = arg(x, "broadcast", true, nullptr);
             check_root(c, root, "broadcast");
             auto o = call(c, a, timeout, "broadcast");
             return c.broadcast(o, vptr(a), a.count, a.dtype, root);
           }, py::arg("x"), py::arg("root"), py::arg("timeout") = py::none(),
           py::arg("blocking") = false)
      .def("reduce", [](NcclComm& c, const py::handle& x, const py::handle& out, int root,
                        const std::string& op, const py::handle& timeout, bool /*blocking*/) {
             auto a = arg(x, "reduce", false, nullptr);
             auto o = arg(out, "reduce", true, &a);
             same_dtype(a, o, "reduce");
             check_root(c, root, "reduce");
             if (c.rank() == root && o.count != a.count)
               throw py::value_error("reduce: out must have x's size on the root");
             auto opts = call(c, a, timeout, "reduce");
             return c.reduce(opts, vptr(a), vptr(o), a.count, a.dtype, redop_arg(op, "reduce"), root);
           }, py::arg("x"), py::arg("out"), py::arg("root"), py::arg("op"), py::arg("timeout") = py::none(),
           py::arg("blocking") = false)
      .def("all_gather", [](NcclComm& c, const py::handle& x, const py::handle& out,
                            const std::vector<size_t>& counts, bool /*uneven*/, const py::handle& timeout,
                            bool /*blocking*/) {
             auto a = arg(x, "all_gather", false, nullptr);
             auto o = arg(out, "all_gather", true, &a);
             same_dtype(a, o, "all_gather");
             check_counts(c, counts, "all_gather");
             if (counts[c.rank()] != a.count || o.count < total(counts))
               throw py::value_error(str_cat("all_gather: x has ", a.count, " elements and out ",
                                             o.count, "; counts say ", counts[c.rank()], " and ",
                                             total(counts)));
             auto opts = call(c, a, timeout, "all_gather");
             return c.all_gather(opts, vptr(a), vptr(o), counts, a.dtype);
           }, py::arg("x"), py::arg("out"), py::arg("counts"), py::arg("uneven"), py::arg("timeout") = py::none(),
           py::arg("blocking") = false)
      .def("reduce_scatter", [](NcclComm& c, const py::handle& x, const py::handle& out,
                                const std::vector<size_t>& counts, const std::string& op,
                                bool /*uneven*/, const py::handle& timeout, bool /*blocking*/) {
             auto a = arg(x, "reduce_scatter", false, nullptr);
             auto o = arg(out, "reduce_scatter", true, &a);
             same_dtype(a, o, "reduce_scatter");
             check_counts(c, counts, "reduce_scatter");
             if (a.count != total(counts) || o.count != counts[c.rank()])
               throw py::value_error(str_cat("reduce_scatter: x has ", a.count, " elements and out ",
                                             o.count, "; counts say ", total(counts), " and ",
                                             counts[c.rank()]));
             auto opts = call(c, a, timeout, "reduce_scatter");
             return c.reduce_scatter(opts, vptr(a), vptr(o), counts, a.dtype,
                                     redop_arg(op, "reduce_scatter"));
           }, py::arg("x"), py::arg("out"), py::arg("counts"), py::arg("op"), py::arg("uneven"),
           py::arg("timeout") = py::none(), py::arg("blocking") = false)
      .def("all_to_all", [](NcclComm& c, const py::handle& x, const py::handle& out,
                            const std::vector<size_t>& send_counts,
                            const std::vector<size_t>& recv_counts, bool /*uneven*/,
                            const py::handle& timeout, bool /*blocking*/) {
             auto a = arg(x, "all_to_all", false, nullptr);
             auto o = arg(out, "all_to_all", true, &a);
             same_dtype(a, o, "all_to_all");
             check_counts(c, send_counts, "all_to_all");
             check_counts(c, recv_counts, "all_to_all");
             if (a.count != total(send_counts) || o.count != total(recv_counts))
               throw py::value_error("all_to_all: array sizes do not match the counts");
             if (a.count && a.ptr == o.ptr)
               throw py::value_error("all_to_all: out must be a separate array");
             auto opts = call(c, a, timeout, "all_to_all");
             return c.all_to_all(opts, vptr(a), vptr(o), send_counts, recv_counts, a.dtype);
           }, py::arg("x"), py::arg("out"), py::arg("send_counts"), py::arg("recv_counts"),
           py::arg("uneven"), py::arg("timeout") = py::none(), py::arg("blocking") = false)
      .def("gather", [](NcclComm& c, const py::handle& x, const py::handle& out,
                        const std::vector<size_t>& counts, int root, const py::handle& timeout,
                        bool /*blocking*/) {
             check_root(c, root, "gather");
             auto a = arg(x, "gather", false, nullptr);
             auto o = arg(out, "gather", true, &a);
             same_dtype(a, o, "gather");
             check_counts(c, counts, "gather");
             if (counts[c.rank()] != a.count || (c.rank() == root && o.count < total(counts)))
               throw py::value_error("gather: array sizes do not match the counts");
             auto opts = call(c, a, timeout, "gather");
             return c.gather(opts, vptr(a), vptr(o), counts, a.dtype, root);
           }, py::arg("x"), py::arg("out"), py::arg("counts"), py::arg("root"), py::arg("timeout") = py::none(),
           py::arg("blocking") = false)
      .def("scatter", [](NcclComm& c, const py::handle& x, const py::handle& out,
                         const std::vector<size_t>& counts, int root, const py::handle& timeout,
                         bool /*blocking*/) {
             check_root(c, root, "scatter");
             // The output decides the stream: non-roots pass an empty x.
             auto o = arg(out, "scatter", true, nullptr);
             auto a = arg(x, "scatter", false, &o);
             same_dtype(a, o, "scatter");
             check_counts(c, counts, "scatter");
             if (counts[c.rank()] != o.count || (c.rank() == root && a.count < total(counts)))
               throw py::value_error("scatter: array sizes do not match the counts");
             auto opts = call(c, o, timeout, "scatter");
             return c.scatter(opts, vptr(a), vptr(o), counts, a.dtype, root);
           }, py::arg("x"), py::arg("out"), py::arg("counts"), py::arg("root"), py::arg("timeout") = py::none(),
           py::arg("blocking") = false)
      .def("barrier", [](NcclComm& c, const py::handle& timeout, const py::handle& stream,
                         bool /*blocking*/) {
             uintptr_t s = kLegacy;
             stream_arg(stream, &s);
             nccl::CallOpts o;
             o.stream = to_cu(s);
             o.timeout = timeout_arg(timeout);
             return c.barrier(o);
           }, py::arg("timeout") = py::none(), py::arg("stream") = py::none(),
           py::arg("blocking") = false)
      .def("send", [](NcclComm& c, const py::handle& x, int peer, uint32_t tag, const py::handle& timeout) {
             auto a = arg(x, "send", false, nullptr);
             check_peer(c, peer, tag, "send");
             auto o = call(c, a, timeout, "send");
             return c.send(o, vptr(a), a.count, a.dtype, peer);
           }, py::arg("x"), py::arg("peer"), py::arg("tag"), py::arg("timeout") = py::none())
      .def("recv", [](NcclComm& c, const py::handle& x, int peer, uint32_t tag, const py::handle& timeout) {
             auto a = arg(x, "recv", true, nullptr);
             check_peer(c, peer, tag, "recv");
             auto o = call(c, a, timeout, "recv");
             return c.recv(o, vptr(a), a.count, a.dtype, peer);
           }, py::arg("x"), py::arg("peer"), py::arg("tag"), py::arg("timeout") = py::none());
}

}  // namespace meshcoll::python
