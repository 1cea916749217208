// One array as every backend sees it: where its elements are, how many, of which type, on
// which device, and who owns the memory. csrc/python/array.cc makes it (the one place where
// numpy, the buffer protocol, DLPack, __cuda_array_interface__ and torch tensors are read and
// checked); the backends only read it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>

#include "common/bytes.h"
#include "common/dtype.h"

namespace meshcoll::comm {

struct ArrayView {
  void* data = nullptr;
  size_t count = 0;  // elements
  DType dtype = DType::kFloat32;
  int device = -1;   // CUDA device ordinal; -1 for host memory
  // Fingerprints (ShapeHash) of the shape and of the shape without axis 0 (the "row", hashed
  // as an array of its own: row_hash of (n, 2, 3) equals shape_hash of (2, 3)), for the
  // agreement check of collectives whose result depends on them (all_gather stacks by shape;
  // the _v collectives split axis 0). Never 0.
  uint64_t shape_hash = 1;
  uint64_t row_hash = 1;
  // Keeps the memory alive until the operation that reads or writes it has completed,
  // whatever the caller drops (Note [Owners] in python/array.cc). Empty for memory the
  // backend owns.
  std::shared_ptr<void> owner;

  size_t bytes() const { return count * dtype_size(dtype); }
  ConstBytes cbytes() const { return {data, bytes()}; }
  MutBytes mbytes() const { return {data, bytes()}; }
};

}  // namespace meshcoll::comm
