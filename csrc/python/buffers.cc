#include "python/buffers.h"

#include "common/error.h"

namespace py = pybind11;

namespace meshcoll::python {

DType dtype_of(const py::dtype& dt, const char* what) {
  const char kind = dt.kind();
  const auto size = dt.itemsize();
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
  throw TypeMismatch(str_cat(what, ": dtype '", std::string(py::str(dt)),
                             "' is not supported; use one of bool, int8, uint8, int32, int64, "
                             "float16, bfloat16 (ml_dtypes), float32, float64"));
}

ArrayView view_of(const py::array& a, bool writable, const char* what) {
  if (!(a.flags() & py::array::c_style))
    throw InvalidArgument(str_cat(what, ": the array is not C-contiguous; pass "
                                        "numpy.ascontiguousarray(x) (and copy the result back)"));
  if (writable && !a.writeable())
    throw InvalidArgument(str_cat(what, ": the array is read-only but this operation writes "
                                        "its result into it; pass a writable array"));
  ArrayView v;
  v.dtype = dtype_of(a.dtype(), what);
  v.data = static_cast<uint8_t*>(const_cast<void*>(a.data()));
  v.count = static_cast<size_t>(a.size());
  v.bytes = v.count * dtype_size(v.dtype);
  return v;
}

}  // namespace meshcoll::python
