// numpy arrays -> (pointer, bytes, dtype), validated while the GIL is held.
// Other array types (buffer protocol, DLPack, CUDA arrays) are turned into numpy arrays or
// device descriptors by python/meshcoll/arrays.py before they reach C++.
#pragma once

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <string>

#include "common/bytes.h"
#include "common/dtype.h"

namespace meshcoll::python {

struct ArrayView {
  uint8_t* data = nullptr;
  size_t bytes = 0;
  size_t count = 0;
  DType dtype = DType::kFloat32;
  ConstBytes cbytes() const { return {data, bytes}; }
  MutBytes mbytes() const { return {data, bytes}; }
};

// Throws TypeMismatch for unsupported dtypes and InvalidArgument for non-contiguous arrays,
// or read-only arrays when `writable`; `what` names the argument ("all_reduce: x").
ArrayView view_of(const pybind11::array& a, bool writable, const char* what);
DType dtype_of(const pybind11::dtype& dt, const char* what);

}  // namespace meshcoll::python
