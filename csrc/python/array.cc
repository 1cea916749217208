#include "python/array.h"

#include <pybind11/numpy.h>
#include <pthread.h>
#include <sys/mman.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <string>
#include <unordered_map>

#include "common/error.h"
#include "common/op_desc.h"

namespace py = pybind11;

namespace meshcoll::python {

namespace {

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
// The C exchange API (dlpack.h v1.3's DLPackExchangeAPI; Note [The DLPack C exchange API]),
// up to the two functions we call.
struct DLPackExchangeAPIHeader {
  uint32_t major, minor;
  DLPackExchangeAPIHeader* prev_api;
};
struct DLPackExchangeAPI {
  DLPackExchangeAPIHeader header;
  void* managed_tensor_allocator;
  void* managed_tensor_from_py_object_no_sync;
  void* managed_tensor_to_py_object_no_sync;
  int (*dltensor_from_py_object_no_sync)(void* py_object, DLTensor* out);
  int (*current_work_stream)(int32_t device_type, int32_t device_id, void** out_stream);
};
constexpr int32_t kDLCPU = 1, kDLCUDA = 2, kDLCUDAHost = 3, kDLCUDAManaged = 13;
constexpr uint8_t kDLInt = 0, kDLUInt = 1, kDLFloat = 2, kDLBfloat = 4, kDLBool = 6;
constexpr uint8_t kDLFloat8_e4m3fn = 10, kDLFloat8_e5m2 = 12;  // DLPack 1.1 (torch >= 2.7)
constexpr uint64_t kDLReadOnly = 1;

const char* const kHostDtypes =
    "bool, int8, uint8, int32, int64, float16, bfloat16 (ml_dtypes), float32, float64";
const char* const kDeviceDtypes =
    "int8, uint8, int32, int64, float16, bfloat16, float32, float64, bool, float8_e4m3fn or "
    "float8_e5m2";

// ---- the shape: dims (if asked for) and the two fingerprints ----------------------------
class ShapeReader {
 public:
  ShapeReader(comm::ArrayView& v, std::vector<int64_t>* dims) : v_(v), dims_(dims) {
    if (dims_) dims_->clear();
  }
  void add(int64_t d) {
    full_.mix(static_cast<uint64_t>(d));
    if (n_++ > 0) row_.mix(static_cast<uint64_t>(d));
    if (dims_) dims_->push_back(d);
  }
  ~ShapeReader() {
    full_.mix(n_);
    row_.mix(n_ ? n_ - 1 : 0);  // a row's own rank: a (n, 2, 3) array's row hashes as (2, 3)
    v_.shape_hash = full_.value();
    v_.row_hash = row_.value();
  }

 private:
  comm::ArrayView& v_;
  std::vector<int64_t>* dims_;
  ShapeHash full_, row_;
  uint64_t n_ = 0;
};

std::string type_name(const py::handle& x) {
  return py::str(py::type::handle_of(x).attr("__name__"));
}

// ---- numpy ---------------------------------------------------------------------------------
DType numpy_dtype(const py::dtype& dt, const Want& w) {
  const char kind = dt.kind();
  const auto size = dt.itemsize();
  if (dt.byteorder() == '>')  // '>' only where it is not native (numpy spells native '=')
    throw TypeMismatch(str_cat(label(w), ": the array is big-endian (dtype '",
                               std::string(py::str(dt)), "'); pass x.astype(x.dtype.newbyteorder('='))"));
  switch (kind) {
    case 'b': return DType::kBool;
    case 'i':
      if (size == 1) return DType::kInt8;
      if (size == 4) return DType::kInt32;
      if (size == 8) return DType::kInt64;
      break;
    case 'u':
      if (size == 1) return DType::kUint8;
      break;
    case 'f':
      if (size == 2) return DType::kFloat16;
      if (size == 4) return DType::kFloat32;
      if (size == 8) return DType::kFloat64;
      break;
    case 'V':
      // ml_dtypes.bfloat16 registers as a 2-byte void type with character code 'E'.
      if (size == 2 && dt.char_() == 'E') return DType::kBFloat16;
      break;
    default: break;
  }
  throw TypeMismatch(str_cat(label(w), ": dtype '", std::string(py::str(dt)),
                             "' is not supported; use one of ", kHostDtypes));
}

void from_numpy(Read& r, const py::array& a, const Want& w, std::vector<int64_t>* dims) {
  if (!(a.flags() & py::array::c_style))
    throw InvalidArgument(str_cat(label(w), ": the array is not C-contiguous; pass "
                                          "numpy.ascontiguousarray(x) (and copy the result back)"));
  if (w.writable && !a.writeable())
    throw InvalidArgument(str_cat(label(w), ": the array is read-only but this operation writes "
                                          "its result into it; pass a writable array"));
  r.view.dtype = numpy_dtype(a.dtype(), w);
  r.view.data = const_cast<void*>(a.data());
  r.view.count = static_cast<size_t>(a.size());
  ShapeReader s(r.view, dims);
  for (py::ssize_t i = 0; i < a.ndim(); ++i) s.add(a.shape(i));
  r.numpy_owned = owns_its_memory(a.ptr());
}

// ---- the buffer protocol (bytearray, array.array, memoryview, ...) ------------------------
DType format_dtype(const char* fmt, size_t itemsize, const Want& w) {
  std::string f = fmt ? fmt : "B";
  char order = '@';
  if (!f.empty() && std::strchr("@=<>!", f[0])) {
    order = f[0];
    f = f.substr(1);
  }
  if (order == '>' || order == '!')
    throw TypeMismatch(str_cat(label(w), ": the buffer is big-endian (format '", fmt,
                               "'); pass native byte order"));
  if (f.size() == 1) {
    switch (f[0]) {
      case '?': return DType::kBool;
      case 'b': return DType::kInt8;
      case 'B': case 'c': return DType::kUint8;
      case 'h': case 'H': break;
      case 'i': case 'l': case 'q': case 'n':
        if (itemsize == 4) return DType::kInt32;
        if (itemsize == 8) return DType::kInt64;
        break;
      case 'e': return DType::kFloat16;
      case 'f': return DType::kFloat32;
      case 'd': return DType::kFloat64;
      default: break;
    }
  }
  throw TypeMismatch(str_cat(label(w), ": buffer format '", fmt ? fmt : "B",
                             "' is not supported; use one of ", kHostDtypes));
}

void from_buffer(Read& r, const py::handle& x, const Want& w, std::vector<int64_t>* dims) {
  Py_buffer b;
  int flags = PyBUF_FORMAT | PyBUF_STRIDES | (w.writable ? PyBUF_WRITABLE : 0);
  if (PyObject_GetBuffer(x.ptr(), &b, flags) != 0) {
    PyErr_Clear();
    if (w.writable && PyObject_CheckBuffer(x.ptr()))
      throw InvalidArgument(str_cat(label(w), ": the buffer is read-only but this operation "
                                            "writes its result into it; pass a writable array"));
    throw py::type_error(str_cat(label(w), ": expected a numpy array or an object with the buffer "
                                         "protocol, __dlpack__ or __cuda_array_interface__, got ",
                                 type_name(x)));
  }
  struct Release {
    Py_buffer* b;
    ~Release() { PyBuffer_Release(b); }
  } release{&b};
  if (!PyBuffer_IsContiguous(&b, 'C'))
    throw InvalidArgument(str_cat(label(w), ": the buffer is not C-contiguous; pass a contiguous copy"));
  r.view.dtype = format_dtype(b.format, static_cast<size_t>(b.itemsize), w);
  if (dtype_size(r.view.dtype) != static_cast<size_t>(b.itemsize))
    throw TypeMismatch(str_cat(label(w), ": buffer format '", b.format, "' has items of ", b.itemsize,
                               " bytes; use one of ", kHostDtypes));
  r.view.data = b.buf;
  r.view.count = static_cast<size_t>(b.len / b.itemsize);
  ShapeReader s(r.view, dims);
  if (b.ndim == 0 && b.shape == nullptr) s.add(static_cast<int64_t>(r.view.count));
  for (int i = 0; i < b.ndim; ++i) s.add(b.shape[i]);
}

// ---- device arrays ---------------------------------------------------------------------------
DLDataType dl_dtype(DType t) {
  switch (t) {
    case DType::kBool: return {kDLBool, 8, 1};
    case DType::kInt8: return {kDLInt, 8, 1};
    case DType::kUint8: return {kDLUInt, 8, 1};
    case DType::kInt32: return {kDLInt, 32, 1};
    case DType::kInt64: return {kDLInt, 64, 1};
    case DType::kFloat16: return {kDLFloat, 16, 1};
    case DType::kBFloat16: return {kDLBfloat, 16, 1};
    case DType::kFloat32: return {kDLFloat, 32, 1};
    case DType::kFloat64: return {kDLFloat, 64, 1};
    case DType::kFloat8E4M3: return {kDLFloat8_e4m3fn, 8, 1};
    case DType::kFloat8E5M2: return {kDLFloat8_e5m2, 8, 1};
  }
  throw InvalidArgument("unknown dtype");
}

DType dtype_from_dl(DLDataType t, const Want& w) {
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
  static const char* const kinds[] = {"int", "uint", "float", "opaque handle ", "bfloat",
                                      "complex", "bool"};
  const std::string name = t.code < 7 && t.lanes == 1
                               ? str_cat(kinds[t.code], int(t.bits))
                               : str_cat("DLPack code ", int(t.code), ", bits ", int(t.bits),
                                         ", lanes ", t.lanes);
  throw TypeMismatch(str_cat(label(w), ": dtype ", name, " is not supported; use ",
                             w.device ? kDeviceDtypes : kHostDtypes));
}

DType dtype_from_typestr(const std::string& ts, const Want& w) {
  if (ts.size() >= 3 && ts[0] == '>')
    throw TypeMismatch(str_cat(label(w), ": __cuda_array_interface__ typestr '", ts,
                               "' is big-endian; pass native byte order"));
  if (ts.size() >= 3) {
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
  throw TypeMismatch(str_cat(label(w), ": __cuda_array_interface__ typestr '", ts, "' is not "
                             "supported; use int8, uint8, int32, int64, float16, float32, "
                             "float64 or bool (bfloat16 and float8 through DLPack: the "
                             "interface has no typestr for them)"));
}

// shape[0..ndim) with strides in `unit`s (elements for DLPack, bytes for the array
// interface). A pointer and a length, not a vector: the DLPack paths (every torch tensor)
// then read the producer's own shape with no allocation per call.
void check_compact(const int64_t* shape, size_t ndim, const int64_t* strides, size_t unit,
                   const Want& w) {
  if (!strides) return;
  int64_t expect = static_cast<int64_t>(unit);
  for (size_t i = ndim; i-- > 0;) {
    if (shape[i] != 1 && strides[i] != expect)
      throw InvalidArgument(str_cat(label(w), ": the array is not C-contiguous; pass a contiguous "
                                    "copy (x.contiguous() / cupy.ascontiguousarray(x))"));
    expect *= shape[i];
  }
}

size_t product(const int64_t* shape, size_t ndim, const Want& w) {
  size_t n = 1;
  for (size_t i = 0; i < ndim; ++i) {
    const int64_t d = shape[i];
    if (d < 0) throw InvalidArgument(str_cat(label(w), ": negative dimension in the array's shape"));
    n *= static_cast<size_t>(d);
  }
  return n;
}

// Per-process caches of what a type is and of torch's dtype objects. Types and dtypes are
// immortal in practice; we hold references so an address is never reused under us.
// kJax: read through DLPack, always read-only (Note [Immutable arrays]).
// kExchange: a torch tensor read through torch's DLPack C exchange API (Note [The DLPack C
// exchange API]).
enum class Kind { kUnknown, kNumpy, kTorch, kExchange, kDLPack, kJax, kCAI, kBuffer };
struct TypeKind {
  py::object type;  // held: the address is never reused under us
  Kind kind;
  const DLPackExchangeAPI* api;  // kExchange
};
struct Caches {
  std::unordered_map<PyTypeObject*, TypeKind> kinds;
  std::unordered_map<PyObject*, std::pair<py::object, DType>> torch_dtypes;
  py::object torch_current_stream;  // torch._C._cuda_getCurrentRawStream, or None
  bool torch_looked_up = false;
};
Caches& caches() {
  static Caches* c = new Caches();  // never destroyed: holds Python objects past finalization
  return *c;
}

// Note [The DLPack C exchange API]
// DLPack 1.3 lets a framework put a table of C functions on its array type
// (`__dlpack_c_exchange_api__`, a capsule): one fills a DLTensor that views the array, with
// no Python object made, and another gives the framework's current stream for a device. A
// torch tensor read through them costs two C calls instead of six Python calls
// (get_device, is_contiguous, dtype, shape, data_ptr and the current stream), the largest
// part of a small GPU call's own host time (Note [Host timers]). torch has it from 2.10
// (older versions are read as before, kTorch). It is used for torch.Tensor and every
// subclass: through torch's methods a subclass pays Python's __torch_function__ on each of
// the six (see docs/performance.md, "2026-11-27 (5d284ee): torch subclasses read through
// DLPack's C exchange API"). The table reads the tensor's own memory, as a collective must; a
// wrapper subclass that has none (DTensor) cannot be read either way. Other frameworks'
// arrays keep __dlpack__: a bare DLTensor cannot say that an array is read-only (the
// versioned capsule's flags can), and torch tensors are never read-only. What the table
// cannot say either, a torch tensor's negative bit, costs one method call
// (check_not_negative_view; its cost is in the same entry).
const DLPackExchangeAPI* exchange_api(PyTypeObject* t) {
  PyObject* cap = PyObject_GetAttrString(reinterpret_cast<PyObject*>(t),
                                         "__dlpack_c_exchange_api__");
  if (!cap) {
    PyErr_Clear();
    return nullptr;
  }
  auto* h = static_cast<DLPackExchangeAPIHeader*>(
      PyCapsule_IsValid(cap, "dlpack_exchange_api")
          ? PyCapsule_GetPointer(cap, "dlpack_exchange_api") : nullptr);
  Py_DECREF(cap);  // the table lives as long as the process (the protocol's promise)
  while (h && h->major != 1) h = h->prev_api;
  auto* api = reinterpret_cast<const DLPackExchangeAPI*>(h);
  return api && api->dltensor_from_py_object_no_sync && api->current_work_stream ? api : nullptr;
}

const TypeKind& type_kind(const py::handle& x) {
  auto& c = caches();
  PyTypeObject* t = Py_TYPE(x.ptr());
  auto it = c.kinds.find(t);
  if (it != c.kinds.end()) return it->second;
  Kind k = Kind::kUnknown;
  const DLPackExchangeAPI* api = nullptr;
  const py::handle type(reinterpret_cast<PyObject*>(t));
  std::string mod = py::str(type.attr("__module__"));
  // torch.Tensor and every subclass, a user's too (torch is imported if x is one).
  py::object torch = py::module_::import("sys").attr("modules").attr("get")("torch");
  py::object tensor = torch.is_none() ? torch : py::getattr(torch, "Tensor", py::none());
  if (!tensor.is_none() && PyType_Check(tensor.ptr()) &&
      PyType_IsSubtype(t, reinterpret_cast<PyTypeObject*>(tensor.ptr()))) {
    api = exchange_api(t);
    k = api ? Kind::kExchange : Kind::kTorch;
  } else if (mod.rfind("jax", 0) == 0 && py::hasattr(x, "__dlpack__")) {
    k = Kind::kJax;
  } else if (py::hasattr(x, "__dlpack__")) {
    k = Kind::kDLPack;
  } else if (py::hasattr(x, "__cuda_array_interface__")) {
    k = Kind::kCAI;
  } else if (PyObject_CheckBuffer(x.ptr())) {
    k = Kind::kBuffer;
  }
  return c.kinds.emplace(t, TypeKind{py::reinterpret_borrow<py::object>(type), k, api})
      .first->second;
}

Kind kind_of(const py::handle& x) {
  if (py::isinstance<py::array>(x)) return Kind::kNumpy;
  return type_kind(x).kind;
}
}  // namespace

const char* array_reader(const py::handle& x) {
  switch (kind_of(x)) {
    case Kind::kNumpy: return "numpy";
    case Kind::kTorch: return "torch";
    case Kind::kExchange: return "dlpack exchange";
    case Kind::kDLPack: return "dlpack";
    case Kind::kJax: return "jax";
    case Kind::kCAI: return "cuda array interface";
    case Kind::kBuffer: return "buffer";
    case Kind::kUnknown: break;
  }
  return "unknown";
}

namespace {

DType torch_dtype(const py::handle& dt, const Want& w) {
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
  throw TypeMismatch(str_cat(label(w), ": dtype ", s, " is not supported; use ", kDeviceDtypes));
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
  if (c.torch_current_stream.is_none()) return kLegacyStream;
  py::object dev = py::reinterpret_steal<py::object>(PyLong_FromLong(device));
  if (!dev) throw py::error_already_set();
  auto r = py::reinterpret_steal<py::object>(
      PyObject_CallOneArg(c.torch_current_stream.ptr(), dev.ptr()));
  if (!r) throw py::error_already_set();
  uintptr_t s = r.cast<uintptr_t>();
  return s == 0 ? kLegacyStream : s;
}

// `name` as an interned str, made once per name (a torch tensor is read on every call: no
// str is built per lookup).
PyObject* interned(const char* name) {
  static auto* names = new std::unordered_map<const char*, PyObject*>();
  PyObject*& n = (*names)[name];
  if (!n && !(n = PyUnicode_InternFromString(name))) throw py::error_already_set();
  return n;
}

// x.<name>(): no bound method object.
py::object call_method(const py::handle& x, const char* name) {
  auto r = py::reinterpret_steal<py::object>(PyObject_CallMethodNoArgs(x.ptr(), interned(name)));
  if (!r) throw py::error_already_set();
  return r;
}

// x.<name>
py::object get_attr(const py::handle& x, const char* name) {
  auto r = py::reinterpret_steal<py::object>(PyObject_GetAttr(x.ptr(), interned(name)));
  if (!r) throw py::error_already_set();
  return r;
}

[[noreturn]] void wrong_memory(const Want& w, bool is_device) {
  if (is_device)
    throw py::type_error(str_cat(label(w), ": the array is in GPU memory; the CPU backend takes "
                                         "host memory: use meshcoll.init(backend='nccl') for GPU "
                                         "arrays"));
  throw py::type_error(str_cat(label(w), ": the array is in host memory; the NCCL backend takes "
                                       "CUDA arrays (PyTorch, CuPy, JAX, or any __dlpack__ / "
                                       "__cuda_array_interface__ object)"));
}

// A torch tensor with the negative bit set reads as the negation of what its memory holds
// (the imaginary part of a conjugate view, z.conj().imag): its data pointer, which is all a
// collective sees, would give the wrong sign silently.
void check_not_negative_view(const py::handle& x, const Want& w) {
  if (call_method(x, "is_neg").cast<bool>())
    throw InvalidArgument(str_cat(label(w), ": the tensor is a negative view (its memory holds "
                                          "the negation of its values); pass x.resolve_neg() "
                                          "(and copy the result back)"));
}

void from_torch(Read& r, const py::handle& x, const Want& w, std::vector<int64_t>* dims) {
  check_not_negative_view(x, w);
  r.view.device = call_method(x, "get_device").cast<int>();
  if (w.device && r.view.device < 0)
    throw py::type_error(str_cat(label(w), ": a CPU tensor: the NCCL backend takes CUDA tensors "
                                           "(move it with x.cuda(), or use "
                                           "meshcoll.init(backend='cpu'))"));
  if (!w.device && r.view.device >= 0) wrong_memory(w, true);
  if (!call_method(x, "is_contiguous").cast<bool>())
    throw InvalidArgument(str_cat(label(w), ": the tensor is not contiguous; pass x.contiguous() "
                                          "(and copy the result back)"));
  r.view.dtype = torch_dtype(get_attr(x, "dtype"), w);
  py::object size = get_attr(x, "shape");  // torch.Size, a tuple of ints
  if (!PyTuple_Check(size.ptr())) throw py::type_error(str_cat(label(w), ": tensor.shape is not a tuple"));
  r.view.count = 1;
  ShapeReader s(r.view, dims);
  for (const py::handle d : py::reinterpret_borrow<py::tuple>(size)) {
    auto n = d.cast<int64_t>();  // torch sizes are >= 0
    r.view.count *= static_cast<size_t>(n);
    s.add(n);
  }
  r.view.data = reinterpret_cast<void*>(call_method(x, "data_ptr").cast<uintptr_t>());
  if (w.device) r.stream = w.has_stream ? w.stream : torch_stream(r.view.device);
}

// A DLPack device type the backend can take: CUDA memory (device backends) or host memory.
// Returns whether it is CUDA memory.
bool check_dlpack_memory(int type, const Want& w) {
  const bool device = type == kDLCUDA || type == kDLCUDAManaged;
  if (!device && type != kDLCPU && type != kDLCUDAHost)
    throw py::type_error(str_cat(label(w), ": DLPack device type ", type, " is neither host nor "
                                           "CUDA memory"));
  if (device != w.device) wrong_memory(w, device);
  return device;
}

// A DLTensor's view: memory kind, dtype, compact shape, data.
void from_dltensor(Read& r, const DLTensor& t, const Want& w, std::vector<int64_t>* dims) {
  const bool is_device = check_dlpack_memory(t.device.device_type, w);
  r.view.device = is_device ? t.device.device_id : -1;
  r.view.dtype = dtype_from_dl(t.dtype, w);
  const auto ndim = static_cast<size_t>(std::max(t.ndim, 0));
  check_compact(t.shape, ndim, t.strides, 1, w);
  r.view.count = product(t.shape, ndim, w);
  ShapeReader s(r.view, dims);
  for (size_t i = 0; i < ndim; ++i) s.add(t.shape[i]);
  r.view.data = static_cast<uint8_t*>(t.data) + t.byte_offset;
}

void from_dlpack(Read& r, const py::handle& x, const Want& w, std::vector<int64_t>* dims) {
  // Before the handshake: a host array is not asked to order work before a CUDA stream.
  if (py::hasattr(x, "__dlpack_device__"))
    check_dlpack_memory(py::tuple(x.attr("__dlpack_device__")())[0].cast<int>(), w);
  // Handshake: the producer orders its pending work before S (device); no stream on the host.
  py::object cap;
  if (w.device) {
    r.stream = w.has_stream ? w.stream : kLegacyStream;
    cap = x.attr("__dlpack__")(py::arg("stream") = py::int_(r.stream));
  } else {
    cap = x.attr("__dlpack__")();
  }
  const char* name = PyCapsule_GetName(cap.ptr());
  const DLTensor* t = nullptr;
  bool readonly = false;
  if (name && std::strcmp(name, "dltensor") == 0) {
    t = &static_cast<DLManagedTensor*>(PyCapsule_GetPointer(cap.ptr(), name))->dl_tensor;
  } else if (name && std::strcmp(name, "dltensor_versioned") == 0) {
    auto* m = static_cast<DLManagedTensorVersioned*>(PyCapsule_GetPointer(cap.ptr(), name));
    if (m->major != 1)
      throw py::type_error(str_cat(label(w), ": DLPack major version ", m->major, " is not supported"));
    readonly = (m->flags & kDLReadOnly) != 0;
    t = &m->dl_tensor;
  } else {
    throw py::type_error(str_cat(label(w), ": __dlpack__ returned an unexpected capsule (",
                                 name ? name : "unnamed", ")"));
  }
  if (!t) throw py::error_already_set();
  if (w.writable && readonly)
    throw InvalidArgument(str_cat(label(w), ": the array is read-only (immutable, as JAX arrays "
                                          "are) but this operation writes its result into it; "
                                          "pass a writable array"));
  from_dltensor(r, *t, w, dims);
}

// Note [The DLPack C exchange API]: the view filled in by the type's own C function, and
// its framework's current stream.
void from_exchange(Read& r, const py::handle& x, const DLPackExchangeAPI& api, const Want& w,
                   std::vector<int64_t>* dims) {
  DLTensor t;
  if (api.dltensor_from_py_object_no_sync(x.ptr(), &t) != 0) {
    py::error_already_set e;  // the framework's reason, first line (torch adds a C++ trace)
    std::string why = e.what();
    why = why.substr(0, why.find('\n'));
    throw py::type_error(str_cat(label(w), ": the tensor cannot be read (", why,
                                 "); pass a dense, strided tensor"));
  }
  from_dltensor(r, t, w, dims);
  if (!w.device) return;
  if (w.has_stream) {
    r.stream = w.stream;
    return;
  }
  void* s = nullptr;
  if (api.current_work_stream(kDLCUDA, t.device.device_id, &s) != 0)
    throw py::error_already_set();
  r.stream = s ? reinterpret_cast<uintptr_t>(s) : kLegacyStream;
}

void from_cai(Read& r, const py::handle& x, const Want& w, std::vector<int64_t>* dims) {
  if (!w.device) wrong_memory(w, true);
  py::dict d = x.attr("__cuda_array_interface__");
  py::tuple data = d["data"];
  r.view.data = data[0].is_none() ? nullptr : reinterpret_cast<void*>(data[0].cast<uintptr_t>());
  if (w.writable && data[1].cast<bool>())
    throw InvalidArgument(str_cat(label(w), ": the array is read-only but this operation writes "
                                          "its result into it; pass a writable array"));
  r.view.dtype = dtype_from_typestr(d["typestr"].cast<std::string>(), w);
  py::tuple shape = d["shape"];
  std::vector<int64_t> ds(shape.size());
  for (size_t i = 0; i < ds.size(); ++i) ds[i] = shape[i].cast<int64_t>();
  if (d.contains("strides") && !d["strides"].is_none()) {
    py::tuple st = d["strides"];
    std::vector<int64_t> strides(st.size());
    for (size_t i = 0; i < strides.size(); ++i) strides[i] = st[i].cast<int64_t>();
    check_compact(ds.data(), ds.size(), strides.data(), dtype_size(r.view.dtype), w);
  }
  r.view.count = product(ds.data(), ds.size(), w);
  ShapeReader s(r.view, dims);
  for (int64_t n : ds) s.add(n);
  uintptr_t own = 0;
  if (d.contains("stream") && !d["stream"].is_none()) own = d["stream"].cast<uintptr_t>();
  if (w.has_stream) {
    r.stream = w.stream;
    if (own && own != w.stream) r.order_after = own;
  } else {
    r.stream = own ? own : kLegacyStream;
  }
}

}  // namespace

std::string label(const Want& w) {
  return w.arg && *w.arg ? str_cat(w.what, ": ", w.arg) : std::string(w.what);
}

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
  *out = h == 0 ? kLegacyStream : h;
  return true;
}

void* to_cu_stream(uintptr_t s) {
  if (s == kLegacyStream || s == 0) return nullptr;  // driver and NCCL: 0 is the legacy stream
  return reinterpret_cast<void*>(s);  // CU_STREAM_PER_THREAD is 0x2, as in DLPack
}

Read read_array(const py::handle& x, const Want& w, std::vector<int64_t>* dims) {
  Read r;
  const bool numpy = py::isinstance<py::array>(x);
  const TypeKind* tk = numpy ? nullptr : &type_kind(x);
  switch (numpy ? Kind::kNumpy : tk->kind) {
    case Kind::kNumpy:
      if (w.device) wrong_memory(w, false);
      from_numpy(r, py::reinterpret_borrow<py::array>(x), w, dims);
      break;
    case Kind::kTorch: from_torch(r, x, w, dims); break;
    case Kind::kExchange:
      check_not_negative_view(x, w);
      from_exchange(r, x, *tk->api, w, dims);
      break;
    case Kind::kDLPack: from_dlpack(r, x, w, dims); break;
    case Kind::kJax:
      // Note [Immutable arrays]: JAX arrays never change once made (XLA may share one buffer
      // between several arrays), but the DLPack capsule JAX hands out carries no read-only
      // flag: without this check a collective wrote its result into one.
      if (w.writable)
        throw InvalidArgument(str_cat(
            label(w), ": JAX arrays are immutable, but this operation writes its result into "
            "this one; pass a writable copy (torch.from_dlpack(x).clone() or "
            "cupy.from_dlpack(x).copy()) and take the result back with jax.numpy.from_dlpack"));
      // A deleted array (x.delete(), or donated to a jitted function) has no buffer left, and
      // JAX's own __dlpack_device__ then fails with "NoneType has no len()".
      if (py::hasattr(x, "is_deleted") && x.attr("is_deleted")().cast<bool>())
        throw InvalidArgument(str_cat(
            label(w), ": the JAX array was deleted (x.delete(), or donated to a jitted function "
            "through donate_argnums), so it has no memory to read; pass a live array (use the "
            "jitted function's result, or do not donate x)"));
      from_dlpack(r, x, w, dims);
      break;
    case Kind::kCAI: from_cai(r, x, w, dims); break;
    case Kind::kBuffer:
      if (w.device) wrong_memory(w, false);
      from_buffer(r, x, w, dims);
      break;
    case Kind::kUnknown:
      throw py::type_error(str_cat(label(w), ": expected ",
                                   w.device ? "a CUDA array (with __dlpack__ or "
                                              "__cuda_array_interface__)"
                                            : "a numpy array or an object with the buffer "
                                              "protocol or __dlpack__",
                                   ", got ", type_name(x)));
  }
  if (r.view.count && !r.view.data)
    throw InvalidArgument(str_cat(label(w), ": the array has a null data pointer"));
  if (!r.numpy_owned) check_memory(r.view, w);  // Note [Unmapped memory]
  if (w.keep) {
    // A buffer-protocol object is held through a memoryview, which keeps its export open:
    // a bytearray cannot be resized under the operation.
    r.view.owner = kind_of(x) == Kind::kBuffer
                       ? owner_of(py::reinterpret_steal<py::object>(PyMemoryView_FromObject(x.ptr())))
                       : owner_of(x);
  }
  return r;
}

namespace {
// What a capsule's DLManagedTensor owns: the memory's owner and the shape.
struct Exported {
  DLManagedTensor managed{};
  std::shared_ptr<void> owner;
  std::vector<int64_t> shape;
};
void delete_exported(DLManagedTensor* m) { delete static_cast<Exported*>(m->manager_ctx); }
}  // namespace

py::capsule device_capsule(std::shared_ptr<void> owner, void* data, int device, DType dt,
                           const std::vector<int64_t>& shape) {
  auto* e = new Exported;
  e->owner = std::move(owner);
  e->shape = shape;
  DLTensor& t = e->managed.dl_tensor;
  t.data = data;
  t.device = {kDLCUDA, device};
  t.ndim = static_cast<int32_t>(e->shape.size());
  t.dtype = dl_dtype(dt);
  t.shape = e->shape.data();
  t.strides = nullptr;  // C-contiguous
  t.byte_offset = 0;
  e->managed.manager_ctx = e;
  e->managed.deleter = &delete_exported;
  // A consumer renames the capsule "used_dltensor" and calls the deleter itself.
  return py::capsule(&e->managed, "dltensor", [](PyObject* cap) {
    if (!PyCapsule_IsValid(cap, "dltensor")) return;
    auto* m = static_cast<DLManagedTensor*>(PyCapsule_GetPointer(cap, "dltensor"));
    if (m && m->deleter) m->deleter(m);
  });
}

}  // namespace meshcoll::python
