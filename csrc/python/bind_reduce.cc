// Bindings for csrc/reduce/kernels.h: the raw kernel table, for tests and Python-side folds.
// Buffers come in through the buffer protocol and are reinterpreted as the named dtype; the
// kernel runs with the GIL released, after every check is done.
#include <pybind11/pybind11.h>

#include <cstdint>
#include <string>

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

// Byte length of a C-contiguous buffer; strided views are refused rather than copied.
size_t contiguous_nbytes(const py::buffer_info& info, const char* fn, const char* what) {
  if (info.size == 0) return 0;
  py::ssize_t expect = info.itemsize;
  for (py::ssize_t k = info.ndim - 1; k >= 0; --k) {
    const py::ssize_t extent = info.shape[static_cast<size_t>(k)];
    const py::ssize_t stride = info.strides[static_cast<size_t>(k)];
    MC_ARG_CHECK(extent == 1 || stride == expect, fn, ": ", what,
                 " is not C-contiguous (dimension ", k, " has stride ", stride, ", expected ",
                 expect, "); pass a contiguous copy, e.g. numpy.ascontiguousarray");
    expect *= extent;
  }
  return static_cast<size_t>(info.size) * static_cast<size_t>(info.itemsize);
}

// Element count of a byte length, which must hold whole elements of t.
size_t element_count(size_t nbytes, DType t, const char* fn) {
  const size_t esz = dtype_size(t);
  MC_ARG_CHECK(nbytes % esz == 0, fn, ": ", nbytes, " bytes is not a whole number of ",
               dtype_name(t), " elements (", esz, " bytes each)");
  return nbytes / esz;
}

void reduce_into(const py::buffer& dst, const py::buffer& src, const std::string& dtype,
                 const std::string& op) {
  const char* fn_name = "_reduce_into";
  const DType t = parse_dtype(dtype);
  const RedOp r = parse_redop(op);
  const reduce::ReduceFn fn = reduce::lookup(t, r);  // TypeMismatch before touching buffers

  const py::buffer_info d = dst.request();
  const py::buffer_info s = src.request();
  MC_ARG_CHECK(!d.readonly, fn_name, ": dst is read-only; pass a writable buffer");
  const size_t d_bytes = contiguous_nbytes(d, fn_name, "dst");
  const size_t s_bytes = contiguous_nbytes(s, fn_name, "src");
  MC_ARG_CHECK(d_bytes == s_bytes, fn_name, ": dst has ", d_bytes, " bytes but src has ",
               s_bytes, "; they must be the same size");
  const size_t count = element_count(d_bytes, t, fn_name);

  // The kernel allows dst == src but not a partial overlap.
  const auto d0 = reinterpret_cast<uintptr_t>(d.ptr);
  const auto s0 = reinterpret_cast<uintptr_t>(s.ptr);
  MC_ARG_CHECK(d0 == s0 || d0 + d_bytes <= s0 || s0 + s_bytes <= d0, fn_name,
               ": dst and src overlap partially; use the same buffer or disjoint ones");

  // d and s (which hold the buffer views) are released after this scope, with the GIL held.
  py::gil_scoped_release nogil;
  fn(d.ptr, s.ptr, count);
}

void divide_by(const py::buffer& buf, const std::string& dtype, size_t n) {
  const char* fn_name = "_divide_by";
  const DType t = parse_dtype(dtype);
  const py::buffer_info b = buf.request();
  MC_ARG_CHECK(!b.readonly, fn_name, ": buf is read-only; pass a writable buffer");
  const size_t count = element_count(contiguous_nbytes(b, fn_name, "buf"), t, fn_name);
  py::gil_scoped_release nogil;
  reduce::divide_by(t, b.ptr, count, n);
}

}  // namespace

void bind_reduce(py::module_& m) {
  m.def("_reduce_into", &reduce_into, py::arg("dst"), py::arg("src"), py::arg("dtype"),
        py::arg("op"),
        "dst[i] = op(dst[i], src[i]) over two contiguous buffers of the same byte size, read "
        "as `dtype` (a numpy-style name such as 'float32' or 'bfloat16'). `op` is one of sum, "
        "prod, min, max, avg (the sum kernel; finish with _divide_by), band, bor, bxor. "
        "Raises TypeError for unsupported pairs (bitwise ops on floats, avg on bool) and "
        "ValueError for bad names, sizes, layouts or a read-only dst.");
  m.def("_divide_by", &divide_by, py::arg("buf"), py::arg("dtype"), py::arg("n"),
        "buf[i] /= n in place, finishing an avg. Integers truncate toward zero; f16/bf16 "
        "divide in f32. Raises ValueError for n == 0 and TypeError for bool.");
  m.def("simd_level", &reduce::simd_level,
        "The SIMD level the reduction kernels dispatched to at run time: 'avx512', 'avx2' or "
        "'baseline'. The environment variable MESHCOLL_SIMD caps it (read once, at first use).");
}

}  // namespace meshcoll::python
