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

// Note [Fingerprints]
// What ranks must agree on beyond a call's count travels in its description (OpDesc.shape)
// as a 64-bit fingerprint of a sequence of whole words: an array's shape, a split's counts,
// the counts of the calls fused in a coalesced block, a composed call's whole description.
// Ranks compare fingerprints, not the layouts, so two layouts that collide pass as one and
// mix data with no error. Collisions must not happen by accident, and the inputs are
// structured (small integers, one total split a few ways), which is where weak mixing
// fails: the first version, FNV-1a folded to 31 bits, had colliding splits of one total
// into three counts that a search found in seconds (issue 34). So each word goes through
// splitmix64's finalizer (a bijection in which every input bit reaches every output bit)
// before it joins the state, and the state through it after: words that differ in a few
// low bits change the whole state, and two different sequences of one length collide only
// as two random 64-bit values do (about 2^-64 a pair). Callers whose sequences vary in
// length mix the length too (ShapeReader in python/array.cc). Four multiplies a word, a few
// words a call: a few nanoseconds.
class ShapeHash {
 public:
  void mix(uint64_t v) { h_ = scramble(h_ ^ scramble(v)); }
  uint64_t value() const { return h_ ? h_ : 1; }  // never 0: "not checked" on the wire

 private:
  static uint64_t scramble(uint64_t x) {
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return x ^ (x >> 31);
  }
  uint64_t h_ = 0x9e3779b97f4a7c15ull;
};

}  // namespace meshcoll::comm
