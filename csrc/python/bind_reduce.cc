// Bindings for csrc/reduce/kernels.h: the raw kernel table, for tests and Python-side folds.
// Buffers come in through the buffer protocol and are reinterpreted as the named dtype (so an
// ml_dtypes.bfloat16 array works as is); the kernel runs with the GIL released, after every
// check is done.
#include <pybind11/pybind11.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "common/check.h"
#include "common/dtype.h"
#include "reduce/kernels.h"

namespace py = pybind11;

namespace meshcoll::python {
namespace {

template <class Enum, class NameFn>
std::string known_names(int count, NameFn name) {
  std::string out;
  for (int i = 0; i < count; ++i) {
    if (i > 0) out += ", ";
    out += name(static_cast<Enum>(i));
  }
  return out;
}

DType parse_dtype(const std::string& name) {
  DType t;
  MC_ARG_CHECK(dtype_from_name(name, &t), "unknown dtype '", name, "'; expected one of ",
               known_names<DType>(kNumDTypes, dtype_name));
  return t;
}

RedOp parse_redop(const std::string& name) {
  RedOp op;
  MC_ARG_CHECK(redop_from_name(name, &op), "unknown reduction op '", name,
               "'; expected one of ", known_names<RedOp>(kNumRedOps, redop_name));
  return op;
}

// A buffer view that asks for no format string: the dtype is the caller's argument, and numpy
// refuses to describe ml_dtypes.bfloat16 in PEP 3118 terms ("cannot include dtype 'E' in a
// buffer"), which py::buffer::request() always asks for. Released in the destructor, so it must
// die with the GIL held (declare it before any gil_scoped_release).
class RawBuffer {
 public:
  explicit RawBuffer(const py::buffer& obj) {
    if (PyObject_GetBuffer(obj.ptr(), &view_, PyBUF_STRIDES) != 0) throw py::error_already_set();
  }
  ~RawBuffer() { PyBuffer_Release(&view_); }
  RawBuffer(const RawBuffer&) = delete;
  RawBuffer& operator=(const RawBuffer&) = delete;

  void* ptr() const { return view_.buf; }
  bool readonly() const { return view_.readonly != 0; }

  // Byte length; strided views are refused rather than copied.
  size_t contiguous_nbytes(const char* fn, const char* what) const {
    if (view_.len == 0) return 0;
    py::ssize_t expect = view_.itemsize;
    for (int k = view_.ndim - 1; k >= 0; --k) {
      const py::ssize_t extent = view_.shape[k];
      const py::ssize_t stride = view_.strides[k];
      MC_ARG_CHECK(extent == 1 || stride == expect, fn, ": ", what,
                   " is not C-contiguous (dimension ", k, " has stride ", stride,
                   ", expected ", expect, "); pass a contiguous copy, e.g. "
                   "numpy.ascontiguousarray");
      expect *= extent;
    }
    return static_cast<size_t>(view_.len);
  }

 private:
  Py_buffer view_{};
};

// Element count of a byte length, which must hold whole elements of t.
size_t element_count(size_t nbytes, DType t, const char* fn) {
  const size_t esz = dtype_size(t);
  MC_ARG_CHECK(nbytes % esz == 0, fn, ": ", nbytes, " bytes is not a whole number of ",
               dtype_name(t), " elements (", esz, " bytes each)");
  return nbytes / esz;
}

void reduce_into(const py::buffer& dst, const py::buffer& src, const std::string& dtype,
                 const std::string& op, const py::object& x) {
  const char* fn_name = "_reduce_into";
  const DType t = parse_dtype(dtype);
  const RedOp r = parse_redop(op);
  const reduce::ReduceFn fn = reduce::lookup(t, r);  // TypeMismatch before touching buffers
  if (!x.is_none()) {  // dst = x OP src (lookup_into), three arrays apart
    const RawBuffer d(dst), a(x.cast<py::buffer>()), s(src);
    MC_ARG_CHECK(!d.readonly(), fn_name, ": dst is read-only; pass a writable buffer");
    const size_t n = d.contiguous_nbytes(fn_name, "dst");
    MC_ARG_CHECK(a.contiguous_nbytes(fn_name, "x") == n && s.contiguous_nbytes(fn_name, "src") == n,
                 fn_name, ": dst, x and src must be the same size");
    const auto d0 = reinterpret_cast<uintptr_t>(d.ptr());
    for (const void* p : {a.ptr(), s.ptr()}) {
      const auto p0 = reinterpret_cast<uintptr_t>(p);
      MC_ARG_CHECK(d0 + n <= p0 || p0 + n <= d0, fn_name, ": dst overlaps x or src");
    }
    const reduce::ReduceIntoFn into = reduce::lookup_into(t, r);
    py::gil_scoped_release nogil;
    into(d.ptr(), a.ptr(), s.ptr(), element_count(n, t, fn_name));
    return;
  }

  const RawBuffer d(dst);
  const RawBuffer s(src);
  MC_ARG_CHECK(!d.readonly(), fn_name, ": dst is read-only; pass a writable buffer");
  const size_t d_bytes = d.contiguous_nbytes(fn_name, "dst");
  const size_t s_bytes = s.contiguous_nbytes(fn_name, "src");
  MC_ARG_CHECK(d_bytes == s_bytes, fn_name, ": dst has ", d_bytes, " bytes but src has ",
               s_bytes, "; they must be the same size");
  const size_t count = element_count(d_bytes, t, fn_name);

  // The kernel allows dst == src but not a partial overlap.
  const auto d0 = reinterpret_cast<uintptr_t>(d.ptr());
  const auto s0 = reinterpret_cast<uintptr_t>(s.ptr());
  MC_ARG_CHECK(d0 == s0 || d0 + d_bytes <= s0 || s0 + s_bytes <= d0, fn_name,
               ": dst and src overlap partially; use the same buffer or disjoint ones");

  py::gil_scoped_release nogil;  // ends before d and s are released
  fn(d.ptr(), s.ptr(), count);
}

void reduce_many(const py::buffer& dst, const py::buffer& x, const py::list& srcs,
                 const std::string& dtype, const std::string& op) {
  const char* fn_name = "_reduce_many";
  const DType t = parse_dtype(dtype);
  const RedOp r = parse_redop(op);
  const reduce::ReduceManyFn fn = reduce::lookup_many(t, r);  // TypeMismatch first
  MC_ARG_CHECK(!srcs.empty(), fn_name, ": srcs is empty; pass one source or more");
  const RawBuffer d(dst), a(x);
  MC_ARG_CHECK(!d.readonly(), fn_name, ": dst is read-only; pass a writable buffer");
  const size_t n = d.contiguous_nbytes(fn_name, "dst");
  MC_ARG_CHECK(a.contiguous_nbytes(fn_name, "x") == n, fn_name, ": dst and x differ in size");
  const auto d0 = reinterpret_cast<uintptr_t>(d.ptr()), x0 = reinterpret_cast<uintptr_t>(a.ptr());
  MC_ARG_CHECK(d0 == x0 || d0 + n <= x0 || x0 + n <= d0, fn_name,
               ": dst and x overlap partially; use the same buffer or disjoint ones");
  std::vector<std::unique_ptr<RawBuffer>> views;
  std::vector<const void*> ptrs;
  for (const auto& s : srcs) {
    views.push_back(std::make_unique<RawBuffer>(s.cast<py::buffer>()));
    MC_ARG_CHECK(views.back()->contiguous_nbytes(fn_name, "a source") == n, fn_name,
                 ": every source must have dst's size");
    const auto s0 = reinterpret_cast<uintptr_t>(views.back()->ptr());
    MC_ARG_CHECK(d0 + n <= s0 || s0 + n <= d0, fn_name, ": a source overlaps dst");
    ptrs.push_back(views.back()->ptr());
  }
  const size_t count = element_count(n, t, fn_name);
  py::gil_scoped_release nogil;  // ends before the views are released
  fn(d.ptr(), a.ptr(), ptrs.data(), ptrs.size(), count);
}

void divide_by(const py::buffer& buf, const std::string& dtype, size_t n) {
  const char* fn_name = "_divide_by";
  const DType t = parse_dtype(dtype);
  const RawBuffer b(buf);
  MC_ARG_CHECK(!b.readonly(), fn_name, ": buf is read-only; pass a writable buffer");
  const size_t count = element_count(b.contiguous_nbytes(fn_name, "buf"), t, fn_name);
  py::gil_scoped_release nogil;
  reduce::divide_by(t, b.ptr(), count, n);
}

}  // namespace

void bind_reduce(py::module_& m) {
  m.def("_reduce_into", &reduce_into, py::arg("dst"), py::arg("src"), py::arg("dtype"),
        py::arg("op"), py::arg("x") = py::none(),
        "dst[i] = op(dst[i], src[i]) (or op(x[i], src[i]) with x, three arrays apart) over "
        "contiguous buffers of the same byte size, read "
        "as `dtype` (a numpy-style name such as 'float32' or 'bfloat16'). `op` is one of sum, "
        "prod, min, max, avg (the sum kernel; finish with _divide_by), band, bor, bxor. "
        "Raises TypeError for unsupported pairs (bitwise ops on floats, avg on bool) and "
        "ValueError for bad names, sizes, layouts or a read-only dst.");
  m.def("_reduce_many", &reduce_many, py::arg("dst"), py::arg("x"), py::arg("srcs"),
        py::arg("dtype"), py::arg("op"),
        "dst = x op srcs[0] op ... op srcs[-1], left to right (dst may be x; no source may "
        "overlap dst); float16 and bfloat16 are rounded once, at the end (Note [Fold of many]).");
  m.def("_divide_by", &divide_by, py::arg("buf"), py::arg("dtype"), py::arg("n"),
        "buf[i] /= n in place, finishing an avg. Integers truncate toward zero; f16/bf16 "
        "divide in f32. Raises ValueError for n == 0 and TypeError for bool.");
  m.def("simd_level", &reduce::simd_level,
        "The SIMD level the reduction kernels dispatched to at run time: 'avx512', 'avx2' or "
        "'baseline'. The environment variable MESHCOLL_SIMD caps it (read once, at first use).");
}

}  // namespace meshcoll::python
